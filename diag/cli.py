"""The `depthdiag` command line. Each command parses options, builds a frozen
config, and calls one library function; the work lives in the libraries.

Bad input (a missing or corrupt file, an invalid spec or config, an unwritable
output, an output in use by another depthdiag process) is reported as one line on
stderr with exit code 2, a run that failed (diverged, ran out of disk) with exit
code 3; `--debug` shows the traceback. Every command that writes a file holds its
lock (common/lock.py) and refuses an existing one unless given `--force`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import click

from common.choices import (
    DEVICE_CHOICES,
    DOCUMENT_CHOICES,
    EVAL_SET_CHOICES,
    FINISH_RULE_CHOICES,
    INTERVAL_METHOD_CHOICES,
    ISOLATE_CHOICES,
    RMS_MATCH_CHOICES,
)
from common.depths import MAX_SERVING_DEPTH
from common.errors import EXIT_BAD_INPUT, EXIT_RUN_FAILED, InputError, RunFailed, naming_files
from common.heap import keep_freed_memory

if TYPE_CHECKING:
    from analysis.stats import IntervalOptions

GRID_FIGURES = ("1", "2", "3-loss", "5", "8")
"""The figures `plot` draws from a collected grid file."""
DOWNSTREAM_FIGURE = "3-downstream"
"""The figure `plot` draws from a `depthdiag lm-eval` file."""


def _os_error_line(err: OSError) -> str:
    """'PATH: reason' for an OS error, on one line (some libraries put several in theirs)."""
    reason = err.strerror or (os.strerror(err.errno) if err.errno else str(err).splitlines()[0])
    return f"{err.filename}: {reason}" if err.filename else reason


def reports_errors(command):
    """One line on stderr and the documented exit code for the project's failures:
    InputError and OS errors (a missing folder, no permission, a full disk) exit 2,
    RunFailed exits 3. Anything else is a bug and keeps its traceback (exit 1)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (InputError, RunFailed, OSError) as err:
            if click.get_current_context().find_root().params.get("debug"):
                raise
            if isinstance(err, RunFailed):
                message, code = str(err), EXIT_RUN_FAILED
            elif isinstance(err, InputError):
                message, code = str(err), EXIT_BAD_INPUT
            else:
                message, code = _os_error_line(err), EXIT_BAD_INPUT
            click.echo(f"depthdiag: error: {message}", err=True)
            sys.exit(code)

    return wrapper


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`--version`: the installed package's version, read from its metadata (no torch import)."""
    if not value or ctx.resilient_parsing:
        return
    from common.version import package_version

    click.echo(f"depthdiag {package_version()}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the depthdiag version and exit.",
)
def main(debug: bool) -> None:
    """Train adaptive-depth looped transformers and diagnose when multi-depth updates matter.

    \b
    Typical pipeline:
      depthdiag train configs/tiny.toml --out runs/tiny
      depthdiag diagnose runs/tiny/snapshots/*.pt --out results/tiny.h5
      depthdiag summarize results/tiny.h5
      depthdiag plot results/tiny.h5 --figure 4 --out figures/figure4.png

    \b
    Exit codes: 0 success; 1 a bug (traceback); 2 bad input (one line naming
    the file and the problem, nothing half-written); 3 the run failed
    (divergence, disk full during a run: one line naming the step and the last
    good checkpoint). --debug shows the traceback for 2 and 3 too.

    \b
    Every writer holds a lock on its output: a second writer is refused with the
    holder's pid. An existing output is refused unless --force is given.
    """
    keep_freed_memory()  # a process-wide malloc setting, so the command sets it, not the library


# --- options several commands share --------------------------------------------------------


def stacked(*options):
    """One decorator that applies `options` as if they were written in this order above a command."""

    def apply(function):
        for option in reversed(options):
            function = option(function)
        return function

    return apply


serving_option = click.option(
    "--serving",
    default="1-16",
    show_default=True,
    help=f"Serving depths: a range (1-16), a list (1,2,4,8) or both (1-4,8,16); at most {MAX_SERVING_DEPTH} "
    "unless --max-depth says otherwise.",
)
max_depth_option = click.option(
    "--max-depth",
    type=click.IntRange(min=1),
    default=MAX_SERVING_DEPTH,
    show_default=True,
    help="The deepest depth accepted in the depth lists (a guard against typos such as '4,160'); raise it on purpose.",
)
device_option = click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True)
no_progress_option = click.option("--no-progress", is_flag=True, help="No progress bar.")


def eval_batch_size_option(name: str):
    """The evaluation minibatch size, under the option name the command uses."""
    return click.option(
        name, type=click.IntRange(min=1), default=32, show_default=True, help="Evaluation sequences per forward pass."
    )


_interval_option_declarations = stacked(
    click.option("--level", type=float, default=0.95, show_default=True, help="Confidence level."),
    click.option(
        "--method",
        type=click.Choice(INTERVAL_METHOD_CHOICES),
        default="t",
        show_default=True,
        help="Student-t interval, or BCa bootstrap as a check.",
    ),
    click.option(
        "--resamples", "n_resamples", type=int, default=9999, show_default=True, help="Bootstrap resamples (bca)."
    ),
)


def interval_options(command):
    """--level, --method and --resamples, handed to `command` as one `options`
    (analysis.stats.IntervalOptions). Goes below `reports_errors`, which reports a bad level."""

    @functools.wraps(command)
    def with_options(*args, level: float, method: str, n_resamples: int, **kwargs):
        from analysis.stats import IntervalOptions

        return command(*args, options=IntervalOptions(level=level, method=method, n_resamples=n_resamples), **kwargs)

    return _interval_option_declarations(with_options)


