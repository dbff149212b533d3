"""depthdiag's own snapshot and checkpoint files (a file, or a sharded NAME.dcp/ folder) as
inputs of the diagnostic: one entry per file, checked before anything is computed, and each
opened as the one form every input becomes (`AdaptedModel`), whole or sharded over torchrun's ranks.

A checkpoint carries no batches: its batches are the next ones its run would have drawn,
`build_source(cfg.data).batch(cfg.train.seed, step + i, cfg.train.batch_size, cfg.train.seq_len)`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.errors import InputError
from diag.sources.adapter import AdaptedModel
from diag.sources.evalset import evaluation_set, resolve_eval_set
from diag.sources.inputs import DiagnoseConfig, Entry
from trainer.checkpoint import (
    Snapshot,
    is_sharded_folder,
    load_indexed_optimizer_state,
    load_sharded_state,
    load_snapshot,
)
from trainer.config import RunConfig
from trainer.data.sources import build_source
from trainer.distributed import World, shard_model
from trainer.model import LoopedTransformer
from trainer.optim import build_optimizer


def file_entries(config: DiagnoseConfig) -> list[Entry]:
    """An entry per snapshot or checkpoint file (or sharded folder) of one model config."""
    entries, first = [], None
    for path in config.snapshots:
        # A sharded run reads a sharded folder's shards on its ranks, never whole here.
        snap = load_snapshot(path, shards=not (config.sharded and is_sharded_folder(path)))
        if first is None:
            first = snap
        elif snap.config.model != first.config.model:
            diff = sorted(k for k, v in snap.config.model.to_dict().items() if first.config.model.to_dict()[k] != v)
            raise InputError(
                f"{path}: model config differs from {first.path} ({', '.join(diff)}); "
                "diagnose snapshots of one model at a time"
            )
        eval_set = resolve_eval_set(config.eval_set, snap.config, snap.path)
        if entries and eval_set != entries[0].eval_set:
            raise InputError(
                f"{path}: --eval-set auto means {eval_set!r} here but {entries[0].eval_set!r} for "
                f"{entries[0].path}; diagnose one kind of run at a time or name the set"
            )
        carried = None if snap.batches is None else int(snap.batches.shape[0])
        wanted = config.batches or (carried if carried is not None else snap.config.train.snapshot_batches)
        if carried is not None and wanted > carried:
            raise InputError(f"{path}: carries {carried} batches, --batches asks for {wanted}")
        entries.append(
            Entry(
                name=Path(path).stem,
                path=str(path),
                sha256=snap.sha256,
                step=snap.step,
                uniform_updates=snap.uniform_updates,
                lr=float(config.lr if config.lr is not None else snap.lr),
                batches=wanted,
                batch_source="data" if carried is None else "snapshot",
                config_json=snap.config.to_json(),
                eval_set=eval_set,
                trained_on=snap.trained_on,
            )
        )
        del snap
    return entries


def file_model(config: DiagnoseConfig, entry: Entry, device: torch.device, world: World | None = None) -> AdaptedModel:
    """The entry's file loaded again (refused if it changed since the run started), as the one
    form: its model on `device` (with `world`: sharded over the ranks), its optimizer with the
    stored state and the next update's LR, its batches, its evaluation set, and the gradient
    clipping (0 means none) and precision its run trained with."""
    # A sharded run reads a sharded folder's shards straight into the sharded model.
    snap = load_snapshot(entry.path, shards=world is None or not is_sharded_folder(entry.path))
    if snap.sha256 != entry.sha256:
        raise InputError(f"{entry.path}: the file changed while the run was going")
    if world is None:
        model = snap.model(device)
        optimizer = snap.optimizer(model)
    else:
        model, optimizer = sharded_snapshot(snap, world)
    eval_tokens, eval_mask = evaluation_set(config.eval_set, snap.config, snap.eval_tokens)
    return AdaptedModel(
        model=model,
        optimizer=optimizer,
        batches=snapshot_batches(snap, entry.batches),
        eval_tokens=eval_tokens,
        eval_mask=eval_mask,
        name=entry.name,
        grad_clip=snap.config.optim.grad_clip or None,
        precision=snap.config.train.precision,
    )


def snapshot_batches(snap: Snapshot, n: int) -> list[torch.Tensor]:
    """The snapshot's first `n` batches [B, T+1]: carried by a snapshot, or for a checkpoint the
    batches its run would have drawn next."""
    if snap.batches is not None:
        return list(snap.batches[:n])
    cfg = snap.config
    source = build_source(cfg.data)
    return [source.batch(cfg.train.seed, snap.step + i, cfg.train.batch_size, cfg.train.seq_len) for i in range(n)]


def pool_sequences(entry: Entry, n: int) -> torch.Tensor:
    """`n` training sequences [n, T+1] of the entry's run, from its stream's batches right after
    the diagnosed ones (steps step + batches, ...)."""
    cfg = RunConfig.from_json(entry.config_json, entry.path)
    source = build_source(cfg.data)
    rows, step = [], entry.step + entry.batches
    while sum(len(r) for r in rows) < n:
        rows.append(source.batch(cfg.train.seed, step, cfg.train.batch_size, cfg.train.seq_len))
        step += 1
    return torch.cat(rows)[:n]


def sharded_snapshot(snap: Snapshot, world: World) -> tuple[LoopedTransformer, torch.optim.Optimizer]:
    """The snapshot's model and training optimizer, sharded over the process group (every
    rank calls this with the same snapshot); the optimizer's LR is the next update's. A
    sharded folder read without its shards (`load_snapshot(..., shards=False)`) goes shard
    by shard into the sharded model (torch.distributed.checkpoint reshards it to this world
    size), never whole on any rank; a file's whole state is loaded, then sharded."""
    if not snap.model_state:
        model = LoopedTransformer(snap.config.model).to(world.device)
        shard_model(model, world, precision="fp32")
        optimizer = build_optimizer(model, snap.config.optim)
        load_sharded_state(snap.path, model, optimizer)
    else:
        model = snap.model(world.device)
        # fp32 weights gathered: the diagnostic's precision option sets its gradients' autocast.
        shard_model(model, world, precision="fp32")
        optimizer = build_optimizer(model, snap.config.optim)
        load_indexed_optimizer_state(model, optimizer, snap.optimizer_state)
    for group in optimizer.param_groups:
        group["lr"] = snap.lr
    return model, optimizer
