"""`depthdiag diagnose` under torchrun (WORLD_SIZE > 1): the units spread over the ranks, one
device each, or with `--sharded` every unit computed by all ranks together on a model sharded
over them; into the same parts folder and the same results file as one process writes.

Every rank builds the same entries and manifest (checked: they are gathered and compared).
Rank 0 alone takes OUT's lock and holds it to the end; the other ranks never take it, as the
lock is per process and they write only unit files into the parts folder rank 0 prepared,
atomically and under their own names, as one process does. Rank 0 hands the ordered list of
units to do to every rank; unit k goes to rank k % N. The ranks go through the list in
rounds of N units and after each round share how theirs went, so that a non-finite unit or
an error on one rank stops all of them at once, each with the same one-line error, and
nobody writes while rank 0 deletes a diverged snapshot's units. A unit does not depend on
which process computes it or on the units computed before it (the resume relies on this
too), so the file is the one a single process writes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from analysis.store import RESULTS_FILE, write_dataset
from common.errors import InputError
from common.lock import exclusive_output
from common.outputs import refuse_inputs, refuse_unrecognized
from common.progress import progress_bar
from diag.arithmetic.model_checks import bias_correction_message
from diag.driver.parts import assemble_results, diverged_error, non_finite, part_path, prepare_parts, run_manifest
from diag.sources.entries import open_entry, run_entries
from diag.sources.inputs import DiagnoseConfig, Entry
from trainer.checkpoint import is_sharded_folder
from trainer.distributed import World, init_world, resolve_device, shutdown_world


def diagnose_across_ranks(config: DiagnoseConfig) -> Path:
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
            manifest = run_manifest(config, entries, world.device, world.world_size)
        except (InputError, OSError) as err:
            error = err
        _agree(world, out, error, manifest)
        with contextlib.ExitStack() as stack:

            def prepare() -> list[tuple[str, int]] | None:
                # Taken before anything on disk is looked at or deleted, held to the end.
                stack.enter_context(exclusive_output(out))
                if config.force or config.resume:
                    refuse_unrecognized(out, kind=RESULTS_FILE)
                if not prepare_parts(config, entries, manifest, out, parts):
                    return None
                return [
                    (e.name, i) for e in entries for i in range(e.batches) if not part_path(parts, e.name, i).exists()
                ]

            todo = _on_main(world, prepare)
            if todo is None:
                return out
            if config.sharded:
                _run_sharded(config, entries, parts, world, todo)
            else:
                _run_share(config, entries, parts, world, todo)

            def assemble() -> None:
                write_dataset(assemble_results(config, entries, manifest, parts), out)
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


def error_line(err: InputError | OSError) -> str:
    """The one line an error is reported with ('PATH: reason' for an OS error)."""
    if isinstance(err, OSError) and err.filename:
        return f"{err.filename}: {err.strerror or err}"
    return str(err)


def _agree(world: World, out: Path, error: InputError | OSError | None, manifest: dict | None) -> None:
    """Raise on every rank when one could not build the run or built another one than rank 0:
    the failing rank its own error, the others its line."""
    reports = _gather(world, (None if error is None else error_line(error), manifest))
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
            message, failure = error_line(err), err
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
    opened, diagnostic, adapted = None, None, None
    enabled = config.progress and world.is_main
    with progress_bar(total, f"diagnose {config.out}", "unit", initial=total - len(todo), enabled=enabled) as bar:
        for r in range(rounds):
            status, failure = None, None
            if r < len(mine):
                name, i = mine[r]
                entry = by_name[name]
                try:
                    if opened != name:
                        diagnostic = adapted = None  # one model in memory at a time
                        diagnostic, adapted = open_entry(config, entry, world.device)
                        opened = name
                        warning = bias_correction_message(adapted.optimizer)
                        if warning and first_owner[name] == world.rank:
                            bar.write(f"warning: {entry.path}: {warning}")
                    bar.set_postfix_str(f"{name} batch {i}")
                    batch = adapted.batches[i]
                    unit = diagnostic.compare(batch)
                    problem = non_finite(unit)
                    if problem is None:
                        write_dataset(unit.expand_dims(snapshot=[name], batch=[i]), part_path(parts, name, i))
                        status = "done"
                    else:
                        status = ("diverged", r * world.world_size + world.rank, name, i, problem)
                except (InputError, OSError) as err:
                    failure = err
                    status = ("error", r * world.world_size + world.rank, error_line(err))
            statuses = _gather(world, status)
            bar.update(statuses.count("done"))
            failed = sorted((s for s in statuses if isinstance(s, tuple)), key=lambda s: s[1])
            if failed:
                _stop(world, entries, parts, failed[0], failure)


def _run_sharded(
    config: DiagnoseConfig, entries: list[Entry], parts: Path, world: World, todo: list[tuple[str, int]]
) -> None:
    """Compute every unit of `todo` with all ranks together, each snapshot's model and
    optimizer state sharded over them (diag/arithmetic/sharded.py); rank 0 writes the unit files. Every
    rank computes the same reduced numbers, so a non-finite unit or a bad input stops all of
    them at the same unit; an error on one rank alone (its file system) stops the others at
    the next unit's check."""
    by_name = {e.name: e for e in entries}
    total = sum(e.batches for e in entries)
    opened, diagnostic, adapted = None, None, None
    enabled = config.progress and world.is_main
    with progress_bar(total, f"diagnose {config.out}", "unit", initial=total - len(todo), enabled=enabled) as bar:
        for name, i in todo:
            entry = by_name[name]
            status, failure = None, None
            try:
                if opened != name:
                    diagnostic = adapted = None  # one model in memory at a time
                    diagnostic, adapted = open_entry(config, entry, world.device, world)
                    opened = name
                    warning = bias_correction_message(adapted.optimizer)
                    if warning and world.is_main:
                        bar.write(f"warning: {entry.path}: {warning}")
                bar.set_postfix_str(f"{name} batch {i}")
                batch = adapted.batches[i]
                unit = diagnostic.compare(batch)
                problem = non_finite(unit)
                if problem is not None:
                    status = ("diverged", 0, name, i, problem)
                elif world.is_main:
                    write_dataset(unit.expand_dims(snapshot=[name], batch=[i]), part_path(parts, name, i))
            except (InputError, OSError) as err:
                failure = err
                status = ("error", world.rank, error_line(err))
            statuses = _gather(world, status)
            failed = [s for s in statuses if s is not None]
            if failed:
                _stop(world, entries, parts, failed[0], failure)
            bar.update(1)


def _stop(world: World, entries: list[Entry], parts: Path, first: tuple, failure: BaseException | None) -> None:
    """Raise on every rank the error of the first failed unit (in the order of the units to
    do); for a non-finite unit rank 0 deletes the snapshot's units as one process does."""
    if first[0] == "error":
        if failure is not None and first[1] % world.world_size == world.rank:
            raise failure
        raise InputError(first[2])
    _, _, name, batch, problem = first
    entry = next(e for e in entries if e.name == name)
    message = str(diverged_error(entries, entry, batch, problem, parts)) if world.is_main else None
    raise InputError(_from_main(world, message))
