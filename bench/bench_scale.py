"""Scaling out: the diagnostic across ranks, and its memory against training's.

1. Diagnose units/min at 2 ranks against 1 rank: `depthdiag diagnose` of one snapshot of
   the config (units spread over the ranks under torchrun, one thread per process), the two
   alternated, twice each. Units/min counts the units phase alone, from the first unit's
   start to the last one's end over all ranks (recorded by a wrapper around
   `UpdateDiagnostic.compare`); start-up and loading, the same at any rank count, are
   reported beside it.
2. Peak memory of one diagnose unit (update depths 4 and 16, serving depths 1-16) against
   one training step at depth 16, the deepest update depth, on SCALE_MODEL (55M parameters)
   with the same batch: each in a fresh process that builds the model and AdamW, takes one
   step at depth 1 (so the optimizer has its state, as at a snapshot), then runs the unit or
   the step. The figure is the process's peak resident memory (VmHWM) less its resident
   memory before the model existed, with glibc's malloc set to hand freed blocks back at
   once (every allocation of 64 KiB and up its own mapping): with the commands' heap setting
   (common/heap.py) freed memory stays resident and the peak would be the sum of everything
   ever allocated, not the most alive at once.
3. The sharded diagnostic's per-rank peak at 2 ranks (diag/arithmetic/sharded.py; the model sharded
   with FSDP2, gloo, one thread per rank) against the same unit's unsharded peak from 2.
   The ranks' own process-group set-up is in both of their baselines.

    .venv/bin/python bench/bench_scale.py [--config configs/tiny.toml]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_diag import snapshot_like  # noqa: E402

from trainer.checkpoint import save_snapshot  # noqa: E402
from trainer.config import OptimConfig, load_config  # noqa: E402
from trainer.model import LoopedTransformer, ModelConfig  # noqa: E402

SCALE_MODEL = ModelConfig(vocab_size=8192, max_seq_len=128, d_model=896, n_heads=14, n_prelude=1, n_core=2, n_coda=1)
"""55M parameters (7M each in the embedding and the head); big enough that weights and
optimizer state, not the interpreter, dominate a process's memory."""
SCALE_BATCH, SCALE_EVAL_ROWS = (8, 128), 8
"""Training batch [rows, tokens] of the memory probes, and the evaluation rows a unit scores."""
STATE_BATCH = (2, 8)
"""A batch whose activations are negligible next to the model's state (2 rows: one per rank)."""
UPDATE_DEPTHS, SERVING_DEPTHS, EVAL_BATCH_SIZE = (4, 16), tuple(range(1, 17)), 4
UNITS = 12
"""Units of the ranks benchmark (one snapshot, this many batches)."""

TIMED_DIAGNOSE = """
import atexit, json, os, sys, time
import diag
from depthdiag.cli import main

compare, times = diag.UpdateDiagnostic.compare, []

def timed(self, batch):
    began = time.time()
    unit = compare(self, batch)
    times.append((began, time.time()))
    return unit

def record():
    with open(os.path.join(os.environ["UNIT_TIMES"], os.environ.get("RANK", "0") + ".json"), "w") as f:
        json.dump(times, f)

diag.UpdateDiagnostic.compare = timed
atexit.register(record)
main(sys.argv[1:], prog_name="depthdiag")
"""


# --- 1. units/min across ranks ---------------------------------------------------------------


def _write_snapshot(config_path: str, folder: Path) -> Path:
    config = load_config(config_path)
    config = replace(config, train=replace(config.train, snapshot_batches=UNITS))
    model, optimizer, batch, _, _ = snapshot_like(config)
    gen = torch.Generator().manual_seed(1)
    batches = torch.randint(0, config.model.vocab_size, (UNITS, *batch.shape), generator=gen)
    eval_tokens = torch.randint(0, config.model.vocab_size, (config.data.eval_sequences, batch.shape[1]), generator=gen)
    return save_snapshot(
        folder / "snapshot.pt",
        config=config,
        step=1,
        uniform_updates=0,
        model=model,
        optimizer=optimizer,
        lr=config.optim.lr,
        batches=batches,
        eval_tokens=eval_tokens,
    )


def _diagnose_seconds(snapshot: Path, folder: Path, ranks: int) -> dict:
    """One `depthdiag diagnose` of every unit at `ranks` processes: its wall time and its units phase."""
    script, times, out = folder / "timed.py", folder / f"times-{ranks}", folder / f"out-{ranks}.h5"
    script.write_text(TIMED_DIAGNOSE)
    times.mkdir(exist_ok=True)
    for stale in times.glob("*.json"):
        stale.unlink()
    program = [str(script)]
    if ranks > 1:
        program = ["-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={ranks}", *program]
    command = [sys.executable, *program, "diagnose", str(snapshot), "--out", str(out), "--force", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UNIT_TIMES": str(times), "PYTHONPATH": str(ROOT)}
    began = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True, cwd=ROOT)
    wall = time.perf_counter() - began
    spans = [span for path in times.glob("*.json") for span in json.loads(path.read_text())]
    units = max(end for _, end in spans) - min(start for start, _ in spans)
    return {"wall_seconds": wall, "units_seconds": units, "units": len(spans)}


