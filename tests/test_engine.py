"""compare_updates against a reference built by hand in this file: real backward
passes, `clip_grad_norm_` and `optimizer.step()` on deep copies, weights edited
directly, NLL from separate `model(x, depth=s)` calls."""

import copy
import math
import re
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr

import diag
from common.choices import RMS_MATCH_CHOICES
from common.errors import InputError
from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic
from diag.arithmetic.measures import global_cosine, global_rms, match_rms
from diag.arithmetic.model_checks import (
    PERTURBATION,
    BiasCorrectionWarning,
    UnchangedByDepthWarning,
    accepted_keywords,
    bias_correction_message,
    check_gradient_coverage,
    no_gradient_message,
    with_perturbed_weights,
)
from diag.arithmetic.random_streams import CRN_SEED, sequence_seed
from trainer.config import OptimConfig
from trainer.loss import clip_gradients_, training_loss
from trainer.model import LoopedTransformer, ModelConfig
from trainer.optim import build_optimizer
from trainer.scoring import nll_by_depth as scoring_nll_by_depth

# The test optimizers have taken a few steps, so compare_updates warns about Adam's bias
# correction throughout; the warning has its own test at the end.
pytestmark = pytest.mark.filterwarnings("ignore::diag.BiasCorrectionWarning")

VOCAB, SEQ = 48, 12
UPDATE_DEPTHS, SERVING = (2, 6), tuple(range(1, 9))
CLIP = 0.5


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = LoopedTransformer(
        ModelConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_heads=2, n_prelude=1, n_core=1, n_coda=1)
    )
    with torch.no_grad():
        # The identity initialisation ignores the state, which would make every depth alike.
        model.adapter.weight.normal_(0, 0.3)
    return model


def tokens(rows, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)


def train_loss(model, batch, depth_kwarg, depth):
    out = model(batch[:, :-1], **{depth_kwarg: depth})
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), ignore_index=-1)


def trained(model, optimizer, steps, depth_kwarg="depth"):
    for step in range(steps):
        train_loss(model, tokens(4, 1000 + step), depth_kwarg, 2 + step % 3).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def adamw_setup(steps=3, lr=1e-2):
    model = tiny_model()
    return trained(model, build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.1)), steps)


# --- the independent reference --------------------------------------------------------------


def reference_gradient(model, batch, depth, depth_kwarg, clip):
    """The training gradient at `depth`, clipped, by a real backward on a deep copy (zeros where a
    parameter gets none)."""
    m = copy.deepcopy(model)
    train_loss(m, batch, depth_kwarg, depth).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
    return {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in m.named_parameters()}


def zero_gradient(model):
    return {name: torch.zeros_like(p) for name, p in model.named_parameters()}


def reference_delta(model, optimizer, grads, dtype=torch.float32):
    """Delta(grads): torch's own `optimizer.step()` on deep copies of the model and the optimizer,
    every parameter and state tensor (but Adam's step count) converted to `dtype`."""
    m, opt = copy.deepcopy((model, optimizer))
    m.to(dtype)  # in place: the copied optimizer still holds these parameters
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step":
                state[key] = value.to(dtype)
    for name, p in m.named_parameters():
        p.grad = grads[name].to(dtype)
    opt.step()
    return {name: p.detach() - q.detach().to(dtype) for (name, p), q in zip(m.named_parameters(), model.parameters())}


ISOLATES = ("counterfactual", "none", "linear")
FD_STEP = 1e-6
"""The finite difference's step h: in float64 its truncation error (as h^2) is near 1e-7 of the linear
term on the test state (1e-5 at h = 1e-5), its rounding error (as 1e-16 / h) far below that."""


def reference_update(model, optimizer, grads, isolate):
    """u under `isolate`: Delta(g) - Delta(0), Delta(g), or d/de Delta(e g) at e = 0 as the central
    difference (Delta(h g) - Delta(-h g)) / 2h of real float64 steps (an AdamW's only)."""
    if isolate == "linear":
        # Where v = 0, Delta(e g) bends on the scale e ~ eps / |g|, far below any step float64 resolves.
        params = dict(model.named_parameters())
        assert all(bool((optimizer.state[params[n]]["exp_avg_sq"][g != 0] > 0).all()) for n, g in grads.items())
        plus, minus = (
            reference_delta(model, optimizer, {n: h * g.double() for n, g in grads.items()}, torch.float64)
            for h in (FD_STEP, -FD_STEP)
        )
        return {name: (plus[name] - minus[name]) / (2 * FD_STEP) for name in plus}
    delta = reference_delta(model, optimizer, grads)
    if isolate == "none":
        return delta
    delta0 = reference_delta(model, optimizer, zero_gradient(model))
    return {name: delta[name] - delta0[name] for name in delta}


def reference_nll(model, eval_tokens, depth_kwarg, serving):
    with torch.no_grad():
        return np.array([float(train_loss(model, eval_tokens, depth_kwarg, s)) for s in serving])


def reference_unit(
    model, optimizer, batch, eval_tokens, depths, serving, depth_kwarg="depth", clip=CLIP, isolate="counterfactual"
):
    updates = [
        reference_update(model, optimizer, reference_gradient(model, batch, depth, depth_kwarg, clip), isolate)
        for depth in depths
    ]

    def rms(u):
        return math.sqrt(sum(float((t.double() ** 2).sum()) for t in u.values()) / sum(t.numel() for t in u.values()))

    raw = [rms(u) for u in updates]
    nll = []
    for u, r in zip(updates, raw):
        updated = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in updated.named_parameters():
                p.add_(u[name] * (raw[0] / r))
        nll.append(reference_nll(updated, eval_tokens, depth_kwarg, serving))
    return np.stack(nll), raw, updates


# --- tests ----------------------------------------------------------------------------------


def test_unit_matches_hand_reference_at_every_serving_depth():
    model, opt = adamw_setup()
    batch, eval_tokens = tokens(4, 1), tokens(6, 2)
    ds = diag.compare_updates(
        model,
        opt,
        batch,
        eval_tokens,
        update_depths=UPDATE_DEPTHS,
        serving_depths=SERVING,
        grad_clip=CLIP,
        eval_batch_size=4,
    )
    nll, raw, updates = reference_unit(model, opt, batch, eval_tokens, UPDATE_DEPTHS, SERVING)
    np.testing.assert_allclose(ds.nll.values, nll, rtol=0, atol=2e-6)
    # The benefit is a difference of nearby NLLs: compare it on its own scale.
    assert np.abs(nll[0] - nll[1]).max() > 1e-4
    np.testing.assert_allclose(ds.benefit.values, nll[0] - nll[1], rtol=0, atol=3e-6)
    np.testing.assert_allclose(ds.nll_before.values, reference_nll(model, eval_tokens, "depth", SERVING), atol=2e-6)
    np.testing.assert_allclose(ds.update_rms.values, raw, rtol=1e-4)
    np.testing.assert_allclose(ds.rms_scale.values, [1.0, raw[0] / raw[1]], rtol=1e-4)
    names = list(updates[0])
    expected_cos = global_cosine([updates[0][n] for n in names], [updates[1][n] for n in names])
    assert abs(float(ds.update_cosine) - expected_cos) < 1e-4
    assert ds.attrs["isolate"] == "counterfactual" and ds.attrs["rms_match"] == "reference"
    assert ds.attrs["lr"] == pytest.approx(1e-2)


def seen_batch():
    """The first batch `trained` steps on: every embedding row it touches has Adam's v > 0, as the
    linear reference's finite difference needs (an unseen token's row has v = 0)."""
    return tokens(4, 1000)


