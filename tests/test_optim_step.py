"""Delta(g), Delta(0) and the linear term against independent references: the
update rules written out in plain tensor arithmetic here, and the real
optimizers' `.step()` on deep copies."""

import copy

import pytest
import torch

from diag.optim_step import AdamStep, DeepCopyStep, SGDStep, optimizer_step

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    matrix = torch.nn.Parameter(torch.randn(6, 5, generator=gen) * 0.1)
    unused = torch.nn.Parameter(torch.randn(4, 3, generator=gen) * 0.1)
    vector = torch.nn.Parameter(1 + torch.randn(5, generator=gen) * 0.1)
    return [matrix, unused, vector]


ZERO_GRAD = 1
"""Index of the parameter whose gradient is zero in `random_grads`."""


def random_grads(params, seed, zero=True):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=gen) * 0.01 for p in params]
    if zero:
        grads[ZERO_GRAD] = torch.zeros_like(params[ZERO_GRAD])
    return grads


def groups(params):
    # Matrices decayed, vectors not, as the trainer builds them; the flat order is `params`.
    return [{"params": params[:2], "weight_decay": WD}, {"params": params[2:], "weight_decay": 0.0}]


def trained(kind, steps, seed=0, **kwargs):
    """Params and an optimizer after `steps` real steps on random gradients."""
    params = make_params(seed)
    if kind == "adamw":
        opt = torch.optim.AdamW(groups(params), lr=LR, betas=BETAS, eps=EPS, **kwargs)
    elif kind == "adam":
        opt = torch.optim.Adam(groups(params), lr=LR, betas=BETAS, eps=EPS, **kwargs)
    else:
        opt = torch.optim.SGD(groups(params), lr=LR, **kwargs)
    for step in range(steps):
        for p, g in zip(params, random_grads(params, 100 + step, zero=False)):
            p.grad = g
        opt.step()
    for p in params:
        p.grad = None
    return params, opt


def flat_params(opt):
    return [p for group in opt.param_groups for p in group["params"]]


def torch_step_delta(opt, grads):
    """Delta(g) by stepping a deep copy of the real optimizer."""
    params = flat_params(opt)
    clones = [p.detach().clone().requires_grad_() for p in params]
    stepped = copy.deepcopy(opt, {id(p): c for p, c in zip(params, clones)})
    for c, g in zip(clones, grads):
        c.grad = g.clone()
    stepped.step()
    return [c.detach() - p.detach() for c, p in zip(clones, params)]


def reference_adamw(opt, grads, decoupled=True):
    """torch's AdamW/Adam rule in plain arithmetic (float64), per parameter."""
    out = []
    grads = iter(grads)
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            g = next(grads).double()
            theta = p.detach().double()
            state = opt.state.get(p, {})
            m = state["exp_avg"].double() if state else torch.zeros_like(theta)
            v = state["exp_avg_sq"].double() if state else torch.zeros_like(theta)
            t = (float(state["step"]) if state else 0.0) + 1
            new = theta * (1 - lr * wd) if decoupled else theta
            if not decoupled:
                g = g + wd * theta
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            new = new - lr * m_hat / (v_hat.sqrt() + eps)
            out.append(new - theta)
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
        torch.testing.assert_close(a.double(), e.double(), rtol=rtol, atol=atol)


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
    for a, b in zip(delta_g, torch_step_delta(opt, grads)):
        assert torch.equal(a, b)
    for a, b in zip(delta_0, torch_step_delta(opt, zero)):
        assert torch.equal(a, b)
    assert_close_lists(delta_g, reference_adamw(opt, grads))
    assert_close_lists(delta_0, reference_adamw(opt, zero))
    u = [a - b for a, b in zip(delta_g, delta_0)]
    u_ref = [a - b for a, b in zip(reference_adamw(opt, grads), reference_adamw(opt, zero))]
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


def test_adam_with_l2_weight_decay_matches_reference():
    params, opt = trained("adam", 3)
    grads = random_grads(params, 8)
    delta = optimizer_step(opt).delta(grads)
    assert_close_lists(delta, reference_adamw(opt, grads, decoupled=False))


def test_lr_override_is_used():
    params, opt = trained("adamw", 2)
    grads = random_grads(params, 9)
    step = optimizer_step(opt, lr=1e-2)
    assert step.lrs == [1e-2, 1e-2]
    for group in opt.param_groups:
        group["lr"] = 1e-2
    assert_close_lists(step.delta(grads), reference_adamw(opt, grads))


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
    for a, b in zip(delta_g, torch_step_delta(opt, grads)):
        assert torch.equal(a, b)
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
    for a, b in zip(step.delta(grads), torch_step_delta(opt, grads)):
        assert torch.equal(a, b)
    # SGD is affine in g, so its first-order term is the whole counterfactual update.
    zero = [torch.zeros_like(p) for p in params]
    counterfactual = [a - b for a, b in zip(step.delta(grads), step.delta(zero))]
    assert_close_lists(step.linear(grads), counterfactual, rtol=1e-4, atol=2e-7)


@pytest.mark.parametrize("steps", [0, 3])
def test_adamw_linear_term_matches_closed_form(steps):
    params, opt = trained("adamw", steps)
    direction = random_grads(params, 14)
    linear = optimizer_step(opt).linear(direction)
    b1, b2 = BETAS
    flat = flat_params(opt)
    for p, d, lin in zip(flat, direction, linear):
        state = opt.state.get(p, {})
        v = state["exp_avg_sq"] if state else torch.zeros_like(p)
        t = (float(state["step"]) if state else 0.0) + 1
        # At g = 0 the second moment does not move to first order: only m' = (1 - b1) d does.
        expected = -LR * (1 - b1) / (1 - b1**t) * d / ((b2 * v / (1 - b2**t)).sqrt() + EPS)
        torch.testing.assert_close(lin, expected, rtol=1e-4, atol=1e-9)
        assert torch.isfinite(lin).all()


def test_adam_l2_linear_term_matches_closed_form():
    params, opt = trained("adam", 2)
    direction = random_grads(params, 15)
    linear = optimizer_step(opt).linear(direction)
    b1, b2 = BETAS
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
    opt = torch.optim.RMSprop(groups(params), lr=LR, momentum=0.5)
    for step in range(3):
        for p, g in zip(params, random_grads(params, 200 + step, zero=False)):
            p.grad = g
        opt.step()
    before = snapshot_state(params, opt)
    step = optimizer_step(opt, lr=2 * LR)
    assert isinstance(step, DeepCopyStep)
    grads = random_grads(params, 16)
    for group in opt.param_groups:
        group["lr"] = 2 * LR
    expected = torch_step_delta(opt, grads)
    for group in opt.param_groups:
        group["lr"] = LR
    for a, b in zip(step.delta(grads), expected):
        assert torch.equal(a, b)
    # Repeated calls start from the same state.
    for a, b in zip(step.delta(grads), expected):
        assert torch.equal(a, b)
    after = snapshot_state(params, opt)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    with pytest.raises(ValueError, match="linear"):
        step.linear(grads)


def test_subclass_of_adamw_is_not_assumed_to_step_like_adamw():
    class Custom(torch.optim.AdamW):
        pass

    params = make_params()
    assert isinstance(optimizer_step(Custom(params, lr=LR)), DeepCopyStep)
