"""What `depthdiag summarize` prints, as text or as a JSON document, for results files (a
seed's or several seeds') and for a run's monitor file. The numbers come from analysis.stats;
this module only lays them out."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from os import PathLike

import xarray as xr

from analysis.stats import (
    FinishingPhase,
    IntervalOptions,
    describe_intervals,
    format_bounds,
    format_finishing_phase,
    format_monitor_summary,
    interval_coverage,
    plural,
)

SECONDARY_KEYS = ("batch_half_width", "batches_per_seed", "between_seed_variance", "within_seed_variance")
"""The within-seed (batch noise) columns of a summary row."""


def format_summary_table(rows: list[dict], *, level: float = 0.95) -> str:
    """The summary rows as an aligned plain-text table (headline interval, then batch noise)."""
    percent = f"{level * 100:g}%"
    seeded = bool(rows) and rows[0]["unit"] != "batch"
    # Results of a model without a depth schedule (an adapter's) have no uniform-updates count.
    scheduled = all("uniform_updates" in row for row in rows)
    header = ("snapshot",) + (("uniform updates",) if scheduled else ()) + ("step", "mean benefit")
    header += (f"{percent} CI", "n", "CI excludes 0")
    if seeded:
        header += ("batch CI ±", "batches/seed", "var(seeds)", "var(batches)")
    lines = []
    for row in rows:
        cells = (
            row["snapshot"],
            *((str(row["uniform_updates"]),) if scheduled else ()),
            str(row["step"]),
            f"{row['mean']:+.4f}",
            format_bounds(row["lower"], row["upper"]),
            f"{row['n']} {plural(row['unit'], row['n'])}",
            "yes" if row["excludes_zero"] else "no",
        )
        if seeded:
            cells += (
                f"{row['batch_half_width']:.4f}",
                str(row["batches_per_seed"]),
                f"{row['between_seed_variance']:.2e}",
                f"{row['within_seed_variance']:.2e}",
            )
        lines.append(cells)
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(cells, widths)) for cells in [header, *lines])


def summary_document(
    results: Sequence[str | PathLike],
    rows: list[dict],
    phase: FinishingPhase | None,
    options: IntervalOptions,
    warnings: Sequence[str] = (),
) -> dict:
    """The JSON document of a results summary: which interval is the headline and what it
    covers, the rows, the finishing phase (None without a snapshot at the switch)."""
    unit = rows[0]["unit"]
    return {
        "results": [str(path) for path in results],
        **dataclasses.asdict(options),
        "headline": {"unit": unit, "covers": interval_coverage(unit)},
        "secondary": {"unit": "batch", "covers": interval_coverage("batch"), "keys": list(SECONDARY_KEYS)},
        "rows": rows,
        "finishing_phase": phase.to_dict() if phase is not None else None,
        "warnings": list(warnings),
    }


def from_a_schedule(ds: xr.Dataset) -> bool:
    """Whether the results come from depthdiag runs, whose snapshots are counted in uniform
    updates after a switch; a model an adapter supplies (diag/adapter.py) or a Hugging Face
    folder (diag/hf.py, batches from its --data) has no schedule, so neither the column nor the
    finishing phase means anything for it."""
    sources = json.loads(str(ds.attrs.get("batch_source", "{}")))
    return not sources or any(source not in ("adapter", "hf-data") for source in sources.values())


def without_schedule(rows: list[dict]) -> list[dict]:
    """Summary rows without the uniform-updates count, for results `from_a_schedule` rejects."""
    return [{key: value for key, value in row.items() if key != "uniform_updates"} for row in rows]


def summary_text(rows: list[dict], phase: FinishingPhase | None, options: IntervalOptions) -> str:
    """The printed results summary: what the intervals cover, the table, and, for rows counted
    in uniform updates, the finishing phase."""
    lines = [
        describe_intervals(rows, level=options.level, method=options.method),
        format_summary_table(rows, level=options.level),
    ]
    if phase is not None:
        lines.append(format_finishing_phase(phase, level=options.level))
    elif rows and "uniform_updates" in rows[0]:
        lines.append("finishing phase: n/a (no snapshot at the switch, 0 uniform updates)")
    return "\n".join(lines)


def monitor_summary_document(path: str | PathLike, ds: xr.Dataset, rows: list[dict], options: IntervalOptions) -> dict:
    """The JSON document of a monitor file's summary."""
    return {
        "monitor": str(path),
        **dataclasses.asdict(options),
        "unit": "batch",
        "covers": interval_coverage("batch"),
        "switch_step": ds.attrs.get("switch_step"),
        "rows": rows,
    }


def monitor_summary_text(path: str | PathLike, ds: xr.Dataset, rows: list[dict], options: IntervalOptions) -> str:
    """The printed summary of a monitor file: the run's schedule and switch, then a line per check."""
    switch = ds.attrs.get("switch_step", -1)
    switch_text = f"switch at step {switch}" if switch is not None and int(switch) >= 0 else "no switch"
    header = f"{path}: {ds.attrs.get('schedule', '')}, {switch_text}"
    return header + "\n" + format_monitor_summary(rows, level=options.level, method=options.method)
