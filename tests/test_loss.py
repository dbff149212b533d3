"""trainer/loss.py: the one loss and the one gradient clipping that training and the
diagnostic share, against torch's own cross-entropy and clip_grad_norm_."""

import pytest
import torch
import torch.nn.functional as F

from trainer.loss import clip_gradients_, counted_targets, forward_precision, summed_token_loss, training_loss
from trainer.model import IGNORE_INDEX, LoopedTransformer, ModelConfig


def gradients(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=gen) * 1e-3, torch.randn(7, generator=gen) * 2e-3]  # total norm ~0.006


@pytest.mark.parametrize("max_norm", [0.004, 1.0])
def test_clipping_is_clip_grad_norm_on_the_same_gradients(max_norm):
    grads = gradients()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = clip_gradients_(grads, max_norm)
    # On the CPU torch's foreach norm and scaling are the per-tensor kernels: bit for bit.
    assert torch.equal(norm, expected_norm)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, params))
    assert (max_norm < 0.005) == any(not torch.equal(g, b) for g, b in zip(grads, gradients()))


@pytest.mark.parametrize("off", [None, 0, 0.0])
def test_without_clipping_the_global_norm_is_reported_and_the_gradients_left_alone(off):
    grads = gradients()
    norm = clip_gradients_(grads, off)
    assert all(torch.equal(g, b) for g, b in zip(grads, gradients()))
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    assert float(clip_gradients_([], 1.0)) == 0.0


def test_the_loss_is_the_mean_cross_entropy_over_counted_targets():
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=2))
    batch = torch.randint(0, 32, (3, 9))
    batch[:2, -1] = IGNORE_INDEX  # targets only: the inputs stay token ids
    assert counted_targets(batch) == 3 * 8 - 2
    logits = model(batch[:, :-1], depth=2)
    targets = batch[:, 1:]
    kept = targets != IGNORE_INDEX
    expected = F.cross_entropy(logits[kept], targets[kept], reduction="mean")
    torch.testing.assert_close(training_loss(model, batch, 2), expected, rtol=1e-6, atol=0)
    assert summed_token_loss(logits, targets).item() == pytest.approx(expected.item() * 22, rel=1e-6)


def test_bf16_runs_the_forward_under_autocast_and_the_loss_in_fp32():
    with forward_precision("cpu", "bf16"):
        assert torch.is_autocast_enabled("cpu")
        logits = torch.randn(1, 2, 4) @ torch.eye(4)
    assert logits.dtype == torch.bfloat16
    assert summed_token_loss(logits, torch.tensor([[0, 1]])).dtype == torch.float32
    with forward_precision("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")


def test_a_bf16_loss_is_the_forward_under_bf16_autocast():
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=2))
    batch = torch.randint(0, 32, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch[:, :-1], depth=2)
    expected = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="mean")
    assert torch.equal(training_loss(model, batch, 2, precision="bf16"), expected)
    assert not torch.equal(training_loss(model, batch, 2), expected)
