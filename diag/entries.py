"""What one `depthdiag diagnose` run diagnoses (diag/run.py drives it): its settings
(`DiagnoseConfig`) and the entries along `snapshot` its inputs become (`run_entries`): snapshot
or checkpoint files of one run, the model an adapter function returns (diag/adapter.py), a
Hugging Face folder (diag/hf.py) or snapshot folders any training loop wrote
(diag/snapshot_folder.py), each checked before the run writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from common.choices import DEVICE_CHOICES, EVAL_SET_CHOICES
from common.depths import MAX_SERVING_DEPTH, SERVING_DEPTHS, UPDATE_DEPTHS
from common.errors import InputError
from diag.adapter import AdaptedModel, adapter_config_json, load_adapter
from diag.engine import DiagnosticOptions, UpdateDiagnostic
from diag.evalset import resolve_eval_set
from diag.families import resolve_family
from diag.hf import DEFAULT_BATCHES as DEFAULT_HF_BATCHES
from diag.hf import HfInput, hf_adapted_model, hf_config_json
from diag.snapshot_loading import SnapshotFolder, read_snapshot_folder
from trainer.checkpoint import Snapshot, is_sharded_folder, load_snapshot
from trainer.distributed import resolve_device


@dataclass(frozen=True)
class DiagnoseConfig:
    snapshots: tuple[str, ...]
    """Snapshot or checkpoint files of one model config, or snapshot folders (diag.save_snapshot)
    of one model (any order; sorted by (uniform_updates, step)); empty with `adapter` or `hf`."""
    out: str
    """Results file to write (HDF5); unit files go to OUT.parts/ until the run is complete."""
    adapter: str | None = None
    """'module:function' returning a diag.AdaptedModel: a model from another codebase instead of snapshots."""
    adapter_args: tuple[tuple[str, str], ...] = ()
    """(KEY, VALUE) keyword arguments of the adapter function, values as strings."""
    hf: HfInput | None = None
    """A Hugging Face model folder (and its tokens, optimizer state) instead of snapshots (diag/hf.py)."""
    update_depths: tuple[int, ...] = UPDATE_DEPTHS
    """Depths of the compared updates; the first is the reference."""
    serving_depths: tuple[int, ...] = SERVING_DEPTHS
    """Depths every updated model is evaluated at."""
    batches: int | None = None
    """Batches per snapshot; None: all a snapshot carries (checkpoints: the run's train.snapshot_batches)."""
    isolate: str = "counterfactual"
    """Isolation of the gradient's effect (see DiagnosticOptions)."""
    rms_match: str = "reference"
    """RMS matching of the updates (see DiagnosticOptions)."""
    lr: float | None = None
    """Override of the learning rate; None: the LR each snapshot's next update uses."""
    eval_batch_size: int = 32
    """Evaluation rows per forward pass."""
    eval_set: str = "auto"
    """'snapshot': the evaluation set the snapshot carries (every target counted); 'attributes'
    (bioS runs): the evaluation presentations, only attribute-value targets counted
    (`BiosSource.attribute_eval`, built from the run's data config), the paper's bioS
    evaluation; 'auto': 'attributes' for bioS runs, 'snapshot' for others."""
    device: str = "auto"
    """'auto' (cuda when available), 'cpu' or 'cuda'."""
    resume: bool = False
    """Continue an interrupted run with the same settings, skipping finished units."""
    force: bool = False
    """Discard an unfinished run's parts and an existing OUT and start over (never those of a
    live run: its lock refuses this run first)."""
    max_depth: int = MAX_SERVING_DEPTH
    """The deepest update or serving depth accepted (a guard against typos such as '4,160')."""
    progress: bool = True
    """Show a progress bar over units (on a terminal)."""
    sharded: bool = False
    """Under torchrun: shard each snapshot's model and optimizer state over the ranks (FSDP2)
    and compute every unit with all of them (diag/sharded.py), for a model that does not fit
    one device; without it the units are spread over the ranks, one whole model each."""
    trust_remote_code: bool = False
    """Run the code a snapshot folder's Hugging Face model ships with (its model/ folder's
    auto_map); `hf` has its own (HfInput.trust_remote_code)."""
    family: str | None = None
    """A model family's name or MODULE:NAME (diag/families.py) to call snapshot folders' or an
    adapter's model by, in place of the family (or depth_kwarg) they say; None: theirs. `hf` has
    its own (HfInput.family); snapshot files are depthdiag's models, called as they trained."""
    diagnostic: DiagnosticOptions = field(init=False, repr=False, compare=False)
    """The engine's options built from the fields above (fp32, no clipping: each snapshot's
    training settings are added by `snapshot_options`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "snapshots", tuple(str(p) for p in self.snapshots))
        given = [
            what
            for what, value in (("snapshot files", self.snapshots), ("--adapter", self.adapter), ("--hf", self.hf))
            if value
        ]
        if not given:
            raise InputError(
                "no snapshot files given (or --hf DIR, a Hugging Face model folder, or --adapter MODULE:FUNCTION "
                "for a model from another codebase)"
            )
        if len(given) > 1:
            raise InputError(f"{' and '.join(given)} exclude each other: diagnose one or the other")
        if self.trust_remote_code and not self.snapshots:
            raise InputError("trust_remote_code is for snapshot folders; a --hf folder's is HfInput.trust_remote_code")
        if self.family is not None and self.hf is not None:
            raise InputError(f"--hf {self.hf.folder}: its family is HfInput.family, not DiagnoseConfig.family")
        if self.adapter_args and self.adapter is None:
            raise InputError("--adapter-arg needs --adapter: it is an argument of the adapter function")
        if self.adapter is not None and self.eval_set == "attributes":
            raise InputError(
                f"--adapter {self.adapter}: --eval-set attributes needs a bioS run's snapshots; "
                "an adapter's model is scored on its eval_tokens"
            )
        if self.hf is not None and self.eval_set == "attributes":
            raise InputError(
                f"--hf {self.hf.folder}: --eval-set attributes needs a bioS run's snapshots; "
                "a model folder is scored on the evaluation set of --data"
            )
        if self.hf is not None and self.hf.estimate_optimizer is not None and self.lr is None:
            raise InputError(
                f"--hf {self.hf.folder}: --estimate-optimizer needs --lr, the learning rate of the estimated "
                "step (a model without a Trainer state has none of its own)"
            )
        if self.batches is not None and self.batches < 1:
            raise InputError(f"--batches must be >= 1, got {self.batches}")
        if self.device not in DEVICE_CHOICES:
            raise InputError(f"device must be one of {DEVICE_CHOICES}, got {self.device!r}")
        if self.eval_set not in EVAL_SET_CHOICES:
            raise InputError(f"eval set must be one of {EVAL_SET_CHOICES}, got {self.eval_set!r}")
        if self.sharded and (self.adapter is not None or self.hf is not None):
            raise InputError("--sharded shards a run's snapshot or checkpoint files, not an --adapter or --hf model")
        if self.resume and self.force:
            raise InputError("--resume and --force contradict each other: pick one")
        deepest = max((*self.update_depths, *self.serving_depths), default=0)
        if deepest > self.max_depth:
            raise InputError(f"depth {deepest} is above the maximum {self.max_depth} (--max-depth N allows deeper)")
        # Built (and so validated, with the engine's own rules) once; each snapshot adds its
        # training settings with `snapshot_options`.
        options = DiagnosticOptions(
            update_depths=self.update_depths,
            serving_depths=self.serving_depths,
            isolate=self.isolate,
            rms_match=self.rms_match,
            lr=self.lr,
            eval_batch_size=self.eval_batch_size,
        )
        object.__setattr__(self, "diagnostic", options)


def snapshot_options(config: DiagnoseConfig, snap: Snapshot) -> DiagnosticOptions:
    """The run's diagnostic options with the snapshot's own training settings: its gradient
    clipping (0 means none) and precision. The learning rate is the run's: the --lr override,
    or None, with which the engine steps at each param group's LR as the snapshot's optimizer
    holds it (the `lr` coordinate records that LR per snapshot)."""
    return replace(
        config.diagnostic, grad_clip=snap.config.optim.grad_clip or None, precision=snap.config.train.precision
    )


@dataclass(frozen=True)
class Entry:
    """What the run needs to know of one snapshot file before computing anything."""

    name: str
    """Coordinate label: the file stem."""
    path: str
    """The file."""
    sha256: str
    """Hex digest of the file when the run started."""
    step: int
    """Update index of the snapshot."""
    uniform_updates: int
    """Updates since the switch to the finishing schedule."""
    lr: float
    """The learning rate of the diagnosed step."""
    batches: int
    """Units (batches) to run on it."""
    batch_source: str
    """'snapshot' (carried in the file) or 'data' (drawn from the run's data config)."""
    config_json: str
    """The run config stored in the file."""
    eval_set: str
    """The evaluation set it is scored on: 'snapshot' or 'attributes' ('auto' resolved)."""
    adapted: AdaptedModel | None = field(default=None, repr=False, compare=False)
    """An adapter's model, optimizer and tokens (None for a file, and for each of several snapshot folders)."""
    diagnostic: UpdateDiagnostic | None = field(default=None, repr=False, compare=False)
    """The adapter's diagnostic, built (and so its input checked) before the run writes anything."""
    snapshot_folder: bool = False
    """A snapshot folder (diag.save_snapshot): loaded again when its units run unless `adapted` holds it."""
    optimizer_state: str | None = None
    """Where the optimizer's state came from, when the model was handed over whole and says (AdaptedModel)."""
    trained_on: tuple[dict[str, str | int], ...] = ()
    """The machines that trained the model up to the snapshot, as the file records them
    (trainer/machine.py; () when it does not)."""


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


def adapted_diagnostic(config: DiagnoseConfig, adapted: AdaptedModel) -> UpdateDiagnostic:
    """The run's diagnostic of a model handed over whole, with its own way of being called,
    clipping and precision; the learning rate is --lr, or the model's (None: each group's own)."""
    options = replace(
        config.diagnostic,
        depth_kwarg=adapted.depth_kwarg,
        family=adapted.family,
        grad_clip=adapted.grad_clip,
        lr=config.lr if config.lr is not None else adapted.lr,
        precision=adapted.precision,
    )
    return UpdateDiagnostic(adapted.model, adapted.optimizer, adapted.eval_tokens, options, eval_mask=adapted.eval_mask)


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
    entries = _folder_entries(config) if folders else _file_entries(config)
    names = [e.name for e in entries]
    for entry in entries:
        if names.count(entry.name) > 1:
            raise InputError(
                f"{entry.path}: another snapshot has the same name {entry.name!r}; "
                "the name labels the snapshot in the results"
            )
    return sorted(entries, key=lambda e: (e.uniform_updates, e.step))


def _file_entries(config: DiagnoseConfig) -> list[Entry]:
    entries, first = [], None
    for path in config.snapshots:
        # A sharded run reads a sharded folder's shards on its ranks, never whole here.
        snap = load_snapshot(path, shards=not (config.sharded and is_sharded_folder(path)))
        if first is None:
            first = snap
        elif snap.config.model != first.config.model:
            diff = sorted(k for k, v in snap.config.model.to_dict().items() if first.config.model.to_dict()[k] != v)
            raise InputError(
                f"{path}: model config differs from {first.path} ({', '.join(diff)}); "
                "diagnose snapshots of one model at a time"
            )
        eval_set = _resolve_eval_set(config.eval_set, snap)
        if entries and eval_set != entries[0].eval_set:
            raise InputError(
                f"{path}: --eval-set auto means {eval_set!r} here but {entries[0].eval_set!r} for "
                f"{entries[0].path}; diagnose one kind of run at a time or name the set"
            )
        carried = None if snap.batches is None else int(snap.batches.shape[0])
        wanted = config.batches or (carried if carried is not None else snap.config.train.snapshot_batches)
        if carried is not None and wanted > carried:
            raise InputError(f"{path}: carries {carried} batches, --batches asks for {wanted}")
        entries.append(
            Entry(
                name=Path(path).stem,
                path=str(path),
                sha256=snap.sha256,
                step=snap.step,
                uniform_updates=snap.uniform_updates,
                lr=float(config.lr if config.lr is not None else snap.lr),
                batches=wanted,
                batch_source="data" if carried is None else "snapshot",
                config_json=snap.config.to_json(),
                eval_set=eval_set,
                trained_on=snap.trained_on,
            )
        )
        del snap
    return entries


def _resolve_eval_set(choice: str, snap: Snapshot) -> str:
    return resolve_eval_set(choice, snap.config, snap.path)
