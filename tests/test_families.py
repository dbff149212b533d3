"""Model families (diag/families.py): a Huginn-convention model is refused when called raw and
diagnosed correctly through its family, against an independent recomputation in plain torch."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from huginn_convention import HuginnConvention

import diag
from common.errors import InputError
from diag.engine import CRN_SEED, BiasCorrectionWarning
from diag.families import DEPTHDIAG, HUGINN, ModelFamily, detect_family, resolve_family

VOCAB, SEQ = 48, 10
UPDATE_DEPTHS, SERVING = (3, 11), (1, 3, 11)
CLIP, WEIGHT_DECAY = 1.0, 0.1
pytestmark = pytest.mark.filterwarnings("ignore", category=BiasCorrectionWarning)


def tokens(rows, seed):
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def trained_model():
    """A HuginnConvention model after a few AdamW steps at sampled depths, as it trains."""
    torch.manual_seed(0)
    model = HuginnConvention(VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=WEIGHT_DECAY)
    for step in range(4):
        batch = tokens(4, 100 + step)
        logits = model(batch[:, :-1]).logits  # num_steps=None: a sampled (without, with) pair
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


# --- an independent recomputation: deep copies, the real optimizer.step(), plain forwards ---


def reference_forward(model, input_ids, num_steps):
    torch.manual_seed(CRN_SEED)  # the stream every forward of the diagnostic starts from
    return model(input_ids, num_steps=num_steps).logits


def reference_step(model, optimizer, grads):
    """The parameters' change from one real optimizer.step() of copies with `grads` set."""
    stepped = copy.deepcopy(model)
    opt = torch.optim.AdamW(stepped.parameters())  # load_state_dict brings the hyperparameters
    opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for p, g in zip(stepped.parameters(), grads):
        p.grad = g.clone()
    before = [p.detach().clone() for p in stepped.parameters()]
    opt.step()
    return [p.detach() - b for p, b in zip(stepped.parameters(), before)]


def reference_update(model, optimizer, batch, depth):
    """u_K = Delta(g_K) - Delta(0), with g_K from a forward of (K - 8, 8) iterations."""
    graded = copy.deepcopy(model).train()
    with_grad = min(depth, 8)
    logits = reference_forward(graded, batch[:, :-1], (depth - with_grad, with_grad))
    F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    torch.nn.utils.clip_grad_norm_(graded.parameters(), CLIP)
    grads = [p.grad for p in graded.parameters()]
    with_gradient = reference_step(model, optimizer, grads)
    with_zero = reference_step(model, optimizer, [torch.zeros_like(g) for g in grads])
    return [a - b for a, b in zip(with_gradient, with_zero)]


def reference_nll(model, eval_tokens):
    model = model.eval()
    with torch.no_grad():
        torch.manual_seed(CRN_SEED)  # one stream for the whole evaluation, depth after depth
        return np.array(
            [
                float(
                    F.cross_entropy(
                        model(eval_tokens[:, :-1], num_steps=s).logits.flatten(0, 1), eval_tokens[:, 1:].flatten()
                    )
                )
                for s in SERVING
            ]
        )


def reference_unit(model, optimizer, batch, eval_tokens):
    updates = [reference_update(model, optimizer, batch, depth) for depth in UPDATE_DEPTHS]
    rms = [math.sqrt(sum(float(t.double().square().sum()) for t in u) / sum(t.numel() for t in u)) for u in updates]
    nll = []
    for u, r in zip(updates, rms):
        updated = copy.deepcopy(model)
        with torch.no_grad():
            for p, t in zip(updated.parameters(), u):
                p.add_(t * (rms[0] / r))
        nll.append(reference_nll(updated, eval_tokens))
    return np.stack(nll), rms


def diagnose(model, optimizer, batch, eval_tokens, **kwargs):
    return diag.compare_updates(
        model,
        optimizer,
        batch,
        eval_tokens,
        update_depths=UPDATE_DEPTHS,
        serving_depths=SERVING,
        grad_clip=CLIP,
        eval_batch_size=len(eval_tokens),
        **kwargs,
    )


# --- tests ------------------------------------------------------------------------------------