# --- flops ----------------------------------------------------------------------------------


@main.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.option(
    "--updates",
    type=click.IntRange(min=1),
    default=None,
    help="Run length to lay the schedules out over (default: the config's train.updates).",
)
@click.option(
    "--schedule",
    "specs",
    multiple=True,
    metavar="SPEC",
    help="A depth schedule spec; repeat for several (default: the config's schedule and uniform:1-16).",
)
@click.option(
    "--match",
    metavar="SPEC",
    default=None,
    help="Also print the run length at which SPEC matches the first schedule's modeled compute.",
)
@click.option("--include-embeddings", is_flag=True, help="Count the LM head matmul too.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@reports_errors
def flops(
    config_path: str,
    updates: int | None,
    specs: tuple[str, ...],
    match: str | None,
    include_embeddings: bool,
    as_json: bool,
) -> None:
    """Modeled training FLOPs of depth schedules on CONFIG's model, relative to uniform:1-16.

    \b
    Example (the paper's 200M row and its compute-matched uniform run):
      depthdiag flops configs/paper-200m.toml --updates 4800 --match uniform:1-16 \\
        --schedule fixed-first:k0=4,switch=0.67,finish=uniform:1-16 \\
        --schedule fixed-first:k0=2,switch=0.8,finish=uniform:1-16
    """
    from trainer.config import load_config
    from trainer.flops import UNIFORM_REFERENCE, flops_report, parameter_counts

    config = load_config(config_path)
    train = config.train
    updates = updates or train.updates
    if not specs:
        specs = tuple(dict.fromkeys((train.schedule, UNIFORM_REFERENCE)))
    report = flops_report(
        config.model,
        specs,
        updates=updates,
        batch_size=train.batch_size,
        seq_len=train.seq_len,
        seed=train.seed,
        include_embeddings=include_embeddings,
        match=match,
    )
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    counts = parameter_counts(config.model)
    non_embedding = sum(counts.values()) - counts["embedding"] - counts["head"]
    tokens = updates * train.batch_size * train.seq_len
    tokens_text = f"{tokens / 1e9:.2f}B" if tokens >= 1e9 else f"{tokens / 1e6:.2f}M"
    click.echo(
        f"{config_path}: {non_embedding / 1e6:.1f}M non-embedding parameters; {updates:,} updates "
        f"x {train.batch_size} x {train.seq_len} tokens ({tokens_text} tokens); "
        f"LM head {'included' if include_embeddings else 'excluded'}"
    )
    width = max(len("schedule"), *(len(row.spec) for row in report.schedules))
    click.echo(f"{'schedule':<{width}}  {'modeled FLOPs':>13}  {'mean depth':>10}  {'vs ' + UNIFORM_REFERENCE:>15}")
    for row in report.schedules:
        click.echo(
            f"{row.spec:<{width}}  {row.modeled_flops:>13.4e}  {row.mean_depth:>10.3f}  "
            f"{row.relative_to_uniform:>15.2%}"
        )
    if report.match is not None:
        m = report.match
        click.echo(
            f"match: {m.spec} over {m.updates:,} updates ({m.modeled_flops:.4e} FLOPs) matches "
            f"{m.reference} over {updates:,} updates ({m.reference_flops:.4e} FLOPs)"
        )


# --- train / eval ---------------------------------------------------------------------------


@main.command("train")
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
@no_progress_option
@reports_errors
def train_run(
    config_path: str, out: str | None, overrides: tuple[str, ...], resume_dir: str | None, no_progress: bool
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
      torchrun --nproc_per_node=4 -m diag.cli train configs/tiny.toml --out runs/tiny
    """
    import os

    # Imported here: torch takes seconds to load and `depthdiag --help` should not wait for it.
    from diag.monitor import train_with_monitor
    from trainer.config import load_config
    from trainer.train import resolve_run_dir

    config = load_config(config_path, overrides)
    run_dir, resume = resolve_run_dir(config_path, out, resume_dir)
    summary = train_with_monitor(config, run_dir, resume=resume, progress=not no_progress)
    if os.environ.get("RANK", "0") == "0":
        click.echo(
            f"trained {summary.updates:,} updates into {summary.run_dir} "
            f"(resumed from {summary.resumed_from}): final loss {summary.final_loss:.4f}, "
            f"{len(summary.checkpoints)} checkpoint(s), {len(summary.snapshots)} snapshot(s) written"
        )


@main.command("eval")
@click.argument("checkpoint", type=click.Path(dir_okay=False, path_type=Path))
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
def eval_checkpoint(
    checkpoint: Path,
    serving: str,
    out: Path | None,
    force: bool,
    max_depth: int,
    device: str,
    batch_size: int,
    no_progress: bool,
) -> None:
    """Mean token NLL of CHECKPOINT (a checkpoint or snapshot) at each serving depth on its
    evaluation set; for the bioS task also the recalled bits per person."""
    from common.depths import parse_serving_depths
    from common.lock import refuse_existing
    from trainer.evaluate import evaluate_checkpoint, format_table

    depths = parse_serving_depths(serving, limit=max_depth)
    refuse_existing([out] if out is not None else [], force=force)
    ds = evaluate_checkpoint(checkpoint, depths, device=device, batch_size=batch_size, progress=not no_progress)
    click.echo(
        f"{checkpoint}: step {ds.attrs['step']}, {ds.attrs['uniform_updates']} uniform updates, "
        f"{ds.attrs['eval_sequences']} evaluation sequences"
    )
    click.echo(format_table(ds))
    if out is not None:
        from analysis.store import write_results

        click.echo(f"wrote {write_results(ds, out, force=force)}")


# --- diagnose -------------------------------------------------------------------------------


@main.command()
@click.argument("snapshots", nargs=-1, type=click.Path(dir_okay=False))
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False),
    help="Results file (HDF5). Finished units wait in OUT.parts/ until the run completes.",
)
@click.option(
    "--adapter",
    metavar="MODULE:FUNCTION",
    default=None,
    help="Instead of SNAPSHOTS, a model from another codebase: FUNCTION returns a diag.AdaptedModel "
    '(model, optimizer, batches, eval_tokens; README: "Models in and out").',
)
@click.option(
    "--adapter-arg",
    "adapter_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="A keyword argument of the adapter function, as a string (repeatable).",
)
@click.option(
    "--update-depths",
    default="4,16",
    show_default=True,
    help="Depths of the compared updates in the --serving grammar, no depth twice; the first is the reference. "
    f"At most {MAX_SERVING_DEPTH} unless --max-depth says otherwise.",
)
@serving_option
@max_depth_option
@click.option(
    "--batches",
    type=click.IntRange(min=1),
    default=None,
    help="Batches per snapshot [default: all a snapshot carries; checkpoints: train.snapshot_batches].",
)
@click.option(
    "--isolate",
    type=click.Choice(ISOLATE_CHOICES),
    default="counterfactual",
    show_default=True,
    help="counterfactual: Delta(g) - Delta(0); none: Delta(g); linear: first-order term.",
)
@click.option(
    "--rms-match",
    type=click.Choice(RMS_MATCH_CHOICES),
    default="reference",
    show_default=True,
    help="Scale the updates to a common RMS (reference: the first depth's).",
)
@click.option("--lr", type=float, default=None, help="Learning rate of the step [default: the snapshot's next LR].")
@device_option
@eval_batch_size_option("--eval-batch-size")
@click.option(
    "--eval-set",
    type=click.Choice(EVAL_SET_CHOICES),
    default="auto",
    show_default=True,
    help="snapshot: the evaluation set the snapshot carries; attributes (bioS): the evaluation "
    "presentations, NLL over the attribute-value tokens only; auto: attributes for bioS runs, "
    "snapshot otherwise.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue an interrupted run with the same settings (damaged unit files are computed again).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Discard an unfinished run or an existing OUT and start over (never a live run's: it holds OUT's lock).",
)
@no_progress_option
@reports_errors
def diagnose(
    snapshots: tuple[str, ...],
    out: str,
    adapter: str | None,
    adapter_args: tuple[str, ...],
    update_depths: str,
    serving: str,
    max_depth: int,
    batches: int | None,
    isolate: str,
    rms_match: str,
    lr: float | None,
    device: str,
    eval_batch_size: int,
    eval_set: str,
    resume: bool,
    force: bool,
    no_progress: bool,
) -> None:
    """Compare single updates at several depths from each SNAPSHOT (snapshot or checkpoint
    files of one run), or from the model an --adapter function returns, on its batches;
    write nll, benefit and update statistics to OUT.

    \b
    Benefit(s) = NLL after the first depth's update - NLL after the last depth's update,
    at each serving depth s: positive favours the last depth's update. See docs/diagnostic.md.

    The run holds OUT's lock (covering OUT.parts/) until it ends; a unit with a non-finite
    NLL, loss or update RMS (a diverged snapshot) stops it with exit 2, naming the file and batch.
    """
    from common.depths import parse_serving_depths, parse_update_depths
    from diag.adapter import parse_adapter_args
    from diag.run import DiagnoseConfig
    from diag.run import diagnose as run_diagnose

    config = DiagnoseConfig(
        snapshots=snapshots,
        out=out,
        adapter=adapter,
        adapter_args=parse_adapter_args(adapter_args),
        update_depths=parse_update_depths(update_depths, limit=max_depth),
        serving_depths=parse_serving_depths(serving, limit=max_depth),
        batches=batches,
        isolate=isolate,
        rms_match=rms_match,
        lr=lr,
        eval_batch_size=eval_batch_size,
        eval_set=eval_set,
        device=device,
        resume=resume,
        force=force,
        max_depth=max_depth,
        progress=not no_progress,
    )
    click.echo(f"wrote {run_diagnose(config)}")


# --- summarize / plot -----------------------------------------------------------------------


def _json_ready(value):
    """`value` with every non-finite float as None (JSON has no NaN: an interval that could not be formed is null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item) for item in value]
    return value


def _warn_on_mixed_learning_rates(ds, results: tuple[Path, ...]) -> str | None:
    from analysis.stats import mixed_learning_rate_warning

    warning = mixed_learning_rate_warning(ds, [str(path) for path in results])
    if warning is not None:
        click.echo(f"depthdiag: warning: {warning}", err=True)
    return warning


def _monitor_file(results: tuple[Path, ...]) -> Path | None:
    """The monitor file among RESULTS when it is the only file; None when none is one."""
    from analysis.monitor import is_monitor_file

    monitors = [path for path in results if is_monitor_file(path)]
    if monitors and len(results) > 1:
        raise InputError(f"{monitors[0]}: a monitor file is summarised or drawn on its own, not with other files")
    return monitors[0] if monitors else None


def _export_csv(rows: list[dict], csv_out: str | None, force: bool) -> bool:
    """Write the summary rows as CSV to `csv_out` (a file, atomically under its lock; '-': stdout);
    returns whether the CSV took stdout's place."""
    if csv_out is None:
        return False
    from analysis.stats import format_csv

    text = format_csv(rows)
    if csv_out == "-":
        click.echo(text, nl=False)
        return True
    from common.atomic import atomic_write_text
    from common.lock import claimed_outputs

    with claimed_outputs([csv_out], force=force):
        atomic_write_text(text, csv_out)
    click.echo(f"wrote {csv_out}", err=True)
    return False


def _summarize_monitor(path: Path, as_json: bool, options: IntervalOptions, csv_out: str | None, force: bool) -> None:
    from analysis.monitor import open_monitor
    from analysis.stats import format_monitor_summary, interval_coverage, monitor_summary_table

    ds = open_monitor(path)
    rows = monitor_summary_table(ds, options=options)
    if _export_csv(rows, csv_out, force):
        return
    if as_json:
        document = {
            "monitor": str(path),
            **dataclasses.asdict(options),
            "unit": "batch",
            "covers": interval_coverage("batch"),
            "switch_step": ds.attrs.get("switch_step"),
            "rows": rows,
        }
        click.echo(json.dumps(_json_ready(document), indent=2))
        return
    switch = ds.attrs.get("switch_step", -1)
    switch_text = f"switch at step {switch}" if switch is not None and int(switch) >= 0 else "no switch"
    click.echo(f"{path}: {ds.attrs.get('schedule', '')}, {switch_text}")
    click.echo(format_monitor_summary(rows, level=options.level, method=options.method))


@main.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (NaN as null).")
@click.option(
    "--csv",
    "csv_out",
    is_flag=False,
    flag_value="-",
    default=None,
    metavar="[FILE|-]",
    help="Also write the summary table as CSV to FILE (a row per snapshot, or per check of a monitor "
    "file; empty fields for intervals that could not be formed); --csv alone or --csv - prints it "
    "instead of the table.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --csv FILE.")
@reports_errors
@interval_options
def summarize(
    results: tuple[Path, ...], as_json: bool, csv_out: str | None, force: bool, options: IntervalOptions
) -> None:
    """Per snapshot: depth-averaged benefit with its confidence intervals, and how long
    the finishing phase needs to be.

    Several RESULTS files are several training seeds of one experiment: the headline
    interval is then over per-seed means (n = seeds), and the within-seed interval over
    batches is shown as batch noise only. One file gives the batch interval alone.
    A run's monitor file (RUN/monitor.h5) gives the depth-averaged benefit per training step.
    """
    if as_json and csv_out == "-":
        raise InputError("--json and --csv - both print to standard output: pick one")
    if csv_out is not None and (Path(csv_out) in results or Path(csv_out).suffix in (".h5", ".hdf5", ".nc")):
        # `--csv a.h5 b.h5` reads a.h5 as the CSV's name: never write over a results file.
        raise InputError(f"--csv {csv_out}: names a results file; put --csv after the RESULTS or name a .csv file")
    if csv_out not in (None, "-"):
        from common.lock import refuse_existing

        refuse_existing([Path(csv_out)], force=force)
    if _monitor_file(results) is not None:
        _summarize_monitor(results[0], as_json, options, csv_out, force)
        return
    from analysis.stats import (
        describe_intervals,
        finishing_phase,
        format_finishing_phase,
        format_summary_table,
        interval_coverage,
        summary_table,
    )
    from analysis.store import open_results

    with naming_files(results):
        ds = open_results(results)
        warning = _warn_on_mixed_learning_rates(ds, results)
        rows = summary_table(ds, options=options)
        has_switch = 0 in ds["uniform_updates"].values
        phase = finishing_phase(ds, options=options) if has_switch else None
    if _export_csv(rows, csv_out, force):
        return
    if as_json:
        unit = rows[0]["unit"]
        document = {
            "results": [str(path) for path in results],
            **dataclasses.asdict(options),
            "headline": {"unit": unit, "covers": interval_coverage(unit)},
            "secondary": {
                "unit": "batch",
                "covers": interval_coverage("batch"),
                "keys": ["batch_half_width", "batches_per_seed", "between_seed_variance", "within_seed_variance"],
            },
            "rows": rows,
            "finishing_phase": phase.to_dict() if phase is not None else None,
            "warnings": [warning] if warning else [],
        }
        click.echo(json.dumps(_json_ready(document), indent=2))
        return
    click.echo(describe_intervals(rows, level=options.level, method=options.method))
    click.echo(format_summary_table(rows, level=options.level))
    if phase is not None:
        click.echo(format_finishing_phase(phase, level=options.level))
    else:
        click.echo("finishing phase: n/a (no snapshot at the switch, 0 uniform updates)")


@main.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--figure",
    "figure_number",
    type=click.Choice(["4", "map", "monitor", "curves", *GRID_FIGURES, DOWNSTREAM_FIGURE]),
    default="4",
    show_default=True,
    help="Which figure: the paper's Figure 4 (results files); map: which update depth helps which serving "
    "depth, at the switch and after 16 uniform updates (results files diagnosed with several update depths, "
    "e.g. --update-depths 4,1,2,8,16); monitor: a run's monitor file (RUN/monitor.h5); curves: a run "
    "directory's training loss (raw and smoothed) and validation NLL per serving depth, the switch marked; "
    "or from a collected "
    "grid file (depthdiag grid collect): 1 (recall by serving depth at each FLOP budget), 2 (serving NLL "
    "against modeled FLOPs), 3-loss (training-loss trajectories), 5 (peak-normalised recall of fixed "
    "depths), 8 (NLL by serving depth); or 3-downstream: accuracy by serving depth per task from "
    "`depthdiag lm-eval` files (several: several seeds, drawn as their mean and range).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Image to write (e.g. figures/figure4.png); a PDF is written beside it.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing image (and the PDF beside it).")
