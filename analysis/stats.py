"""Confidence intervals for the update-diagnostic benefit (pure numpy/scipy/xarray).

The unit of replication is the training seed. Serving depths of one batch are evaluated on the
same update and evaluation tokens, so they are strongly correlated and averaged within the
batch first; batches within a seed share the trained weights, so they are averaged within the
seed; the headline interval is a Student-t interval over the per-seed means (n = seeds). The
within-seed interval over batches is secondary: it measures batch noise only, and a rerun of
the same seed elsewhere can fall outside it. With one file (no `seed` dimension) the only
interval is the batch one, labelled as such. Incomplete units (NaN, e.g. the padding where
snapshots of one file have different batch counts) are left out and do not count in n.
"""

from __future__ import annotations

import csv
import dataclasses
import inspect
import io
import math
from typing import Literal

import numpy as np
import scipy.stats
import xarray as xr

from common.choices import INTERVAL_METHOD_CHOICES, RESAMPLES_RANGE
from common.errors import InputError

Method = Literal["t", "bca"]

# scipy >= 1.15 names the generator `rng`; older releases only accept `random_state`.
_BOOTSTRAP_RNG_KEYWORD = "rng" if "rng" in inspect.signature(scipy.stats.bootstrap).parameters else "random_state"


def _finite_or_no_interval(
    values: np.ndarray, fewest: int
) -> tuple[np.ndarray, tuple[float, float, float, int] | None]:
    """The finite `values` (float64), and with fewer than `fewest` of them the (mean, NaN, NaN, n)
    an interval function returns instead of an interval (mean NaN when none is finite)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    n = values.size
    if n >= fewest:
        return values, None
    return values, (float(values.mean()) if n else math.nan, math.nan, math.nan, n)


def t_interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float, int]:
    """(mean, lower, upper, n) of the Student-t interval for the mean of the finite `values`.

    With fewer than two finite values the bounds are NaN (no spread to estimate).
    """
    values, without = _finite_or_no_interval(values, fewest=2)
    if without is not None:
        return without
    n, mean = values.size, float(values.mean())
    half_width = scipy.stats.t.ppf(0.5 + level / 2, df=n - 1) * values.std(ddof=1) / math.sqrt(n)
    return mean, float(mean - half_width), float(mean + half_width), n


def bca_interval(
    values: np.ndarray, level: float = 0.95, *, n_resamples: int = 9999, seed: int = 0
) -> tuple[float, float, float, int]:
    """(mean, lower, upper, n) of the BCa bootstrap interval for the mean of the finite `values`.

    Seeded, so the same data give the same interval. Bounds are NaN with fewer than
    three finite values or when all values are equal (the bootstrap distribution is degenerate).
    """
    values, without = _finite_or_no_interval(values, fewest=3)
    if without is not None:
        return without
    n, mean = values.size, float(values.mean())
    if np.all(values == values[0]):
        return mean, math.nan, math.nan, n
    result = scipy.stats.bootstrap(
        (values,),
        np.mean,
        confidence_level=level,
        n_resamples=n_resamples,
        method="BCa",
        vectorized=True,
        **{_BOOTSTRAP_RNG_KEYWORD: np.random.default_rng(seed)},
    )
    return mean, float(result.confidence_interval.low), float(result.confidence_interval.high), n


@dataclasses.dataclass(frozen=True)
class IntervalOptions:
    """How intervals are computed; the `options` of the functions below."""

    level: float = 0.95
    """Confidence level, in (0, 1)."""
    method: Method = "t"
    """'t': Student-t interval over units; 'bca': BCa bootstrap interval over units."""
    n_resamples: int = 9999
    """Bootstrap resamples (method 'bca' only), within common.choices.RESAMPLES_RANGE."""
    seed: int = 0
    """Seed of the bootstrap resampling (method 'bca' only), so intervals are reproducible."""

    def __post_init__(self) -> None:
        if not 0 < self.level < 1:
            raise InputError(f"confidence level must be in (0, 1), got {self.level}")
        if self.method not in INTERVAL_METHOD_CHOICES:
            raise InputError(
                f"interval method must be one of {', '.join(INTERVAL_METHOD_CHOICES)}, got {self.method!r}"
            )
        fewest, most = RESAMPLES_RANGE
        if not fewest <= self.n_resamples <= most:
            raise InputError(f"n_resamples must be in [{fewest}, {most}], got {self.n_resamples}")


def replication_units(benefit: xr.DataArray, *, seed_dim: str = "seed") -> tuple[xr.DataArray, str]:
    """The values the interval is taken over, and the name of their dimension.

    Without `seed_dim`: `benefit` itself, over `batch`. With it: each seed's mean over
    its complete batches, over `seed_dim`.
    """
    if seed_dim in benefit.dims:
        return benefit.mean("batch", skipna=True), seed_dim
    return benefit, "batch"


def interval_over(values: xr.DataArray, dim: str, *, options: IntervalOptions = IntervalOptions()) -> xr.Dataset:
    """An interval for the mean along `dim`, separately at every index of the other dims.

    Returns a Dataset with `mean`, `lower`, `upper` (float) and `n` (int), over the other dims.
    """
    values = values.transpose(..., dim)
    outer_shape = values.shape[:-1]
    data = values.values.reshape(-1, values.shape[-1])  # [units of the other dims, len(dim)]
    rows = [
        t_interval(row, options.level)
        if options.method == "t"
        else bca_interval(row, options.level, n_resamples=options.n_resamples, seed=options.seed)
        for row in data
    ]
    columns = np.array([row[:3] for row in rows], dtype=np.float64).reshape(*outer_shape, 3)
    counts = np.array([row[3] for row in rows], dtype=np.int64).reshape(outer_shape)
    outer_dims = values.dims[:-1]
    coords = {name: coord for name, coord in values.coords.items() if dim not in coord.dims}
    return xr.Dataset(
        {
            "mean": (outer_dims, columns[..., 0]),
            "lower": (outer_dims, columns[..., 1]),
            "upper": (outer_dims, columns[..., 2]),
            "n": (outer_dims, counts),
        },
        coords=coords,
    )


def _describe(intervals: xr.Dataset, ds: xr.Dataset, unit: str, options: IntervalOptions) -> xr.Dataset:
    intervals.attrs = {"level": options.level, "method": options.method, "unit": unit}
    if "update_depth" in ds.coords:
        # The benefit is the reference (first) update depth's NLL minus the other's.
        update_depths = [int(d) for d in ds["update_depth"].values]
        intervals.attrs.update(reference_depth=update_depths[0], compared_depth=update_depths[-1])
    return intervals


def depth_averaged_benefit(
    ds: xr.Dataset,
    *,
    options: IntervalOptions = IntervalOptions(),
    seed_dim: str = "seed",
) -> xr.Dataset:
    """Benefit averaged over serving depths, with its interval, per snapshot.

    Each batch's benefit is first averaged over serving depths (a batch missing any
    depth is left out), then the interval is over batches, or over per-seed means
    when `ds` has `seed_dim`. Returns mean/lower/upper/n over `snapshot`.
    """
    units, unit_dim = replication_units(depth_averaged_per_batch(ds), seed_dim=seed_dim)
    intervals = interval_over(units, unit_dim, options=options)
    return _describe(intervals, ds, unit_dim, options)


def benefit_by_depth(
    ds: xr.Dataset,
    *,
    options: IntervalOptions = IntervalOptions(),
    seed_dim: str = "seed",
) -> xr.Dataset:
    """Benefit at each serving depth with its interval over batches (or seeds).

    Returns mean/lower/upper/n over (`snapshot`, `serving_depth`).
    """
    units, unit_dim = replication_units(ds["benefit"], seed_dim=seed_dim)
    intervals = interval_over(units, unit_dim, options=options)
    intervals = intervals.transpose("snapshot", "serving_depth")
    return _describe(intervals, ds, unit_dim, options)


def depth_averaged_per_batch(ds: xr.Dataset) -> xr.DataArray:
    """Each batch's benefit averaged over serving depths (NaN when any depth is missing)."""
    return ds["benefit"].mean("serving_depth", skipna=False)


