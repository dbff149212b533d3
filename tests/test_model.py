"""trainer/model.py: the looped transformer."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from common.errors import InputError
from trainer.model import (
    EXPLICIT_ATTENTION_MAX_LEN,
    LoopedTransformer,
    ModelConfig,
    Rotary,
    _cpu_low_precision_attention,
)

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
    "variant",
    [dict(), dict(n_coda=0), dict(n_coda=2, norm="sandwich", mlp="swiglu", injection="add"), dict(n_coda=3)],
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
    if T > EXPLICIT_ATTENTION_MAX_LEN:
        # Past the explicit length: fp32 attention rounded once to bf16, also inside the autocast
        # region the model runs it in (which must not round q, k, v to bf16 again).
        with torch.autocast("cpu", dtype=torch.bfloat16):
            in_autocast = _cpu_low_precision_attention(q, k, v)
        assert torch.equal(got, reference.bfloat16()) and torch.equal(in_autocast, got)
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


@pytest.mark.parametrize(
    "T, fused_calls", [(8, 0), (EXPLICIT_ATTENTION_MAX_LEN, 0), (EXPLICIT_ATTENTION_MAX_LEN + 1, 1 + 2 * 2 + 1)]
)
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


# --- the model against a transformer written out by hand ----------------------------------------


def reference_logits(model: LoopedTransformer, x: torch.Tensor, depth: int) -> torch.Tensor:
    """The looped transformer of the module docstring in plain tensor operations on the model's own
    parameters (live, so autograd reaches them): RMSNorm, interleaved-pair rotary embeddings with
    base 10000, causal softmax attention, the MLP, the injection and the loop, all spelled out."""
    cfg = model.config
    p = dict(model.named_parameters(remove_duplicate=False))  # a tied head keeps its own name

    def norm(h, name):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * p[f"{name}.weight"]

    def rotate(t):  # [B, H, T, Dh]: pair (2i, 2i+1) at position n turns by n * 10000^(-2i / Dh)
        T, Dh = t.shape[-2:]
        angles = torch.outer(torch.arange(T, dtype=torch.float64), 10000.0 ** (-torch.arange(0, Dh, 2) / Dh))
        cos, sin = angles.cos().float(), angles.sin().float()
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

    def attention(h, name):
        B, T, d = h.shape
        heads = [t.reshape(B, T, cfg.n_heads, -1).transpose(1, 2) for t in (h @ p[f"{name}.qkv.weight"].T).split(d, -1)]
        q, k, v = rotate(heads[0]), rotate(heads[1]), heads[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d) @ p[f"{name}.proj.weight"].T

    def mlp(h, name):
        up = h @ p[f"{name}.up.weight"].T
        hidden = F.silu(h @ p[f"{name}.gate.weight"].T) * up if cfg.mlp == "swiglu" else F.gelu(up)
        return hidden @ p[f"{name}.down.weight"].T

    def block(h, name):
        def post(t, which):
            return norm(t, f"{name}.{which}") if cfg.norm == "sandwich" else t

        h = h + post(attention(norm(h, f"{name}.attn_norm"), f"{name}.attn"), "attn_post_norm")
        return h + post(mlp(norm(h, f"{name}.mlp_norm"), f"{name}.mlp"), "mlp_post_norm")

    e = p["embed.weight"][x]
    for i in range(cfg.n_prelude):
        e = block(e, f"prelude.{i}")
    if cfg.init_state == "zeros":
        state = torch.zeros_like(e)
    else:
        noise = torch.randn(e.shape, generator=torch.Generator().manual_seed(cfg.state_noise_seed), dtype=torch.float32)
        state = cfg.state_noise_std * noise
    for _ in range(depth):
        h = torch.cat((state, e), -1) @ p["adapter.weight"].T if cfg.injection == "concat" else state + e
        for i in range(cfg.n_core):
            h = block(h, f"core.{i}")
        state = h
    h = norm(state, "loop_norm")
    for i in range(cfg.n_coda):
        h = block(h, f"coda.{i}")
    return norm(h, "final_norm") @ p["head.weight"].T


# Shapes that differ from one another (B, T, heads, head width, d, V, MLP width), so a transposed or
# misread axis cannot pass; a norm epsilon large enough to move every norm's output.
ODD = dict(vocab_size=37, max_seq_len=9, d_model=24, n_heads=3, norm_eps=0.05)
ARCHITECTURES = {
    "pre-gelu-concat": dict(ODD, n_prelude=1, n_core=2, n_coda=1),
    "sandwich-swiglu-add-noise-tied": dict(
        ODD,
        n_prelude=2,
        n_core=1,
        n_coda=2,
        norm="sandwich",
        mlp="swiglu",
        injection="add",
        init_state="noise",
        state_noise_std=0.7,
        state_noise_seed=5,
        tie_embeddings=True,
        d_ff=40,
    ),
    "input-adapter-noise-no-prelude-no-coda": dict(
        ODD, n_prelude=0, n_core=3, n_coda=0, adapter_init="input", init_state="noise", state_noise_seed=3
    ),
}


@pytest.mark.parametrize("changes", ARCHITECTURES.values(), ids=ARCHITECTURES.keys())
def test_forward_is_the_looped_transformer_written_out_by_hand(changes):
    model = trained_like(ModelConfig(**changes))
    x = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outputs = {depth: model(x, depth=depth) for depth in (1, 3)}
        for depth, logits in outputs.items():
            assert logits.shape == (2, 7, 37)
            torch.testing.assert_close(logits, reference_logits(model, x, depth), rtol=1e-4, atol=1e-5)
    assert (outputs[1] - outputs[3]).abs().max() > 1e-3  # the depths differ: the loop ran


@pytest.mark.parametrize("changes", [ARCHITECTURES["pre-gelu-concat"], dict(ODD, backprop_depth=3)])
def test_gradient_reaches_every_iteration_as_by_hand(changes):
    """Full backprop (and truncation deeper than the depth) takes every iteration's gradient."""
    model = trained_like(ModelConfig(**changes))
    x, y = torch.randint(0, 37, (2, 7)), torch.randint(0, 37, (2, 7))
    params = list(model.parameters())
    got = torch.autograd.grad(F.cross_entropy(model(x, depth=3).flatten(0, 1), y.flatten()), params)
    expected = torch.autograd.grad(F.cross_entropy(reference_logits(model, x, 3).flatten(0, 1), y.flatten()), params)
    for (name, _), g, r in zip(model.named_parameters(), got, expected):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-6, msg=name)


