"""Running a grid's cells (`depthdiag grid run`): one plan and one loop for every executor.

Every cell trains in its own run directory RUNS/axis=label/.../ with `depthdiag train` in a
subprocess (so a crash or Ctrl-C of one cell loses nothing the others wrote): a cell whose
summary.json exists is finished and skipped, one with a checkpoint resumes from it
bit-exactly, and a directory that holds a run of another config is refused before anything
starts (`plan_grid`). `run_cells` then starts the cells up to a limit, waits for them, notes
each in the progress bar, stops the ones in flight on an interrupt and ends with one
RunFailed that names every failed cell and its log. What differs between runners is only how
a cell starts and how it is followed, a `CellExecutor`: `run_grid` here starts each cell as a
process of this machine (output in RUNS/logs/), depthdiag/slurm.py's `submit_grid` as one
Slurm job through submitit (output in RUNS/.submitit/).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from common.errors import InputError, RunFailed
from common.lock import exclusive_output
from common.progress import progress_bar
from common.signals import terminate_raises
from depthdiag.grid import Cell, GridSpec, cell_state, grid_cells


@dataclass(frozen=True)
class GridRunReport:
    """What `run_grid` (or `submit_grid`) did."""

    trained: tuple[str, ...]
    """Cells trained (or resumed) to the end by this call."""
    skipped: tuple[str, ...]
    """Cells that were already finished."""


def train_command(spec: GridSpec, cell: Cell, runs: Path, *, resume: bool, processes: int = 1) -> list[str]:
    """The `depthdiag train` command line that trains (or resumes) `cell`; with `processes` > 1
    under torchrun (one process per GPU, as docs/training.md describes)."""
    run_dir = str(runs / cell.name)
    launcher = [sys.executable, "-m"]
    if processes > 1:
        # torch.distributed.run is torchrun of this very interpreter; --standalone picks a free
        # port, so that several cells on one node do not meet.
        launcher += ["torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", "-m"]
    command = [*launcher, "depthdiag", "train", str(spec.base), "--out", run_dir, "--no-progress"]
    for assignment in cell.overrides:
        command += ["--set", assignment]
    # A new cell's directory, if there is one, holds a start of this very cell (cell_state
    # checked its config) that never reached a checkpoint: start it over.
    return command + (["--resume", run_dir] if resume else ["--force"])


def log_path(runs: Path, name: str) -> Path:
    """The cell's log under RUNS/logs/ (one flat file per cell)."""
    return runs / "logs" / (name.replace("/", "__") + ".log")


def start_note(what: str) -> str:
    """The line a cell's log gets for each start: '# DATE TIME what'."""
    return f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {what}\n"


@dataclass(frozen=True)
class GridPlan:
    """Every cell of a grid and what a runner does with each in its runs folder."""

    cells: list[Cell]
    """All cells, in the grid's order."""
    states: dict[str, str]
    """Each cell's `cell_state` by name."""
    pending: list[Cell]
    """The cells still to train (not finished), in order."""
    skipped: tuple[str, ...]
    """The names of the finished cells."""


def plan_grid(spec: GridSpec, runs: Path) -> GridPlan:
    """Every cell of `spec` and its state (`cell_state`) in `runs`: what every runner starts from,
    so that whichever runs the grid, a finished cell is never trained again."""
    cells = grid_cells(spec)
    states = {cell.name: cell_state(cell, runs) for cell in cells}
    pending = [cell for cell in cells if states[cell.name] != "finished"]
    return GridPlan(cells, states, pending, tuple(cell.name for cell in cells if states[cell.name] == "finished"))


@dataclass(frozen=True)
class CellEnd:
    """How a started cell ended."""

    code: int | None
    """The exit status of its training (0: trained to the end), or None when it ended without one."""
    log: Path
    """Where its output went (named when it failed)."""
    ending: str = ""
    """How it ended when it has no exit status (e.g. 'job 123 ended CANCELLED')."""

    def failure(self, name: str) -> str:
        """The cell `name` as RunFailed lists it."""
        ended = f"exit {self.code}" if self.code is not None else self.ending
        return f"{name} ({ended}, log {self.log})"


