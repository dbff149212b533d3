"""Run configuration: frozen dataclasses loaded from TOML, overridable with
`--set section.key=value`, serialised as JSON into every checkpoint, snapshot
and results file.

    [model]  ModelConfig (trainer/model.py)
    [data]   DataConfig
    [optim]  OptimConfig
    [train]  TrainConfig
    [monitor] MonitorConfig (optional: left out of the JSON while it is the default, off)
    [logging] LoggingConfig (optional: left out of the JSON while it is the default, off)

Keys added after runs were stored (train.eval_every, train.eval_depths, train.parallel,
[logging]) are left out of the JSON while they hold their defaults, so a stored config
loads with them at their defaults and equals, and serialises as, the config a new run writes.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from common.choices import (
    DEVICE_CHOICES,
    EVAL_SET_CHOICES,
    PARALLEL_CHOICES,
    PLANTED_UNIT_CHOICES,
    PRECISION_CHOICES,
)
from common.depths import MAX_SERVING_DEPTH, SERVING_DEPTHS, UPDATE_DEPTHS, checked_depths, parse_serving_depths
from common.errors import InputError
from common.observers import without_observer_keys
from trainer.model import ModelConfig
from trainer.schedules import parse_schedule


@dataclass(frozen=True)
class DataConfig:
    source: str = "bios"
    """'bios' (synthetic factual recall, generated from the seed), 'bin' (nanoGPT-style
    token files train.bin / val.bin in `path`) or 'text' (a UTF-8 file, byte-level tokens)."""
    path: str = ""
    """Directory of train.bin/val.bin for 'bin'; the text file for 'text'; unused for 'bios'.
    `load_config` makes a relative path absolute: against the config file's folder when the file
    gives it, against the working directory when --set does."""
    bin_dtype: str = "uint16"
    """Token dtype of .bin files: 'uint16' or 'uint32'."""
    bios_people: int = 500
    """Number of fictional people in the bioS task."""
    seed: int = 0
    """Seed of the data itself (the bioS population); batches also depend on train.seed and the step."""
    eval_sequences: int = 64
    """Held-out evaluation sequences carried by snapshots and used by `depthdiag eval`."""
    planted_fraction: float = 0.0
    """bioS: the share of bio slots, in training and evaluation streams alike, that hold a
    planted multi-hop lookup instead (trainer/data/bios.py, docs/data.md); 0: none."""
    planted_unit: str = "slot"
    """bioS: what planted_fraction is a share of: 'slot' (bio slots) or 'row' (whole rows, every
    slot of a planted row planted, so a row is planted or not)."""
    planted_queries: int = 1
    """bioS: queries a planted sequence asks about its one listing, each answer a counted
    evaluation target; the listing shrinks to make room (docs/data.md)."""
    planted_max_hops: int = 4
    """bioS: a planted query asks for 1..planted_max_hops hops."""

    def __post_init__(self) -> None:
        if self.source not in ("bios", "bin", "text"):
            raise InputError(f"data.source must be 'bios', 'bin' or 'text', got {self.source!r}")
        if self.source in ("bin", "text") and not self.path:
            raise InputError(f"data.path is required for data.source={self.source!r}")
        if self.bin_dtype not in ("uint16", "uint32"):
            raise InputError(f"data.bin_dtype must be 'uint16' or 'uint32', got {self.bin_dtype!r}")
        if self.bios_people < 1 or self.eval_sequences < 1:
            raise InputError("data.bios_people and data.eval_sequences must be >= 1")
        if self.seed < 0:
            raise InputError(f"data.seed must be >= 0 (numpy seeds are non-negative), got {self.seed}")
        if not 0 <= self.planted_fraction < 1 or (self.planted_fraction and self.source != "bios"):
            raise InputError(f"data.planted_fraction must be in [0, 1) and is for bioS, got {self.planted_fraction}")
        if self.planted_unit not in PLANTED_UNIT_CHOICES:
            raise InputError(f"data.planted_unit must be one of {PLANTED_UNIT_CHOICES}, got {self.planted_unit!r}")
        if self.planted_queries < 1 or self.planted_max_hops < 1:
            raise InputError(
                f"data.planted_queries and data.planted_max_hops must be >= 1, got "
                f"{self.planted_queries} and {self.planted_max_hops}"
            )


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"
    """'adamw' (torch.optim.AdamW) or 'sgd' (torch.optim.SGD with momentum)."""
    lr: float = 2e-3
    """Peak learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (ndim >= 2); norms are not decayed."""
    momentum: float = 0.9
    """SGD momentum."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    warmup: int = 100
    """Linear warmup updates from 0 to lr."""
    decay_fraction: float = 0.1
    """Final fraction of updates over which the LR decays linearly to min_lr_ratio * lr."""
    min_lr_ratio: float = 0.1
    """LR at the last update, relative to lr."""

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise InputError(f"optim.name must be 'adamw' or 'sgd', got {self.name!r}")
        if self.lr <= 0 or self.eps <= 0:
            raise InputError("optim.lr and optim.eps must be > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and 0 <= self.momentum < 1):
            raise InputError("optim.beta1, optim.beta2 and optim.momentum must be in [0, 1)")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.warmup < 0:
            raise InputError("optim.weight_decay, optim.grad_clip and optim.warmup must be >= 0")
        if not 0 <= self.decay_fraction <= 1 or not 0 <= self.min_lr_ratio <= 1:
            raise InputError("optim.decay_fraction and optim.min_lr_ratio must be in [0, 1]")


@dataclass(frozen=True)
class TrainConfig:
    schedule: str = "fixed-first:k0=4,switch=0.8,finish=uniform:1-16"
    """Depth schedule spec (see trainer/schedules.py), e.g. 'fixed:4', 'uniform:1-16'."""
    updates: int = 1500
    """Total optimizer updates."""
    batch_size: int = 32
    """Global batch size in sequences (split across ranks under torchrun)."""
    seq_len: int = 64
    """Tokens per training sequence (the model sees seq_len inputs and seq_len targets)."""
    seed: int = 0
    """Seed of initialisation, batch order and depth sampling."""
    checkpoint_every: int = 500
    """Write a resumable checkpoint every this many updates (and at the end); 0: only at the end."""
    snapshot_uniform_updates: tuple[int, ...] = (0, 16, 64, 256)
    """Write a diagnostic snapshot after this many updates of the finishing phase (0 = at the switch)."""
    snapshot_batches: int = 64
    """Training batches carried by each snapshot (the next ones the run would see)."""
    precision: str = "fp32"
    """'fp32' or 'bf16' (autocast: matmuls in bf16; norms, the attention softmax and the loss in fp32)."""
    compile: bool = False
    """torch.compile every transformer block (the loop over depths stays in Python, so no depth
    recompiles; bf16 compiles two graphs, for fp32 and bf16 residual streams). On the tiny CPU
    config with bf16 it takes 1.1-1.2x the updates/s of eager bf16 (`make bench`) for 5-15 s of
    compiling per process, so it pays off for runs of a few hundred updates."""
    device: str = "auto"
    """'auto' (cuda when available), 'cpu' or 'cuda'."""
    parallel: str = "ddp"
    """How torchrun's processes train: 'ddp' (every rank holds the whole model, gradients
    all-reduced) or 'fsdp' (FSDP2: every transformer block and the rest of the model sharded
    over the ranks, checkpoints written as torch.distributed.checkpoint folders, snapshots
    gathered into the usual files). One process trains the plain model under either."""
    log_every: int = 10
    """Write a metrics line every this many updates."""
    eval_every: int = 0
    """Score the held-out evaluation set at every `eval_depths` depth every this many updates and
    at the end (keys val_nll_S of the metrics line; rank 0, no effect on training); a multiple of
    log_every, so it lands on a metrics line. 0: off (the default)."""
    eval_depths: str = "1-16"
    """Serving depths of the validation NLL, in the depth-list grammar ('1-16', '1,2,4,8', '1-4,8,16')."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "snapshot_uniform_updates", tuple(self.snapshot_uniform_updates))
        for name in ("updates", "batch_size", "seq_len", "snapshot_batches", "log_every"):
            if getattr(self, name) < 1:
                raise InputError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise InputError(f"train.seed must be >= 0 (numpy seeds are non-negative), got {self.seed}")
        if self.checkpoint_every < 0 or any(n < 0 for n in self.snapshot_uniform_updates):
            raise InputError("train.checkpoint_every and train.snapshot_uniform_updates must be >= 0")
        if self.precision not in PRECISION_CHOICES:
            raise InputError(f"train.precision must be 'fp32' or 'bf16', got {self.precision!r}")
        if self.parallel not in PARALLEL_CHOICES:
            raise InputError(f"train.parallel must be 'ddp' or 'fsdp', got {self.parallel!r}")
        if self.device not in DEVICE_CHOICES:
            raise InputError(f"train.device must be one of {', '.join(DEVICE_CHOICES)}, got {self.device!r}")
        # Parsed here so a bad spec is reported against the config file that holds it.
        try:
            parse_schedule(self.schedule, seed=self.seed, total_updates=self.updates)
        except InputError as err:
            raise InputError(f"train.schedule: {err}") from None
        if self.eval_every < 0:
            raise InputError(f"train.eval_every must be >= 0 (0: off), got {self.eval_every}")
        if self.eval_every % self.log_every:
            raise InputError(
                f"train.eval_every={self.eval_every} must be a multiple of train.log_every={self.log_every} "
                "(the validation NLL goes on the metrics line of its update)"
            )
        deepest = max(self.eval_depth_list)
        if deepest > MAX_SERVING_DEPTH:
            raise InputError(
                f"train.eval_depths {self.eval_depths!r}: depth {deepest} is above the maximum {MAX_SERVING_DEPTH}"
            )

    @property
    def eval_depth_list(self) -> tuple[int, ...]:
        """`eval_depths` as sorted distinct depths."""
        return parse_serving_depths(self.eval_depths, "train.eval_depths", limit=None)


@dataclass(frozen=True)
class MonitorConfig:
    """The in-training update diagnostic (diag/in_training/monitor.py): it never changes the training
    itself, only adds RUN/monitor.h5. A check runs after `step` updates for every positive
    multiple of `every` up to train.updates and at the schedule's switch step. Step 0 is
    not checked: the optimizer has no state yet, so Adam's first update is sign-like (its
    bias correction) and says nothing about the loss surface."""

    every: int = 0
    """Run a check every this many updates; 0: no monitor (the default)."""
    batches: int = 2
    """Diagnostic batches per check, drawn from the run's data source through a stream of their
    own (never the training batches); the interval over them is batch noise of one run only."""
    update_depths: tuple[int, ...] = UPDATE_DEPTHS
    """Depths of the compared updates; the first is the reference, the benefit is against the last."""
    serving_depths: tuple[int, ...] = SERVING_DEPTHS
    """Depths every updated model is evaluated at."""
    eval_sequences: int = 16
    """Evaluation sequences each check scores (the run's evaluation set drawn at this size): the
    cost of a check grows with it."""
    eval_set: str = "auto"
    """'auto' (bioS: 'attributes', the attribute-value tokens of the evaluation presentations, as
    `depthdiag diagnose` scores them; other data: 'snapshot', the held-out set), or either by name."""

    def __post_init__(self) -> None:
        for name in ("update_depths", "serving_depths"):
            depths = checked_depths(getattr(self, name), f"monitor.{name}", limit=MAX_SERVING_DEPTH)
            object.__setattr__(self, name, depths)
        if len(self.update_depths) < 2:
            raise InputError(f"monitor.update_depths needs at least two depths, got {list(self.update_depths)}")
        if not self.serving_depths:
            raise InputError("monitor.serving_depths must not be empty")
        if self.every < 0:
            raise InputError(f"monitor.every must be >= 0 (0: off), got {self.every}")
        for name in ("batches", "eval_sequences"):
            if getattr(self, name) < 1:
                raise InputError(f"monitor.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_set not in EVAL_SET_CHOICES:
            raise InputError(f"monitor.eval_set must be one of {', '.join(EVAL_SET_CHOICES)}, got {self.eval_set!r}")

    @property
    def enabled(self) -> bool:
        return self.every > 0


@dataclass(frozen=True)
class LoggingConfig:
    """Where the metrics lines go besides RUN/metrics.jsonl (rank 0; trainer/sinks.py): the same
    scalars, for watching a run live. Both are optional extras and off by default."""

    tensorboard: bool = False
    """Write TensorBoard event files to RUN/tensorboard (needs the `tensorboard` extra)."""
    wandb: bool = False
    """Log to Weights & Biases (needs the `wandb` extra): offline, into RUN/wandb, unless the
    environment sets WANDB_MODE (e.g. WANDB_MODE=online to upload)."""
    wandb_project: str = "depthdiag"
    """The W&B project; the W&B run is named after the run directory."""

    def __post_init__(self) -> None:
        if not self.wandb_project:
            raise InputError("logging.wandb_project must not be empty")


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "monitor": MonitorConfig,
    "logging": LoggingConfig,
}

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The integers a config field takes: every one ends up in a torch or numpy int64 somewhere
(seeds, shapes, step counters), and beyond them torch and numpy fail with a traceback."""

OPTIONAL_SECTIONS = ("monitor", "logging")
"""Sections left out of `RunConfig.to_dict` while they equal their defaults."""
OPTIONAL_KEYS = {
    "train": ("eval_every", "eval_depths", "parallel"),
    "data": ("planted_fraction", "planted_unit", "planted_queries", "planted_max_hops"),
}
"""Keys left out of `RunConfig.to_dict` while they equal their defaults: runs stored before
they existed must compare equal to runs without them."""


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The looped transformer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where batches and the evaluation set come from."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Depth schedule, length, batch shape, checkpoints and snapshots."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """The in-training update diagnostic (off by default)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """TensorBoard and W&B mirrors of the metrics lines (off by default)."""

    def __post_init__(self) -> None:
        if self.train.seq_len > self.model.max_seq_len:
            raise InputError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        if self.monitor.eval_set == "attributes" and self.data.source != "bios":
            raise InputError(f"monitor.eval_set='attributes' needs data.source='bios', got {self.data.source!r}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section as a dict; OPTIONAL_SECTIONS and OPTIONAL_KEYS only when they differ from
        their defaults, so a run that uses none of them stores exactly the config it stored before
        they existed."""
        values = self.all_sections()
        for name in OPTIONAL_SECTIONS:
            if getattr(self, name) == SECTIONS[name]():
                del values[name]
        for name, keys in OPTIONAL_KEYS.items():
            default = SECTIONS[name]()
            for key in keys:
                if values[name][key] == getattr(default, key):
                    del values[name][key]
        return values

    def all_sections(self) -> dict[str, dict[str, Any]]:
        """Every section as a dict, the optional ones included even when they are the default."""
        return {name: asdict(getattr(self, name)) for name in SECTIONS}

    def outcome_sections(self) -> dict[str, dict[str, Any]]:
        """`all_sections` without the keys that only observe the run (common/observers.py):
        what two configs must share for their runs to be the same training."""
        return without_observer_keys(self.all_sections())

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(
        cls, values: dict[str, Any], source: str = "config", suppliers: Mapping[str, str] | None = None
    ) -> RunConfig:
        """Build and validate; any problem raises InputError naming `source`, or, for a problem
        with values that `suppliers` attributes ('section.key' -> e.g. "--set 'train.seed=3'"),
        the suppliers of the values it names."""
        suppliers = suppliers or {}
        unknown = sorted(set(values) - set(SECTIONS))
        if unknown:
            raise InputError(f"{source}: unknown config section(s): {', '.join(unknown)}")
        sections = {}
        for name, klass in SECTIONS.items():
            section = values.get(name, {})
            if not isinstance(section, dict):
                raise InputError(f"{source}: [{name}] must be a table")
            known = {f.name for f in fields(klass)}
            bad = sorted(set(section) - known)
            if bad:
                raise InputError(f"{source}: unknown key(s) in [{name}]: {', '.join(bad)}")
            for key, value in section.items():
                given_by = suppliers.get(f"{name}.{key}", source)
                expected = _expected_type(klass, key)
                if not _has_type(value, expected):
                    raise InputError(f"{given_by}: {name}.{key} must be {expected}, got {value!r}")
                if isinstance(value, float) and not math.isfinite(value):
                    raise InputError(f"{given_by}: {name}.{key} must be a finite number, got {value!r}")
                if any(not INT64_MIN <= v <= INT64_MAX for v in _integers(value)):
                    raise InputError(
                        f"{given_by}: {name}.{key}={value!r} is outside the 64-bit integer range "
                        f"[{INT64_MIN}, {INT64_MAX}]"
                    )
            try:
                sections[name] = klass(**section)
            except (TypeError, ValueError) as err:
                raise InputError(_blamed(str(err), source, suppliers)) from None
        try:
            return cls(**sections)
        except ValueError as err:
            raise InputError(_blamed(str(err), source, suppliers)) from None

    @classmethod
    def from_json(cls, text: str, source: str = "config") -> RunConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise InputError(f"{source}: config is not valid JSON ({err})") from None
        return cls.from_dict(values, source)

    def with_overrides(self, assignments: list[str] | tuple[str, ...]) -> RunConfig:
        """Apply `section.key=value` assignments; values parse as TOML literals
        (numbers, booleans, arrays, quoted strings) and fall back to bare strings."""
        values = self.all_sections()
        suppliers = _apply_overrides(values, assignments, source="config")
        every = ", ".join(f"--set {assignment!r}" for assignment in assignments) or "config"
        return RunConfig.from_dict(values, source=every, suppliers=suppliers)


def _apply_overrides(values: dict[str, Any], assignments: list[str] | tuple[str, ...], source: str) -> dict[str, str]:
    """Set each `section.key=value` of `assignments` in the raw sections `values` (in place,
    later ones winning); returns 'section.key' -> the assignment that gave it, as errors name it."""
    suppliers = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or section not in SECTIONS:
            raise InputError(f"--set {assignment!r}: expected section.key=value with section in {', '.join(SECTIONS)}")
        if name not in {f.name for f in fields(SECTIONS[section])}:
            raise InputError(f"--set {assignment!r}: unknown key {name!r} in [{section}]")
        table = values.setdefault(section, {})
        if not isinstance(table, dict):
            raise InputError(f"{source}: [{section}] must be a table")
        table[name] = _parse_literal(raw.strip())
        suppliers[f"{section}.{name}"] = f"--set {assignment!r}"
    return suppliers


_NAMED_KEY = re.compile(rf"\b(?:{'|'.join(SECTIONS)})\.\w+")


def _blamed(problem: str, source: str, suppliers: Mapping[str, str]) -> str:
    """'WHO: problem', WHO being the suppliers of the keys `problem` names, `source` first; when
    it names none of theirs (some messages name only one of the keys they check), `source` and
    every supplier."""
    named = dict.fromkeys(suppliers[key] for key in _NAMED_KEY.findall(problem) if key in suppliers)
    who = named or dict.fromkeys([source, *suppliers.values()])
    return f"{', '.join(sorted(who, key=lambda supplier: supplier != source))}: {problem}"


def _integers(value: Any) -> list[int]:
    """The integers a field value holds (bools are flags, not integers)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in items if isinstance(v, int) and not isinstance(v, bool)]


def _expected_type(klass: type, key: str) -> str:
    """'int', 'float', 'str', 'bool' or 'a list of integers', read off the field's default."""
    default = getattr(klass(), key)
    return "a list of integers" if isinstance(default, tuple) else type(default).__name__


def _has_type(value: Any, expected: str) -> bool:
    # TOML and JSON tell bools from ints, and ints from floats; a float field takes an int.
    if isinstance(value, bool):
        return expected == "bool"
    if expected == "a list of integers":
        return isinstance(value, (list, tuple)) and all(_has_type(v, "int") for v in value)
    if expected == "float":
        return isinstance(value, (int, float))
    return type(value).__name__ == expected


def _parse_literal(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a TOML run config and apply `overrides` (`section.key=value`, as `with_overrides`
    parses them), then validate the result once, so an override may complete or correct the
    file; errors raise InputError naming the file, or the override that gave the bad value.

    A relative data.path in the file is relative to the file's folder, one in `overrides`
    (`--set data.path=...`) to the working directory. Either way the config holds it absolute
    (symlinks resolved), so what a run stores (config.json, checkpoints, snapshots) finds the
    data from any working directory, and loading the same file again gives the same config."""
    path = Path(path)
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read config ({err})") from None
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"{path}: invalid TOML ({err})") from None
    suppliers = {
        f"{name}.{key}": str(path) for name, section in values.items() if isinstance(section, dict) for key in section
    }
    suppliers.update(_apply_overrides(values, overrides, source=str(path)))
    data = values.get("data")
    if isinstance(data, dict) and isinstance(data.get("path"), str) and data["path"]:
        folder = path.parent if suppliers["data.path"] == str(path) else Path.cwd()
        if not Path(data["path"]).is_absolute():
            data["path"] = str((folder / data["path"]).resolve())
    return RunConfig.from_dict(values, source=str(path), suppliers=suppliers)


def replace_section(config: RunConfig, section: str, **changes: Any) -> RunConfig:
    """A copy of `config` with some fields of one section changed (validated)."""
    return replace(config, **{section: replace(getattr(config, section), **changes)})
