"""Experiment grids: one TOML file names a base config and the axes to vary;
depthdiag/grid_run.py's `run_grid` trains every cell that is not finished, `collect_grid`
evaluates every finished cell at many serving depths and writes one xarray/HDF5 file with a
dimension per axis (schema: analysis/grid_file.py).

A grid file:

    base = "../configs/grid-tiny.toml"      # relative to the grid file (as a data.path it assigns is)
    serving = "1-64"                         # the depths `grid collect` evaluates (default 1-64)
    [set]                                    # overrides of the base for every cell
    "train.log_every" = 10
    [budget]                                 # optional: how the `budget` axis sizes runs
    match = "flops"                          # or "updates"
    reference = "uniform:1-16"               # flops: this schedule over the base's updates is 100%
    [axes]
    schedule = { fixed4 = "fixed:4", uniform = "uniform:1-16",
                 uniform-matched = { schedule = "uniform:1-16", flops_of = "fixed4" } }
    seed = [0, 1, 2]
    budget = [0.15, 0.45, 1.0]

Axis names are config keys (`optim.lr`) or the shorthands `schedule` (train.schedule),
`seed` (train.seed) and `budget` (a fraction of the base run's budget: its updates, or
with match = "flops" the modeled FLOPs of `reference` over them, which every schedule's
run is sized to spend by the iso-FLOP solver of trainer/flops.py, to within one update).
An axis is a list of values (each its own label) or a table label -> value, where a value
may be a table of several assignments; `flops_of = LABEL` sizes a cell to the modeled FLOPs
of the cell with that label on the same axis (every other coordinate equal), as the
paper's compute-matched uniform run is.

Every cell trains in its own run directory RUNS/axis=label/.../; `cell_state` tells a
finished cell from an interrupted or new one (and refuses a directory that holds a run of
another config). How the cells are run, as processes or as Slurm jobs: depthdiag/grid_run.py.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import re
import tomllib
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.depths import parse_serving_depths
from common.errors import InputError
from common.progress import progress_bar
from trainer.checkpoint import CHECKPOINT_DIR, checkpoint_name, latest_checkpoint
from trainer.config import RunConfig, load_config
from trainer.flops import iso_flop_updates, schedule_flops
from trainer.run_dir import EVAL_CACHE
from trainer.schedules import parse_schedule

SHORTHANDS = {"schedule": "train.schedule", "seed": "train.seed"}
"""Axis names (and assignment keys) that stand for a config key."""
BUDGET = "budget"
"""The axis of budget fractions."""
FLOPS_OF = "flops_of"
"""The assignment key that sizes a cell to another cell's modeled FLOPs."""
MATCHES = ("updates", "flops")
"""How a budget fraction sizes a run."""
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+:,=-]*$")


@dataclass(frozen=True)
class AxisValue:
    """One coordinate of an axis and what it changes in a cell."""

    label: str | int | float
    """The coordinate (the value itself for a list axis)."""
    assignments: tuple[tuple[str, Any], ...]
    """(config key, value) pairs, `budget` and `flops_of` included, in the file's order."""

    def get(self, key: str) -> Any:
        return dict(self.assignments).get(key)


@dataclass(frozen=True)
class Axis:
    """One dimension of the grid."""

    name: str
    """The dimension's name (a config key, or schedule, seed, budget)."""
    values: tuple[AxisValue, ...]
    """Its coordinates in the file's order."""


@dataclass(frozen=True)
class Budget:
    """How a budget fraction sizes a run."""

    match: str
    """'updates' (fraction x the base's updates) or 'flops' (the iso-FLOP solver)."""
    reference: str
    """Schedule whose run over the base's updates is the full FLOP budget (match = 'flops')."""


