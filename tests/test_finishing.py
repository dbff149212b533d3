"""The finishing phase: where the benefit decays below a fraction of its switch value (per seed,
for the seed mean, its spread over resampled seeds), the equivalence bound that shows it below,
and the first interval containing zero; checked by hand and against scipy."""

import json
import math

import numpy as np
import pytest
import scipy.stats
import xarray as xr
from helpers import benefit_results, hand_seeds, scipy_t

from analysis.finishing import (
    FinishingPhase,
    SeedDecay,
    decay_point,
    decay_spread,
    equivalence_bounds,
    finishing_phase,
    format_finishing_phase,
    with_equivalence,
)
from analysis.stats import Interval, IntervalOptions, summary_table


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


def test_finishing_phase_takes_its_fraction_and_level():
    curves = [[1, 0.5, 0.01, 0.01], [1, 0.01, 0.01, 0.01], [1, 0.5, 0.5, 0.01]]
    # Seed-mean curve 1, 0.34, 0.17, 0.01: below 0.6 from 4 on, and so is every seed's own curve.
    loose = finishing_phase(seed_curves(curves), fraction=0.6)
    assert loose.fraction == 0.6 and loose.decay_updates == 4
    assert [decay.uniform_updates for decay in loose.per_seed] == [4, 4, 4]
    # At the 50% level the seeds' interval after 4 updates (0.5, 0.01, 0.5) no longer reaches zero, nor does any
    # later one: [0.01, 0.01, 0.5] after 8, three equal seeds after 16.
    narrow = finishing_phase(seed_curves(curves), options=IntervalOptions(level=0.5))
    after_four = scipy_t([0.5, 0.01, 0.5], level=0.5)
    assert after_four[0] > 0 and narrow.first_zero_overlap is None
    assert (narrow.switch.lower, narrow.switch.upper) == pytest.approx((1.0, 1.0))


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


def test_decay_point_edges():
    assert decay_point([0, 4, 8], [2.0, 0.09, 0.09]) == 4  # 5% of a switch benefit of 2 is 0.1
    assert decay_point([0, 4], [0.5, 0.01]) == 4  # a switch benefit below 1 decays like any other
    assert decay_point([0, 4], [0.0, -1.0]) is None  # a zero switch benefit has nothing to decay
    assert decay_point([0, 4], [1.0, 0.25], fraction=0.25) is None  # exactly the fraction is not below it
    with pytest.raises(ValueError, match="switch"):
        decay_point([], [])
    # A float32 seed curve (a float32 file): 0.03217036649584770 lies below 5% of 0.6434073448181152
    # (0.03217036724...), though float32 arithmetic would round that threshold down onto the value itself.
    assert decay_point([0, 4], np.array([0.6434073448181152, 0.0321703664958477], dtype=np.float32)) == 4


def test_per_seed_switch_values_and_the_phase_as_json():
    phase = finishing_phase(seed_curves([[2.0, 0.05, 0.01, 0.01], [1.0, 0.5, 0.01, 0.01]]))
    assert phase.per_seed == (SeedDecay(0, 2.0, 4, 0), SeedDecay(1, 1.0, 8, 4))
    as_dict = json.loads(json.dumps(phase.to_dict()))
    assert as_dict["per_seed"][0] == {"seed": 0, "switch_value": 2.0, "uniform_updates": 4, "after": 0}
    assert as_dict["switch"]["mean"] == pytest.approx(1.5) and as_dict["decay_updates"] == 8


def phase_of(switch: Interval, **fields) -> FinishingPhase:
    """A FinishingPhase over a grid ending at 16 updates, with nothing found unless `fields` say so."""
    defaults = {"fraction": 0.05, "level": 0.95, "max_uniform_updates": 16, "decay_updates": None, "decay_after": None}
    defaults |= {"decay_spread": None, "resamples": 9999, "per_seed": (), "bound_updates": None}
    defaults |= {"first_zero_overlap": None, "zero_overlap": None, "intervals_formed": True}
    return FinishingPhase(switch=switch, **(defaults | fields))


