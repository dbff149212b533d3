"""`depthdiag exits`: which depth to serve each token."""

from __future__ import annotations

from pathlib import Path

import click

from common.choices import EVAL_SET_CHOICES
from common.errors import InputError
from depthdiag.cli.app import reports_errors
from depthdiag.cli.options import device_option, eval_batch_size_option, hf_input_options, no_progress_option

SHIPPED_CRITERIA = ("kl", "l2", "entropy", "maxprob")
"""trainer.exits.CRITERIA's names, listed here so that --help imports no torch (a test checks)."""


def parse_thresholds(values: tuple[str, ...]) -> dict[str, tuple[float, ...]]:
    """--thresholds NAME=T1,T2,... (repeatable) as {name: thresholds}."""
    parsed = {}
    for value in values:
        name, sep, numbers = value.partition("=")
        try:
            thresholds = tuple(float(t) for t in numbers.split(",")) if sep and name else ()
        except ValueError:
            thresholds = ()
        if not thresholds:
            raise InputError(f"--thresholds {value!r}: expected CRITERION=T1,T2,..., e.g. kl=5e-4,1e-3")
        parsed[name] = thresholds
    return parsed


@click.command("exits")
@click.argument("checkpoints", nargs=-1, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Results file to write.")
@click.option(
    "--criteria",
    default=",".join(SHIPPED_CRITERIA),
    show_default=True,
    help="Comma-separated exit criteria: kl (KL of successive next-token distributions), l2 (relative change of "
    "the recurrent state), entropy, maxprob, or MODULE:NAME naming a trainer.exits.Criterion.",
)
@click.option(
    "--thresholds",
    multiple=True,
    metavar="CRITERION=T1,T2,...",
    help="Thresholds of one criterion, replacing its default sweep of 20 (repeatable).",
)
@click.option(
    "--max-depth",
    type=click.IntRange(min=2),
    default=16,
    show_default=True,
    help="S: tokens are scored at depths 1..S; one whose criterion never fires is served at S.",
)
@click.option(
    "--eval-set",
    type=click.Choice(EVAL_SET_CHOICES),
    default="auto",
    show_default=True,
    help="snapshot: the checkpoint's evaluation set; attributes (bioS): only the attribute-value targets "
    "counted; auto: attributes for bioS runs, snapshot otherwise.",
)
@click.option(
    "--grouping",
    "groupings",
    multiple=True,
    metavar="NAME",
    help="Break the overthinking ledger down by a grouping of the targets (repeatable): attribute (bioS, "
    "--eval-set attributes), frequency, position, or MODULE:NAME (as diagnose --grouping).",
)
@click.option(
    "--real-exit",
    is_flag=True,
    help="Also serve with real per-token exit at every threshold (stopped tokens frozen, later iterations "
    "attending to them; depthdiag's own models), one forward per threshold.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --out results file.")
@device_option
@eval_batch_size_option("--batch-size")
@no_progress_option
@reports_errors
@hf_input_options(training=False, snapshot_folders=True)
def exits(
    checkpoints: tuple[Path, ...],
    out: Path,
    criteria: str,
    thresholds: tuple[str, ...],
    max_depth: int,
    eval_set: str,
    groupings: tuple[str, ...],
    real_exit: bool,
    force: bool,
    device: str,
    batch_size: int,
    no_progress: bool,
    hf,
    trust_remote_code: bool,
    family: str | None,
) -> None:
    """Simulate per-token exit criteria from one pass over depths 1..S of each CHECKPOINT
    (checkpoints or snapshots, or snapshot folders that diag.save_snapshot wrote, with their
    --family and --trust-remote-code; several are several seeds of one experiment) or of --hf DIR:
    for each criterion and threshold the mean served depth, modeled FLOPs per token, mean NLL and
    top-1 accuracy; the oracle (each token at the smallest depth within epsilon of its best NLL)
    and the lowest NLL any per-token choice of depths reaches at each mean depth; the fixed
    depths; and the overthinking ledger (tokens turning right -> wrong from one depth to the
    next). `depthdiag summarize OUT` prints the table, `depthdiag plot OUT --figure exits` draws it."""
    from analysis.store import RESULTS_FILE, write_results
    from common.outputs import check_outputs
    from depthdiag.exits import ExitsConfig, exits_of_checkpoints, exits_of_hf
    from trainer.exits import criterion_named

    if bool(checkpoints) == (hf is not None):
        raise InputError("give CHECKPOINT... or --hf DIR (a Hugging Face model folder), one of them")
    names = [name.strip() for name in criteria.split(",") if name.strip()]
    if not names:
        raise InputError("--criteria: give at least one criterion")
    chosen = tuple(criterion_named(name) for name in names)
    parsed = parse_thresholds(thresholds)
    unknown = sorted(set(parsed) - {c.name for c in chosen})
    if unknown:
        raise InputError(f"--thresholds {unknown[0]}: not among --criteria ({', '.join(c.name for c in chosen)})")
    inputs = list(checkpoints) if hf is None else [hf.folder]
    check_outputs([out], kind=RESULTS_FILE, inputs=inputs, force=force)
    config = ExitsConfig(
        criteria=chosen,
        thresholds=parsed,
        max_depth=max_depth,
        eval_set=eval_set,
        groupings=groupings,
        real_exit=real_exit,
        batch_size=batch_size,
        device=device,
        progress=not no_progress,
    )
    if hf is None:
        ds = exits_of_checkpoints(checkpoints, config, trust_remote_code=trust_remote_code, family=family)
    else:
        ds = exits_of_hf(hf, config)
    click.echo(f"wrote {write_results(ds, out, force=force, inputs=inputs)}")
