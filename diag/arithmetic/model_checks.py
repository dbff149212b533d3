"""What the diagnostic checks of a model, its tokens and its optimizer before it measures anything.

A model from another codebase is measured or refused, never silently mismeasured: each
problem is a one-sentence InputError naming the fix, or a warning where the numbers stand
but mean less (UnchangedByDepthWarning, BiasCorrectionWarning).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch import Tensor

from common.errors import InputError
from diag.arithmetic.random_streams import CRN_SEED


def accepted_keywords(model: nn.Module) -> str:
    """The keywords `model.forward` names, for messages."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return "its keywords are not readable"
    keywords = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if parameters and parameters[0].kind is not parameters[0].KEYWORD_ONLY:
        keywords = keywords[1:]  # the first is the input ids
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        keywords.append("**kwargs")
    return ", ".join(keywords) if keywords else "no keyword besides the input"


def check_depth_kwarg(model: nn.Module, depth_kwarg: str) -> None:
    """Refuse a `depth_kwarg` the model's forward cannot take, listing the keywords it can."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return  # no readable signature (a C extension): the call itself will tell
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    keywords = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if depth_kwarg in keywords:
        return
    raise InputError(
        f"depth_kwarg={depth_kwarg!r}: {type(model).__name__}.forward takes no keyword {depth_kwarg!r} "
        f"(it accepts {accepted_keywords(model)}); depth_kwarg names the keyword that sets the number of "
        "loop iterations, e.g. depth_kwarg='num_steps' for Huginn-style models"
    )


PERTURBATION = 0.1
"""The noise that tells a depth keyword the forward ignores from weights at which the output
does not change with depth: 0.1 times each tensor's RMS (of at least 0.1, so that a tensor of
zeros moves too)."""


def with_perturbed_weights(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """`params` with Gaussian noise added to every floating tensor, from a generator of its own
    (the caller's random streams are not touched)."""
    generator = torch.Generator().manual_seed(CRN_SEED)
    perturbed = {}
    for name, value in params.items():
        if value.is_floating_point():
            rms = float(value.double().square().mean().sqrt())  # NaN for an empty tensor, which gets no noise
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float32)
            value = value + (PERTURBATION * max(rms, PERTURBATION) * noise).to(value.device, value.dtype)
        perturbed[name] = value
    return perturbed


class UnchangedByDepthWarning(UserWarning):
    """The model's output is the same at every depth at the diagnosed weights, though its depth
    keyword sets the depth (the output changes with it once the weights are perturbed): a model
    that does not use its depth yet, e.g. with zero-initialised output projections."""


def check_vocabulary(tokens: Tensor, name: str, vocab_size: int) -> None:
    """Refuse token ids the model's logits have no entry for (cross_entropy would index out of range)."""
    top = int(tokens.max()) if tokens.numel() else -1
    if top >= vocab_size:
        raise InputError(
            f"{name} holds token id {top} but the model's logits have {vocab_size} entries (its vocabulary); "
            "tokenize with the model's own vocabulary"
        )


class BiasCorrectionWarning(UserWarning):
    """Adam's bias correction still dominates the step being diagnosed: its updates are
    close to sign-like and the comparison says more about normalisation than curvature."""


def bias_correction_message(optimizer: torch.optim.Optimizer) -> str | None:
    """Why a diagnostic of `optimizer`'s next step says little (docs/diagnostic.md), or None:
    an Adam or AdamW that has taken fewer than 3 / (1 - beta2) steps."""
    if not isinstance(optimizer, torch.optim.Adam):
        return None
    beta2 = float(optimizer.param_groups[0]["betas"][1])
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    taken = min(steps) if steps else 0.0
    bound = 3 / (1 - beta2)
    if taken >= bound:
        return None
    return (
        f"the optimizer has taken {taken:.0f} steps (< 3 / (1 - beta2) = {bound:.0f}), so Adam's bias correction "
        "makes its updates sign-like and the diagnostic reflects normalisation more than curvature; diagnose a "
        "state from later in training (docs/diagnostic.md)"
    )


def checked_tokens(tokens: Tensor, name: str) -> Tensor:
    if not torch.is_tensor(tokens) or tokens.dim() != 2 or tokens.shape[1] < 2:
        shape = tuple(tokens.shape) if torch.is_tensor(tokens) else type(tokens).__name__
        raise InputError(f"{name} must be an integer tensor [rows, T+1] with T >= 1, got {shape}")
    if tokens.is_floating_point() or tokens.is_complex():
        raise InputError(f"{name} must hold integer token ids, got {tokens.dtype}")
    return tokens.long()


UNREACHED_FIX = (
    "the loss never reaches them (e.g. a gate or head that only a loss of the model's own uses); freeze them "
    "(requires_grad=False), and the optimizer steps them with a zero gradient"
)
"""The fix for parameters that get no gradient at any depth."""


def no_gradient_message(missing: list[str], trainable: int, depth: int, fix: str) -> str:
    """The refusal of a gradient that leaves the parameters `missing` out: an update made of zeros
    there would be measured as if those parameters did not matter. `fix` says what to do."""
    modules = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in missing))  # a top-level name is its own module
    shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
    return (
        f"{len(missing)} of {trainable} trainable parameters get no gradient at update depth {depth} ({shown}); {fix}"
    )


def check_gradient_coverage(trainable: list[str], grads: Sequence[Tensor | None], depth: int) -> None:
    """Refuse a gradient that leaves trainable parameters out, as parameters the loss never
    reaches: the sharded diagnostic's check, whose LoopedTransformer-like models take their depth
    as one int and act with every parameter at every depth unless one is unused."""
    missing = [name for name, g in zip(trainable, grads) if g is None]
    if missing:
        raise InputError(no_gradient_message(missing, len(trainable), depth, UNREACHED_FIX))
