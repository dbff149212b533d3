"""Figures of the update diagnostic (the paper's Figure 4, the update-depth x serving-depth
map, and the in-training monitor's figure), drawn from stored intervals, of experiment
grids (Figures 1, 2, 3-top, 5 and 8, from `analysis.grid`'s seed bands), of one run's
training curves (RUN/metrics.jsonl, `analysis.training`), and of downstream evaluation
(Figure 3's bottom row, from `analysis.downstream`'s accuracy bands).

Computing and drawing are separate: `analysis.stats` (and its siblings) produce interval Datasets
(mean, lower, upper, n), and the functions here draw exactly those numbers, never
an interval of their own (so no seaborn estimator or bootstrap is used; seaborn
only provides the style and palette). Figures are built on `matplotlib.figure.Figure`
rather than pyplot, so nothing needs a display and no global figure state is kept.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.cm import ScalarMappable
from matplotlib.collections import QuadMesh
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from analysis.downstream import accuracy_bands
from analysis.grid import (
    TERMINAL_FRACTION,
    band_description,
    closest_switch,
    families,
    figure2_points,
    normalised_recall,
    paired_difference,
    per_schedule,
    require,
    schedules_and_seeds,
    seed_band,
    select_schedules,
    switch_group,
    terminal_window,
)
from analysis.monitor import switch_step
from analysis.stats import (
    FinishingPhase,
    IntervalOptions,
    batch_noise,
    benefit_by_depth,
    depth_averaged_benefit,
    finishing_phase,
    method_name,
    monitor_benefit_map,
    monitor_depth_averaged_benefit,
    plural,
    trailing_mean,
    update_depth_map,
)
from analysis.training import run_switch
from common.atomic import atomic_output
from common.benefit import benefit_description
from common.errors import InputError
from common.lock import claimed_outputs

STYLE = "whitegrid"
PALETTE = "colorblind"
ZERO_LINE = {"color": "0.25", "linewidth": 0.9, "linestyle": "--", "zorder": 1}


def _new_axes(figsize=(5.0, 3.8)) -> Axes:
    with sns.axes_style(STYLE):
        return Figure(figsize=figsize, layout="constrained").add_subplot()


def _select_snapshots(intervals: xr.Dataset, uniform_updates: Sequence[int]) -> list[int]:
    """Positions along `snapshot` of the requested uniform-update counts, in the requested order.

    Counts the results do not contain are skipped with a warning; none at all is an error.
    """
    available = [int(u) for u in intervals["uniform_updates"].values]
    missing = [u for u in uniform_updates if u not in available]
    selected = [available.index(u) for u in uniform_updates if u in available]
    if not selected:
        raise InputError(
            f"no snapshot after {', '.join(map(str, uniform_updates))} uniform updates "
            f"(the results have {', '.join(map(str, available))})"
        )
    if missing:
        warnings.warn(
            f"no snapshot after {', '.join(map(str, missing))} uniform updates; drawing the others",
            stacklevel=3,
        )
    return selected


def _benefit_label(intervals: xr.Dataset) -> str:
    reference, compared = intervals.attrs.get("reference_depth"), intervals.attrs.get("compared_depth")
    if reference is None or compared is None:
        return "benefit (NLL)"
    return f"benefit: NLL after K={reference} update\n− NLL after K={compared} update"


def _interval_note(intervals: xr.Dataset) -> str:
    """Which interval is drawn, over how many units, and (for batches) that it covers batch noise only."""
    level = float(intervals.attrs.get("level", 0.95))
    unit = intervals.attrs.get("unit", "batch")
    n = np.unique(intervals["n"].values)
    count = str(int(n[0])) if n.size == 1 else f"{int(n.min())}-{int(n.max())}"
    method = method_name(intervals.attrs.get("method", "t"))
    note = f"mean and {level:.0%} {method} CI over {count} {plural(unit)}"
    if unit == "batch":
        return note + "\n(batch noise of one seed only, not seed-to-seed variation)"
    return note + " (per-seed means)"


def _snapshot_label(uniform_updates: int) -> str:
    if uniform_updates == 0:
        return "switch (0 uniform updates)"
    return f"{uniform_updates} uniform updates"


def plot_benefit_by_depth(
    intervals: xr.Dataset, *, uniform_updates: Sequence[int] = (0, 16), ax: Axes | None = None
) -> Axes:
    """Benefit against serving depth: a mean line and an interval band per selected snapshot.

    `intervals` is `analysis.stats.benefit_by_depth` output (over snapshot, serving_depth).
    Snapshots are chosen by their uniform-update count. Returns the axes drawn on.
    """
    if ax is None:
        ax = _new_axes()
    colors = sns.color_palette(PALETTE)
    depths = intervals["serving_depth"].values
    for slot, index in enumerate(_select_snapshots(intervals, uniform_updates)):
        row = intervals.isel(snapshot=index)
        color = colors[slot % len(colors)]
        label = _snapshot_label(int(row["uniform_updates"]))
        ax.fill_between(depths, row["lower"].values, row["upper"].values, color=color, alpha=0.25, linewidth=0)
        ax.plot(depths, row["mean"].values, color=color, marker="o", markersize=3.5, label=label)
    ax.axhline(0.0, **ZERO_LINE)
    ax.set_xlabel("serving depth")
    ax.set_ylabel(_benefit_label(intervals))
    ax.set_title(_interval_note(intervals), fontsize="small")
    ax.legend(frameon=False, fontsize="small")
    return ax


def _mark_finishing_phase(ax: Axes, phase: FinishingPhase, counts: list[int], mean: np.ndarray) -> None:
    """The finishing-phase length on the depth-averaged panel, whose x axis is the snapshot position."""
    below = f"mean < {phase.fraction:.0%} of switch"
    if phase.decay_updates in counts:
        ax.axvline(
            counts.index(phase.decay_updates),
            color="0.4",
            linestyle=":",
            linewidth=1.2,
            label=f"{below} from {phase.decay_updates} updates on",
        )
    else:
        ax.plot([], [], " ", label=f"{below}: none within {phase.max_uniform_updates}")
    if phase.first_zero_overlap in counts:
        position = counts.index(phase.first_zero_overlap)
        ax.plot(
            position,
            mean[position],
            "o",
            markersize=13,
            markerfacecolor="none",
            color="0.2",
            label=f"first CI containing 0: {phase.first_zero_overlap} updates",
        )
    else:
        ax.plot([], [], " ", label=f"no CI contains 0 within {phase.max_uniform_updates}")


def plot_depth_averaged_benefit(
    intervals: xr.Dataset,
    *,
    uniform_updates: Sequence[int] | None = None,
    noise: xr.Dataset | None = None,
    phase: FinishingPhase | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Depth-averaged benefit per snapshot, as points with interval error bars.

    `intervals` is `analysis.stats.depth_averaged_benefit` output (over snapshot);
    by default every snapshot is drawn, ordered by uniform updates. With `noise`
    (`analysis.stats.batch_noise` of several seeds) a thick inner bar shows the
    within-seed batch interval's mean half-width, so the reader sees batch noise
    next to seed noise. With `phase` (`analysis.stats.finishing_phase`) the decay
    point and the first interval containing zero are marked. Returns the axes drawn on.
    """
    if ax is None:
        ax = _new_axes(figsize=(4.0, 3.8))
    if uniform_updates is None:
        uniform_updates = sorted(int(u) for u in intervals["uniform_updates"].values)
    selected = _select_snapshots(intervals, uniform_updates)
    rows = intervals.isel(snapshot=selected)
    mean, lower, upper = (rows[name].values for name in ("mean", "lower", "upper"))
    positions = np.arange(len(selected))
    color = sns.color_palette(PALETTE)[0]
    seeded = intervals.attrs.get("unit") != "batch"
    ax.errorbar(
        positions,
        mean,
        yerr=np.stack([mean - lower, upper - mean]),
        fmt="o",
        capsize=5,
        color=color,
        elinewidth=1.5,
        label="CI over seeds" if seeded else "CI over batches",
    )
    if noise is not None and seeded:
        half_width = noise.sel(snapshot=rows["snapshot"].values)["batch_half_width"].values
        ax.errorbar(
            positions,
            mean,
            yerr=half_width,
            fmt="none",
            elinewidth=5,
            alpha=0.45,
            color=color,
            capsize=0,
            label="batch noise only (mean within-seed CI)",
        )
    counts = [int(u) for u in rows["uniform_updates"].values]
    if phase is not None:
        _mark_finishing_phase(ax, phase, counts, mean)
    ax.axhline(0.0, **ZERO_LINE)
    ax.set_xticks(positions, [str(u) for u in counts])
    ax.set_xlim(-0.5, len(selected) - 0.5)
    ax.set_xlabel("uniform updates since the switch")
    ax.set_ylabel("benefit averaged over serving depths")
    ax.set_title(_interval_note(intervals), fontsize="small")
    ax.legend(frameon=False, fontsize="x-small")
    return ax


