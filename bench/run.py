"""`make bench`: every benchmark in one process, one after another, into bench/results.json.

Each figure is a ratio of two sides measured alternately in this run (never an
absolute time compared with a threshold), printed next to its target. The measured
part of docs/performance.md is rendered from the written file by bench/report.py.

    .venv/bin/python bench/run.py [--config configs/tiny.toml] [--monitor-config configs/tiny-monitor.toml]
                                  [--out bench/results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import operator
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common.heap import keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def help_seconds(repeats: int = 5) -> float:
    """Median wall time of `depthdiag --help` in a fresh interpreter."""
    command = [sys.executable, "-c", "from depthdiag.cli import main; main(['--help'])"]
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True, cwd=ROOT)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def machine() -> dict:
    """The machine of the run: its cores and platform, and the kernels torch ran (the record
    results files carry, trainer/machine.py)."""
    import torch

    from trainer.machine import machine as kernels

    record = kernels()
    return {
        "cpu": record["cpu_model"],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "kernels": record,
    }


_HOLDS = {">=": operator.ge, "<=": operator.le, "<": operator.lt}


def _row(benchmark: str, measured: float, target: str, unit: str) -> dict:
    """One figure of the table; `target` is a comparison and a bound, e.g. '>= 2.0'."""
    comparison, bound = target.split()
    return {
        "benchmark": benchmark,
        "measured": measured,
        "target": target,
        "holds": _HOLDS[comparison](measured, float(bound)),
        "unit": unit,
    }


def figures(results: dict) -> list[dict]:
    """The table: one row per benchmark figure, with its target and whether it holds."""
    train, diag, model, attribution = results["train"], results["diag"], results["model"], results["attribution"]
    training = [(train["settings"], f"{train['threads']} torch threads")]
    if train.get("settings_one_thread"):
        training.append((train["settings_one_thread"], "1 torch thread, as each job of `make figure4` runs"))
    return [
        *(
            _row(
                f"training updates/s, tiny config, default vs plain fp32 eager (alternated), {threads}",
                settings["speedup_vs_plain"][settings["default_is"]],
                ">= 2.0",
                "x",
            )
            for settings, threads in training
        ),
        _row(
            "diagnose units/min, default vs the first version's one-at-a-time path",
            diag["throughput"]["speedup"],
            ">= 2.0",
            "x",
        ),
        _row(
            "nll_by_depth s=1..16 vs separate forwards, fraction of the FLOPs model's speed-up",
            model["depths_1_16"]["fraction"],
            ">= 0.85",
            "",
        ),
        _row(
            "nll_by_depth s=1..64 vs separate forwards, fraction of the FLOPs model's speed-up",
            model["depths_1_64"]["fraction"],
            ">= 0.85",
            "",
        ),
        _row("one diagnostic unit vs its unavoidable parts", diag["unit_vs_parts"]["ratio"], "<= 1.15", "x"),
        _row(
            "fixed-first vs uniform wall-clock saving, measured / modeled", train["fixed_first"]["ratio"], ">= 0.90", ""
        ),
        _row(
            "in-training monitor at its default setting, fraction of training time",
            results["monitor"]["fraction"],
            "<= 0.15",
            "",
        ),
        _row(
            "the same monitor through the transformers.Trainer callback, fraction of training time",
            results["monitor_callback"]["fraction"],
            "<= 0.15",
            "",
        ),
        _row(
            "diagnose units/min at 2 ranks vs 1 (torchrun, units spread, one thread each)",
            results["scale"]["ranks"]["speedup"],
            ">= 1.8",
            "x",
        ),
        _row(
            "diagnose unit's peak memory vs a training step's at depth 16, 55M parameters",
            results["scale"]["memory"]["unit_over_step"],
            "<= 2.0",
            "x",
        ),
        _row(
            "sharded diagnostic's per-rank peak at 2 ranks vs the unsharded unit's",
            results["scale"]["memory"]["sharded_over_unsharded"],
            "<= 0.6",
            "x",
        ),
        _row(
            "exit criteria, 4 x 20 thresholds with oracle and ledger from one pass, vs eval at depths 1..16",
            results["exits"]["ratio"],
            "<= 1.3",
            "x",
        ),
        _row(
            "attributing a pool of 256 sequences at serving depths 1..16 vs one diagnostic unit",
            attribution["time"]["pool_over_unit"]["256"],
            "<= 4.0",
            "x",
        ),
        _row(
            "attribution's time, pool of 1,024 over 256, over the linear 4",
            attribution["time"]["growth"] / attribution["time"]["expected_growth"],
            "<= 1.2",
            "",
        ),
        _row(
            "attributing a pool of 1,024: peak memory over the unit's plus what the design keeps",
            attribution["memory"]["pool_over_unit_and_kept"],
            "<= 1.0",
            "",
        ),
        _row("`depthdiag --help` wall time", results["help_seconds"], "< 0.5", "s"),
    ]


def format_table(rows: list[dict]) -> str:
    lines = ["| benchmark | measured | target | holds |", "|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['benchmark']} | {row['measured']:.2f}{row['unit']} | {row['target']} | "
            f"{'yes' if row['holds'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument(
        "--monitor-config",
        default="configs/tiny-monitor.toml",
        help="The run (with its [monitor] setting) whose monitor overhead is measured.",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results.json"))
    args = parser.parse_args()
    keep_freed_memory()  # as the commands do

    import bench_attribution
    import bench_diag
    import bench_exits
    import bench_model
    import bench_monitor
    import bench_monitor_callback
    import bench_scale
    import bench_train

    began = time.perf_counter()
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "help_seconds": help_seconds(),
    }
    for name, module in (("model", bench_model), ("train", bench_train), ("diag", bench_diag)):
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        results[name] = module.run(args.config) if name != "train" else module.run(args.config, [])
    print("bench: monitor ...", file=sys.stderr, flush=True)
    results["monitor"] = bench_monitor.run(args.monitor_config)
    print("bench: monitor through the Trainer callback ...", file=sys.stderr, flush=True)
    results["monitor_callback"] = bench_monitor_callback.run(args.monitor_config)
    print("bench: scale (diagnose across ranks, memory) ...", file=sys.stderr, flush=True)
    results["scale"] = bench_scale.run(args.config)
    print("bench: exit criteria ...", file=sys.stderr, flush=True)
    results["exits"] = bench_exits.run(args.config)
    print("bench: attribution ...", file=sys.stderr, flush=True)
    results["attribution"] = bench_attribution.run(args.config)
    results["figures"] = figures(results)
    results["seconds"] = time.perf_counter() - began
    out = Path(args.out)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    print(format_table(results["figures"]))
    print(f"wrote {out} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