# |engine - reference| <= atol + rtol |reference| per element. counterfactual and none: torch's own
# kernel on the same gradient, equal to the bit on the test state. linear: the jvp in fp32 against the
# float64 finite difference, measured within 1.5% of this allowance (1.4e-7 on elements up to 2.8).
UPDATE_TOLERANCE = {
    "counterfactual": {"rtol": 1e-4, "atol": 1e-7},
    "none": {"rtol": 1e-4, "atol": 1e-7},
    "linear": {"rtol": 1e-5, "atol": 1e-7},
}


@pytest.mark.parametrize("isolate", ISOLATES)
def test_updates_match_torch_steps_and_reference_rms_matching(isolate):
    model, opt = adamw_setup()
    batch = seen_batch()
    diagnostic = UpdateDiagnostic(
        model, opt, tokens(4, 4), DiagnosticOptions(update_depths=UPDATE_DEPTHS, grad_clip=CLIP, isolate=isolate)
    )
    names = diagnostic.stepped
    delta0 = reference_delta(model, opt, zero_gradient(model))
    for a, name in zip(diagnostic.delta0, names):
        assert torch.equal(a, delta0[name])
    updates = []
    for depth in UPDATE_DEPTHS:
        _, grads = diagnostic.gradient(batch, depth)
        u = diagnostic.update(grads)
        expected = reference_update(model, opt, reference_gradient(model, batch, depth, "depth", CLIP), isolate)
        for a, name in zip(u, names):
            torch.testing.assert_close(
                a, expected[name], check_dtype=False, **UPDATE_TOLERANCE[isolate], msg=lambda m, n=name: f"{n}: {m}"
            )
        updates.append(u)
    matched, scales = match_rms(updates, "reference")
    assert [global_rms(m) for m in matched] == pytest.approx([global_rms(updates[0])] * 2, rel=1e-6)
    assert scales[0] == 1.0


def test_each_isolation_matches_its_own_hand_reference_and_no_other():
    model, opt = adamw_setup()
    batch, eval_tokens = seen_batch(), tokens(6, 2)
    # Three steps of AdamW with weight decay: momentum and decay make Delta(0) far from 0, and a young
    # second moment makes Delta far from linear, so the three rules give three different units.
    references = {
        isolate: reference_unit(model, opt, batch, eval_tokens, UPDATE_DEPTHS, SERVING, isolate=isolate)
        for isolate in ISOLATES
    }
    # Measured worst errors over the three: NLL 5.6e-7 and benefit 7.2e-7 (fp32 evaluations summed in
    # another order), update RMS and RMS scale 5e-8 relative, cosine 2.2e-8 (linear; the others agree to
    # 1e-15): each tolerance is 14-45x its error.
    nll_atol, rms_rtol, cosine_atol = 1e-5, 1e-6, 1e-6
    for isolate, (nll, raw, updates) in references.items():
        ds = diag.compare_updates(
            model,
            opt,
            batch,
            eval_tokens,
            update_depths=UPDATE_DEPTHS,
            serving_depths=SERVING,
            isolate=isolate,
            grad_clip=CLIP,
            eval_batch_size=4,
        )
        assert ds.attrs["isolate"] == isolate
        np.testing.assert_allclose(ds.nll.values, nll, rtol=0, atol=nll_atol, err_msg=isolate)
        np.testing.assert_allclose(ds.benefit.values, nll[0] - nll[1], rtol=0, atol=nll_atol, err_msg=isolate)
        np.testing.assert_allclose(ds.update_rms.values, raw, rtol=rms_rtol, err_msg=isolate)
        np.testing.assert_allclose(ds.rms_scale.values, [1.0, raw[0] / raw[1]], rtol=rms_rtol, err_msg=isolate)
        names = list(updates[0])
        cosine = global_cosine([updates[0][n] for n in names], [updates[1][n] for n in names])
        assert float(ds.update_cosine) == pytest.approx(cosine, rel=0, abs=cosine_atol), isolate
        # Another rule's unit is far outside these tolerances (measured: NLL 0.035, benefit 0.013 apart).
        for other, (other_nll, _, _) in references.items():
            if other != isolate:
                assert np.abs(other_nll - nll).max() > 100 * nll_atol, (isolate, other)
                assert np.abs((other_nll[0] - other_nll[1]) - (nll[0] - nll[1])).max() > 100 * nll_atol


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gradient_is_the_training_loops_gradient_bitwise(precision):
    model, opt = adamw_setup()
    batch = tokens(4, 16)
    batch[0, -1] = -1  # an ignored target changes the loss's denominator
    diagnostic = UpdateDiagnostic(model, opt, tokens(2, 17), DiagnosticOptions(grad_clip=0.05, precision=precision))
    loss, grads = diagnostic.gradient(batch, 3)
    reference = copy.deepcopy(model)
    expected = training_loss(reference, batch, 3, precision=precision)
    expected.backward()
    norm = clip_gradients_([p.grad for p in reference.parameters() if p.requires_grad], 0.05)
    assert float(norm) > 0.05  # the clip is active
    assert loss == expected.item()
    named = dict(reference.named_parameters())
    for name, g in zip(diagnostic.stepped, grads):
        assert torch.equal(g, named[name].grad), name


def test_compare_updates_leaves_model_and_optimizer_bitwise_unchanged():
    model, opt = adamw_setup()
    params = list(model.parameters())
    params[0].grad = torch.randn_like(params[0])  # a stale gradient the user left must survive
    before_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    before_grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    before_buffers = {n: b.clone() for n, b in model.named_buffers()}
    before_opt = copy.deepcopy(opt.state_dict())
    for isolate in ("counterfactual", "none", "linear"):
        diag.compare_updates(
            model,
            opt,
            seen_batch(),  # linear refuses tokens whose embedding rows have v = 0
            tokens(4, 6),
            update_depths=UPDATE_DEPTHS,
            serving_depths=(1, 3),
            isolate=isolate,
            grad_clip=CLIP,
        )
    for n, p in model.named_parameters():
        assert torch.equal(p, before_params[n])
        assert (p.grad is None) == (before_grads[n] is None)
        if p.grad is not None:
            assert torch.equal(p.grad, before_grads[n])
    for n, b in model.named_buffers():
        assert torch.equal(b, before_buffers[n])
    after_opt = opt.state_dict()
    assert after_opt["param_groups"] == before_opt["param_groups"]
    for key, state in before_opt["state"].items():
        for name, value in state.items():
            assert torch.equal(after_opt["state"][key][name], value)


def test_more_than_two_update_depths_give_benefit_against_each():
    model, opt = adamw_setup()
    ds = diag.compare_updates(
        model, opt, tokens(4, 7), tokens(4, 8), update_depths=(2, 4, 6), serving_depths=(1, 2, 6), rms_match="geomean"
    )
    assert ds.benefit_all.dims == ("update_depth", "serving_depth")
    np.testing.assert_array_equal(ds.benefit_all.values, ds.nll.values[0] - ds.nll.values)
    np.testing.assert_array_equal(ds.benefit.values, ds.benefit_all.values[-1])
    matched_rms = ds.update_rms.values * ds.rms_scale.values
    np.testing.assert_allclose(matched_rms, np.exp(np.log(ds.update_rms.values).mean()), rtol=1e-9)
    assert ds.benefit.attrs["description"] == (
        "NLL after the update at depth 2 minus NLL after the update at depth 6; positive favours the depth-6 update"
    )
    two = diag.compare_updates(model, opt, tokens(4, 7), tokens(4, 8))
    assert "benefit_all" not in two and two.sizes == {"update_depth": 2, "serving_depth": 16}