def figure4(ds: xr.Dataset, *, options: IntervalOptions = IntervalOptions()) -> Figure:
    """The paper's Figure 4 from a results Dataset (one file or several seeds).

    Left: benefit by serving depth at 0 and 16 uniform updates. Right: depth-averaged
    benefit at every snapshot (the dense grid 0, 4, ..., 256 when diagnosed), with
    the batch noise and the finishing-phase length marked. Intervals are over seeds
    when `ds` has a `seed` dimension, else over batches (and say so).
    """
    by_depth = benefit_by_depth(ds, options=options)
    averaged = depth_averaged_benefit(ds, options=options)
    noise = batch_noise(ds, options=options)
    phase = finishing_phase(ds, options=options) if 0 in ds["uniform_updates"].values else None
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(11.0, 4.4), layout="constrained")
        left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 3]})
    plot_benefit_by_depth(by_depth, ax=left)
    plot_depth_averaged_benefit(averaged, noise=noise, phase=phase, ax=right)
    if "compared_depth" in by_depth.attrs:
        reference, compared = by_depth.attrs["reference_depth"], by_depth.attrs["compared_depth"]
        fig.suptitle(f"benefit = {benefit_description(reference, compared)}", fontsize="medium")
    return fig


# --- the update-depth x serving-depth map -------------------------------------------------------


def _map_note(cells: xr.Dataset, sep: str = "\n") -> str:
    """What a map cell is, over how many units, and what the dots mark."""
    level = float(cells.attrs.get("level", 0.95))
    unit = cells.attrs.get("unit", "batch")
    method = method_name(cells.attrs.get("method", "t"))
    n = np.unique(cells["n"].values)
    count = str(int(n[0])) if n.size == 1 else f"{int(n.min())}-{int(n.max())}"
    what = f"mean over {count} {plural(unit)}" + (" (per-seed batch means)" if unit != "batch" else "")
    note = f"cell: {what}{sep}dot: {level:.0%} {method} CI over {plural(unit)} excludes 0"
    if unit == "batch":
        return note + "\n(batch noise of one seed only, not seed-to-seed variation)"
    return note


def _symmetric_limit(values: np.ndarray) -> float:
    finite = np.abs(values[np.isfinite(values)])
    limit = float(finite.max()) if finite.size else 1.0
    return limit if limit > 0 else 1.0