def test_finishing_phase_lines_in_full():
    phase = finishing_phase(seed_curves([[1, 0.5, 0.01, 0.01], [1, 0.01, 0.01, 0.01], [1, 0.5, 0.5, 0.01]]))
    lower, upper = scipy_t([0.5, 0.01, 0.5])  # the seeds after 4 updates
    assert format_finishing_phase(phase).splitlines() == [
        "finishing phase: switch benefit +1.0000 [+1.0000, +1.0000] over 3 seeds; "
        "mean benefit below 5% of it for good from: 16 uniform updates (after 8; the grid brackets the crossing)",
        "  per seed: seed 0: 8, seed 1: 4, seed 2: 16; range 4-16 (each crossing lies between its grid count and "
        "the one before)",
        # Resampled seed means cross at 4 only when every draw is seed 1 (1/27 = 3.7% > 2.5%), at 16
        # whenever seed 2 is drawn (19/27).
        "  over seeds: 95% of the seed-mean crossings over 9999 resamples of the 3 seeds lie from 4 to 16 uniform "
        "updates",
        # Every seed's margin b(16) - 0.05 b(0) is -0.04; after 8 seed 2's is +0.45.
        "finishing phase: shown below 5% of the switch benefit for good (one-sided 95% bound over seeds of "
        "benefit - 5% x switch benefit, paired by seed) from: 16 uniform updates",
        f"finishing phase: first snapshot whose 95% CI contains zero: 4 uniform updates, benefit +0.3367 "
        f"[{lower:+.4f}, {upper:+.4f}] over 3 seeds",
    ]
    never = phase_of(Interval(0.5, 0.25, 0.75, 2, "seed"), level=0.9, per_seed=(SeedDecay(0, 0.4, None, None),) * 2)
    assert format_finishing_phase(never).splitlines() == [
        "finishing phase: switch benefit +0.5000 [+0.2500, +0.7500] over 2 seeds; "
        "mean benefit below 5% of it for good from: none within 16",
        "  per seed: seed 0: none within 16, seed 0: none within 16 (each crossing lies between its grid count and "
        "the one before)",
        "finishing phase: shown below 5% of the switch benefit for good (one-sided 90% bound over seeds of "
        "benefit - 5% x switch benefit, paired by seed) from: none within 16",
        "finishing phase: first snapshot whose 90% CI contains zero: none within 16",
    ]


def test_a_switch_benefit_that_is_not_positive_is_named_as_the_reason():
    for mean in (0.0, -0.5):
        text = format_finishing_phase(phase_of(Interval(mean, -1.0, 1.0, 4, "batch"), intervals_formed=False))
        assert text.splitlines()[0].endswith("for good from: none within 16 (the switch benefit is not positive)")
        assert text.splitlines()[1] == (
            "finishing phase: first snapshot whose 95% CI contains zero: "
            "n/a (no interval could be formed: fewer than two units)"
        )


# --- the equivalence bound and the crossing's spread over seeds -------------------------------


def random_seed_curves(rng, seeds=6) -> tuple[np.ndarray, xr.Dataset]:
    """Seed curves over 0, 4, 8, 16 uniform updates, each seed's switch value its own (so that
    pairing by seed matters), with batch noise on top; the per-seed means and the Dataset."""
    switch = rng.uniform(0.5, 1.5, seeds)
    later = rng.normal(0.03, 0.02, (seeds, 3))
    curves = np.concatenate([switch[:, None], later], axis=1)
    noise = rng.normal(0.0, 0.01, (seeds, 4, 3, 2))
    noise -= noise.mean(axis=(2, 3), keepdims=True)  # each seed's mean stays its curve
    return curves, benefit_results(curves[:, :, None, None] + noise, uniform_updates=[0, 4, 8, 16], seeded=True)


def test_the_equivalence_bound_is_scipys_one_sided_t_bound_of_the_paired_margins():
    curves, ds = random_seed_curves(np.random.default_rng(3))
    bounds = equivalence_bounds(ds, fraction=0.05)
    for index in (1, 2, 3):
        margins = curves[:, index] - 0.05 * curves[:, 0]
        upper = margins.mean() + scipy.stats.t.ppf(0.95, len(margins) - 1) * scipy.stats.sem(margins)
        assert float(bounds["margin"][index]) == pytest.approx(margins.mean(), rel=1e-9)
        assert float(bounds["margin_upper"][index]) == pytest.approx(upper, rel=1e-9)
        assert bool(bounds["below"][index]) == (upper < 0)
        assert int(bounds["n"][index]) == len(margins)
    # At the switch there is nothing to bound.
    assert math.isnan(float(bounds["margin_upper"][0])) and not bool(bounds["below"][0])


