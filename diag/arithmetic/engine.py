"""The update diagnostic for one (snapshot, batch) unit. Formulas: docs/diagnostic.md.

For weights theta with optimizer state S and one training batch b:

    g_K    = grad of the training loss at depth K on b (clipped as in training)
    u_K    = Delta(g_K) - Delta(0)          isolate='counterfactual' (default)
           = Delta(g_K)                     isolate='none'
           = d/de Delta(e g_K) at e = 0     isolate='linear'
    u_K   <- u_K * c_K                      RMS matching (default: to the first depth's RMS)
    nll[K, s] = eval NLL of theta + u_K at serving depth s
    benefit_K(s) = nll[K_ref, s] - nll[K, s]     (positive favours depth K over K_ref)

`UpdateDiagnostic` holds what is shared by every batch of one snapshot (fp32
clones of theta and S, the NLL of theta itself); `compare_updates` is the
one-shot wrapper. Neither touches the model or the optimizer: all forwards go
through `torch.func.functional_call` on clones (diag/arithmetic/sharded.py: the same for
an FSDP2-sharded model). A unit streams its updates (`compare`): besides those
clones it holds at most two updates and one gradient at a time.

A model from another codebase is measured or refused, never silently mismeasured; each
problem is a one-sentence InputError naming the fix: a forward that takes no `depth_kwarg`,
or whose output does not change with it even with its weights perturbed (a `**kwargs` forward
swallows a wrong keyword), an output that is neither logits nor an object with `.logits` (a
family's `logits_from` says where they are), token ids beyond the logits' last dimension,
trainable parameters that get no gradient at an update depth (the fix fitting what further
forwards find: a loop run without gradient for an integer depth, backprop truncated by the
forward itself, or parameters the loss never reaches). A model whose output does not change
with depth at the diagnosed weights only (a fresh model with zero-initialised output
projections) is diagnosed, with an UnchangedByDepthWarning.

Every forward runs from a fixed random stream (common random numbers, `CRN_SEED`), so a model
that draws noise in its forward (a random initial state) is compared fairly and reproducibly,
and the caller's RNG states are left as they were; the unit's `random_forward` attribute says
whether the forward drew any. Such a model is evaluated one sequence at a time, each
(sequence, serving depth) forward from the stream of its sequence (`sequence_seed`), so its
numbers do not depend on the serving depths asked for, the evaluation batch size or the
process. `compare_updates` warns (BiasCorrectionWarning) when Adam's state is too young for
the comparison to mean much.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import xarray as xr
from torch import Tensor

from common.benefit import benefit_description
from common.choices import ISOLATE_CHOICES, PRECISION_CHOICES, RMS_MATCH_CHOICES
from common.depths import SERVING_DEPTHS, UPDATE_DEPTHS, checked_depths
from common.errors import InputError
from diag.arithmetic.families import ModelFamily, keyword_family
from diag.arithmetic.measures import SumOverRanks, geomean_rms, global_cosine, global_rms, scale_ratio, tensor_rms
from diag.arithmetic.model_checks import (
    UNREACHED_FIX,
    BiasCorrectionWarning,
    UnchangedByDepthWarning,
    accepted_keywords,
    bias_correction_message,
    check_depth_kwarg,
    check_vocabulary,
    checked_tokens,
    no_gradient_message,
    with_perturbed_weights,
)
from diag.arithmetic.optim_step import OptimizerStep, fp32_clone, optimizer_step
from diag.arithmetic.random_streams import common_random_numbers, rng_states, sequence_seed
from diag.arithmetic.target_groups import TargetGroups, group_nll_sums, group_variables
from trainer.loss import clip_gradients_, counted_targets, forward_precision, summed_token_loss
from trainer.model import IGNORE_INDEX, LoopedTransformer
from trainer.scoring import chunk_counts, mean_nll_by_depth, nll_by_depth


@dataclass(frozen=True)
class DiagnosticOptions:
    update_depths: tuple[int, ...] = UPDATE_DEPTHS
    """Depths the update is computed at; the first is the reference, benefit is against the last."""
    serving_depths: tuple[int, ...] = SERVING_DEPTHS
    """Depths every updated model is evaluated at."""
    depth_kwarg: str = "depth"
    """Keyword the model's forward takes the depth as, one int, full backprop; `family` says more."""
    family: ModelFamily | None = None
    """How to call the model for a gradient and an evaluation at a depth (diag/arithmetic/families.py,
    e.g. diag.HUGINN: a pair num_steps, truncated backprop); None: `depth_kwarg`."""
    isolate: str = "counterfactual"
    """'counterfactual': Delta(g) - Delta(0); 'none': Delta(g); 'linear': first-order term of Delta at 0."""
    rms_match: str = "reference"
    """'reference' (to the first depth's RMS), 'geomean' (to the geometric mean), 'none', 'per-tensor'."""
    lr: float | None = None
    """Learning rate of the step; None uses each param group's own."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this, as training does; None or 0 disables."""
    precision: str = "fp32"
    """'fp32' or 'bf16' (autocast) for the gradient passes, as in training; evaluation is fp32."""
    eval_batch_size: int = 32
    """Rows of the evaluation set per forward pass (1 for a model whose forward draws random
    numbers, whatever this says: see `UpdateDiagnostic.evaluate`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "update_depths", checked_depths(self.update_depths, "update_depths"))
        object.__setattr__(self, "serving_depths", checked_depths(self.serving_depths, "serving_depths"))
        if len(self.update_depths) < 2:
            raise InputError(f"update_depths needs at least two depths to compare, got {list(self.update_depths)}")
        if not self.serving_depths:
            raise InputError("serving_depths must not be empty")
        if not self.depth_kwarg.isidentifier():
            raise InputError(f"depth_kwarg must be a keyword name, got {self.depth_kwarg!r}")
        if self.family is not None:
            if not isinstance(self.family, ModelFamily):
                raise InputError(f"family must be a diag.ModelFamily, got {type(self.family).__name__}")
            if self.depth_kwarg not in ("depth", self.family.depth_kwarg):
                raise InputError(
                    f"depth_kwarg={self.depth_kwarg!r} contradicts family {self.family.name!r}, whose depth "
                    f"keyword is {self.family.depth_kwarg!r}: give one or the other"
                )
        if self.isolate not in ISOLATE_CHOICES:
            raise InputError(f"isolate must be one of {ISOLATE_CHOICES}, got {self.isolate!r}")
        if self.rms_match not in RMS_MATCH_CHOICES:
            raise InputError(f"rms_match must be one of {RMS_MATCH_CHOICES}, got {self.rms_match!r}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"lr must be a positive number, got {self.lr!r}")
        if self.grad_clip is not None and not self.grad_clip >= 0:
            raise InputError(f"grad_clip must be >= 0, got {self.grad_clip!r}")
        if self.precision not in PRECISION_CHOICES:
            raise InputError(f"precision must be one of {PRECISION_CHOICES}, got {self.precision!r}")
        if self.eval_batch_size < 1:
            raise InputError(f"eval_batch_size must be >= 1, got {self.eval_batch_size}")


# --- pure update arithmetic --------------------------------------------------------------------


# --- the diagnostic ----------------------------------------------------------------------------


@contextlib.contextmanager
def module_mode(model: nn.Module, *, training: bool) -> Iterator[None]:
    """Gradients in training mode and evaluations in eval mode (dropout, for models that
    have it), as training and evaluation would run them; every submodule's own mode is
    restored afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