def ranks(config_path: str, repeats: int = 2) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        snapshot = _write_snapshot(config_path, folder)
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for r in range(repeats):
            for n in (1, 2) if r % 2 == 0 else (2, 1):
                runs[n].append(_diagnose_seconds(snapshot, folder, n))
    median = {n: statistics.median(run["units_seconds"] for run in rs) for n, rs in runs.items()}
    wall = {n: statistics.median(run["wall_seconds"] for run in rs) for n, rs in runs.items()}
    return {
        "config": config_path,
        "units": UNITS,
        "units_per_minute": {str(n): UNITS * 60 / s for n, s in median.items()},
        "wall_seconds": {str(n): s for n, s in wall.items()},
        "speedup": median[1] / median[2],
        "speedup_with_start_up": wall[1] / wall[2],
        "runs": {str(n): rs for n, rs in runs.items()},
    }


# --- 2. and 3. memory ------------------------------------------------------------------------


def _status_bytes(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes (not ru_maxrss, which a child inherits)."""
    for line in open("/proc/self/status", encoding="ascii"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _hand_freed_memory_back() -> None:
    """Fixed malloc thresholds (glibc raises them as it goes otherwise): a freed block of
    64 KiB or more leaves the process at once, so the peak is the most that was alive."""
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
    mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD


def _probe_inputs(rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, SCALE_MODEL.vocab_size, (rows, tokens + 1), generator=gen)
    eval_tokens = torch.randint(0, SCALE_MODEL.vocab_size, (SCALE_EVAL_ROWS, tokens + 1), generator=gen)
    return batch, eval_tokens


def memory_probe(kind: str, rows: int, tokens: int) -> None:
    """In a fresh process (see the module docstring): 'train', 'diagnose' or 'sharded' (a
    rank), on a batch of `rows` x `tokens`."""
    _hand_freed_memory_back()
    import torch.distributed as dist

    from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic
    from trainer.loss import counted_targets, loss_sum_of
    from trainer.optim import build_optimizer

    sharded = kind == "sharded"
    if sharded:
        dist.init_process_group("gloo")
    batch, eval_tokens = _probe_inputs(rows, tokens)
    before = _status_bytes("VmRSS")
    torch.manual_seed(0)
    model = LoopedTransformer(SCALE_MODEL)
    world, rank = (dist.get_world_size(), dist.get_rank()) if sharded else (1, 0)
    if sharded:
        from trainer.distributed import init_world, shard_model

        shard_model(model, init_world("cpu"), precision="fp32")
    optimizer = build_optimizer(model, OptimConfig())
    rows = batch.tensor_split(world)[rank]
    (loss_sum_of(model, rows, 1) / (counted_targets(batch) / world)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    began = time.perf_counter()
    if kind == "train":
        (loss_sum_of(model, batch, max(UPDATE_DEPTHS)) / counted_targets(batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        options = DiagnosticOptions(
            update_depths=UPDATE_DEPTHS, serving_depths=SERVING_DEPTHS, eval_batch_size=EVAL_BATCH_SIZE
        )
        if sharded:
            from diag.arithmetic.sharded import ShardedUpdateDiagnostic as Diagnostic
        else:
            Diagnostic = UpdateDiagnostic
        Diagnostic(model, optimizer, eval_tokens, options).compare(batch)
    seconds = time.perf_counter() - began
    peak = _status_bytes("VmHWM") - before
    if sharded:
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
        dist.destroy_process_group()
        if rank:
            return
        peak = max(peaks)
    parameters = sum(p.numel() for p in LoopedTransformer(SCALE_MODEL).parameters()) if kind == "train" else None
    print(json.dumps({"peak_bytes": peak, "seconds": seconds, "parameters": parameters}))


def _probe(kind: str, batch: tuple[int, int]) -> dict:
    program = [__file__, "--memory-probe", kind, "--batch", f"{batch[0]}x{batch[1]}"]
    if kind == "sharded":
        program = ["-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", *program]
    threads = "1" if kind == "sharded" else str(torch.get_num_threads())
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, *program], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _peaks(batch: tuple[int, int]) -> dict:
    train, unit, sharded = (_probe(kind, batch) for kind in ("train", "diagnose", "sharded"))
    return {
        "batch": list(batch),
        "train_step": train,
        "diagnose_unit": unit,
        "sharded_unit_per_rank": sharded,
        "unit_over_step": unit["peak_bytes"] / train["peak_bytes"],
        "sharded_over_unsharded": sharded["peak_bytes"] / unit["peak_bytes"],
    }


def memory() -> dict:
    """The peaks at SCALE_BATCH (the contracts), and at STATE_BATCH, where activations are
    negligible and the peaks are bytes per parameter of weights, gradients, clones and state."""
    at_batch, state_only = _peaks(SCALE_BATCH), _peaks(STATE_BATCH)
    parameters = at_batch["train_step"]["parameters"]
    return {
        "model": SCALE_MODEL.to_dict(),
        "parameters": parameters,
        **at_batch,
        "state_only": state_only,
        "bytes_per_parameter": {
            name: state_only[name]["peak_bytes"] / parameters
            for name in ("train_step", "diagnose_unit", "sharded_unit_per_rank")
        },
    }


def run(config_path: str) -> dict:
    return {"ranks": ranks(config_path), "memory": memory()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--memory-probe", choices=("train", "diagnose", "sharded"), help=argparse.SUPPRESS)
    parser.add_argument("--batch", default="8x128", help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=("ranks", "memory"), help="Run one part alone.")
    args = parser.parse_args()
    if args.memory_probe:
        rows, tokens = (int(n) for n in args.batch.split("x"))
        memory_probe(args.memory_probe, rows, tokens)
        return
    if args.part == "ranks":
        print(json.dumps(ranks(args.config), indent=2))
    elif args.part == "memory":
        print(json.dumps(memory(), indent=2))
    else:
        print(json.dumps(run(args.config), indent=2))


if __name__ == "__main__":
    main()
