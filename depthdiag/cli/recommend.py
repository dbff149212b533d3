"""`depthdiag recommend`."""

from __future__ import annotations

from pathlib import Path

import click

from common.choices import (
    FINISH_RULE_CHOICES,
)
from common.errors import InputError
from common.json_text import json_text
from depthdiag.cli.app import reports_errors


@click.command()
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
    from common.lock import claimed_outputs
    from common.outputs import GRID_SPEC, check_output
    from diag.in_training.recommend import RecommendConfig, comparison_grid, format_recommendation
    from diag.in_training.recommend import recommend as run_recommend

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
        check_output(grid_out, kind=GRID_SPEC, inputs=[monitor, base_config], force=force)
    recommendation = run_recommend(config)
    if grid_out is not None:
        with claimed_outputs([grid_out], kind=GRID_SPEC, inputs=[monitor, base_config], force=force):
            text = comparison_grid(recommendation, base=base_config, out=grid_out, seeds=grid_seeds)
            atomic_write_text(text, grid_out)
        click.echo(f"wrote {grid_out}", err=True)
    if as_json:
        click.echo(json_text(recommendation.to_dict()))
    else:
        click.echo(format_recommendation(recommendation))
