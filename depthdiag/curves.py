"""A run's training curves for `depthdiag plot RUN --figure curves`: its metrics.jsonl
(analysis/training.py) with the switch step of the depth schedule its config.json names."""

from __future__ import annotations

import os
import warnings

import xarray as xr

from analysis.training import metrics_path, read_metrics
from trainer.config import RunConfig
from trainer.schedules import parse_schedule


def training_curves(run: str | os.PathLike) -> xr.Dataset:
    """The metrics of `run` (a run directory or its metrics.jsonl) as `read_metrics` gives them,
    with the schedule's switch from the run's config.json; without that file the switch is not
    known (a warning says so)."""
    path = metrics_path(run)
    config_path = path.parent / "config.json"
    switch = None
    if config_path.is_file():
        config = RunConfig.from_json(config_path.read_text(encoding="utf-8"), source=str(config_path))
        tc = config.train
        switch = parse_schedule(tc.schedule, seed=tc.seed, total_updates=tc.updates).switch_step
    else:
        warnings.warn(f"{config_path}: no such file, so the schedule's switch is not marked", stacklevel=2)
    return read_metrics(path, switch_step=switch)
