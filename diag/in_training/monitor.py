"""The in-training monitor: the update diagnostic on the live model and optimizer, every
`every` updates, into a monitor file (analysis/monitor.py has the schema).

`DepthMonitor` is the monitor for any training loop (docs/your-run.md; the Trainer callbacks of
diag/in_training/hf_callbacks.py wrap it): the loop calls `after_update(step, model, optimizer)` and supplies
the monitor's own batches. `UpdateMonitor` is the same monitor configured from a depthdiag run:
`depthdiag train` passes one to `trainer.train.train(..., monitor=)` when the config's [monitor]
block is on (a library caller does the same: `train(config, run_dir,
monitor=UpdateMonitor(config, run_dir))`); the training loop calls it through the protocol of
trainer/hooks.py and never imports diag.

A check of a depthdiag run after `step` updates, when step is a positive multiple of
`monitor.every` or the schedule's switch step (not step 0: see MonitorConfig):

- batches: `monitor.batches` batches of the run's global batch shape from the run's data
  source, through a stream of their own: batch i is `source.batch(seed_s, i, ...)` with
  seed_s = seeded_generator(train.seed, step, MONITOR_SALT).integers(2**63), a pure
  function of (train.seed, step, i) that the training batches (seeded (train.seed, step))
  never see;
- evaluation: the run's evaluation set at `monitor.eval_sequences` rows, chosen as
  `depthdiag diagnose --eval-set` chooses it (diag/sources/evalset.py: bioS runs score the
  attribute-value tokens);
- the step: the engine's defaults (counterfactual isolation, RMS matched to the first
  update depth) at the learning rate of the next update, lr_at(step), with the run's
  clipping and precision, as a snapshot at that step would be diagnosed.

The check runs on clones (diag/arithmetic/engine.py) inside a guard that restores every process RNG,
so the training that follows is the training without a monitor, to the bit.

The whole (small) file is rewritten atomically after each check. Resume rule: a run
resumed at step s keeps the checks before s and recomputes the rest (the model, the
optimizer and the monitor's batches at s are those of the uninterrupted run), so a killed
and resumed run writes the same file as one that was never interrupted.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from analysis.monitor import KIND, NO_SWITCH, describe, is_monitor_file, open_monitor
from analysis.store import write_dataset
from common.benefit import benefit_description
from common.depths import SERVING_DEPTHS, UPDATE_DEPTHS
from common.errors import InputError
from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic
from diag.arithmetic.families import ModelFamily
from diag.sources.evalset import evaluation_set, resolve_eval_set
from trainer.config import RunConfig
from trainer.data.sources import TokenSource, build_source
from trainer.distributed import is_sharded
from trainer.machine import machine
from trainer.optim import OPTIMIZER_CLASSES, lr_at
from trainer.rng import process_rng_state, seeded_generator, set_process_rng_state
from trainer.run_dir import MONITOR_FILE
from trainer.schedules import parse_schedule

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


BatchStream = Callable[[int, int], torch.Tensor]
"""(step, i) -> batch i of the check after `step` updates, int64 [B, T+1]: the monitor's own
batches, which the training's data order never sees."""


def window_batches(tokens: torch.Tensor | np.ndarray, *, batch_size: int, seq_len: int, seed: int = 0) -> BatchStream:
    """A monitor batch stream from a flat array of token ids (e.g. a memmap of train.bin): batch
    i of the check after `step` updates is `batch_size` windows of seq_len + 1 tokens whose starts
    are drawn from a generator seeded (seed, step, i, MONITOR_SALT), a pure function of those, so
    a resumed run draws the same batches and the training's own data order is never touched."""
    flat = tokens.detach().cpu().numpy() if torch.is_tensor(tokens) else np.asarray(tokens)
    if flat.ndim != 1 or not np.issubdtype(flat.dtype, np.integer):
        raise InputError("window_batches takes a flat array of integer token ids")
    last_start = len(flat) - seq_len - 1
    if last_start < 0:
        raise InputError(f"window_batches: {len(flat)} tokens, fewer than seq_len + 1 = {seq_len + 1}")

    def batch(step: int, i: int) -> torch.Tensor:
        starts = seeded_generator(seed, step, i, MONITOR_SALT).integers(0, last_start + 1, size=batch_size)
        index = starts[:, None] + np.arange(seq_len + 1)  # [batch_size, seq_len + 1]
        return torch.from_numpy(flat[index].astype(np.int64))

    return batch


