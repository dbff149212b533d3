import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from trainer.model import EXPLICIT_ATTENTION_MAX_LEN, LoopedTransformer, ModelConfig, _cpu_low_precision_attention

SMALL = dict(vocab_size=40, max_seq_len=16, d_model=32, n_heads=2, n_prelude=1, n_core=2, n_coda=1)


def trained_like(config: ModelConfig, seed: int = 0) -> LoopedTransformer:
    """A model away from its initialisation, whose depths all differ."""
    torch.manual_seed(seed)
    model = LoopedTransformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def separate_nll(model, x, y, depths):
    return torch.stack([F.cross_entropy(model(x, depth=s).flatten(0, 1), y.flatten()) for s in depths])


@pytest.mark.parametrize("init_state", ["zeros", "noise"])
@pytest.mark.parametrize("variant", [dict(), dict(injection="add", norm="sandwich", mlp="swiglu")])
def test_nll_by_depth_equals_separate_forwards(init_state, variant):
    model = trained_like(ModelConfig(**SMALL, init_state=init_state, **variant))
    x, y = torch.randint(0, 40, (2, 16)), torch.randint(0, 40, (2, 16))
    depths = list(range(1, 17))
    with torch.no_grad():
        one_pass = model.nll_by_depth(x, y, depths)
        separate = separate_nll(model, x, y, depths)
    torch.testing.assert_close(one_pass, separate, rtol=1e-5, atol=1e-5)
    # The depths must actually differ, or the comparison above proves nothing.
    assert (separate.max() - separate.min()) > 1e-3


@pytest.mark.parametrize("init_state", ["zeros", "noise"])
def test_nll_by_depth_deep_and_unordered(init_state):
    model = trained_like(ModelConfig(**SMALL, init_state=init_state))
    x, y = torch.randint(0, 40, (1, 12)), torch.randint(0, 40, (1, 12))
    depths = [64, 1, 33, 7]
    with torch.no_grad():
        torch.testing.assert_close(
            model.nll_by_depth(x, y, depths), separate_nll(model, x, y, depths), rtol=1e-5, atol=1e-5
        )


def test_ignored_targets_are_skipped():
    model = trained_like(ModelConfig(**SMALL))
    x, y = torch.randint(0, 40, (1, 12)), torch.randint(0, 40, (1, 12))
    y_masked = y.clone()
    y_masked[0, :6] = -1
    with torch.no_grad():
        nll = model.nll_by_depth(x, y_masked, [3])
        logits = model(x, depth=3)
    expected = F.cross_entropy(logits[0, 6:], y[0, 6:])
    torch.testing.assert_close(nll[0], expected)


@pytest.mark.parametrize(
    "variant", [dict(), dict(n_coda=0), dict(n_coda=2, norm="sandwich", mlp="swiglu", injection="add")]
)
def test_ignored_targets_are_not_read_out(variant):
    """With some targets ignored, only the counted tokens reach the head (and the last coda
    block's MLP), and the NLL at every depth is still that of full forwards."""
    model = trained_like(ModelConfig(**{**SMALL, **variant}))
    x, y = torch.randint(0, 40, (3, 16)), torch.randint(0, 40, (3, 16))
    counted = torch.rand(3, 16) < 0.4
    counted[0] = False  # a row with nothing counted still feeds the others' attention
    y_masked = y.masked_fill(~counted, -1)
    depths = [5, 1, 3]
    head_rows = []
    hook = model.head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[:-1].numel()))
    with torch.no_grad():
        nll = model.nll_by_depth(x, y_masked, depths)
        hook.remove()
        expected = torch.stack([F.cross_entropy(model(x, depth=s)[counted], y[counted]) for s in depths])
    assert head_rows == [int(counted.sum())] * len(depths)
    torch.testing.assert_close(nll, expected, rtol=1e-6, atol=1e-6)


def test_noise_state_is_deterministic_and_seeded():
    x = torch.randint(0, 40, (2, 8))
    a = trained_like(ModelConfig(**SMALL, init_state="noise", state_noise_seed=1))
    with torch.no_grad():
        first, second = a(x, depth=3), a(x, depth=3)
        b = LoopedTransformer(ModelConfig(**SMALL, init_state="noise", state_noise_seed=2))
        b.load_state_dict(a.state_dict())
        other_seed = b(x, depth=3)
    assert torch.equal(first, second)
    assert not torch.allclose(first, other_seed)


@pytest.mark.parametrize("adapter_init", ["sum", "input"])
def test_concat_adapter_passes_prelude_output_at_init(adapter_init):
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(**SMALL, adapter_init=adapter_init))
    e, state = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    torch.testing.assert_close(model.adapter(torch.cat((torch.zeros_like(e), e), dim=-1)), e)
    carried = state if adapter_init == "sum" else torch.zeros_like(state)
    torch.testing.assert_close(model.adapter(torch.cat((state, e), dim=-1)), carried + e)


