"""The optimizer's own step as a pure function of the gradient: Delta(g).

    Delta(g) = theta' - theta, where theta' is what `optimizer.step()` would
    produce from (theta, S) with gradient g. Nothing real is stepped: every call
    works on fresh fp32 clones (float64 ones of float64 tensors) of theta and of
    the optimizer state S, taken once when the step is built. Complex parameters
    are refused: the diagnostic's gradients, norms and cosines are real.

Adam and AdamW (torch.optim.Adam/AdamW) and SGD run torch's own functional
kernels (`torch.optim.adam.adam`, `torch.optim.sgd.sgd`) with the param
group's hyperparameters, so Delta matches `optimizer.step()` to the bit on the
same device. Any other torch.optim optimizer is deep-copied onto cloned
parameters and stepped. `linear` is the first-order term of Delta at g = 0 in
the direction of g, computed with `torch.func.jvp` of an out-of-place
transcription of the same update rule (Adam, AdamW and SGD only).

Tensors are handled as flat lists in the optimizer's order: every parameter
of every param group, group by group. For an FSDP2-sharded model (DTensor
parameters and state) every tensor is this process's local shard.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim.adam import adam as adam_kernel
from torch.optim.sgd import sgd as sgd_kernel

from common.errors import InputError
from trainer.distributed import local_part


def _as_float(value) -> float:
    return float(value.item()) if torch.is_tensor(value) else float(value)


def fp32_clone(t: Tensor) -> Tensor:
    """An fp32 copy of `t` (float64 stays float64: a float64 model steps as torch steps it, not
    rounded to fp32), of its local shard when `t` is sharded: the step is elementwise, so each
    process steps its own shard and the shards together are the unsharded step to the bit."""
    t = local_part(t).detach()
    if not t.is_floating_point():
        return t.clone()
    return t.to(dtype=torch.promote_types(t.dtype, torch.float32), copy=True)


LINEAR_REMEDY = "use isolate='counterfactual'"
"""What `refuse_where_not_linear` tells a diagnostic to do instead."""


@dataclass(frozen=True)
class _Group:
    """One param group's slice of the flat parameter list and its hyperparameters."""

    start: int
    """Index of the group's first parameter in the flat list."""
    stop: int
    """One past the group's last parameter."""
    hyper: dict
    """The group's settings (lr already overridden when asked), without 'params'."""