def main_process() -> bool:
    """Rank 0 of torchrun (or a single process): the one that checks; the others go on."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or (
        torch.distributed.get_rank() == 0
    )


class DepthMonitor:
    """The update diagnostic inside a training loop, every `every` updates (and at the extra
    `check_steps`, e.g. a schedule's switch), into one monitor file (analysis/monitor.py's
    schema, which `summarize`, `plot --figure monitor` and `recommend` read).

    The loop calls `after_update(step, model, optimizer)` after each update (step = updates
    done; the optimizer then holds the learning rate of the next update). A check runs the
    diagnostic on clones of the model and the optimizer with the monitor's own batches
    (`batches(step, i)`, supplied by the caller) inside a guard that restores every process
    RNG, the grad mode and autocast, so the training that follows is the training without
    the monitor, to the bit. Under torchrun only rank 0 checks and the others return at once,
    unless the model is sharded with FSDP2: then every rank runs the check together
    (diag/arithmetic/sharded.py) and rank 0 writes.
    The whole (small) file is rewritten atomically after each check.

    Resume: `resume(step)` (or `start_step` at construction) keeps the checks of the file
    before `step` and recomputes the rest, so a killed and resumed run writes the file of an
    uninterrupted one; a file written with other settings (`identity`) is refused.

    `depthdiag train` runs this monitor too, configured from the run (`UpdateMonitor`)."""

    def __init__(
        self,
        path: str | Path,
        *,
        batches: BatchStream,
        eval_tokens: torch.Tensor,
        every: int,
        eval_mask: torch.Tensor | None = None,
        batches_per_check: int = 4,
        update_depths: Sequence[int] = UPDATE_DEPTHS,
        serving_depths: Sequence[int] = SERVING_DEPTHS,
        lr: float | Callable[[int], float] | None = None,
        grad_clip: float | None = None,
        precision: str = "fp32",
        family: ModelFamily | None = None,
        depth_kwarg: str = "depth",
        schedule: str | None = None,
        updates: int | None = None,
        seed: int = 0,
        check_steps: Sequence[int] = (),
        description: Mapping[str, Any] | None = None,
        start_step: int | None = None,
    ):
        if not (isinstance(every, int) and every >= 0):
            raise InputError(f"every must be a number of updates >= 0, got {every!r}")
        if not (isinstance(batches_per_check, int) and batches_per_check >= 1):
            raise InputError(f"batches_per_check must be >= 1, got {batches_per_check!r}")
        self.path = Path(path)
        self._batch_stream = batches
        self._eval = (eval_tokens, eval_mask)
        self.every = every
        self.batches_per_check = batches_per_check
        self._lr = lr
        self._options = DiagnosticOptions(
            update_depths=tuple(update_depths),
            serving_depths=tuple(serving_depths),
            grad_clip=grad_clip,
            precision=precision,
            family=family,
            depth_kwarg=depth_kwarg,
        )
        self.schedule = None if schedule is None else parse_schedule(schedule, seed=seed, total_updates=updates)
        """The depth schedule training draws from (trainer/schedules.py), when it follows one:
        its switch is checked, and each check records its depth distribution."""
        self.updates = updates
        self._seed = seed
        switch = None if self.schedule is None else self.schedule.switch_step
        self.check_steps = frozenset(int(s) for s in check_steps) | ({switch} if switch is not None else set())
        """Steps checked besides the multiples of `every`."""
        self.description = dict(description or {})
        """What the file's `config` attribute says of the run (JSON), besides the monitor's settings."""
        self._checks: list[xr.Dataset] = []
        self._attrs: dict = {}
        self._resumed = False
        if start_step is not None:
            self.resume(start_step)

    # --- which steps ---

    def due(self, step: int) -> bool:
        """Whether a check runs after `step` updates (never before the first update)."""
        return step > 0 and ((self.every > 0 and step % self.every == 0) or step in self.check_steps)

    def steps(self, updates: int | None = None) -> list[int]:
        """Every step a run of `updates` updates (default: the schedule's) checks, in order."""
        total = self.updates if updates is None else updates
        if total is None:
            raise InputError("steps() needs the run's number of updates")
        return [step for step in range(total + 1) if self.due(step)]

    # --- what a check uses (`UpdateMonitor` takes them from the run) ---

    def batches(self, step: int) -> list[torch.Tensor]:
        """The check's batches, int64 [B, T+1] each."""
        return [self._batch_stream(step, i) for i in range(self.batches_per_check)]

    @property
    def evaluation(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(eval_tokens int64 [E, T+1], eval_mask bool [E, T] or None) every check scores."""
        return self._eval

    def options(self, step: int) -> DiagnosticOptions:
        """The diagnostic's options of the check after `step` updates: the learning rate is
        `lr` (a number, or a function of the step), or None: each param group's own, which after
        an update is the next update's when the loop's scheduler has stepped."""
        lr = self._lr(step) if callable(self._lr) else self._lr
        return replace(self._options, lr=lr)

    def identity(self) -> str:
        """What a resumed run must share with the file's writer (its `config` attribute)."""
        settings = {
            "every": self.every,
            "batches_per_check": self.batches_per_check,
            "update_depths": list(self._options.update_depths),
            "serving_depths": list(self._options.serving_depths),
            "lr": self._lr if isinstance(self._lr, (int, float)) or self._lr is None else "per step",
            "grad_clip": self._options.grad_clip,
            "precision": self._options.precision,
            "model_family": None if self._options.family is None else self._options.family.name,
            "depth_kwarg": self._options.depth_kwarg,
            "schedule": None if self.schedule is None else self.schedule.spec,
            "updates": self.updates,
            "seed": self._seed,
            "check_steps": sorted(self.check_steps),
        }
        return json.dumps({"depth_monitor": settings, **self.description}, sort_keys=True, default=str)

    def file_attrs(self) -> dict:
        """The file's attributes: the run (as `description` tells it), the settings, the versions."""
        from common.provenance import provenance

        used = self.options(0)
        switch = None if self.schedule is None else self.schedule.switch_step
        eval_tokens, eval_mask = self.evaluation
        return {
            "kind": KIND,
            "config": self.identity(),
            "monitor": json.dumps(json.loads(self.identity())["depth_monitor"], sort_keys=True),
            "schedule": "" if self.schedule is None else self.schedule.spec,
            "switch_step": NO_SWITCH if switch is None else int(switch),
            "updates": -1 if self.updates is None else int(self.updates),
            "eval_set": "given" if eval_mask is None else "given, masked",
            "eval_sequences": int(eval_tokens.shape[0]),
            "isolate": used.isolate,
            "rms_match": used.rms_match,
            "grad_clip": float(used.grad_clip or 0.0),
            "precision": used.precision,
            "batch_stream": "batch i of the check after step updates: the caller's batches(step, i)",
            **(
                {}
                if used.family is None
                else {"model_family": used.family.name, "backprop": used.family.backprop_text()}
            ),
            **provenance(),
        }

    # --- the hook (trainer/hooks.py) ---

    def resume(self, step: int) -> None:
        """Keep the checks before `step` of the file (none for a fresh run: step 0) and write the
        file back with those alone."""
        self._attrs = self.file_attrs()
        self._checks = []
        self._resumed = True
        if not main_process():
            return
        if self.path.exists() and not is_monitor_file(self.path):
            raise InputError(f"{self.path}: exists and is not a monitor file; the monitor writes nothing over it")
        if step > 0 and self.path.is_file():
            stored = open_monitor(self.path)
            if stored.attrs.get("config") != self._attrs["config"]:
                raise InputError(f"{self.path}: written by a run of another config; move it away to resume")
            kept = stored.sel(step=stored["step"].values < step)
            if kept.sizes["step"]:
                self._checks = [kept]
        self._write()

    def after_update(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Check the model and optimizer after `step` updates when the step is due: on rank 0
        alone, or for an FSDP2-sharded model on every rank together (rank 0 writes)."""
        if not self.due(step) or not (main_process() or is_sharded(model)):
            return
        if not self._resumed:
            self.resume(0)
        if "optimizer" not in self._attrs:
            self._attrs["optimizer"] = type(optimizer).__name__
        device = next(model.parameters()).device
        # The machine whose kernels computed the checks; a resume elsewhere records its own.
        self._attrs["machine"] = machine(device.type)
        with untouched_process_state(device):
            check = self.check(step, model, optimizer)
        if main_process():
            self._checks.append(check)
            self._write()

    def close(self) -> None:
        self._checks, self._attrs, self._resumed = [], {}, False

    # --- one check ---

    def depth_distribution(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(depths, probability of each as the training depth at `step`): the schedule's, or
        NaN over 1..the deepest depth compared when training follows no schedule the monitor knows."""
        if self.schedule is None:
            deepest = max(*self._options.update_depths, *self._options.serving_depths)
            depths = np.arange(1, deepest + 1, dtype=np.int64)
            return depths, np.full(len(depths), np.nan)
        depths = np.arange(1, self.schedule.max_depth + 1, dtype=np.int64)
        distribution = self.schedule.depth_distribution(step)
        return depths, np.array([distribution.get(int(d), 0.0) for d in depths])

    def check(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> xr.Dataset:
        """The diagnostic of the model and optimizer after `step` updates: a Dataset with a
        `step` dimension of length 1. Leaves the model and optimizer as they were."""
        eval_tokens, eval_mask = self.evaluation
        kind = UpdateDiagnostic
        if is_sharded(model):
            from diag.arithmetic.sharded import (
                ShardedUpdateDiagnostic as kind,  # FSDP2's imports, for sharded runs only
            )
        diagnostic = kind(model, optimizer, eval_tokens, self.options(step), eval_mask=eval_mask)
        units = [diagnostic.compare(batch) for batch in self.batches(step)]
        stacked = xr.concat([unit[[n for n in PER_BATCH if n in unit]] for unit in units], dim="batch")
        stacked = stacked.assign_coords(batch=np.arange(len(units), dtype=np.int64))
        depths, probability = self.depth_distribution(step)
        ds = stacked.assign(
            nll_before=units[0]["nll_before"],
            lr=((), np.float64(diagnostic.step.lrs[0] if diagnostic.options.lr is None else diagnostic.options.lr)),
            depth_probability=(("depth",), probability),
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
        update_depths = self._options.update_depths
        ds["benefit"].attrs["description"] = benefit_description(update_depths[0], update_depths[-1])
        return describe(ds)

    def _write(self) -> None:
        ds = self.dataset()
        if ds is None:
            self.path.unlink(missing_ok=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_dataset(ds, self.path)


class UpdateMonitor(DepthMonitor):
    """The DepthMonitor of a depthdiag run (rank 0): the run's config says everything, into
    RUN/monitor.h5 (see the module docstring).

    Construction is cheap (the data source and the evaluation set are built at the first
    check, which only rank 0 runs), so every torchrun rank may build one."""

    def __init__(self, config: RunConfig, run_dir: str | Path):
        if not config.monitor.enabled:
            raise InputError("monitor.every is 0: the monitor is off")
        mc, tc = config.monitor, config.train
        self.config = config
        self.eval_set = resolve_eval_set(mc.eval_set, config, "monitor.eval_set")
        self._source = None
        self._evaluation: tuple[torch.Tensor, torch.Tensor | None] | None = None
        super().__init__(
            Path(run_dir) / MONITOR_FILE,
            batches=self._run_batch,
            eval_tokens=torch.empty(0, 2, dtype=torch.long),  # built on first use: `evaluation`
            every=mc.every,
            batches_per_check=mc.batches,
            update_depths=mc.update_depths,
            serving_depths=mc.serving_depths,
            lr=functools.partial(lr_at, optim=config.optim, total_updates=tc.updates),
            grad_clip=config.optim.grad_clip or None,
            precision=tc.precision,
            schedule=tc.schedule,
            updates=tc.updates,
            seed=tc.seed,
        )

    @property
    def source(self) -> TokenSource:
        """The run's data source (built on first use)."""
        if self._source is None:
            self._source = build_source(self.config.data)
        return self._source

    def _run_batch(self, step: int, i: int) -> torch.Tensor:
        tc = self.config.train
        return self.source.batch(monitor_batch_seed(tc.seed, step), i, tc.batch_size, tc.seq_len)

    @property
    def evaluation(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The run's evaluation set at monitor.eval_sequences rows, as diagnose chooses it."""
        if self._evaluation is None:
            rows = self.config.monitor.eval_sequences
            self._evaluation = evaluation_set(self.eval_set, self.config, rows=rows, source=self.source)
        return self._evaluation

    def identity(self) -> str:
        return self.config.to_json()

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

    def close(self) -> None:
        super().close()
        self._source, self._evaluation = None, None
