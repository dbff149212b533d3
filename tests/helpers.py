"""Helpers shared by several test files: test files import them from here, never from each other.

- processes that hold an output's lock (start_holder), and a child's SIGINT at its default
  (sigint_at_its_default);
- the tiny text-corpus training run of the training-loop tests and its metrics
  (text_corpus, tiny_config, read_metrics, without_wall_time, Interrupt, assert_same_payload);
- torchrun with gloo processes on the CPU (DDP_CONFIG, torchrun_train, run_depthdiag);
- the toy bioS run of the figure-4 pipeline (TOY_CONFIG);
- the short run whose snapshots the diagnostic reads (run_config, write_run and its depths);
- benefit Datasets for the statistics (benefit_results, hand_seeds) and scipy's t interval (scipy_t).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import scipy.stats
import torch
import torch.nn.functional as F
import xarray as xr

from trainer.checkpoint import save_checkpoint, save_snapshot
from trainer.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from trainer.data.sources import build_source
from trainer.model import LoopedTransformer, ModelConfig
from trainer.optim import build_optimizer

# --- output locks -----------------------------------------------------------------------------

HOLD = """
import sys
from common.lock import exclusive_output
with exclusive_output(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def sigint_at_its_default() -> None:
    """A child process's preexec_fn for a test that interrupts it: SIGINT back to its default. A
    shell without job control starts background commands with SIGINT ignored, the child would
    inherit that, and Python would then never raise KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_holder(output: str | Path) -> subprocess.Popen:
    """Another process that holds `output`'s lock, returned once it says so: it holds it until
    it is killed or its stdin closes (at the latest when the test process ends), never for a
    fixed time a slow test could outlast."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(output)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


# --- the tiny training run --------------------------------------------------------------------

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree".split()


def text_corpus(directory: Path) -> Path:
    rng = random.Random(0)
    path = directory / "corpus.txt"
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(4000)), encoding="utf-8")
    return path


