"""Benefit intervals: batch-level Student-t (and BCa) intervals, checked against scipy.stats directly."""

import math
import warnings

import numpy as np
import pytest
import scipy.stats
import xarray as xr
from helpers import benefit_results, hand_seeds, scipy_t

from analysis.finishing import finishing_phase
from analysis.stats import (
    Interval,
    IntervalOptions,
    batch_noise,
    bca_interval,
    benefit_by_depth,
    depth_averaged_benefit,
    describe_intervals,
    format_monitor_summary,
    mixed_learning_rate_warning,
    monitor_benefit_map,
    monitor_depth_averaged_benefit,
    monitor_summary_table,
    per_seed_benefits,
    replication_units,
    summary_table,
    t_interval,
    trailing_mean,
)
from analysis.summary import format_summary_table, summary_text
from common.choices import RESAMPLES_RANGE


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


@pytest.mark.parametrize(
    "options", [{"level": 1.5}, {"level": 0.0}, {"level": 1.0}, {"method": "normal"}, {"n_resamples": 0}]
)
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        depth_averaged_benefit(benefit_results(np.zeros((1, 3, 2))), options=IntervalOptions(**options))


# --- seed-level headline, batch noise, finishing phase: hand computations -------------------

T_975_DF1 = 12.706204736174707  # scipy.stats.t.ppf(0.975, 1)
T_975_DF2 = 4.302652729749464  # scipy.stats.t.ppf(0.975, 2)


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


def test_a_seed_dimension_of_another_name_is_honoured():
    ds = hand_seeds().rename(seed="run")
    switch, after = summary_table(ds, seed_dim="run")
    assert (switch["unit"], switch["n"], switch["mean"], switch["batches_per_seed"]) == ("run", 3, 3.0, 2)
    half = T_975_DF2 / math.sqrt(3)  # seed means 3, 2, 4
    assert (switch["lower"], switch["upper"]) == pytest.approx((3.0 - half, 3.0 + half), rel=1e-12)
    assert (switch["between_seed_variance"], switch["within_seed_variance"]) == pytest.approx((1.0, 1.0))
    by_depth = benefit_by_depth(ds, seed_dim="run")
    assert by_depth.attrs["unit"] == "run" and (by_depth["n"].values == 3).all()
    phase = finishing_phase(ds, seed_dim="run")
    assert [decay.seed for decay in phase.per_seed] == [0, 1, 2] and phase.switch.n == 3


def test_the_summary_rows_use_the_requested_level_for_both_intervals():
    switch, _ = summary_table(hand_seeds(), options=IntervalOptions(level=0.9))
    # Seed means 3, 2, 4 (s = 1); each seed's two batch means differ by 2 (s = sqrt(2)).
    assert switch["lower"] == pytest.approx(3.0 - scipy.stats.t.ppf(0.95, 2) / math.sqrt(3), rel=1e-12)
    assert switch["batch_half_width"] == pytest.approx(scipy.stats.t.ppf(0.95, 1), rel=1e-12)


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


# --- intervals: defaults, edges and precision, against scipy and by hand ----------------------


def test_two_values_form_a_95_percent_interval_by_default():
    # 1 and 3: mean 2, s = sqrt(2), half-width t(0.975, 1) * sqrt(2) / sqrt(2).
    assert t_interval(np.array([1.0, 3.0])) == pytest.approx((2.0, 2.0 - T_975_DF1, 2.0 + T_975_DF1, 2), rel=1e-12)


def test_float32_values_are_averaged_in_float64():
    # A results file may hold float32; its interval must not carry float32 rounding.
    values32 = np.random.default_rng(8).normal(0.1, 1.0, 1000).astype(np.float32)
    values64 = values32.astype(np.float64)
    mean, lower, upper, n = t_interval(values32)
    assert n == 1000 and mean == pytest.approx(values64.mean(), rel=1e-12)
    assert (lower, upper) == pytest.approx(scipy_t(values64), rel=1e-12)


def test_no_finite_value_and_constant_values_give_nan_bounds_without_warnings():
    # These are expected inputs (a unit never evaluated, a benefit identical in every batch), not errors.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        empty = t_interval(np.array([np.nan, np.nan]))
        constant = bca_interval(np.full(4, 7.0))
    assert empty[3] == 0 and all(math.isnan(value) for value in empty[:3])
    assert (constant[0], constant[3]) == (7.0, 4) and math.isnan(constant[1]) and math.isnan(constant[2])


