"""transformers.Trainer callbacks: the depth-need monitor, switch-point snapshots, and a depth
schedule driving a looped model's training depth (the optional `hf` extra).

    trainer = transformers.Trainer(model, args, train_dataset=..., callbacks=[
        ScheduledDepthCallback("fixed-first:k0=4,switch=0.8,finish=uniform:1-16", updates=args.max_steps),
        DepthMonitorCallback(batches=monitor_batches, eval_tokens=held_out, every=50,
                             schedule="fixed-first:k0=4,switch=0.8,finish=uniform:1-16"),
        SnapshotCallback(batches=monitor_batches, eval_tokens=held_out, steps=(400,)),
    ])

Each writes into the Trainer's output folder: OUTPUT/monitor.h5 (the schema `summarize`,
`plot --figure monitor` and `recommend` read) and OUTPUT/snapshot-STEP/ (a snapshot folder that
`depthdiag diagnose` reads). They act at `on_step_end`, when the Trainer has taken the update of
`state.global_step` and stepped its scheduler: the optimizer then holds the learning rate of the
next update, the one a snapshot or a check diagnoses. Neither changes the training: a check runs
on clones inside a guard that restores every RNG (diag/in_training/monitor.py), a snapshot only reads.

The model family (how to call the model at a depth, diag/arithmetic/families.py) is detected from the
model's `config.model_type` unless given; the gradient clipping and the precision default to the
Trainer's own (`args.max_grad_norm`, `args.bf16`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import TrainerCallback

from common.depths import SERVING_DEPTHS, UPDATE_DEPTHS
from diag.arithmetic.families import ModelFamily, detect_family
from diag.in_training.monitor import BatchStream, DepthMonitor, main_process
from trainer.schedules import parse_schedule

MONITOR_NAME = "monitor.h5"
"""The monitor's file in the Trainer's output folder."""


def _inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's wrapper (its state is the one that steps)."""
    return getattr(optimizer, "optimizer", optimizer)


def _family(model: torch.nn.Module, family: ModelFamily | None) -> ModelFamily:
    if family is not None:
        return family
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return detect_family(model_type, f"the Trainer's model ({type(model).__name__})")


def _training_settings(args, grad_clip: float | None, precision: str | None) -> tuple[float | None, str]:
    clip = (args.max_grad_norm or None) if grad_clip is None else grad_clip
    return clip, precision or ("bf16" if args.bf16 else "fp32")


class ScheduledDepthCallback(TrainerCallback):
    """Trains a looped model at the depth a depth schedule draws for each update: before update
    `step`, `model.config.<attribute>` is set to the schedule's depth (the depth the model's
    forward uses when called without one, as the Trainer calls it), and after the update it is
    set back, so a checkpoint saves the model's serving depth. `schedule` is a spec of
    trainer/schedules.py over `updates` updates, or any function of the step."""

    def __init__(
        self,
        schedule: str | Callable[[int], int],
        *,
        updates: int | None = None,
        seed: int = 0,
        attribute: str = "num_steps",
    ):
        if isinstance(schedule, str):
            schedule = parse_schedule(schedule, seed=seed, total_updates=updates).depth_at
        self.depth_at = schedule
        self.attribute = attribute
        self._serving: int | None = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._serving = getattr(model.config, self.attribute)
        setattr(model.config, self.attribute, int(self.depth_at(state.global_step)))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self._serving is not None:
            setattr(model.config, self.attribute, self._serving)
            self._serving = None