def test_compare_updates_passes_its_evaluation_batch_size_on():
    model, opt = adamw_setup()
    args = (model, opt, tokens(4, 7), tokens(5, 8))
    kwargs = dict(update_depths=(1, 2), serving_depths=(1, 2))
    whole = diag.compare_updates(*args, **kwargs)
    one_by_one = diag.compare_updates(*args, eval_batch_size=1, **kwargs)
    np.testing.assert_allclose(one_by_one.nll.values, whole.nll.values, rtol=0, atol=1e-6)
    with pytest.raises(InputError, match="eval_batch_size must be >= 1, got 0"):
        diag.compare_updates(*args, eval_batch_size=0, **kwargs)


@dataclass
class Output:
    logits: torch.Tensor


class HuginnStyle(nn.Module):
    """Not this project's model: depth as `num_steps`, an output object, no nll_by_depth,
    a frozen parameter outside the graph, and a buffer written by every forward."""

    def __init__(self, d=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.core = nn.Sequential(nn.Linear(2 * d, d), nn.Tanh())
        self.head = nn.Linear(d, VOCAB)
        self.unused = nn.Parameter(torch.ones(3), requires_grad=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, input_ids, num_steps):
        e = self.embed(input_ids)
        state = torch.zeros_like(e)
        for _ in range(num_steps):
            state = self.core(torch.cat((state, e), dim=-1))
        self.calls += 1
        return Output(logits=self.head(state))


def test_huginn_style_model_runs_with_num_steps():
    torch.manual_seed(0)
    model = HuginnStyle()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    trained(model, opt, 2, depth_kwarg="num_steps")
    calls = int(model.calls)
    batch, eval_tokens = tokens(4, 9), tokens(5, 10)
    ds = diag.compare_updates(
        model,
        opt,
        batch,
        eval_tokens,
        update_depths=(1, 4),
        serving_depths=(1, 2, 4, 8),
        depth_kwarg="num_steps",
        grad_clip=CLIP,
        eval_batch_size=2,
    )
    assert int(model.calls) == calls
    nll, _, _ = reference_unit(model, opt, batch, eval_tokens, (1, 4), (1, 2, 4, 8), depth_kwarg="num_steps")
    np.testing.assert_allclose(ds.nll.values, nll, rtol=0, atol=2e-6)
    np.testing.assert_allclose(ds.benefit.values, nll[0] - nll[1], rtol=0, atol=3e-6)
    diagnostic = UpdateDiagnostic(model, opt, eval_tokens, DiagnosticOptions(depth_kwarg="num_steps"))
    _, grads = diagnostic.gradient(batch, 3)
    unused = grads[diagnostic.stepped.index("unused")]
    assert torch.equal(unused, torch.zeros(3))  # frozen: no gradient, and none asked for
    assert ds.attrs["random_forward"] == 0


def test_geomean_matching_runs_as_many_forwards_as_reference_matching():
    """Holding every update until all RMS are known costs memory, not forwards."""

    def forwards(rms_match):
        torch.manual_seed(0)
        model = HuginnStyle()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        calls = []
        model.register_forward_hook(lambda *_: calls.append(1))
        diag.compare_updates(
            model,
            opt,
            tokens(4, 9),
            tokens(5, 10),
            update_depths=(1, 3),
            serving_depths=(1, 2),
            depth_kwarg="num_steps",
            rms_match=rms_match,
        )
        return len(calls)

    assert forwards("geomean") == forwards("reference") > 0


def test_trainable_parameters_without_a_gradient_are_refused_naming_them():
    torch.manual_seed(0)
    model = HuginnStyle()
    model.unused.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diagnostic = UpdateDiagnostic(model, opt, tokens(5, 10), DiagnosticOptions(depth_kwarg="num_steps"))
    with pytest.raises(
        InputError,
        match=r"^1 of 6 trainable parameters get no gradient at update depth 3 \(unused\); they get none at depth 1 "
        r"either: the loss never reaches them .*; freeze them \(requires_grad=False\)",
    ):
        diagnostic.gradient(tokens(4, 9), 3)


class NoGradLoop(HuginnStyle):
    """Runs all but the last iteration without gradient, as a Huginn-convention forward does
    for an integer num_steps, so the embedding gets no gradient beyond depth 1."""

    def forward(self, input_ids, num_steps):
        e = self.embed(input_ids)
        with torch.no_grad():
            state = torch.zeros_like(e)
            for _ in range(num_steps - 1):
                state = self.core(torch.cat((state, e), dim=-1))
        state = self.core(torch.cat((state, e.detach() if num_steps > 1 else e), dim=-1))
        return Output(logits=self.head(state))


@pytest.mark.parametrize("deep", [2, 4])
def test_a_loop_run_without_gradient_is_refused_not_filled_with_zeros(deep):
    torch.manual_seed(0)
    model = NoGradLoop()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fix = (
        "they get one at depth 1: only the last iterations of the forward carry gradient (backprop truncated by "
        "the forward itself) and they act only in earlier ones; if the model trains so, say how many iterations "
        "carry gradient in its family, ModelFamily(..., depth_kwarg='num_steps', backprop_depth=k) without "
        "pair_depth, and beyond depth k they get the zero gradient training gives them (docs/diagnostic.md)"
    )
    with pytest.raises(
        InputError, match=rf"^1 of \d+ trainable parameters get no gradient at update depth {deep} \(embed\); "
    ) as refused:
        diag.compare_updates(
            model,
            opt,
            tokens(4, 9),
            tokens(5, 10),
            update_depths=(1, deep),
            serving_depths=(1, deep),
            depth_kwarg="num_steps",
        )
    assert str(refused.value).endswith(f"; {fix}")


class SwallowsKeywords(HuginnStyle):
    """A Hugging Face style forward: unknown keywords disappear into **kwargs."""

    def forward(self, input_ids, num_steps=2, **kwargs):
        return super().forward(input_ids, num_steps)


def test_a_depth_keyword_the_forward_ignores_is_refused():
    torch.manual_seed(0)
    model = SwallowsKeywords()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(
        InputError,
        match=r"depth_kwarg='depth': SwallowsKeywords's output is the same at depth=1 and 4, and stays the same "
        r"with every weight perturbed, so the keyword does not set its depth .*accepts num_steps, \*\*kwargs",
    ):
        diag.compare_updates(model, opt, tokens(4, 9), tokens(5, 10), update_depths=(1, 4), serving_depths=(1, 2))
    ds = diag.compare_updates(
        model, opt, tokens(4, 9), tokens(5, 10), update_depths=(1, 4), serving_depths=(1, 2), depth_kwarg="num_steps"
    )
    assert ds.sizes["serving_depth"] == 2


class AtLeastTwoIterations(HuginnStyle):
    """A loop of at least two iterations: depths 1 and 2 give the same output, deeper ones do not."""

    def forward(self, input_ids, num_steps):
        return super().forward(input_ids, max(num_steps, 2))


def test_the_depth_keyword_is_probed_at_the_deepest_depth_asked_for():
    """Depths 1, 2 and 4 asked for: the probe compares 1 with 4, where the output changes, not
    1 with 2, where it does not."""
    torch.manual_seed(0)
    model = AtLeastTwoIterations()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnchangedByDepthWarning)
        ds = diag.compare_updates(
            model,
            opt,
            tokens(4, 9),
            tokens(5, 10),
            update_depths=(1, 4),
            serving_depths=(1, 2),
            depth_kwarg="num_steps",
        )
    assert ds.sizes["serving_depth"] == 2


class RandomStart(HuginnStyle):
    """Draws its initial state from the global RNG on every forward, as Huginn does."""

    def forward(self, input_ids, num_steps):
        e = self.embed(input_ids)
        state = torch.randn_like(e)
        for _ in range(num_steps):
            state = self.core(torch.cat((state, e), dim=-1))
        return Output(logits=self.head(state))


