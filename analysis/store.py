"""The results file: an xarray Dataset in HDF5 (netCDF4 via h5netcdf).

Schema (one file = one diagnostic run; several seeds combine along `seed`):

| variable | dims |
|---|---|
| nll | snapshot, batch, update_depth, serving_depth |
| nll_before | snapshot, serving_depth |
| benefit | snapshot, batch, serving_depth |
| update_rms, rms_scale | snapshot, batch, update_depth |
| update_cosine | snapshot, batch |

Coordinates: `snapshot` (str) with `uniform_updates`, `step` and `lr` along it, `batch`,
`update_depth`, `serving_depth`, and the run's training seed `seed` (a scalar; the
dimension of several seeds combined). Every variable and coordinate carries `long_name`
and `units` (CF style, DESCRIPTIONS). Attributes are str, int or float only, so every
netCDF reader sees the same values; they include the run config, the diagnostic settings
and the provenance: python_version, numpy_version, torch_version, depthdiag_version,
git_commit and git_dirty (1 when the source tree had uncommitted changes, 0 when not,
'unknown' without git), and what computed the numbers (MACHINE_ATTRS, JSON): `machine`, the
machine and kernels of the diagnose run, and `trained_on`, those that trained its snapshots.
Files combined as seeds keep these per seed, as string coordinates along `seed`.

Files written before the seed coordinate and the descriptions existed open as well: a
file's seed then comes from its `seed` attribute or its run config's train.seed, and the
descriptions are added on opening (`open_results`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import h5py
import numpy as np
import xarray as xr

from common.atomic import atomic_output
from common.errors import InputError, unreachable_input
from common.lock import claimed_outputs
from common.observers import without_observer_keys
from common.outputs import WRITTEN_BY, OutputKind

ENGINE = "h5netcdf"
COMPRESSION = {"zlib": True, "complevel": 4, "shuffle": True}

VARIABLE_DIMS: dict[str, tuple[str, ...]] = {
    "nll": ("snapshot", "batch", "update_depth", "serving_depth"),
    "nll_before": ("snapshot", "serving_depth"),
    "benefit": ("snapshot", "batch", "serving_depth"),
    "update_rms": ("snapshot", "batch", "update_depth"),
    "rms_scale": ("snapshot", "batch", "update_depth"),
    "update_cosine": ("snapshot", "batch"),
}
INDEX_COORDS = ("snapshot", "batch", "update_depth", "serving_depth")
MACHINE_ATTRS = ("machine", "trained_on")
"""The attributes that say which machine and kernels computed a file (JSON; trainer/machine.py
records): they may differ between seeds, and are kept per seed when files are combined."""
SNAPSHOT_COORDS = ("uniform_updates", "step")

DESCRIPTIONS: dict[str, tuple[str, str]] = {
    "nll": ("mean token NLL on the evaluation set after the RMS-matched update", "nats"),
    "nll_before": ("mean token NLL on the evaluation set before the update", "nats"),
    "benefit": ("NLL after the reference update minus NLL after the other", "nats"),
    "benefit_all": ("NLL after the reference update minus NLL after each", "nats"),
    "update_rms": ("RMS of the update over all parameters, before matching", "1"),
    "rms_scale": ("factor the update was scaled by to match RMS", "1"),
    "train_loss": ("training loss of the diagnostic batch at the update depth", "nats"),
    "update_cosine": ("cosine between the first and the last depth's updates", "1"),
    "update_depth": ("recurrent depth the update was computed at", "iterations"),
    "serving_depth": ("recurrent depth the updated model was evaluated at", "iterations"),
    "snapshot": ("snapshot file the update starts from", "1"),
    "uniform_updates": ("updates since the switch to the finishing schedule", "updates"),
    "step": ("updates before the snapshot", "updates"),
    "lr": ("learning rate of the diagnosed update", "1"),
    "batch": ("diagnostic batch of the snapshot", "1"),
    "seed": ("training seed of the run", "1"),
    "machine": ("machine and kernels that diagnosed the seed's file (JSON, trainer/machine.py)", "1"),
    "trained_on": ("machines and kernels that trained the seed's snapshots (JSON list)", "1"),
    "attribution": ("first-order share of the training sequence in the benefit (isolate linear)", "nats"),
    "linear_benefit": (
        "first-order benefit of the isolate-linear updates: the batch rows' attributions summed",
        "nats",
    ),
    "benefit_counterfactual": ("the unit's benefit under isolate counterfactual", "nats"),
    "clip_coefficient": ("factor gradient clipping scaled the batch gradient by", "1"),
    "example_tokens": ("token ids of the attributed training sequence", "1"),
    "example": ("attributed training sequence: the batch's rows, then the pool's", "1"),
    "in_batch": ("whether the sequence is a row of the unit's batch (else of the pool)", "1"),
    "removal_benefit": ("the unit's benefit under isolate counterfactual with the removal's rows taken out", "nats"),
    "removed_rows": ("rows of the unit's batch the removal took out", "1"),
    "removal": ("the batch's rows ranked highest (top), lowest (bottom) or at random, removed", "1"),
    "removed": ("one of the removal's rows", "1"),
}
"""name -> (long_name, units) of every variable and coordinate a results file may hold; the
monitor file (analysis/monitor.py) shares the entries of the variables both hold."""


def describe_results(ds: xr.Dataset) -> xr.Dataset:
    """`ds` with `long_name` and `units` on every variable and coordinate DESCRIPTIONS names."""
    for name, (long_name, units) in DESCRIPTIONS.items():
        if name in ds.variables:
            ds[name].attrs.update(long_name=long_name, units=units)
    for name in list(ds.data_vars):
        for prefix, (long_name, units) in GROUPED_DESCRIPTIONS.items():
            if str(name).startswith(prefix):
                grouping = str(name)[len(prefix) :]
                ds[name].attrs.update(long_name=long_name.format(grouping), units=units)
                ds[grouping].attrs.update(long_name=f"group of evaluation targets by {grouping}", units="1")
    return ds


GROUPED_DESCRIPTIONS = {
    "nll_by_": ("mean NLL of each group of evaluation targets by {} after the update", "nats"),
    "nll_before_by_": ("mean NLL of each group of evaluation targets by {} before the update", "nats"),
    "targets_by_": ("counted evaluation targets in each group by {}", "1"),
}
"""long_name and units of the variables `diagnose --grouping X` adds (X: the grouping)."""


def _netcdf_attr(name: str, value):
    """An attribute value as str/int/float: bools as 0/1, dicts and lists as JSON strings."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, sort_keys=True)
        except TypeError as err:
            raise TypeError(f"attribute {name!r}: not JSON-serialisable ({err})") from None
    raise TypeError(
        f"attribute {name!r}: {type(value).__name__} is not allowed in a results file "
        "(use str, int, float, bool or a JSON-serialisable dict)"
    )


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _is_results_file(path: Path) -> bool:
    """An HDF5 file whose attributes carry depthdiag's mark (`written_by`, which `write_dataset`
    adds) or, in files from before the mark, depthdiag's provenance."""
    try:
        with open(path, "rb") as handle:
            if handle.read(len(_HDF5_SIGNATURE)) != _HDF5_SIGNATURE:
                return False
        with h5py.File(path, "r") as file:
            written_by = file.attrs.get("written_by", b"")
            written_by = written_by.decode() if isinstance(written_by, bytes) else str(written_by)
            return written_by == WRITTEN_BY or "depthdiag_version" in file.attrs
    except (OSError, ValueError):
        return False


