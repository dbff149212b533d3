"""Benefit intervals: batch-level Student-t (and BCa) intervals, checked against scipy.stats directly."""

import math

import numpy as np
import pytest
import scipy.stats
import xarray as xr

from analysis.stats import (
    IntervalOptions,
    batch_noise,
    bca_interval,
    benefit_by_depth,
    decay_point,
    depth_averaged_benefit,
    describe_intervals,
    finishing_phase,
    format_finishing_phase,
    format_summary_table,
    mixed_learning_rate_warning,
    summary_table,
    t_interval,
)


def benefit_results(benefit: np.ndarray, uniform_updates=None, seeded: bool = False) -> xr.Dataset:
    """A Dataset with the coordinates the statistics read, around `benefit` [(seed,) snapshot, batch, depth]."""
    dims = (("seed",) if seeded else ()) + ("snapshot", "batch", "serving_depth")
    n_snapshots, n_batches, n_depths = benefit.shape[-3:]
    uniform_updates = list(uniform_updates if uniform_updates is not None else range(n_snapshots))
    coords = {
        "snapshot": [f"s{u}" for u in uniform_updates],
        "uniform_updates": ("snapshot", uniform_updates),
        "step": ("snapshot", [1000 + u for u in uniform_updates]),
        "batch": np.arange(n_batches),
        "serving_depth": np.arange(1, n_depths + 1),
        "update_depth": [4, 16],
    }
    if seeded:
        coords["seed"] = np.arange(benefit.shape[0])
    return xr.Dataset({"benefit": (dims, benefit)}, coords=coords)


def scipy_t(values, level=0.95):
    values = np.asarray(values)
    return scipy.stats.t.interval(level, len(values) - 1, loc=values.mean(), scale=scipy.stats.sem(values))


def correlated_benefit(rng, n_snapshots, n_batches, n_depths, means, batch_sd=0.5, depth_sd=0.05):
    """Benefit with a shared per-batch effect: depths of one batch move together, as in the diagnostic."""
    batch_effect = rng.normal(0.0, batch_sd, (n_snapshots, n_batches, 1))
    noise = rng.normal(0.0, depth_sd, (n_snapshots, n_batches, n_depths))
    return np.asarray(means, dtype=float)[:, None, None] + batch_effect + noise


def test_t_interval_matches_scipy():
    values = np.random.default_rng(0).normal(0.3, 1.0, 17)
    for level in (0.9, 0.95, 0.99):
        mean, lower, upper, n = t_interval(values, level)
        expected = scipy_t(values, level)
        assert n == 17 and mean == pytest.approx(values.mean())
        assert (lower, upper) == pytest.approx(expected, rel=1e-12)


def test_t_interval_skips_nan_and_needs_two_values():
    assert t_interval(np.array([1.0, np.nan, 3.0]))[3] == 2
    mean, lower, upper, n = t_interval(np.array([2.0, np.nan]))
    assert (mean, n) == (2.0, 1) and math.isnan(lower) and math.isnan(upper)


def test_depth_average_comes_before_the_interval():
    rng = np.random.default_rng(1)
    benefit = correlated_benefit(rng, 2, 12, 16, means=[0.2, -0.1])
    intervals = depth_averaged_benefit(benefit_results(benefit))

    for index in range(2):
        batch_means = benefit[index].mean(axis=1)
        lower, upper = scipy_t(batch_means)
        row = intervals.isel(snapshot=index)
        assert int(row["n"]) == 12
        assert float(row["mean"]) == pytest.approx(benefit[index].mean())
        assert (float(row["lower"]), float(row["upper"])) == pytest.approx((lower, upper), rel=1e-12)
        # Treating the 12 x 16 correlated values as independent would claim far more precision.
        pooled_lower, pooled_upper = scipy_t(benefit[index].ravel())
        assert pooled_upper - pooled_lower < 0.5 * (upper - lower)


