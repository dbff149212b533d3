"""The loss and the gradient clipping of one training update, shared by the training loop and
the update diagnostic (diag/arithmetic/engine.py), so the diagnostic differentiates exactly what training does.

The loss is the summed token cross-entropy (IGNORE_INDEX skipped, computed in fp32 whatever the
forward's precision) divided by the number of counted targets; clipping scales the gradients to
a global norm of at most `max_norm`, with torch's clip_grad_norm_ formula.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from trainer.model import IGNORE_INDEX


def forward_precision(device_type: str, precision: str) -> contextlib.AbstractContextManager:
    """The context a training forward runs in: bf16 autocast for precision 'bf16', else none."""
    if precision == "bf16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of `logits` [B, T, V] against `targets` int64 [B, T], in fp32,
    IGNORE_INDEX targets skipped."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def counted_targets(batch: torch.Tensor) -> int:
    """Targets of `batch` int64 [B, T+1] that the loss counts (not IGNORE_INDEX)."""
    return int((batch[:, 1:] != IGNORE_INDEX).sum())


def loss_sum_of(model: torch.nn.Module, batch: torch.Tensor, depth: int, *, precision: str = "fp32") -> torch.Tensor:
    """Summed token cross-entropy of `batch` int64 [B, T+1] at `depth`: inputs
    batch[:, :-1], targets batch[:, 1:], IGNORE_INDEX skipped; the forward runs under
    bf16 autocast when precision='bf16', the loss in fp32."""
    with forward_precision(batch.device.type, precision):
        logits = model(batch[:, :-1], depth=depth)  # [B, T, V]
    return summed_token_loss(logits, batch[:, 1:])


def training_loss(model: torch.nn.Module, batch: torch.Tensor, depth: int, *, precision: str = "fp32") -> torch.Tensor:
    """The loss one single-process training update differentiates: mean token
    cross-entropy of `batch` int64 [B, T+1] at `depth` (bit-identical to the loop's)."""
    return loss_sum_of(model, batch, depth, precision=precision) / float(counted_targets(batch))


def clip_gradients_(grads: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Scale `grads` in place so their global L2 norm is at most `max_norm` (None or 0: no
    clipping), as torch.nn.utils.clip_grad_norm_ scales parameters' gradients; returns the norm
    before clipping."""
    # clip_grad_norm_'s formula, spelled out for gradients that are not parameters' .grad
    # (the diagnostic's): torch.nn.utils.get_total_norm needs torch >= 2.6.
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    # Sharded gradients (FSDP2's DTensors): each shard's norm is a partial DTensor that the
    # stack and the norm reduce over the ranks, so `total` is already the global norm,
    # replicated; full_tensor() makes it a plain tensor, and the scaling applies to each
    # rank's own shard.
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if max_norm:
        coef = clip_coefficient(total, max_norm)
        for g in grads:
            (g.to_local() if hasattr(g, "to_local") else g).mul_(coef.to(g.device))
    return total


def clip_coefficient(norm: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """The factor clipping scales gradients of global L2 norm `norm` by: min(1, max_norm /
    (norm + 1e-6)), clip_grad_norm_'s; 1 when `max_norm` is None or 0."""
    if not max_norm:
        return torch.ones_like(norm)
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