class CellExecutor(Protocol):
    """How one kind of runner starts a cell and follows it; `run_cells` does everything else."""

    poll_seconds: float
    """How long the loop waits between two looks at the cells in flight."""

    def start(self, cell: Cell, resume: bool) -> Any:
        """Start training `cell` (from its newest checkpoint when `resume`), note the start in its
        log (`log_path`, `start_note`) and return what `ended` and `stop` follow it by."""

    def ended(self, started: Any) -> CellEnd | None:
        """How a started cell ended, or None while it still runs."""

    def stop(self, started: list[Any]) -> str:
        """Stop the cells still in flight (after an interrupt or an error); returns a line for
        the user, or '' when there is nothing to say."""


def run_cells(spec: GridSpec, runs: Path, executor: CellExecutor, *, jobs: int | None, progress: bool) -> GridRunReport:
    """Train every unfinished cell of `spec` into `runs` with `executor`, at most `jobs` in
    flight (None: all at once). A failed cell does not stop the others; RunFailed names every
    failed cell and its log at the end. An interrupt (Ctrl-C, SIGTERM) stops the cells in flight."""
    plan = plan_grid(spec, runs)
    pending = list(plan.pending)
    running: dict[str, Any] = {}
    trained, failed = [], []
    with (
        exclusive_output(runs),
        terminate_raises(),
        progress_bar(len(plan.cells), "grid", "cell", initial=len(plan.skipped), enabled=progress) as bar,
    ):
        (runs / "logs").mkdir(parents=True, exist_ok=True)
        try:
            while pending or running:
                while pending and (jobs is None or len(running) < jobs):
                    cell = pending.pop(0)
                    running[cell.name] = executor.start(cell, resume=plan.states[cell.name] == "interrupted")
                    bar.set_postfix_str(", ".join(running))
                time.sleep(executor.poll_seconds)
                for name, started in list(running.items()):
                    end = executor.ended(started)
                    if end is None:
                        continue
                    del running[name]
                    if end.code == 0:
                        trained.append(name)
                    else:
                        failed.append(end.failure(name))
                    bar.update(1)
                    bar.set_postfix_str(", ".join(running))
        finally:
            if running and (note := executor.stop(list(running.values()))):
                bar.write(note)
    if failed:
        raise _failed_cells(spec, len(plan.cells), failed)
    return GridRunReport(trained=tuple(trained), skipped=plan.skipped)


def _failed_cells(spec: GridSpec, total: int, failures: Sequence[str]) -> RunFailed:
    """The error that ends a grid run some of whose cells failed; `failures` describe one cell each."""
    listed = "; ".join(failures)
    return RunFailed(f"{spec.path}: {len(failures)} of {total} cells failed: {listed}; rerun to resume them")


class _Processes:
    """Each cell as a `depthdiag train` process of this machine, its output appended to its log."""

    poll_seconds = 0.2

    def __init__(self, spec: GridSpec, runs: Path, threads: int):
        self.spec, self.runs = spec, runs
        self.env = dict(os.environ, OMP_NUM_THREADS=str(threads))

    def start(self, cell: Cell, resume: bool) -> tuple[subprocess.Popen, IO[str]]:
        log = log_path(self.runs, cell.name).open("a", encoding="utf-8")
        command = train_command(self.spec, cell, self.runs, resume=resume)
        log.write(start_note(" ".join(command)))
        log.flush()  # before the process appends to the same file
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env), log

    def ended(self, started: tuple[subprocess.Popen, IO[str]]) -> CellEnd | None:
        process, log = started
        if process.poll() is None:
            return None
        log.close()
        return CellEnd(process.returncode, Path(log.name))

    def stop(self, started: list[tuple[subprocess.Popen, IO[str]]]) -> str:
        for process, log in started:
            process.terminate()
            process.wait()
            log.close()
        return ""


def run_grid(
    spec: GridSpec,
    runs: str | Path,
    *,
    jobs: int | None = 1,
    threads: int = 1,
    progress: bool = True,
) -> GridRunReport:
    """Train every unfinished cell of `spec` into `runs`, `jobs` at a time, each with
    `threads` torch threads. A failed cell does not stop the others; RunFailed names every
    failed cell and its log at the end; `jobs` None is 1. (depthdiag/slurm.py's `submit_grid`
    runs the same cells as one submitit job each.)"""
    jobs = 1 if jobs is None else jobs
    if jobs < 1 or threads < 1:
        raise InputError("--jobs and --threads must be >= 1")
    runs = Path(runs)
    return run_cells(spec, runs, _Processes(spec, runs, threads), jobs=jobs, progress=progress)
