"""What `depthdiag summarize` prints, as text or as a JSON document, for results files (a
seed's or several seeds') and for a run's monitor file. The numbers come from analysis.stats;
this module only lays them out."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from os import PathLike

import xarray as xr

from analysis.finishing import FinishingPhase, format_finishing_phase
from analysis.stats import (
    IntervalOptions,
    describe_intervals,
    format_bounds,
    format_monitor_summary,
    interval_coverage,
    plural,
)
from analysis.store import machines_by_seed
from common.provenance import describe_machine, describe_machines

SECONDARY_KEYS = ("batch_half_width", "batches_per_seed", "between_seed_variance", "within_seed_variance")
"""The within-seed (batch noise) columns of a summary row."""


def format_summary_table(rows: list[dict], *, level: float = 0.95, fraction: float = 0.05) -> str:
    """The summary rows as an aligned plain-text table (headline interval, the equivalence
    bound's verdict where the rows carry it (analysis.finishing.with_equivalence), then batch
    noise)."""
    percent = f"{level * 100:g}%"
    seeded = bool(rows) and rows[0]["unit"] != "batch"
    bounded = bool(rows) and "shown_below_fraction" in rows[0]
    # Results of a model without a depth schedule (an adapter's) have no uniform-updates count.
    scheduled = all("uniform_updates" in row for row in rows)
    header = ("snapshot",) + (("uniform updates",) if scheduled else ()) + ("step", "mean benefit")
    header += (f"{percent} CI", "n", "CI excludes 0")
    if bounded:
        header += (f"< {fraction:.0%} of switch",)
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
        if bounded:
            cells += ({True: "shown", False: "not shown", None: "-"}[row["shown_below_fraction"]],)
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


def machine_groups(ds: xr.Dataset) -> list[dict]:
    """The files of `ds` grouped by what computed them: per group the machines that trained it
    (`trained_on`), the one that diagnosed it (`diagnosed_on`) and its `seeds` (None for a
    single file without a seed), in the order the files came."""
    groups: dict[str, dict] = {}
    for seed, diagnosed, trained in machines_by_seed(ds):
        key = json.dumps([trained, diagnosed], sort_keys=True)
        group = groups.setdefault(key, {"trained_on": trained, "diagnosed_on": diagnosed, "seeds": []})
        group["seeds"].append(seed)
    return list(groups.values())


def machine_lines(groups: list[dict]) -> list[str]:
    """The summary's lines that say which machines and kernels computed the numbers."""
    lines = []
    for group in groups:
        seeds = [seed for seed in group["seeds"] if seed is not None]
        whose = "" if len(groups) == 1 else f" (seeds {' '.join(str(seed) for seed in seeds)})"
        lines.append(f"trained on{whose}: {describe_machines(group['trained_on'])}")
        lines.append(f"diagnosed on{whose}: {describe_machine(group['diagnosed_on'])}")
    return lines


def machine_warning(groups: list[dict]) -> str | None:
    """One line when the files were computed by different machines or kernels, None when not."""
    if len(groups) < 2:
        return None
    return (
        f"the files were trained or diagnosed on {len(groups)} different machines or kernel sets: bf16 kernels "
        "round differently and training amplifies it, so the spread over these files holds machine-to-machine "
        "variation besides seed noise (`depthdiag machines` sets them side by side)"
    )


def summary_document(
    results: Sequence[str | PathLike],
    rows: list[dict],
    phase: FinishingPhase | None,
    options: IntervalOptions,
    warnings: Sequence[str] = (),
    *,
    per_seed: dict[str, list[dict]] | None = None,
    machines: list[dict] = (),
) -> dict:
    """The JSON document of a results summary: which interval is the headline and what it
    covers, the rows (each with its seeds' own means and batch intervals under `per_seed` when
    several seeds are combined), the finishing phase (None without a snapshot at the switch) and
    what computed the numbers (`machine_groups`)."""
    unit = rows[0]["unit"]
    if per_seed is not None:
        rows = [{**row, "per_seed": per_seed[row["snapshot"]]} for row in rows]
    return {
        "results": [str(path) for path in results],
        **dataclasses.asdict(options),
        "headline": {"unit": unit, "covers": interval_coverage(unit)},
        "secondary": {"unit": "batch", "covers": interval_coverage("batch"), "keys": list(SECONDARY_KEYS)},
        "rows": rows,
        "finishing_phase": phase.to_dict() if phase is not None else None,
        "machines": list(machines),
        "warnings": list(warnings),
    }


def from_a_schedule(ds: xr.Dataset) -> bool:
    """Whether the results come from depthdiag runs, whose snapshots are counted in uniform
    updates after a switch; a model an adapter supplies (diag/sources/adapter.py) or a Hugging Face
    folder (diag/sources/hf.py, batches from its --data) has no schedule, so neither the column nor the
    finishing phase means anything for it."""
    sources = json.loads(str(ds.attrs.get("batch_source", "{}")))
    return not sources or any(source not in ("adapter", "hf-data") for source in sources.values())


def without_schedule(rows: list[dict]) -> list[dict]:
    """Summary rows without the uniform-updates count, for results `from_a_schedule` rejects."""
    return [{key: value for key, value in row.items() if key != "uniform_updates"} for row in rows]


def summary_text(
    rows: list[dict], phase: FinishingPhase | None, options: IntervalOptions, machines: list[dict] = ()
) -> str:
    """The printed results summary: what the intervals cover, the table, for rows counted in
    uniform updates the finishing phase, and what computed the numbers (`machine_groups`)."""
    lines = [
        describe_intervals(rows, level=options.level, method=options.method),
        format_summary_table(rows, level=options.level, fraction=phase.fraction if phase is not None else 0.05),
    ]
    if phase is not None and any(row.get("shown_below_fraction") is not None for row in rows):
        fraction = f"{phase.fraction:.0%}"
        lines.append(
            f"< {fraction} of switch: shown when the one-sided {options.level:.0%} bound over seeds of "
            f"benefit - {fraction} x switch benefit (paired by seed) lies below 0; not shown is no evidence "
            "either way"
        )
    if phase is not None:
        lines.append(format_finishing_phase(phase))
    elif rows and "uniform_updates" in rows[0]:
        lines.append("finishing phase: n/a (no snapshot at the switch, 0 uniform updates)")
    lines += machine_lines(list(machines))
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
