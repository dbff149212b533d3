"""`depthdiag recommend`: a fixed-first schedule for a run of N updates, sized from a pilot
run's in-training monitor (RUN/monitor.h5).

The finishing-phase length F and the switch arithmetic are pure functions in
analysis/recommend.py (no torch); this module adds what needs the trainer: the pilot's
schedule (its K0 and finishing schedule, from the run config the monitor file stores) and
the modeled training compute of the recommended schedule (trainer/flops.py, on the pilot's
model, batch size and sequence length) against uniform:1-16 and against the paper's 80%
switch with the pilot's K0 and finish.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from analysis.monitor import open_monitor
from analysis.recommend import FinishLength, SwitchPlan, describe_finish, finish_length, format_checks, switch_plan
from analysis.stats import IntervalOptions
from common.errors import InputError
from common.outputs import GRID_SPEC_HEADER
from trainer.config import RunConfig
from trainer.flops import UNIFORM_REFERENCE, flops_report
from trainer.schedules import FixedFirstSchedule, parse_schedule

PAPER_SWITCH = 0.8
"""The paper's default switch: the last 20% of the updates finish at many depths."""


@dataclasses.dataclass(frozen=True)
class RecommendConfig:
    """What `depthdiag recommend` was asked."""

    monitor: Path
    """The pilot run's RUN/monitor.h5."""
    updates: int
    """N: length of the run to plan."""
    threshold: float = 0.05
    checks: int = 2
    margin: float = 1.5
    rule: str = "fraction"
    options: IntervalOptions = IntervalOptions()
    include_embeddings: bool = False


@dataclasses.dataclass(frozen=True)
class ScheduleCompute:
    spec: str
    modeled_flops: float
    relative_to_uniform: float


@dataclasses.dataclass(frozen=True)
class Recommendation:
    monitor: str
    pilot_schedule: str
    pilot_updates: int
    finish: FinishLength
    plan: SwitchPlan
    spec: str
    """The recommended schedule for `plan.updates` updates."""
    recommended: ScheduleCompute
    paper: ScheduleCompute
    """The paper's 80% switch with the pilot's K0 and finish, over the same updates."""
    uniform_flops: float
    saving_vs_uniform: float
    """1 - recommended / uniform:1-16 modeled FLOPs."""
    saving_vs_paper: float
    """1 - recommended / paper modeled FLOPs (negative: the recommendation costs more)."""
    batch_size: int
    seq_len: int
    include_embeddings: bool

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _pilot(ds, source: Path) -> tuple[RunConfig, FixedFirstSchedule]:
    text = ds.attrs.get("config")
    if not isinstance(text, str):
        raise InputError(f"{source}: no run config (attribute 'config') to read the pilot's schedule and model from")
    config = RunConfig.from_json(text, source=str(source))
    train = config.train
    schedule = parse_schedule(train.schedule, seed=train.seed, total_updates=train.updates)
    if not isinstance(schedule, FixedFirstSchedule):
        raise InputError(f"{source}: the pilot's schedule {train.schedule} is not fixed-first: there is no switch")
    return config, schedule


def fixed_first_spec(k0: int, switch: str, finish: str) -> str:
    return f"fixed-first:k0={k0},switch={switch},finish={finish}"


def recommend(config: RecommendConfig) -> Recommendation:
    """F from the pilot's monitor file, the switch for `config.updates` updates, the spec and
    its modeled compute. Bad input raises InputError naming the monitor file."""
    ds = open_monitor(config.monitor)
    finish = finish_length(
        ds,
        source=config.monitor,
        threshold=config.threshold,
        checks=config.checks,
        rule=config.rule,
        options=config.options,
    )
    pilot, schedule = _pilot(ds, config.monitor)
    plan = switch_plan(finish.finish_updates, updates=config.updates, margin=config.margin)
    spec = fixed_first_spec(schedule.k0, plan.switch_text, schedule.finish.spec)
    paper_spec = fixed_first_spec(schedule.k0, f"{PAPER_SWITCH:g}", schedule.finish.spec)
    train = pilot.train
    planned = parse_schedule(spec, seed=train.seed, total_updates=config.updates)
    if planned.switch_step != plan.switch_step:  # switch_text guarantees it
        raise AssertionError(f"{spec} switches at step {planned.switch_step}, not {plan.switch_step}")
    report = flops_report(
        pilot.model,
        [spec, paper_spec],
        updates=config.updates,
        batch_size=train.batch_size,
        seq_len=train.seq_len,
        seed=train.seed,
        include_embeddings=config.include_embeddings,
    )
    recommended, paper = (
        ScheduleCompute(spec=s, modeled_flops=row.modeled_flops, relative_to_uniform=row.relative_to_uniform)
        for s, row in zip((spec, paper_spec), report.schedules)
    )
    return Recommendation(
        monitor=str(config.monitor),
        pilot_schedule=schedule.spec,
        pilot_updates=train.updates,
        finish=finish,
        plan=plan,
        spec=spec,
        recommended=recommended,
        paper=paper,
        uniform_flops=recommended.modeled_flops / recommended.relative_to_uniform,
        saving_vs_uniform=1 - recommended.relative_to_uniform,
        saving_vs_paper=1 - recommended.modeled_flops / paper.modeled_flops,
        batch_size=train.batch_size,
        seq_len=train.seq_len,
        include_embeddings=config.include_embeddings,
    )


