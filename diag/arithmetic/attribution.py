"""The deep update's benefit attributed to training sequences, to first order. Formulas and
cost: docs/diagnostic.md.

For update depths (a, b), one batch of B sequences and weights theta with optimizer state S:

    g_K,i  = grad of sequence i's summed token loss at depth K / the batch's counted targets
             (sum over the batch's rows: g_K, the gradient the diagnostic uses)
    kappa_K = min(1, grad_clip / (||g_K|| + 1e-6))          the batch's clipping, held fixed
    J      = d Delta / d g at g = 0                           the step isolate='linear' applies
    c_K    = RMS-matching factor of u_K = J kappa_K g_K       (c_a = 1 under 'reference'), held fixed
    e_s    = grad of the evaluation NLL at serving depth s
    attribution(i, s) = e_s . J (c_a kappa_a g_a,i - c_b kappa_b g_b,i)
    linear_benefit(s) = e_s . (c_a u_a - c_b u_b)             = sum over the batch's rows

so a positive attribution says that sequence i pushes the deep update ahead at serving depth s.
The removal check tests the ranking against the diagnostic itself: the unit's benefit (default
isolation, nothing held fixed) with the quarter of the batch ranked highest at one serving depth
removed, the lowest quarter, and a random quarter.
The steps this applies to (Adam, AdamW, SGD) act element by element: J is diagonal, so
e_s . J x = (J e_s) . x, and one w_s = J e_s per serving depth scores every sequence with one
dot product per sequence and depth. Sequences of a pool beyond the batch are scored against the
same update (the same kappa, c and e), their gradients divided by the batch's counted targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr
from torch import Tensor
from tqdm.auto import tqdm

from common.depths import SERVING_DEPTHS, checked_depths
from common.errors import InputError
from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic, module_mode
from diag.arithmetic.families import ModelFamily
from diag.arithmetic.measures import matching_factors
from diag.arithmetic.optim_step import AdamStep, SGDStep
from diag.arithmetic.random_streams import common_random_numbers, sequence_seed
from trainer.loss import clip_coefficient, clip_gradients_, counted_targets, forward_precision, summed_token_loss
from trainer.model import IGNORE_INDEX, LoopedTransformer, RMSNorm

ATTRIBUTION_VARIABLES = (
    "attribution",
    "linear_benefit",
    "benefit_counterfactual",
    "clip_coefficient",
    "example_tokens",
    "removal_benefit",
    "removed_rows",
)
"""The variables `SequenceAttribution.unit` adds to a unit (the last two with a removal depth)."""

REMOVALS = ("top", "bottom", "random")
"""The removal check's subsets of a batch: its rows ranked highest, lowest, and at random."""

ATTRIBUTION_REMEDY = (
    "the attribution is first order by definition: attribute a later snapshot, where every value "
    "the sequences reach has been updated"
)
"""What the attribution says where Adam's step is not linear in the gradient (it has no other isolation)."""

REMOVAL_FRACTION = 0.25
"""The share of a batch's rows each removal takes out."""


def removed_rows(scores: np.ndarray, rng: np.random.Generator, fraction: float = REMOVAL_FRACTION) -> np.ndarray:
    """The rows of a batch the removal check takes out, one row per REMOVALS entry [3, m]: the m
    = round(fraction * B) highest `scores` [B], the m lowest (ties by row order), m drawn by
    `rng` without replacement. At least one row stays."""
    count = len(scores)
    m = min(max(1, round(fraction * count)), count - 1)
    if m < 1:
        raise InputError(f"the removal check needs a batch of at least two sequences, got {count}")
    highest = np.argsort(-scores, kind="stable")[:m]
    lowest = np.argsort(scores, kind="stable")[:m]
    return np.stack([highest, lowest, np.sort(rng.choice(count, size=m, replace=False))])


