"""The statistics of a collected experiment grid behind the paper's grid figures (1, 2, 3-top,
5, 8), Table 3 and the paired comparison of one schedule against the others (no torch).

The file itself (its schema, `grid_dataset`, `open_grid`) is `analysis.grid_file`; its names
are re-exported here, so `analysis.grid` is the one import for a grid.

The unit of replication is the training seed (axis `seed`): bands over seeds are either a
Student-t 95% interval for the mean (`analysis.stats.interval_over`) or the range (min to
max) across seeds, and every figure says which, over how many seeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import xarray as xr

# Re-exported: importers of the grid file's names keep importing them from `analysis.grid`.
from analysis.grid_file import (  # noqa: F401
    CELL_KEYS,
    COORDINATES,
    GRID_VARIABLES,
    KIND,
    LOG_STEP_DIM,
    NO_SWITCH,
    OPTIONAL_VARIABLES,
    SERVING_DIM,
    describe,
    grid_axes,
    grid_dataset,
    is_grid_dataset,
    open_grid,
    validate_grid,
)
from analysis.stats import IntervalOptions, interval_over
from common.errors import InputError

TERMINAL_FRACTION = 200 / 4800
"""The paper's terminal window: the final 200 updates of a 4,800-update run."""

Band = Literal["t95", "range"]


# --- statistics over seeds ---------------------------------------------------------------------


def seed_band(values: xr.DataArray, *, band: Band = "t95", seed_dim: str = "seed") -> xr.Dataset:
    """The mean over seeds and a band around it, at every index of the other dims.

    band 't95': the Student-t 95% interval for the mean (`analysis.stats.interval_over`);
    band 'range': the minimum and maximum across seeds (the paper's Figures 2, 3 and 8).
    NaN values (a missing metrics line) are left out and do not count in `n`; with fewer
    than two finite seeds, or no `seed_dim` at all (n = 1), the bounds are NaN. Returns
    `mean`, `lower`, `upper` (with `values`' long_name and units) and `n`, attributes
    `band` and `seed_dim`.
    """
    if band not in ("t95", "range"):
        raise InputError(f"band must be 't95' or 'range', got {band!r}")
    if seed_dim not in values.dims:
        mean = values.astype(np.float64)
        nan = xr.full_like(mean, np.nan)
        bands = xr.Dataset({"mean": mean, "lower": nan, "upper": nan, "n": mean.notnull().astype(np.int64)})
    elif band == "t95":
        bands = interval_over(values, seed_dim, options=IntervalOptions(level=0.95, method="t"))
    else:
        values = values.transpose(..., seed_dim)
        n = values.count(seed_dim)
        spread = n >= 2
        bands = xr.Dataset(
            {
                "mean": values.mean(seed_dim, skipna=True),
                "lower": values.min(seed_dim, skipna=True).where(spread),
                "upper": values.max(seed_dim, skipna=True).where(spread),
                "n": n.astype(np.int64),
            }
        )
    for name in ("mean", "lower", "upper"):
        bands[name].attrs = {key: values.attrs[key] for key in ("long_name", "units") if key in values.attrs}
    bands["n"].attrs = {"long_name": "seeds with a finite value", "units": "1"}
    bands.attrs = {"band": band, "seed_dim": seed_dim}
    return bands


def band_description(bands: xr.Dataset, unit: str = "seed") -> str:
    """'mean and 95% CI over 3 seeds' or 'mean and range across 3 seeds' (n from `bands`);
    'one seed: no band' when no band could be formed."""
    counts = np.unique(bands["n"].values[bands["n"].values > 0]) if bands["n"].size else np.array([])
    if counts.size == 0 or counts.max() < 2:
        return f"one {unit}: no band"
    count = str(int(counts[0])) if counts.size == 1 else f"{int(counts.min())}-{int(counts.max())}"
    what = "95% CI (Student-t) over" if bands.attrs.get("band") == "t95" else "range (min-max) across"
    return f"mean and {what} {count} {unit}s"


