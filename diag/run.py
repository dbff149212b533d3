"""`depthdiag diagnose`: every (snapshot, batch) unit of several snapshot files
into one results file (docs/formats.md), durably and resumably.

Each finished unit is written atomically as its own small file in
`OUT.parts/`; when all are done they are assembled into OUT (atomically) and
the parts directory is removed. A manifest in the parts directory records the
settings and the snapshots' sha256, so `--resume` continues only the same
run, skipping every unit already on disk: a killed run loses at most the unit
in flight and, resumed, ends with the same file as an uninterrupted run. A
resume may drop or replace a snapshot none of whose units is on disk; one with
finished units must come back as the same file.

The run (under torchrun: rank 0) holds the lock of OUT (common/lock.py) from before it touches
anything until it ends; the lock covers OUT.parts/ too, so a second run on the same OUT, `--force`
included, is refused with the holder's pid and deletes nothing. A resumed run opens
every finished unit file before computing: a damaged one is deleted and computed again
(with a warning naming it), and a complete OUT whose parts directory survived (a kill
during the final cleanup) is recognised as complete. A unit with a non-finite NLL,
training loss or update RMS (a diverged snapshot) stops the run as bad input, naming the
snapshot file and the batch; that snapshot's finished units are deleted, every other
snapshot's are kept for a `--resume` without the file or with a replacement (with none
kept, the parts directory goes). Parts are deleted otherwise only by `--force` and once
OUT is complete.

Ordinary checkpoints (no `batches`) are accepted: their batches are the next
ones the run itself would have drawn, `build_source(cfg.data).batch(cfg.train.seed,
step + i, cfg.train.batch_size, cfg.train.seq_len)`.

In place of snapshot files, an adapter function (diag/adapter.py) may hand the run a model
from another codebase: it becomes the one entry along `snapshot`, with the sha256 of its
weights, optimizer state and tokens in place of a file's, through the same units, parts,
resume and results file. Snapshot folders that any training loop wrote with
`diag.save_snapshot` (diag/snapshot_folder.py) are entries of that kind too, one per folder.

Under torchrun (WORLD_SIZE > 1, `_diagnose_across_ranks`) the units are spread over the ranks,
one device each, into the same parts folder and the same results file as one process writes:
rank 0 alone holds OUT's lock, prepares and assembles; the ranks only exchange small messages
over a gloo group. Only snapshot and checkpoint files are spread.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from analysis.store import RESULTS_FILE, describe_results, write_dataset
from common.atomic import atomic_output, is_temporary, remove_stale_temporaries_in
from common.benefit import benefit_description
from common.errors import InputError
from common.lock import exclusive_output
from common.outputs import OutputKind, refuse_inputs, refuse_unrecognized
from common.progress import progress_bar
from common.provenance import describe_machine, provenance
from diag.engine import UpdateDiagnostic, bias_correction_message
from diag.entries import DiagnoseConfig, Entry, adapted_diagnostic, load_folder, run_entries, snapshot_options
from diag.evalset import evaluation_set
from diag.snapshot_loading import read_snapshot_folder
from trainer.checkpoint import Snapshot, is_sharded_folder, load_snapshot
from trainer.data import build_source
from trainer.distributed import World, init_world, resolve_device, shutdown_world
from trainer.machine import machine

MANIFEST = "manifest.json"

PER_UNIT = ("nll", "benefit", "benefit_all", "update_rms", "rms_scale", "update_cosine", "train_loss")
"""Variables with a value per (snapshot, batch) unit; nll_before is per snapshot."""

MUST_BE_FINITE = {"nll": "NLL", "nll_before": "NLL before the update", "train_loss": "loss", "update_rms": "update RMS"}
"""A unit's variables that are finite for any model that has not diverged (the cosine and the
RMS scales may be NaN for a zero update), with the words an error uses for them."""


def _manifest(config: DiagnoseConfig, entries: list[Entry], device: torch.device, world_size: int = 1) -> dict:
    """Everything that determines the results, to the last bit: a resumed run must agree
    on all of it (the device and the machine's kernels too, as kernels differ in their
    rounding, and for a sharded run the number of ranks, over which its sums are split)."""
    settings = {
        k: v
        for k, v in asdict(config).items()
        if k in ("update_depths", "serving_depths", "isolate", "rms_match", "lr", "eval_batch_size", "eval_set")
    }
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    if config.sharded:
        settings["sharded_over"] = world_size
    return {
        "settings": settings,
        "device": device.type,
        "machine": machine(device.type),
        "snapshots": [{"name": e.name, "sha256": e.sha256, "batches": e.batches} for e in entries],
    }


def _part_path(parts: Path, name: str, batch: int) -> Path:
    return parts / f"{name}.b{batch:05d}.h5"


def _finished_units(parts: Path, name: str, batches: int) -> list[Path]:
    return [path for path in (_part_path(parts, name, b) for b in range(batches)) if path.exists()]


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


def _prepare(config: DiagnoseConfig, entries: list[Entry], manifest: dict, out: Path, parts: Path) -> bool:
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
    if _non_finite(unit) is not None:
        return "non-finite values"
    return None


def _remove_damaged_parts(config: DiagnoseConfig, entries: list[Entry], parts: Path) -> list[Path]:
    """Delete every finished unit file that cannot be read back as its unit; return them."""
    damaged = []
    for entry in entries:
        for batch in range(entry.batches):
            path = _part_path(parts, entry.name, batch)
            if path.exists() and _part_problem(config, entry, batch, path) is not None:
                path.unlink()
                damaged.append(path)
    return damaged


def _non_finite(unit: xr.Dataset) -> str | None:
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


def _load_again(entry: Entry, *, shards: bool = True) -> Snapshot:
    snap = load_snapshot(entry.path, shards=shards)
    if snap.sha256 != entry.sha256:
        raise InputError(f"{entry.path}: the file changed while the run was going")
    return snap


def _batches(snap: Snapshot, indices: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
    """(i, batch i [B, T+1]) for each of `indices`: carried by the snapshot, or for a
    checkpoint the batches the run itself would have drawn next."""
    if snap.batches is not None:
        for i in indices:
            yield i, snap.batches[i]
        return
    cfg = snap.config
    source = build_source(cfg.data)
    for i in indices:
        yield i, source.batch(cfg.train.seed, snap.step + i, cfg.train.batch_size, cfg.train.seq_len)


def _open(
    config: DiagnoseConfig, entry: Entry, device: torch.device, indices: list[int]
) -> tuple[UpdateDiagnostic, torch.optim.Optimizer, Iterator[tuple[int, torch.Tensor]]]:
    """The entry's diagnostic, its optimizer, and its batches (i, batch i) for `indices`."""
    if entry.adapted is not None:
        batches = entry.adapted.batches
        return entry.diagnostic, entry.adapted.optimizer, ((i, batches[i]) for i in indices)
    if entry.snapshot_folder:
        adapted = load_folder(config, read_snapshot_folder(entry.path))
        if adapted.fingerprint() != entry.sha256:
            raise InputError(f"{entry.path}: the snapshot folder changed while the run was going")
        batches = adapted.batches
        return adapted_diagnostic(config, adapted), adapted.optimizer, ((i, batches[i]) for i in indices)
    snap = _load_again(entry)
    model = snap.model(device)
    optimizer = snap.optimizer(model)
    eval_tokens, eval_mask = _evaluation_set(config, snap)
    diagnostic = UpdateDiagnostic(model, optimizer, eval_tokens, snapshot_options(config, snap), eval_mask=eval_mask)
    return diagnostic, optimizer, _batches(snap, indices)


