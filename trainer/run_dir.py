"""What a run directory holds, and how `--force` recognises one depthdiag wrote
(common/outputs.py): the files and folders a run, its monitor and a grid's evaluation write
into it, and nothing else."""

from __future__ import annotations

from pathlib import Path

from common.outputs import OutputKind, json_file, only_entries
from trainer.checkpoint import CHECKPOINT_DIR, SNAPSHOT_DIR
from trainer.sinks import TENSORBOARD_DIR, WANDB_DIR

MONITOR_FILE = "monitor.h5"
"""The in-training diagnostic's results file in the run directory (diag/in_training/monitor.py writes it)."""
EVAL_CACHE = "grid-eval.h5"
"""A grid cell's evaluation, kept in its run directory (depthdiag/grid.py writes it)."""
RUN_ENTRIES = (
    "config.json",
    "metrics.jsonl",
    "summary.json",
    CHECKPOINT_DIR,
    SNAPSHOT_DIR,
    MONITOR_FILE,
    EVAL_CACHE,
    TENSORBOARD_DIR,
    WANDB_DIR,
)
"""Everything a run (and the tools that work on it) writes into its directory."""


def _is_run_directory(run_dir: Path) -> bool:
    """A run directory depthdiag wrote: a run's entries alone, config.json a run config."""
    config = json_file(run_dir / "config.json")
    return (
        run_dir.is_dir()
        and only_entries(run_dir, RUN_ENTRIES)
        and config is not None
        and {"model", "train"} <= config.keys()
    )


RUN_DIRECTORY = OutputKind(
    "run directory",
    _is_run_directory,
    folder=True,
    existing_hint="resume it with --resume, replace it with --force, or choose another --out",
    entries=RUN_ENTRIES,
)
