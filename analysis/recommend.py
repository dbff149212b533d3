"""How long the finishing phase needs to be, read off a pilot run's in-training monitor
(RUN/monitor.h5), and the fixed-first switch that gives a run of N updates that finishing
phase. Pure numpy/xarray: no torch, no trainer (the modeled FLOPs of the recommended
schedule are computed in diag/in_training/recommend.py).

F, the finishing-phase length, in uniform updates after the switch:

    A check after the switch is *settled* when, under `rule`,
      fraction (default): its depth-averaged benefit (mean over the check's batches) is below
                          `threshold` x the benefit at the switch check;
      zero:               its interval over the check's batches contains 0 (needs >= 2 batches);
      either:             one or the other.
    F = step - switch_step of the first check from which every later check is settled
    ("for good": a dip followed by a rebound does not count), provided that final run of
    settled checks is at least `checks` checks long (one lucky last check is not enough).

The true crossing lies between the check before F and F itself: F is the upper end of that
bracket, so the checks' spacing (monitor.every) is the resolution. The default rule is
`fraction` because it does not depend on the check's batch count: with the monitor's few
batches per check (2 by default) the t interval is wide (df = 1) and contains 0 long before
the benefit has decayed, so `zero` and `either` settle early. The interval is over batches of
one run: batch noise only, not run-to-run variation; the margin covers the rest.

From F, for a run of N updates: F' = ceil(margin x F), switch = 1 - F'/N, clamped to [0, 1]
(clamped when F' > N: the whole run is then the finishing phase).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import xarray as xr

from analysis.monitor import switch_step as monitor_switch_step
from analysis.stats import Interval, IntervalOptions, format_bounds, monitor_depth_averaged_benefit, plural
from common.choices import FINISH_RULE_CHOICES
from common.errors import InputError


@dataclasses.dataclass(frozen=True)
class Check:
    """One monitor check after the switch, judged by the rule."""

    step: int
    uniform_updates: int
    """step - switch_step."""
    mean: float
    """Depth-averaged benefit, mean over the check's batches."""
    lower: float
    upper: float
    n: int
    """Batches the interval is over."""
    below_threshold: bool
    """mean < threshold x the switch check's mean."""
    contains_zero: bool
    """The interval over batches contains 0 (False when it could not be formed)."""
    settled: bool
    """Settled under the rule."""


@dataclasses.dataclass(frozen=True)
class FinishLength:
    """F read off a monitor file (see the module docstring)."""

    rule: str
    threshold: float
    checks_needed: int
    level: float
    switch_step: int
    switch: Interval
    """Depth-averaged benefit at the switch check, with its interval over batches."""
    checks: tuple[Check, ...]
    """Every check after the switch, in step order."""
    finish_updates: int
    """F: uniform updates after the switch from which the benefit has settled for good."""
    settled_checks: int
    """Length of the final run of settled checks (from F to the last check)."""
    after: int
    """Uniform updates of the check before F (the switch: 0): the crossing lies in (after, F]."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _settled(rule: str, below: bool, contains_zero: bool) -> bool:
    if rule == "fraction":
        return below
    if rule == "zero":
        return contains_zero
    return below or contains_zero


def finish_length(
    ds: xr.Dataset,
    *,
    source: str | os.PathLike = "monitor file",
    threshold: float = 0.05,
    checks: int = 2,
    rule: str = "fraction",
    options: IntervalOptions = IntervalOptions(),
) -> FinishLength:
    """F from a monitor Dataset (analysis.monitor.open_monitor). Refused (InputError naming
    `source`): a run without a switch, no check at the switch, a benefit at the switch that is
    not positive (there is nothing to decay), too few batches for the zero rule, and no F
    within the pilot's checks."""
    if rule not in FINISH_RULE_CHOICES:
        raise InputError(f"rule must be one of {', '.join(FINISH_RULE_CHOICES)}, got {rule!r}")
    if not 0 < threshold < 1:
        raise InputError(f"threshold must be a fraction in (0, 1), got {threshold}")
    if isinstance(checks, bool) or not isinstance(checks, int) or checks < 1:
        raise InputError(f"checks must be a positive integer, got {checks!r}")
    switch = monitor_switch_step(ds)
    if switch is None:
        schedule = ds.attrs.get("schedule", "")
        raise InputError(
            f"{source}: the pilot has no switch{f' ({schedule})' if schedule else ''}: "
            "recommend needs a fixed-first pilot monitored at its switch"
        )
    intervals = monitor_depth_averaged_benefit(ds, options=options).sortby("step")
    steps = [int(step) for step in intervals["step"].values]
    if switch not in steps:
        raise InputError(f"{source}: no check at the switch (step {switch}) to measure the decay from")
    at = steps.index(switch)
    row = intervals.isel(step=at)
    at_switch = Interval(float(row["mean"]), float(row["lower"]), float(row["upper"]), int(row["n"]), "batch")
    if not at_switch.mean > 0:
        raise InputError(
            f"{source}: the depth-averaged benefit at the switch (step {switch}) is {at_switch.mean:+.4g}, "
            "not positive: the deep update does not help there, so there is no finishing phase to size"
        )
    if rule != "fraction" and int(intervals["n"].max()) < 2:
        raise InputError(
            f"{source}: one batch per check gives no interval over batches for the {rule!r} rule; use --rule fraction"
        )
    after_switch = []
    for index in range(at + 1, len(steps)):
        row = intervals.isel(step=index)
        mean, lower, upper = float(row["mean"]), float(row["lower"]), float(row["upper"])
        below = bool(mean < threshold * at_switch.mean)  # NaN: not below
        contains_zero = bool(lower <= 0 <= upper)  # NaN bounds: contains nothing
        after_switch.append(
            Check(
                step=steps[index],
                uniform_updates=steps[index] - switch,
                mean=mean,
                lower=lower,
                upper=upper,
                n=int(row["n"]),
                below_threshold=below,
                contains_zero=contains_zero,
                settled=_settled(rule, below, contains_zero),
            )
        )
    # The final run of settled checks: from the last unsettled check (exclusive) to the end.
    first = len(after_switch)
    while first > 0 and after_switch[first - 1].settled:
        first -= 1
    settled = len(after_switch) - first
    if settled < checks:
        observed = after_switch[-1].uniform_updates if after_switch else 0
        why = (
            f"the last {settled} check(s) settle, fewer than --checks {checks}"
            if settled
            else "the last check has not settled"
        )
        raise InputError(
            f"{source}: no F found; the finishing phase needs longer than the pilot's {observed} updates "
            f"after the switch ({why}; rule {rule}, threshold {threshold:g} x the switch's benefit "
            f"{at_switch.mean:+.4g})"
        )
    return FinishLength(
        rule=rule,
        threshold=threshold,
        checks_needed=checks,
        level=options.level,
        switch_step=switch,
        switch=at_switch,
        checks=tuple(after_switch),
        finish_updates=after_switch[first].uniform_updates,
        settled_checks=settled,
        after=after_switch[first - 1].uniform_updates if first > 0 else 0,
    )


