"""`depthdiag exits`: exit criteria simulated from one all-depth pass, against the oracle and the
fixed depths, and the overthinking ledger, for one or more checkpoints (seeds) or a Hugging Face
model folder; one results file (analysis/exits.py reads it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from analysis.exits import (
    KIND,
    best_depth,
    frontier_at,
    ledger,
    ledger_by_group,
    lower_frontier,
    oracle,
    sweep,
)
from common.errors import InputError
from common.provenance import provenance
from trainer.distributed import resolve_device
from trainer.exits import Criterion, DepthTable, depth_table, real_exit_nll
from trainer.flops import eval_flops
from trainer.machine import machine
from trainer.model import IGNORE_INDEX, LoopedTransformer, ModelConfig

EPSILONS = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
"""The oracle's tolerances (nats) by default."""

FRONTIER_POINTS_PER_DEPTH = 8
"""Samples of the lower frontier stored per unit of mean depth (the figure draws them)."""


@dataclass(frozen=True)
class ExitsConfig:
    """What `depthdiag exits` computes."""

    criteria: tuple[Criterion, ...]
    """The criteria to sweep."""
    thresholds: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Thresholds by criterion name, replacing a criterion's default sweep."""
    max_depth: int = 16
    """S: tokens are scored at depths 1..S, and one that never exits is served at S."""
    epsilons: tuple[float, ...] = EPSILONS
    """The oracle's tolerances."""
    eval_set: str = "auto"
    """Which evaluation targets (diag/sources/evalset.py): auto, snapshot or attributes."""
    groupings: tuple[str, ...] = ()
    """Groupings of the targets the ledger is broken down by (diag/sources/groupings.py)."""
    real_exit: bool = False
    """Also run the real-exit forward at every threshold (depthdiag's own models)."""
    batch_size: int = 32
    """Evaluation sequences per forward pass."""
    device: str = "auto"
    """Where the model runs: auto (cuda when there is one), cpu or cuda."""
    progress: bool = True
    """Progress bars on long passes."""

    def thresholds_of(self, criterion: Criterion) -> tuple[float, ...]:
        """The thresholds swept for `criterion`: given ones, else its defaults."""
        return self.thresholds.get(criterion.name, criterion.thresholds)


def exits_of_checkpoints(
    paths: Sequence[str | Path], config: ExitsConfig, *, trust_remote_code: bool = False, family: str | None = None
) -> xr.Dataset:
    """The exits results of depthdiag checkpoints or snapshots, or of snapshot folders that
    `diag.save_snapshot` wrote (several: several seeds of one experiment, along `run`). A folder's
    model is called as its family says, or as `family` (a family name or MODULE:NAME) says;
    `trust_remote_code` runs the code a folder's Hugging Face model ships with."""
    from diag.sources.evalset import evaluation_set, resolve_eval_set
    from diag.sources.groupings import target_groupings
    from trainer.checkpoint import is_sharded_folder, load_snapshot

    # A sharded checkpoint (NAME.dcp/) is a folder too, read like a file.
    folders = [path for path in paths if Path(path).is_dir() and not is_sharded_folder(path)]
    if folders and len(folders) < len(paths):
        raise InputError(f"{folders[0]}: a snapshot folder, among checkpoint files; give files or folders")
    if folders:
        return _exits_of_folders(folders, config, trust_remote_code=trust_remote_code, family=family)
    if trust_remote_code or family is not None:
        given = "--trust-remote-code" if trust_remote_code else f"--family {family}"
        raise InputError(f"{given}: only with --hf DIR or snapshot folders; checkpoints hold depthdiag's own model")
    target = resolve_device(config.device)
    runs = []
    for path in paths:
        snapshot = load_snapshot(path)
        eval_set = resolve_eval_set(config.eval_set, snapshot.config, path)
        tokens, mask = evaluation_set(eval_set, snapshot.config, snapshot.eval_tokens)
        groups = target_groupings(config.groupings, tokens, mask, run=snapshot.config, eval_set=eval_set, origin=path)
        model = snapshot.model(target).eval()
        attrs = {
            "checkpoint": str(snapshot.path),
            "checkpoint_sha256": snapshot.sha256,
            "checkpoint_step": snapshot.step,
            "config": snapshot.config.to_json(),
        }
        runs.append(
            _one_run(model, tokens, mask, groups, config, target, snapshot.config.model, attrs, eval_set=eval_set)
        )
    return _combine(runs, config, target)