class OptimizerStep:
    """Delta(g) for one (theta, optimizer state) pair; build with `optimizer_step`."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: float | None):
        self.params: list[Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
        """The real parameters, in flat order (read only)."""
        self.groups: list[_Group] = []
        start = 0
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            if lr is not None:
                hyper["lr"] = float(lr)
            self.groups.append(_Group(start, start + len(group["params"]), hyper))
            start += len(group["params"])
        for i, p in enumerate(self.params):
            if p.is_complex():
                # torch steps a complex parameter as its real and imaginary parts; the gradients,
                # RMS and cosines the diagnostic builds around Delta are real, and would drop the latter.
                dtype = str(p.dtype).removeprefix("torch.")
                raise InputError(
                    f"the optimizer's {self._name(i)} is {dtype}: the update diagnostic measures real "
                    "parameters only (complex gradients, norms and cosines are not supported)"
                )
        self.theta: list[Tensor] = [fp32_clone(p) for p in self.params]
        """fp32 (float64 for float64) clones of the parameters at construction."""
        self.optimizer_class = type(optimizer).__name__

    def _name(self, i: int) -> str:
        """Parameter i as an error names it: its index in the optimizer's state_dict, its group, its shape."""
        group = next(j for j, g in enumerate(self.groups) if g.start <= i < g.stop)
        return f"parameter {i} (param group {group}, {list(self.params[i].shape)})"

    @property
    def lrs(self) -> list[float]:
        """The learning rate each param group's step uses."""
        return [_as_float(g.hyper["lr"]) for g in self.groups]

    def delta(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """Delta(g): the step's change of every parameter (fp32, flat order)."""
        grads = self._check(grads)
        return [self._parameter_delta(i, grads[i], g.hyper) for g in self.groups for i in range(g.start, g.stop)]

    def counterfactual(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """Delta(g) - Delta(0), parameter by parameter: besides the result, only one
        parameter's clones are alive at a time (the whole-model Delta(0) is never held)."""
        grads = self._check(grads)
        return [
            self._parameter_delta(i, grads[i], g.hyper).sub_(
                self._parameter_delta(i, torch.zeros_like(grads[i]), g.hyper)
            )
            for g in self.groups
            for i in range(g.start, g.stop)
        ]

    def _parameter_delta(self, i: int, grad: Tensor, hyper: dict) -> Tensor:
        """Delta of parameter i alone with gradient `grad` (its group's settings `hyper`). The
        kernels step every parameter independently, so one at a time is the step to the bit."""
        raise NotImplementedError

    def linear(
        self, direction: Sequence[Tensor], sum_over_ranks: Callable[[Tensor], Tensor] | None = None
    ) -> list[Tensor]:
        """d/de Delta(e * direction) at e = 0 (fp32, flat order); on a sharded model every rank
        calls it with its shards and `sum_over_ranks`, which adds a tensor up over the ranks."""
        raise InputError(
            f"isolate='linear' needs the update rule written out; it supports Adam, AdamW "
            f"and SGD, not {self.optimizer_class}"
        )

    def linear_transposed(self, vector: Sequence[Tensor]) -> list[Tensor]:
        """J^T `vector` for J = d Delta / d g at g = 0 (fp32, flat order): Adam, AdamW and SGD
        step element by element, so J is diagonal and this is J `vector`. No refusal: where
        Adam's second moment is 0 the slope is taken at eps (`refuse_where_not_linear` says
        whether a gradient reaches such values)."""
        return self.linear(vector)

    def refuse_where_not_linear(
        self,
        direction: Sequence[Tensor],
        sum_over_ranks: Callable[[Tensor], Tensor] | None = None,
        remedy: str = LINEAR_REMEDY,
    ) -> None:
        """InputError where Delta has no first-order term along `direction` (none for SGD);
        `remedy` ends its message (what the caller can do instead)."""

    def _jvp_at_zero(self, direction: list[Tensor], delta_of: Callable[[int, Tensor, dict], Tensor]) -> list[Tensor]:
        """d/de delta_of(i, e * direction[i], hyper) at e = 0 for every parameter i (`direction` checked)."""
        out: list[Tensor] = []
        for g in self.groups:
            for i in range(g.start, g.stop):
                _, tangent = torch.func.jvp(
                    lambda grad, i=i, hyper=g.hyper: delta_of(i, grad, hyper),
                    (torch.zeros_like(direction[i]),),
                    (direction[i],),
                )
                out.append(tangent)
        return out

    def _check(self, grads: Sequence[Tensor]) -> list[Tensor]:
        if len(grads) != len(self.theta):
            raise InputError(f"expected {len(self.theta)} gradients, got {len(grads)}")
        for i, g in enumerate(grads):
            if g.is_complex():
                # Converting it to the parameter's real dtype would drop its imaginary part.
                raise InputError(
                    f"gradient {i} is {str(g.dtype).removeprefix('torch.')}, its parameter real: gradients must be real"
                )
        return [g.detach().to(dtype=t.dtype, device=t.device) for g, t in zip(grads, self.theta)]


class AdamStep(OptimizerStep):
    """torch.optim.Adam / AdamW through `torch.optim.adam.adam`."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: float | None):
        super().__init__(optimizer, lr)
        self.state: list[dict[str, Tensor]] = []
        for group, g in zip(optimizer.param_groups, self.groups):
            for p, theta in zip(group["params"], self.theta[g.start : g.stop]):
                self.state.append(self._initial_state(optimizer.state.get(p, {}), theta, g.hyper))
        self._vanishing: list[Tensor] | None = None

    @staticmethod
    def _initial_state(state: dict, theta: Tensor, hyper: dict) -> dict[str, Tensor]:
        if state:
            return {k: (local_part(v).detach().clone() if k == "step" else fp32_clone(v)) for k, v in state.items()}
        # torch's lazy initialisation (Adam._init_group): step on the CPU unless capturable/fused,
        # in float64 under a float64 default dtype unless fused (torch.optim.optimizer._get_scalar_dtype);
        # capturable Adam computes its bias corrections in the step's dtype.
        on_device = hyper.get("capturable") or hyper.get("fused")
        wide = torch.get_default_dtype() == torch.float64 and not hyper.get("fused")
        fresh = {
            "step": torch.zeros(
                (), dtype=torch.float64 if wide else torch.float32, device=theta.device if on_device else "cpu"
            ),
            "exp_avg": torch.zeros_like(theta),
            "exp_avg_sq": torch.zeros_like(theta),
        }
        if hyper.get("amsgrad"):
            fresh["max_exp_avg_sq"] = torch.zeros_like(theta)
        return fresh

    def _parameter_delta(self, i: int, grad: Tensor, hyper: dict) -> Tensor:
        param, _ = self._stepped(i, grad, hyper)
        return param.sub_(self.theta[i])

    def _stepped(self, i: int, grad: Tensor, hyper: dict) -> tuple[Tensor, dict[str, Tensor]]:
        """Parameter i and its state after torch's step with gradient `grad`, on clones."""
        param = self.theta[i].clone()
        state = {k: v.clone() for k, v in self.state[i].items()}
        beta1, beta2 = hyper["betas"]
        adam_kernel(
            [param],
            [grad],
            [state["exp_avg"]],
            [state["exp_avg_sq"]],
            [state["max_exp_avg_sq"]] if hyper.get("amsgrad") else [],
            [state["step"]],
            foreach=hyper.get("foreach"),
            capturable=hyper.get("capturable", False),
            differentiable=False,
            fused=hyper.get("fused"),
            decoupled_weight_decay=hyper.get("decoupled_weight_decay", False),
            amsgrad=hyper.get("amsgrad", False),
            beta1=beta1,
            beta2=beta2,
            lr=hyper["lr"],
            weight_decay=hyper["weight_decay"],
            eps=hyper["eps"],
            maximize=hyper.get("maximize", False),
        )
        return param, state

    def linear(
        self, direction: Sequence[Tensor], sum_over_ranks: Callable[[Tensor], Tensor] | None = None
    ) -> list[Tensor]:
        self.refuse_where_not_linear(direction, sum_over_ranks)
        return self.linear_transposed(direction)

    def linear_transposed(self, vector: Sequence[Tensor]) -> list[Tensor]:
        return self._jvp_at_zero(
            self._check(vector), lambda i, grad, hyper: adam_delta(self.theta[i], grad, self.state[i], hyper)
        )

    def _vanishing_second_moments(self) -> list[Tensor]:
        """Per parameter (flat order), where the second moment the step divides by is 0 after
        torch's own step with a zero gradient (read once: the state does not change)."""
        if self._vanishing is None:
            self._vanishing = []
            for g in self.groups:
                for i in range(g.start, g.stop):
                    _, state = self._stepped(i, torch.zeros_like(self.theta[i]), g.hyper)
                    self._vanishing.append(state["max_exp_avg_sq" if g.hyper.get("amsgrad") else "exp_avg_sq"] == 0)
        return self._vanishing

    def refuse_where_not_linear(
        self,
        direction: Sequence[Tensor],
        sum_over_ranks: Callable[[Tensor], Tensor] | None = None,
        remedy: str = LINEAR_REMEDY,
    ) -> None:
        """InputError where Delta has no first-order term on the gradient's scale: where the second
        moment the step divides by is 0 after torch's own step with a zero gradient and the direction
        d is not 0. There v(e) = (1 - b2) e^2 d^2, so the denominator is |e d| sqrt((1 - b2) / bc2) + eps:
        Delta(e d) is about -lr sign(e d) (times bias corrections) once |e d| is far above eps, and its
        slope at 0, lr (1 - b1) / (bc1 eps), holds only below that; where momentum is left there, the
        |e| makes a kink and there is no slope at all. On a sharded model every rank counts its
        shards and `sum_over_ranks` adds the counts up, so that all ranks refuse together. Each
        direction may hold several rows ([rows, *shape]): the refusal counts them all."""
        direction = self._check(direction)
        counts: dict[int, int] = {}
        for i, vanishing in enumerate(self._vanishing_second_moments()):
            count = int(torch.count_nonzero(vanishing & (direction[i] != 0)))  # direction may be [rows, *shape]
            if count:
                counts[i] = count
        total = sum(counts.values())
        if sum_over_ranks is not None:
            total = int(sum_over_ranks(torch.tensor(float(total), dtype=torch.float64, device=self.theta[0].device)))
        if total:
            names = ", ".join(self._name(i) for i in list(counts)[:3]) + (
                f" and {len(counts) - 3} more" if len(counts) > 3 else ""
            )
            parameters = f"{len(counts)} parameter{'s' if len(counts) > 1 else ''} (the optimizer's {names})"
            if not counts:
                parameters = "parameters in other ranks' shards"
            raise InputError(
                f"isolate='linear': Adam's second moment at g = 0 is 0 where the gradient is not, at "
                f"{total} values of {parameters}; there the step is "
                f"about -lr sign(g), not linear in g on the gradient's scale: {remedy}"
            )


def adam_delta(theta: Tensor, grad: Tensor, state: dict[str, Tensor], hyper: dict) -> Tensor:
    """Out-of-place transcription of torch's single-tensor Adam/AdamW step for one
    parameter (differentiable in `grad`); returns theta' - theta."""
    beta1, beta2 = (_as_float(b) for b in hyper["betas"])
    lr, wd, eps = _as_float(hyper["lr"]), hyper["weight_decay"], hyper["eps"]
    if hyper.get("maximize", False):
        grad = -grad
    param = theta
    if wd != 0:
        if hyper.get("decoupled_weight_decay", False):
            param = param * (1 - lr * wd)
        else:
            grad = grad + wd * theta
    step = _as_float(state["step"]) + 1
    exp_avg = torch.lerp(state["exp_avg"], grad, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad
    if hyper.get("amsgrad", False):
        exp_avg_sq = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = _sqrt_flat_at_zero(exp_avg_sq) / bias_correction2_sqrt + eps
    return param - (lr / bias_correction1) * exp_avg / denom - theta


def _sqrt_flat_at_zero(v: Tensor) -> Tensor:
    """sqrt(v) whose derivative is 0 where v = 0 instead of inf * 0 = nan. Exact for the
    linear term: `AdamStep.linear` refuses every value where v = 0 at g = 0 and the direction
    is not 0, so where v = 0 here it stays 0 along the direction and the denominator is eps."""
    positive = v > 0
    return torch.where(positive, v, torch.ones_like(v)).sqrt() * positive


class SGDStep(OptimizerStep):
    """torch.optim.SGD (momentum, dampening, nesterov, weight decay) through `torch.optim.sgd.sgd`."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: float | None):
        super().__init__(optimizer, lr)
        self.buffers: list[Tensor | None] = []
        for p in self.params:
            buf = optimizer.state.get(p, {}).get("momentum_buffer")
            self.buffers.append(None if buf is None else fp32_clone(buf))

    def _parameter_delta(self, i: int, grad: Tensor, hyper: dict) -> Tensor:
        param = self.theta[i].clone()
        buffer = self.buffers[i]
        sgd_kernel(
            [param],
            [grad],
            [None if buffer is None else buffer.clone()] if hyper["momentum"] != 0 else [],
            foreach=hyper.get("foreach"),
            fused=hyper.get("fused"),
            weight_decay=hyper["weight_decay"],
            momentum=hyper["momentum"],
            lr=hyper["lr"],
            dampening=hyper["dampening"],
            nesterov=hyper["nesterov"],
            maximize=hyper.get("maximize", False),
        )
        return param.sub_(self.theta[i])

    def linear(
        self, direction: Sequence[Tensor], sum_over_ranks: Callable[[Tensor], Tensor] | None = None
    ) -> list[Tensor]:
        return self._jvp_at_zero(
            self._check(direction), lambda i, grad, hyper: sgd_delta(self.theta[i], grad, self.buffers[i], hyper)
        )


def sgd_delta(theta: Tensor, grad: Tensor, buffer: Tensor | None, hyper: dict) -> Tensor:
    """Out-of-place transcription of torch's single-tensor SGD step for one parameter
    (differentiable in `grad`); returns theta' - theta."""
    if hyper.get("maximize", False):
        grad = -grad
    if hyper["weight_decay"] != 0:
        grad = grad + hyper["weight_decay"] * theta
    momentum = hyper["momentum"]
    if momentum != 0:
        # torch starts the buffer at the first gradient itself, without dampening.
        buf = grad if buffer is None else buffer * momentum + (1 - hyper["dampening"]) * grad
        grad = grad + momentum * buf if hyper["nesterov"] else buf
    return -_as_float(hyper["lr"]) * grad


class DeepCopyStep(OptimizerStep):
    """Any other optimizer: a deep copy bound to cloned parameters, stepped once per call."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: float | None):
        super().__init__(optimizer, lr)
        self._template_params = [t.clone().requires_grad_(p.requires_grad) for t, p in zip(self.theta, self.params)]
        memo = {id(p): t for p, t in zip(self.params, self._template_params)}
        self._template = copy.deepcopy(optimizer, memo)
        for group, g in zip(self._template.param_groups, self.groups):
            group["lr"] = g.hyper["lr"]

    def delta(self, grads: Sequence[Tensor]) -> list[Tensor]:
        grads = self._check(grads)
        params = [t.detach().clone().requires_grad_(t.requires_grad) for t in self._template_params]
        stepped = copy.deepcopy(self._template, {id(t): p for t, p in zip(self._template_params, params)})
        for p, g in zip(params, grads):
            p.grad = g.clone()
        stepped.step()
        return [p.detach().sub(t) for p, t in zip(params, self.theta)]

    def counterfactual(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """Delta(g) - Delta(0) of the whole step: a copied optimizer steps every parameter at once."""
        delta0 = self.delta([torch.zeros_like(t) for t in self.theta])
        return [d.sub_(d0) for d, d0 in zip(self.delta(grads), delta0)]


STEPPED_BY_KERNELS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""The optimizer classes whose step runs torch's own functional kernels; any other is deep-copied."""


def optimizer_step(optimizer: torch.optim.Optimizer, lr: float | None = None) -> OptimizerStep:
    """Delta(g) for the optimizer's current parameters and state; `lr` overrides every group's LR.

    Exact classes only: a subclass may change the step, so it goes through the deep copy."""
    kind = type(optimizer)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return AdamStep(optimizer, lr)
    if kind is torch.optim.SGD:
        return SGDStep(optimizer, lr)
    return DeepCopyStep(optimizer, lr)
