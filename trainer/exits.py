"""Which depth to serve each token: the per-token readouts of every depth 1..S from one pass,
and the statistics exit criteria decide on.

A criterion fires at the first depth where its statistic crosses a threshold, and the token is
then served at that depth (at S when it never fires). From one all-depth pass this module
records, for every counted evaluation target and every depth, the NLL, whether the top-1
prediction is right and each criterion's statistic; the sweep over thresholds, the oracle and
the overthinking ledger are arithmetic on those arrays (analysis/exits.py).

Shipped criteria (`CRITERIA`), each statistic computed in fp32 after the head, whatever the
model's precision:

- `kl`: KL(p_s || p_{s-1}) between successive next-token distributions; fires below tau
  (undefined at s = 1, so it fires at 2 at the earliest);
- `l2`: relative change of the recurrent state ||h_s - h_{s-1}|| / ||h_s||; fires below tau
  (needs the state: models with `readouts_by_depth`; from 2 at the earliest);
- `entropy`: H(p_s); fires below tau;
- `maxprob`: max p_s; fires above tau.

A criterion of your own is a `Criterion` (its statistic a function of this depth's and the
previous depth's `Readout`), named on the command line as MODULE:NAME.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from common.errors import InputError
from common.imports import import_named
from common.progress import track
from trainer.model import IGNORE_INDEX
from trainer.scoring import DepthCall, LogitsOf, chunk_counts, depth_keyword, forward_per_depth, output_logits


@dataclass(frozen=True)
class Readout:
    """One depth's readout at the counted targets of a chunk."""

    depth: int
    """The serving depth s (core iterations)."""
    log_probs: Tensor
    """log p_s, float32 [N, V]: log-softmax of the head's logits in fp32."""
    state: Tensor | None
    """The recurrent state h_s at those targets' positions [N, d], or None when the model does not expose it."""

    @functools.cached_property
    def probs(self) -> Tensor:
        """p_s, float32 [N, V], computed once for every criterion that reads it."""
        return self.log_probs.exp()

    @functools.cached_property
    def top(self) -> tuple[Tensor, Tensor]:
        """(max log p_s, argmax p_s), [N] each, computed once."""
        values, indices = self.log_probs.max(-1)
        return values, indices


@dataclass(frozen=True)
class Criterion:
    """An exit criterion: a per-token statistic and the side of a threshold on which it fires."""

    name: str
    """How tables, files and figures call it."""
    statistic: Callable[[Readout, Readout | None], Tensor]
    """(this depth's readout, the previous depth's or None at s = 1) -> float32 [N]; NaN where
    undefined (the criterion does not fire there)."""
    fires_below: bool
    """True: fires where statistic < threshold; False: where statistic > threshold."""
    thresholds: tuple[float, ...]
    """The thresholds `depthdiag exits` sweeps by default."""
    needs_state: bool = False
    """Whether the statistic reads `Readout.state` (refused for models that do not expose it)."""

    def fires(self, statistic: np.ndarray | Tensor, threshold: float):
        """Where the criterion fires at `threshold` (NaN never fires)."""
        return statistic < threshold if self.fires_below else statistic > threshold


def _undefined(readout: Readout) -> Tensor:
    return torch.full(readout.log_probs.shape[:1], float("nan"), device=readout.log_probs.device)


def kl_to_previous(readout: Readout, previous: Readout | None) -> Tensor:
    """KL(p_s || p_{s-1}) per token, fp32 [N]."""
    if previous is None:
        return _undefined(readout)
    return (readout.probs * (readout.log_probs - previous.log_probs)).sum(-1)


def relative_state_change(readout: Readout, previous: Readout | None) -> Tensor:
    """||h_s - h_{s-1}|| / ||h_s|| per token, fp32 [N]."""
    if previous is None:
        return _undefined(readout)
    state, before = readout.state.float(), previous.state.float()
    return (state - before).norm(dim=-1) / state.norm(dim=-1)


def entropy(readout: Readout, previous: Readout | None) -> Tensor:
    """H(p_s) per token in nats, fp32 [N]."""
    return -(readout.probs * readout.log_probs).sum(-1)


def max_probability(readout: Readout, previous: Readout | None) -> Tensor:
    """max p_s per token, fp32 [N]."""
    return readout.top[0].exp()


def _geometric(low: float, high: float, n: int = 20) -> tuple[float, ...]:
    return tuple(float(t) for t in np.geomspace(low, high, n))


CRITERIA = {
    "kl": Criterion("kl", kl_to_previous, fires_below=True, thresholds=_geometric(1e-6, 1.0)),
    "l2": Criterion("l2", relative_state_change, fires_below=True, thresholds=_geometric(1e-4, 1.0), needs_state=True),
    "entropy": Criterion("entropy", entropy, fires_below=True, thresholds=_geometric(1e-3, 4.0)),
    "maxprob": Criterion(
        "maxprob", max_probability, fires_below=False, thresholds=tuple(float(1 - t) for t in _geometric(1e-3, 0.5))
    ),
}
"""The shipped criteria by name. Default thresholds: 20 geometrically spaced values (for
maxprob 1 - tau, from 0.999 down to 0.5); Huginn's 5e-4 for kl lies inside its range."""


