"""analysis/machines.py and `depthdiag machines`: one experiment on several machines side by side,
checked by hand, and the verdict probabilities against simulation."""

import json
import math
import warnings

import numpy as np
import pytest
import scipy.stats
import xarray as xr
from click.testing import CliRunner

from analysis.machines import (
    MOST_SEEDS,
    SEED_COUNTS,
    MachineComparison,
    MachineGroup,
    below_bound_probability,
    excludes_zero_probability,
    format_machine_comparison,
    machine_comparison,
    seeds_needed,
)
from analysis.stats import IntervalOptions
from analysis.store import write_dataset
from common.errors import InputError
from common.provenance import describe_machine
from depthdiag.cli import main

COUNTS = [0, 4, 16]
MACHINE_A = {"cpu_model": "CPU A", "bf16_matmul": "brg_matmul:avx10_1_512_amx", "bf16_matrix_units": 1}
MACHINE_B = {"cpu_model": "CPU A", "bf16_matmul": "brg_matmul:avx512_core_bf16", "bf16_matrix_units": 0}


def seed_file(
    path, seed: int, curve, machine: dict | None, *, counts=COUNTS, trained: bool = True, padded=False, label="u"
) -> str:
    """A results file of one seed whose depth-averaged benefit per snapshot (uniform updates
    `counts`, named `label` and the count) is `curve` exactly (two batches and depths that
    average to it), diagnosed on `machine` and, where `trained`, trained on it. `padded`: a third
    batch, diagnosed at every snapshot but the last (NaN padding there)."""
    curve = np.asarray(curve, dtype=float)
    spread = np.array([[-0.01, 0.01], [0.02, -0.02], [0.03, -0.03]])[: 3 if padded else 2]  # batch x depth, zero mean
    benefit = curve[:, None, None] + spread[None]
    if padded:
        benefit[-1, -1] = np.nan
    shape = benefit.shape
    nll = np.stack([3.0 + benefit, np.full(shape, 3.0)], axis=2)
    attrs = {"seed": seed}
    if machine is not None:
        attrs |= {"machine": json.dumps(machine)} | ({"trained_on": json.dumps([machine])} if trained else {})
    ds = xr.Dataset(
        {
            "nll": (("snapshot", "batch", "update_depth", "serving_depth"), nll),
            "nll_before": (("snapshot", "serving_depth"), np.full((shape[0], shape[2]), 3.1)),
            "benefit": (("snapshot", "batch", "serving_depth"), benefit),
            "update_rms": (("snapshot", "batch", "update_depth"), np.full(shape[:2] + (2,), 1e-3)),
            "rms_scale": (("snapshot", "batch", "update_depth"), np.ones(shape[:2] + (2,))),
            "update_cosine": (("snapshot", "batch"), np.zeros(shape[:2])),
        },
        coords={
            "snapshot": [f"{label}{c:04d}" for c in counts],
            "uniform_updates": ("snapshot", counts),
            "step": ("snapshot", [100 + c for c in counts]),
            "batch": list(range(benefit.shape[1])),
            "update_depth": [4, 16],
            "serving_depth": [1, 2],
        },
        attrs=attrs,
    )
    write_dataset(ds, path)
    return str(path)


CURVES_A = {0: [0.9, 0.05, 0.02], 1: [0.6, 0.03, 0.01], 2: [1.2, 0.06, 0.03]}
CURVES_B = {0: [1.1, 0.04, 0.03], 1: [0.5, 0.02, 0.00], 2: [0.8, 0.07, 0.02]}


@pytest.fixture
def two_machines(tmp_path):
    return [seed_file(tmp_path / f"a{s}.h5", s, c, MACHINE_A) for s, c in CURVES_A.items()] + [
        seed_file(tmp_path / f"b{s}.h5", s, c, MACHINE_B) for s, c in CURVES_B.items()
    ]


def test_each_machine_is_summarised_over_its_own_seeds(two_machines):
    comparison = machine_comparison(two_machines)
    assert [group.label for group in comparison.groups] == ["machine 1", "machine 2"]
    assert [group.trained_on for group in comparison.groups] == [[MACHINE_A], [MACHINE_B]]
    assert [group.seeds for group in comparison.groups] == [[0, 1, 2], [0, 1, 2]]
    for index, row in enumerate(comparison.rows):
        assert row["uniform_updates"] == COUNTS[index]
        for machine, curves in zip(row["machines"], (CURVES_A, CURVES_B)):
            values = np.array([curve[index] for curve in curves.values()])
            lower, upper = scipy.stats.t.interval(0.95, 2, values.mean(), scipy.stats.sem(values))
            assert machine["mean"] == pytest.approx(values.mean())
            assert (machine["lower"], machine["upper"]) == pytest.approx((lower, upper))
            assert machine["excludes_zero"] == bool(lower > 0 or upper < 0)


