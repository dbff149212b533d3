"""Delta(g), Delta(0) and the linear term against independent references: the
update rules written out in plain tensor arithmetic here, linear terms derived
by hand, and the real optimizers' `.step()` on deep copies."""

import copy

import pytest
import torch

from common.errors import InputError
from diag.arithmetic.optim_step import AdamStep, DeepCopyStep, SGDStep, adam_delta, optimizer_step, sgd_delta

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1


def make_params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    matrix = torch.randn(6, 5, generator=gen) * 0.1
    unused = torch.randn(4, 3, generator=gen) * 0.1
    vector = 1 + torch.randn(5, generator=gen) * 0.1
    bias = torch.randn(3, generator=gen) * 0.1
    return [torch.nn.Parameter(t.to(dtype)) for t in (matrix, unused, vector, bias)]


ADAM_LINEAR_ATOL = 1e-8
"""Under L2 decay on the first step the two terms of Adam's slope nearly cancel (to ~lr * eps / |wd theta|);
the fp32 jvp keeps ~1e-9 of that. Slopes elsewhere are ~1e-3."""

ZERO_GRAD = 1
"""Index of the parameter whose gradient is zero in `random_grads`."""


def random_grads(params, seed, zero=True):
    gen = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(p.shape, generator=gen) * 0.01).to(p.dtype) for p in params]
    if zero:
        grads[ZERO_GRAD] = torch.zeros_like(params[ZERO_GRAD])
    return grads


def groups(params, wd=WD):
    # Matrices decayed, vectors not, as the trainer builds them; a third group (decayed at its own
    # rate) so that a group's slice of the flat list starts neither at 0 nor at the first group's end.
    # The flat order is `params`.
    return [
        {"params": params[:2], "weight_decay": wd},
        {"params": params[2:3], "weight_decay": 0.0},
        {"params": params[3:], "weight_decay": wd / 2},
    ]


def build(kind, param_groups, **kwargs):
    if kind == "adamw":
        return torch.optim.AdamW(param_groups, **{"lr": LR, "betas": BETAS, "eps": EPS, **kwargs})
    if kind == "adam":
        return torch.optim.Adam(param_groups, **{"lr": LR, "betas": BETAS, "eps": EPS, **kwargs})
    if kind == "sgd":
        return torch.optim.SGD(param_groups, **{"lr": LR, **kwargs})
    return torch.optim.RMSprop(param_groups, **{"lr": LR, "momentum": 0.5, **kwargs})


def trained(kind, steps, seed=0, wd=WD, dtype=torch.float32, **kwargs):
    """Params and an optimizer after `steps` real steps on random gradients."""
    params = make_params(seed, dtype)
    opt = build(kind, groups(params, wd), **kwargs)
    train(params, opt, steps)
    return params, opt


def train(params, opt, steps, seed=100):
    for step in range(steps):
        for p, g in zip(params, random_grads(params, seed + step, zero=False)):
            p.grad = g
        opt.step()
    for p in params:
        p.grad = None


def flat_params(opt):
    return [p for group in opt.param_groups for p in group["params"]]


def hypers(opt):
    """Each parameter's group settings (without 'params'), in flat order."""
    return [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups for _ in group["params"]]


def torch_step_delta(opt, grads):
    """Delta(g) by stepping a deep copy of the real optimizer, on fp32 copies of its parameters and state."""
    params = flat_params(opt)
    clones = [p.detach().float().clone().requires_grad_() for p in params]
    stepped = copy.deepcopy(opt, {id(p): c for p, c in zip(params, clones)})
    for state in stepped.state.values():
        for k, v in state.items():
            if k != "step" and v.is_floating_point():
                state[k] = v.float()
    for c, g in zip(clones, grads):
        c.grad = g.float().clone()
    stepped.step()
    return [c.detach() - p.detach().float() for c, p in zip(clones, params)]


def with_lr(opt, lr):
    """A deep copy of `opt` (same parameters) whose every group steps with `lr`."""
    params = flat_params(opt)
    other = copy.deepcopy(opt, {id(p): p for p in params})
    for group in other.param_groups:
        group["lr"] = lr
    return other


