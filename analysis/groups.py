"""The benefit by group of evaluation targets (`diagnose --grouping`, `summarize --by`).

A results file recorded with a grouping X holds nll_by_X (..., update_depth, serving_depth, X)
and targets_by_X (..., X): each group's mean NLL after every update and its counted targets.
A group's benefit is its NLL after the reference update minus after the deep one, and its
interval is formed as the headline's: over batches for one file, over per-seed means for
several (analysis/stats.py). The groups' benefits weighted by their targets give back the
headline benefit when every counted target is in one group.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from analysis.stats import IntervalOptions, interval_coverage, interval_over, replication_units
from common.errors import InputError


def groupings_in(ds: xr.Dataset) -> list[str]:
    """The groupings a results Dataset records (`diagnose --grouping`)."""
    return [str(name)[len("nll_by_") :] for name in ds.data_vars if str(name).startswith("nll_by_")]


def group_benefit(ds: xr.Dataset, grouping: str) -> xr.DataArray:
    """Each unit's benefit per group of `grouping`: (..., serving_depth, grouping)."""
    if f"nll_by_{grouping}" not in ds:
        recorded = ", ".join(groupings_in(ds)) or "none"
        raise InputError(
            f"the results record no grouping {grouping!r} (diagnose --grouping {grouping}); recorded: {recorded}"
        )
    nll = ds[f"nll_by_{grouping}"]
    return nll.isel(update_depth=0, drop=True) - nll.isel(update_depth=-1, drop=True)


def group_benefit_intervals(
    ds: xr.Dataset, grouping: str, *, options: IntervalOptions = IntervalOptions(), seed_dim: str = "seed"
) -> xr.Dataset:
    """Per snapshot and group: the benefit at each serving depth (mean/lower/upper/n over
    (snapshot, serving_depth, grouping)) and averaged over serving depths (depth_mean,
    depth_lower, depth_upper over (snapshot, grouping)), intervals over batches or seeds as the
    headline's; `targets`, each group's counted targets in one unit."""
    benefit = group_benefit(ds, grouping)
    units, unit_dim = replication_units(benefit, seed_dim=seed_dim)
    by_depth = interval_over(units, unit_dim, options=options).transpose("snapshot", "serving_depth", grouping)
    averaged_units, _ = replication_units(benefit.mean("serving_depth", skipna=False), seed_dim=seed_dim)
    averaged = interval_over(averaged_units, unit_dim, options=options).transpose("snapshot", grouping)
    targets = ds[f"targets_by_{grouping}"]
    targets = targets.isel({dim: 0 for dim in targets.dims if dim != grouping})
    result = by_depth.assign(
        depth_mean=averaged["mean"], depth_lower=averaged["lower"], depth_upper=averaged["upper"], targets=targets
    )
    result.attrs = {"grouping": grouping, "unit": unit_dim, "level": options.level, "method": options.method}
    return result


def group_rows(intervals: xr.Dataset) -> list[dict]:
    """One row per (snapshot, group, serving depth), for --json and --csv."""
    grouping = intervals.attrs["grouping"]
    rows = []
    for snapshot in intervals["snapshot"].values:
        for group in intervals[grouping].values:
            for depth in intervals["serving_depth"].values:
                cell = intervals.sel({"snapshot": snapshot, grouping: group, "serving_depth": depth})
                rows.append(
                    {
                        "snapshot": str(snapshot),
                        grouping: str(group),
                        "serving_depth": int(depth),
                        "targets": int(cell["targets"]),
                        "mean": float(cell["mean"]),
                        "lower": _finite(cell["lower"]),
                        "upper": _finite(cell["upper"]),
                        "n": int(cell["n"]),
                        "unit": intervals.attrs["unit"],
                    }
                )
    return rows


def _finite(value: xr.DataArray) -> float | None:
    number = float(value)
    return number if np.isfinite(number) else None


def group_text(intervals: xr.Dataset) -> str:
    """The printed breakdown: per snapshot, a row per group with its counted targets, its
    depth-averaged benefit and interval, and its benefit at every serving depth."""
    grouping, unit = intervals.attrs["grouping"], intervals.attrs["unit"]
    n = int(intervals["n"].max()) if intervals["n"].size else 0
    depths = [int(d) for d in intervals["serving_depth"].values]
    lines = [
        f"benefit by {grouping}: mean over serving depths with its {intervals.attrs['level']:.0%} interval "
        f"({interval_coverage(unit)}, n = {n}), then the mean at each serving depth"
    ]
    width = max(len(grouping), *(len(str(g)) for g in intervals[grouping].values))
    for snapshot in intervals["snapshot"].values:
        lines.append(f"\n{snapshot}")
        header = f"  {grouping:<{width}}  targets  {'benefit':>9}  {'interval':>21}  " + " ".join(
            f"{f's={d}':>9}" for d in depths
        )
        lines.append(header)
        for group in intervals[grouping].values:
            cell = intervals.sel({"snapshot": snapshot, grouping: group})
            if int(cell["targets"]) == 0:
                lines.append(f"  {str(group):<{width}}  {0:>7}  no counted targets")
                continue
            lower, upper = float(cell["depth_lower"]), float(cell["depth_upper"])
            bounds = f"[{lower:+.5f}, {upper:+.5f}]" if np.isfinite(lower) and np.isfinite(upper) else "n/a"
            per_depth = " ".join(f"{float(v):+9.5f}" for v in cell["mean"].values)
            lines.append(
                f"  {str(group):<{width}}  {int(cell['targets']):>7}  {float(cell['depth_mean']):+9.5f}  "
                f"{bounds:>21}  {per_depth}"
            )
    return "\n".join(lines)
