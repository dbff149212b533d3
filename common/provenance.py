"""Provenance: the versions and source state every results file records (depthdiag's own
version, Python, numpy and torch, the git commit and whether the tree had uncommitted changes),
and the one-line description of a machine record (which trainer/machine.py probes, with torch).
Torch-free: library versions come from the imported module when it is loaded and from the
installed package's metadata otherwise, so `--version` stays fast."""

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def package_version() -> str:
    """depthdiag's version as installed, or 'unknown' when it runs from a source tree only."""
    try:
        return metadata.version("depthdiag")
    except metadata.PackageNotFoundError:
        return "unknown"


def _git(*args: str) -> subprocess.CompletedProcess | None:
    """`git ARGS` run in this source tree; None when git cannot be run at all."""
    try:
        return subprocess.run(
            ["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> str:
    result = _git("rev-parse", "HEAD")
    return result.stdout.strip() if result is not None and result.returncode == 0 else "unknown"


def _git_dirty() -> int | str:
    """1 when the source tree has uncommitted changes to tracked files, 0 when not; 'unknown'
    (with the reason) when git cannot tell, e.g. an installed copy outside a checkout."""
    result = _git("status", "--porcelain", "--untracked-files=no")
    if result is None:
        return "unknown (no git)"
    if result.returncode != 0:
        return "unknown (not a git checkout)"
    return int(bool(result.stdout.strip()))


def _library_version(name: str) -> str:
    module = sys.modules.get(name)
    if module is not None:
        return str(module.__version__)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def provenance() -> dict[str, str | int]:
    """The versions and source state a results file records."""
    return {
        "depthdiag_version": package_version(),
        "python_version": platform.python_version(),
        "numpy_version": _library_version("numpy"),
        "torch_version": _library_version("torch"),
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
    }


def describe_machine(record: dict | None) -> str:
    """A machine record (trainer/machine.py) as one line: the CPU, torch's CPU kernel level, the
    bf16 matmul oneDNN ran, the threads, the cap on oneDNN's ISA and the GPU where there are."""
    if not record:
        return "unknown (not recorded)"
    matmul = record.get("bf16_matmul", "unknown")
    units = " (bf16 matrix units)" if record.get("bf16_matrix_units") else ""
    threads = record.get("threads")
    parts = [
        str(record.get("cpu_model", "unknown CPU")),
        f"torch CPU kernels {record.get('torch_cpu_capability', 'unknown')}",
        f"oneDNN {record.get('onednn_version', 'unknown')} bf16 matmul {matmul}{units}",
    ]
    if threads is not None:
        parts.append(f"{threads} thread{'' if threads == 1 else 's'}")
    if record.get("onednn_max_cpu_isa"):
        parts.append(f"ONEDNN_MAX_CPU_ISA={record['onednn_max_cpu_isa']}")
    if record.get("cuda_device"):
        parts.append(f"CUDA {record['cuda_device']} (capability {record.get('cuda_capability', '?')})")
    return "; ".join(parts)


def describe_machines(records: list[dict] | tuple[dict, ...]) -> str:
    """The machines that trained a run, in order, as one line ('unknown' when none is recorded)."""
    if not records:
        return describe_machine(None)
    return " then ".join(describe_machine(record) for record in records)
