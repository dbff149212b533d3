"""`depthdiag summarize`, `plot`, `sensitivity` and `machines`: reading results files."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import click

from common.errors import InputError, naming_files
from common.json_text import json_text
from depthdiag.cli.app import reports_errors
from depthdiag.cli.options import fraction_option, interval_options

if TYPE_CHECKING:
    from analysis.stats import IntervalOptions

GRID_FIGURES = ("1", "2", "3-loss", "5", "8")
"""The figures `plot` draws from a collected grid file."""
DOWNSTREAM_FIGURE = "3-downstream"
"""The figure `plot` draws from a `depthdiag lm-eval` file."""


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


def _exits_file(results: tuple[Path, ...]) -> Path | None:
    """The `depthdiag exits` file among RESULTS when it is the only file; None when none is one."""
    from analysis.exits import is_exits_file

    found = [path for path in results if is_exits_file(path)]
    if found and len(results) > 1:
        raise InputError(f"{found[0]}: an exits file holds all its runs; summarise or draw it on its own")
    return found[0] if found else None


def _summarize_exits(path: Path, as_json: bool, csv_out: str | None, grouping: str | None) -> None:
    from analysis.exits import format_frontier, frontier_rows, open_exits

    if csv_out is not None or grouping is not None:
        raise InputError(f"{path}: an exits file is summarised as its frontier table (--json for the rows)")
    ds = open_exits(path)
    if as_json:
        rows = [
            {key: value.tolist() if hasattr(value, "tolist") else value for key, value in row.items()}
            for row in frontier_rows(ds)
        ]
        click.echo(json_text({"file": str(path), "rows": rows}))
        return
    click.echo(format_frontier(ds))


def _export_csv(rows: list[dict], csv_out: str | None, force: bool, results: tuple[Path, ...]) -> bool:
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
    from common.outputs import SUMMARY_CSV

    with claimed_outputs([csv_out], kind=SUMMARY_CSV, inputs=results, force=force):
        atomic_write_text(text, csv_out)
    click.echo(f"wrote {csv_out}", err=True)
    return False


def _summarize_monitor(path: Path, as_json: bool, options: IntervalOptions, csv_out: str | None, force: bool) -> None:
    from analysis.monitor import open_monitor
    from analysis.stats import monitor_summary_table
    from analysis.summary import monitor_summary_document, monitor_summary_text

    ds = open_monitor(path)
    rows = monitor_summary_table(ds, options=options)
    if _export_csv(rows, csv_out, force, (path,)):
        return
    if as_json:
        click.echo(json_text(monitor_summary_document(path, ds, rows, options)))
    else:
        click.echo(monitor_summary_text(path, ds, rows, options))


def _summarize_groups(
    results: tuple[Path, ...], grouping: str, as_json: bool, options: IntervalOptions, csv_out: str | None, force: bool
) -> None:
    from analysis.groups import group_benefit_intervals, group_rows, group_text
    from analysis.store import open_results

    with naming_files(results):
        intervals = group_benefit_intervals(open_results(results), grouping, options=options)
    rows = group_rows(intervals)
    if _export_csv(rows, csv_out, force, results):
        return
    if as_json:
        click.echo(json_text({"results": [str(r) for r in results], "grouping": grouping, "rows": rows}))
    else:
        click.echo(group_text(intervals))


@click.command()
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
@click.option(
    "--by",
    "grouping",
    default=None,
    metavar="GROUPING",
    help="Print the benefit per group of evaluation targets of a grouping the results recorded "
    "(diagnose --grouping: attribute, frequency, position, or a function's name), per snapshot and "
    "serving depth, with the headline's intervals; --json and --csv give a row per (snapshot, group, depth).",
)
@fraction_option
@reports_errors
@interval_options
def summarize(
    results: tuple[Path, ...],
    as_json: bool,
    csv_out: str | None,
    force: bool,
    grouping: str | None,
    fraction: float,
    options: IntervalOptions,
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
        from common.outputs import SUMMARY_CSV, check_output

        check_output(csv_out, kind=SUMMARY_CSV, inputs=results, force=force)
    if _exits_file(results) is not None:
        _summarize_exits(results[0], as_json, csv_out, grouping)
        return
    if _monitor_file(results) is not None:
        if grouping is not None:
            raise InputError(f"--by {grouping}: a monitor file records no groups; diagnose --grouping does")
        _summarize_monitor(results[0], as_json, options, csv_out, force)
        return
    if grouping is not None:
        _summarize_groups(results, grouping, as_json, options, csv_out, force)
        return
    from analysis.finishing import finishing_phase, with_equivalence
    from analysis.stats import per_seed_benefits, summary_table
    from analysis.store import open_results
    from analysis.summary import (
        from_a_schedule,
        machine_groups,
        machine_warning,
        summary_document,
        summary_text,
        without_schedule,
    )

    with naming_files(results):
        ds = open_results(results)
        warnings = [_warn_on_mixed_learning_rates(ds, results)]
        machines = machine_groups(ds)
        warnings.append(machine_warning(machines))
        if warnings[-1] is not None:
            click.echo(f"depthdiag: warning: {warnings[-1]}", err=True)
        rows = summary_table(ds, options=options)
        scheduled = from_a_schedule(ds)
        if not scheduled:
            rows = without_schedule(rows)
        has_switch = scheduled and 0 in ds["uniform_updates"].values
        phase = None
        if has_switch:
            phase = finishing_phase(ds, fraction=fraction, options=options)
            rows = with_equivalence(rows, ds, fraction=fraction, options=options)
        per_seed = per_seed_benefits(ds, options=options)
    if _export_csv(rows, csv_out, force, results):
        return
    warnings = [warning for warning in warnings if warning is not None]
    extremes = _attribution_extremes(ds, results[0])
    planted = _planted_labels(ds, results[0])
    if as_json:
        document = summary_document(results, rows, phase, options, warnings, per_seed=per_seed, machines=machines)
        document.update(_attribution_document(ds, extremes, planted, options))
        click.echo(json_text(document))
    else:
        click.echo(summary_text(rows, phase, options, machines))
        for text in _attribution_texts(ds, extremes, planted, options):
            click.echo(text)


def _attribution_document(ds, extremes, planted, options: IntervalOptions) -> dict:
    """An attribution file's entries in summarize --json: the top and bottom sequences, how far
    the first order reaches, the removal check, how well the attribution finds planted sequences."""
    from analysis import attribution

    document = {}
    if extremes is not None:
        document["attribution_extremes"] = extremes[0]
    if "linear_benefit" in ds:
        document["first_order"] = attribution.first_order_rows(attribution.first_order_reach(ds))
    if "removal_benefit" in ds:
        document["removal_check"] = attribution.removal_rows(attribution.removal_intervals(ds, options=options))
    if planted is not None:
        found = attribution.labelled_auroc(ds, planted)
        document["planted_auroc"] = json.loads(found.to_dataframe().reset_index().to_json(orient="records"))
    return document


def _attribution_texts(ds, extremes, planted, options: IntervalOptions) -> list[str]:
    """The same, printed."""
    from analysis import attribution

    texts = [] if extremes is None else [extremes[1]]
    if "linear_benefit" in ds:
        texts.append(attribution.first_order_text(attribution.first_order_reach(ds)))
    if "removal_benefit" in ds:
        texts.append(attribution.removal_text(attribution.removal_intervals(ds, options=options)))
    if planted is not None:
        texts.append(attribution.auroc_text(attribution.labelled_auroc(ds, planted), options=options))
    return texts


def _planted_labels(ds, first: Path):
    """Whether each attributed sequence holds a planted sequence's answer, over the dims of
    `example_tokens` without `token`, for the attribution files of a bioS run with planted
    sequences (data.planted_fraction); None for any other file. The run config is `first`'s
    (files of several seeds share their data config)."""
    import xarray as xr

    from analysis.store import file_attribute
    from trainer.config import RunConfig
    from trainer.data.sources import build_source

    if "example_tokens" not in ds:
        return None
    config_json = file_attribute(first, "config")
    try:
        config = RunConfig.from_json(config_json) if config_json else None
    except InputError:  # an adapter's or a folder's config
        return None
    if config is None or config.data.source != "bios" or not config.data.planted_fraction:
        return None
    tokens = ds["example_tokens"]
    answers = build_source(config.data).planted_answers(tokens.values)[..., 1:].any(-1)  # targets only
    return xr.DataArray(answers, dims=tokens.dims[:-1], coords={d: tokens[d] for d in tokens.dims[:-1]})


def _attribution_extremes(ds, results: Path) -> tuple[list[dict], str] | None:
    """A `depthdiag attribute` file's top and bottom sequences (rows, text), decoded by the run's
    data source where it can render tokens (bioS); None for a file without attributions and
    for several files (seeds) at once."""
    if "attribution" not in ds or "seed" in ds.dims:  # several seeds: listed file by file
        return None
    from analysis.attribution import extreme_sequences, extremes_text

    rows = extreme_sequences(ds)
    return rows, extremes_text(rows, _token_decoder(ds.attrs.get("config"), results))


def _token_decoder(config_json: str | None, results: Path):
    """The run's rendering of token ids as text: bioS's renderer, a text run's tokenizer
    (trainer/data/text_tokens.py), or the ids themselves when there is neither."""
    from trainer.config import RunConfig
    from trainer.data.sources import build_source
    from trainer.data.text_tokens import resolve_tokenizer

    def ids(tokens) -> str:
        return " ".join(map(str, tokens))

    try:
        config = RunConfig.from_json(config_json) if config_json else None
        if config is None:
            return ids
        if config.data.source == "bios":
            return build_source(config.data).describe
        tokenizer = resolve_tokenizer(config, None, results)
    except InputError:  # an adapter's or a folder's config, or a tokenizer that is not there
        return ids
    return lambda tokens: repr(tokenizer.decode(tokens))


@click.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--figure",
    "figure_number",
    type=click.Choice(
        ["4", "map", "groups", "planted", "exits", "monitor", "curves", *GRID_FIGURES, DOWNSTREAM_FIGURE]
    ),
    default="4",
    show_default=True,
    help="Which figure: the paper's Figure 4 (results files); map: which update depth helps which serving "
    "depth, at the switch and after 16 uniform updates (results files diagnosed with several update depths, "
    "e.g. --update-depths 4,1,2,8,16); groups: the benefit per group (--by GROUPING) and serving depth, at the "
    "switch and after 16 uniform updates (results files diagnosed with --grouping); planted: how well the "
    "attribution ranks planted sequences above the rest, AUROC by serving depth per seed (depthdiag attribute "
    "files of a run with data.planted_fraction); exits: NLL against mean served depth (and modeled FLOPs) for "
    "every exit criterion, the oracle, the lowest NLL at each mean depth and the fixed depths (a depthdiag exits "
    "file); monitor: a run's monitor "
    "file (RUN/monitor.h5); curves: a run "
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
@click.option("--by", "grouping", default=None, metavar="GROUPING", help="The grouping --figure groups draws.")
@reports_errors
@interval_options
def plot(
    results: tuple[Path, ...],
    figure_number: str,
    out: Path,
    force: bool,
    grouping: str | None,
    options: IntervalOptions,
) -> None:
    """Draw a figure from RESULTS files (several files are several seeds: the error bars and
    bands are then intervals over seeds; with one file they cover batch noise only).
    `--figure map` draws the update-depth x serving-depth map (seed-level means, or batch
    means for one file); `--figure monitor` draws a run's RUN/monitor.h5; `--figure curves` a
    run directory's metrics.jsonl (`depthdiag plot runs/tiny --figure curves --out curves.png`)."""
    from analysis.figures import (
        check_figure,
        figure4,
        group_benefit_figure,
        monitor_figure,
        save_figure,
        update_depth_map_figure,
    )
    from analysis.monitor import open_monitor
    from analysis.store import open_results

    if (figure_number == "groups") != (grouping is not None):
        raise InputError("--figure groups and --by GROUPING go together")
    check_figure(out, inputs=results, force=force)
    if figure_number == "curves":
        _plot_curves(results, out, force)
        return
    if figure_number in GRID_FIGURES:
        _plot_grid(results, figure_number, out, force)
        return
    if figure_number == DOWNSTREAM_FIGURE:
        _plot_downstream(results, out, force)
        return
    if figure_number == "exits":
        _plot_exits(results, out, force)
        return
    if _exits_file(results[:1]) is not None:
        raise InputError(f"{results[0]}: --figure {figure_number} draws results files; an exits file --figure exits")
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
            elif figure_number == "groups":
                fig = group_benefit_figure(ds, grouping, options=options)
            elif figure_number == "planted":
                fig = _planted_figure(ds, results)
            else:
                fig = figure4(ds, options=options)
    for warning in caught:
        click.echo(f"depthdiag: warning: {warning.message}", err=True)
    for path in save_figure(fig, out, force=force, inputs=results):
        click.echo(f"wrote {path}")


