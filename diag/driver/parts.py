"""The parts folder of a diagnose run and the results file assembled from it.

Each finished unit is written atomically as its own small file in `OUT.parts/`, beside a
manifest of everything that determines the results (`run_manifest`); a resume continues only
the same run, after deleting damaged unit files; a unit with a non-finite number stops the run
(`diverged_error`); the finished units become OUT (`assemble_results`).
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from analysis.store import describe_results
from common.atomic import atomic_output, is_temporary, remove_stale_temporaries_in
from common.benefit import benefit_description
from common.errors import InputError
from common.outputs import OutputKind, refuse_unrecognized
from common.provenance import describe_machine, provenance
from diag.arithmetic.attribution import ATTRIBUTION_VARIABLES
from diag.sources.inputs import DiagnoseConfig, Entry
from trainer.machine import machine

MANIFEST = "manifest.json"


PER_UNIT = ("nll", "benefit", "benefit_all", "update_rms", "rms_scale", "update_cosine", "train_loss")
"""Variables with a value per (snapshot, batch) unit; nll_before is per snapshot."""

BASE_DIMS = ("snapshot", "batch", "update_depth", "serving_depth")
"""A unit's dimensions besides its own (groupings', examples')."""


def extra_variables(unit: xr.Dataset) -> list[str]:
    """A unit's variables by group of the evaluation targets (nll_by_X, nll_before_by_X,
    targets_by_X) and its attribution's (attribution, linear_benefit, clip_coefficient,
    example_tokens): per unit in the results, along coordinates of their own."""
    prefixes = ("nll_by_", "nll_before_by_", "targets_by_")
    return [str(name) for name in unit.data_vars if str(name).startswith(prefixes) or name in ATTRIBUTION_VARIABLES]


MUST_BE_FINITE = {"nll": "NLL", "nll_before": "NLL before the update", "train_loss": "loss", "update_rms": "update RMS"}
"""A unit's variables that are finite for any model that has not diverged (the cosine and the
RMS scales may be NaN for a zero update), with the words an error uses for them."""


def run_manifest(config: DiagnoseConfig, entries: list[Entry], device: torch.device, world_size: int = 1) -> dict:
    """Everything that determines the results, to the last bit: a resumed run must agree
    on all of it (the device and the machine's kernels too, as kernels differ in their
    rounding, and for a sharded run the number of ranks, over which its sums are split)."""
    settings = {
        k: v
        for k, v in asdict(config).items()
        if k in ("update_depths", "serving_depths", "isolate", "rms_match", "lr", "eval_batch_size", "eval_set")
    }
    # Absent when not asked for: a run without them resumes the files of older runs.
    if config.groupings:
        settings["groupings"] = list(config.groupings)
    if config.attribute:
        settings.update(attribute=True, pool=config.pool)
    if config.removal_depth is not None:
        settings["removal_depth"] = config.removal_depth
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    if config.sharded:
        settings["sharded_over"] = world_size
    return {
        "settings": settings,
        "device": device.type,
        "machine": machine(device.type),
        "snapshots": [{"name": e.name, "sha256": e.sha256, "batches": e.batches} for e in entries],
    }


def part_path(parts: Path, name: str, batch: int) -> Path:
    return parts / f"{name}.b{batch:05d}.h5"


def _finished_units(parts: Path, name: str, batches: int) -> list[Path]:
    return [path for path in (part_path(parts, name, b) for b in range(batches)) if path.exists()]


def _write_json(value: dict, path: Path) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(value, sort_keys=True, indent=1), encoding="utf-8")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_PART_NAME = re.compile(r".+\.b\d{5}\.h5")


def _is_parts_folder(parts: Path) -> bool:
    """An OUT.parts/ diagnose wrote: its manifest, unit files and temporaries of them alone."""
    return parts.is_dir() and all(
        entry.name == MANIFEST or _PART_NAME.fullmatch(entry.name) or is_temporary(entry.name)
        for entry in parts.iterdir()
    )


