"""trainer/train.py, the training loop: loss going down, metrics, exact resume, refusals (its LR
schedule: tests/test_optim.py; its logging: tests/test_train_logging.py; its fast paths:
tests/test_train_fast_paths.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Interrupt, read_metrics, start_holder, text_corpus, tiny_config, without_wall_time

from common.errors import InputError, RunFailed
from trainer.checkpoint import latest_checkpoint, load_snapshot
from trainer.flops import update_flops
from trainer.optim import lr_at
from trainer.schedules import parse_schedule
from trainer.train import train

# --- the loop -----------------------------------------------------------------------------


def test_loss_decreases_and_metrics_follow_the_schedule(tmp_path):
    config = tiny_config(text_corpus(tmp_path), updates=40, checkpoint_every=0, snapshot_uniform_updates=[])
    summary = train(config, tmp_path / "run", progress=False)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(40))
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert summary.final_loss == losses[-1]

    schedule = parse_schedule(config.train.schedule, seed=config.train.seed, total_updates=40)
    assert [r["depth"] for r in records] == [schedule.depth_at(s) for s in range(40)]
    assert [r["lr"] for r in records] == [lr_at(s, config.optim, 40) for s in range(40)]
    tokens_per_update = config.train.batch_size * config.train.seq_len
    assert [r["tokens"] for r in records] == [tokens_per_update * (s + 1) for s in range(40)]
    modeled = np.cumsum([update_flops(config.model, schedule.depth_at(s), batch_size=8, seq_len=16) for s in range(40)])
    np.testing.assert_allclose([r["flops"] for r in records], modeled, rtol=1e-12)
    walls = [r["wall_time"] for r in records]
    assert all(b > a for a, b in zip(walls, walls[1:]))


def test_sgd_and_coarser_logging(tmp_path):
    config = tiny_config(text_corpus(tmp_path), updates=9, log_every=4, checkpoint_every=0, snapshot_uniform_updates=[])
    config = config.with_overrides(["optim.name='sgd'", "optim.lr=0.05"])
    train(config, tmp_path / "run", progress=False)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [3, 7, 8]
    assert load_snapshot(latest_checkpoint(tmp_path / "run")).optimizer_class == "SGD"


def straight_and_killed_runs(config, tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """`config` trained to the end into tmp_path/straight, and into tmp_path/resumed killed in
    the middle of update 7 (its checkpoint after update 4 kept)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(config, straight, progress=False)
    import trainer.train as train_module

    monkeypatch.setattr(train_module, "update_flops", Interrupt(update_flops, 7))
    with pytest.raises(KeyboardInterrupt):
        train(config, resumed, progress=False)
    monkeypatch.undo()
    return straight, resumed


