"""Depth schedules: parsing, purity, and empirical distributions against their definitions."""

import math

import numpy as np
import pytest
from scipy import stats

from common.errors import InputError
from trainer.rng import batch_rng, seeded_generator
from trainer.schedules import (
    DEPTH_SALT,
    FixedFirstSchedule,
    PLNSchedule,
    ProgressiveSchedule,
    UniformSchedule,
    parse_schedule,
)

ALPHA = 1e-3  # goodness-of-fit tests use fixed seeds, so a pass is reproducible


def histogram(depths, max_depth):
    return np.bincount(np.asarray(depths), minlength=max_depth + 1)[1:]  # [max_depth], index k-1


def chi_square_p(observed, probabilities):
    """Pearson chi-square p-value, pooling cells with expected count < 5 into one."""
    observed = np.asarray(observed, dtype=float)
    expected = np.asarray(probabilities, dtype=float) * observed.sum()
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(observed, expected).pvalue


def depths_of(schedule, steps):
    return [schedule.depth_at(step) for step in steps]


def as_vector(distribution, max_depth):
    return np.array([distribution.get(k, 0.0) for k in range(1, max_depth + 1)])


# --- parsing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,canonical",
    [
        ("fixed:4", "fixed:4"),
        ("uniform:1-16", "uniform:1-16"),
        ("uniform", "uniform:1-16"),
        ("pln", "pln:mean=8,sigma=0.5,max=16"),
        ("pln:max=32,mean=4.5", "pln:mean=4.5,sigma=0.5,max=32"),
        ("progressive:mean=8,warmup=0.75,shape=1-sqrt", "progressive:mean=8,sigma=0.5,max=16,warmup=0.75,shape=1-sqrt"),
        ("progressive:shape=linear", "progressive:mean=8,sigma=0.5,max=16,warmup=0.75,shape=linear"),
        (
            "progressive:max=12,sigma=0.3,shape=linear,warmup=0.5,mean=6",
            "progressive:mean=6,sigma=0.3,max=12,warmup=0.5,shape=linear",
        ),
        ("fixed-first", "fixed-first:k0=4,switch=0.8,finish=uniform:1-16"),
        ("fixed-first:k0=2, switch=0.5, finish=uniform:1-16", "fixed-first:k0=2,switch=0.5,finish=uniform:1-16"),
        (
            "fixed-first:k0=2,switch=0.67,finish=pln:mean=8,sigma=0.5,max=16",
            "fixed-first:k0=2,switch=0.67,finish=pln:mean=8,sigma=0.5,max=16",
        ),
    ],
)
def test_spec_round_trips_through_its_canonical_form(spec, canonical):
    schedule = parse_schedule(spec, seed=0, total_updates=100)
    assert schedule.spec == canonical
    assert parse_schedule(canonical, seed=0, total_updates=100) == schedule


@pytest.mark.parametrize(
    "spec",
    [
        "fixed:0",
        "fixed",
        "fixed:x",
        "uniform:5-2",
        "uniform:0-4",
        "uniform:3",
        "fixed-first:switch=1.5",
        "fixed-first:k0=0",
        "fixed-first:k0=4,switch=0.8,finish=fixed:4",
        "fixed-first:k0=4,finish=uniform:1-16,switch=0.5",
        "pln:mean=-1",
        "pln:mean=0",
        "pln:sigma=nan",
        "pln:max=0",
        "pln:foo=1",
        "pln:mean=8,mean=9",
        "progressive:shape=cubic",
        "progressive:warmup=2",
        "progressive:mean=0.5",
        "geometric:3",
        "",
    ],
)
def test_bad_specs_raise_one_line_input_errors(spec):
    with pytest.raises(InputError) as err:
        parse_schedule(spec, seed=0, total_updates=100)
    message = str(err.value)
    assert message.startswith(f"schedule {spec!r}: ") and "\n" not in message