@dataclass(frozen=True)
class GridSpec:
    """A parsed grid file."""

    path: Path
    """The grid file."""
    text: str
    """Its text (stored in the collected file)."""
    base: Path
    """The base run config (resolved against the grid file's folder)."""
    overrides: tuple[tuple[str, Any], ...]
    """[set]: config assignments applied to every cell before the axes'."""
    axes: tuple[Axis, ...]
    """The grid's axes in the file's order."""
    budget: Budget | None
    """The [budget] table, when the grid has one."""
    serving: str = "1-64"
    """Serving depths `grid collect` evaluates every cell at (the file's `serving`; default 1-64)."""


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    coords: tuple[tuple[str, str | int | float], ...]
    """(axis name, label) for every axis, in axis order."""
    config: RunConfig
    """The cell's run config, train.updates sized by its budget."""
    overrides: tuple[str, ...]
    """KEY=VALUE assignments that turn the base config into `config` (for `depthdiag train --set`)."""
    modeled_flops: float
    """Expected modeled FLOPs of the run (trainer/flops.py)."""

    @property
    def name(self) -> str:
        """The cell's run directory below the grid's runs directory."""
        return _cell_name(self.coords)

    @property
    def key(self) -> tuple:
        """The labels in axis order (the cell's coordinates in the collected file)."""
        return tuple(label for _, label in self.coords)


def _cell_name(coords: tuple[tuple[str, Any], ...]) -> str:
    return "/".join(f"{axis}={label}" for axis, label in coords)


