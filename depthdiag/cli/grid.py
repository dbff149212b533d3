"""`depthdiag grid run|collect|table|compare`."""

from __future__ import annotations

from pathlib import Path

import click

from common.json_text import json_text
from depthdiag.cli.app import reports_errors
from depthdiag.cli.options import (
    device_option,
    max_depth_option,
    no_progress_option,
)


@click.group()
def grid() -> None:
    """Experiment grids: a TOML file names a base config and the axes to vary (schedule,
    seed, budget, any config key); `grid run` trains every unfinished cell, `grid collect`
    evaluates them all into one file with a dimension per axis, `grid table` prints the
    paper's Table 3 from it, `grid compare` one schedule against the others by serving
    depth, and `plot --figure 1|2|3-loss|5|8` draws it. The grid file's
    format: depthdiag/grid.py, and the examples under grids/."""


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


def _grid_run_kept(grid_file: Path, **_) -> str:
    return (
        "finished cells and the checkpoints of the cells in flight are kept; "
        f"rerun `depthdiag grid run {grid_file}` with the same options to resume"
    )


@grid.command("run")
@grid_file_argument
@runs_option
@base_option
@grid_set_option
@axis_option
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    help="Cells trained side by side (default 1; with a submitit --executor: every cell submitted at once).",
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=1, show_default=True, help="Torch threads of each cell's run."
)
@click.option(
    "--executor",
    type=click.Choice(["process", "slurm", "submitit-local"]),
    default="process",
    show_default=True,
    help="process: a `depthdiag train` process per cell on this machine; slurm: one Slurm job per cell "
    "through submitit (pip install 'depthdiag[slurm]'); submitit-local: the same jobs as processes here.",
)
@click.option("--slurm-partition", default=None, help="Partition of the cells' jobs (default: the cluster's).")
@click.option(
    "--slurm-time",
    type=click.IntRange(min=1),
    default=None,
    metavar="MINUTES",
    help="Time limit of each cell's job (default 60); a cell cut short resumes from its checkpoint on the next "
    "`grid run`.",
)
@click.option(
    "--slurm-gpus-per-node",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="GPUs of each cell's job, on one node; more than one trains the cell under torchrun, one process per GPU.",
)
@click.option(
    "--slurm-param",
    "slurm_params",
    multiple=True,
    metavar="KEY=VALUE",
    help="Another parameter of submitit's Slurm executor, e.g. account=proj, qos=high, mem=64G (repeatable).",
)
@click.option("--dry-run", is_flag=True, help="List the cells (updates, modeled FLOPs, state) and train nothing.")
@no_progress_option
@reports_errors(kept=_grid_run_kept)
def grid_run(
    grid_file: Path,
    runs: Path | None,
    base_config: Path | None,
    overrides: tuple[str, ...],
    axis_values: tuple[str, ...],
    jobs: int | None,
    threads: int,
    executor: str,
    slurm_partition: str | None,
    slurm_time: int | None,
    slurm_gpus_per_node: int,
    slurm_params: tuple[str, ...],
    dry_run: bool,
    no_progress: bool,
) -> None:
    """Train every cell of GRID that has not finished: finished cells are skipped, an
    interrupted one resumes from its newest checkpoint (bit-exactly), each in its own
    `depthdiag train` process (output in RUNS/logs/), or with --executor slurm as one Slurm
    job per cell (output in RUNS/.submitit/), waited for here. Exit 3 names the cells that failed."""
    from common.errors import InputError
    from depthdiag.grid import format_cells, load_grid
    from depthdiag.grid_run import run_grid

    slurm = None
    if executor == "process":
        if slurm_partition is not None or slurm_time is not None or slurm_gpus_per_node or slurm_params:
            raise InputError("--slurm-* options need --executor slurm or submitit-local")
    else:
        from depthdiag.slurm import SlurmOptions, import_submitit, slurm_parameters

        import_submitit()  # a missing extra is one line before anything else
        slurm = SlurmOptions(
            partition=slurm_partition,
            time_min=60 if slurm_time is None else slurm_time,
            gpus_per_node=slurm_gpus_per_node,
            parameters=slurm_parameters(slurm_params),
        )
    spec = load_grid(grid_file, axis_values, base=base_config, overrides=overrides)
    runs = _grid_runs(grid_file, runs)
    if dry_run:
        click.echo(format_cells(spec, runs))
        return
    if slurm is None:
        report = run_grid(spec, runs, jobs=jobs, threads=threads, progress=not no_progress)
    else:
        from depthdiag.slurm import submit_grid

        cluster = "local" if executor == "submitit-local" else "slurm"
        report = submit_grid(
            spec, runs, cluster=cluster, options=slurm, jobs=jobs, threads=threads, progress=not no_progress
        )
    click.echo(f"{runs}: {len(report.trained)} cell(s) trained, {len(report.skipped)} already finished")


def _grid_collect_kept(**_) -> str:
    return "every finished cell's evaluation is kept in its run directory; rerun the same command to continue"


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
@reports_errors(kept=_grid_collect_kept)
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
    from analysis.store import RESULTS_FILE, write_results
    from common.depths import parse_serving_depths
    from common.outputs import check_output
    from depthdiag.grid import collect_grid, load_grid

    check_output(out, kind=RESULTS_FILE, inputs=[grid_file], force=force)
    spec = load_grid(grid_file, axis_values, base=base_config, overrides=overrides)
    depths = parse_serving_depths(serving if serving is not None else spec.serving, limit=max_depth)
    ds = collect_grid(
        spec, _grid_runs(grid_file, runs), serving=depths, device=device, jobs=jobs, progress=not no_progress
    )
    click.echo(f"wrote {write_results(ds, out, force=force, inputs=[grid_file])}")


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
        click.echo(json_text(rows))
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
        click.echo(json_text({"attrs": comparison.attrs, "variables": document}))
    else:
        click.echo(format_comparison(comparison))
