"""`depthdiag recommend`: a fixed-first schedule for a run of N updates, sized from a pilot
run's in-training monitor (RUN/monitor.h5).

The finishing-phase length F and the switch arithmetic are pure functions in
analysis/recommend.py (no torch); this module adds what needs the trainer: the pilot's
schedule (its K0 and finishing schedule, from the run config the monitor file stores) and
the modeled training compute of the recommended schedule (trainer/flops.py, on the pilot's
model, batch size and sequence length) against uniform:1-16 and against the paper's 80%
switch with the pilot's K0 and finish.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from analysis.monitor import open_monitor
from analysis.recommend import FinishLength, SwitchPlan, describe_finish, finish_length, format_checks, switch_plan
from analysis.stats import IntervalOptions
from common.errors import InputError
from common.outputs import GRID_SPEC_HEADER
from trainer.config import RunConfig
from trainer.flops import UNIFORM_REFERENCE, flops_report, mean_depth
from trainer.model import ModelConfig
from trainer.schedules import FixedFirstSchedule, parse_schedule

PAPER_SWITCH = 0.8
"""The paper's default switch: the last 20% of the updates finish at many depths."""


@dataclasses.dataclass(frozen=True)
class RecommendConfig:
    """What `depthdiag recommend` was asked."""

    monitor: Path
    """The pilot run's RUN/monitor.h5."""
    updates: int
    """N: length of the run to plan."""
    threshold: float = 0.05
    checks: int = 2
    margin: float = 1.5
    rule: str = "fraction"
    options: IntervalOptions = IntervalOptions()
    include_embeddings: bool = False


@dataclasses.dataclass(frozen=True)
class ScheduleCompute:
    spec: str
    modeled_flops: float
    relative_to_uniform: float


@dataclasses.dataclass(frozen=True)
class Recommendation:
    monitor: str
    pilot_schedule: str
    pilot_updates: int
    finish: FinishLength
    plan: SwitchPlan
    spec: str
    """The recommended schedule for `plan.updates` updates."""
    recommended: ScheduleCompute
    paper: ScheduleCompute
    """The paper's 80% switch with the pilot's K0 and finish, over the same updates."""
    uniform_flops: float
    saving_vs_uniform: float
    """1 - recommended / uniform:1-16 modeled FLOPs."""
    saving_vs_paper: float
    """1 - recommended / paper modeled FLOPs (negative: the recommendation costs more)."""
    batch_size: int | None
    seq_len: int | None
    include_embeddings: bool
    cost_model: str = "modeled FLOPs"
    """'modeled FLOPs' (trainer/flops.py on the pilot's depthdiag model), or 'core iterations'
    for a pilot monitored in another codebase (diag.DepthMonitor): every update costs its depth."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Pilot:
    """What the pilot run's monitor file says of the run."""

    schedule: FixedFirstSchedule
    updates: int
    seed: int
    model: ModelConfig | None
    """The depthdiag model, for modeled FLOPs; None for a model of another codebase."""
    batch_size: int | None = None
    seq_len: int | None = None


def _pilot(ds, source: Path) -> _Pilot:
    text = ds.attrs.get("config")
    if not isinstance(text, str):
        raise InputError(f"{source}: no run config (attribute 'config') to read the pilot's schedule and model from")
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        document = None
    if isinstance(document, dict) and "depth_monitor" in document:  # diag.DepthMonitor in another loop
        settings = document["depth_monitor"]
        spec, updates, seed = settings.get("schedule"), settings.get("updates"), settings.get("seed", 0)
        if not spec or not isinstance(updates, int):
            raise InputError(
                f"{source}: the monitor was given no depth schedule and number of updates "
                "(DepthMonitor(schedule=..., updates=...)): there is no switch to size a finishing phase from"
            )
        schedule = parse_schedule(spec, seed=seed, total_updates=updates)
        model = batch_size = seq_len = None
    else:
        config = RunConfig.from_json(text, source=str(source))
        train = config.train
        spec, updates, seed = train.schedule, train.updates, train.seed
        schedule = parse_schedule(spec, seed=seed, total_updates=updates)
        model, batch_size, seq_len = config.model, train.batch_size, train.seq_len
    if not isinstance(schedule, FixedFirstSchedule):
        raise InputError(f"{source}: the pilot's schedule {spec} is not fixed-first: there is no switch")
    return _Pilot(schedule, updates, seed, model, batch_size, seq_len)


def _core_iterations(specs: list[str], *, updates: int, seed: int) -> list[ScheduleCompute]:
    """Each schedule's training depth summed over `updates` updates, relative to uniform:1-16's:
    the compute of a model whose every update costs its depth (the looped part alone)."""
    uniform = mean_depth(parse_schedule(UNIFORM_REFERENCE, seed=seed, total_updates=updates))
    rows = []
    for spec in specs:
        depth = mean_depth(parse_schedule(spec, seed=seed, total_updates=updates))
        rows.append(ScheduleCompute(spec=spec, modeled_flops=depth * updates, relative_to_uniform=depth / uniform))
    return rows


def fixed_first_spec(k0: int, switch: str, finish: str) -> str:
    return f"fixed-first:k0={k0},switch={switch},finish={finish}"


