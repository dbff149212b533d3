"""The in-training monitor: the update diagnostic on the live model and optimizer, every
`monitor.every` updates, into RUN/monitor.h5 (analysis/monitor.py has the schema).

`depthdiag train` passes an `UpdateMonitor` to `trainer.train.train(..., monitor=)` when
the config's [monitor] block is on (`train_with_monitor` does it for library callers); the
training loop calls it through the protocol of trainer/hooks.py and never imports diag.

A check after `step` updates, when step is a positive multiple of `every` or the
schedule's switch step (not step 0: see MonitorConfig):

- batches: `monitor.batches` batches of the run's global batch shape from the run's data
  source, through a stream of their own: batch i is `source.batch(seed_s, i, ...)` with
  seed_s = seeded_generator(train.seed, step, MONITOR_SALT).integers(2**63), a pure
  function of (train.seed, step, i) that the training batches (seeded (train.seed, step))
  never see;
- evaluation: the run's evaluation set at `monitor.eval_sequences` rows, chosen as
  `depthdiag diagnose --eval-set` chooses it (diag/evalset.py: bioS runs score the
  attribute-value tokens);
- the step: the engine's defaults (counterfactual isolation, RMS matched to the first
  update depth) at the learning rate of the next update, lr_at(step), with the run's
  clipping and precision, as a snapshot at that step would be diagnosed.

The check runs on clones (diag/engine.py) inside a guard that restores every process RNG,
so the training that follows is the training without a monitor, to the bit.

The whole (small) file is rewritten atomically after each check. Resume rule: a run
resumed at step s keeps the checks before s and recomputes the rest (the model, the
optimizer and the monitor's batches at s are those of the uninterrupted run), so a killed
and resumed run writes the same file as one that was never interrupted.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from analysis.monitor import KIND, NO_SWITCH, describe, open_monitor
from analysis.store import write_dataset
from common.benefit import benefit_description
from common.errors import InputError
from diag.engine import DiagnosticOptions, UpdateDiagnostic
from diag.evalset import evaluation_set, resolve_eval_set
from trainer.config import RunConfig
from trainer.data import TokenSource, build_source
from trainer.optim import OPTIMIZER_CLASSES, lr_at
from trainer.rng import process_rng_state, seeded_generator, set_process_rng_state
from trainer.run_dir import MONITOR_FILE
from trainer.schedules import parse_schedule
from trainer.train import TrainSummary, train

MONITOR_SALT = 0x30A1_70C4
"""Third word of the monitor's batch seeds: keeps them apart from every training stream."""

PER_BATCH = ("nll", "benefit", "benefit_all", "update_rms", "rms_scale", "update_cosine", "train_loss")
"""The engine's per-unit variables, stacked along `batch`."""


def monitor_batch_seed(train_seed: int, step: int) -> int:
    """The seed of the monitor's batches at the check after `step` updates."""
    return int(seeded_generator(train_seed, step, MONITOR_SALT).integers(0, 2**63))


@contextlib.contextmanager
def untouched_process_state(device: torch.device) -> Iterator[None]:
    """Run the block outside any autocast region of the caller (the engine opens its own for
    bf16 runs) and leave every process-wide RNG (torch, CUDA, numpy, Python) and the grad
    mode as they were before it, however it ends. The engine itself draws no random number;
    this keeps it so for any model it is given."""
    rng = process_rng_state()
    grad = torch.is_grad_enabled()
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        set_process_rng_state(rng)
        torch.set_grad_enabled(grad)


