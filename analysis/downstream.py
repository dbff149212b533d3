"""The downstream-evaluation file of `depthdiag lm-eval`: schema, reading, and the accuracy
bands its figure draws (no torch, no lm-eval).

The results-file conventions of analysis/store.py (HDF5 via h5netcdf, attributes
str/int/float only, `long_name` and `units` on every variable), dims (task, serving_depth):

| variable | dims |
|---|---|
| one per metric lm-eval reports: acc, acc_stderr, acc_norm, acc_norm_stderr, ... | task, serving_depth |
| chance | task |
| exit_METRIC for each metric (with `--exit`) | task, exit |
| exit_mean_depth (with `--exit`) | exit |

A metric reported under a filter other than lm-eval's 'none' is named METRIC_FILTER (e.g.
exact_match_strict_match); a metric a task does not report is NaN for it. `chance` is the
accuracy of a uniform guess (multiple-choice tasks; NaN for the others). Coordinates:
`task` (str) with `n_samples` (documents evaluated) and `n_shot` along it, `serving_depth`, and
with exit rules `exit` (str: CRITERION:THRESHOLD, each token served at the first iteration where
the criterion fires, real per-token exit). `exit_mean_depth` is the mean depth at which the rule
stopped the positions predicting the scored continuation tokens, pooled over all tasks.
Attributes: `kind` = 'lm_eval', the checkpoint's path, sha256 and run config, the tokenizer,
`lm_eval_version`, `task_versions`, `task_configs` and `n_shot` (JSON), `limit`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import xarray as xr

from analysis.store import open_checked
from common.errors import InputError

KIND = "lm_eval"
"""The `kind` attribute of a downstream-evaluation file."""

DIMS = ("task", "serving_depth")
EXIT_DIMS = ("task", "exit")
EXIT_PREFIX = "exit_"
"""The metrics at an exit rule are named EXIT_PREFIX + METRIC, over EXIT_DIMS."""
EXIT_DEPTH = "exit_mean_depth"
STDERR_SUFFIX = "_stderr"
NO_FILTER = "none"
"""lm-eval's name for 'no filter' in its 'metric,filter' result keys."""

BAND_Z = 1.959963984540054
"""Normal quantile of a two-sided 95% interval: the band is mean +- BAND_Z x stderr."""

COORDINATES = {
    "serving_depth": ("recurrent depth the model was evaluated at", "iterations"),
    "n_samples": ("documents evaluated", "1"),
    "n_shot": ("few-shot examples in each prompt", "1"),
}


def variable_name(key: str) -> tuple[str, str] | None:
    """lm-eval's 'acc,none' -> ('acc', 'acc'); 'exact_match,strict-match' ->
    ('exact_match_strict_match', 'exact_match'); None for a key that is not a metric."""
    metric, comma, filter_name = key.partition(",")
    if not comma:
        return None
    name = metric if filter_name == NO_FILTER else f"{metric}_{filter_name}"
    return re.sub(r"\W", "_", name), metric


