"""SIGTERM ends a command as Ctrl-C does: `Terminated`, a KeyboardInterrupt, is raised in the
main thread, so the same `finally` blocks remove temporaries and release locks and the same
`except KeyboardInterrupt` handlers stop child processes. The CLI exits 130 after SIGINT and
143 after SIGTERM (128 + the signal number, the shell's convention)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (a scheduler's stop, `kill`)."""


def _raise_terminated(signum, frame):
    raise Terminated


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Turn SIGTERM into `Terminated` for the block (main thread only: Python runs signal
    handlers there, and elsewhere the handler cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupt_exit(err: KeyboardInterrupt) -> tuple[str, int]:
    """(the signal's name, the exit code) for an interrupt."""
    return ("SIGTERM", EXIT_SIGTERM) if isinstance(err, Terminated) else ("SIGINT", EXIT_SIGINT)
