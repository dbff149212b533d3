"""Training throughput: the default fast path against the plain fp32 eager loop, achieved
FLOP/s against the matmul peak, whether step time tracks modeled FLOPs, and keeping freed
memory (common/heap.py) against glibc's default malloc.

    python bench/bench_train.py [--config configs/tiny.toml] [--set key=value ...]

Every update goes through `trainer.train.TrainStep`, the training loop's own step,
with the run's batches and LR schedule. Sides that are compared run alternately
in the same process (ABBA segments), so drifting machine load falls on both; the
heap's sides, a process-wide setting, alternate as fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from common.heap import keep_freed_memory
from trainer.config import RunConfig, load_config, replace_section
from trainer.data.sources import build_source
from trainer.distributed import resolve_device
from trainer.flops import update_flops
from trainer.model import LoopedTransformer
from trainer.optim import lr_at
from trainer.schedules import parse_schedule
from trainer.train import TrainStep

FIXED_FIRST = "fixed-first:k0=4,switch=0.8,finish=uniform:1-16"
UNIFORM = "uniform:1-16"


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
    """One model taking the run's updates at whatever depths it is given, through TrainStep."""

    def __init__(self, config: RunConfig, device: torch.device):
        self.config, self.device = config, device
        self.source = build_source(config.data)
        torch.manual_seed(config.train.seed)
        self.step = TrainStep.for_run(LoopedTransformer(config.model).to(device), config)

    def update(self, step: int, depth: int) -> float:
        """Seconds for update `step` at `depth` (the loss read back, as at a log point)."""
        tc = self.config.train
        synchronize(self.device)
        began = time.perf_counter()
        batch = self.source.batch(tc.seed, step, tc.batch_size, tc.seq_len).to(self.device)  # [B, T+1]
        loss_sum, _ = self.step(batch, depth, lr_at(step, self.config.optim, tc.updates))
        float(loss_sum)
        return time.perf_counter() - began


