"""`depthdiag flops`."""

from __future__ import annotations

import click

from common.json_text import json_text
from depthdiag.cli.app import reports_errors


@click.command()
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
    from trainer.flops import UNIFORM_REFERENCE, flops_report, format_flops_report

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
        click.echo(json_text(report.to_dict()))
        return
    click.echo(format_flops_report(report, config.model, source=config_path))