def test_a_random_forward_is_reproducible_and_leaves_the_callers_rng_alone():
    torch.manual_seed(0)
    model = RandomStart()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trained(model, opt, 3, depth_kwarg="num_steps")
    batch, eval_tokens = tokens(4, 9), tokens(5, 10)
    results = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        results.append(
            diag.compare_updates(
                model, opt, batch, eval_tokens, update_depths=(1, 4), serving_depths=(1, 4), depth_kwarg="num_steps"
            )
        )
        assert torch.equal(torch.get_rng_state(), before)  # the caller's stream goes on where it was
    xr.testing.assert_identical(results[0], results[1])
    assert results[0].attrs["random_forward"] == 1


def test_a_random_forwards_numbers_do_not_depend_on_the_depths_asked_for_or_the_evaluation_batch_size():
    """Each (sequence, depth) draws its own noise: the benefit at depth 8 is the same whether 8 is
    asked for alone or after 1-7, and whether the 12 rows go in chunks of 12 or of 5."""
    torch.manual_seed(0)
    model = RandomStart()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trained(model, opt, 3, depth_kwarg="num_steps")
    batch, eval_tokens = tokens(4, 9), tokens(12, 10)

    def unit(serving_depths, eval_batch_size):
        return diag.compare_updates(
            model,
            opt,
            batch,
            eval_tokens,
            update_depths=(2, 6),
            serving_depths=serving_depths,
            depth_kwarg="num_steps",
            eval_batch_size=eval_batch_size,
        )

    every_depth = unit(range(1, 9), 12)
    for other in (unit((8,), 12), unit(range(1, 9), 5), unit((3, 8), 1)):
        for name in ("nll", "nll_before", "benefit"):
            np.testing.assert_array_equal(
                other[name].sel(serving_depth=8).values, every_depth[name].sel(serving_depth=8).values, err_msg=name
            )
    assert every_depth.attrs["random_forward"] == 1
    assert np.abs(every_depth.benefit.values).max() > 1e-4  # the depths' updates differ measurably


class ZeroInitResidual(nn.Module):
    """A looped model as freshly initialised: every iteration adds a residual branch whose output
    projection is zero, so the state, and the output, are the same at every depth."""

    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.inner = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, num_steps):
        state = self.embed(input_ids)
        for _ in range(num_steps):
            state = state + self.out(torch.tanh(self.inner(state)))
        return self.head(state)


def test_a_model_that_does_not_use_its_depth_yet_is_diagnosed_with_a_warning():
    torch.manual_seed(0)
    model = ZeroInitResidual()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(
        UnchangedByDepthWarning,
        match=r"^ZeroInitResidual's output is the same at num_steps=1 and 4 at these weights, though num_steps sets "
        r"its depth \(with the weights perturbed the output changes with it\): the model does not use its depth "
        r"yet \(e\.g\. zero-initialised output projections\), so it scores alike at every serving depth before "
        r"the update$",
    ):
        ds = diag.compare_updates(
            model,
            opt,
            tokens(4, 9),
            tokens(5, 10),
            update_depths=(1, 4),
            serving_depths=(1, 4),
            depth_kwarg="num_steps",
        )
    assert ds.nll_before.values[0] == ds.nll_before.values[1]  # alike before the update
    assert ds.nll.values[1, 0] != ds.nll.values[1, 1]  # the update makes the depths differ


def test_the_perturbation_adds_a_tenth_of_each_tensors_rms_in_noise_of_its_own_stream():
    """The weights the depth keyword is probed with: each floating tensor plus noise of 0.1 times
    its RMS (at least 0.1), drawn in float32 from a generator of its own in the tensors' order,
    in the tensor's own dtype; integer tensors and the caller's random stream untouched."""
    params = {
        "weight": torch.randn(3, 4, dtype=torch.float64),
        "zeros": torch.zeros(5),
        "empty": torch.zeros(0),
        "steps": torch.arange(3),
        "half": torch.randn(6).bfloat16(),
    }
    torch.manual_seed(1)
    caller_stream = torch.get_rng_state()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the noise is float32 whatever the default
    try:
        perturbed = with_perturbed_weights(params)
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(torch.get_rng_state(), caller_stream)
    generator = torch.Generator().manual_seed(CRN_SEED)
    for name, value in params.items():
        if not value.is_floating_point():
            assert perturbed[name] is value
            continue
        rms = value.double().square().mean().sqrt().item() if value.numel() else 0.0
        noise = torch.randn(value.shape, generator=generator, dtype=torch.float32)
        expected = value + (PERTURBATION * max(rms, PERTURBATION) * noise).to(value.dtype)
        assert perturbed[name].dtype == value.dtype and torch.equal(perturbed[name], expected), name
    assert not torch.equal(perturbed["zeros"], params["zeros"])  # a tensor of zeros moves too


def test_a_gradient_that_misses_parameters_names_their_first_four_modules():
    missing = ["a.w", "a.b", "b.w", "c", "d.e.w", "f.w"]
    assert no_gradient_message(missing, 10, 3, "the fix") == (
        "6 of 10 trainable parameters get no gradient at update depth 3 (a, b, c, d.e and 1 more); the fix"
    )
    assert "(a, b, c, d.e); " in no_gradient_message(missing[:5], 10, 3, "the fix")
    with pytest.raises(InputError, match=r"^1 of 2 trainable parameters get no gradient at update depth 4 \(y\)"):
        check_gradient_coverage(["x.w", "y"], [torch.zeros(1), None], 4)
    check_gradient_coverage(["x.w", "y"], [torch.zeros(1), torch.zeros(1)], 4)  # every one reached: nothing to say


def test_each_evaluation_sequence_has_its_own_stream_from_the_projects_seeding_recipe():
    """Sequence i's seed is the first 63-bit draw of numpy's PCG64 seeded with [CRN_SEED, i]
    (trainer/rng.py's recipe), so another implementation can replay a random forward's noise."""
    seeds = [sequence_seed(index) for index in range(64)]
    assert seeds[:3] == [int(np.random.Generator(np.random.PCG64([CRN_SEED, i])).integers(2**63)) for i in range(3)]
    assert len(set(seeds)) == 64 and max(seeds) > 2**62 and min(seeds) >= 0


def test_a_forward_without_a_readable_signature_is_named_as_such():
    model = nn.Module()
    model.forward = torch.relu  # a C function: inspect.signature cannot read it
    assert accepted_keywords(model) == "its keywords are not readable"


def test_evaluation_weights_chunks_by_token_count():
    model, opt = adamw_setup(steps=1)
    eval_tokens = tokens(7, 11)
    eval_tokens[[1, 4, 5], -1] = -1  # ignored targets make chunks unequal in token count
    diagnostic = UpdateDiagnostic(model, opt, eval_tokens, DiagnosticOptions(serving_depths=(1, 3), eval_batch_size=3))
    np.testing.assert_allclose(diagnostic.nll_before, reference_nll(model, eval_tokens, "depth", (1, 3)), atol=2e-6)
    assert diagnostic.nll_before.dtype == np.float64


def test_fresh_adamw_counterfactual_updates_are_lr_sign_like():
    model = tiny_model()
    opt = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1))
    diagnostic = UpdateDiagnostic(model, opt, tokens(2, 12))
    _, grads = diagnostic.gradient(tokens(4, 13), 2)
    for u, g in zip(diagnostic.update(grads), grads):
        torch.testing.assert_close(u, -1e-3 * g / (g.abs() + 1e-8), rtol=1e-4, atol=2e-7)


