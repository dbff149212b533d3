"""The checks `load_snapshot` (trainer/checkpoint.py) runs on what it read from a checkpoint or
snapshot before anything uses it: the scalars, the token tensors, the model and optimizer state
against the stored config, a checkpoint's run counters and RNG states, the machine records. Each
raises InputError "PATH: problem" at the first problem; every check on a tensor is one
vectorised pass, so validation costs a fraction of reading the file."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from common.errors import InputError
from trainer.config import RunConfig
from trainer.model import LoopedTransformer
from trainer.optim import OPTIMIZER_CLASSES, build_optimizer
from trainer.rng import check_rng_state


def one_line(err: BaseException) -> str:
    """`err` on one short line for an InputError message (its type's name when it says nothing)."""
    text = " ".join(str(err).split())
    return text[:200] if text else type(err).__name__


def check_trained_on(path: Path, key: str, records: Any) -> tuple[dict[str, str | int], ...]:
    """The machine records stored under `key` (trainer/checkpoint.py TRAINED_ON), once they are
    a list of flat dicts of strings and ints."""
    flat = isinstance(records, list) and all(
        isinstance(record, dict) and all(isinstance(k, str) and isinstance(v, (str, int)) for k, v in record.items())
        for record in records
    )
    if not flat:
        raise InputError(f"{path}: '{key}' must be a list of machine records (dicts of strings and ints)")
    return tuple(records)


def check_scalars(path: Path, config: RunConfig, payload: dict[str, Any]) -> None:
    """step, uniform_updates, optimizer_class and lr: their types, and the class against the stored config."""
    for key in ("step", "uniform_updates"):
        if not isinstance(payload[key], int):
            raise InputError(f"{path}: '{key}' must be an int")
    if payload["step"] < 0:
        raise InputError(f"{path}: negative step {payload['step']}")
    expected_class = OPTIMIZER_CLASSES[config.optim.name]
    if payload["optimizer_class"] != expected_class:
        raise InputError(
            f"{path}: optimizer_class {payload['optimizer_class']!r} does not match optim.name={config.optim.name!r}"
        )
    if not isinstance(payload["lr"], float):
        raise InputError(f"{path}: 'lr' must be a float")
    _check_lr(path, config, "'lr'", payload["lr"])


def check_kind(path: Path, kind: str | None, is_snapshot: bool) -> None:
    if kind == "checkpoint" and is_snapshot:
        raise InputError(
            f"{path}: a snapshot, not a checkpoint (it has no RNG states or run counters to resume from); "
            "resume from a checkpoint train wrote to checkpoints/"
        )
    if kind == "snapshot" and not is_snapshot:
        raise InputError(f"{path}: a checkpoint, not a snapshot (it carries no batches)")


def _check_lr(path: Path, config: RunConfig, what: str, lr: Any) -> None:
    """A learning rate: a finite number > 0; 0 only when the run decays to 0 (min_lr_ratio 0)."""
    if isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.is_floating_point():
        lr = float(lr)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise InputError(f"{path}: {what} must be a number, got {type(lr).__name__}")
    if not math.isfinite(lr) or lr < 0 or (lr == 0 and config.optim.min_lr_ratio != 0):
        bound = ">= 0 (optim.min_lr_ratio is 0)" if config.optim.min_lr_ratio == 0 else "> 0"
        raise InputError(f"{path}: {what} is {lr!r}; a learning rate must be finite and {bound}")


def check_tokens(path: Path, key: str, value: Any, shape: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
        raise InputError(f"{path}: '{key}' must be an int64 tensor")
    if tuple(value.shape) != shape:
        raise InputError(f"{path}: '{key}' has shape {list(value.shape)}, the stored config implies {list(shape)}")
    if value.numel() and (int(value.min()) < 0 or int(value.max()) >= vocab_size):
        raise InputError(f"{path}: '{key}' holds token ids outside [0, {vocab_size})")
    return value


def check_model_state(path: Path, config: RunConfig, state: Any) -> None:
    if not isinstance(state, dict):
        raise InputError(f"{path}: 'model' must be a state_dict")
    with torch.device("meta"):
        reference = LoopedTransformer(config.model).state_dict()
    missing = sorted(set(reference) - set(state))
    unexpected = sorted(set(state) - set(reference))
    if missing or unexpected:
        raise InputError(
            f"{path}: model state_dict does not match the stored config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for name, tensor in reference.items():
        value = state[name]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            raise InputError(f"{path}: model weight {name} has the wrong shape for the stored config")
        if value.dtype != tensor.dtype:
            raise InputError(f"{path}: model weight {name} is {value.dtype}, the model's weights are {tensor.dtype}")
        if value.is_floating_point() and not _all_finite(value):
            raise InputError(f"{path}: model weight {name} holds non-finite values (NaN or inf)")


def check_optimizer_state(path: Path, config: RunConfig, state: Any) -> None:
    """The optimizer state_dict against the optimizer the stored config builds: the same param
    groups and hyperparameters, finite LRs, and every parameter's state of its shape and dtype."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) or "param_groups" not in state:
        raise InputError(f"{path}: 'optimizer' must be an optimizer state_dict")
    groups = state["param_groups"]
    if not isinstance(groups, list) or len(groups) != 2:
        count = len(groups) if isinstance(groups, list) else "no list of"
        raise InputError(f"{path}: optimizer state has {count} param groups, expected 2")
    with torch.device("meta"):
        model = LoopedTransformer(config.model)
    optimizer = build_optimizer(model, config.optim)
    reference = optimizer.state_dict()["param_groups"]
    names = {id(p): name for name, p in model.named_parameters()}
    params: dict[int, tuple[str, torch.Tensor]] = {}
    for i, (group, expected, live) in enumerate(zip(groups, reference, optimizer.param_groups)):
        if not isinstance(group, dict) or group.get("params") != expected["params"]:
            raise InputError(f"{path}: optimizer param group {i} does not hold the stored config's parameters")
        _check_lr(path, config, f"optimizer param group {i} lr", group.get("lr"))
        for key, value in expected.items():
            if key in _CONFIG_SETTINGS and not _same_setting(group.get(key), value):
                raise InputError(
                    f"{path}: optimizer param group {i} {key}={group.get(key)!r}, the stored config gives {value!r}"
                )
        params.update({pid: (names[id(p)], p) for pid, p in zip(expected["params"], live["params"])})
    required = _STATE_KEYS[OPTIMIZER_CLASSES[config.optim.name]]
    for pid, entry in state["state"].items():
        if pid not in params or not isinstance(entry, dict):
            raise InputError(f"{path}: optimizer state for an unknown parameter {pid!r}")
        name, param = params[pid]
        missing = [key for key in required if key not in entry]
        if missing:
            raise InputError(f"{path}: optimizer state of {name} lacks {', '.join(missing)}")
        for key, value in entry.items():
            if key == "step":
                _check_step(path, name, value)
            elif value is not None or key != "momentum_buffer":  # SGD keeps None before its first step
                _check_state_tensor(path, name, key, value, param)


_CONFIG_SETTINGS = ("weight_decay", "betas", "eps", "momentum")
"""Param group settings the run config determines (the optimizer takes them from the file on load)."""

_STATE_KEYS = {"AdamW": ("step", "exp_avg", "exp_avg_sq"), "SGD": ()}
"""Per parameter state every optimizer class keeps once the parameter has been stepped."""


def _same_setting(stored: Any, expected: Any) -> bool:
    if isinstance(stored, (tuple, list)) and isinstance(expected, (tuple, list)):
        return len(stored) == len(expected) and all(map(_same_setting, stored, expected))
    return type(stored) is type(expected) and stored == expected


def _check_step(path: Path, name: str, step: Any) -> None:
    if isinstance(step, torch.Tensor) and step.numel() == 1 and step.dtype != torch.bool:
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step < 0:
        raise InputError(f"{path}: optimizer state of {name}: step must be a finite number >= 0, got {step!r}")


def _check_state_tensor(path: Path, name: str, key: str, value: Any, param: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{path}: optimizer state of {name}: {key} must be a tensor, got {type(value).__name__}")
    if value.shape != param.shape:
        raise InputError(
            f"{path}: optimizer state of {name}: {key} has shape {list(value.shape)}, the parameter {list(param.shape)}"
        )
    if value.dtype != param.dtype:
        raise InputError(f"{path}: optimizer state of {name}: {key} is {value.dtype}, the parameter is {param.dtype}")
    if not _all_finite(value):
        raise InputError(f"{path}: optimizer state of {name}: {key} holds non-finite values (NaN or inf)")


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a floating tensor is finite. One summation answers it (a NaN or
    an inf anywhere makes the sum NaN or inf) several times faster than an elementwise test,
    which only runs when the sum is not finite (a sum of finite values may overflow)."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


RESUME_COUNTERS = ("tokens", "flops", "wall_time")
"""The run counters a checkpoint carries; resuming needs every one."""


def check_progress(path: Path, progress: Any, required: tuple[str, ...]) -> None:
    """A checkpoint's run counters: finite numbers >= 0, with every one of `required`."""
    if not isinstance(progress, dict):
        raise InputError(f"{path}: 'progress' must be a dict of run counters")
    for key in dict.fromkeys((*required, *progress)):
        value = progress.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InputError(f"{path}: 'progress' {key} must be a finite number >= 0, got {value!r}")


def check_rng(path: Path, rng: Any) -> None:
    """A checkpoint's RNG states: they must load into generators of their kinds."""
    try:
        check_rng_state(rng)
    except (TypeError, ValueError, KeyError, RuntimeError, AttributeError) as err:
        raise InputError(f"{path}: 'rng' does not hold usable RNG states ({one_line(err)})") from None
