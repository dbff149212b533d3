"""`depthdiag grid run --executor slurm`: every unfinished cell of a grid as one job submitted
through submitit (the `slurm` extra), waited for with a progress bar.

A cell's job runs the very command the local runner starts (`grid_run.train_command`:
`depthdiag train`, or under torchrun with several GPUs per cell) in the folder the grid was
submitted from, so a cell trains, resumes and fails the same way whichever runner runs it.
The plan and the loop are the local runner's (`grid_run.run_cells`); this module only says
how a cell's job is submitted, followed and cancelled (`_SubmititJobs`). A finished cell is
never submitted again, an interrupted one resumes from its newest checkpoint (the job reads
the cell's state when it starts, so a job Slurm requeues resumes too). Each job's output (the cell's training
log, stderr included) is submitit's `RUNS/.submitit/CELL/JOBID_0_log.out`, and every
submission is noted in the cell's `RUNS/logs/CELL.log` as the local runner's starts are.

`--executor submitit-local` runs the same path with submitit's local executor (jobs are
processes of this machine): how the tests, and a user without a cluster, check it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InputError
from depthdiag.grid import Cell, GridSpec, cell_state
from depthdiag.grid_run import CellEnd, GridRunReport, log_path, run_cells, start_note, train_command

SUBMITIT_DIR = ".submitit"
"""The folder below the grid's runs directory where submitit keeps each cell's jobs and logs."""


@dataclass(frozen=True)
class SlurmOptions:
    """What each cell's job asks of the cluster."""

    partition: str | None = None
    """Slurm partition (None: the cluster's default)."""
    time_min: int = 60
    """Time limit of one cell's job in minutes (a cell cut short resumes on the next `grid run`)."""
    gpus_per_node: int = 0
    """GPUs of each cell's job, all on one node; more than one trains the cell under torchrun."""
    parameters: tuple[tuple[str, Any], ...] = ()
    """More parameters of submitit's Slurm executor (account, qos, mem, constraint, ...), as KEY, value."""