def expected_shapes(cfg: ModelConfig, ff: int) -> dict[str, tuple[int, ...]]:
    """Every checkpointed tensor of the model and its shape, from the module docstring; bias-free linears."""
    d, V = cfg.d_model, cfg.vocab_size
    shapes = {"embed.weight": (V, d), "loop_norm.weight": (d,), "final_norm.weight": (d,), "head.weight": (V, d)}
    if cfg.injection == "concat":
        shapes["adapter.weight"] = (d, 2 * d)
    blocks = [f"prelude.{i}" for i in range(cfg.n_prelude)] + [f"core.{i}" for i in range(cfg.n_core)]
    for name in blocks + [f"coda.{i}" for i in range(cfg.n_coda)]:
        shapes |= {
            f"{name}.attn_norm.weight": (d,),
            f"{name}.attn.qkv.weight": (3 * d, d),
            f"{name}.attn.proj.weight": (d, d),
            f"{name}.mlp_norm.weight": (d,),
            f"{name}.mlp.up.weight": (ff, d),
            f"{name}.mlp.down.weight": (d, ff),
        }
        if cfg.mlp == "swiglu":
            shapes[f"{name}.mlp.gate.weight"] = (ff, d)
        if cfg.norm == "sandwich":
            shapes |= {f"{name}.attn_post_norm.weight": (d,), f"{name}.mlp_post_norm.weight": (d,)}
    return shapes


@pytest.mark.parametrize(
    "changes, ff",
    [
        (dict(d_model=32, n_heads=2), 128),  # gelu: 4 d
        (dict(d_model=48, n_heads=2, mlp="swiglu", norm="sandwich", injection="add", n_coda=2), 128),  # 8/3 d to 64
        (dict(d_model=32, n_heads=2, d_ff=40, tie_embeddings=True), 40),
    ],
)
def test_checkpoint_holds_exactly_the_documented_tensors(changes, ff):
    """The rotary tables are derived from the config, so they stay out of the checkpoint."""
    cfg = ModelConfig(vocab_size=40, max_seq_len=16, **changes)
    model = LoopedTransformer(cfg)
    assert {name: tuple(t.shape) for name, t in model.state_dict().items()} == expected_shapes(cfg, ff)
    assert {name for name, _ in model.named_buffers()} == {"rotary.cos", "rotary.sin"}
    assert (model.head.weight is model.embed.weight) == cfg.tie_embeddings


