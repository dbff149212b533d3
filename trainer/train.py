"""The training loop, one for every depth schedule.

Update `step` (0-based) trains at depth `schedule.depth_at(step)` on the global
batch `source.batch(train.seed, step, ...)` with learning rate `lr_at(step)`;
all three are pure functions of the step, so a resumed run and every torchrun
rank agree without communication.

A run directory holds:

    config.json                    the run config (JSON)
    metrics.jsonl                  a line per log_every updates and per checkpoint (see `train`)
    tensorboard/, wandb/           TensorBoard and W&B mirrors of the metrics lines, when [logging] asks
    checkpoints/step_XXXXXX.pt     resumable state after XXXXXX updates; `latest` names the newest
    checkpoints/step_XXXXXX.dcp/   the same, of a run sharded with train.parallel='fsdp' under torchrun:
                                   torch.distributed.checkpoint shards of the model and optimizer and
                                   meta.pt (trainer/checkpoint.py); resumable at any number of processes
    snapshots/uNNNN_stepXXXXXX.pt  diagnostic inputs NNNN updates after the switch; of a sharded run
                                   snapshots/uNNNN_stepXXXXXX.dcp/, shards and meta.pt as its checkpoints
    monitor.h5                     the in-training update diagnostic, when a monitor is given
                                   (diag/in_training/monitor.py)
    summary.json                   written when the run finishes

While a run writes it, `.DIR.lock` beside the directory (common/lock.py) keeps a second
run out of it.

Run it with `depthdiag train CONFIG` or, distributed,
`torchrun --nproc_per_node=N -m depthdiag train CONFIG [--out DIR] [--set k=v] [--resume DIR]`,
the ranks replicating the model (DDP, train.parallel='ddp') or sharding it (FSDP2, 'fsdp').
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from common.atomic import atomic_write_text
from common.errors import InputError, RunFailed
from common.lock import exclusive_output
from common.outputs import check_output, empty_folder
from common.progress import progress_bar
from trainer.checkpoint import (
    CHECKPOINT_DIR,
    LATEST,
    SNAPSHOT_DIR,
    checkpoint_name,
    latest_checkpoint,
    save_checkpoint,
    save_sharded_state,
    save_snapshot,
    snapshot_name,
)
from trainer.config import RunConfig
from trainer.data.sources import TokenSource, build_source
from trainer.distributed import (
    World,
    all_gather_ints,
    all_reduce_int,
    all_reduce_sum,
    barrier,
    init_world,
    shard_model,
    shutdown_world,
)
from trainer.flops import update_flops
from trainer.hooks import TrainingMonitor
from trainer.loss import clip_gradients_, counted_targets, forward_precision, loss_sum_of
from trainer.model import LoopedTransformer
from trainer.optim import build_optimizer, lr_at
from trainer.resources import check_memory
from trainer.run_dir import RUN_DIRECTORY
from trainer.run_setup import (
    checked_schedule,
    initial_model,
    load_sharded_checkpoint,
    machines_that_trained,
    prepare_run_dir,
    snapshot_steps,
)
from trainer.schedules import Schedule
from trainer.scoring import mean_nll_by_depth
from trainer.sinks import MetricsSink, build_sinks, check_extras


class TrainStep:
    """One training update: the forward at a depth under the run's precision, the summed
    token loss divided by the counted targets, backward, global-norm clipping and the
    optimizer step. The loop, the benchmarks and the GPU check all train through it, so
    there is one definition of an update.

    Nothing is read back to the host: the loss sum and the gradient norm come back as
    tensors, and a device keeps working until the caller logs them."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        precision: str = "fp32",
        grad_clip: float = 0.0,
        forward: torch.nn.Module | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.precision = precision
        self.grad_clip = grad_clip
        self.forward = forward if forward is not None else model
        """What the forward runs through: the model, or its DistributedDataParallel wrapper."""
        self.params = [p for p in model.parameters() if p.requires_grad]

    @classmethod
    def for_run(cls, model: torch.nn.Module, config: RunConfig, forward: torch.nn.Module | None = None) -> TrainStep:
        """The run's optimizer over `model` (already on its device) and the run's settings;
        compiles the model's blocks when the run asks for it."""
        if config.train.compile:
            model.compile_blocks()
        return cls(
            model,
            build_optimizer(model, config.optim),
            precision=config.train.precision,
            grad_clip=config.optim.grad_clip,
            forward=forward,
        )

    def __call__(
        self, batch: torch.Tensor, depth: int, lr: float, divisor: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take one update on `batch` int64 [B, T+1] (on the model's device) at `depth` with
        learning rate `lr`; returns (summed token loss, gradient norm before clipping).
        The loss is divided by `divisor`, by default this batch's counted targets (under
        DDP the loop passes the global count per rank, as DDP averages over ranks)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = loss_sum_of(self.forward, batch, depth, precision=self.precision)
        (loss_sum / (divisor if divisor is not None else counted_targets(batch))).backward()
        grad_norm = clip_gradients_([p.grad for p in self.params if p.grad is not None], self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum.detach(), grad_norm.detach()


@dataclass(frozen=True)
class TrainSummary:
    """What a finished run reports (also written to run_dir/summary.json)."""

    run_dir: str
    """The run directory."""
    updates: int
    """Updates completed."""
    resumed_from: int
    """Step the run resumed from (0 for a fresh run)."""
    final_loss: float
    """Mean training loss over the last logging interval."""
    tokens: int
    """Training tokens consumed over the whole run (global)."""
    flops: float
    """Cumulative modeled FLOPs over the whole run."""
    wall_time: float
    """Seconds of training (checkpoint writes included) over the whole run, resumes included."""
    checkpoints: tuple[str, ...]
    """Checkpoints this invocation wrote."""
    snapshots: tuple[str, ...]
    """Snapshots this invocation wrote."""
    trained_on: tuple[dict[str, str | int], ...] = ()
    """The machines and kernels that trained the run, in the order it met them (trainer/machine.py)."""


def train(
    config: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    monitor: TrainingMonitor | None = None,
) -> TrainSummary:
    """Train `config` into `out_dir` (see the module docstring); under torchrun each
    process calls this and rank 0 writes every file. `resume=True` continues from the
    newest checkpoint in `out_dir` and refuses a config that differs from the stored one.
    A fresh run refuses an existing, non-empty `out_dir` unless `force`, which empties one that
    is a run directory depthdiag wrote (RUN_DIRECTORY) and refuses anything else.

    metrics.jsonl has a line every log_every updates and at every checkpoint: step (0-based
    index of the update), depth (this update's), depth_counts (how many of the updates since
    the previous line trained at each depth: {"depth": count}, depths ascending), loss
    (token-weighted mean over those updates), lr, grad_norm (before clipping), tokens and
    flops (cumulative, this update included), wall_time (seconds since the run began, time
    between an interruption and its resume, the monitor's checks and the validation
    excluded), under torchrun rank_depths (the depth every rank used at this update), and
    with train.eval_every > 0, every eval_every updates and at the last, val_nll_S for each
    depth S of train.eval_depths: the mean token NLL (nats) of the held-out evaluation set
    at serving depth S of the model after this update (eval mode, no gradients, fp32, one
    pass for all depths; rank 0 computes it, every rank when sharded, under bf16 autocast
    there when training in bf16; the training is the same to the bit with it on or off).
    The same scalars go to the sinks [logging] asks for (trainer/sinks.py).

    The run directory is exclusive: rank 0 holds its lock (common/lock.py) from before
    anything in it is read until the run ends, and a second `train` into it, fresh or
    resumed, is refused with InputError naming the holder's pid before it changes anything.

    `monitor` (trainer/hooks.py; rank 0 only) is shown the model and optimizer at the run's
    starting step and after every update; it changes nothing the training computes."""
    run_dir = Path(out_dir)
    check_extras(config)
    world = init_world(config.train.device)
    try:
        with _run_dir_lock(config, run_dir, world, fresh=not resume, force=force):
            run = _set_up(config, run_dir, world, resume=resume)
            sinks = build_sinks(config, run_dir, start=run.start) if world.is_main else []
            try:
                final_loss = _train_updates(run, progress=progress, monitor=monitor, sinks=sinks)
            finally:
                for sink in sinks:
                    sink.close()
            return _finish(run, final_loss)
    finally:
        shutdown_world(world)


@contextlib.contextmanager
def _run_dir_lock(config: RunConfig, run_dir: Path, world: World, *, fresh: bool, force: bool) -> Iterator[None]:
    """Check that the run fits in each rank's device memory (trainer/resources.py, before
    anything is written), then hold the run directory's lock (rank 0) for the block; for a
    `fresh` run, refuse an existing run directory unless `force`, which replaces one depthdiag
    wrote (common/outputs.py). Every rank learns whether all were willing before any other
    collective, so under torchrun a refusal ends every rank with an InputError instead of
    leaving the others waiting at a barrier."""
    with contextlib.ExitStack() as stack:
        refusal = None
        try:
            check_memory(config, world.device, world.world_size)
            if world.is_main:
                stack.enter_context(exclusive_output(run_dir))
                if fresh:
                    check_output(run_dir, kind=RUN_DIRECTORY, force=force)
                    if force:
                        empty_folder(run_dir)
        except InputError as err:
            refusal = err
        refused = all_gather_ints(world, int(refusal is not None))
        if refusal is not None:
            raise refusal
        if any(refused):
            raise InputError(f"{run_dir}: rank {refused.index(1)} refused the run (its error line says why)")
        yield


@dataclass
class _Run:
    """A training run set up in this process (fresh or resumed), and what this invocation wrote."""

    config: RunConfig
    run_dir: Path
    world: World
    schedule: Schedule
    source: TokenSource
    eval_tokens: torch.Tensor
    """int64 [E, T+1]: the evaluation set every checkpoint and snapshot carries."""
    model: LoopedTransformer
    update: TrainStep
    """The training step, holding the optimizer."""
    start: int
    """Updates done before this invocation: the step it resumed from, 0 for a fresh run."""
    counters: dict[str, float]
    """tokens, flops and wall_time over the whole run, resumes included; checkpoints carry them."""
    snapshot_at: dict[int, int]
    """Step -> uniform updates, for every snapshot the run writes."""
    resumed_loss: float
    """The loss of the last metrics line kept from before `start` (rank 0; NaN when there is none)."""
    last_checkpoint: Path | None
    """The newest checkpoint on disk: where a failed run can resume from."""
    trained_on: tuple[dict[str, str | int], ...]
    """The machines that trained the run, this one last (trainer/machine.py): every checkpoint,
    snapshot and the summary records them."""
    checkpoints: list[str] = field(default_factory=list)
    """Checkpoints this invocation wrote."""
    snapshots: list[str] = field(default_factory=list)
    """Snapshots this invocation wrote."""

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over the ranks (FSDP2), so that every rank takes part
        in each checkpoint, snapshot and validation pass."""
        return self.world.distributed and self.config.train.parallel == "fsdp"

    def uniform_updates(self, step: int) -> int:
        switch = self.schedule.switch_step
        return 0 if switch is None else step - switch

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint is written after `step` updates (never at the step resumed from)."""
        tc = self.config.train
        periodic = tc.checkpoint_every and step % tc.checkpoint_every == 0
        return step > self.start and bool(periodic or step == tc.updates)

    def boundary_due(self, step: int) -> bool:
        """Whether a snapshot or a checkpoint is written after `step` updates."""
        return step in self.snapshot_at or self.checkpoint_due(step)

    def write_boundary(self, step: int) -> None:
        """Snapshot and checkpoint due after `step` updates (rank 0; every rank when sharded,
        each writing its own shards of both). The snapshot
        goes first, so a checkpoint on disk implies every snapshot up to its step is too. A
        write the file system refuses (full, read-only, over a size limit) fails the run."""
        if not (self.world.is_main or self.sharded):
            return
        try:
            if step in self.snapshot_at:
                self._write_snapshot(step)
            if self.checkpoint_due(step):
                self._write_checkpoint(step)
        except OSError as err:
            reason = err.strerror or str(err).splitlines()[0]
            raise self.failed(step, f"writing {err.filename or self.run_dir} failed ({reason})") from None

    def failed(self, step: int, problem: str) -> RunFailed:
        """The error that ends the run at `step`, naming where to resume from."""
        resume = f"resume from {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint was written yet"
        return RunFailed(f"{self.run_dir}: step {step}: {problem}; {resume}")

    def _state_at(self, step: int) -> dict[str, Any]:
        """What every checkpoint and snapshot written after `step` updates records."""
        return {
            "config": self.config,
            "step": step,
            "uniform_updates": self.uniform_updates(step),
            "model": self.model,
            "optimizer": self.update.optimizer,
            "lr": lr_at(step, self.config.optim, self.config.train.updates),
            "eval_tokens": self.eval_tokens,
            "trained_on": self.trained_on,
        }

    def _write_snapshot(self, step: int) -> None:
        tc = self.config.train
        batches = torch.stack(
            [self.source.batch(tc.seed, step + i, tc.batch_size, tc.seq_len) for i in range(tc.snapshot_batches)]
        )  # [n, B, T+1]
        path = self.run_dir / SNAPSHOT_DIR / snapshot_name(self.snapshot_at[step], step, sharded=self.sharded)
        if self.sharded:
            save_sharded_state(path, self.world, **self._state_at(step), batches=batches)
            if not self.world.is_main:
                return
        else:
            save_snapshot(path, **self._state_at(step), batches=batches)
        self.snapshots.append(str(path))

    def _write_checkpoint(self, step: int) -> None:
        path = self.run_dir / CHECKPOINT_DIR / checkpoint_name(step, sharded=self.sharded)
        if self.sharded:
            save_sharded_state(path, self.world, **self._state_at(step), progress=self.counters)
            if not self.world.is_main:
                return
        else:
            save_checkpoint(path, **self._state_at(step), progress=self.counters)
        atomic_write_text(path.name + "\n", path.parent / LATEST)
        self.checkpoints.append(str(path))
        self.last_checkpoint = path


def _set_up(config: RunConfig, run_dir: Path, world: World, *, resume: bool) -> _Run:
    """Check the config against the processes and the data; build the model (fresh, or
    resumed from the newest checkpoint), the training step and its optimizer on this
    process's device; prepare the run directory."""
    tc = config.train
    schedule = checked_schedule(config, world)
    source = build_source(config.data)
    if config.model.vocab_size < source.vocab_size:
        raise InputError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the data's vocabulary "
            f"({source.vocab_size} tokens)"
        )
    eval_tokens = source.eval_tokens(config.data.eval_sequences, tc.seq_len)  # [E, T+1]
    sharded = world.distributed and tc.parallel == "fsdp"
    model, checkpoint = initial_model(config, run_dir, resume=resume, sharded=sharded)
    model.to(world.device)
    ddp = None
    if sharded:
        shard_model(model, world, tc.precision)  # before the optimizer, which holds the shards
    elif world.distributed:
        # Every parameter takes part at every depth, so DDP needs no unused-parameter search.
        ddp = DistributedDataParallel(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    update = TrainStep.for_run(model, config, forward=ddp)  # after the move: loaded state follows the parameters
    if checkpoint is not None and sharded:
        load_sharded_checkpoint(checkpoint, model, update.optimizer)
    elif checkpoint is not None:
        update.optimizer.load_state_dict(checkpoint.optimizer_state)
    start = checkpoint.step if checkpoint is not None else 0
    resumed_loss = prepare_run_dir(config, run_dir, world, keep_metrics_before=start)
    return _Run(
        config=config,
        run_dir=run_dir,
        world=world,
        schedule=schedule,
        source=source,
        eval_tokens=eval_tokens,
        model=model,
        update=update,
        start=start,
        counters=dict(checkpoint.progress)
        if checkpoint is not None
        else {"tokens": 0.0, "flops": 0.0, "wall_time": 0.0},
        snapshot_at=snapshot_steps(schedule, config, world),
        resumed_loss=resumed_loss,
        last_checkpoint=latest_checkpoint(run_dir) if checkpoint is not None else None,
        trained_on=machines_that_trained(checkpoint, world),
    )


class _MetricsLog:
    """metrics.jsonl (written by rank 0, and passed on to the sinks) and the interval behind
    its next line: the summed loss and counted targets of the updates since the previous
    line on this rank, and their depths."""

    def __init__(self, path: Path, world: World, *, last_loss: float, sinks: list[MetricsSink] = ()):
        self.world = world
        self.last_loss = last_loss
        """The loss of the last line, over all ranks."""
        self.interval_loss = torch.zeros((), dtype=torch.float64, device=world.device)
        self.interval_tokens = torch.zeros((), dtype=torch.float64, device=world.device)
        self.interval_depths: dict[int, int] = {}
        self.file = path.open("a", encoding="utf-8") if world.is_main else None
        self.sinks = list(sinks)

    def add(self, loss_sum: torch.Tensor, counted: int, depth: int) -> None:
        """Count one update: its summed token loss and its counted targets on this rank, and its depth."""
        self.interval_loss += loss_sum.to(torch.float64)
        self.interval_tokens += counted
        self.interval_depths[depth] = self.interval_depths.get(depth, 0) + 1

    def write(
        self,
        *,
        step: int,
        depth: int,
        lr: float,
        grad_norm: torch.Tensor,
        counters: dict[str, float],
        val_nll: dict[int, float] | None = None,
    ) -> None:
        """Close the interval with a line for update `step` (every rank takes part: the loss
        is the token-weighted mean over all ranks); `val_nll` (rank 0) maps serving depth to
        the validation NLL after this update."""
        totals = all_reduce_sum(self.world, torch.stack((self.interval_loss, self.interval_tokens)))
        self.last_loss = float(totals[0] / totals[1])
        depths = all_gather_ints(self.world, depth)
        depth_counts = {str(d): n for d, n in sorted(self.interval_depths.items())}
        self.interval_loss.zero_()
        self.interval_tokens.zero_()
        self.interval_depths = {}
        if self.file is None:
            return
        record: dict[str, Any] = {
            "step": step,
            "depth": depth,
            "depth_counts": depth_counts,
            "loss": self.last_loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens": int(counters["tokens"]),
            "flops": counters["flops"],
            "wall_time": counters["wall_time"],
        }
        if self.world.distributed:
            record["rank_depths"] = depths
        for serving, nll in (val_nll or {}).items():
            record[f"val_nll_{serving}"] = nll
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class _DivergenceWatch:
    """The first update whose loss or gradient norm was not finite. Kept on the device, so
    watching costs no host sync per update; read at every metrics line and before every
    write, so a non-finite model never reaches a checkpoint or a snapshot."""

    def __init__(self, world: World):
        self.world = world
        self.first = torch.full((), -1, dtype=torch.int64, device=world.device)

    def observe(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        diverged = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
        self.first = torch.where(diverged & (self.first < 0), step, self.first)

    def check(self, run: _Run) -> None:
        """Raise RunFailed naming the first non-finite update (the earliest over all ranks)."""
        steps = [step for step in all_gather_ints(self.world, int(self.first)) if step >= 0]
        if steps:
            raise run.failed(
                min(steps),
                "the loss or the gradient norm is not finite (diverged: lower optim.lr or raise optim.warmup)",
            )


def _show_monitor(run: _Run, monitor: TrainingMonitor | None, step: int) -> float:
    """Show the monitor (rank 0; every rank when the model is sharded, as each holds a part
    of it) the model and optimizer after `step` updates; returns the seconds it took. A
    monitor file the file system refuses fails the run."""
    if monitor is None or not (run.world.is_main or run.sharded):
        return 0.0
    began = time.perf_counter()
    try:
        monitor.after_update(step, run.model, run.update.optimizer)
    except OSError as err:
        reason = err.strerror or str(err).splitlines()[0]
        raise run.failed(step, f"writing {err.filename or run.run_dir} failed ({reason})") from None
    return time.perf_counter() - began


def _validation_due(run: _Run, done: int) -> bool:
    """Whether the validation NLL is computed after `done` updates (always on a metrics line:
    eval_every is a multiple of log_every, and the last update has a checkpoint's line)."""
    tc = run.config.train
    return tc.eval_every > 0 and (done % tc.eval_every == 0 or done == tc.updates)


def _validation_nll(run: _Run) -> tuple[dict[int, float] | None, float]:
    """(serving depth -> mean token NLL of the run's evaluation set, seconds it took) on
    rank 0; (None, 0) elsewhere. Runs in eval mode without gradients and draws no random
    numbers, so the training that follows is the same to the bit. A sharded model gathers
    its weights block by block in the pass, so there every rank scores the whole set
    alongside rank 0 and drops the result; with train.precision='bf16' it gathers the
    blocks' weights in bf16 (trainer/distributed.py shard_model), so the pass runs under
    bf16 autocast instead of in fp32."""
    if not (run.world.is_main or run.sharded):
        return None, 0.0
    began = time.perf_counter()
    depths = run.config.train.eval_depth_list
    was_training = run.model.training
    run.model.eval()
    precision = run.config.train.precision if run.sharded else "fp32"
    try:
        with forward_precision(run.world.device.type, precision):
            nll = mean_nll_by_depth(run.model, run.eval_tokens, depths, device=run.world.device)
    finally:
        run.model.train(was_training)
    if not run.world.is_main:
        return None, time.perf_counter() - began
    return dict(zip(depths, nll.tolist())), time.perf_counter() - began


def _train_updates(
    run: _Run, *, progress: bool, monitor: TrainingMonitor | None = None, sinks: list[MetricsSink] = ()
) -> float:
    """Take the updates from run.start to train.updates, logging metrics (and the validation
    NLL when due) and writing the snapshots and checkpoints due after each (and showing the
    monitor each state); returns the loss of the last logged interval."""
    tc, world = run.config.train, run.world
    log = _MetricsLog(run.run_dir / "metrics.jsonl", world, last_loss=run.resumed_loss, sinks=sinks)
    watch = _DivergenceWatch(world)
    bar = progress_bar(tc.updates, f"train {run.run_dir}", "upd", initial=run.start, enabled=progress and world.is_main)
    try:
        run.write_boundary(run.start)
        if monitor is not None and (world.is_main or run.sharded):
            monitor.resume(run.start)
        _show_monitor(run, monitor, run.start)
        session_began, wall_time_before = time.perf_counter(), run.counters["wall_time"]
        for step in range(run.start, tc.updates):
            depth = run.schedule.depth_at(step)
            lr = lr_at(step, run.config.optim, tc.updates)
            batch = run.source.batch(
                tc.seed, step, tc.batch_size, tc.seq_len, rank=world.rank, world_size=world.world_size
            )  # [B/world, T+1], on the CPU
            # The mean over the global batch's counted tokens. DDP averages gradients over ranks,
            # so each rank divides its sum by the mean count per rank; on one process this is
            # exactly `training_loss`.
            local_count = counted_targets(batch)
            count = all_reduce_int(world, local_count)
            loss_sum, grad_norm = run.update(batch.to(world.device), depth, lr, divisor=count / world.world_size)

            watch.observe(step, loss_sum, grad_norm)
            log.add(loss_sum, local_count, depth)
            run.counters["tokens"] += tc.batch_size * tc.seq_len
            run.counters["flops"] += update_flops(run.config.model, depth, batch_size=tc.batch_size, seq_len=tc.seq_len)
            run.counters["wall_time"] = wall_time_before + time.perf_counter() - session_began
            done = step + 1
            # A line at every checkpoint too: the interval is then empty at any resume point,
            # so a resumed run logs exactly the losses of an uninterrupted one.
            if done % tc.log_every == 0 or run.boundary_due(done):
                watch.check(run)
            if done % tc.log_every == 0 or run.checkpoint_due(done):
                val_nll, val_seconds = _validation_nll(run) if _validation_due(run, done) else (None, 0.0)
                session_began += val_seconds  # wall_time counts training alone
                log.write(step=step, depth=depth, lr=lr, grad_norm=grad_norm, counters=run.counters, val_nll=val_nll)
            bar.set_postfix(depth=depth, loss=f"{log.last_loss:.4f}", refresh=False)  # the last logged interval's
            bar.update(1)
            run.write_boundary(done)
            session_began += _show_monitor(run, monitor, done)  # wall_time counts training alone
    finally:
        bar.close()
        log.close()
        if monitor is not None and (world.is_main or run.sharded):
            monitor.close()
    return log.last_loss


def _finish(run: _Run, final_loss: float) -> TrainSummary:
    """The run's summary, written to summary.json by rank 0."""
    summary = TrainSummary(
        run_dir=str(run.run_dir),
        updates=run.config.train.updates,
        resumed_from=run.start,
        final_loss=final_loss,
        tokens=int(run.counters["tokens"]),
        flops=run.counters["flops"],
        wall_time=run.counters["wall_time"],
        checkpoints=tuple(run.checkpoints),
        snapshots=tuple(run.snapshots),
        trained_on=run.trained_on,
    )
    if run.world.is_main:
        atomic_write_text(json.dumps(asdict(summary), indent=2) + "\n", run.run_dir / "summary.json")
    barrier(run.world)
    return summary
