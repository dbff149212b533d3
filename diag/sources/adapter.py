"""Models from other codebases in `depthdiag diagnose`: an adapter function builds them.

    depthdiag diagnose --adapter mypkg.huginn:load --adapter-arg path=ckpt.pt --out r.h5

imports `mypkg.huginn` (the current directory is searched first, as `python -m` does),
calls `load(path="ckpt.pt")` (every --adapter-arg value is a string) and runs the
diagnostic on the `AdaptedModel` it returns, through the same resumable run and results
file as snapshot files: one entry along `snapshot`, labelled with the adapter's `name`
(default: the --adapter spec). An import that fails, a missing function, an argument the
function does not take or a return value of another type is an InputError naming the
adapter; an exception raised inside the function is its own and keeps its traceback.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from common.choices import PRECISION_CHOICES
from common.errors import InputError
from common.imports import import_named
from diag.arithmetic.families import ModelFamily
from diag.arithmetic.target_groups import TargetGroups


def _is_token_tensor(value: Any, dims: int) -> bool:
    return (
        torch.is_tensor(value)
        and value.dim() == dims
        and value.shape[-1] >= 2
        and not (value.is_floating_point() or value.is_complex())
    )


@dataclass(frozen=True)
class AdaptedModel:
    """A model with everything one diagnostic run needs: what an adapter function returns, and
    the one form every input of `depthdiag diagnose` is opened as (diag/sources/entries.py),
    a snapshot file's model included. Nothing here is modified by the run."""

    model: nn.Module
    """Its forward takes the input ids [B, T] and the depth as the keyword `depth_kwarg`, and
    returns logits [B, T, V] or an object with `.logits` (or as `family` says). It runs on the
    device it is on."""
    optimizer: torch.optim.Optimizer
    """The optimizer over `model`'s parameters with the state of the step to diagnose."""
    batches: Sequence[Tensor] | Tensor
    """Training batches, token ids [B, T+1] each (or one tensor [n, B, T+1]): one unit each."""
    eval_tokens: Tensor
    """Held-out token ids [E, T+1]; every target eval_tokens[:, 1:] is counted."""
    depth_kwarg: str = "depth"
    """The keyword of the model's forward that sets the depth, as one int with full backprop."""
    family: ModelFamily | None = None
    """How to call the model for a gradient and an evaluation at a depth (diag/arithmetic/families.py, e.g.
    diag.HUGINN for Huginn-convention models); None: `depth_kwarg`. Give one or the other."""
    lr: float | None = None
    """The learning rate of the diagnosed step; None: each param group's own."""
    grad_clip: float | None = None
    """Clip the gradient's global norm to this, as the model's training did; None: no clipping."""
    name: str | None = None
    """The label along `snapshot` in the results file; None: the --adapter spec."""
    precision: str = "fp32"
    """How the gradients are computed, as the model trained: 'fp32', or 'bf16' (bf16
    autocast on the model's device); evaluations always run in fp32."""
    eval_mask: Tensor | None = None
    """bool [E, T]: the targets eval_tokens[:, 1:] to count (e.g. answers only); None: all."""
    optimizer_state: str | None = None
    """Where the optimizer's state came from, recorded as the results file's `optimizer_state`
    (e.g. a Trainer checkpoint, or an estimate for a model published without one); None: not said."""
    eval_groups: Sequence[TargetGroups] = ()
    """Groupings of the evaluation targets (diag.TargetGroups) to record each group's NLLs by,
    besides those --grouping names."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise InputError(f"AdaptedModel.model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise InputError(
                f"AdaptedModel.optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}"
            )
        batches = tuple(self.batches.unbind(0)) if torch.is_tensor(self.batches) else tuple(self.batches)
        if not batches or not all(_is_token_tensor(b, 2) for b in batches):
            raise InputError(
                "AdaptedModel.batches must be one or more integer tensors of token ids [B, T+1] "
                "(or one tensor [n, B, T+1]) with T >= 1"
            )
        object.__setattr__(self, "batches", batches)
        if not _is_token_tensor(self.eval_tokens, 2):
            raise InputError("AdaptedModel.eval_tokens must be an integer tensor of token ids [E, T+1] with T >= 1")
        if not isinstance(self.depth_kwarg, str) or not self.depth_kwarg.isidentifier():
            raise InputError(f"AdaptedModel.depth_kwarg must be a keyword name, got {self.depth_kwarg!r}")
        if self.family is not None and not isinstance(self.family, ModelFamily):
            raise InputError(f"AdaptedModel.family must be a diag.ModelFamily, got {type(self.family).__name__}")
        for key in ("lr", "grad_clip"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InputError(f"AdaptedModel.{key} must be a positive number or None, got {value!r}")
        if self.precision not in PRECISION_CHOICES:
            raise InputError(
                f"AdaptedModel.precision must be one of {', '.join(PRECISION_CHOICES)}, got {self.precision!r}"
            )
        if self.eval_mask is not None and not (
            torch.is_tensor(self.eval_mask)
            and self.eval_mask.dtype == torch.bool
            and self.eval_mask.shape == self.eval_tokens[:, 1:].shape
        ):
            raise InputError(
                "AdaptedModel.eval_mask must be a bool tensor of the targets' shape "
                f"{list(self.eval_tokens[:, 1:].shape)} (eval_tokens[:, 1:]) or None"
            )
        if self.name is not None and (
            not isinstance(self.name, str) or not self.name or self.name.startswith(".") or "/" in self.name
        ):
            raise InputError(f"AdaptedModel.name must be a file name (no '/', not hidden), got {self.name!r}")

    def fingerprint(self) -> str:
        """SHA-256 over the weights, buffers, optimizer state, tokens and settings: what a
        resumed run checks to continue only the same inputs (a snapshot file's sha256 does that for files)."""
        digest = hashlib.sha256()

        def add(value: Any) -> None:
            if torch.is_tensor(value):
                flat = value.detach().cpu().contiguous().reshape(-1)
                digest.update(f"{value.dtype}{list(value.shape)}".encode())
                digest.update(flat.view(torch.uint8).numpy().tobytes())
            elif isinstance(value, dict):
                for key in sorted(value, key=str):
                    digest.update(str(key).encode())
                    add(value[key])
            elif isinstance(value, (list, tuple)):
                digest.update(f"[{len(value)}]".encode())
                for item in value:
                    add(item)
            else:
                digest.update(repr(value).encode())

        add(dict(self.model.state_dict()))
        add(self.optimizer.state_dict())
        add(list(self.batches))
        add(self.eval_tokens)
        add(self.eval_mask)
        add([self.depth_kwarg, self.lr, self.grad_clip, type(self.model).__qualname__, type(self.optimizer).__name__])
        add(self.precision)
        add(None if self.family is None else self.family.identity())
        add(self.optimizer_state)
        return digest.hexdigest()


def parse_adapter_args(assignments: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """('KEY=VALUE', ...) -> ((KEY, VALUE), ...): each KEY a Python identifier, given once."""
    pairs = []
    for text in assignments:
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise InputError(f"--adapter-arg {text!r}: expected KEY=VALUE with KEY a Python identifier")
        if key in dict(pairs):
            raise InputError(f"--adapter-arg {key}: given twice")
        pairs.append((key, value))
    return tuple(pairs)


def adapter_function(spec: str) -> Callable[..., Any]:
    """The function `spec` ('module:function', the function part possibly dotted) names."""
    target = import_named(spec, "--adapter", "MODULE:FUNCTION", "mypkg.adapters:load_huginn")
    if not callable(target):
        raise InputError(f"--adapter {spec}: {spec.partition(':')[2]!r} is a {type(target).__name__}, not a function")
    return target


def load_adapter(spec: str, args: Sequence[tuple[str, str]] = ()) -> AdaptedModel:
    """Import the adapter `spec`, call it with `args` as keyword arguments, check what it returns."""
    function = adapter_function(spec)
    kwargs = dict(args)
    try:
        inspect.signature(function).bind(**kwargs)
    except TypeError as err:
        raise InputError(f"--adapter {spec}: the --adapter-arg values do not fit its parameters ({err})") from None
    except ValueError:
        pass  # no readable signature: the call will tell
    try:
        result = function(**kwargs)
    except InputError as err:
        raise InputError(f"--adapter {spec}: {err}") from None
    if not isinstance(result, AdaptedModel):
        raise InputError(
            f"--adapter {spec}: returned a {type(result).__name__}, not a diag.AdaptedModel "
            "(model, optimizer, batches, eval_tokens[, depth_kwarg, lr, grad_clip, name])"
        )
    return result


def adapter_config_json(spec: str, args: Sequence[tuple[str, str]], adapted: AdaptedModel) -> str:
    """What stands in a results file's `config` attribute for an adapter's run."""
    return json.dumps(
        {
            "adapter": spec,
            "adapter_args": dict(args),
            "model_class": f"{type(adapted.model).__module__}.{type(adapted.model).__qualname__}",
            "optimizer_class": type(adapted.optimizer).__name__,
            "depth_kwarg": adapted.depth_kwarg if adapted.family is None else adapted.family.depth_kwarg,
            "model_family": None if adapted.family is None else adapted.family.name,
            "grad_clip": adapted.grad_clip,
            "precision": adapted.precision,
            "eval_mask": adapted.eval_mask is not None,
        },
        sort_keys=True,
    )