def moments(opt, p):
    """(step count so far, exp_avg, exp_avg_sq, max_exp_avg_sq) of one Adam parameter, in float64;
    torch starts them at zero."""
    state = opt.state.get(p, {})
    zero = torch.zeros_like(p, dtype=torch.float64)
    if not state:
        return 0.0, zero, zero, zero
    vmax = state["max_exp_avg_sq"].double() if "max_exp_avg_sq" in state else zero
    return float(state["step"]), state["exp_avg"].double(), state["exp_avg_sq"].double(), vmax


def reference_adam(opt, grads):
    """torch's Adam/AdamW rule (L2 or decoupled decay, amsgrad, maximize) in plain arithmetic
    (float64): the update itself, per parameter."""
    out = []
    grads = iter(grads)
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            g = next(grads).double()
            g = -g if group["maximize"] else g
            theta = p.detach().double()
            steps, m, v, vmax = moments(opt, p)
            t = steps + 1
            update = -lr * wd * theta if group["decoupled_weight_decay"] else torch.zeros_like(theta)
            if not group["decoupled_weight_decay"]:
                g = g + wd * theta
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            if group["amsgrad"]:
                v = torch.maximum(vmax, v)
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            out.append(update - lr * m_hat / (v_hat.sqrt() + eps))
    return out


def reference_adam_linear(opt, direction):
    """d/de Delta(e * direction) at e = 0 by hand (float64). At g = 0 the gradient the moments see is
    g0 = wd * theta under L2 decay (0 when decoupled), so m moves by (1 - b1) d and v by
    2 (1 - b2) g0 d, with d negated under maximize; amsgrad's max passes v's change on only where
    the new v is the larger. The decoupled decay does not depend on g."""
    out = []
    direction = iter(direction)
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            d = next(direction).double()
            d = -d if group["maximize"] else d
            theta = p.detach().double()
            steps, m, v, vmax = moments(opt, p)
            t = steps + 1
            g0 = torch.zeros_like(theta) if group["decoupled_weight_decay"] else wd * theta
            m0, v0 = b1 * m + (1 - b1) * g0, b2 * v + (1 - b2) * g0 * g0
            dm, dv = (1 - b1) * d, 2 * (1 - b2) * g0 * d
            if group["amsgrad"]:
                dv = torch.where(v0 > vmax, dv, 0.0)
                v0 = torch.maximum(vmax, v0)
            bc1, bc2 = 1 - b1**t, 1 - b2**t
            den = (v0 / bc2).sqrt() + eps
            dden = torch.where(v0 > 0, dv / (2 * (v0 * bc2).sqrt()), 0.0)
            out.append(-lr / bc1 * (dm / den - m0 * dden / den**2))
    return out


def reference_sgd_linear(opt, direction):
    """SGD is affine in g; its slope by hand, times -lr: without momentum 1; with momentum the new
    buffer's share of g, (1 - dampening), or all of it on the first step (torch starts the buffer
    at the gradient itself), and under nesterov 1 + momentum times that share; negated under maximize."""
    out = []
    direction = iter(direction)
    for group in opt.param_groups:
        momentum, nesterov = group["momentum"], group["nesterov"]
        for p in group["params"]:
            d = next(direction).double()
            first = opt.state.get(p, {}).get("momentum_buffer") is None
            share = 1.0 if first else 1 - group["dampening"]
            slope = 1.0 if momentum == 0 else (1 + momentum * share if nesterov else share)
            out.append(-group["lr"] * slope * (-d if group["maximize"] else d))
    return out


def snapshot_state(params, opt):
    return (
        [p.detach().clone() for p in params],
        copy.deepcopy({id_: {k: v.clone() for k, v in s.items()} for id_, s in enumerate(opt.state.values())}),
    )


def assert_close_lists(actual, expected, rtol=1e-4, atol=2e-7):
    # atol: the update is theta' - theta in fp32, so it carries an ulp of |theta| (~1e-7 near 1).
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        torch.testing.assert_close(a.double(), e.double(), rtol=rtol, atol=atol)


