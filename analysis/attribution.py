"""The sequences a results file of `depthdiag attribute` ranks highest and lowest.

attribution(snapshot, batch, example, serving_depth) says how much each training sequence
pushes the deep update ahead (positive) or holds it back (negative) at each serving depth, to
first order (docs/diagnostic.md). Each unit scores its own batch's rows, then the pool's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import xarray as xr


def extreme_sequences(ds: xr.Dataset, k: int = 2) -> list[dict]:
    """Per snapshot and serving depth, the `k` highest and `k` lowest attributions over all of
    the snapshot's units: a row each with the batch, example, whether it is a batch row, the
    attribution, the sequence's token ids, and its rank ('top 1', ..., 'bottom 1')."""
    rows = []
    for snapshot in ds["snapshot"].values:
        here = ds.sel(snapshot=snapshot)
        values = here["attribution"].transpose("batch", "example", "serving_depth").values  # [B, N, S]
        for s, depth in enumerate(here["serving_depth"].values):
            flat = values[:, :, s].ravel()
            finite = np.flatnonzero(np.isfinite(flat))
            order = finite[np.argsort(flat[finite], kind="stable")]
            picks = [(f"top {r + 1}", i) for r, i in enumerate(order[::-1][:k])]
            picks += [(f"bottom {r + 1}", i) for r, i in enumerate(order[:k])]
            for rank, index in picks:
                batch, example = np.unravel_index(index, values.shape[:2])
                rows.append(
                    {
                        "snapshot": str(snapshot),
                        "serving_depth": int(depth),
                        "rank": rank,
                        "batch": int(here["batch"].values[batch]),
                        "example": int(here["example"].values[example]),
                        "in_batch": bool(here["in_batch"].values[example]),
                        "pool_row": int(example - here["in_batch"].values.sum()),
                        "attribution": float(flat[index]),
                        "tokens": [int(t) for t in here["example_tokens"].values[batch, example]],
                    }
                )
    return rows


def extremes_text(rows: Sequence[dict], decode: Callable[[Sequence[int]], str], width: int = 90) -> str:
    """The printed list: per snapshot and serving depth, each ranked sequence decoded."""
    lines = ["sequences that push the deep update ahead (top) or hold it back (bottom), to first order:"]
    heading = None
    for row in rows:
        if (row["snapshot"], row["serving_depth"]) != heading:
            heading = (row["snapshot"], row["serving_depth"])
            lines.append(f"{row['snapshot']}, serving depth {row['serving_depth']}:")
        where = f"batch {row['batch']} row {row['example']}"
        if not row["in_batch"]:  # the pool is scored against every batch's update
            where = f"pool {row['pool_row']} (batch {row['batch']})"
        text = decode(row["tokens"])
        text = text if len(text) <= width else text[: width - 3] + "..."
        lines.append(f"  {row['rank']:<8} {row['attribution']:+.3e}  {where:<18} {text}")
    return "\n".join(lines)
