"""Atomic file writes: a file appears under its final name complete or not at all.

The data goes to a temporary file beside the target (the same directory, so the
rename never crosses a file system), is fsynced, and then replaces the target with
`os.replace`. On any error, Ctrl-C included, the temporary file is removed and the
target is left as it was. Temporary names start with a dot, so globs for the real
files never see them.

`atomic_directory` does the same for a folder of files, which appears complete or not
at all, and `atomic_outputs` for a set of files that belong together, which appears whole
or not at all (its docstring says what can still split it). Only `kill -9` (or a power cut)
leaves a temporary behind: `.NAME.XXXXXXXX.tmpSUFFIX` beside NAME (a file, or a folder for
`atomic_directory`). A writer that holds the output's lock (common/lock.py) is the only one
that can be writing NAME, so it removes such leftovers with `remove_stale_temporaries`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to; when the block ends without an
    error, move it over `path`. The directory must exist.

    The temporary file keeps `path`'s suffix, so writers that infer the format from the
    name (matplotlib's savefig) behave as for the final name. A symlinked `path` stays a
    link: the file it leads to is the one replaced.
    """
    given = Path(path)
    path = Path(os.path.realpath(given))
    tmp = _new_temporary(path)
    tmp_name = str(tmp)
    try:
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
            raise OSError(err.errno, err.strerror or str(err).splitlines()[0], str(given)) from None
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new empty temporary folder beside `path` to fill; when the block ends without
    an error, it takes the place of `path`, replacing the folder there if there is one (the
    caller decides whether it may). The parent directory must exist.

    Readers see the old folder or the new one, each complete; between the two renames of a
    replacement `path` is briefly absent, with Ctrl-C and SIGTERM held off so that an
    interrupt cannot leave it so. A symlinked `path` stays a link to the folder replaced.
    """
    given = Path(path)
    path = Path(os.path.realpath(given))
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=temporary_suffix(path), dir=path.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file() and not file.is_symlink():
                with open(file, "rb") as handle:
                    os.fsync(handle.fileno())
        if path.exists():
            # rename() replaces an empty folder only: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=temporary_suffix(path), dir=path.parent))
            with interrupts_deferred():
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
        named = str(err.filename).replace(str(tmp), str(given))
        raise OSError(err.errno, err.strerror or str(err).splitlines()[0], named) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_outputs(paths: Iterable[str | os.PathLike]) -> Iterator[list[Path]]:
    """Yield a temporary path beside each of `paths` (in their order) to write to; when the
    block ends without an error, move them all over `paths`: a set of files that belong
    together (an image and its PDF) appears whole or not at all. The directories must exist.

    Nothing is renamed before every member is written and on disk. On any error until then,
    Ctrl-C included, every temporary is removed and no member is replaced. SIGINT and SIGTERM that
    arrive during the renames take effect once they are all done (`interrupts_deferred`).

    What can still split the set, leaving each file complete, the old version or the new:
    a rename that fails part-way (say the folder was made read-only in between) leaves the
    members before it new and the rest old, and raises; `kill -9` or a power cut during the
    renames leaves the members renamed so far new, the rest old, and the others' temporaries
    for the next writer holding the lock to remove (`remove_stale_temporaries`).
    """
    paths = [Path(path) for path in paths]
    real = [Path(os.path.realpath(path)) for path in paths]  # a symlinked member stays a link
    temporaries: list[Path] = []
    try:
        for path in real:
            temporaries.append(_new_temporary(path))
        try:
            yield temporaries
        except OSError as err:
            if err.filename is not None:
                raise
            # A failed write does not say which file it was writing.
            reason = err.strerror or str(err).splitlines()[0]
            raise OSError(err.errno, reason, ", ".join(map(str, paths))) from None
        for path, tmp in zip(paths, temporaries):
            try:
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
            except OSError as err:
                raise OSError(err.errno, err.strerror or str(err).splitlines()[0], str(path)) from None
        with interrupts_deferred():
            for path, tmp in zip(real, temporaries):
                os.replace(tmp, path)
    except OSError as err:
        named = {str(tmp): str(path) for path, tmp in zip(paths, temporaries)}
        if err.filename is None or str(err.filename) not in named:
            raise
        # Name the file the user asked for, not the temporary one.
        raise OSError(err.errno, err.strerror or str(err).splitlines()[0], named[str(err.filename)]) from None
    finally:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)


_INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the block, then let each take effect as it would have.

    Blocking them with `signal.pthread_sigmask` would not do: it blocks them for this thread
    only, and the kernel then hands them to another (numpy's BLAS threads are in every
    depthdiag process), where SIGTERM still ends the process and SIGINT still makes Python
    raise KeyboardInterrupt here. Python runs its handlers in the main thread between
    bytecodes, whichever thread the signal came to, so for the block each gets a handler that
    only notes it; afterwards the old handlers are back and the noted signals raised again.
    Handlers can be set in the main thread only: elsewhere the block runs unguarded, as does
    a signal whose handler was set outside Python.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for signum in _INTERRUPTS:
        if signal.getsignal(signum) is not None:
            previous[signum] = signal.signal(signum, lambda number, _frame: caught.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def _new_temporary(path: Path) -> Path:
    """A new empty file beside `path` named as a temporary of it, with the permissions a new
    file gets (mkstemp makes it private, 0600)."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=temporary_suffix(path), dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, new_file_mode())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def new_file_mode() -> int:
    """The mode `open` gives a new file: 0o666 less the umask. For files made by a library
    that creates them private, to give them the permissions of every other output."""
    return 0o666 & ~_umask()


def _umask() -> int:
    # The umask can only be read by setting it: set it straight back.
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _remove(stale: Path) -> None:
    """Remove a leftover temporary: a file, or a folder of `atomic_directory`."""
    if stale.is_dir() and not stale.is_symlink():
        shutil.rmtree(stale, ignore_errors=True)
    else:
        stale.unlink(missing_ok=True)


def temporary_suffix(path: Path) -> str:
    """The end of a temporary's name for `path` (every temporary beside `path` is named
    `.NAME.XXXXXXXX` + this, which is how `remove_stale_temporaries` knows it)."""
    return f".tmp{path.suffix}"


# mkstemp's names: the prefix, eight characters of [a-z0-9_], the suffix.
_RANDOM = r"[a-z0-9_]{8}"


def is_temporary_of(name: str, target: str) -> bool:
    """Whether the file name `name` is one of `atomic_output`'s temporaries of `target`."""
    pattern = re.escape(f".{target}.") + _RANDOM + re.escape(temporary_suffix(Path(target)))
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
        if is_temporary_of(name, path.name):
            stale = path.parent / name
            _remove(stale)
            removed.append(stale)
    return removed


def is_temporary(name: str) -> bool:
    """Whether the file name `name` is one of `atomic_output`'s temporaries, of any target."""
    match = re.fullmatch(r"\.(.+)\." + _RANDOM + r"\.tmp(.*)", name)
    return match is not None and is_temporary_of(name, match.group(1))


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
        if is_temporary(name):
            stale = directory / name
            _remove(stale)
            removed.append(stale)
    return removed


def atomic_write_text(text: str, path: str | os.PathLike) -> Path:
    """Write `text` (UTF-8) to `path` atomically; returns the path."""
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