def test_linear_isolation_and_bf16_gradients_run():
    model, opt = adamw_setup()
    ds = diag.compare_updates(
        model,
        opt,
        seen_batch(),
        tokens(4, 15),
        update_depths=UPDATE_DEPTHS,
        serving_depths=(1, 2),
        isolate="linear",
        rms_match="per-tensor",
        precision="bf16",
    )
    assert np.isfinite(ds.nll.values).all() and ds.attrs["isolate"] == "linear"


def test_match_rms_modes():
    gen = torch.Generator().manual_seed(0)
    updates = [[torch.randn(4, 3, generator=gen) * s, torch.randn(5, generator=gen) * 2 * s] for s in (1.0, 3.0, 0.5)]
    rms = [global_rms(u) for u in updates]
    for u, r in zip(updates, rms):
        assert r == pytest.approx(math.sqrt(sum(float((t**2).sum()) for t in u) / 17))
    matched, scales = match_rms(updates, "reference")
    assert [global_rms(m) for m in matched] == pytest.approx([rms[0]] * 3)
    matched, _ = match_rms(updates, "geomean")
    assert [global_rms(m) for m in matched] == pytest.approx([math.prod(rms) ** (1 / 3)] * 3)
    matched, scales = match_rms(updates, "none")
    assert scales == [1.0] * 3 and all(torch.equal(a, b) for a, b in zip(matched[1], updates[1]))
    matched, scales = match_rms(updates, "per-tensor")
    for m in matched:
        assert [global_rms([t]) for t in m] == pytest.approx([global_rms([t]) for t in updates[0]])
    assert scales == pytest.approx([global_rms(m) / r for m, r in zip(matched, rms)])
    # An exactly zero update cannot be scaled; it stays zero instead of becoming NaN.
    zero = [[torch.zeros(3)], [torch.ones(3)]]
    assert match_rms(zero[::-1], "reference")[1] == [1.0, 1.0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"update_depths": (4,)}, "at least two"),
        ({"update_depths": (4, 4)}, "repeat"),
        ({"serving_depths": (0, 1)}, "positive"),
        ({"isolate": "partial"}, "isolate"),
        ({"rms_match": "max"}, "rms_match"),
        ({"lr": -1.0}, "lr"),
    ],
)
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiagnosticOptions(**kwargs)


class WithDropout(nn.Module):
    """A model with dropout on its output: random in training mode, deterministic in eval mode."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.dropout = nn.Dropout(0.5)

    def forward(self, input_ids, depth):
        return self.dropout(self.inner(input_ids, depth=depth))


def test_evaluation_runs_in_eval_mode_and_modes_are_restored():
    model = WithDropout(tiny_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    model.inner.eval()  # a mixed state, which must come back as it was
    batch, eval_tokens = tokens(4, 9), tokens(3, 10)
    first = diag.compare_updates(model, opt, batch, eval_tokens, update_depths=(1, 3), serving_depths=(1, 2))
    second = diag.compare_updates(model, opt, batch, eval_tokens, update_depths=(1, 3), serving_depths=(1, 2))
    # Dropout left on during evaluation would make the two NLLs differ.
    np.testing.assert_array_equal(first.nll_before.values, second.nll_before.values)
    with torch.no_grad():
        model.eval()
        expected = [train_loss(model, eval_tokens, "depth", s).item() for s in (1, 2)]
        model.train()
        model.inner.eval()
    np.testing.assert_allclose(first.nll_before.values, expected, rtol=1e-6)
    assert model.training and model.dropout.training and not model.inner.training


def test_eval_mask_counts_only_the_marked_targets():
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=40, max_seq_len=10, d_model=16, n_heads=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch, eval_tokens = torch.randint(0, 40, (3, 11)), torch.randint(0, 40, (5, 11))
    mask = torch.rand(5, 10) < 0.4
    ds = diag.compare_updates(
        model,
        optimizer,
        batch,
        eval_tokens,
        update_depths=(1, 3),
        serving_depths=(1, 2, 4),
        eval_mask=mask,
        eval_batch_size=2,
    )
    with torch.no_grad():
        for i, s in enumerate((1, 2, 4)):
            logits = model(eval_tokens[:, :-1], depth=s)
            expected = F.cross_entropy(logits[mask].double(), eval_tokens[:, 1:][mask])
            assert ds["nll_before"].values[i] == pytest.approx(float(expected), rel=1e-6)
    with pytest.raises(ValueError, match="eval_mask"):
        diag.compare_updates(model, optimizer, batch, eval_tokens, eval_mask=mask[:, :5])


# --- bad input from the Python API: one sentence naming the fix -------------------------------


def test_a_depth_keyword_the_forward_does_not_take_names_the_ones_it_does():
    torch.manual_seed(0)
    model = HuginnStyle()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError) as caught:
        diag.compare_updates(model, opt, tokens(4, 1), tokens(4, 2), update_depths=(1, 2), serving_depths=(1,))
    message = str(caught.value)
    assert "depth_kwarg='depth'" in message and "takes no keyword 'depth'" in message
    assert "(it accepts num_steps)" in message and "depth_kwarg='num_steps'" in message
    assert isinstance(caught.value, ValueError) and "\n" not in message


class ReturnsTuple(nn.Module):
    """A forward that returns (logits, cache), as some codebases do without return_dict."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, depth):
        return self.inner(input_ids, depth=depth), None


@dataclass
class NoLogits:
    hidden: torch.Tensor


class ReturnsObject(ReturnsTuple):
    def forward(self, input_ids, depth):
        return NoLogits(self.inner(input_ids, depth=depth))


class ReturnsLogitsTuple(ReturnsTuple):
    def forward(self, input_ids, depth):
        return Output(logits=(self.inner(input_ids, depth=depth),))


class ReturnsLoss(ReturnsTuple):
    def forward(self, input_ids, depth):
        return self.inner(input_ids, depth=depth).mean(-1)  # [B, T]: not logits


@pytest.mark.parametrize(
    ("wrapper", "named"),
    [
        (ReturnsTuple, "returned a tuple, not a tensor of logits"),
        (ReturnsObject, "returned a NoLogits, not a tensor of logits"),
        (ReturnsLogitsTuple, "returned a Output whose .logits is a tuple, not a tensor of logits"),
        (ReturnsLoss, "shape [4, 12]"),
    ],
)
def test_an_output_that_is_not_logits_is_named(wrapper, named):
    model = wrapper(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match=re.escape(named)) as caught:
        diag.compare_updates(model, opt, tokens(4, 1), tokens(4, 2), update_depths=(1, 2), serving_depths=(1,))
    assert "\n" not in str(caught.value)


def test_token_ids_beyond_the_logits_name_both_numbers():
    model = tiny_model()  # VOCAB = 48 logits
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    foreign = tokens(4, 2)
    foreign[2, 5] = VOCAB + 11  # one id of a larger tokenizer: the embedding would fail on it first
    with pytest.raises(
        InputError, match=f"eval_tokens holds token id {VOCAB + 11} but the model's logits have {VOCAB}"
    ):
        diag.compare_updates(model, opt, tokens(4, 1), foreign, update_depths=(1, 2), serving_depths=(1,))
    with pytest.raises(InputError, match=f"batch holds token id {VOCAB + 11} but the model's logits have {VOCAB}"):
        diag.compare_updates(model, opt, foreign, tokens(4, 1), update_depths=(1, 2), serving_depths=(1,))
    # An id that is the last one the logits cover is fine.
    edge = tokens(4, 3)
    edge[0, 0] = VOCAB - 1
    diag.compare_updates(model, opt, edge, edge, update_depths=(1, 2), serving_depths=(1,))