@reports_errors
@interval_options
def plot(results: tuple[Path, ...], figure_number: str, out: Path, force: bool, options: IntervalOptions) -> None:
    """Draw a figure from RESULTS files (several files are several seeds: the error bars and
    bands are then intervals over seeds; with one file they cover batch noise only).
    `--figure map` draws the update-depth x serving-depth map (seed-level means, or batch
    means for one file); `--figure monitor` draws a run's RUN/monitor.h5; `--figure curves` a
    run directory's metrics.jsonl (`depthdiag plot runs/tiny --figure curves --out curves.png`)."""
    from analysis.figures import figure4, figure_paths, monitor_figure, save_figure, update_depth_map_figure
    from analysis.monitor import open_monitor
    from analysis.store import open_results
    from common.lock import refuse_existing

    refuse_existing(figure_paths(out), force=force)
    if figure_number == "curves":
        _plot_curves(results, out, force)
        return
    if figure_number in GRID_FIGURES:
        _plot_grid(results, figure_number, out, force)
        return
    if figure_number == DOWNSTREAM_FIGURE:
        _plot_downstream(results, out, force)
        return
    monitor = _monitor_file(results)
    if (monitor is not None) != (figure_number == "monitor"):
        wanted = "a monitor file (RUN/monitor.h5)" if figure_number == "monitor" else "results files"
        raise InputError(f"{results[0]}: --figure {figure_number} draws {wanted}")
    with naming_files(results):
        ds = open_monitor(monitor) if monitor is not None else open_results(results)
        if monitor is None:
            _warn_on_mixed_learning_rates(ds, results)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if monitor is not None:
                fig = monitor_figure(ds, options=options)
            elif figure_number == "map":
                fig = update_depth_map_figure(ds, options=options)
            else:
                fig = figure4(ds, options=options)
    for warning in caught:
        click.echo(f"depthdiag: warning: {warning.message}", err=True)
    for path in save_figure(fig, out, force=force):
        click.echo(f"wrote {path}")