def batch_noise(
    ds: xr.Dataset,
    *,
    options: IntervalOptions = IntervalOptions(),
    seed_dim: str = "seed",
) -> xr.Dataset:
    """The secondary, within-seed view of the depth-averaged benefit, per snapshot.

    For each seed, the interval over its batches (batch noise only), summarised as
    `batch_half_width` (mean over seeds of that interval's half-width) and
    `batches_per_seed` (the fewest batches any seed has). Also the two variance
    components a reader needs to judge whether enough batches were diagnosed:
    `between_seed_variance`, the sample variance of the per-seed means (NaN without
    two seeds), and `within_seed_variance`, the mean over seeds of s^2_batch / n_batch,
    the part of a seed mean's variance that batch noise contributes. The former
    contains the latter, so batch noise is negligible when the latter is a small
    fraction of the former.
    """
    per_batch = depth_averaged_per_batch(ds)
    seeded = seed_dim in per_batch.dims
    if not seeded:
        per_batch = per_batch.expand_dims({seed_dim: [0]})
    per_seed = interval_over(per_batch, "batch", options=options)
    counts = per_batch.count("batch")
    within = (per_batch.var("batch", ddof=1) / counts).where(counts >= 2)
    seed_means = per_seed["mean"]
    between = (
        seed_means.var(seed_dim, ddof=1).where(seed_means.count(seed_dim) >= 2)
        if seeded
        else xr.full_like(seed_means.isel({seed_dim: 0}, drop=True), np.nan)
    )
    result = xr.Dataset(
        {
            "batch_half_width": ((per_seed["upper"] - per_seed["lower"]) / 2).mean(seed_dim),
            "batches_per_seed": per_seed["n"].min(seed_dim),
            "between_seed_variance": between,
            "within_seed_variance": within.mean(seed_dim),
        }
    )
    result.attrs = {"level": options.level, "method": options.method, "seeded": int(seeded)}
    return result