def plot_update_depth_map(
    cells: xr.Dataset,
    *,
    limit: float | None = None,
    colorbar: bool = True,
    note: bool = True,
    ax: Axes | None = None,
) -> Axes:
    """One snapshot of `analysis.stats.update_depth_map` (mean/lower/upper/n over update_depth,
    serving_depth) as a heat map: serving depth on x, update depth K on y (one row per depth,
    evenly spaced), each cell the mean benefit of the depth-K update over the reference update
    at that serving depth, on a diverging colour scale centred at 0 (+-`limit`, by default the
    largest |mean|). A dot marks the cells whose interval excludes 0. The title names the
    snapshot and (unless `note` is False: a figure that says it once) what a cell and a dot
    are, over how many seeds or batches. Returns the axes."""
    if ax is None:
        ax = _new_axes(figsize=(5.5, 3.2))
    cells = cells.transpose("update_depth", "serving_depth")
    means = cells["mean"].values
    limit = _symmetric_limit(means) if limit is None else limit
    update_depths = [int(d) for d in cells["update_depth"].values]
    serving = cells["serving_depth"].values
    rows = np.arange(len(update_depths))
    mesh = ax.pcolormesh(
        _step_edges(serving),
        np.arange(len(update_depths) + 1) - 0.5,
        means,
        cmap=sns.color_palette("vlag", as_cmap=True),
        vmin=-limit,
        vmax=limit,
        shading="flat",
    )
    excludes = (cells["lower"].values > 0) | (cells["upper"].values < 0)
    row_index, column_index = np.nonzero(excludes)
    ax.plot(serving[column_index], rows[row_index], linestyle="none", marker=".", markersize=4, color="0.1")
    if colorbar:
        ax.figure.colorbar(mesh, ax=ax, label="benefit (NLL)")
    reference = cells.attrs.get("reference_depth")
    ax.set_yticks(rows, [str(d) for d in update_depths])
    ax.set_xlabel("serving depth")
    ax.set_ylabel(f"update depth K (reference K={reference})" if reference is not None else "update depth K")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    title = [_snapshot_label(int(cells["uniform_updates"]))] if "uniform_updates" in cells.coords else []
    ax.set_title("\n".join(title + ([_map_note(cells)] if note else [])), fontsize="small")
    ax.grid(False)
    return ax


def update_depth_map_figure(
    ds: xr.Dataset, *, uniform_updates: Sequence[int] = (0, 16), options: IntervalOptions = IntervalOptions()
) -> Figure:
    """Which update depth helps which serving depth, from a results Dataset diagnosed with
    several update depths (e.g. --update-depths 4,1,2,8,16; the first is the reference): one
    heat map per selected snapshot (default the switch and after 16 uniform updates), side by
    side on one colour scale centred at 0. Cells are seed-level means when `ds` has a `seed`
    dimension, batch means otherwise (and the titles say which, with n)."""
    cells = update_depth_map(ds, options=options)
    selected = _select_snapshots(cells, uniform_updates)
    limit = _symmetric_limit(cells["mean"].isel(snapshot=selected).values)
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(5.2 * len(selected) + 1.0, 3.8), layout="constrained")
        axes = np.atleast_1d(fig.subplots(1, len(selected), sharey=True))
    for ax, index in zip(axes, selected):
        plot_update_depth_map(cells.isel(snapshot=index), limit=limit, colorbar=False, note=False, ax=ax)
    for ax in axes[1:]:
        ax.set_ylabel("")
    mesh = next(c for c in axes[-1].collections if isinstance(c, QuadMesh))
    fig.colorbar(mesh, ax=list(axes), label="benefit (NLL)")
    reference = cells.attrs["reference_depth"]
    fig.suptitle(
        f"benefit of the depth-K update over the K={reference} update: NLL after K={reference} − NLL after K "
        f"(positive: K helps more)\n{_map_note(cells, sep='; ')}",
        fontsize="medium",
    )
    return fig


def figure_paths(out: str | os.PathLike) -> list[Path]:
    """The files `save_figure` writes for `out`: `out` and, unless it is a PDF, a PDF beside it.
    An unknown image format is refused here, before anything is written: the temporary
    file's name cannot tell matplotlib the format."""
    out = Path(out)
    if out.suffix.lstrip(".").lower() not in FigureCanvasBase.get_supported_filetypes():
        raise InputError(f"{out}: unknown image format {out.suffix or '(no extension)'}; use e.g. .png or .pdf")
    return [out] if out.suffix.lower() == ".pdf" else [out, out.with_suffix(".pdf")]


def save_figure(fig: Figure, out: str | os.PathLike, *, dpi: int = 200, force: bool = True) -> list[Path]:
    """Write `fig` to `out` and a PDF beside it, each atomically, holding both files' locks;
    return the paths written. Without `force` an existing file is refused (InputError)."""
    paths = figure_paths(out)
    with claimed_outputs(paths, force=force):
        for path in paths:
            with atomic_output(path) as tmp:
                # No creation date in the PDF, so rerunning on the same results gives the same bytes.
                metadata = {"CreationDate": None} if path.suffix.lower() == ".pdf" else None
                fig.savefig(tmp, format=path.suffix.lstrip(".").lower(), dpi=dpi, metadata=metadata)
    return paths


# --- the in-training monitor -------------------------------------------------------------------