def criterion_named(spec: str, option: str = "--criteria") -> Criterion:
    """The shipped criterion `spec`, or the `Criterion` a MODULE:NAME spec names (`option`: the
    command-line option it came from, for messages)."""
    if spec in CRITERIA:
        return CRITERIA[spec]
    if ":" not in spec:
        raise InputError(f"{option} {spec}: not one of {', '.join(CRITERIA)}, nor MODULE:NAME")
    found = import_named(spec, option, "MODULE:NAME", "my_exits:margin")
    if not isinstance(found, Criterion):
        raise InputError(f"{option} {spec}: names a {type(found).__name__}, not a trainer.exits.Criterion")
    return found


def exit_rule(spec: str, option: str = "--exit") -> tuple[Criterion, float]:
    """'kl:5e-4' (or 'MODULE:NAME:TAU') as (criterion, threshold): the criterion that serves
    each token at the first depth where it fires at that threshold."""
    name, sep, value = spec.rpartition(":")
    try:
        threshold = float(value) if sep and name else math.nan
    except ValueError:
        threshold = math.nan
    if not math.isfinite(threshold):
        raise InputError(f"{option} {spec}: expected CRITERION:THRESHOLD, e.g. kl:5e-4")
    return criterion_named(name, option), threshold


@dataclass(frozen=True)
class DepthTable:
    """Every counted evaluation target at every depth 1..S, from one all-depth pass."""

    nll: np.ndarray
    """NLL of each target at each depth, float32 [S, N]."""
    correct: np.ndarray
    """Whether the top-1 prediction at each depth is the target, bool [S, N]."""
    statistics: dict[str, np.ndarray]
    """Each criterion's statistic by name, float32 [S, N] (NaN where undefined)."""
    mean_nll: np.ndarray
    """Mean NLL at each depth exactly as `depthdiag eval` computes it (chunk means weighted by
    their counted targets, in float64), float64 [S]."""
    rows: np.ndarray
    """The evaluation row of each target, int64 [N]."""
    positions: np.ndarray
    """The position of each target in its row, int64 [N]."""


def one_pass_readouts(model: nn.Module) -> bool:
    """Whether the model reads out every depth from one pass with its recurrent state."""
    return callable(getattr(model, "readouts_by_depth", None)) and callable(getattr(model, "nll_by_depth", None))


def _chunk_readouts(model, input_ids, targets, depths, *, depth_call, logits_of):
    """(depth, state [N, d] or None, log p [N, V] float32, the chunk's mean NLL as eval has it)
    at the counted targets of `targets` [b, T], depth by depth in increasing order."""
    flat_targets = targets.flatten()
    counted = flat_targets != IGNORE_INDEX
    if one_pass_readouts(model):
        # LoopedTransformer.nll_by_depth's route, so that the chunk means are eval's to the bit
        positions = None if bool(counted.all()) else counted.nonzero().squeeze(1)
        wanted = flat_targets if positions is None else flat_targets[positions]
        for depth, state, logits in model.readouts_by_depth(input_ids, depths, positions):
            log_probs = F.log_softmax(logits.flatten(0, -2).float(), dim=-1)
            # cross_entropy is nll_loss of log_softmax: the same kernels, once
            yield depth, state.flatten(0, -2), log_probs, F.nll_loss(log_probs, wanted)
        return
    for depth, logits in forward_per_depth(
        model, input_ids, depths, state=None, depth_call=depth_call, logits_of=logits_of
    ):
        log_probs = F.log_softmax(logits.flatten(0, 1).float(), dim=-1)
        mean = F.nll_loss(log_probs, flat_targets, ignore_index=IGNORE_INDEX)
        yield depth, None, log_probs[counted], mean


