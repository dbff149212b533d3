"""diag/driver/run.py, the driver of `depthdiag diagnose` (depthdiag/cli/diagnose.py): snapshot files in,
one results file out; resume after a kill."""

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from click.testing import CliRunner
from helpers import BATCH, CARRIED, SEQ, SERVING, TRAINING_MACHINE, UPDATE_DEPTHS, run_config, write_run

import diag
from analysis.store import open_results, write_dataset
from common.depths import parse_update_depths
from common.errors import InputError
from depthdiag.cli import main
from diag.driver.run import DiagnoseConfig, diagnose
from trainer.checkpoint import load_snapshot
from trainer.config import DataConfig, RunConfig
from trainer.data.sources import build_source
from trainer.model import ModelConfig

# The runs here are a few updates long, so compare_updates warns about Adam's bias correction
# throughout; the warning the command prints has its own test at the end.
pytestmark = pytest.mark.filterwarnings("ignore::diag.BiasCorrectionWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("run"))


def expected_unit(path, batch, **kwargs):
    snap = load_snapshot(path)
    model = snap.model()
    return diag.compare_updates(
        model,
        snap.optimizer(model),
        batch,
        snap.eval_tokens,
        update_depths=UPDATE_DEPTHS,
        serving_depths=SERVING,
        grad_clip=snap.config.optim.grad_clip,
        **kwargs,
    )


def test_results_file_follows_the_schema_and_matches_compare_updates(run, tmp_path):
    out = tmp_path / "results.h5"
    config = DiagnoseConfig(
        snapshots=(str(run[4]), str(run[2])),
        out=str(out),
        update_depths=UPDATE_DEPTHS,
        serving_depths=SERVING,
        batches=2,
        eval_set="snapshot",
        progress=False,
    )
    assert diagnose(config) == out
    assert not out.with_name("results.h5.parts").exists()
    ds = open_results(out)
    assert list(ds.snapshot.values) == ["snap-u00", "snap-u02"]  # sorted by uniform updates
    assert list(ds.uniform_updates.values) == [0, 2] and list(ds.step.values) == [2, 4]
    assert ds.nll.dims == ("snapshot", "batch", "update_depth", "serving_depth")
    assert ds.sizes == {"snapshot": 2, "batch": 2, "update_depth": 2, "serving_depth": 5}
    for s, step in enumerate((2, 4)):
        snap = load_snapshot(run[step])
        for b in range(2):
            unit = expected_unit(run[step], snap.batches[b])
            np.testing.assert_allclose(ds.nll.values[s, b], unit.nll.values, rtol=0, atol=1e-9)
            np.testing.assert_allclose(ds.benefit.values[s, b], unit.benefit.values, rtol=0, atol=1e-9)
            np.testing.assert_allclose(ds.update_rms.values[s, b], unit.update_rms.values, rtol=1e-9)
            assert float(ds.update_cosine.values[s, b]) == pytest.approx(float(unit.update_cosine), abs=1e-9)
        np.testing.assert_allclose(ds.nll_before.values[s], unit.nll_before.values, rtol=0, atol=1e-9)
    assert ds.attrs["isolate"] == "counterfactual" and ds.attrs["rms_match"] == "reference"
    assert ds.attrs["eval_set"] == "snapshot"
    assert set(json.loads(ds.attrs["snapshot_sha256"])) == {"snap-u00", "snap-u02"}
    assert "torch_version" in ds.attrs and "config" in ds.attrs and "created" in ds.attrs
    assert ds.lr.values.tolist() == [7e-3, 7e-3]


def test_results_say_which_machines_trained_and_diagnosed_them(run, tmp_path):
    from trainer.machine import machine

    out = tmp_path / "results.h5"
    config = DiagnoseConfig(
        snapshots=(str(run[2]), str(run["checkpoint"])),
        out=str(out),
        update_depths=UPDATE_DEPTHS,
        serving_depths=SERVING,
        batches=1,
        eval_set="snapshot",
        progress=False,
    )
    diagnose(config)
    ds = open_results(out)
    assert json.loads(ds.attrs["machine"]) == machine("cpu")
    # The snapshot names its training machine; the checkpoint, written without one, adds nothing.
    assert json.loads(ds.attrs["trained_on"]) == [TRAINING_MACHINE]
    assert json.loads(ds.attrs["diagnose_manifest"])["machine"] == machine("cpu")


def interrupted_after_one_unit(monkeypatch, args: list, out: Path) -> None:
    """`diagnose ARGS --out OUT` interrupted (Ctrl-C) once its first unit is written."""
    compare = diag.UpdateDiagnostic.compare
    calls = []

    def crash_after_one(self, batch):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return compare(self, batch)

    with monkeypatch.context() as patch:
        patch.setattr(diag.UpdateDiagnostic, "compare", crash_after_one)
        assert cli(*args, "--out", out).exit_code != 0


def test_a_resume_on_another_machine_is_refused_and_keeps_the_finished_units(run, tmp_path, monkeypatch):
    import diag.driver.parts as parts_module

    args = [run[2], "--batches", 2, *SMALL]
    out, parts = tmp_path / "r.h5", tmp_path / "r.h5.parts"
    interrupted_after_one_unit(monkeypatch, args, out)
    finished = listing(parts)
    elsewhere = {**parts_module.machine("cpu"), "bf16_matmul": "another kernel"}
    monkeypatch.setattr(parts_module, "machine", lambda device: elsewhere)
    result = cli(*args, "--out", out, "--resume")
    assert result.exit_code == 2
    assert "the unfinished run computed its units on " in result.stderr
    assert "bf16 matmul another kernel" in result.stderr
    assert listing(parts) == finished and not out.exists()


def test_checkpoints_draw_the_runs_next_batches(run, tmp_path):
    out = tmp_path / "ckpt.h5"
    diagnose(
        DiagnoseConfig(
            snapshots=(str(run["checkpoint"]),),
            out=str(out),
            update_depths=UPDATE_DEPTHS,
            serving_depths=SERVING,
            batches=2,
            isolate="none",
            eval_set="snapshot",
            progress=False,
        )
    )
    ds = open_results(out)
    cfg = run_config()
    batch = build_source(cfg.data).batch(cfg.train.seed, 5 + 1, BATCH, SEQ)
    unit = expected_unit(run["checkpoint"], batch, isolate="none")
    np.testing.assert_allclose(ds.nll.values[0, 1], unit.nll.values, rtol=0, atol=1e-9)
    assert ds.attrs["batch_source"] == '{"ckpt-000005": "data"}' and ds.attrs["isolate"] == "none"


def test_bios_runs_are_scored_on_the_evaluation_presentations_by_default(run, tmp_path):
    out = tmp_path / "attributes.h5"
    diagnose(
        DiagnoseConfig(
            snapshots=(str(run[2]),),
            out=str(out),
            update_depths=UPDATE_DEPTHS,
            serving_depths=SERVING,
            batches=1,
            progress=False,
        )
    )  # eval_set 'auto
    ds = open_results(out)
    assert ds.attrs["eval_set"] == "attributes"
    cfg = run_config()
    tokens, mask = build_source(cfg.data).attribute_eval(cfg.data.eval_sequences, SEQ)
    snap = load_snapshot(run[2])
    model = snap.model()
    unit = diag.compare_updates(
        model,
        snap.optimizer(model),
        snap.batches[0],
        tokens,
        eval_mask=mask,
        update_depths=UPDATE_DEPTHS,
        serving_depths=SERVING,
        grad_clip=snap.config.optim.grad_clip,
    )
    np.testing.assert_allclose(ds.nll.values[0, 0], unit.nll.values, rtol=0, atol=1e-9)


def test_attribute_evaluation_set_needs_a_bios_run_and_auto_takes_the_snapshots_set(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a few words of text, repeated. " * 40, encoding="utf-8")
    config = run_config()
    config = RunConfig(
        model=ModelConfig(**{**config.model.to_dict(), "vocab_size": 256}),
        data=DataConfig(source="text", path=str(corpus), eval_sequences=4),
        optim=config.optim,
        train=config.train,
    )
    paths = write_run(tmp_path, config)
    result = cli(paths[2], "--out", tmp_path / "r.h5", "--eval-set", "attributes")
    assert result.exit_code == 2 and "needs a bioS run" in result.output
    assert not (tmp_path / "r.h5").exists() and not (tmp_path / "r.h5.parts").exists()
    assert cli(paths[2], "--out", tmp_path / "r.h5", "--batches", 1, "--no-progress").exit_code == 0
    assert open_results(tmp_path / "r.h5").attrs["eval_set"] == "snapshot"


def cli(*args):
    return CliRunner().invoke(main, ["diagnose", *map(str, args)])


def test_refusals_are_one_line_errors(run, tmp_path):
    (tmp_path / "other").mkdir()
    other = write_run(tmp_path / "other", run_config(d_model=16))
    out = tmp_path / "r.h5"
    result = cli(run[2], other[2], "--out", out)
    assert result.exit_code == 2 and "model config differs" in result.output and "d_model" in result.output
    no_optimizer = tmp_path / "no-opt.pt"
    payload = torch.load(run[2], weights_only=True)
    del payload["optimizer"]
    torch.save(payload, no_optimizer)
    result = cli(no_optimizer, "--out", out)
    assert result.exit_code == 2 and "optimizer" in result.output and len(result.output.strip().splitlines()) == 1
    result = cli(run[2], "--out", out, "--batches", CARRIED + 1)
    assert result.exit_code == 2 and "carries 6 batches" in result.output
    result = cli(run[2], "--out", out, "--update-depths", "4")
    assert result.exit_code == 2 and "at least two" in result.output
    assert cli(run[2], "--out", out, "--batches", 1, "--serving", "1-2", "--no-progress").exit_code == 0
    result = cli(run[2], "--out", out, "--batches", 1, "--serving", "1-2")
    assert result.exit_code == 2 and "already exists" in result.output
    assert cli(run[2], "--out", out, "--batches", 1, "--serving", "1-2", "--force").exit_code == 0
    # Resuming a finished run with the same settings has nothing to do; other settings are refused.
    assert cli(run[2], "--out", out, "--batches", 1, "--serving", "1-2", "--resume").exit_code == 0
    assert cli(run[2], "--out", out, "--batches", 1, "--serving", "1-3", "--resume").exit_code == 2
    parts = tmp_path / "r.h5.parts"
    parts.mkdir()
    result = cli(run[2], "--out", out, "--batches", 1, "--serving", "1-2", "--force", "--resume")
    assert result.exit_code == 2 and "contradict" in result.output
    result = cli(run[2], "--out", out, "--batches", 1, "--serving", "1-2")
    assert result.exit_code == 2 and "--resume" in result.output


def test_parse_update_depths_keeps_the_order():
    assert parse_update_depths("16,4") == (16, 4)
    assert parse_update_depths("4,1-3") == (4, 1, 2, 3)
    with pytest.raises(InputError):
        parse_update_depths("4,x")


def finished_parts(parts: Path) -> list[Path]:
    # Hidden files are temporaries of the atomic writes the kill interrupted.
    return [p for p in parts.glob("*.h5") if not p.name.startswith(".")] if parts.is_dir() else []


def comparable(path):
    with xr.open_dataset(path, engine="h5netcdf") as ds:
        ds = ds.load()
    del ds.attrs["created"]
    return ds


# `depthdiag diagnose ARGS...` whose second unit file, once written (atomically: on disk
# under its name), is reported by a byte on the pipe whose write end is the first argument,
# after which the command waits forever: the test kills it there, at a known point.
HOLD_AFTER_TWO_UNITS = """
import os, sys, threading
from pathlib import Path
import diag.driver.run
from depthdiag.cli import main

report, write, written = int(sys.argv[1]), diag.driver.run.write_dataset, []

def write_then_hold(ds, path):
    write(ds, path)
    if Path(path).parent.name.endswith(".parts"):
        written.append(path)
        if len(written) == 2:
            os.write(report, b"2")
            threading.Event().wait()

diag.driver.run.write_dataset = write_then_hold
main(sys.argv[2:], prog_name="depthdiag")
"""


def test_killed_run_resumed_equals_uninterrupted_run(run, tmp_path, monkeypatch):
    batches = 3  # of each snapshot: the kill comes after 2 of its 6 units
    args = [run[2], run[4], "--batches", batches, "--update-depths", "2,8", "--serving", "1-8", "--no-progress"]
    full = tmp_path / "full.h5"
    assert cli(*args, "--out", full).exit_code == 0

    out = tmp_path / "killed.h5"
    parts = tmp_path / "killed.h5.parts"
    # The same thread count as this process: float reductions may group differently otherwise.
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    report, child_end = os.pipe()
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_AFTER_TWO_UNITS, str(child_end), "diagnose", *map(str, args), "--out", out],
            env=env,
            pass_fds=(child_end,),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    os.close(child_end)  # the child's end only: a child that exits closes the pipe, and the read sees b""
    with os.fdopen(report, "rb") as reported:
        ready, _, _ = select.select([reported], [], [], 300)
        word = reported.read(1) if ready else b"(no word in 300 s)"
    proc.kill()
    proc.wait()
    assert word == b"2" and proc.returncode == -signal.SIGKILL, (word, (tmp_path / "stderr").read_text())
    finished = len(finished_parts(parts))
    assert finished == 2 and not out.exists()

    result = cli(*args, "--out", out)
    assert result.exit_code == 2 and "--resume" in result.output
    computed = []
    compare = diag.UpdateDiagnostic.compare
    monkeypatch.setattr(
        diag.UpdateDiagnostic, "compare", lambda self, batch: computed.append(1) or compare(self, batch)
    )
    assert cli(*args, "--out", out, "--resume").exit_code == 0
    assert len(computed) == 2 * batches - finished  # finished units are reused, not recomputed
    assert not parts.exists()
    xr.testing.assert_identical(comparable(out), comparable(full))


# --- one writer per output, resume that finishes what it can, bounded depths, non-finite units ---

SMALL = ["--update-depths", "2,5", "--serving", "1-3", "--no-progress"]


def listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_live_runs_output_and_parts_are_never_touched_by_a_second_run(run, tmp_path):
    from helpers import start_holder

    out, parts = tmp_path / "r.h5", tmp_path / "r.h5.parts"
    parts.mkdir()
    (parts / "manifest.json").write_text("{}")
    (parts / "snap-u00.b00000.h5").write_bytes(b"a finished unit")
    write_dataset(xr.Dataset(attrs={"note": "a finished file"}), out)
    finished = out.read_bytes()
    before = listing(parts)
    holder = start_holder(out)  # a diagnose on OUT in another process, as far as the lock goes
    try:
        for flag in ("--force", "--resume"):
            result = cli(run[2], "--out", out, "--batches", 1, *SMALL, flag)
            assert result.exit_code == 2, result.output
            assert result.stderr.strip().splitlines() == [
                f"depthdiag: error: {out}: in use by another depthdiag process (pid {holder.pid}); "
                "wait for it to finish or stop it"
            ]
            assert listing(parts) == before and out.read_bytes() == finished
    finally:
        holder.kill()
        holder.wait()
    # The holder gone (however it ended), --force starts over.
    assert cli(run[2], "--out", out, "--batches", 1, *SMALL, "--force").exit_code == 0
    assert not parts.exists() and open_results(out).sizes["batch"] == 1


def test_the_lock_is_held_for_the_whole_run(run, tmp_path, monkeypatch):
    from common.lock import lock_path

    out = tmp_path / "r.h5"
    held = []
    compare = diag.UpdateDiagnostic.compare
    monkeypatch.setattr(
        diag.UpdateDiagnostic,
        "compare",
        lambda self, batch: held.append(lock_path(out).read_text().strip()) or compare(self, batch),
    )
    assert cli(run[2], "--out", out, "--batches", 2, *SMALL).exit_code == 0
    assert held == [str(os.getpid())] * 2 and not lock_path(out).exists()


def interrupted_run(run, out: Path, monkeypatch, *, finished: int) -> None:
    """Leave OUT.parts/ with `finished` of the snapshot's 4 units done, as a crash would."""
    calls = []
    compare = diag.UpdateDiagnostic.compare

    def crash_after(self, batch):
        if len(calls) == finished:
            raise KeyboardInterrupt
        calls.append(1)
        return compare(self, batch)

    with monkeypatch.context() as patch:
        patch.setattr(diag.UpdateDiagnostic, "compare", crash_after)
        result = cli(run[2], "--out", out, "--batches", 4, *SMALL)
    assert result.exit_code != 0 and len(finished_parts(out.with_name(out.name + ".parts"))) == finished


def test_resume_after_a_kill_during_the_cleanup_accepts_the_complete_file(run, tmp_path, monkeypatch):
    out, parts = tmp_path / "r.h5", tmp_path / "r.h5.parts"
    interrupted_run(run, out, monkeypatch, finished=2)
    leftover = listing(parts)
    assert cli(run[2], "--out", out, "--batches", 4, *SMALL, "--resume").exit_code == 0
    complete = out.read_bytes()
    # A kill in the parts' removal: OUT complete, some parts (the manifest gone first) still there.
    parts.mkdir()
    for name, data in leftover.items():
        if name != "manifest.json":
            (parts / name).write_bytes(data)
    computed = []
    monkeypatch.setattr(diag.UpdateDiagnostic, "compare", lambda self, batch: computed.append(1))
    result = cli(run[2], "--out", out, "--batches", 4, *SMALL, "--resume")
    assert result.exit_code == 0, result.output
    assert "already complete" in result.stderr and str(parts) in result.stderr
    assert not parts.exists() and out.read_bytes() == complete and computed == []


def test_resume_recomputes_damaged_unit_files_and_removes_stale_temporaries(run, tmp_path, monkeypatch):
    full = tmp_path / "full.h5"
    assert cli(run[2], "--out", full, "--batches", 4, *SMALL).exit_code == 0
    out, parts = tmp_path / "r.h5", tmp_path / "r.h5.parts"
    interrupted_run(run, out, monkeypatch, finished=3)
    damaged = parts / "snap-u00.b00001.h5"
    damaged.write_bytes(damaged.read_bytes()[:200])  # a torn write of an older version, a bad disk
    stale_part = parts / ".snap-u00.b00003.h5.abcd1234.tmp.h5"  # what kill -9 leaves in a write
    stale_out = tmp_path / ".r.h5.abcd1234.tmp.h5"
    for path in (stale_part, stale_out):
        path.write_bytes(b"half")
    seen = []
    compare = diag.UpdateDiagnostic.compare
    monkeypatch.setattr(
        diag.UpdateDiagnostic,
        "compare",
        lambda self, batch: seen.append((stale_part.exists(), stale_out.exists())) or compare(self, batch),
    )
    result = cli(run[2], "--out", out, "--batches", 4, *SMALL, "--resume")
    assert result.exit_code == 0, result.output
    (warning,) = [line for line in result.stderr.splitlines() if "damaged" in line]
    assert warning.startswith(f"warning: {parts}: 1 damaged unit file") and damaged.name in warning
    assert seen == [(False, False)] * 2  # the damaged unit and the one never finished
    xr.testing.assert_identical(comparable(out), comparable(full))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.h5", "r.h5"]


def test_depths_are_bounded_unless_max_depth_allows_more(run, tmp_path):
    out = tmp_path / "r.h5"
    for option, value in (("--update-depths", "2,65"), ("--serving", "1-65")):
        result = cli(run[2], "--out", out, "--batches", 1, option, value)
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert option in line and "<= 64" in line and "--max-depth" in line
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InputError, match="depth 65 is above the maximum 64"):
        DiagnoseConfig(snapshots=(str(run[2]),), out=str(out), update_depths=(2, 65))
    result = cli(run[2], "--out", out, "--batches", 1, "--update-depths", "2,65", "--serving", "65", "--max-depth", 65)
    assert result.exit_code == 0, result.output
    assert open_results(out)["update_depth"].values.tolist() == [2, 65]
    assert "--max-depth" in CliRunner().invoke(main, ["diagnose", "--help"]).output


