"""torchrun: two gloo processes on CPU train the same run as one process."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import load_snapshot
from trainer.schedules import parse_schedule
from trainer.train import train

CONFIG = """
[model]
vocab_size = 256
max_seq_len = 16
d_model = 32
n_heads = 2

[data]
source = "text"
path = "{corpus}"
eval_sequences = 4

[optim]
lr = 3e-3
warmup = 2

[train]
schedule = "fixed-first:k0=2,switch=0.5,finish=uniform:1-4"
updates = 8
batch_size = 8
seq_len = 16
checkpoint_every = 4
snapshot_uniform_updates = [0, 2]
snapshot_batches = 2
device = "cpu"
log_every = 1
eval_every = 4
eval_depths = "1-3"
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def torchrun_train(config_path: Path, out: Path) -> subprocess.CompletedProcess:
    """`depthdiag train CONFIG --out OUT` under torchrun with 2 gloo processes, one thread each."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "depthdiag",
        "train",
        str(config_path),
        "--out",
        str(out),
        "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=240, cwd=Path(__file__).resolve().parents[1]
    )


def test_two_gloo_processes_match_one_process(tmp_path):
    corpus = tmp_path / "corpus.txt"
    rng = random.Random(2)
    corpus.write_text(" ".join(rng.choice("one two three four five six seven".split()) for _ in range(3000)))
    config_path = tmp_path / "run.toml"
    config_path.write_text(CONFIG.format(corpus=corpus))

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
