"""The paper's grid figures (1, 2, 3-top, 5 and 8) from a collected grid file, drawn from
`analysis.grid`'s seed bands: recall and NLL against serving depth, recall normalised by its
peak, training loss over the run and its terminal window, and NLL against modeled FLOPs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from analysis.figures.shared import PALETTE, STYLE, ZERO_LINE, new_axes
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
from analysis.stats import plural

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
        ax = new_axes()
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
        ax = new_axes()
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
        ax = new_axes()
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
    ax = new_axes(figsize=(5.6, 4.0))
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
        ax = new_axes()
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
        ax = new_axes()
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
        ax = new_axes()
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
        ax = new_axes()
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