def test_the_equivalence_bound_takes_its_fraction_level_and_method():
    curves, ds = random_seed_curves(np.random.default_rng(4))
    margins = curves[:, 3] - 0.2 * curves[:, 0]
    loose = equivalence_bounds(ds, fraction=0.2, options=IntervalOptions(level=0.9))
    upper = margins.mean() + scipy.stats.t.ppf(0.9, len(margins) - 1) * scipy.stats.sem(margins)
    assert float(loose["margin_upper"][3]) == pytest.approx(upper, rel=1e-9)
    bca = equivalence_bounds(ds, fraction=0.2, options=IntervalOptions(method="bca", n_resamples=999, seed=2))
    # BCa counts resampled means below the observed one, so it is fed the very margins the Dataset
    # gives (their means are the curves' to 1e-17, which is enough to move a tie).
    seed_means = ds["benefit"].mean("serving_depth").mean("batch").values
    margins = seed_means[:, 3] - 0.2 * seed_means[:, 0]
    expected = scipy.stats.bootstrap(
        (margins,), np.mean, confidence_level=0.9, n_resamples=999, method="BCa", rng=np.random.default_rng(2)
    )
    assert float(bca["margin_upper"][3]) == pytest.approx(expected.confidence_interval.high, rel=1e-9)


def test_one_file_forms_no_equivalence_bound():
    bounds = equivalence_bounds(hand_seeds().isel(seed=0, drop=True))
    assert np.isnan(bounds["margin_upper"].values).all() and not bounds["below"].values.any()
    with pytest.raises(Exception, match="no snapshot at the switch"):
        equivalence_bounds(hand_seeds().isel(snapshot=[1]))


def test_the_summary_rows_carry_the_equivalence_verdict():
    ds = hand_seeds()  # seed means 3, 2, 4 at the switch, 0 after 16: margins -0.15, -0.1, -0.2
    switch, after = with_equivalence(summary_table(ds), ds)
    assert switch["shown_below_fraction"] is None and switch["margin_upper"] is None
    margins = np.array([-0.15, -0.1, -0.2])
    upper = margins.mean() + scipy.stats.t.ppf(0.95, 2) * scipy.stats.sem(margins)
    assert after["margin_upper"] == pytest.approx(upper) and after["shown_below_fraction"] is bool(upper < 0)


def exact_crossing_distribution(curves: list[list[float]], counts: list[int]) -> dict:
    """The decay point of the mean of every equally likely draw of len(curves) seeds with
    replacement, and its probability: what the bootstrap samples from."""
    import itertools

    curves = np.asarray(curves, dtype=float)
    draws = list(itertools.product(range(len(curves)), repeat=len(curves)))
    found: dict = {}
    for draw in draws:
        crossing = decay_point(counts, curves[list(draw)].mean(axis=0))
        found[crossing] = found.get(crossing, 0) + 1 / len(draws)
    return found


@pytest.mark.parametrize(
    ("curves", "expected"),
    [
        # The mean crosses at 4 only when every draw is seed 1: 1/27 = 3.7% of draws, more than 2.5%.
        ([[1, 0.5, 0.01, 0.01], [1, 0.01, 0.01, 0.01], [1, 0.5, 0.5, 0.01]], (4, 16)),
        # With four seeds that is 1/256 < 2.5%: the range starts at 8.
        ([[1, 0.5, 0.01, 0.01], [1, 0.01, 0.01, 0.01], [1, 0.5, 0.5, 0.01], [1, 0.5, 0.01, 0.01]], (8, 16)),
        # A seed that never settles drags every draw that holds it past the grid: None.
        ([[1, 0.5, 0.01, 0.01], [1, 0.01, 0.01, 0.01], [1, 0.5, 0.5, 0.5]], (4, None)),
    ],
)
def test_the_crossings_spread_over_seeds_follows_the_exact_resampling_distribution(curves, expected):
    counts = [0, 4, 8, 16]
    exact = exact_crossing_distribution(curves, counts)
    order = sorted(exact, key=lambda c: math.inf if c is None else c)
    cumulative = np.cumsum([exact[c] for c in order])
    # The 2.5% and 97.5% points of the exact distribution, which 9999 resamples find.
    assert (order[int(np.searchsorted(cumulative, 0.025))], order[int(np.searchsorted(cumulative, 0.975))]) == expected
    assert decay_spread(counts, np.asarray(curves, dtype=float), fraction=0.05, options=IntervalOptions()) == expected


def test_the_spread_is_reproducible_and_reaches_the_phase():
    curves = [[1, 0.5, 0.01, 0.01], [1, 0.01, 0.01, 0.01], [1, 0.5, 0.5, 0.01]]
    phase = finishing_phase(seed_curves(curves))
    assert phase.decay_spread == (4, 16) and phase.resamples == 9999 and phase.level == 0.95
    assert phase.bound_updates == 16  # every seed's margin after 16 updates is 0.01 - 0.05
    as_dict = json.loads(json.dumps(phase.to_dict()))
    assert as_dict["decay_spread"] == [4, 16] and as_dict["bound_updates"] == 16


