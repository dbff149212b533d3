"""The sizes and directions of updates, and their RMS matching (docs/diagnostic.md).

An update is a list of tensors, one per parameter; every sum runs in float64. With
`sum_over_ranks`, the tensors are this process's shards of a sharded model's update and the
sums run over every process's shards, so the numbers are those of the whole update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from common.choices import RMS_MATCH_CHOICES
from common.errors import InputError

SumOverRanks = Callable[[Tensor], Tensor]
"""Sums a float64 tensor over the processes that hold the shards of an update (a sharded
diagnostic's all-reduce); None: the update is whole in this process."""


def _summed(values: Tensor, sum_over_ranks: SumOverRanks | None) -> Tensor:
    return values if sum_over_ranks is None else sum_over_ranks(values)


def _squared_norms(update: Sequence[Tensor], sum_over_ranks: SumOverRanks | None = None) -> Tensor:
    """||u_p||^2 of every tensor, float64 [P], on the tensors' device (one sync when read)."""
    if not update:
        return torch.zeros(0, dtype=torch.float64)
    norms = torch.stack([torch.linalg.vector_norm(u, dtype=torch.float64).square() for u in update])
    return _summed(norms, sum_over_ranks)


def _numels(update: Sequence[Tensor], sum_over_ranks: SumOverRanks | None = None) -> list[int]:
    """Elements of every tensor (of the whole tensors, when they are shards)."""
    numels = [u.numel() for u in update]
    if sum_over_ranks is None or not update:
        return numels
    return [int(n) for n in sum_over_ranks(torch.tensor(numels, dtype=torch.float64, device=update[0].device))]


def global_rms(update: Sequence[Tensor], sum_over_ranks: SumOverRanks | None = None) -> float:
    """sqrt(sum_p ||u_p||^2 / sum_p numel_p), accumulated in float64; with `sum_over_ranks`,
    `update` is this process's shards and the sums run over every process's."""
    numel = sum(_numels(update, sum_over_ranks))
    if numel == 0:
        return 0.0
    return math.sqrt(float(_squared_norms(update, sum_over_ranks).sum()) / numel)


def global_cosine(a: Sequence[Tensor], b: Sequence[Tensor], sum_over_ranks: SumOverRanks | None = None) -> float:
    """<a, b> / (|a| |b|) over all tensors together, in float64; NaN when either is zero.
    With `sum_over_ranks` the dot products and norms of the shards are summed before they are divided."""
    dot = torch.stack([torch.dot(x.flatten().double(), y.flatten().double()) for x, y in zip(a, b)]).sum()
    sums = torch.stack((dot, _squared_norms(a).sum(), _squared_norms(b).sum()))
    dot, norm2_a, norm2_b = (float(v) for v in _summed(sums, sum_over_ranks).cpu())
    if norm2_a == 0 or norm2_b == 0:
        return math.nan
    return dot / (math.sqrt(norm2_a) * math.sqrt(norm2_b))


def scale_ratio(target: float, value: float) -> float:
    # An update that is exactly zero cannot be scaled to anything; leave it as it is.
    return target / value if value > 0 else 1.0


def tensor_rms(update: Sequence[Tensor], sum_over_ranks: SumOverRanks | None = None) -> list[float]:
    """RMS of every tensor of `update` (0 for an empty one)."""
    squared = _squared_norms(update, sum_over_ranks).tolist()
    return [math.sqrt(n2 / n) if n else 0.0 for n2, n in zip(squared, _numels(update, sum_over_ranks))]


def geomean_rms(rms: Sequence[float]) -> float:
    """exp(mean log RMS) over the non-zero RMS values (0 when all are zero)."""
    positive = [r for r in rms if r > 0]
    return math.exp(sum(math.log(r) for r in positive) / len(positive)) if positive else 0.0


def match_rms(updates: Sequence[Sequence[Tensor]], mode: str) -> tuple[list[list[Tensor]], list[float]]:
    """Scale every update (one list of tensors per depth; the first is the reference).

    reference:  u_K * RMS(u_ref) / RMS(u_K)
    geomean:    u_K * G / RMS(u_K), G = exp(mean_K log RMS(u_K))
    none:       u_K
    per-tensor: every tensor u_K,p * RMS(u_ref,p) / RMS(u_K,p)
    Returns the scaled updates and each depth's global scale RMS(scaled) / RMS(u_K).
    """
    factors = matching_factors(updates, mode)
    if mode == "none":
        return [list(u) for u in updates], [1.0] * len(updates)
    matched = [[t * f for t, f in zip(u, fs)] for u, fs in zip(updates, factors)]
    if mode == "per-tensor":
        return matched, [scale_ratio(global_rms(m), global_rms(u)) for m, u in zip(matched, updates)]
    return matched, [fs[0] if fs else 1.0 for fs in factors]


def matching_factors(updates: Sequence[Sequence[Tensor]], mode: str) -> list[list[float]]:
    """The factor RMS matching multiplies each tensor of each update by (`match_rms`), per
    depth and tensor: one value repeated over the tensors except under 'per-tensor'."""
    if mode not in RMS_MATCH_CHOICES:
        raise InputError(f"rms_match must be one of {RMS_MATCH_CHOICES}, got {mode!r}")
    if mode == "per-tensor":
        reference = tensor_rms(updates[0])
        return [[scale_ratio(r, o) for r, o in zip(reference, tensor_rms(u))] for u in updates]
    rms = [global_rms(u) for u in updates]
    if mode == "none":
        scales = [1.0] * len(updates)
    else:
        target = rms[0] if mode == "reference" else geomean_rms(rms)
        scales = [scale_ratio(target, r) for r in rms]
    return [[scale] * len(u) for u, scale in zip(updates, scales)]
