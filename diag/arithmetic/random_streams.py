"""Common random numbers: every forward of the diagnostic runs from a fixed random stream.

A model whose forward draws noise (a random initial state) is then compared fairly (every
update depth sees the same noise) and reproducibly, and the caller's random streams are left
exactly as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from trainer.rng import seeded_generator

CRN_SEED = 20260
"""The seed of the random stream every forward of the diagnostic starts from (an evaluation
forward of a model that draws random numbers: the stream of its sequence, `sequence_seed`)."""


def sequence_seed(index: int) -> int:
    """The seed of the random stream of evaluation sequence `index` (its row in the evaluation
    set): a pure function of (CRN_SEED, index), through the project's one seeding recipe."""
    return int(seeded_generator(CRN_SEED, index).integers(2**63))


def _cuda_in_use() -> list[int]:
    """The CUDA devices whose RNGs the diagnostic forks and seeds: only those of an initialised
    CUDA, since seeding one before would queue a seed for whenever it is initialised."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


@contextlib.contextmanager
def common_random_numbers() -> Iterator[Callable[[int], None]]:
    """Run the block from the fixed random stream CRN_SEED (the CPU's and every initialised
    CUDA device's), and give the caller's RNG states back afterwards, exactly as they were.
    Yields `reseed(seed)`, which starts those streams again from `seed` inside the block."""
    cuda = _cuda_in_use()

    def reseed(seed: int) -> None:
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)

    with torch.random.fork_rng(devices=cuda):
        reseed(CRN_SEED)
        yield reseed


def rng_states() -> list[Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(index) for index in _cuda_in_use())]
