"""The in-training monitor of one run (RUN/monitor.h5): the batch-mean benefit over training
step and serving depth, and the depth-averaged benefit against step with its interval over
the check's batches."""

from __future__ import annotations

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis.figures.shared import PALETTE, STYLE, ZERO_LINE, mark_switch, new_axes, step_edges
from analysis.monitor import switch_step
from analysis.stats import IntervalOptions, method_name, monitor_benefit_map, monitor_depth_averaged_benefit
from common.benefit import benefit_description


def plot_monitor_heatmap(benefit: xr.DataArray, *, switch_step: int | None = None, ax: Axes | None = None) -> Axes:
    """The batch-mean benefit (`analysis.stats.monitor_benefit_map`) as a heat map over training
    step (x) and serving depth (y), on a colour scale centred at zero, the switch marked."""
    if ax is None:
        ax = new_axes(figsize=(5.5, 3.8))
    values = benefit.transpose("serving_depth", "step").values
    limit = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 1.0
    limit = limit if limit > 0 else 1.0
    mesh = ax.pcolormesh(
        step_edges(benefit["step"].values),
        step_edges(benefit["serving_depth"].values),
        values,
        cmap=sns.color_palette("vlag", as_cmap=True),
        vmin=-limit,
        vmax=limit,
        shading="flat",
    )
    ax.figure.colorbar(mesh, ax=ax, label="batch-mean benefit (NLL)")
    mark_switch(ax, switch_step)
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
        ax = new_axes(figsize=(5.0, 3.8))
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
    mark_switch(ax, switch_step)
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