def per_seed_benefits(
    ds: xr.Dataset, *, options: IntervalOptions = IntervalOptions(), seed_dim: str = "seed"
) -> dict[str, list[dict]] | None:
    """Per snapshot, each seed's depth-averaged benefit: its mean over batches and the interval
    over those batches (batch noise only), as {snapshot: [{seed, mean, lower, upper, n}]}, so a
    rerun can be compared seed by seed. None for a single file (no seeds)."""
    if seed_dim not in ds.dims:
        return None
    per_seed = interval_over(depth_averaged_per_batch(ds), "batch", options=options)
    return {
        str(snapshot): [
            {
                "seed": int(seed),
                "mean": float(row["mean"]),
                "lower": float(row["lower"]),
                "upper": float(row["upper"]),
                "n": int(row["n"]),
            }
            for seed, row in (
                (seed, per_seed.sel({seed_dim: seed, "snapshot": snapshot})) for seed in ds[seed_dim].values
            )
        ]
        for snapshot in ds["snapshot"].values
    }


def interval_coverage(unit: str) -> str:
    """What an interval over `unit`s covers, in words, for every place it is shown."""
    if unit == "batch":
        return "over batches of one seed: batch noise only, not seed-to-seed variation"
    return "over training seeds (per-seed means of batch means)"


def summary_table(
    ds: xr.Dataset,
    *,
    options: IntervalOptions = IntervalOptions(),
    seed_dim: str = "seed",
) -> list[dict]:
    """One row per snapshot, ordered by uniform updates: the depth-averaged benefit and its intervals.

    Headline keys: snapshot, uniform_updates, step, mean, lower, upper, n, unit
    ("seed", or "batch" for a single file), excludes_zero (the interval lies
    entirely above or below 0). Secondary keys (see `batch_noise`):
    batch_half_width, batches_per_seed, between_seed_variance (None for a single
    file, where it does not exist), within_seed_variance.
    """
    intervals = depth_averaged_benefit(ds, options=options, seed_dim=seed_dim)
    noise = batch_noise(ds, options=options, seed_dim=seed_dim)
    intervals = xr.merge([intervals, noise], combine_attrs="override").sortby("uniform_updates")
    seeded = seed_dim in ds.dims
    rows = []
    for index in range(intervals.sizes["snapshot"]):
        row = intervals.isel(snapshot=index)
        lower, upper = float(row["lower"]), float(row["upper"])
        rows.append(
            {
                "snapshot": str(row["snapshot"].values),
                "uniform_updates": int(row["uniform_updates"]),
                "step": int(row["step"]),
                "mean": float(row["mean"]),
                "lower": lower,
                "upper": upper,
                "n": int(row["n"]),
                "unit": intervals.attrs["unit"],
                # NaN bounds compare False both ways: an interval that could not be formed excludes nothing.
                "excludes_zero": bool(lower > 0 or upper < 0),
                "batch_half_width": float(row["batch_half_width"]),
                "batches_per_seed": int(row["batches_per_seed"]),
                "between_seed_variance": float(row["between_seed_variance"]) if seeded else None,
                "within_seed_variance": float(row["within_seed_variance"]),
            }
        )
    return rows


def plural(unit: str, n: int | None = None) -> str:
    """'batch' -> 'batches', 'seed' -> 'seeds' (singular for n == 1)."""
    if n == 1:
        return unit
    return f"{unit}{'es' if unit == 'batch' else 's'}"


def method_name(method: str) -> str:
    """The interval method as a reader names it: 'Student-t' or 'BCa bootstrap'."""
    return "BCa bootstrap" if method == "bca" else "Student-t"