@dataclasses.dataclass(frozen=True)
class SwitchPlan:
    """The fixed-first switch that gives a run of `updates` updates a finishing phase of
    ceil(margin x F) updates."""

    finish_updates: int
    """F, from the pilot."""
    margin: float
    planned_finish_updates: int
    """F' = ceil(margin x F): the finishing phase the plan asks for."""
    updates: int
    """N, the planned run's length."""
    switch: float
    """1 - F'/N, clamped to [0, 1]."""
    switch_text: str
    """`switch` as written in the spec: the shortest %g form (6 significant digits or more)
    whose round(switch x N) is the switch step."""
    switch_step: int
    """round(switch x N): the first finishing update, as trainer.schedules computes it."""
    clamped: bool
    """F' > N: the whole run is the finishing phase (and still shorter than F')."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def switch_text(switch_step: int, updates: int) -> str:
    """The switch fraction for `switch_step` of `updates` as a spec writes it: `%g` with 6
    significant digits (the schedules' own canonical form) or the fewest more that still give
    round(float(text) x updates) == switch_step."""
    exact = switch_step / updates
    for digits in range(6, 18):
        text = f"{exact:.{digits}g}"
        if round(float(text) * updates) == switch_step:
            return text
    return repr(exact)


def switch_plan(finish_updates: int, *, updates: int, margin: float = 1.5) -> SwitchPlan:
    """F' = ceil(margin x F) and switch = 1 - F'/N (clamped to [0, 1]) for a run of N = `updates`."""
    if isinstance(updates, bool) or not isinstance(updates, int) or updates < 1:
        raise InputError(f"updates must be a positive integer, got {updates!r}")
    if not (math.isfinite(margin) and margin >= 1):
        raise InputError(f"margin must be a number >= 1 (a safety margin), got {margin}")
    if finish_updates < 1:
        raise InputError(f"the finishing-phase length must be >= 1 update, got {finish_updates}")
    # Rounded first so that 1.1 x 10 (11.000000000000002 in binary) asks for 11, not 12.
    planned = math.ceil(round(margin * finish_updates, 9))
    clamped = planned > updates
    step = max(updates - planned, 0)
    return SwitchPlan(
        finish_updates=finish_updates,
        margin=margin,
        planned_finish_updates=planned,
        updates=updates,
        switch=step / updates,
        switch_text=switch_text(step, updates),
        switch_step=step,
        clamped=clamped,
    )


def format_checks(finish: FinishLength) -> str:
    """The checks after the switch as an aligned table, the rule's verdict on each."""
    percent = f"{finish.level * 100:g}%"
    header = (
        "step",
        "uniform updates",
        "mean benefit",
        f"{percent} CI (batches)",
        f"< {finish.threshold:.0%} of switch",
        "CI contains 0",
        "settled",
    )
    rows = [
        (
            str(check.step),
            str(check.uniform_updates),
            f"{check.mean:+.4f}",
            format_bounds(check.lower, check.upper),
            "yes" if check.below_threshold else "no",
            "yes" if check.contains_zero else "no",
            ("yes" if check.settled else "no") + (" <- F" if check.uniform_updates == finish.finish_updates else ""),
        )
        for check in finish.checks
    ]
    widths = [max(len(cells[i]) for cells in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(cells, widths)) for cells in [header, *rows])


RULE_WORDS = {
    "fraction": "mean benefit below {threshold} of the switch's",
    "zero": "interval over batches contains 0",
    "either": "mean benefit below {threshold} of the switch's, or its interval over batches contains 0",
}


def describe_finish(finish: FinishLength) -> str:
    """F in one sentence: the rule, from where, for how many checks, and the bracket."""
    words = RULE_WORDS[finish.rule].format(threshold=f"{finish.threshold:.0%}")
    n = np.unique([check.n for check in finish.checks])
    count = str(int(n[0])) if n.size == 1 else f"{int(n.min())}-{int(n.max())}"
    return (
        f"F = {finish.finish_updates} uniform updates: from step {finish.switch_step + finish.finish_updates} on, "
        f"every check settled ({words}), {finish.settled_checks} {plural('check', finish.settled_checks)} "
        f"(needed: {finish.checks_needed}); the crossing lies in ({finish.after}, {finish.finish_updates}]; "
        f"intervals over {count} batches of one run (batch noise only)"
    )