def attribute_benefit(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Tensor,
    eval_tokens: Tensor,
    *,
    update_depths: Sequence[int] = (4, 16),
    serving_depths: Sequence[int] = SERVING_DEPTHS,
    family: ModelFamily | None = None,
    depth_kwarg: str = "depth",
    grad_clip: float | None = None,
    rms_match: str = "reference",
    precision: str = "fp32",
    eval_mask: Tensor | None = None,
    lr: float | None = None,
    pool: Tensor | None = None,
    progress: bool = False,
) -> xr.Dataset:
    """Attribute the benefit of the update at `update_depths[-1]` over the one at
    `update_depths[0]` (isolate='linear') to the sequences of `batch` [B, T+1] and of `pool`
    [N, T+1]: `attribution(example, serving_depth)` (the batch's rows, then the pool's; coordinate
    `in_batch`), `linear_benefit(serving_depth)` (from the batch gradients, the sum of the batch
    rows' attributions), `clip_coefficient(update_depth)`, `example_tokens(example, token)`, beside
    the unit's own variables (`compare_updates`'s, isolate='linear': its `benefit` for comparison,
    `rms_scale` the fixed c). The other arguments mean what they mean for `diag.compare_updates`."""
    depths = checked_depths(update_depths, "update_depths")
    if len(depths) != 2:
        raise InputError(f"update_depths must be two depths (reference, deep), got {list(depths)}")
    options = DiagnosticOptions(
        update_depths=depths,
        serving_depths=tuple(serving_depths),
        depth_kwarg=depth_kwarg,
        family=family,
        isolate="linear",
        rms_match=rms_match,
        lr=lr,
        grad_clip=grad_clip,
        precision=precision,
    )
    diagnostic = UpdateDiagnostic(model, optimizer, eval_tokens, options, eval_mask)
    return SequenceAttribution(diagnostic).unit(batch, pool, progress=progress)