def slurm_parameters(assignments: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    """`--slurm-param KEY=VALUE` pairs; a VALUE that is a TOML literal (64, true, "a b") is that value,
    any other is the text itself (account=proj)."""
    pairs = []
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--slurm-param {assignment!r}: expected KEY=VALUE, e.g. account=myproject")
        try:
            parsed = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value.strip()
        pairs.append((key.strip(), parsed))
    return tuple(pairs)


def import_submitit():
    """The submitit module, or the one-line error that says how to install it."""
    try:
        import submitit
    except ImportError:
        raise InputError("--executor slurm and submitit-local need submitit: pip install 'depthdiag[slurm]'") from None
    return submitit


def run_cell(spec: GridSpec, cell: Cell, runs: Path, processes: int, env: dict[str, str], cwd: str) -> int:
    """The job of one cell (submitit pickles it by name, so it stays a module-level function):
    in `cwd`, the folder the grid was submitted from, train `cell` as the local runner would
    now, with `env` added, and return the exit status. The cell's state is read here, not at
    submission, so that a job Slurm requeues (after a preemption) resumes from the newest
    checkpoint instead of starting over. The training's output, stderr included, goes to the
    job's stdout, which submitit writes to the job's log."""
    os.chdir(cwd)
    state = cell_state(cell, runs)
    if state == "finished":
        print(f"{runs / cell.name}: already finished", flush=True)
        return 0
    command = train_command(spec, cell, runs, resume=state == "interrupted", processes=processes)
    print(f"# {' '.join(command)}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    process = subprocess.Popen(command, env={**os.environ, **env}, stderr=subprocess.STDOUT)
    # submitit's job environment ignores SIGTERM (it waits for its own time-out signal): pass it
    # on, so that a cancelled job stops its training, which keeps its checkpoints for a resume.
    signal.signal(signal.SIGTERM, lambda signum, frame: process.send_signal(signum))
    try:
        return process.wait()
    finally:
        if process.poll() is None:  # the job itself was interrupted
            process.terminate()
            process.wait()


def _executor(submitit, cluster: str, folder: Path, name: str, options: SlurmOptions, threads: int):
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    processes = max(1, options.gpus_per_node)
    parameters: dict[str, Any] = {
        "name": f"depthdiag:{name}",
        "timeout_min": options.time_min,
        "nodes": 1,
        "tasks_per_node": 1,  # one task: torchrun, when there is one, starts the processes itself
        "cpus_per_task": threads * processes,
        "stderr_to_stdout": True,
    }
    if options.gpus_per_node:
        parameters["gpus_per_node"] = options.gpus_per_node
    if cluster == "slurm":
        if options.partition:
            parameters["slurm_partition"] = options.partition
        parameters.update({f"slurm_{key}": value for key, value in options.parameters})
    try:
        executor.update_parameters(**parameters)
    except (NameError, ValueError, TypeError) as err:  # the first line of submitit's names the parameter
        raise InputError(f"--slurm-param: {str(err).splitlines()[0]}") from None
    return executor


class _SubmititJobs:
    """Each cell as one submitit job of `cluster` ('slurm' or 'local'), for `grid_run.run_cells`."""

    def __init__(self, submitit, cluster: str, spec: GridSpec, runs: Path, options: SlurmOptions, threads: int):
        self.submitit, self.cluster, self.spec, self.runs = submitit, cluster, spec, runs
        self.options, self.threads = options, threads
        self.processes = max(1, options.gpus_per_node)
        self.env = {"OMP_NUM_THREADS": str(threads)}
        self.cwd = os.getcwd()
        # Slurm's job states come from sacct, which submitit asks at most every few seconds
        # however often it is polled.
        self.poll_seconds = 0.5 if cluster == "local" else 5

    def start(self, cell: Cell, resume: bool):
        folder = self.runs / SUBMITIT_DIR / cell.name.replace("/", "__")
        executor = _executor(self.submitit, self.cluster, folder, cell.name, self.options, self.threads)
        command = train_command(self.spec, cell, self.runs, resume=resume, processes=self.processes)
        refused = (self.submitit.core.utils.FailedJobError, self.submitit.core.utils.FailedSubmissionError)
        try:
            job = executor.submit(run_cell, self.spec, cell, self.runs, self.processes, self.env, self.cwd)
        except refused as err:
            # sbatch refused the job (an unknown partition, a limit on queued jobs: --jobs N)
            raise InputError(
                f"{self.spec.path}: cell {cell.name}: submission refused: {' '.join(str(err).split())}"
            ) from None
        with log_path(self.runs, cell.name).open("a", encoding="utf-8") as log:
            log.write(
                start_note(
                    f"submitted as {self.cluster} job {job.job_id} (log {job.paths.stdout}): {' '.join(command)}"
                )
            )
        return job

    def ended(self, job) -> CellEnd | None:
        if not job.done():
            return None
        try:
            code = job.result()
        except Exception:  # submitit's FailedJobError or UncompletedJobError: cancelled, out of time, killed
            code = None
        return CellEnd(code, job.paths.stdout, ending=f"job {job.job_id} ended {job.state}")

    def stop(self, jobs: list) -> str:
        """Cancel the jobs in flight. A local job's cancel is a SIGINT, which a process started in
        the background ignores: its controller also gets SIGTERM, which reaches `run_cell`."""
        for job in jobs:
            job.cancel(check=False)
            controller = getattr(job, "_process", None) if self.cluster == "local" else None
            if controller is not None and controller.poll() is None:
                controller.terminate()
                try:
                    controller.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        ids = " ".join(str(job.job_id) for job in jobs)
        hint = f"; if one still runs: scancel {ids}" if self.cluster == "slurm" else ""
        return f"cancelled the jobs in flight ({ids}){hint}"


def submit_grid(
    spec: GridSpec,
    runs: str | Path,
    *,
    cluster: str,
    options: SlurmOptions,
    jobs: int | None = None,
    threads: int = 1,
    progress: bool = True,
) -> GridRunReport:
    """Submit every unfinished cell of `spec` as one job of `cluster` ('slurm' or 'local'),
    at most `jobs` in flight (None: all at once), and wait for them all. A failed cell does
    not stop the others; RunFailed names every failed cell, its exit status and its log. An
    interrupt (Ctrl-C, SIGTERM) cancels the jobs still in flight."""
    if (jobs is not None and jobs < 1) or threads < 1 or options.time_min < 1 or options.gpus_per_node < 0:
        raise InputError("--jobs, --threads and --slurm-time must be >= 1, --slurm-gpus-per-node >= 0")
    submitit = import_submitit()
    if cluster == "slurm" and shutil.which("sbatch") is None:
        raise InputError(
            "--executor slurm: no sbatch on this machine (run it on the cluster's login node; "
            "--executor submitit-local runs the same jobs here)"
        )
    runs = Path(runs)
    return run_cells(
        spec, runs, _SubmititJobs(submitit, cluster, spec, runs, options, threads), jobs=jobs, progress=progress
    )