def terminal_window(updates, fraction: float = TERMINAL_FRACTION):
    """W = max(1, round(fraction * updates)) (halves round to even), elementwise."""
    if not 0 < fraction <= 1:
        raise InputError(f"the terminal fraction must be in (0, 1], got {fraction}")
    return np.maximum(1, np.rint(np.asarray(updates, dtype=np.float64) * fraction)).astype(np.int64)


def terminal_loss(ds: xr.Dataset, *, fraction: float = TERMINAL_FRACTION) -> xr.DataArray:
    """Each cell's mean training loss over its final W = max(1, round(fraction * updates))
    updates, 0-based steps updates-W .. updates-1 (the paper's terminal NLL: the final 200
    of 4,800 updates, scaled to the run length).

    A metrics line at step s whose mean covers u updates covers steps s-u+1..s; the mean
    is update-weighted, and a line straddling the window's start counts with the updates
    it has inside the window (taking its mean as the mean of those too). NaN when no line
    reaches into the window.
    """
    windows = ds["updates"].copy(data=terminal_window(ds["updates"].values, fraction))
    end_of_line = ds[LOG_STEP_DIM]
    start_of_line = end_of_line - ds["loss_updates"] + 1
    window_start, window_end = ds["updates"] - windows, ds["updates"] - 1
    overlap = (np.minimum(end_of_line, window_end) - np.maximum(start_of_line, window_start) + 1).clip(min=0)
    overlap = overlap.where(ds["loss"].notnull(), 0)
    weighted = (ds["loss"].fillna(0.0) * overlap).sum(LOG_STEP_DIM)
    total = overlap.sum(LOG_STEP_DIM)
    result = (weighted / total.where(total > 0)).transpose(*grid_axes(ds))
    result.attrs = {"long_name": "mean training loss over the terminal window", "units": "nats"}
    return result.rename("terminal_loss")


def _serving_list(ds: xr.Dataset, serving) -> list[int]:
    depths = [int(d) for d in serving]
    available = set(int(d) for d in ds[SERVING_DIM].values)
    missing = [d for d in depths if d not in available]
    if not depths or missing:
        raise InputError(f"serving depth {missing[0] if missing else '(none)'} is not in the grid's serving depths")
    return depths


def serving_label(serving) -> str:
    """'1-16' for a contiguous run of depths, else the depths joined by commas."""
    depths = [int(d) for d in serving]
    if len(depths) > 1 and depths == list(range(depths[0], depths[-1] + 1)):
        return f"{depths[0]}-{depths[-1]}"
    return ",".join(map(str, depths))


def mean_serving_nll(ds: xr.Dataset, serving: Sequence[int] = range(1, 17)) -> xr.DataArray:
    """Each cell's NLL averaged over the `serving` depths (NaN when any of them is NaN)."""
    depths = _serving_list(ds, serving)
    result = ds["nll"].sel({SERVING_DIM: depths}).mean(SERVING_DIM, skipna=False)
    result.attrs = {"long_name": f"mean NLL over serving depths {serving_label(depths)}", "units": "nats"}
    return result.rename("mean_serving_nll")


def require(ds: xr.Dataset, what: str, *, variables: Sequence[str] = (), dims: Sequence[str] = ()) -> None:
    """InputError("WHAT needs ...") when `ds` lacks one of `variables` or `dims`."""
    for name in variables:
        if name not in ds.data_vars:
            raise InputError(f"{what} needs the variable {name!r}, which the grid does not have")
    for name in dims:
        if name not in ds.dims:
            raise InputError(f"{what} needs a grid axis {name!r}; the grid's axes are {list(grid_axes(ds))}")


def schedules_and_seeds(ds: xr.Dataset, what: str, *, schedule_dim: str = "schedule", seed_dim: str = "seed"):
    """`ds` with every axis but `schedule_dim` and `seed_dim` of length one dropped; InputError
    when another axis has several values (select one first, e.g. ds.sel(budget=0.45))."""
    require(ds, what, dims=[schedule_dim])
    for name in grid_axes(ds):
        if name in (schedule_dim, seed_dim):
            continue
        if ds.sizes[name] > 1:
            raise InputError(
                f"{what} compares schedules over seeds, but axis {name!r} has {ds.sizes[name]} values; "
                f"select one first (ds.sel({name}=...))"
            )
        ds = ds.isel({name: 0}, drop=True)
    return ds