def test_batch_level_intervals_cover_the_true_mean():
    # Many independent experiments at once (one per "snapshot"); the interval must hold its
    # nominal coverage under within-batch correlation, which a pooled interval would not.
    rng = np.random.default_rng(2)
    true_mean, n_experiments = 0.1, 2000
    benefit = correlated_benefit(rng, n_experiments, 8, 16, means=np.full(n_experiments, true_mean))
    intervals = depth_averaged_benefit(benefit_results(benefit))
    covered = (intervals["lower"] <= true_mean) & (true_mean <= intervals["upper"])
    assert 0.93 <= float(covered.mean()) <= 0.97


def test_per_depth_intervals_match_scipy():
    rng = np.random.default_rng(3)
    benefit = correlated_benefit(rng, 3, 10, 6, means=[0.0, 0.5, -0.5])
    intervals = benefit_by_depth(benefit_results(benefit), options=IntervalOptions(level=0.9))
    assert intervals["mean"].dims == ("snapshot", "serving_depth")
    for snapshot in range(3):
        for depth in range(6):
            lower, upper = scipy_t(benefit[snapshot, :, depth], level=0.9)
            row = intervals.isel(snapshot=snapshot, serving_depth=depth)
            assert float(row["mean"]) == pytest.approx(benefit[snapshot, :, depth].mean())
            assert (float(row["lower"]), float(row["upper"])) == pytest.approx((lower, upper), rel=1e-12)
    assert intervals.attrs["unit"] == "batch" and intervals.attrs["level"] == 0.9


def test_incomplete_batches_are_left_out():
    rng = np.random.default_rng(4)
    benefit = correlated_benefit(rng, 1, 6, 5, means=[0.3])
    benefit[0, 2, 4] = np.nan  # one depth of one batch never evaluated
    intervals = depth_averaged_benefit(benefit_results(benefit))
    complete = np.delete(benefit[0], 2, axis=0).mean(axis=1)
    assert int(intervals["n"][0]) == 5
    assert (float(intervals["lower"][0]), float(intervals["upper"][0])) == pytest.approx(scipy_t(complete))


def test_several_seeds_use_per_seed_means():
    rng = np.random.default_rng(5)
    n_seeds, n_snapshots, n_batches, n_depths = 4, 2, 6, 5
    seed_effect = rng.normal(0.0, 0.3, (n_seeds, 1, 1, 1))
    benefit = seed_effect + rng.normal(0.1, 0.2, (n_seeds, n_snapshots, n_batches, n_depths))
    benefit[3, :, 4:] = np.nan  # the last seed ran fewer batches
    ds = benefit_results(benefit, seeded=True)

    averaged = depth_averaged_benefit(ds)
    by_depth = benefit_by_depth(ds)
    assert averaged.attrs["unit"] == "seed"
    for snapshot in range(n_snapshots):
        seed_means = [np.nanmean(benefit[s, snapshot].mean(axis=1)) for s in range(n_seeds)]
        row = averaged.isel(snapshot=snapshot)
        assert int(row["n"]) == n_seeds
        assert float(row["mean"]) == pytest.approx(np.mean(seed_means))
        assert (float(row["lower"]), float(row["upper"])) == pytest.approx(scipy_t(seed_means))
        for depth in range(n_depths):
            depth_means = [np.nanmean(benefit[s, snapshot, :, depth]) for s in range(n_seeds)]
            cell = by_depth.isel(snapshot=snapshot, serving_depth=depth)
            assert (float(cell["lower"]), float(cell["upper"])) == pytest.approx(scipy_t(depth_means))


