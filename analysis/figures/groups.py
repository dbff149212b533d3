"""The benefit by group of evaluation targets (`diagnose --grouping`): one heat map of group x
serving depth per selected snapshot."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.collections import QuadMesh
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis.figures.shared import STYLE, new_axes, select_snapshots, snapshot_label, step_edges
from analysis.groups import group_benefit_intervals
from analysis.stats import IntervalOptions, method_name, plural


def _note(cells: xr.Dataset) -> str:
    """What a cell and a dot are, over how many seeds or batches."""
    unit, n = cells.attrs["unit"], np.unique(cells["n"].values)
    count = str(int(n[0])) if n.size == 1 else f"{int(n.min())}-{int(n.max())}"
    method = method_name(cells.attrs.get("method", "t"))
    note = f"cell: mean over {count} {plural(unit)}; dot: {cells.attrs['level']:.0%} {method} CI excludes 0"
    return note + (" (batch noise of one seed only)" if unit == "batch" else "")


def plot_group_benefit(
    cells: xr.Dataset, *, limit: float | None = None, note: bool = True, ax: Axes | None = None
) -> Axes:
    """One snapshot of `analysis.groups.group_benefit_intervals` as a heat map: serving depth on
    x, one row per group (its counted targets beside its name), each cell the group's mean
    benefit on a diverging scale centred at 0 (+-`limit`, default the largest |mean|), a dot
    where its interval excludes 0. Returns the axes."""
    if ax is None:
        ax = new_axes(figsize=(5.5, 3.2))
    grouping = cells.attrs["grouping"]
    cells = cells.transpose(grouping, "serving_depth")
    means = cells["mean"].values
    if limit is None:
        finite = np.abs(means[np.isfinite(means)])
        limit = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    serving, rows = cells["serving_depth"].values, np.arange(cells.sizes[grouping])
    mesh = ax.pcolormesh(
        step_edges(serving),
        np.arange(len(rows) + 1) - 0.5,
        means,
        cmap=sns.color_palette("vlag", as_cmap=True),
        vmin=-limit,
        vmax=limit,
        shading="flat",
    )
    row_index, column_index = np.nonzero((cells["lower"].values > 0) | (cells["upper"].values < 0))
    ax.plot(serving[column_index], rows[row_index], linestyle="none", marker=".", markersize=4, color="0.1")
    labels = [f"{g} ({int(t)})" for g, t in zip(cells[grouping].values, cells["targets"].values)]
    ax.set_yticks(rows, labels)
    if not ax.yaxis_inverted():  # the first group on top, as a table lists it
        ax.invert_yaxis()
    ax.set_xlabel("serving depth")
    ax.set_ylabel(f"{grouping} (targets)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    title = [snapshot_label(int(cells["uniform_updates"]))] if "uniform_updates" in cells.coords else []
    ax.set_title("\n".join(title + ([_note(cells)] if note else [])), fontsize="small")
    ax.grid(False)
    if note:
        ax.figure.colorbar(mesh, ax=ax, label="benefit (NLL)")
    return ax


def group_benefit_figure(
    ds: xr.Dataset,
    grouping: str,
    *,
    uniform_updates: Sequence[int] = (0, 16),
    options: IntervalOptions = IntervalOptions(),
) -> Figure:
    """The benefit per group of `grouping` and serving depth at the selected snapshots (default
    the switch and after 16 uniform updates), side by side on one colour scale centred at 0;
    seed-level means when `ds` has seeds, batch means otherwise (the title says which)."""
    cells = group_benefit_intervals(ds, grouping, options=options)
    selected = select_snapshots(cells, uniform_updates)
    finite = np.abs(cells["mean"].isel(snapshot=selected).values)
    finite = finite[np.isfinite(finite)]
    limit = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    with sns.axes_style(STYLE):
        width = max(5.2 * len(selected) + 1.5, 9.0)
        fig = Figure(figsize=(width, 0.4 * cells.sizes[grouping] + 2.6), layout="constrained")
        axes = np.atleast_1d(fig.subplots(1, len(selected), sharey=True))
    for ax, index in zip(axes, selected):
        plot_group_benefit(cells.isel(snapshot=index), limit=limit, note=False, ax=ax)
    for ax in axes[1:]:
        ax.set_ylabel("")
    mesh = next(c for c in axes[-1].collections if isinstance(c, QuadMesh))
    fig.colorbar(mesh, ax=list(axes), label="benefit (NLL)")
    reference, deep = (int(d) for d in ds["update_depth"].values[[0, -1]])
    fig.suptitle(
        f"benefit by {grouping}: NLL after the K={reference} update − NLL after the K={deep} update\n"
        f"(positive: the deep update helps more)\n{_note(cells)}",
        fontsize="medium",
    )
    return fig
