"""common/heap.py: freed memory stays in the process, in every command."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import depthdiag.cli.app
from depthdiag.cli import main

ROOT = Path(__file__).resolve().parents[1]

# What glibc's malloc does with large blocks in a fresh process, read back from its own
# counters (mallinfo2): whether freeing 16 MiB of heap blocks (100 KiB each, below the
# default mmap threshold) hands the memory back to the kernel ("returned", bytes the heap
# shrank by), then whether a 16 MiB block gets a mapping of its own ("mapped", the count of
# mapped blocks it added). In this order because freeing a mapped block raises glibc's
# default thresholds, after which the default would keep heap blocks too.
PROBE = """
import ctypes, json, sys
from common.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "kept" else None

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
    )]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
blocks = (ctypes.c_void_p * 160)()  # before the blocks, so nothing else lies between them and the heap's top
for i in range(len(blocks)):
    blocks[i] = libc.malloc(100 << 10)
grown = libc.mallinfo2().arena
for block in reversed(blocks):
    libc.free(block)
returned = grown - libc.mallinfo2().arena
before = libc.mallinfo2().hblks
block = libc.malloc(16 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(json.dumps({"kept": kept, "returned": returned, "mapped": mapped}))
"""


def malloc_behaviour(side: str) -> dict:
    # The environment can change glibc's defaults (MALLOC_*_, GLIBC_TUNABLES); the default side needs glibc's own.
    env = {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, side], capture_output=True, text=True, check=True, cwd=ROOT, env=env
    )
    return json.loads(done.stdout)


GLIBC = platform.libc_ver()


@pytest.mark.skipif(
    GLIBC[0] != "glibc" or tuple(map(int, GLIBC[1].split("."))) < (2, 33), reason="glibc's setting, mallinfo2"
)
def test_freed_memory_stays_in_the_heap_and_large_blocks_come_from_it():
    default, kept = malloc_behaviour("default"), malloc_behaviour("kept")
    # The probe tells the two apart: by default freed heap memory goes back to the kernel (all
    # but glibc's 128 KiB top pad) and a 16 MiB block is a mapping of its own.
    assert default["returned"] > 8 << 20 and default["mapped"] == 1
    # Kept: the heap does not shrink, and the 16 MiB block comes from it.
    assert kept["kept"] is True
    assert kept["returned"] <= 0 and kept["mapped"] == 0


def test_every_command_keeps_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(depthdiag.cli.app, "keep_freed_memory", lambda: calls.append(True))
    result = CliRunner().invoke(main, ["flops", "configs/tiny.toml"])
    assert result.exit_code == 0, result.output
    assert calls == [True]
