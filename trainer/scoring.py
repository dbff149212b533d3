"""Scoring a model at many serving depths: logits and mean token NLL per depth, over
one batch or a whole evaluation set, and the bioS recall (trainer/data/bios.py).

Any model whose forward takes the depth as a keyword (`model(input_ids, depth=K)`,
or other keywords: `depth_call`) and returns logits [B, T, V] or an object with
`.logits` can be scored. A LoopedTransformer reads out every wanted depth from one
pass of max(depths) iterations (its `logits_by_depth` / `nll_by_depth`); other
models get one forward per depth.

The NLL functions can run the model with other weights than its own (`state`,
through `torch.func.functional_call`): the update diagnostic (diag/arithmetic/engine.py)
evaluates updated weights that way without touching the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from common.errors import InputError
from common.progress import track
from trainer.data.bios import ATTRIBUTES, BiosSource
from trainer.model import IGNORE_INDEX

StateFn = Callable[[], dict[str, Tensor]]
"""Gives the parameters and buffers (by state_dict name) to run a model with; called
once per forward, so that each forward can get fresh copies of buffers it may write."""


DepthCall = Callable[[int], dict[str, Any]]
"""The forward's keywords for serving at a depth (a model family's `eval_call`)."""

LogitsOf = Callable[[Any], Tensor]
"""The logits in a forward's output (a model family's `logits`; default `output_logits`)."""


def depth_keyword(depth: int) -> dict[str, Any]:
    """This project's convention: `model(input_ids, depth=K)`."""
    return {"depth": depth}


def output_logits(output) -> Tensor:
    """The logits of a forward's output: the output itself, or its `.logits`
    (Hugging Face style output objects); InputError naming the type for anything else."""
    logits = output.logits if hasattr(output, "logits") else output
    if not torch.is_tensor(logits):
        what = type(output).__name__ + (f" whose .logits is a {type(logits).__name__}" if logits is not output else "")
        raise InputError(
            f"the model's forward returned a {what}, not a tensor of logits or an object with a .logits tensor; "
            "wrap the model in a Module whose forward returns one of those"
        )
    return logits


class NllByDepth(nn.Module):
    """Routes forward to `model.nll_by_depth`, so `torch.func` (functional_call, vmap)
    can run the one-pass readout with substituted weights (named `model.<name>`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, targets: Tensor, depths: list[int]) -> Tensor:
        return self.model.nll_by_depth(input_ids, targets, depths)


def forward_per_depth(
    model: nn.Module,
    input_ids: Tensor,
    depths: Sequence[int],
    *,
    state: StateFn | None,
    depth_call: DepthCall,
    logits_of: LogitsOf = output_logits,
) -> Iterator[tuple[int, Tensor]]:
    """(depth, logits [B, T, V]) from one forward per depth, in the order given: the
    fallback for models without a one-pass readout."""
    for depth in depths:
        kwargs = depth_call(depth)
        if state is None:
            output = model(input_ids, **kwargs)
        else:
            output = torch.func.functional_call(model, state(), (input_ids,), kwargs)
        yield depth, logits_of(output)


def logits_by_depth(model: nn.Module, input_ids: Tensor, depths: Sequence[int]) -> Iterator[tuple[int, Tensor]]:
    """(depth, logits [B, T, V]) for each depth in increasing order: from one pass of the
    model's `logits_by_depth` when it has one, otherwise one forward per depth."""
    wanted = sorted(set(int(d) for d in depths))
    if hasattr(model, "logits_by_depth"):
        yield from model.logits_by_depth(input_ids, wanted)
        return
    yield from forward_per_depth(model, input_ids, wanted, state=None, depth_call=depth_keyword)


