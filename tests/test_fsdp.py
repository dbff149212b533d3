"""train.parallel='fsdp' under torchrun: two gloo processes sharding the model with FSDP2 train
the run one process trains (its update monitor's file included), write
torch.distributed.checkpoint folders that resume to the bit (and at another number of
processes), and snapshots a plain process reads like any other."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from helpers import DDP_CONFIG, read_metrics, run_depthdiag, torchrun_train, without_wall_time

from analysis.monitor import open_monitor
from common.errors import InputError
from diag.in_training.monitor import MONITOR_FILE, UpdateMonitor
from trainer.checkpoint import LATEST, META, latest_checkpoint, load_snapshot
from trainer.config import RunConfig, load_config
from trainer.resources import training_memory
from trainer.train import train

UPDATES = 20
"""Updates of the shared runs: checkpoints after 10 and 20, snapshots after 10 and 12."""
HALF = UPDATES // 2
LAST, MIDDLE = f"step_{UPDATES:06d}", f"step_{HALF:06d}"
"""The names of the checkpoints after the last update and after the first half."""
SNAPSHOTS = (f"u0000_step{HALF:06d}", f"u0002_step{HALF + 2:06d}")
"""The names of the snapshots: at the switch and after 2 uniform updates."""


def fsdp_config(directory: Path, *, parallel: str = "fsdp") -> Path:
    """DDP_CONFIG over 20 updates with every update logged, clipping that binds most updates
    (so sharded clipping is compared too) and the validation NLL after 10 and 20."""
    corpus = directory / "corpus.txt"
    rng = random.Random(2)
    corpus.write_text(" ".join(rng.choice("one two three four five six seven".split()) for _ in range(3000)))
    text = DDP_CONFIG.format(corpus=corpus)
    for old, new in (
        ("updates = 8", f"updates = {UPDATES}"),
        ("checkpoint_every = 4", f"checkpoint_every = {HALF}"),
        ("eval_every = 4", f"eval_every = {HALF}"),
        ("warmup = 2", "warmup = 2\ngrad_clip = 0.5"),
        ('device = "cpu"', f'device = "cpu"\nparallel = "{parallel}"'),
    ):
        assert old in text
        text = text.replace(old, new)
    path = directory / f"{parallel}.toml"
    path.write_text(text)
    return path


MONITOR = f"""
[monitor]
every = {HALF}
batches = 2
update_depths = [2, 4]
serving_depths = [1, 2, 3, 4]
eval_sequences = 4
"""
"""The update monitor of the shared runs: a check after 10 updates (the switch) and after 20."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same monitored run trained by 2 FSDP2 processes and by one process
    (tests/test_distributed.py checks DDP against one process)."""
    directory = tmp_path_factory.mktemp("fsdp")
    config_path = fsdp_config(directory)
    config_path.write_text(config_path.read_text() + MONITOR)
    result = torchrun_train(config_path, directory / "fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    config = load_config(config_path)
    train(config, directory / "single", monitor=UpdateMonitor(config, directory / "single"), progress=False)
    return {"config": config_path, "fsdp": directory / "fsdp", "single": directory / "single"}


def losses(run_dir: Path, key: str = "loss") -> list[float]:
    return [r[key] for r in read_metrics(run_dir)]


# First in this file: under `make mutants` the shared runs' in-process training counts as this
# test's, so mutmut runs it for the mutants that training reaches.
def test_rank_zero_writes_the_monitor_file_of_one_process(runs):
    """Under FSDP2 every rank checks the update together on its shards
    (diag/arithmetic/sharded.py) and rank 0 writes: the monitor file of one process."""
    ranks, single = open_monitor(runs["fsdp"] / MONITOR_FILE), open_monitor(runs["single"] / MONITOR_FILE)
    assert ranks["step"].values.tolist() == single["step"].values.tolist() == [HALF, UPDATES]
    # The gradient reductions over ranks round differently: the same numbers to float tolerance.
    np.testing.assert_allclose(ranks["nll"].values, single["nll"].values, rtol=1e-4)
    np.testing.assert_allclose(ranks["benefit"].values, single["benefit"].values, atol=1e-4)
    np.testing.assert_allclose(ranks["update_cosine"].values, single["update_cosine"].values, atol=1e-4)


def test_fsdp_trains_the_one_process_run(runs):
    fsdp, single = read_metrics(runs["fsdp"]), read_metrics(runs["single"])
    assert [r["step"] for r in fsdp] == [r["step"] for r in single] == list(range(UPDATES))
    assert [r["loss"] for r in fsdp] == pytest.approx([r["loss"] for r in single], rel=1e-5)
    # The norms before clipping are global over the shards, and the clipping (to 0.5,
    # binding at every update here) scales the shards alike, or the losses would part.
    assert [r["grad_norm"] for r in fsdp] == pytest.approx([r["grad_norm"] for r in single], rel=1e-5)
    assert min(r["grad_norm"] for r in fsdp) > 0.5
    # Every rank joined the validation passes (FSDP2 gathers weights in them); rank 0 recorded them.
    validated = [r for r in fsdp if "val_nll_1" in r]
    assert [r["step"] for r in validated] == [HALF - 1, UPDATES - 1]
    for a in validated:
        b = single[a["step"]]
        assert [a[f"val_nll_{d}"] for d in (1, 2, 3)] == pytest.approx([b[f"val_nll_{d}"] for d in (1, 2, 3)], rel=1e-5)


def test_fsdp_checkpoints_are_dcp_folders_a_plain_process_reads(runs):
    checkpoints = runs["fsdp"] / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [LATEST, f"{MIDDLE}.dcp", f"{LAST}.dcp"]
    assert latest_checkpoint(runs["fsdp"]) == checkpoints / f"{LAST}.dcp"
    assert not list(runs["fsdp"].rglob(".*.tmp*"))
    sharded = load_snapshot(checkpoints / f"{LAST}.dcp", kind="checkpoint")
    single = load_snapshot(runs["single"] / "checkpoints" / f"{LAST}.pt", kind="checkpoint")
    assert (sharded.step, sharded.uniform_updates, sharded.lr) == (single.step, single.uniform_updates, single.lr)
    assert sharded.progress.keys() == single.progress.keys()
    assert torch.equal(sharded.eval_tokens, single.eval_tokens)
    assert_close_states(sharded, single)


def test_fsdp_snapshots_are_sharded_folders_a_plain_process_reads_as_the_one_process_files(runs):
    assert sorted(p.name for p in (runs["fsdp"] / "snapshots").iterdir()) == [f"{n}.dcp" for n in SNAPSHOTS]
    for name in SNAPSHOTS:
        sharded = load_snapshot(runs["fsdp"] / "snapshots" / f"{name}.dcp", kind="snapshot")
        single = load_snapshot(runs["single"] / "snapshots" / f"{name}.pt", kind="snapshot")
        assert (sharded.step, sharded.uniform_updates, sharded.lr) == (single.step, single.uniform_updates, single.lr)
        assert torch.equal(sharded.batches, single.batches)
        assert_close_states(sharded, single)
        # The gathered optimizer state loads into a plain optimizer and takes its next step.
        model = sharded.model()
        sharded.optimizer(model)
        with pytest.raises(InputError, match="a snapshot, not a checkpoint"):
            load_snapshot(runs["fsdp"] / "snapshots" / f"{name}.dcp", kind="checkpoint")


@pytest.mark.slow  # 12 s; sharded snapshots after updates stay in make test
def test_a_snapshot_before_the_first_update_is_sharded_without_an_optimizer_step(tmp_path):
    """A switch at step 0 snapshots a fresh optimizer: gathering its state would create it with
    a zero-LR step (AdamW's first, changing the training); the folder holds the model's shards
    and the stateless optimizer, and the run is the one process's."""
    config_path = fsdp_config(tmp_path)
    text = config_path.read_text().replace("switch=0.5", "switch=0").replace(f"updates = {UPDATES}", "updates = 6")
    text = text.replace(f"checkpoint_every = {HALF}", "checkpoint_every = 6")
    config_path.write_text(text.replace(f"eval_every = {HALF}", "eval_every = 0"))
    result = torchrun_train(config_path, tmp_path / "fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    train(load_config(config_path), tmp_path / "single", progress=False)
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "single"), rel=1e-5)
    snapshot = load_snapshot(tmp_path / "fsdp" / "snapshots" / "u0000_step000000.dcp", kind="snapshot")
    assert snapshot.optimizer_state["state"] == {}
    single = load_snapshot(tmp_path / "single" / "snapshots" / "u0000_step000000.pt", kind="snapshot")
    assert all(torch.equal(snapshot.model_state[k], v) for k, v in single.model_state.items())