def _plot_grid(results: tuple[Path, ...], figure_number: str, out: Path, force: bool) -> None:
    from analysis import figures
    from analysis.grid import open_grid

    if len(results) != 1:
        raise InputError(f"--figure {figure_number} draws one collected grid file, got {len(results)} files")
    draw = {
        "1": figures.figure1,
        "2": figures.figure2,
        "3-loss": figures.figure3_loss,
        "5": figures.figure5,
        "8": figures.figure8,
    }[figure_number]
    with naming_files(results):
        fig = draw(open_grid(results[0]))
    for path in figures.save_figure(fig, out, force=force):
        click.echo(f"wrote {path}")


def _plot_curves(runs: tuple[Path, ...], out: Path, force: bool) -> None:
    from analysis.figures import curves_figure, save_figure
    from diag.curves import training_curves

    if len(runs) != 1:
        raise InputError(f"--figure curves draws one run directory, got {len(runs)} paths")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = curves_figure(training_curves(runs[0]))
    for warning in caught:
        click.echo(f"depthdiag: warning: {warning.message}", err=True)
    for path in save_figure(fig, out, force=force):
        click.echo(f"wrote {path}")


@main.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--after",
    "after_updates",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Compare the switch with the snapshot after this many uniform updates.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON (NaN as null).")
