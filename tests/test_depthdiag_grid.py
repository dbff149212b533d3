"""Experiment grids (depthdiag/grid.py, grid_run.py, and `depthdiag grid` in depthdiag/cli/grid.py):
the grid file, budgets sized by the iso-FLOP solver, a killed grid that resumes its interrupted cell
bit-exactly and skips finished ones, and the collected file with exactly one entry per cell."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from grid_helpers import (
    KILLED_GRID,
    final_weights,
    grid_stopped_after_a_checkpoint,
    toy_grid_folder,
    write_grid,
)

from common.errors import InputError
from depthdiag.grid import GridSpec, cell_state, collect_grid, grid_cells, load_grid
from depthdiag.grid_run import run_grid
from trainer.checkpoint import latest_checkpoint
from trainer.flops import update_flops


@pytest.fixture
def folder(tmp_path) -> Path:
    """A folder with a byte-level text corpus and a toy base config (d=32: seconds per run)."""
    return toy_grid_folder(tmp_path)


# A 2x2 grid whose cells the tests share, trained once, 2 cells at a time: the collect test
# reads it, and the tests of a changed grid file check that the trained cells are kept or refused.
COLLECTED = (
    '[budget]\nmatch = "updates"\n[axes]\nschedule = ["fixed:2", "uniform:1-4"]\nseed = [0]\nbudget = [0.5, 1]\n'
)


@pytest.fixture(scope="module")
def trained_grid(tmp_path_factory) -> tuple[Path, GridSpec, Path]:
    """(folder, spec, runs): COLLECTED's cells trained into runs. Tests train nothing more into it."""
    folder = toy_grid_folder(tmp_path_factory.mktemp("grid"))
    spec, runs = load_grid(write_grid(folder, COLLECTED)), folder / "runs"
    run_grid(spec, runs, jobs=2, progress=False)
    return folder, spec, runs


SCHEDULES = """
[budget]
match = "flops"
reference = "uniform:1-4"
[axes.schedule]
fixed2 = "fixed:2"
ff50 = "fixed-first:k0=2,switch=0.5,finish=uniform:1-4"
uniform = "uniform:1-4"
matched = { schedule = "uniform:1-4", flops_of = "ff50" }
[axes]
seed = [0, 1]
budget = [0.5, 1.0]
"""


# --- the grid file and its cells ------------------------------------------------------------


def test_cells_are_the_product_of_the_axes_in_order(folder):
    cells = grid_cells(load_grid(write_grid(folder, SCHEDULES)))
    assert len(cells) == 4 * 2 * 2
    assert cells[0].name == "schedule=fixed2/seed=0/budget=0.5"
    assert cells[-1].name == "schedule=matched/seed=1/budget=1.0"
    assert {cell.config.train.seed for cell in cells} == {0, 1}
    assert cells[0].config.train.schedule == "fixed:2"


def test_flop_matched_budgets_agree_within_one_update(folder):
    """Every schedule's run at a budget spends the reference's compute at that fraction, to
    within the compute of one update of its own schedule (the iso-FLOP solver's guarantee)."""
    spec = load_grid(write_grid(folder, SCHEDULES))
    cells = grid_cells(spec)
    model, tc = cells[0].config.model, cells[0].config.train
    per_update_max = update_flops(model, 4, batch_size=tc.batch_size, seq_len=tc.seq_len)
    reference = {c.key[1:]: c.modeled_flops for c in cells if c.key[0] == "uniform"}
    for cell in cells:
        seed, budget = cell.key[1:]
        target = budget * reference[(seed, 1.0)]
        if cell.key[0] == "matched":
            target = next(c.modeled_flops for c in cells if c.key == ("ff50", seed, budget))
        assert abs(cell.modeled_flops - target) <= per_update_max, cell.name
    # The full-budget uniform run is the base's own length; fixed:2 affords more updates.
    by_name = {cell.name: cell for cell in cells}
    assert by_name["schedule=uniform/seed=0/budget=1.0"].config.train.updates == 12
    assert by_name["schedule=fixed2/seed=0/budget=1.0"].config.train.updates > 12
    assert by_name["schedule=uniform/seed=0/budget=0.5"].config.train.updates == 6


