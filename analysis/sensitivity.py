"""How much the diagnostic's verdict depends on its two ablation settings.

The counterfactual isolation and reference RMS matching are choices; a reader should
see whether the headline (a positive benefit at the switch that fades after a short
finishing phase) survives the alternatives. Results files are grouped by their
(isolate, rms_match) attributes, each group is combined along the seed dimension
(so the files of a group must differ in nothing but the seed), and each row gives the
seed-level depth-averaged benefit at the switch and after a number of uniform updates.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

from analysis.finishing import interval_at
from analysis.stats import (
    Interval,
    IntervalOptions,
    depth_averaged_benefit,
    format_bounds,
    interval_coverage,
    method_name,
    plural,
)
from analysis.store import combine_seeds, open_results
from common.choices import ISOLATE_CHOICES, RMS_MATCH_CHOICES
from common.errors import InputError


@dataclasses.dataclass(frozen=True)
class SensitivityRow:
    """One (isolate, rms_match) combination: the benefit at the switch and after `after_updates`.

    `ratio` is after / switch of the means: how much of the switch benefit is left.
    """

    isolate: str
    rms_match: str
    files: tuple[str, ...]
    at_switch: Interval
    after: Interval
    ratio: float


@dataclasses.dataclass(frozen=True)
class SensitivityTable:
    """Rows in the order of the settings' choices; `missing` lists the combinations not diagnosed."""

    after_updates: int
    level: float
    method: str
    rows: tuple[SensitivityRow, ...]
    missing: tuple[tuple[str, str], ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _setting(ds, path, key: str) -> str:
    if key not in ds.attrs:
        raise InputError(f"{path}: no {key!r} attribute; cannot place it in the sensitivity table")
    return str(ds.attrs[key])


def _order(value: str, choices: Sequence[str]) -> tuple[int, str]:
    return (choices.index(value), value) if value in choices else (len(choices), value)


def _interval_after(intervals, updates: int, source) -> Interval:
    counts = [int(u) for u in intervals["uniform_updates"].values]
    if updates not in counts:
        raise InputError(f"{source}: no snapshot after {updates} uniform updates (the grid is {counts})")
    return interval_at(intervals, counts.index(updates))


def sensitivity_table(
    paths: Sequence[str | os.PathLike],
    *,
    after_updates: int = 16,
    options: IntervalOptions = IntervalOptions(),
) -> SensitivityTable:
    """The sensitivity table of the results files `paths` (any mix of settings and seeds).

    Raises InputError naming the file when a file lacks the settings attributes, when
    the files of one combination differ in more than the seed, or when a combination
    has no snapshot at the switch or after `after_updates` uniform updates.
    """
    groups: dict[tuple[str, str], list] = {}
    for path in paths:
        ds = open_results(path)
        key = (_setting(ds, path, "isolate"), _setting(ds, path, "rms_match"))
        groups.setdefault(key, []).append((ds, path))
    rows = []
    for isolate, rms_match in sorted(
        groups, key=lambda key: (_order(key[0], ISOLATE_CHOICES), _order(key[1], RMS_MATCH_CHOICES))
    ):
        members = groups[(isolate, rms_match)]
        datasets, sources = [ds for ds, _ in members], [path for _, path in members]
        combined = datasets[0] if len(datasets) == 1 else combine_seeds(datasets, sources)
        intervals = depth_averaged_benefit(combined, options=options)
        at_switch = _interval_after(intervals, 0, sources[0])
        after = _interval_after(intervals, after_updates, sources[0])
        ratio = after.mean / at_switch.mean if at_switch.mean != 0 else math.nan
        rows.append(SensitivityRow(isolate, rms_match, tuple(map(str, sources)), at_switch, after, ratio))
    missing = tuple(
        (isolate, rms_match)
        for isolate in ISOLATE_CHOICES
        for rms_match in RMS_MATCH_CHOICES
        if (isolate, rms_match) not in groups
    )
    return SensitivityTable(after_updates, options.level, options.method, tuple(rows), missing)


def _cell(interval: Interval) -> str:
    return f"{interval.mean:+.4f} {format_bounds(interval.lower, interval.upper, missing='n/a')}"


def format_sensitivity_markdown(table: SensitivityTable) -> str:
    """The table as Markdown, with a note saying which interval each row shows."""
    percent = f"{table.level:.0%}"
    header = (
        "isolate",
        "rms_match",
        "n",
        f"benefit at switch ({percent} CI)",
        f"after {table.after_updates} uniform updates ({percent} CI)",
        "after / switch",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in table.rows:
        count = f"{row.at_switch.n} {plural(row.at_switch.unit)}"
        ratio = f"{row.ratio:.2f}" if math.isfinite(row.ratio) else "n/a"
        cells = (row.isolate, row.rms_match, count, _cell(row.at_switch), _cell(row.after), ratio)
        lines.append("| " + " | ".join(cells) + " |")
    units = {row.at_switch.unit for row in table.rows}
    notes = [f"Depth-averaged benefit; {percent} {method_name(table.method)} CI {interval_coverage('seed')}."]
    if "batch" in units:
        notes.append(f"Rows with n in batches come from one seed: their CI is {interval_coverage('batch')}.")
    if table.missing:
        notes.append("Not diagnosed: " + ", ".join(f"{i} x {r}" for i, r in table.missing) + ".")
    return "\n".join(lines) + "\n\n" + "\n".join(notes)
