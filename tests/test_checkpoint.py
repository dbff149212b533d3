"""Snapshots and checkpoints: round trips, what a run writes, refusals of bad files, `depthdiag eval`."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import re
from pathlib import Path

import pytest
import torch
import xarray as xr
from click.testing import CliRunner
from helpers import Interrupt, assert_same_payload

from common.errors import InputError
from depthdiag.cli import main
from trainer.checkpoint import FORMAT_VERSION, atomic_torch_save, latest_checkpoint, load_snapshot, save_snapshot
from trainer.config import RunConfig
from trainer.data.sources import build_source
from trainer.flops import update_flops
from trainer.loss import training_loss
from trainer.model import LoopedTransformer
from trainer.optim import build_optimizer, lr_at
from trainer.schedules import parse_schedule
from trainer.train import TrainStep, train

WORDS = "a stitch in time saves nine but the early bird still catches the worm at dawn".split()


def tiny_config(directory: Path, **train_overrides) -> RunConfig:
    corpus = directory / "corpus.txt"
    rng = random.Random(1)
    corpus.write_text(" ".join(rng.choice(WORDS) for _ in range(3000)), encoding="utf-8")
    train_section = {
        "schedule": "fixed-first:k0=2,switch=0.5,finish=uniform:1-4",
        "updates": 8,
        "batch_size": 4,
        "seq_len": 16,
        "checkpoint_every": 1,
        "snapshot_uniform_updates": [0, 1],
        "snapshot_batches": 2,
        "device": "cpu",
        "log_every": 1,
    }
    train_section.update(train_overrides)
    return RunConfig.from_dict(
        {
            "model": {"vocab_size": 256, "max_seq_len": 16, "d_model": 32, "n_heads": 2},
            "data": {"source": "text", "path": str(corpus), "eval_sequences": 3},
            "optim": {"lr": 3e-3, "warmup": 2},
            "train": train_section,
        }
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[RunConfig, Path]:
    directory = tmp_path_factory.mktemp("run")
    config = tiny_config(directory)
    train(config, directory / "run", progress=False)
    return config, directory / "run"


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_same_state(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_snapshot_round_trip_restores_the_exact_next_step(tmp_path, optimizer_name):
    config = tiny_config(tmp_path).with_overrides([f"optim.name='{optimizer_name}'"])
    torch.manual_seed(0)
    model = LoopedTransformer(config.model)
    optimizer = build_optimizer(model, config.optim)
    tokens = torch.randint(0, 256, (4, 17))
    for _ in range(2):
        training_loss(model, tokens, depth=3).backward()
        optimizer.step()
        optimizer.zero_grad()
    batches = torch.randint(0, 256, (2, 4, 17))
    eval_tokens = torch.randint(0, 256, (3, 17))
    path = save_snapshot(
        tmp_path / "s.pt",
        config=config,
        step=5,
        uniform_updates=1,
        model=model,
        optimizer=optimizer,
        lr=1.5e-3,
        batches=batches,
        eval_tokens=eval_tokens,
    )

    snapshot = load_snapshot(path)
    assert (snapshot.step, snapshot.uniform_updates, snapshot.lr) == (5, 1, 1.5e-3)
    assert snapshot.optimizer_class == type(optimizer).__name__
    assert snapshot.config == config
    assert torch.equal(snapshot.batches, batches) and torch.equal(snapshot.eval_tokens, eval_tokens)
    assert snapshot.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    restored = snapshot.model()
    assert_same_state(restored.state_dict(), model.state_dict())
    restored_optimizer = snapshot.optimizer(restored)
    assert_same_state(restored_optimizer.state_dict()["state"], optimizer.state_dict()["state"])
    assert [g["lr"] for g in restored_optimizer.param_groups] == [1.5e-3, 1.5e-3]

    # The restored pair takes bit-for-bit the step the original takes at the snapshot's LR.
    for group in optimizer.param_groups:
        group["lr"] = 1.5e-3
    for m, opt in ((model, optimizer), (restored, restored_optimizer)):
        training_loss(m, batches[0], depth=2).backward()
        opt.step()
    assert_same_state(restored.state_dict(), model.state_dict())


def test_run_snapshots_carry_the_runs_state_batches_and_eval_set(run):
    config, run_dir = run
    tc = config.train
    schedule = parse_schedule(tc.schedule, seed=tc.seed, total_updates=tc.updates)
    source = build_source(config.data)
    at_switch = load_snapshot(run_dir / "snapshots/u0000_step000004.pt")
    after_one = load_snapshot(run_dir / "snapshots/u0001_step000005.pt")
    assert (at_switch.step, at_switch.uniform_updates, after_one.step, after_one.uniform_updates) == (4, 0, 5, 1)
    expected = torch.stack([source.batch(tc.seed, 4 + i, tc.batch_size, tc.seq_len) for i in range(2)])
    assert torch.equal(at_switch.batches, expected)
    assert torch.equal(at_switch.eval_tokens, source.eval_tokens(3, tc.seq_len))
    assert at_switch.lr == lr_at(4, config.optim, tc.updates)
    checkpoint = load_snapshot(run_dir / "checkpoints/step_000004.pt")
    assert checkpoint.batches is None
    assert_same_state(at_switch.model_state, checkpoint.model_state)
    assert_same_state(at_switch.optimizer_state, checkpoint.optimizer_state)

    # The snapshot's next batch, depth and LR reproduce the run's next update exactly.
    model = at_switch.model()
    update = TrainStep(model, at_switch.optimizer(model), precision=tc.precision, grad_clip=config.optim.grad_clip)
    update(at_switch.batches[0], schedule.depth_at(4), at_switch.lr)
    assert_same_state(model.state_dict(), after_one.model_state)


def test_every_file_a_run_writes_loads_safely(run):
    _, run_dir = run
    written = sorted(p for p in run_dir.rglob("*") if p.is_file())
    assert {p.suffix for p in written} <= {".pt", ".json", ".jsonl", ""}
    for path in written:
        if path.suffix == ".pt":
            payload = torch.load(path, weights_only=True)
            assert payload["format_version"] == FORMAT_VERSION
            assert RunConfig.from_json(payload["config"]) == run[0]
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            [json.loads(line) for line in path.read_text().splitlines()]
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_000008.pt"


def test_a_state_read_back_saves_to_the_same_bytes(run, tmp_path):
    # What a resume does to the model and optimizer: rebuilt from a file, then saved again.
    original = run[1] / "snapshots/u0000_step000004.pt"
    snapshot = load_snapshot(original)
    model = snapshot.model()
    again = save_snapshot(
        tmp_path / original.name,
        config=snapshot.config,
        step=snapshot.step,
        uniform_updates=snapshot.uniform_updates,
        model=model,
        optimizer=snapshot.optimizer(model),
        lr=snapshot.lr,
        batches=snapshot.batches,
        eval_tokens=snapshot.eval_tokens,
        trained_on=snapshot.trained_on,
    )
    assert snapshot.trained_on  # the training machine is recorded, and saved back alike
    assert load_snapshot(again).sha256 == snapshot.sha256


def sha256s(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.pt"))}


def test_a_resumed_run_writes_snapshots_byte_identical_to_an_uninterrupted_runs(tmp_path, monkeypatch):
    # The snapshots (after updates 4 and 5) are written after the resume from step_000002.pt;
    # their sha256 is what a results file records as its input.
    config = tiny_config(tmp_path, checkpoint_every=2)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(config, straight, progress=False)
    import trainer.train as train_module

    with monkeypatch.context() as patch:
        patch.setattr(train_module, "update_flops", Interrupt(update_flops, 4))
        with pytest.raises(KeyboardInterrupt):
            train(config, resumed, progress=False)
    assert latest_checkpoint(resumed).name == "step_000002.pt" and not (resumed / "snapshots").exists()
    train(config, resumed, resume=True, progress=False)
    assert sha256s(resumed / "snapshots") == sha256s(straight / "snapshots")
    assert len(sha256s(straight / "snapshots")) == 2
    # A checkpoint also records the seconds trained and the process's RNG states, Python's and
    # numpy's among them, which no run seeds (training draws on neither): two runs' checkpoints
    # differ there whatever happens, and agree in the rest.
    for name in ("step_000004.pt", "step_000008.pt"):
        a, b = (torch.load(run / "checkpoints" / name, weights_only=True) for run in (straight, resumed))
        for payload in (a, b):
            assert payload["progress"].pop("wall_time") > 0
            del payload["rng"]["python"], payload["rng"]["numpy"]
        assert_same_payload(a, b, name)


def test_atomic_save_leaves_nothing_when_the_write_fails(tmp_path):
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"previous")
    with pytest.raises((AttributeError, pickle.PicklingError)):  # by Python version
        atomic_torch_save({"bad": lambda: None}, target)
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


# --- bad files ----------------------------------------------------------------------------


def rewrite(source: Path, target: Path, **changes) -> Path:
    payload = torch.load(source, weights_only=True)
    for key, value in changes.items():
        if value is None:
            del payload[key]
        else:
            payload[key] = value
    torch.save(payload, target)
    return target


def bad_files(run_dir: Path, directory: Path) -> dict[str, tuple[Path, str]]:
    snapshot = run_dir / "snapshots/u0000_step000004.pt"
    truncated = directory / "truncated.pt"
    data = snapshot.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    return {
        "truncated": (truncated, "truncated"),
        "version": (rewrite(snapshot, directory / "version.pt", format_version=FORMAT_VERSION + 1), "format_version"),
        "missing key": (rewrite(snapshot, directory / "nokey.pt", eval_tokens=None), "missing key(s) eval_tokens"),
        "shape": (rewrite(snapshot, directory / "shape.pt", batches=torch.zeros(2, 3, 17, dtype=torch.int64)), "shape"),
        "missing file": (directory / "absent.pt", "no such file"),
        "not a dict": (_saved([1, 2], directory / "list.pt"), "not a depthdiag"),
    }


def _saved(value, path: Path) -> Path:
    torch.save(value, path)
    return path


def test_load_snapshot_names_the_file_and_the_problem(run, tmp_path):
    for label, (path, problem) in bad_files(run[1], tmp_path).items():
        with pytest.raises(InputError) as err:
            load_snapshot(path)
        message = str(err.value)
        assert message.startswith(f"{path}: ") and problem in message and "\n" not in message, label


def test_cli_bad_inputs_exit_2_with_one_line_and_write_nothing(run, tmp_path):
    config, run_dir = run
    runner = CliRunner()
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for label, (path, _) in bad_files(run_dir, inputs).items():
        out = tmp_path / "out" / "eval.h5"
        result = runner.invoke(main, ["eval", str(path), "--out", str(out), "--no-progress"])
        assert result.exit_code == 2, (label, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0], (label, result.stderr)
        assert not (tmp_path / "out").exists(), label

    bad_config = tmp_path / "bad.toml"
    bad_config.write_text("[train]\nupdates = 4\nsurprise = 1\n")
    result = runner.invoke(main, ["train", str(bad_config), "--out", str(tmp_path / "never")])
    assert result.exit_code == 2 and "surprise" in result.stderr and str(bad_config) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "never").exists()

    # A resume whose newest checkpoint is damaged is refused before anything is touched.
    damaged = tmp_path / "damaged"
    (damaged / "checkpoints").mkdir(parents=True)
    (damaged / "checkpoints/step_000004.pt").write_bytes((run_dir / "checkpoints/step_000004.pt").read_bytes()[:100])
    config_file = tmp_path / "config.toml"
    config_file.write_text(_toml(config))
    result = runner.invoke(main, ["train", str(config_file), "--resume", str(damaged), "--no-progress"])
    assert result.exit_code == 2 and "step_000004.pt" in result.stderr
    assert sorted(p.name for p in damaged.rglob("*")) == ["checkpoints", "step_000004.pt"]


def _toml(config: RunConfig) -> str:
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"


# --- depthdiag eval -----------------------------------------------------------------------


def test_eval_matches_separate_forwards_and_writes_a_dataset(run, tmp_path):
    _, run_dir = run
    checkpoint = run_dir / "checkpoints/step_000008.pt"
    out = tmp_path / "eval.h5"
    result = CliRunner().invoke(
        main, ["eval", str(checkpoint), "--serving", "1-3,6", "--out", str(out), "--batch-size", "2", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    ds = xr.load_dataset(out, engine="h5netcdf")
    assert list(ds["serving_depth"].values) == [1, 2, 3, 6]
    snapshot = load_snapshot(checkpoint)
    model = snapshot.model()
    tokens = snapshot.eval_tokens
    with torch.no_grad():
        for depth, nll in zip([1, 2, 3, 6], ds["nll"].values):
            logits = model(tokens[:, :-1], depth=depth)
            reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            assert nll == pytest.approx(float(reference), rel=1e-5)
    assert ds.attrs["checkpoint_sha256"] == snapshot.sha256 and ds.attrs["step"] == 8
    assert "nll" in result.output and f"{ds['nll'].values[0]:.4f}" in result.output


def test_eval_reports_bios_recall_per_serving_depth(tmp_path):
    from trainer.evaluate import evaluate_checkpoint
    from trainer.scoring import recall_bits

    config = RunConfig.from_dict(
        {
            "model": {"vocab_size": 256, "max_seq_len": 32, "d_model": 32, "n_heads": 2},
            "data": {"source": "bios", "bios_people": 10, "eval_sequences": 2},
            "train": {"schedule": "fixed:2", "updates": 2, "batch_size": 4, "seq_len": 32, "device": "cpu"},
        }
    )
    train(config, tmp_path / "run", progress=False)
    checkpoint = tmp_path / "run/checkpoints/step_000002.pt"
    ds = evaluate_checkpoint(checkpoint, [1, 3], device="cpu", progress=False)
    snapshot = load_snapshot(checkpoint)
    expected = recall_bits(snapshot.model(), build_source(config.data), [1, 3])
    assert list(ds["recall_bits"].values) == [expected[1], expected[3]]


# --- bad values inside well-formed files --------------------------------------------------


def edited(source: Path, target: Path, edit) -> Path:
    """`source` loaded, changed in place by `edit(payload)`, saved to `target`."""
    payload = torch.load(source, weights_only=True)
    edit(payload)
    torch.save(payload, target)
    return target


def _set(*keys_and_value):
    """An edit that sets payload[k1][k2]...[kn] = value (a callable value gets the old one)."""
    *keys, value = keys_and_value

    def edit(payload):
        holder = payload
        for key in keys[:-1]:
            holder = holder[key]
        holder[keys[-1]] = value(holder[keys[-1]]) if callable(value) else value

    return edit


def _poison(tensor: torch.Tensor, value: float) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[tensor.numel() // 2] = value
    return tensor


def _drop(*keys):
    def edit(payload):
        holder = payload
        for key in keys[:-1]:
            holder = holder[key]
        del holder[keys[-1]]

    return edit


SNAPSHOT_EDITS = {
    "nan weight": (_set("model", "embed.weight", lambda t: _poison(t, float("nan"))), "embed.weight holds non-finite"),
    "inf gain": (
        _set("model", "final_norm.weight", lambda t: _poison(t, float("inf"))),
        "final_norm.weight holds non-finite",
    ),
    "int weights": (_set("model", "embed.weight", lambda t: t.to(torch.int64)), "embed.weight is torch.int64"),
    "fp16 weights": (_set("model", "embed.weight", lambda t: t.half()), "embed.weight is torch.float16"),
    "exp_avg shape": (_set("optimizer", "state", 0, "exp_avg", torch.zeros(3)), "exp_avg has shape [3]"),
    "exp_avg_sq ints": (
        _set("optimizer", "state", 0, "exp_avg_sq", lambda t: t.to(torch.int64)),
        "exp_avg_sq is torch.int64",
    ),
    "nan exp_avg": (
        _set("optimizer", "state", 1, "exp_avg", lambda t: _poison(t, float("nan"))),
        "exp_avg holds non-finite",
    ),
    "negative step": (_set("optimizer", "state", 0, "step", torch.tensor(-1.0)), "step must be a finite number"),
    "nan step": (_set("optimizer", "state", 0, "step", torch.tensor(float("nan"))), "step must be a finite number"),
    "missing moment": (_drop("optimizer", "state", 0, "exp_avg_sq"), "lacks exp_avg_sq"),
    "unknown parameter": (_set("optimizer", "state", 999, {"step": torch.tensor(1.0)}), "unknown parameter 999"),
    "group without its params": (
        _set("optimizer", "param_groups", 0, "params", [0, 1]),
        "param group 0 does not hold",
    ),
    "nan lr": (_set("lr", float("nan")), "'lr' is nan"),
    "negative lr": (_set("lr", -1e-3), "'lr' is -0.001"),
    "zero lr": (_set("lr", 0.0), "must be finite and > 0"),
    "inf group lr": (_set("optimizer", "param_groups", 0, "lr", float("inf")), "param group 0 lr is inf"),
    "nan eps": (_set("optimizer", "param_groups", 1, "eps", float("nan")), "param group 1 eps=nan"),
    "machine records not a list": (_set("trained_on", "a CPU"), "'trained_on' must be a list of machine records"),
    "nested machine record": (_set("trained_on", [{"cpu": {"model": "x"}}]), "'trained_on' must be a list"),
}


@pytest.mark.parametrize("label", SNAPSHOT_EDITS)
def test_load_snapshot_refuses_bad_values_naming_the_file_and_the_problem(run, tmp_path, label):
    edit, problem = SNAPSHOT_EDITS[label]
    path = edited(run[1] / "snapshots/u0000_step000004.pt", tmp_path / "bad.pt", edit)
    with pytest.raises(InputError) as err:
        load_snapshot(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and problem in message and "\n" not in message, message


CHECKPOINT_EDITS = {
    "nan counter": (_set("progress", "tokens", float("nan")), "'progress' tokens"),
    "missing counter": (_drop("progress", "wall_time"), "'progress' wall_time"),
    "damaged torch rng": (_set("rng", "torch", torch.zeros(3, dtype=torch.uint8)), "'rng' does not hold usable"),
    "damaged python rng": (_set("rng", "python", "internal", torch.zeros(2)), "'rng' does not hold usable"),
}


@pytest.mark.parametrize("label", CHECKPOINT_EDITS)
def test_load_snapshot_refuses_bad_checkpoint_counters_and_rng_states(run, tmp_path, label):
    edit, problem = CHECKPOINT_EDITS[label]
    path = edited(run[1] / "checkpoints/step_000004.pt", tmp_path / "bad.pt", edit)
    with pytest.raises(InputError, match=re.escape(problem)) as err:
        load_snapshot(path, kind="checkpoint")
    assert str(err.value).startswith(f"{path}: ")


def test_sgd_momentum_of_the_wrong_shape_is_refused(tmp_path):
    config = tiny_config(tmp_path).with_overrides(["optim.name='sgd'"])
    model = LoopedTransformer(config.model)
    optimizer = build_optimizer(model, config.optim)
    training_loss(model, torch.randint(0, 256, (4, 17)), depth=2).backward()
    optimizer.step()
    good = save_snapshot(
        tmp_path / "sgd.pt",
        config=config,
        step=1,
        uniform_updates=0,
        model=model,
        optimizer=optimizer,
        lr=1e-3,
        batches=torch.zeros(2, 4, 17, dtype=torch.int64),
        eval_tokens=torch.zeros(3, 17, dtype=torch.int64),
    )
    assert load_snapshot(good).optimizer_class == "SGD"
    bad = edited(good, tmp_path / "bad.pt", _set("optimizer", "state", 2, "momentum_buffer", torch.zeros(5, 5)))
    with pytest.raises(InputError, match=r"momentum_buffer has shape \[5, 5\]"):
        load_snapshot(bad)


def test_a_zero_lr_is_read_where_the_run_decays_to_zero(run, tmp_path):
    def decay_to_zero(payload):
        config = json.loads(payload["config"])
        config["optim"]["min_lr_ratio"] = 0.0
        payload["config"] = json.dumps(config)
        payload["lr"] = 0.0

    path = edited(run[1] / "snapshots/u0000_step000004.pt", tmp_path / "zero.pt", decay_to_zero)
    assert load_snapshot(path).lr == 0.0


def test_each_kind_is_refused_where_the_other_belongs(run, tmp_path):
    config, run_dir = run
    snapshot, checkpoint = run_dir / "snapshots/u0000_step000004.pt", run_dir / "checkpoints/step_000004.pt"
    assert load_snapshot(snapshot, kind="snapshot").batches is not None
    assert load_snapshot(checkpoint, kind="checkpoint").batches is None
    with pytest.raises(InputError, match=f"^{re.escape(str(snapshot))}: a snapshot, not a checkpoint"):
        load_snapshot(snapshot, kind="checkpoint")
    with pytest.raises(InputError, match=f"^{re.escape(str(checkpoint))}: a checkpoint, not a snapshot"):
        load_snapshot(checkpoint, kind="snapshot")

    # A snapshot copied to where `train --resume` looks for the newest checkpoint.
    copied = tmp_path / "copied"
    (copied / "checkpoints").mkdir(parents=True)
    (copied / "checkpoints/step_000004.pt").write_bytes(snapshot.read_bytes())
    config_file = tmp_path / "config.toml"
    config_file.write_text(_toml(config))
    before = sorted(p.name for p in copied.rglob("*"))
    result = CliRunner().invoke(main, ["train", str(config_file), "--resume", str(copied), "--no-progress"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "step_000004.pt: a snapshot, not a checkpoint" in lines[0], result.stderr
    assert sorted(p.name for p in copied.rglob("*")) == before


def test_cli_refuses_a_snapshot_with_non_finite_weights_with_exit_2(run, tmp_path):
    edit, _ = SNAPSHOT_EDITS["nan weight"]
    path = edited(run[1] / "snapshots/u0000_step000004.pt", tmp_path / "nan.pt", edit)
    for command in (["eval", str(path), "--out", str(tmp_path / "out/e.h5")], ["diagnose", str(path)]):
        if command[0] == "diagnose":
            command += ["--out", str(tmp_path / "out/d.h5")]
        result = CliRunner().invoke(main, [*command, "--no-progress"])
        assert result.exit_code == 2, (command, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "embed.weight holds non-finite" in lines[0], result.stderr
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, __import__("common.signals").signals.Terminated])
def test_an_interrupt_during_a_save_stays_an_interrupt_and_leaves_nothing(tmp_path, monkeypatch, interrupt):
    import trainer.checkpoint as checkpoint

    writes = []
    real_write = checkpoint._WholeWrites.write

    def interrupted_write(self, data):
        writes.append(len(data))
        if len(writes) == 3:  # mid-archive: torch's zip writer then reports a bad position instead
            raise interrupt
        return real_write(self, data)

    monkeypatch.setattr(checkpoint._WholeWrites, "write", interrupted_write)
    with pytest.raises(interrupt):
        atomic_torch_save({"weights": torch.zeros(1000)}, tmp_path / "c.pt")
    assert list(tmp_path.iterdir()) == []