def assert_close_states(a, b) -> None:
    """Two loaded snapshots' model and optimizer states: the same keys, tensors within 1e-5."""
    assert a.model_state.keys() == b.model_state.keys()
    for name, tensor in a.model_state.items():
        torch.testing.assert_close(tensor, b.model_state[name], rtol=1e-5, atol=1e-5)
    assert a.optimizer_state["param_groups"] == b.optimizer_state["param_groups"]
    assert a.optimizer_state["state"].keys() == b.optimizer_state["state"].keys()
    for index, entry in a.optimizer_state["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(value, b.optimizer_state["state"][index][key], rtol=1e-5, atol=1e-6)


def torchrun_resume(config_path: Path, run_dir: Path, processes: int = 2):
    return run_depthdiag("train", config_path, "--resume", run_dir, "--no-progress", ranks=processes)


def interrupted_copy(run_dir: Path, copy: Path, suffix: str = ".dcp") -> Path:
    """`run_dir` as an interruption after its checkpoint of update 10 would have left it."""
    shutil.copytree(run_dir, copy)
    last = copy / "checkpoints" / f"{LAST}{suffix}"
    shutil.rmtree(last) if last.is_dir() else last.unlink()
    (copy / "checkpoints" / LATEST).write_text(f"{MIDDLE}{suffix}\n")
    (copy / "summary.json").unlink()
    return copy


def test_fsdp_resume_is_bit_exact(runs, tmp_path):
    resumed = interrupted_copy(runs["fsdp"], tmp_path / "resumed")
    result = torchrun_resume(runs["config"], resumed)
    assert result.returncode == 0, result.stderr[-3000:]
    assert without_wall_time(resumed) == without_wall_time(runs["fsdp"])
    xr.testing.assert_identical(open_monitor(resumed / MONITOR_FILE), open_monitor(runs["fsdp"] / MONITOR_FILE))
    a = load_snapshot(resumed / "checkpoints" / f"{LAST}.dcp")
    b = load_snapshot(runs["fsdp"] / "checkpoints" / f"{LAST}.dcp")
    for name, tensor in a.model_state.items():
        assert torch.equal(tensor, b.model_state[name]), name
    for index, entry in a.optimizer_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b.optimizer_state["state"][index][key]), (index, key)