def file_attribute(path: str | os.PathLike, name: str) -> str | None:
    """The text attribute `name` of the HDF5 file at `path`, read without decoding the dataset
    (a millisecond, where opening it with xarray takes a hundred); None when the file is not a
    readable HDF5 file or holds no such text attribute."""
    try:
        with h5py.File(path, "r") as file:
            value = file.attrs.get(name)
    except (OSError, ValueError):
        return None
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return value if isinstance(value, str) else None


RESULTS_FILE = OutputKind("results file", _is_results_file)
"""What `write_results` (and --force) may replace: a results file depthdiag wrote."""


def write_dataset(ds: xr.Dataset, path: str | os.PathLike) -> None:
    """Write `ds` to `path` atomically, compressed (zlib 4 + shuffle on numeric data variables).

    Attributes of the dataset and of its variables are converted to str/int/float
    (see `_netcdf_attr`); any other attribute type raises TypeError naming it.
    """
    ds = ds.copy(deep=False)
    # The mark by which --force recognises a results file depthdiag wrote (common/outputs.py).
    ds.attrs = {key: _netcdf_attr(key, value) for key, value in {**ds.attrs, "written_by": WRITTEN_BY}.items()}
    encoding = {}
    for name, variable in ds.variables.items():
        variable.attrs = {key: _netcdf_attr(f"{name}.{key}", value) for key, value in variable.attrs.items()}
        # Encoding left over from the file a dataset was read from (chunk sizes,
        # source path) may not fit the new shapes; every write starts afresh.
        variable.encoding = {}
        if name in ds.data_vars and np.issubdtype(variable.dtype, np.number):
            encoding[name] = dict(COMPRESSION)
    # HDF5 builds the file in memory and Python writes the bytes: a write that fails on
    # disk (full, or over a file-size limit) is then a plain OSError, where HDF5 writing to
    # the file itself crashed the interpreter when it closed the failed file.
    data = ds.to_netcdf(engine=ENGINE, encoding=encoding)
    with atomic_output(path) as tmp, open(tmp, "wb") as handle:
        handle.write(data)


