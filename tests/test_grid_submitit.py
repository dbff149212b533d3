"""`depthdiag grid run --executor slurm|submitit-local` (depthdiag/slurm.py), through submitit's
local executor, which runs the Slurm path's jobs as processes of this machine: the same cells
and results as the local runner, a failed cell named with its exit status and log, and a rerun
that submits only the cells that have not finished."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("submitit")

from grid_helpers import (  # noqa: E402
    KILLED_GRID,
    final_weights,
    grid_stopped_after_a_checkpoint,
    toy_grid_folder,
    write_grid,
)

from common.errors import InputError, RunFailed  # noqa: E402
from depthdiag.cli import main  # noqa: E402
from depthdiag.grid import cell_state, collect_grid, grid_cells, load_grid  # noqa: E402
from depthdiag.grid_run import run_grid, train_command  # noqa: E402
from depthdiag.slurm import SUBMITIT_DIR, SlurmOptions, run_cell, submit_grid  # noqa: E402


@pytest.fixture
def folder(tmp_path) -> Path:
    """The grid tests' folder: a byte-level text corpus and a toy base config (seconds per run)."""
    return toy_grid_folder(tmp_path)


ONE_CELL = '[axes]\nschedule = ["uniform:1-4"]\n'
# lr = 1e3 diverges: that cell's `depthdiag train` exits 3, the other cell finishes.
ONE_FAILS = '[axes]\n"optim.lr" = [1000.0, 0.003]\n'


def submissions(runs: Path, cell: str) -> int:
    """How many times `cell` was submitted: one line in its log per submission."""
    log = runs / "logs" / (cell.replace("/", "__") + ".log")
    return log.read_text(encoding="utf-8").count(" submitted as local job ") if log.is_file() else 0


def submit(spec, runs: Path, **kwargs):
    return submit_grid(spec, runs, cluster="local", options=SlurmOptions(), jobs=2, progress=False, **kwargs)


def run_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(arg) for arg in args], prog_name="depthdiag")
    return result.exit_code, result.stdout, result.stderr


def test_the_submitit_path_collects_what_the_local_runner_does(folder):
    grid = write_grid(folder, ONE_CELL)  # one cell: the path is the same for every cell
    spec = load_grid(grid)
    code, out, err = run_cli(
        "grid", "run", grid, "--runs", folder / "jobs", "--executor", "submitit-local", "--jobs", "2", "--no-progress"
    )
    assert (code, out.strip()) == (0, f"{folder / 'jobs'}: 1 cell(s) trained, 0 already finished"), err
    run_grid(spec, folder / "local", jobs=2, progress=False)
    by_jobs = collect_grid(spec, folder / "jobs", serving=(1, 2), progress=False)
    local = collect_grid(spec, folder / "local", serving=(1, 2), progress=False)
    # Training is deterministic: the same cells give the same numbers to the bit.
    for name in ("nll", "loss", "updates", "modeled_flops"):
        np.testing.assert_array_equal(by_jobs[name].values, local[name].values)
    # Each cell's job wrote its training output to its submitit log below the runs directory.
    for cell in grid_cells(spec):
        (log,) = (folder / "jobs" / SUBMITIT_DIR / cell.name.replace("/", "__")).glob("*_log.out")
        assert log.stat().st_size > 0
    # Nothing is left to do: a rerun submits no job.
    assert submit(spec, folder / "jobs").trained == ()
    assert all(submissions(folder / "jobs", cell.name) == 1 for cell in grid_cells(spec))


@pytest.mark.slow  # 16 s; the shared loop's failure path stays in make test (test_depthdiag_grid.py)
def test_a_failed_cell_is_named_with_its_log_and_a_rerun_submits_only_it(folder, monkeypatch):
    spec = load_grid(write_grid(folder, ONE_FAILS))
    runs = folder / "runs"
    with pytest.raises(RunFailed, match=r"1 of 2 cells failed: optim.lr=1000.0 \(exit 3, log .*_log.out\)") as err:
        submit(spec, runs)
    log = Path(str(err.value).split("log ")[1].split(")")[0])
    assert log.is_relative_to(runs / SUBMITIT_DIR) and "diverged" in log.read_text(encoding="utf-8").lower()
    assert (runs / "optim.lr=0.003" / "summary.json").is_file()
    # A job that starts on a finished cell (Slurm requeued it) trains nothing.
    finished = next(cell for cell in grid_cells(spec) if cell.name == "optim.lr=0.003")
    summary = (runs / finished.name / "summary.json").stat().st_mtime_ns
    monkeypatch.chdir(folder)  # run_cell moves to the folder the grid was submitted from: undone after the test
    assert run_cell(spec, finished, runs, 1, {}, str(folder)) == 0
    assert (runs / finished.name / "summary.json").stat().st_mtime_ns == summary
    with pytest.raises(RunFailed, match="1 of 2 cells failed: optim.lr=1000.0"):
        submit(spec, runs)
    assert submissions(runs, "optim.lr=1000.0") == 2
    assert submissions(runs, "optim.lr=0.003") == 1


