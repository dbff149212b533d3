"""Which depth to serve: mean NLL against mean served depth (and modeled FLOPs per token) for
every exit criterion swept over its thresholds, the oracle, the lowest NLL any per-token choice of
depths reaches, and the fixed depths (`analysis.exits.mean_over_runs` computes the points)."""

from __future__ import annotations

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.figures.shared import PALETTE, STYLE, new_axes


def plot_exits(means: xr.Dataset, *, x: str = "depth", ax: Axes | None = None) -> Axes:
    """`means` from `mean_over_runs`; `x` 'depth' (mean served depth) or 'gflops' (modeled
    GFLOPs per token). Returns the axes."""
    if ax is None:
        ax = new_axes()
    depths = {"fixed": "serving_depth", "exit": "exit_depth", "oracle": "oracle_depth", "frontier": "frontier_depth"}

    def along(name: str) -> np.ndarray:
        variable = depths[name] if x == "depth" else f"{name}_gflops"
        return means[variable].values.astype(float)

    ax.plot(along("frontier"), means["frontier_nll"].values, color="0.2", linewidth=1.2, label="lowest at mean depth")
    ax.plot(
        along("oracle"),
        means["oracle_nll"].values,
        color="0.2",
        linestyle="--",
        marker="x",
        markersize=4,
        label="oracle (epsilon sweep)",
    )
    ax.plot(
        along("fixed"),
        means["fixed_nll"].values,
        linestyle="none",
        marker="s",
        markersize=4,
        color="0.55",
        label="fixed depth",
    )
    colours = sns.color_palette(PALETTE, means.sizes["criterion"])
    exit_x = np.atleast_2d(along("exit"))
    for colour, (i, criterion) in zip(colours, enumerate(means["criterion"].values)):
        ax.plot(exit_x[i], means["exit_nll"].values[i], marker="o", markersize=3, color=colour, label=str(criterion))
    ax.set_xlabel("mean served depth" if x == "depth" else "modeled GFLOPs per token")
    ax.set_ylabel("mean NLL (nats)")
    ax.legend(fontsize="x-small")
    return ax


def exits_figure(panels: dict[str, xr.Dataset]) -> Figure:
    """One row per labelled `mean_over_runs` Dataset (e.g. one per training schedule): `plot_exits`
    against mean depth, and against modeled FLOPs where every file has them; each row its own NLL
    axis (schedules can differ by an order of magnitude at depth)."""
    flops = all(np.isfinite(means["fixed_gflops"].values).all() for means in panels.values())
    columns = ("depth", "gflops") if flops else ("depth",)
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(5.2 * len(columns) + 0.4, 3.9 * len(panels) + 0.4), layout="constrained")
        axes = np.atleast_2d(fig.subplots(len(panels), len(columns), sharey="row", squeeze=False))
    for row, (label, means) in zip(axes, panels.items()):
        for ax, x in zip(row, columns):
            plot_exits(means, x=x, ax=ax)
            ax.set_title(
                f"{label}: {int(means.attrs['targets'])} targets, mean over {means.attrs['runs']} run(s)",
                fontsize="small",
            )
    fig.suptitle(
        "exit criteria against the oracle, the lowest NLL at each mean depth and the fixed depths", fontsize="medium"
    )
    return fig
