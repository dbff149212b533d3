"""Where the training loop's metrics lines go besides RUN/metrics.jsonl: TensorBoard and
Weights & Biases, each an optional extra switched on in the config's [logging] block.

A sink gets every metrics line as the dict written to metrics.jsonl (rank 0 only) and
mirrors its scalars under the names of `scalars`; nothing a sink does feeds back into
the training. A sink whose package is missing is a one-line InputError naming the extra,
raised before the run touches its directory.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Protocol

from common.errors import InputError
from trainer.config import RunConfig

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"

SCALAR_NAMES = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "depth": "train/depth",
    "tokens": "train/tokens",
    "flops": "train/flops",
    "wall_time": "train/wall_time",
}
"""metrics.jsonl key -> scalar name; val_nll_S becomes val/nll_depth_S."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics line (the keys of SCALAR_NAMES and every val_nll_S), by name."""
    values = {name: float(record[key]) for key, name in SCALAR_NAMES.items() if key in record}
    for key, value in record.items():
        if key.startswith("val_nll_"):
            values[f"val/nll_depth_{key.removeprefix('val_nll_')}"] = float(value)
    return values


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None:
        """One metrics line (its `step` is the 0-based index of the update it closes)."""
        ...

    def close(self) -> None:
        """The run ends (finished, failed or interrupted)."""
        ...


def _require(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(
            f"logging.{extra} = true needs the {extra!r} extra (pip install 'depthdiag[{extra}]'): "
            f"no module named {module!r}"
        ) from None


def check_extras(config: RunConfig) -> None:
    """InputError naming the extra of the first sink [logging] asks for whose package is missing."""
    if config.logging.tensorboard:
        _require("tensorboard", "tensorboard")
    if config.logging.wandb:
        _require("wandb", "wandb")


class TensorBoardSink:
    """Event files in RUN/tensorboard. A run purges the events from its starting step on (all
    of them for a fresh run: a run killed before its first checkpoint starts over), which
    it logs again, so TensorBoard shows each step once."""

    def __init__(self, run_dir: Path, *, start: int):
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=start)

    def write(self, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=int(record["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run named after the run directory, its files in RUN/wandb, with the run config.
    Offline (nothing leaves the machine, nothing waits for a network) unless the environment
    sets WANDB_MODE; `wandb sync RUN/wandb/wandb/offline-run-*` uploads an offline run later."""

    def __init__(self, config: RunConfig, run_dir: Path, *, start: int):
        self.wandb = _require("wandb", "wandb")
        (run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(
            project=config.logging.wandb_project,
            name=run_dir.name,
            dir=str(run_dir / WANDB_DIR),
            config={**config.to_dict(), "resumed_from": start},
            mode=os.environ.get("WANDB_MODE") or "offline",
        )

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


def build_sinks(config: RunConfig, run_dir: Path, *, start: int) -> list[MetricsSink]:
    """The sinks [logging] asks for; InputError naming the extra when its package is missing."""
    sinks: list[MetricsSink] = []
    try:
        if config.logging.tensorboard:
            sinks.append(TensorBoardSink(run_dir, start=start))
        if config.logging.wandb:
            sinks.append(WandbSink(config, run_dir, start=start))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