def select_schedules(ds: xr.Dataset, schedules: Sequence[str] | None, schedule_dim: str = "schedule") -> list[str]:
    """The schedule labels to draw, in order: `schedules`, or all of the grid's."""
    available = [str(label) for label in ds[schedule_dim].values]
    if schedules is None:
        return available
    unknown = [label for label in schedules if label not in available]
    if unknown:
        raise InputError(f"schedule {unknown[0]!r} is not in the grid (it has {', '.join(available)})")
    return list(schedules)


def per_schedule(values: xr.DataArray, schedule_dim: str = "schedule"):
    """One value per schedule label (the first along every other axis: a schedule's spec,
    initial depth and switch fraction are the same for all its seeds)."""
    values = values.isel({dim: 0 for dim in values.dims if dim != schedule_dim})
    return {str(label): value.item() for label, value in zip(values[schedule_dim].values, values)}


def paired_difference(values: xr.DataArray, reference: str, *, schedule_dim: str = "schedule") -> xr.DataArray:
    """`values` minus the `reference` schedule's, paired cell by cell (the same seed)."""
    labels = [str(label) for label in values[schedule_dim].values]
    if reference not in labels:
        raise InputError(f"the reference schedule {reference!r} is not in the grid (it has {', '.join(labels)})")
    return values - values.sel({schedule_dim: reference}, drop=True)


def paired_ratio(values: xr.DataArray, reference: str, *, schedule_dim: str = "schedule") -> xr.DataArray:
    """`values` divided by the `reference` schedule's, paired cell by cell (the same seed)."""
    labels = [str(label) for label in values[schedule_dim].values]
    if reference not in labels:
        raise InputError(f"the reference schedule {reference!r} is not in the grid (it has {', '.join(labels)})")
    return values / values.sel({schedule_dim: reference}, drop=True)


def normalised_recall(ds: xr.Dataset, *, schedule_dim: str = "schedule", seed_dim: str = "seed") -> xr.DataArray:
    """Each schedule's seed-mean recall curve over serving depth divided by its own peak
    (the maximum of that seed-mean curve), so every curve peaks at exactly 1."""
    require(ds, "normalised recall", variables=["recall_bits"])
    recall = ds["recall_bits"]
    mean = recall.mean(seed_dim) if seed_dim in recall.dims else recall
    result = mean / mean.max(SERVING_DIM)
    result.attrs = {"long_name": "seed-mean recall / its peak over serving depths", "units": "1"}
    return result


def finish_family(finish: str) -> str:
    """The family of a finishing distribution spec: 'uniform', 'pln', or the spec's own kind
    ('fixed' for 'fixed:4'). The progressive curriculum ends as the Poisson-lognormal it
    ramps up to, so it is the baseline of the 'pln' family."""
    kind = finish.partition(":")[0].strip()
    return "pln" if kind == "progressive" else kind


def switch_group(fraction: float) -> str | None:
    """'67%' or '80%' for a switch fraction within 0.02 of 2/3 or 0.8; None without a switch;
    otherwise the fraction as a percentage."""
    if not math.isfinite(fraction):
        return None
    if abs(fraction - 2 / 3) <= 0.02:
        return "67%"
    if abs(fraction - 0.8) <= 0.02:
        return "80%"
    return f"{fraction:.0%}"


# --- Table 3 -----------------------------------------------------------------------------------


def _mean_sd(values: np.ndarray) -> tuple[float | None, float | None]:
    """(mean, SD with ddof=1) of the finite values; None for what cannot be formed."""
    values = np.asarray(values, dtype=np.float64).ravel()
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None, None
    return float(values.mean()), (float(values.std(ddof=1)) if values.size > 1 else None)


def _one_or_all(values) -> int | list[int]:
    unique = sorted({int(v) for v in np.asarray(values).ravel()})
    return unique[0] if len(unique) == 1 else unique