def _planted_figure(ds, results: tuple[Path, ...]):
    from analysis.attribution import labelled_auroc
    from analysis.figures import auroc_figure

    planted = _planted_labels(ds, results[0])
    if planted is None:
        raise InputError(
            f"{results[0]}: --figure planted draws depthdiag attribute files of a run with data.planted_fraction > 0"
        )
    return auroc_figure(labelled_auroc(ds, planted))


def _plot_exits(results: tuple[Path, ...], out: Path, force: bool) -> None:
    """Each `depthdiag exits` file as one row of the figure, labelled by its file name."""
    from analysis.exits import is_exits_file, mean_over_runs, open_exits
    from analysis.figures import exits_figure, save_figure

    for path in results:
        if not is_exits_file(path):
            raise InputError(f"{path}: --figure exits draws depthdiag exits files")
    if len({path.stem for path in results}) < len(results):
        raise InputError("--figure exits labels each file by its name: give files of different names")
    with naming_files(results):
        fig = exits_figure({path.stem: mean_over_runs(open_exits(path)) for path in results})
    for path in save_figure(fig, out, force=force, inputs=results):
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
    for path in figures.save_figure(fig, out, force=force, inputs=results):
        click.echo(f"wrote {path}")


def _plot_curves(runs: tuple[Path, ...], out: Path, force: bool) -> None:
    from analysis.figures import curves_figure, save_figure
    from depthdiag.curves import training_curves

    if len(runs) != 1:
        raise InputError(f"--figure curves draws one run directory, got {len(runs)} paths")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = curves_figure(training_curves(runs[0]))
    for warning in caught:
        click.echo(f"depthdiag: warning: {warning.message}", err=True)
    for path in save_figure(fig, out, force=force, inputs=runs):
        click.echo(f"wrote {path}")