def test_compare_updates_warns_while_adams_bias_correction_dominates():
    model = tiny_model()
    beta2 = 0.5  # 3 / (1 - beta2) = 6 steps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, beta2))
    args = (tokens(4, 1), tokens(4, 2))
    kwargs = dict(update_depths=(1, 2), serving_depths=(1,))
    with pytest.warns(BiasCorrectionWarning, match=r"taken 0 steps \(< 3 / \(1 - beta2\) = 6\)") as caught:
        diag.compare_updates(model, opt, *args, **kwargs)
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller's line
    trained(model, opt, 5)
    with pytest.warns(BiasCorrectionWarning, match="taken 5 steps"):
        diag.compare_updates(model, opt, *args, **kwargs)
    trained(model, opt, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BiasCorrectionWarning)
        diag.compare_updates(model, opt, *args, **kwargs)  # 6 steps: no warning
        diag.compare_updates(model, torch.optim.SGD(model.parameters(), lr=0.1), *args, **kwargs)


# --- the pure arithmetic against hand computation ---------------------------------------------


@pytest.mark.parametrize("rms_match", RMS_MATCH_CHOICES)
def test_streaming_compare_equals_every_update_held_and_matched_at_once(rms_match):
    """compare() evaluates and frees each update as soon as its scale is known; the result is the
    one of holding every update, scaling them all with match_rms and evaluating them, to the bit."""
    model, opt = adamw_setup()
    options = DiagnosticOptions(update_depths=(1, 3, 5), serving_depths=(1, 4), rms_match=rms_match)
    diagnostic = UpdateDiagnostic(model, opt, tokens(6, 2), options)
    batch = tokens(4, 3)
    ds = diagnostic.compare(batch)
    updates = [diagnostic.update(diagnostic.gradient(batch, depth)[1]) for depth in options.update_depths]
    matched, scales = match_rms(updates, rms_match)
    assert ds.rms_scale.values.tolist() == scales
    assert ds.update_cosine.item() == global_cosine(updates[0], updates[-1])
    np.testing.assert_array_equal(ds.nll.values, np.stack([diagnostic.evaluate(u) for u in matched]))


def test_match_rms_modes_against_hand_computation():
    # u0: RMS sqrt((4 * 0.1^2 + 12 * 0.3^2) / 16) = sqrt(0.07), per tensor 0.1 and 0.3; u1: RMS 0.1, its
    # second tensor zero; u2 exactly zero. Every update also holds an empty tensor. RMSs below one on purpose.
    u0 = [torch.full((4,), 0.1), torch.full((12,), 0.3), torch.zeros(0)]
    u1 = [torch.full((4,), -0.2), torch.zeros(12), torch.zeros(0)]
    u2 = [torch.zeros(4), torch.zeros(12), torch.zeros(0)]
    updates, r0, r1 = [u0, u1, u2], math.sqrt(0.07), 0.1

    def filled(matched):
        return [[(t.numel(), float(t[0]) if t.numel() else None) for t in u] for u in matched]

    def approx(values):
        return pytest.approx(values, rel=1e-6)

    matched, scales = match_rms(updates, "reference")
    assert scales == approx([1.0, r0 / r1, 1.0])
    assert filled(matched) == [
        [(4, approx(0.1)), (12, approx(0.3)), (0, None)],
        [(4, approx(-0.2 * r0 / r1)), (12, 0.0), (0, None)],
        [(4, 0.0), (12, 0.0), (0, None)],
    ]
    g = math.sqrt(r0 * r1)  # the geometric mean of the non-zero RMSs
    matched, scales = match_rms(updates, "geomean")
    assert scales == approx([g / r0, g / r1, 1.0])
    assert float(matched[1][0][0]) == approx(-0.2 * g / r1) and float(matched[0][1][0]) == approx(0.3 * g / r0)
    matched, scales = match_rms(updates, "none")
    assert scales == [1.0, 1.0, 1.0] and all(a is b for m, u in zip(matched, updates) for a, b in zip(m, u))
    # per-tensor: every tensor to the reference's RMS of that tensor; a zero tensor stays zero.
    matched, scales = match_rms(updates, "per-tensor")
    assert filled(matched) == [
        [(4, approx(0.1)), (12, approx(0.3)), (0, None)],
        [(4, approx(-0.1)), (12, 0.0), (0, None)],
        [(4, 0.0), (12, 0.0), (0, None)],
    ]
    assert scales == approx([1.0, math.sqrt(4 * 0.01 / 16) / r1, 1.0])
    for mode in ("reference", "geomean", "none", "per-tensor"):
        assert match_rms([[], []], mode) == ([[], []], [1.0, 1.0]), mode


def test_global_rms_and_cosine_against_hand_computation():
    assert global_rms([]) == 0.0 and global_rms([torch.zeros(0)]) == 0.0
    assert global_rms([torch.tensor([-3.0])]) == 3.0
    assert global_rms([torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])]) == pytest.approx(
        math.sqrt(25 / 6)
    )
    # Accumulated in float64: squares of fp32 entries near 1e20 would overflow in fp32.
    assert global_rms([torch.full((4,), 1e20)]) == pytest.approx(1e20, rel=1e-6)
    a = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0]])]  # |a| = 5
    b = [torch.tensor([1.0, 1.0]), torch.tensor([[2.0, 0.0]])]  # |b| = sqrt(6), <a, b> = 3
    assert global_cosine(a, b) == pytest.approx(3 / (5 * math.sqrt(6)), rel=1e-12)
    zero = [torch.zeros(2), torch.zeros(1, 2)]
    assert math.isnan(global_cosine(a, zero)) and math.isnan(global_cosine(zero, b))


# --- options and input checks -----------------------------------------------------------------


def test_options_accept_every_boundary_value():
    options = DiagnosticOptions(
        update_depths=[np.int64(1), 2], serving_depths=(1,), lr=1e-3, grad_clip=0.0, eval_batch_size=1, precision="bf16"
    )
    assert options.update_depths == (1, 2) and all(type(d) is int for d in options.update_depths)
    assert DiagnosticOptions(grad_clip=0.5, depth_kwarg="num_steps").grad_clip == 0.5
    for isolate in ("counterfactual", "linear", "none"):
        DiagnosticOptions(isolate=isolate)
    for mode in ("reference", "geomean", "per-tensor", "none"):
        DiagnosticOptions(rms_match=mode)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"update_depths": (4, True)}, "update_depths must be positive integers, got True"),
        ({"update_depths": (4, 2.0)}, "update_depths must be positive integers, got 2.0"),
        ({"serving_depths": (1, 2, 1)}, r"serving_depths must not repeat a depth, got \[1, 2, 1\]"),
        ({"serving_depths": ()}, "serving_depths must not be empty"),
        ({"depth_kwarg": "num steps"}, "depth_kwarg must be a keyword name"),
        ({"lr": 0.0}, "lr must be a positive number"),
        ({"lr": math.inf}, "lr must be a positive number"),
        ({"lr": math.nan}, "lr must be a positive number"),
        ({"grad_clip": -0.1}, "grad_clip must be >= 0"),
        ({"grad_clip": math.nan}, "grad_clip must be >= 0"),
        ({"precision": "fp16"}, "precision must be one of"),
        ({"eval_batch_size": 0}, "eval_batch_size must be >= 1"),
    ],
)
def test_options_refuse_one_past_each_boundary(kwargs, match):
    with pytest.raises(InputError, match=match):
        DiagnosticOptions(**kwargs)


def sgd_diagnostic(eval_tokens=None, model=None, eval_mask=None, **options):
    model = tiny_model() if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eval_tokens = tokens(3, 2) if eval_tokens is None else eval_tokens
    options = DiagnosticOptions(update_depths=(1, 2), **options)
    return UpdateDiagnostic(model, optimizer, eval_tokens, options, eval_mask=eval_mask)