def test_budgets_matched_on_updates_scale_the_base_length(folder):
    spec = load_grid(
        write_grid(
            folder, '[budget]\nmatch = "updates"\n[axes]\nschedule = ["fixed:2", "fixed:4"]\nbudget = [0.25, 1]\n'
        )
    )
    assert [cell.config.train.updates for cell in grid_cells(spec)] == [3, 12, 3, 12]


def test_any_config_key_is_an_axis_and_set_applies_to_every_cell(folder):
    spec = load_grid(write_grid(folder, '[set]\n"optim.warmup" = 5\n[axes]\n"optim.lr" = [0.001, 0.002]\n'))
    cells = grid_cells(spec)
    assert [cell.config.optim.lr for cell in cells] == [0.001, 0.002]
    assert {cell.config.optim.warmup for cell in cells} == {5}
    assert cells[0].name == "optim.lr=0.001"


def test_set_on_the_command_line_follows_the_grid_files_set(folder):
    grid = write_grid(folder, '[set]\n"train.updates" = 20\n"optim.warmup" = 5\n[axes]\nseed = [0]\n')
    (cell,) = grid_cells(load_grid(grid, overrides=["train.updates=8"]))
    assert (cell.config.train.updates, cell.config.optim.warmup) == (8, 5)


def test_axis_values_can_be_replaced_from_the_command_line(folder):
    spec = load_grid(write_grid(folder, "[axes]\nseed = [0, 1]\n"), ["seed=0,1,2,3"])
    assert [cell.config.train.seed for cell in grid_cells(spec)] == [0, 1, 2, 3]
    spec = load_grid(write_grid(folder, '[axes]\nschedule = ["fixed:2"]\n'), ["schedule=fixed:3,uniform:1-4"])
    assert [cell.config.train.schedule for cell in grid_cells(spec)] == ["fixed:3", "uniform:1-4"]
    with pytest.raises(InputError, match="expected NAME=V1,V2"):
        load_grid(write_grid(folder, "[axes]\nseed = [0, 1]\n"), ["budget=0.5"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[axes]\n", "names no axis"),
        ("[axes]\nbogus = [1]\n", "neither a config key"),
        ("[axes]\nseed = [0, 0]\n", "repeats a label"),
        ('[axes]\nschedule = ["fixed:0"]\n', "cell schedule=fixed:0"),
        ("[axes]\nbudget = [0.5]\n", "needs a [budget] table"),
        ('[budget]\nmatch = "bits"\n[axes]\nbudget = [0.5]\n', "match must be one of"),
        ('[axes]\nschedule = { a = { schedule = "fixed:2", flops_of = "b" } }\n', "not a label of the axis"),
        ('[axes]\nschedule = { "a/b" = "fixed:2" }\n', "names a directory"),
        ("[axes]\nseed = [0]\n[extra]\n", "unknown key"),
        ('[axes]\n"train.seed" = [-1]\n', "train.seed must be >= 0"),
        ('serving = "0-4"\n[axes]\nseed = [0]\n', "serving '0-4': need 1 <= depth"),
        ("set = 3\n[axes]\nseed = [0]\n", "`set` must be a table"),
    ],
)
def test_a_bad_grid_file_is_one_clear_error(folder, text, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        grid_cells(load_grid(write_grid(folder, text)))


def test_a_missing_grid_file_names_it(tmp_path):
    with pytest.raises(InputError, match="no such grid file"):
        load_grid(tmp_path / "absent.toml")


# --- running --------------------------------------------------------------------------------


@pytest.mark.slow  # trains the long cell twice, about a minute on 2 cores
def test_a_killed_grid_resumes_its_interrupted_cell_bit_exactly_and_skips_finished_ones(folder):
    grid = write_grid(folder, KILLED_GRID)
    runs = folder / "runs"
    long_dir = runs / "schedule=long"
    assert grid_stopped_after_a_checkpoint(folder, grid, runs) == 143  # SIGTERM, as documented
    spec = load_grid(grid)
    short, long = grid_cells(spec)
    assert cell_state(short, runs) == "finished"
    assert cell_state(long, runs) == "interrupted"
    short_checkpoint = latest_checkpoint(runs / short.name)
    short_mtime = short_checkpoint.stat().st_mtime_ns

    report = run_grid(spec, runs, progress=False)
    assert report.skipped == (short.name,) and report.trained == (long.name,)
    assert short_checkpoint.stat().st_mtime_ns == short_mtime
    summary = json.loads((long_dir / "summary.json").read_text())
    assert summary["updates"] == 300 and summary["resumed_from"] == 10  # where the hook stopped it

    # The same cell trained without interruption ends with the same weights, to the bit.
    clean = run_grid(spec, folder / "clean", progress=False)
    assert set(clean.trained) == {short.name, long.name}
    resumed, uninterrupted = final_weights(long_dir), final_weights(folder / "clean" / long.name)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    # A second run has nothing left to do.
    assert run_grid(spec, runs, progress=False).trained == ()


def test_a_run_directory_of_another_config_is_refused_before_training(trained_grid):
    folder, _, runs = trained_grid
    changed = write_grid(folder, '[set]\n"optim.lr" = 0.001\n' + COLLECTED, name="changed.toml")
    with pytest.raises(InputError, match=r"holds a run of another config \(optim.lr changed\)"):
        run_grid(load_grid(changed), runs, progress=False)


def test_a_finished_cell_stays_finished_when_only_keys_that_observe_it_change(trained_grid):
    folder, spec, runs = trained_grid
    observed = write_grid(folder, '[set]\n"train.log_every" = 3\n' + COLLECTED, name="observed.toml")
    assert grid_cells(load_grid(observed))[0].config.train.log_every != grid_cells(spec)[0].config.train.log_every
    assert run_grid(load_grid(observed), runs, progress=False).trained == ()


def test_a_failing_cell_is_reported_and_the_others_still_train(folder):
    # lr = 1e3 diverges: that cell's train exits 3, the other cell finishes.
    grid = write_grid(folder, '[axes]\n"optim.lr" = [1000.0, 0.003]\n')
    from common.errors import RunFailed

    with pytest.raises(RunFailed, match=r"1 of 2 cells failed: optim.lr=1000.0 \(exit 3, log "):
        run_grid(load_grid(grid), folder / "runs", jobs=2, progress=False)
    assert (folder / "runs" / "optim.lr=0.003" / "summary.json").is_file()


# --- collecting -----------------------------------------------------------------------------


def test_collect_has_exactly_one_entry_per_cell(trained_grid):
    folder, spec, runs = trained_grid
    with pytest.raises(InputError, match="4 of 4 cells have not finished"):
        collect_grid(spec, folder / "untrained", serving=(1, 2, 3), progress=False)
    ds = collect_grid(spec, runs, serving=(1, 2, 3), jobs=2, progress=False)  # evaluated in 2 worker processes
    assert dict(ds["nll"].sizes) == {"schedule": 2, "seed": 1, "budget": 2, "serving_depth": 3}
    assert list(ds["schedule"].values) == ["fixed:2", "uniform:1-4"]
    assert np.isfinite(ds["nll"].values).all()
    assert ds["updates"].sel(budget=0.5).values.tolist() == [[6], [6]]
    # Each cell's entry is its own run's: the final checkpoint's NLL and its metrics.
    for cell in grid_cells(spec):
        where = dict(cell.coords)
        evaluated = final_nll(runs / cell.name, (1, 2, 3))
        np.testing.assert_allclose(ds["nll"].sel(where).values, evaluated, rtol=0, atol=1e-12)
        metrics = [json.loads(line) for line in (runs / cell.name / "metrics.jsonl").read_text().splitlines()]
        losses = ds["loss"].sel(where).dropna("log_step")
        assert losses["log_step"].values.tolist() == [m["step"] for m in metrics]
        np.testing.assert_allclose(losses.values, [m["loss"] for m in metrics])
    # A second collect (in this process) reuses every cell's cached evaluation: the same numbers.
    again = collect_grid(spec, runs, serving=(1, 2, 3), progress=False)
    np.testing.assert_array_equal(again["nll"].values, ds["nll"].values)


def final_nll(run_dir: Path, depths) -> np.ndarray:
    from trainer.evaluate import evaluate_checkpoint

    return evaluate_checkpoint(latest_checkpoint(run_dir), depths, device="cpu", progress=False)["nll"].values
