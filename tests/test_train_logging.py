"""trainer/train.py's logging and trainer/sinks.py: what a run tells while it trains: the depths of
each logging interval, the validation NLL per serving depth (without changing the training to
the bit, resumable), the config keys that switch them on (old configs load and compare as
before), and the TensorBoard and W&B sinks."""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import zlib
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import Interrupt, assert_same_payload, read_metrics, text_corpus, tiny_config, without_wall_time

from common.errors import InputError
from trainer.checkpoint import load_snapshot
from trainer.config import LoggingConfig, RunConfig, TrainConfig, load_config
from trainer.flops import update_flops
from trainer.model import IGNORE_INDEX
from trainer.schedules import parse_schedule
from trainer.train import train

ROOT = Path(__file__).resolve().parents[1]
EVAL = ["train.eval_every=4", "train.eval_depths='1-3,5'"]
"""Validation after 4, 8 and 12 updates (tiny_config's checkpoints) at serving depths 1, 2, 3, 5."""


# --- the config ---------------------------------------------------------------------------------


def test_a_stored_config_without_the_new_keys_loads_and_serialises_as_before():
    # config.json of a run trained before validation and [logging] existed, as it stored it.
    stored = json.loads((ROOT / "tests/data/config-stored-before-validation.json").read_text())
    assert "logging" not in stored and not {"eval_every", "eval_depths"} & set(stored["train"])
    loaded = RunConfig.from_dict(stored)
    assert loaded.train.eval_every == 0 and loaded.train.eval_depths == "1-16" and loaded.logging == LoggingConfig()
    assert loaded.to_json() == json.dumps(stored, sort_keys=True)
    # A new config that leaves the keys at their defaults is the stored one, in memory and on disk.
    spelled_out = RunConfig.from_dict(
        {**stored, "train": {**stored["train"], "eval_every": 0, "eval_depths": "1-16"}, "logging": {}}
    )
    assert spelled_out == loaded and spelled_out.to_dict() == loaded.to_dict()


def test_the_new_keys_round_trip_when_set():
    config = load_config(ROOT / "configs/tiny.toml", ["train.eval_every=20", "logging.tensorboard=true"])
    values = config.to_dict()
    assert values["train"]["eval_every"] == 20 and "eval_depths" not in values["train"]  # each key on its own
    assert values["logging"] == {"tensorboard": True, "wandb": False, "wandb_project": "depthdiag"}
    assert RunConfig.from_json(config.to_json()) == config
    other = config.with_overrides(["train.eval_depths='1,4'"])
    assert other.to_dict()["train"]["eval_depths"] == "1,4" and RunConfig.from_json(other.to_json()) == other
    assert TrainConfig(eval_depths="4,1-2").eval_depth_list == (1, 2, 4)


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("train.eval_every=-10", r"train\.eval_every must be >= 0"),
        ("train.eval_every=15", r"train\.eval_every=15 must be a multiple of train\.log_every=10"),
        ("train.eval_depths='0-4'", r"train\.eval_depths '0-4'"),
        ("train.eval_depths='1-65'", r"train\.eval_depths '1-65': depth 65 is above the maximum 64"),
        ("train.eval_depths=4", r"train\.eval_depths must be str"),
        ("logging.wandb_project=''", r"logging\.wandb_project must not be empty"),
        ("logging.tensorboard=1", r"logging\.tensorboard must be bool"),
    ],
)
def test_bad_settings_are_refused(assignment, message):
    with pytest.raises(InputError, match=message) as err:
        load_config(ROOT / "configs/tiny.toml", [assignment])
    assert "\n" not in str(err.value)


# --- depths of each interval ------------------------------------------------------------------