def test_the_machine_spread_of_one_seed_beside_the_seed_spread(two_machines):
    rows = machine_comparison(two_machines).rows
    for index, row in enumerate(rows):
        a = np.array([curve[index] for curve in CURVES_A.values()])
        b = np.array([curve[index] for curve in CURVES_B.values()])
        assert row["seed_sd"] == pytest.approx(np.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2))
        # Each seed on two machines: the variance of its pair, (a - b)^2 / 2, averaged over seeds.
        assert row["machine_sd"] == pytest.approx(np.sqrt(np.mean((a - b) ** 2 / 2)))
        assert row["paired_seeds"] == 3
        pooled = (a + b) / 2  # each seed the mean of its machines
        lower, upper = scipy.stats.t.interval(0.95, 2, pooled.mean(), scipy.stats.sem(pooled))
        assert (row["pooled"]["lower"], row["pooled"]["upper"]) == pytest.approx((lower, upper))
        assert row["run_sd"] == pytest.approx(np.concatenate([a, b]).std(ddof=1))
    assert rows[0]["shown_below_probability"] is None  # nothing to bound at the switch


def test_the_verdict_probabilities_match_simulated_runs():
    rng = np.random.default_rng(0)
    for mean, sd, n in ((0.03, 0.04, 5), (0.03, 0.04, 12), (-0.02, 0.05, 8)):
        draws = rng.normal(mean, sd, (40000, n))
        means, sems = draws.mean(axis=1), draws.std(axis=1, ddof=1) / np.sqrt(n)
        two_sided = scipy.stats.t.ppf(0.975, n - 1) * sems
        excluded = np.mean((means - two_sided > 0) | (means + two_sided < 0))
        assert excludes_zero_probability(mean, sd, n) == pytest.approx(excluded, abs=0.01)
        below = np.mean(means + scipy.stats.t.ppf(0.95, n - 1) * sems < 0)
        assert below_bound_probability(mean, sd, n) == pytest.approx(below, abs=0.01)


def test_seeds_needed_is_the_first_count_that_reaches_the_target():
    def probability(n):
        return excludes_zero_probability(0.03, 0.04, n)

    needed = seeds_needed(probability)
    assert probability(needed) >= 0.9 > probability(needed - 1)
    assert seeds_needed(lambda n: 0.5) is None


def test_a_comparison_needs_two_machines_and_recorded_ones(tmp_path, two_machines):
    with pytest.raises(InputError, match="every file was computed on the same machine"):
        machine_comparison(two_machines[:3])
    unrecorded = seed_file(tmp_path / "old.h5", 7, [1.0, 0.1, 0.0], None)
    with pytest.raises(InputError, match="records no machine"):
        machine_comparison([*two_machines, unrecorded])


def test_the_machines_command_prints_the_comparison(two_machines):
    result = CliRunner().invoke(main, ["machines", *two_machines])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == format_machine_comparison(machine_comparison(two_machines))
    assert "- **machine 2** (seeds 0 1 2): trained on CPU A;" in result.stdout
    as_json = json.loads(CliRunner().invoke(main, ["machines", *two_machines, "--json"]).stdout)
    assert [row["uniform_updates"] for row in as_json["rows"]] == COUNTS


def test_far_out_the_probabilities_are_certainties_not_nan():
    # scipy's noncentral t returns NaN deep in a tail (seen for a switch benefit 3 SD from zero at 10 seeds).
    assert excludes_zero_probability(0.83, 0.28, 10) == pytest.approx(1.0)
    assert excludes_zero_probability(-0.83, 0.28, 10) == pytest.approx(1.0)
    assert below_bound_probability(-0.5, 0.01, 10) == pytest.approx(1.0)
    assert below_bound_probability(0.5, 0.01, 10) == 0.0
    assert below_bound_probability(0.5, 0.039, 10) == 0.0  # where scipy's lower-tail cdf is NaN
    critical = scipy.stats.t.ppf(0.95, 9)
    assert math.isnan(scipy.stats.nct(df=9, nc=0.5 * math.sqrt(10) / 0.039).cdf(-critical))


