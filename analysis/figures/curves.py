"""One run's training curves (RUN/metrics.jsonl, `analysis.training`): the training loss, raw
and smoothed, and the validation NLL at each serving depth, the schedule's switch marked."""

from __future__ import annotations

import seaborn as sns
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from analysis.figures.shared import PALETTE, STYLE, mark_switch, new_axes
from analysis.stats import trailing_mean
from analysis.training import run_switch


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
        ax = new_axes(figsize=(5.5, 3.8))
    window = smoothing_window(ds.sizes["updates"]) if window is None else window
    color = sns.color_palette(PALETTE)[0]
    x, loss = ds["updates"].values, ds["loss"].values
    ax.plot(x, loss, color=color, alpha=0.35, linewidth=0.8, label="per metrics line (mean since the previous)")
    smoothed = f"trailing mean over {window} line{'s' * (window != 1)}"
    ax.plot(x, trailing_mean(loss, window), color=color, linewidth=1.8, label=smoothed)
    mark_switch(ax, switch_step)
    ax.set_xlabel("updates")
    ax.set_ylabel("training loss (nats)")
    ax.set_title("training loss", fontsize="small")
    ax.legend(frameon=False, fontsize="x-small")
    return ax


def plot_validation_nll(ds: xr.Dataset, *, switch_step: int | None = None, ax: Axes | None = None) -> Axes:
    """Validation NLL (`val_nll` of `analysis.training.read_metrics`) against updates, a line
    per serving depth coloured from shallow to deep; the schedule's switch dotted."""
    if ax is None:
        ax = new_axes(figsize=(5.5, 3.8))
    val = ds["val_nll"].dropna("updates", how="all")
    depths = [int(d) for d in val["serving_depth"].values]
    colors = sns.color_palette("viridis", len(depths))
    for color, depth in zip(colors, depths):
        ax.plot(val["updates"].values, val.sel(serving_depth=depth).values, color=color, marker="o", markersize=2.5)
    mappable = ScalarMappable(norm=Normalize(min(depths), max(depths)), cmap=sns.color_palette("viridis", as_cmap=True))
    ax.figure.colorbar(mappable, ax=ax, label="serving depth")
    mark_switch(ax, switch_step)
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