def test_initialisation_follows_the_documented_scales():
    """Linear and embedding weights N(0, init_std), residual projections N(0, init_std / sqrt(2 * blocks))
    counting each block once, norms at one, the adapter [I | I] ('sum')."""
    cfg = ModelConfig(
        vocab_size=300, max_seq_len=8, d_model=64, n_heads=2, n_prelude=2, n_core=1, n_coda=1, init_std=0.05
    )
    torch.manual_seed(0)
    model = LoopedTransformer(cfg)
    residual_std = 0.05 / math.sqrt(2 * 4)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones(64)), name
        elif name == "adapter.weight":
            assert torch.equal(p, torch.cat((torch.eye(64), torch.eye(64)), dim=1))
        else:
            std = residual_std if name.endswith(("attn.proj.weight", "mlp.down.weight")) else 0.05
            # 4096 or more draws: the sample deviation is within 3% of the true one (2.2% at 4096).
            assert float(p.detach().std()) == pytest.approx(std, rel=0.05), name
            assert abs(float(p.detach().mean())) < 0.1 * std, name


def test_a_bf16_model_with_a_noise_state_runs_in_bf16_near_its_fp32_self():
    model = trained_like(ModelConfig(**ARCHITECTURES["pre-gelu-concat"], init_state="noise", state_noise_std=0.5))
    x = torch.randint(0, 37, (2, 7))
    with torch.no_grad():
        expected = reference_logits(model, x, 2)
        logits = model.bfloat16()(x, depth=2)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), expected, rtol=0, atol=0.05)


def test_output_does_not_depend_on_torchs_default_dtype():
    """The noise state is drawn in float32 whatever the default dtype: the same model, the same logits."""
    model = trained_like(ModelConfig(**ARCHITECTURES["input-adapter-noise-no-prelude-no-coda"]))
    x = torch.randint(0, 37, (2, 7))
    with torch.no_grad():
        expected = model(x, depth=2)
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = model(x, depth=2)
        finally:
            torch.set_default_dtype(before)
    assert torch.equal(got, expected)


def test_noise_state_lands_on_the_inputs_device():
    """The meta device (shapes only) stands in for an accelerator: the CPU-drawn noise must follow e."""
    model = LoopedTransformer(ModelConfig(**ARCHITECTURES["pre-gelu-concat"], init_state="noise")).to("meta")
    logits = model(torch.zeros(2, 7, dtype=torch.long, device="meta"), depth=2)
    assert logits.device.type == "meta" and logits.shape == (2, 7, 37)


def test_a_sequence_at_max_seq_len_runs_and_one_longer_is_refused():
    model = LoopedTransformer(ModelConfig(**ODD))
    assert model(torch.zeros(1, 9, dtype=torch.long), depth=1).shape == (1, 9, 37)
    with pytest.raises(InputError, match="sequence length 10 exceeds model.max_seq_len=9"):
        model(torch.zeros(1, 10, dtype=torch.long), depth=1)


# --- the configuration ----------------------------------------------------------------------


def test_config_accepts_every_boundary_value():
    smallest = ModelConfig(vocab_size=1, max_seq_len=1, d_model=2, n_heads=1, n_core=1, n_prelude=0, n_coda=0)
    assert smallest.d_ff == 0 and smallest.backprop_depth == 0
    ModelConfig(state_noise_std=0.0, init_std=1.0, norm_eps=1.0, d_model=24, n_heads=3)
    for name, allowed in {
        "mlp": ("gelu", "swiglu"),
        "norm": ("pre", "sandwich"),
        "injection": ("concat", "add"),
        "adapter_init": ("sum", "input"),
        "init_state": ("zeros", "noise"),
    }.items():
        for value in allowed:
            assert getattr(ModelConfig(**{name: value}), name) == value


