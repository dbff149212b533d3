"""Exclusive outputs: one writer per run directory or results file.

A writer holds an advisory `flock` on a lock file beside its output for as long as it
writes. The kernel drops the lock when the holder dies, however it dies, so a lock of a
dead process is never in the way: the next writer simply takes it. The holder's pid is
written into the lock file only so that a refused writer can say who holds it.

Taking the lock also removes the temporaries a killed writer of the output left beside it
(`.NAME.XXXXXXXX.tmpSUFFIX`, see common/atomic.py): while we hold the lock nobody else can
be writing them. `claimed_outputs` adds the output rule of common/outputs.py under the locks.

A lock belongs to the output's real path (symlinks and other spellings resolved), so every
name for one output meets the same lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from common.atomic import remove_stale_temporaries
from common.errors import InputError
from common.outputs import OutputKind, check_outputs


def lock_path(output: str | Path) -> Path:
    """The lock file of an output: `.NAME.lock` beside its real path (inside it for a directory
    would be deleted by --force along with the directory)."""
    output = Path(os.path.realpath(output))
    return output.parent / f".{output.name}.lock"


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        return "unknown"
    return pid or "unknown"


@contextlib.contextmanager
def exclusive_output(output: str | Path) -> Iterator[Path]:
    """Hold the lock of `output` (a file or directory, existing or not) for the block.

    Raises InputError naming the holder's pid when another live process holds it. Once
    held, stale temporaries of `output` (left by a killed writer) are removed. The lock
    file is removed on the way out.
    """
    output = Path(output)
    path = lock_path(output)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"{output}: cannot create its folder ({err.strerror or err})") from None
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise InputError(f"{output}: cannot create the lock file {path} ({err.strerror or err})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise InputError(
                f"{output}: in use by another depthdiag process (pid {_holder(path)}); wait for it to finish or stop it"
            ) from None
        # The previous holder removes the file before it lets go: if the file we locked is
        # no longer the one at `path`, lock the new one instead.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        remove_stale_temporaries(os.path.realpath(output))
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)


@contextlib.contextmanager
def claimed_outputs(
    outputs: Iterable[str | Path], *, kind: OutputKind, inputs: Iterable[str | Path] = (), force: bool
) -> Iterator[list[Path]]:
    """Hold the locks of all `outputs` (in the order given) for the block, and apply the output
    rule (common/outputs.py: never an input; an existing one only with `force`, and only if
    depthdiag wrote it); yields the paths. With `force` the block overwrites them; nothing is
    deleted here.

    Check with `check_outputs` before long work too, so that a refusal comes first; this
    checks again under the lock.
    """
    outputs = [Path(output) for output in outputs]
    with contextlib.ExitStack() as stack:
        for output in outputs:
            stack.enter_context(exclusive_output(output))
        check_outputs(outputs, kind=kind, inputs=inputs, force=force)
        yield outputs
