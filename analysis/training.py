"""A run's training curves, read from RUN/metrics.jsonl (written by trainer/train.py; its
line layout is documented there and in `depthdiag train --help`). No torch: the metrics of
a run can be drawn on any machine.

The Dataset has one dimension, `updates` (updates done after a line's update: its `step`
+ 1), and `serving_depth` for the validation NLL:

| variable | dims |
|---|---|
| loss, lr, grad_norm, depth, tokens, flops, wall_time | updates |
| val_nll | updates, serving_depth (NaN on lines without a validation) |

Attributes: `switch_step` (updates before the schedule's switch; -1 without one), `source`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import xarray as xr

from common.errors import InputError

METRICS_FILE = "metrics.jsonl"
NO_SWITCH = -1
VAL_KEY = re.compile(r"^val_nll_(\d+)$")

SCALARS: dict[str, tuple[str, str]] = {
    "loss": ("mean training token NLL over the updates since the previous line", "nats"),
    "lr": ("learning rate of the line's update", "1"),
    "grad_norm": ("global gradient norm of the line's update, before clipping", "1"),
    "depth": ("training depth of the line's update", "iterations"),
    "tokens": ("training tokens so far", "tokens"),
    "flops": ("modeled training FLOPs so far", "FLOPs"),
    "wall_time": ("seconds of training so far", "s"),
}
"""metrics.jsonl key -> (long_name, units) of the scalars a line may hold."""


def metrics_path(run: str | os.PathLike) -> Path:
    """RUN/metrics.jsonl for a run directory; a metrics file itself is taken as it is."""
    run = Path(run)
    return run if run.is_file() else run / METRICS_FILE


def read_metrics(run: str | os.PathLike, *, switch_step: int | None = None) -> xr.Dataset:
    """The metrics lines of a run directory (or of its metrics.jsonl) as a Dataset (see the
    module docstring). A last line cut short (a run writing it) is left out; any other line
    that is not a metrics line is an InputError naming the file and the line."""
    path = metrics_path(run)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (a run directory holds metrics.jsonl)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read ({err})") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            int(record["step"]), float(record["loss"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            if number == len(lines):
                break
            raise InputError(f"{path}: line {number} is not a metrics line") from None
        records.append(record)
    if not records:
        raise InputError(f"{path}: no metrics lines yet")
    updates = np.array([int(r["step"]) + 1 for r in records], dtype=np.int64)
    if np.any(np.diff(updates) <= 0):
        raise InputError(f"{path}: steps out of order")
    variables = {}
    for key, (long_name, units) in SCALARS.items():
        values = np.array([float(r.get(key, np.nan)) for r in records], dtype=np.float64)
        if np.isfinite(values).any():
            variables[key] = xr.Variable(("updates",), values, {"long_name": long_name, "units": units})
    depths = sorted({int(m.group(1)) for r in records for key in r if (m := VAL_KEY.match(key))})
    coords = {"updates": ("updates", updates, {"long_name": "updates done (the line's step + 1)", "units": "updates"})}
    if depths:
        values = np.array([[float(r.get(f"val_nll_{d}", np.nan)) for d in depths] for r in records])
        variables["val_nll"] = xr.Variable(
            ("updates", "serving_depth"),
            values,
            {"long_name": "mean token NLL of the held-out evaluation set", "units": "nats"},
        )
        coords["serving_depth"] = (
            "serving_depth",
            np.array(depths, dtype=np.int64),
            {"long_name": "recurrent depth the model was evaluated at", "units": "iterations"},
        )
    attrs = {"switch_step": NO_SWITCH if switch_step is None else int(switch_step), "source": str(path)}
    return xr.Dataset(variables, coords=coords, attrs=attrs)


def run_switch(ds: xr.Dataset) -> int | None:
    """The schedule's switch step `read_metrics` recorded, or None."""
    value = int(ds.attrs.get("switch_step", NO_SWITCH))
    return None if value == NO_SWITCH else value