def format_recommendation(rec: Recommendation) -> str:
    """The short report `depthdiag recommend` prints."""
    finish, plan = rec.finish, rec.plan
    lines = [
        f"pilot: {rec.monitor} ({rec.pilot_schedule} over {rec.pilot_updates:,} updates, switch at step "
        f"{finish.switch_step})",
        f"depth-averaged benefit at the switch: {finish.switch.describe()}; after it:",
        format_checks(finish),
        describe_finish(finish),
        f"F' = ceil({plan.margin:g} x {plan.finish_updates}) = {plan.planned_finish_updates} finishing updates "
        f"(safety margin {plan.margin:g})",
    ]
    switch = f"switch = 1 - {plan.planned_finish_updates}/{plan.updates:,} = {plan.switch_text}"
    if plan.clamped:
        switch = (
            f"switch = 0 (clamped from 1 - {plan.planned_finish_updates}/{plan.updates:,} < 0: the whole run "
            "is the finishing phase and still shorter than F')"
        )
    lines += [
        f"for {plan.updates:,} updates: {switch}, the switch at step {plan.switch_step:,} "
        f"({plan.updates - plan.switch_step:,} finishing updates)",
        f"recommended: {rec.spec}",
        f"modeled training compute (the pilot's model, {rec.batch_size} x {rec.seq_len} tokens per update, "
        f"LM head {'included' if rec.include_embeddings else 'excluded'}), over {plan.updates:,} updates:",
        f"  {rec.spec}: {rec.recommended.relative_to_uniform:.2%} of {UNIFORM_REFERENCE} "
        f"(saves {rec.saving_vs_uniform:.2%})",
        f"  {rec.paper.spec} (the paper's 80% switch): {rec.paper.relative_to_uniform:.2%} of {UNIFORM_REFERENCE}; "
        f"the recommendation needs {1 - rec.saving_vs_paper:.2%} of its compute "
        f"({'saves' if rec.saving_vs_paper >= 0 else 'costs'} {abs(rec.saving_vs_paper):.2%}"
        f"{'' if rec.saving_vs_paper >= 0 else ' more'})",
    ]
    return "\n".join(lines)


def comparison_grid(rec: Recommendation, *, base: Path, out: Path, seeds: tuple[int, ...]) -> str:
    """An experiment grid (depthdiag/grid.py) that trains the recommended schedule against the
    paper's 80% switch and uniform:1-16 over the same updates for every seed, on `base` with
    the monitor off and no snapshots; evaluated at serving depths 1..16. `base` is written
    relative to the folder of `out`, where the grid file goes."""
    relative = Path(os.path.relpath(Path(base).resolve(), Path(out).resolve().parent))
    return "\n".join(
        [
            f"{GRID_SPEC_HEADER} from {rec.monitor}:",
            f"# F = {rec.finish.finish_updates} uniform updates, F' = {rec.plan.planned_finish_updates} with the "
            f"margin {rec.plan.margin:g}. The recommended schedule",
            "# against the paper's 80% switch and uniform:1-16 over the same updates, for every seed.",
            f"base = {json.dumps(str(relative))}",
            'serving = "1-16"',
            "",
            "[set]",
            f'"train.updates" = {rec.plan.updates}',
            '"train.snapshot_uniform_updates" = []',
            '"monitor.every" = 0',
            "",
            "[axes.schedule]",
            f"recommended = {json.dumps(rec.spec)}",
            f"ff80 = {json.dumps(rec.paper.spec)}",
            f"uniform = {json.dumps(UNIFORM_REFERENCE)}",
            "",
            "[axes]",
            f"seed = [{', '.join(str(s) for s in seeds)}]",
            "",
        ]
    )
