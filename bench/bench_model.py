"""nll_by_depth over serving depths 1..16 vs 16 separate forwards.

Contract (DESIGN.md section 8): the measured speed-up of the one-pass
evaluation reaches at least 85% of the speed-up the FLOPs model predicts.
Both paths are timed alternately in the same run, so machine noise hits both;
only ratios are reported.

    .venv/bin/python bench/bench_model.py [--config configs/tiny.toml] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from trainer.config import load_config
from trainer.flops import eval_flops, nll_by_depth_flops
from trainer.model import LoopedTransformer

DEPTHS = list(range(1, 17))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64, help="evaluation sequences per pass")
    args = parser.parse_args()

    config = load_config(args.config)
    model_config, seq_len = config.model, config.train.seq_len
    torch.manual_seed(0)
    model = LoopedTransformer(model_config).eval()
    x = torch.randint(0, model_config.vocab_size, (args.batch, seq_len))
    y = torch.randint(0, model_config.vocab_size, (args.batch, seq_len))

    def one_pass() -> None:
        model.nll_by_depth(x, y, DEPTHS)

    def separate() -> None:
        for s in DEPTHS:
            F.cross_entropy(model(x, depth=s).flatten(0, 1), y.flatten())

    times: dict[str, list[float]] = {"one_pass": [], "separate": []}
    with torch.no_grad():
        one_pass(), separate()  # warm-up
        for _ in range(args.repeats):
            for name, fn in (("one_pass", one_pass), ("separate", separate)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)

    shape = dict(batch_size=args.batch, seq_len=seq_len, include_embeddings=True)
    predicted = sum(eval_flops(model_config, s, **shape) for s in DEPTHS) / nll_by_depth_flops(model_config, DEPTHS, **shape)
    measured = statistics.median(times["separate"]) / statistics.median(times["one_pass"])
    fraction = measured / predicted
    print(f"nll_by_depth(1..16) vs 16 separate forwards, {args.batch}x{seq_len} tokens, {args.config}")
    print(f"  predicted speed-up (FLOPs model): {predicted:.2f}x")
    print(f"  measured speed-up (median of {args.repeats}, alternated): {measured:.2f}x")
    print(f"  fraction of predicted: {fraction:.2f} (contract >= 0.85): {'PASS' if fraction >= 0.85 else 'FAIL'}")


if __name__ == "__main__":
    main()