def truncated_reference_loss(model: LoopedTransformer, x, y, depth: int, backprop_depth: int):
    """Hand-built truncated backprop: the first depth - backprop_depth iterations use
    detached copies of every parameter and of the prelude output, so autograd can only
    reach the live parameters through the last backprop_depth iterations."""
    frozen = {name: p.detach().clone() for name, p in model.named_parameters()}
    e = model._prelude(x)
    state = torch.zeros_like(e)

    def iterate(state, e, params):
        def run(prefix, module, *args):
            sub = {n[len(prefix) + 1 :]: t for n, t in params.items() if n.startswith(prefix + ".")}
            return functional_call(module, sub, args)

        h = run("adapter", model.adapter, torch.cat((state, e), dim=-1))
        for i, block in enumerate(model.core):
            h = run(f"core.{i}", block, h, model.rotary)
        return h

    live = dict(model.named_parameters())
    for k in range(depth):
        detached = k < depth - backprop_depth
        state = iterate(state, e.detach() if detached else e, frozen if detached else live)
    logits = model._readout(state)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_truncated_backprop_matches_hand_built_reference():
    depth, backprop_depth = 6, 2
    truncated = trained_like(ModelConfig(**SMALL, backprop_depth=backprop_depth))
    full = LoopedTransformer(ModelConfig(**SMALL))
    full.load_state_dict(truncated.state_dict())
    x, y = torch.randint(0, 40, (2, 10)), torch.randint(0, 40, (2, 10))

    F.cross_entropy(truncated(x, depth=depth).flatten(0, 1), y.flatten()).backward()
    got = {n: p.grad.clone() for n, p in truncated.named_parameters()}
    truncated.zero_grad(set_to_none=True)
    truncated_reference_loss(truncated, x, y, depth, backprop_depth).backward()
    F.cross_entropy(full(x, depth=depth).flatten(0, 1), y.flatten()).backward()

    for name, p in truncated.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # Truncation must change the core's gradient, or the reference check is vacuous.
    core_grad = got["core.0.mlp.up.weight"]
    full_grad = dict(full.named_parameters())["core.0.mlp.up.weight"].grad
    assert not torch.allclose(core_grad, full_grad, rtol=1e-3, atol=1e-6)


def test_truncated_backprop_keeps_the_forward_value():
    truncated = trained_like(ModelConfig(**SMALL, backprop_depth=3))
    full = LoopedTransformer(ModelConfig(**SMALL))
    full.load_state_dict(truncated.state_dict())
    x = torch.randint(0, 40, (2, 10))
    torch.testing.assert_close(truncated(x, depth=9), full(x, depth=9))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_depth_is_rejected(bad):
    model = LoopedTransformer(ModelConfig(**SMALL))
    with pytest.raises(ValueError, match="depth"):
        model(torch.zeros(1, 4, dtype=torch.long), depth=bad)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(n_heads=3), "divide"),
        (dict(mlp="relu"), "mlp"),
        (dict(n_core=0), "n_core"),
        (dict(backprop_depth=-1), "backprop_depth"),
    ],
)
def test_config_validation(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**SMALL, **changes})


def test_parameter_groups_cover_every_parameter():
    model = LoopedTransformer(ModelConfig(**SMALL))
    assert sum(model.parameter_groups().values()) == sum(p.numel() for p in model.parameters())


def test_rotary_is_the_pairwise_rotation_to_the_bit():
    from trainer.model import Rotary

    rotary = Rotary(head_dim=8, max_seq_len=12)
    x = torch.randn(2, 3, 12, 8, requires_grad=True)
    angles = torch.outer(torch.arange(12.0), 10000.0 ** (-torch.arange(0, 8, 2.0) / 8))
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    reference = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    assert torch.equal(rotary(x), reference)
    grad = torch.randn_like(reference)
    (expected,) = torch.autograd.grad(reference, x, grad)
    (got,) = torch.autograd.grad(rotary(x), x, grad)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("T", [EXPLICIT_ATTENTION_MAX_LEN, EXPLICIT_ATTENTION_MAX_LEN + 1])
def test_cpu_bf16_attention_is_causal_attention_to_bf16_rounding(T):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, 8).bfloat16().requires_grad_() for _ in range(3))
    reference_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*reference_inputs, is_causal=True)
    got = _cpu_low_precision_attention(q, k, v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference, rtol=0, atol=2e-2)
    grad = torch.randn_like(reference)
    got_grads = torch.autograd.grad(got, (q, k, v), grad.bfloat16())
    reference_grads = torch.autograd.grad(reference, reference_inputs, grad)
    for g, r in zip(got_grads, reference_grads):
        torch.testing.assert_close(g.float(), r, rtol=0, atol=5e-2)
    # Causal: changing the last position's keys and values leaves every earlier output as it was.
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[..., -1, :], v2[..., -1, :] = 7.0, -7.0
    changed = _cpu_low_precision_attention(q.detach(), k2, v2)
    assert torch.equal(changed[..., :-1, :], got.detach()[..., :-1, :])
    assert not torch.equal(changed[..., -1, :], got.detach()[..., -1, :])


@pytest.mark.parametrize("T, fused_calls", [(8, 0), (EXPLICIT_ATTENTION_MAX_LEN + 1, 1 + 2 * 2 + 1)])
def test_cpu_bf16_attention_calls_the_fused_kernel_in_fp32_only_past_the_explicit_length(monkeypatch, T, fused_calls):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = LoopedTransformer(ModelConfig(vocab_size=32, max_seq_len=T, d_model=16, n_heads=2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 32, (2, T)), depth=2)
    assert len(seen) == fused_calls  # prelude, core x depth, coda: all explicit, or all fused in fp32
    assert set(seen) <= {(torch.float32,) * 3}
