"""Atomic file writes: a file appears under its final name complete or not at all.

The data goes to a temporary file beside the target (the same directory, so the
rename never crosses a file system), is fsynced, and then replaces the target with
`os.replace`. On any error, Ctrl-C included, the temporary file is removed and the
target is left as it was. Temporary names start with a dot, so globs for the real
files never see them.

`atomic_directory` does the same for a folder of files, which appears complete or not
at all. Only `kill -9` (or a power cut) leaves a temporary behind: `.NAME.XXXXXXXX.tmpSUFFIX`
beside NAME (a file, or a folder for `atomic_directory`). A writer that holds the output's
lock (common/lock.py) is the only one that can be writing NAME, so it removes such
leftovers with `remove_stale_temporaries`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
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


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new empty temporary folder beside `path` to fill; when the block ends without
    an error, it takes the place of `path`, replacing the folder there if there is one (the
    caller decides whether it may). The parent directory must exist.

    Readers see the old folder or the new one, each complete; between the two renames of a
    replacement `path` is briefly absent.
    """
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=_temporary_suffix(path), dir=path.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file() and not file.is_symlink():
                with open(file, "rb") as handle:
                    os.fsync(handle.fileno())
        if path.exists():
            # rename() replaces an empty folder only: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=_temporary_suffix(path), dir=path.parent))
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except OSError:
                os.replace(old, path)
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except OSError as err:
        if err.filename is None or str(tmp) not in str(err.filename):
            raise
        # Name the folder the user asked for, not the temporary one.
        named = str(err.filename).replace(str(tmp), str(path))
        raise OSError(err.errno, err.strerror or str(err).splitlines()[0], named) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove(stale: Path) -> None:
    """Remove a leftover temporary: a file, or a folder of `atomic_directory`."""
    if stale.is_dir() and not stale.is_symlink():
        shutil.rmtree(stale, ignore_errors=True)
    else:
        stale.unlink(missing_ok=True)


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
            _remove(stale)
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
            _remove(stale)
            removed.append(stale)
    return removed


def atomic_write_text(text: str, path: str | os.PathLike) -> Path:
    """Write `text` (UTF-8) to `path` atomically; returns the path."""
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