@pytest.mark.parametrize(
    "setting",
    [
        {"precision": "fp32"},
        {"precision": "bf16"},
        # 48 s of compiling in a fresh process; compiled blocks stay in make test (test_train_fast_paths.py).
        pytest.param({"precision": "bf16", "compile": True}, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_interrupt_then_resume_is_bit_exact(tmp_path, monkeypatch, setting):
    corpus = text_corpus(tmp_path)
    config = tiny_config(corpus, **setting)  # 12 updates, checkpoints every 4
    straight, resumed = straight_and_killed_runs(config, tmp_path, monkeypatch)
    assert latest_checkpoint(resumed).name == "step_000004.pt"  # at most one checkpoint interval lost
    assert not list(resumed.rglob("*.tmp*"))
    summary = train(config, resumed, resume=True, progress=False)
    assert summary.resumed_from == 4

    assert [r["loss"] for r in read_metrics(resumed)] == [r["loss"] for r in read_metrics(straight)]
    assert [r["step"] for r in read_metrics(resumed)] == list(range(12))
    a, b = load_snapshot(straight / "checkpoints/step_000012.pt"), load_snapshot(resumed / "checkpoints/step_000012.pt")
    for name, tensor in a.model_state.items():
        assert torch.equal(tensor, b.model_state[name]), name
    for index, state in a.optimizer_state["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b.optimizer_state["state"][index][key]), (index, key)
    assert a.progress["tokens"] == b.progress["tokens"] and a.progress["flops"] == b.progress["flops"]
    for name in ("u0000_step000006.pt", "u0002_step000008.pt"):
        sa, sb = load_snapshot(straight / "snapshots" / name), load_snapshot(resumed / "snapshots" / name)
        assert all(torch.equal(v, sb.model_state[k]) for k, v in sa.model_state.items())


def test_the_run_records_the_machines_that_trained_it(tmp_path, monkeypatch):
    import trainer.run_setup as run_setup_module
    from trainer.machine import machine

    corpus = text_corpus(tmp_path)
    config = tiny_config(corpus)
    straight, resumed = straight_and_killed_runs(config, tmp_path, monkeypatch)
    here = machine("cpu")
    assert load_snapshot(straight / "snapshots/u0000_step000006.pt").trained_on == (here,)
    assert json.loads((straight / "summary.json").read_text())["trained_on"] == [here]
    # The killed run resumes on another machine: what it writes from then on names both, in order.
    elsewhere = {**here, "bf16_matmul": "another kernel", "bf16_matrix_units": 0}
    monkeypatch.setattr(run_setup_module, "machine", lambda device: elsewhere)
    train(config, resumed, resume=True, progress=False)
    assert load_snapshot(resumed / "checkpoints/step_000004.pt").trained_on == (here,)
    assert load_snapshot(resumed / "snapshots/u0000_step000006.pt").trained_on == (here, elsewhere)
    assert load_snapshot(resumed / "checkpoints/step_000012.pt").trained_on == (here, elsewhere)
    assert json.loads((resumed / "summary.json").read_text())["trained_on"] == [here, elsewhere]


def test_a_resume_may_change_only_what_observes_the_run_and_trains_the_same_weights(tmp_path, monkeypatch):
    corpus = text_corpus(tmp_path)
    config = tiny_config(corpus, snapshot_uniform_updates=[])
    straight, resumed = straight_and_killed_runs(config, tmp_path, monkeypatch)
    observed = config.with_overrides(["train.log_every=2", "train.eval_every=4", "train.eval_depths='1-2'"])
    summary = train(observed, resumed, resume=True, progress=False)
    assert summary.resumed_from == 4
    assert any("val_nll_2" in r for r in read_metrics(resumed))  # the new evaluation ran
    a, b = load_snapshot(straight / "checkpoints/step_000012.pt"), load_snapshot(resumed / "checkpoints/step_000012.pt")
    assert all(torch.equal(tensor, b.model_state[name]) for name, tensor in a.model_state.items())
    # What changes the training is still refused.
    with pytest.raises(InputError, match=r"another config \(optim.lr: 0.003 -> 0.001\)"):
        train(config.with_overrides(["optim.lr=0.001"]), resumed, resume=True, progress=False)


def test_resume_inside_a_logging_interval_logs_what_an_uninterrupted_run_logs(tmp_path, monkeypatch):
    config = tiny_config(text_corpus(tmp_path), log_every=3, checkpoint_every=4, snapshot_uniform_updates=[])
    train(config, tmp_path / "straight", progress=False)
    import trainer.train as train_module

    monkeypatch.setattr(train_module, "update_flops", Interrupt(update_flops, 7))
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "resumed", progress=False)
    monkeypatch.undo()
    train(config, tmp_path / "resumed", resume=True, progress=False)

    assert without_wall_time(tmp_path / "resumed") == without_wall_time(tmp_path / "straight")


def test_resume_with_another_config_is_refused_and_writes_nothing(tmp_path):
    config = tiny_config(text_corpus(tmp_path), updates=4, snapshot_uniform_updates=[])
    run = tmp_path / "run"
    train(config, run, progress=False)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    other = config.with_overrides(["train.updates=8", "optim.lr=0.01"])
    with pytest.raises(InputError, match=r"step_000004\.pt: .*optim\.lr: 0\.003 -> 0\.01; train\.updates: 4 -> 8"):
        train(other, run, resume=True, progress=False)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_fresh_run_into_an_existing_run_is_refused_unless_forced(tmp_path):
    config = tiny_config(text_corpus(tmp_path), updates=4, snapshot_uniform_updates=[])
    train(config, tmp_path / "run", progress=False)
    first = without_wall_time(tmp_path / "run")
    with pytest.raises(InputError, match="run: already exists; resume it with --resume, replace it with --force"):
        train(config, tmp_path / "run", progress=False)
    (tmp_path / "run" / "checkpoints" / ".step_000002.pt.abcd1234.tmp.pt").write_bytes(b"left by a kill")
    train(config, tmp_path / "run", force=True, progress=False)
    assert without_wall_time(tmp_path / "run") == first  # started over, not appended to
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["latest", "step_000004.pt"]
    with pytest.raises(InputError, match="no checkpoint to resume"):
        train(config, tmp_path / "empty", resume=True, progress=False)


def tree_state(directory: Path) -> dict[Path, tuple[int, bytes | None]]:
    """Every path under `directory` with its mtime and, for files, its bytes."""
    return {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in directory.rglob("*")}


@pytest.mark.parametrize("resume", [False, True])
def test_a_second_train_into_a_run_directory_in_use_is_refused_and_changes_nothing(tmp_path, resume):
    from click.testing import CliRunner

    from depthdiag.cli import main

    corpus = text_corpus(tmp_path)
    config_file = tmp_path / "tiny.toml"
    config_file.write_text(
        "[model]\nvocab_size = 256\nmax_seq_len = 16\nd_model = 32\nn_heads = 2\n"
        f'[data]\nsource = "text"\npath = "{corpus}"\neval_sequences = 2\n'
        '[train]\nschedule = "fixed:2"\nupdates = 3\nbatch_size = 4\nseq_len = 16\ndevice = "cpu"\n'
    )
    run_dir = tmp_path / "run"
    runner = CliRunner()
    if resume:
        assert runner.invoke(main, ["train", str(config_file), "--out", str(run_dir), "--no-progress"]).exit_code == 0
    # Another process (a running `depthdiag train`, say) holds the run directory.
    holder = start_holder(run_dir)
    try:
        before = tree_state(tmp_path)
        where = ["--resume", str(run_dir)] if resume else ["--out", str(run_dir)]
        result = runner.invoke(main, ["train", str(config_file), *where, "--no-progress"])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(run_dir) in lines[0] and f"pid {holder.pid}" in lines[0], result.stderr
        assert tree_state(tmp_path) == before
        assert run_dir.exists() == resume
    finally:
        holder.kill()
        holder.wait()
    # Once the holder is gone (killed: its lock file stays behind), the directory is free again.
    result = runner.invoke(main, ["train", str(config_file), *where, "--no-progress"])
    assert result.exit_code == 0, result.output


KILLED_WRITER = """
import os, signal, sys
from common.atomic import atomic_output
writes = [atomic_output(target) for target in sys.argv[1:]]
for write in writes:
    write.__enter__()  # the temporary file is made; the write never ends
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_run_removes_the_temporary_files_a_killed_run_left_behind(tmp_path):
    config = tiny_config(text_corpus(tmp_path), updates=4, snapshot_uniform_updates=[0])
    run = tmp_path / "run"
    train(config, run, progress=False)
    # A run killed with kill -9 inside its atomic writes leaves their hidden temporaries.
    targets = [run / "checkpoints/step_000005.pt", run / "checkpoints/latest", run / "snapshots/u0001_step000003.pt"]
    targets.append(run / "config.json")
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, *map(str, targets)])
    assert killed.returncode == -9
    left = sorted(run.rglob(".*.tmp*"))
    assert len(left) == 4 and all(p.stat().st_size == 0 for p in left)
    others = [run / ".notes", run / "checkpoints/.keep", run / "snapshots/mine.tmp.pt"]
    for path in others:
        path.write_text("not ours")
    before = {p.name for p in run.rglob("*")} - {p.name for p in left}

    train(config, run, resume=True, progress=False)
    assert sorted(run.rglob(".*.tmp*")) == []
    assert {p.name for p in run.rglob("*")} == before
    assert all(p.read_text() == "not ours" for p in others)


def test_vocabulary_larger_than_the_model_is_refused(tmp_path):
    config = tiny_config(text_corpus(tmp_path)).with_overrides(["model.vocab_size=100"])
    with pytest.raises(InputError, match="model.vocab_size=100"):
        train(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model_vocab", [256, 128])
def test_bin_token_ids_past_meta_json_vocab_size_are_refused_before_anything_is_written(tmp_path, model_vocab):
    data = tmp_path / "data"
    data.mkdir()
    tokens = np.arange(2000, dtype=np.uint16) % 128
    tokens[1500] = 200
    tokens.tofile(data / "train.bin")
    (np.arange(500, dtype=np.uint16) % 128).tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"vocab_size": 128}))
    config = tiny_config(text_corpus(tmp_path)).with_overrides(
        ["data.source='bin'", f"data.path='{data}'", f"model.vocab_size={model_vocab}"]
    )
    with pytest.raises(InputError, match=r"train\.bin: token id 200 at position 1500 is not below vocab_size 128"):
        train(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_cli_train_then_resume_a_finished_run(tmp_path):
    from click.testing import CliRunner

    from depthdiag.cli import main

    corpus = text_corpus(tmp_path)
    config_file = tmp_path / "tiny.toml"
    config_file.write_text(
        "[model]\nvocab_size = 256\nmax_seq_len = 16\nd_model = 32\nn_heads = 2\n"
        f'[data]\nsource = "text"\npath = "{corpus}"\neval_sequences = 2\n'
        '[train]\nschedule = "fixed:2"\nupdates = 3\nbatch_size = 4\nseq_len = 16\ndevice = "cpu"\n'
    )
    runner = CliRunner()
    run_dir = tmp_path / "run"
    first = runner.invoke(
        main, ["train", str(config_file), "--out", str(run_dir), "--set", "train.log_every=1", "--no-progress"]
    )
    assert first.exit_code == 0, first.output
    last_loss = read_metrics(run_dir)[-1]["loss"]
    assert f"final loss {last_loss:.4f}" in first.output

    again = runner.invoke(
        main, ["train", str(config_file), "--resume", str(run_dir), "--set", "train.log_every=1", "--no-progress"]
    )
    assert again.exit_code == 0, again.output
    assert "resumed from 3" in again.output and f"final loss {last_loss:.4f}" in again.output

    mismatch = runner.invoke(
        main,
        [
            "train",
            str(config_file),
            "--resume",
            str(run_dir),
            "--out",
            str(tmp_path / "x"),
            "--set",
            "train.log_every=1",
        ],
    )
    assert mismatch.exit_code == 2 and "--resume" in mismatch.stderr


def test_bf16_autocast_trains(tmp_path):
    config = tiny_config(
        text_corpus(tmp_path), updates=20, precision="bf16", checkpoint_every=0, snapshot_uniform_updates=[]
    )
    train(config, tmp_path / "run", progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3])
    # Weights and optimizer state stay fp32 under autocast.
    state = load_snapshot(latest_checkpoint(tmp_path / "run"))
    assert {t.dtype for t in state.model_state.values()} == {torch.float32}


@pytest.mark.slow
def test_loss_decreases_on_the_tiny_config(tmp_path):
    from trainer.config import load_config

    config = load_config(
        Path(__file__).resolve().parents[1] / "configs/tiny.toml",
        [
            "train.schedule='fixed:4'",
            "train.updates=60",
            "train.device='cpu'",
            "train.checkpoint_every=0",
            "optim.warmup=10",
            "train.log_every=1",
        ],
    )
    train(config, tmp_path / "run", progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 1.0


def test_snapshots_past_the_end_are_reported_not_written(tmp_path):
    config = tiny_config(text_corpus(tmp_path), updates=8, snapshot_uniform_updates=[0, 4, 5], checkpoint_every=0)
    with pytest.warns(UserWarning, match=r"\[5\]: the run ends 4 updates after the switch"):
        summary = train(config, tmp_path / "run", progress=False)
    assert [Path(p).name for p in summary.snapshots] == ["u0000_step000004.pt", "u0004_step000008.pt"]


# --- failures -----------------------------------------------------------------------------


def every_tensor_is_finite(value) -> bool:
    if torch.is_tensor(value):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, dict):
        return all(every_tensor_is_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(every_tensor_is_finite(v) for v in value)
    return True


def test_divergence_fails_the_run_before_anything_non_finite_is_written(tmp_path):
    # lr 1e3 reaches a non-finite loss within a few updates; log lines come every 5
    # updates, so the failure is found between two of them, not at the update itself.
    config = tiny_config(text_corpus(tmp_path), checkpoint_every=2, log_every=5, updates=40).with_overrides(
        ["optim.lr=1e3", "optim.warmup=0"]
    )
    run_dir = tmp_path / "run"
    with pytest.raises(RunFailed) as err:
        train(config, run_dir, progress=False)
    message = str(err.value)
    assert "not finite" in message and str(run_dir) in message and "\n" not in message
    written = sorted((run_dir / "checkpoints").glob("*.pt")) + sorted((run_dir / "snapshots").glob("*.pt"))
    for path in written:
        state = torch.load(path, weights_only=True)
        assert every_tensor_is_finite(state["model"]) and every_tensor_is_finite(state["optimizer"]), path
    newest = latest_checkpoint(run_dir)
    assert (f"resume from {newest}" in message) if newest else ("no checkpoint" in message)
    failed_at = int(message.split("step ")[1].split(":")[0])
    assert all(np.isfinite(line["loss"]) for line in read_metrics(run_dir))
    assert not (run_dir / "summary.json").exists()
    assert newest is None or load_snapshot(newest).step <= failed_at


def test_a_failed_checkpoint_write_fails_the_run_naming_the_file(tmp_path, monkeypatch):
    import trainer.train as train_module

    def full_disk(path, **kwargs):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(train_module, "save_checkpoint", full_disk)
    run_dir = tmp_path / "run"
    with pytest.raises(RunFailed, match="step 4: writing .*step_000004.pt failed \\(No space left on device\\)"):
        train(tiny_config(text_corpus(tmp_path)), run_dir, progress=False)
