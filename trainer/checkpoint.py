"""Checkpoints and snapshots: single `torch.save` files of plain tensors, ints,
strings and dicts, so every one loads with `torch.load(path, weights_only=True)`.

A snapshot is a self-contained diagnostic input (weights, optimizer state, the
LR of the next update, the next training batches, the evaluation set, and
`trained_on`: the machines and kernels that trained the run so far, trainer/machine.py). A
checkpoint carries the same keys minus `batches`, plus what resuming needs
(RNG states and the run's counters). `load_snapshot` reads both kinds.

A run sharded with FSDP2 (train.parallel='fsdp' under torchrun) writes its checkpoints
and snapshots as folders `NAME.dcp/` instead (`save_sharded_state`): the model and
optimizer state as torch.distributed.checkpoint shards, every rank writing its own,
and `meta.pt` (rank 0), a torch.save file of the other keys (a snapshot's batches
among them). Such a folder loads into a sharded model at any number of ranks
(`load_sharded_state` reshards: a resume, `diagnose --sharded`), and `load_snapshot`
reads it in a plain process as a whole model's checkpoint or snapshot, gathering the
shards. `gathered_state` gathers a sharded model's state into one process.

Writes are atomic (common/atomic.py): an interrupted write never leaves a
half-written file (or checkpoint folder) under the final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.atomic import atomic_directory, atomic_output
from common.digest import file_sha256
from common.errors import InputError, unreachable_input
from trainer.checkpoint_checks import (
    RESUME_COUNTERS,
    check_kind,
    check_model_state,
    check_optimizer_state,
    check_progress,
    check_rng,
    check_scalars,
    check_tokens,
    check_trained_on,
    one_line,
)
from trainer.config import RunConfig
from trainer.distributed import World, broadcast_object
from trainer.model import LoopedTransformer
from trainer.optim import build_optimizer
from trainer.rng import process_rng_state

FORMAT_VERSION = 1
"""Bumped whenever the meaning or layout of a key changes; files of another version are refused."""

COMMON_KEYS = (
    "format_version",
    "config",
    "step",
    "uniform_updates",
    "model",
    "optimizer",
    "optimizer_class",
    "lr",
    "eval_tokens",
)
SNAPSHOT_KEYS = COMMON_KEYS + ("batches",)
CHECKPOINT_KEYS = COMMON_KEYS + ("rng", "progress")
SHARDED_KEYS = ("model", "optimizer")
"""What a sharded folder holds as DCP shards; meta.pt holds the other keys of its kind (an
optimizer without state yet, before the first update, is in meta.pt whole: it has no tensors)."""
META = "meta.pt"
"""The file of a sharded folder that holds everything but the shards."""
SHARDED_SUFFIX = ".dcp"
"""How a sharded folder's name ends (`checkpoint_name` and `snapshot_name` with sharded=True)."""
TRAINED_ON = "trained_on"
"""The optional key of the machines that trained the run up to the file (trainer/machine.py
records, in the order the run met them; a resume on another machine adds its own). Files
written before it existed have none and read as ()."""
KINDS = ("snapshot", "checkpoint")
"""What `load_snapshot(path, kind=...)` may insist on; a file with `batches` is a snapshot."""


class _WholeWrites(io.FileIO):
    """An unbuffered file whose write() writes all it is given or raises, and keeps the OS
    error: torch.save reports a failed write (a full disk, a file-size limit) only as a
    RuntimeError about the archive's position, so the cause is read back from here."""

    error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += super().write(view[done:])
        except OSError as err:
            self.error = err
            raise
        return done


