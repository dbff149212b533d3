"""Diagnose throughput and the cost of one diagnostic unit.

Everything runs on the evaluation set a default `depthdiag diagnose` of the config scores
(`--eval-set auto`: for bioS, the attribute-value targets only).

1. Units per minute of the default diagnostic (gradient passes in the run's training
   precision, evaluation as `UpdateDiagnostic.evaluate` does it, reading out only the
   counted tokens) against the first version's path (fp32 gradient passes, one update at
   a time in chunks of 32 rows, every token read out), alternated in one process. Both
   give the same NLL within float32 rounding when the precision is the same.
   Alongside, the default's two evaluations alone: the first version's unit over them
   is the most any faster gradient pass could give.
2. Evaluation variants, measured on the same updates: chunk sizes, both updates stacked
   under torch.func.vmap, and the first version's readout of every token.
3. One unit against the sum of its unavoidable parts (two forward+backward passes, one
   all-depth evaluation per update). Contract (docs/performance.md): at most 1.15x.
4. Peak resident memory of a diagnose process against the size of weights plus
   optimizer state (a fresh subprocess, so nothing else inflates its peak).

    .venv/bin/python bench/bench_diag.py [--config configs/tiny.toml] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic, module_mode
from diag.arithmetic.measures import match_rms
from diag.sources.evalset import evaluation_set, resolve_eval_set
from trainer.config import RunConfig, load_config
from trainer.model import IGNORE_INDEX, LoopedTransformer
from trainer.optim import build_optimizer
from trainer.scoring import NllByDepth, mean_nll_by_depth

UPDATE_DEPTHS, SERVING = (4, 16), tuple(range(1, 17))
FIRST_VERSION = {"precision": "fp32", "eval_batch_size": 32}
"""The settings of the first version's diagnose on the tiny config."""


class EveryTokenReadout(nn.Module):
    """The first version's scoring: logits of every token at every depth, then the NLL of the
    counted targets. Its `nll_by_depth` is what `mean_nll_by_depth` calls, with the model's
    weights under `model.<name>`."""

    def __init__(self, model: LoopedTransformer):
        super().__init__()
        self.model = model

    def nll_by_depth(self, input_ids: torch.Tensor, targets: torch.Tensor, depths: list[int]) -> torch.Tensor:
        nll = {
            s: F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
            for s, logits in self.model.logits_by_depth(input_ids, depths)
        }
        return torch.stack([nll[s] for s in depths])


class FirstVersionDiagnostic(UpdateDiagnostic):
    """`UpdateDiagnostic` evaluating as the first version did: one update at a time, every token read out."""

    def evaluate(self, update=None) -> np.ndarray:
        params = dict(self.theta)
        for name, u in zip(self.stepped, update or []):
            params[name] = params[name] + u
        with module_mode(self.model, training=False):
            nll = mean_nll_by_depth(
                EveryTokenReadout(self.model),
                self.eval_tokens,
                list(self.options.serving_depths),
                targets=self.eval_targets,
                batch_size=self.options.eval_batch_size,
                counts=self._chunk_counts,
                state=lambda: {f"model.{name}": value for name, value in self.module_state(params).items()},
            )
        return nll.cpu().numpy()