class DepthMonitorCallback(TrainerCallback):
    """The depth-need monitor (diag.DepthMonitor) in a Trainer run, into OUTPUT/monitor.h5.

    `batches(step, i)` gives the check's batch i after `step` updates (the monitor's own stream,
    never the training batches; `diag.in_training.monitor.window_batches` draws them from a token array);
    `eval_tokens` [E, T+1] is the held-out set every check scores. `schedule` (a spec of
    trainer/schedules.py, over the run's max_steps updates) is the depth schedule training
    follows, when it follows one: its switch is checked and its depth distribution recorded. A
    run resumed from a checkpoint keeps the checks before its step and recomputes the rest."""

    def __init__(
        self,
        *,
        batches: BatchStream,
        eval_tokens: torch.Tensor,
        every: int,
        eval_mask: torch.Tensor | None = None,
        batches_per_check: int = 2,
        update_depths: Sequence[int] = UPDATE_DEPTHS,
        serving_depths: Sequence[int] = SERVING_DEPTHS,
        family: ModelFamily | None = None,
        schedule: str | None = None,
        seed: int = 0,
        grad_clip: float | None = None,
        precision: str | None = None,
        name: str = MONITOR_NAME,
    ):
        self._settings = dict(
            batches=batches,
            eval_tokens=eval_tokens,
            eval_mask=eval_mask,
            every=every,
            batches_per_check=batches_per_check,
            update_depths=tuple(update_depths),
            serving_depths=tuple(serving_depths),
            schedule=schedule,
            seed=seed,
        )
        self._family, self._grad_clip, self._precision, self.name = family, grad_clip, precision, name
        self.monitor: DepthMonitor | None = None
        """The run's monitor, from the start of training."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        grad_clip, precision = _training_settings(args, self._grad_clip, self._precision)
        self.monitor = DepthMonitor(
            Path(args.output_dir) / self.name,
            **self._settings,
            family=_family(model, self._family),
            grad_clip=grad_clip,
            precision=precision,
            updates=state.max_steps,
            description={"trainer": {"output_dir": str(args.output_dir), "max_steps": state.max_steps}},
        )
        self.monitor.resume(state.global_step)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.monitor.after_update(state.global_step, model, _inner_optimizer(optimizer))

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()


class SnapshotCallback(TrainerCallback):
    """Switch-point snapshots of a Trainer run: after update `step` for every step of `steps`
    and the `schedule`'s switch (a spec over the run's max_steps updates), the model, the
    optimizer, `n_batches` batches `batches(step, i)` and `eval_tokens` go to
    OUTPUT/snapshot-STEP/ (diag.save_snapshot), a folder `depthdiag diagnose` reads."""

    def __init__(
        self,
        *,
        batches: BatchStream,
        eval_tokens: torch.Tensor,
        steps: Sequence[int] = (),
        schedule: str | None = None,
        seed: int = 0,
        n_batches: int = 4,
        eval_mask: torch.Tensor | None = None,
        family: ModelFamily | None = None,
        grad_clip: float | None = None,
        precision: str | None = None,
    ):
        self.batches, self.eval_tokens, self.eval_mask = batches, eval_tokens, eval_mask
        self.steps, self.schedule, self.seed, self.n_batches = frozenset(steps), schedule, seed, n_batches
        self._family, self._grad_clip, self._precision = family, grad_clip, precision
        self._due: frozenset[int] = frozenset()
        self.written: list[Path] = []
        """The snapshot folders written so far."""

    def on_train_begin(self, args, state, control, **kwargs):
        switch = None
        if self.schedule is not None:
            switch = parse_schedule(self.schedule, seed=self.seed, total_updates=state.max_steps).switch_step
        self._due = self.steps | ({switch} if switch is not None else set())

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        step = state.global_step
        if step not in self._due or not main_process():
            return
        import diag

        grad_clip, precision = _training_settings(args, self._grad_clip, self._precision)
        self.written.append(
            diag.save_snapshot(
                Path(args.output_dir) / f"snapshot-{step}",
                model,
                _inner_optimizer(optimizer),
                [self.batches(step, i) for i in range(self.n_batches)],
                self.eval_tokens,
                step=step,
                family=_family(model, self._family),
                grad_clip=grad_clip,
                precision=precision,
                eval_mask=self.eval_mask,
            )
        )