def _run_units(config: DiagnoseConfig, entries: list[Entry], parts: Path, device: torch.device) -> None:
    todo = {e.name: [i for i in range(e.batches) if not _part_path(parts, e.name, i).exists()] for e in entries}
    total = sum(e.batches for e in entries)
    done = total - sum(len(v) for v in todo.values())
    with progress_bar(total, f"diagnose {config.out}", "unit", initial=done, enabled=config.progress) as bar:
        for entry in entries:
            if not todo[entry.name]:
                continue
            diagnostic, optimizer, batches = _open(config, entry, device, todo[entry.name])
            warning = bias_correction_message(optimizer)
            if warning:
                bar.write(f"warning: {entry.path}: {warning}")
            for i, batch in batches:
                bar.set_postfix_str(f"{entry.name} batch {i}")
                unit = diagnostic.compare(batch)
                problem = _non_finite(unit)
                if problem is not None:
                    raise _diverged(entries, entry, i, problem, parts)
                write_dataset(unit.expand_dims(snapshot=[entry.name], batch=[i]), _part_path(parts, entry.name, i))
                bar.update(1)
            del diagnostic, optimizer, batches


def _diverged(entries: list[Entry], entry: Entry, batch: int, problem: str, parts: Path) -> InputError:
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


def _evaluation_set(config: DiagnoseConfig, snap: Snapshot) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(eval_tokens, eval_mask) for the chosen evaluation set."""
    return evaluation_set(config.eval_set, snap.config, snap.eval_tokens)


def _run_seed(entries: list[Entry]) -> int | None:
    """The training seed every snapshot's run shares (None when they differ, or for a model
    from an adapter, whose config records no training run)."""
    seeds = {json.loads(e.config_json).get("train", {}).get("seed") for e in entries}
    return int(seeds.pop()) if len(seeds) == 1 and None not in seeds else None


def _assemble(config: DiagnoseConfig, entries: list[Entry], manifest: dict, parts: Path) -> xr.Dataset:
    n_batch = max(e.batches for e in entries)
    arrays: dict[str, np.ndarray] = {}
    dims: dict[str, tuple[str, ...]] = {}
    nll_before = None
    for s, entry in enumerate(entries):
        for b in range(entry.batches):
            with xr.open_dataset(_part_path(parts, entry.name, b), engine="h5netcdf") as unit:
                unit = unit.load().isel(snapshot=0, batch=0)
            if nll_before is None:
                nll_before = np.full((len(entries), unit.sizes["serving_depth"]), np.nan)
                for name in PER_UNIT:
                    if name in unit:
                        dims[name] = ("snapshot", "batch") + unit[name].dims
                        arrays[name] = np.full((len(entries), n_batch) + unit[name].shape, np.nan)
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
        # stream, diag/engine.py CRN_SEED); units of runs from before the check count as 0.
        "random_forward": int(unit_attrs.get("random_forward", 0)),
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


def _device(config: DiagnoseConfig, entries: list[Entry]) -> torch.device:
    """The device the units run on: --device for snapshot files; for an adapter, the one its
    model is on (moving a caller's model would change it)."""
    adapted = entries[0].adapted
    if adapted is None:
        return resolve_device(config.device)
    device = entries[0].diagnostic.device
    if config.device != "auto" and config.device != device.type:
        raise InputError(
            f"--adapter {config.adapter}: --device {config.device}, but the adapter's model is on {device.type}; "
            "the adapter puts the model on its device (e.g. through an --adapter-arg)"
        )
    return device


def diagnose(config: DiagnoseConfig) -> Path:
    """Run every unit of `config` and write the results file; returns its path. Under torchrun
    (WORLD_SIZE > 1) every rank calls this and the units are spread over them."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _diagnose_across_ranks(config)
    if config.sharded:
        raise InputError(
            "--sharded shards the model over torchrun's ranks: run the command under torchrun with "
            "--nproc_per_node=2 or more (docs/scaling.md)"
        )
    out = Path(config.out)
    parts = out.with_name(out.name + ".parts")
    refuse_inputs(out, config.snapshots)
    entries = run_entries(config)
    config = replace(config, eval_set=entries[0].eval_set)
    device = _device(config, entries)
    manifest = _manifest(config, entries, device)
    # Taken before anything on disk is looked at or deleted, held to the end.
    with exclusive_output(out):
        if config.force or config.resume:
            # What --force replaces or --resume keeps must be a results file; without either
            # flag `_prepare` refuses an existing OUT.
            refuse_unrecognized(out, kind=RESULTS_FILE)
        if not _prepare(config, entries, manifest, out, parts):
            return out
        _run_units(config, entries, parts, device)
        write_dataset(_assemble(config, entries, manifest, parts), out)
        shutil.rmtree(parts)
    return out


# --- across ranks -------------------------------------------------------------------------------
#
# Every rank builds the same entries and manifest (checked: they are gathered and compared).
# Rank 0 alone takes OUT's lock and holds it to the end; the other ranks never take it, as the
# lock is per process and they write only unit files into the parts folder rank 0 prepared,
# atomically and under their own names, as one process does. Rank 0 hands the ordered list of
# units to do to every rank; unit k goes to rank k % N. The ranks go through the list in
# rounds of N units and after each round share how theirs went, so that a non-finite unit or
# an error on one rank stops all of them at once, each with the same one-line error, and
# nobody writes while rank 0 deletes a diverged snapshot's units. A unit does not depend on
# which process computes it or on the units computed before it (the resume relies on this
# too), so the file is the one a single process writes.


def _diagnose_across_ranks(config: DiagnoseConfig) -> Path:
    """`diagnose` on this rank of torchrun's process group (see the comment above)."""
    if (
        config.adapter is not None
        or config.hf is not None
        or any(Path(p).is_dir() and not is_sharded_folder(p) for p in config.snapshots)
    ):
        given = "--adapter" if config.adapter else "--hf" if config.hf else "snapshot folders"
        raise InputError(
            f"{given}: under torchrun only snapshot or checkpoint files are spread over the ranks; "
            "diagnose this model in one process"
        )
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if resolve_device(config.device).type == "cuda" and local_ranks > torch.cuda.device_count():
        # Every rank sees the same counts and so refuses here, before any waits for the others.
        raise InputError(
            f"{local_ranks} ranks on this machine but {torch.cuda.device_count()} CUDA device(s): one each is needed "
            "(fewer ranks, or --device cpu)"
        )
    out = Path(config.out)
    parts = out.with_name(out.name + ".parts")
    # Spread units: gloo even on CUDA, as the group only carries small CPU objects, never
    # tensors of the models. Sharded: the device's own backend carries the model's shards.
    world = init_world(config.device, backend=None if config.sharded else "gloo")
    try:
        entries, manifest, error = None, None, None
        try:
            refuse_inputs(out, config.snapshots)
            entries = run_entries(config)
            config = replace(config, eval_set=entries[0].eval_set)
            manifest = _manifest(config, entries, world.device, world.world_size)
        except (InputError, OSError) as err:
            error = err
        _agree(world, out, error, manifest)
        with contextlib.ExitStack() as stack:

            def prepare() -> list[tuple[str, int]] | None:
                # Taken before anything on disk is looked at or deleted, held to the end.
                stack.enter_context(exclusive_output(out))
                if config.force or config.resume:
                    refuse_unrecognized(out, kind=RESULTS_FILE)
                if not _prepare(config, entries, manifest, out, parts):
                    return None
                return [
                    (e.name, i) for e in entries for i in range(e.batches) if not _part_path(parts, e.name, i).exists()
                ]

            todo = _on_main(world, prepare)
            if todo is None:
                return out
            if config.sharded:
                _run_sharded(config, entries, parts, world, todo)
            else:
                _run_share(config, entries, parts, world, todo)

            def assemble() -> None:
                write_dataset(_assemble(config, entries, manifest, parts), out)
                shutil.rmtree(parts)

            _on_main(world, assemble)
        return out
    finally:
        shutdown_world(world)


def _gather(world: World, value: object) -> list:
    """Every rank's `value` (a small picklable object), in rank order."""
    values = [None] * world.world_size
    torch.distributed.all_gather_object(values, value)
    return values


def _from_main(world: World, value: object) -> object:
    """Rank 0's `value`, on every rank."""
    box = [value if world.is_main else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _error_line(err: InputError | OSError) -> str:
    """The one line an error is reported with ('PATH: reason' for an OS error)."""
    if isinstance(err, OSError) and err.filename:
        return f"{err.filename}: {err.strerror or err}"
    return str(err)


def _agree(world: World, out: Path, error: InputError | OSError | None, manifest: dict | None) -> None:
    """Raise on every rank when one could not build the run or built another one than rank 0:
    the failing rank its own error, the others its line."""
    reports = _gather(world, (None if error is None else _error_line(error), manifest))
    if error is not None:
        raise error
    for rank, (message, other) in enumerate(reports):
        if message is not None:
            raise InputError(message)
        if other != reports[0][1]:
            raise InputError(f"{out}: rank {rank} sees other snapshot files or settings than rank 0")


def _on_main(world: World, work):
    """`work()` on rank 0, its result on every rank; its InputError or OS error is raised on
    every rank (the same line), so that none waits for a rank 0 that has given up."""
    result, message, failure = None, None, None
    if world.is_main:
        try:
            result = work()
        except (InputError, OSError) as err:
            message, failure = _error_line(err), err
    result, message = _from_main(world, (result, message))
    if message is not None:
        raise failure if world.is_main else InputError(message)
    return result


def _run_share(
    config: DiagnoseConfig, entries: list[Entry], parts: Path, world: World, todo: list[tuple[str, int]]
) -> None:
    """Compute this rank's units of `todo` (unit k is rank k % N's) into `parts`, in rounds of
    one unit per rank; stop every rank after the round in which one failed."""
    by_name = {e.name: e for e in entries}
    mine = todo[world.rank :: world.world_size]
    # The rank computing an entry's first unit to do warns about it, so each warning shows once.
    first_owner = {}
    for k, (name, _) in enumerate(todo):
        first_owner.setdefault(name, k % world.world_size)
    total = sum(e.batches for e in entries)
    rounds = -(-len(todo) // world.world_size)
    opened, batches = None, None
    enabled = config.progress and world.is_main
    with progress_bar(total, f"diagnose {config.out}", "unit", initial=total - len(todo), enabled=enabled) as bar:
        for r in range(rounds):
            status, failure = None, None
            if r < len(mine):
                name, i = mine[r]
                entry = by_name[name]
                try:
                    if opened != name:
                        diagnostic = optimizer = batches = None  # one model in memory at a time
                        indices = [b for n, b in mine if n == name]
                        diagnostic, optimizer, batches = _open(config, entry, world.device, indices)
                        opened = name
                        warning = bias_correction_message(optimizer)
                        if warning and first_owner[name] == world.rank:
                            bar.write(f"warning: {entry.path}: {warning}")
                    bar.set_postfix_str(f"{name} batch {i}")
                    _, batch = next(batches)  # batch i: the iterator follows `mine`
                    unit = diagnostic.compare(batch)
                    problem = _non_finite(unit)
                    if problem is None:
                        write_dataset(unit.expand_dims(snapshot=[name], batch=[i]), _part_path(parts, name, i))
                        status = "done"
                    else:
                        status = ("diverged", r * world.world_size + world.rank, name, i, problem)
                except (InputError, OSError) as err:
                    failure = err
                    status = ("error", r * world.world_size + world.rank, _error_line(err))
            statuses = _gather(world, status)
            bar.update(statuses.count("done"))
            failed = sorted((s for s in statuses if isinstance(s, tuple)), key=lambda s: s[1])
            if failed:
                _stop(world, entries, parts, failed[0], failure)


def _run_sharded(
    config: DiagnoseConfig, entries: list[Entry], parts: Path, world: World, todo: list[tuple[str, int]]
) -> None:
    """Compute every unit of `todo` with all ranks together, each snapshot's model and
    optimizer state sharded over them (diag/sharded.py); rank 0 writes the unit files. Every
    rank computes the same reduced numbers, so a non-finite unit or a bad input stops all of
    them at the same unit; an error on one rank alone (its file system) stops the others at
    the next unit's check."""
    by_name = {e.name: e for e in entries}
    total = sum(e.batches for e in entries)
    opened, diagnostic, batches = None, None, None
    enabled = config.progress and world.is_main
    with progress_bar(total, f"diagnose {config.out}", "unit", initial=total - len(todo), enabled=enabled) as bar:
        for name, i in todo:
            entry = by_name[name]
            status, failure = None, None
            try:
                if opened != name:
                    diagnostic = batches = None  # one model in memory at a time
                    indices = [b for n, b in todo if n == name]
                    diagnostic, optimizer, batches = _open_sharded(config, entry, world, indices)
                    opened = name
                    warning = bias_correction_message(optimizer)
                    if warning and world.is_main:
                        bar.write(f"warning: {entry.path}: {warning}")
                    del optimizer
                bar.set_postfix_str(f"{name} batch {i}")
                _, batch = next(batches)
                unit = diagnostic.compare(batch)
                problem = _non_finite(unit)
                if problem is not None:
                    status = ("diverged", 0, name, i, problem)
                elif world.is_main:
                    write_dataset(unit.expand_dims(snapshot=[name], batch=[i]), _part_path(parts, name, i))
            except (InputError, OSError) as err:
                failure = err
                status = ("error", world.rank, _error_line(err))
            statuses = _gather(world, status)
            failed = [s for s in statuses if s is not None]
            if failed:
                _stop(world, entries, parts, failed[0], failure)
            bar.update(1)


def _open_sharded(
    config: DiagnoseConfig, entry: Entry, world: World, indices: list[int]
) -> tuple[UpdateDiagnostic, torch.optim.Optimizer, Iterator[tuple[int, torch.Tensor]]]:
    """`_open` for the sharded diagnostic: the snapshot's model and optimizer sharded over the ranks."""
    from diag.sharded import ShardedUpdateDiagnostic, sharded_snapshot

    # A sharded folder's shards go straight into the sharded model, never whole on a rank.
    snap = _load_again(entry, shards=not is_sharded_folder(entry.path))
    model, optimizer = sharded_snapshot(snap, world)
    eval_tokens, eval_mask = _evaluation_set(config, snap)
    options = snapshot_options(config, snap)
    diagnostic = ShardedUpdateDiagnostic(model, optimizer, eval_tokens, options, eval_mask=eval_mask)
    return diagnostic, optimizer, _batches(snap, indices)


def _stop(world: World, entries: list[Entry], parts: Path, first: tuple, failure: BaseException | None) -> None:
    """Raise on every rank the error of the first failed unit (in the order of the units to
    do); for a non-finite unit rank 0 deletes the snapshot's units as one process does."""
    if first[0] == "error":
        if failure is not None and first[1] % world.world_size == world.rank:
            raise failure
        raise InputError(first[2])
    _, _, name, batch, problem = first
    entry = next(e for e in entries if e.name == name)
    message = str(_diverged(entries, entry, batch, problem, parts)) if world.is_main else None
    raise InputError(_from_main(world, message))