def snapshot_like(config: RunConfig):
    """A model and optimizer with state (one real step taken), a batch, and the evaluation
    set (int64 [E, T+1]) and mask (bool [E, T] or None) a default diagnose of `config` scores."""
    cfg, T, B = config.model, config.train.seq_len, config.train.batch_size
    torch.manual_seed(0)
    model = LoopedTransformer(cfg)
    optimizer = build_optimizer(model, config.optim)
    batch = torch.randint(0, cfg.vocab_size, (B, T + 1))
    eval_tokens = torch.randint(0, cfg.vocab_size, (config.data.eval_sequences, T + 1))
    eval_tokens, eval_mask = evaluation_set(resolve_eval_set("auto", config, "bench"), config, eval_tokens)
    F.cross_entropy(model(batch[:, :-1], depth=4).flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, batch, eval_tokens, eval_mask


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def alternated(functions: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turns after one warm-up each."""
    for fn in functions.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            times[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in times.items()}


def throughput(config: RunConfig, repeats: int) -> dict:
    model, optimizer, batch, eval_tokens, eval_mask = snapshot_like(config)
    common = dict(update_depths=UPDATE_DEPTHS, serving_depths=SERVING, grad_clip=config.optim.grad_clip or None)
    default = DiagnosticOptions(precision=config.train.precision, **common)
    first = DiagnosticOptions(**FIRST_VERSION, **common)
    diagnostics = {
        "default": UpdateDiagnostic(model, optimizer, eval_tokens, default, eval_mask=eval_mask),
        "first version": FirstVersionDiagnostic(model, optimizer, eval_tokens, first, eval_mask=eval_mask),
    }
    for diagnostic in diagnostics.values():
        _ = diagnostic.nll_before  # per-snapshot work, shared by every batch
    units = {name: (lambda d=d: d.compare(batch)) for name, d in diagnostics.items()}
    # The default's evaluations alone, on the updates a unit evaluates: what a unit would
    # cost if its gradient passes were free, the bound on any faster gradient path.
    reference = diagnostics["default"]
    gradients = [reference.gradient(batch, depth)[1] for depth in UPDATE_DEPTHS]
    matched, _ = match_rms([reference.update(g) for g in gradients], default.rms_match)
    seconds = alternated({**units, "default evaluations": lambda: [reference.evaluate(u) for u in matched]}, repeats)
    return {
        "default_options": {"precision": default.precision, "eval_batch_size": default.eval_batch_size},
        "first_version_options": {**FIRST_VERSION, "readout": "every token"},
        "counted_fraction": _counted_fraction(eval_mask),
        "units_per_minute": {name: 60 / seconds[name] for name in units},
        "speedup": seconds["first version"] / seconds["default"],
        "speedup_with_free_gradients": seconds["first version"] / seconds["default evaluations"],
    }


def _counted_fraction(eval_mask: torch.Tensor | None) -> float:
    return 1.0 if eval_mask is None else float(eval_mask.float().mean())


def evaluation_variants(config: RunConfig, repeats: int) -> dict:
    """Seconds to evaluate two updated parameter sets, per variant, and the largest NLL
    difference of each from the one-at-a-time chunk-32 evaluation."""
    model, optimizer, batch, eval_tokens, eval_mask = snapshot_like(config)
    options = dict(update_depths=UPDATE_DEPTHS, serving_depths=SERVING, grad_clip=config.optim.grad_clip or None)
    by_chunk = {
        rows: UpdateDiagnostic(
            model, optimizer, eval_tokens, DiagnosticOptions(eval_batch_size=rows, **options), eval_mask=eval_mask
        )
        for rows in (16, 32, 64)
    }
    reference = by_chunk[32]
    updates = [reference.update(reference.gradient(batch, depth)[1]) for depth in UPDATE_DEPTHS]
    results = {
        f"one at a time, {rows} rows per chunk": (lambda d=d: [d.evaluate(u) for u in updates])
        for rows, d in by_chunk.items()
    }
    results["stacked under vmap, 64 rows"] = lambda: stacked_evaluation(reference, updates)
    first = FirstVersionDiagnostic(model, optimizer, eval_tokens, DiagnosticOptions(**options), eval_mask=eval_mask)
    results["one at a time, 32 rows, every token read out (first version)"] = lambda: [
        first.evaluate(u) for u in updates
    ]
    expected = torch.from_numpy(np.stack([reference.evaluate(u) for u in updates]))
    seconds = alternated(results, repeats)
    differences = {name: float((torch.as_tensor(fn()) - expected).abs().max()) for name, fn in results.items()}
    return {name: {"seconds": seconds[name], "max_nll_difference": differences[name]} for name in results}


def stacked_evaluation(diagnostic: UpdateDiagnostic, updates) -> torch.Tensor:
    """Both updated parameter sets evaluated in one vmap over stacked weights: [updates, S]."""
    params = []
    for update in updates:
        values = dict(diagnostic.theta)
        for name, u in zip(diagnostic.stepped, update):
            values[name] = values[name] + u
        params.append(values)
    stacked = {f"model.{name}": torch.stack([p[name] for p in params]) for name in params[0]}
    buffers = {f"model.{name}": b for name, b in diagnostic.buffers.items()}
    module = NllByDepth(diagnostic.model)
    tokens, targets = diagnostic.eval_tokens, diagnostic.eval_targets
    with torch.no_grad():
        nll = torch.vmap(
            lambda p: torch.func.functional_call(module, {**p, **buffers}, (tokens[:, :-1], targets, list(SERVING)))
        )(stacked)
    return nll.double()


def unit_vs_parts(config: RunConfig, repeats: int) -> dict:
    model, optimizer, batch, eval_tokens, eval_mask = snapshot_like(config)
    options = DiagnosticOptions(
        update_depths=UPDATE_DEPTHS,
        serving_depths=SERVING,
        grad_clip=config.optim.grad_clip or None,
        precision=config.train.precision,
    )
    diagnostic = UpdateDiagnostic(model, optimizer, eval_tokens, options, eval_mask=eval_mask)
    eval_targets = diagnostic.eval_targets
    _ = diagnostic.nll_before
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=options.precision == "bf16")

    def parts() -> None:
        for depth in UPDATE_DEPTHS:
            with autocast:
                logits = model(batch[:, :-1], depth=depth)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for _ in UPDATE_DEPTHS:
                for rows, targets in zip(
                    eval_tokens.split(options.eval_batch_size), eval_targets.split(options.eval_batch_size)
                ):
                    model.nll_by_depth(rows[:, :-1], targets, SERVING)

    seconds = alternated({"unit": lambda: diagnostic.compare(batch), "parts": parts}, repeats)
    return {
        "unit_seconds": seconds["unit"],
        "parts_seconds": seconds["parts"],
        "ratio": seconds["unit"] / seconds["parts"],
    }


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in bytes. Not
    ru_maxrss: Linux carries that over exec from the forking parent, so a subprocess of a
    big process would start at the parent's peak."""
    for line in open("/proc/self/status", encoding="ascii"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_probe(config_path: str) -> None:
    """Run in a fresh process: resident memory before building anything, and its peak after
    building the model and optimizer and running two units."""
    config = load_config(config_path)
    before = _status_bytes("VmRSS")
    model, optimizer, batch, eval_tokens, eval_mask = snapshot_like(config)
    options = DiagnosticOptions(precision=config.train.precision, grad_clip=config.optim.grad_clip or None)
    diagnostic = UpdateDiagnostic(model, optimizer, eval_tokens, options, eval_mask=eval_mask)
    for _ in range(2):
        diagnostic.compare(batch)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    peak = _status_bytes("VmHWM")
    print(
        json.dumps(
            {"peak_rss_bytes": peak, "rss_before_model_bytes": before, "weights_and_optimizer_bytes": state_bytes}
        )
    )


def memory(config_path: str) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--config", config_path, "--memory-probe"],
        capture_output=True,
        text=True,
        check=True,
    )
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    probe["peak_over_baseline_per_state_byte"] = (probe["peak_rss_bytes"] - probe["rss_before_model_bytes"]) / probe[
        "weights_and_optimizer_bytes"
    ]
    return probe


def run(config_path: str, repeats: int = 3) -> dict:
    config = load_config(config_path)
    return {
        "config": config_path,
        "threads": torch.get_num_threads(),
        "throughput": throughput(config, repeats),
        "evaluation": evaluation_variants(config, repeats),
        "unit_vs_parts": unit_vs_parts(config, repeats),
        "memory": memory(config_path),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        memory_probe(args.config)
        return
    print(json.dumps(run(args.config, args.repeats), indent=2))


if __name__ == "__main__":
    main()