def table3(
    ds: xr.Dataset,
    *,
    rows: Sequence[str] | None = None,
    reference: str = "uniform",
    schedule_dim: str = "schedule",
    seed_dim: str = "seed",
    serving: Sequence[int] = range(1, 17),
    terminal_fraction: float = TERMINAL_FRACTION,
) -> list[dict]:
    """The paper's Table 3: one row per schedule label (`rows`, default all, in grid order).

    Keys: schedule, schedule_spec, n_seeds, updates, terminal_window (W), serving (e.g.
    '1-16'), reference, and mean / SD over seeds (ddof=1; SD None with one seed) of:
    terminal_nll (`terminal_loss`), serving_nll (`mean_serving_nll`), flops_ratio (modeled
    FLOPs / the reference's, per seed), wall_reduction (1 - wall time / the reference's,
    per seed; None for the reference itself). JSON-ready: NaN is None. The grid must vary
    only schedule and seed (other axes of length one are dropped).
    """
    ds = schedules_and_seeds(ds, "Table 3", schedule_dim=schedule_dim, seed_dim=seed_dim)
    labels = select_schedules(ds, rows, schedule_dim)
    if reference not in [str(label) for label in ds[schedule_dim].values]:
        raise InputError(f"the reference schedule {reference!r} is not in the grid")
    terminal = terminal_loss(ds, fraction=terminal_fraction)
    serving_nll = mean_serving_nll(ds, serving)
    flops_ratio = paired_ratio(ds["modeled_flops"], reference, schedule_dim=schedule_dim)
    wall_reduction = 1 - paired_ratio(ds["wall_time"], reference, schedule_dim=schedule_dim)
    windows = ds["updates"].copy(data=terminal_window(ds["updates"].values, terminal_fraction))
    specs = per_schedule(ds["schedule_spec"], schedule_dim)
    table = []
    for label in labels:
        pick = {schedule_dim: label}
        row = {
            "schedule": label,
            "schedule_spec": specs[label],
            "n_seeds": int(ds.sizes.get(seed_dim, 1)),
            "updates": _one_or_all(ds["updates"].sel(pick).values),
            "terminal_window": _one_or_all(windows.sel(pick).values),
            "serving": serving_label(serving),
            "reference": reference,
        }
        for name, values in (
            ("terminal_nll", terminal),
            ("serving_nll", serving_nll),
            ("flops_ratio", flops_ratio),
            ("wall_reduction", wall_reduction),
        ):
            mean, sd = (None, None) if name == "wall_reduction" and label == reference else _mean_sd(values.sel(pick))
            row[f"{name}_mean"], row[f"{name}_sd"] = mean, sd
        table.append(row)
    return table


def _with_sd(mean: float | None, sd: float | None, digits: int = 5) -> str:
    if mean is None:
        return "–"
    return f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def _percent(mean: float | None, sd: float | None) -> str:
    if mean is None:
        return "–"
    text = f"{mean:.1%}"
    return text + (f" ± {sd:.1%}" if sd is not None and round(sd * 1000) > 0 else "")


def _updates_text(value) -> str:
    return f"{value:,}" if isinstance(value, int) else "/".join(f"{v:,}" for v in value)


def format_table3(rows: list[dict]) -> str:
    """`table3` rows as a Markdown table with the paper's columns, then a one-line footnote
    (mean ± SD over N seeds, the terminal window, what the FLOPs and wall-clock columns are
    relative to)."""
    if not rows:
        raise InputError("Table 3 has no rows")
    serving = rows[0]["serving"]
    lines = [
        f"| schedule | updates | terminal NLL | mean serving NLL ({serving}) | modeled FLOPs | wall-clock reduction |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = (
            row["schedule"],
            _updates_text(row["updates"]),
            _with_sd(row["terminal_nll_mean"], row["terminal_nll_sd"]),
            _with_sd(row["serving_nll_mean"], row["serving_nll_sd"]),
            _percent(row["flops_ratio_mean"], row["flops_ratio_sd"]),
            _percent(row["wall_reduction_mean"], row["wall_reduction_sd"]),
        )
        lines.append("| " + " | ".join(cells) + " |")
    seeds = sorted({row["n_seeds"] for row in rows})
    n = str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
    spans = sorted({(_updates_text(row["terminal_window"]), _updates_text(row["updates"])) for row in rows})
    window = "; ".join(f"the final {w} of {u} updates" for w, u in spans)
    reference = rows[0]["reference"]
    lines.append("")
    lines.append(
        f"Mean ± SD (ddof 1) over {n} seeds; terminal NLL: mean training loss over {window}; "
        f"modeled FLOPs relative to {reference}; wall-clock reduction = 1 − wall time / {reference}'s, "
        "paired by seed."
    )
    return "\n".join(lines)