def test_the_bound_must_hold_for_good():
    # After 4 updates every seed is far below 5% of its switch value, after 8 one seed rebounds.
    curves = [[1, 0.0, 0.01, 0.0], [1, 0.0, 0.02, 0.0], [1, 0.0, 0.4, 0.0]]
    phase = finishing_phase(seed_curves(curves))
    assert phase.bound_updates == 16
    assert "paired by seed) from: 16 uniform updates" in format_finishing_phase(phase)


def test_a_one_sided_bound_below_the_median_and_bcas_refusal():
    curves, ds = random_seed_curves(np.random.default_rng(5))
    margins = curves[:, 2] - 0.05 * curves[:, 0]
    low = equivalence_bounds(ds, options=IntervalOptions(level=0.4))
    expected = margins.mean() + scipy.stats.t.ppf(0.4, len(margins) - 1) * scipy.stats.sem(margins)
    assert float(low["margin_upper"][2]) == pytest.approx(expected, rel=1e-9) and expected < margins.mean()
    with pytest.raises(Exception, match="a one-sided BCa bound needs a level above 0.5"):
        equivalence_bounds(ds, options=IntervalOptions(level=0.4, method="bca"))


# --- every setting reaches the arithmetic, and the edges of the resampled spread ----------------


def decaying_seeds(rng, seeds=5, counts=(0, 4, 8, 16, 24, 32, 48, 64, 96, 128)) -> np.ndarray:
    """Seed curves [seeds, counts] that decay geometrically at rates of their own, so that their
    crossings of 5% of the switch value, and those of resampled means, spread over the grid."""
    switch = rng.uniform(0.8, 1.2, seeds)
    rates = rng.uniform(0.02, 0.3, seeds)
    return switch[:, None] * np.exp(-rates[:, None] * np.asarray(counts, dtype=float)[None, :])


