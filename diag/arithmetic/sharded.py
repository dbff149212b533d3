"""The update diagnostic on an FSDP2-sharded model, for a model whose weights, gradients,
clones and optimizer state do not fit on one device.

Every rank of the process group builds one `ShardedUpdateDiagnostic` over the same
`fully_shard`-ed model and its optimizer and calls every method together, with the same
batch and evaluation set; each holds only its shard of theta, of the optimizer state and
of every update, and the numbers come out equal to the unsharded `UpdateDiagnostic`'s
within float rounding (tests/test_sharded_diag.py: within 1e-6). What changes, and why:

- The gradient: the batch's rows are split over the ranks and `backward()` runs through the
  sharded model (torch.autograd.grad cannot differentiate with respect to sharded
  parameters); FSDP2's reduce-scatter averages the ranks' gradients, so each rank divides
  its summed loss by the batch's counted targets over the world size, as training under
  torchrun does. Each rank reads its shard of `.grad`; clipping uses the global norm.
- Delta(g) is elementwise, so each rank steps its own shards (diag/arithmetic/optim_step.py).
- Every RMS, norm and dot product is summed over the ranks before it is divided or
  compared (a shard's partial sum read as the whole would be silently wrong).
- Evaluation: theta + u is copied into the local shards of the real parameters (no_grad, all
  shards resharded first), the evaluation chunks are spread over the ranks, and theta is
  copied back, bit for bit. `torch.func.functional_call` cannot be used: on an FSDP2 module
  it silently evaluates the module's own weights instead of the substituted ones.

The model's own parameters are therefore written during an evaluation and restored after
it; nothing else of the model or the optimizer changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from common.errors import InputError
from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic, module_mode
from diag.arithmetic.model_checks import check_gradient_coverage
from diag.arithmetic.optim_step import STEPPED_BY_KERNELS
from diag.arithmetic.random_streams import common_random_numbers
from trainer.distributed import local_part, register_evaluation_methods
from trainer.loss import counted_targets, forward_precision, summed_token_loss
from trainer.scoring import nll_by_depth


def _sum_over_ranks(values: Tensor) -> Tensor:
    total = values.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


class ShardedUpdateDiagnostic(UpdateDiagnostic):
    """`UpdateDiagnostic` for an FSDP2 model (see the module docstring): built and called on
    every rank together. `model` is the `fully_shard`-ed model (its root sharded too),
    `optimizer` the torch.optim Adam, AdamW or SGD over its sharded parameters."""

    sum_over_ranks = staticmethod(_sum_over_ranks)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        eval_tokens: Tensor,
        options: DiagnosticOptions = DiagnosticOptions(),
        eval_mask: Tensor | None = None,
    ):
        if not dist.is_initialized():
            raise InputError("the sharded diagnostic runs under torchrun, in an initialised process group")
        if not isinstance(model, FSDPModule):
            raise InputError("the sharded diagnostic needs the model's root sharded too (fully_shard(model) last)")
        if type(optimizer) not in STEPPED_BY_KERNELS:
            # Any other optimizer is deep-copied and stepped whole (diag/arithmetic/optim_step.py), not per shard.
            raise InputError(
                f"the sharded diagnostic steps Adam, AdamW and SGD shard by shard, not {type(optimizer).__name__}"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        register_evaluation_methods(model)
        super().__init__(model, optimizer, eval_tokens, options, eval_mask=eval_mask)
        self._params: dict[str, nn.Parameter] = dict(model.named_parameters())

    def _probe(self) -> tuple[int, bool]:
        """The base probe runs through functional_call, which an FSDP2 module ignores: the
        sharded diagnostic is for LoopedTransformer-like models that report their width."""
        config = getattr(self.model, "config", None)
        vocab_size = getattr(config, "vocab_size", None)
        if not isinstance(vocab_size, int):
            raise InputError("the sharded diagnostic needs a model whose config names its vocab_size")
        return vocab_size, False

    def _rows(self, batch: Tensor) -> Tensor:
        """This rank's rows of `batch`."""
        if batch.shape[0] < self.world_size:
            raise InputError(
                f"a batch of {batch.shape[0]} rows cannot be split over {self.world_size} ranks; "
                "diagnose batches of at least one row per rank"
            )
        return batch.tensor_split(self.world_size)[self.rank]

    def gradient(self, batch: Tensor, depth: int) -> tuple[float, list[Tensor]]:
        """As `UpdateDiagnostic.gradient`, through the sharded model's own backward; the
        gradients are this rank's shards."""
        batch = self.check_batch(batch)
        rows = self._rows(batch)
        params = [self._params[name] for name in self.stepped]
        trainable = [name for name, p in self._params.items() if p.requires_grad]
        for p in self._params.values():
            p.grad = None  # FSDP2 accumulates into .grad
        count = float(counted_targets(batch))
        try:
            with torch.enable_grad(), common_random_numbers(), module_mode(self.model, training=True):
                with forward_precision(self.device.type, self.options.precision):
                    output = self.model(rows[:, :-1], **self.family.gradient_call(depth))
                loss_sum = summed_token_loss(self.family.logits(output), rows[:, 1:])
                (loss_sum / (count / self.world_size)).backward()
            check_gradient_coverage(trainable, [self._params[n].grad for n in trainable], depth)
            grads = [
                local_part(p.grad).float().clone() if p.grad is not None else torch.zeros_like(self.theta[n])
                for n, p in zip(self.stepped, params)
            ]
        finally:
            for p in self._params.values():
                p.grad = None
        if self.options.grad_clip:
            total = float(self.sum_over_ranks(torch.stack([g.double().square().sum() for g in grads]).sum())) ** 0.5
            # torch's clip_grad_norm_ coefficient, on the norm of the whole gradient
            coef = min(self.options.grad_clip / (total + 1e-6), 1.0)
            for g in grads:
                g.mul_(coef)
        loss = float(self.sum_over_ranks(loss_sum.detach().double().reshape(1))) / count
        return loss, grads

    @contextlib.contextmanager
    def _weights(self, update: Sequence[Tensor] | None) -> Iterator[None]:
        """The model's local shards hold theta + update inside the block, theta after it."""
        self._reshard()
        with torch.no_grad():
            if update is not None:
                for name, u in zip(self.stepped, update):
                    local_part(self._params[name]).copy_(self.theta[name] + u)
            try:
                yield
            finally:
                self._reshard()
                if update is not None:
                    for name in self.stepped:
                        local_part(self._params[name]).copy_(self.theta[name])

    def _reshard(self) -> None:
        # A root module stays unsharded after a forward without backward: an unsharded copy
        # would be evaluated instead of the shards just written.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def evaluate(self, update: Sequence[Tensor] | None = None) -> np.ndarray:
        """As `UpdateDiagnostic.evaluate`; the evaluation chunks are spread over the ranks
        (chunk c to rank c % world size) and their token-weighted sums added up."""
        depths = list(self.options.serving_depths)
        size = self.options.eval_batch_size
        chunks = list(zip(self.eval_tokens.split(size), self.eval_targets.split(size), self._chunk_counts))
        mine = chunks[self.rank :: self.world_size]
        rounds = -(-len(chunks) // self.world_size)
        total = torch.zeros(len(depths), dtype=torch.float64, device=self.device)
        with self._weights(update), module_mode(self.model, training=False), common_random_numbers():
            for r in range(rounds):
                # Every rank runs the same number of forwards (each one all-gathers weights):
                # one without a chunk of its own repeats the first and leaves it out.
                rows, targets, count = mine[r] if r < len(mine) else (*chunks[0][:2], 0)
                if count == 0 and r < len(mine):
                    rows, targets = chunks[0][:2]  # no counted target: its NLL is NaN, weight 0
                with torch.no_grad():
                    nll = nll_by_depth(
                        self.model,
                        rows[:, :-1],
                        targets,
                        depths,
                        depth_call=self.family.eval_call,
                        logits_of=self.family.logits,
                    )
                if count:
                    total += nll.double() * count
        return (self.sum_over_ranks(total) / sum(self._chunk_counts)).cpu().numpy()