def test_bca_matches_scipy_bootstrap_and_is_reproducible():
    rng = np.random.default_rng(6)
    benefit = correlated_benefit(rng, 2, 15, 4, means=[0.4, 0.0])
    ds = benefit_results(benefit)
    options = IntervalOptions(method="bca", n_resamples=2000, seed=11)
    intervals = depth_averaged_benefit(ds, options=options)
    again = depth_averaged_benefit(ds, options=options)
    xr.testing.assert_identical(intervals, again)
    for index in range(2):
        batch_means = benefit[index].mean(axis=1)
        reference = scipy.stats.bootstrap(
            (batch_means,), np.mean, n_resamples=2000, method="BCa", rng=np.random.default_rng(11)
        ).confidence_interval
        row = intervals.isel(snapshot=index)
        assert (float(row["lower"]), float(row["upper"])) == pytest.approx((reference.low, reference.high))
    assert bca_interval(np.ones(5))[1:3] == pytest.approx((math.nan, math.nan), nan_ok=True)


def test_summary_table_rows():
    rng = np.random.default_rng(7)
    # Stored out of order: the table is ordered by uniform updates.
    benefit = correlated_benefit(rng, 3, 12, 8, means=[0.0, 2.0, -2.0], batch_sd=0.2)
    ds = benefit_results(benefit, uniform_updates=[16, 0, 64])
    rows = summary_table(ds)
    intervals = depth_averaged_benefit(ds)

    assert [row["uniform_updates"] for row in rows] == [0, 16, 64]
    for row in rows:
        stored = intervals.sel(snapshot=row["snapshot"])
        assert row["mean"] == float(stored["mean"]) and row["n"] == 12 and row["unit"] == "batch"
        assert (row["lower"], row["upper"]) == (float(stored["lower"]), float(stored["upper"]))
        assert row["step"] == 1000 + row["uniform_updates"]
        assert row["excludes_zero"] == (row["lower"] > 0 or row["upper"] < 0)
    assert rows[0]["excludes_zero"] and rows[2]["excludes_zero"]

    text = format_summary_table(rows)
    assert len(text.splitlines()) == 4 and "95% CI" in text and "s16" in text


def test_single_unit_gives_no_interval_and_excludes_nothing():
    rows = summary_table(benefit_results(np.full((1, 1, 3), 5.0)))
    assert rows[0]["n"] == 1 and math.isnan(rows[0]["lower"]) and not rows[0]["excludes_zero"]
    assert "n/a" in format_summary_table(rows)


@pytest.mark.parametrize("options", [{"level": 1.5}, {"method": "normal"}, {"n_resamples": 0}])
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        depth_averaged_benefit(benefit_results(np.zeros((1, 3, 2))), options=IntervalOptions(**options))


# --- seed-level headline, batch noise, finishing phase: hand computations -------------------

T_975_DF1 = 12.706204736174707  # scipy.stats.t.ppf(0.975, 1)
T_975_DF2 = 4.302652729749464  # scipy.stats.t.ppf(0.975, 2)


def hand_seeds() -> xr.Dataset:
    """3 seeds x 2 snapshots (0, 16 updates) x 2 batches x 2 serving depths, numbers chosen by hand.

    At the switch the depth-averaged batch means are (2, 4), (1, 3), (3, 5): seed means
    3, 2, 4. After 16 updates every seed's batch means are (+0.1, -0.1): seed means 0.
    """
    at_switch = [[[1.0, 3.0], [3.0, 5.0]], [[0.0, 2.0], [2.0, 4.0]], [[2.0, 4.0], [4.0, 6.0]]]
    after = [[[0.0, 0.2], [-0.2, 0.0]]] * 3
    benefit = np.stack([np.array(at_switch), np.array(after)], axis=1)  # [seed, snapshot, batch, depth]
    return benefit_results(benefit, uniform_updates=[0, 16], seeded=True)


