"""diag/arithmetic/measures.py against numpy by hand: the RMS of each tensor and of the whole
update, their geometric mean, the matching factors, and the sums over ranks of a sharded update
(a stand-in for the all-reduce: two ranks holding the same shards)."""

import math

import numpy as np
import pytest
import torch

from diag.arithmetic.measures import geomean_rms, global_rms, matching_factors, tensor_rms


def update(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(shape, generator=generator) for shape in ((3, 4), (5,), (0,), (2, 2, 2))]


def by_hand(tensors) -> tuple[list[float], float]:
    arrays = [t.double().numpy().ravel() for t in tensors]
    per_tensor = [math.sqrt(float(np.mean(a**2))) if a.size else 0.0 for a in arrays]
    everything = np.concatenate(arrays)
    return per_tensor, math.sqrt(float(np.mean(everything**2)))


def two_ranks(values: torch.Tensor) -> torch.Tensor:
    """The all-reduce of two ranks that hold the same shards."""
    return values + values


def test_tensor_and_global_rms_are_the_hand_values():
    tensors = update(0, scale=3.0)
    per_tensor, whole = by_hand(tensors)
    assert tensor_rms(tensors) == pytest.approx(per_tensor, rel=1e-12)
    assert tensor_rms(tensors)[2] == 0.0  # the empty tensor
    assert global_rms(tensors) == pytest.approx(whole, rel=1e-12)
    assert global_rms([]) == 0.0


def test_summed_over_ranks_two_copies_of_the_shards_have_the_same_rms():
    tensors = update(1)
    assert tensor_rms(tensors, two_ranks) == pytest.approx(tensor_rms(tensors), rel=1e-12)
    assert global_rms(tensors, two_ranks) == pytest.approx(global_rms(tensors), rel=1e-12)
    # Squares summed over ranks but elements not (or the reverse) would be off by sqrt(2).
    one = tensors[:1]  # an update of one tensor: the counts read no second one
    assert tensor_rms(one, two_ranks) == pytest.approx(tensor_rms(one), rel=1e-12)


def test_geomean_rms_skips_zeros():
    assert geomean_rms([1.0, 4.0, 0.0]) == pytest.approx(2.0, rel=1e-12)
    assert geomean_rms([0.0, 0.0]) == 0.0
    assert geomean_rms([]) == 0.0


def test_matching_factors_by_mode():
    updates = [update(2), update(3, scale=2.0), update(4, scale=0.5)]
    rms = [global_rms(u) for u in updates]
    n = len(updates[0])
    assert matching_factors(updates, "none") == [[1.0] * n] * 3
    reference = matching_factors(updates, "reference")
    assert [fs[0] for fs in reference] == pytest.approx([rms[0] / r for r in rms], rel=1e-12)
    assert all(len(set(fs)) == 1 for fs in reference)
    geomean = math.exp(np.mean(np.log(rms)))
    assert [fs[0] for fs in matching_factors(updates, "geomean")] == pytest.approx(
        [geomean / r for r in rms], rel=1e-12
    )
    per_tensor = matching_factors(updates, "per-tensor")
    reference = by_hand(updates[0])[0]
    for fs, u in zip(per_tensor, updates):
        expected = [a / b if b > 0 else 1.0 for a, b in zip(reference, by_hand(u)[0])]
        assert fs == pytest.approx(expected, rel=1e-12)