def alternate(trainers: dict[str, Trainer], depths: dict[str, list[int]], segment: int) -> dict[str, float]:
    """Seconds each trainer spends on its depths, run in alternating `segment`-update blocks;
    the order flips every block (ABBA), since the second side of a block finds warmer caches."""
    seconds = dict.fromkeys(trainers, 0.0)
    names = list(trainers)
    updates = len(next(iter(depths.values())))
    for start in range(0, updates, segment):
        for name in names if (start // segment) % 2 == 0 else names[::-1]:
            for step in range(start, min(start + segment, updates)):
                seconds[name] += trainers[name].update(step, depths[name][step])
    return seconds


def depth_mix(config: RunConfig, updates: int) -> list[int]:
    """The depths of `updates` of the config's own updates spread evenly over its whole run."""
    tc = config.train
    schedule = parse_schedule(tc.schedule, seed=tc.seed, total_updates=tc.updates)
    return [schedule.depth_at(round(i * (tc.updates - 1) / max(updates - 1, 1))) for i in range(updates)]


def settings_speedup(config: RunConfig, device: torch.device, updates: int, segment: int) -> dict:
    """Updates/s of the config's own settings and of each single fast setting against the
    plain fp32 eager loop, on the config's schedule, alternated in one run."""
    tc = config.train
    plain = replace_section(config, "train", precision="fp32", compile=False)
    sides = {
        "plain fp32 eager": plain,
        "bf16 autocast": replace_section(plain, "train", precision="bf16"),
        "compiled blocks (fp32)": replace_section(plain, "train", compile=True),
        "bf16 + compiled blocks": replace_section(plain, "train", precision="bf16", compile=True),
    }
    default = f"default ({tc.precision}{', compiled' if tc.compile else ''})"
    depth_list = depth_mix(config, updates)
    trainers, compile_seconds = {}, {}
    for name, side in sides.items():
        began = time.perf_counter()
        trainers[name] = Trainer(side, device)
        for depth in sorted(set(depth_list)):  # warm-up, and compiling, outside the timing
            trainers[name].update(0, depth)
        compile_seconds[name] = time.perf_counter() - began
    seconds = alternate(trainers, {name: depth_list for name in trainers}, segment)
    rates = {name: updates / s for name, s in seconds.items()}
    matching = [
        name for name, side in sides.items() if (side.train.precision, side.train.compile) == (tc.precision, tc.compile)
    ]
    return {
        "updates": updates,
        "mean_depth": sum(depth_list) / updates,
        "default": default,
        "default_is": matching[0] if matching else None,
        "updates_per_second": rates,
        "warmup_seconds": compile_seconds,
        "speedup_vs_plain": {name: rate / rates["plain fp32 eager"] for name, rate in rates.items()},
    }


def achieved_flops(config: RunConfig, device: torch.device, updates: int, peak: float) -> dict:
    """Achieved FLOP/s (modeled, LM head included, as the hardware does that work) of the
    config's settings at fixed:4 and uniform:1-16, against the matmul peak."""
    tc = config.train
    rows = {}
    for spec in ("fixed:4", UNIFORM):
        schedule = parse_schedule(spec, seed=tc.seed, total_updates=updates)
        trainer = Trainer(config, device)
        trainer.update(0, schedule.depth_at(0))
        seconds = flops = 0.0
        for step in range(updates):
            depth = schedule.depth_at(step)
            seconds += trainer.update(step, depth)
            flops += update_flops(
                config.model, depth, batch_size=tc.batch_size, seq_len=tc.seq_len, include_embeddings=True
            )
        rows[spec] = {
            "seconds_per_update": seconds / updates,
            "tokens_per_second": updates * tc.batch_size * tc.seq_len / seconds,
            "flops_per_second": flops / seconds,
            "fraction_of_peak": flops / seconds / peak,
        }
    return rows


def fixed_first_saving(config: RunConfig, device: torch.device, updates: int, segment: int) -> dict:
    """Fixed-first's measured wall-clock saving over uniform against its modeled saving
    (the paper's accounting, head excluded), over the same update indices."""
    tc = config.train
    schedules = {spec: parse_schedule(spec, seed=tc.seed, total_updates=updates) for spec in (FIXED_FIRST, UNIFORM)}
    trainers = {spec: Trainer(config, device) for spec in schedules}
    depths = {spec: [s.depth_at(step) for step in range(updates)] for spec, s in schedules.items()}
    for spec, trainer in trainers.items():
        trainer.update(0, depths[spec][0])
    seconds = alternate(trainers, depths, segment)
    modeled = {
        spec: sum(update_flops(config.model, d, batch_size=tc.batch_size, seq_len=tc.seq_len) for d in depths[spec])
        for spec in schedules
    }
    measured_saving = 1 - seconds[FIXED_FIRST] / seconds[UNIFORM]
    modeled_saving = 1 - modeled[FIXED_FIRST] / modeled[UNIFORM]
    return {
        "updates": updates,
        "seconds": seconds,
        "measured_saving": measured_saving,
        "modeled_saving": modeled_saving,
        "ratio": measured_saving / modeled_saving,
    }


def one_thread_settings(config_path: str, overrides: list[str], updates: int, segment: int) -> dict:
    """`settings_speedup` in a fresh process with OMP_NUM_THREADS=1, as each job of `make
    figure4` and of the grids runs. A process of its own, because compiled CPU kernels keep
    the thread count they were compiled under."""
    return in_fresh_process(
        config_path, overrides, 1, ["--settings-only", f"--updates={updates}", f"--segment={segment}"]
    )


def in_fresh_process(config_path: str, overrides: list[str], threads: int, arguments: list[str]):
    """What this script prints as JSON when run with `arguments` on the config in a new
    process with OMP_NUM_THREADS=`threads`."""
    command = [sys.executable, __file__, "--config", config_path, *arguments]
    command += [arg for override in overrides for arg in ("--set", override)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def heap_side(config: RunConfig, device: torch.device, updates: int) -> dict:
    """Updates/s, page faults per update and the fraction of the time spent in the kernel
    of the config's own settings on its depth mix, after two warm-up updates: one side of
    `heap_speedup`, in a process of its own."""
    import resource  # Unix only, as is the heap setting this measures

    depth_list = depth_mix(config, updates)
    trainer = Trainer(config, device)
    for step in range(2):
        trainer.update(step, depth_list[0])
    before = resource.getrusage(resource.RUSAGE_SELF)
    seconds = sum(trainer.update(step, depth) for step, depth in enumerate(depth_list))
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "updates_per_second": updates / seconds,
        "page_faults_per_update": (after.ru_minflt - before.ru_minflt) / updates,
        "system_fraction": (after.ru_stime - before.ru_stime) / seconds,
    }


def heap_speedup(config_path: str, overrides: list[str], updates: int, rounds: int, threads: int) -> dict:
    """Training with freed memory kept (common/heap.py, what the commands set) against
    glibc's default malloc, at `threads` threads. The setting is process-wide, so each side
    runs in fresh processes, `rounds` of each alternated (ABBA); the speed-up is the ratio
    of their summed rates, and the page faults per update show what it removes."""
    sides: dict[str, list[dict]] = {"kept": [], "glibc default": []}
    for round_ in range(rounds):
        for side in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
            arguments = ["--heap-side", f"--updates={updates}"]
            arguments += ["--malloc-default"] if side == "glibc default" else []
            sides[side].append(in_fresh_process(config_path, overrides, threads, arguments))
    summed = {side: sum(row["updates_per_second"] for row in rows) for side, rows in sides.items()}
    return {
        "updates": updates,
        "rounds": rounds,
        "threads": threads,
        "sides": sides,
        "speedup": summed["kept"] / summed["glibc default"],
    }


def run(
    config_path: str,
    overrides: list[str],
    *,
    updates: int = 16,
    fixed_first_updates: int = 30,
    segment: int = 4,
    heap_updates: int = 24,
    heap_rounds: int = 4,
) -> dict:
    config = load_config(config_path, overrides)
    device = resolve_device(config.train.device)
    tc = config.train
    peaks = {"fp32": matmul_peak(device, torch.float32), "bf16": matmul_peak(device, torch.bfloat16)}
    threads = torch.get_num_threads()
    settings = {threads: settings_speedup(config, device, updates, segment)}
    if device.type == "cpu" and threads > 1:
        settings[1] = one_thread_settings(config_path, overrides, updates, segment)
    return {
        "config": config_path,
        "device": str(device),
        "threads": threads,
        "precision": tc.precision,
        "compile": tc.compile,
        "matmul_peak_flops": peaks,
        "settings": settings[threads],
        "settings_one_thread": settings.get(1),
        "achieved": achieved_flops(config, device, max(updates // 2, 4), peaks[tc.precision]),
        "fixed_first": fixed_first_saving(config, device, fixed_first_updates, segment),
        "heap": [heap_speedup(config_path, overrides, heap_updates, heap_rounds, n) for n in sorted(settings)]
        if device.type == "cpu" and sys.platform == "linux"
        else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--updates", type=int, default=16, help="Timed updates per side.")
    parser.add_argument("--fixed-first-updates", type=int, default=30)
    parser.add_argument("--segment", type=int, default=4, help="Updates per alternating segment.")
    parser.add_argument(
        "--achieved-only",
        action="store_true",
        help="Only tokens/s and achieved FLOP/s of the config's own settings against the matmul "
        "peak in its precision (the GPU check's throughput line).",
    )
    parser.add_argument(
        "--settings-only",
        action="store_true",
        help="Only the settings' updates/s against the plain fp32 eager loop, as JSON.",
    )
    parser.add_argument(
        "--heap-side",
        action="store_true",
        help="Only the updates/s, page faults per update and kernel-time fraction of the config's "
        "own settings on its depth mix, as JSON (one side of the heap benchmark).",
    )
    parser.add_argument(
        "--malloc-default",
        action="store_true",
        help="Leave glibc's malloc at its defaults instead of keeping freed memory as the commands do.",
    )
    args = parser.parse_args()
    if not args.malloc_default:
        keep_freed_memory()
    if args.heap_side:
        config = load_config(args.config, args.overrides)
        print(json.dumps(heap_side(config, resolve_device(config.train.device), args.updates)))
        return
    if args.settings_only:
        config = load_config(args.config, args.overrides)
        print(json.dumps(settings_speedup(config, resolve_device(config.train.device), args.updates, args.segment)))
        return
    if args.achieved_only:
        config = load_config(args.config, args.overrides)
        device = resolve_device(config.train.device)
        dtype = torch.bfloat16 if config.train.precision == "bf16" else torch.float32
        peak = matmul_peak(device, dtype, size=8192 if device.type == "cuda" else 2048)
        for spec, row in achieved_flops(config, device, args.updates, peak).items():
            print(
                f"{spec}: {row['tokens_per_second']:,.0f} tokens/s, {row['flops_per_second'] / 1e12:.2f} TFLOP/s "
                f"modeled = {row['fraction_of_peak']:.1%} of the {config.train.precision} matmul peak "
                f"({peak / 1e12:.1f} TFLOP/s measured here), compile={config.train.compile}"
            )
        return
    print(
        json.dumps(
            run(
                args.config,
                args.overrides,
                updates=args.updates,
                fixed_first_updates=args.fixed_first_updates,
                segment=args.segment,
            ),
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