def test_seed_level_interval_by_hand():
    rows = summary_table(hand_seeds())
    switch, after = rows
    assert (switch["unit"], switch["n"], switch["batches_per_seed"]) == ("seed", 3, 2)
    # Seed means 3, 2, 4: mean 3, sd 1, n 3.
    half = T_975_DF2 * 1.0 / math.sqrt(3)
    assert switch["mean"] == pytest.approx(3.0)
    assert (switch["lower"], switch["upper"]) == pytest.approx((3.0 - half, 3.0 + half), rel=1e-12)
    # Between seeds: var(3, 2, 4) = 1. Within: each seed's batch means differ by 2, s^2 = 2, / 2 batches = 1.
    assert switch["between_seed_variance"] == pytest.approx(1.0)
    assert switch["within_seed_variance"] == pytest.approx(1.0)
    # Each seed's batch interval: t(0.975, 1) * sqrt(2) / sqrt(2).
    assert switch["batch_half_width"] == pytest.approx(T_975_DF1)
    assert after["mean"] == pytest.approx(0.0) and after["between_seed_variance"] == pytest.approx(0.0)
    assert after["within_seed_variance"] == pytest.approx(0.01)
    assert after["batch_half_width"] == pytest.approx(T_975_DF1 * 0.1)


def test_batch_noise_of_one_file_has_no_seed_variance():
    noise = batch_noise(hand_seeds().isel(seed=0, drop=True))
    assert noise.attrs["seeded"] == 0
    assert float(noise["within_seed_variance"].isel(snapshot=0)) == pytest.approx(1.0)
    assert np.isnan(noise["between_seed_variance"]).all()
    rows = summary_table(hand_seeds().isel(seed=0, drop=True))
    assert rows[0]["unit"] == "batch" and rows[0]["n"] == 2 and rows[0]["between_seed_variance"] is None


def test_headline_is_labelled_with_what_it_covers():
    seeded = describe_intervals(summary_table(hand_seeds()))
    assert "over training seeds" in seeded and "n = 3 seeds" in seeded and "batch noise only" in seeded
    single = describe_intervals(summary_table(hand_seeds().isel(seed=0, drop=True)))
    assert "batch noise only" in single and "n = 2 batches" in single
    table = format_summary_table(summary_table(hand_seeds()))
    assert "var(seeds)" in table and "1.00e+00" in table


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0, 0.5, 0.04, 0.03], 8),
        ([1.0, 0.01, 0.5, 0.01], 16),  # a rebound: the first dip does not count
        ([1.0, 0.01, np.nan, 0.01], 16),  # a missing snapshot is not evidence of a decay
        ([1.0, 0.5, 0.2, 0.1], None),
        ([-1.0, -2.0, -3.0, -4.0], None),  # no positive benefit to decay from
    ],
)
def test_decay_point(values, expected):
    assert decay_point([0, 4, 8, 16], values) == expected


def test_decay_point_sorts_the_grid_and_needs_the_switch():
    assert decay_point([16, 0, 8, 4], [0.03, 1.0, 0.04, 0.5]) == 8
    assert decay_point([0, 4], [1.0, 0.2], fraction=0.25) == 4
    with pytest.raises(ValueError, match="switch"):
        decay_point([4, 8], [1.0, 0.0])


def seed_curves(curves) -> xr.Dataset:
    """Seeds whose depth-averaged benefit follows `curves` [seed][snapshot] exactly (no batch noise)."""
    curves = np.asarray(curves, dtype=float)
    benefit = np.broadcast_to(curves[:, :, None, None], curves.shape + (2, 3)).copy()
    return benefit_results(benefit, uniform_updates=[0, 4, 8, 16], seeded=True)