@click.command()
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
        click.echo(json_text(table.to_dict()))
    else:
        click.echo(format_sensitivity_markdown(table))


def _plot_downstream(results: tuple[Path, ...], out: Path, force: bool) -> None:
    from analysis.downstream import open_downstream
    from analysis.figures import figure3_downstream, save_figure

    with naming_files(results):
        fig = figure3_downstream(open_downstream(results))
    for path in save_figure(fig, out, force=force, inputs=results):
        click.echo(f"wrote {path}")


@click.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON (NaN as null).")
@fraction_option
@reports_errors
@interval_options
def machines(results: tuple[Path, ...], as_json: bool, fraction: float, options: IntervalOptions) -> None:
    """One experiment's per-seed results files from two or more machines or kernel sets (e.g.
    `make figure4` and `make figure4 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`), side by side, as
    Markdown: each machine's depth-averaged benefit per snapshot with its interval over seeds
    and its verdicts, one seed's spread across machines beside the spread across seeds, the
    interval pooled over machines, and how many seeds each verdict needs to come out the same
    on any of the machines. Files are grouped by the machine records they carry."""
    from analysis.machines import format_machine_comparison, machine_comparison

    with naming_files(results):
        comparison = machine_comparison(results, fraction=fraction, options=options)
    if as_json:
        click.echo(json_text(comparison.to_dict()))
    else:
        click.echo(format_machine_comparison(comparison))