def atomic_torch_save(payload: dict[str, Any], path: str | Path) -> Path:
    """`torch.save(payload)` to `path` atomically (common/atomic.py), its directory created if
    need be, its tensors on the CPU; equal payloads give equal bytes (`_plain`). A failed write
    raises the OSError behind it, naming `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp, _WholeWrites(tmp, "wb") as handle:
        # Saved through a handle, not a file name: torch names the archive's top folder
        # after a file name, which would put the temporary name into the bytes.
        try:
            torch.save(_plain(payload), handle)
        except RuntimeError as err:
            # Ctrl-C or SIGTERM during a write: torch reports the archive's position instead.
            if isinstance(err.__context__, KeyboardInterrupt):
                raise err.__context__ from None
            if handle.error is None:
                raise
            raise OSError(handle.error.errno, handle.error.strerror, str(path)) from None
    return path


def _state_payload(
    *,
    config: RunConfig,
    step: int,
    uniform_updates: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr: float,
    eval_tokens: torch.Tensor,
    trained_on: tuple[dict[str, str | int], ...] = (),
    states: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    model_state, optimizer_state = states if states is not None else (model.state_dict(), optimizer.state_dict())
    return {
        "format_version": FORMAT_VERSION,
        "config": config.to_json(),
        "step": int(step),
        "uniform_updates": int(uniform_updates),
        "model": {k: v.detach().cpu() for k, v in model_state.items()},
        "optimizer": optimizer_state,
        "optimizer_class": type(optimizer).__name__,
        "lr": float(lr),
        "eval_tokens": eval_tokens.detach().to("cpu", torch.int64),
        TRAINED_ON: [dict(record) for record in trained_on],
    }


def save_snapshot(
    path: str | Path,
    *,
    config: RunConfig,
    step: int,
    uniform_updates: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr: float,
    batches: torch.Tensor,
    eval_tokens: torch.Tensor,
    trained_on: tuple[dict[str, str | int], ...] = (),
) -> Path:
    """Write a diagnostic snapshot; `batches` int64 [n, B, T+1] are the next n training batches,
    `trained_on` the machines that trained the run so far (TRAINED_ON)."""
    payload = _state_payload(
        config=config,
        step=step,
        uniform_updates=uniform_updates,
        model=model,
        optimizer=optimizer,
        lr=lr,
        eval_tokens=eval_tokens,
        trained_on=trained_on,
    )
    payload["batches"] = batches.detach().to("cpu", torch.int64)
    return atomic_torch_save(payload, path)


def save_checkpoint(
    path: str | Path,
    *,
    config: RunConfig,
    step: int,
    uniform_updates: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr: float,
    eval_tokens: torch.Tensor,
    progress: dict[str, float],
    trained_on: tuple[dict[str, str | int], ...] = (),
) -> Path:
    """Write a resumable checkpoint; `progress` holds the run's counters (tokens, flops, wall_time),
    `trained_on` the machines that trained the run so far (TRAINED_ON)."""
    payload = _state_payload(
        config=config,
        step=step,
        uniform_updates=uniform_updates,
        model=model,
        optimizer=optimizer,
        lr=lr,
        eval_tokens=eval_tokens,
        trained_on=trained_on,
    )
    payload["rng"] = process_rng_state()
    payload["progress"] = {k: float(v) for k, v in progress.items()}
    return atomic_torch_save(payload, path)


def save_sharded_state(
    path: str | Path,
    world: World,
    *,
    config: RunConfig,
    step: int,
    uniform_updates: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr: float,
    eval_tokens: torch.Tensor,
    batches: torch.Tensor | None = None,
    progress: dict[str, float] | None = None,
    trained_on: tuple[dict[str, str | int], ...] = (),
) -> Path:
    """Write a sharded folder of an FSDP2-sharded `model` and its `optimizer` (see the module
    docstring); every rank calls it. With `batches` (int64 [n, B, T+1], the next n training
    batches) it is a snapshot, else a resumable checkpoint with the run's `progress` counters.
    The folder is filled under a temporary name (rank 0's, broadcast) and renamed once the
    shards and meta.pt are all on disk, so `path` appears complete or not at all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    path = Path(path)
    if world.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
    stateless = not optimizer.state
    with atomic_directory(path) if world.is_main else contextlib.nullcontext() as tmp:
        folder = Path(broadcast_object(world, str(tmp) if world.is_main else None))
        if stateless:
            # Before the first update: get_state_dict would create the optimizer's state with a
            # zero-LR step, which counts as AdamW's first and changes the training that follows.
            shards = {"model": get_model_state_dict(model)}
        else:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            shards = {"model": model_state, "optimizer": optimizer_state}
        # dcp.save returns on rank 0 once every rank has written its shards (its metadata
        # gathers their write results), so the rename below never publishes a partial folder.
        dcp.save(shards, checkpoint_id=folder)
        if world.is_main:
            everything = _state_payload(
                config=config,
                step=step,
                uniform_updates=uniform_updates,
                model=model,
                optimizer=optimizer,
                lr=lr,
                eval_tokens=eval_tokens,
                trained_on=trained_on,
                states=({}, {}),  # the shards hold them
            )
            payload = {k: v for k, v in everything.items() if k not in SHARDED_KEYS}
            if stateless:
                payload["optimizer"] = optimizer.state_dict()  # its settings alone: no tensors to shard
            if batches is not None:
                payload["batches"] = batches.detach().to("cpu", torch.int64)
            else:
                payload["rng"] = process_rng_state()
                payload["progress"] = {k: float(v) for k, v in (progress or {}).items()}
            atomic_torch_save(payload, folder / META)
    return path


def load_sharded_state(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the shards of the sharded folder `path` into `model` and `optimizer`: under
    torchrun an FSDP2-sharded model, every rank calling it (DCP reshards to this world size);
    in a plain process a plain model (no collective, even where a process group exists)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    alone = not (dist.is_initialized() and any(hasattr(p, "full_tensor") for p in model.parameters()))
    stored = dcp.FileSystemReader(Path(path)).read_metadata().state_dict_metadata
    stateless = not any(key.startswith("optimizer.") for key in stored)  # a snapshot before the first update
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state} if stateless else {"model": model_state, "optimizer": optimizer_state}
    with warnings.catch_warnings():
        # DCP warns at every load in one process that it assumes one process was meant: it was.
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, checkpoint_id=Path(path), no_dist=alone)
    if stateless:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
        optimizer.state.clear()  # get_state_dict's zero-LR step created it: a fresh optimizer has none
        return
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def gathered_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model state_dict and torch's plain, index-keyed optimizer state_dict of an
    FSDP2-sharded `model` and its `optimizer`, on the CPU, what a single process's
    `model.state_dict()` and `optimizer.state_dict()` hold: a collective every rank joins;
    rank 0 gets them, the other ranks empty dicts."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    if not optimizer.state:
        # Before the first update there is no per-parameter state to gather, and
        # get_optimizer_state_dict would create it with a zero-LR step, which counts as
        # AdamW's first (its bias correction) and so changes the training that follows.
        return model_state, (optimizer.state_dict() if dist.get_rank() == 0 else {})
    named = get_optimizer_state_dict(model, optimizer, options=options)
    return model_state, (_indexed_optimizer_state(named) if dist.get_rank() == 0 else {})


