"""analysis/machines.py and `depthdiag machines`: one experiment on several machines side by side,
checked by hand, and the verdict probabilities against simulation."""

import json

import numpy as np
import pytest
import scipy.stats
import xarray as xr
from click.testing import CliRunner

from analysis.machines import (
    below_bound_probability,
    excludes_zero_probability,
    format_machine_comparison,
    machine_comparison,
    seeds_needed,
)
from analysis.store import write_dataset
from common.errors import InputError
from depthdiag.cli import main

COUNTS = [0, 4, 16]
MACHINE_A = {"cpu_model": "CPU A", "bf16_matmul": "brg_matmul:avx10_1_512_amx", "bf16_matrix_units": 1}
MACHINE_B = {"cpu_model": "CPU A", "bf16_matmul": "brg_matmul:avx512_core_bf16", "bf16_matrix_units": 0}


def seed_file(path, seed: int, curve, machine: dict | None) -> str:
    """A results file of one seed whose depth-averaged benefit per snapshot is `curve` exactly
    (two batches and depths that average to it), computed on `machine`."""
    curve = np.asarray(curve, dtype=float)
    spread = np.array([[-0.01, 0.01], [0.02, -0.02]])  # batch x depth, zero mean
    benefit = curve[:, None, None] + spread[None]
    shape = benefit.shape
    nll = np.stack([3.0 + benefit, np.full(shape, 3.0)], axis=2)
    attrs = {"seed": seed}
    if machine is not None:
        attrs |= {"machine": json.dumps(machine), "trained_on": json.dumps([machine])}
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
            "snapshot": [f"u{c:04d}" for c in COUNTS],
            "uniform_updates": ("snapshot", COUNTS),
            "step": ("snapshot", [100 + c for c in COUNTS]),
            "batch": [0, 1],
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