@reports_errors
@interval_options
def sensitivity(results: tuple[Path, ...], after_updates: int, as_json: bool, options: IntervalOptions) -> None:
    """Depth-averaged benefit at the switch and after --after uniform updates, for every
    (isolate, rms_match) combination among RESULTS, as a Markdown table.

    RESULTS may mix settings and seeds: files are grouped by their isolate and rms_match
    attributes and each group is combined along seeds (its files must differ in the seed only).
    """
    from analysis.sensitivity import format_sensitivity_markdown, sensitivity_table

    with naming_files(results):
        table = sensitivity_table(results, after_updates=after_updates, options=options)
    if as_json:
        click.echo(json.dumps(_json_ready(table.to_dict()), indent=2))
    else:
        click.echo(format_sensitivity_markdown(table))


# --- recommend ----------------------------------------------------------------------------


@main.command()
@click.argument("monitor", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--updates", type=click.IntRange(min=1), required=True, help="N: the length of the run to plan, in updates."
)
@click.option(
    "--threshold",
    type=float,
    default=0.05,
    show_default=True,
    help="A check is settled when its mean benefit is below this fraction of the switch's (rule fraction).",
)
@click.option(
    "--checks",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="F needs at least this many consecutive settled checks, and every later check settled.",
)
@click.option(
    "--margin",
    type=float,
    default=1.5,
    show_default=True,
    help="Safety margin: the plan's finishing phase is ceil(margin x F) updates (>= 1).",
)
@click.option(
    "--rule",
    type=click.Choice(FINISH_RULE_CHOICES),
    default="fraction",
    show_default=True,
    help="When a check is settled: fraction (mean below --threshold x the switch's), zero (its interval "
    "over batches contains 0; wide with few batches per check), or either.",
)
@click.option("--level", type=float, default=0.95, show_default=True, help="Confidence level of the intervals.")
@click.option("--include-embeddings", is_flag=True, help="Count the LM head matmul in the modeled FLOPs too.")
@click.option("--json", "as_json", is_flag=True, help="Print the recommendation as JSON (NaN as null).")
@click.option(
    "--grid",
    "grid_out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write an experiment grid that trains the recommended schedule against the 80% switch and "
    "uniform:1-16 over --updates for every --seeds (run it with `depthdiag grid run`); needs --base.",
)
@click.option(
    "--base",
    "base_config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The run config the --grid's runs start from (the pilot's config; its monitor is switched off).",
)
@click.option("--seeds", default="0,1,2", show_default=True, help="Training seeds of the --grid.")
@click.option("--force", is_flag=True, help="Overwrite an existing --grid file.")
@reports_errors
def recommend(
    monitor: Path,
    updates: int,
    threshold: float,
    checks: int,
    margin: float,
    rule: str,
    level: float,
    include_embeddings: bool,
    as_json: bool,
    grid_out: Path | None,
    base_config: Path | None,
    seeds: str,
    force: bool,
) -> None:
    """Size a fixed-first schedule for a run of --updates N from a pilot run's MONITOR file
    (RUN/monitor.h5 of a fixed-first run with a [monitor] block).

    \b
    F = uniform updates after the switch from which the deep update's depth-averaged
    benefit has settled (default rule: mean below --threshold x its value at the switch)
    for at least --checks consecutive checks and for good; F' = ceil(--margin x F);
    switch = 1 - F'/N (clamped to [0, 1]). Prints the spec with the pilot's K0 and
    finish, and its modeled training compute against uniform:1-16 and the paper's 80% switch.
    """
    from analysis.stats import IntervalOptions
    from common.atomic import atomic_write_text
    from common.lock import claimed_outputs, refuse_existing
    from diag.recommend import RecommendConfig, comparison_grid, format_recommendation
    from diag.recommend import recommend as run_recommend

    config = RecommendConfig(
        monitor=monitor,
        updates=updates,
        threshold=threshold,
        checks=checks,
        margin=margin,
        rule=rule,
        options=IntervalOptions(level=level),
        include_embeddings=include_embeddings,
    )
    if (grid_out is None) != (base_config is None):
        raise InputError("--grid and --base go together: the grid's runs start from the --base config")
    try:
        grid_seeds = tuple(int(seed) for seed in seeds.split(","))
    except ValueError:
        raise InputError(f"--seeds {seeds!r}: expected integers separated by commas, e.g. 0,1,2") from None
    if grid_out is not None:
        refuse_existing([grid_out], force=force)
    recommendation = run_recommend(config)
    if grid_out is not None:
        with claimed_outputs([grid_out], force=force):
            text = comparison_grid(recommendation, base=base_config, out=grid_out, seeds=grid_seeds)
            atomic_write_text(text, grid_out)
        click.echo(f"wrote {grid_out}", err=True)
    if as_json:
        click.echo(json.dumps(_json_ready(recommendation.to_dict()), indent=2))
    else:
        click.echo(format_recommendation(recommendation))