@pytest.mark.parametrize(
    "spec,message",
    [
        ("fixed:x", "depth must be an integer"),
        ("pln:mean=abc", "mean must be a number"),
        ("pln:sigma=abc", "sigma must be a number"),
        ("pln:max=1.5", "max must be an integer"),
        ("progressive:mean=abc", "mean must be a number"),
        ("progressive:sigma=abc", "sigma must be a number"),
        ("progressive:max=1.5", "max must be an integer"),
        ("progressive:warmup=abc", "warmup must be a number"),
        ("uniform:a-16", "low must be an integer, got 'a'"),
        ("uniform:1-b", "high must be an integer, got 'b'"),
        ("uniform:1-2-3", "high must be an integer, got '2-3'"),
        ("fixed-first:k0=x", "k0 must be an integer, got 'x'"),
        ("fixed-first:k0=4=5", "k0 must be an integer, got '4=5'"),
        ("fixed-first:k0=4X", "k0 must be an integer, got '4X'"),
        ("fixed-first:switch=x", "switch must be a number, got 'x'"),
        ("fixed-first:=4", "expected key=value, got '=4'"),
        ("fixed-first:k0=", "expected key=value, got 'k0='"),
        ("fixed-first:finish=uniform:1:16", "finish 'uniform:1:16': expected a range .* got '1:16'"),
    ],
)
def test_a_malformed_value_is_named_by_its_key(spec, message):
    # Several keys take numbers: the message says which one is wrong.
    with pytest.raises(InputError, match=message):
        parse_schedule(spec, seed=0, total_updates=100)


@pytest.mark.parametrize(
    "spec,distribution",
    [
        ("fixed:1", {1: 1.0}),
        ("pln:mean=0.5,sigma=0,max=1", {1: 1.0}),
        ("progressive:mean=1,sigma=0,max=1,warmup=0,shape=1-sqrt", {1: 1.0}),
    ],
)
def test_the_smallest_valid_values_are_accepted(spec, distribution):
    # Depth 1, max 1, sigma 0, a mean below 1 (PLN) or of exactly 1 (progressive), no warmup: all valid settings.
    schedule = parse_schedule(spec, seed=0, total_updates=10)
    assert schedule.spec == spec
    assert schedule.average_distribution() == pytest.approx(distribution)
    assert {schedule.depth_at(step) for step in range(10)} == {1}


def test_progressive_without_warmup_starts_at_the_full_mean():
    schedule = parse_schedule("progressive:mean=6,warmup=0", seed=0, total_updates=10)
    assert [schedule.pln_mean_at(step) for step in (0, 1, 9)] == [6.0, 6.0, 6.0]
    full_warmup = parse_schedule("progressive:mean=6,warmup=1,shape=linear", seed=0, total_updates=10)
    assert [full_warmup.pln_mean_at(step) for step in (0, 5, 9)] == pytest.approx([1.0, 3.5, 5.5])


@pytest.mark.parametrize("cls", [PLNSchedule, ProgressiveSchedule])
def test_an_infinite_sigma_is_rejected_by_the_schedule_itself(cls):
    # The parser already refuses "inf"; the dataclasses are public too.
    with pytest.raises(InputError, match="sigma must be a finite number"):
        cls(sigma=math.inf)


@pytest.mark.parametrize("spec", ["fixed:3", "uniform:2-5", "pln", "progressive", "fixed-first"])
def test_a_prefix_of_one_update_up_to_the_whole_run_is_averaged_and_no_other(spec):
    schedule = parse_schedule(spec, seed=0, total_updates=50)
    assert schedule.total_updates == 50
    for updates in (1, 50):
        assert sum(schedule.average_distribution(updates).values()) == pytest.approx(1.0)
    for updates in (0, 51):
        with pytest.raises(InputError, match=r"updates must be in \[1, 50\]"):
            schedule.average_distribution(updates)


def test_progressive_prefix_average_is_the_mean_of_its_steps_laws():
    schedule = parse_schedule("progressive:mean=8,warmup=0.5,shape=linear", seed=0, total_updates=40)
    for updates in (1, 10, 40):
        expected = np.zeros(16)
        for step in range(updates):
            expected += as_vector(schedule.depth_distribution(step), 16) / updates
        assert as_vector(schedule.average_distribution(updates), 16) == pytest.approx(expected, abs=1e-12)


def test_fixed_first_average_with_k0_outside_the_finish_range():
    # K0 = 20 for 25 of 100 updates, then uniform 1..16: depth 20 gets exactly the fixed phase's share.
    schedule = parse_schedule("fixed-first:k0=20,switch=0.25,finish=uniform:1-16", seed=0, total_updates=100)
    assert schedule.average_distribution() == pytest.approx({**{k: 0.75 / 16 for k in range(1, 17)}, 20: 0.25})


def test_pln_probabilities_are_never_negative_where_the_clipped_tail_rounds_below_zero():
    # At mean 0.25 the quadrature's mass below the clip sums to 1 + 2e-16: the clipped tail must read 0, not -2e-16.
    distribution = parse_schedule("pln:mean=0.25,sigma=0.3,max=16", seed=0, total_updates=1).depth_distribution(0)
    assert min(distribution.values()) >= 0
    assert sum(distribution.values()) == pytest.approx(1.0)


# --- purity ---------------------------------------------------------------------------------

