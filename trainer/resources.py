"""Whether a training run can fit in memory, asked before anything is allocated or written.

A request far beyond the machine (a typo'd model.d_model, a batch size with three zeros too
many) would otherwise fail deep inside torch or numpy with an allocation traceback, possibly
after the run directory was made. `training_memory` is a lower bound on what one training
process holds: fp32 weights and gradients, the optimizer state, the rotary tables, the
training batch, and the activations one update at depth 1 must keep for its backward pass
(every block's normed input and MLP hidden layer, the fp32 logits). Under FSDP2
(train.parallel='fsdp' at several processes) a process holds only its share of the weights,
gradients and optimizer state. Copies autocast makes, the whole weights of the block FSDP2
gathers for a forward, deeper updates, allocator slack and the monitor are left out, so a
refusal means the run clearly cannot fit, never that it might not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import InputError
from trainer.config import RunConfig
from trainer.flops import parameter_counts
from trainer.optim import OPTIMIZER_CLASSES

OPTIMIZER_STATE_FLOATS = {"adamw": 2, "sgd": 1}
"""fp32 values per parameter the optimizer keeps: AdamW's two moments, SGD's momentum buffer
(which torch only creates for a non-zero momentum)."""


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one training process needs at least, by what they hold."""

    parameters: int
    """Distinct parameters of the model (a tied embedding counted once)."""
    embedding_parameters: int
    """Those of them in the embedding and the LM head."""
    bytes_per_parameter: int
    """fp32 weight, gradient and optimizer state of one parameter."""
    parameter_shards: int
    """Processes the weights, gradients and optimizer state are split over (the world size
    under train.parallel='fsdp', else 1)."""
    rotary_bytes: int
    """The rotary cos and sin tables (fp32 buffers)."""
    block_activation_bytes: int
    """What one update's blocks keep for the backward pass: each block's normed input and MLP hidden layer."""
    logit_bytes: int
    """One update's fp32 logits, which the loss reads."""
    batch_bytes: int
    """This process's int64 training batch."""
    eval_bytes: int
    """The int64 evaluation set (host memory)."""
    snapshot_bytes: int
    """The int64 batches a snapshot carries, stacked before it is written (host memory)."""

    def parameter_bytes(self, parameters: int) -> int:
        """This process's share of the weights, gradients and optimizer state of `parameters`."""
        return self.bytes_per_parameter * parameters // self.parameter_shards

    @property
    def model_bytes(self) -> int:
        """Weights, gradients, optimizer state (this process's share) and rotary tables."""
        return self.parameter_bytes(self.parameters) + self.rotary_bytes

    @property
    def activation_bytes(self) -> int:
        """What one update keeps for its backward pass."""
        return self.block_activation_bytes + self.logit_bytes

    def on(self, device_type: str) -> int:
        """The bytes that must fit on a device of this type (a 'cpu' holds the host's share too)."""
        device = self.model_bytes + self.activation_bytes + self.batch_bytes
        return device + self.eval_bytes + self.snapshot_bytes if device_type == "cpu" else device


