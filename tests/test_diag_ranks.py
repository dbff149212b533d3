"""`depthdiag diagnose` under torchrun (diag/driver/run.py, "across ranks"): two gloo processes on the
CPU write the results file one process writes, resume an interrupted run, and stop together
on a non-finite unit. Every run here is a subprocess with one thread, so that the float
reductions of one process and of each rank group the same way."""

import json
import subprocess
from pathlib import Path

import pytest
import xarray as xr
from helpers import run_depthdiag, write_run

from common.errors import InputError
from diag.driver.run import DiagnoseConfig, diagnose

REPO = Path(__file__).resolve().parents[1]

# 2 snapshots x 3 batches: rank 0 computes units 0, 2, 4 of the six, rank 1 units 1, 3, 5.
ARGS = ["--batches", "3", "--update-depths", "2,5", "--serving", "1-3", "--no-progress"]

# `depthdiag ARGS...` with a fault chosen by DIAGNOSE_FAULT: 'interrupt': Ctrl-C in the third
# unit (two finished); 'nan-on-rank-1': rank 1's first unit is non-finite, as a diverged model's.
FAULTY = """
import os, sys
import diag
from depthdiag.cli import main

compare, calls, fault = diag.UpdateDiagnostic.compare, [], os.environ["DIAGNOSE_FAULT"]

def faulty(self, batch):
    calls.append(1)
    if fault == "interrupt" and len(calls) == 3:
        raise KeyboardInterrupt
    unit = compare(self, batch)
    if fault == "nan-on-rank-1" and os.environ.get("RANK") == "1" and len(calls) == 1:
        unit["nll"][...] = float("nan")
    return unit

diag.UpdateDiagnostic.compare = faulty
main(sys.argv[1:], prog_name="depthdiag")
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("run"))


def depthdiag(tmp_path: Path, *args, ranks: int = 1, fault: str | None = None) -> subprocess.CompletedProcess:
    """`depthdiag diagnose ARGS` in one process or under torchrun with `ranks` gloo processes
    (helpers.run_depthdiag); with `fault`, through FAULTY."""
    if fault is None:
        return run_depthdiag("diagnose", *args, ranks=ranks)
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    return run_depthdiag("diagnose", *args, ranks=ranks, script=script, env={"DIAGNOSE_FAULT": fault})


def comparable(path: Path) -> xr.Dataset:
    """The results file without the attributes that record when and from what source it was written."""
    with xr.open_dataset(path, engine="h5netcdf") as ds:
        ds = ds.load()
    for key in ("created", "git_commit", "git_dirty"):
        ds.attrs.pop(key, None)
    return ds


@pytest.mark.slow  # 2 ranks twice, 35 s; 2 ranks stay in make test (a non-finite unit, the sharded file)
def test_two_ranks_write_the_file_one_process_writes_and_resume_it(run, tmp_path):
    snapshots = [run[4], run[2], run["checkpoint"]]
    single = tmp_path / "single.h5"
    result = depthdiag(tmp_path, *snapshots, *ARGS, "--out", single)
    assert result.returncode == 0, result.stderr

    ranks = tmp_path / "ranks.h5"
    result = depthdiag(tmp_path, *snapshots, *ARGS, "--out", ranks, ranks=2)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"wrote {ranks}"]  # rank 0 alone says so
    assert not (tmp_path / "ranks.h5.parts").exists() and not (tmp_path / ".ranks.h5.lock").exists()
    xr.testing.assert_identical(comparable(ranks), comparable(single))
    # The young optimizers' warning, once per snapshot although both ranks compute units of each.
    warned = [line for line in result.stderr.splitlines() if "bias correction" in line]
    assert sorted(line.split(": ")[1] for line in warned) == sorted(map(str, snapshots)), result.stderr

    # Rank 0's refusal (OUT exists) is every rank's, with its line.
    result = depthdiag(tmp_path, *snapshots, *ARGS, "--out", ranks, ranks=2)
    errors = [line for line in result.stderr.splitlines() if line.startswith("depthdiag: error:")]
    assert errors == [f"depthdiag: error: {ranks}: already exists; pass --force to overwrite it"] * 2, result.stderr

    # A run interrupted with two units finished, resumed at two ranks: the same file.
    resumed, parts = tmp_path / "resumed.h5", tmp_path / "resumed.h5.parts"
    result = depthdiag(tmp_path, *snapshots, *ARGS, "--out", resumed, fault="interrupt")
    assert result.returncode == 130, result.stderr
    assert sorted(p.name for p in parts.glob("*.h5")) == ["snap-u00.b00000.h5", "snap-u00.b00001.h5"]
    result = depthdiag(tmp_path, *snapshots, *ARGS, "--out", resumed, "--resume", ranks=2)
    assert result.returncode == 0, result.stderr
    assert not parts.exists()
    xr.testing.assert_identical(comparable(resumed), comparable(single))


def test_a_non_finite_unit_on_one_rank_stops_both_with_one_error_line(run, tmp_path):
    out, parts = tmp_path / "r.h5", tmp_path / "r.h5.parts"
    result = depthdiag(tmp_path, run[2], run[4], *ARGS, "--out", out, ranks=2, fault="nan-on-rank-1")
    assert result.returncode != 0
    errors = {line for line in result.stderr.splitlines() if line.startswith("depthdiag: error:")}
    # Rank 1's first unit is the second of the list, snap-u00's batch 1; rank 0 finished batch 0
    # of snap-u00, deleted with the diverged snapshot, so nothing is kept.
    assert errors == {
        f"depthdiag: error: {run[2]}: batch 1: non-finite NLL (nan); the snapshot's model has "
        "diverged or its update overflows, so it cannot be diagnosed (nothing written)"
    }, result.stderr
    assert not out.exists() and not parts.exists()


def test_models_handed_over_whole_are_refused_under_torchrun(run, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # refused before any process group is joined
    config = DiagnoseConfig(snapshots=(), adapter="some.module:load", out=str(tmp_path / "r.h5"))
    with pytest.raises(InputError, match="--adapter: under torchrun only snapshot or checkpoint files"):
        diagnose(config)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_random_forwards_units_are_the_same_in_one_process_and_on_two_ranks(tmp_path):
    """A model that draws its initial state in its forward (tests/random_start_worker.py): every
    unit's NLLs and benefit, computed by whichever rank the unit goes to, equal one process's."""
    script = REPO / "tests" / "random_start_worker.py"
    for ranks in (1, 2):
        result = run_depthdiag(tmp_path / f"ranks{ranks}.json", ranks=ranks, script=script)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"ranks{ranks}.json").read_text()) for ranks in (1, 2))
    assert one == two and len(one) == 4
