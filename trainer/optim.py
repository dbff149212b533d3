"""The training optimizer. One factory, so the training loop, a snapshot's
`Snapshot.optimizer` and the tests build the same param groups and kernels, and a
saved optimizer state always loads into the optimizer it came from."""

from __future__ import annotations

import torch

from common.errors import InputError
from trainer.config import OptimConfig

OPTIMIZER_CLASSES = {"adamw": "AdamW", "sgd": "SGD"}
"""optim.name -> the class name of the optimizer it builds, which checkpoints record."""


def build_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """The training optimizer over `model`'s parameters, in two param groups:
    matrices (ndim >= 2, weight-decayed) first, then vectors (norm gains, no decay).
    Loading a saved `optimizer` state requires exactly these groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if optim.name == "adamw":
        # foreach=False: the per-tensor kernel is what CPU uses anyway, and fixing it keeps
        # resumed and diagnostic steps on the same arithmetic path on every device.
        return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=False)
    return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, foreach=False)


def lr_at(step: int, optim: OptimConfig, total_updates: int) -> float:
    """Learning rate of update `step` (0-based): linear warmup over `warmup` updates
    (update i uses (i+1)/warmup of the peak), constant, then linear decay over the
    last `decay_fraction` of the run reaching min_lr_ratio * lr at the last update.
    Where warmup and decay overlap the smaller factor wins; steps past the end keep
    the final LR."""
    if step < 0:
        raise InputError(f"step must be >= 0, got {step}")
    factor = 1.0
    if optim.warmup:
        factor = min(factor, (step + 1) / optim.warmup)
    decay_updates = round(optim.decay_fraction * total_updates)
    if decay_updates:
        done = min(step - (total_updates - decay_updates) + 1, decay_updates)
        if done > 0:
            factor = min(factor, 1.0 - (1.0 - optim.min_lr_ratio) * done / decay_updates)
    return optim.lr * factor
