"""What the training loop calls besides its own work: the in-training monitor's hook.

The trainer defines the protocol and `diag` provides the implementation
(`diag.in_training.monitor.UpdateMonitor`), which `depthdiag train` passes to `train(..., monitor=)`
when the config's [monitor] block is on: trainer never imports diag.

Only rank 0 calls the hook (other torchrun ranks go on and wait for it at the next
collective), except under train.parallel='fsdp': there each rank holds only its shards of
the model and the optimizer, so every rank calls it, and a hook that needs the whole model
computes with all of them together (diag/arithmetic/sharded.py). A hook must leave the model, the
optimizer and every process-wide state the training reads (RNGs, grad mode, autocast,
module modes) as it found them: training with a monitor equals training without one, to
the bit.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TrainingMonitor(Protocol):
    def resume(self, step: int) -> None:
        """Called once, before anything else: the run starts (fresh: 0) or resumes at `step`.
        Whatever the monitor recorded at `step` or later is forgotten: it will be recorded again."""
        ...

    def after_update(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The model and optimizer after `step` updates (step = the starting step too, before
        this invocation's first update), at the learning rate of the next update lr_at(step).
        OSError means the monitor's file could not be written (the run fails on it)."""
        ...

    def close(self) -> None:
        """The run ends (finished, failed or interrupted)."""
        ...
