"""The toy grid of the grid tests (test_depthdiag_grid.py, test_grid_submitit.py): its base
config and folder, grid files, a grid stopped mid-cell, and a run's final weights. Test files
import them from here, never from each other."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import torch
from helpers import text_corpus

from trainer.checkpoint import latest_checkpoint, load_snapshot

BASE = """
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
warmup = 3
[train]
schedule = "uniform:1-4"
updates = 12
batch_size = 8
seq_len = 16
checkpoint_every = 4
snapshot_uniform_updates = []
device = "cpu"
log_every = 2
"""


def toy_grid_folder(directory: Path) -> Path:
    """`directory` with a byte-level text corpus and the toy base config BASE (d=32: seconds per run)."""
    corpus = text_corpus(directory)
    (directory / "base.toml").write_text(BASE.format(corpus=corpus), encoding="utf-8")
    return directory


def write_grid(folder: Path, text: str, name: str = "grid.toml") -> Path:
    path = folder / name
    path.write_text('base = "base.toml"\n' + text, encoding="utf-8")
    return path


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_snapshot(latest_checkpoint(run_dir), kind="checkpoint").model_state


# The sitecustomize of the grid's processes: the run in HOLD_RUN, once it has written its
# first checkpoint, says so on the FIFO HOLD_FIFO and trains no further, so the grid is
# stopped mid-cell however slowly the machine runs. The grid starts its cells as
# subprocesses with its descriptors closed: the hook reaches them through the environment,
# and their signal comes back through a named pipe.
HOLD_AFTER_CHECKPOINT = """
import os
import threading
from pathlib import Path

from trainer import train

_write_checkpoint = train._Run._write_checkpoint


def write_checkpoint_and_hold(run, step):
    _write_checkpoint(run, step)
    if Path(run.run_dir).resolve() == Path(os.environ["HOLD_RUN"]).resolve():
        with open(os.environ["HOLD_FIFO"], "wb") as fifo:
            fifo.write(b"1")
            fifo.flush()
            threading.Event().wait()  # until the process is ended (SIGTERM still acts as without the hook)


train._Run._write_checkpoint = write_checkpoint_and_hold
"""


KILLED_GRID = (
    '[set]\n"train.checkpoint_every" = 10\n[axes]\n'
    'schedule = { short = "fixed:2", long = { schedule = "fixed:2", "train.updates" = 300 } }\n'
)
"""Two cells: `short` finishes, `long` (300 updates) is stopped by `grid_stopped_after_a_checkpoint`."""


def grid_stopped_after_a_checkpoint(folder: Path, grid: Path, runs: Path, *options: str) -> int:
    """`depthdiag grid run GRID --runs RUNS OPTIONS` stopped with SIGTERM once its long cell
    has written its first checkpoint (after 10 updates, HOLD_AFTER_CHECKPOINT holding it
    there); returns the grid command's exit status."""
    hook = folder / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_AFTER_CHECKPOINT, encoding="utf-8")
    fifo = folder / "checkpointed"
    os.mkfifo(fifo)
    # Opened before the grid starts and without blocking: the cell's open for writing then
    # never waits, and the read end sees data only once the cell has written.
    checkpointed = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    hold = str(runs / "schedule=long")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, HOLD_RUN=hold, HOLD_FIFO=str(fifo))
    command = [sys.executable, "-m", "depthdiag", "grid", "run", str(grid), "--runs", str(runs), "--no-progress"]
    process = subprocess.Popen([*command, *options], cwd=folder, env=env)
    exited = os.pidfd_open(process.pid)  # readable once the grid has ended: a grid that fails is not waited out
    try:
        ready, _, _ = select.select([checkpointed, exited], [], [], 300)
        written = os.read(checkpointed, 1) if checkpointed in ready else b""
    finally:
        # SIGTERM, not SIGINT: a shell without job control starts background commands with
        # SIGINT ignored, which would make this test depend on how it was launched.
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        os.close(exited)
        os.close(checkpointed)
    assert written == b"1", "the long cell never wrote a checkpoint"
    return process.returncode