def test_the_probabilities_need_two_units_and_a_spread_and_split_the_level_at_zero():
    for probability in (excludes_zero_probability, below_bound_probability):
        assert math.isnan(probability(0.1, 0.05, 1))
        assert math.isnan(probability(0.1, 0.0, 5))
        assert 0 < probability(0.1, 0.05, 2) < 1
    # A true mean of zero: each tail holds half of 1 - level, one-sided the bound's whole 1 - level.
    assert excludes_zero_probability(0.0, 1.0, 5) == pytest.approx(0.05)
    assert excludes_zero_probability(0.0, 1.0, 5, level=0.8) == pytest.approx(0.2)
    assert below_bound_probability(0.0, 1.0, 5) == pytest.approx(0.05)
    assert below_bound_probability(0.0, 1.0, 5, level=0.8) == pytest.approx(0.2)


def test_seeds_needed_searches_two_to_most_seeds_and_a_reached_target_counts():
    assert seeds_needed(lambda n: 1.0) == 2
    assert seeds_needed(lambda n: 0.9 if n == 7 else 0.0) == 7
    assert seeds_needed(lambda n: 0.5 if n == 7 else 0.0, target=0.5) == 7
    assert seeds_needed(lambda n: float(n == MOST_SEEDS)) == MOST_SEEDS
    assert seeds_needed(lambda n: float(n > MOST_SEEDS)) is None


def test_machines_are_told_apart_by_their_records_alone(tmp_path, two_machines):
    # The same machine's record with its keys in another order, and a file that records the
    # machine that diagnosed it but none that trained it (snapshots of an older trainer).
    reordered = dict(reversed(MACHINE_B.items()))
    third = seed_file(tmp_path / "b3.h5", 3, [0.7, 0.04, 0.01], reordered)
    untrained = seed_file(tmp_path / "c.h5", 4, [0.7, 0.04, 0.01], MACHINE_A, trained=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a machine of one seed has no seed spread
        comparison = machine_comparison([*two_machines, third, untrained])
    groups = comparison.groups
    assert [group.seeds for group in groups] == [[0, 1, 2], [0, 1, 2, 3], [4]]
    assert groups[2].trained_on == [] and groups[2].diagnosed_on == MACHINE_A
    # The seed SD pools the two machines with seeds to spread; the third adds nothing.
    a = np.array(list(CURVES_A.values()))[:, 1]
    b = np.array([*(c[1] for c in CURVES_B.values()), 0.04])
    expected = np.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2)
    assert comparison.rows[1]["seed_sd"] == pytest.approx(expected)


def test_machines_must_share_the_snapshot_grid_not_its_names(tmp_path, two_machines):
    other = seed_file(tmp_path / "c.h5", 0, [1.0, 0.05, 0.02], {"cpu_model": "CPU C"}, counts=[0, 4, 8])
    for files, named in (([*two_machines, other], other), ([other, *two_machines], two_machines[0])):
        with pytest.raises(InputError, match=f"{named}: its snapshots' uniform updates differ from {files[0]}'s"):
            machine_comparison(files)
    # Snapshots are matched by their uniform updates: machine A's files may hold them in another
    # order and machine B's may name them otherwise.
    order = [2, 0, 1]
    shuffled = [
        seed_file(tmp_path / f"s{s}.h5", s, np.array(c)[order], MACHINE_A, counts=np.array(COUNTS)[order].tolist())
        for s, c in CURVES_A.items()
    ]
    renamed = [seed_file(tmp_path / f"r{s}.h5", s, c, MACHINE_B, label="step") for s, c in CURVES_B.items()]
    assert machine_comparison([*shuffled, *renamed]).rows == machine_comparison(two_machines).rows


def test_a_snapshot_diagnosed_on_fewer_batches_is_the_mean_of_its_own(tmp_path, two_machines):
    padded = [seed_file(tmp_path / f"p{s}.h5", s, c, MACHINE_A, padded=True) for s, c in CURVES_A.items()]
    rows = machine_comparison([*padded, *two_machines[3:]]).rows
    for row, expected in zip(rows, machine_comparison(two_machines).rows):
        assert row["machines"][0]["mean"] == pytest.approx(expected["machines"][0]["mean"])
        assert row["seed_sd"] == pytest.approx(expected["seed_sd"])


