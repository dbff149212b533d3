"""How long the finishing phase needs to be, read off a grid of snapshots after the switch
(pure numpy/scipy/xarray).

Three readings, from the weakest claim to the strongest:
- the first snapshot whose interval contains zero: the benefit is no longer *shown* to differ
  from zero there, which says as much about the number of seeds as about the benefit;
- the decay point: where the benefit falls below `fraction` of its switch value for good, for
  the seed mean and per seed, with its spread over seeds (a bootstrap that resamples seeds);
- the equivalence bound: where the benefit is *shown* to be below `fraction` of its switch
  value, a one-sided bound on the mean over seeds of b(N) - fraction * b(0), paired within
  each seed. Absence ("indistinguishable from zero") is claimed with this bound, not with an
  interval that happens to contain zero.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import scipy.stats
import xarray as xr

from analysis.stats import (
    Interval,
    IntervalOptions,
    bca_interval,
    depth_averaged_benefit,
    depth_averaged_per_batch,
    replication_units,
)
from common.errors import InputError


def decay_point(uniform_updates, values, *, fraction: float = 0.05) -> int | None:
    """The first uniform-update count from which `values` stay below `fraction` x their switch value.

    `values` run along `uniform_updates`, which must contain 0 (the switch). "Stays"
    means every later snapshot is below too, so a dip followed by a rebound does not
    count. None when the switch value is not positive (there is no benefit to decay)
    or the values never settle below within the grid. A missing (NaN) value counts
    as not below: the claim must rest on measured snapshots.
    """
    order = np.argsort(np.asarray(uniform_updates))
    counts = np.asarray(uniform_updates)[order]
    values = np.asarray(values, dtype=np.float64)[order]
    if counts.size == 0 or counts[0] != 0:
        raise InputError("no snapshot at the switch (0 uniform updates) to measure the decay from")
    switch = values[0]
    if not switch > 0:
        return None
    below = values < fraction * switch
    for index in range(1, counts.size):
        if below[index:].all():
            return int(counts[index])
    return None


def _decay_indices(curves: np.ndarray, fraction: float) -> np.ndarray:
    """For each row of `curves` [rows, counts] (the switch first, counts ascending), the index of
    its decay point (`decay_point`), or the number of counts where there is none."""
    switch = curves[:, :1]
    below = (curves < fraction * switch) & (switch > 0)
    # below_for_good[:, j]: every count from j on is below.
    below_for_good = np.flip(np.cumprod(np.flip(below, axis=1), axis=1), axis=1).astype(bool)
    below_for_good[:, 0] = False  # the switch itself is never its own decay point
    found = below_for_good.any(axis=1)
    return np.where(found, below_for_good.argmax(axis=1), curves.shape[1])


def decay_spread(
    counts: list[int], seed_curves: np.ndarray, *, fraction: float, options: IntervalOptions
) -> tuple[int | None, int | None]:
    """The spread over seeds of the seed mean's decay point: the `options.level` range of the
    decay points of `options.n_resamples` seed-mean curves, each over seeds drawn with
    replacement from the rows of `seed_curves` [seeds, counts] (seeded by `options.seed`). A
    bound of None means "not within the grid". The decay point is a grid count and censored
    at the grid's end, so the range is read off the resampled counts themselves (no
    interpolation between grid counts)."""
    curves = np.asarray(seed_curves, dtype=np.float64)
    rng = np.random.default_rng(options.seed)
    draws = rng.integers(0, curves.shape[0], size=(options.n_resamples, curves.shape[0]))
    means = curves[draws].mean(axis=1)  # [resamples, counts]
    indices = np.sort(_decay_indices(means, fraction))
    tail = (1 - options.level) / 2
    lower = indices[int(np.floor(tail * (indices.size - 1)))]
    upper = indices[int(np.ceil((1 - tail) * (indices.size - 1)))]
    grid = [*counts, None]  # index len(counts): none within the grid
    return grid[lower], grid[upper]


def _one_sided_upper(values: np.ndarray, options: IntervalOptions) -> tuple[float, float, int]:
    """(mean, one-sided `options.level` upper bound, n) of the finite `values`: Student-t, or the
    upper end of the two-sided BCa interval at level 2 * level - 1."""
    if options.method == "t":
        finite = np.asarray(values, dtype=np.float64)
        finite = finite[np.isfinite(finite)]
        mean, n = (float(finite.mean()) if finite.size else math.nan), int(finite.size)
        if n < 2:
            return mean, math.nan, n
        return mean, mean + float(scipy.stats.t.ppf(options.level, n - 1) * finite.std(ddof=1) / math.sqrt(n)), n
    if options.level <= 0.5:
        raise InputError(f"a one-sided BCa bound needs a level above 0.5, got {options.level}")
    mean, _, high, n = bca_interval(values, 2 * options.level - 1, n_resamples=options.n_resamples, seed=options.seed)
    return mean, high, n


def equivalence_bounds(
    ds: xr.Dataset,
    *,
    fraction: float = 0.05,
    options: IntervalOptions = IntervalOptions(),
    seed_dim: str = "seed",
) -> xr.Dataset:
    """Per snapshot, whether the depth-averaged benefit is shown to lie below `fraction` of the
    switch benefit: over seeds, the margin d = b(N) - fraction * b(0) of each seed's means
    (paired: the same seed's switch snapshot), its mean `margin` and its one-sided
    `options.level` upper bound `margin_upper` (Student-t, or BCa as `options.method` says),
    `n` seeds and `below`
    (margin_upper < 0). Without `seed_dim` (one file: batches of different snapshots are not
    paired) and at the switch itself the bound is not formed (NaN, below False)."""
    counts = ds["uniform_updates"].values
    if 0 not in counts:
        raise InputError("no snapshot at the switch (0 uniform updates) to bound the benefit against")
    margin = np.full(counts.size, np.nan)
    upper = np.full(counts.size, np.nan)
    n = np.zeros(counts.size, dtype=np.int64)
    if seed_dim in ds.dims:
        seed_means, _ = replication_units(depth_averaged_per_batch(ds), seed_dim=seed_dim)
        seed_means = seed_means.transpose(seed_dim, "snapshot").values  # [seeds, snapshots]
        switch = seed_means[:, int(np.flatnonzero(counts == 0)[0])]
        for index in np.flatnonzero(counts != 0):
            margin[index], upper[index], n[index] = _one_sided_upper(seed_means[:, index] - fraction * switch, options)
    result = xr.Dataset(
        {
            "margin": ("snapshot", margin),
            "margin_upper": ("snapshot", upper),
            "n": ("snapshot", n),
            "below": ("snapshot", upper < 0),
        },
        coords={name: coord for name, coord in ds.coords.items() if coord.dims == ("snapshot",)},
    )
    result.attrs = {"fraction": fraction, "level": options.level, "method": options.method}
    return result


def with_equivalence(
    rows: list[dict],
    ds: xr.Dataset,
    *,
    fraction: float = 0.05,
    options: IntervalOptions = IntervalOptions(),
    seed_dim: str = "seed",
) -> list[dict]:
    """Summary rows (analysis.stats.summary_table) with each snapshot's equivalence bound:
    `margin_upper` (the one-sided bound of `equivalence_bounds`) and `shown_below_fraction`
    (whether that bound lies below 0), both None where no bound is formed: at the switch, or
    for one file."""
    bounds = equivalence_bounds(ds, fraction=fraction, options=options, seed_dim=seed_dim)
    by_name = {str(name): index for index, name in enumerate(bounds["snapshot"].values)}
    marked = []
    for row in rows:
        upper = float(bounds["margin_upper"].values[by_name[row["snapshot"]]])
        formed = bool(np.isfinite(upper))
        marked.append(
            {
                **row,
                "margin_upper": upper if formed else None,
                "shown_below_fraction": bool(upper < 0) if formed else None,
            }
        )
    return marked


@dataclasses.dataclass(frozen=True)
class SeedDecay:
    """One seed's decay point (None: not within the grid, or no positive switch benefit); the
    crossing itself lies in (`after`, `uniform_updates`], between two grid counts."""

    seed: int
    switch_value: float
    uniform_updates: int | None
    after: int | None


@dataclasses.dataclass(frozen=True)
class FinishingPhase:
    """How long the finishing phase needs to be, read off a grid of snapshots after the switch.

    `decay_updates` is where the seed-mean depth-averaged benefit falls below
    `fraction` of its switch value for good (the true crossing lies after
    `decay_after`, the previous grid count); `per_seed` repeats that per seed, and
    `decay_spread` is its `level` range over seeds (`decay_spread`; None for one file).
    `bound_updates` is where the benefit is shown below `fraction` of the switch benefit for
    good, by the one-sided bound of `equivalence_bounds` at every later snapshot (None: not
    within the grid, or one file). `first_zero_overlap` is the first snapshot after the switch
    whose headline interval contains zero (None: none within the grid, or no interval could be
    formed, `intervals_formed` False, with fewer than two units).
    """

    fraction: float
    """The fraction of the switch benefit the decay is measured against."""
    level: float
    """The confidence level of every interval and bound here."""
    max_uniform_updates: int
    """The grid's last count: "none within" it is the censored answer."""
    switch: Interval
    """The switch benefit and its headline interval."""
    decay_updates: int | None
    """The seed mean's decay point."""
    decay_after: int | None
    """The grid count before `decay_updates`."""
    decay_spread: tuple[int | None, int | None] | None
    """The `level` range of the decay point over resampled seeds (None: one file)."""
    resamples: int
    """How many seed resamples `decay_spread` drew."""
    per_seed: tuple[SeedDecay, ...]
    """Each seed's decay point."""
    bound_updates: int | None
    """The first count from which every snapshot's equivalence bound lies below the fraction."""
    first_zero_overlap: int | None
    """The first count after the switch whose headline interval contains zero."""
    zero_overlap: Interval | None
    """That snapshot's interval."""
    intervals_formed: bool
    """Whether any interval after the switch could be formed."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def interval_at(intervals: xr.Dataset, index: int) -> Interval:
    """The Interval of row `index` along `snapshot` of `depth_averaged_benefit` output."""
    row = intervals.isel(snapshot=index)
    return Interval(
        mean=float(row["mean"]),
        lower=float(row["lower"]),
        upper=float(row["upper"]),
        n=int(row["n"]),
        unit=intervals.attrs["unit"],
    )


def finishing_phase(
    ds: xr.Dataset,
    *,
    fraction: float = 0.05,
    options: IntervalOptions = IntervalOptions(),
    seed_dim: str = "seed",
) -> FinishingPhase:
    """The finishing-phase length from `ds`'s grid of snapshots (see `FinishingPhase`).

    Raises InputError when the grid has no snapshot at the switch.
    """
    intervals = depth_averaged_benefit(ds, options=options, seed_dim=seed_dim).sortby("uniform_updates")
    counts = [int(u) for u in intervals["uniform_updates"].values]
    decay = decay_point(counts, intervals["mean"].values, fraction=fraction)
    per_seed: tuple[SeedDecay, ...] = ()
    spread = None
    if seed_dim in ds.dims:
        seed_means, _ = replication_units(depth_averaged_per_batch(ds), seed_dim=seed_dim)
        seed_means = seed_means.sortby("uniform_updates")
        crossings = {
            int(seed): decay_point(counts, seed_means.sel({seed_dim: seed}).values, fraction=fraction)
            for seed in seed_means[seed_dim].values
        }
        per_seed = tuple(
            SeedDecay(
                seed=seed,
                switch_value=float(seed_means.sel({seed_dim: seed}).values[0]),
                uniform_updates=crossing,
                after=_grid_before(counts, crossing),
            )
            for seed, crossing in crossings.items()
        )
        curves = seed_means.transpose(seed_dim, "snapshot").values
        complete = curves[np.isfinite(curves).all(axis=1)]  # a seed missing a snapshot has no curve
        if complete.shape[0] >= 2:
            spread = decay_spread(counts, complete, fraction=fraction, options=options)
    bounds = equivalence_bounds(ds, fraction=fraction, options=options, seed_dim=seed_dim).sortby("uniform_updates")
    below = bounds["below"].values
    bound_index = next((index for index in range(1, len(counts)) if below[index:].all()), None)
    # From the first snapshot after the switch: the switch's own interval says nothing about decay.
    after_switch = [interval_at(intervals, index) for index in range(1, len(counts))]
    formed = any(np.isfinite(interval.lower) for interval in after_switch)
    zero_index = next((index for index, interval in enumerate(after_switch, start=1) if interval.contains_zero()), None)
    return FinishingPhase(
        fraction=fraction,
        level=options.level,
        max_uniform_updates=counts[-1],
        switch=interval_at(intervals, 0),
        decay_updates=decay,
        decay_after=_grid_before(counts, decay),
        decay_spread=spread,
        resamples=options.n_resamples,
        per_seed=per_seed,
        bound_updates=counts[bound_index] if bound_index is not None else None,
        first_zero_overlap=counts[zero_index] if zero_index is not None else None,
        zero_overlap=interval_at(intervals, zero_index) if zero_index is not None else None,
        intervals_formed=formed,
    )


def _grid_before(counts: list[int], count: int | None) -> int | None:
    """The grid count before `count` (None for None)."""
    return counts[counts.index(count) - 1] if count is not None else None


def format_finishing_phase(phase: FinishingPhase) -> str:
    """The finishing-phase lines of `summarize`."""
    percent = f"{phase.fraction:.0%}"
    level = f"{phase.level:.0%}"
    within = f"none within {phase.max_uniform_updates}"

    def count(value: int | None) -> str:
        return within if value is None else str(value)

    if phase.decay_updates is None:
        reason = "" if phase.switch.mean > 0 else " (the switch benefit is not positive)"
        decay = f"{within}{reason}"
    else:
        decay = f"{phase.decay_updates} uniform updates (after {phase.decay_after}; the grid brackets the crossing)"
    lines = [
        f"finishing phase: switch benefit {phase.switch.describe()}; "
        f"mean benefit below {percent} of it for good from: {decay}"
    ]
    if phase.per_seed:
        crossings = ", ".join(f"seed {decay.seed}: {count(decay.uniform_updates)}" for decay in phase.per_seed)
        found = [decay.uniform_updates for decay in phase.per_seed if decay.uniform_updates is not None]
        spread = f"; range {min(found)}-{max(found)}" if found else ""
        lines.append(f"  per seed: {crossings}{spread} (each crossing lies between its grid count and the one before)")
    if phase.decay_spread is not None:
        low, high = phase.decay_spread
        lines.append(
            f"  over seeds: {level} of the seed-mean crossings over {phase.resamples} resamples of the "
            f"{len(phase.per_seed)} seeds lie from {count(low)} to {count(high)} uniform updates"
        )
    if phase.per_seed:
        bound = f"{phase.bound_updates} uniform updates" if phase.bound_updates is not None else within
        lines.append(
            f"finishing phase: shown below {percent} of the switch benefit for good (one-sided {level} bound "
            f"over seeds of benefit - {percent} x switch benefit, paired by seed) from: {bound}"
        )
    if phase.zero_overlap is not None:
        zero = f"{phase.first_zero_overlap} uniform updates, benefit {phase.zero_overlap.describe()}"
    elif not phase.intervals_formed:
        zero = "n/a (no interval could be formed: fewer than two units)"
    else:
        zero = within
    lines.append(f"finishing phase: first snapshot whose {level} CI contains zero: {zero}")
    return "\n".join(lines)