def write_results(
    ds: xr.Dataset, path: str | os.PathLike, *, force: bool = False, inputs: Iterable[str | os.PathLike] = ()
) -> Path:
    """`write_dataset` for a command's output: holds `path`'s lock while writing and applies the
    output rule (common/outputs.py): never one of `inputs`, an existing file only with `force`
    and only a results file depthdiag wrote (InputError). Returns the path."""
    with claimed_outputs([path], kind=RESULTS_FILE, inputs=inputs, force=force):
        write_dataset(ds, path)
    return Path(path)


def _fail(source, problem: str) -> InputError:
    return InputError(f"{source}: {problem}")


def validate_results(ds: xr.Dataset, source, *, seed_dim: str = "seed") -> None:
    """Raise InputError("SOURCE: problem") unless `ds` follows the results schema and holds
    finite benefit data (at least one value; NaN marks a missing unit, never an infinity).

    Any variable may carry an extra `seed_dim` dimension (several seeds combined);
    variables beyond the schema's are allowed.
    """
    for name, dims in VARIABLE_DIMS.items():
        if name not in ds.data_vars:
            raise _fail(source, f"not a results file (no variable {name!r})")
        actual = tuple(d for d in ds[name].dims if d != seed_dim)
        if set(actual) != set(dims) or len(actual) != len(dims):
            raise _fail(source, f"variable {name!r} has dims {ds[name].dims}, expected {dims}")
        if not np.issubdtype(ds[name].dtype, np.floating):
            raise _fail(source, f"variable {name!r} has dtype {ds[name].dtype}, expected floating point")
    for coord in INDEX_COORDS:
        if coord not in ds.coords:
            raise _fail(source, f"missing coordinate {coord!r}")
    if ds["snapshot"].dtype.kind not in "UOS":
        raise _fail(source, f"coordinate 'snapshot' has dtype {ds['snapshot'].dtype}, expected strings")
    for coord in SNAPSHOT_COORDS:
        if coord not in ds.coords or ds[coord].dims != ("snapshot",):
            raise _fail(source, f"missing coordinate {coord!r} along 'snapshot'")
        if not np.issubdtype(ds[coord].dtype, np.integer):
            raise _fail(source, f"coordinate {coord!r} has dtype {ds[coord].dtype}, expected integers")
    for coord in ("update_depth", "serving_depth"):
        if not np.issubdtype(ds[coord].dtype, np.integer):
            raise _fail(source, f"coordinate {coord!r} has dtype {ds[coord].dtype}, expected integers")
    if ds.sizes["update_depth"] < 2:
        raise _fail(source, "fewer than two update depths: there is nothing to compare")
    benefit = np.asarray(ds["benefit"].values, dtype=np.float64)
    if np.isinf(benefit).any():
        raise _fail(source, "the benefit holds infinite values (a diverged snapshot?); diagnose it again")
    if not np.isfinite(benefit).any():
        raise _fail(source, "no finite benefit value (every unit is NaN): nothing to summarize or draw")
    for key, value in ds.attrs.items():
        if not isinstance(value, (str, int, float, np.integer, np.floating)):
            raise _fail(source, f"attribute {key!r} has type {type(value).__name__}, expected str/int/float")


def _canonical(ds: xr.Dataset, seed_dim: str) -> xr.Dataset:
    """Dims of every schema variable in schema order (seed first where present)."""
    for name, dims in VARIABLE_DIMS.items():
        order = ((seed_dim,) if seed_dim in ds[name].dims else ()) + dims
        ds[name] = ds[name].transpose(*order)
    return ds


def open_checked(path: str | os.PathLike, what: str, validate) -> xr.Dataset:
    """The file at `path` loaded into memory (file closed), checked by `validate(ds, path)`,
    with plain Python attributes; InputError naming the file and `what` it should have been."""
    path = Path(path)
    if not path.is_file():
        raise unreachable_input(path)
    try:
        with xr.open_dataset(path, engine=ENGINE) as ds:
            ds = ds.load()
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise _fail(path, f"not a readable {what} ({reason})") from None
    validate(ds, path)
    # netCDF hands attributes back as numpy scalars; plain Python values print and serialise cleanly.
    # The mark belongs to the file, not to the data: a dataset written again gets it anew.
    ds.attrs = {
        key: value.item() if isinstance(value, np.generic) else value
        for key, value in ds.attrs.items()
        if key != "written_by"
    }
    return ds


