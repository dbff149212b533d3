"""The collected file of an experiment grid: its schema, building it and reading it (no torch).

`depthdiag/grid.py` trains every cell of a grid (one value per axis, e.g. schedule x seed x
budget), evaluates each finished run at serving depths 1..64 and hands the numbers to
`grid_dataset`, which builds ONE Dataset; `analysis.store.write_dataset` writes it with the
results-file conventions (HDF5 via h5netcdf, zlib 4 + shuffle, attributes str/int/float
only, `long_name` and `units` on every variable and coordinate).

| variable | dims |
|---|---|
| nll, recall_bits (bioS data only) | AXES..., serving_depth |
| loss, loss_updates | AXES..., log_step |
| updates, modeled_flops, flops, wall_time, schedule_spec, initial_depth, | AXES... |
| switch_fraction, switch_step, finish | AXES... |

AXES are the grid's axes in the order given (any names: xarray and netCDF accept dots, so
"optim.lr" is an axis as it stands). `log_step` is the sorted union of the cells' metrics
steps; a cell without a line at a step holds NaN loss and 0 loss_updates there. Attributes:
the caller's, plus `kind` = 'grid'.

The statistics drawn from this file are in `analysis.grid`, which re-exports the names here.
"""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import xarray as xr

from analysis.store import open_checked
from common.errors import InputError

KIND = "grid"
"""The `kind` attribute of a collected grid file."""

NO_SWITCH = -1
"""`switch_step` of a schedule without a switch."""

SERVING_DIM = "serving_depth"
LOG_STEP_DIM = "log_step"

GRID_VARIABLES: dict[str, tuple[tuple[str, ...], str, str, str]] = {
    "nll": ((SERVING_DIM,), "f", "mean token NLL on the evaluation set at the serving depth", "nats"),
    "recall_bits": ((SERVING_DIM,), "f", "recalled bits per person at the serving depth (bioS)", "bits"),
    "loss": ((LOG_STEP_DIM,), "f", "mean training loss over the updates the metrics line covers", "nats"),
    "loss_updates": ((LOG_STEP_DIM,), "i", "updates the metrics line's mean covers (0: no line)", "updates"),
    "updates": ((), "i", "training updates of the run", "updates"),
    "modeled_flops": ((), "f", "expected modeled training FLOPs of the run's schedule", "FLOPs"),
    "flops": ((), "f", "realized cumulative modeled training FLOPs", "FLOPs"),
    "wall_time": ((), "f", "training wall-clock time", "s"),
    "schedule_spec": ((), "U", "canonical spec of the depth schedule", "1"),
    "initial_depth": ((), "i", "K0 of a fixed-first schedule, depth of a fixed one, else 0", "iterations"),
    "switch_fraction": ((), "f", "fraction of the run before the switch (NaN: no switch)", "1"),
    "switch_step": ((), "i", "step of the schedule's switch (-1: no switch)", "updates"),
    "finish": ((), "U", "finishing distribution of a fixed-first schedule, else the schedule's spec", "1"),
}
"""name -> (dims after the axes, dtype kind 'f'/'i'/'U', long_name, units). `recall_bits` is optional."""

OPTIONAL_VARIABLES = ("recall_bits",)
CELL_KEYS = tuple(GRID_VARIABLES) + ("loss_steps",)
"""The keys of one cell's dict in `grid_dataset`."""

COORDINATES = {
    SERVING_DIM: ("recurrent depth the trained model was evaluated at", "iterations"),
    LOG_STEP_DIM: ("0-based step of a training metrics line (the last update it covers)", "updates"),
}


def _axis_values(name: str, values) -> np.ndarray:
    """One axis's coordinate values as a 1-d array of str, int or float; InputError otherwise."""
    values = list(values)
    if not values:
        raise InputError(f"grid axis {name!r} has no values")
    if any(
        isinstance(v, (bool, np.bool_)) or not isinstance(v, (str, int, float, np.integer, np.floating)) for v in values
    ):
        raise InputError(f"grid axis {name!r}: values must be str, int or float labels, got {values!r}")
    if any(isinstance(v, str) for v in values) and not all(isinstance(v, str) for v in values):
        raise InputError(f"grid axis {name!r} mixes strings and numbers: {values!r}")
    array = np.array(values, dtype=str) if isinstance(values[0], str) else np.array(values)
    if len(set(array.tolist())) != len(values):
        raise InputError(f"grid axis {name!r} repeats a value: {values!r}")
    return array


def _cell_name(axes: dict[str, np.ndarray], key: tuple) -> str:
    return "(" + ", ".join(f"{name}={value!r}" for name, value in zip(axes, key)) + ")"


