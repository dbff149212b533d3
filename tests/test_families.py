"""Model families (diag/arithmetic/families.py): a Huginn-convention model is refused when called raw and
diagnosed correctly through its family, and a model that truncates backprop in its own forward
and returns a tuple is diagnosed through a family that says both, each against an independent
recomputation in plain torch."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from huginn_convention import HuginnConvention, Output

import diag
from common.errors import InputError
from diag.arithmetic.families import DEPTHDIAG, HUGINN, ModelFamily, detect_family, resolve_family
from diag.arithmetic.model_checks import BiasCorrectionWarning
from diag.arithmetic.random_streams import CRN_SEED, sequence_seed

VOCAB, SEQ = 48, 10
UPDATE_DEPTHS, SERVING = (3, 11), (1, 3, 11)
CLIP, WEIGHT_DECAY = 1.0, 0.1
pytestmark = pytest.mark.filterwarnings("ignore", category=BiasCorrectionWarning)


def tokens(rows, seed):
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


class NumStepsRequired(HuginnConvention):
    """The same model with no default for num_steps: a call without it fails."""

    def forward(self, input_ids, num_steps, **kwargs):
        return super().forward(input_ids, num_steps, **kwargs)


def trained_model(model_class=HuginnConvention):
    """A HuginnConvention model after a few AdamW steps at sampled depths, as it trains."""
    torch.manual_seed(0)
    model = model_class(VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=WEIGHT_DECAY)
    for step in range(4):
        batch = tokens(4, 100 + step)
        logits = model(batch[:, :-1], num_steps=None).logits  # a sampled (without, with) pair
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
    """A random forward is evaluated sequence by sequence, each (sequence, depth) forward from its
    sequence's stream; every row counts SEQ targets, so the NLL is the mean of the rows' means."""
    model = model.eval()
    nll = np.zeros((len(eval_tokens), len(SERVING)))
    with torch.no_grad():
        for i, row in enumerate(eval_tokens):
            for j, s in enumerate(SERVING):
                torch.manual_seed(sequence_seed(i))
                nll[i, j] = float(F.cross_entropy(model(row[None, :-1], num_steps=s).logits[0], row[1:]))
    return nll.mean(axis=0)


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


@pytest.mark.parametrize("model_class", [HuginnConvention, NumStepsRequired])
def test_called_raw_the_huginn_convention_is_refused_for_its_missing_gradients(model_class):
    """The fix is told by a forward with the pair (0, depth), whether or not the forward has a
    default for its depth keyword."""
    model, optimizer = trained_model(model_class)
    fix = (
        "the forward runs its loop without gradient for an integer num_steps and with gradient for a pair "
        "(iterations without, iterations with), as a Huginn-convention forward does; call it as it trains, "
        "through a pair-depth family: family=diag.HUGINN (--family huginn), or "
        "ModelFamily(..., depth_kwarg='num_steps', pair_depth=True, backprop_depth=n) (docs/diagnostic.md)"
    )
    prefix = r"^\d+ of \d+ trainable parameters get no gradient at update depth 3 \(.*\); "
    with pytest.raises(InputError, match=prefix) as refused:
        diagnose(model, optimizer, tokens(4, 1), tokens(6, 2), depth_kwarg="num_steps")
    assert str(refused.value).endswith(f"; {fix}")


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
        "from diag.arithmetic.families import ModelFamily\nOURO = ModelFamily('ouro', depth_kwarg='n_loops')\nNOT = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    assert resolve_family("my_families:OURO").depth_kwarg == "n_loops"
    with pytest.raises(InputError, match=r"^--family my_families:NOT: 'NOT' is a int, not a diag.ModelFamily"):
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
        ({"name": "x", "logits_from": True}, "logits_from must be an index, a key or attribute name, or a function"),
        ({"name": "x", "logits_from": ""}, "logits_from must not be an empty name"),
        ({"name": "x", "forward_kwargs": (("depth", 1),)}, "must not set the depth keyword"),
    ],
)
def test_a_malformed_family_is_one_line(fields, problem):
    with pytest.raises(InputError, match=problem):
        ModelFamily(**fields)


# --- a model that truncates backprop in its own forward and returns a tuple -------------------

BPTT_K = 4
TRUNCATED_DEPTHS = (3, 9)
"""3 <= BPTT_K: the gradient flows through every iteration; 9 > BPTT_K: through the last 4 only."""


class TruncatingLoop(torch.nn.Module):
    """A looped LM as codebases with a `bptt_k` setting write one: `forward(ids, n_loops=K)` runs K
    iterations and detaches the state before the last `bptt_k`, so only they carry gradient; the
    initial state is a learned projection of the embedding (`start` acts in the first iteration
    only); the embedding is injected at every iteration; it returns the tuple (logits, state)."""

    def __init__(self, vocab=VOCAB, d=16, bptt_k=BPTT_K):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.start = torch.nn.Linear(d, d)
        self.step = torch.nn.Linear(2 * d, d)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)
        self.bptt_k = bptt_k

    def forward(self, input_ids, n_loops):
        embedded = self.embed(input_ids)
        state = self.start(embedded)
        for i in range(n_loops):
            if i == n_loops - self.bptt_k:
                state = state.detach()
            state = torch.tanh(self.step(torch.cat((state, embedded), dim=-1)))
        return self.head(self.norm(state)), state


TRUNCATING = ModelFamily("truncating", depth_kwarg="n_loops", backprop_depth=BPTT_K, logits_from=0)


def trained_truncating():
    torch.manual_seed(0)
    model = TruncatingLoop()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=WEIGHT_DECAY)
    for step in range(4):
        batch = tokens(4, 200 + step)
        logits, _ = model(batch[:, :-1], n_loops=2 + 3 * step)
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def truncated_reference_update(model, optimizer, batch, depth):
    """u_K = Delta(g_K) - Delta(0) from a real backward through the model's own truncation; a
    parameter it leaves without gradient steps with zero in both, as it gets none in training."""
    graded = copy.deepcopy(model).train()
    logits, _ = graded(batch[:, :-1], n_loops=depth)
    F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    torch.nn.utils.clip_grad_norm_(graded.parameters(), CLIP)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in graded.parameters()]
    with_gradient = reference_step(model, optimizer, grads)
    with_zero = reference_step(model, optimizer, [torch.zeros_like(g) for g in grads])
    return [a - b for a, b in zip(with_gradient, with_zero)]


def truncated_reference_unit(model, optimizer, batch, eval_tokens):
    updates = [truncated_reference_update(model, optimizer, batch, depth) for depth in TRUNCATED_DEPTHS]
    rms = [math.sqrt(sum(float(t.double().square().sum()) for t in u) / sum(t.numel() for t in u)) for u in updates]
    nll = []
    for u, r in zip(updates, rms):
        updated = copy.deepcopy(model).eval()
        with torch.no_grad():
            for p, t in zip(updated.parameters(), u):
                p.add_(t * (rms[0] / r))
            nll.append(
                [
                    float(
                        F.cross_entropy(
                            updated(eval_tokens[:, :-1], n_loops=s)[0].flatten(0, 1), eval_tokens[:, 1:].flatten()
                        )
                    )
                    for s in SERVING
                ]
            )
    return np.array(nll), rms, updates


def diagnose_truncating(model, optimizer, batch, eval_tokens, family):
    return diag.compare_updates(
        model,
        optimizer,
        batch,
        eval_tokens,
        update_depths=TRUNCATED_DEPTHS,
        serving_depths=SERVING,
        family=family,
        grad_clip=CLIP,
    )


def test_a_forward_that_truncates_itself_and_returns_a_tuple_matches_a_plain_torch_recomputation():
    model, optimizer = trained_truncating()
    batch, eval_tokens = tokens(4, 1), tokens(6, 2)
    ds = diagnose_truncating(model, optimizer, batch, eval_tokens, TRUNCATING)
    nll, rms, updates = truncated_reference_unit(model, optimizer, batch, eval_tokens)
    np.testing.assert_allclose(ds.nll.values, nll, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ds.benefit.values, nll[0] - nll[-1], rtol=0, atol=1e-6)
    np.testing.assert_allclose(ds.update_rms.values, rms, rtol=1e-6)
    start = [name for name, _ in model.named_parameters()].index("start.weight")
    assert updates[0][start].abs().max() > 0 and updates[1][start].abs().max() == 0  # cut off at depth 9
    assert np.abs(nll[0] - nll[-1]).max() > 1e-4
    assert ds.attrs["model_family"] == "truncating" and ds.attrs["random_forward"] == 0
    assert ds.attrs["backprop"] == "backprop through the last 4 iterations, truncated by the model's own forward"


def test_a_truncating_forward_without_backprop_depth_is_refused_with_that_fix():
    model, optimizer = trained_truncating()
    unsaid = ModelFamily("unsaid", depth_kwarg="n_loops", logits_from=0)
    with pytest.raises(
        InputError,
        match=r"^2 of 9 trainable parameters get no gradient at update depth 9 \(start\); they get one at depth 1: "
        r"only the last iterations of the forward carry gradient .* ModelFamily\(\.\.\., depth_kwarg='n_loops', "
        r"backprop_depth=k\) without pair_depth",
    ):
        diagnose_truncating(model, optimizer, tokens(4, 1), tokens(6, 2), unsaid)
    # A backprop depth above the forward's own truncation is refused the same way.
    overstated = ModelFamily("overstated", depth_kwarg="n_loops", backprop_depth=9, logits_from=0)
    with pytest.raises(InputError, match=r"at update depth 9 \(start\); they get one at depth 1"):
        diagnose_truncating(model, optimizer, tokens(4, 1), tokens(6, 2), overstated)


def test_logits_from_an_index_a_key_an_attribute_or_a_function():
    logits = torch.zeros(1, 2, 3)
    output = Output(logits)
    assert ModelFamily("a", logits_from=0).logits((logits, "state")) is logits
    assert ModelFamily("a", logits_from="scores").logits({"scores": logits}) is logits
    assert ModelFamily("a", logits_from="logits").logits(output) is logits
    assert ModelFamily("a", logits_from=lambda out: out[1]).logits(("state", logits)) is logits
    assert ModelFamily("a").logits(output) is logits  # the default: a tensor, or .logits
    with pytest.raises(InputError, match=r"^model family a: logits_from=0, but the forward returned a tensor, not a"):
        ModelFamily("a", logits_from=0).logits(logits)
    with pytest.raises(InputError, match=r"logits_from=2, but the forward returned a tuple without it"):
        ModelFamily("a", logits_from=2).logits((logits, "state"))
    with pytest.raises(InputError, match=r"logits_from='scores', but the forward returned a Output without that key"):
        ModelFamily("a", logits_from="scores").logits(output)
    with pytest.raises(InputError, match=r"logits_from=1 gives a str, not a tensor of logits"):
        ModelFamily("a", logits_from=1).logits((logits, "state"))


def test_a_tuple_output_without_logits_from_is_named():
    model, optimizer = trained_truncating()
    plain = ModelFamily("plain", depth_kwarg="n_loops", backprop_depth=BPTT_K)
    with pytest.raises(InputError, match=r"the model's forward returned a tuple, not a tensor of logits"):
        diagnose_truncating(model, optimizer, tokens(4, 1), tokens(6, 2), plain)