def _step_edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges around (possibly irregular) steps: midpoints, the ends half a gap out."""
    steps = np.asarray(steps, dtype=np.float64)
    if steps.size == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    middle = (steps[1:] + steps[:-1]) / 2
    return np.concatenate([[steps[0] - (middle[0] - steps[0])], middle, [steps[-1] + (steps[-1] - middle[-1])]])


def _mark_switch(ax: Axes, switch_step: int | None, *, label: bool = True) -> None:
    if switch_step is not None:
        ax.axvline(
            switch_step,
            color="0.15",
            linestyle=":",
            linewidth=1.3,
            label=f"schedule switch (step {switch_step})" if label else None,
        )


def plot_monitor_heatmap(benefit: xr.DataArray, *, switch_step: int | None = None, ax: Axes | None = None) -> Axes:
    """The batch-mean benefit (`analysis.stats.monitor_benefit_map`) as a heat map over training
    step (x) and serving depth (y), on a colour scale centred at zero, the switch marked."""
    if ax is None:
        ax = _new_axes(figsize=(5.5, 3.8))
    values = benefit.transpose("serving_depth", "step").values
    limit = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 1.0
    limit = limit if limit > 0 else 1.0
    mesh = ax.pcolormesh(
        _step_edges(benefit["step"].values),
        _step_edges(benefit["serving_depth"].values),
        values,
        cmap=sns.color_palette("vlag", as_cmap=True),
        vmin=-limit,
        vmax=limit,
        shading="flat",
    )
    ax.figure.colorbar(mesh, ax=ax, label="batch-mean benefit (NLL)")
    _mark_switch(ax, switch_step)
    ax.set_xlabel("training step (updates before the check)")
    ax.set_ylabel("serving depth")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("benefit by serving depth (mean over batches)", fontsize="small")
    if switch_step is not None:
        ax.legend(frameon=False, fontsize="x-small", loc="upper left")
    ax.grid(False)
    return ax


def plot_monitor_trend(intervals: xr.Dataset, *, switch_step: int | None = None, ax: Axes | None = None) -> Axes:
    """The depth-averaged benefit against training step with its interval over the check's
    batches (`analysis.stats.monitor_depth_averaged_benefit`), the switch marked."""
    if ax is None:
        ax = _new_axes(figsize=(5.0, 3.8))
    steps = intervals["step"].values
    color = sns.color_palette(PALETTE)[0]
    level = float(intervals.attrs.get("level", 0.95))
    method = method_name(intervals.attrs.get("method", "t"))
    n = np.unique(intervals["n"].values)
    count = str(int(n[0])) if n.size == 1 else f"{int(n.min())}-{int(n.max())}"
    ax.fill_between(
        steps,
        intervals["lower"].values,
        intervals["upper"].values,
        color=color,
        alpha=0.25,
        linewidth=0,
        label=f"{level:.0%} CI over {count} batches",
    )
    ax.plot(steps, intervals["mean"].values, color=color, marker="o", markersize=3.5, label="mean")
    ax.axhline(0.0, **ZERO_LINE)
    _mark_switch(ax, switch_step)
    ax.set_xlabel("training step (updates before the check)")
    ax.set_ylabel("benefit averaged over serving depths")
    ax.set_title(
        f"mean and {level:.0%} {method} CI over {count} batches of one run\n"
        "(batch noise only, not run-to-run variation)",
        fontsize="small",
    )
    ax.legend(frameon=False, fontsize="x-small")
    return ax


def monitor_figure(ds: xr.Dataset, *, options: IntervalOptions = IntervalOptions()) -> Figure:
    """The in-training monitor of one run (RUN/monitor.h5): left the batch-mean benefit over
    (step, serving depth), right the depth-averaged benefit against step with its interval
    over batches; the schedule's switch (the file's `switch_step`) marked on both."""
    switch = switch_step(ds)
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(12.0, 4.4), layout="constrained")
        left, right = fig.subplots(1, 2)
    plot_monitor_heatmap(monitor_benefit_map(ds), switch_step=switch, ax=left)
    plot_monitor_trend(monitor_depth_averaged_benefit(ds, options=options), switch_step=switch, ax=right)
    depths = [int(d) for d in ds["update_depth"].values]
    schedule = ds.attrs.get("schedule", "")
    fig.suptitle(
        f"in-training monitor{f' ({schedule})' if schedule else ''}\nbenefit = "
        f"{benefit_description(depths[0], depths[-1])}",
        fontsize="medium",
    )
    return fig


# --- experiment grids (the paper's Figures 1, 2, 3-top, 5 and 8) ------------------------------

SWITCH_LINE = {"linestyle": ":", "linewidth": 1.2}


def _schedule_colors(labels: Sequence[str]) -> dict[str, tuple]:
    """One palette colour per schedule label, in order."""
    colors = sns.color_palette(PALETTE, max(len(labels), 1))
    return {label: colors[index % len(colors)] for index, label in enumerate(labels)}


def plot_schedule_bands(
    bands: xr.Dataset,
    *,
    x_dim: str,
    schedule_dim: str = "schedule",
    colors: dict[str, tuple] | None = None,
    marker: str | None = None,
    ax: Axes | None = None,
) -> Axes:
    """One mean line and its band per schedule label: `bands` is `analysis.grid.seed_band`
    output over (`schedule_dim`, `x_dim`). Points whose mean is NaN (no value there) are
    left out; a band is drawn only where it exists (two or more seeds). Returns the axes."""
    if ax is None:
        ax = _new_axes()
    labels = [str(label) for label in bands[schedule_dim].values]
    colors = colors or _schedule_colors(labels)
    for label in labels:
        row = bands.sel({schedule_dim: label}).transpose(x_dim)
        x, mean = row[x_dim].values, row["mean"].values
        shown = np.isfinite(mean)
        lower, upper = row["lower"].values[shown], row["upper"].values[shown]
        if np.isfinite(lower).any():
            ax.fill_between(x[shown], lower, upper, color=colors[label], alpha=0.2, linewidth=0)
        ax.plot(x[shown], mean[shown], color=colors[label], marker=marker, markersize=3, label=label)
    return ax


def _log2_depth_axis(ax: Axes, depths) -> None:
    depths = [int(d) for d in depths]
    ax.set_xscale("log", base=2)
    ticks = [d for d in depths if d & (d - 1) == 0]
    ax.set_xticks(ticks, [str(d) for d in ticks])
    ax.set_xlabel("serving depth (iterations, log scale)")


def _fit_y(ax: Axes, bands: xr.Dataset, x_dim: str, low: float, high: float) -> None:
    """y limits that hold the means and bands drawn between x = low and high (a zoom)."""
    inside = bands.sel({x_dim: (bands[x_dim] >= low) & (bands[x_dim] <= high)})
    values = np.concatenate([inside[name].values.ravel() for name in ("mean", "lower", "upper")])
    values = values[np.isfinite(values)]
    if values.size:
        pad = max(float(values.max() - values.min()) * 0.08, 1e-9)
        ax.set_ylim(float(values.min()) - pad, float(values.max()) + pad)
    ax.set_xlim(low, high)


def plot_recall_by_depth(
    bands: xr.Dataset, *, ceiling: float | None = None, title: str = "", ax: Axes | None = None
) -> Axes:
    """Recalled bits per person against serving depth (log2 axis), one mean line and band per
    schedule (`seed_band` of `recall_bits`), the task ceiling as a dashed line when given."""
    if ax is None:
        ax = _new_axes()
    plot_schedule_bands(bands, x_dim="serving_depth", marker="o", ax=ax)
    if ceiling is not None:
        ax.axhline(ceiling, color="0.3", linestyle="--", linewidth=1.0, label=f"task ceiling ({ceiling:g} bits)")
    _log2_depth_axis(ax, bands["serving_depth"].values)
    ax.set_ylabel("recalled bits per person")
    ax.set_title(title, fontsize="small")
    ax.legend(frameon=False, fontsize="x-small")
    return ax


def _budget_label(value) -> str:
    if isinstance(value, str):
        return value
    return f"{float(value):.0%} of the FLOP budget"


def figure1(
    ds: xr.Dataset,
    *,
    budget_dim: str = "budget",
    schedules: Sequence[str] | None = None,
    schedule_dim: str = "schedule",
    seed_dim: str = "seed",
) -> Figure:
    """The paper's Figure 1 from a grid Dataset over (schedule, seed, budget): one panel per
    budget value, recalled bits per person against serving depth for each schedule, the mean
    and 95% Student-t CI over seeds, the task ceiling (`recall_ceiling_bits`) dashed."""
    require(ds, "figure 1", variables=["recall_bits"], dims=[budget_dim, schedule_dim])
    labels = select_schedules(ds, schedules, schedule_dim)
    budgets = ds[budget_dim].values.tolist()
    ceiling = ds.attrs.get("recall_ceiling_bits")
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(4.6 * len(budgets) + 0.4, 4.0), layout="constrained")
        axes = np.atleast_1d(fig.subplots(1, len(budgets), sharey=True))
    notes = []
    for ax, budget in zip(axes, budgets):
        cells = schedules_and_seeds(
            ds.sel({budget_dim: [budget]}), "figure 1", schedule_dim=schedule_dim, seed_dim=seed_dim
        )
        bands = seed_band(cells["recall_bits"].sel({schedule_dim: labels}), band="t95", seed_dim=seed_dim)
        notes.append(band_description(bands))
        plot_recall_by_depth(
            bands, ceiling=None if ceiling is None else float(ceiling), title=_budget_label(budget), ax=ax
        )
    for ax in axes[1:]:
        ax.set_ylabel("")
    fig.suptitle(f"recall across serving depths; {'; '.join(dict.fromkeys(notes))}", fontsize="medium")
    return fig


def plot_normalised_recall(
    curves: xr.DataArray,
    *,
    training_depths: dict[str, int] | None = None,
    schedule_dim: str = "schedule",
    ax: Axes | None = None,
) -> Axes:
    """Each schedule's recall curve divided by its own peak (`analysis.grid.normalised_recall`)
    against serving depth (log2 axis), a dotted vertical line at each model's training depth."""
    if ax is None:
        ax = _new_axes()
    labels = [str(label) for label in curves[schedule_dim].values]
    colors = _schedule_colors(labels)
    depths = curves["serving_depth"].values
    for label in labels:
        ax.plot(
            depths, curves.sel({schedule_dim: label}).values, color=colors[label], marker="o", markersize=3, label=label
        )
        depth = (training_depths or {}).get(label, 0)
        if depth > 0:
            ax.axvline(depth, color=colors[label], **SWITCH_LINE)
    _log2_depth_axis(ax, depths)
    ax.set_ylabel("recall / its peak over serving depths")
    ax.legend(frameon=False, fontsize="x-small")
    return ax