def tiny_config(corpus: Path, **train_overrides) -> RunConfig:
    """d=32, byte-level text: a run of a few dozen updates takes seconds on one core."""
    train_section = {
        "schedule": "fixed-first:k0=2,switch=0.5,finish=uniform:1-4",
        "updates": 12,
        "batch_size": 8,
        "seq_len": 16,
        "checkpoint_every": 4,
        "snapshot_uniform_updates": [0, 2],
        "snapshot_batches": 3,
        "device": "cpu",
        "log_every": 1,
    }
    train_section.update(train_overrides)
    return RunConfig.from_dict(
        {
            "model": {"vocab_size": 256, "max_seq_len": 16, "d_model": 32, "n_heads": 2},
            "data": {"source": "text", "path": str(corpus), "eval_sequences": 4},
            "optim": {"lr": 3e-3, "warmup": 3},
            "train": train_section,
        }
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_wall_time(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in read_metrics(run_dir)]


class Interrupt:
    """Raises KeyboardInterrupt on the n-th modeled-FLOPs call, i.e. in the middle of update n-1."""

    def __init__(self, real, n: int):
        self.real, self.n, self.calls = real, n, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return self.real(*args, **kwargs)


def assert_same_payload(a, b, where: str = "") -> None:
    """Two torch.load payloads (dicts of tensors, lists, scalars) equal to the bit."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_payload(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_payload(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# --- torchrun -----------------------------------------------------------------------------------

DDP_CONFIG = """
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


def run_depthdiag(
    *args, ranks: int = 1, script: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`depthdiag ARGS` (or `python SCRIPT ARGS`) in one process without torchrun's environment,
    or under torchrun with `ranks` gloo processes; one thread each, so that the float reductions
    of one process and of each rank group the same way."""
    repo = Path(__file__).resolve().parents[1]
    program = ["-m", "depthdiag"] if script is None else [str(script)]
    if ranks > 1:
        launcher = ["-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={ranks}"]
        program = [*launcher, "--master_addr=127.0.0.1", f"--master_port={free_port()}", *program]
    environment = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    paths = [str(repo), environment.get("PYTHONPATH")]
    environment.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, paths)), **(env or {}))
    command = [sys.executable, *program, *map(str, args)]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300, cwd=repo)


def torchrun_train(config_path: Path, out: Path) -> subprocess.CompletedProcess:
    """`depthdiag train CONFIG --out OUT` under torchrun with 2 gloo processes, one thread each."""
    return run_depthdiag("train", config_path, "--out", out, "--no-progress", ranks=2)


# --- the toy pipeline run -----------------------------------------------------------------------

TOY_CONFIG = """
[model]
vocab_size = 256
max_seq_len = 32
d_model = 32
n_heads = 2
n_prelude = 1
n_core = 1
n_coda = 1

[data]
source = "bios"
bios_people = 40
eval_sequences = 8

[optim]
lr = 3e-3
warmup = 5

[train]
schedule = "fixed-first:k0=2,switch=0.5,finish=uniform:1-8"
updates = 40
batch_size = 8
seq_len = 32
checkpoint_every = 0
snapshot_uniform_updates = [0, 4, 16]
snapshot_batches = 3
"""


# --- a short run for the diagnostic -------------------------------------------------------------

# Its sequence length, batch size and batches per snapshot; the depths the diagnose tests ask for.
SEQ, BATCH, CARRIED = 12, 4, 6
UPDATE_DEPTHS, SERVING = (2, 5), (1, 2, 3, 5, 8)


def run_config(d_model=32):
    return RunConfig(
        model=ModelConfig(vocab_size=200, max_seq_len=SEQ, d_model=d_model, n_heads=2, n_prelude=1, n_core=1, n_coda=1),
        data=DataConfig(bios_people=20, eval_sequences=8),
        optim=OptimConfig(lr=1e-2, grad_clip=1.0, warmup=0),
        train=TrainConfig(batch_size=BATCH, seq_len=SEQ, snapshot_batches=CARRIED, seed=3),
    )


TRAINING_MACHINE = {"cpu_model": "the machine that trained the test run", "bf16_matmul": "aten", "threads": 1}
"""The machine record `write_run`'s snapshots say trained them."""


def write_run(directory: Path, config=None):
    """Two snapshots (0 and 2 uniform updates) and a checkpoint of one short run."""
    config = config or run_config()
    torch.manual_seed(0)
    model = LoopedTransformer(config.model)
    with torch.no_grad():
        model.adapter.weight.normal_(0, 0.3)  # let the depth matter from the start
    optimizer = build_optimizer(model, config.optim)
    source = build_source(config.data)
    eval_tokens = source.eval_tokens(config.data.eval_sequences, config.train.seq_len)
    paths = {}
    for step in range(5):
        if step in (2, 4):
            batches = torch.stack(
                [source.batch(config.train.seed, step + i, BATCH, config.train.seq_len) for i in range(CARRIED)]
            )
            paths[step] = save_snapshot(
                directory / f"snap-u{step - 2:02d}.pt",
                config=config,
                step=step,
                uniform_updates=step - 2,
                model=model,
                optimizer=optimizer,
                lr=7e-3,
                batches=batches,
                eval_tokens=eval_tokens,
                trained_on=(TRAINING_MACHINE,),
            )
        batch = source.batch(config.train.seed, step, BATCH, config.train.seq_len)
        logits = model(batch[:, :-1], depth=2 + step % 3)
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    paths["checkpoint"] = save_checkpoint(
        directory / "ckpt-000005.pt",
        config=config,
        step=5,
        uniform_updates=3,
        model=model,
        optimizer=optimizer,
        lr=5e-3,
        eval_tokens=eval_tokens,
        progress={"tokens": 0.0},
    )
    return paths


class TokenRows(torch.utils.data.Dataset):
    """Rows of token ids [N, T] as a transformers.Trainer dataset: each row its own labels."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


# --- benefit Datasets for the statistics ------------------------------------------------------


def benefit_results(
    benefit: np.ndarray, uniform_updates=None, seeded: bool = False, update_depths=(4, 16)
) -> xr.Dataset:
    """A Dataset with the coordinates the statistics read, around `benefit` [(seed,) snapshot, batch, depth]."""
    dims = (("seed",) if seeded else ()) + ("snapshot", "batch", "serving_depth")
    n_snapshots, n_batches, n_depths = benefit.shape[-3:]
    uniform_updates = list(uniform_updates if uniform_updates is not None else range(n_snapshots))
    coords = {
        "snapshot": [f"s{u}" for u in uniform_updates],
        "uniform_updates": ("snapshot", uniform_updates),
        "step": ("snapshot", [1000 + u for u in uniform_updates]),
        "batch": np.arange(n_batches),
        "serving_depth": np.arange(1, n_depths + 1),
        "update_depth": list(update_depths),
    }
    if seeded:
        coords["seed"] = np.arange(benefit.shape[0])
    return xr.Dataset({"benefit": (dims, benefit)}, coords=coords)


def scipy_t(values, level=0.95):
    values = np.asarray(values)
    return scipy.stats.t.interval(level, len(values) - 1, loc=values.mean(), scale=scipy.stats.sem(values))


def hand_seeds() -> xr.Dataset:
    """3 seeds x 2 snapshots (0, 16 updates) x 2 batches x 2 serving depths, numbers chosen by hand.

    At the switch the depth-averaged batch means are (2, 4), (1, 3), (3, 5): seed means
    3, 2, 4. After 16 updates every seed's batch means are (+0.1, -0.1): seed means 0.
    """
    at_switch = [[[1.0, 3.0], [3.0, 5.0]], [[0.0, 2.0], [2.0, 4.0]], [[2.0, 4.0], [4.0, 6.0]]]
    after = [[[0.0, 0.2], [-0.2, 0.0]]] * 3
    benefit = np.stack([np.array(at_switch), np.array(after)], axis=1)  # [seed, snapshot, batch, depth]
    return benefit_results(benefit, uniform_updates=[0, 16], seeded=True)
