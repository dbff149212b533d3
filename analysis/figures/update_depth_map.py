"""The update-depth x serving-depth map: which update depth K helps which serving depth, one
heat map per snapshot of a results Dataset diagnosed with several update depths."""

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
from analysis.stats import IntervalOptions, method_name, plural, update_depth_map


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
        ax = new_axes(figsize=(5.5, 3.2))
    cells = cells.transpose("update_depth", "serving_depth")
    means = cells["mean"].values
    limit = _symmetric_limit(means) if limit is None else limit
    update_depths = [int(d) for d in cells["update_depth"].values]
    serving = cells["serving_depth"].values
    rows = np.arange(len(update_depths))
    mesh = ax.pcolormesh(
        step_edges(serving),
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
    title = [snapshot_label(int(cells["uniform_updates"]))] if "uniform_updates" in cells.coords else []
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
    selected = select_snapshots(cells, uniform_updates)
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