def figure5(ds: xr.Dataset, *, schedules: Sequence[str] | None = None, schedule_dim: str = "schedule") -> Figure:
    """The paper's Figure 5: recall across serving depths for each schedule (fixed K = 1, 2,
    4, 8), each normalised by the peak of its own seed-mean curve, the training depth
    (`initial_depth`) dotted."""
    require(ds, "figure 5", variables=["recall_bits"], dims=[schedule_dim])
    cells = schedules_and_seeds(ds, "figure 5", schedule_dim=schedule_dim)
    labels = select_schedules(cells, schedules, schedule_dim)
    cells = cells.sel({schedule_dim: labels})
    curves = normalised_recall(cells, schedule_dim=schedule_dim)
    n = cells.sizes.get("seed", 1)
    ax = _new_axes(figsize=(5.6, 4.0))
    plot_normalised_recall(curves, training_depths=per_schedule(cells["initial_depth"], schedule_dim), ax=ax)
    ax.set_title(
        f"seed-mean recall over {n} {plural('seed', n)}, each divided by its own peak\n"
        "(dotted: the model's training depth)",
        fontsize="small",
    )
    return ax.figure


def plot_nll_by_depth(
    bands: xr.Dataset, *, zoom: tuple[int, int] | None = None, log_depth: bool = True, ax: Axes | None = None
) -> Axes:
    """NLL against serving depth, one mean line and band per schedule (`seed_band` of `nll`);
    with `zoom` = (low, high) the x axis is limited to those depths and y fitted to them."""
    if ax is None:
        ax = _new_axes()
    plot_schedule_bands(bands, x_dim="serving_depth", marker="o", ax=ax)
    if zoom is None:
        if log_depth:
            _log2_depth_axis(ax, bands["serving_depth"].values)
    else:
        _fit_y(ax, bands, "serving_depth", *zoom)
        ax.set_xlabel("serving depth (iterations)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("NLL (nats)")
    ax.legend(frameon=False, fontsize="x-small")
    return ax


def figure8(
    ds: xr.Dataset,
    *,
    schedules: Sequence[str] | None = None,
    zoom: tuple[int, int] = (4, 16),
    schedule_dim: str = "schedule",
) -> Figure:
    """The paper's Figure 8: NLL against serving depth, left the full range, right a zoom on
    serving depths 4..16; the mean line and the range across seeds."""
    require(ds, "figure 8", variables=["nll"], dims=[schedule_dim])
    cells = schedules_and_seeds(ds, "figure 8", schedule_dim=schedule_dim)
    labels = select_schedules(cells, schedules, schedule_dim)
    bands = seed_band(cells["nll"].sel({schedule_dim: labels}), band="range")
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(11.0, 4.2), layout="constrained")
        left, right = fig.subplots(1, 2)
    plot_nll_by_depth(bands, ax=left)
    plot_nll_by_depth(bands, zoom=zoom, ax=right)
    left.set_title("all serving depths", fontsize="small")
    right.set_title(f"serving depths {zoom[0]}-{zoom[1]}", fontsize="small")
    fig.suptitle(f"NLL across serving depths; {band_description(bands)}", fontsize="medium")
    return fig


