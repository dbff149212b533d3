"""Evaluate a checkpoint or snapshot at many serving depths: mean token NLL on
the evaluation set it carries (one `nll_by_depth` pass per minibatch), and for
the bioS task the recalled bits per person (both computed by trainer/scoring.py),
as a Dataset over `serving_depth`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from common.provenance import package_version
from trainer.checkpoint import load_snapshot
from trainer.data.sources import build_source
from trainer.distributed import resolve_device
from trainer.machine import machine
from trainer.scoring import mean_nll_by_depth, recall_bits


def evaluate_checkpoint(
    path: str | Path,
    serving_depths: Sequence[int],
    *,
    device: str = "auto",
    batch_size: int = 32,
    progress: bool = True,
) -> xr.Dataset:
    """NLL (and bioS recall bits) per serving depth of a checkpoint or snapshot, as a
    Dataset over `serving_depth` with the file's provenance in its attributes."""
    snapshot = load_snapshot(path)
    target = resolve_device(device)
    model = snapshot.model(target).eval()
    depths = tuple(int(s) for s in serving_depths)
    nll = mean_nll_by_depth(
        model, snapshot.eval_tokens, depths, batch_size=batch_size, device=target, progress=progress
    )
    variables = {
        "nll": (
            ("serving_depth",),
            nll.cpu().numpy(),
            {"long_name": "mean token NLL on the evaluation set", "units": "nats"},
        )
    }
    if snapshot.config.data.source == "bios":
        source = build_source(snapshot.config.data)
        bits = recall_bits(model, source, depths, device=target, progress=progress)
        variables["recall_bits"] = (
            ("serving_depth",),
            np.array([bits[s] for s in depths], dtype=np.float64),
            {"long_name": "recalled bits per person", "units": "bits"},
        )
    return xr.Dataset(
        variables,
        coords={"serving_depth": list(depths)},
        attrs={
            "checkpoint": str(snapshot.path),
            "checkpoint_sha256": snapshot.sha256,
            "step": snapshot.step,
            "uniform_updates": snapshot.uniform_updates,
            "config": snapshot.config.to_json(),
            "eval_sequences": int(snapshot.eval_tokens.shape[0]),
            "torch_version": str(torch.__version__),
            "depthdiag_version": package_version(),
            "machine": machine(target.type),
        },
    )


def format_table(ds: xr.Dataset) -> str:
    """One row per serving depth: NLL, and recall bits when present."""
    columns = [name for name in ("nll", "recall_bits") if name in ds]
    lines = ["depth  " + "  ".join(f"{name:>11}" for name in columns)]
    for i, depth in enumerate(ds["serving_depth"].values):
        lines.append(f"{int(depth):>5}  " + "  ".join(f"{float(ds[name].values[i]):>11.4f}" for name in columns))
    return "\n".join(lines)