@pytest.mark.slow
def test_a_grid_killed_mid_cell_resumes_that_cell_from_its_checkpoint(folder):
    """`grid run --executor submitit-local` stopped (SIGTERM) while a cell's job trains: the job
    is cancelled, its training keeps its checkpoint, and the next submission trains that cell
    alone, from the checkpoint, to the weights of an uninterrupted run (a minute: slow)."""
    grid = write_grid(folder, KILLED_GRID)
    runs = folder / "runs"
    # One job at a time, so that the short cell has finished when the long one is stopped.
    assert grid_stopped_after_a_checkpoint(folder, grid, runs, "--executor", "submitit-local", "--jobs", "1") == 143
    spec = load_grid(grid)
    short, long = grid_cells(spec)
    assert (cell_state(short, runs), cell_state(long, runs)) == ("finished", "interrupted")
    report = submit(spec, runs)
    assert report.skipped == (short.name,) and report.trained == (long.name,)
    assert submissions(runs, short.name) == 1 and submissions(runs, long.name) == 2
    summary = json.loads((runs / long.name / "summary.json").read_text())
    assert summary["resumed_from"] == 10  # the checkpoint the stopped job left
    clean = run_grid(spec, folder / "clean", progress=False)
    assert long.name in clean.trained
    resumed, uninterrupted = final_weights(runs / long.name), final_weights(folder / "clean" / long.name)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_a_job_that_ends_without_a_result_is_reported(folder, monkeypatch):
    """A job killed (out of time, cancelled) returns no exit status: its state is reported."""
    import depthdiag.slurm

    spec = load_grid(write_grid(folder, '[axes]\nschedule = ["fixed:2"]\n'))
    monkeypatch.setattr(depthdiag.slurm, "run_cell", _killed)
    with pytest.raises(RunFailed, match=r"1 of 1 cells failed: schedule=fixed:2 \(job \d+ ended \w+, log "):
        submit(spec, folder / "runs")


def _killed(*args):
    raise RuntimeError("the job died")


def test_several_gpus_per_cell_train_under_torchrun(folder):
    spec = load_grid(write_grid(folder, '[axes]\nschedule = ["fixed:2"]\n'))
    (cell,) = grid_cells(spec)
    command = train_command(spec, cell, folder / "runs", resume=False, processes=4)
    assert command[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m"]
    assert command[6:8] == ["depthdiag", "train"]


def test_slurm_without_sbatch_or_submitit_is_one_clear_error(folder, monkeypatch):
    import depthdiag.slurm

    grid = write_grid(folder, '[axes]\nschedule = ["fixed:2"]\n')
    monkeypatch.setattr(depthdiag.slurm.shutil, "which", lambda name: None)
    with pytest.raises(InputError, match="no sbatch on this machine"):
        submit_grid(load_grid(grid), folder / "runs", cluster="slurm", options=SlurmOptions(partition="gpu"))
    code, _, err = run_cli("grid", "run", grid, "--slurm-partition", "gpu")
    assert code == 2 and "--slurm-* options need --executor slurm" in err
    code, _, err = run_cli("grid", "run", grid, "--executor", "slurm", "--slurm-param", "account")
    assert code == 2 and "expected KEY=VALUE" in err
    monkeypatch.setitem(sys.modules, "submitit", None)  # as if it were not installed
    code, _, err = run_cli("grid", "run", grid, "--executor", "slurm")
    assert code == 2 and err.strip().endswith("pip install 'depthdiag[slurm]'") and len(err.splitlines()) == 1
    assert not (folder / "runs").exists()


def fake_slurm(folder: Path, monkeypatch) -> None:
    """An srun and an sbatch on the PATH that refuse every job, as on a cluster without the partition."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    for name in ("srun", "sbatch"):
        (bin_dir / name).write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpu' >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_the_slurm_options_become_the_jobs_parameters(tmp_path, monkeypatch):
    """What each cell's sbatch asks for (submitit's Slurm executor is built without a cluster
    when srun is on the PATH; nothing is submitted here)."""
    import submitit

    from depthdiag.slurm import _executor

    fake_slurm(tmp_path, monkeypatch)
    options = SlurmOptions(partition="gpu", time_min=240, gpus_per_node=4, parameters=(("account", "proj"),))
    executor = _executor(submitit, "slurm", tmp_path / "jobs", "seed=0", options, threads=2)
    parameters = executor._executor.parameters
    assert {key: parameters[key] for key in ("partition", "time", "gpus_per_node", "cpus_per_task", "account")} == {
        "partition": "gpu",
        "time": 240,
        "gpus_per_node": 4,
        "cpus_per_task": 8,  # --threads for each of the 4 torchrun processes
        "account": "proj",
    }
    assert parameters["job_name"] == "depthdiag:seed=0" and parameters["stderr_to_stdout"] is True
    bad = SlurmOptions(parameters=(("bogus", 1),))
    with pytest.raises(InputError, match=r"^--slurm-param: Unknown argument 'bogus'[^\n]*$"):
        _executor(submitit, "slurm", tmp_path / "jobs", "seed=0", bad, threads=1)


def test_a_refused_submission_is_one_clear_error(folder, monkeypatch):
    fake_slurm(folder, monkeypatch)
    spec = load_grid(write_grid(folder, '[axes]\nschedule = ["fixed:2"]\n'))
    refused = r"grid.toml: cell schedule=fixed:2: submission refused: .*invalid partition specified: gpu"
    with pytest.raises(InputError, match=refused):
        submit_grid(spec, folder / "runs", cluster="slurm", options=SlurmOptions(partition="gpu"), progress=False)