def _exits_of_folders(
    paths: Sequence[str | Path], config: ExitsConfig, *, trust_remote_code: bool, family: str | None
) -> xr.Dataset:
    from diag.arithmetic.families import keyword_family, resolve_family
    from diag.sources.groupings import target_groupings
    from diag.sources.snapshot_loading import read_snapshot_folder

    if config.eval_set == "attributes":
        raise InputError(f"--eval-set attributes: bioS runs' checkpoints only; {paths[0]} is a snapshot folder")
    target = resolve_device(config.device)
    runs = []
    for path in paths:
        folder = read_snapshot_folder(path)
        adapted = folder.load(trust_remote_code=trust_remote_code, device=target)
        called = resolve_family(family) if family is not None else adapted.family or keyword_family(adapted.depth_kwarg)
        tokens, mask = adapted.eval_tokens, adapted.eval_mask
        groups = target_groupings(config.groupings, tokens, mask, run=None, eval_set=None, origin=path)
        model = adapted.model.eval()
        model_config = model.config if isinstance(model, LoopedTransformer) else None
        attrs = {
            "snapshot_folder": str(path),
            "checkpoint_step": folder.step,
            "model_family": called.name,
            "config": folder.config_json(),
        }
        runs.append(
            _one_run(
                model,
                tokens,
                mask,
                groups,
                config,
                target,
                model_config,
                attrs,
                depth_call=called.eval_call,
                logits_of=called.logits,
            )
        )
    return _combine(runs, config, target)


def exits_of_hf(source, config: ExitsConfig) -> xr.Dataset:
    """The exits results of a Hugging Face model folder (diag/sources/hf.py's `HfInput`), on the
    evaluation set of its --data, served as its model family serves."""
    from diag.sources.groupings import target_groupings
    from diag.sources.hf import hf_model

    target = resolve_device(config.device)
    model, family = hf_model(source, target)
    tokens = source.tokens.eval_tokens()
    groups = target_groupings(config.groupings, tokens, None, run=None, eval_set=None, origin=source.folder)
    attrs = {"hf_folder": str(source.folder), "model_family": family.name, "data": str(source.tokens.data)}
    run = _one_run(
        model, tokens, None, groups, config, target, None, attrs, depth_call=family.eval_call, logits_of=family.logits
    )
    return _combine([run], config, target)


def _one_run(
    model,
    tokens,
    mask,
    groups,
    config: ExitsConfig,
    device,
    model_config: ModelConfig | None,
    attrs: dict,
    *,
    eval_set: str = "snapshot",
    **calls,
) -> xr.Dataset:
    if config.real_exit and not callable(getattr(model, "forward_with_exit", None)):
        raise InputError("--real-exit needs a model with forward_with_exit (depthdiag's own, or its hf export)")
    targets = tokens[:, 1:] if mask is None else tokens[:, 1:].masked_fill(~mask, IGNORE_INDEX)
    table = depth_table(
        model,
        tokens,
        config.max_depth,
        config.criteria,
        targets=targets,
        batch_size=config.batch_size,
        device=device,
        progress=config.progress,
        **calls,
    )
    ds = exits_dataset(table, config)
    for grouping in groups:
        ids = grouping.ids[table.rows, table.positions].cpu().numpy()
        by = ledger_by_group(table.correct, table.nll, ids, len(grouping.labels))
        dim = grouping.name
        ds = ds.assign_coords({dim: list(grouping.labels)})
        ds[f"wrong_to_right_by_{dim}"] = (("step", dim), by["wrong_to_right"])
        ds[f"right_to_wrong_by_{dim}"] = (("step", dim), by["right_to_wrong"])
        ds[f"targets_by_{dim}"] = ((dim,), by["targets"])
        ds[f"best_below_max_by_{dim}"] = ((dim,), by["best_below_max"])
    if config.real_exit:
        real_nll = np.full(ds["exit_nll"].shape, np.nan)
        real_depth = np.full(ds["exit_nll"].shape, np.nan)
        for c, criterion in enumerate(config.criteria):
            thresholds = config.thresholds_of(criterion)
            real_nll[c, : len(thresholds)], real_depth[c, : len(thresholds)] = real_exit_nll(
                model,
                tokens,
                criterion,
                thresholds,
                config.max_depth,
                targets=targets,
                batch_size=config.batch_size,
                device=device,
                progress=config.progress,
            )
        ds["real_exit_nll"] = (("criterion", "threshold_index"), real_nll)
        ds["real_exit_depth"] = (("criterion", "threshold_index"), real_depth)
    if model_config is not None:
        seq_len = tokens.shape[1] - 1
        one, two = (eval_flops(model_config, s, batch_size=1, seq_len=seq_len) / seq_len for s in (1, 2))
        ds.attrs.update({"flops_fixed": one - (two - one), "flops_per_iteration": two - one})
    ds.attrs.update({**attrs, "eval_set": eval_set, "groupings": " ".join(g.name for g in groups)})
    return ds


