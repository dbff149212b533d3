"""Modeled FLOPs of the looped transformer, per update, per evaluation and per schedule.

The accounting of McLeish et al. (2025), used by the paper: per token,

    6 x (non-embedding parameters applied with gradient)
  + 2 x (parameters applied without gradient: iterations cut off by truncated backprop)
  + the attention term,

where a core iteration applies the adapter and every core block once, so recurrent
parameters count once per iteration. The attention term counts the QK^T and AV
matmuls over the full T x T score matrix, as torch's FlopCounterMode does for
`scaled_dot_product_attention` (it ignores causal masking): 4 * T * d_model per
token per attention layer forward, three times that for an iteration with gradient.
Embeddings and the LM head are excluded by default; `include_embeddings` adds the
head matmul (the embedding lookup is not a matmul). Norm weights count as parameters.

Because every depth costs `fixed + K * per_iteration`, a schedule's expected cost
depends only on its depth distribution, averaged over the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from common.errors import InputError
from trainer.model import ModelConfig
from trainer.schedules import Schedule, parse_schedule

UNIFORM_REFERENCE = "uniform:1-16"
"""The schedule FLOPs are reported relative to (the paper's uniform training)."""


def parameter_counts(model: ModelConfig) -> dict[str, int]:
    """Parameter counts by role, from the config alone; the same keys and values as
    `LoopedTransformer(model).parameter_groups()`."""
    d = model.d_model
    block_norms = (4 if model.norm == "sandwich" else 2) * d
    mlp = (3 if model.mlp == "swiglu" else 2) * d * model.ff_width
    block = 4 * d * d + mlp + block_norms  # qkv (3 d^2) + proj (d^2) + MLP + norms
    return {
        "embedding": model.vocab_size * d,
        "prelude": model.n_prelude * block,
        "adapter": 2 * d * d if model.injection == "concat" else 0,
        "core": model.n_core * block,
        "coda": model.n_coda * block,
        "norms": 2 * d,  # loop_norm and final_norm
        "head": model.vocab_size * d,
    }


def _attention_forward_per_token(model: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one attention layer's QK^T and AV matmuls."""
    return 4.0 * seq_len * model.d_model


def _check_shape(batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise InputError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")


def _check_depth(depth: int) -> None:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise InputError(f"depth must be a positive integer, got {depth!r}")


def update_flops(
    model: ModelConfig, depth: int, *, batch_size: int, seq_len: int, include_embeddings: bool = False
) -> float:
    """Modeled FLOPs of one training update (forward and backward) at `depth`."""
    _check_depth(depth)
    _check_shape(batch_size, seq_len)
    counts = parameter_counts(model)
    attention = _attention_forward_per_token(model, seq_len)
    once = counts["prelude"] + counts["coda"] + counts["norms"] + (counts["head"] if include_embeddings else 0)
    per_iteration = counts["adapter"] + counts["core"]
    without_grad = max(0, depth - model.backprop_depth) if model.backprop_depth else 0
    with_grad = depth - without_grad
    per_token = (
        6 * once
        + 3 * attention * (model.n_prelude + model.n_coda)
        + with_grad * (6 * per_iteration + 3 * attention * model.n_core)
        + without_grad * (2 * per_iteration + attention * model.n_core)
    )
    return float(batch_size * seq_len * per_token)


def nll_by_depth_flops(
    model: ModelConfig, depths: Sequence[int], *, batch_size: int, seq_len: int, include_embeddings: bool = False
) -> float:
    """Modeled forward FLOPs of `LoopedTransformer.nll_by_depth(depths)`: one pass of
    max(depths) iterations with a readout (norms, coda, head) after each requested depth,
    every target counted (with some ignored, the last coda MLP and the head run on fewer tokens)."""
    depths = sorted(set(depths))
    if not depths:
        raise InputError("depths must not be empty")
    for depth in depths:
        _check_depth(depth)
    _check_shape(batch_size, seq_len)
    counts = parameter_counts(model)
    attention = _attention_forward_per_token(model, seq_len)
    readout = counts["coda"] + counts["norms"] + (counts["head"] if include_embeddings else 0)
    per_token = (
        2 * counts["prelude"]
        + attention * model.n_prelude
        + max(depths) * (2 * (counts["adapter"] + counts["core"]) + attention * model.n_core)
        + len(depths) * (2 * readout + attention * model.n_coda)
    )
    return float(batch_size * seq_len * per_token)


def eval_flops(
    model: ModelConfig, depth: int, *, batch_size: int, seq_len: int, include_embeddings: bool = False
) -> float:
    """Modeled FLOPs of one forward pass at `depth` (no gradient)."""
    return nll_by_depth_flops(
        model, [depth], batch_size=batch_size, seq_len=seq_len, include_embeddings=include_embeddings
    )


def mean_depth(schedule: Schedule, updates: int | None = None) -> float:
    """Expected training depth averaged over the first `updates` updates (default: all)."""
    return sum(k * p for k, p in schedule.average_distribution(updates).items())


def schedule_flops(
    model: ModelConfig,
    schedule: Schedule,
    *,
    updates: int | None = None,
    batch_size: int,
    seq_len: int,
    include_embeddings: bool = False,
) -> float:
    """Expected modeled FLOPs of the first `updates` updates of `schedule` (default: the
    whole run), over the schedule's exact depth distribution at every step."""
    distribution = schedule.average_distribution(updates)
    updates = schedule.total_updates if updates is None else updates
    per_update = sum(
        p * update_flops(model, k, batch_size=batch_size, seq_len=seq_len, include_embeddings=include_embeddings)
        for k, p in distribution.items()
    )
    return updates * per_update


def iso_flop_updates(
    model: ModelConfig,
    spec: str,
    reference: Schedule | float,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    include_embeddings: bool = False,
) -> int:
    """The number of updates n for which a run of schedule `spec` (laid out over n
    updates, so a fixed-first switch moves with n) has expected modeled compute closest
    to `reference`: a schedule's whole-run compute, or a FLOP budget.

    This is how the paper's compute-matched uniform run (3,296 updates against
    fixed-first K0=4 at 67% of 4,800) is sized. Raises InputError on a bad spec."""
    if isinstance(reference, (int, float)):
        budget = float(reference)
    else:
        budget = schedule_flops(
            model, reference, batch_size=batch_size, seq_len=seq_len, include_embeddings=include_embeddings
        )
    if not (math.isfinite(budget) and budget > 0):
        raise InputError(f"the FLOP budget must be a finite number > 0, got {budget}")

    def run_flops(n: int) -> float:
        return schedule_flops(
            model,
            parse_schedule(spec, seed=seed, total_updates=n),
            batch_size=batch_size,
            seq_len=seq_len,
            include_embeddings=include_embeddings,
        )

    # A run's compute grows with its length (every update costs > 0), so bisect for the
    # first n reaching the budget, then keep whichever neighbour lands closer.
    low, high = 1, 2
    while run_flops(high) < budget:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if run_flops(middle) < budget:
            low = middle
        else:
            high = middle
    return min((low, high), key=lambda n: abs(run_flops(n) - budget))


@dataclass(frozen=True)
class ScheduleFlops:
    """Modeled compute of one schedule over a run."""

    spec: str
    """Canonical schedule spec."""
    modeled_flops: float
    """Expected modeled FLOPs of the whole run."""
    mean_depth: float
    """Expected training depth averaged over the run."""
    relative_to_uniform: float
    """modeled_flops / that of uniform:1-16 over the same updates."""


@dataclass(frozen=True)
class FlopMatch:
    """A run of one schedule sized to another's modeled compute."""

    spec: str
    """Canonical spec of the schedule being sized."""
    reference: str
    """Canonical spec of the schedule whose compute it matches."""
    updates: int
    """Updates at which the two runs' modeled compute is closest."""
    modeled_flops: float
    """Expected modeled FLOPs of the sized run."""
    reference_flops: float
    """Expected modeled FLOPs of the reference run."""


@dataclass(frozen=True)
class FlopsReport:
    """What `depthdiag flops` prints."""

    updates: int
    """Run length every schedule is laid out over."""
    batch_size: int
    """Sequences per update."""
    seq_len: int
    """Tokens per sequence."""
    include_embeddings: bool
    """Whether the LM head matmul is counted."""
    schedules: tuple[ScheduleFlops, ...]
    """One row per requested schedule, in the order given."""
    match: FlopMatch | None = None
    """The compute-matched run, when requested."""

    def to_dict(self) -> dict:
        return asdict(self)


def flops_report(
    model: ModelConfig,
    specs: Sequence[str],
    *,
    updates: int,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    include_embeddings: bool = False,
    match: str | None = None,
) -> FlopsReport:
    """Modeled compute of each schedule over `updates` updates, relative to uniform:1-16,
    and optionally the run length at which schedule `match` matches the first one's
    compute. Bad specs raise InputError."""
    if not specs:
        raise InputError("at least one schedule is needed")
    shape = dict(batch_size=batch_size, seq_len=seq_len, include_embeddings=include_embeddings)
    uniform = parse_schedule(UNIFORM_REFERENCE, seed=seed, total_updates=updates)
    uniform_flops = schedule_flops(model, uniform, **shape)
    schedules = [parse_schedule(spec, seed=seed, total_updates=updates) for spec in specs]
    rows = []
    for schedule in schedules:
        flops = schedule_flops(model, schedule, **shape)
        rows.append(
            ScheduleFlops(
                spec=schedule.spec,
                modeled_flops=flops,
                mean_depth=mean_depth(schedule),
                relative_to_uniform=flops / uniform_flops,
            )
        )
    matched = None
    if match is not None:
        n = iso_flop_updates(model, match, schedules[0], seed=seed, **shape)
        sized = parse_schedule(match, seed=seed, total_updates=n)
        matched = FlopMatch(
            spec=sized.spec,
            reference=schedules[0].spec,
            updates=n,
            modeled_flops=schedule_flops(model, sized, **shape),
            reference_flops=rows[0].modeled_flops,
        )
    return FlopsReport(
        updates=updates,
        batch_size=batch_size,
        seq_len=seq_len,
        include_embeddings=include_embeddings,
        schedules=tuple(rows),
        match=matched,
    )


def format_flops_report(report: FlopsReport, model: ModelConfig, *, source: str) -> str:
    """The table `depthdiag flops` prints: the model's size and the run's tokens, a row per
    schedule (modeled FLOPs, mean depth, share of uniform:1-16), and the compute match."""
    counts = parameter_counts(model)
    non_embedding = sum(counts.values()) - counts["embedding"] - counts["head"]
    tokens = report.updates * report.batch_size * report.seq_len
    tokens_text = f"{tokens / 1e9:.2f}B" if tokens >= 1e9 else f"{tokens / 1e6:.2f}M"
    lines = [
        f"{source}: {non_embedding / 1e6:.1f}M non-embedding parameters; {report.updates:,} updates "
        f"x {report.batch_size} x {report.seq_len} tokens ({tokens_text} tokens); "
        f"LM head {'included' if report.include_embeddings else 'excluded'}"
    ]
    width = max(len("schedule"), *(len(row.spec) for row in report.schedules))
    lines.append(f"{'schedule':<{width}}  {'modeled FLOPs':>13}  {'mean depth':>10}  {'vs ' + UNIFORM_REFERENCE:>15}")
    lines += [
        f"{row.spec:<{width}}  {row.modeled_flops:>13.4e}  {row.mean_depth:>10.3f}  {row.relative_to_uniform:>15.2%}"
        for row in report.schedules
    ]
    if report.match is not None:
        m = report.match
        lines.append(
            f"match: {m.spec} over {m.updates:,} updates ({m.modeled_flops:.4e} FLOPs) matches "
            f"{m.reference} over {report.updates:,} updates ({m.reference_flops:.4e} FLOPs)"
        )
    return "\n".join(lines)