def plot_loss_curves(
    bands: xr.Dataset,
    *,
    switch_steps: dict[str, list[int]] | None = None,
    window: tuple[int, int] | None = None,
    schedule_dim: str = "schedule",
    ax: Axes | None = None,
) -> Axes:
    """Training loss against step, one mean line and band per schedule (`seed_band` of `loss`
    over log_step), each fixed-first schedule's switch dotted in its colour; with `window` =
    (first, last step) the axes zoom on it (the terminal window)."""
    if ax is None:
        ax = _new_axes()
    labels = [str(label) for label in bands[schedule_dim].values]
    colors = _schedule_colors(labels)
    plot_schedule_bands(bands, x_dim="log_step", schedule_dim=schedule_dim, colors=colors, ax=ax)
    for label in labels:
        for step in (switch_steps or {}).get(label, []):
            ax.axvline(step, color=colors[label], **SWITCH_LINE)
    if window is not None:
        _fit_y(ax, bands, "log_step", *window)
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (nats)")
    ax.legend(frameon=False, fontsize="x-small")
    return ax


def figure3_loss(
    ds: xr.Dataset,
    *,
    schedules: Sequence[str] | None = None,
    terminal_fraction: float = TERMINAL_FRACTION,
    schedule_dim: str = "schedule",
) -> Figure:
    """The paper's Figure 3 (top): the training loss of each schedule, left the whole run,
    right the terminal window (the final W = round(fraction * updates) updates); the mean and
    the range across seeds, each fixed-first schedule's switch (the loss spike) dotted."""
    require(ds, "figure 3", variables=["loss", "switch_step", "updates"], dims=[schedule_dim])
    cells = schedules_and_seeds(ds, "figure 3", schedule_dim=schedule_dim)
    labels = select_schedules(cells, schedules, schedule_dim)
    cells = cells.sel({schedule_dim: labels})
    bands = seed_band(cells["loss"], band="range")
    switches = {
        label: sorted({int(s) for s in np.ravel(cells["switch_step"].sel({schedule_dim: label}).values) if s >= 0})
        for label in labels
    }
    updates = int(cells["updates"].max())
    window = (updates - int(terminal_window(updates, terminal_fraction)), updates - 1)
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(11.0, 4.2), layout="constrained")
        left, right = fig.subplots(1, 2)
    plot_loss_curves(bands, switch_steps=switches, schedule_dim=schedule_dim, ax=left)
    left.axvspan(*window, color="0.85", zorder=0)
    plot_loss_curves(bands, switch_steps=switches, window=window, schedule_dim=schedule_dim, ax=right)
    left.set_title("whole run (dotted: each schedule's switch; shaded: terminal window)", fontsize="small")
    right.set_title(
        f"terminal window: steps {window[0]}-{window[1]} (the final {window[1] - window[0] + 1} updates)",
        fontsize="small",
    )
    fig.suptitle(f"training loss; {band_description(bands)}", fontsize="medium")
    return fig


def _switch_marker(fraction: float) -> tuple[str, bool, str]:
    """(marker, filled, legend words) of a Figure 2 point by its switch fraction."""
    group = switch_group(fraction)
    if group is None:
        return "s", True, "no switch"
    return "o", group == "67%", f"switch {group}"


