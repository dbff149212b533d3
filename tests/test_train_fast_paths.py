"""trainer/train.py's fast paths (bf16 autocast, compiled blocks) against the plain fp32 eager path
on the same batches (exact resume under bf16: tests/test_train.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import read_metrics, text_corpus, tiny_config

from trainer.checkpoint import latest_checkpoint, load_snapshot
from trainer.train import train

UPDATES = 30
# Largest relative difference of any logged loss from the fp32 eager run's over 30 updates, measured per setting
# on this config (identical run to run; an Intel Xeon with native bf16, torch 2.13): bf16 5.6e-4 and compiled bf16
# 1.07e-3, since bf16 rounds every matmul input to 8 bits of mantissa and the trajectories drift apart slowly
# (1.0e-3 and 1.5e-3 were recorded here before: the drift varies by machine and kernel), and compiled fp32 1.5e-7
# (other fusion, fp32 rounding). The bf16 tolerances are about 4.5x their measurement; compiled fp32's is 67x and
# still ten times below a drift of 1e-4.
BF16_TOLERANCE = 2.5e-3
COMPILED_FP32_TOLERANCE = 1e-5
COMPILED_BF16_TOLERANCE = 5e-3


def losses(config, run_dir) -> np.ndarray:
    train(config, run_dir, progress=False)
    return np.array([r["loss"] for r in read_metrics(run_dir)])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plain")
    config = tiny_config(
        text_corpus(directory), updates=UPDATES, checkpoint_every=0, snapshot_uniform_updates=[], schedule="uniform:1-4"
    )
    return directory, losses(config, directory / "run")


@pytest.mark.parametrize(
    "setting,tolerance",
    [
        ({"precision": "bf16"}, BF16_TOLERANCE),
        # Inductor's cold compile, about 30 s of make test's CPU: the compiled blocks' own wiring
        # stays in make test (test_compiled_blocks_compile_once_for_every_depth), their numbers here.
        pytest.param({"compile": True}, COMPILED_FP32_TOLERANCE, marks=pytest.mark.slow),
        pytest.param({"precision": "bf16", "compile": True}, COMPILED_BF16_TOLERANCE, marks=pytest.mark.slow),
    ],
    ids=["bf16", "compiled-fp32", "compiled-bf16"],
)
def test_fast_path_follows_the_plain_loss_trajectory(plain, tmp_path, setting, tolerance):
    directory, reference = plain
    config = tiny_config(
        text_corpus(directory),
        updates=UPDATES,
        checkpoint_every=0,
        snapshot_uniform_updates=[],
        schedule="uniform:1-4",
        **setting,
    )
    fast = losses(config, tmp_path / "run")
    assert fast.shape == reference.shape
    relative = np.abs(fast - reference) / reference
    assert relative.max() < tolerance, relative.max()
    if setting.get("precision") == "bf16":
        assert not np.array_equal(fast, reference)  # bf16 is really in use
    state = load_snapshot(latest_checkpoint(tmp_path / "run"))
    assert {t.dtype for t in state.model_state.values()} == {torch.float32}


def test_compiled_blocks_compile_once_for_every_depth(tmp_path, monkeypatch):
    """What the blocks compile to is counted by TorchDynamo, which captures the graphs, before
    any backend sees them: its eager backend runs them as captured, without inductor's code
    generation, which the trajectory tests above exercise in the slow set."""
    from torch._dynamo.utils import counters

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **options: compile_module(self, backend="eager", **options)
    )
    torch._dynamo.reset()
    counters.clear()
    config = tiny_config(
        text_corpus(tmp_path),
        updates=12,
        checkpoint_every=0,
        snapshot_uniform_updates=[],
        schedule="uniform:1-4",
        compile=True,
    )
    train(config, tmp_path / "run", progress=False)
    depths = {r["depth"] for r in read_metrics(tmp_path / "run")}
    assert depths == {1, 2, 3, 4}  # every depth was trained...
    assert counters["stats"]["unique_graphs"] == 1  # ...through one graph shared by every block