def _number(value) -> float:
    """A reported value as a float: lm-eval writes 'N/A' for a standard error it could not form."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return math.nan
    return float(value)


def _describe(name: str, metric: str, key: str) -> dict[str, str]:
    if metric.endswith(STDERR_SUFFIX):
        base = metric[: -len(STDERR_SUFFIX)]
        text = f"standard error of {base} over the documents (lm-eval's {key})"
    else:
        text = f"lm-eval metric {key}"
    return {"long_name": text, "units": "1"}


def downstream_dataset(
    per_depth: Mapping[int, Mapping[str, Mapping[str, object]]],
    *,
    chance: Mapping[str, float],
    n_samples: Mapping[str, int],
    n_shot: Mapping[str, int],
    attrs: Mapping[str, object],
    per_exit: Mapping[str, Mapping[str, Mapping[str, object]]] | None = None,
    exit_depth: Mapping[str, float] | None = None,
) -> xr.Dataset:
    """The file's Dataset from lm-eval's `results["results"]` of each serving depth
    ({depth: {task: {'acc,none': 0.26, ...}}}), tasks in the order of the first depth; with
    `per_exit` ({rule: results}) also each metric at each exit rule and `exit_depth` ({rule: mean
    served depth})."""
    depths = sorted(int(depth) for depth in per_depth)
    if not depths:
        raise InputError("no serving depth was evaluated")
    tasks = list(per_depth[depths[0]])
    if not tasks:
        raise InputError("lm-eval reported no task")
    per_exit = per_exit or {}
    names: dict[str, tuple[str, str]] = {}
    for results in (*per_depth.values(), *per_exit.values()):
        for metrics in results.values():
            for key in metrics:
                parsed = variable_name(key)
                if parsed is not None:
                    names.setdefault(parsed[0], (parsed[1], key))
    variables = {
        name: (DIMS, values, _describe(name, *names[name]))
        for name, values in _metric_table(per_depth, depths, tasks, names).items()
    }
    if per_exit:
        rules = list(per_exit)
        for name, values in _metric_table(per_exit, rules, tasks, names).items():
            description = _describe(name, *names[name])
            description["long_name"] += " with real per-token exit at each exit rule"
            variables[EXIT_PREFIX + name] = (EXIT_DIMS, values, description)
        variables[EXIT_DEPTH] = (
            ("exit",),
            np.array([float((exit_depth or {}).get(rule, math.nan)) for rule in rules]),
            {
                "long_name": "mean depth at which the rule stopped the positions predicting the scored "
                "continuation tokens, pooled over all tasks",
                "units": "iterations",
            },
        )
    variables["chance"] = (
        ("task",),
        np.array([float(chance.get(task, math.nan)) for task in tasks]),
        {"long_name": "accuracy of a uniform guess: mean over the documents of 1 / choices", "units": "1"},
    )
    exits = {"exit": np.array(list(per_exit), dtype=str)} if per_exit else {}
    ds = xr.Dataset(
        variables,
        coords={
            **exits,
            "task": np.array(tasks, dtype=str),
            "serving_depth": np.array(depths, dtype=np.int64),
            "n_samples": ("task", np.array([int(n_samples.get(task, 0)) for task in tasks], dtype=np.int64)),
            "n_shot": ("task", np.array([int(n_shot.get(task, 0)) for task in tasks], dtype=np.int64)),
        },
        attrs={**attrs, "kind": KIND},
    )
    ds["task"].attrs.update(long_name="lm-eval task", units="1")
    for name, (long_name, units) in COORDINATES.items():
        ds[name].attrs.update(long_name=long_name, units=units)
    return ds


def _metric_table(results_by, columns, tasks, names) -> dict[str, np.ndarray]:
    """Each metric of `names` over (task, column) from {column: lm-eval results}, NaN where missing."""
    data = {name: np.full((len(tasks), len(columns)), np.nan) for name in names}
    for j, column in enumerate(columns):
        for i, task in enumerate(tasks):
            for key, value in results_by[column].get(task, {}).items():
                parsed = variable_name(key)
                if parsed is not None:
                    data[parsed[0]][i, j] = _number(value)
    return data


def depth_metrics(ds: xr.Dataset) -> list[str]:
    """The metrics over (task, serving_depth) (and seed, for several files), standard errors included."""
    return [name for name in ds.data_vars if tuple(d for d in ds[name].dims if d != "seed") == DIMS]


def is_downstream_dataset(ds: xr.Dataset) -> bool:
    return ds.attrs.get("kind") == KIND


def validate_downstream(ds: xr.Dataset, source) -> None:
    """Raise InputError("SOURCE: problem") unless `ds` follows the downstream schema."""
    if not is_downstream_dataset(ds):
        raise InputError(f"{source}: not a depthdiag lm-eval file (no kind = {KIND!r} attribute)")
    for coord in DIMS:
        if coord not in ds.coords:
            raise InputError(f"{source}: missing coordinate {coord!r}")
    if ds["task"].dtype.kind not in "UOS":
        raise InputError(f"{source}: coordinate 'task' has dtype {ds['task'].dtype}, expected strings")
    if not np.issubdtype(ds["serving_depth"].dtype, np.integer):
        raise InputError(
            f"{source}: coordinate 'serving_depth' has dtype {ds['serving_depth'].dtype}, expected integers"
        )
    for coord in ("n_samples", "n_shot"):
        if coord not in ds.coords or ds[coord].dims != ("task",) or not np.issubdtype(ds[coord].dtype, np.integer):
            raise InputError(f"{source}: missing integer coordinate {coord!r} along 'task'")
    metrics = [name for name in ds.data_vars if name != "chance"]
    if not metrics:
        raise InputError(f"{source}: holds no metric")
    exits = "exit" in ds.dims
    if exits and (ds["exit"].dtype.kind not in "UOS" or EXIT_DEPTH not in ds.data_vars):
        raise InputError(f"{source}: an 'exit' dimension needs string exit rules and {EXIT_DEPTH!r}")
    for name in metrics:
        dims = (("exit",) if name == EXIT_DEPTH else EXIT_DIMS) if exits and name.startswith(EXIT_PREFIX) else DIMS
        if ds[name].dims != dims or not np.issubdtype(ds[name].dtype, np.floating):
            raise InputError(f"{source}: variable {name!r} is not floating point over {dims}")
    if "chance" not in ds.data_vars or ds["chance"].dims != ("task",):
        raise InputError(f"{source}: no variable 'chance' over ('task',)")


def open_downstream(paths) -> xr.Dataset:
    """One downstream-evaluation file, or several (one per training seed) combined along
    `seed`, loaded into memory (files closed) and validated."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [Path(path) for path in paths]
    if not paths:
        raise InputError("no depthdiag lm-eval file given")
    datasets = [open_checked(path, "depthdiag lm-eval file", validate_downstream) for path in paths]
    if len(datasets) == 1:
        return datasets[0]
    return combine_seeds(datasets, paths)


SAME_ACROSS_SEEDS = ("tasks", "limit", "n_shot", "lm_eval_version", "task_versions")
"""Attributes that files combined as seeds must share: the same evaluation of other models."""