def training_memory(config: RunConfig, world_size: int = 1) -> MemoryNeed:
    """The lower bound of one of `world_size` training processes (see the module docstring)."""
    model, tc = config.model, config.train
    counts = parameter_counts(model)
    embedding = counts["embedding"] + (0 if model.tie_embeddings else counts["head"])
    state_floats = OPTIMIZER_STATE_FLOATS[config.optim.name]
    if config.optim.name == "sgd" and not config.optim.momentum:
        state_floats = 0
    tokens = tc.batch_size // world_size * tc.seq_len
    activation = 2 if tc.precision == "bf16" else 4
    blocks = model.n_prelude + model.n_core + model.n_coda
    row_bytes = (tc.seq_len + 1) * 8
    return MemoryNeed(
        parameters=sum(counts.values()) - counts["embedding"] - counts["head"] + embedding,
        embedding_parameters=embedding,
        bytes_per_parameter=(2 + state_floats) * 4,
        parameter_shards=world_size if tc.parallel == "fsdp" else 1,
        rotary_bytes=2 * model.max_seq_len * (model.d_model // model.n_heads) * 4,
        block_activation_bytes=tokens * blocks * (model.d_model + model.ff_width) * activation,
        logit_bytes=tokens * model.vocab_size * 4,
        batch_bytes=tc.batch_size // world_size * row_bytes,
        eval_bytes=config.data.eval_sequences * row_bytes,
        snapshot_bytes=tc.snapshot_batches * tc.batch_size * row_bytes if tc.snapshot_uniform_updates else 0,
    )


def available_memory(device: torch.device) -> int | None:
    """Bytes an allocation on `device` can still get: CUDA's free memory; on the CPU the
    kernel's MemAvailable (within a cgroup's memory.max), or the physical memory where
    there is no /proc. None when neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    limits = []
    meminfo = _text_or_none(Path("/proc/meminfo"))
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            limits.append(int(line.split()[1]) * 1024)
    cgroup = _text_or_none(Path("/sys/fs/cgroup/memory.max"))
    if cgroup and cgroup.strip().isdigit():  # "max" when the cgroup sets no limit
        limits.append(int(cgroup))
    if not limits:
        try:
            limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            return None
    return min(limits)


def check_memory(
    config: RunConfig,
    device: torch.device,
    world_size: int = 1,
    *,
    available: int | None = None,
    source: str | None = None,
) -> None:
    """Raise InputError ("SOURCE: KEY=VALUE needs at least N ...; this machine has M available")
    when the lower bound of `training_memory` exceeds `available` (default: what
    `available_memory` reads for `device`); does nothing when that cannot be read."""
    if available is None:
        available = available_memory(device)
    need = training_memory(config, world_size)
    total = need.on(device.type)
    if available is None or total <= available:
        return
    model, tc = config.model, config.train
    state = f"weights, gradients and {OPTIMIZER_CLASSES[config.optim.name]} state"
    blocks = model.n_prelude + model.n_core + model.n_coda
    parts = [
        (
            need.parameter_bytes(need.embedding_parameters),
            f"model.vocab_size={model.vocab_size}",
            f"the {state} of {need.embedding_parameters:,} embedding parameters",
        ),
        (
            need.parameter_bytes(need.parameters - need.embedding_parameters),
            f"model.d_model={model.d_model}",
            f"the {state} of {need.parameters - need.embedding_parameters:,} parameters in {blocks} blocks",
        ),
        (need.rotary_bytes, f"model.max_seq_len={model.max_seq_len}", "the rotary tables"),
        (
            need.block_activation_bytes + need.batch_bytes,
            f"train.batch_size={tc.batch_size}, train.seq_len={tc.seq_len}",
            "the batch and the activations of one update",
        ),
        (
            need.logit_bytes,
            f"model.vocab_size={model.vocab_size}, train.batch_size={tc.batch_size}, train.seq_len={tc.seq_len}",
            "the logits of one update",
        ),
    ]
    if device.type == "cpu":
        parts.append((need.eval_bytes, f"data.eval_sequences={config.data.eval_sequences}", "the evaluation set"))
        parts.append((need.snapshot_bytes, f"train.snapshot_batches={tc.snapshot_batches}", "a snapshot's batches"))
    part, keys, what = max(parts)
    where = "this machine has" if device.type == "cpu" else f"the GPU {device} has"
    prefix = f"{source}: " if source else ""
    raise InputError(
        f"{prefix}{keys} needs at least {_bytes_text(total)} ({_bytes_text(part)} of it for {what}); "
        f"{where} {_bytes_text(available)} available"
    )


def _text_or_none(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _bytes_text(n: int) -> str:
    """'48 TB', '23.1 GB': three significant digits in decimal units."""
    units = ("B", "kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    power = 0
    while power < len(units) - 1 and n >= 1000 ** (power + 1):
        power += 1
    return f"{n / 1000**power:.3g} {units[power]}"
