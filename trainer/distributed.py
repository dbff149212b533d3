"""Process-group setup for `torchrun`: one process per device, DDP with gloo on
CPU and nccl on GPU. Without torchrun's environment everything runs as a
single process and no collective is ever called."""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()
