"""trainer/distributed.py under torchrun: two gloo processes on CPU train the same run as one
process."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import DDP_CONFIG, read_metrics, torchrun_train

from trainer.checkpoint import load_snapshot
from trainer.schedules import parse_schedule
from trainer.train import train


def test_two_gloo_processes_match_one_process(tmp_path):
    corpus = tmp_path / "corpus.txt"
    rng = random.Random(2)
    corpus.write_text(" ".join(rng.choice("one two three four five six seven".split()) for _ in range(3000)))
    config_path = tmp_path / "run.toml"
    config_path.write_text(DDP_CONFIG.format(corpus=corpus))

    result = torchrun_train(config_path, tmp_path / "ddp")
    assert result.returncode == 0, result.stderr[-3000:]

    from trainer.config import load_config

    config = load_config(config_path)
    train(config, tmp_path / "single", progress=False)

    ddp, single = read_metrics(tmp_path / "ddp"), read_metrics(tmp_path / "single")
    assert [r["step"] for r in ddp] == [r["step"] for r in single] == list(range(8))
    assert [r["loss"] for r in ddp] == pytest.approx([r["loss"] for r in single], rel=1e-5)
    schedule = parse_schedule(config.train.schedule, seed=config.train.seed, total_updates=8)
    assert [r["rank_depths"] for r in ddp] == [[schedule.depth_at(s)] * 2 for s in range(8)]
    assert "rank_depths" not in single[0]
    assert [r["depth_counts"] for r in ddp] == [{str(schedule.depth_at(s)): 1} for s in range(8)]
    # Rank 0 alone scored the evaluation set; the others went on to the next update.
    validated = [r["step"] for r in ddp if "val_nll_1" in r]
    assert validated == [r["step"] for r in single if "val_nll_1" in r] == [3, 7]
    for a, b in zip(ddp, single):
        if "val_nll_1" in a:
            assert [a[f"val_nll_{d}"] for d in (1, 2, 3)] == pytest.approx(
                [b[f"val_nll_{d}"] for d in (1, 2, 3)], rel=1e-4
            )

    # Rank 0 alone wrote the files, with the same checkpoints and snapshots as one process.
    for relative in (
        "checkpoints/step_000004.pt",
        "checkpoints/step_000008.pt",
        "snapshots/u0000_step000004.pt",
        "snapshots/u0002_step000006.pt",
    ):
        a, b = load_snapshot(tmp_path / "ddp" / relative), load_snapshot(tmp_path / "single" / relative)
        assert a.step == b.step
        for name, tensor in a.model_state.items():
            torch.testing.assert_close(tensor, b.model_state[name], rtol=1e-4, atol=1e-5)
        if a.batches is not None:
            assert torch.equal(a.batches, b.batches)
    assert not list((tmp_path / "ddp").rglob("*.tmp*"))