def _open_one(path: Path, seed_dim: str) -> xr.Dataset:
    """A results file, validated, with the seed coordinate (from the attributes when the file
    predates it) and the descriptions."""
    ds = open_checked(path, "results file", lambda ds, source: validate_results(ds, source, seed_dim=seed_dim))
    if seed_dim not in ds.coords:
        seed = _seed_of(ds)
        if seed is not None:
            ds = ds.assign_coords({seed_dim: np.int64(seed)})
    return describe_results(_canonical(ds, seed_dim))


def _seed_of(ds: xr.Dataset, seed_dim: str = "seed"):
    """The run's seed: its scalar `seed_dim` coordinate, else the `seed` attribute, else the
    run config's train.seed; None when none is there."""
    if seed_dim in ds.coords and ds[seed_dim].ndim == 0:
        return int(ds[seed_dim])
    if "seed" in ds.attrs:
        return int(ds.attrs["seed"])
    config = ds.attrs.get("config")
    if isinstance(config, str):
        try:
            return int(json.loads(config)["train"]["seed"])
        except (ValueError, KeyError, TypeError):
            return None
    return None


# Diagnostic settings that change what a results file measures, stored as file attributes.
DIAGNOSTIC_SETTINGS = ("isolate", "rms_match", "lr_override", "eval_set")
LAYOUT_COORDS = ("update_depth", "serving_depth", "uniform_updates")


def _first_difference(first, other, path: str = "") -> tuple[str, object, object] | None:
    """(dotted key, first's value, other's value) of the first place two JSON values differ, or None."""
    if isinstance(first, dict) and isinstance(other, dict):
        for key in sorted(set(first) | set(other)):
            where = f"{path}.{key}" if path else str(key)
            if key not in first or key not in other:
                return where, first.get(key, "(absent)"), other.get(key, "(absent)")
            found = _first_difference(first[key], other[key], where)
            if found is not None:
                return found
        return None
    return None if first == other else (path, first, other)


def _config_without_seed(ds: xr.Dataset):
    """The run config as a dict without train.seed (the one key seeds may differ in) and the keys
    that only observe a run (common/observers.py), or None."""
    text = ds.attrs.get("config")
    if not isinstance(text, str):
        return None
    try:
        config = json.loads(text)
    except ValueError:
        return text
    if isinstance(config, dict) and isinstance(config.get("train"), dict):
        config = {**config, "train": {k: v for k, v in config["train"].items() if k != "seed"}}
    return without_observer_keys(config)


def batches_per_snapshot(ds: xr.Dataset) -> list[int]:
    """How many batches of each snapshot hold a benefit at every serving depth, the batches the
    statistics count (NaN padding and unfinished batches do not)."""
    finished = ds["benefit"].notnull().all("serving_depth")
    return [int(count) for count in finished.sum("batch").values]


def _check_same_experiment(first: xr.Dataset, first_path, other: xr.Dataset, other_path, seed_dim: str) -> None:
    """Files combined as seeds must differ in the seed only, so that the spread over them is seed noise.

    Compared: depths and the uniform-update grid, batches per snapshot, the diagnostic
    settings (DIAGNOSTIC_SETTINGS) and the run config without train.seed and the keys that
    only observe a run (common/observers.py).
    Provenance (creation time, versions, snapshot hashes) may differ.
    """
    if seed_dim in other.dims:
        raise _fail(other_path, "already combines several seeds; pass the per-seed files instead")
    refuse = "; only the seed may differ between files combined as seeds"
    for coord in LAYOUT_COORDS:
        if not np.array_equal(first[coord].values, other[coord].values):
            raise _fail(
                other_path,
                f"coordinate {coord!r} {other[coord].values.tolist()} differs from "
                f"{first_path}'s {first[coord].values.tolist()}{refuse}",
            )
    first_batches, other_batches = batches_per_snapshot(first), batches_per_snapshot(other)
    if first_batches != other_batches:
        raise _fail(
            other_path, f"batches per snapshot {other_batches} differ from {first_path}'s {first_batches}{refuse}"
        )
    for key in DIAGNOSTIC_SETTINGS:
        if first.attrs.get(key) != other.attrs.get(key):
            raise _fail(
                other_path,
                f"{key} {other.attrs.get(key, '(absent)')!r} differs from "
                f"{first_path}'s {first.attrs.get(key, '(absent)')!r}{refuse}",
            )
    difference = _first_difference(_config_without_seed(first), _config_without_seed(other))
    if difference is not None:
        key, first_value, other_value = difference
        what = f"run config key {key}" if key else "run config"
        raise _fail(other_path, f"{what} {other_value!r} differs from {first_path}'s {first_value!r}{refuse}")