def _toml_literal(value: Any) -> str:
    """`value` as a TOML literal, the form `--set KEY=VALUE` parses."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    raise InputError(f"unsupported value {value!r} (strings, numbers, booleans and lists only)")


def _check_key(source: Path, key: str, where: str) -> str:
    key = SHORTHANDS.get(key, key)
    if key in (BUDGET, FLOPS_OF):
        return key
    section, _, field_name = key.partition(".")
    if not field_name or not section.isidentifier() or not field_name.isidentifier():
        raise InputError(
            f"{source}: {where}: {key!r} is neither a config key (section.key) nor one of "
            f"schedule, seed, {BUDGET}, {FLOPS_OF}"
        )
    return key


def _label(source: Path, axis: str, label: Any) -> str | int | float:
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise InputError(f"{source}: axis {axis!r}: a label must be a string or a number, got {label!r}")
    if isinstance(label, float) and not math.isfinite(label):
        raise InputError(f"{source}: axis {axis!r}: label {label!r} is not finite")
    if isinstance(label, str) and not _LABEL.match(label):
        raise InputError(
            f"{source}: axis {axis!r}: label {label!r} must be letters, digits and . _ + : , = - (it names a directory)"
        )
    return label


def _axis_value(source: Path, axis: str, label: Any, value: Any) -> AxisValue:
    label = _label(source, axis, label)
    if isinstance(value, dict):
        if not value:
            raise InputError(f"{source}: axis {axis!r}: value {label!r} assigns nothing")
        pairs = [(_check_key(source, key, f"axis {axis!r}, value {label!r}"), v) for key, v in value.items()]
    else:
        pairs = [(_check_key(source, axis, f"axis {axis!r}"), value)]
    for key, v in pairs:
        if key == BUDGET and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 100):
            raise InputError(f"{source}: axis {axis!r}: a budget fraction must be a number > 0, got {v!r}")
        if key == FLOPS_OF and not isinstance(v, (str, int, float)):
            raise InputError(f"{source}: axis {axis!r}: {FLOPS_OF} names a label of the axis, got {v!r}")
    return AxisValue(label=label, assignments=tuple(pairs))


def _parse_axis(source: Path, name: str, values: Any) -> Axis:
    if isinstance(values, list):
        parsed = [_axis_value(source, name, v, v) for v in values]
    elif isinstance(values, dict):
        parsed = [_axis_value(source, name, label, v) for label, v in values.items()]
    else:
        raise InputError(f"{source}: axis {name!r} must be a list of values or a table label -> value")
    if not parsed:
        raise InputError(f"{source}: axis {name!r} has no values")
    labels = [str(v.label) for v in parsed]
    if len(set(labels)) != len(labels):
        raise InputError(f"{source}: axis {name!r} repeats a label")
    for value in parsed:
        target = value.get(FLOPS_OF)
        if target is not None and str(target) not in labels:
            raise InputError(f"{source}: axis {name!r}: {FLOPS_OF} = {target!r} is not a label of the axis")
    return Axis(name=name, values=tuple(parsed))


def _data_path(folder: Path, key: str, value: Any) -> Any:
    """A relative data.path assigned in the grid file, made absolute against the file's folder
    (as trainer/config.py does for a config file's); any other assignment as it is."""
    if key != "data.path" or not isinstance(value, str) or not value or Path(value).is_absolute():
        return value
    return str((folder / value).resolve())


def _axis_paths(folder: Path, name: str, values: Any) -> Any:
    """An axis of the grid file with its data.path assignments made absolute (`_data_path`).
    Only a table axis can assign a path: a list axis's values are labels, which name folders."""
    if not isinstance(values, dict):
        return values
    return {
        label: {key: _data_path(folder, key, v) for key, v in value.items()}
        if isinstance(value, dict)
        else _data_path(folder, name, value)
        for label, value in values.items()
    }


def _literal(text: str) -> Any:
    """A value given on the command line: a TOML literal (0, 0.5, "a"), else the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_grid(
    path: str | Path,
    axis_values: Sequence[str] = (),
    *,
    base: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> GridSpec:
    """Read and check a grid file. `axis_values` ("seed=0,1,2,3") replace a list axis's
    values, as `--axis` does on the command line, `base` replaces its base config (`--base`)
    and `overrides` ("train.updates=4800", `--set`) follow its [set]."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        raw = tomllib.loads(text)
    except FileNotFoundError:
        raise InputError(f"{path}: no such grid file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read the grid file ({err})") from None
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"{path}: invalid TOML ({err})") from None
    unknown = set(raw) - {"base", "serving", "set", "budget", "axes"}
    if unknown:
        raise InputError(f"{path}: unknown key(s) {', '.join(sorted(unknown))} (base, serving, set, budget, axes)")
    serving = raw.get("serving", "1-64")
    if not isinstance(serving, str):
        raise InputError(f'{path}: serving must be a depth list such as "1-64" or "1-16,32,64"')
    parse_serving_depths(serving, f"{path}: serving")
    if not isinstance(raw.get("base"), str):
        raise InputError(f"{path}: `base` (the base run config, relative to the grid file) is missing")
    for table in ("set", "budget", "axes"):
        if not isinstance(raw.get(table, {}), dict):
            raise InputError(f"{path}: `{table}` must be a table ([{table}])")
    axes_table = {name: _axis_paths(path.parent, name, values) for name, values in raw.get("axes", {}).items()}
    for assignment in axis_values:
        name, sep, values = assignment.partition("=")
        if not sep or name.strip() not in axes_table or not isinstance(axes_table[name.strip()], list):
            raise InputError(f"--axis {assignment!r}: expected NAME=V1,V2,... for a list axis of {path}")
        axes_table[name.strip()] = [_literal(v.strip()) for v in values.split(",")]
    if not axes_table:
        raise InputError(f"{path}: [axes] names no axis to vary")
    axes = tuple(_parse_axis(path, name, values) for name, values in axes_table.items())
    budget = raw.get("budget")
    if budget is not None:
        if not isinstance(budget, dict) or budget.get("match") not in MATCHES:
            raise InputError(f"{path}: [budget] match must be one of {', '.join(MATCHES)}")
        if budget["match"] == "flops" and not isinstance(budget.get("reference"), str):
            raise InputError(f"{path}: [budget] match = 'flops' needs reference = a schedule spec")
        budget = Budget(match=budget["match"], reference=budget.get("reference", ""))
    uses_budget = any(
        value.get(BUDGET) is not None or value.get(FLOPS_OF) is not None for a in axes for value in a.values
    )
    if uses_budget and budget is None:
        raise InputError(f"{path}: a budget axis or {FLOPS_OF} needs a [budget] table (match = 'updates' or 'flops')")
    settings = [
        (_check_key(path, key, "[set]"), _data_path(path.parent, key, v)) for key, v in raw.get("set", {}).items()
    ]
    for assignment in overrides:
        key, sep, value = assignment.partition("=")
        if not sep:
            raise InputError(f"--set {assignment!r}: expected KEY=VALUE")
        settings.append((_check_key(path, key.strip(), "--set"), _literal(value.strip())))
    return GridSpec(
        path=path,
        text=text,
        base=Path(base) if base is not None else path.parent / raw["base"],
        overrides=tuple(settings),
        axes=axes,
        budget=budget,
        serving=serving,
    )