@pytest.mark.parametrize(
    "bad, shown",
    [
        (torch.zeros(5, dtype=torch.long), r"got \(5,\)"),
        (torch.zeros(2, 3, 4, dtype=torch.long), r"got \(2, 3, 4\)"),
        (torch.zeros(3, 1, dtype=torch.long), r"got \(3, 1\)"),
        ([[1, 2, 3]], "got list"),
    ],
)
def test_token_tensors_of_the_wrong_shape_are_named(bad, shown):
    diagnostic = sgd_diagnostic()
    with pytest.raises(InputError, match=r"batch must be an integer tensor \[rows, T\+1\] with T >= 1, " + shown):
        diagnostic.check_batch(bad)
    with pytest.raises(InputError, match=r"eval_tokens must be an integer tensor \[rows, T\+1\] with T >= 1, " + shown):
        sgd_diagnostic(eval_tokens=bad)


def test_token_ids_are_integers_below_the_vocabulary():
    diagnostic = sgd_diagnostic()
    assert diagnostic.check_batch(torch.ones(2, 2, dtype=torch.int32)).dtype == torch.int64  # T = 1 is enough
    with pytest.raises(InputError, match="batch must hold integer token ids, got torch.float32"):
        diagnostic.check_batch(tokens(2, 3).float())
    edge = tokens(2, 3)
    edge[1, 2] = VOCAB  # one past the last id the logits cover
    with pytest.raises(InputError, match=f"batch holds token id {VOCAB} but the model's logits have {VOCAB} entries"):
        diagnostic.check_batch(edge)


def test_an_evaluation_set_without_a_counted_target_is_named_as_such():
    with pytest.raises(InputError, match="the evaluation set has no counted target"):
        sgd_diagnostic(eval_tokens=torch.zeros(0, SEQ + 1, dtype=torch.long))
    with pytest.raises(InputError, match="the evaluation set has no counted target"):
        sgd_diagnostic(eval_mask=torch.zeros(3, SEQ, dtype=torch.bool))
    # Even for a one-token vocabulary an empty set is empty, not an unknown token id.
    one_token = LoopedTransformer(ModelConfig(vocab_size=1, max_seq_len=4, d_model=8, n_heads=2))
    with pytest.raises(InputError, match="no counted target"):
        sgd_diagnostic(eval_tokens=torch.zeros(0, 5, dtype=torch.long), model=one_token)
    # One counted target is enough.
    only_one = torch.zeros(3, SEQ, dtype=torch.bool)
    only_one[1, 4] = True
    assert sgd_diagnostic(eval_mask=only_one, serving_depths=(1,)).nll_before.shape == (1,)


@pytest.mark.parametrize(
    "bad", [np.ones((3, SEQ), dtype=bool), torch.ones(3, SEQ), torch.ones(3, SEQ - 1, dtype=torch.bool)]
)
def test_an_eval_mask_that_is_not_a_bool_tensor_of_the_targets_shape_is_refused(bad):
    with pytest.raises(InputError, match=r"eval_mask must be a bool tensor of the targets' shape \[3, 12\]"):
        sgd_diagnostic(eval_mask=bad)


class KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, *, num_steps, cache=None):
        raise AssertionError("never called: the keyword check comes first")


class InputThenKeywordOnly(KeywordOnly):
    def forward(self, input_ids, *, num_steps):
        raise AssertionError


class TwoKeywords(KeywordOnly):
    def forward(self, input_ids, num_steps, cache=None):
        raise AssertionError


class InputOnly(KeywordOnly):
    def forward(self, input_ids):
        raise AssertionError


class NoArguments(KeywordOnly):
    def forward(self):
        raise AssertionError