@pytest.mark.parametrize(("fraction", "level"), [(0.05, 0.95), (0.5, 0.9), (0.1, 0.9)])
def test_the_rows_follow_the_fraction_and_level_asked_for(two_machines, fraction, level):
    """Every number of a row recomputed from the seeds' curves: the machines' intervals and
    verdicts, the pooled interval and the verdict probabilities of a fresh run. At a fraction
    of 0.1 one machine's verdict at 90% is not its verdict at 95%."""
    comparison = machine_comparison(two_machines, fraction=fraction, options=IntervalOptions(level=level))
    assert (comparison.fraction, comparison.level) == (fraction, level)
    a, b = np.array(list(CURVES_A.values())), np.array(list(CURVES_B.values()))  # [seed, snapshot]
    runs = np.concatenate([a, b])
    margins = runs - fraction * runs[:, :1]
    verdicts, levels_disagree = set(), False
    for index, row in enumerate(comparison.rows):
        for machine, curves in zip(row["machines"], (a, b)):
            values = curves[:, index]
            lower, upper = scipy.stats.t.interval(level, 2, values.mean(), scipy.stats.sem(values))
            assert (machine["lower"], machine["upper"]) == pytest.approx((lower, upper))
            assert machine["n"] == 3 and machine["excludes_zero"] == bool(lower > 0 or upper < 0)
            if index == 0:
                assert machine["shown_below"] is None
            else:
                margin = values - fraction * curves[:, 0]
                bound, bound_95 = (
                    margin.mean() + scipy.stats.t.ppf(q, 2) * scipy.stats.sem(margin) for q in (level, 0.95)
                )
                assert machine["shown_below"] == bool(bound < 0)
                levels_disagree |= (bound < 0) != (bound_95 < 0)
            verdicts.add((machine["excludes_zero"], machine["shown_below"]))
        pooled = (a[:, index] + b[:, index]) / 2
        lower, upper = scipy.stats.t.interval(level, 2, pooled.mean(), scipy.stats.sem(pooled))
        assert row["pooled"] == pytest.approx({"mean": pooled.mean(), "lower": lower, "upper": upper, "n": 3})

        def excludes(n, values=runs[:, index]):
            return excludes_zero_probability(values.mean(), values.std(ddof=1), n, level)

        def below(n, values=margins[:, index]):
            return below_bound_probability(values.mean(), values.std(ddof=1), n, level)

        assert row["excludes_zero_probability"] == pytest.approx({str(k): excludes(k) for k in SEED_COUNTS})
        assert row["seeds_needed_excludes_zero"] == seeds_needed(excludes)
        if index == 0:
            assert row["shown_below_probability"] is None and row["seeds_needed_shown_below"] is None
        else:
            assert row["shown_below_probability"] == pytest.approx({str(k): below(k) for k in SEED_COUNTS})
            assert row["seeds_needed_shown_below"] == seeds_needed(below)
    assert {excluded for excluded, _ in verdicts} == {True, False}  # both verdicts were checked
    assert levels_disagree == (fraction == 0.1)


