"""The cost of attributing the benefit to training sequences (diag/arithmetic/attribution.py).

On a snapshot-like state of the config (AdamW after a few steps on random tokens, its
evaluation set), update depths 4 and 16, serving depths 1..16:

1. Time: one diagnostic unit (`UpdateDiagnostic.compare`, the default isolation) against the
   attribution of a pool of POOLS[0] sequences, and of POOLS[1], alternated in one process.
   A pool's cost is `SequenceAttribution.unit(batch, pool)` less the same call without a pool
   (which holds the batch's own rows and its two comparison units), with e_s and w_s computed
   before (`depthdiag attribute` computes them once per snapshot; their cost is reported
   beside it). Contracts: the pool of 256 at most 4x one unit, and the time linear in the
   pool (1,024 over 256 about 4). Beside them, the floor of any reverse-mode attribution: the
   batch gradients of the pool's 256 sequences at both update depths (batches of the
   config's size, nothing per sequence), over one unit.
2. Memory: the peak resident memory of a fresh process that runs two units, against one that
   attributes the larger pool (each less its memory before the model existed, glibc's malloc
   handing freed blocks back at once as bench/bench_scale.py sets it), beside what the design
   keeps on top of a unit: e_s and w_s (fp32) at every serving depth, 8 S bytes per trainable
   parameter, one group's gradients at the deep update depth (4 bytes per parameter
   and row), and one float64 per sequence and serving depth. Contract: the pool's peak at most
   the unit's plus that.

    .venv/bin/python bench/bench_attribution.py [--config configs/tiny.toml] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_diag import alternated, snapshot_like, timed  # noqa: E402
from bench_scale import _hand_freed_memory_back, _status_bytes  # noqa: E402

from diag.arithmetic.attribution import (  # noqa: E402
    CAPTURED_ACTIVATION_FACTOR,
    SequenceAttribution,
    row_activation_bytes,
    vectorised_rows,
)
from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic  # noqa: E402
from trainer.config import RunConfig, load_config  # noqa: E402

UPDATE_DEPTHS, SERVING = (4, 16), tuple(range(1, 17))
POOLS = (256, 1024)
WARM_STEPS = 4
"""AdamW steps on random batches before the benchmark, so that every embedding row the
sequences use has a second moment (isolate='linear' refuses a zero one)."""


def snapshot(config: RunConfig):
    """`bench_diag.snapshot_like`, WARM_STEPS more steps, and random pool sequences."""
    model, optimizer, batch, eval_tokens, eval_mask = snapshot_like(config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(WARM_STEPS):
        tokens = torch.randint(0, config.model.vocab_size, batch.shape, generator=generator)
        F.cross_entropy(model(tokens[:, :-1], depth=4).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    pool = torch.randint(0, config.model.vocab_size, (max(POOLS), batch.shape[1]), generator=generator)
    return model, optimizer, batch, eval_tokens, eval_mask, pool


def diagnostics(config: RunConfig, model, optimizer, eval_tokens, eval_mask):
    common = dict(
        update_depths=UPDATE_DEPTHS,
        serving_depths=SERVING,
        grad_clip=config.optim.grad_clip or None,
        precision=config.train.precision,
    )
    unit = UpdateDiagnostic(model, optimizer, eval_tokens, DiagnosticOptions(**common), eval_mask=eval_mask)
    linear = UpdateDiagnostic(
        model, optimizer, eval_tokens, DiagnosticOptions(isolate="linear", **common), eval_mask=eval_mask
    )
    return unit, SequenceAttribution(linear)


def time_pools(config: RunConfig, repeats: int) -> dict:
    model, optimizer, batch, eval_tokens, eval_mask, pool = snapshot(config)
    unit, attribution = diagnostics(config, model, optimizer, eval_tokens, eval_mask)
    _ = unit.nll_before
    directions = timed(lambda: attribution.unit(batch))  # the first call also computes e_s and w_s
    small, large = POOLS
    rows = len(batch)

    def batch_gradients() -> None:  # the pool's sequences in batches, at both depths: no per-sequence work
        for start in range(0, small, rows):
            for depth in UPDATE_DEPTHS:
                attribution.diagnostic.reached_gradients(pool[start : start + rows], depth)

    sides = {"unit": lambda: unit.compare(batch), "no pool": lambda: attribution.unit(batch)}
    sides.update({f"pool {n}": (lambda n=n: attribution.unit(batch, pool[:n])) for n in POOLS})
    sides[f"batch gradients {small}"] = batch_gradients
    seconds = alternated(sides, repeats)
    cost = {n: seconds[f"pool {n}"] - seconds["no pool"] for n in POOLS}
    return {
        "seconds": seconds,
        "first_call_seconds": directions,
        "pool_over_unit": {str(n): cost[n] / seconds["unit"] for n in POOLS},
        "batch_gradients_over_unit": seconds[f"batch gradients {small}"] / seconds["unit"],
        "growth": cost[large] / cost[small],
        "expected_growth": large / small,
    }


def memory_probe(config_path: str, side: str) -> None:
    """In a fresh process: the peak resident memory of two units, or of attributing the larger
    pool, over the memory before the model existed."""
    _hand_freed_memory_back()
    config = load_config(config_path)
    before = _status_bytes("VmRSS")
    model, optimizer, batch, eval_tokens, eval_mask, pool = snapshot(config)
    unit, attribution = diagnostics(config, model, optimizer, eval_tokens, eval_mask)
    if side == "unit":
        for _ in range(2):
            unit.compare(batch)
    else:
        attribution.unit(batch, pool)
    peak = _status_bytes("VmHWM") - before
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    deep = row_activation_bytes(attribution.diagnostic, batch[0], max(UPDATE_DEPTHS))
    group = vectorised_rows(
        trainable, len(batch), deep, deep, CAPTURED_ACTIVATION_FACTOR
    )  # one group at the deep depth
    print(json.dumps({"peak_bytes": peak, "trainable_parameters": trainable, "vectorised_rows": group}))


def memory(config_path: str) -> dict:
    probes = {}
    for side in ("unit", "pool"):
        result = subprocess.run(
            [sys.executable, __file__, "--config", config_path, "--memory-probe", side],
            capture_output=True,
            text=True,
            check=True,
        )
        probes[side] = json.loads(result.stdout.strip().splitlines()[-1])
    parameters, group = probes["unit"]["trainable_parameters"], probes["unit"]["vectorised_rows"]
    kept = 8 * len(SERVING) * parameters + 4 * group * parameters + 8 * len(SERVING) * max(POOLS)
    extra = probes["pool"]["peak_bytes"] - probes["unit"]["peak_bytes"]
    return {
        "unit_peak_bytes": probes["unit"]["peak_bytes"],
        "pool_peak_bytes": probes["pool"]["peak_bytes"],
        "extra_bytes": extra,
        "kept_by_design_bytes": kept,
        "vectorised_rows": group,
        "extra_over_kept": extra / kept,
        "pool_over_unit": probes["pool"]["peak_bytes"] / probes["unit"]["peak_bytes"],
        "pool_over_unit_and_kept": probes["pool"]["peak_bytes"] / (probes["unit"]["peak_bytes"] + kept),
    }


def run(config_path: str, repeats: int = 2) -> dict:
    config = load_config(config_path)
    return {
        "config": config_path,
        "threads": torch.get_num_threads(),
        "time": time_pools(config, repeats),
        "memory": memory(config_path),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory-probe", choices=("unit", "pool"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        memory_probe(args.config, args.memory_probe)
        return
    print(json.dumps(run(args.config, args.repeats), indent=2))


if __name__ == "__main__":
    main()
