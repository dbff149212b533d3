"""`depthdiag diagnose`."""

from __future__ import annotations

import os
from pathlib import Path

import click

from common.choices import (
    EVAL_SET_CHOICES,
    ISOLATE_CHOICES,
    RMS_MATCH_CHOICES,
)
from common.depths import MAX_SERVING_DEPTH, UPDATE_DEPTHS, depths_text
from depthdiag.cli.app import reports_errors
from depthdiag.cli.options import (
    device_option,
    eval_batch_size_option,
    hf_input_options,
    max_depth_option,
    no_progress_option,
    serving_option,
)


def _diagnose_kept(out: str, **_) -> str:
    parts = Path(f"{out}.parts")
    if not parts.is_dir():
        return "no unit had finished; nothing was written"
    return f"{parts} keeps every finished unit; continue with the same command and --resume"


@click.command()
@click.argument("snapshots", nargs=-1, type=click.Path())
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
    "(model, optimizer, batches, eval_tokens; docs/api.md).",
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
    default=depths_text(UPDATE_DEPTHS),
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
    "--grouping",
    "groupings",
    multiple=True,
    metavar="NAME",
    help="Also record the NLLs of each group of evaluation targets (repeatable): attribute (bioS, "
    "--eval-set attributes), frequency (of the target token in the run's training stream, quartiles), "
    "position (four spans of the sequence), or MODULE:NAME, a function of eval_tokens [E, T+1] returning "
    "group ids [E, T]. summarize --by NAME prints the benefit per group. Costs one more evaluation pass.",
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
@click.option(
    "--sharded",
    is_flag=True,
    help="Under torchrun: shard each snapshot's model and optimizer state over the ranks (FSDP2) and compute "
    "every unit with all of them, for a model that does not fit one device.",
)
@no_progress_option
@reports_errors(kept=_diagnose_kept)
@hf_input_options(training=True, snapshot_folders=True)
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
    groupings: tuple[str, ...],
    resume: bool,
    force: bool,
    sharded: bool,
    no_progress: bool,
    hf,
    trust_remote_code: bool,
    family: str | None,
    attribute: bool = False,
    pool: int = 0,
    removal_depth: int | None = None,
) -> None:
    """Compare single updates at several depths from each SNAPSHOT (snapshot or checkpoint
    files of one run, or snapshot folders any training loop wrote with diag.save_snapshot;
    --trust-remote-code runs the code of a folder's Hugging Face model), from a Hugging Face
    model folder (--hf DIR, on batches of --data), or from the model an --adapter function
    returns, on its batches; write nll, benefit and update statistics to OUT. A snapshot folder
    and an adapter's model say how they are called at a depth (their model family); --family
    says it in their place.

    \b
    Benefit(s) = NLL after the first depth's update - NLL after the last depth's update,
    at each serving depth s: positive favours the last depth's update. See docs/diagnostic.md.

    The run holds OUT's lock (covering OUT.parts/) until it ends; a unit with a non-finite
    NLL, loss or update RMS (a diverged snapshot) stops it with exit 2, naming the file and batch.

    Under torchrun the units of snapshot or checkpoint files are spread over the ranks (one
    device each), into the same OUT a single process writes:
      torchrun --nproc_per_node=4 -m depthdiag diagnose runs/tiny/seed0/snapshots/*.pt --out r.h5
    With --sharded every unit runs on all ranks together, the model sharded over them; the
    numbers equal one process's within float rounding (docs/scaling.md).
    """
    from common.depths import parse_serving_depths, parse_update_depths
    from diag.driver.run import DiagnoseConfig
    from diag.driver.run import diagnose as run_diagnose
    from diag.sources.adapter import parse_adapter_args

    config = DiagnoseConfig(
        snapshots=snapshots,
        out=out,
        adapter=adapter,
        adapter_args=parse_adapter_args(adapter_args),
        hf=hf,
        update_depths=parse_update_depths(update_depths, limit=max_depth),
        serving_depths=parse_serving_depths(serving, limit=max_depth),
        batches=batches,
        isolate=isolate,
        rms_match=rms_match,
        lr=lr,
        eval_batch_size=eval_batch_size,
        eval_set=eval_set,
        groupings=groupings,
        device=device,
        resume=resume,
        force=force,
        sharded=sharded,
        max_depth=max_depth,
        progress=not no_progress,
        trust_remote_code=trust_remote_code,
        family=family,
        attribute=attribute,
        pool=pool,
        removal_depth=removal_depth,
    )
    written = run_diagnose(config)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 wrote it
        click.echo(f"wrote {written}")


def _attribute(**options) -> None:
    diagnose.callback(**options, isolate="linear", sharded=False, attribute=True)


attribute = click.Command(
    "attribute",
    callback=_attribute,
    params=[
        *(param for param in diagnose.params if param.name not in ("isolate", "sharded")),
        click.Option(
            ["--pool"],
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="Also score N training sequences of the run's own stream, right after the diagnosed batches, "
            "against each unit's update (snapshot and checkpoint files).",
        ),
        click.Option(
            ["--removal-depth"],
            type=click.IntRange(min=1),
            default=None,
            metavar="S",
            help="Also check the ranking at serving depth S against the diagnostic itself: each unit's benefit "
            "(default isolation) with the quarter of its batch ranked highest at S removed, the lowest quarter, and "
            "a random quarter (three more units per batch); summarize prints the paired differences.",
        ),
    ],
    help="""Attribute each unit's benefit (isolate='linear') to the training sequences of its batch,
    to first order: attribution(example, serving_depth) = e_s . J (c_a kappa_a g_a,i - c_b kappa_b g_b,i),
    positive where sequence i pushes the deep update ahead at serving depth s; the batch's rows sum to
    linear_benefit, written beside the unit's own benefit. Takes what diagnose takes (snapshot or
    checkpoint files, snapshot folders, --hf, --adapter) and writes a results file with the same lock,
    --resume and --force rules; summarize FILE lists the top and bottom sequences per serving depth.
    See docs/diagnostic.md.""",
    short_help="Attribute the deep update's benefit to training sequences.",
)