def _vector(cell: dict, key: str, length: int | None, where: str, integer: bool = False) -> np.ndarray:
    array = np.asarray(cell[key], dtype=np.int64 if integer else np.float64)
    if array.ndim != 1:
        raise InputError(f"cell {where}: {key} must be one-dimensional, got shape {array.shape}")
    if length is not None and array.size != length:
        raise InputError(f"cell {where}: {key} has {array.size} values, expected {length}")
    return array


def _scalar(value, key: str, kind: str, where: str):
    """One cell's scalar as str, int or float (by `kind`: 'U', 'i', 'f'); InputError otherwise."""
    if kind == "U":
        if not isinstance(value, str):
            raise InputError(f"cell {where}: {key} must be a string, got {value!r}")
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"cell {where}: {key} must be a number, got {value!r}")
    if kind == "i":
        if not (math.isfinite(value) and int(value) == value):
            raise InputError(f"cell {where}: {key} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def grid_dataset(
    axes: dict[str, list], cells: dict[tuple, dict], *, serving_depths: list[int], attrs: dict
) -> xr.Dataset:
    """The collected grid Dataset (schema in the module docstring) from one dict per cell.

    `axes` maps each axis name, in order, to its coordinate values (str, int or float
    labels). `cells` maps the tuple of one value per axis (in axes order) to a dict with
    the keys of CELL_KEYS: nll and recall_bits (arrays over `serving_depths`; recall_bits
    None in every cell or in none), loss_steps / loss / loss_updates (one entry per training
    metrics line), updates, modeled_flops, flops, wall_time, schedule_spec, initial_depth,
    switch_fraction, switch_step and finish. Every cell of the axes' product must be given
    and no other; InputError names the first missing or extra cell, or the cell and key of
    any other problem.
    """
    if not axes:
        raise InputError("a grid needs at least one axis")
    reserved = {SERVING_DIM, LOG_STEP_DIM} & set(axes)
    if reserved:
        raise InputError(f"grid axis {sorted(reserved)[0]!r} is reserved for the file's own dimension")
    coords = {name: _axis_values(name, values) for name, values in axes.items()}
    depths = np.asarray(serving_depths)
    if depths.ndim != 1 or depths.size == 0 or not np.issubdtype(depths.dtype, np.integer) or (depths < 1).any():
        raise InputError(f"serving_depths must be a non-empty list of positive integers, got {serving_depths!r}")
    if np.unique(depths).size != depths.size:
        raise InputError(f"serving_depths repeats a depth: {serving_depths!r}")
    if "kind" in attrs and attrs["kind"] != KIND:
        raise InputError(f"attribute kind={attrs['kind']!r} would mark the file as something other than a grid")

    expected = list(itertools.product(*(array.tolist() for array in coords.values())))
    given = {tuple(key) if isinstance(key, tuple) else (key,): cell for key, cell in cells.items()}
    missing = [key for key in expected if key not in given]
    if missing:
        raise InputError(f"grid cell {_cell_name(coords, missing[0])} is missing ({len(missing)} of {len(expected)})")
    expected_set = set(expected)
    extra = [key for key in given if key not in expected_set]
    if extra:
        raise InputError(f"grid cell {_cell_name(coords, extra[0])} is not in the axes' product ({len(extra)} extra)")

    with_recall = {given[key].get("recall_bits") is not None for key in expected}
    if len(with_recall) > 1:
        raise InputError("recall_bits is None in some cells and not in others: give it for every cell or for none")
    with_recall = with_recall.pop()

    parsed, all_steps = [], []
    for key in expected:
        cell, where = given[key], _cell_name(coords, key)
        unknown = sorted(set(cell) - set(CELL_KEYS))
        absent = sorted(set(CELL_KEYS) - set(cell) - set(OPTIONAL_VARIABLES))
        if unknown or absent:
            problem = f"unknown key {unknown[0]!r}" if unknown else f"no key {absent[0]!r}"
            raise InputError(f"cell {where}: {problem}")
        steps = _vector(cell, "loss_steps", None, where, integer=True)
        if (steps < 0).any() or (np.diff(steps) <= 0).any():
            raise InputError(f"cell {where}: loss_steps must be non-negative and strictly increasing")
        line_updates = _vector(cell, "loss_updates", steps.size, where, integer=True)
        if (line_updates < 1).any():
            raise InputError(f"cell {where}: loss_updates must be at least 1 for every metrics line")
        parsed.append(
            {
                "nll": _vector(cell, "nll", depths.size, where),
                "recall_bits": _vector(cell, "recall_bits", depths.size, where) if with_recall else None,
                "loss_steps": steps,
                "loss": _vector(cell, "loss", steps.size, where),
                "loss_updates": line_updates,
            }
        )
        all_steps.append(steps)

    log_steps = np.unique(np.concatenate(all_steps)) if all_steps else np.array([], dtype=np.int64)
    shape = tuple(array.size for array in coords.values())
    dims = tuple(coords)
    data: dict[str, np.ndarray] = {
        "nll": np.empty(shape + (depths.size,)),
        "loss": np.full(shape + (log_steps.size,), np.nan),
        "loss_updates": np.zeros(shape + (log_steps.size,), dtype=np.int64),
    }
    if with_recall:
        data["recall_bits"] = np.empty(shape + (depths.size,))
    scalars = {name: [] for name, (extra_dims, *_) in GRID_VARIABLES.items() if not extra_dims}
    for index, (key, cell, vectors) in enumerate(zip(expected, (given[k] for k in expected), parsed)):
        position = np.unravel_index(index, shape)
        data["nll"][position] = vectors["nll"]
        if with_recall:
            data["recall_bits"][position] = vectors["recall_bits"]
        columns = np.searchsorted(log_steps, vectors["loss_steps"])
        data["loss"][position + (columns,)] = vectors["loss"]
        data["loss_updates"][position + (columns,)] = vectors["loss_updates"]
        for name in scalars:
            scalars[name].append(_scalar(cell[name], name, GRID_VARIABLES[name][1], _cell_name(coords, key)))
    for name, values in scalars.items():
        kind = GRID_VARIABLES[name][1]
        dtype = {"f": np.float64, "i": np.int64, "U": str}[kind]
        data[name] = np.array(values, dtype=dtype).reshape(shape)

    variables = {name: (dims + GRID_VARIABLES[name][0], data[name]) for name in GRID_VARIABLES if name in data}
    ds = xr.Dataset(
        variables,
        coords={**coords, SERVING_DIM: depths.astype(np.int64), LOG_STEP_DIM: log_steps.astype(np.int64)},
        attrs={**attrs, "kind": KIND},
    )
    return describe(ds)


