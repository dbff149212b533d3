"""Exclusive outputs: a second writer is refused while the first lives, and takes over
once it is gone, however it ended."""

import os
import signal
import subprocess
import sys

import pytest

from common.errors import InputError
from common.lock import exclusive_output, lock_path

HOLD = """
import sys, time
from common.lock import exclusive_output
with exclusive_output(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def start_holder(output):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(output)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_process_is_refused_with_the_holders_pid(tmp_path):
    output = tmp_path / "results.h5"
    holder = start_holder(output)
    try:
        with pytest.raises(InputError, match=f"pid {holder.pid}") as err:
            with exclusive_output(output):
                pass
        assert str(output) in str(err.value)
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path):
    output = tmp_path / "run"
    holder = start_holder(output)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert lock_path(output).exists()  # left behind by kill -9, and no obstacle
    with exclusive_output(output):
        assert lock_path(output).read_text().strip() == str(os.getpid())
    assert not lock_path(output).exists()


def test_lock_is_released_on_an_exception_and_can_be_taken_again(tmp_path):
    output = tmp_path / "out.h5"
    with pytest.raises(RuntimeError):
        with exclusive_output(output):
            raise RuntimeError("boom")
    with exclusive_output(output):
        pass
    assert list(tmp_path.iterdir()) == []