def assert_equal_lists(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == torch.float32
        assert torch.equal(a, e)


@pytest.mark.parametrize("steps", [0, 1, 2, 5])
def test_adamw_delta_matches_torch_step_and_plain_arithmetic(steps):
    params, opt = trained("adamw", steps)
    before = snapshot_state(params, opt)
    step = optimizer_step(opt)
    assert isinstance(step, AdamStep)
    grads = random_grads(params, 7)
    zero = [torch.zeros_like(p) for p in params]
    delta_g, delta_0 = step.delta(grads), step.delta(zero)
    # The kernel torch itself runs: bitwise equal to stepping a copy.
    assert_equal_lists(delta_g, torch_step_delta(opt, grads))
    assert_equal_lists(delta_0, torch_step_delta(opt, zero))
    assert_close_lists(delta_g, reference_adam(opt, grads))
    assert_close_lists(delta_0, reference_adam(opt, zero))
    u = [a - b for a, b in zip(delta_g, delta_0)]
    u_ref = [a - b for a, b in zip(reference_adam(opt, grads), reference_adam(opt, zero))]
    assert_close_lists(u, u_ref, rtol=1e-4, atol=2e-7)
    # The zero-gradient parameter still decays and drifts, and its counterfactual update is zero.
    assert torch.count_nonzero(delta_0[ZERO_GRAD]) > 0
    assert torch.equal(u[ZERO_GRAD], torch.zeros_like(u[ZERO_GRAD]))
    # Nothing real moved.
    after = snapshot_state(params, opt)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert before[1].keys() == after[1].keys()
    for i in before[1]:
        assert all(torch.equal(before[1][i][k], after[1][i][k]) for k in before[1][i])


@pytest.mark.parametrize("steps", [0, 3])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_adam_and_adamw_step_like_torch_with_amsgrad_and_maximize(kind, maximize, amsgrad, steps):
    params, opt = trained(kind, steps, amsgrad=amsgrad, maximize=maximize)
    step = optimizer_step(opt)
    grads = random_grads(params, 8)
    zero = [torch.zeros_like(p) for p in params]
    delta_g, delta_0 = step.delta(grads), step.delta(zero)
    assert_equal_lists(delta_g, torch_step_delta(opt, grads))
    assert_equal_lists(delta_0, torch_step_delta(opt, zero))
    assert_close_lists(delta_g, reference_adam(opt, grads))
    if steps:
        assert_close_lists(step.linear(grads), reference_adam_linear(opt, grads), rtol=1e-4, atol=ADAM_LINEAR_ATOL)
    else:
        # A fresh state's second moment is 0 (test_linear_is_refused_where_the_step_has_no_first_order_term).
        with pytest.raises(InputError, match="^isolate='linear': "):
            step.linear(grads)
    # adam_delta, the rule the linear term differentiates, is the step itself, not only its slope.
    thetas = [p.detach() for p in flat_params(opt)]
    states = [opt.state[p] if steps else fresh_adam_state(p) for p in flat_params(opt)]
    transcribed = [adam_delta(*args) for args in zip(thetas, grads, states, hypers(opt))]
    assert_close_lists(transcribed, torch_step_delta(opt, grads))


def fresh_adam_state(p):
    # torch's lazy initialisation: no steps yet, zero moments.
    zero = torch.zeros_like(p, dtype=torch.float32)
    return {"step": torch.tensor(0.0), "exp_avg": zero, "exp_avg_sq": zero, "max_exp_avg_sq": zero}


def test_adam_with_l2_weight_decay_matches_reference():
    params, opt = trained("adam", 3)
    grads = random_grads(params, 8)
    delta = optimizer_step(opt).delta(grads)
    assert_close_lists(delta, reference_adam(opt, grads))


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_lr_override_is_used(kind):
    params, opt = trained(kind, 2, momentum=0.9) if kind == "sgd" else trained(kind, 2)
    grads = random_grads(params, 9)
    step = optimizer_step(opt, lr=1e-2)
    assert step.lrs == [1e-2] * 3
    assert optimizer_step(opt).lrs == [LR] * 3
    reference = with_lr(opt, 1e-2)
    assert_equal_lists(step.delta(grads), torch_step_delta(reference, grads))
    linear = reference_adam_linear if kind == "adamw" else reference_sgd_linear
    assert_close_lists(step.linear(grads), linear(reference, grads), rtol=1e-4, atol=ADAM_LINEAR_ATOL)


def test_counterfactual_on_fresh_adamw_is_lr_times_sign():
    params, opt = trained("adamw", 0)
    grads = random_grads(params, 10)
    step = optimizer_step(opt)
    zero = [torch.zeros_like(p) for p in params]
    u = [a - b for a, b in zip(step.delta(grads), step.delta(zero))]
    for ui, g in zip(u, grads):
        # Bias correction makes m_hat = g and v_hat = g^2 at the first step.
        torch.testing.assert_close(ui, -LR * g / (g.abs() + EPS), rtol=1e-4, atol=2e-7)
        torch.testing.assert_close(ui, -LR * torch.sign(g), rtol=1e-4, atol=2e-7)


@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_sgd_momentum_counterfactual_is_scaled_gradient(dampening):
    params, opt = trained("sgd", 2, momentum=0.9, dampening=dampening, weight_decay=0.01)
    step = optimizer_step(opt)
    assert isinstance(step, SGDStep)
    grads = random_grads(params, 11)
    zero = [torch.zeros_like(p) for p in params]
    delta_g, delta_0 = step.delta(grads), step.delta(zero)
    assert_equal_lists(delta_g, torch_step_delta(opt, grads))
    for ui, g in zip((a - b for a, b in zip(delta_g, delta_0)), grads):
        torch.testing.assert_close(ui, -LR * (1 - dampening) * g, rtol=1e-4, atol=2e-7)


def test_sgd_first_step_starts_momentum_at_the_gradient():
    # torch initialises the buffer with the gradient itself (no dampening).
    params, opt = trained("sgd", 0, momentum=0.9, dampening=0.5)
    step = optimizer_step(opt)
    grads = random_grads(params, 12)
    u = [a - b for a, b in zip(step.delta(grads), step.delta([torch.zeros_like(p) for p in params]))]
    for ui, g in zip(u, grads):
        torch.testing.assert_close(ui, -LR * g, rtol=1e-4, atol=2e-7)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_delta_matches_torch_step_and_linear_term_is_the_counterfactual(nesterov):
    params, opt = trained("sgd", 3, momentum=0.8, nesterov=nesterov, weight_decay=0.05)
    step = optimizer_step(opt)
    grads = random_grads(params, 13)
    assert_equal_lists(step.delta(grads), torch_step_delta(opt, grads))
    # SGD is affine in g, so its first-order term is the whole counterfactual update.
    zero = [torch.zeros_like(p) for p in params]
    counterfactual = [a - b for a, b in zip(step.delta(grads), step.delta(zero))]
    assert_close_lists(step.linear(grads), counterfactual, rtol=1e-4, atol=2e-7)


SGD_SETTINGS = {
    "plain": {},
    "maximize": {"maximize": True},
    "dampened-maximize": {"momentum": 0.9, "dampening": 0.3, "maximize": True},
    "nesterov-maximize": {"momentum": 0.9, "nesterov": True, "maximize": True},
    "foreach": {"momentum": 0.9, "dampening": 0.3, "foreach": True},
}


@pytest.mark.parametrize("steps", [0, 2])
@pytest.mark.parametrize("settings", SGD_SETTINGS.values(), ids=SGD_SETTINGS)
def test_sgd_steps_like_torch_for_every_setting(settings, steps):
    params, opt = trained("sgd", steps, **settings)
    step = optimizer_step(opt)
    grads = random_grads(params, 19)
    zero = [torch.zeros_like(p) for p in params]
    assert_equal_lists(step.delta(grads), torch_step_delta(opt, grads))
    assert_equal_lists(step.delta(zero), torch_step_delta(opt, zero))
    assert_close_lists(step.linear(grads), reference_sgd_linear(opt, grads), rtol=1e-5, atol=1e-12)
    # sgd_delta, the rule the linear term differentiates, is the step itself, not only its slope.
    buffers = [opt.state.get(p, {}).get("momentum_buffer") for p in flat_params(opt)]
    transcribed = [sgd_delta(p.detach(), *args) for p, *args in zip(flat_params(opt), grads, buffers, hypers(opt))]
    assert_close_lists(transcribed, torch_step_delta(opt, grads))


@pytest.mark.parametrize(
    "kind, settings", [("adam", {}), ("adamw", {}), ("sgd", {"momentum": 1.0, "dampening": 0.5})], ids=str
)
def test_weight_decay_of_one_and_momentum_of_one_step_like_torch(kind, settings):
    # 1 is a legal weight decay and a legal momentum, not a switch that turns them off.
    params, opt = trained(kind, 2, wd=1.0, **settings)
    step = optimizer_step(opt)
    grads = random_grads(params, 20)
    expected = torch_step_delta(opt, grads)
    assert_equal_lists(step.delta(grads), expected)
    if kind == "sgd":
        buffers = [opt.state[p]["momentum_buffer"] for p in flat_params(opt)]
        transcribed = [sgd_delta(p.detach(), *args) for p, *args in zip(flat_params(opt), grads, buffers, hypers(opt))]
        assert_close_lists(step.linear(grads), reference_sgd_linear(opt, grads), rtol=1e-5, atol=1e-12)
    else:
        states = [opt.state[p] for p in flat_params(opt)]
        transcribed = [adam_delta(p.detach(), *args) for p, *args in zip(flat_params(opt), grads, states, hypers(opt))]
        assert_close_lists(step.linear(grads), reference_adam_linear(opt, grads), rtol=1e-4, atol=ADAM_LINEAR_ATOL)
    assert_close_lists(transcribed, expected)


@pytest.mark.parametrize(
    "kind, settings",
    [("adamw", {}), ("adam", {"amsgrad": True}), ("sgd", {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.1})],
    ids=str,
)
def test_fused_optimizers_step_with_their_own_fused_kernel(kind, settings):
    # torch's fused CPU kernels round a few elements differently from the single-tensor ones (those
    # past the last full vector of a tensor among them), so only the group's own fused kernel
    # reproduces optimizer.step() to the bit: many tensors with such tails make a difference certain.
    gen = torch.Generator().manual_seed(3)
    shapes = [(63, 65)] * 2 + [(15,)] * 20
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    opt = build(kind, [{"params": params}], lr=0.1, fused=True, **settings)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    assert_equal_lists(optimizer_step(opt).delta(grads), torch_step_delta(opt, grads))


@pytest.mark.parametrize("kind", ["adamw", "sgd", "rmsprop"])
def test_the_step_is_the_one_from_when_it_was_built(kind):
    params, opt = trained(kind, 2, momentum=0.9) if kind == "sgd" else trained(kind, 2)
    step = optimizer_step(opt)
    grads = random_grads(params, 17)
    expected = torch_step_delta(opt, grads)
    # Training goes on in place: the real parameters and state move, the step built before does not.
    train(params, opt, 1, seed=300)
    assert_equal_lists(step.delta(grads), expected)


@pytest.mark.parametrize("kind, settings", [("adamw", {}), ("sgd", {"momentum": 0.9, "dampening": 0.3})], ids=str)
def test_bf16_parameters_and_gradients_step_in_fp32(kind, settings):
    params, opt = trained(kind, 2, dtype=torch.bfloat16, **settings)
    step = optimizer_step(opt)
    grads = random_grads(params, 21)
    # The reference steps fp32 copies of the bf16 parameters, state and gradients.
    expected = torch_step_delta(opt, grads)
    assert_equal_lists(step.delta(grads), expected)
    assert_equal_lists(step.delta([g.double() for g in grads]), expected)
    linear = reference_adam_linear if kind == "adamw" else reference_sgd_linear
    assert_close_lists(step.linear(grads), linear(opt, grads), rtol=1e-4, atol=ADAM_LINEAR_ATOL)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "rmsprop"])
