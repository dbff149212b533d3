"""nll_by_depth over serving depths 1..S vs S separate forwards, for S = 16 and 64.

Contract (docs/performance.md): the measured speed-up of the one-pass evaluation
reaches at least 85% of the speed-up the FLOPs model predicts. Both paths are
timed alternately in the same run, so machine noise hits both; only ratios are
reported.

    .venv/bin/python bench/bench_model.py [--config configs/tiny.toml] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from trainer.config import load_config
from trainer.flops import eval_flops, nll_by_depth_flops
from trainer.model import LoopedTransformer


def speedup(model: LoopedTransformer, x: torch.Tensor, y: torch.Tensor, depths: list[int], repeats: int) -> dict:
    def one_pass() -> None:
        model.nll_by_depth(x, y, depths)

    def separate() -> None:
        for s in depths:
            F.cross_entropy(model(x, depth=s).flatten(0, 1), y.flatten())

    times: dict[str, list[float]] = {"one_pass": [], "separate": []}
    with torch.no_grad():
        one_pass(), separate()  # warm-up
        for _ in range(repeats):
            for name, fn in (("one_pass", one_pass), ("separate", separate)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    shape = dict(batch_size=x.shape[0], seq_len=x.shape[1], include_embeddings=True)
    predicted = sum(eval_flops(model.config, s, **shape) for s in depths) / nll_by_depth_flops(
        model.config, depths, **shape
    )
    measured = statistics.median(times["separate"]) / statistics.median(times["one_pass"])
    return {"predicted_speedup": predicted, "measured_speedup": measured, "fraction": measured / predicted}


def run(config_path: str, repeats: int = 5, batch: int = 64) -> dict:
    config = load_config(config_path)
    torch.manual_seed(0)
    model = LoopedTransformer(config.model).eval()
    x = torch.randint(0, config.model.vocab_size, (batch, config.train.seq_len))
    y = torch.randint(0, config.model.vocab_size, (batch, config.train.seq_len))
    return {
        "config": config_path,
        "tokens": [batch, config.train.seq_len],
        "depths_1_16": speedup(model, x, y, list(range(1, 17)), repeats),
        "depths_1_64": speedup(model, x[: batch // 4], y[: batch // 4], list(range(1, 65)), max(repeats // 2, 2)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(run(args.config, args.repeats), indent=2))


if __name__ == "__main__":
    main()
