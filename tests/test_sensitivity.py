"""The sensitivity table over (isolate, rms_match) at the seed level, from synthetic results files."""

import json

import numpy as np
import pytest
import scipy.stats
import xarray as xr
from click.testing import CliRunner

from analysis.sensitivity import format_sensitivity_markdown, sensitivity_table
from analysis.store import VARIABLE_DIMS, write_dataset
from common.errors import InputError
from depthdiag.cli import main

GRID = (0, 16, 64)


def settings_results(seed: int, isolate: str, rms_match: str, switch: float, after: float) -> xr.Dataset:
    """One seed's results whose depth-averaged benefit is exactly `switch` at 0 and `after` at 16 updates.

    Two batches of two depths each: batch means `value - 0.1` and `value + 0.1` around the seed's value.
    """
    values = np.array([switch, after, 0.0])
    benefit = values[:, None, None] + np.array([[-0.1, -0.1], [0.1, 0.1]])[None]  # [snapshot, batch, depth]
    nll = np.stack([3.0 + benefit, np.full_like(benefit, 3.0)], axis=2)
    shape = benefit.shape[:2]
    config = {"train": {"seed": seed, "updates": 100}, "optim": {"lr": 1e-3}}
    return xr.Dataset(
        {
            "nll": (VARIABLE_DIMS["nll"], nll),
            "nll_before": (VARIABLE_DIMS["nll_before"], np.full((len(GRID), 2), 3.1)),
            "benefit": (VARIABLE_DIMS["benefit"], benefit),
            "update_rms": (VARIABLE_DIMS["update_rms"], np.ones(shape + (2,))),
            "rms_scale": (VARIABLE_DIMS["rms_scale"], np.ones(shape + (2,))),
            "update_cosine": (VARIABLE_DIMS["update_cosine"], np.full(shape, 0.5)),
        },
        coords={
            "snapshot": [f"uniform-{u}" for u in GRID],
            "uniform_updates": ("snapshot", list(GRID)),
            "step": ("snapshot", [100 + u for u in GRID]),
            "batch": [0, 1],
            "update_depth": [4, 16],
            "serving_depth": [1, 2],
        },
        attrs={"config": json.dumps(config), "isolate": isolate, "rms_match": rms_match, "lr_override": "none"},
    )


SEED_VALUES = {  # (isolate, rms_match) -> [(switch, after 16)] per seed
    ("counterfactual", "reference"): [(0.30, 0.02), (0.20, 0.00), (0.25, 0.01)],
    ("none", "none"): [(0.50, 0.40), (0.70, 0.30)],
    ("linear", "geomean"): [(0.10, 0.05)],
}


@pytest.fixture
def files(tmp_path):
    paths = []
    for (isolate, rms_match), seeds in SEED_VALUES.items():
        for seed, (switch, after) in enumerate(seeds):
            paths.append(tmp_path / f"{isolate}-{rms_match}-seed{seed}.h5")
            write_dataset(settings_results(seed, isolate, rms_match, switch, after), paths[-1])
    return paths


def test_rows_are_seed_level_intervals_by_hand(files):
    table = sensitivity_table(files)
    assert [(row.isolate, row.rms_match) for row in table.rows] == [
        ("counterfactual", "reference"),
        ("linear", "geomean"),
        ("none", "none"),
    ]
    reference = table.rows[0]
    assert reference.at_switch.unit == "seed" and reference.at_switch.n == 3 and len(reference.files) == 3
    # Seed means at the switch: 0.30, 0.20, 0.25 -> mean 0.25, sd 0.05.
    half = scipy.stats.t.ppf(0.975, 2) * 0.05 / np.sqrt(3)
    assert reference.at_switch.mean == pytest.approx(0.25)
    assert (reference.at_switch.lower, reference.at_switch.upper) == pytest.approx((0.25 - half, 0.25 + half))
    assert reference.after.mean == pytest.approx(0.01) and reference.ratio == pytest.approx(0.04)
    # One seed: the batch interval over its two batches (0.0, 0.2), labelled as batches.
    single = table.rows[1]
    assert single.at_switch.unit == "batch" and single.at_switch.n == 2
    assert table.rows[2].ratio == pytest.approx(0.35 / 0.6)
    assert ("counterfactual", "per-tensor") in table.missing and len(table.missing) == 12 - 3


def test_markdown_says_which_interval(files):
    text = format_sensitivity_markdown(sensitivity_table(files))
    lines = text.splitlines()
    assert lines[0].startswith("| isolate | rms_match | n | benefit at switch (95% CI) | after 16 uniform updates")
    assert lines[2].startswith("| counterfactual | reference | 3 seeds | +0.2500 [")
    assert "| linear | geomean | 2 batches |" in text and "batch noise only" in text
    assert "Not diagnosed: counterfactual x geomean" in text


def test_a_group_differing_in_more_than_the_seed_is_refused(files, tmp_path):
    odd = settings_results(5, "none", "none", 0.5, 0.4)
    odd.attrs["config"] = json.dumps({"train": {"seed": 5, "updates": 200}, "optim": {"lr": 1e-3}})
    write_dataset(odd, tmp_path / "odd.h5")
    with pytest.raises(InputError, match=r"odd.h5: run config key train.updates 200 differs"):
        sensitivity_table([*files, tmp_path / "odd.h5"])
    with pytest.raises(InputError, match="no snapshot after 32 uniform updates"):
        sensitivity_table(files, after_updates=32)


def test_sensitivity_command(files):
    runner = CliRunner()
    text = runner.invoke(main, ["sensitivity", *map(str, files)])
    assert text.exit_code == 0, text.output
    assert "| counterfactual | reference | 3 seeds |" in text.stdout
    as_json = runner.invoke(main, ["sensitivity", *map(str, files), "--json", "--after", "16"])
    document = json.loads(as_json.stdout)
    assert document["after_updates"] == 16 and len(document["rows"]) == 3
    assert document["rows"][0]["at_switch"]["n"] == 3
    missing = runner.invoke(main, ["sensitivity", *map(str, files), "--after", "32"])
    assert missing.exit_code == 2 and len(missing.stderr.splitlines()) == 1
