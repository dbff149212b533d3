"""Atomic file writes: a file appears under its final name complete or not at all.

The data goes to a temporary file beside the target (the same directory, so the
rename never crosses a file system), is fsynced, and then replaces the target with
`os.replace`. On any error, Ctrl-C included, the temporary file is removed and the
target is left as it was. Temporary names start with a dot, so globs for the real
files never see them.

Only `kill -9` (or a power cut) leaves a temporary behind: `.NAME.XXXXXXXX.tmpSUFFIX`
beside NAME. A writer that holds the output's lock (common/lock.py) is the only one that
can be writing NAME, so it removes such leftovers with `remove_stale_temporaries`.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to; when the block ends without an
    error, move it over `path`. The directory must exist.

    The temporary file keeps `path`'s suffix, so writers that infer the format from the
    name (matplotlib's savefig) behave as for the final name.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_temporary_suffix(path), dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        # mkstemp creates the file private (0600); the result should get the usual permissions.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        try:
            yield tmp
            # The data must be on disk before the rename makes it visible under the real name.
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as err:
            if err.filename not in (None, tmp_name):
                raise
            # Name the file the user asked for, not the temporary one.
            raise OSError(err.errno, err.strerror or str(err).splitlines()[0], str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)


def _temporary_suffix(path: Path) -> str:
    return f".tmp{path.suffix}"


# mkstemp's names: the prefix, eight characters of [a-z0-9_], the suffix.
_RANDOM = r"[a-z0-9_]{8}"


def _is_temporary_of(name: str, target: str) -> bool:
    """Whether the file name `name` is one of `atomic_output`'s temporaries of `target`."""
    pattern = re.escape(f".{target}.") + _RANDOM + re.escape(_temporary_suffix(Path(target)))
    return re.fullmatch(pattern, name) is not None


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the temporaries `atomic_output` left beside `path` when a writer of `path` was
    killed; return the paths removed.

    Call it only while holding `path`'s lock (common/lock.py does, on taking it): then no
    other process can be writing one of them.
    """
    path = Path(path)
    try:
        names = os.listdir(path.parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in sorted(names):
        if _is_temporary_of(name, path.name):
            stale = path.parent / name
            stale.unlink(missing_ok=True)
            removed.append(stale)
    return removed


def remove_stale_temporaries_in(directory: str | os.PathLike) -> list[Path]:
    """Remove every `atomic_output` temporary in `directory` (whose files are all written by
    the holder of one lock, such as diagnose's OUT.parts/); return the paths removed."""
    directory = Path(directory)
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in sorted(names):
        match = re.fullmatch(r"\.(.+)\." + _RANDOM + r"\.tmp(.*)", name)
        if match and _is_temporary_of(name, match.group(1)):
            stale = directory / name
            stale.unlink(missing_ok=True)
            removed.append(stale)
    return removed


def atomic_write_text(text: str, path: str | os.PathLike) -> Path:
    """Write `text` (UTF-8) to `path` atomically; returns the path."""
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