def test_bca_defaults_are_scipys_95_percent_and_9999_resamples_seeded_with_zero():
    values = np.random.default_rng(9).normal(0.2, 1.0, 10)
    reference = scipy.stats.bootstrap((values,), np.mean, method="BCa", rng=np.random.default_rng(0))
    mean, lower, upper, n = bca_interval(values)
    assert (mean, n) == (pytest.approx(values.mean()), 10)
    low, high = reference.confidence_interval
    assert (lower, upper) == pytest.approx((low, high), rel=1e-12)


def test_bca_forms_an_interval_from_three_values_at_the_requested_level():
    values = np.array([0.1, 0.5, 1.3])
    reference = scipy.stats.bootstrap(
        (values,), np.mean, confidence_level=0.9, n_resamples=999, method="BCa", rng=np.random.default_rng(3)
    ).confidence_interval
    assert bca_interval(values, 0.9, n_resamples=999, seed=3) == pytest.approx(
        (values.mean(), reference.low, reference.high, 3), rel=1e-12
    )
    assert math.isnan(bca_interval(values[:2])[1])  # two values: no bootstrap interval


def test_bca_options_reach_the_bootstrap():
    rng = np.random.default_rng(10)
    benefit = correlated_benefit(rng, 1, 9, 3, means=[0.3])
    options = IntervalOptions(level=0.8, method="bca", n_resamples=500, seed=5)
    row = depth_averaged_benefit(benefit_results(benefit), options=options).isel(snapshot=0)
    reference = scipy.stats.bootstrap(
        (benefit[0].mean(axis=1),),
        np.mean,
        confidence_level=0.8,
        n_resamples=500,
        method="BCa",
        rng=np.random.default_rng(5),
    ).confidence_interval
    assert (float(row["lower"]), float(row["upper"])) == pytest.approx((reference.low, reference.high), rel=1e-12)


def test_the_extreme_valid_options_are_accepted():
    assert IntervalOptions(level=0.01, n_resamples=RESAMPLES_RANGE[0]).n_resamples == RESAMPLES_RANGE[0]
    assert IntervalOptions(n_resamples=RESAMPLES_RANGE[1]).n_resamples == RESAMPLES_RANGE[1]
    assert IntervalOptions(level=0.999).level == 0.999


def test_replication_units_are_per_seed_batch_means_or_the_batches_themselves():
    ds = hand_seeds()
    units, dim = replication_units(ds["benefit"])
    assert dim == "seed" and set(units.dims) == {"seed", "snapshot", "serving_depth"}
    np.testing.assert_allclose(
        units.transpose("seed", "snapshot", "serving_depth").values, ds["benefit"].values.mean(2)
    )
    single = ds.isel(seed=0, drop=True)["benefit"]
    units, dim = replication_units(single)
    assert dim == "batch" and units.identical(single)


def test_intervals_name_the_reference_and_the_compared_update_depth():
    # The benefit is the first update depth's NLL minus the last one's, whatever their order.
    ds = benefit_results(np.ones((1, 3, 2)), update_depths=(4, 1, 16))
    expected = {"level": 0.95, "method": "t", "unit": "batch", "reference_depth": 4, "compared_depth": 16}
    assert depth_averaged_benefit(ds).attrs == expected
    assert benefit_by_depth(ds).attrs == expected
    assert depth_averaged_benefit(ds.drop_vars("update_depth")).attrs == {"level": 0.95, "method": "t", "unit": "batch"}


def test_batch_noise_with_two_seeds_and_a_lost_batch_by_hand():
    # 2 seeds x 2 snapshots x 3 batches, one serving depth; seed 1 lost its third batch at 8 updates.
    benefit = np.array([[[1.0, 2.0, 3.0], [0.0, 0.0, 3.0]], [[2.0, 4.0, 6.0], [1.0, 3.0, np.nan]]])[..., None]
    noise = batch_noise(benefit_results(benefit, uniform_updates=[0, 8], seeded=True), options=IntervalOptions(0.9))
    assert noise.attrs == {"level": 0.9, "method": "t", "seeded": 1}
    t2, t1 = scipy.stats.t.ppf(0.95, 2), scipy.stats.t.ppf(0.95, 1)
    # At the switch: seed means 2 and 4 (variance 2); s^2 / n = 1/3 and 4/3; half-widths t2 * s / sqrt(3).
    # After 8 updates: seed means 1 and 2 (variance 0.5); s^2 / n = 3/3 and 2/2; half-widths t2 * 1, t1 * 1.
    np.testing.assert_allclose(noise["between_seed_variance"].values, [2.0, 0.5])
    np.testing.assert_allclose(noise["within_seed_variance"].values, [5 / 6, 1.0])
    np.testing.assert_allclose(noise["batch_half_width"].values, [t2 * 1.5 / math.sqrt(3), (t2 + t1) / 2])
    assert noise["batches_per_seed"].values.tolist() == [3, 2]


def test_batch_noise_of_one_file_carries_no_seed():
    noise = batch_noise(hand_seeds().isel(seed=0, drop=True))
    assert "seed" not in noise.coords and "seed" not in noise.dims


def test_an_interval_that_touches_zero_does_not_exclude_it():
    # Every batch exactly 0: the interval is [0, 0], which contains zero.
    (row,) = summary_table(benefit_results(np.zeros((1, 3, 2))))
    assert (row["lower"], row["upper"]) == (0.0, 0.0) and not row["excludes_zero"]
    switch, after = summary_table(hand_seeds())
    assert 0 < switch["lower"] < 1 and switch["excludes_zero"]  # 3 +- 2.48 lies above zero
    assert (after["lower"], after["upper"]) == (0.0, 0.0) and not after["excludes_zero"]


# --- what the summary prints, written out by hand ------------------------------------------------


def test_the_headline_description_in_full():
    seeded = describe_intervals(summary_table(hand_seeds()))
    assert seeded == (
        "headline: 95% Student-t CI over training seeds (per-seed means of batch means), n = 3 seeds\n"
        "secondary: within-seed 95% CI over batches (batch noise only), shown as its mean half-width over seeds; "
        "var(seeds) = variance of the seed means, "
        "var(batches) = mean s^2_batch / n_batch (batch noise in one seed mean)"
    )
    (one_snapshot,) = summary_table(hand_seeds().isel(snapshot=[0]))
    assert describe_intervals([one_snapshot]).startswith("headline: 95% Student-t CI over training seeds")
    rows = [{"unit": "batch", "n": 4}, {"unit": "batch", "n": 2}, {"unit": "batch", "n": 3}]
    assert describe_intervals(rows, level=0.9, method="bca") == (
        "headline: 90% BCa bootstrap CI over batches of one seed: batch noise only, not seed-to-seed variation, "
        "n = 2-4 batches; diagnose several seeds for the interval a replication would fall in"
    )


def test_no_rows_are_described_in_one_line():
    # summary_text puts the description above the table, which without rows is its header alone.
    assert describe_intervals([]) == "headline: none (no snapshots to summarise)"
    assert summary_text([], None, IntervalOptions()).splitlines()[0] == "headline: none (no snapshots to summarise)"


def test_the_summary_table_in_full():
    rows = [
        {"snapshot": "u0000", "uniform_updates": 0, "step": 1000, "mean": 0.25, "lower": 0.125, "upper": 0.375}
        | {"n": 12, "unit": "batch", "excludes_zero": True},
        {"snapshot": "u0016", "uniform_updates": 16, "step": 1016, "mean": -1.5, "lower": math.nan}
        | {"upper": math.nan, "n": 1, "unit": "batch", "excludes_zero": False},
    ]
    assert format_summary_table(rows).splitlines() == [
        "snapshot  uniform updates  step  mean benefit               95% CI           n  CI excludes 0",
        "   u0000                0  1000       +0.2500   [+0.1250, +0.3750]  12 batches            yes",
        "   u0016               16  1016       -1.5000  n/a (too few units)     1 batch             no",
    ]
    seeded = [
        {"snapshot": "u0000", "uniform_updates": 0, "step": 1000, "mean": 3.0, "lower": 0.5, "upper": 5.5}
        | {"n": 3, "unit": "seed", "excludes_zero": True, "batch_half_width": 12.70620}
        | {"batches_per_seed": 2, "between_seed_variance": 1.0, "within_seed_variance": 0.00125},
    ]
    assert format_summary_table(seeded, level=0.9).splitlines() == [
        "snapshot  uniform updates  step  mean benefit              90% CI        n  CI excludes 0"
        "  batch CI ±  batches/seed  var(seeds)  var(batches)",
        "   u0000                0  1000       +3.0000  [+0.5000, +5.5000]  3 seeds            yes"
        "     12.7062             2    1.00e+00      1.25e-03",
    ]