def combine_seeds(datasets: list[xr.Dataset], sources: list[Path]) -> xr.Dataset:
    """Files of one evaluation of several training seeds' checkpoints, along `seed` (the run
    config's train.seed; InputError when files share one or differ in what they evaluate)."""
    first, first_path = datasets[0], sources[0]
    seeds = []
    for ds, path in zip(datasets, sources):
        for coord in ("task", "serving_depth", "n_samples", "exit"):
            values, first_values = (d[coord].values.tolist() if coord in d.coords else [] for d in (ds, first))
            if values != first_values:
                raise InputError(f"{path}: {coord} {values} differs from {first_path}'s")
        for key in SAME_ACROSS_SEEDS:
            if ds.attrs.get(key) != first.attrs.get(key):
                raise InputError(f"{path}: {key} {ds.attrs.get(key)!r} differs from {first_path}'s")
        try:
            seed = int(json.loads(ds.attrs["config"])["train"]["seed"])
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: no run config with train.seed to tell the seeds apart") from None
        if seed in seeds:
            raise InputError(f"{path}: seed {seed} again; the same run twice is not two seeds")
        seeds.append(seed)
    return xr.concat(
        datasets,
        dim=xr.DataArray(seeds, dims="seed", name="seed", attrs={"long_name": "training seed", "units": "1"}),
        data_vars="all",
        coords="minimal",
        compat="override",
        combine_attrs="drop_conflicts",
    )


def accuracy_bands(ds: xr.Dataset, metric: str = "acc") -> xr.Dataset:
    """`metric` over (task, serving_depth) as `mean`, `lower` and `upper`.

    One model: lower and upper = mean -+ BAND_Z x its lm-eval standard error, clipped to [0, 1]
    (a normal 95% interval over the documents: document sampling noise of that model, not seed
    noise), NaN where lm-eval gave no standard error. Several seeds (a `seed` dimension): the mean over
    seeds and the range (min to max) across them, as the paper's Figure 3 draws."""
    if metric not in depth_metrics(ds):
        available = ", ".join(name for name in depth_metrics(ds) if not name.endswith(STDERR_SUFFIX))
        raise InputError(f"the file has no metric {metric!r} (it has {available})")
    values = ds[metric]
    if "seed" in values.dims:
        n = ds.sizes["seed"]
        return xr.Dataset(
            {"mean": values.mean("seed"), "lower": values.min("seed"), "upper": values.max("seed")},
            attrs={"metric": metric, "band": f"range (min-max) of {metric} across {n} seeds, line: their mean"},
        )
    stderr_name = f"{metric}{STDERR_SUFFIX}"
    stderr = ds[stderr_name] if stderr_name in ds.data_vars else xr.full_like(values, np.nan)
    # A fraction of documents lies in [0, 1]; the normal approximation does not know it.
    return xr.Dataset(
        {
            "mean": values,
            "lower": (values - BAND_Z * stderr).clip(min=0.0),
            "upper": (values + BAND_Z * stderr).clip(max=1.0),
        },
        attrs={
            "metric": metric,
            "band": f"{metric} +- 1.96 x lm-eval's {stderr_name}, within [0, 1] (normal 95% interval over "
            "documents; one model: no seed noise)",
        },
    )


def format_downstream(ds: xr.Dataset) -> str:
    """One block per task: a row per serving depth, then one per exit rule, with each metric and
    its standard error."""
    metrics = [name for name in depth_metrics(ds) if not name.endswith(STDERR_SUFFIX)]
    rules = ds["exit"].values.tolist() if "exit" in ds.dims else []
    lines = []
    for task in ds["task"].values:
        row = ds.sel(task=task)
        shown = [name for name in metrics if np.isfinite(row[name].values).any()]
        chance = float(row["chance"])
        chance_text = f", chance {chance:.4f}" if np.isfinite(chance) else ""
        lines.append(f"{task}: {int(row['n_samples'])} documents, {int(row['n_shot'])}-shot{chance_text}")
        labelled = [
            (f"{int(depth)}", _cells(row.sel(serving_depth=depth), shown)) for depth in row["serving_depth"].values
        ]
        for rule in rules:
            at_rule = row.sel(exit=rule)
            label = f"exit {rule} (mean depth {float(at_rule[EXIT_DEPTH]):.2f})"
            labelled.append((label, _cells(at_rule, [EXIT_PREFIX + name for name in shown])))
        width = max(len("depth"), *(len(label) for label, _ in labelled))  # the cells line up under the header
        lines.append(f"{'depth':>{width}}  " + "  ".join(f"{name:>18}" for name in shown))
        lines.extend(f"{label:>{width}}  {cells}" for label, cells in labelled)
    return "\n".join(lines)


def _cells(values: xr.Dataset, names: list[str]) -> str:
    """Each metric of one row as 'value ± stderr' (the value alone without a standard error)."""
    cells = []
    for name in names:
        value = float(values[name])
        stderr_name = f"{name}{STDERR_SUFFIX}"
        stderr = float(values[stderr_name]) if stderr_name in values else math.nan
        cells.append(f"{value:.4f} ± {stderr:.4f}" if np.isfinite(stderr) else f"{value:.4f}")
    return "  ".join(f"{cell:>18}" for cell in cells)