def exits_dataset(table: DepthTable, config: ExitsConfig) -> xr.Dataset:
    """One run's results from its table: the fixed depths, each criterion at each threshold, the
    oracle at each epsilon, the lower frontier and the ledger."""
    S = config.max_depth
    at_max = float(table.mean_nll[-1])
    frontier = lower_frontier(table.nll, at_max)
    width = max(len(config.thresholds_of(c)) for c in config.criteria)
    shape = (len(config.criteria), width)
    thresholds, exit_depth, exit_nll, exit_accuracy = (np.full(shape, np.nan) for _ in range(4))
    for c, criterion in enumerate(config.criteria):
        values = config.thresholds_of(criterion)
        result = sweep(
            table.nll, table.correct, at_max, table.statistics[criterion.name], values, criterion.fires_below
        )
        thresholds[c, : len(values)] = values
        exit_depth[c, : len(values)] = result["depth"]
        exit_nll[c, : len(values)] = result["nll"]
        exit_accuracy[c, : len(values)] = result["accuracy"]
    best = oracle(table.nll, table.correct, at_max, config.epsilons)
    wrong_to_right, right_to_wrong = ledger(table.correct)
    depths = np.arange(1, S + 1)
    frontier_depths = np.linspace(1, S, FRONTIER_POINTS_PER_DEPTH * (S - 1) + 1)
    fixed_accuracy = table.correct.mean(axis=1)
    return xr.Dataset(
        {
            "fixed_nll": (("serving_depth",), table.mean_nll, {"long_name": "mean NLL at a fixed depth (as eval)"}),
            "fixed_accuracy": (("serving_depth",), fixed_accuracy),
            "fixed_gap": (("serving_depth",), table.mean_nll - frontier_at(frontier, depths.astype(float))),
            "exit_depth": (("criterion", "threshold_index"), exit_depth, {"long_name": "mean served depth"}),
            "exit_nll": (("criterion", "threshold_index"), exit_nll, {"long_name": "mean NLL at the served depth"}),
            "exit_accuracy": (("criterion", "threshold_index"), exit_accuracy),
            "exit_gap": (("criterion", "threshold_index"), exit_nll - frontier_at(frontier, exit_depth)),
            "oracle_depth": (("epsilon",), best["depth"]),
            "oracle_nll": (("epsilon",), best["nll"]),
            "oracle_accuracy": (("epsilon",), best["accuracy"]),
            "oracle_gap": (("epsilon",), best["nll"] - frontier_at(frontier, best["depth"])),
            "frontier_nll": (("frontier_depth",), frontier_at(frontier, frontier_depths)),
            "wrong_to_right": (("step",), wrong_to_right),
            "right_to_wrong": (("step",), right_to_wrong),
            "targets": ((), table.nll.shape[1]),
            "best_below_max": ((), int((best_depth(table.nll) < S).sum())),
        },
        coords={
            "serving_depth": depths,
            "criterion": [c.name for c in config.criteria],
            "threshold_index": np.arange(width),
            "threshold": (("criterion", "threshold_index"), thresholds),
            "epsilon": list(config.epsilons),
            "frontier_depth": frontier_depths,
            "step": depths[:-1],
        },
    )


PER_RUN_ATTRS = (
    "checkpoint",
    "checkpoint_sha256",
    "checkpoint_step",
    "config",
    "snapshot_folder",
    "hf_folder",
    "model_family",
    "data",
    "eval_set",
)


def _combine(runs: list[xr.Dataset], config: ExitsConfig, device) -> xr.Dataset:
    """The runs along `run`, their own attributes as variables over it."""
    per_run = {
        name: (("run",), [str(ds.attrs[name]) for ds in runs]) for name in PER_RUN_ATTRS if name in runs[0].attrs
    }
    shared = {key: value for key, value in runs[0].attrs.items() if key not in PER_RUN_ATTRS}
    for ds in runs[1:]:
        if ds.attrs.get("groupings") != shared.get("groupings"):
            raise InputError("the checkpoints give different groupings; exits combines runs of one experiment")
    combined = xr.concat([ds.drop_attrs() for ds in runs], dim="run", coords="different", compat="equals")
    combined = combined.assign_coords(run=np.arange(len(runs))).assign(per_run)
    combined.attrs = {
        **shared,
        "kind": KIND,
        "max_depth": config.max_depth,
        "criteria": " ".join(c.name for c in config.criteria),
        "batch_size": config.batch_size,
        "targets": int(combined["targets"].values[0]),
        **provenance(),
        "machine": machine(torch.device(device).type),
    }
    return combined
