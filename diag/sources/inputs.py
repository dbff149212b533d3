"""What a `depthdiag diagnose` run is asked to read and compute (`DiagnoseConfig`), and what
each of its inputs becomes before anything is computed (`Entry`, one per label along `snapshot`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.choices import DEVICE_CHOICES, EVAL_SET_CHOICES
from common.depths import MAX_SERVING_DEPTH, SERVING_DEPTHS, UPDATE_DEPTHS
from common.errors import InputError
from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic
from diag.sources.adapter import AdaptedModel
from diag.sources.hf import HfInput
from trainer.checkpoint import is_sharded_folder


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
    """A Hugging Face model folder (and its tokens, optimizer state) instead of snapshots (diag/sources/hf.py)."""
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
    groupings: tuple[str, ...] = ()
    """Groupings of the evaluation targets to record each group's NLLs by (diag/sources/groupings.py):
    'attribute', 'frequency', 'position' or MODULE:NAME; `summarize --by` reads them."""
    attribute: bool = False
    """Each unit also attributes its benefit to its batch's sequences and `pool` more
    (diag/arithmetic/attribution.py, `depthdiag attribute`); needs isolate 'linear' and two
    update depths."""
    pool: int = 0
    """Sequences of the run's own stream, after the diagnosed batches, scored against each unit's
    update besides its batch's (snapshot and checkpoint files only)."""
    removal_depth: int | None = None
    """With attribution: also the removal check at this serving depth, the benefit with the
    quarter of each batch ranked highest there removed, the lowest and a random quarter (three
    more default units per batch; diag/arithmetic/attribution.py)."""
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
    and compute every unit with all of them (diag/arithmetic/sharded.py), for a model that does not fit
    one device; without it the units are spread over the ranks, one whole model each."""
    trust_remote_code: bool = False
    """Run the code a snapshot folder's Hugging Face model ships with (its model/ folder's
    auto_map); `hf` has its own (HfInput.trust_remote_code)."""
    family: str | None = None
    """A model family's name or MODULE:NAME (diag/arithmetic/families.py) to call snapshot folders' or an
    adapter's model by, in place of the family (or depth_kwarg) they say; None: theirs. `hf` has
    its own (HfInput.family); snapshot files are depthdiag's models, called as they trained."""
    diagnostic: DiagnosticOptions = field(init=False, repr=False, compare=False)
    """The engine's options built from the fields above (fp32, no clipping: each snapshot's
    training settings are added when its entry is opened, `adapted_diagnostic`)."""

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
        if self.attribute and (self.isolate != "linear" or len(self.update_depths) != 2):
            raise InputError("attribution splits the benefit of isolate='linear' between two update depths")
        if self.pool < 0 or (self.pool and not self.attribute):
            raise InputError(f"--pool must be >= 0 and is for attribution, got {self.pool}")
        if self.pool and (self.adapter is not None or self.hf is not None):
            raise InputError("--pool draws from a run's own stream: snapshot or checkpoint files only")
        if self.removal_depth is not None and (not self.attribute or self.removal_depth not in self.serving_depths):
            raise InputError(
                f"--removal-depth {self.removal_depth}: is for attribution, at one of the serving depths "
                f"{list(self.serving_depths)}"
            )
        if self.attribute and self.sharded:
            raise InputError("attribution: not with --sharded yet")
        if self.groupings and self.sharded:
            raise InputError("--grouping: not with --sharded yet; diagnose the groups in one process")
        folders = [path for path in self.snapshots if Path(path).is_dir() and not is_sharded_folder(path)]
        if self.pool and folders:
            raise InputError(f"{folders[0]}: --pool draws from a run's own stream: snapshot or checkpoint files only")
        deepest = max((*self.update_depths, *self.serving_depths), default=0)
        if deepest > self.max_depth:
            raise InputError(f"depth {deepest} is above the maximum {self.max_depth} (--max-depth N allows deeper)")
        # Built (and so validated, with the engine's own rules) once; each snapshot adds its
        # training settings when its entry is opened (`adapted_diagnostic`).
        options = DiagnosticOptions(
            update_depths=self.update_depths,
            serving_depths=self.serving_depths,
            isolate=self.isolate,
            rms_match=self.rms_match,
            lr=self.lr,
            eval_batch_size=self.eval_batch_size,
        )
        object.__setattr__(self, "diagnostic", options)


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