def nll_by_depth(
    model: nn.Module,
    input_ids: Tensor,
    targets: Tensor,
    depths: Sequence[int],
    *,
    state: StateFn | None = None,
    depth_call: DepthCall = depth_keyword,
    logits_of: LogitsOf = output_logits,
) -> Tensor:
    """Mean token NLL of `targets` [B, T] (IGNORE_INDEX skipped) given `input_ids` [B, T]
    at each depth, float32 [len(depths)] in the order given: from one pass of the model's
    `nll_by_depth` when it has one, otherwise one forward per depth (`logits_of` finding the
    logits in each output). With `state`, the model runs with those weights instead of its own."""
    depths = list(depths)
    if callable(getattr(model, "nll_by_depth", None)):
        if state is None:
            return model.nll_by_depth(input_ids, targets, depths)
        routed = {f"model.{name}": value for name, value in state().items()}
        return torch.func.functional_call(NllByDepth(model), routed, (input_ids, targets, depths))
    return torch.stack(
        [
            F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
            for _, logits in forward_per_depth(
                model, input_ids, depths, state=state, depth_call=depth_call, logits_of=logits_of
            )
        ]
    )


class TokenNllByDepth(nn.Module):
    """Routes forward to the one-pass readout of `model.logits_by_depth`, returning the NLL of
    every target at every depth [S, B, T] (float32, 0 where IGNORE_INDEX), so that
    `torch.func.functional_call` can run it with substituted weights (named `model.<name>`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, targets: Tensor, depths: list[int]) -> Tensor:
        nll = {s: _token_nll(logits, targets) for s, logits in self.model.logits_by_depth(input_ids, depths)}
        return torch.stack([nll[int(s)] for s in depths])


def _token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """NLL of every target [B, T] of `logits` [B, T, V], in fp32 (0 where IGNORE_INDEX)."""
    flat = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return flat.view(targets.shape)


def token_nll_by_depth(
    model: nn.Module,
    input_ids: Tensor,
    targets: Tensor,
    depths: Sequence[int],
    *,
    state: StateFn | None = None,
    depth_call: DepthCall = depth_keyword,
    logits_of: LogitsOf = output_logits,
) -> Tensor:
    """NLL of every target of `targets` [B, T] given `input_ids` [B, T] at each depth, float32
    [len(depths), B, T] (0 where IGNORE_INDEX): from one pass of the model's `logits_by_depth`
    when `nll_by_depth` takes that route too (the model has both), otherwise one forward per
    depth with `depth_call`, so that the two score the same forwards."""
    depths = list(depths)
    if callable(getattr(model, "nll_by_depth", None)) and callable(getattr(model, "logits_by_depth", None)):
        if state is None:
            return TokenNllByDepth(model)(input_ids, targets, depths)
        routed = {f"model.{name}": value for name, value in state().items()}
        return torch.func.functional_call(TokenNllByDepth(model), routed, (input_ids, targets, depths))
    return torch.stack(
        [
            _token_nll(logits, targets)
            for _, logits in forward_per_depth(
                model, input_ids, depths, state=state, depth_call=depth_call, logits_of=logits_of
            )
        ]
    )


def group_sums(token_nll: Tensor, groups: Tensor, n_groups: int) -> Tensor:
    """Summed NLL per group, float64 [S, n_groups], from the NLL of every target token_nll
    [S, B, T] and each target's group groups int64 [B, T] (-1: in no group)."""
    member = groups >= 0
    index = groups[member]  # [N]
    sums = torch.zeros(token_nll.shape[0], n_groups, dtype=torch.float64, device=token_nll.device)
    return sums.index_add_(1, index, token_nll[:, member].double())


def chunk_counts(targets: Tensor, batch_size: int) -> list[int]:
    """Counted targets (not IGNORE_INDEX) in each chunk of `batch_size` rows of `targets`
    [N, T]. Reading a count stalls the device, so callers that evaluate the same set
    many times read them once and pass them to `mean_nll_by_depth`."""
    return [int((rows != IGNORE_INDEX).sum()) for rows in targets.split(batch_size)]


