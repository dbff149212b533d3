"""Render bench/results.json into the measured part of docs/performance.md (between its markers).

.venv/bin/python bench/report.py [bench/results.json [docs/performance.md]]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from common.provenance import describe_machine

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = ROOT / "bench" / "results.json"
DEFAULT_REPORT = ROOT / "docs" / "performance.md"
"""The page whose markers the measurements go between (the performance contracts' page)."""
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _heap_paragraph(heaps: list[dict]) -> str:
    """Keeping freed memory (common/heap.py) against glibc's default, at each thread count."""

    def mean(heap: dict, side: str, key: str) -> float:
        rows = heap["sides"][side]
        return sum(row[key] for row in rows) / len(rows)

    parts = [
        f"{heap['speedup']:.2f}x at {heap['threads']} thread{'s' if heap['threads'] > 1 else ''} "
        f"(page faults per update {mean(heap, 'glibc default', 'page_faults_per_update'):,.0f} to "
        f"{mean(heap, 'kept', 'page_faults_per_update'):,.0f}, time in the kernel "
        f"{mean(heap, 'glibc default', 'system_fraction'):.0%} to {mean(heap, 'kept', 'system_fraction'):.0%})"
        for heap in heaps
    ]
    return (
        "Freed memory kept (common/heap.py, what every command sets) against glibc's default malloc, "
        f"updates/s in fresh processes alternated, {heaps[0]['rounds']} a side: {', '.join(parts)}."
    )


def render(results: dict) -> str:
    machine = results["machine"]
    train, diag = results["train"], results["diag"]
    kernels = describe_machine(machine["kernels"]) if "kernels" in machine else "not recorded (an older run)"
    lines = [
        f"From `make bench` on {results['date'][:10]}: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['torch_threads']} torch threads, torch {machine['torch']} "
        f"(`bench/results.json` holds every number). Kernels: {kernels}.",
        "",
        "| benchmark | measured | target | holds |",
        "|---|---|---|---|",
    ]
    for row in results["figures"]:
        lines.append(
            f"| {row['benchmark']} | {row['measured']:.2f}{row['unit']} | {row['target']} | "
            f"{'yes' if row['holds'] else '**no**'} |"
        )
    settings, one_thread = train["settings"], train.get("settings_one_thread")
    lines += [
        "",
        f"Training settings on the tiny config's depth mix (mean depth {settings['mean_depth']:.1f}), "
        "updates/s relative to the plain fp32 eager loop, alternated in one run "
        f"(default: {settings['default_is']}):",
        "",
        f"| setting | speed-up, {train['threads']} threads | warm-up incl. compiling |"
        + (" speed-up, 1 thread | warm-up, 1 thread |" if one_thread else ""),
        "|---|---|---|" + ("---|---|" if one_thread else ""),
    ]
    for name, ratio in settings["speedup_vs_plain"].items():
        row = f"| {name} | {ratio:.2f}x | {settings['warmup_seconds'][name]:.0f} s |"
        if one_thread:
            row += f" {one_thread['speedup_vs_plain'][name]:.2f}x | {one_thread['warmup_seconds'][name]:.0f} s |"
        lines.append(row)
    peaks = train["matmul_peak_flops"]
    lines += [
        "",
        f"Matmul peak measured in the same run: fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, "
        f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s. Achieved by training ({train['precision']}):",
    ]
    for spec, row in train["achieved"].items():
        lines.append(
            f"{spec} {row['flops_per_second'] / 1e9:.0f} GFLOP/s "
            f"({row['fraction_of_peak']:.0%} of the {train['precision']} peak, "
            f"{row['tokens_per_second']:,.0f} tokens/s);"
        )
    lines[-1] = lines[-1].rstrip(";") + "."
    if train.get("heap"):
        lines += ["", _heap_paragraph(train["heap"])]
    throughput = diag["throughput"]
    lines += [
        "",
        f"Diagnose: {throughput['units_per_minute']['default']:.1f} units/min by default against "
        f"{throughput['units_per_minute']['first version']:.1f} for the first version's path "
        f"({throughput['first_version_options']['precision']} gradient passes, "
        f"{throughput['first_version_options']['eval_batch_size']} rows per evaluation chunk, every token read "
        f"out; the default: {throughput['default_options']['precision']}, "
        f"{throughput['default_options']['eval_batch_size']} rows, only the counted tokens read out, "
        f"{throughput['counted_fraction']:.0%} of this evaluation set's). The default's two "
        f"fp32 evaluations alone take 1/{throughput['speedup_with_free_gradients']:.2f} of the first version's unit: "
        "even free gradient passes would stay below that speed-up. Evaluating two updated parameter sets:",
        "",
        "| evaluation | seconds | largest NLL difference from one at a time, 32 rows |",
        "|---|---|---|",
    ]
    for name, row in diag["evaluation"].items():
        lines.append(f"| {name} | {row['seconds']:.2f} | {row['max_nll_difference']:.1e} |")
    memory = diag["memory"]
    lines += [
        "",
        f"Peak resident memory of a diagnose process: {memory['peak_rss_bytes'] / 2**20:.0f} MiB, "
        f"{(memory['peak_rss_bytes'] - memory['rss_before_model_bytes']) / 2**20:.0f} MiB above the "
        f"interpreter with torch loaded, against {memory['weights_and_optimizer_bytes'] / 2**20:.1f} MiB of "
        f"weights plus optimizer state.",
    ]
    if "scale" in results:
        lines += ["", _scale_paragraph(results["scale"]), "", _fits_table(results["scale"]["memory"])]
    return "\n".join(lines)


MODEL_SIZES = {"200M (paper-200m)": 206e6, "1B (paper-1b)": 1.06e9, "3.5B (Huginn's size)": 3.5e9}
GPUS = {"80 GB": 80e9, "141 GB": 141e9}
USABLE = 0.8
"""Of a GPU's memory, what the state may take: the rest is left for activations, the CUDA
context and the allocator's slack."""


def _ranks_needed(state_bytes: float, capacity: float, efficiency: float) -> int:
    """The fewest ranks (1, 2, 4, 8, ...) whose per-rank share of `state_bytes` fits `capacity`;
    a share at R ranks is state / R / efficiency (efficiency measured at 2 ranks)."""
    ranks = 1
    while (state_bytes if ranks == 1 else state_bytes / ranks / efficiency) > capacity:
        ranks *= 2
    return ranks


def _fits_table(memory: dict) -> str:
    """What fits on one GPU, from the bytes per parameter measured (bench/bench_scale.py)."""
    per = memory["bytes_per_parameter"]
    train, unit, sharded = per["train_step"], per["diagnose_unit"], per["sharded_unit_per_rank"]
    efficiency = unit / 2 / sharded  # 1.0: the 2-rank share is exactly half
    lines = [
        f"What fits, from the bytes per parameter measured above with a negligible batch (a training step "
        f"{train:.1f}, a diagnose unit {unit:.1f}, a diagnose unit sharded over 2 ranks {sharded:.1f} per rank, "
        f"so {efficiency:.0%} of a perfect halving), allowing the state {USABLE:.0%} of a GPU's memory and "
        "the rest for activations (which come on top: a unit's gradient pass at depth 16 keeps what a "
        "training step at depth 16 of the same micro-batch keeps). Ranks: GPUs that a sharded run "
        "(`train.parallel=fsdp`, `diagnose --sharded`) needs, assuming the share keeps shrinking as at 2 "
        "ranks; measured on the CPU, so the CUDA context and the caching allocator come on top.",
        "",
        "| model | training state | diagnose state | " + " | ".join(f"train / diagnose, {g}" for g in GPUS) + " |",
        "|---|---|---|" + "---|" * len(GPUS),
    ]
    for name, parameters in MODEL_SIZES.items():
        cells = []
        for capacity in GPUS.values():
            usable = USABLE * capacity
            needs = [_ranks_needed(b * parameters, usable, efficiency) for b in (train, unit)]
            cells.append(" / ".join("1 GPU" if n == 1 else f"{n} ranks" for n in needs))
        lines.append(
            f"| {name} | {train * parameters / 1e9:.0f} GB | {unit * parameters / 1e9:.0f} GB | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def _scale_paragraph(scale: dict) -> str:
    """Diagnose across ranks and the memory of the diagnostic (bench/bench_scale.py)."""
    ranks, memory = scale["ranks"], scale["memory"]
    per_minute = ranks["units_per_minute"]
    mib = 2**20
    step, unit, sharded = memory["train_step"], memory["diagnose_unit"], memory["sharded_unit_per_rank"]
    return "\n".join(
        [
            f"Diagnose across ranks ({ranks['units']} units of one snapshot of {ranks['config']}, one thread per "
            f"process): {per_minute['1']:.1f} units/min at 1 rank, {per_minute['2']:.1f} at 2 "
            f"({ranks['speedup']:.2f}x over the units; {ranks['speedup_with_start_up']:.2f}x of the whole command, "
            f"start-up and loading included: {ranks['wall_seconds']['1']:.1f} s and "
            f"{ranks['wall_seconds']['2']:.1f} s).",
            "",
            f"Memory on a {memory['parameters'] / 1e6:.0f}M-parameter model, batch {memory['batch'][0]} x "
            f"{memory['batch'][1]} tokens, peak above the process before the model existed (freed memory handed "
            f"back at once): a training step at depth 16 {step['peak_bytes'] / mib:,.0f} MiB, one diagnose unit "
            f"(depths 4 and 16, serving 1-16) {unit['peak_bytes'] / mib:,.0f} MiB "
            f"({memory['unit_over_step']:.2f}x), the same unit sharded over 2 ranks {sharded['peak_bytes'] / mib:,.0f} "
            f"MiB per rank ({memory['sharded_over_unsharded']:.2f}x the unsharded unit; {sharded['seconds']:.0f} s "
            f"against {unit['seconds']:.0f} s unsharded on this machine's cores).",
        ]
    )


def main() -> None:
    if len(sys.argv) > 3:
        sys.exit("usage: bench/report.py [RESULTS_JSON [REPORT_MD]]")
    results_path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_RESULTS
    report_path = Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_REPORT
    results = json.loads(results_path.read_text(encoding="utf-8"))
    report = report_path.read_text(encoding="utf-8")
    if BEGIN not in report or END not in report:
        sys.exit(f"{report_path}: no {BEGIN} ... {END} markers to fill")
    head, rest = report.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    tmp = report_path.with_suffix(".md.tmp")
    tmp.write_text(f"{head}{BEGIN}\n{render(results)}\n{END}{tail}", encoding="utf-8")
    os.replace(tmp, report_path)
    print(f"updated {report_path} from {results_path}")


if __name__ == "__main__":
    main()
