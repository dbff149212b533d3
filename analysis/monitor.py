"""The in-training monitor's file, RUN/monitor.h5: its schema and reading (no torch).

The results-file conventions of analysis/store.py (HDF5 via h5netcdf, zlib 4 +
shuffle, attributes str/int/float only, `long_name` and `units` on every variable)
with `step` in place of `snapshot`: one check per step, the model after `step`
updates diagnosed at the learning rate of the next update.

| variable | dims |
|---|---|
| nll | step, batch, update_depth, serving_depth |
| nll_before | step, serving_depth |
| benefit | step, batch, serving_depth |
| update_rms, rms_scale, train_loss | step, batch, update_depth |
| update_cosine | step, batch |
| lr | step |
| depth_probability | step, depth |

Attributes: `kind` = 'monitor', `config` (the run config, JSON), `monitor` (the
[monitor] settings, JSON), `switch_step` (the schedule's switch; -1 without one),
`schedule`, `eval_set`, `eval_sequences`, isolate, rms_match, optimizer,
grad_clip, precision, `batch_stream` (how the batches are drawn) and versions.
"""

from __future__ import annotations

import os

import numpy as np
import xarray as xr

from analysis.store import DESCRIPTIONS, file_attribute, open_checked
from common.errors import InputError

KIND = "monitor"
"""The `kind` attribute that marks a monitor file."""

NO_SWITCH = -1
"""`switch_step` of a schedule without a switch."""

MONITOR_VARIABLES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "nll": (("step", "batch", "update_depth", "serving_depth"), *DESCRIPTIONS["nll"]),
    "nll_before": (("step", "serving_depth"), *DESCRIPTIONS["nll_before"]),
    "benefit": (("step", "batch", "serving_depth"), *DESCRIPTIONS["benefit"]),
    "update_rms": (("step", "batch", "update_depth"), *DESCRIPTIONS["update_rms"]),
    "rms_scale": (("step", "batch", "update_depth"), *DESCRIPTIONS["rms_scale"]),
    "train_loss": (("step", "batch", "update_depth"), *DESCRIPTIONS["train_loss"]),
    "update_cosine": (("step", "batch"), *DESCRIPTIONS["update_cosine"]),
    "lr": (("step",), "learning rate of the diagnosed update (the next training update's)", "1"),
    "depth_probability": (("step", "depth"), "probability of each training depth at this step under the schedule", "1"),
}
"""name -> (dims, long_name, units). `benefit_all` (step, batch, update_depth, serving_depth) is
added when more than two update depths are compared."""

COORDINATES = {
    "step": ("updates before the check", "updates"),
    "batch": ("diagnostic batch of the check", "1"),
    "update_depth": DESCRIPTIONS["update_depth"],
    "serving_depth": DESCRIPTIONS["serving_depth"],
    "depth": ("training depth of the schedule", "iterations"),
}


def describe(ds: xr.Dataset) -> xr.Dataset:
    """`ds` with `long_name` and `units` on every variable and coordinate of the schema."""
    for name, (_, long_name, units) in MONITOR_VARIABLES.items():
        if name in ds:
            ds[name].attrs.update(long_name=long_name, units=units)
    if "benefit_all" in ds:
        long_name, units = DESCRIPTIONS["benefit_all"]
        ds["benefit_all"].attrs.update(long_name=long_name, units=units)
    for name, (long_name, units) in COORDINATES.items():
        if name in ds.coords:
            ds[name].attrs.update(long_name=long_name, units=units)
    return ds


def is_monitor_dataset(ds: xr.Dataset) -> bool:
    return ds.attrs.get("kind") == KIND


def is_monitor_file(path: str | os.PathLike) -> bool:
    """Whether `path` is an HDF5 file marked as a monitor file (False for anything else, results
    files included); `open_monitor` checks the rest."""
    return file_attribute(path, "kind") == KIND


def validate_monitor(ds: xr.Dataset, source) -> None:
    """Raise InputError("SOURCE: problem") unless `ds` follows the monitor schema."""
    if not is_monitor_dataset(ds):
        raise InputError(f"{source}: not a monitor file (no kind = {KIND!r} attribute)")
    for name, (dims, _, _) in MONITOR_VARIABLES.items():
        if name not in ds.data_vars:
            raise InputError(f"{source}: not a monitor file (no variable {name!r})")
        if ds[name].dims != dims:
            raise InputError(f"{source}: variable {name!r} has dims {ds[name].dims}, expected {dims}")
        if not np.issubdtype(ds[name].dtype, np.floating):
            raise InputError(f"{source}: variable {name!r} has dtype {ds[name].dtype}, expected floating point")
    for coord in COORDINATES:
        if coord not in ds.coords or not np.issubdtype(ds[coord].dtype, np.integer):
            raise InputError(f"{source}: missing integer coordinate {coord!r}")
    if ds.sizes["update_depth"] < 2:
        raise InputError(f"{source}: fewer than two update depths: there is nothing to compare")


def open_monitor(path: str | os.PathLike) -> xr.Dataset:
    """A monitor file, loaded into memory (file closed) and validated."""
    return open_checked(path, "monitor file", validate_monitor)


def switch_step(ds: xr.Dataset) -> int | None:
    """The schedule's switch step the file records, or None."""
    value = int(ds.attrs.get("switch_step", NO_SWITCH))
    return None if value == NO_SWITCH else value
