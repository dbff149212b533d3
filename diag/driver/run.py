"""`depthdiag diagnose`: every (snapshot, batch) unit of its inputs into one results file
(docs/formats.md), durably and resumably. The run's data goes down once:

    inputs --run_entries--> entries --open_entry--> AdaptedModel --compare--> unit files --> OUT
    (diag/sources/)           (checked)  (the one form)   (diag/arithmetic/)   (diag/driver/parts.py)

Every input becomes entries along `snapshot` before anything is written: snapshot or
checkpoint files of one run, the model an adapter function returns, a Hugging Face folder, or
snapshot folders that any training loop wrote with `diag.save_snapshot`. When its units run,
each entry is opened as the one form the diagnostic takes (a model, its optimizer, its batches
and evaluation set, and how to call it) and the diagnostic of it.

Each finished unit is written atomically as its own small file in `OUT.parts/`; when all are
done they are assembled into OUT (atomically) and the parts directory is removed. A manifest in
the parts directory records the settings and the inputs' sha256, so `--resume` continues only
the same run, skipping every unit already on disk: a killed run loses at most the unit in
flight and, resumed, ends with the same file as an uninterrupted run. A resume may drop or
replace a snapshot none of whose units is on disk; one with finished units must come back as
the same file.

The run (under torchrun: rank 0) holds the lock of OUT (common/lock.py) from before it touches
anything until it ends; the lock covers OUT.parts/ too, so a second run on the same OUT, `--force`
included, is refused with the holder's pid and deletes nothing. A resumed run opens every
finished unit file before computing: a damaged one is deleted and computed again (with a warning
naming it), and a complete OUT whose parts directory survived (a kill during the final cleanup)
is recognised as complete. A unit with a non-finite NLL, training loss or update RMS (a diverged
snapshot) stops the run as bad input, naming the snapshot file and the batch; that snapshot's
finished units are deleted, every other snapshot's are kept for a `--resume` without the file or
with a replacement (with none kept, the parts directory goes). Parts are deleted otherwise only
by `--force` and once OUT is complete.

Under torchrun (WORLD_SIZE > 1) the units are spread over the ranks (diag/driver/ranks.py).
"""

from __future__ import annotations

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
from diag.arithmetic.attribution import SequenceAttribution
from diag.arithmetic.model_checks import bias_correction_message
from diag.driver.parts import assemble_results, diverged_error, non_finite, part_path, prepare_parts, run_manifest
from diag.driver.ranks import diagnose_across_ranks
from diag.sources.entries import open_entry, run_entries
from diag.sources.files import pool_sequences
from diag.sources.inputs import DiagnoseConfig, Entry
from trainer.distributed import resolve_device


def _run_units(config: DiagnoseConfig, entries: list[Entry], parts: Path, device: torch.device) -> None:
    todo = {e.name: [i for i in range(e.batches) if not part_path(parts, e.name, i).exists()] for e in entries}
    total = sum(e.batches for e in entries)
    done = total - sum(len(v) for v in todo.values())
    with progress_bar(total, f"diagnose {config.out}", "unit", initial=done, enabled=config.progress) as bar:
        for entry in entries:
            if not todo[entry.name]:
                continue
            diagnostic, adapted = open_entry(config, entry, device)
            pool = pool_sequences(entry, config.pool) if config.pool else None
            attribution = None  # its e_s are computed once per snapshot
            warning = bias_correction_message(adapted.optimizer)
            if warning:
                bar.write(f"warning: {entry.path}: {warning}")
            for i in todo[entry.name]:
                batch = adapted.batches[i]
                bar.set_postfix_str(f"{entry.name} batch {i}")
                try:
                    if config.attribute:
                        attribution = attribution or SequenceAttribution(diagnostic)
                        unit = attribution.unit(batch, pool, removal_depth=config.removal_depth, removal_seed=i)
                    else:
                        unit = diagnostic.compare(batch)
                except InputError as err:  # a unit's problem (e.g. isolate='linear' refused): name its file
                    raise InputError(f"{entry.path}, batch {i}: {err}") from None
                problem = non_finite(unit)
                if problem is not None:
                    raise diverged_error(entries, entry, i, problem, parts)
                write_dataset(unit.expand_dims(snapshot=[entry.name], batch=[i]), part_path(parts, entry.name, i))
                bar.update(1)
            del diagnostic, adapted, attribution  # one model in memory at a time


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
        if config.attribute:
            raise InputError("attribution: not under torchrun yet; run it in one process")
        return diagnose_across_ranks(config)
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
    manifest = run_manifest(config, entries, device)
    # Taken before anything on disk is looked at or deleted, held to the end.
    with exclusive_output(out):
        if config.force or config.resume:
            # What --force replaces or --resume keeps must be a results file; without either
            # flag `prepare_parts` refuses an existing OUT.
            refuse_unrecognized(out, kind=RESULTS_FILE)
        if not prepare_parts(config, entries, manifest, out, parts):
            return out
        _run_units(config, entries, parts, device)
        write_dataset(assemble_results(config, entries, manifest, parts), out)
        shutil.rmtree(parts)
    return out
