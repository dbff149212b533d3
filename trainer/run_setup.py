"""What `train` (trainer/train.py) sets a run up from before its first update: the depth
schedule, checked against the processes; the initial model, fresh from train.seed or resumed
from the newest checkpoint with the process RNGs restored; the run directory made ready
(config.json, the metrics lines a resume keeps, no temporaries a killed run left); the steps
that write snapshots; and the machines that trained the run."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from common.atomic import atomic_write_text, remove_stale_temporaries_in
from common.errors import InputError
from trainer.checkpoint import (
    CHECKPOINT_DIR,
    SNAPSHOT_DIR,
    Snapshot,
    latest_checkpoint,
    load_indexed_optimizer_state,
    load_sharded_state,
    load_snapshot,
)
from trainer.config import RunConfig
from trainer.distributed import World, barrier, native_bf16
from trainer.machine import machine
from trainer.model import LoopedTransformer
from trainer.rng import set_process_rng_state
from trainer.schedules import Schedule, parse_schedule


def machines_that_trained(checkpoint: Snapshot | None, world: World) -> tuple[dict[str, str | int], ...]:
    """The machines that trained the run: the checkpoint's, and this process's unless it is the
    same as the last one (a resume on the same machine adds nothing)."""
    before = checkpoint.trained_on if checkpoint is not None else ()
    here = machine(world.device.type)
    return before if before and before[-1] == here else (*before, here)


def checked_schedule(config: RunConfig, world: World) -> Schedule:
    """The run's depth schedule, once the batch is known to split over the processes; warns
    (rank 0) when bf16 would be emulated."""
    tc = config.train
    if tc.batch_size % world.world_size:
        raise InputError(f"train.batch_size={tc.batch_size}: not divisible by the {world.world_size} processes")
    schedule = parse_schedule(tc.schedule, seed=tc.seed, total_updates=tc.updates)
    if tc.precision == "bf16" and not native_bf16(world.device) and world.is_main:
        warnings.warn(
            f"train.precision='bf16': {world.device} has no native bf16 matmuls, so autocast "
            "emulates them and runs slower than fp32; consider --set train.precision=fp32",
            stacklevel=3,
        )
    return schedule


def initial_model(
    config: RunConfig, run_dir: Path, *, resume: bool, sharded: bool = False
) -> tuple[LoopedTransformer, Snapshot | None]:
    """The model on the CPU, initialised from train.seed (so every device starts from the
    same weights); when resuming, with the weights of the newest checkpoint in `run_dir`
    (returned too) and the process RNGs restored to its states. A resume refuses a missing
    checkpoint or another config (a fresh run's directory is checked under its lock). A
    `sharded` run reads a sharded checkpoint's meta.pt alone: its shards go into the
    sharded model (`load_sharded_checkpoint`)."""
    torch.manual_seed(config.train.seed)
    model = LoopedTransformer(config.model)
    if not resume:
        return model, None
    checkpoint_path = latest_checkpoint(run_dir)
    if checkpoint_path is None:
        raise InputError(f"{run_dir}: no checkpoint to resume from")
    checkpoint = load_snapshot(checkpoint_path, kind="checkpoint", shards=not sharded)
    differences = _config_differences(checkpoint.config, config)
    if differences:
        raise InputError(
            f"{checkpoint_path}: the run was trained with another config "
            f"({'; '.join(differences)}); resume with the stored {run_dir / 'config.json'} "
            "or train into a new directory"
        )
    if checkpoint.model_state:  # empty when a sharded run loads a folder's shards itself
        model.load_state_dict(checkpoint.model_state)
    set_process_rng_state(checkpoint.rng)
    return model, checkpoint


def load_sharded_checkpoint(checkpoint: Snapshot, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load `checkpoint` into the FSDP2-sharded `model` and its `optimizer` (every rank): a
    sharded folder's shards through torch.distributed.checkpoint, which reshards them to
    this world size; a checkpoint file (of a one-process run) whole, each rank keeping its
    shards. The weights of a file were loaded before sharding already (`initial_model`)."""
    if checkpoint.path.is_dir():
        load_sharded_state(checkpoint.path, model, optimizer)
    else:
        load_indexed_optimizer_state(model, optimizer, checkpoint.optimizer_state)


def _config_differences(stored: RunConfig, given: RunConfig) -> list[str]:
    """'section.key: old -> new' for every key that differs, observer-only keys aside."""
    before, after = stored.outcome_sections(), given.outcome_sections()
    return [
        f"{section}.{key}: {before[section][key]!r} -> {after[section][key]!r}"
        for section in before
        for key in before[section]
        if before[section][key] != after[section][key]
    ]


def prepare_run_dir(config: RunConfig, run_dir: Path, world: World, *, keep_metrics_before: int) -> float:
    """Rank 0 creates the run directory, removes the temporary files of writes a killed run
    left behind, writes config.json and keeps the metrics lines of the updates before
    `keep_metrics_before`; every rank waits for it. Returns the last kept loss (NaN when
    there is none, and on other ranks)."""
    last_loss = float("nan")
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(run_dir)
        atomic_write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n", run_dir / "config.json")
        last_loss = _start_metrics(run_dir / "metrics.jsonl", keep_before=keep_metrics_before)
    barrier(world)
    return last_loss


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove the temporary files of atomic writes in `run_dir`, its checkpoints/ and its
    snapshots/, which a killed run (kill -9, power loss) leaves behind; returns them. Only
    for the holder of the run directory's lock: no other writer can then be alive to own one."""
    return [
        path
        for directory in (run_dir, run_dir / CHECKPOINT_DIR, run_dir / SNAPSHOT_DIR)
        for path in remove_stale_temporaries_in(directory)
    ]


def _start_metrics(path: Path, keep_before: int) -> float:
    """Keep the metrics lines of updates before `keep_before` (a resume repeats the rest);
    an unparsable tail from an interrupted write is dropped. Returns the last kept loss (NaN if none)."""
    kept, last_loss = [], float("nan")
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", keep_before) < keep_before:
                kept.append(line)
                last_loss = record.get("loss", last_loss)
    atomic_write_text("".join(f"{line}\n" for line in kept), path)
    return last_loss


def snapshot_steps(schedule: Schedule, config: RunConfig, world: World) -> dict[int, int]:
    """Step -> uniform updates of every snapshot the run writes; warns (rank 0) about the
    requested ones past the end of the run."""
    tc, switch = config.train, schedule.switch_step
    if switch is None:
        return {}
    beyond = [n for n in tc.snapshot_uniform_updates if switch + n > tc.updates]
    if beyond and world.is_main:
        warnings.warn(
            f"train.snapshot_uniform_updates {beyond}: the run ends {tc.updates - switch} updates "
            "after the switch, so these snapshots are not written",
            stacklevel=3,
        )
    return {switch + n: n for n in tc.snapshot_uniform_updates if switch + n <= tc.updates}
