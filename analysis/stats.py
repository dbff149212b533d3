"""Confidence intervals for the update-diagnostic benefit (pure numpy/scipy/xarray).

The unit of replication is the diagnostic batch: serving depths of one batch are
evaluated on the same update and the same evaluation tokens, so they are strongly
correlated and are averaged within the batch before any interval is formed.
With several seeds (a `seed` dimension), each seed's batch mean is one unit and
the interval is over seeds, since batches within a seed share the trained weights.

Incomplete units (NaN, e.g. batches an interrupted run never reached, or padding
from combining seeds with different batch counts) are left out and do not count in n.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import scipy.stats
import xarray as xr

Method = Literal["t", "bca"]
METHODS = ("t", "bca")

# scipy >= 1.15 names the generator `rng`; older releases only accept `random_state`.
_BOOTSTRAP_RNG_KEYWORD = "rng" if "rng" in inspect.signature(scipy.stats.bootstrap).parameters else "random_state"


def t_interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float, int]:
    """(mean, lower, upper, n) of the Student-t interval for the mean of the finite `values`.

    With fewer than two finite values the bounds are NaN (no spread to estimate).
    """
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    n = values.size
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = float(values.mean())
    if n < 2:
        return mean, math.nan, math.nan, n
    half_width = scipy.stats.t.ppf(0.5 + level / 2, df=n - 1) * values.std(ddof=1) / math.sqrt(n)
    return mean, mean - half_width, mean + half_width, n


def bca_interval(
    values: np.ndarray, level: float = 0.95, *, n_resamples: int = 9999, seed: int = 0
) -> tuple[float, float, float, int]:
    """(mean, lower, upper, n) of the BCa bootstrap interval for the mean of the finite `values`.

    Seeded, so the same data give the same interval. Bounds are NaN with fewer than
    three finite values or when all values are equal (the bootstrap distribution is degenerate).
    """
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    n = values.size
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = float(values.mean())
    if n < 3 or np.all(values == values[0]):
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


@dataclass(frozen=True)
class IntervalOptions:
    """How intervals are computed; the `options` of the functions below."""

    level: float = 0.95
    """Confidence level, in (0, 1)."""
    method: Method = "t"
    """'t': Student-t interval over units; 'bca': BCa bootstrap interval over units."""
    n_resamples: int = 9999
    """Bootstrap resamples (method 'bca' only)."""
    seed: int = 0
    """Seed of the bootstrap resampling (method 'bca' only), so intervals are reproducible."""

    def __post_init__(self) -> None:
        if not 0 < self.level < 1:
            raise ValueError(f"confidence level must be in (0, 1), got {self.level}")
        if self.method not in METHODS:
            raise ValueError(f"interval method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.n_resamples < 1:
            raise ValueError(f"n_resamples must be positive, got {self.n_resamples}")


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
    per_batch = ds["benefit"].mean("serving_depth", skipna=False)
    units, unit_dim = replication_units(per_batch, seed_dim=seed_dim)
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


def summary_table(
    ds: xr.Dataset,
    *,
    options: IntervalOptions = IntervalOptions(),
    seed_dim: str = "seed",
) -> list[dict]:
    """One row per snapshot, ordered by uniform updates: the depth-averaged benefit and its interval.

    Keys: snapshot, uniform_updates, step, mean, lower, upper, n, unit ("batch" or
    the seed dimension), excludes_zero (the interval lies entirely above or below 0).
    """
    intervals = depth_averaged_benefit(ds, options=options, seed_dim=seed_dim)
    intervals = intervals.sortby("uniform_updates")
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
            }
        )
    return rows


def format_summary_table(rows: list[dict], *, level: float = 0.95) -> str:
    """The summary rows as an aligned plain-text table."""
    percent = f"{level * 100:g}%"
    header = ("snapshot", "uniform updates", "step", "mean benefit", f"{percent} CI", "n", "CI excludes 0")
    lines = [
        (
            row["snapshot"],
            str(row["uniform_updates"]),
            str(row["step"]),
            f"{row['mean']:+.4f}",
            f"[{row['lower']:+.4f}, {row['upper']:+.4f}]" if math.isfinite(row["lower"]) else "n/a (too few units)",
            f"{row['n']} {row['unit']}{'es' if row['unit'] == 'batch' else 's'}",
            "yes" if row["excludes_zero"] else "no",
        )
        for row in rows
    ]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(cells, widths)) for cells in [header, *lines])
