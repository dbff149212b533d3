"""Downstream evaluation (`depthdiag lm-eval` files, the paper's Figure 3 bottom row): each
task's accuracy against serving depth with `analysis.downstream`'s band and the chance level."""

from __future__ import annotations

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis.downstream import accuracy_bands
from analysis.figures.shared import PALETTE, STYLE, new_axes


def plot_downstream_accuracy(
    bands: xr.Dataset, *, chance: float | None = None, title: str = "", ax: Axes | None = None
) -> Axes:
    """One task's accuracy against serving depth: `bands` is `analysis.downstream.accuracy_bands`
    of one task (mean, lower, upper over serving_depth); the band where it exists, the chance
    level dashed when given (and finite)."""
    if ax is None:
        ax = new_axes()
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
