"""Randomness: the one recipe every seeded numpy generator is built from, the
generator and rows of a global training batch, and the capture and restore of the
process-wide RNGs a checkpoint carries.

`seeded_generator(*words)` is PCG64 seeded with the list of words (through numpy's
SeedSequence), so a generator is a pure function of its words and generators with
different words are independent. The words in use:

    (train.seed, step)               a training batch (`batch_rng`)
    (train.seed, step, DEPTH_SALT)   a depth draw (trainer/schedules.py)
    (data.seed, stream, _BIOS_SALT)  the bioS population and evaluation set (trainer/data/bios.py)
    (train.seed, step, MONITOR_SALT) the seed of the monitor's batches at a check (diag/in_training/monitor.py)

A global batch's randomness is drawn whole from `batch_rng(seed, step)` and each
rank keeps its contiguous rows (`rank_rows`), so the ranks' rows in rank order are
exactly the one-process batch and no rank needs to talk to another.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from common.errors import InputError


def seeded_generator(*words: int) -> np.random.Generator:
    """The numpy generator of `words` (non-negative integers); see the module docstring."""
    return np.random.Generator(np.random.PCG64(list(words)))


def batch_rng(seed: int, step: int) -> np.random.Generator:
    """The generator of one global batch: a pure function of (seed, step)."""
    if seed < 0 or step < 0:
        raise InputError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    return seeded_generator(seed, step)


def rank_rows(batch_size: int, rank: int, world_size: int) -> slice:
    """The contiguous rows of a global batch that belong to `rank`."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise InputError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if batch_size < 1 or batch_size % world_size:
        raise InputError(f"batch_size={batch_size} must be a positive multiple of world_size={world_size}")
    per_rank = batch_size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def process_rng_state() -> dict[str, Any]:
    """Every process-wide RNG (torch, Python, numpy's global state, CUDA when present), as
    tensors and plain types, so a checkpoint can carry it."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _python_rng_state()}
    np_name, np_keys, np_pos, np_gauss, np_cached = np.random.get_state()
    state["numpy"] = {
        "name": np_name,
        "keys": torch.from_numpy(np_keys.astype(np.int64)),
        "pos": int(np_pos),
        "has_gauss": int(np_gauss),
        "cached_gaussian": float(np_cached),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_process_rng_state(state: dict[str, Any]) -> None:
    """Restore what `process_rng_state` captured."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]["version"], state["python"]["internal"], state["python"]["gauss"]
    random.setstate((version, tuple(internal.tolist()), None if gauss is None else float(gauss)))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["name"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def check_rng_state(state: dict[str, Any]) -> None:
    """Raise (TypeError, ValueError, KeyError, RuntimeError) unless `state` is what
    `process_rng_state` captures: each part is loaded into a throwaway generator of its kind,
    so the process's own generators are untouched."""
    if not isinstance(state, dict):
        raise TypeError(f"expected a dict, got {type(state).__name__}")
    torch.Generator().set_state(state["torch"])
    version, internal, gauss = state["python"]["version"], state["python"]["internal"], state["python"]["gauss"]
    random.Random().setstate((version, tuple(internal.tolist()), None if gauss is None else float(gauss)))
    np_state = state["numpy"]
    np.random.RandomState().set_state(
        (
            np_state["name"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    cuda = state.get("cuda", [])
    if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
        raise TypeError("cuda states must be a list of uint8 tensors")


def _python_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}