def test_each_line_counts_the_depths_of_its_interval(tmp_path):
    config = tiny_config(text_corpus(tmp_path), schedule="uniform:1-4", log_every=3, checkpoint_every=4, updates=14)
    train(config, tmp_path / "run", progress=False)
    schedule = parse_schedule("uniform:1-4", seed=0, total_updates=14)
    records = read_metrics(tmp_path / "run")
    steps = [r["step"] for r in records]
    assert steps == [2, 3, 5, 7, 8, 11, 13]  # every 3rd update and every checkpoint (4, 8, 12 is also 3rd, 14)
    previous = -1
    for record in records:
        expected = Counter(schedule.depth_at(s) for s in range(previous + 1, record["step"] + 1))
        assert record["depth_counts"] == {str(d): expected[d] for d in sorted(expected)}
        assert list(record["depth_counts"]) == sorted(record["depth_counts"], key=int)
        assert record["depth"] == schedule.depth_at(record["step"])
        previous = record["step"]
    assert sum(sum(r["depth_counts"].values()) for r in records) == 14


# --- validation NLL ---------------------------------------------------------------------------


def separate_forward_nll(model: torch.nn.Module, tokens: torch.Tensor, depth: int) -> float:
    """Mean token NLL of tokens int64 [E, T+1] at `depth` from one plain forward (no one-pass readout)."""
    with torch.no_grad():
        logits = model(tokens[:, :-1], depth=depth)
    targets = tokens[:, 1:]
    return float(F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), ignore_index=IGNORE_INDEX))


def test_validation_nll_matches_separate_forwards_of_the_checkpoints(tmp_path):
    config = tiny_config(text_corpus(tmp_path)).with_overrides(EVAL)  # 12 updates, checkpoints every 4
    run = tmp_path / "run"
    train(config, run, progress=False)
    records = {r["step"]: r for r in read_metrics(run)}
    with_val = sorted(step for step, r in records.items() if any(k.startswith("val_nll_") for k in r))
    assert with_val == [3, 7, 11]
    for step in with_val:
        assert [k for k in records[step] if k.startswith("val_nll_")] == [f"val_nll_{d}" for d in (1, 2, 3, 5)]
        checkpoint = load_snapshot(run / f"checkpoints/step_{step + 1:06d}.pt")
        model = checkpoint.model().eval()
        for depth in (1, 2, 3, 5):
            reference = separate_forward_nll(model, checkpoint.eval_tokens, depth)
            assert records[step][f"val_nll_{depth}"] == pytest.approx(reference, rel=1e-5), (step, depth)
    # The model changes between checks, so the NLL does too (the keys are not a constant).
    assert records[3]["val_nll_2"] != records[11]["val_nll_2"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_with_validation_equals_training_without_it(tmp_path, precision):
    corpus = text_corpus(tmp_path)
    config = tiny_config(corpus, precision=precision, schedule="uniform:1-4")
    plain, validated = tmp_path / "plain", tmp_path / "validated"
    summary = train(config, plain, progress=False)
    validated_summary = train(config.with_overrides(EVAL), validated, progress=False)

    def without_validation(run_dir: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith("val_nll_")} for r in without_wall_time(run_dir)]

    assert without_validation(validated) == without_validation(plain)
    assert without_validation(validated) != without_wall_time(validated)
    assert validated_summary.final_loss == summary.final_loss
    written = sorted(p.relative_to(plain) for p in plain.rglob("*.pt"))
    assert written and written == sorted(p.relative_to(validated) for p in validated.rglob("*.pt"))
    for relative in written:
        a, b = torch.load(plain / relative, weights_only=True), torch.load(validated / relative, weights_only=True)
        a.pop("config"), b.pop("config")  # b's config has the eval keys; the rest, RNG states included, is equal
        progress_a, progress_b = a.pop("progress", None), b.pop("progress", None)
        assert_same_payload(a, b, str(relative))
        if progress_a is not None:
            assert (progress_a["tokens"], progress_a["flops"]) == (progress_b["tokens"], progress_b["flops"])


