"""Run-config keys that only observe a run.

They change what a run reports (how often metrics lines are written, the periodic
evaluation at serving depths, TensorBoard and W&B mirrors), never its weights, snapshots
or diagnostics. Resuming a run, re-running a grid cell and combining results files as
seeds therefore ignore them: a user may turn on validation curves or W&B halfway
through a run without starting over."""

from __future__ import annotations

from typing import Any

OBSERVER_KEYS: dict[str, tuple[str, ...]] = {
    "train": ("log_every", "eval_every", "eval_depths"),
    "logging": ("tensorboard", "wandb", "wandb_project"),
}
"""Section -> the keys of it that only observe the run."""


def without_observer_keys(config: dict[str, Any]) -> dict[str, Any]:
    """A run config's sections (section -> key -> value) without OBSERVER_KEYS; a section
    left empty is dropped. Anything that is not a dict of sections is returned as given."""
    if not isinstance(config, dict):
        return config
    kept = {}
    for section, values in config.items():
        if isinstance(values, dict):
            values = {k: v for k, v in values.items() if k not in OBSERVER_KEYS.get(section, ())}
            if not values:
                continue
        kept[section] = values
    return kept