def load_indexed_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, indexed: dict[str, Any]
) -> None:
    """Load torch's plain, index-keyed optimizer state_dict (a checkpoint or snapshot file's)
    into the optimizer of an FSDP2-sharded `model`, each rank keeping its shards: the indices
    name the optimizer's parameters in the order of its param groups (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): name for name, p in model.named_parameters()}
    params = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    named = {
        "state": {params[i]: value for i, value in indexed["state"].items()},
        "param_groups": [
            {**group, "params": [params[i] for i in group["params"]]} for group in indexed["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def _indexed_optimizer_state(named: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict keyed by parameter names (torch.distributed.checkpoint's form)
    in torch's plain form: parameters numbered in the order of the param groups."""
    index: dict[str, int] = {}
    groups = []
    for group in named["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    state = sorted(((index[name], value) for name, value in named["state"].items()), key=lambda item: item[0])
    return {"state": dict(state), "param_groups": groups}


def _plain(value: Any) -> Any:
    """`value` with its tensors on the CPU, rebuilt so that its pickle depends on the values
    alone. Pickle writes a second reference to one object as a back-reference but an equal
    copy in full, so object identity reaches the bytes: in a fresh run the optimizer state's
    keys ('step', 'lr', 'exp_avg', ...) are the very strings of the payload's own keys and of
    torch's code, after a resume they are copies read back from the checkpoint, and the same
    state pickled to other bytes (another sha256 for a tensor-identical snapshot). Every
    string interned (one object per value) and every container new (none shared), equal
    payloads pickle alike."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) is str:
        return sys.intern(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


@dataclass(frozen=True)
class Snapshot:
    """A loaded snapshot or checkpoint (validated)."""

    path: Path
    """The file (or sharded folder) it was read from."""
    config: RunConfig
    """The full run config the file was written under."""
    step: int
    """Updates completed when it was written (the next update has index `step`)."""
    uniform_updates: int
    """Updates since the switch to the finishing schedule (negative before it; 0 without a switch)."""
    lr: float
    """The learning rate the next update uses."""
    optimizer_class: str
    """'AdamW' or 'SGD'."""
    batches: torch.Tensor | None
    """int64 [n, B, T+1]: the next n training batches (None for ordinary checkpoints)."""
    eval_tokens: torch.Tensor
    """int64 [E, T+1]: the held-out evaluation set."""
    sha256: str
    """Hex digest of the file's bytes (of a sharded folder: of its files' names and digests)."""
    model_state: dict[str, torch.Tensor] = field(repr=False)
    """The model state_dict (empty when a sharded folder was read with `shards=False`)."""
    optimizer_state: dict[str, Any] = field(repr=False)
    """The optimizer state_dict, torch's plain index-keyed form (empty as `model_state`)."""
    rng: dict[str, Any] | None = field(default=None, repr=False)
    """RNG states (checkpoints only)."""
    progress: dict[str, float] | None = field(default=None, repr=False)
    """Run counters tokens, flops, wall_time (checkpoints only)."""
    trained_on: tuple[dict[str, str | int], ...] = ()
    """The machines and kernels that trained the run up to this file (TRAINED_ON; () when the
    file predates the record)."""

    def model(self, device: str | torch.device = "cpu") -> LoopedTransformer:
        """A LoopedTransformer with the stored weights (fp32, on `device`)."""
        model = LoopedTransformer(self.config.model)
        model.load_state_dict(self.model_state)
        return model.to(device)

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The training optimizer over `model` with the stored state, its LR set to `lr`
        (the next update's), so `optimizer.step()` takes exactly the run's next step."""
        optimizer = build_optimizer(model, self.config.optim)
        optimizer.load_state_dict(self.optimizer_state)
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        return optimizer


def load_snapshot(path: str | Path, kind: str | None = None, *, shards: bool = True) -> Snapshot:
    """Read and validate a snapshot or checkpoint, a file or a sharded folder (`NAME.dcp/`,
    whose shards are loaded into a plain model and optimizer on the CPU); any problem raises
    InputError "PATH: problem".

    `kind` 'snapshot' or 'checkpoint' refuses a file of the other kind (None reads either).
    `shards=False` reads a sharded folder's meta.pt alone and leaves model_state and
    optimizer_state empty: for a sharded run, which loads the shards itself (`load_sharded_state`).
    Validated: the keys and format version, the stored config, the scalars (lr finite and
    positive), the token tensors (shape, dtype, ids within the vocabulary), the model
    state (every weight of the config's model, of its shape and dtype, finite), the
    optimizer state (its param groups, finite positive LRs, the hyperparameters of the
    stored config, per parameter state of the parameter's shape and dtype, finite, a finite
    non-negative step) and, in checkpoints, the run counters and RNG states
    (trainer/checkpoint_checks.py)."""
    if kind not in (None, *KINDS):
        raise ValueError(f"kind must be None or one of {KINDS}, got {kind!r}")
    path = Path(path)
    sharded = path.is_dir()
    payload = _read_sharded_payload(path, shards) if sharded else _read_payload(path)
    is_snapshot = "batches" in payload
    check_kind(path, kind, is_snapshot)
    config = _stored_config(path, payload)
    check_scalars(path, config, payload)
    T1 = config.train.seq_len + 1
    eval_tokens = check_tokens(
        path, "eval_tokens", payload["eval_tokens"], (config.data.eval_sequences, T1), config.model.vocab_size
    )
    batches = None
    if is_snapshot:
        batches = check_tokens(
            path,
            "batches",
            payload["batches"],
            (config.train.snapshot_batches, config.train.batch_size, T1),
            config.model.vocab_size,
        )
    if not sharded or shards:
        check_model_state(path, config, payload["model"])
        check_optimizer_state(path, config, payload["optimizer"])
    if not is_snapshot:
        check_progress(path, payload["progress"], required=RESUME_COUNTERS if kind == "checkpoint" else ())
        check_rng(path, payload["rng"])
    return Snapshot(
        path=path,
        config=config,
        step=payload["step"],
        uniform_updates=payload["uniform_updates"],
        lr=payload["lr"],
        optimizer_class=payload["optimizer_class"],
        batches=batches,
        eval_tokens=eval_tokens,
        sha256=_folder_sha256(path) if sharded else file_sha256(path),
        model_state=payload["model"],
        optimizer_state=payload["optimizer"],
        rng=payload.get("rng"),
        progress=payload.get("progress"),
        trained_on=check_trained_on(path, TRAINED_ON, payload.get(TRAINED_ON, [])),
    )


def _read_payload(path: Path, expected: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The file's top-level dict, once it is known to be of this format version with every key
    of its kind (or `expected`)."""
    if not path.is_file():
        raise unreachable_input(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError... for damaged files
        raise InputError(f"{path}: truncated or not a depthdiag snapshot/checkpoint ({one_line(err)})") from None
    if not isinstance(payload, dict):
        raise InputError(f"{path}: not a depthdiag snapshot/checkpoint (top level is {type(payload).__name__})")
    version = payload.get("format_version")
    if version != FORMAT_VERSION:
        raise InputError(f"{path}: format_version {version!r}, this depthdiag reads format_version {FORMAT_VERSION}")
    if expected is None:
        expected = SNAPSHOT_KEYS if "batches" in payload else CHECKPOINT_KEYS
    missing = [k for k in expected if k not in payload]
    if missing:
        raise InputError(f"{path}: missing key(s) {', '.join(missing)}")
    return payload


def is_sharded_folder(path: str | Path) -> bool:
    """Whether `path` is a folder meant as a sharded checkpoint or snapshot (NAME.dcp/, or any
    folder holding a meta.pt), which `load_snapshot` reads like a checkpoint or snapshot file."""
    path = Path(path)
    return path.is_dir() and (path.suffix == SHARDED_SUFFIX or (path / META).is_file())


def _read_sharded_payload(path: Path, shards: bool) -> dict[str, Any]:
    """A sharded folder's meta.pt with, when `shards`, the model and optimizer state_dicts of
    its shards loaded into a plain model and optimizer of the stored config (the optimizer's
    in torch's plain index-keyed form): the payload a checkpoint or snapshot file holds."""
    meta = path / META
    if not meta.is_file() and path.suffix != SHARDED_SUFFIX:
        raise InputError(
            f"{path}: a folder, not a snapshot or checkpoint file (nor a sharded one, NAME{SHARDED_SUFFIX}/)"
        )
    if not meta.is_file():
        raise InputError(f"{path}: no {META}, so not a complete sharded depthdiag checkpoint or snapshot")
    payload = _read_payload(meta, expected=tuple(k for k in COMMON_KEYS if k not in SHARDED_KEYS))
    if "model" in payload:
        raise InputError(f"{meta}: not the meta.pt of a sharded folder (it holds the weights)")
    kind_keys = SNAPSHOT_KEYS if "batches" in payload else CHECKPOINT_KEYS
    missing = [k for k in kind_keys if k not in payload and k not in SHARDED_KEYS]
    if missing:
        raise InputError(f"{meta}: missing key(s) {', '.join(missing)}")
    if not shards:
        payload.update(model={}, optimizer=payload.get("optimizer", {}))
        return payload
    from torch.distributed.checkpoint import CheckpointException

    config = _stored_config(meta, payload)
    model = LoopedTransformer(config.model)
    optimizer = build_optimizer(model, config.optim)
    try:
        load_sharded_state(path, model, optimizer)
    # DCP raises CheckpointException (a BaseException) for a missing or damaged shard, and
    # RuntimeError, ValueError... for shards of another shape.
    except (Exception, CheckpointException) as err:
        raise InputError(
            f"{path}: the shards do not load into the stored config's model and optimizer ({one_line(err)})"
        ) from None
    payload.update(model=model.state_dict(), optimizer=payload.get("optimizer") or optimizer.state_dict())
    return payload


def _stored_config(path: Path, payload: dict[str, Any]) -> RunConfig:
    if not isinstance(payload["config"], str):
        raise InputError(f"{path}: 'config' must be a JSON string")
    return RunConfig.from_json(payload["config"], source=f"{path} (stored config)")


def _folder_sha256(path: Path) -> str:
    """The digest of a folder: of its files' relative names and SHA-256s, in name order."""
    digest = hashlib.sha256()
    for file in sorted(f for f in path.rglob("*") if f.is_file()):
        digest.update(f"{file.relative_to(path).as_posix()}\0{file_sha256(file)}\n".encode())
    return digest.hexdigest()


CHECKPOINT_DIR = "checkpoints"
SNAPSHOT_DIR = "snapshots"
LATEST = "latest"


def snapshot_name(uniform_updates: int, step: int, *, sharded: bool = False) -> str:
    """A snapshot file's name, or with `sharded` a sharded snapshot folder's."""
    return f"u{uniform_updates:04d}_step{step:06d}{SHARDED_SUFFIX if sharded else '.pt'}"


def checkpoint_name(step: int, *, sharded: bool = False) -> str:
    """A checkpoint file's name, or with `sharded` a sharded checkpoint folder's."""
    return f"step_{step:06d}{SHARDED_SUFFIX if sharded else '.pt'}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint (file or sharded folder) `latest` names, or the highest-step one when
    the pointer is missing or stale. A sharded folder is complete whenever it exists (it
    appears by a rename), and `latest` names it only after that."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    pointer = directory / LATEST
    if pointer.is_file():
        named = directory / pointer.read_text(encoding="utf-8").strip()
        if named.is_file() or (named.suffix == SHARDED_SUFFIX and named.is_dir()):
            return named
    pattern = "step_[0-9][0-9][0-9][0-9][0-9][0-9]"
    folders = (p for p in directory.glob(f"{pattern}{SHARDED_SUFFIX}") if p.is_dir())
    candidates = [*directory.glob(f"{pattern}.pt"), *folders]
    return max(candidates, key=lambda p: (p.stem, p.suffix)) if candidates else None