@pytest.mark.parametrize(
    "model, accepted",
    [
        (KeywordOnly(), "(it accepts num_steps, cache)"),
        (InputThenKeywordOnly(), "(it accepts num_steps)"),
        (TwoKeywords(), "(it accepts num_steps, cache)"),
        (InputOnly(), "(it accepts no keyword besides the input)"),
        (NoArguments(), "(it accepts no keyword besides the input)"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_the_keywords_a_forward_accepts_are_listed_without_the_input(model, accepted):
    with pytest.raises(InputError) as caught:
        UpdateDiagnostic(model, torch.optim.SGD(model.parameters(), lr=0.1), tokens(2, 1))
    assert f"{type(model).__name__}.forward takes no keyword 'depth' {accepted}; depth_kwarg names" in str(caught.value)


def test_bias_correction_message_until_three_over_one_minus_beta2_steps():
    model = nn.Linear(3, 2)
    assert bias_correction_message(torch.optim.SGD(model.parameters(), lr=0.1)) is None
    # Group 0's beta2 sets the bound (0.5: 3 / (1 - 0.5) = 6 steps); group 1's would ask for 3000.
    optimizer = torch.optim.Adam(
        [{"params": [model.weight], "betas": (0.9, 0.5)}, {"params": [model.bias], "betas": (0.9, 0.999)}], lr=1e-3
    )
    assert bias_correction_message(optimizer) == (
        "the optimizer has taken 0 steps (< 3 / (1 - beta2) = 6), so Adam's bias correction makes its updates "
        "sign-like and the diagnostic reflects normalisation more than curvature; diagnose a state from later "
        "in training (docs/diagnostic.md)"
    )
    for step in range(1, 7):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        message = bias_correction_message(optimizer)
        if step < 6:
            assert f"has taken {step} steps (< 3 / (1 - beta2) = 6)" in message
    assert message is None


def test_compare_updates_warns_once_for_a_young_adam_and_not_for_a_mature_one():
    """The warning itself (its caller-facing line has its own test, which mutmut's extra frame breaks)."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.5))
    args, kwargs = (model, optimizer, tokens(4, 1), tokens(4, 2)), dict(update_depths=(1, 2), serving_depths=(1,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        diag.compare_updates(*args, **kwargs)
    assert [w.category for w in caught] == [BiasCorrectionWarning]
    assert str(caught[0].message).startswith("the optimizer has taken 0 steps (< 3 / (1 - beta2) = 6)")
    trained(model, optimizer, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diag.compare_updates(*args, **kwargs)


# --- what the diagnostic holds, runs and returns ----------------------------------------------


def test_unit_dataset_names_its_axes_settings_and_groups():
    model = tiny_model()
    core = [p for n, p in model.named_parameters() if n.startswith("core.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("core.")]
    optimizer = torch.optim.SGD([{"params": rest, "lr": 0.1}, {"params": core, "lr": 0.02}], momentum=0.9)
    ds = diag.compare_updates(
        model, optimizer, tokens(4, 1), tokens(4, 2), update_depths=(3, 1), serving_depths=(2, 5), precision="bf16"
    )
    assert ds.update_depth.values.tolist() == [3, 1] and ds.serving_depth.values.tolist() == [2, 5]
    assert {name: ds[name].dims for name in ds.data_vars} == {
        "nll": ("update_depth", "serving_depth"),
        "nll_before": ("serving_depth",),
        "benefit": ("serving_depth",),
        "update_rms": ("update_depth",),
        "rms_scale": ("update_depth",),
        "update_cosine": (),
        "train_loss": ("update_depth",),
    }
    assert all(ds[name].dtype == np.float64 for name in ds.data_vars)
    assert ds.attrs == {
        "isolate": "counterfactual",
        "rms_match": "reference",
        "lr": 0.1,
        "optimizer": "SGD",
        "grad_clip": 0.0,
        "precision": "bf16",
        "random_forward": 0,
        "group_lrs": "[0.1, 0.02]",
    }
    assert ds.benefit.attrs["description"] == (
        "NLL after the update at depth 3 minus NLL after the update at depth 1; positive favours the depth-1 update"
    )
    one_group = diag.compare_updates(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tokens(4, 1),
        tokens(4, 2),
        update_depths=(1, 2),
        serving_depths=(1,),
        grad_clip=0.5,
    )
    assert one_group.attrs["grad_clip"] == 0.5 and "group_lrs" not in one_group.attrs


def test_three_update_depths_compare_cosine_and_benefit_of_first_and_last():
    model, opt = adamw_setup()
    batch, eval_tokens, depths = seen_batch(), tokens(4, 2), (2, 4, 6)
    ds = diag.compare_updates(
        model, opt, batch, eval_tokens, update_depths=depths, serving_depths=(1, 6), grad_clip=CLIP
    )
    nll, _, updates = reference_unit(model, opt, batch, eval_tokens, depths, (1, 6))
    first, last = (
        np.concatenate([u[n].double().flatten().numpy() for n in updates[0]]) for u in (updates[0], updates[-1])
    )
    cosine = first @ last / (np.linalg.norm(first) * np.linalg.norm(last))
    middle = np.concatenate([updates[1][n].double().flatten().numpy() for n in updates[0]])
    assert abs(cosine - first @ middle / (np.linalg.norm(first) * np.linalg.norm(middle))) > 1e-3  # the pair matters
    assert float(ds.update_cosine) == pytest.approx(cosine, abs=1e-6)
    np.testing.assert_allclose(ds.benefit.values, nll[0] - nll[-1], rtol=0, atol=1e-5)


def test_a_partly_frozen_model_updates_only_what_the_optimizer_steps():
    """A frozen embedding outside the optimizer and a frozen parameter inside it: the unit is the hand
    reference's, the frozen ones never move, and later edits of the model are not seen (a snapshot)."""
    model = tiny_model()
    model.embed.weight.requires_grad_(False)
    model.head.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "embed.weight"], lr=1e-2)
    trained(model, optimizer, 2)
    batch, eval_tokens = tokens(4, 1), tokens(4, 2)
    nll, _, _ = reference_unit(model, optimizer, batch, eval_tokens, (1, 3), (1, 2))
    nll_before = reference_nll(model, eval_tokens, "depth", (1, 2))
    diagnostic = UpdateDiagnostic(
        model, optimizer, eval_tokens, DiagnosticOptions(update_depths=(1, 3), serving_depths=(1, 2), grad_clip=CLIP)
    )
    # The optimizer's fp32 clones are the diagnostic's theta, not a second copy.
    assert all(diagnostic.theta[n] is t for n, t in zip(diagnostic.stepped, diagnostic.step.theta))
    with torch.no_grad():
        model.embed.weight.add_(1.0)  # after the snapshot: must not be seen
    np.testing.assert_allclose(diagnostic.nll_before, nll_before, rtol=0, atol=2e-6)
    _, grads = diagnostic.gradient(batch, 1)
    assert "embed.weight" not in diagnostic.stepped
    assert torch.equal(grads[diagnostic.stepped.index("head.weight")], torch.zeros(VOCAB, 32))
    ds = diagnostic.compare(batch)
    np.testing.assert_allclose(ds.nll.values, nll, rtol=0, atol=2e-6)


def test_a_bf16_model_is_diagnosed_in_fp32():
    model = tiny_model()
    reference = copy.deepcopy(model)
    model.bfloat16()
    optimizer = torch.optim.SGD([p for n, p in model.named_parameters() if n.startswith("core.")], lr=0.1)
    diagnostic = UpdateDiagnostic(
        model, optimizer, tokens(4, 2), DiagnosticOptions(update_depths=(1, 2), serving_depths=(1, 3))
    )
    assert all(t.dtype == torch.float32 for t in diagnostic.theta.values())
    reference.load_state_dict({n: t.float() for n, t in model.state_dict().items()})
    np.testing.assert_allclose(
        diagnostic.nll_before, reference_nll(reference, tokens(4, 2), "depth", (1, 3)), atol=2e-6
    )


class Recording(nn.Module):
    """Records (input shape, training mode) of every forward of a wrapped model."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []

    def forward(self, input_ids, depth):
        self.calls.append((tuple(input_ids.shape), self.training))
        return self.inner(input_ids, depth=depth)


def test_forwards_run_in_their_modes_and_evaluation_chunks_of_32_rows_by_default():
    """The probe: one evaluation chunk's shape at the shallowest and the deepest depth, eval mode.
    Gradients: training mode. Evaluations: eval mode, chunks of 32 rows (the default), with the
    counted targets read once, not per evaluation; each update is evaluated right after its
    gradient (streaming), theta itself last."""
    model = Recording(tiny_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eval_tokens = tokens(33, 2)
    diagnostic = UpdateDiagnostic(
        model, optimizer, eval_tokens, DiagnosticOptions(update_depths=(1, 2), serving_depths=(1,))
    )
    assert model.calls == [((32, SEQ), False)] * 2
    model.calls.clear()
    ds = diagnostic.compare(tokens(4, 1))
    gradient, evaluation = [((4, SEQ), True)], [((32, SEQ), False), ((1, SEQ), False)]
    assert model.calls == (gradient + evaluation) * 2 + evaluation
    model.calls.clear()
    one_shot = diag.compare_updates(
        model, optimizer, tokens(4, 1), eval_tokens, update_depths=(1, 2), serving_depths=(1,)
    )
    assert model.calls == [((32, SEQ), False)] * 2 + (gradient + evaluation) * 2 + evaluation
    assert model.training and ds.sizes == one_shot.sizes == {"update_depth": 2, "serving_depth": 1}


def test_evaluations_reuse_the_counts_read_at_construction(monkeypatch):
    import trainer.scoring

    model, opt = adamw_setup(steps=1)
    diagnostic = UpdateDiagnostic(
        model, opt, tokens(7, 11), DiagnosticOptions(update_depths=(1, 2), serving_depths=(1,), eval_batch_size=3)
    )

    def stalls(*args, **kwargs):
        raise AssertionError("counted targets read again")

    monkeypatch.setattr(trainer.scoring, "chunk_counts", stalls)
    assert np.isfinite(diagnostic.compare(tokens(4, 1)).nll.values).all()


def test_bf16_means_bf16_whatever_autocasts_default_dtype():
    model, opt = adamw_setup()
    batch = tokens(4, 16)
    diagnostic = UpdateDiagnostic(model, opt, tokens(2, 17), DiagnosticOptions(precision="bf16"))
    expected = training_loss(copy.deepcopy(model), batch, 3, precision="bf16")
    before = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        loss, _ = diagnostic.gradient(batch, 3)
    finally:
        torch.set_autocast_dtype("cpu", before)
    assert loss == expected.item()


def test_options_hold_depths_as_tuples_of_ints():
    options = DiagnosticOptions(update_depths=[np.int64(4), 16], serving_depths=range(1, 4))
    assert options.update_depths == (4, 16) and options.serving_depths == (1, 2, 3)
    assert all(type(d) is int for d in (*options.update_depths, *options.serving_depths))


class SeparateForwardsOnly(nn.Module):
    """The tiny model without its one-pass readout: nll_by_depth must fall back to a forward per depth."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, depth):
        return self.inner(input_ids, depth=depth)


def test_the_one_pass_readout_is_used_when_the_model_has_one_and_equals_separate_forwards():
    model = tiny_model()
    batch = tokens(3, 5)
    calls = []
    one_pass = model.nll_by_depth
    model.nll_by_depth = lambda *args: calls.append(args) or one_pass(*args)
    with torch.no_grad():
        fast = scoring_nll_by_depth(model, batch[:, :-1], batch[:, 1:], [1, 3])
        slow = scoring_nll_by_depth(SeparateForwardsOnly(model), batch[:, :-1], batch[:, 1:], [1, 3])
    assert len(calls) == 1
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