# --- Figure 2 ----------------------------------------------------------------------------------

FAMILY_ORDER = ("uniform", "pln")
"""Rows of Figure 2 come in this order; any other family (e.g. 'fixed') follows in grid order."""


def figure2_points(
    ds: xr.Dataset,
    *,
    reference: str = "uniform",
    serving: Sequence[int] = range(1, 17),
    schedule_dim: str = "schedule",
    seed_dim: str = "seed",
) -> xr.Dataset:
    """One point per schedule for Figure 2's left column: modeled FLOPs relative to the
    `reference` (per seed ratio) and the mean serving NLL over `serving`, each as the seed
    mean and the range across seeds (`flops_mean/lower/upper`, `nll_mean/lower/upper`, `n`),
    with `family` (`finish_family` of `finish`), `initial_depth` and `switch_fraction` as
    coordinates along `schedule_dim`."""
    ds = schedules_and_seeds(ds, "figure 2", schedule_dim=schedule_dim, seed_dim=seed_dim)
    flops = seed_band(
        paired_ratio(ds["modeled_flops"], reference, schedule_dim=schedule_dim), band="range", seed_dim=seed_dim
    )
    nll = seed_band(mean_serving_nll(ds, serving), band="range", seed_dim=seed_dim)
    points = xr.Dataset(
        {
            **{f"flops_{key}": flops[key] for key in ("mean", "lower", "upper")},
            **{f"nll_{key}": nll[key] for key in ("mean", "lower", "upper")},
            "n": nll["n"],
        }
    )
    labels = [str(label) for label in ds[schedule_dim].values]
    finishes, depths, fractions = (
        per_schedule(ds[name], schedule_dim) for name in ("finish", "initial_depth", "switch_fraction")
    )
    points = points.assign_coords(
        family=(schedule_dim, [finish_family(finishes[label]) for label in labels]),
        initial_depth=(schedule_dim, [int(depths[label]) for label in labels]),
        switch_fraction=(schedule_dim, [float(fractions[label]) for label in labels]),
    )
    points.attrs = {"band": "range", "seed_dim": seed_dim, "reference": reference, "serving": serving_label(serving)}
    return points


def families(points: xr.Dataset) -> list[str]:
    """Figure 2's rows: the finishing families present, uniform and pln first."""
    present = list(dict.fromkeys(str(family) for family in points["family"].values))
    return [family for family in FAMILY_ORDER if family in present] + [
        family for family in present if family not in FAMILY_ORDER
    ]


def closest_switch(points: xr.Dataset, labels: Sequence[str], target: float = 2 / 3, schedule_dim="schedule"):
    """The labels among `labels` whose switch fraction is the one closest to `target` (all
    schedules sharing it); [] when none of them has a switch."""
    fractions = {
        label: float(points["switch_fraction"].sel({schedule_dim: label}))
        for label in labels
        if math.isfinite(float(points["switch_fraction"].sel({schedule_dim: label})))
    }
    if not fractions:
        return []
    best = min(abs(value - target) for value in fractions.values())
    return [label for label, value in fractions.items() if abs(value - target) == best]


# --- A schedule against the others, paired by seed ---------------------------------------------


