"""FSDP2 at one device, for bench/gpu_check.sh: a process group of one rank (nccl on CUDA,
gloo on the CPU), the model sharded as `train.parallel=fsdp` shards it, UPDATES training
updates in --precision (bf16: FSDP2's bf16 policy for the blocks) through the loop's own
TrainStep, then the sharded diagnostic of the trained state against the unsharded diagnostic of the
same state gathered whole. Prints what it measures; exits non-zero when the loss does not
fall or the two diagnostics differ by more than 1e-5.

    python bench/gpu_fsdp_check.py --device cuda --updates 200 --d-model 512
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic
from diag.arithmetic.sharded import ShardedUpdateDiagnostic
from trainer.checkpoint import gathered_state
from trainer.config import OptimConfig
from trainer.distributed import World, shard_model
from trainer.model import LoopedTransformer, ModelConfig
from trainer.optim import build_optimizer
from trainer.train import TrainStep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    world = World(rank=0, world_size=1, device=device)
    config = ModelConfig(
        vocab_size=4096, max_seq_len=128, d_model=args.d_model, n_heads=8, n_prelude=2, n_core=4, n_coda=2
    )
    torch.manual_seed(0)
    model = shard_model(LoopedTransformer(config).to(device), world, args.precision)
    step = TrainStep(model, build_optimizer(model, OptimConfig(lr=1e-3)), precision=args.precision, grad_clip=1.0)
    # A fixed stream of token rows with structure to learn: each row repeats a short random phrase.
    gen = torch.Generator().manual_seed(1)
    phrases = torch.randint(0, config.vocab_size, (256, 16), generator=gen)

    def batch(i: int) -> torch.Tensor:
        rows = phrases[torch.randint(0, len(phrases), (32,), generator=torch.Generator().manual_seed(i))]
        return rows.repeat(1, 9)[:, :129].to(device)  # [32, 129]

    began, losses = time.perf_counter(), []
    for i in range(args.updates):
        loss_sum, _ = step(batch(i), depth=4 if i < args.updates // 2 else 1 + i % 16, lr=1e-3)
        losses.append(float(loss_sum) / (32 * 128))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    print(
        f"fsdp2 {args.precision} training, {args.updates} updates: "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {seconds:.1f} s"
    )
    assert losses[-1] < losses[0], "FSDP2 training did not reduce the loss"

    # The trained state, gathered whole, then sharded again with fp32 weights gathered, as
    # `diagnose --sharded` shards a snapshot (the training's bf16 policy would round the weights).
    model_state, optimizer_state = gathered_state(model, step.optimizer)
    whole = LoopedTransformer(config).to(device)
    whole.load_state_dict(model_state)
    optimizer = build_optimizer(whole, OptimConfig(lr=1e-3))
    optimizer.load_state_dict(optimizer_state)
    named = get_optimizer_state_dict(whole, optimizer, options=StateDictOptions(full_state_dict=True))
    resharded = LoopedTransformer(config).to(device)
    resharded.load_state_dict(model_state)
    shard_model(resharded, world, "fp32")
    resharded_optimizer = build_optimizer(resharded, OptimConfig(lr=1e-3))
    set_optimizer_state_dict(resharded, resharded_optimizer, named, options=StateDictOptions(full_state_dict=True))

    options = DiagnosticOptions(update_depths=(4, 16), serving_depths=(1, 4, 8, 16), eval_batch_size=16)
    eval_tokens, unit_batch = batch(10**6)[:16], batch(10**6 + 1)
    began = time.perf_counter()
    sharded = ShardedUpdateDiagnostic(resharded, resharded_optimizer, eval_tokens, options).compare(unit_batch)
    sharded_seconds = time.perf_counter() - began
    began = time.perf_counter()
    unsharded = UpdateDiagnostic(whole, optimizer, eval_tokens, options).compare(unit_batch)
    print(f"one unit: sharded {sharded_seconds:.1f} s, unsharded {time.perf_counter() - began:.1f} s")
    worst = max(float(np.abs(sharded[n].values - unsharded[n].values).max()) for n in ("nll", "update_rms"))
    print(
        f"sharded diagnostic at 1 rank vs unsharded: benefit {sharded['benefit'].values.round(5).tolist()} vs "
        f"{unsharded['benefit'].values.round(5).tolist()}, max |difference| {worst:.2e}"
    )
    assert worst < 1e-5, "the sharded diagnostic differs from the unsharded one"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