def test_finishing_phase_by_hand():
    phase = finishing_phase(seed_curves([[1, 0.5, 0.01, 0.01], [1, 0.01, 0.01, 0.01], [1, 0.5, 0.5, 0.01]]))
    # Seed-mean curve: 1, 0.34, 0.17, 0.01 -> below 0.05 from 16 on (the crossing lies in (8, 16]).
    assert (phase.decay_updates, phase.decay_after, phase.max_uniform_updates) == (16, 8, 16)
    assert [decay.uniform_updates for decay in phase.per_seed] == [8, 4, 16]
    assert [decay.after for decay in phase.per_seed] == [4, 0, 8]  # the crossing lies in (after, count]
    assert phase.switch.mean == pytest.approx(1.0) and phase.switch.unit == "seed"
    # After 4 updates the seeds are at 0.5, 0.01, 0.5: an interval over seeds that reaches below zero.
    assert phase.first_zero_overlap == 4
    assert (phase.zero_overlap.lower, phase.zero_overlap.upper) == pytest.approx(scipy_t([0.5, 0.01, 0.5]))
    text = format_finishing_phase(phase)
    assert "for good from: 16 uniform updates (after 8" in text
    assert "seed 0: 8, seed 1: 4, seed 2: 16" in text and "contains zero: 4 uniform updates" in text


def test_no_interval_containing_zero_within_the_grid():
    phase = finishing_phase(seed_curves([[1, 0.5, 0.2, 0.1], [1, 0.6, 0.3, 0.2], [1, 0.4, 0.25, 0.15]]))
    assert phase.first_zero_overlap is None and phase.zero_overlap is None
    assert "contains zero: none within 16" in format_finishing_phase(phase)


def test_finishing_phase_with_a_seed_that_never_crosses():
    phase = finishing_phase(seed_curves([[1, 0.5, 0.01, 0.01], [1, 0.5, 0.3, 0.2], [1, 0.01, 0.01, 0.01]]))
    assert [decay.uniform_updates for decay in phase.per_seed] == [8, None, 4]
    assert phase.per_seed[1].after is None
    assert phase.decay_updates is None
    assert "seed 1: none within 16" in format_finishing_phase(phase)


def test_the_switch_itself_is_never_the_first_interval_containing_zero():
    # A switch benefit indistinguishable from zero says nothing about how fast it decays.
    phase = finishing_phase(seed_curves([[1, 0.3, 0.2, 0.1], [-1, 0.35, 0.25, 0.12], [0.5, 0.32, 0.22, 0.11]]))
    assert phase.switch.contains_zero()
    assert phase.first_zero_overlap is None and phase.intervals_formed


def test_one_seed_forms_no_interval_and_says_so():
    phase = finishing_phase(seed_curves([[1, 0.5, 0.01, 0.01]]))
    assert not phase.intervals_formed and phase.first_zero_overlap is None
    assert "no interval could be formed" in format_finishing_phase(phase)


def test_first_snapshot_whose_seed_interval_contains_zero():
    phase = finishing_phase(hand_seeds())
    assert phase.first_zero_overlap == 16
    assert phase.zero_overlap.contains_zero() and phase.zero_overlap.n == 3
    assert phase.decay_updates == 16 and phase.decay_after == 0


def test_mixed_learning_rates_are_named_per_file():
    ds = hand_seeds()
    same = ds.assign_coords(lr=(("seed", "snapshot"), np.full((3, 2), 1e-3)))
    assert mixed_learning_rate_warning(same, ["a.h5", "b.h5", "c.h5"]) is None
    assert mixed_learning_rate_warning(ds, ["a.h5", "b.h5", "c.h5"]) is None  # no lr recorded
    mixed = ds.assign_coords(lr=(("seed", "snapshot"), [[1e-3, 1e-3], [1e-3, 1e-3], [1e-3, 5e-4]]))
    message = mixed_learning_rate_warning(mixed, ["a.h5", "b.h5", "c.h5"])
    assert message.count("\n") == 0 and "different learning rates" in message
    assert "c.h5: lr 0.001 (s0), lr 0.0005 (s16)" in message and "a.h5: lr 0.001" in message
    one_file = hand_seeds().isel(seed=0, drop=True).assign_coords(lr=("snapshot", [2e-3, 1e-3]))
    assert "only.h5: lr 0.002 (s0), lr 0.001 (s16)" in mixed_learning_rate_warning(one_file, ["only.h5"])