def paired_comparison(
    ds: xr.Dataset,
    *,
    schedule: str,
    serving: Sequence[int] = range(1, 17),
    level: float = 0.95,
    schedule_dim: str = "schedule",
    seed_dim: str = "seed",
) -> xr.Dataset:
    """`schedule`'s NLL minus every other schedule's, paired by seed, at each serving depth
    and averaged over `serving`: the mean over seeds and its Student-t interval (over seeds,
    n = seeds; positive: `schedule` is worse). Also each schedule's mean NLL and modeled
    FLOPs relative to `schedule`'s. Dims: `other` (the other schedules) x serving_depth,
    plus `depth_mean_*` over `other`."""
    ds = schedules_and_seeds(ds, "the comparison", schedule_dim=schedule_dim, seed_dim=seed_dim)
    depths = _serving_list(ds, serving)
    nll = ds["nll"].sel({SERVING_DIM: depths})
    others = [label for label in select_schedules(ds, None, schedule_dim) if label != schedule]
    difference = -paired_difference(nll, schedule, schedule_dim=schedule_dim).sel({schedule_dim: others})
    difference = difference.rename({schedule_dim: "other"})
    options = IntervalOptions(level=level, method="t")
    by_depth = interval_over(difference, seed_dim, options=options)
    averaged = interval_over(difference.mean(SERVING_DIM), seed_dim, options=options)
    flops = paired_ratio(ds["modeled_flops"], schedule, schedule_dim=schedule_dim).mean(seed_dim)
    result = xr.Dataset(
        {
            "difference": by_depth["mean"],
            "lower": by_depth["lower"],
            "upper": by_depth["upper"],
            "depth_mean": averaged["mean"],
            "depth_mean_lower": averaged["lower"],
            "depth_mean_upper": averaged["upper"],
            "nll": nll.mean(seed_dim),
            "flops_ratio": flops,
        }
    )
    result.attrs = {
        "schedule": schedule,
        "n_seeds": int(ds.sizes.get(seed_dim, 1)),
        "level": level,
        "serving": serving_label(depths),
    }
    return result


def format_comparison(comparison: xr.Dataset) -> str:
    """`paired_comparison` as Markdown: per serving depth, each schedule's seed-mean NLL and
    the paired difference with its interval; then the depth average and modeled FLOPs."""
    schedule, n, level = comparison.attrs["schedule"], comparison.attrs["n_seeds"], comparison.attrs["level"]
    others = [str(label) for label in comparison["other"].values]
    labels = [str(label) for label in comparison["schedule"].values]

    def interval(mean, lower, upper) -> str:
        bounds = "n/a" if not np.isfinite(lower) else f"[{lower:+.4f}, {upper:+.4f}]"
        return f"{mean:+.4f} {bounds}"

    header = ["depth", *(f"NLL {label}" for label in labels), *(f"{schedule} − {other}" for other in others)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for depth in comparison[SERVING_DIM].values:
        nll = [f"{comparison['nll'].sel({'schedule': label, SERVING_DIM: depth}).item():.4f}" for label in labels]
        pick = {SERVING_DIM: depth}
        diffs = [
            interval(*(comparison[name].sel(other=other, **pick).item() for name in ("difference", "lower", "upper")))
            for other in others
        ]
        lines.append("| " + " | ".join([str(int(depth)), *nll, *diffs]) + " |")
    mean_nll = [f"{comparison['nll'].sel(schedule=label).mean(SERVING_DIM).item():.4f}" for label in labels]
    averaged = [
        interval(
            *(
                comparison[name].sel(other=other).item()
                for name in ("depth_mean", "depth_mean_lower", "depth_mean_upper")
            )
        )
        for other in others
    ]
    lines.append("| " + " | ".join([f"mean {comparison.attrs['serving']}", *mean_nll, *averaged]) + " |")
    flops = ", ".join(f"{label} {comparison['flops_ratio'].sel(schedule=label).item():.1%}" for label in labels)
    lines += [
        "",
        f"Differences: {schedule}'s NLL minus the other's, paired by seed (positive: {schedule} is worse); "
        f"mean and {level:.0%} Student-t interval over {n} seeds (training seeds: initialisation, batch order "
        f"and depth draws). Modeled training FLOPs relative to {schedule}: {flops}.",
    ]
    return "\n".join(lines)