def _config(spec: GridSpec, name: str, overrides: list[str]) -> RunConfig:
    try:
        return load_config(spec.base, overrides)
    except InputError as err:
        raise InputError(f"{spec.path}: cell {name}: {err}") from None


def _flops(config: RunConfig, schedule_spec: str, updates: int) -> float:
    tc = config.train
    schedule = parse_schedule(schedule_spec, seed=tc.seed, total_updates=updates)
    return schedule_flops(config.model, schedule, batch_size=tc.batch_size, seq_len=tc.seq_len)


def _sized_updates(spec: GridSpec, config: RunConfig, fraction: float, matched_flops: float | None) -> int:
    """train.updates of a cell: the base's updates scaled by its budget fraction, or the
    run length of its schedule that spends the FLOP budget (or `matched_flops`)."""
    tc = config.train
    if matched_flops is None and (spec.budget is None or spec.budget.match == "updates"):
        return max(1, round(fraction * tc.updates))
    if matched_flops is None:
        matched_flops = fraction * _flops(config, spec.budget.reference, tc.updates)
    return iso_flop_updates(
        config.model, tc.schedule, matched_flops, batch_size=tc.batch_size, seq_len=tc.seq_len, seed=tc.seed
    )


def grid_cells(spec: GridSpec) -> list[Cell]:
    """Every cell of the grid (the product of its axes, first axis slowest), configs
    checked and budgets sized; a bad assignment raises InputError naming the cell."""
    combos = {
        tuple(value.label for value in combo): combo for combo in itertools.product(*(a.values for a in spec.axes))
    }
    cells: dict[tuple, Cell] = {}
    # Cells sized to another cell's FLOPs come after the cells they follow.
    for key in sorted(combos, key=lambda k: any(v.get(FLOPS_OF) is not None for v in combos[k])):
        combo = combos[key]
        coords = tuple((axis.name, label) for axis, label in zip(spec.axes, key, strict=True))
        name = _cell_name(coords)
        assignments = list(spec.overrides) + [pair for value in combo for pair in value.assignments]
        overrides = [f"{k}={_toml_literal(v)}" for k, v in assignments if k not in (BUDGET, FLOPS_OF)]
        config = _config(spec, name, overrides)
        fraction = math.prod(float(v) for k, v in assignments if k == BUDGET)
        matched = None
        for index, value in enumerate(combo):
            target = value.get(FLOPS_OF)
            if target is None:
                continue
            label = next(v.label for v in spec.axes[index].values if str(v.label) == str(target))
            sibling = key[:index] + (label,) + key[index + 1 :]
            if sibling not in cells:
                raise InputError(f"{spec.path}: cell {name}: {FLOPS_OF} = {target!r} names a cell sized the same way")
            matched = cells[sibling].modeled_flops
        updates = _sized_updates(spec, config, fraction, matched)
        overrides.append(f"train.updates={updates}")
        config = _config(spec, name, overrides)
        cells[key] = Cell(
            coords=coords,
            config=config,
            overrides=tuple(overrides),
            modeled_flops=_flops(config, config.train.schedule, updates),
        )
    return [cells[key] for key in combos]


# --- a cell's state in its runs folder (what running and collecting start from) -------------


