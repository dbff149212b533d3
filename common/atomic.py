"""Atomic file writes: a file appears under its final name complete or not at all.

The data goes to a temporary file beside the target (the same directory, so the
rename never crosses a file system), is fsynced, and then replaces the target with
`os.replace`. On any error, Ctrl-C included, the temporary file is removed and the
target is left as it was. Temporary names start with a dot, so globs for the real
files never see them.
"""

from __future__ import annotations

import contextlib
import os
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
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
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


def atomic_write_text(text: str, path: str | os.PathLike) -> Path:
    """Write `text` (UTF-8) to `path` atomically; returns the path."""
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