def test_an_interval_in_words():
    assert Interval(0.25, 0.125, 0.375, 4, "batch").describe() == "+0.2500 [+0.1250, +0.3750] over 4 batches"
    assert Interval(-2.0, math.nan, math.nan, 1, "seed").describe() == "-2.0000 n/a (too few units) over 1 seed"


def test_an_interval_contains_zero_up_to_and_including_its_bounds():
    assert Interval(0.5, 0.0, 1.0, 3, "seed").contains_zero()
    assert Interval(-0.5, -1.0, 0.0, 3, "seed").contains_zero()
    assert not Interval(0.8, 0.2, 1.5, 3, "seed").contains_zero()
    assert not Interval(-0.8, -1.5, -0.2, 3, "seed").contains_zero()
    assert not Interval(1.0, math.nan, math.nan, 1, "seed").contains_zero()


def test_mixed_learning_rate_message_in_full():
    ds = benefit_results(np.zeros((2, 3, 2, 2)), uniform_updates=[0, 4, 8], seeded=True)
    mixed = ds.assign_coords(lr=(("seed", "snapshot"), [[1e-3, 1e-3, 1e-3], [1e-3, 5e-4, 5e-4]]))
    assert mixed_learning_rate_warning(mixed, ["a.h5", "b.h5"]) == (
        "snapshots were diagnosed at different learning rates: a.h5: lr 0.001; b.h5: lr 0.001 (s0), lr 0.0005 (s4 s8)"
    )
    # One snapshot per file, a different rate in each.
    ds = benefit_results(np.zeros((2, 1, 2, 2)), seeded=True)
    one_each = ds.assign_coords(lr=(("seed", "snapshot"), [[1e-3], [2e-3]]))
    assert mixed_learning_rate_warning(one_each, ["a.h5", "b.h5"]) == (
        "snapshots were diagnosed at different learning rates: a.h5: lr 0.001; b.h5: lr 0.002"
    )


# --- decay point and finishing phase: edges by hand ----------------------------------------------


def test_trailing_mean_of_a_window_without_values_is_nan_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        smoothed = trailing_mean([np.nan, np.nan, 1.0], 2)
    np.testing.assert_array_equal(smoothed, [np.nan, np.nan, 1.0])


def test_trailing_mean_of_float32_losses_is_computed_in_float64():
    values = np.random.default_rng(11).normal(3.0, 0.5, 1000).astype(np.float32)
    exact = values.astype(np.float64)
    expected = [exact[max(0, i - 9) : i + 1].mean() for i in range(exact.size)]
    np.testing.assert_allclose(trailing_mean(values, 10), expected, rtol=1e-10)


# --- the in-training monitor's numbers and summary ----------------------------------------------


def monitor_results(benefit: np.ndarray, steps=(2, 4, 6), **attrs) -> xr.Dataset:
    """A monitor Dataset around `benefit` [step, batch, serving depth], lr 1e-3 halved at each check."""
    lr = 1e-3 / 2 ** np.arange(len(steps))
    return xr.Dataset(
        {
            "benefit": (("step", "batch", "serving_depth"), benefit, {"long_name": "benefit", "units": "nats"}),
            "lr": (("step",), lr),
        },
        coords={
            "step": list(steps),
            "batch": np.arange(benefit.shape[1]),
            "serving_depth": np.arange(1, benefit.shape[2] + 1),
            "update_depth": [4, 16],
        },
        attrs=attrs,
    )