@torch.no_grad()
def mean_nll_by_depth(
    model: nn.Module,
    tokens: Tensor,
    depths: Sequence[int],
    *,
    targets: Tensor | None = None,
    batch_size: int = 32,
    counts: Sequence[int] | None = None,
    state: StateFn | None = None,
    depth_call: DepthCall = depth_keyword,
    logits_of: LogitsOf = output_logits,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> Tensor:
    """Mean token NLL of an evaluation set at each depth, float64 [len(depths)] on `device`
    (default: the tokens' device).

    `tokens` int64 [N, T+1] give the inputs tokens[:, :-1]; the targets are tokens[:, 1:]
    or `targets` [N, T] (e.g. with some masked to IGNORE_INDEX). Chunks of `batch_size`
    rows go through `nll_by_depth` (with `state`, `depth_call`, `logits_of`); each chunk's mean is
    weighted by its counted targets (`counts`, from `chunk_counts` when not given) and
    accumulated in float64."""
    device = tokens.device if device is None else torch.device(device)
    targets = tokens[:, 1:] if targets is None else targets
    counts = chunk_counts(targets, batch_size) if counts is None else counts
    if sum(counts) == 0:
        raise InputError("evaluation set: no counted targets")
    total = torch.zeros(len(depths), dtype=torch.float64, device=device)
    chunks = list(zip(tokens.split(batch_size), targets.split(batch_size), counts))
    for rows, chunk_targets, count in track(chunks, len(chunks), "eval", "batch", enabled=progress):
        if count == 0:
            continue
        rows, chunk_targets = rows.to(device), chunk_targets.to(device)  # [b, T+1], [b, T]
        nll = nll_by_depth(
            model, rows[:, :-1], chunk_targets, depths, state=state, depth_call=depth_call, logits_of=logits_of
        )
        total += nll.double() * count
    return total / sum(counts)


# --- bioS recall ---------------------------------------------------------------------------


def score_recall(correct: np.ndarray, cardinalities: Sequence[int], min_templates: int = 4) -> float:
    """Recalled bits per person from exactness flags bool [people, attributes,
    templates]: a fact is recalled when exact on >= min_templates templates and
    is worth log2(cardinality) bits; the bits are averaged over people."""
    correct = np.asarray(correct, dtype=bool)
    if correct.ndim != 3 or correct.shape[1] != len(cardinalities):
        raise InputError(f"correct must be [people, {len(cardinalities)}, templates], got {correct.shape}")
    recalled = correct.sum(axis=2) >= min_templates  # [people, attributes]
    return float((recalled @ np.log2(np.asarray(cardinalities, dtype=np.float64))).mean())


def exact_values(logits: Tensor, tokens: Tensor, owner: Tensor, attributes: int) -> Tensor:
    """bool [rows, attributes]: whether the argmax of logits [rows, T, V] at every
    value token of an attribute (owner [rows, T]) names the token tokens [rows, T]."""
    wrong = logits[:, :-1].argmax(-1) != tokens[:, 1:]  # [rows, T-1]
    bins = torch.zeros(len(tokens), attributes + 1, dtype=torch.int64, device=tokens.device)
    bins.scatter_add_(1, owner[:, 1:] + 1, wrong.long())  # bin 0 collects non-value positions, ignored
    return bins[:, 1:] == 0


@torch.no_grad()
def recall_bits(
    model: nn.Module,
    source: BiosSource,
    depths: Sequence[int],
    *,
    device: str | torch.device = "cpu",
    batch_size: int = 512,
    progress: bool = False,
) -> dict[int, float]:
    """Recalled bits per person at each serving depth (greedy, teacher-forced; see
    trainer/data/bios.py). The model must already be on `device`; it is put in eval mode and
    restored afterwards."""
    spec = source.spec
    depths = sorted(set(int(d) for d in depths))
    if not depths:
        raise InputError("depths must not be empty")
    tokens, owner = source.recall_set()
    exact = torch.zeros(len(depths), len(tokens), len(ATTRIBUTES), dtype=torch.bool)
    was_training = model.training
    model.eval()
    try:
        starts = range(0, len(tokens), batch_size)
        for start in track(starts, len(starts), "recall", "batch", enabled=progress):
            chunk = slice(start, start + batch_size)
            ids, own = tokens[chunk].to(device), owner[chunk].to(device)
            for i, (_, logits) in enumerate(logits_by_depth(model, ids, depths)):
                exact[i, chunk] = exact_values(logits, ids, own, len(ATTRIBUTES)).cpu()
    finally:
        model.train(was_training)
    # rows are person-major: [depths, people * templates, A] -> [depths, people, A, templates]
    exact = exact.view(len(depths), source.people, spec.templates, len(ATTRIBUTES)).permute(0, 1, 3, 2).numpy()
    return {
        depth: score_recall(exact[i], spec.cardinalities, spec.recall_min_templates) for i, depth in enumerate(depths)
    }
