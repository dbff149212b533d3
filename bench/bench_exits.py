"""The cost of simulating exit criteria from one all-depth pass (`depthdiag exits`), and how
much the KL criterion's decisions move between bf16 and fp32.

1. Time: the evaluation set of the config (or of --checkpoint) at depths 1..16 as `depthdiag
   eval` scores it (`mean_nll_by_depth`), against the per-token table of the four shipped
   criteria (`depth_table`) plus the sweep of 20 thresholds each, the oracle, the lower
   frontier and the ledger (`exits_dataset`), alternated in one process. Contract: at most 1.3x.
2. Precision: the per-token exit depths of `kl` at each of its 20 default thresholds with the
   model under bf16 autocast against fp32 (the statistic itself computed in fp32 after the
   head either way): the fraction of counted targets whose exit depth differs. Meaningful on a
   trained checkpoint (--checkpoint); on the config's random model it only exercises the path.

    .venv/bin/python bench/bench_exits.py [--config configs/tiny.toml] [--checkpoint FILE] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_diag import alternated, snapshot_like  # noqa: E402

from analysis.exits import exit_depths  # noqa: E402
from depthdiag.exits import ExitsConfig, exits_dataset  # noqa: E402
from trainer.checkpoint import load_snapshot  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.exits import CRITERIA, depth_table  # noqa: E402
from trainer.model import IGNORE_INDEX  # noqa: E402
from trainer.scoring import mean_nll_by_depth  # noqa: E402

MAX_DEPTH = 16


def model_and_set(config_path: str, checkpoint: str | None):
    """(model in eval mode, evaluation tokens [E, T+1], targets [E, T] with IGNORE_INDEX where not counted)."""
    if checkpoint is not None:
        snapshot = load_snapshot(checkpoint)
        return snapshot.model("cpu").eval(), snapshot.eval_tokens, snapshot.eval_tokens[:, 1:]
    model, _, _, tokens, mask = snapshot_like(load_config(config_path))
    targets = tokens[:, 1:] if mask is None else tokens[:, 1:].masked_fill(~mask, IGNORE_INDEX)
    return model.eval(), tokens, targets


def run(config_path: str, checkpoint: str | None = None, repeats: int = 3) -> dict:
    model, tokens, targets = model_and_set(config_path, checkpoint)
    criteria = tuple(CRITERIA.values())
    config = ExitsConfig(criteria=criteria, max_depth=MAX_DEPTH, progress=False)
    depths = list(range(1, MAX_DEPTH + 1))

    def evaluate():
        mean_nll_by_depth(model, tokens, depths, targets=targets)

    def simulate():
        exits_dataset(depth_table(model, tokens, MAX_DEPTH, criteria, targets=targets), config)

    seconds = alternated({"eval": evaluate, "exits": simulate}, repeats)
    fp32 = depth_table(model, tokens, MAX_DEPTH, (CRITERIA["kl"],), targets=targets).statistics["kl"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = depth_table(model, tokens, MAX_DEPTH, (CRITERIA["kl"],), targets=targets).statistics["kl"]
    differs = [
        float((exit_depths(fp32, t, True) != exit_depths(bf16, t, True)).mean()) for t in CRITERIA["kl"].thresholds
    ]
    return {
        "source": checkpoint or config_path,
        "seconds": seconds,
        "ratio": seconds["exits"] / seconds["eval"],
        "kl_bf16_vs_fp32": {
            "thresholds": list(CRITERIA["kl"].thresholds),
            "fraction_differing": differs,
            "mean_fraction_differing": float(np.mean(differs)),
            "targets": int(fp32.shape[1]),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--checkpoint", default=None, help="A trained checkpoint instead of the config's random model.")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(args.config, args.checkpoint, args.repeats), indent=2))


if __name__ == "__main__":
    main()