SPECS = [
    "uniform:1-16",
    "pln:mean=8,sigma=0.5,max=16",
    "progressive:mean=8,warmup=0.75",
    "fixed-first:k0=4,switch=0.5,finish=uniform:1-16",
]


@pytest.mark.parametrize("spec", SPECS)
def test_depths_are_pure_in_seed_and_step(spec):
    steps = range(200)
    forward = depths_of(parse_schedule(spec, seed=7, total_updates=200), steps)
    fresh = parse_schedule(spec, seed=7, total_updates=200)
    backward = [fresh.depth_at(step) for step in reversed(steps)][::-1]
    assert forward == backward
    other_seed = depths_of(parse_schedule(spec, seed=8, total_updates=200), steps)
    assert forward != other_seed


def test_a_depth_draw_is_the_generator_of_seed_step_and_the_depth_salt():
    # trainer/rng.py's recipe: (seed, step, DEPTH_SALT), independent of the batch generator of (seed, step).
    schedule = parse_schedule("uniform:1-16", seed=3, total_updates=100)
    depths = depths_of(schedule, range(100))
    assert depths == [int(seeded_generator(3, step, DEPTH_SALT).integers(1, 17)) for step in range(100)]
    assert depths != [int(batch_rng(3, step).integers(1, 17)) for step in range(100)]
    # A negative seed is taken modulo 2**64 (seed words must be non-negative): -1 draws as 2**64 - 1 does,
    # and seeds that differ by less than 2**64 draw differently.
    assert depths_of(parse_schedule("uniform:1-16", seed=-1, total_updates=100), range(100)) == depths_of(
        parse_schedule("uniform:1-16", seed=2**64 - 1, total_updates=100), range(100)
    )
    assert depths_of(parse_schedule("uniform:1-16", seed=0, total_updates=100), range(100)) != depths_of(
        parse_schedule("uniform:1-16", seed=2, total_updates=100), range(100)
    )


@pytest.mark.parametrize("step", [-1, True, 1.0, "1"])
def test_a_step_that_is_not_a_non_negative_integer_is_refused(step):
    schedule = parse_schedule("uniform:1-16", seed=0, total_updates=10)
    with pytest.raises(InputError, match="step must be a non-negative integer"):
        schedule.depth_at(step)
    with pytest.raises(InputError, match="step must be a non-negative integer"):
        schedule.depth_distribution(step)
    assert schedule.depth_at(np.int64(3)) == schedule.depth_at(3)


# --- distributions --------------------------------------------------------------------------


def test_fixed_is_constant():
    schedule = parse_schedule("fixed:5", seed=0, total_updates=50)
    assert set(depths_of(schedule, range(50))) == {5}
    assert schedule.depth_distribution(3) == {5: 1.0}


def test_uniform_matches_its_distribution():
    schedule = parse_schedule("uniform:3-9", seed=1, total_updates=7000)
    counts = histogram(depths_of(schedule, range(7000)), 9)
    assert counts[:2].sum() == 0
    assert chi_square_p(counts[2:], [1 / 7] * 7) > ALPHA
    assert schedule.depth_distribution(11) == pytest.approx({k: 1 / 7 for k in range(3, 10)})


def pln_reference_sample(mean, sigma, max_depth, n, seed):
    """The formula of docs/formats.md, drawn independently of the schedule's code."""
    rng = np.random.default_rng(seed)
    tau = rng.normal(math.log(mean) - sigma**2 / 2, sigma, size=n)
    return np.minimum(rng.poisson(np.exp(tau)) + 1, max_depth)


@pytest.mark.parametrize("mean,sigma,max_depth", [(8, 0.5, 16), (3, 1.0, 12), (20, 0.3, 16)])
def test_pln_distribution_matches_the_formula_and_its_samples(mean, sigma, max_depth):
    schedule = parse_schedule(f"pln:mean={mean},sigma={sigma},max={max_depth}", seed=2, total_updates=6000)
    exact = as_vector(schedule.depth_distribution(0), max_depth)
    assert exact.sum() == pytest.approx(1.0)
    reference = histogram(pln_reference_sample(mean, sigma, max_depth, 200_000, seed=99), max_depth)
    assert np.abs(exact - reference / reference.sum()).max() < 0.005
    sampled = histogram(depths_of(schedule, range(6000)), max_depth)
    assert chi_square_p(sampled, exact) > ALPHA