def test_fsdp_checkpoint_resumes_in_one_process(runs, tmp_path):
    resumed = interrupted_copy(runs["fsdp"], tmp_path / "resumed")
    summary = train(load_config(runs["config"]), resumed, resume=True, progress=False)
    assert summary.resumed_from == HALF
    assert losses(resumed)[HALF:] == pytest.approx(losses(runs["fsdp"])[HALF:], rel=1e-5)
    assert (resumed / "checkpoints" / f"{LAST}.pt").is_file()  # one process writes the usual file


@pytest.mark.slow  # 15 s; the DCP resume and the reshard to one process stay in make test
def test_a_one_process_checkpoint_resumes_sharded(runs, tmp_path):
    resumed = interrupted_copy(runs["single"], tmp_path / "resumed", suffix=".pt")
    result = torchrun_resume(runs["config"], resumed)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(resumed)[HALF:] == pytest.approx(losses(runs["single"])[HALF:], rel=1e-5)
    assert latest_checkpoint(resumed) == resumed / "checkpoints" / f"{LAST}.dcp"


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_at_four_processes(runs, tmp_path):
    resumed = interrupted_copy(runs["fsdp"], tmp_path / "resumed")
    result = torchrun_resume(runs["config"], resumed, processes=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(resumed)[HALF:] == pytest.approx(losses(runs["fsdp"])[HALF:], rel=1e-5)
    after = read_metrics(resumed)[HALF:]
    assert [r["rank_depths"] for r in after] == [[r["depth"]] * 4 for r in after]


def test_a_damaged_checkpoint_folder_is_one_line(runs, tmp_path):
    folder = tmp_path / f"{MIDDLE}.dcp"
    shutil.copytree(runs["fsdp"] / "checkpoints" / f"{MIDDLE}.dcp", folder)
    (folder / META).write_bytes(b"not a torch file")
    with pytest.raises(InputError, match=rf"^{folder / META}: truncated or not a depthdiag") as caught:
        load_snapshot(folder)
    assert "\n" not in str(caught.value)
    (folder / META).unlink()
    with pytest.raises(InputError, match=rf"^{folder}: no {META}, so not a complete sharded") as caught:
        load_snapshot(folder)
    shutil.copy(runs["fsdp"] / "checkpoints" / f"{MIDDLE}.dcp" / META, folder / META)
    (folder / "__1_0.distcp").unlink()
    with pytest.raises(InputError, match=rf"^{folder}: the shards do not load") as caught:
        load_snapshot(folder)
    assert "\n" not in str(caught.value)


def test_parallel_is_validated_and_shards_the_memory_bound(tmp_path):
    config = load_config(fsdp_config(tmp_path))
    values = config.to_dict()
    values["train"]["parallel"] = "zero3"
    with pytest.raises(InputError, match="train.parallel must be 'ddp' or 'fsdp', got 'zero3'"):
        RunConfig.from_dict(values)
    values["train"]["parallel"] = "ddp"
    ddp = RunConfig.from_dict(values)
    sharded, replicated = training_memory(config, 4), training_memory(ddp, 4)
    assert sharded.parameter_bytes(sharded.parameters) == replicated.parameter_bytes(replicated.parameters) // 4
    assert training_memory(config, 1).model_bytes == training_memory(ddp, 1).model_bytes


@pytest.mark.slow  # 13 s where bf16 is emulated; fp32 FSDP2 training stays in make test
def test_fsdp_bf16_trains_close_to_one_process(tmp_path):
    """With bf16 the blocks' weights are gathered in bf16 under autocast: the losses stay
    within bf16 rounding of one process's bf16 run, and the validation pass runs (in bf16)."""
    config_path = fsdp_config(tmp_path)
    text = config_path.read_text().replace(f"updates = {UPDATES}", "updates = 8")
    text = text.replace(f"eval_every = {HALF}", "eval_every = 4")
    text = text.replace('parallel = "fsdp"', 'parallel = "fsdp"\nprecision = "bf16"')
    config_path.write_text(text)
    result = torchrun_train(config_path, tmp_path / "fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    train(load_config(config_path), tmp_path / "single", progress=False)
    fsdp, single = read_metrics(tmp_path / "fsdp"), read_metrics(tmp_path / "single")
    assert [r["loss"] for r in fsdp] == pytest.approx([r["loss"] for r in single], rel=1e-3)
    assert [r["val_nll_2"] for r in fsdp if "val_nll_2" in r] == pytest.approx(
        [r["val_nll_2"] for r in single if "val_nll_2" in r], rel=1e-2
    )


@pytest.mark.slow
def test_fsdp_compiles_its_blocks(tmp_path):
    """train.compile with sharding: the compiled sharded blocks train the eager run (a minute of
    compiling on a cold cache)."""
    config_path = fsdp_config(tmp_path)
    config_path.write_text(config_path.read_text().replace(f"updates = {UPDATES}", "updates = 8"))
    eager = load_config(config_path)
    config_path.write_text(config_path.read_text().replace('parallel = "fsdp"', 'parallel = "fsdp"\ncompile = true'))
    result = torchrun_train(config_path, tmp_path / "compiled")
    assert result.returncode == 0, result.stderr[-3000:]
    train(eager, tmp_path / "eager", progress=False)
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)


@pytest.mark.slow  # 30 s; the sharded diagnose at 2 ranks stays in make test (test_sharded_diag.py)
def test_a_sharded_checkpoint_is_diagnosed_whole_and_shard_by_shard(runs, tmp_path):
    """`diagnose` of the fsdp run's last checkpoint folder and of a snapshot folder in one process
    (the shards gathered into a plain model) and at 2 ranks with --sharded (each rank loading
    only its shards): the same numbers within 1e-6."""
    checkpoint = runs["fsdp"] / "checkpoints" / f"{LAST}.dcp"
    snapshot = runs["fsdp"] / "snapshots" / f"{SNAPSHOTS[1]}.dcp"
    args = ["--batches", "2", "--update-depths", "1,4", "--serving", "1-3", "--no-progress"]
    for source in (checkpoint, snapshot):
        whole, sharded = tmp_path / f"{source.stem}-whole.h5", tmp_path / f"{source.stem}-sharded.h5"
        result = run_depthdiag("diagnose", source, *args, "--out", whole)
        assert result.returncode == 0, result.stderr[-3000:]
        result = run_depthdiag("diagnose", source, *args, "--out", sharded, "--sharded", ranks=2)
        assert result.returncode == 0, result.stderr[-3000:]
        with xr.open_dataset(whole, engine="h5netcdf") as one, xr.open_dataset(sharded, engine="h5netcdf") as two:
            for name in one.data_vars:
                np.testing.assert_allclose(two[name].values, one[name].values, rtol=1e-6, atol=1e-6, err_msg=name)