def format_bounds(lower: float, upper: float, *, missing: str = "n/a (too few units)") -> str:
    """'[+lower, +upper]' to four places, or `missing` for an interval that could not be formed."""
    return f"[{lower:+.4f}, {upper:+.4f}]" if math.isfinite(lower) else missing


def describe_intervals(rows: list[dict], *, level: float = 0.95, method: Method = "t") -> str:
    """The lines that say which interval the summary's headline is and what it covers."""
    if not rows:
        # summary_text prints the table's header alone then: say so rather than name an interval.
        return "headline: none (no snapshots to summarise)"
    unit = rows[0]["unit"]
    counts = sorted({row["n"] for row in rows})
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    headline = f"headline: {level:.0%} {method_name(method)} CI {interval_coverage(unit)}, n = {n} {plural(unit)}"
    if unit == "batch":
        return headline + "; diagnose several seeds for the interval a replication would fall in"
    return (
        headline + f"\nsecondary: within-seed {level:.0%} CI over batches (batch noise only), "
        "shown as its mean half-width over seeds; var(seeds) = variance of the seed means, "
        "var(batches) = mean s^2_batch / n_batch (batch noise in one seed mean)"
    )


def trailing_mean(values, window: int) -> np.ndarray:
    """Mean of each value and the `window` - 1 before it (fewer at the start), NaNs skipped:
    the smoothed training loss of `depthdiag plot --figure curves`."""
    values = np.asarray(values, dtype=np.float64)
    if window < 1:
        raise InputError(f"window must be >= 1, got {window}")
    finite = np.isfinite(values)
    sums = np.cumsum(np.where(finite, values, 0.0))
    counts = np.cumsum(finite)
    behind_sums = np.concatenate([np.zeros(window), sums[:-window]])[: values.size]
    behind_counts = np.concatenate([np.zeros(window), counts[:-window]])[: values.size]
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums - behind_sums) / (counts - behind_counts)


def format_csv(rows: list[dict]) -> str:
    """Summary rows (`summary_table`, `monitor_summary_table`) as CSV: a header of every key in
    the order first seen, then a line per row; floats at full precision, an interval that could
    not be formed (NaN) or a value that does not exist (None) as an empty field."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        values = [row.get(column) for column in columns]
        writer.writerow(["" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v for v in values])
    return buffer.getvalue()


# --- an interval as a value -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean with its confidence interval over `n` units of kind `unit` ("seed" or "batch")."""

    mean: float
    lower: float
    upper: float
    n: int
    unit: str

    def contains_zero(self) -> bool:
        """True when the interval includes 0; an interval that could not be formed (NaN) contains nothing."""
        return bool(self.lower <= 0 <= self.upper)

    def describe(self) -> str:
        return f"{self.mean:+.4f} {format_bounds(self.lower, self.upper)} over {self.n} {plural(self.unit, self.n)}"


# --- the update-depth x serving-depth map ------------------------------------------------


def update_depth_benefit(ds: xr.Dataset) -> xr.DataArray:
    """The benefit of each update depth's update over the reference (the first update depth's):
    NLL after the reference update minus NLL after the depth-K update, over (..., update_depth,
    serving_depth); the reference's own row is 0. The stored `benefit_all` (written when more
    than two update depths are diagnosed) when present, else the same difference from `nll`."""
    if "benefit_all" in ds.data_vars:
        return ds["benefit_all"]
    nll = ds["nll"]
    return nll.isel(update_depth=0, drop=True) - nll


def update_depth_map(
    ds: xr.Dataset,
    *,
    options: IntervalOptions = IntervalOptions(),
    seed_dim: str = "seed",
) -> xr.Dataset:
    """Which update depth helps which serving depth: per (snapshot, update_depth, serving_depth)
    the benefit of the depth-K update over the reference update (`update_depth_benefit`), with its
    interval over batches, or over per-seed batch means when `ds` has `seed_dim` (the same units
    as `benefit_by_depth`). The reference depth is left out (its benefit is 0 by definition) and
    the other update depths are sorted. Returns mean/lower/upper/n; attrs level, method, unit and
    reference_depth.
    """
    update_depths = [int(d) for d in ds["update_depth"].values]
    reference = update_depths[0]
    compared = sorted(update_depths[1:])
    benefit = update_depth_benefit(ds).sel(update_depth=compared)
    units, unit_dim = replication_units(benefit, seed_dim=seed_dim)
    intervals = interval_over(units, unit_dim, options=options).transpose("snapshot", "update_depth", "serving_depth")
    intervals.attrs = {
        "level": options.level,
        "method": options.method,
        "unit": unit_dim,
        "reference_depth": reference,
    }
    return intervals