class SequenceAttribution:
    """The attribution units of one snapshot's diagnostic (isolate='linear', two update
    depths). What does not depend on the batch, e_s and w_s = J^T e_s at every serving depth,
    is computed on the first unit and kept (2 S copies of the trainable parameters). The dot
    products with w_s run in fp32, or float64 for a float64 model, and add up in float64 (fp32
    is three times faster than float64 and 1.7e-7 from it for the median sequence of
    configs/tiny-fp32.toml's model)."""

    def __init__(self, diagnostic: UpdateDiagnostic):
        options = diagnostic.options
        if options.isolate != "linear" or len(options.update_depths) != 2:
            raise InputError("attribution needs isolate='linear' and two update depths (reference, deep)")
        if not isinstance(diagnostic.step, (AdamStep, SGDStep)):
            raise InputError(
                "attribution needs a step that acts element by element (Adam, AdamW, SGD), "
                f"not {diagnostic.step.optimizer_class}"
            )
        self.diagnostic = diagnostic
        self._eval_gradients: list[list[Tensor]] = []  # e_s per serving depth, flat order
        self._directions: list[Tensor] = []  # per tensor: w_s stacked over serving depths [S, numel]

    def _serving_directions(self, bar) -> None:
        """e_s and w_s = J^T e_s at every serving depth, once."""
        if self._eval_gradients:
            return
        diagnostic = self.diagnostic
        directions = []
        for depth in diagnostic.options.serving_depths:
            e = diagnostic.flat(eval_gradient(diagnostic, depth))
            self._eval_gradients.append(e)
            directions.append(diagnostic.step.linear_transposed(e))
            bar.update()
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in diagnostic.theta.values()) else torch.float32
        self._directions = [
            torch.stack([w[t].flatten().to(dtype) for w in directions]) for t in range(len(directions[0]))
        ]

    def unit(
        self,
        batch: Tensor,
        pool: Tensor | None = None,
        *,
        removal_depth: int | None = None,
        removal_seed: int = 0,
        progress: bool = False,
    ) -> xr.Dataset:
        """The unit on `batch` and the attribution of its benefit to the rows of `batch` and
        `pool`: the unit's own variables and `attribution(example, serving_depth)`,
        `linear_benefit(serving_depth)`, `benefit_counterfactual(serving_depth)` (the unit's
        benefit under the default isolation, one more unit: how far the first order reaches),
        `clip_coefficient(update_depth)`, `example_tokens(example, token)` and the coordinate
        `in_batch(example)` (see `attribute_benefit`).

        With `removal_depth` (a serving depth), three more default units: `removal_benefit(removal,
        serving_depth)`, the benefit with the batch's `removed_rows(removal, removed)` taken out
        (REMOVALS: ranked highest and lowest by attribution at that depth, random by
        `removal_seed`)."""
        diagnostic, options = self.diagnostic, self.diagnostic.options
        batch = diagnostic.check_batch(batch)
        rows = [batch] if pool is None else [batch, diagnostic.check_batch(pool, "pool")]
        examples = sum(len(r) for r in rows)
        count = float(counted_targets(batch))
        first = not self._eval_gradients
        bar = tqdm(total=2 * examples + first * len(options.serving_depths), desc="attribute", disable=not progress)
        self._serving_directions(bar)

        # The update at each depth from the batch gradient, and the fixed clipping and RMS factors.
        clip, updates = [], []
        for depth in options.update_depths:
            _, by_name = diagnostic.reached_gradients(batch, depth)
            norm = clip_gradients_(list(by_name.values()), options.grad_clip)  # scaled by kappa in place
            clip.append(float(clip_coefficient(norm, options.grad_clip)))
            gradient = diagnostic.flat(by_name)
            diagnostic.step.refuse_where_not_linear(gradient, remedy=ATTRIBUTION_REMEDY)
            updates.append(diagnostic.step.linear(gradient))
        factors = matching_factors(updates, options.rms_match)
        difference = [fa * ua - fb * ub for fa, ua, fb, ub in zip(factors[0], updates[0], factors[1], updates[1])]
        del updates
        # linear_benefit from e_s itself (the sequences are scored with w_s = J^T e_s).
        linear_benefit = [_dot(e, difference) for e in self._eval_gradients]
        del difference

        attribution = self._scored_rows(rows, count, clip, factors, bar)
        bar.close()
        unit = diagnostic.compare(batch)
        default = diagnostic.with_isolation("counterfactual")
        default.eval_groups = []  # only its benefit is read: no group passes
        counterfactual = default.compare(batch)["benefit"]
        attribution = attribution.cpu().numpy()
        if removal_depth is not None:
            if removal_depth not in options.serving_depths:
                raise InputError(f"removal depth {removal_depth} is not one of the serving depths")
            column = list(options.serving_depths).index(removal_depth)
            removed = removed_rows(attribution[: len(batch), column], np.random.default_rng(removal_seed))
            kept = [np.setdiff1d(np.arange(len(batch)), rows) for rows in removed]
            unit = unit.assign(
                removal_benefit=(
                    ("removal", "serving_depth"),
                    np.stack([default.compare(batch[torch.as_tensor(k)])["benefit"].values for k in kept]),
                ),
                removed_rows=(("removal", "removed"), removed.astype(np.int64)),
            ).assign_coords(removal=list(REMOVALS))
        return unit.assign(
            attribution=(("example", "serving_depth"), attribution),
            linear_benefit=(("serving_depth",), np.array(linear_benefit)),
            benefit_counterfactual=counterfactual,
            clip_coefficient=(("update_depth",), np.array(clip)),
            example_tokens=(("example", "token"), torch.cat(rows).cpu().numpy()),
        ).assign_coords(example=np.arange(examples), in_batch=("example", np.arange(examples) < len(batch)))

    def _scored_rows(
        self, rows: list[Tensor], count: float, clip: list[float], factors: list[list[float]], bar
    ) -> Tensor:
        """attribution [example, S] of the rows of `rows` (the batch, then the pool), one group
        of their gradients at a time; the last group's gradients go when this returns, before the
        unit's own passes."""
        diagnostic, options = self.diagnostic, self.diagnostic.options
        batch = rows[0]
        attribution = torch.zeros(sum(len(r) for r in rows), len(options.serving_depths), dtype=torch.float64)
        saved = [row_activation_bytes(diagnostic, batch[0], depth) for depth in options.update_depths]
        for k, depth in enumerate(options.update_depths):
            weight = clip[k] * (1.0 if k == 0 else -1.0)
            for start, gradients in row_gradients(diagnostic, rows, depth, count, saved[k], max(saved)):
                if start + len(gradients[0]) > len(batch):
                    diagnostic.step.refuse_where_not_linear(gradients, remedy=ATTRIBUTION_REMEDY)
                scored = attribution[start : start + len(gradients[0])]  # [rows, S]
                for factor, w, g in zip(factors[k], self._directions, gradients):
                    scored += (weight * factor) * (g.flatten(1).to(w.dtype) @ w.T)
                bar.update(len(gradients[0]))
        return attribution


