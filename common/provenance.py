"""Provenance: the versions and source state every results file records (depthdiag's own
version, Python, numpy and torch, the git commit and whether the tree had uncommitted changes).
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