@torch.no_grad()
def depth_table(
    model: nn.Module,
    tokens: Tensor,
    max_depth: int,
    criteria: Sequence[Criterion],
    *,
    targets: Tensor | None = None,
    batch_size: int = 32,
    depth_call: DepthCall = depth_keyword,
    logits_of: LogitsOf = output_logits,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> DepthTable:
    """Score every counted target of `tokens` int64 [E, T+1] (targets tokens[:, 1:] or
    `targets` [E, T] with IGNORE_INDEX where not counted) at depths 1..max_depth, in chunks of
    `batch_size` rows as `depthdiag eval` takes them: one pass per chunk for models with a
    one-pass readout, one forward per depth (`depth_call`, `logits_of`) otherwise."""
    if max_depth < 1:
        raise InputError(f"max_depth must be >= 1, got {max_depth}")
    device = tokens.device if device is None else torch.device(device)
    targets = tokens[:, 1:] if targets is None else targets
    with_state = one_pass_readouts(model)
    for criterion in criteria:
        if criterion.needs_state and not with_state:
            raise InputError(
                f"criterion {criterion.name} needs the recurrent state, which this model does not expose "
                "(only models with readouts_by_depth, as depthdiag's own, do)"
            )
    depths = list(range(1, max_depth + 1))
    counts = chunk_counts(targets, batch_size)
    if sum(counts) == 0:
        raise InputError("evaluation set: no counted targets")
    nll, correct, rows, positions = [], [], [], []
    statistics = {criterion.name: [] for criterion in criteria}
    total = torch.zeros(max_depth, dtype=torch.float64, device=device)
    chunks = list(zip(tokens.split(batch_size), targets.split(batch_size), counts))
    for index, (chunk, chunk_targets, count) in enumerate(
        track(chunks, len(chunks), "exits", "batch", enabled=progress)
    ):
        if count == 0:
            continue
        chunk, chunk_targets = chunk.to(device), chunk_targets.to(device)  # [b, T+1], [b, T]
        counted = (chunk_targets != IGNORE_INDEX).nonzero()  # [N, 2]: row, position
        wanted = chunk_targets[counted[:, 0], counted[:, 1]]  # [N]
        chunk_nll, chunk_correct, chunk_stats, means = [], [], {name: [] for name in statistics}, []
        previous = None
        for depth, state, log_probs, mean in _chunk_readouts(
            model, chunk[:, :-1], chunk_targets, depths, depth_call=depth_call, logits_of=logits_of
        ):
            readout = Readout(depth, log_probs, state)  # [N, V]
            chunk_nll.append(-log_probs.gather(1, wanted[:, None]).squeeze(1))
            chunk_correct.append(readout.top[1] == wanted)
            for criterion in criteria:
                chunk_stats[criterion.name].append(criterion.statistic(readout, previous).float())
            means.append(mean)
            previous = readout
        total += torch.stack(means).double() * count
        nll.append(torch.stack(chunk_nll).cpu())
        correct.append(torch.stack(chunk_correct).cpu())
        for name, values in chunk_stats.items():
            statistics[name].append(torch.stack(values).cpu())
        rows.append(counted[:, 0].cpu() + index * batch_size)
        positions.append(counted[:, 1].cpu())
    return DepthTable(
        nll=torch.cat(nll, dim=1).numpy(),
        correct=torch.cat(correct, dim=1).numpy(),
        statistics={name: torch.cat(values, dim=1).numpy() for name, values in statistics.items()},
        mean_nll=(total / sum(counts)).cpu().numpy(),
        rows=torch.cat(rows).numpy(),
        positions=torch.cat(positions).numpy(),
    )


@torch.no_grad()
def real_exit_nll(
    model: nn.Module,
    tokens: Tensor,
    criterion: Criterion,
    thresholds: Sequence[float],
    max_depth: int,
    *,
    targets: Tensor | None = None,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(mean NLL, mean exit depth), float64 [len(thresholds)] each, over the counted targets of
    `tokens` when `model.forward_with_exit` serves every token at the depth `criterion` picks
    at each threshold as it runs (stopped tokens frozen, see LoopedTransformer.forward_with_exit)."""
    if not callable(getattr(model, "forward_with_exit", None)):
        raise InputError("the real-exit forward needs a model with forward_with_exit (depthdiag's own)")
    device = tokens.device if device is None else torch.device(device)
    targets = tokens[:, 1:] if targets is None else targets
    nll_sum = np.zeros(len(thresholds))
    depth_sum = np.zeros(len(thresholds))
    counted_total = int((targets != IGNORE_INDEX).sum())
    if counted_total == 0:
        raise InputError("evaluation set: no counted targets")
    pairs = list(zip(tokens.split(batch_size), targets.split(batch_size)))
    work = [(i, chunk, chunk_targets) for i in range(len(thresholds)) for chunk, chunk_targets in pairs]
    for i, chunk, chunk_targets in track(work, len(work), "real exits", "batch", enabled=progress):
        chunk, chunk_targets = chunk.to(device), chunk_targets.to(device)
        counted = chunk_targets != IGNORE_INDEX  # [b, T]
        logits, exit_depth = model.forward_with_exit(chunk[:, :-1], max_depth, ExitDecisions(criterion, thresholds[i]))
        token_nll = F.cross_entropy(
            logits.flatten(0, 1).float(), chunk_targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        )
        nll_sum[i] += float(token_nll[counted.flatten()].double().sum())
        depth_sum[i] += float(exit_depth[counted].double().sum())
    return nll_sum / counted_total, depth_sum / counted_total


class ExitDecisions:
    """The `exits` callback of `LoopedTransformer.forward_with_exit` for one criterion at one
    threshold: which tokens stop after each iteration, remembering the previous readout."""

    def __init__(self, criterion: Criterion, threshold: float):
        self.criterion, self.threshold = criterion, threshold
        self.previous: Readout | None = None

    def __call__(self, depth: int, state: Tensor, logits: Tensor) -> Tensor:
        readout = _flat(Readout(depth, F.log_softmax(logits.float(), dim=-1), state))  # b*T tokens
        statistic = self.criterion.statistic(readout, self.previous)
        self.previous = readout
        return self.criterion.fires(statistic, self.threshold).view(state.shape[:2])


def _flat(readout: Readout) -> Readout:
    """A readout over [b, T] tokens as one over b*T."""
    state = None if readout.state is None else readout.state.flatten(0, -2)
    return Readout(readout.depth, readout.log_probs.flatten(0, -2), state)