# --- learning rates -----------------------------------------------------------------------


def mixed_learning_rate_warning(ds: xr.Dataset, files, *, seed_dim: str = "seed") -> str | None:
    """One line naming the files and their learning rates when snapshots were diagnosed at
    different LRs (within a file or across seeds); None when they agree or are unknown.

    The update's size scales with the LR, so benefits measured at different LRs are
    not comparable as one curve. `files` are the results files in seed order.
    """
    if "lr" not in ds.coords:
        return None
    lr = ds["lr"] if seed_dim in ds["lr"].dims else ds["lr"].expand_dims({seed_dim: 1})
    if len(set(np.unique(lr.values[np.isfinite(lr.values)]))) <= 1:
        return None
    snapshots = [str(name) for name in ds["snapshot"].values]
    described = []
    for position, file in enumerate(files):
        rates = lr.isel({seed_dim: position}).values
        by_rate = {rate: [name for name, r in zip(snapshots, rates) if r == rate] for rate in dict.fromkeys(rates)}
        if len(by_rate) == 1:
            described.append(f"{file}: lr {rates[0]:g}")
        else:
            parts = (f"lr {rate:g} ({' '.join(names)})" for rate, names in by_rate.items())
            described.append(f"{file}: " + ", ".join(parts))
    return "snapshots were diagnosed at different learning rates: " + "; ".join(described)


# --- the in-training monitor (RUN/monitor.h5, analysis/monitor.py) ---------------------------


def monitor_benefit_map(ds: xr.Dataset) -> xr.DataArray:
    """The batch-mean benefit of a monitor Dataset over (step, serving_depth) (NaN batches skipped)."""
    benefit = ds["benefit"].mean("batch", skipna=True).transpose("step", "serving_depth")
    benefit.attrs = dict(ds["benefit"].attrs)
    return benefit


def monitor_depth_averaged_benefit(ds: xr.Dataset, *, options: IntervalOptions = IntervalOptions()) -> xr.Dataset:
    """Per step of a monitor Dataset: the benefit averaged over serving depths within each
    batch, then mean/lower/upper/n over the check's batches (one run: batch noise only)."""
    intervals = interval_over(depth_averaged_per_batch(ds), "batch", options=options)
    return _describe(intervals, ds, "batch", options)


def monitor_summary_table(ds: xr.Dataset, *, options: IntervalOptions = IntervalOptions()) -> list[dict]:
    """One row per check of a monitor Dataset: step, lr, phase ('fixed' before the schedule's
    switch, 'switch', 'finish' after it; '' without a switch), and the depth-averaged benefit
    with its interval over batches (mean, lower, upper, n, excludes_zero)."""
    intervals = monitor_depth_averaged_benefit(ds, options=options)
    switch = int(ds.attrs.get("switch_step", -1))
    rows = []
    for index, step in enumerate(int(s) for s in ds["step"].values):
        row = intervals.isel(step=index)
        lower, upper = float(row["lower"]), float(row["upper"])
        phase = "" if switch < 0 else "fixed" if step < switch else "switch" if step == switch else "finish"
        rows.append(
            {
                "step": step,
                "lr": float(ds["lr"].values[index]),
                "phase": phase,
                "mean": float(row["mean"]),
                "lower": lower,
                "upper": upper,
                "n": int(row["n"]),
                "unit": "batch",
                "excludes_zero": bool(lower > 0 or upper < 0),
            }
        )
    return rows


def format_monitor_summary(rows: list[dict], *, level: float = 0.95, method: Method = "t") -> str:
    """The monitor's summary: what the interval is, then a line per check."""
    counts = sorted({row["n"] for row in rows})
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}" if counts else "0"
    lines = [
        f"monitor: depth-averaged benefit per step; {level:.0%} {method_name(method)} CI over the check's "
        f"batches of one run (n = {n}): batch noise only, not run-to-run variation"
    ]
    percent = f"{level * 100:g}%"
    header = ("step", "phase", "lr", "mean benefit", f"{percent} CI", "n", "CI excludes 0")
    cells = [
        (
            str(row["step"]),
            row["phase"] or "-",
            f"{row['lr']:.3g}",
            f"{row['mean']:+.4f}",
            format_bounds(row["lower"], row["upper"]),
            f"{row['n']} {plural('batch', row['n'])}",
            "yes" if row["excludes_zero"] else "no",
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in [header, *cells]]
    return "\n".join(lines)
