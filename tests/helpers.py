"""Helpers shared by several test files."""

import subprocess
import sys
from pathlib import Path

HOLD = """
import sys
from common.lock import exclusive_output
with exclusive_output(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def start_holder(output: str | Path) -> subprocess.Popen:
    """Another process that holds `output`'s lock, returned once it says so: it holds it until
    it is killed or its stdin closes (at the latest when the test process ends), never for a
    fixed time a slow test could outlast."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(output)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder
