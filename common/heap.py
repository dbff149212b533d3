"""Keep freed memory in the process instead of handing it back to the kernel.

glibc's malloc serves large blocks (128 KiB and up, a threshold it raises as it goes)
with fresh mappings and gives memory at the top of the heap back once enough of it is
free. A training step allocates and frees tens of MiB of activations every update, so
the kernel maps and zeroes the same pages again each time: about 12,000 page faults
per update of the tiny config, 7% of its time spent in the kernel at one thread and
11-13% at two (`make bench`). Serving every block up to 32 MiB from the heap and never
trimming it keeps those pages mapped; the process's peak memory is unchanged, it just
stays at its peak.
"""

from __future__ import annotations

import ctypes
import platform

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's largest accepted M_MMAP_THRESHOLD on 64-bit systems."""
_NEVER_TRIM = 2**31 - 1
"""The largest value mallopt's int argument takes."""


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (see the module docstring).
    Process-wide, so the commands call it, not the library. Returns whether it took
    effect: False under another C library (macOS, musl), where nothing changes."""
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
