"""Training throughput and whether step time tracks modeled FLOPs.

    python bench/bench_train.py [--config configs/tiny.toml] [--set key=value ...]

Prints, for the config's model and batch shape:

1. the machine's matmul peak, measured here (best of several square matmuls in the
   config's precision);
2. for fixed:4 and uniform:1-16: seconds per update, tokens/s, achieved FLOP/s
   (modeled FLOPs with the LM head included, as the hardware does that work) and
   its ratio to the matmul peak;
3. fixed-first's measured wall-clock saving over uniform against its modeled
   saving (the paper's accounting, head excluded). The two schedules run in
   alternating segments over the same update indices so drifting machine load
   falls on both alike (ABBA order). Contract (DESIGN.md section 8): ratio >= 0.90.

Each update is the training loop's own: forward, loss, backward, clipping,
optimizer step, with the run's batches and LR schedule.
"""

from __future__ import annotations

import argparse
import time

import torch

from trainer.checkpoint import build_optimizer
from trainer.config import RunConfig, load_config
from trainer.data import build_source
from trainer.distributed import resolve_device
from trainer.flops import update_flops
from trainer.model import LoopedTransformer
from trainer.schedules import parse_schedule
from trainer.train import clip_gradients, lr_at, training_loss

FIXED_FIRST = "fixed-first:k0=4,switch=0.8,finish=uniform:1-16"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` [size x size] matmuls in `dtype` (after one warm-up)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        began = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - began)
    return 2 * size**3 / best


class Trainer:
    """One model and optimizer taking the run's updates at whatever depths it is given."""

    def __init__(self, config: RunConfig, device: torch.device):
        self.config, self.device = config, device
        self.source = build_source(config.data)
        torch.manual_seed(config.train.seed)
        self.model = LoopedTransformer(config.model).to(device)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.params = list(self.model.parameters())

    def update(self, step: int, depth: int) -> float:
        """Seconds for update `step` at `depth`."""
        tc = self.config.train
        synchronize(self.device)
        began = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.config.optim, tc.updates)
        batch = self.source.batch(tc.seed, step, tc.batch_size, tc.seq_len).to(self.device)  # [B, T+1]
        training_loss(self.model, batch, depth, precision=tc.precision).backward()
        clip_gradients(self.params, self.config.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        return time.perf_counter() - began


def throughput(config: RunConfig, spec: str, updates: int, device: torch.device, peak: float) -> None:
    tc = config.train
    schedule = parse_schedule(spec, seed=tc.seed, total_updates=updates)
    trainer = Trainer(config, device)
    trainer.update(0, schedule.depth_at(0))  # warm-up: allocator, kernels
    seconds = 0.0
    flops = 0.0
    depths = [schedule.depth_at(step) for step in range(updates)]
    for step, depth in enumerate(depths):
        seconds += trainer.update(step, depth)
        flops += update_flops(config.model, depth, batch_size=tc.batch_size, seq_len=tc.seq_len,
                              include_embeddings=True)
    tokens = updates * tc.batch_size * tc.seq_len
    # Seconds per update depend on the depths drawn, so the mean depth goes beside them.
    print(f"{spec:<14} mean depth {sum(depths) / updates:>5.2f}  {seconds / updates:>6.3f} s/update  "
          f"{tokens / seconds:>8,.0f} tokens/s  "
          f"{flops / seconds / 1e9:>8.2f} GFLOP/s  = {flops / seconds / peak:>6.1%} of matmul peak")


def fixed_first_saving(config: RunConfig, updates: int, segment: int, device: torch.device) -> None:
    tc = config.train
    schedules = {spec: parse_schedule(spec, seed=tc.seed, total_updates=updates)
                 for spec in (FIXED_FIRST, "uniform:1-16")}
    trainers = {spec: Trainer(config, device) for spec in schedules}
    seconds = dict.fromkeys(schedules, 0.0)
    modeled = dict.fromkeys(schedules, 0.0)
    for spec, trainer in trainers.items():
        trainer.update(0, schedules[spec].depth_at(0))
    for start in range(0, updates, segment):
        # ABBA order: whichever schedule runs second in a segment gets a warmer cache,
        # so the order flips every segment.
        order = list(schedules.items()) if (start // segment) % 2 == 0 else list(schedules.items())[::-1]
        for spec, schedule in order:
            for step in range(start, min(start + segment, updates)):
                depth = schedule.depth_at(step)
                seconds[spec] += trainers[spec].update(step, depth)
                modeled[spec] += update_flops(config.model, depth, batch_size=tc.batch_size, seq_len=tc.seq_len)
    measured_saving = 1 - seconds[FIXED_FIRST] / seconds["uniform:1-16"]
    modeled_saving = 1 - modeled[FIXED_FIRST] / modeled["uniform:1-16"]
    print(f"{FIXED_FIRST} vs uniform:1-16 over {updates} updates (alternating {segment}-update segments):")
    print(f"  wall clock {seconds[FIXED_FIRST]:.1f} s vs {seconds['uniform:1-16']:.1f} s: "
          f"measured saving {measured_saving:.1%}, modeled saving {modeled_saving:.1%}, "
          f"ratio {measured_saving / modeled_saving:.2f} (contract >= 0.90)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--updates", type=int, default=8, help="Timed updates per throughput row.")
    parser.add_argument("--fixed-first-updates", type=int, default=30,
                        help="Run length laid out for the fixed-first vs uniform comparison.")
    parser.add_argument("--segment", type=int, default=4, help="Updates per alternating segment.")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default).")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.config, args.overrides)
    device = resolve_device(config.train.device)
    tc = config.train
    # The peak in the precision the matmuls of training run in, so the ratio can not exceed 1 under bf16.
    peak = matmul_peak(device, torch.bfloat16 if tc.precision == "bf16" else torch.float32)
    print(f"{args.config}: d_model={config.model.d_model}, blocks {config.model.n_prelude}/{config.model.n_core}/"
          f"{config.model.n_coda}, batch {tc.batch_size}x{tc.seq_len}, {tc.precision} on {device} "
          f"({torch.get_num_threads()} CPU threads)")
    print(f"{tc.precision} matmul peak: {peak / 1e9:.1f} GFLOP/s")
    for spec in ("fixed:4", "uniform:1-16"):
        throughput(config, spec, args.updates, device, peak)
    fixed_first_saving(config, args.fixed_first_updates, args.segment, device)


if __name__ == "__main__":
    main()