# --- grid ------------------------------------------------------------------------------------


@main.group()
def grid() -> None:
    """Experiment grids: a TOML file names a base config and the axes to vary (schedule,
    seed, budget, any config key); `grid run` trains every unfinished cell, `grid collect`
    evaluates them all into one file with a dimension per axis, `grid table` prints the
    paper's Table 3 from it, `grid compare` one schedule against the others by serving
    depth, and `plot --figure 1|2|3-loss|5|8` draws it. The grid file's
    format: diag/grid.py, and the examples under grids/."""


grid_file_argument = click.argument("grid_file", metavar="GRID", type=click.Path(dir_okay=False, path_type=Path))
runs_option = click.option(
    "--runs",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder of the cells' run directories (default: runs/<grid name>).",
)
base_option = click.option(
    "--base",
    "base_config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Use this run config as the grid's base instead of the one the grid file names (e.g. paper scale).",
)
grid_set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config value of every cell after the grid's [set], e.g. --set train.updates=4800 (repeatable).",
)
axis_option = click.option(
    "--axis",
    "axis_values",
    multiple=True,
    metavar="NAME=V1,V2",
    help="Replace the values of a list axis, e.g. --axis seed=0,1,2,3 (repeatable).",
)


def _grid_runs(grid_file: Path, runs: Path | None) -> Path:
    return runs if runs is not None else Path("runs") / grid_file.stem


@grid.command("run")
@grid_file_argument
@runs_option
@base_option
@grid_set_option
@axis_option
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True, help="Cells trained side by side.")
@click.option(
    "--threads", type=click.IntRange(min=1), default=1, show_default=True, help="Torch threads of each cell's run."
)
@click.option("--dry-run", is_flag=True, help="List the cells (updates, modeled FLOPs, state) and train nothing.")
@no_progress_option
@reports_errors
def grid_run(
    grid_file: Path,
    runs: Path | None,
    base_config: Path | None,
    overrides: tuple[str, ...],
    axis_values: tuple[str, ...],
    jobs: int,
    threads: int,
    dry_run: bool,
    no_progress: bool,
) -> None:
    """Train every cell of GRID that has not finished: finished cells are skipped, an
    interrupted one resumes from its newest checkpoint (bit-exactly), each in its own
    `depthdiag train` process (output in RUNS/logs/). Exit 3 names the cells that failed."""
    from diag.grid import format_cells, load_grid, run_grid

    spec = load_grid(grid_file, axis_values, base=base_config, overrides=overrides)
    runs = _grid_runs(grid_file, runs)
    if dry_run:
        click.echo(format_cells(spec, runs))
        return
    report = run_grid(spec, runs, jobs=jobs, threads=threads, progress=not no_progress)
    click.echo(f"{runs}: {len(report.trained)} cell(s) trained, {len(report.skipped)} already finished")


