"""trainer/optim.py: the LR schedule (`lr_at`) against a piecewise reference built from ramps."""

import numpy as np
import pytest

from trainer.config import OptimConfig
from trainer.optim import lr_at


def reference_lrs(lr: float, warmup: int, decay_fraction: float, min_ratio: float, total: int) -> np.ndarray:
    """Piecewise schedule built from ramps: warmup ramp, flat, decay ramp ending at min_ratio."""
    factors = np.ones(total)
    if warmup:
        factors = np.minimum(factors, np.minimum(np.arange(1, total + 1) / warmup, 1.0))
    decay = round(decay_fraction * total)
    if decay:
        ramp = np.linspace(1.0, min_ratio, decay + 1)[1:]  # the last update lands on min_ratio
        factors[total - decay :] = np.minimum(factors[total - decay :], ramp)
    return lr * factors


@pytest.mark.parametrize(
    "warmup,decay_fraction,min_ratio,total",
    [(10, 0.2, 0.1, 100), (0, 0.1, 0.0, 50), (5, 0.0, 0.1, 30), (40, 0.5, 0.3, 60), (0, 1.0, 0.5, 7)],
)
def test_lr_at_matches_piecewise_reference(warmup, decay_fraction, min_ratio, total):
    optim = OptimConfig(lr=1e-3, warmup=warmup, decay_fraction=decay_fraction, min_lr_ratio=min_ratio)
    got = np.array([lr_at(step, optim, total) for step in range(total)])
    np.testing.assert_allclose(got, reference_lrs(1e-3, warmup, decay_fraction, min_ratio, total), rtol=1e-12)
    assert lr_at(total + 5, optim, total) == pytest.approx(got[-1])


def test_lr_at_rejects_negative_step():
    with pytest.raises(ValueError):
        lr_at(-1, OptimConfig(), 10)
