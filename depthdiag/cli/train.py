"""`depthdiag train` and `depthdiag eval`."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import click

from common.errors import InputError
from depthdiag.cli.app import reports_errors
from depthdiag.cli.options import (
    device_option,
    eval_batch_size_option,
    hf_input_options,
    max_depth_option,
    no_progress_option,
    serving_option,
)


def _train_kept(config_path: str, out: str | None, overrides: tuple[str, ...], resume_dir: str | None, **_) -> str:
    from trainer.checkpoint import latest_checkpoint

    run_dir, _resume = resolve_run_dir(config_path, out, resume_dir)
    newest = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    # The same overrides: a resume refuses a config that differs from the stored one.
    command = ["depthdiag", "train", config_path, *(word for value in overrides for word in ("--set", value))]
    if newest is None:
        restart = shlex.join([*command, "--out", str(run_dir), "--force"])
        return f"{run_dir} holds no checkpoint yet; start over with: {restart}"
    resume = shlex.join([*command, "--resume", str(run_dir)])
    return f"{run_dir} keeps its checkpoints, the newest {newest.name}; resume with: {resume}"


@click.command("train")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.option(
    "--out", type=click.Path(file_okay=False), default=None, help="Run directory (default: runs/<config name>)."
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config value, e.g. --set train.updates=200 (repeatable).",
)
@click.option(
    "--resume",
    "resume_dir",
    metavar="RUN_DIR",
    type=click.Path(file_okay=False),
    default=None,
    help="Continue RUN_DIR from its newest checkpoint; the config must equal the stored one.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Start over in an existing run directory depthdiag wrote (its checkpoints, snapshots and metrics "
    "are deleted); anything else in --out is never deleted.",
)
@no_progress_option
@reports_errors(kept=_train_kept)
def train_run(
    config_path: str,
    out: str | None,
    overrides: tuple[str, ...],
    resume_dir: str | None,
    force: bool,
    no_progress: bool,
) -> None:
    """Train the looped transformer CONFIG describes: metrics, checkpoints and
    switch-point snapshots go to the run directory, and with a [monitor] block the
    in-training update diagnostic to RUN/monitor.h5.

    \b
    RUN/metrics.jsonl has a JSON line every train.log_every updates and at each checkpoint:
      step         0-based index of the update the line closes
      depth        that update's depth; depth_counts: {"K": updates at depth K since the last line}
      loss         mean training token NLL (nats) since the last line; lr, grad_norm
      tokens, flops, wall_time   cumulative: tokens, modeled FLOPs, seconds of training
      val_nll_S    with train.eval_every = N > 0, every N updates and at the last: mean token
                   NLL (nats) of the held-out evaluation set at serving depth S, for each S of
                   train.eval_depths (default 1-16); N must be a multiple of train.log_every
    [logging] tensorboard = true / wandb = true mirror these scalars to RUN/tensorboard and
    W&B (offline in RUN/wandb unless WANDB_MODE says otherwise); extras `tensorboard`, `wandb`.

    \b
    Under torchrun every process runs this and rank 0 writes the files:
      torchrun --nproc_per_node=4 -m depthdiag train configs/tiny.toml --out runs/tiny
    """

    # Imported here: torch takes seconds to load and `depthdiag --help` should not wait for it.
    from common.outputs import check_output
    from trainer.config import load_config
    from trainer.distributed import resolve_device
    from trainer.resources import check_memory
    from trainer.run_dir import RUN_DIRECTORY
    from trainer.train import train

    config = load_config(config_path, overrides)
    if "WORLD_SIZE" not in os.environ:
        # `train` checks this too, for every caller (under torchrun on each rank's own device,
        # its verdict shared by all); here the refusal can name the config file.
        check_memory(config, resolve_device(config.train.device), source=config_path)
    run_dir, resume = resolve_run_dir(config_path, out, resume_dir)
    if resume and force:
        raise InputError("--resume and --force contradict each other: pick one")
    if not resume:
        check_output(run_dir, kind=RUN_DIRECTORY, inputs=[config_path], force=force)
    monitor = None
    if config.monitor.enabled:
        # Only then: the monitor brings the diagnostic and xarray, half a second more at every start.
        from diag.in_training.monitor import UpdateMonitor

        monitor = UpdateMonitor(config, run_dir)
    summary = train(config, run_dir, resume=resume, force=force, progress=not no_progress, monitor=monitor)
    if os.environ.get("RANK", "0") == "0":
        click.echo(
            f"trained {summary.updates:,} updates into {summary.run_dir} "
            f"(resumed from {summary.resumed_from}): final loss {summary.final_loss:.4f}, "
            f"{len(summary.checkpoints)} checkpoint(s), {len(summary.snapshots)} snapshot(s) written"
        )


@click.command("eval")
@click.argument("checkpoint", required=False, type=click.Path(path_type=Path))
@serving_option
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the table as an xarray Dataset (HDF5 via h5netcdf).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --out file.")
@max_depth_option
@device_option
@eval_batch_size_option("--batch-size")
@no_progress_option
@reports_errors
@hf_input_options(training=False)
def eval_checkpoint(
    checkpoint: Path | None,
    serving: str,
    out: Path | None,
    force: bool,
    max_depth: int,
    device: str,
    batch_size: int,
    no_progress: bool,
    hf,
) -> None:
    """Mean token NLL of CHECKPOINT (a checkpoint or snapshot) at each serving depth on its
    evaluation set; for the bioS task also the recalled bits per person. With --hf DIR instead,
    a Hugging Face model folder on the evaluation set of --data, called at each depth as its
    model family serves."""
    from analysis.store import RESULTS_FILE
    from common.depths import parse_serving_depths
    from common.outputs import check_outputs
    from trainer.evaluate import format_table

    if (checkpoint is None) == (hf is None):
        raise InputError("give CHECKPOINT or --hf DIR (a Hugging Face model folder), one of them")
    depths = parse_serving_depths(serving, limit=max_depth)
    source = checkpoint if hf is None else hf.folder
    check_outputs([out] if out is not None else [], kind=RESULTS_FILE, inputs=[source], force=force)
    if hf is None:
        from trainer.evaluate import evaluate_checkpoint

        ds = evaluate_checkpoint(checkpoint, depths, device=device, batch_size=batch_size, progress=not no_progress)
        click.echo(
            f"{checkpoint}: step {ds.attrs['step']}, {ds.attrs['uniform_updates']} uniform updates, "
            f"{ds.attrs['eval_sequences']} evaluation sequences"
        )
    else:
        from diag.sources.hf import evaluate_hf

        ds = evaluate_hf(hf, depths, device=device, batch_size=batch_size, progress=not no_progress)
        click.echo(
            f"{hf.folder}: model family {ds.attrs['model_family']}, {ds.attrs['eval_sequences']} evaluation "
            f"sequences of {ds.attrs['seq_len']} tokens from {ds.attrs['data']}"
        )
    click.echo(format_table(ds))
    if out is not None:
        from analysis.store import write_results

        click.echo(f"wrote {write_results(ds, out, force=force, inputs=[source])}")


def resolve_run_dir(config_path: str | Path, out: str | Path | None, resume: str | Path | None) -> tuple[Path, bool]:
    """(run directory, resume?) from the command line: --resume DIR continues DIR, --out DIR
    starts there, neither starts runs/<config name>."""
    if resume is not None:
        if out is not None and Path(out).resolve() != Path(resume).resolve():
            raise InputError(f"--out {out}: differs from --resume {resume}; a resumed run stays in its directory")
        return Path(resume), True
    return (Path(out) if out is not None else Path("runs") / Path(config_path).stem), False