def describe(ds: xr.Dataset) -> xr.Dataset:
    """`ds` with `long_name` and `units` on every variable and coordinate of the schema
    (a grid axis: long_name 'grid axis NAME', units '1')."""
    for name, (_, _, long_name, units) in GRID_VARIABLES.items():
        if name in ds:
            ds[name].attrs.update(long_name=long_name, units=units)
    for name, (long_name, units) in COORDINATES.items():
        if name in ds.coords:
            ds[name].attrs.update(long_name=long_name, units=units)
    for name in grid_axes(ds):
        ds[name].attrs.update(long_name=f"grid axis {name}", units="1")
    return ds


def grid_axes(ds: xr.Dataset) -> tuple[str, ...]:
    """The grid's axes, in order (the dims of its per-cell variables)."""
    return tuple(ds["updates"].dims)


def is_grid_dataset(ds: xr.Dataset) -> bool:
    return ds.attrs.get("kind") == KIND


def validate_grid(ds: xr.Dataset, source) -> None:
    """Raise InputError("SOURCE: problem") unless `ds` follows the grid schema."""
    if not is_grid_dataset(ds):
        raise InputError(f"{source}: not a grid file (no kind = {KIND!r} attribute)")
    if "updates" not in ds.data_vars:
        raise InputError(f"{source}: not a grid file (no variable 'updates')")
    axes = grid_axes(ds)
    for name, (extra_dims, kind, _, _) in GRID_VARIABLES.items():
        if name not in ds.data_vars:
            if name in OPTIONAL_VARIABLES:
                continue
            raise InputError(f"{source}: not a grid file (no variable {name!r})")
        if ds[name].dims != axes + extra_dims:
            raise InputError(f"{source}: variable {name!r} has dims {ds[name].dims}, expected {axes + extra_dims}")
        if ds[name].dtype.kind not in {"f": "f", "i": "iu", "U": "UO"}[kind]:
            raise InputError(f"{source}: variable {name!r} has dtype {ds[name].dtype}")
    for coord in (*axes, SERVING_DIM, LOG_STEP_DIM):
        if coord not in ds.coords:
            raise InputError(f"{source}: missing coordinate {coord!r}")
    for coord in (SERVING_DIM, LOG_STEP_DIM):
        if not np.issubdtype(ds[coord].dtype, np.integer):
            raise InputError(f"{source}: coordinate {coord!r} has dtype {ds[coord].dtype}, expected integers")


def open_grid(path: str | os.PathLike) -> xr.Dataset:
    """A collected grid file, loaded into memory (file closed) and validated; InputError naming
    the file for anything else (a results or monitor file included)."""
    return open_checked(path, "grid file", validate_grid)
