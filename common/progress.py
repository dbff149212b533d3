"""Progress reporting that suits where it goes.

On a terminal: a tqdm bar. Anywhere else (a log file, CI, `make ... > log`): a
plain line every `LINE_EVERY_SECONDS` and one at the end, never carriage-return
frames, so a log stays readable line by line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm import tqdm

LINE_EVERY_SECONDS = 30.0
"""Seconds between plain progress lines when stderr is not a terminal."""


class LineProgress:
    """The part of tqdm's interface depthdiag uses, printed as occasional plain lines."""

    def __init__(
        self, total: int | None, desc: str, unit: str, *, initial: int = 0, every: float = LINE_EVERY_SECONDS, file=None
    ):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.every = every
        self.file = file if file is not None else sys.stderr
        self.postfix = ""
        self._started = self._last = time.monotonic()
        self._initial = self._printed_at = initial

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last >= self.every:
            self._print()

    def write(self, message: str) -> None:
        print(message, file=self.file, flush=True)

    def close(self) -> None:
        if self.n != self._printed_at:
            self._print()

    def line(self) -> str:
        """'desc: n/total unit (p%), r unit/s, eta m:ss, postfix' with the parts that are known."""
        elapsed = time.monotonic() - self._started
        rate = (self.n - self._initial) / elapsed if elapsed > 0 else 0.0
        done = f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"
        parts = [f"{self.desc}: {done}" + (f" ({self.n / self.total:.0%})" if self.total else "")]
        if rate > 0:
            parts.append(f"{rate:.3g} {self.unit}/s")
            if self.total:
                remaining = max(self.total - self.n, 0) / rate
                parts.append(f"eta {int(remaining // 60)}:{int(remaining % 60):02d}")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    def _print(self) -> None:
        self._last, self._printed_at = time.monotonic(), self.n
        self.write(self.line())


class _TerminalBar(tqdm):
    """tqdm whose `write` goes to stderr, where the bar is (tqdm's own default is stdout)."""

    @classmethod
    def write(cls, s, file=None, end="\n", nolock=False):
        super().write(s, file=sys.stderr if file is None else file, end=end, nolock=nolock)


class _Silent(LineProgress):
    """No progress lines; `write` still prints (warnings must not vanish with the bar)."""

    def _print(self) -> None:
        self._last, self._printed_at = time.monotonic(), self.n


def progress_bar(total: int | None, desc: str, unit: str, *, initial: int = 0, enabled: bool = True):
    """A tqdm bar when stderr is a terminal, a LineProgress otherwise, and no progress output
    when not `enabled`. Messages go through the bar's `write`, which keeps a tqdm bar intact."""
    if not enabled:
        return _Silent(total, desc, unit, initial=initial)
    if sys.stderr.isatty():
        return _TerminalBar(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)
    return LineProgress(total, desc, unit, initial=initial)


def track(iterable: Iterable, total: int | None, desc: str, unit: str, *, enabled: bool = True) -> Iterator:
    """Iterate with a progress bar (see `progress_bar`)."""
    with progress_bar(total, desc, unit, enabled=enabled) as bar:
        for item in iterable:
            yield item
            bar.update(1)