def test_a_killed_and_resumed_run_with_validation_writes_the_same_metrics(tmp_path, monkeypatch):
    config = tiny_config(text_corpus(tmp_path), log_every=2, checkpoint_every=4).with_overrides(
        ["train.eval_every=2", "train.eval_depths='1-4'"]
    )
    train(config, tmp_path / "straight", progress=False)
    import trainer.train as train_module

    monkeypatch.setattr(train_module, "update_flops", Interrupt(update_flops, 7))  # dies in update 6
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "resumed", progress=False)
    monkeypatch.undo()
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [1, 3, 5]
    train(config, tmp_path / "resumed", resume=True, progress=False)
    assert without_wall_time(tmp_path / "resumed") == without_wall_time(tmp_path / "straight")
    assert all("val_nll_4" in r for r in read_metrics(tmp_path / "straight"))


# --- sinks --------------------------------------------------------------------------------------


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_mirrors_the_metrics_lines(tmp_path, monkeypatch):
    config = tiny_config(text_corpus(tmp_path), log_every=2).with_overrides([*EVAL, "logging.tensorboard=true"])
    # Interrupted and resumed: the resumed run logs steps 4..5 again, which TensorBoard must show once.
    import trainer.train as train_module

    monkeypatch.setattr(train_module, "update_flops", Interrupt(update_flops, 7))
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "run", progress=False)
    monkeypatch.undo()
    train(config, tmp_path / "run", resume=True, progress=False)
    records = read_metrics(tmp_path / "run")
    logged = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("depth", "train/depth"), ("flops", "train/flops")):
        # Event files hold float32 values.
        expected = [(r["step"], pytest.approx(float(r[key]), rel=1e-6)) for r in records]
        assert logged[tag] == expected, tag
    for depth in (1, 2, 3, 5):
        expected = [(r["step"], pytest.approx(r[f"val_nll_{depth}"], rel=1e-6)) for r in records if "val_nll_1" in r]
        assert logged[f"val/nll_depth_{depth}"] == expected
    assert [step for step, _ in logged["val/nll_depth_1"]] == [3, 7, 11]


@pytest.fixture
def isolated_wandb(tmp_path, monkeypatch):
    """The real wandb package with nothing reaching a network: no W&B setting of the machine
    applies (an API key or WANDB_MODE would change what the sink does), its own files go to
    tmp_path, and a request that slipped through would meet a closed local port, not
    api.wandb.ai. A hung W&B service fails the test instead of hanging the suite, and the
    service process has exited (wandb.teardown waits for it) before the next test starts."""
    import wandb

    for name in [name for name in os.environ if name.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    home = tmp_path / "wandb-home"
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")  # no crash reports to Sentry
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leaves pytest's captured stdout alone
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "true")  # no system-metrics sampler process
    with deadline(300):
        yield wandb
    with deadline(60):
        wandb.teardown()


@contextmanager
def deadline(seconds: int):
    """TimeoutError in the main thread after `seconds` (it interrupts waits on sockets,
    locks and child processes too)."""

    def expire(signum, frame):
        raise TimeoutError(f"W&B did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


LOG_BLOCK = 32 * 1024
LOG_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
"""A transaction log's first 7 bytes: its identifier, magic number and format version 0."""


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (RUN/wandb/wandb/offline-run-*/run-ID.wandb, what
    `wandb sync` uploads): after the header, LevelDB's log format, 32 KiB blocks of chunks
    each with a header of crc32 (of its kind and data), length and kind (a whole record, or its
    first, a middle or its last part), a block's tail too short for a header zeroed; each
    record a serialised wandb.proto Record. wandb (0.31) has no public Python reader of it."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[: len(LOG_HEADER)] == LOG_HEADER
    records, pending, pos = [], b"", len(LOG_HEADER)
    while pos + 7 <= len(data):
        if LOG_BLOCK - pos % LOG_BLOCK < 7:
            pos += LOG_BLOCK - pos % LOG_BLOCK
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + 7 : pos + 7 + length]
        assert kind in (1, 2, 3, 4) and zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad chunk at {pos}"
        pending += chunk
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            records.append(Record.FromString(pending))
            pending = b""
    assert not pending, "the log ends inside a record"
    return records