def plot_flops_vs_nll(
    points: xr.Dataset,
    *,
    labels: Sequence[str],
    depth_colors: dict[int, tuple],
    schedule_dim: str = "schedule",
    ax: Axes | None = None,
) -> Axes:
    """Figure 2's left panel: one marker per schedule in `labels` (`analysis.grid.figure2_points`),
    mean serving NLL against modeled FLOPs relative to the reference, error bars the range
    across seeds; filled for a 67% switch, open for 80% (and any other, its value in the
    legend), colour by initial depth; the reference as a black star."""
    if ax is None:
        ax = _new_axes()
    reference = points.attrs["reference"]
    for label in [*labels, reference]:
        point = points.sel({schedule_dim: label})
        x, y = float(point["flops_mean"]), float(point["nll_mean"])
        xerr = [[x - float(point["flops_lower"])], [float(point["flops_upper"]) - x]]
        yerr = [[y - float(point["nll_lower"])], [float(point["nll_upper"]) - y]]
        xerr, yerr = np.nan_to_num(xerr), np.nan_to_num(yerr)
        if label == reference:
            marker, filled, color, words = "*", True, "0.1", "reference"
        else:
            marker, filled, words = _switch_marker(float(point["switch_fraction"]))
            color = depth_colors[int(point["initial_depth"])]
            words = f"K0={int(point['initial_depth'])}, {words}"
        ax.errorbar(
            x,
            y,
            xerr=xerr,
            yerr=yerr,
            fmt=marker,
            markersize=10 if marker == "*" else 7,
            color=color,
            markerfacecolor=color if filled else "none",
            capsize=0,
            label=f"{label} ({words})",
        )
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(f"modeled FLOPs relative to {reference}")
    ax.set_ylabel(f"mean NLL over serving depths {points.attrs['serving']} (nats)")
    ax.legend(frameon=False, fontsize="x-small")
    return ax


def plot_nll_difference(bands: xr.Dataset, *, reference: str, ax: Axes | None = None) -> Axes:
    """Figure 2's right panel: per-serving-depth NLL minus the reference's, paired by seed
    (`seed_band` of `analysis.grid.paired_difference`), one line and band per schedule."""
    if ax is None:
        ax = _new_axes()
    if bands.sizes.get("schedule", 0):
        plot_schedule_bands(bands, x_dim="serving_depth", marker="o", ax=ax)
        ax.legend(frameon=False, fontsize="x-small")
    else:
        ax.text(0.5, 0.5, "no fixed-first schedule in this row", transform=ax.transAxes, ha="center")
    ax.axhline(0.0, **ZERO_LINE)
    ax.set_xlabel("serving depth (iterations)")
    ax.set_ylabel(f"NLL − {reference}'s NLL (nats)")
    ax.set_title(f"positive = worse than {reference}", fontsize="small")
    return ax


def figure2(
    ds: xr.Dataset,
    *,
    reference: str = "uniform",
    serving: Sequence[int] = range(1, 17),
    schedule_dim: str = "schedule",
    seed_dim: str = "seed",
) -> Figure:
    """The paper's Figure 2: one row per finishing family (the `finish` spec's kind: uniform,
    pln; a schedule without a finishing phase goes to its own spec's family). Left: mean
    serving NLL against modeled FLOPs relative to `reference`, one marker per schedule (seed
    mean, bars the range across seeds). Right: NLL minus the reference's at each serving depth
    (paired by seed; mean and range) for the row's schedules whose switch is closest to 67%."""
    require(ds, "figure 2", variables=["nll", "modeled_flops", "finish"], dims=[schedule_dim])
    points = figure2_points(ds, reference=reference, serving=serving, schedule_dim=schedule_dim, seed_dim=seed_dim)
    cells = schedules_and_seeds(ds, "figure 2", schedule_dim=schedule_dim, seed_dim=seed_dim)
    difference = seed_band(
        paired_difference(cells["nll"], reference, schedule_dim=schedule_dim), band="range", seed_dim=seed_dim
    )
    rows = families(points)
    depths = sorted({int(d) for d in points["initial_depth"].values})
    palette = sns.color_palette(PALETTE, max(len(depths), 1))
    depth_colors = {depth: palette[index % len(palette)] for index, depth in enumerate(depths)}
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(11.0, 3.8 * len(rows)), layout="constrained")
        axes = np.atleast_2d(fig.subplots(len(rows), 2, squeeze=False))
    for (left, right), family in zip(axes, rows):
        labels = [
            str(label)
            for label, kind in zip(points[schedule_dim].values, points["family"].values)
            if kind == family and str(label) != reference
        ]
        plot_flops_vs_nll(points, labels=labels, depth_colors=depth_colors, schedule_dim=schedule_dim, ax=left)
        left.set_title(f"{family} finishing", fontsize="small")
        closest = closest_switch(points, labels, schedule_dim=schedule_dim)
        plot_nll_difference(difference.sel({schedule_dim: closest}), reference=reference, ax=right)
        if closest:
            fractions = sorted({switch_group(float(points["switch_fraction"].sel({schedule_dim: c}))) for c in closest})
            right.set_title(
                f"{family} finishing, switch {', '.join(fractions)}: positive = worse than {reference}",
                fontsize="small",
            )
    n = int(points["n"].max())
    fig.suptitle(
        f"mean and range across {n} {plural('seed', n)}; filled: 67% switch, open: 80% (other fractions named); "
        "colour: initial depth K0",
        fontsize="medium",
    )
    return fig


# --- one run's training curves (RUN/metrics.jsonl) ---------------------------------------------


def smoothing_window(lines: int) -> int:
    """Metrics lines the smoothed loss averages: about 5% of the run's lines, at least 1."""
    return max(1, round(lines / 20))