def _dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """sum over tensors of a . b, accumulated in float64."""
    return float(sum(torch.vdot(x.flatten().double(), y.flatten().double()) for x, y in zip(a, b)))


def eval_gradient(diagnostic: UpdateDiagnostic, depth: int) -> dict[str, Tensor]:
    """e_s: the gradient of the evaluation NLL at serving depth `depth` (mean over counted
    targets, eval mode, fp32) for every trainable parameter it reaches, by name; the same
    forwards as `UpdateDiagnostic.evaluate` (a model that draws random numbers: one sequence at
    a time, each from its own stream)."""
    call = diagnostic.family.full_gradient_call(depth)
    if call is None and isinstance(diagnostic.model, LoopedTransformer):
        call = diagnostic.family.eval_call(depth)  # its truncation is a setting `full_backprop` lifts
    if call is None:
        raise InputError(
            f"family {diagnostic.family.name!r}: the forward truncates backprop by itself, so the evaluation NLL's "
            "gradient would miss the iterations it runs without gradient; attribution needs a family whose "
            "gradient call says the truncation (pair_depth=True)"
        )
    rows = 1 if diagnostic.random_forward else diagnostic.options.eval_batch_size
    tokens, targets = diagnostic.eval_tokens, diagnostic.eval_targets
    total = float((targets != IGNORE_INDEX).sum())
    leaves = {n: t.detach().requires_grad_(diagnostic.requires_grad[n]) for n, t in diagnostic.theta.items()}
    trainable = [n for n in leaves if diagnostic.requires_grad[n]]
    summed: dict[str, Tensor] = {}
    with (
        torch.enable_grad(),
        module_mode(diagnostic.model, training=False),
        full_backprop(diagnostic.model),
        common_random_numbers() as reseed,
    ):
        for start in range(0, len(tokens), rows):
            if diagnostic.random_forward:
                reseed(sequence_seed(start))
            output = torch.func.functional_call(
                diagnostic.model,
                diagnostic.module_state(leaves),
                (tokens[start : start + rows, :-1],),
                call,
            )
            loss = summed_token_loss(diagnostic.family.logits(output), targets[start : start + rows]) / total
            if not loss.requires_grad:
                continue
            grads = torch.autograd.grad(loss, [leaves[n] for n in trainable], allow_unused=True)
            for name, g in zip(trainable, grads):
                if g is not None:
                    summed[name] = summed[name] + g if name in summed else g
    return summed


@contextlib.contextmanager
def full_backprop(model: torch.nn.Module) -> Iterator[None]:
    """A LoopedTransformer with truncated backprop (config.backprop_depth) backpropagates
    through every iteration inside the block; its config is restored afterwards."""
    if not isinstance(model, LoopedTransformer) or not model.config.backprop_depth:
        yield
        return
    config = model.config
    model.config = dataclasses.replace(config, backprop_depth=0)
    try:
        yield
    finally:
        model.config = config


ROW_GRADIENT_BYTES = 1 << 28
"""How much memory the per-sequence gradients of one group may hold (fp32)."""

