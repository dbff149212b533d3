"""Figures of the update diagnostic (the paper's Figure 4, the update-depth x serving-depth
map, and the in-training monitor's figure), drawn from stored intervals.

Computing and drawing are separate: `analysis.stats` produces interval Datasets
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
from matplotlib.collections import QuadMesh
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

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
    update_depth_map,
)
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