def test_unclipped_pln_mean_is_mean_plus_one():
    # E[Poisson(e^tau)] = E[e^tau] = mean, the identity the tau offset -sigma^2/2 is there for.
    schedule = parse_schedule("pln:mean=8,sigma=0.5,max=200", seed=0, total_updates=10)
    distribution = schedule.depth_distribution(0)
    assert sum(k * p for k, p in distribution.items()) == pytest.approx(9.0, abs=1e-6)


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_progressive_mean_curve(shape):
    total, warmup, mean = 1000, 0.75, 8.0
    schedule = parse_schedule(f"progressive:mean={mean},warmup={warmup},shape={shape}", seed=0, total_updates=total)

    def curve(step):
        u = min(step / (warmup * total), 1.0)
        return 1 + (mean - 1) * (u if shape == "linear" else 1 - math.sqrt(1 - u))

    for step in (0, 100, 375, 600, 749, 750, 999):
        assert schedule.pln_mean_at(step) == pytest.approx(curve(step))
    assert schedule.pln_mean_at(0) == 1.0 and schedule.pln_mean_at(900) == mean
    pln = parse_schedule(f"pln:mean={curve(375)},sigma=0.5,max=16", seed=0, total_updates=1)
    assert schedule.depth_distribution(375) == pytest.approx(pln.depth_distribution(0))


def test_progressive_samples_follow_the_rising_mean():
    total = 4000
    schedule = parse_schedule("progressive:mean=8,warmup=0.75,shape=linear", seed=4, total_updates=total)
    depths = np.array(depths_of(schedule, range(total)))
    for start in (0, 1000, 3200):
        window = range(start, start + 400)
        expected = np.mean([sum(k * p for k, p in schedule.depth_distribution(s).items()) for s in window])
        variance = np.mean([sum(k * k * p for k, p in schedule.depth_distribution(s).items()) for s in window])
        stderr = math.sqrt((variance - expected**2) / len(window))
        assert abs(depths[start : start + 400].mean() - expected) < 4 * stderr
    early, late = depths[:400].mean(), depths[-400:].mean()
    assert early < 3 < 8 < late


@pytest.mark.parametrize("switch,total", [(0.8, 1500), (0.67, 4800), (0.5, 5), (0.5, 7), (0.0, 10), (1.0, 10)])
def test_fixed_first_switches_at_exactly_round_switch_times_updates(switch, total):
    # k0 outside the finishing range makes the fixed phase visible in every draw.
    schedule = parse_schedule(f"fixed-first:k0=17,switch={switch},finish=uniform:1-16", seed=0, total_updates=total)
    expected = round(switch * total)
    assert schedule.switch_step == expected
    fixed = [step for step in range(total) if schedule.depth_at(step) == 17]
    assert fixed == list(range(expected))
    if expected < total:
        assert schedule.depth_distribution(expected) == pytest.approx({k: 1 / 16 for k in range(1, 17)})


def test_fixed_first_finish_uses_the_finish_schedule_draws():
    finish = parse_schedule("pln:mean=6,sigma=0.5,max=16", seed=5, total_updates=300)
    schedule = parse_schedule(
        "fixed-first:k0=4,switch=0.5,finish=pln:mean=6,sigma=0.5,max=16", seed=5, total_updates=300
    )
    assert depths_of(schedule, range(150, 300)) == depths_of(finish, range(150, 300))
    average = schedule.average_distribution()
    expected = {k: 0.5 * p for k, p in finish.depth_distribution(0).items()}
    expected[4] += 0.5
    assert average == pytest.approx(expected)


def test_the_smallest_fixed_first_and_uniform_ranges_are_accepted():
    assert parse_schedule("fixed-first:k0=1,switch=0.5", seed=0, total_updates=10).k0 == 1
    assert parse_schedule("uniform:3-3", seed=0, total_updates=10).depth_distribution(0) == {3: 1.0}


@pytest.mark.parametrize("total_updates", [0, -1, True, 10.0])
def test_a_run_length_that_is_not_a_positive_integer_is_refused(total_updates):
    with pytest.raises(InputError, match="total_updates"):
        parse_schedule("uniform:1-16", seed=0, total_updates=total_updates)


def test_a_fixed_first_finish_draws_from_the_runs_seed_and_length():
    # Built directly, with a finish made for another seed and run length: the run's own win.
    schedule = FixedFirstSchedule(
        k0=4, switch=0.5, finish=UniformSchedule(1, 16, seed=3, total_updates=1), seed=7, total_updates=100
    )
    assert (schedule.finish.seed, schedule.finish.total_updates) == (7, 100)
    parsed = parse_schedule("fixed-first:k0=4,switch=0.5,finish=uniform:1-16", seed=7, total_updates=100)
    assert depths_of(schedule, range(100)) == depths_of(parsed, range(100))