def test_a_wrong_number_of_gradients_is_an_input_error(kind):
    params, opt = trained(kind, 1)
    step = optimizer_step(opt)
    with pytest.raises(InputError, match="expected 4 gradients, got 3"):
        step.delta(random_grads(params, 22)[:3])
    if kind != "rmsprop":
        with pytest.raises(InputError, match="expected 4 gradients, got 5"):
            step.linear(random_grads(params, 22) + [torch.zeros(1)])


@pytest.mark.parametrize("steps", [1, 3])
def test_adamw_linear_term_matches_closed_form(steps):
    params, opt = trained("adamw", steps)
    direction = random_grads(params, 14)
    linear = optimizer_step(opt).linear(direction)
    b1, b2 = BETAS
    flat = flat_params(opt)
    assert len(linear) == len(flat)
    for p, d, lin in zip(flat, direction, linear):
        v, t = opt.state[p]["exp_avg_sq"], float(opt.state[p]["step"]) + 1
        # At g = 0 the second moment does not move to first order: only m' = (1 - b1) d does.
        expected = -LR * (1 - b1) / (1 - b1**t) * d / ((b2 * v / (1 - b2**t)).sqrt() + EPS)
        torch.testing.assert_close(lin, expected, rtol=1e-4, atol=1e-9)
        assert torch.isfinite(lin).all()