def test_a_non_finite_unit_stops_the_run_naming_the_snapshot_and_batch(run, tmp_path, monkeypatch):
    out, parts = tmp_path / "r.h5", tmp_path / "r.h5.parts"
    calls = []
    compare = diag.UpdateDiagnostic.compare

    def diverged_at_the_second(self, batch):
        unit = compare(self, batch)
        calls.append(1)
        if len(calls) == 2:
            unit["nll"][...] = np.nan  # what a diverged model's update gives
        return unit

    with monkeypatch.context() as patch:
        patch.setattr(diag.UpdateDiagnostic, "compare", diverged_at_the_second)
        result = cli(run[2], "--out", out, "--batches", 3, *SMALL)
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.stderr.splitlines() if not line.startswith("warning:")]
    assert line.startswith("depthdiag: error: ") and f"{run[2]}: batch 1: non-finite NLL (nan)" in line
    assert not out.exists() and not parts.exists() and list(tmp_path.iterdir()) == []
    # Nothing is in the way of the next run, without --force.
    assert cli(run[2], "--out", out, "--batches", 3, *SMALL).exit_code == 0


def test_a_non_finite_unit_keeps_the_other_snapshots_finished_units_for_the_resume(run, tmp_path, monkeypatch):
    bad = tmp_path / "snap-u02.pt"
    bad.write_bytes(run[4].read_bytes())
    args = [run[2], bad, "--batches", 2, *SMALL]
    out, parts = tmp_path / "r.h5", tmp_path / "r.h5.parts"
    compare = diag.UpdateDiagnostic.compare
    interrupted_after_one_unit(monkeypatch, args, out)
    assert [p.name for p in finished_parts(parts)] == ["snap-u00.b00000.h5"]

    # The resumed session finishes snap-u00, then snap-u02 diverges at its second batch.
    computed = []

    def diverged_at_the_second_of_snap_u02(self, batch):
        unit = compare(self, batch)
        computed.append(1)
        if len(computed) == 3:
            unit["update_rms"][...] = np.inf
        return unit

    with monkeypatch.context() as patch:
        patch.setattr(diag.UpdateDiagnostic, "compare", diverged_at_the_second_of_snap_u02)
        result = cli(*args, "--out", out, "--resume")
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.stderr.splitlines() if not line.startswith("warning:")]
    assert line == (
        f"depthdiag: error: {bad}: batch 1: non-finite update RMS (inf); the snapshot's model has diverged or its "
        f"update overflows, so it cannot be diagnosed; the 2 finished unit(s) of the other snapshots are kept in "
        f"{parts}: remove or replace {bad} and rerun with --resume"
    )
    assert sorted(p.name for p in finished_parts(parts)) == ["snap-u00.b00000.h5", "snap-u00.b00001.h5"]
    assert not out.exists()

    # A replacement under the same name is another file: only its units are computed.
    payload = torch.load(run[4], weights_only=True)
    payload["lr"] = 6e-3
    torch.save(payload, bad)
    computed.clear()
    with monkeypatch.context() as patch:
        patch.setattr(diag.UpdateDiagnostic, "compare", lambda self, batch: computed.append(1) or compare(self, batch))
        result = cli(*args, "--out", out, "--resume")
    assert result.exit_code == 0, result.output
    assert len(computed) == 2 and not parts.exists()
    full = tmp_path / "full.h5"
    assert cli(*args, "--out", full).exit_code == 0
    xr.testing.assert_identical(comparable(out), comparable(full))