def recommend(config: RecommendConfig) -> Recommendation:
    """F from the pilot's monitor file, the switch for `config.updates` updates, the spec and
    its modeled compute. Bad input raises InputError naming the monitor file."""
    ds = open_monitor(config.monitor)
    finish = finish_length(
        ds,
        source=config.monitor,
        threshold=config.threshold,
        checks=config.checks,
        rule=config.rule,
        options=config.options,
    )
    pilot = _pilot(ds, config.monitor)
    schedule = pilot.schedule
    plan = switch_plan(finish.finish_updates, updates=config.updates, margin=config.margin)
    spec = fixed_first_spec(schedule.k0, plan.switch_text, schedule.finish.spec)
    paper_spec = fixed_first_spec(schedule.k0, f"{PAPER_SWITCH:g}", schedule.finish.spec)
    planned = parse_schedule(spec, seed=pilot.seed, total_updates=config.updates)
    if planned.switch_step != plan.switch_step:  # switch_text guarantees it
        raise AssertionError(f"{spec} switches at step {planned.switch_step}, not {plan.switch_step}")
    if pilot.model is None:
        recommended, paper = _core_iterations([spec, paper_spec], updates=config.updates, seed=pilot.seed)
    else:
        report = flops_report(
            pilot.model,
            [spec, paper_spec],
            updates=config.updates,
            batch_size=pilot.batch_size,
            seq_len=pilot.seq_len,
            seed=pilot.seed,
            include_embeddings=config.include_embeddings,
        )
        recommended, paper = (
            ScheduleCompute(spec=s, modeled_flops=row.modeled_flops, relative_to_uniform=row.relative_to_uniform)
            for s, row in zip((spec, paper_spec), report.schedules)
        )
    return Recommendation(
        monitor=str(config.monitor),
        pilot_schedule=schedule.spec,
        pilot_updates=pilot.updates,
        finish=finish,
        plan=plan,
        spec=spec,
        recommended=recommended,
        paper=paper,
        uniform_flops=recommended.modeled_flops / recommended.relative_to_uniform,
        saving_vs_uniform=1 - recommended.relative_to_uniform,
        saving_vs_paper=1 - recommended.modeled_flops / paper.modeled_flops,
        batch_size=pilot.batch_size,
        seq_len=pilot.seq_len,
        include_embeddings=config.include_embeddings,
        cost_model="modeled FLOPs" if pilot.model is not None else "core iterations",
    )


def format_recommendation(rec: Recommendation) -> str:
    """The short report `depthdiag recommend` prints."""
    finish, plan = rec.finish, rec.plan
    lines = [
        f"pilot: {rec.monitor} ({rec.pilot_schedule} over {rec.pilot_updates:,} updates, switch at step "
        f"{finish.switch_step})",
        f"depth-averaged benefit at the switch: {finish.switch.describe()}; after it:",
        format_checks(finish),
        describe_finish(finish),
        f"F' = ceil({plan.margin:g} x {plan.finish_updates}) = {plan.planned_finish_updates} finishing updates "
        f"(safety margin {plan.margin:g})",
    ]
    switch = f"switch = 1 - {plan.planned_finish_updates}/{plan.updates:,} = {plan.switch_text}"
    if plan.clamped:
        switch = (
            f"switch = 0 (clamped from 1 - {plan.planned_finish_updates}/{plan.updates:,} < 0: the whole run "
            "is the finishing phase and still shorter than F')"
        )
    lines += [
        f"for {plan.updates:,} updates: {switch}, the switch at step {plan.switch_step:,} "
        f"({plan.updates - plan.switch_step:,} finishing updates)",
        f"recommended: {rec.spec}",
        (
            f"modeled training compute (the pilot's model, {rec.batch_size} x {rec.seq_len} tokens per update, "
            f"LM head {'included' if rec.include_embeddings else 'excluded'}), over {plan.updates:,} updates:"
            if rec.cost_model == "modeled FLOPs"
            else f"training compute as core iterations (every update costs its depth: the looped part alone; the "
            f"pilot's model is from another codebase), over {plan.updates:,} updates:"
        ),
        f"  {rec.spec}: {rec.recommended.relative_to_uniform:.2%} of {UNIFORM_REFERENCE} "
        f"(saves {rec.saving_vs_uniform:.2%})",
        f"  {rec.paper.spec} (the paper's 80% switch): {rec.paper.relative_to_uniform:.2%} of {UNIFORM_REFERENCE}; "
        f"the recommendation needs {1 - rec.saving_vs_paper:.2%} of its compute "
        f"({'saves' if rec.saving_vs_paper >= 0 else 'costs'} {abs(rec.saving_vs_paper):.2%}"
        f"{'' if rec.saving_vs_paper >= 0 else ' more'})",
    ]
    return "\n".join(lines)


def comparison_grid(rec: Recommendation, *, base: Path, out: Path, seeds: tuple[int, ...]) -> str:
    """An experiment grid (depthdiag/grid.py) that trains the recommended schedule against the
    paper's 80% switch and uniform:1-16 over the same updates for every seed, on `base` with
    the monitor off and no snapshots; evaluated at serving depths 1..16. `base` is written
    relative to the folder of `out`, where the grid file goes."""
    relative = Path(os.path.relpath(Path(base).resolve(), Path(out).resolve().parent))
    return "\n".join(
        [
            f"{GRID_SPEC_HEADER} from {rec.monitor}:",
            f"# F = {rec.finish.finish_updates} uniform updates, F' = {rec.plan.planned_finish_updates} with the "
            f"margin {rec.plan.margin:g}. The recommended schedule",
            "# against the paper's 80% switch and uniform:1-16 over the same updates, for every seed.",
            f"base = {json.dumps(str(relative))}",
            'serving = "1-16"',
            "",
            "[set]",
            f'"train.updates" = {rec.plan.updates}',
            '"train.snapshot_uniform_updates" = []',
            '"monitor.every" = 0',
            "",
            "[axes.schedule]",
            f"recommended = {json.dumps(rec.spec)}",
            f"ff80 = {json.dumps(rec.paper.spec)}",
            f"uniform = {json.dumps(UNIFORM_REFERENCE)}",
            "",
            "[axes]",
            f"seed = [{', '.join(str(s) for s in seeds)}]",
            "",
        ]
    )