def test_called_raw_the_huginn_convention_is_refused_for_its_missing_gradients():
    model, optimizer = trained_model()
    with pytest.raises(InputError, match=r"^\d+ of \d+ trainable parameters get no gradient at update depth 3 .*"):
        diagnose(model, optimizer, tokens(4, 1), tokens(6, 2), depth_kwarg="num_steps")


def test_through_its_family_it_matches_a_plain_torch_recomputation():
    model, optimizer = trained_model()
    batch, eval_tokens = tokens(4, 1), tokens(6, 2)
    ds = diagnose(model, optimizer, batch, eval_tokens, family=HUGINN)
    nll, rms = reference_unit(model, optimizer, batch, eval_tokens)
    np.testing.assert_allclose(ds.nll.values, nll, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ds.benefit.values, nll[0] - nll[-1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(ds.update_rms.values, rms, rtol=1e-5)
    assert np.abs(nll[0] - nll[-1]).max() > 1e-4  # the two depths' updates differ measurably
    assert ds.attrs["random_forward"] == 1
    assert ds.attrs["model_family"] == "huginn"
    assert ds.attrs["backprop"] == "backprop through the last 8 iterations"


def test_the_gradient_at_depth_11_runs_3_iterations_without_and_8_with_gradient():
    assert HUGINN.gradient_call(11) == {"num_steps": (3, 8)}
    assert HUGINN.gradient_call(3) == {"num_steps": (0, 3)}
    assert HUGINN.eval_call(11) == {"num_steps": 11}
    full = ModelFamily("full-pair", depth_kwarg="num_steps", pair_depth=True)
    assert full.gradient_call(11) == {"num_steps": (0, 11)}
    assert DEPTHDIAG.gradient_call(5) == DEPTHDIAG.eval_call(5) == {"num_steps": 5}
    cached = ModelFamily("cached", forward_kwargs=(("use_cache", False),))
    assert cached.gradient_call(2) == {"use_cache": False, "depth": 2}


def test_the_random_forward_is_the_same_under_any_caller_seed_and_leaves_the_rng_alone():
    model, optimizer = trained_model()
    batch, eval_tokens = tokens(4, 1), tokens(6, 2)
    results = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        results.append(diagnose(model, optimizer, batch, eval_tokens, family=HUGINN))
        assert torch.equal(torch.get_rng_state(), before)
    np.testing.assert_array_equal(results[0].nll.values, results[1].nll.values)
    np.testing.assert_array_equal(results[0].benefit.values, results[1].benefit.values)


def test_a_family_contradicting_depth_kwarg_is_refused():
    model, optimizer = trained_model()
    with pytest.raises(InputError, match="contradicts family 'huginn'"):
        diagnose(model, optimizer, tokens(4, 1), tokens(6, 2), family=HUGINN, depth_kwarg="steps")


def test_families_resolve_by_name_by_module_and_by_model_type(tmp_path, monkeypatch):
    assert resolve_family("huginn") is HUGINN
    (tmp_path / "my_families.py").write_text(
        "from diag.families import ModelFamily\nOURO = ModelFamily('ouro', depth_kwarg='n_loops')\nNOT = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    assert resolve_family("my_families:OURO").depth_kwarg == "n_loops"
    with pytest.raises(InputError, match=r"^--family my_families:NOT: 'NOT' is a int, not a diag.families.ModelFamily"):
        resolve_family("my_families:NOT")
    with pytest.raises(InputError, match=r"^--family 'ouro': not a known family \(depthdiag, huginn\)"):
        resolve_family("ouro")
    assert detect_family("huginn_raven", "ckpt/") is HUGINN
    with pytest.raises(InputError, match=r"^ckpt/: model_type 'llama' is no known model family"):
        detect_family("llama", "ckpt/")


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"name": "a b"}, "must be a short name"),
        ({"name": "x", "depth_kwarg": "1x"}, "depth_kwarg must be a keyword name"),
        ({"name": "x", "backprop_depth": 0, "pair_depth": True}, "backprop_depth must be >= 1"),
        ({"name": "x", "backprop_depth": 4}, "needs pair_depth=True"),
        ({"name": "x", "forward_kwargs": (("depth", 1),)}, "must not set the depth keyword"),
    ],
)
def test_a_malformed_family_is_one_line(fields, problem):
    with pytest.raises(InputError, match=problem):
        ModelFamily(**fields)