def open_results(paths, *, seed_dim: str = "seed") -> xr.Dataset:
    """Open one results file, or combine several (one per seed) along `seed_dim`.

    One file is returned as stored (loaded into memory, file closed); several are
    combined by `combine_seeds`, in the order given.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise InputError("no results files given")
    datasets = [_open_one(path, seed_dim) for path in paths]
    if len(datasets) == 1:
        return datasets[0]
    return combine_seeds(datasets, paths, seed_dim=seed_dim)


def combine_seeds(datasets, sources, *, seed_dim: str = "seed") -> xr.Dataset:
    """Combine results Datasets of one experiment, one per training seed, along `seed_dim`.

    The files must differ in nothing but the seed (see `_check_same_experiment`);
    otherwise InputError names the file (from `sources`) and the first difference.
    Snapshots are matched by uniform-update count and labelled as in the first
    file. The `seed_dim` coordinate is each file's seed (its scalar `seed_dim`
    coordinate, else attribute `seed`, else the run config's train.seed) when every file
    has one, else 0..n-1. The `lr`
    coordinate, when present, becomes (seed, snapshot): seeds may have been
    diagnosed at different learning rates, which the summary warns about.
    Attributes shared by all files are kept; the rest are dropped, but for MACHINE_ATTRS,
    which become coordinates along `seed_dim` ('' where a file has none).
    """
    first, first_path = datasets[0], sources[0]
    if seed_dim in first.dims:
        raise _fail(first_path, "already combines several seeds; pass the per-seed files instead")
    for ds, path in zip(datasets[1:], sources[1:]):
        _check_same_experiment(first, first_path, ds, path, seed_dim)

    seeds = [_seed_of(ds, seed_dim) for ds in datasets]
    if any(seed is None for seed in seeds):
        seeds = list(range(len(datasets)))
    seen: dict[int, object] = {}
    for seed, path in zip(seeds, sources):
        if seed in seen:
            raise _fail(path, f"has the same seed ({seed}) as {seen[seed]}; the same run twice is not two seeds")
        seen[seed] = path

    # Snapshot labels and step counts may differ between seeds (run directories,
    # step offsets); the uniform-update count, checked equal above, is what matches them.
    relabelled = [
        ds.assign_coords(snapshot=first["snapshot"].values, step=("snapshot", first["step"].values)) for ds in datasets
    ]
    per_seed_coords = [name for name in ("lr",) if all(name in ds.coords for ds in relabelled)]
    combined = xr.concat(
        [ds.reset_coords(per_seed_coords).drop_vars(seed_dim, errors="ignore") for ds in relabelled],
        dim=xr.DataArray(seeds, dims=seed_dim, name=seed_dim),
        join="outer",
        combine_attrs="drop_conflicts",
        coords="minimal",
        compat="override",
    )
    combined.attrs = {key: value for key, value in combined.attrs.items() if key not in MACHINE_ATTRS}
    machines = {key: (seed_dim, [str(ds.attrs.get(key, "")) for ds in datasets]) for key in MACHINE_ATTRS}
    combined = combined.set_coords(per_seed_coords).assign_coords(machines)
    return describe_results(_canonical(combined, seed_dim))


def machines_by_seed(ds: xr.Dataset, *, seed_dim: str = "seed") -> list[tuple[int | None, dict, list]]:
    """(seed, the diagnosing machine, the machines that trained it) of each file of `ds`, as the
    files record them (MACHINE_ATTRS): one entry for a single file (seed None without one), one
    per seed for combined files; {} and [] where a file records none."""

    def parsed(text, empty):
        try:
            return json.loads(text) if text else empty
        except ValueError:
            return empty

    if seed_dim in ds.dims:
        return [
            (
                int(seed),
                parsed(str(ds["machine"].values[index]) if "machine" in ds.coords else "", {}),
                parsed(str(ds["trained_on"].values[index]) if "trained_on" in ds.coords else "", []),
            )
            for index, seed in enumerate(ds[seed_dim].values)
        ]
    seed = int(ds[seed_dim]) if seed_dim in ds.coords else None
    return [(seed, parsed(ds.attrs.get("machine", ""), {}), parsed(ds.attrs.get("trained_on", ""), []))]