def test_machines_without_a_seed_in_common_have_no_machine_spread(tmp_path, two_machines):
    moved = [seed_file(tmp_path / f"m{s}.h5", s + 10, c, MACHINE_B) for s, c in CURVES_B.items() if s < 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no mean of an empty list of pairs
        rows = machine_comparison([*two_machines[:3], *moved]).rows
    assert all(math.isnan(row["machine_sd"]) and row["paired_seeds"] == 0 for row in rows)
    # Machine B's two seeds have a spread of their own.
    a, b = np.array(list(CURVES_A.values())), np.array([CURVES_B[0], CURVES_B[1]])
    assert [row["seed_sd"] for row in rows] == pytest.approx(
        np.sqrt((a.var(axis=0, ddof=1) + b.var(axis=0, ddof=1)) / 2)
    )


def test_machines_of_one_seed_each_have_no_seed_spread_and_the_switch_is_never_bounded(tmp_path):
    # A switch benefit below zero too: a bound below a fraction of it is no verdict to reach.
    files = [seed_file(tmp_path / "a.h5", 0, [-0.5, 0.01, 0.0], MACHINE_A)]
    files.append(seed_file(tmp_path / "b.h5", 0, [-0.4, 0.02, 0.01], MACHINE_B))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        rows = machine_comparison(files).rows
    assert all(math.isnan(row["seed_sd"]) for row in rows)
    assert rows[0]["shown_below_probability"] is None and rows[0]["seeds_needed_shown_below"] is None


def test_the_comparison_reads_as_its_markdown_table():
    """The Markdown of a comparison given by hand (not computed), line by line."""
    diagnoser = {"cpu_model": "CPU D"}
    comparison = MachineComparison(
        groups=[
            MachineGroup("machine 1", [MACHINE_A], diagnoser, ["a0.h5", "a1.h5"], [0, 1]),
            MachineGroup("machine 2", [MACHINE_B], MACHINE_B, ["b0.h5"], [0]),
        ],
        fraction=0.05,
        level=0.9,
        rows=[
            {
                "uniform_updates": 0,
                "machines": [
                    {"mean": 0.9, "lower": 0.5, "upper": 1.3, "n": 2, "excludes_zero": True, "shown_below": None},
                    {
                        "mean": 1.1,
                        "lower": math.nan,
                        "upper": math.nan,
                        "n": 1,
                        "excludes_zero": False,
                        "shown_below": None,
                    },
                ],
                "seed_sd": 0.25,
                "machine_sd": 0.125,
                "paired_seeds": 1,
                "pooled": {"mean": 1.0, "lower": 0.75, "upper": 1.25, "n": 2},
                "run_sd": 0.2,
                "excludes_zero_probability": {"5": 0.5, "10": 0.75, "20": 0.99},
                "seeds_needed_excludes_zero": 12,
                "shown_below_probability": None,
                "seeds_needed_shown_below": None,
            },
            {
                "uniform_updates": 16,
                "machines": [
                    {
                        "mean": -0.01,
                        "lower": -0.02,
                        "upper": 0.005,
                        "n": 2,
                        "excludes_zero": False,
                        "shown_below": True,
                    },
                    {
                        "mean": 0.02,
                        "lower": math.nan,
                        "upper": math.nan,
                        "n": 1,
                        "excludes_zero": False,
                        "shown_below": False,
                    },
                ],
                "seed_sd": 0.0125,
                "machine_sd": math.nan,
                "paired_seeds": 1,
                "pooled": {"mean": 0.005, "lower": -0.1, "upper": 0.11, "n": 2},
                "run_sd": 0.015,
                "excludes_zero_probability": {"5": 0.05, "10": 0.06, "20": 0.07},
                "seeds_needed_excludes_zero": None,
                "shown_below_probability": {"5": 0.1, "10": 0.2, "20": 0.3},
                "seeds_needed_shown_below": 40,
            },
        ],
    )
    a, b, d = describe_machine(MACHINE_A), describe_machine(MACHINE_B), describe_machine(diagnoser)
    assert format_machine_comparison(comparison).splitlines() == [
        "Machines (what trained each file's snapshots; what diagnosed them):",
        "",
        f"- **machine 1** (seeds 0 1): trained on {a}; diagnosed on {d}",
        f"- **machine 2** (seeds 0): trained on {b}; diagnosed on {b}",
        "",
        "Depth-averaged benefit per snapshot, 90% Student-t CI over each machine's seeds; seed SD = the "
        "spread of seed means within a machine (pooled), machine SD = the spread of one seed's mean across "
        "machines (pooled over the seeds run on several); pooled = over seeds, each the mean of its machines. "
        "Verdicts: 0 = the CI excludes zero, < 5% = the benefit is shown below 5% of the switch benefit "
        "(one-sided 90% bound, paired by seed).",
        "",
        "| uniform updates | machine 1 | machine 2 | verdicts (0 / < 5%) | seed SD | machine SD | pooled |",
        "|---:|---|---|---|---:|---:|---|",
        "| 0 | +0.9000 [+0.5000, +1.3000] | +1.1000 n/a (too few units) | yes / - ; no / - | 0.2500 | 0.1250 "
        "| +1.0000 [+0.7500, +1.2500] (2 seeds) |",
        "| 16 | -0.0100 [-0.0200, +0.0050] | +0.0200 n/a (too few units) | no / yes ; no / no | 0.0125 | nan "
        "| +0.0050 [-0.1000, +0.1100] (2 seeds) |",
        "",
        "How likely a fresh run of n seeds on any of these machines is to reach each verdict, from the mean "
        "and SD of every (seed, machine) run (noncentral t), and the seeds a verdict needs to come out the "
        "same way 90% of the time:",
        "",
        "| uniform updates | run SD | P(CI excludes 0), n = 5 / 10 / 20 | seeds for 90% | "
        "P(shown < 5%), n = 5 / 10 / 20 | seeds for 90% |",
        "|---:|---:|---|---:|---|---:|",
        "| 0 | 0.2000 | 0.50 / 0.75 / 0.99 | 12 | - | - |",
        "| 16 | 0.0150 | 0.05 / 0.06 / 0.07 | > 200 | 0.10 / 0.20 / 0.30 | 40 |",
    ]
