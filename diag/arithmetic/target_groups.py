"""Groups of evaluation targets, for the benefit by group (docs/diagnostic.md).

The benefit at serving depth s is a mean over the counted evaluation targets, so it splits
exactly into groups of them: with n_g targets in group g and NLLs nll_g,

    benefit(s) = sum_g n_g benefit_g(s) / sum_g n_g

when every counted target is in one group. A grouping gives each target of eval_tokens[:, 1:]
one group id (-1: in none); the diagnostic records each group's mean NLL before and after
every update (`UpdateDiagnostic`'s `eval_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from common.errors import InputError
from diag.arithmetic.random_streams import common_random_numbers
from trainer.scoring import group_sums, token_nll_by_depth

RESERVED_NAMES = frozenset(
    {
        *("update_depth", "serving_depth", "snapshot", "batch", "seed", "example", "token", "in_batch"),
        *("uniform_updates", "step", "lr", "machine", "trained_on", "unit", "removal", "removed"),
    }
)
"""Names in a results file (dimensions, coordinates) a grouping's name must not take."""


@dataclass(frozen=True)
class TargetGroups:
    """One grouping of the evaluation targets."""

    name: str
    """Its name, the dimension of its groups in the results (`attribute`, `frequency`, ...)."""
    ids: Tensor
    """int64 [E, T]: the group of each target of eval_tokens[:, 1:]; -1 for a target in none."""
    labels: tuple[str, ...]
    """Group g's label, for g = 0..G-1."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name in RESERVED_NAMES:
            raise InputError(
                f"a grouping's name must be an identifier other than {sorted(RESERVED_NAMES)}, got {self.name!r}"
            )
        if not torch.is_tensor(self.ids) or self.ids.dtype != torch.int64 or self.ids.dim() != 2:
            raise InputError(f"grouping {self.name!r}: ids must be an int64 tensor [E, T], one group per target")
        object.__setattr__(self, "labels", tuple(str(label) for label in self.labels))
        if not self.labels or len(set(self.labels)) != len(self.labels):
            raise InputError(f"grouping {self.name!r}: labels must be distinct and at least one")
        if self.ids.numel() and not (-1 <= int(self.ids.min()) and int(self.ids.max()) < len(self.labels)):
            raise InputError(
                f"grouping {self.name!r}: ids must lie in -1..{len(self.labels) - 1} (one per label, -1 for none)"
            )

    def for_targets(self, targets: Tensor) -> Tensor:
        """The ids on `targets`' device, -1 where a target is not counted (IGNORE_INDEX < 0)."""
        if self.ids.shape != targets.shape:
            raise InputError(
                f"grouping {self.name!r}: ids of shape {list(self.ids.shape)}, the evaluation targets' is "
                f"{list(targets.shape)} (eval_tokens[:, 1:])"
            )
        return self.ids.to(targets.device).masked_fill(targets < 0, -1)


def groups_of_ids(name: str, ids: Tensor) -> TargetGroups:
    """A grouping from any integer ids [E, T] (negative: in no group): the distinct ids, in
    increasing order, become groups labelled by their value."""
    ids = torch.as_tensor(ids).long()
    values = torch.unique(ids[ids >= 0])  # sorted
    mapped = torch.where(ids >= 0, torch.searchsorted(values, ids), torch.full_like(ids, -1))
    return TargetGroups(name, mapped, tuple(str(v) for v in values.tolist()) or ("none",))


@torch.no_grad()
def group_nll_sums(diagnostic: Any, state: Callable[[], dict[str, Tensor]]) -> list[np.ndarray]:
    """Summed NLL per group of each of `diagnostic.eval_groups` (an UpdateDiagnostic's) with the
    weights `state` at every serving depth, float64 [S, G] per grouping: the evaluation's own
    chunks and random streams (a model whose forward draws random numbers: one forward per
    sequence and depth, from the sequence's stream), one more pass over the evaluation set."""
    depths = list(diagnostic.options.serving_depths)
    sums = [np.zeros((len(depths), len(grouping.labels))) for grouping, _ in diagnostic.eval_groups]
    random = diagnostic.random_forward
    rows = 1 if random else diagnostic.options.eval_batch_size
    passes = [([depth], position) for position, depth in enumerate(depths)] if random else [(depths, None)]
    with common_random_numbers() as reseed:
        for start in range(0, len(diagnostic.eval_tokens), rows):
            inputs = diagnostic.eval_tokens[start : start + rows, :-1]
            targets = diagnostic.eval_targets[start : start + rows]
            for wanted, position in passes:
                if random:
                    reseed(diagnostic._sequence_seeds[start])
                token_nll = token_nll_by_depth(
                    diagnostic.model,
                    inputs,
                    targets,
                    wanted,
                    state=state,
                    depth_call=diagnostic.family.eval_call,
                    logits_of=diagnostic.family.logits,
                )  # [len(wanted), rows, T]
                at = slice(None) if position is None else slice(position, position + 1)
                for total, (grouping, ids) in zip(sums, diagnostic.eval_groups):
                    total[at] += group_sums(token_nll, ids[start : start + rows], len(grouping.labels)).cpu().numpy()
    return sums


def group_variables(
    eval_groups: Sequence[tuple[TargetGroups, Tensor]],
    after: list[list[np.ndarray]],
    before: list[np.ndarray],
) -> dict[str, xr.DataArray]:
    """One unit's results per grouping X: nll_by_X (update_depth, serving_depth, X) and
    nll_before_by_X (serving_depth, X), the groups' mean NLLs (NaN for a group without
    counted targets), and targets_by_X (X), their counted targets, labelled by the groups.
    The depths' coordinates are those of the unit's dataset they are assigned to. `after[k][j]`:
    the summed NLL [S, G] of grouping j after update k; `before[j]`: of theta itself;
    `eval_groups`: each grouping with its ids on the targets."""
    variables = {}
    for j, (grouping, on_targets) in enumerate(eval_groups):
        dim = grouping.name
        counts = torch.bincount(on_targets[on_targets >= 0], minlength=len(grouping.labels)).cpu().numpy()
        with np.errstate(invalid="ignore"):  # a group without counted targets sums to 0: 0 / 0 is NaN
            mean_after = np.stack([sums[j] for sums in after]) / counts  # [update_depth, S, G]
            mean_before = before[j] / counts  # [S, G]
        variables[f"nll_by_{dim}"] = xr.DataArray(mean_after, dims=("update_depth", "serving_depth", dim))
        variables[f"nll_before_by_{dim}"] = xr.DataArray(mean_before, dims=("serving_depth", dim))
        variables[f"targets_by_{dim}"] = xr.DataArray(counts.astype(np.int64), coords={dim: list(grouping.labels)})
    return variables
