"""One diagnostic unit vs the sum of its unavoidable parts.

Contract (DESIGN.md section 8): a (snapshot, batch) unit of the update
diagnostic takes at most 1.15x the time of the work it cannot avoid: one
forward+backward pass at each update depth and one all-depth evaluation
(`nll_by_depth` over the serving depths) per update. The per-snapshot work
(Delta(0), the NLL before the update) is shared by all of a snapshot's batches
and done before timing. Both sides are timed alternately in the same run, so
machine noise hits both; only the ratio is reported.

    .venv/bin/python bench/bench_diag.py [--config configs/tiny.toml] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from diag.engine import DiagnosticOptions, UpdateDiagnostic
from trainer.checkpoint import build_optimizer
from trainer.config import load_config
from trainer.model import LoopedTransformer

UPDATE_DEPTHS, SERVING = (4, 16), tuple(range(1, 17))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = load_config(args.config)
    cfg, T, B, E = config.model, config.train.seq_len, config.train.batch_size, config.data.eval_sequences
    torch.manual_seed(0)
    model = LoopedTransformer(cfg)
    optimizer = build_optimizer(model, config.optim)
    batch = torch.randint(0, cfg.vocab_size, (B, T + 1))
    eval_tokens = torch.randint(0, cfg.vocab_size, (E, T + 1))
    # One real step so the optimizer carries state, as at any snapshot.
    F.cross_entropy(model(batch[:, :-1], depth=4).flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    options = DiagnosticOptions(update_depths=UPDATE_DEPTHS, serving_depths=SERVING,
                                grad_clip=config.optim.grad_clip or None)
    diagnostic = UpdateDiagnostic(model, optimizer, eval_tokens, options)
    diagnostic.delta0, diagnostic.nll_before  # per-snapshot work, shared by every batch

    def unit() -> None:
        diagnostic.compare(batch)

    def parts() -> None:
        for depth in UPDATE_DEPTHS:
            loss = F.cross_entropy(model(batch[:, :-1], depth=depth).flatten(0, 1), batch[:, 1:].flatten())
            torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for _ in UPDATE_DEPTHS:
                for rows in eval_tokens.split(options.eval_batch_size):
                    model.nll_by_depth(rows[:, :-1], rows[:, 1:], SERVING)

    times: dict[str, list[float]] = {"unit": [], "parts": []}
    unit(), parts()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("unit", unit), ("parts", parts)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)

    ratio = statistics.median(times["unit"]) / statistics.median(times["parts"])
    print(f"diagnostic unit (update depths {UPDATE_DEPTHS}, serving 1..16) vs its unavoidable parts, "
          f"batch {B}x{T}, {E} eval sequences, {args.config}")
    print(f"  unit {statistics.median(times['unit']):.3f}s, parts {statistics.median(times['parts']):.3f}s "
          f"(medians of {args.repeats}, alternated)")
    print(f"  ratio: {ratio:.3f}x (contract <= 1.15): {'PASS' if ratio <= 1.15 else 'FAIL'}")


if __name__ == "__main__":
    main()