def plot_training_loss(
    ds: xr.Dataset, *, window: int | None = None, switch_step: int | None = None, ax: Axes | None = None
) -> Axes:
    """Training loss (`analysis.training.read_metrics`) against updates: each metrics line's
    interval mean, thin, and its trailing mean over `window` lines (default
    `smoothing_window`), thick; the schedule's switch dotted."""
    if ax is None:
        ax = _new_axes(figsize=(5.5, 3.8))
    window = smoothing_window(ds.sizes["updates"]) if window is None else window
    color = sns.color_palette(PALETTE)[0]
    x, loss = ds["updates"].values, ds["loss"].values
    ax.plot(x, loss, color=color, alpha=0.35, linewidth=0.8, label="per metrics line (mean since the previous)")
    smoothed = f"trailing mean over {window} line{'s' * (window != 1)}"
    ax.plot(x, trailing_mean(loss, window), color=color, linewidth=1.8, label=smoothed)
    _mark_switch(ax, switch_step)
    ax.set_xlabel("updates")
    ax.set_ylabel("training loss (nats)")
    ax.set_title("training loss", fontsize="small")
    ax.legend(frameon=False, fontsize="x-small")
    return ax


def plot_validation_nll(ds: xr.Dataset, *, switch_step: int | None = None, ax: Axes | None = None) -> Axes:
    """Validation NLL (`val_nll` of `analysis.training.read_metrics`) against updates, a line
    per serving depth coloured from shallow to deep; the schedule's switch dotted."""
    if ax is None:
        ax = _new_axes(figsize=(5.5, 3.8))
    val = ds["val_nll"].dropna("updates", how="all")
    depths = [int(d) for d in val["serving_depth"].values]
    colors = sns.color_palette("viridis", len(depths))
    for color, depth in zip(colors, depths):
        ax.plot(val["updates"].values, val.sel(serving_depth=depth).values, color=color, marker="o", markersize=2.5)
    mappable = ScalarMappable(norm=Normalize(min(depths), max(depths)), cmap=sns.color_palette("viridis", as_cmap=True))
    ax.figure.colorbar(mappable, ax=ax, label="serving depth")
    _mark_switch(ax, switch_step)
    ax.set_xlabel("updates")
    ax.set_ylabel("validation NLL (nats)")
    ax.set_title("held-out NLL at each serving depth", fontsize="small")
    if switch_step is not None:
        ax.legend(frameon=False, fontsize="x-small")
    return ax


def curves_figure(ds: xr.Dataset, *, window: int | None = None) -> Figure:
    """One run's training curves (`analysis.training.read_metrics`): the training loss, raw and
    smoothed, and, when the run validated (train.eval_every), the validation NLL per serving
    depth beside it; the schedule's switch marked on both."""
    switch = run_switch(ds)
    validated = "val_nll" in ds
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(11.0 if validated else 5.5, 4.2), layout="constrained")
        axes = fig.subplots(1, 2 if validated else 1, squeeze=False)[0]
    plot_training_loss(ds, window=window, switch_step=switch, ax=axes[0])
    if validated:
        plot_validation_nll(ds, switch_step=switch, ax=axes[1])
    fig.suptitle(f"training curves: {ds.attrs.get('source', '')}", fontsize="medium")
    return fig


# --- downstream evaluation (depthdiag lm-eval) --------------------------------------------------


def plot_downstream_accuracy(
    bands: xr.Dataset, *, chance: float | None = None, title: str = "", ax: Axes | None = None
) -> Axes:
    """One task's accuracy against serving depth: `bands` is `analysis.downstream.accuracy_bands`
    of one task (mean, lower, upper over serving_depth); the band where it exists, the chance
    level dashed when given (and finite)."""
    if ax is None:
        ax = _new_axes()
    depths = bands["serving_depth"].values
    mean, lower, upper = (bands[name].values for name in ("mean", "lower", "upper"))
    color = sns.color_palette(PALETTE, 1)[0]
    if np.isfinite(lower).any():
        ax.fill_between(depths, lower, upper, color=color, alpha=0.2, linewidth=0)
    ax.plot(depths, mean, color=color, marker="o", markersize=3, label=bands.attrs.get("metric", ""))
    if chance is not None and np.isfinite(chance):
        ax.axhline(chance, color="0.3", linestyle="--", linewidth=1.0, label=f"chance ({chance:.3f})")
    ax.set_xlabel("serving depth (iterations)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{bands.attrs.get('metric', 'accuracy')} (fraction correct)")
    ax.set_title(title, fontsize="small")
    ax.legend(frameon=False, fontsize="x-small")
    return ax


def figure3_downstream(ds: xr.Dataset, *, metric: str = "acc") -> Figure:
    """The paper's Figure 3, bottom row, from `depthdiag lm-eval` files: one panel per task,
    `metric` against serving depth with its band (`analysis.downstream.accuracy_bands`: one
    file, a normal 95% interval over the documents; several seeds, their range) and the
    chance level dashed."""
    bands = accuracy_bands(ds, metric)
    tasks = [str(task) for task in ds["task"].values]
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(4.2 * len(tasks) + 0.4, 3.8), layout="constrained")
        axes = np.atleast_1d(fig.subplots(1, len(tasks)))
    for ax, task in zip(axes, tasks):
        n = int(ds["n_samples"].sel(task=task))
        chance = ds["chance"].sel(task=task)
        plot_downstream_accuracy(
            bands.sel(task=task),
            chance=float(chance.max()) if chance.notnull().any() else None,
            title=f"{task} ({n} documents)",
            ax=ax,
        )
    fig.suptitle(f"{metric} across serving depths\nband: {bands.attrs['band']}", fontsize="medium")
    return fig