def test_a_resume_that_would_drop_finished_units_is_refused_and_deletes_nothing(run, tmp_path, monkeypatch):
    out, parts = tmp_path / "r.h5", tmp_path / "r.h5.parts"
    interrupted_run(run, out, monkeypatch, finished=2)
    before = listing(parts)
    for other in ([run[4], "--batches", 4, *SMALL], [run[2], "--batches", 3, *SMALL], [run[2], "--batches", 4]):
        result = cli(*other, "--out", out, "--resume")
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert str(parts) in line and "--force" in line
        assert listing(parts) == before


def test_the_bias_correction_warning_is_shown_once_per_snapshot(run, tmp_path):
    # The snapshots' AdamW has taken 2 and 4 steps, far below 3 / (1 - 0.95) = 60.
    args = [run[2], run[4], "--out", tmp_path / "r.h5", "--batches", 2, "--serving", "1-2", "--no-progress"]
    result = CliRunner().invoke(main, ["diagnose", *map(str, args)])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "bias correction" in line]
    assert warnings == [
        f"warning: {run[2]}: the optimizer has taken 2 steps (< 3 / (1 - beta2) = 60), so Adam's bias correction "
        "makes its updates sign-like and the diagnostic reflects normalisation more than curvature; diagnose a "
        "state from later in training (docs/diagnostic.md)",
        f"warning: {run[4]}: the optimizer has taken 4 steps (< 3 / (1 - beta2) = 60), so Adam's bias correction "
        "makes its updates sign-like and the diagnostic reflects normalisation more than curvature; diagnose a "
        "state from later in training (docs/diagnostic.md)",
    ]