PARTS_FOLDER = OutputKind("diagnose parts folder", _is_parts_folder, folder=True)
"""What `--force` may discard beside OUT: the finished units of an earlier run on OUT."""


def prepare_parts(config: DiagnoseConfig, entries: list[Entry], manifest: dict, out: Path, parts: Path) -> bool:
    """Check what is on disk against the flags; return False when OUT already holds this run.
    Called with OUT's lock held: nothing here can belong to a live run."""
    if parts.exists():
        if config.force:
            refuse_unrecognized(parts, kind=PARTS_FOLDER)
            shutil.rmtree(parts)
        elif not config.resume:
            raise InputError(
                f"{parts}: an unfinished diagnose run is here; pass --resume to continue it or --force to start over"
            )
        elif out.exists() and _finished_manifest(out) == manifest:
            # Killed while removing the parts of a run that had written OUT: finish the cleanup.
            shutil.rmtree(parts)
            _say(f"{out}: already complete; removed {parts}, left over from the end of that run")
            return False
        else:
            try:
                stored = json.loads((parts / MANIFEST).read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                raise InputError(f"{parts}: no readable {MANIFEST}; pass --force to start over") from None
            problem = _resume_problem(stored, manifest, parts)
            if problem is not None:
                raise InputError(f"{parts}: {problem}; rerun it with those or pass --force to start over")
            if stored != manifest:
                _write_json(manifest, parts / MANIFEST)
            remove_stale_temporaries_in(parts)
            damaged = _remove_damaged_parts(config, entries, parts)
            if damaged:
                _say(
                    f"warning: {parts}: {len(damaged)} damaged unit file(s) deleted, to be computed again: "
                    + ", ".join(path.name for path in damaged)
                )
            return True
    if out.exists() and not config.force:
        if config.resume and _finished_manifest(out) == manifest:
            return False
        raise InputError(f"{out}: already exists; pass --force to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    parts.mkdir()
    _write_json(manifest, parts / MANIFEST)
    return True


def _resume_problem(stored: object, manifest: dict, parts: Path) -> str | None:
    """Why this run (`manifest`) cannot continue the unfinished one of `parts` (`stored`), None
    when it can. The settings, device and machine are the same; every snapshot with finished units
    is again one of the run's, the same file with the same batches. A snapshot without any
    (the one a non-finite unit stopped) may be left out or replaced: nothing of it is lost."""
    if not isinstance(stored, dict) or not isinstance(stored.get("snapshots"), list):
        return f"no readable {MANIFEST}"
    if stored.get("machine") != manifest["machine"]:
        # Units of two kernel sets in one file would mix their rounding, unrecorded.
        return (
            f"the unfinished run computed its units on {describe_machine(stored.get('machine'))}, "
            f"this one would on {describe_machine(manifest['machine'])}"
        )
    if {k: v for k, v in stored.items() if k != "snapshots"} != {k: v for k, v in manifest.items() if k != "snapshots"}:
        return "the unfinished run used other settings"
    for record in stored["snapshots"]:
        try:
            finished = _finished_units(parts, record["name"], record["batches"])
        except (KeyError, TypeError):
            return f"no readable {MANIFEST}"
        if finished and record not in manifest["snapshots"]:
            return (
                f"the unfinished run has {len(finished)} finished unit(s) of {record['name']!r}, "
                "which this run does not diagnose as the same file with the same batches"
            )
    return None


def _part_problem(config: DiagnoseConfig, entry: Entry, batch: int, path: Path) -> str | None:
    """Why the unit file `path` cannot be assembled (None: it can)."""
    try:
        with xr.open_dataset(path, engine="h5netcdf") as unit:
            unit = unit.load()
    except (OSError, ValueError, KeyError, TypeError) as err:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    if unit.sizes.get("snapshot") != 1 or unit.sizes.get("batch") != 1:
        return "not one unit"
    if str(unit["snapshot"].values[0]) != entry.name or int(unit["batch"].values[0]) != batch:
        return "another unit's file"
    for coord, expected in (("update_depth", config.update_depths), ("serving_depth", config.serving_depths)):
        if coord not in unit.coords or unit[coord].values.tolist() != list(expected):
            return f"other {coord}s"
    for name in ("nll", "benefit", "update_rms", "rms_scale", "update_cosine", *MUST_BE_FINITE):
        if name not in unit:
            return f"no variable {name!r}"
    if non_finite(unit) is not None:
        return "non-finite values"
    return None


def _remove_damaged_parts(config: DiagnoseConfig, entries: list[Entry], parts: Path) -> list[Path]:
    """Delete every finished unit file that cannot be read back as its unit; return them."""
    damaged = []
    for entry in entries:
        for batch in range(entry.batches):
            path = part_path(parts, entry.name, batch)
            if path.exists() and _part_problem(config, entry, batch, path) is not None:
                path.unlink()
                damaged.append(path)
    return damaged


def non_finite(unit: xr.Dataset) -> str | None:
    """'NLL (nan)' for the first of a unit's must-be-finite variables that holds a NaN or an
    infinity, None when all are finite."""
    for name, words in MUST_BE_FINITE.items():
        values = np.asarray(unit[name].values, dtype=np.float64)
        bad = values[~np.isfinite(values)]
        if bad.size:
            return f"{words} ({bad[0]})"
    return None


def _finished_manifest(out: Path) -> dict | None:
    try:
        with xr.open_dataset(out, engine="h5netcdf") as ds:
            return json.loads(ds.attrs["diagnose_manifest"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def diverged_error(entries: list[Entry], entry: Entry, batch: int, problem: str, parts: Path) -> InputError:
    """The error that stops the run at `entry`'s non-finite unit `batch`. The entry's finished
    units are deleted: they can never be assembled, as the same file fails again at this batch
    and a replacement is another file. Every other snapshot's finished units are the user's
    work, kept for a resume without the file or with a new one."""
    for path in _finished_units(parts, entry.name, entry.batches):
        path.unlink()
    kept = sum(len(_finished_units(parts, e.name, e.batches)) for e in entries if e is not entry)
    what = (
        f"{entry.path}: batch {batch}: non-finite {problem}; the snapshot's model has diverged "
        "or its update overflows, so it cannot be diagnosed"
    )
    if not kept:
        shutil.rmtree(parts)
        return InputError(f"{what} (nothing written)")
    return InputError(
        f"{what}; the {kept} finished unit(s) of the other snapshots are kept in {parts}: "
        f"remove or replace {entry.path} and rerun with --resume"
    )


def _run_seed(entries: list[Entry]) -> int | None:
    """The training seed every snapshot's run shares (None when they differ, or for a model
    from an adapter, whose config records no training run)."""
    seeds = {json.loads(e.config_json).get("train", {}).get("seed") for e in entries}
    return int(seeds.pop()) if len(seeds) == 1 and None not in seeds else None


def assemble_results(config: DiagnoseConfig, entries: list[Entry], manifest: dict, parts: Path) -> xr.Dataset:
    n_batch = max(e.batches for e in entries)
    arrays: dict[str, np.ndarray] = {}
    dims: dict[str, tuple[str, ...]] = {}
    nll_before = None
    for s, entry in enumerate(entries):
        for b in range(entry.batches):
            with xr.open_dataset(part_path(parts, entry.name, b), engine="h5netcdf") as unit:
                unit = unit.load().isel(snapshot=0, batch=0)
            if nll_before is None:
                nll_before = np.full((len(entries), unit.sizes["serving_depth"]), np.nan)
                for name in (*PER_UNIT, *extra_variables(unit)):
                    if name in unit:
                        dims[name] = ("snapshot", "batch") + unit[name].dims
                        # Counts and token ids stay integers (-1 where a snapshot has fewer batches).
                        integer = unit[name].dtype.kind in "iu"
                        shape = (len(entries), n_batch) + unit[name].shape
                        arrays[name] = np.full(shape, -1, dtype=np.int64) if integer else np.full(shape, np.nan)
                # Group labels, examples: the coordinates of a unit's own dimensions.
                extra_coords = {
                    name: (coord.dims, coord.values)
                    for name, coord in unit.coords.items()
                    if coord.dims and not set(coord.dims) & set(BASE_DIMS)
                }
                unit_attrs = dict(unit.attrs)
            if b == 0:
                nll_before[s] = unit["nll_before"].values
            for name in arrays:
                arrays[name][s, b] = unit[name].values
    variables = {name: (dims[name], arrays[name]) for name in arrays}
    variables["nll_before"] = (("snapshot", "serving_depth"), nll_before)
    coords = {
        "snapshot": [e.name for e in entries],
        "uniform_updates": ("snapshot", np.array([e.uniform_updates for e in entries], dtype=np.int64)),
        "step": ("snapshot", np.array([e.step for e in entries], dtype=np.int64)),
        "lr": ("snapshot", np.array([e.lr for e in entries], dtype=np.float64)),
        "batch": np.arange(n_batch, dtype=np.int64),
        "update_depth": np.array(config.update_depths, dtype=np.int64),
        "serving_depth": np.array(config.serving_depths, dtype=np.int64),
        **extra_coords,  # names a grouping may not take (RESERVED_NAMES) never clash
    }
    seed = _run_seed(entries)
    if seed is not None:
        coords["seed"] = np.int64(seed)
    configs = {e.name: e.config_json for e in entries}
    attrs = {
        "config": entries[0].config_json,
        "isolate": config.isolate,
        "rms_match": config.rms_match,
        "eval_set": config.eval_set,
        "lr_override": float(config.lr) if config.lr is not None else "none",
        "optimizer": str(unit_attrs["optimizer"]),
        "grad_clip": float(unit_attrs["grad_clip"]),
        "precision": str(unit_attrs["precision"]),
        # 1 when the model's forward draws random numbers (every forward then ran from one fixed
        # stream, diag/arithmetic/engine.py CRN_SEED); units of runs from before the check count as 0.
        "random_forward": int(unit_attrs.get("random_forward", 0)),
        **({"removal_depth": int(config.removal_depth)} if config.removal_depth is not None else {}),
        **provenance(),
        # The machine of the units' kernels; what trained the snapshots, where they record it.
        "machine": manifest["machine"],
        "trained_on": _trained_on(entries),
        "snapshot_sha256": json.dumps({e.name: e.sha256 for e in entries}, sort_keys=True),
        "snapshot_paths": json.dumps({e.name: e.path for e in entries}, sort_keys=True),
        "batch_source": json.dumps({e.name: e.batch_source for e in entries}, sort_keys=True),
        "diagnose_manifest": json.dumps(manifest, sort_keys=True),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    for key in ("model_family", "backprop"):
        if key in unit_attrs:
            attrs[key] = str(unit_attrs[key])
    if entries[0].optimizer_state is not None:
        attrs["optimizer_state"] = entries[0].optimizer_state
    if len(set(configs.values())) > 1:
        attrs["snapshot_configs"] = json.dumps({k: json.loads(v) for k, v in configs.items()}, sort_keys=True)
    ds = xr.Dataset(variables, coords=coords, attrs=attrs)
    ds["benefit"].attrs["description"] = benefit_description(config.update_depths[0], config.update_depths[-1])
    return describe_results(ds)


def _trained_on(entries: list[Entry]) -> list[dict]:
    """The distinct machines that trained the snapshots, in the order they first appear."""
    machines: list[dict] = []
    for entry in entries:
        machines += [record for record in entry.trained_on if record not in machines]
    return machines
