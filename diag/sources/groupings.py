"""The groupings of evaluation targets `depthdiag diagnose --grouping` records the benefit by
(diag/arithmetic/target_groups.py):

- `attribute` (bioS runs, --eval-set attributes): the attribute each counted target is a
  value token of (birth_day, birth_month, ...), and `planted` for the answers of planted
  sequences (data.planted_fraction);
- `frequency`: how often the target token occurs in the run's training stream (a sample of its
  first batches), in quartiles by rank over the counted targets, rarest first (q1..q4);
- `position`: the target's position in its sequence, in four equal spans;
- MODULE:NAME: a function of yours, NAME(eval_tokens int64 [E, T+1]) -> int ids [E, T], one
  group per target of eval_tokens[:, 1:] (negative: in none); its groups are its distinct ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from common.errors import InputError
from common.imports import import_named, one_line
from diag.arithmetic.target_groups import TargetGroups, groups_of_ids
from trainer.config import RunConfig
from trainer.data.sources import build_source

SHIPPED = ("attribute", "frequency", "position")
FREQUENCY_SAMPLE_BATCHES = 64
"""Training batches (from the run's first step) whose tokens the frequency grouping counts."""
QUANTILES = 4


def target_groupings(
    names: Sequence[str],
    eval_tokens: Tensor,
    eval_mask: Tensor | None,
    *,
    run: RunConfig | None,
    eval_set: str | None,
    origin: object,
) -> tuple[TargetGroups, ...]:
    """The groupings `names` of the targets of `eval_tokens` [E, T+1] (`eval_mask`: the counted
    ones); `run` and `eval_set`: the run's config and its resolved evaluation set, where the
    input has them (a snapshot or checkpoint file); `origin` names the input in errors."""
    return tuple(_grouping(name, eval_tokens, eval_mask, run, eval_set, origin) for name in names)


def _grouping(
    name: str,
    eval_tokens: Tensor,
    eval_mask: Tensor | None,
    run: RunConfig | None,
    eval_set: str | None,
    origin: object,
) -> TargetGroups:
    if ":" in name:
        return _user_grouping(name, eval_tokens)
    if name == "position":
        return position_groups(eval_tokens.shape[1] - 1, len(eval_tokens))
    if name not in SHIPPED:
        raise InputError(f"--grouping {name}: not one of {', '.join(SHIPPED)}, nor MODULE:NAME")
    if run is None:
        raise InputError(
            f"{origin}: --grouping {name} needs the run's data, which only depthdiag's snapshot and checkpoint files "
            "carry; use position or a MODULE:NAME function of the evaluation tokens"
        )
    if name == "frequency":
        return frequency_groups(eval_tokens, eval_mask, run)
    if run.data.source != "bios" or eval_set != "attributes":
        raise InputError(f"{origin}: --grouping attribute needs a bioS run diagnosed with --eval-set attributes")
    return attribute_groups(eval_tokens, run, origin)


def position_groups(length: int, rows: int, spans: int = QUANTILES) -> TargetGroups:
    """Targets by position 0..length-1 in `spans` equal spans (fewer when length is shorter)."""
    spans = max(1, min(spans, length))
    span = torch.arange(length) * spans // length  # [T]
    edges = [int((span == k).nonzero()[0]) for k in range(spans)] + [length]
    labels = tuple(f"{edges[k]}-{edges[k + 1] - 1}" for k in range(spans))
    return TargetGroups("position", span.expand(rows, length).clone(), labels)


def frequency_groups(eval_tokens: Tensor, eval_mask: Tensor | None, run: RunConfig) -> TargetGroups:
    """Counted targets by their token's count in the first FREQUENCY_SAMPLE_BATCHES training
    batches of the run's stream, in quartiles by rank over the counted targets, rarest first
    (q1..q4 whatever the run, so that seeds line up); a token's targets share a quartile, the
    one its rarest tie starts in, so ties can leave a quartile empty."""
    source = build_source(run.data)
    counts = torch.zeros(max(source.vocab_size, int(eval_tokens.max()) + 1), dtype=torch.int64)
    for step in range(FREQUENCY_SAMPLE_BATCHES):
        batch = source.batch(run.train.seed, step, run.train.batch_size, run.train.seq_len)
        counts += torch.bincount(batch.flatten(), minlength=len(counts))[: len(counts)]
    frequency = counts[eval_tokens[:, 1:]]  # [E, T]
    counted = torch.ones_like(frequency, dtype=torch.bool) if eval_mask is None else eval_mask.to(frequency.device)
    return TargetGroups("frequency", quantile_ids(frequency, counted), tuple(f"q{k + 1}" for k in range(QUANTILES)))


def quantile_ids(values: Tensor, counted: Tensor, quantiles: int = QUANTILES) -> Tensor:
    """The quantile by rank (0 = smallest) of each counted value among the counted ones, -1
    where not counted; equal values share the quantile their first rank falls in."""
    ordered = torch.sort(values[counted]).values
    first_rank = torch.searchsorted(ordered, values)  # [E, T]: how many counted values are smaller
    ids = first_rank * quantiles // max(len(ordered), 1)
    return torch.where(counted, ids, torch.full_like(ids, -1))


def attribute_groups(eval_tokens: Tensor, run: RunConfig, origin: object) -> TargetGroups:
    """Targets by the bioS attribute they are a value token of, and the answers of planted
    sequences as the group `planted` where the run plants them (-1: none of these)."""
    source = build_source(run.data)
    tokens, owners = source.attribute_owners(len(eval_tokens), eval_tokens.shape[1] - 1)
    if not torch.equal(tokens, eval_tokens.cpu()):
        raise InputError(f"{origin}: --grouping attribute: the evaluation set is not the run's attribute set")
    return TargetGroups("attribute", owners[:, 1:].long(), source.owner_labels)


def _user_grouping(spec: str, eval_tokens: Tensor) -> TargetGroups:
    function = import_named(spec, "--grouping", "MODULE:NAME", "my_groups:by_sentence")
    try:
        ids = function(eval_tokens.cpu())
    except Exception as err:  # the user's code can raise anything; they need its first line
        raise InputError(f"--grouping {spec}: the function failed ({one_line(err)})") from None
    expected = list(eval_tokens[:, 1:].shape)
    if not torch.is_tensor(ids) or ids.is_floating_point() or ids.is_complex() or list(ids.shape) != expected:
        raise InputError(f"--grouping {spec}: must return an integer tensor of group ids {expected}, one per target")
    return groups_of_ids(spec.rpartition(":")[2].rpartition(".")[2], ids.to(eval_tokens.device))