@grid.command("collect")
@grid_file_argument
@runs_option
@base_option
@grid_set_option
@axis_option
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The collected file (xarray/HDF5), e.g. results/grid-figure1.h5.",
)
@click.option(
    "--serving",
    default=None,
    help="Serving depths every cell is evaluated at (a range, a list or both; default: the grid file's "
    "`serving`, or 1-64).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --out file.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True, help="Cells evaluated side by side.")
@max_depth_option
@device_option
@no_progress_option
@reports_errors
def grid_collect(
    grid_file: Path,
    runs: Path | None,
    base_config: Path | None,
    overrides: tuple[str, ...],
    axis_values: tuple[str, ...],
    out: Path,
    serving: str | None,
    force: bool,
    jobs: int,
    max_depth: int,
    device: str,
    no_progress: bool,
) -> None:
    """Evaluate the final checkpoint of every cell of GRID at the --serving depths (NLL on
    its evaluation set, and recalled bits per person on bioS) and write one file with a
    dimension per grid axis, the cells' training-loss trajectories and modeled FLOPs. Each
    cell's evaluation is kept in its run directory and reused while its checkpoint is the same."""
    from analysis.store import write_results
    from common.depths import parse_serving_depths
    from common.lock import refuse_existing
    from diag.grid import collect_grid, load_grid

    refuse_existing([out], force=force)
    spec = load_grid(grid_file, axis_values, base=base_config, overrides=overrides)
    depths = parse_serving_depths(serving if serving is not None else spec.serving, limit=max_depth)
    ds = collect_grid(
        spec, _grid_runs(grid_file, runs), serving=depths, device=device, jobs=jobs, progress=not no_progress
    )
    click.echo(f"wrote {write_results(ds, out, force=force)}")


@grid.command("table")
@click.argument("collected", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--reference",
    default="uniform",
    show_default=True,
    help="The schedule label FLOPs and wall-clock time are measured against.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (NaN as null) instead of Markdown.")
@reports_errors
def grid_table(collected: Path, reference: str, as_json: bool) -> None:
    """The paper's Table 3 from a COLLECTED grid file: per schedule, terminal training NLL,
    mean serving NLL over depths 1-16, modeled FLOPs relative to --reference and the measured
    wall-clock reduction, mean and SD over seeds."""
    from analysis.grid import format_table3, open_grid, table3

    rows = table3(open_grid(collected), reference=reference)
    if as_json:
        click.echo(json.dumps(_json_ready(rows), indent=2))
    else:
        click.echo(format_table3(rows))


@grid.command("compare")
@click.argument("collected", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--schedule", required=True, help="The schedule label compared with every other schedule of the grid.")
@click.option("--serving", default="1-16", show_default=True, help="Serving depths of the comparison.")
@click.option("--level", type=float, default=0.95, show_default=True, help="Confidence level of the intervals.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (NaN as null) instead of Markdown.")
@reports_errors
def grid_compare(collected: Path, schedule: str, serving: str, level: float, as_json: bool) -> None:
    """Per serving depth, the NLL of --schedule minus every other schedule's in a COLLECTED
    grid file, paired by seed, with a Student-t interval over seeds, and the depth average;
    plus each schedule's modeled FLOPs relative to --schedule."""
    from analysis.grid import format_comparison, open_grid, paired_comparison
    from common.depths import parse_serving_depths

    comparison = paired_comparison(
        open_grid(collected), schedule=schedule, serving=parse_serving_depths(serving), level=level
    )
    if as_json:
        document = {name: comparison[name].to_dict(data="list") for name in comparison.data_vars}
        click.echo(json.dumps(_json_ready({"attrs": comparison.attrs, "variables": document}), indent=2))
    else:
        click.echo(format_comparison(comparison))


# --- export ---------------------------------------------------------------------------------


@main.command("export")
@click.argument("checkpoint", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Folder to write model.safetensors and config.json to (new, or empty).",
)
@click.option("--force", is_flag=True, help="Overwrite an earlier export in --out (never a folder with other files).")
@reports_errors
def export_model(checkpoint: Path, out: Path, force: bool) -> None:
    """Write the model of CHECKPOINT (a checkpoint or a snapshot) as OUT/model.safetensors
    (its state_dict) and OUT/config.json (its ModelConfig, with the source file's sha256 and
    the run config for provenance), which load back with a few lines of plain PyTorch and
    no pickle (README: "Models in and out")."""
    from trainer.export import export_checkpoint

    click.echo(f"wrote {export_checkpoint(checkpoint, out, force=force)}")


# --- prepare ---------------------------------------------------------------------------------


@main.command()
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Output folder: train.bin, val.bin, tokenizer.json, meta.json (data.source = 'bin', data.path = it).",
)
@click.option(
    "--vocab-size",
    type=int,
    default=None,
    help="Train a byte-level BPE tokenizer of this many tokens on the training documents.",
)
@click.option(
    "--tokenizer",
    "tokenizer_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Encode with this tokenizer.json instead (exactly one of --vocab-size and --tokenizer).",
)
@click.option(
    "--text-field", default="text", show_default=True, help="The field of a .jsonl line that holds its document."
)
@click.option(
    "--val-fraction",
    type=float,
    default=0.01,
    show_default=True,
    help="Expected fraction of documents held out in val.bin (a hash of each document's text decides).",
)
@click.option(
    "--document",
    type=click.Choice(DOCUMENT_CHOICES),
    default="paragraph",
    show_default=True,
    help="A document of a plain-text file: a blank-line separated paragraph, or the whole file.",
)
@click.option(
    "--eot", default="<|endoftext|>", show_default=True, help="The end-of-text token that follows every document."
)
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@no_progress_option
@reports_errors
def prepare(
    inputs: tuple[str, ...],
    out: Path,
    vocab_size: int | None,
    tokenizer_file: Path | None,
    text_field: str,
    val_fraction: float,
    document: str,
    eot: str,
    force: bool,
    no_progress: bool,
) -> None:
    """Tokenize a text corpus into nanoGPT-style train.bin / val.bin for data.source = "bin".

    INPUT: files, folders (every non-hidden file below, in sorted order) or glob patterns;
    plain UTF-8 text, or JSON lines (.jsonl) with the document in --text-field. The
    train/val split is by document, decided by a hash of its text. Two runs on the same
    input write byte-identical files.

    \b
    Example:
      depthdiag prepare books/ --out data/books --vocab-size 8192
      # then in the run config: [data] source = "bin", path = "../data/books"
    """
    from trainer.prepare import PrepareConfig
    from trainer.prepare import prepare as prepare_corpus

    config = PrepareConfig(
        inputs=inputs,
        out=out,
        vocab_size=vocab_size,
        tokenizer=tokenizer_file,
        text_field=text_field,
        val_fraction=val_fraction,
        document=document,
        eot=eot,
        force=force,
    )
    meta = prepare_corpus(config, progress=not no_progress).meta
    asked = (meta["tokenizer_training"] or {}).get("vocab_size_asked")
    short = f" (asked for {asked:,}: no more pairs occur twice)" if asked and asked > meta["vocab_size"] else ""
    click.echo(
        f"wrote {out}: vocabulary {meta['vocab_size']:,}{short}, {meta['dtype']}; "
        f"train {meta['tokens']['train']:,} tokens ({meta['documents']['train']:,} documents), "
        f"val {meta['tokens']['val']:,} tokens ({meta['documents']['val']:,} documents)"
    )


# --- lm-eval ---------------------------------------------------------------------------------


@main.command("lm-eval")
@click.argument("checkpoint", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--tasks",
    required=True,
    help="lm-evaluation-harness task, group or tag names separated by commas, e.g. hellaswag,piqa,arc_easy.",
)
@serving_option
@max_depth_option
@click.option(
    "--include-path",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="A folder of task YAML files to use besides lm-eval's own (its --include_path).",
)
@click.option(
    "--limit",
    type=float,
    default=None,
    help="Evaluate only the first N documents of each task (or a fraction of each, below 1) [default: all].",
)
@click.option(
    "--num-fewshot",
    type=click.IntRange(min=0),
    default=None,
    help="Few-shot examples per prompt [default: each task's own, 0 for hellaswag, piqa, arc_easy].",
)
@click.option(
    "--tokenizer",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A Hugging Face tokenizers file to use instead of the checkpoint's own (bytes for 'text' data, "
    "the data folder's meta.json tokenizer for 'bin').",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The results file (xarray/HDF5): every metric over task x serving depth.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --out file.")
@eval_batch_size_option("--batch-size")
@device_option
@no_progress_option
@reports_errors
def lm_eval_run(
    checkpoint: Path,
    tasks: str,
    serving: str,
    max_depth: int,
    include_path: Path | None,
    limit: float | None,
    num_fewshot: int | None,
    tokenizer: Path | None,
    out: Path,
    force: bool,
    batch_size: int,
    device: str,
    no_progress: bool,
) -> None:
    """Downstream accuracy of CHECKPOINT (a checkpoint or snapshot) on lm-evaluation-harness
    tasks at every --serving depth, into one file (draw it with `plot --figure 3-downstream`).
    Needs the eval extra: pip install -e .[eval].

    \b
    Every request is scored at all serving depths from one pass of the deepest, so depths
    1-16 cost about one evaluation at depth 16 (generation tasks decode once per depth).
    Example (the paper's Figure 3, bottom row):
      depthdiag lm-eval runs/x/checkpoints/latest.pt --tasks hellaswag,piqa,arc_easy \\
        --serving 1-16 --out results/x-downstream.h5
    """
    from analysis.downstream import format_downstream
    from analysis.store import write_dataset
    from common.depths import parse_serving_depths
    from common.lock import claimed_outputs, refuse_existing
    from diag.downstream import DownstreamConfig, evaluate_downstream, parse_tasks, require_harness

    require_harness()
    config = DownstreamConfig(
        checkpoint=checkpoint,
        tasks=parse_tasks(tasks),
        serving_depths=parse_serving_depths(serving, limit=max_depth),
        include_path=include_path,
        limit=limit,
        num_fewshot=num_fewshot,
        tokenizer=tokenizer,
        batch_size=batch_size,
        device=device,
        progress=not no_progress,
    )
    refuse_existing([out], force=force)
    # The lock is held over the whole evaluation: a second writer of --out is refused at once,
    # not after hours of evaluating.
    with claimed_outputs([out], force=force):
        ds = evaluate_downstream(config)
        click.echo(format_downstream(ds))
        write_dataset(ds, out)
    click.echo(f"wrote {out}")


def _plot_downstream(results: tuple[Path, ...], out: Path, force: bool) -> None:
    from analysis.downstream import open_downstream
    from analysis.figures import figure3_downstream, save_figure

    with naming_files(results):
        fig = figure3_downstream(open_downstream(results))
    for path in save_figure(fig, out, force=force):
        click.echo(f"wrote {path}")


if __name__ == "__main__":
    # `torchrun --nproc_per_node=N -m diag.cli train CONFIG` runs the same command on every rank.
    main(prog_name="depthdiag")