def _stored_config(run_dir: Path) -> RunConfig | None:
    path = run_dir / "config.json"
    if not path.is_file():
        return None
    try:
        return RunConfig.from_json(path.read_text(encoding="utf-8"), source=str(path))
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read ({err})") from None


def cell_state(cell: Cell, runs: Path) -> str:
    """'finished', 'interrupted' (a checkpoint to resume from) or 'new'; a run directory
    that holds a run of another config raises InputError."""
    run_dir = runs / cell.name
    stored = _stored_config(run_dir)
    if stored is not None and stored.outcome_sections() != cell.config.outcome_sections():
        before, after = stored.outcome_sections(), cell.config.outcome_sections()
        changed = [f"{s}.{k}" for s in before for k in before[s] if before[s][k] != after[s][k]]
        raise InputError(
            f"{run_dir}: holds a run of another config ({', '.join(changed)} changed); "
            "remove it, or write the grid to another --runs directory"
        )
    if (run_dir / "summary.json").is_file():
        return "finished"
    if latest_checkpoint(run_dir) is not None:
        return "interrupted"
    return "new"


# --- collecting -----------------------------------------------------------------------------


def _metrics(run_dir: Path) -> tuple[list[int], list[float], list[int]]:
    """(step, loss, updates covered) of every line of the run's metrics.jsonl."""
    from analysis.training import read_metrics

    metrics = read_metrics(run_dir)
    updates = metrics["updates"].values.tolist()
    covered = [done - before for before, done in zip([0, *updates], updates)]
    return [done - 1 for done in updates], metrics["loss"].values.tolist(), covered


def _evaluation(checkpoint: Path, run_dir: Path, serving: tuple[int, ...], *, device: str, progress: bool):
    """The checkpoint's NLL (and bioS recall) per serving depth, from the cell's cache when
    it was computed for this very checkpoint and these depths."""
    import xarray as xr

    from analysis.store import ENGINE, write_dataset
    from trainer.checkpoint import file_sha256
    from trainer.evaluate import evaluate_checkpoint

    cache = run_dir / EVAL_CACHE
    if cache.is_file():
        with xr.open_dataset(cache, engine=ENGINE) as stored:
            stored = stored.load()
        if (
            stored.attrs.get("checkpoint_sha256") == file_sha256(checkpoint)
            and tuple(int(s) for s in stored["serving_depth"].values) == serving
        ):
            return stored
    evaluated = evaluate_checkpoint(checkpoint, serving, device=device, progress=progress)
    write_dataset(evaluated, cache)
    return evaluated


def _schedule_facts(config: RunConfig) -> dict[str, Any]:
    from trainer.schedules import FixedFirstSchedule, FixedSchedule

    tc = config.train
    schedule = parse_schedule(tc.schedule, seed=tc.seed, total_updates=tc.updates)
    first = isinstance(schedule, FixedFirstSchedule)
    return {
        "schedule_spec": schedule.spec,
        "initial_depth": schedule.k0 if first else schedule.depth if isinstance(schedule, FixedSchedule) else 0,
        "switch_fraction": float(schedule.switch) if first else math.nan,
        "switch_step": schedule.switch_step if first else -1,
        "finish": schedule.finish.spec if first else schedule.spec,
    }