VECTORISED_ACTIVATION_FACTOR = 2
"""A vectorised backward holds about this many times the activations autograd saves for its
rows' forward, besides one gradient per row (measured on configs/tiny-fp32.toml's model, per
row: 23.6 MB saved at depth 16 and 47.4 MB held in groups of 8 to 32; 7.0 and 17.2 MB at depth
4; a plain backward holds what it saved, 24.1 MB)."""

CAPTURED_ACTIVATION_FACTOR = 1
"""A captured backward (`_captured_row_gradients`) holds about the activations autograd saves for
its rows' forward, besides one gradient per row: it keeps each module's input where autograd
would have kept it for the parameter's gradient (measured on configs/tiny-fp32.toml's model at
depth 16: 32 rows hold 823 MB, 25.7 MB a row with its 3.8 MB gradient; the batch's plain backward
772 MB)."""


def saved_activation_bytes(forward: Callable[[], object], exclude: Iterable[Tensor] = ()) -> int:
    """The bytes autograd saves for the backward of `forward()` (run under torch.enable_grad()),
    each storage counted once and those of `exclude` (the parameters) not at all."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(saved.values())


def vectorised_rows(
    trainable_parameters: int, batch_rows: int, row_bytes: int, deep_row_bytes: int, activation_factor: int
) -> int:
    """The rows `row_gradients` takes in one group at an update depth whose forward saves
    `row_bytes` of activations per row, where the update depth that saves most (the deep one,
    unless a truncation says otherwise) saves `deep_row_bytes`: as many as ROW_GRADIENT_BYTES
    holds at 4 bytes per trainable parameter, and as many as fit, at `activation_factor` times
    their activations and one gradient each, in what the batch's own backward at that depth
    holds (so a pool needs no more memory than the unit); at least one, at most the batch's rows."""
    gradient = 4 * trainable_parameters
    fit = batch_rows * deep_row_bytes // (activation_factor * row_bytes + gradient)
    return max(1, min(batch_rows, ROW_GRADIENT_BYTES // gradient, fit))


def row_activation_bytes(diagnostic: UpdateDiagnostic, row: Tensor, depth: int) -> int:
    """What the training forward of one sequence `row` [T+1] at `depth` saves for its backward."""
    with common_random_numbers():
        return saved_activation_bytes(
            lambda: diagnostic.training_logits(row[None, :-1], diagnostic.family.gradient_call(depth)),
            exclude=diagnostic.theta.values(),
        )


def row_gradients(
    diagnostic: UpdateDiagnostic,
    chunks: Sequence[Tensor],
    depth: int,
    count: float,
    row_bytes: int,
    deep_row_bytes: int,
) -> Iterator[tuple[int, list[Tensor]]]:
    """g_K,i for the rows of `chunks` (the batch, then the pool), some rows at a time: (the index
    of the first row over all chunks, the gradients in flat order, each [rows, *shape], fp32), the
    gradient of each row's summed token loss at training depth `depth` divided by `count`. A
    group takes `vectorised_rows` rows (`row_bytes` and `deep_row_bytes`: what one row's forward
    saves at this depth and at the update depth that saves most).

    A LoopedTransformer's rows come from one batched forward and backward per group, each row's
    parameter gradients formed by hooks from its activations (`_captured_row_gradients`); a
    noisy initial state, drawn for the whole forward, puts the batch's rows in one group and the
    pool's in groups of as many, so that the rows' gradients sum to the batch's. Another model
    whose forward draws no random numbers runs `torch.func.vmap` of one row's gradient. One that
    draws random numbers (or one vmap cannot batch: it reads a value out of a tensor) runs the
    batch's rows as one forward, from the stream the diagnostic's gradient starts from, and the
    pool's in forwards of as many rows; then one backward per row."""
    batch_rows = len(chunks[0])
    trainable = sum(t.numel() for n, t in diagnostic.theta.items() if diagnostic.requires_grad[n])
    captured = _captures(diagnostic)
    vectorised = not captured and not diagnostic.random_forward
    factor = CAPTURED_ACTIVATION_FACTOR if captured else VECTORISED_ACTIVATION_FACTOR
    group = vectorised_rows(trainable, batch_rows, row_bytes, deep_row_bytes, factor)
    if captured and diagnostic.model.config.init_state != "zeros":
        group = batch_rows
    first = 0
    for chunk in chunks:
        start = 0
        while start < len(chunk):
            gradients = None
            if captured:
                gradients = _captured_row_gradients(diagnostic, chunk[start : start + group], depth, count)
            elif vectorised:
                try:
                    gradients = _vmapped_row_gradients(diagnostic, chunk[start : start + group], depth, count)
                except (RuntimeError, NotImplementedError):  # random draws, or an operation vmap cannot batch
                    vectorised = False
            if gradients is None:
                gradients = _batched_row_gradients(diagnostic, chunk[start : start + batch_rows], depth, count)
            yield first + start, gradients
            start += len(gradients[0])
        first += len(chunk)


def _vmapped_row_gradients(diagnostic: UpdateDiagnostic, part: Tensor, depth: int, count: float) -> list[Tensor]:
    """Each row's gradient by `torch.func.grad` of its loss, vectorised over the rows of `part`
    (random operations refused, so a forward that draws any raises instead of sharing draws)."""
    theta = {name: t.detach() for name, t in diagnostic.theta.items()}
    trainable = {name: t for name, t in theta.items() if diagnostic.requires_grad[name]}
    call = diagnostic.family.gradient_call(depth)

    def row_loss(params: dict[str, Tensor], row: Tensor) -> Tensor:  # row [T+1]
        state = diagnostic.module_state({**theta, **params})
        with forward_precision(diagnostic.device.type, diagnostic.options.precision):
            output = torch.func.functional_call(diagnostic.model, state, (row[None, :-1],), call)
        return summed_token_loss(diagnostic.family.logits(output), row[None, 1:]) / count

    with torch.enable_grad(), module_mode(diagnostic.model, training=True), warnings.catch_warnings():
        # torch's note that an operation (the CPU attention's backward) is vectorised by a loop:
        # measured, the groups still cost about one batched forward and backward (docs/diagnostic.md)
        warnings.filterwarnings("ignore", message="There is a performance drop", category=UserWarning)
        by_name = torch.func.vmap(torch.func.grad(row_loss), in_dims=(None, 0), randomness="error")(trainable, part)
    return [
        by_name[n].detach().float() if n in by_name else theta[n].new_zeros((len(part), *theta[n].shape)).float()
        for n in diagnostic.stepped
    ]


CAPTURED_MODULES = (torch.nn.Linear, torch.nn.Embedding, RMSNorm)
"""The modules whose parameters' per-sequence gradients `_captured_row_gradients` forms."""


def _parameter_owners(model: torch.nn.Module) -> dict[torch.nn.Module, dict[str, str]]:
    """Each module holding a trainable parameter -> {its attribute: the parameter's name}."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {
        module: own
        for module in model.modules()
        if (own := {a: names[id(p)] for a, p in module.named_parameters(recurse=False) if p.requires_grad})
    }


def _captures(diagnostic: UpdateDiagnostic) -> bool:
    """Whether `_captured_row_gradients` serves the diagnostic's model: a LoopedTransformer whose
    forward draws no random numbers, every trainable parameter the weight of a CAPTURED_MODULES
    module (a bias would have no hook)."""
    model = diagnostic.model
    return (
        isinstance(model, LoopedTransformer)
        and not diagnostic.random_forward
        and all(
            isinstance(m, CAPTURED_MODULES) and set(own) == {"weight"} for m, own in _parameter_owners(model).items()
        )
    )


def _captured_row_gradients(diagnostic: UpdateDiagnostic, part: Tensor, depth: int, count: float) -> list[Tensor]:
    """Each row's gradient from one batched forward and backward of `part` through a
    LoopedTransformer, whose parameters all sit in Linear, Embedding and RMSNorm modules. The
    parameters are held without gradient, so autograd differentiates the activations only (from
    the embedding's output on); hooks on those modules take each call's input and, in the
    backward, its output gradient, and form every row's parameter gradient from the two: for a
    Linear weight the row's output gradient [T, out] transposed times its input [T, in], one
    batched product per call, summed over the calls (the loop's iterations that carry gradient);
    for an RMSNorm weight the output gradient times the normalised input, summed over tokens; for
    the embedding the output gradient added into the rows of the row's tokens."""
    model = diagnostic.model
    owners = _parameter_owners(model)
    owners.setdefault(model.embed, {})  # the graph's root, whether its weight trains or not
    rows = len(part)
    sums: dict[str, Tensor] = {}

    def add(name: str, gradient: Tensor) -> None:  # gradient [rows, *shape]
        dtype = diagnostic.theta[name].dtype
        sums[name] = sums[name].add_(gradient) if name in sums else gradient.to(dtype)

    def hook(module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        own = owners[module]
        x = args[0].detach()
        if isinstance(module, torch.nn.Embedding):  # the graph's root: x [rows, T] token ids
            output = output.detach().requires_grad_()

            def backward(grad: Tensor) -> None:  # grad [rows, T, d] in the weight's dtype (theta's)
                if own:
                    weight = grad.new_zeros((rows, *module.weight.shape))
                    add(own["weight"], weight.scatter_add_(1, x[..., None].expand_as(grad), grad))

            output.register_hook(backward)
            return output
        if not output.requires_grad:  # an iteration truncated backprop runs without gradient
            return None
        if isinstance(module, RMSNorm):
            normalised = F.rms_norm(x.float(), module.normalized_shape, None, module.eps)  # [rows, T, d]

            def backward(grad: Tensor) -> None:
                add(own["weight"], (grad.float() * normalised).sum(1))

        else:  # a Linear
            x = x.to(output.dtype)  # under autocast the bf16 copy autograd would have kept, not the fp32 input

            def backward(grad: Tensor) -> None:  # grad [rows, T, out], x [rows, T, in]
                name, product = own["weight"], (grad.transpose(1, 2), x)
                if name in sums and sums[name].dtype == grad.dtype:  # accumulated in the product's pass
                    sums[name].baddbmm_(*product)
                else:
                    add(name, torch.bmm(*product))

        output.register_hook(backward)
        return None

    handles = [module.register_forward_hook(hook) for module in owners]
    try:
        held = {name: t.detach() for name, t in diagnostic.theta.items()}
        with (
            torch.enable_grad(),
            forward_precision(diagnostic.device.type, diagnostic.options.precision),
            module_mode(model, training=True),
        ):
            output = torch.func.functional_call(
                model, diagnostic.module_state(held), (part[:, :-1],), diagnostic.family.gradient_call(depth)
            )
            loss = summed_token_loss(diagnostic.family.logits(output), part[:, 1:]) / count
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return [
        sums[n].float() if n in sums else diagnostic.theta[n].new_zeros((rows, *diagnostic.theta[n].shape)).float()
        for n in diagnostic.stepped
    ]


def _batched_row_gradients(diagnostic: UpdateDiagnostic, part: Tensor, depth: int, count: float) -> list[Tensor]:
    """Each row's gradient by its own backward through one forward of `part` (the stream the
    diagnostic's gradient starts from)."""
    rows = []
    with torch.enable_grad(), common_random_numbers():
        leaves, trainable, logits = diagnostic.training_logits(part[:, :-1], diagnostic.family.gradient_call(depth))
        for row in range(len(part)):
            loss = summed_token_loss(logits[row : row + 1], part[row : row + 1, 1:]) / count
            grads = (
                torch.autograd.grad(loss, [leaves[n] for n in trainable], retain_graph=True, allow_unused=True)
                if loss.requires_grad
                else [None] * len(trainable)
            )
            rows.append(diagnostic.flat({n: g for n, g in zip(trainable, grads) if g is not None}))
    return [torch.stack(per_row) for per_row in zip(*rows)]
