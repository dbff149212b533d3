"""The project's two failure types besides bugs; the CLI maps each to an exit code:
0 success, 1 a bug (traceback), 2 bad input (InputError, and OS errors such as a
missing folder or a full disk), 3 the run failed (RunFailed)."""

import contextlib
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