@pytest.mark.parametrize(
    ("level", "resamples", "seed"),
    [
        (0.5, 101, 1),
        (0.6, 127, 5),
        (0.8, 103, 2),
        (0.9, 150, 3),
        (0.95, 100, 4),
        # where the ends' positions fall between two different crossings (found by a search)
        (0.5, 103, 1),
        (0.5, 100, 11),
        (0.5, 101, 11),
    ],
)
def test_the_spread_is_the_lower_and_higher_quantile_of_the_resampled_crossings(level, resamples, seed):
    counts = [0, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    curves = decaying_seeds(np.random.default_rng(seed), counts=counts)
    # By the definition: resample seeds with replacement (the options' seed), take each mean curve's
    # decay point (None past the grid), and read the range's ends off the sorted points.
    draws = np.random.default_rng(seed).integers(0, len(curves), size=(resamples, len(curves)))
    grid = [*counts, None]
    crossings = [grid.index(decay_point(counts, curves[draw].mean(axis=0))) for draw in draws]
    tail = (1 - level) / 2
    expected = (
        grid[int(np.quantile(crossings, tail, method="lower"))],
        grid[int(np.quantile(crossings, 1 - tail, method="higher"))],
    )
    assert len(set(crossings)) >= 3  # the draws disagree, so the range's ends are read, not given
    options = IntervalOptions(level=level, n_resamples=resamples, seed=seed)
    assert decay_spread(counts, curves, fraction=0.05, options=options) == expected


@pytest.mark.parametrize(
    ("curve", "expected"),
    [
        ([1.0, 0.05, 0.05], None),  # exactly 5% of the switch value is not below it
        ([2.0, 0.05, 0.05], 4),  # 5% of the switch value, not 5% divided by it
        ([0.0, -1.0, -1.0], None),  # no positive switch benefit to decay from
        ([1.0, 0.5, 0.01], 8),
    ],
)
def test_one_seeds_spread_is_its_own_decay_point(curve, expected):
    assert decay_point([0, 4, 8], curve) == expected
    options = IntervalOptions(n_resamples=100)
    assert decay_spread([0, 4, 8], np.array([curve]), fraction=0.05, options=options) == (expected, expected)


def test_decay_indices_keep_each_row_its_own():
    counts = [0, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    curves = decaying_seeds(np.random.default_rng(9), seeds=6, counts=counts)
    points = [decay_point(counts, row) for row in curves]
    assert len(set(points)) >= 3
    # One seed at a time, and the seeds in one call: the rows are not mixed.
    for row, point in zip(curves, points):
        assert decay_spread(counts, row[None, :], fraction=0.05, options=IntervalOptions(n_resamples=100)) == (
            point,
            point,
        )
    from analysis.finishing import _decay_indices

    grid = [*counts, None]
    assert [grid[i] for i in _decay_indices(curves, 0.05)] == points


def test_the_phase_and_the_summary_rows_take_their_fraction_level_and_seed_dimension():
    # Every seed below 20% of its switch value from 4 on, but not below 5% until 16; after 4 the
    # margins spread so that the one-sided bound is below 0 at level 0.8, not at 0.95.
    curves = [[1.0, 0.1, 0.12, 0.01], [1.0, 0.19, 0.1, 0.0], [1.2, 0.12, 0.1, 0.01]]
    ds = seed_curves(curves).rename({"seed": "run"})
    options = IntervalOptions(level=0.8, n_resamples=199, seed=1)
    bounds = equivalence_bounds(ds, fraction=0.2, options=options, seed_dim="run")
    margins = np.array(curves)[:, 1] - 0.2 * np.array(curves)[:, 0]
    upper = margins.mean() + scipy.stats.t.ppf(0.8, 2) * scipy.stats.sem(margins)
    assert float(bounds["margin_upper"][1]) == pytest.approx(upper, rel=1e-9)
    phase = finishing_phase(ds, fraction=0.2, options=options, seed_dim="run")
    assert phase.bound_updates == 4 and phase.decay_spread == (4, 4) and phase.level == 0.8
    assert finishing_phase(ds, fraction=0.2, seed_dim="run").bound_updates == 8
    assert finishing_phase(ds, seed_dim="run").bound_updates == 16
    rows = with_equivalence(summary_table(ds, seed_dim="run"), ds, fraction=0.2, options=options, seed_dim="run")
    assert [row["margin_upper"] for row in rows[1:]] == pytest.approx(
        [float(bounds["margin_upper"][i]) for i in (1, 2, 3)], rel=1e-12
    )


def test_two_seeds_form_a_bound_and_a_spread_and_one_seed_neither():
    curves = [[1.0, 0.5, 0.01, 0.01], [1.0, 0.01, 0.02, 0.01]]
    phase = finishing_phase(seed_curves(curves))
    margins = np.array(curves)[:, 3] - 0.05
    upper = margins.mean() + scipy.stats.t.ppf(0.95, 1) * scipy.stats.sem(margins)
    bounds = equivalence_bounds(seed_curves(curves))
    assert int(bounds["n"][3]) == 2 and float(bounds["margin_upper"][3]) == pytest.approx(upper, rel=1e-9)
    assert phase.decay_spread is not None
    one = finishing_phase(seed_curves(curves[:1]))
    assert one.decay_spread is None and one.bound_updates is None
    with pytest.raises(Exception, match="a one-sided BCa bound needs a level above 0.5"):
        equivalence_bounds(seed_curves(curves), options=IntervalOptions(level=0.5, method="bca"))


def test_a_bound_above_zero_is_not_shown_below_the_fraction():
    curves, ds = random_seed_curves(np.random.default_rng(3))
    rows = with_equivalence(summary_table(ds), ds, fraction=0.0)
    # After the switch the seeds sit near +0.03: the bound is above zero and below one.
    assert all(0 < row["margin_upper"] < 1 and row["shown_below_fraction"] is False for row in rows[1:])


def test_the_bounds_are_a_dataset_by_snapshot_with_whole_seed_counts():
    _, ds = random_seed_curves(np.random.default_rng(3))
    bounds = equivalence_bounds(ds)
    assert all(bounds[name].dims == ("snapshot",) for name in ("margin", "margin_upper", "n", "below"))
    assert (bounds["margin"].dtype, bounds["n"].dtype, bounds["below"].dtype) == (np.float64, np.int64, bool)
    assert list(bounds["uniform_updates"].values) == [0, 4, 8, 16] and np.isnan(bounds["margin"].values[0])
    assert bounds.attrs == {"fraction": 0.05, "level": 0.95, "method": "t"}
    options = IntervalOptions(level=0.9, method="bca", n_resamples=100)
    assert equivalence_bounds(ds, fraction=0.2, options=options).attrs == {
        "fraction": 0.2,
        "level": 0.9,
        "method": "bca",
    }


def test_the_switch_is_never_its_own_decay_point_whatever_the_fraction():
    # Everything is below 150% of the switch value, the switch included: the decay point is the next count.
    assert decay_point([0, 4, 8], [1.0, 0.5, 0.2], fraction=1.5) == 4