def offline_runs(run: Path) -> list[Path]:
    return sorted((run / "wandb").rglob("offline-run-*/run-*.wandb"))


def test_wandb_logs_every_metrics_line_offline(tmp_path, isolated_wandb):
    config = tiny_config(text_corpus(tmp_path), log_every=2).with_overrides(
        [*EVAL, "logging.wandb=true", "logging.wandb_project='tests'"]
    )
    run = tmp_path / "run"
    train(config, run, progress=False)
    # The W&B service process writes the log and may still hold part of it after run.finish()
    # (a make test read it empty once); its exit, as a training process's own exit, writes it out.
    isolated_wandb.teardown()
    # Offline (WANDB_MODE is unset): one W&B run, inside the run directory, finished.
    [log] = offline_runs(run)
    records = wandb_records(log)
    kinds = [record.WhichOneof("record_type") for record in records]
    assert kinds.count("run") == 1 and kinds[-1] == "exit"
    [started] = [record.run for record in records if record.HasField("run")]
    assert (started.project, started.display_name) == ("tests", "run")
    config_items = {item.key: json.loads(item.value_json) for item in started.config.update if item.key != "_wandb"}
    assert config_items == {**json.loads((run / "config.json").read_text()), "resumed_from": 0}

    # One history row per metrics line, at its step, with its numbers under the sink's names.
    metrics = read_metrics(run)
    rows = [record.history for record in records if record.HasField("history")]
    assert [row.step.num for row in rows] == [line["step"] for line in metrics] == [1, 3, 5, 7, 9, 11]
    for row, line in zip(rows, metrics):
        logged = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in row.item}
        assert logged["_step"] == line["step"]
        expected = {
            "train/loss": line["loss"],
            "train/lr": line["lr"],
            "train/grad_norm": line["grad_norm"],
            "train/depth": line["depth"],
            "train/tokens": line["tokens"],
            "train/flops": line["flops"],
            "train/wall_time": line["wall_time"],
        }
        if line["step"] in (3, 7, 11):
            expected |= {f"val/nll_depth_{depth}": line[f"val_nll_{depth}"] for depth in (1, 2, 3, 5)}
        # W&B adds its own keys (_step, _runtime, _timestamp).
        assert {name: v for name, v in logged.items() if not name.startswith("_")} == expected, line["step"]


def test_wandb_takes_the_mode_the_environment_sets(tmp_path, isolated_wandb, monkeypatch):
    config = tiny_config(text_corpus(tmp_path), updates=4, log_every=2).with_overrides(["logging.wandb=true"])
    monkeypatch.setenv("WANDB_MODE", "disabled")
    train(config, tmp_path / "disabled", progress=False)
    assert len(read_metrics(tmp_path / "disabled")) == 2 and offline_runs(tmp_path / "disabled") == []
    # Online needs an API key, which the fixture took away: wandb refuses before it sends anything.
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(isolated_wandb.errors.UsageError, match="API key"):
        train(config, tmp_path / "online", progress=False)


@pytest.mark.parametrize("extra", ["wandb", "tensorboard"])
def test_a_missing_extra_is_one_line_naming_it_before_anything_is_written(tmp_path, monkeypatch, extra):
    monkeypatch.setitem(sys.modules, extra, None)  # an import of it raises ImportError
    config = tiny_config(text_corpus(tmp_path)).with_overrides([f"logging.{extra}=true"])
    with pytest.raises(InputError, match=rf"needs the '{extra}' extra \(pip install 'depthdiag\[{extra}\]'\)") as err:
        train(config, tmp_path / "run", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()
