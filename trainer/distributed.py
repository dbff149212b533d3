"""Process-group setup for `torchrun`: one process per device, DDP or FSDP2 (`shard_model`)
with gloo on CPU and nccl on GPU. Without torchrun's environment everything runs as a
single process and no collective is ever called."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.errors import InputError


@dataclass(frozen=True)
class World:
    """Where this process sits among the training processes."""

    rank: int
    """Global rank, 0 writes every file."""
    world_size: int
    """Number of training processes."""
    device: torch.device
    """The device this process trains on."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(choice: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' was asked for, but no CUDA device is available")
    return torch.device(choice)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` does bf16 matmuls in hardware (CUDA with bf16, or a CPU with
    AVX512-BF16 or AMX); elsewhere bf16 autocast is emulated and slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    # Not mkldnn's bf16 check: it only asks for AVX-512 and so says yes on CPUs that emulate bf16.
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def init_world(device_choice: str, *, backend: str | None = None) -> World:
    """Join the process group torchrun describes in the environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or run alone without it. A rank's device
    is cuda:LOCAL_RANK when `device_choice` resolves to CUDA. `backend` None: nccl on
    CUDA, gloo on CPU; 'gloo' for a group that only exchanges small CPU objects (diagnose)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_choice)
    if world_size == 1:
        return World(rank=0, world_size=1, device=device)
    rank = int(os.environ["RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    return World(rank=rank, world_size=world_size, device=device)


def shutdown_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(world: World, value: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy); identity on one process."""
    if not world.distributed:
        return value
    total = value.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def all_reduce_int(world: World, value: int) -> int:
    """Sum of an int over ranks; no communication on one process."""
    if not world.distributed:
        return value
    return int(all_reduce_sum(world, torch.tensor(value, dtype=torch.int64, device=world.device)).item())


def all_gather_ints(world: World, value: int) -> list[int]:
    """Every rank's `value`, in rank order; [value] on one process."""
    if not world.distributed:
        return [value]
    mine = torch.tensor([value], dtype=torch.int64, device=world.device)
    gathered = [torch.zeros_like(mine) for _ in range(world.world_size)]
    dist.all_gather(gathered, mine)
    return [int(t.item()) for t in gathered]


def broadcast_object(world: World, value: Any) -> Any:
    """Rank 0's picklable `value` on every rank; `value` itself on one process."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard_model(model: torch.nn.Module, world: World, precision: str) -> torch.nn.Module:
    """`model` (a LoopedTransformer on `world.device`) sharded in place with FSDP2 over all
    ranks: every transformer block is its own unit, so only one block's weights are gathered
    at a time (the core's once per iteration, K times a forward), and the root unit holds the
    rest (embedding, adapter, norms, head). The evaluation methods are registered as forwards
    (`register_evaluation_methods`), so the validation pass gathers weights like one (every
    rank must call it). Returns `model`.

    With precision 'bf16' the blocks' weights are gathered in bf16 (half the bytes of the
    all-gathers, which the core repeats every iteration) and every gradient is reduced in
    fp32. The bf16 autocast of train.precision stays on (trainer/loss.py): it is what keeps
    the norms, the attention softmax and the loss in fp32 and casts each matmul's inputs,
    as under DDP. The block inputs are not cast and the root's weights stay fp32, so the
    embedding and the residual stream between blocks stay fp32 as they do under autocast alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.world_size,))
    blocks = MixedPrecisionPolicy()
    if precision == "bf16":
        blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in (*model.prelude, *model.core, *model.coda):
        fully_shard(block, mesh=mesh, mp_policy=blocks)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    register_evaluation_methods(model)
    return model


EVALUATION_METHODS = ("nll_by_depth", "logits_by_depth", "attend", "feed_forward")
"""Methods besides forward that an evaluation calls on a sharded module: the looped model's one
pass over every depth, and a block's sublayers, which a readout of some positions calls apart."""


def register_evaluation_methods(model: torch.nn.Module) -> None:
    """Give every FSDP2 module's evaluation methods (EVALUATION_METHODS) the unshard and
    reshard hooks of its forward: without them a method reads the sharded parameters. Once
    per module, however often it is called."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    for module in model.modules():
        if isinstance(module, FSDPModule) and not getattr(module, "_evaluation_methods_registered", False):
            for method in EVALUATION_METHODS:
                if callable(getattr(module, method, None)):
                    register_fsdp_forward_method(module, method)
            module._evaluation_methods_registered = True


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` or a submodule was sharded with FSDP2's `fully_shard`. Looked up only
    once FSDP2 is imported (nothing can be sharded before), so callers that never shard do
    not pay for importing it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of an FSDP2-sharded tensor (a DTensor); any other tensor itself.
    Without torch.distributed.tensor imported there is no DTensor, and it is not imported here."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()
