"""The inputs of one `depthdiag diagnose` run turned into entries along `snapshot`
(`run_entries`), each checked before the run writes anything: snapshot or checkpoint files of
one run (diag/sources/files.py), the model an adapter function returns (diag/sources/adapter.py),
a Hugging Face folder (diag/sources/hf.py) or snapshot folders any training loop wrote
(diag/sources/snapshot_folder.py); and each entry opened, when its units run, as the one form
every input becomes (`AdaptedModel`) and the diagnostic of it (`open_entry`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from common.errors import InputError
from diag.arithmetic.engine import UpdateDiagnostic
from diag.arithmetic.families import resolve_family
from diag.sources.adapter import AdaptedModel, adapter_config_json, load_adapter
from diag.sources.files import file_entries, file_model
from diag.sources.groupings import target_groupings
from diag.sources.hf import DEFAULT_BATCHES as DEFAULT_HF_BATCHES
from diag.sources.hf import hf_adapted_model, hf_config_json
from diag.sources.inputs import DiagnoseConfig, Entry
from diag.sources.snapshot_loading import SnapshotFolder, read_snapshot_folder
from trainer.checkpoint import is_sharded_folder
from trainer.config import RunConfig
from trainer.distributed import World, resolve_device


def _adapter_entry(config: DiagnoseConfig) -> Entry:
    spec = config.adapter
    adapted = with_run_family(config, load_adapter(spec, config.adapter_args))
    config_json = adapter_config_json(spec, config.adapter_args, adapted)
    return _adapted_entry(config, adapted, option=f"--adapter {spec}", path=spec, config_json=config_json)


def _hf_entry(config: DiagnoseConfig) -> Entry:
    source = config.hf
    source = replace(source, lr=config.lr)
    adapted, step = hf_adapted_model(
        source,
        batches=config.batches or DEFAULT_HF_BATCHES,
        update_depths=config.update_depths,
        device=config.device,
    )
    config_json = hf_config_json(source, adapted)
    option = f"--hf {source.folder}"
    # An estimated state's step count only silences bias correction: the model's step is unknown (0).
    return _adapted_entry(
        config,
        adapted,
        option=option,
        path=source.folder,
        config_json=config_json,
        step=0 if step is None else step,
        batch_source="hf-data",
    )


def _adapted_entry(
    config: DiagnoseConfig,
    adapted: AdaptedModel,
    *,
    option: str,
    path: str,
    config_json: str,
    step: int | None = None,
    batch_source: str = "adapter",
) -> Entry:
    """The one entry of a model handed over whole (an adapter's, a Hugging Face folder's, a
    snapshot folder's), its diagnostic built, and so every input checked, before anything is
    written; `option` starts every error message."""
    wanted = config.batches or len(adapted.batches)
    if wanted > len(adapted.batches):
        raise InputError(f"{option}: returned {len(adapted.batches)} batches, --batches asks for {wanted}")
    try:
        diagnostic = adapted_diagnostic(config, adapted)
        for i in range(wanted):
            diagnostic.check_batch(adapted.batches[i], f"batch {i}")
    except InputError as err:
        raise InputError(f"{option}: {err}") from None
    if step is None:
        steps = [float(s["step"]) for s in adapted.optimizer.state.values() if "step" in s]
        step = int(max(steps)) if steps else 0
    return Entry(
        name=adapted.name or path,
        path=path,
        sha256=adapted.fingerprint(),
        step=step,
        uniform_updates=0,
        lr=diagnostic.step.lrs[0],
        batches=wanted,
        batch_source=batch_source,
        config_json=config_json,
        eval_set="snapshot",
        adapted=adapted,
        diagnostic=diagnostic,
        optimizer_state=adapted.optimizer_state,
    )


def adapted_diagnostic(
    config: DiagnoseConfig, adapted: AdaptedModel, *, sharded: bool = False, entry: Entry | None = None
) -> UpdateDiagnostic:
    """The run's diagnostic of `adapted`, with its own way of being called, clipping and
    precision; the learning rate is --lr, or the model's (None: each group's own). `sharded`:
    the model is sharded over torchrun's ranks, which all call the diagnostic together. The
    evaluation targets are grouped by the model's own groupings and --grouping's, those that
    need the run's data read from `entry`, a snapshot or checkpoint file's."""
    run = RunConfig.from_json(entry.config_json, str(entry.path)) if entry is not None else None
    origin = entry.path if entry is not None else adapted.name or "the model"
    eval_set = entry.eval_set if entry is not None else None
    named = target_groupings(
        config.groupings, adapted.eval_tokens, adapted.eval_mask, run=run, eval_set=eval_set, origin=origin
    )
    eval_groups = (*adapted.eval_groups, *named)
    options = replace(
        config.diagnostic,
        depth_kwarg=adapted.depth_kwarg,
        family=adapted.family,
        grad_clip=adapted.grad_clip,
        lr=config.lr if config.lr is not None else adapted.lr,
        precision=adapted.precision,
    )
    if sharded:
        # Imported here: FSDP's modules take most of a second to import, which no unsharded run needs.
        from diag.arithmetic.sharded import ShardedUpdateDiagnostic

        if eval_groups:
            raise InputError("--grouping: not with --sharded yet; diagnose the groups in one process")
        return ShardedUpdateDiagnostic(
            adapted.model, adapted.optimizer, adapted.eval_tokens, options, eval_mask=adapted.eval_mask
        )
    return UpdateDiagnostic(
        adapted.model,
        adapted.optimizer,
        adapted.eval_tokens,
        options,
        eval_mask=adapted.eval_mask,
        eval_groups=eval_groups,
    )


def _folder_entries(config: DiagnoseConfig) -> list[Entry]:
    """An entry per snapshot folder, each loaded and checked as `_adapted_entry` checks a model
    handed over. One folder stays loaded for the run; of several, each is loaded again when its
    units run (as snapshot files are), so that one model at a time is in memory."""
    if config.eval_set == "attributes":
        raise InputError(
            f"{config.snapshots[0]}: --eval-set attributes needs a bioS run's snapshot files; "
            "a snapshot folder's model is scored on its eval_tokens"
        )
    folders = [read_snapshot_folder(path) for path in config.snapshots]
    first = folders[0]
    for folder in folders[1:]:
        differ = [key for key, value in first.settings().items() if folder.settings()[key] != value]
        if differ:
            raise InputError(
                f"{folder.path}: {', '.join(differ)} differ from {first.path}'s; "
                "diagnose snapshot folders of one model, trained one way, at a time"
            )
    out = Path(config.out).resolve()
    entries = []
    for folder in folders:
        if out.is_relative_to(folder.path.resolve()):
            raise InputError(f"{config.out}: inside the snapshot folder {folder.path}, an input; write it elsewhere")
        adapted = load_folder(config, folder)
        carried = len(adapted.batches)
        if config.batches is not None and config.batches > carried:
            raise InputError(f"{folder.path}: carries {carried} batches, --batches asks for {config.batches}")
        entry = _adapted_entry(
            config,
            adapted,
            option=str(folder.path),
            path=str(folder.path),
            config_json=folder.config_json(),
            step=folder.step,
            batch_source="snapshot",
        )
        saved_on = folder.document.get("provenance", {}).get("machine")
        entry = replace(entry, snapshot_folder=True, trained_on=(saved_on,) if saved_on else ())
        if len(folders) > 1:
            entry = replace(entry, adapted=None, diagnostic=None)
        entries.append(entry)
        del adapted
    return entries


def load_folder(config: DiagnoseConfig, folder: SnapshotFolder) -> AdaptedModel:
    """The folder's model on the run's device, called as --family says when given."""
    adapted = folder.load(trust_remote_code=config.trust_remote_code, device=resolve_device(config.device))
    return with_run_family(config, adapted)


def with_run_family(config: DiagnoseConfig, adapted: AdaptedModel) -> AdaptedModel:
    """`adapted` called by the run's --family instead of the family or depth keyword it says
    (the family is part of its fingerprint, so a resume with another --family is refused)."""
    if config.family is None:
        return adapted
    return replace(adapted, family=resolve_family(config.family), depth_kwarg="depth")


def run_entries(config: DiagnoseConfig) -> list[Entry]:
    if config.adapter is not None:
        return [_adapter_entry(config)]
    if config.hf is not None:
        return [_hf_entry(config)]
    # A sharded checkpoint or snapshot (NAME.dcp/) is a folder too, read like a file.
    folders = [path for path in config.snapshots if Path(path).is_dir() and not is_sharded_folder(path)]
    if folders and len(folders) < len(config.snapshots):
        raise InputError(
            f"{folders[0]}: a snapshot folder, among snapshot files; diagnose snapshot files or snapshot folders"
        )
    if config.trust_remote_code and not folders:
        raise InputError("--trust-remote-code: only with --hf DIR or snapshot folders (it runs a model's own code)")
    if config.family is not None and not folders:
        raise InputError(
            f"--family {config.family}: only with --hf DIR, --adapter or snapshot folders; snapshot files hold "
            "depthdiag's own model, which is called as it trained"
        )
    entries = _folder_entries(config) if folders else file_entries(config)
    names = [e.name for e in entries]
    for entry in entries:
        if names.count(entry.name) > 1:
            raise InputError(
                f"{entry.path}: another snapshot has the same name {entry.name!r}; "
                "the name labels the snapshot in the results"
            )
    return sorted(entries, key=lambda e: (e.uniform_updates, e.step))


def open_entry(
    config: DiagnoseConfig, entry: Entry, device: torch.device, world: World | None = None
) -> tuple[UpdateDiagnostic, AdaptedModel]:
    """The entry's diagnostic and the one form it diagnoses (its model, optimizer and batches).
    A model handed over whole is the one the entry holds; a snapshot folder or file is loaded
    again and refused if it changed since the run started. `world`: the run shards each file's
    model over torchrun's ranks (`--sharded`)."""
    if entry.adapted is not None:
        return entry.diagnostic, entry.adapted
    if entry.snapshot_folder:
        adapted = load_folder(config, read_snapshot_folder(entry.path))
        if adapted.fingerprint() != entry.sha256:
            raise InputError(f"{entry.path}: the snapshot folder changed while the run was going")
    else:
        adapted = file_model(config, entry, device, world)
        return adapted_diagnostic(config, adapted, sharded=world is not None, entry=entry), adapted
    return adapted_diagnostic(config, adapted, sharded=world is not None), adapted