def test_adam_l2_linear_term_matches_closed_form():
    params, opt = trained("adam", 2)
    direction = random_grads(params, 15)
    linear = optimizer_step(opt).linear(direction)
    b1, b2 = BETAS
    assert len(linear) == len(direction)
    pairs = iter(zip(direction, linear))
    for group in opt.param_groups:
        wd = group["weight_decay"]
        for p in group["params"]:
            d, lin = (t.double() for t in next(pairs))
            state = opt.state[p]
            theta, t = p.detach().double(), float(state["step"]) + 1
            bc1, bc2 = 1 - b1**t, 1 - b2**t
            g0 = wd * theta  # the L2 term is the gradient at g = 0
            m = b1 * state["exp_avg"].double() + (1 - b1) * g0
            v = b2 * state["exp_avg_sq"].double() + (1 - b2) * g0 * g0
            den = (v / bc2).sqrt() + EPS
            dm, dv = (1 - b1) * d, 2 * (1 - b2) * g0 * d
            dden = dv / (2 * (v * bc2).sqrt())
            expected = -LR / bc1 * (dm / den - m * dden / den**2)
            torch.testing.assert_close(lin, expected, rtol=1e-4, atol=1e-10)


def test_other_optimizers_go_through_a_deep_copy():
    params = make_params()
    opt = build("rmsprop", groups(params))
    train(params, opt, 3, seed=200)
    before = snapshot_state(params, opt)
    step = optimizer_step(opt, lr=2 * LR)
    assert isinstance(step, DeepCopyStep)
    grads = random_grads(params, 16)
    expected = torch_step_delta(with_lr(opt, 2 * LR), grads)
    assert_equal_lists(step.delta(grads), expected)
    # Repeated calls start from the same state.
    assert_equal_lists(step.delta(grads), expected)
    zero = [torch.zeros_like(p) for p in params]
    counterfactual = [a - b for a, b in zip(expected, torch_step_delta(with_lr(opt, 2 * LR), zero))]
    assert_equal_lists(step.counterfactual(grads), counterfactual)
    after = snapshot_state(params, opt)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    # The refusal names the optimizer it cannot write out.
    with pytest.raises(InputError, match="supports Adam, AdamW and SGD, not RMSprop"):
        step.linear(grads)