class UpdateMonitor:
    """The hook of trainer/hooks.py for one run (rank 0): checks due steps into RUN/monitor.h5.

    Construction is cheap (the data source and the evaluation set are built at the first
    check, which only rank 0 runs), so every torchrun rank may build one."""

    def __init__(self, config: RunConfig, run_dir: str | Path):
        if not config.monitor.enabled:
            raise InputError("monitor.every is 0: the monitor is off")
        self.config = config
        self.path = Path(run_dir) / MONITOR_FILE
        self.schedule = parse_schedule(
            config.train.schedule, seed=config.train.seed, total_updates=config.train.updates
        )
        self.eval_set = resolve_eval_set(config.monitor.eval_set, config, "monitor.eval_set")
        self._checks: list[xr.Dataset] = []
        self._attrs: dict = {}
        self._source = None
        self._eval: tuple[torch.Tensor, torch.Tensor | None] | None = None

    # --- which steps ---

    def due(self, step: int) -> bool:
        """Whether a check runs after `step` updates."""
        return step > 0 and (step % self.config.monitor.every == 0 or step == self.schedule.switch_step)

    def steps(self) -> list[int]:
        """Every step a full run checks, in order."""
        return [step for step in range(self.config.train.updates + 1) if self.due(step)]

    # --- the hook ---

    @property
    def source(self) -> TokenSource:
        """The run's data source (built on first use)."""
        if self._source is None:
            self._source = build_source(self.config.data)
        return self._source

    @property
    def evaluation(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(eval_tokens int64 [E, T+1], eval_mask bool [E, T] or None) every check scores."""
        if self._eval is None:
            rows = self.config.monitor.eval_sequences
            self._eval = evaluation_set(self.eval_set, self.config, rows=rows, source=self.source)
        return self._eval

    def resume(self, step: int) -> None:
        """Keep the checks before `step` from RUN/monitor.h5 (none for a fresh run) and write
        the file back with those alone."""
        self._attrs = self.file_attrs()
        self._checks = []
        if step > 0 and self.path.is_file():
            stored = open_monitor(self.path)
            if stored.attrs.get("config") != self.config.to_json():
                raise InputError(f"{self.path}: written by a run of another config; move it away to resume")
            kept = stored.sel(step=stored["step"].values < step)
            if kept.sizes["step"]:
                self._checks = [kept]
        self._write()

    def after_update(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not self.due(step):
            return
        if not self._attrs:
            raise RuntimeError("UpdateMonitor.resume must be called before after_update")
        device = next(model.parameters()).device
        with untouched_process_state(device):
            self._checks.append(self.check(step, model, optimizer))
        self._write()

    def close(self) -> None:
        self._checks, self._attrs, self._source, self._eval = [], {}, None, None

    # --- one check ---

    def options(self, step: int) -> DiagnosticOptions:
        mc, cfg = self.config.monitor, self.config
        return DiagnosticOptions(
            update_depths=mc.update_depths,
            serving_depths=mc.serving_depths,
            lr=lr_at(step, cfg.optim, cfg.train.updates),
            grad_clip=cfg.optim.grad_clip or None,
            precision=cfg.train.precision,
        )

    def batches(self, step: int) -> list[torch.Tensor]:
        """The check's batches, int64 [B, T+1] each (the run's global batch shape)."""
        tc = self.config.train
        seed = monitor_batch_seed(tc.seed, step)
        return [self.source.batch(seed, i, tc.batch_size, tc.seq_len) for i in range(self.config.monitor.batches)]

    def check(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> xr.Dataset:
        """The diagnostic of the model and optimizer after `step` updates: a Dataset with a
        `step` dimension of length 1. Leaves the model and optimizer as they were."""
        eval_tokens, eval_mask = self.evaluation
        diagnostic = UpdateDiagnostic(model, optimizer, eval_tokens, self.options(step), eval_mask=eval_mask)
        units = [diagnostic.compare(batch) for batch in self.batches(step)]
        stacked = xr.concat([unit[[n for n in PER_BATCH if n in unit]] for unit in units], dim="batch")
        stacked = stacked.assign_coords(batch=np.arange(len(units), dtype=np.int64))
        depths = np.arange(1, self.schedule.max_depth + 1, dtype=np.int64)
        distribution = self.schedule.depth_distribution(step)
        ds = stacked.assign(
            nll_before=units[0]["nll_before"],
            lr=((), np.float64(diagnostic.options.lr)),
            depth_probability=(("depth",), np.array([distribution.get(int(d), 0.0) for d in depths])),
        ).assign_coords(depth=depths)
        ds.attrs = dict(units[0].attrs)
        return ds.expand_dims(step=[step])

    # --- the file ---

    def dataset(self) -> xr.Dataset | None:
        """Every check so far as one Dataset over `step` (None before the first)."""
        if not self._checks:
            return None
        ds = xr.concat(self._checks, dim="step", combine_attrs="override") if len(self._checks) > 1 else self._checks[0]
        ds = ds.transpose("step", "batch", "update_depth", "serving_depth", "depth")
        ds.attrs = dict(self._attrs)
        ds["benefit"].attrs["description"] = benefit_description(
            self.config.monitor.update_depths[0], self.config.monitor.update_depths[-1]
        )
        return describe(ds)

    def file_attrs(self) -> dict:
        """The file's attributes: the run, the monitor's settings and the versions."""
        from common.provenance import provenance

        cfg, mc = self.config, self.config.monitor
        switch = self.schedule.switch_step
        used = self.options(0)  # every check's options but the step's learning rate
        return {
            "kind": KIND,
            "config": cfg.to_json(),
            "monitor": json.dumps(asdict(mc), sort_keys=True),
            "schedule": cfg.train.schedule,
            "switch_step": NO_SWITCH if switch is None else int(switch),
            "updates": cfg.train.updates,
            "eval_set": self.eval_set,
            "eval_sequences": mc.eval_sequences,
            "isolate": used.isolate,
            "rms_match": used.rms_match,
            "optimizer": OPTIMIZER_CLASSES[cfg.optim.name],
            "grad_clip": float(used.grad_clip or 0.0),
            "precision": used.precision,
            "batch_stream": (
                "batch i of the check after step updates: source.batch(seeded_generator(train.seed, step, "
                f"{MONITOR_SALT:#x}).integers(2**63), i, train.batch_size, train.seq_len)"
            ),
            **provenance(),
        }

    def _write(self) -> None:
        ds = self.dataset()
        if ds is None:
            self.path.unlink(missing_ok=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_dataset(ds, self.path)


def train_with_monitor(
    config: RunConfig, run_dir: str | Path, *, resume: bool = False, force: bool = False, progress: bool = True
) -> TrainSummary:
    """`trainer.train.train` with an `UpdateMonitor` when config.monitor is on (what `depthdiag
    train` runs)."""
    monitor = UpdateMonitor(config, run_dir) if config.monitor.enabled else None
    return train(config, run_dir, resume=resume, force=force, progress=progress, monitor=monitor)