def test_monitor_rows_by_hand():
    # Depth-averaged batch means per check: (2, 3, 4), (-1, 0, 1), (0, 0, 0).
    means = np.array([[2.0, 3.0, 4.0], [-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    benefit = means[..., None] + np.array([-0.5, 0.5])
    ds = monitor_results(benefit, switch_step=4)
    rows = monitor_summary_table(ds)
    assert [(row["step"], row["phase"], row["lr"], row["unit"], row["n"]) for row in rows] == [
        (2, "fixed", 1e-3, "batch", 3),
        (4, "switch", 5e-4, "batch", 3),
        (6, "finish", 2.5e-4, "batch", 3),
    ]
    half = T_975_DF2 / math.sqrt(3)  # s = 1 for the first two checks
    np.testing.assert_allclose(
        [(row["mean"], row["lower"], row["upper"]) for row in rows],
        [(3.0, 3.0 - half, 3.0 + half), (0.0, -half, half), (0.0, 0.0, 0.0)],
        rtol=1e-12,
        atol=1e-15,
    )
    assert [row["excludes_zero"] for row in rows] == [True, False, False]
    t_90 = scipy.stats.t.ppf(0.95, 2)
    at_90 = monitor_depth_averaged_benefit(ds, options=IntervalOptions(level=0.9))
    assert float(at_90["lower"][0]) == pytest.approx(3.0 - t_90 / math.sqrt(3), rel=1e-12)
    rows_90 = monitor_summary_table(ds, options=IntervalOptions(level=0.9))
    assert rows_90[0]["upper"] == pytest.approx(3.0 + t_90 / math.sqrt(3), rel=1e-12)
    assert monitor_depth_averaged_benefit(ds).attrs == {
        "level": 0.95,
        "method": "t",
        "unit": "batch",
        "reference_depth": 4,
        "compared_depth": 16,
    }


def test_monitor_phases_without_a_switch_and_with_a_switch_at_step_zero():
    benefit = np.zeros((3, 2, 2))
    assert [row["phase"] for row in monitor_summary_table(monitor_results(benefit))] == ["", "", ""]
    assert [row["phase"] for row in monitor_summary_table(monitor_results(benefit, switch_step=-1))] == ["", "", ""]
    # A schedule that switches at step 0: every check lies in the finishing phase.
    at_zero = monitor_results(benefit, switch_step=0)
    assert [row["phase"] for row in monitor_summary_table(at_zero)] == ["finish", "finish", "finish"]


def test_monitor_map_skips_missing_batches_and_keeps_the_description():
    benefit = np.arange(12.0).reshape(2, 3, 2)
    benefit[1, 0, :] = np.nan  # the first batch of the second check was never evaluated
    heat = monitor_benefit_map(monitor_results(benefit, steps=(3, 6)))
    assert heat.dims == ("step", "serving_depth") and heat.attrs == {"long_name": "benefit", "units": "nats"}
    np.testing.assert_array_equal(heat.values, [[2.0, 3.0], [9.0, 10.0]])


def test_the_monitor_summary_in_full():
    rows = [
        {"step": 3, "phase": "fixed", "lr": 1e-3, "mean": 0.5, "lower": 0.25, "upper": 0.75, "n": 3}
        | {"excludes_zero": True},
        {"step": 12, "phase": "", "lr": 2.5e-4, "mean": -0.125, "lower": math.nan, "upper": math.nan, "n": 1}
        | {"excludes_zero": False},
        {"step": 15, "phase": "finish", "lr": 1e-4, "mean": 0.0, "lower": -0.5, "upper": 0.5, "n": 2}
        | {"excludes_zero": False},
    ]
    assert format_monitor_summary(rows, level=0.9, method="bca").splitlines() == [
        "monitor: depth-averaged benefit per step; 90% BCa bootstrap CI over the check's batches of one run "
        "(n = 1-3): batch noise only, not run-to-run variation",
        "step   phase       lr  mean benefit               90% CI          n  CI excludes 0",
        "   3   fixed    0.001       +0.5000   [+0.2500, +0.7500]  3 batches            yes",
        "  12       -  0.00025       -0.1250  n/a (too few units)    1 batch             no",
        "  15  finish   0.0001       +0.0000   [-0.5000, +0.5000]  2 batches             no",
    ]
    assert "of one run (n = 3): batch noise only" in format_monitor_summary(rows[:1])
    assert format_monitor_summary([]).splitlines()[0] == (
        "monitor: depth-averaged benefit per step; 95% Student-t CI over the check's batches of one run "
        "(n = 0): batch noise only, not run-to-run variation"
    )


def test_per_seed_benefits_are_each_seeds_batches_at_the_level_asked():
    """summarize --json's per-seed rows: each seed's batch means (depth-averaged) and their
    interval at the options' level, by hand on hand_seeds(); None without seeds."""
    ds = hand_seeds()
    for level in (0.95, 0.8):
        rows = per_seed_benefits(ds, options=IntervalOptions(level=level))
        assert list(rows) == ["s0", "s16"]
        for seed, batch_means in enumerate([(2.0, 4.0), (1.0, 3.0), (3.0, 5.0)]):
            row = rows["s0"][seed]
            assert (row["seed"], row["n"], row["mean"]) == (seed, 2, pytest.approx(np.mean(batch_means)))
            assert (row["lower"], row["upper"]) == pytest.approx(scipy_t(batch_means, level))
        assert [row["mean"] for row in rows["s16"]] == pytest.approx([0.0] * 3)
    assert per_seed_benefits(benefit_results(np.ones((1, 2, 2)))) is None
