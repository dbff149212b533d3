"""What more than one figure family uses: the seaborn style and palette, the zero and switch
lines, a fresh pyplot-free axes, choosing snapshots of a results Dataset and naming them, and
the cell edges of a heat map."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from common.errors import InputError

STYLE = "whitegrid"
PALETTE = "colorblind"
ZERO_LINE = {"color": "0.25", "linewidth": 0.9, "linestyle": "--", "zorder": 1}


def new_axes(figsize=(5.0, 3.8)) -> Axes:
    with sns.axes_style(STYLE):
        return Figure(figsize=figsize, layout="constrained").add_subplot()


def select_snapshots(intervals: xr.Dataset, uniform_updates: Sequence[int]) -> list[int]:
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
            # Past this helper and the plot function that called it: the warning names the caller's line.
            stacklevel=3,
        )
    return selected


def snapshot_label(uniform_updates: int) -> str:
    if uniform_updates == 0:
        return "switch (0 uniform updates)"
    return f"{uniform_updates} uniform updates"


def step_edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges around (possibly irregular) steps: midpoints, the ends half a gap out."""
    steps = np.asarray(steps, dtype=np.float64)
    if steps.size == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    middle = (steps[1:] + steps[:-1]) / 2
    return np.concatenate([[steps[0] - (middle[0] - steps[0])], middle, [steps[-1] + (steps[-1] - middle[-1])]])


def mark_switch(ax: Axes, switch_step: int | None, *, label: bool = True) -> None:
    if switch_step is not None:
        ax.axvline(
            switch_step,
            color="0.15",
            linestyle=":",
            linewidth=1.3,
            label=f"schedule switch (step {switch_step})" if label else None,
        )