def test_subclass_of_adamw_is_not_assumed_to_step_like_adamw():
    class Custom(torch.optim.AdamW):
        pass

    params = make_params()
    assert isinstance(optimizer_step(Custom(params, lr=LR)), DeepCopyStep)


@pytest.fixture
def float64_default():
    """torch's default dtype float64 for one test, the previous one restored however it ends."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("steps", [0, 3])
def test_float64_parameters_step_in_float64_like_torch(float64_default, steps):
    params, opt = trained("adamw", steps, dtype=torch.float64)
    step = optimizer_step(opt)
    grads = random_grads(params, 23)
    # torch's own AdamW on deep copies of the float64 parameters and state, nothing converted.
    clones = [p.detach().clone().requires_grad_() for p in params]
    stepped = copy.deepcopy(opt, {id(p): c for p, c in zip(params, clones)})
    for c, g in zip(clones, grads):
        c.grad = g.clone()
    stepped.step()
    for i, (delta, c, p) in enumerate(zip(step.delta(grads), clones, params)):
        assert delta.dtype == torch.float64
        assert torch.equal(delta, c.detach() - p.detach())  # torch's own kernel, in float64: to the bit
        # A fresh state is the one torch initialises: its step count in float64 under this default too.
        assert step.state[i]["step"].dtype == stepped.state[c]["step"].dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturable Adam steps on CUDA only")
def test_a_fresh_capturable_step_counts_in_float64_under_a_float64_default(float64_default):
    # Capturable Adam computes its bias corrections from the step tensor in its own dtype: a float32
    # count would round them to fp32 where torch, under this default, keeps them in float64.
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(dtype=torch.float64)]
    opt = build("adamw", groups(params), capturable=True)
    grads = [g.cuda() for g in random_grads(params, 28)]
    clones = [p.detach().clone().requires_grad_() for p in params]
    stepped = copy.deepcopy(opt, {id(p): c for p, c in zip(params, clones)})
    for c, g in zip(clones, grads):
        c.grad = g.clone()
    stepped.step()
    for delta, c, p in zip(optimizer_step(opt).delta(grads), clones, params):
        assert torch.equal(delta, c.detach() - p.detach())


def complex_case(kind):
    """Params whose third (param group 1) is complex64, an optimizer over them, gradients with imaginary parts."""
    params = make_params()
    real = params[2].detach()
    params[2] = torch.nn.Parameter(torch.complex(real, real.flip(0)))
    grads = random_grads(params, 24)
    grads[2] = torch.complex(grads[2].real, -grads[2].real.flip(0))
    return params, build(kind, groups(params)), grads


@pytest.mark.parametrize("kind", ["adamw", "sgd", "rmsprop"])
def test_complex_parameters_are_refused_naming_them(kind):
    params, opt, grads = complex_case(kind)
    # torch's own step moves the imaginary part, which a real Delta(g) would drop.
    clones = [p.detach().clone().requires_grad_() for p in params]
    stepped = copy.deepcopy(opt, {id(p): c for p, c in zip(params, clones)})
    for c, g in zip(clones, grads):
        c.grad = g
    stepped.step()
    assert not torch.equal(clones[2].detach().imag, params[2].detach().imag)
    with pytest.raises(InputError, match=r"^the optimizer's parameter 2 \(param group 1, \[5\]\) is complex64: "):
        optimizer_step(opt)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "rmsprop"])
def test_a_complex_gradient_of_a_real_parameter_is_refused(kind):
    params, opt = trained(kind, 1)
    step = optimizer_step(opt)
    grads = random_grads(params, 25)
    grads[3] = grads[3] * (1 + 1j)
    isolations = [step.delta, step.counterfactual] + ([step.linear] if kind != "rmsprop" else [])
    for isolation in isolations:
        with pytest.raises(InputError, match=r"^gradient 3 is complex64, its parameter real: gradients must be real$"):
            isolation(grads)


LINEAR_REFUSAL = r"^isolate='linear': Adam's second moment at g = 0 is 0 where the gradient is not, at "


@pytest.mark.parametrize(
    "kind, refused",
    [
        (
            "adamw",
            r"38 values of 3 parameters \(the optimizer's parameter 0 \(param group 0, \[6, 5\]\), "
            r"parameter 2 \(param group 1, \[5\]\), parameter 3 \(param group 2, \[3\]\)\)",
        ),
        # L2 decay: the decayed parameters' moments see wd * theta at g = 0, the undecayed vector nothing.
        ("adam", r"5 values of 1 parameter \(the optimizer's parameter 2 \(param group 1, \[5\]\)\)"),
    ],
    ids=["adamw", "adam-l2"],
)
def test_linear_is_refused_where_the_step_has_no_first_order_term(kind, refused):
    params, opt = trained(kind, 0)
    grads = random_grads(params, 26)
    # A fresh AdamW's v = 0: torch's own update is about -lr sign(g) at any gradient far above eps,
    # the same for half the gradient; Delta(e g) bends on the scale |e g| ~ eps, so its slope at 0
    # (lr / eps) says nothing about the update.
    zero = [torch.zeros_like(p) for p in params]
    if kind == "adamw":
        updates = [
            [a - b for a, b in zip(torch_step_delta(opt, [g * scale for g in grads]), torch_step_delta(opt, zero))]
            for scale in (1.0, 0.5)
        ]
        assert_close_lists(updates[1], updates[0])
    with pytest.raises(InputError, match=LINEAR_REFUSAL + refused + r"; .* use isolate='counterfactual'$"):
        optimizer_step(opt).linear(grads)


def test_the_linear_refusal_of_two_parameters_names_both():
    params, opt = trained("adamw", 0)
    grads = random_grads(params, 26)
    grads[3].zero_()
    with pytest.raises(
        InputError,
        match=LINEAR_REFUSAL + r"35 values of 2 parameters \(the optimizer's parameter 0 \(param group 0, \[6, 5\]\), "
        r"parameter 2 \(param group 1, \[5\]\)\);",
    ):
        optimizer_step(opt).linear(grads)


def test_the_linear_refusal_names_three_parameters_and_counts_the_rest():
    params, opt = trained("adamw", 0)
    with pytest.raises(InputError, match=LINEAR_REFUSAL + r"50 values of 4 parameters \(.*\[5\]\) and 1 more\);"):
        optimizer_step(opt).linear(random_grads(params, 29, zero=False))


def trained_with_a_parameter_never_stepped_by_a_gradient():
    """AdamW after 3 steps in which parameter ZERO_GRAD got zero gradients: its state exists with v = 0."""
    params = make_params()
    opt = build("adamw", groups(params))
    for seed in range(100, 103):
        for p, g in zip(params, random_grads(params, seed)):
            p.grad = g
        opt.step()
    return params, opt


def test_linear_term_where_the_second_moment_is_zero_and_so_is_the_gradient():
    params, opt = trained_with_a_parameter_never_stepped_by_a_gradient()
    assert not opt.state[params[ZERO_GRAD]]["exp_avg_sq"].any()
    step = optimizer_step(opt)
    direction = random_grads(params, 27)
    # Zero where v = 0 too: the step does not move there along the direction, so the term is exact.
    assert_close_lists(step.linear(direction), reference_adam_linear(opt, direction), rtol=1e-4, atol=ADAM_LINEAR_ATOL)
    direction[ZERO_GRAD][0, :2] = 0.01
    with pytest.raises(InputError, match=LINEAR_REFUSAL + r"2 values of 1 parameter \(the optimizer's parameter 1 "):
        step.linear(direction)


def test_the_linear_refusal_is_decided_over_every_ranks_shards():
    # Sharded, each rank checks its shards: a count on another rank refuses here too, so that no
    # rank goes on into a collective the others have left.
    params, opt = trained_with_a_parameter_never_stepped_by_a_gradient()
    step = optimizer_step(opt)
    direction = random_grads(params, 27)
    direction[ZERO_GRAD].zero_()  # nothing refused in this rank's shards
    step.linear(direction, sum_over_ranks=lambda total: total)
    with pytest.raises(InputError, match=LINEAR_REFUSAL + r"3 values of parameters in other ranks' shards;"):
        step.linear(direction, sum_over_ranks=lambda total: total + 3)
    # The ranks' counts add up exactly past 2^24 values (fp32 would round 2^24 + 3 to 2^24 + 4).
    with pytest.raises(InputError, match=LINEAR_REFUSAL + r"16777219 values of parameters in other ranks' shards;"):
        step.linear(direction, sum_over_ranks=lambda total: total + 2**24 + 3)


def test_the_ranks_count_the_refusal_of_an_optimizer_with_one_parameter():
    param = make_params()[0]
    step = optimizer_step(build("adamw", [{"params": [param]}]))  # fresh: v = 0 everywhere
    with pytest.raises(InputError, match=LINEAR_REFUSAL + r"32 values of 1 parameter \(the optimizer's parameter 0 "):
        step.linear([torch.ones_like(param)], sum_over_ranks=lambda total: total + 2)


def test_amsgrad_is_linear_where_its_running_maximum_outlives_the_second_moment():
    # A gradient that stopped long ago: v decays to 0 (fp32 underflow), the maximum amsgrad divides
    # by keeps its value, so the step has a slope there and nothing is refused.
    params, opt = trained("adamw", 2, amsgrad=True, betas=(0.9, 0.1))
    for seed in range(60):
        for p, g in zip(params, random_grads(params, 300 + seed)):
            p.grad = g
        opt.step()
    state = opt.state[params[ZERO_GRAD]]
    assert not state["exp_avg_sq"].any() and state["max_exp_avg_sq"].all()
    direction = random_grads(params, 31, zero=False)
    linear = optimizer_step(opt).linear(direction)
    assert_close_lists(linear, reference_adam_linear(opt, direction), rtol=1e-4, atol=ADAM_LINEAR_ATOL)
