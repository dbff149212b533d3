"""The paper's Figure 4 from a results Dataset: the benefit against serving depth at chosen
snapshots, and the depth-averaged benefit at every snapshot with the batch noise and the
finishing-phase length marked."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.figures.shared import PALETTE, STYLE, ZERO_LINE, new_axes, select_snapshots, snapshot_label
from analysis.finishing import FinishingPhase, finishing_phase
from analysis.stats import (
    IntervalOptions,
    batch_noise,
    benefit_by_depth,
    depth_averaged_benefit,
    method_name,
    plural,
)
from analysis.summary import from_a_schedule
from common.benefit import benefit_description


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


def plot_benefit_by_depth(
    intervals: xr.Dataset, *, uniform_updates: Sequence[int] | None = (0, 16), ax: Axes | None = None
) -> Axes:
    """Benefit against serving depth: a mean line and an interval band per selected snapshot.

    `intervals` is `analysis.stats.benefit_by_depth` output (over snapshot, serving_depth).
    Snapshots are chosen by their uniform-update count, or with `uniform_updates=None` all of
    them, labelled by name (results without a depth schedule). Returns the axes drawn on.
    """
    if ax is None:
        ax = new_axes()
    colors = sns.color_palette(PALETTE)
    depths = intervals["serving_depth"].values
    if uniform_updates is None:
        selected = range(intervals.sizes["snapshot"])
    else:
        selected = select_snapshots(intervals, uniform_updates)
    for slot, index in enumerate(selected):
        row = intervals.isel(snapshot=index)
        color = colors[slot % len(colors)]
        if uniform_updates is None:
            label = str(row["snapshot"].values)
        else:
            label = snapshot_label(int(row["uniform_updates"]))
        ax.fill_between(depths, row["lower"].values, row["upper"].values, color=color, alpha=0.25, linewidth=0)
        ax.plot(depths, row["mean"].values, color=color, marker="o", markersize=3.5, label=label)
    ax.axhline(0.0, **ZERO_LINE)
    ax.set_xlabel("serving depth")
    ax.set_ylabel(_benefit_label(intervals))
    ax.set_title(_interval_note(intervals), fontsize="small")
    ax.legend(frameon=False, fontsize="small")
    return ax


def _mark_from(ax: Axes, count: int | None, counts: list[int], linestyle: str, what: str, nowhere: str) -> None:
    """A vertical line at the snapshot of `count` uniform updates, labelled "WHAT from COUNT
    updates on"; only the legend entry `nowhere` where the grid holds no such count."""
    if count in counts:
        ax.axvline(
            counts.index(count),
            color="0.4",
            linestyle=linestyle,
            linewidth=1.2,
            label=f"{what} from {count} updates on",
        )
    else:
        ax.plot([], [], " ", label=nowhere)


def _mark_finishing_phase(ax: Axes, phase: FinishingPhase, counts: list[int], mean: np.ndarray) -> None:
    """The finishing-phase length on the depth-averaged panel, whose x axis is the snapshot position."""
    below = f"mean < {phase.fraction:.0%} of switch"
    within = phase.max_uniform_updates
    _mark_from(ax, phase.decay_updates, counts, ":", below, f"{below}: none within {within}")
    if phase.per_seed:  # the equivalence bound needs seeds to pair
        shown = f"shown < {phase.fraction:.0%} of switch (one-sided {phase.level:.0%} bound)"
        _mark_from(ax, phase.bound_updates, counts, "--", shown, f"{shown}: not within {within}")
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
    next to seed noise. With `phase` (`analysis.finishing.finishing_phase`) the decay
    point and the first interval containing zero are marked. Returns the axes drawn on.
    """
    if ax is None:
        ax = new_axes(figsize=(4.0, 3.8))
    if uniform_updates is None:
        uniform_updates = sorted(int(u) for u in intervals["uniform_updates"].values)
    selected = select_snapshots(intervals, uniform_updates)
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
    when `ds` has a `seed` dimension, else over batches (and say so). Results without a
    depth schedule (an adapter's model, `analysis.summary.from_a_schedule`) get the left
    panel alone, every snapshot by name: there are no uniform updates to count.
    """
    by_depth = benefit_by_depth(ds, options=options)
    if not from_a_schedule(ds):
        with sns.axes_style(STYLE):
            fig = Figure(figsize=(5.5, 4.4), layout="constrained")
            plot_benefit_by_depth(by_depth, uniform_updates=None, ax=fig.subplots())
    else:
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