@pytest.mark.parametrize(
    "changes, message",
    [
        *[(dict([(name, 0)]), f"model.{name} must be >= 1") for name in ("vocab_size", "max_seq_len", "d_model")],
        (dict(n_heads=0), "model.n_heads must be >= 1"),
        (dict(n_core=0), "model.n_core must be >= 1"),
        *[
            (dict([(name, -1)]), f"model.{name} must be >= 0")
            for name in ("n_prelude", "n_coda", "d_ff", "backprop_depth")
        ],
        (dict(d_model=30, n_heads=4), "must divide"),
        (dict(d_model=30, n_heads=2), "must be even"),
        *[
            (dict([(name, "other")]), f"model.{name} must be one of")
            for name in ("mlp", "norm", "injection", "adapter_init", "init_state")
        ],
        (dict(state_noise_std=-0.5), "state_noise_std"),
        (dict(init_std=0.0), "init_std"),
        (dict(norm_eps=0.0), "norm_eps"),
    ],
)
def test_config_refuses_one_past_each_boundary(changes, message):
    with pytest.raises(InputError, match=message):
        ModelConfig(**changes)


def test_config_round_trips_through_a_dict_and_names_unknown_keys():
    config = ModelConfig(**ARCHITECTURES["sandwich-swiglu-add-noise-tied"])
    values = config.to_dict()
    assert values["d_model"] == 24 and values["mlp"] == "swiglu" and values["tie_embeddings"] is True
    assert ModelConfig.from_dict(values) == config
    assert ModelConfig.from_dict({"d_model": 24, "n_heads": 3}) == ModelConfig(d_model=24, n_heads=3)
    with pytest.raises(InputError, match="unknown model config keys: depth, width$"):
        ModelConfig.from_dict({"width": 3, "d_model": 24, "depth": 2})


def test_fp32_attention_on_the_cpu_is_the_fused_kernel(monkeypatch):
    """Only low precision takes the written-out form: fp32 calls the fused kernel in every block."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, kwargs))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    LoopedTransformer(ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=2))(
        torch.zeros(1, 8, dtype=torch.long), depth=2
    )
    assert seen == [(torch.float32, {"is_causal": True})] * (1 + 2 * 2 + 1)


def test_with_every_target_counted_the_coda_runs_as_whole_blocks():
    """Whole blocks are what compiled blocks have graphs for: the token-subset readout is only for
    targets that leave some tokens out."""
    model = trained_like(ModelConfig(**{**SMALL, "n_coda": 2}))
    x, y = torch.randint(0, 40, (2, 8)), torch.randint(0, 40, (2, 8))
    calls = []
    for block in model.coda:
        block.register_forward_hook(lambda module, args, out: calls.append(module))
    with torch.no_grad():
        model.nll_by_depth(x, y, [2, 1])
        assert calls == [model.coda[0], model.coda[1]] * 2
        calls.clear()
        model.nll_by_depth(x, y.masked_fill(torch.rand(2, 8) < 0.5, -1), [2, 1])
    assert calls == [model.coda[0]] * 2  # the last block split into attention, then the counted tokens' MLP


def test_compile_blocks_compiles_every_block_for_static_shapes(monkeypatch):
    # Static shapes: one graph per block shape, shared by every depth (the depth loop stays in Python). Whether
    # the compiled forward equals the eager one is tests/test_train_fast_paths.py's; here, what is asked of
    # torch.compile.
    model = LoopedTransformer(ModelConfig(vocab_size=64, max_seq_len=16, d_model=32, n_heads=2))
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: calls.append((self, kwargs)))
    model.compile_blocks()
    blocks = [*model.prelude, *model.core, *model.coda]
    assert [block for block, _ in calls] == blocks and len(blocks) == 4
    assert all(kwargs == {"dynamic": False} for _, kwargs in calls)


def test_rotary_keeps_a_bf16_input_in_bf16_with_tables_rounded_to_it():
    rotary = Rotary(8, 16)
    x = torch.randn(2, 16, 8).to(torch.bfloat16)
    out = rotary(x)
    assert out.dtype == torch.bfloat16
    cos, sin = rotary.cos.to(torch.bfloat16), rotary.sin.to(torch.bfloat16)
    swapped = torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    assert torch.equal(out, x * cos + swapped * sin)