class UpdateDiagnostic:
    """Everything one snapshot's units share: clones of theta and the optimizer state,
    and the NLL of theta itself (computed once, on first use).

    Build it from the model and the optimizer as they are at the snapshot; later changes
    to either are not seen. `compare(batch)` runs one unit.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        eval_tokens: Tensor,
        options: DiagnosticOptions = DiagnosticOptions(),
        eval_mask: Tensor | None = None,
        eval_groups: Sequence[TargetGroups] = (),
    ):
        self.model = model
        self.options = options
        self.step: OptimizerStep = optimizer_step(optimizer, options.lr)
        names_by_id = {id(p): name for name, p in model.named_parameters()}
        stepped = []
        for p in self.step.params:
            if id(p) not in names_by_id:
                raise InputError("the optimizer holds a parameter that is not one of the model's parameters")
            stepped.append(names_by_id[id(p)])
        if len(set(stepped)) != len(stepped):
            raise InputError("the optimizer lists a parameter more than once")
        # The optimizer's clones are the same numbers: share them instead of holding two copies.
        shared = dict(zip(stepped, self.step.theta))
        values = {name: shared[name] if name in shared else fp32_clone(p) for name, p in model.named_parameters()}
        self.theta: dict[str, Tensor] = values
        """Parameter name -> fp32 clone (deduplicated names, as named_parameters gives them)."""
        self.stepped: list[str] = stepped
        """Names of the optimizer's parameters, in its flat order."""
        self.requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
        self.buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        self.device = next(iter(values.values())).device if values else torch.device("cpu")
        self.eval_tokens = checked_tokens(eval_tokens, "eval_tokens").to(self.device)
        self.family: ModelFamily = options.family or keyword_family(options.depth_kwarg)
        """How the model is called for a gradient and for an evaluation at a depth."""
        check_depth_kwarg(model, self.family.depth_kwarg)
        self.vocab_size, self.random_forward = self._probe()
        """V: the last dimension of the model's logits (every token id must be below it), and
        whether the forward draws random numbers."""
        check_vocabulary(self.eval_tokens, "eval_tokens", self.vocab_size)
        targets = self.eval_tokens[:, 1:]
        if eval_mask is not None:
            if not torch.is_tensor(eval_mask) or eval_mask.dtype != torch.bool or eval_mask.shape != targets.shape:
                raise InputError(
                    f"eval_mask must be a bool tensor of the targets' shape {list(targets.shape)} (eval_tokens[:, 1:])"
                )
            targets = targets.masked_fill(~eval_mask.to(self.device), IGNORE_INDEX)
        self.eval_targets = targets
        """int64 [E, T]: the evaluation targets, IGNORE_INDEX where eval_mask leaves a token out."""
        names = [grouping.name for grouping in eval_groups]
        if len(set(names)) != len(names):
            raise InputError(f"eval_groups: each grouping needs a name of its own, got {names}")
        self.eval_groups = [(grouping, grouping.for_targets(targets)) for grouping in eval_groups]
        """Each grouping of the targets with its ids on the targets (-1 where not counted)."""
        # Counted targets per evaluation chunk, read once: every evaluation reuses them, and
        # reading them per chunk would stall the device on each one.
        self._chunk_counts = chunk_counts(self.eval_targets, options.eval_batch_size)
        if sum(self._chunk_counts) == 0:
            raise InputError("the evaluation set has no counted target (all IGNORE_INDEX or masked out)")
        if self.random_forward:
            # Evaluated one sequence at a time (`evaluate`): each sequence's counted targets and seed.
            self._sequence_counts = chunk_counts(self.eval_targets, 1)
            self._sequence_seeds = [sequence_seed(index) for index in range(len(self.eval_targets))]
        self._nll_before: np.ndarray | None = None
        self._group_sums_before: list[np.ndarray] | None = None
        self._unreached_at_depth_one: frozenset[str] | None = None
        """The trainable parameters the gradient at depth 1 does not reach (read when needed)."""

    sum_over_ranks: SumOverRanks | None = None
    """None: the update is whole here; a sharded diagnostic sums its reductions over the ranks."""

    # --- pieces, each usable on its own ---

    def module_state(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """What `torch.func.functional_call` takes: `params` and fresh clones of the buffers."""
        # Fresh buffer clones per call: a module that writes its buffers in forward
        # (running statistics) must not leak one pass into the next.
        return {**params, **{name: b.clone() for name, b in self.buffers.items()}}

    def _probe(self) -> tuple[int, bool]:
        """(the last dimension of the model's logits, whether its forward draws random numbers),
        from forwards of token id 0 at the shallowest and the deepest depth of the comparison:
        the width is known before any token reaches the embedding, so a foreign vocabulary is
        named instead of failing as an index error deep in the model, and a depth keyword the
        forward ignores (swallowed by `**kwargs`) is refused. The input has an evaluation
        chunk's shape, which compiled blocks have a graph for anyway. A LoopedTransformer needs
        no probe: its width is its config's vocab_size, its depth keyword its own, and its
        forward deterministic (noise comes from a generator seeded per call); the forwards
        would otherwise cost every monitor check two more evaluation chunks."""
        if isinstance(self.model, LoopedTransformer):
            return self.model.config.vocab_size, False
        rows = min(self.options.eval_batch_size, self.eval_tokens.shape[0])
        probe = torch.zeros(rows, self.eval_tokens.shape[1] - 1, dtype=torch.long, device=self.device)
        depths = sorted({*self.options.serving_depths, *self.options.update_depths})
        outputs, random = [], False
        for depth in dict.fromkeys((depths[0], depths[-1])):
            logits, drew = self._probe_forward(self.theta, probe, depth)
            random = random or drew
            if logits.dim() != 3 or logits.shape[:2] != probe.shape:
                raise InputError(
                    f"the model's forward returned logits of shape {list(logits.shape)} for input ids of shape "
                    f"{list(probe.shape)}; it must return logits [B, T, V], one row of V per input token"
                )
            outputs.append(logits)
        if len(outputs) == 2 and torch.equal(outputs[0], outputs[1]):
            self._tell_an_ignored_keyword_from_an_unused_depth(probe, depths[0], depths[-1])
        return int(outputs[0].shape[-1]), random

    def _probe_forward(self, params: dict[str, Tensor], probe: Tensor, depth: int) -> tuple[Tensor, bool]:
        """The logits of the model with `params` on `probe` at serving depth `depth`, and whether
        the forward drew random numbers."""
        with torch.no_grad(), module_mode(self.model, training=False), common_random_numbers():
            before = rng_states()
            call = self.family.eval_call(depth)
            output = torch.func.functional_call(self.model, self.module_state(params), (probe,), call)
            drew = any(not torch.equal(a, b) for a, b in zip(before, rng_states()))
        return self.family.logits(output), drew

    def _tell_an_ignored_keyword_from_an_unused_depth(self, probe: Tensor, shallow: int, deep: int) -> None:
        """The output is the same at depths `shallow` and `deep`. The same forwards with every
        weight perturbed tell why: a keyword that sets the number of loop iterations changes the
        output of almost any weights, so an output that stays the same means the keyword does not
        reach the loop (refused), and one that changes means the weights do not use their depth
        yet (zero-initialised output projections leave the state as it was at every iteration:
        warned, and diagnosed, since an update from such a state is well defined)."""
        keyword, name = self.family.depth_kwarg, type(self.model).__name__
        perturbed = with_perturbed_weights(self.theta)
        if torch.equal(
            self._probe_forward(perturbed, probe, shallow)[0], self._probe_forward(perturbed, probe, deep)[0]
        ):
            raise InputError(
                f"depth_kwarg={keyword!r}: {name}'s output is the same at {keyword}={shallow} and {deep}, and stays "
                f"the same with every weight perturbed, so the keyword does not set its depth (its forward accepts "
                f"{accepted_keywords(self.model)}); name the keyword that sets the number of loop iterations, "
                "e.g. depth_kwarg='num_steps' for Huginn-style models"
            )
        warnings.warn(
            f"{name}'s output is the same at {keyword}={shallow} and {deep} at these weights, though {keyword} sets "
            "its depth (with the weights perturbed the output changes with it): the model does not use its depth "
            "yet (e.g. zero-initialised output projections), so it scores alike at every serving depth before "
            "the update",
            UnchangedByDepthWarning,
            stacklevel=2,
        )

    def check_batch(self, batch: Tensor, name: str = "batch") -> Tensor:
        """`batch` as int64 on the model's device; InputError unless it is token ids [B, T+1]
        that the model's logits cover."""
        batch = checked_tokens(batch, name).to(self.device)
        check_vocabulary(batch, name, self.vocab_size)
        return batch

    def gradient(self, batch: Tensor, depth: int) -> tuple[float, list[Tensor]]:
        """Training loss at `depth` on `batch` [B, T+1] and its gradient for the optimizer's
        parameters (fp32, flat order; zeros where a parameter gets none: a frozen one, or one
        the family's truncated backprop leaves out), clipped over all parameters as
        `clip_grad_norm_(model.parameters())` does in training."""
        loss, by_name = self.reached_gradients(batch, depth)
        clip_gradients_(list(by_name.values()), self.options.grad_clip)  # fresh tensors: scaled in place
        return float(loss.detach()), self.flat(by_name)

    def reached_gradients(self, batch: Tensor, depth: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Training loss at `depth` on `batch` [B, T+1] and its unclipped gradient for every
        trainable parameter it reaches, by name; InputError where it reaches fewer than
        training at that depth does."""
        batch = self.check_batch(batch)
        loss, trainable, grads = self._loss_and_gradients(batch, self.family.gradient_call(depth))
        missing = [name for name, g in zip(trainable, grads) if g is None]
        if missing and not self._left_out_by_truncation(batch, depth, missing):
            fix = self._no_gradient_fix(batch, depth, missing)
            raise InputError(no_gradient_message(missing, len(trainable), depth, fix))
        return loss, {name: g for name, g in zip(trainable, grads) if g is not None}

    def flat(self, by_name: dict[str, Tensor]) -> list[Tensor]:
        """Gradients by name as the optimizer's flat list (fp32; zeros where one is missing)."""
        return [by_name[n].float() if n in by_name else torch.zeros_like(self.theta[n]) for n in self.stepped]

    def _loss_and_gradients(self, batch: Tensor, call: dict) -> tuple[Tensor, list[str], Sequence[Tensor | None]]:
        """Training's loss on `batch` of one forward with the keywords `call`, the names of the
        trainable parameters and their gradients (None where the loss does not reach one)."""
        # a caller's no_grad must not leave the loss without a graph
        with torch.enable_grad(), common_random_numbers():
            leaves, trainable, logits = self.training_logits(batch[:, :-1], call)
            # Training's loss (trainer/loss.py): summed, then divided by the counted targets.
            loss = summed_token_loss(logits, batch[:, 1:]) / float(counted_targets(batch))
            if not loss.requires_grad:  # the whole forward ran without gradient
                return loss, trainable, [None] * len(trainable)
            grads = torch.autograd.grad(loss, [leaves[n] for n in trainable], allow_unused=True)
        return loss, trainable, grads

    def training_logits(self, inputs: Tensor, call: dict) -> tuple[dict[str, Tensor], list[str], Tensor]:
        """One training forward (train mode, the run's precision) of `inputs` [B, T] with the
        keywords `call`, from fresh leaf clones of theta: the leaves, the names of the trainable
        ones, and the logits [B, T, V]. Gradients need torch.enable_grad() around it."""
        leaves = {name: t.detach().requires_grad_(self.requires_grad[name]) for name, t in self.theta.items()}
        trainable = [name for name in leaves if self.requires_grad[name]]
        with forward_precision(self.device.type, self.options.precision), module_mode(self.model, training=True):
            output = torch.func.functional_call(self.model, self.module_state(leaves), (inputs,), call)
        return leaves, trainable, self.family.logits(output)

    def _unreached(self, batch: Tensor, call: dict) -> set[str]:
        """The trainable parameters the loss of a forward with the keywords `call` does not reach."""
        _, trainable, grads = self._loss_and_gradients(batch, call)
        return {name for name, g in zip(trainable, grads) if g is None}

    def _unreached_at_one(self, batch: Tensor) -> frozenset[str]:
        """The trainable parameters the gradient at depth 1 does not reach. At depth 1 the only
        iteration carries gradient under any truncation, so this is every parameter the loss
        reaches at all; which ones does not depend on the batch: read once."""
        if self._unreached_at_depth_one is None:
            self._unreached_at_depth_one = frozenset(self._unreached(batch, self.family.gradient_call(1)))
        return self._unreached_at_depth_one

    def _left_out_by_truncation(self, batch: Tensor, depth: int, missing: list[str]) -> bool:
        """Whether the family's truncated backprop leaves the parameters `missing` out at `depth`
        as training at that depth does: the gradient flows through fewer iterations than `depth`,
        and at depth 1 it reaches them, so they act only before the iterations that carry it."""
        window = self.family.backprop_depth
        return window is not None and depth > window and not set(missing) & self._unreached_at_one(batch)

    def _no_gradient_fix(self, batch: Tensor, depth: int, missing: list[str]) -> str:
        """What to do about parameters that get no gradient at `depth`, from further forwards:
        the depth keyword given as a pair (iterations without, iterations with gradient) reaching
        every parameter means a forward that runs its loop without gradient for an int (Huginn's
        convention); the gradient at depth 1 reaching them means backprop truncated to the last
        iterations, which they do not act in; reached at neither, the loss never reaches them."""
        family, keyword = self.family, self.family.depth_kwarg
        if not family.pair_depth and self._reaches_every_parameter(
            batch, {**family.gradient_call(depth), keyword: (0, depth)}
        ):
            return (
                f"the forward runs its loop without gradient for an integer {keyword} and with gradient for a pair "
                "(iterations without, iterations with), as a Huginn-convention forward does; call it as it trains, "
                "through a pair-depth family: family=diag.HUGINN (--family huginn), or "
                f"ModelFamily(..., depth_kwarg={keyword!r}, pair_depth=True, backprop_depth=n) (docs/diagnostic.md)"
            )
        if depth > 1 and not set(missing) & self._unreached_at_one(batch):
            return (
                "they get one at depth 1: only the last iterations of the forward carry gradient (backprop "
                "truncated by the forward itself) and they act only in earlier ones; if the model trains so, say how "
                f"many iterations carry gradient in its family, ModelFamily(..., depth_kwarg={keyword!r}, "
                "backprop_depth=k) without pair_depth, and beyond depth k they get the zero gradient training gives "
                "them (docs/diagnostic.md)"
            )
        return f"they get none at depth 1 either: {UNREACHED_FIX}"

    def _reaches_every_parameter(self, batch: Tensor, call: dict) -> bool:
        """Whether the loss of a forward with the keywords `call` reaches every trainable parameter;
        False when the forward fails: a forward that takes no such call fails in its own way (a
        TypeError, a shape error, an assertion), which only says the call is not its convention."""
        try:
            return not self._unreached(batch, call)
        except Exception:
            return False

    @property
    def delta0(self) -> list[Tensor]:
        """Delta(0): the step with a zero gradient (momentum drift and weight decay); computed
        on each use (`update` subtracts it parameter by parameter and never holds it whole)."""
        return self.step.delta([torch.zeros_like(t) for t in self.step.theta])

    def update(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """u for one gradient under the chosen isolation (fp32, optimizer's flat order)."""
        if self.options.isolate == "linear":
            return self.step.linear(grads, self.sum_over_ranks)
        if self.options.isolate == "none":
            return self.step.delta(grads)
        return self.step.counterfactual(grads)

    def evaluate(self, update: Sequence[Tensor] | None = None) -> np.ndarray:
        """Mean token NLL of theta + update on the evaluation set at every serving depth
        (float64 [S]), token-weighted over chunks of rows (trainer/scoring.py); for a model whose
        forward draws random numbers, over sequences evaluated one at a time
        (`_nll_sequence_by_sequence`)."""
        state = functools.partial(self.module_state, self._updated(update))
        with module_mode(self.model, training=False), common_random_numbers() as reseed:
            if self.random_forward:
                nll = self._nll_sequence_by_sequence(state, reseed)
            else:
                nll = mean_nll_by_depth(
                    self.model,
                    self.eval_tokens,
                    list(self.options.serving_depths),
                    targets=self.eval_targets,
                    batch_size=self.options.eval_batch_size,
                    counts=self._chunk_counts,
                    state=state,
                    depth_call=self.family.eval_call,
                    logits_of=self.family.logits,
                )
        return nll.cpu().numpy()

    @torch.no_grad()
    def _nll_sequence_by_sequence(
        self, state: Callable[[], dict[str, Tensor]], reseed: Callable[[int], None]
    ) -> Tensor:
        """The evaluation of a model whose forward draws random numbers: one forward per
        (sequence, serving depth) of that sequence alone, each from the random stream of the
        sequence (`sequence_seed` of its row), so that the noise a sequence gets at a depth
        depends on its row, the depth and CRN_SEED only, never on the other depths asked for, the
        rows evaluated with it or the process (a batched forward's noise would: row i of a batch
        draws from where the rows before it stopped). Each sequence's mean NLL is weighted by its
        counted targets, in float64. The price: E x S forwards of one row instead of
        ceil(E / eval_batch_size) x S of many (docs/diagnostic.md)."""
        depths = list(self.options.serving_depths)
        totals = torch.zeros(len(depths), dtype=torch.float64, device=self.device)
        for index, count in enumerate(self._sequence_counts):
            if count == 0:
                continue
            inputs, targets = self.eval_tokens[index : index + 1, :-1], self.eval_targets[index : index + 1]
            for position, depth in enumerate(depths):
                reseed(self._sequence_seeds[index])
                nll = nll_by_depth(
                    self.model,
                    inputs,
                    targets,
                    [depth],
                    state=state,
                    depth_call=self.family.eval_call,
                    logits_of=self.family.logits,
                )
                totals[position] += nll[0].double() * count
        return totals / sum(self._sequence_counts)

    @property
    def nll_before(self) -> np.ndarray:
        """NLL of theta itself at every serving depth (float64 [S]), computed once."""
        if self._nll_before is None:
            self._nll_before = self.evaluate(None)
        return self._nll_before

    def group_nll_sums(self, update: Sequence[Tensor] | None = None) -> list[np.ndarray]:
        """Summed NLL of every group of every grouping (`eval_groups`) of theta + update at every
        serving depth: one float64 [S, G] per grouping (diag/arithmetic/target_groups.py)."""
        with module_mode(self.model, training=False):
            return group_nll_sums(self, functools.partial(self.module_state, self._updated(update)))

    def _updated(self, update: Sequence[Tensor] | None) -> dict[str, Tensor]:
        """theta + update, by parameter name (theta itself for None)."""
        params = dict(self.theta)
        if update is not None:
            for name, u in zip(self.stepped, update):
                params[name] = params[name] + u
        return params

    @property
    def group_sums_before(self) -> list[np.ndarray]:
        """`group_nll_sums` of theta itself, computed once."""
        if self._group_sums_before is None:
            self._group_sums_before = self.group_nll_sums(None)
        return self._group_sums_before

    def with_isolation(self, isolate: str) -> UpdateDiagnostic:
        """This diagnostic with another isolation; its clones and the NLL before are shared."""
        other = copy.copy(self)
        other.options = dataclasses.replace(self.options, isolate=isolate)
        return other

    # --- one unit ---

    def compare(self, batch: Tensor) -> xr.Dataset:
        """Run the diagnostic on one batch [B, T+1]; see the module docstring.

        Streaming: an update is scaled in place and evaluated as soon as its RMS match is
        known, then freed, so besides Delta(0) at most two updates are alive (the reference,
        which the cosine reads at the last depth, and the current one); rms_match='geomean'
        needs every RMS first and holds every update."""
        opts = self.options
        last = len(opts.update_depths) - 1
        losses, raw_rms, scales, nll = [], [], [], []
        grouped: list[list[np.ndarray]] = []  # [update depth][grouping] -> summed NLL [S, G]
        held: list[list[Tensor]] = []
        reference: list[Tensor] = []
        reference_tensor_rms: list[float] = []
        cosine = math.nan
        for i, depth in enumerate(opts.update_depths):
            loss, grads = self.gradient(batch, depth)
            update = self.update(grads)
            del grads
            losses.append(loss)
            raw_rms.append(global_rms(update, self.sum_over_ranks))
            if i == 0:
                reference = update
                if opts.rms_match == "per-tensor":
                    reference_tensor_rms = tensor_rms(update, self.sum_over_ranks)
            if i == last:
                cosine = global_cosine(reference, update, self.sum_over_ranks)
            if opts.rms_match == "geomean":
                held.append(update)
                continue
            # The reference's own scale is exactly 1 in every mode: it is evaluated unscaled and
            # kept for the cosine.
            scales.append(self._scale_(update, raw_rms[i], raw_rms[0], reference_tensor_rms) if i else 1.0)
            nll.append(self.evaluate(update))
            grouped.append(self.group_nll_sums(update) if self.eval_groups else [])
            del update
        if held:
            target = geomean_rms(raw_rms)
            del reference
            for i in range(len(held)):
                update, held[i] = held[i], []
                scales.append(scale_ratio(target, raw_rms[i]))
                for t in update:
                    t.mul_(scales[-1])
                nll.append(self.evaluate(update))
                grouped.append(self.group_nll_sums(update) if self.eval_groups else [])
                del update
        ds = self._dataset(np.stack(nll), losses, raw_rms, scales, cosine)  # nll [update_depth, serving_depth]
        if not self.eval_groups:
            return ds
        return ds.assign(group_variables(self.eval_groups, grouped, self.group_sums_before))

    def _scale_(
        self, update: list[Tensor], rms: float, reference_rms: float, reference_tensor_rms: list[float]
    ) -> float:
        """Scale `update` in place to the reference (rms_match 'reference', 'per-tensor'; 'none'
        leaves it); returns its global scale RMS(scaled) / RMS(update), as `match_rms` does."""
        mode = self.options.rms_match
        if mode == "none":
            return 1.0
        if mode == "reference":
            scale = scale_ratio(reference_rms, rms)
            for t in update:
                t.mul_(scale)
            return scale
        own = tensor_rms(update, self.sum_over_ranks)
        for t, r, o in zip(update, reference_tensor_rms, own):
            t.mul_(scale_ratio(r, o))
        return scale_ratio(global_rms(update, self.sum_over_ranks), rms)

    def _dataset(
        self, nll: np.ndarray, losses: list[float], raw_rms: list[float], scales: list[float], cosine: float
    ) -> xr.Dataset:
        opts = self.options
        ud, sd = ("update_depth",), ("serving_depth",)
        variables = {
            "nll": (ud + sd, nll),
            "nll_before": (sd, self.nll_before),
            "benefit": (sd, nll[0] - nll[-1]),
            "update_rms": (ud, np.asarray(raw_rms, dtype=np.float64)),
            "rms_scale": (ud, np.asarray(scales, dtype=np.float64)),
            "update_cosine": ((), np.float64(cosine)),
            "train_loss": (ud, np.asarray(losses, dtype=np.float64)),
        }
        if len(opts.update_depths) > 2:
            variables["benefit_all"] = (ud + sd, nll[0][None, :] - nll)
        lrs = self.step.lrs
        attrs = {
            "isolate": opts.isolate,
            "rms_match": opts.rms_match,
            "lr": lrs[0] if lrs else math.nan,
            "optimizer": self.step.optimizer_class,
            "grad_clip": float(opts.grad_clip or 0.0),
            "precision": opts.precision,
            "random_forward": int(self.random_forward),
        }
        if opts.family is not None:
            attrs["model_family"] = opts.family.name
            attrs["backprop"] = opts.family.backprop_text()
        if len(set(lrs)) > 1:
            attrs["group_lrs"] = json.dumps(lrs)
        ds = xr.Dataset(
            variables,
            coords={"update_depth": list(opts.update_depths), "serving_depth": list(opts.serving_depths)},
            attrs=attrs,
        )
        ds["benefit"].attrs["description"] = benefit_description(opts.update_depths[0], opts.update_depths[-1])
        return ds


def compare_updates(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Tensor,
    eval_tokens: Tensor,
    *,
    update_depths: Sequence[int] = UPDATE_DEPTHS,
    serving_depths: Iterable[int] = SERVING_DEPTHS,
    depth_kwarg: str = "depth",
    family: ModelFamily | None = None,
    isolate: str = "counterfactual",
    rms_match: str = "reference",
    lr: float | None = None,
    grad_clip: float | None = None,
    precision: str = "fp32",
    eval_batch_size: int = 32,
    eval_mask: Tensor | None = None,
) -> xr.Dataset:
    """The update diagnostic for one (snapshot, batch) unit; see `UpdateDiagnostic` and
    docs/diagnostic.md. `batch` [B, T+1] and `eval_tokens` [E, T+1] are token ids;
    `eval_mask` bool [E, T], when given, counts only the targets eval_tokens[:, 1:] it marks.
    The model and the optimizer are left bit-for-bit unchanged.

    Bad input is one InputError (a ValueError) naming the fix; an Adam state too young for
    the comparison to mean much is a BiasCorrectionWarning."""
    options = DiagnosticOptions(
        update_depths=tuple(update_depths),
        serving_depths=tuple(serving_depths),
        depth_kwarg=depth_kwarg,
        family=family,
        isolate=isolate,
        rms_match=rms_match,
        lr=lr,
        grad_clip=grad_clip,
        precision=precision,
        eval_batch_size=eval_batch_size,
    )
    diagnostic = UpdateDiagnostic(model, optimizer, eval_tokens, options, eval_mask=eval_mask)
    message = bias_correction_message(optimizer)
    if message is not None:
        warnings.warn(message, BiasCorrectionWarning, stacklevel=2)
    return diagnostic.compare(batch)
