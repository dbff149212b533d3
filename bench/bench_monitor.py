"""The in-training monitor's cost: its checks as a fraction of the training time of a run
with the config's [monitor] setting (contract, docs/performance.md: at most 15%).

    python bench/bench_monitor.py [--config configs/tiny-monitor.toml] [--set key=value ...]

One model trains through `trainer.train.TrainStep` at the run's own depth mix (its updates
spread evenly over the whole schedule) and, in the same process, the monitor
(`diag.in_training.monitor.UpdateMonitor`, file writes included) checks it: rounds of `updates`
timed updates and one timed check alternate, the order flipping every round (ABBA), so
drifting machine load falls on both sides. The run's overhead is then

    checks per run x seconds per check / (updates per run x seconds per update)

with the checks a full run makes (every `monitor.every` updates, step 0 and the switch included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from bench_train import Trainer, synchronize

from diag.in_training.monitor import UpdateMonitor
from trainer.config import load_config
from trainer.distributed import resolve_device
from trainer.schedules import parse_schedule


def run(config_path: str, overrides: list[str] = (), *, rounds: int = 4, updates: int = 8) -> dict:
    # Start from no compiled code, as a training process does: the benchmarks before this one
    # compiled other variants of the same blocks, which count against torch's recompile limit.
    torch._dynamo.reset()
    config = load_config(config_path, list(overrides))
    if not config.monitor.enabled:
        raise SystemExit(f"{config_path}: monitor.every is 0; benchmark a config with a [monitor] block")
    device = resolve_device(config.train.device)
    tc, mc = config.train, config.monitor
    schedule = parse_schedule(tc.schedule, seed=tc.seed, total_updates=tc.updates)
    # The run's depth mix: `rounds * updates` updates spread evenly over the whole run.
    total = rounds * updates
    steps = [round(i * (tc.updates - 1) / max(total - 1, 1)) for i in range(total)]
    trainer = Trainer(config, device)
    with tempfile.TemporaryDirectory() as run_dir:
        monitor = UpdateMonitor(config, run_dir)
        monitor.resume(0)
        for depth in sorted({schedule.depth_at(s) for s in steps}):  # warm-up outside the timing
            trainer.update(0, depth)
        model, optimizer = trainer.step.model, trainer.step.optimizer
        monitor.after_update(0, model, optimizer)
        update_seconds, check_seconds = [], []
        for r in range(rounds):

            def train_round(r=r) -> None:
                for step in steps[r * updates : (r + 1) * updates]:
                    update_seconds.append(trainer.update(step, schedule.depth_at(step)))

            def check_round(r=r) -> None:
                synchronize(device)
                began = time.perf_counter()
                monitor.after_update((r + 1) * mc.every, model, optimizer)
                synchronize(device)
                check_seconds.append(time.perf_counter() - began)

            for side in (train_round, check_round) if r % 2 == 0 else (check_round, train_round):
                side()
        checks = len(monitor.steps())
        monitor.close()
    per_update, per_check = statistics.mean(update_seconds), statistics.mean(check_seconds)
    return {
        "config": config_path,
        "device": str(device),
        "monitor": {"every": mc.every, "batches": mc.batches, "eval_sequences": mc.eval_sequences},
        "updates_per_run": tc.updates,
        "checks_per_run": checks,
        "seconds_per_update": per_update,
        "seconds_per_check": per_check,
        "check_in_updates": per_check / per_update,
        "fraction": checks * per_check / (tc.updates * per_update),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-monitor.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=4, help="Alternating rounds of updates and one check.")
    parser.add_argument("--updates", type=int, default=8, help="Timed updates per round.")
    args = parser.parse_args()
    print(json.dumps(run(args.config, args.overrides, rounds=args.rounds, updates=args.updates), indent=2))


if __name__ == "__main__":
    main()
