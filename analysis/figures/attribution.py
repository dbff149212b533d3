"""How well the attribution finds a planted kind of training sequence: AUROC by serving depth,
one line per seed, beside the shuffled-label control (`analysis.attribution.labelled_auroc`)."""

from __future__ import annotations

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.figures.shared import PALETTE, STYLE, ZERO_LINE, new_axes, snapshot_label


def plot_auroc(found: xr.Dataset, *, threshold: float = 0.75, ax: Axes | None = None) -> Axes:
    """One snapshot of `labelled_auroc` (dims (seed,) serving_depth): each seed's AUROC against
    serving depth as a line with dots, its shuffled-label control dashed in the same colour, the
    chance level 0.5 and `threshold` as horizontal lines. Returns the axes."""
    if ax is None:
        ax = new_axes()
    found = found if "seed" in found.dims else found.expand_dims(seed=[0])
    colours = sns.color_palette(PALETTE, found.sizes["seed"])
    depths = found["serving_depth"].values
    for colour, seed in zip(colours, found["seed"].values):
        cell = found.sel(seed=seed)
        ax.plot(depths, cell["auroc"].values, marker="o", markersize=3, color=colour, label=f"seed {int(seed)}")
        ax.plot(depths, cell["shuffled"].values, linestyle=":", color=colour, alpha=0.8)
    ax.axhline(0.5, **ZERO_LINE)
    ax.axhline(threshold, color="0.5", linewidth=0.8)
    ax.set_ylim(0, 1)
    ax.set_xlabel("serving depth")
    ax.set_ylabel("AUROC (dotted: labels shuffled)")
    if "uniform_updates" in found.coords:
        ax.set_title(snapshot_label(int(np.ravel(found["uniform_updates"].values)[0])), fontsize="small")
    ax.legend(fontsize="x-small", ncols=2)
    return ax


def auroc_figure(found: xr.Dataset, *, what: str = "planted") -> Figure:
    """`plot_auroc` for every snapshot of `found`, side by side."""
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(5.0 * found.sizes["snapshot"] + 0.5, 4.0), layout="constrained")
        axes = np.atleast_1d(fig.subplots(1, found.sizes["snapshot"], sharey=True))
    for ax, snapshot in zip(axes, found["snapshot"].values):
        plot_auroc(found.sel(snapshot=snapshot), ax=ax)
    counts = f"{int(found['positives'].sum())} of {int(found['rows'].sum())} batch rows, all seeds and snapshots"
    fig.suptitle(f"attribution ranking {what} training sequences above the rest\n({counts})", fontsize="medium")
    return fig