def collect_cell(cell: Cell, runs: Path, serving: tuple[int, ...], *, device: str = "cpu", progress: bool = False):
    """One finished cell's entry of the collected file (analysis.grid.grid_dataset)."""
    run_dir = runs / cell.name
    if cell_state(cell, runs) != "finished":
        raise InputError(f"{run_dir}: the cell has not finished training; run `depthdiag grid run` first")
    checkpoint = latest_checkpoint(run_dir)
    updates = cell.config.train.updates
    if checkpoint is None or checkpoint.name not in (checkpoint_name(updates), checkpoint_name(updates, sharded=True)):
        raise InputError(f"{run_dir}: no checkpoint of the final update ({updates}) in {run_dir / CHECKPOINT_DIR}")
    summary_path = run_dir / "summary.json"
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        wall_time, flops = float(summary["wall_time"]), float(summary["flops"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise InputError(f"{summary_path}: not a run summary ({err})") from None
    evaluated = _evaluation(checkpoint, run_dir, serving, device=device, progress=progress)
    steps, losses, covered = _metrics(run_dir)
    return {
        "nll": evaluated["nll"].values,
        "recall_bits": evaluated["recall_bits"].values if "recall_bits" in evaluated else None,
        "loss_steps": steps,
        "loss": losses,
        "loss_updates": covered,
        "updates": updates,
        "modeled_flops": cell.modeled_flops,
        "flops": flops,
        "wall_time": wall_time,
        **_schedule_facts(cell.config),
    }


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def collect_grid(
    spec: GridSpec,
    runs: str | Path,
    *,
    serving: Sequence[int] | None = None,
    device: str = "cpu",
    jobs: int = 1,
    progress: bool = True,
):
    """Evaluate every cell of `spec` (all must have finished) at `serving` depths (default:
    the grid file's), `jobs` cells at a time in processes of one torch thread each, and
    return the collected Dataset (analysis/grid.py): one entry per cell, a dimension per axis."""
    import datetime

    from analysis.grid import grid_dataset
    from common.provenance import provenance
    from trainer.data.sources import build_source
    from trainer.distributed import resolve_device
    from trainer.machine import machine

    runs = Path(runs)
    cells = grid_cells(spec)
    unfinished = [cell.name for cell in cells if cell_state(cell, runs) != "finished"]
    if unfinished:
        raise InputError(
            f"{runs}: {len(unfinished)} of {len(cells)} cells have not finished ({', '.join(unfinished[:3])}"
            f"{', ...' if len(unfinished) > 3 else ''}); run `depthdiag grid run {spec.path}` first"
        )
    serving = parse_serving_depths(spec.serving) if serving is None else tuple(int(s) for s in serving)
    entries = {}
    with progress_bar(len(cells), "collect", "cell", enabled=progress) as bar:
        if jobs == 1:
            for cell in cells:
                entries[cell.key] = collect_cell(cell, runs, serving, device=device)
                bar.update(1)
        else:
            # Small models use one core each better than two threads share one model.
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(jobs, mp_context=context, initializer=_one_thread) as pool:
                futures = {pool.submit(collect_cell, cell, runs, serving, device=device): cell for cell in cells}
                for future in as_completed(futures):
                    entries[futures[future].key] = future.result()
                    bar.update(1)
    attrs = {
        "grid": spec.text,
        "grid_file": str(spec.path),
        "runs": str(runs),
        "base_config": cells[0].config.to_json(),
        "budget_match": spec.budget.match if spec.budget else "updates",
        "budget_reference": spec.budget.reference if spec.budget else "",
        **provenance(),
        # The evaluating processes' machine: one thread each when several evaluate (_one_thread).
        "machine": {**machine(resolve_device(device).type), **({"threads": 1} if jobs > 1 else {})},
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    data = cells[0].config.data
    if data.source == "bios":
        attrs["recall_ceiling_bits"] = float(build_source(data).spec.bits_per_person)
    axes = {axis.name: [value.label for value in axis.values] for axis in spec.axes}
    return grid_dataset(axes, entries, serving_depths=list(serving), attrs=attrs)


def format_cells(spec: GridSpec, runs: str | Path) -> str:
    """One line per cell: its name, schedule, updates, modeled FLOPs and state."""
    runs = Path(runs)
    lines = [f"{'cell':<40} {'schedule':<56} {'updates':>8} {'modeled FLOPs':>14}  state"]
    for cell in grid_cells(spec):
        tc = cell.config.train
        state = cell_state(cell, runs)
        lines.append(f"{cell.name:<40} {tc.schedule:<56} {tc.updates:>8,} {cell.modeled_flops:>14.4e}  {state}")
    return "\n".join(lines)
