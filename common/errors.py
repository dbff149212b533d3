"""The project's two failure types besides bugs; the CLI maps each to an exit code:
0 success, 1 a bug (traceback), 2 bad input (InputError, and OS errors such as a
missing folder or a full disk), 3 the run failed (RunFailed)."""

import contextlib
import errno
import os
from collections.abc import Iterator

EXIT_BUG = 1
EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 3


class InputError(ValueError):
    """Bad input from the user, raised where the input is checked: the CLI prints the
    message on one line and exits 2. Any other exception is a bug and keeps its traceback.

    The message names the file or option and the problem, e.g.
    "runs/a/ckpt.pt: truncated or not a torch.save file". A ValueError subclass, so code
    that validated through the Python API with `except ValueError` keeps working.
    """


class RunFailed(Exception):
    """A run that started well and could not finish (divergence, the disk filling up during
    training): the CLI prints the message on one line and exits 3. The message names the
    step and the last good checkpoint to resume from."""


@contextlib.contextmanager
def naming_files(files) -> Iterator[None]:
    """Re-raise an InputError whose message names none of `files` with them in front
    ("a.h5, b.h5: problem"), so that every error of a command that reads those files says
    which ones it concerns."""
    names = [str(name) for name in files]
    try:
        yield
    except InputError as err:
        message = str(err)
        if names and not any(name in message for name in names):
            raise InputError(f"{', '.join(names)}: {message}") from None
        raise


def unreachable_input(path: str | os.PathLike, what: str = "file") -> InputError:
    """The InputError for an input `path` that is not a readable `what` ("file", or "file or
    folder"), with the real reason: a symbolic link loop, a broken link, no such path, a
    folder where a file was expected."""
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return InputError(f"{path}: symbolic link loop (a link that leads back to itself)")
        if os.path.islink(path):
            return InputError(f"{path}: broken symbolic link (to {os.readlink(path)})")
        return InputError(f"{path}: {f'no such {what}' if err.errno == errno.ENOENT else err.strerror}")
    if what == "file" and os.path.isdir(path):
        return InputError(f"{path}: is a folder, not a file")
    return InputError(f"{path}: not a regular {what}")
