"""The training optimizer. One factory, so the training loop, a snapshot's
`Snapshot.optimizer` and the tests build the same param groups and kernels, and a
saved optimizer state always loads into the optimizer it came from."""

from __future__ import annotations

import torch

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
