"""Exclusive outputs: a second writer is refused while the first lives, and takes over
once it is gone, however it ended."""

import os
import signal
import subprocess
import sys

import pytest
from helpers import start_holder

from common.errors import InputError
from common.lock import exclusive_output, lock_path


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


KILLED_WRITER = """
import os, signal, sys
from common.atomic import atomic_output
with atomic_output(sys.argv[1]) as tmp:
    tmp.write_text("half of it")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_taking_the_lock_removes_the_temporaries_a_killed_writer_left(tmp_path):
    output = tmp_path / "results.h5"
    writer = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(output)])
    assert writer.returncode == -signal.SIGKILL
    (left,) = [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # what kill -9 leaves
    assert left.name.startswith(".results.h5.") and left.name.endswith(".tmp.h5")
    output.write_text("the finished file")
    kept = [
        tmp_path / ".other.h5.abcd1234.tmp.h5",  # another output's
        tmp_path / ".results.h5.notes",  # not a temporary
        tmp_path / ".results.h5.abcd1234.tmp.png",  # another suffix: not one of results.h5's
    ]
    for path in kept:
        path.write_text("")
    with exclusive_output(output):
        assert not left.exists()
        assert all(path.exists() for path in kept) and output.read_text() == "the finished file"


def test_stale_temporaries_in_a_directory_only_atomic_outputs(tmp_path):
    from common.atomic import remove_stale_temporaries_in

    stale = [tmp_path / ".a.b00001.h5.x_y12345.tmp.h5", tmp_path / ".manifest.json.abcdefgh.tmp.json"]
    kept = [tmp_path / "a.b00000.h5", tmp_path / ".hidden", tmp_path / ".a.h5.short.tmp.h5"]
    for path in stale + kept:
        path.write_text("")
    assert remove_stale_temporaries_in(tmp_path) == sorted(stale)
    assert sorted(tmp_path.iterdir()) == sorted(kept)


def test_claimed_outputs_refuse_an_existing_output_unless_forced_and_a_held_one_always(tmp_path):
    from common.lock import claimed_outputs
    from common.outputs import OutputKind

    note = OutputKind("note", lambda path: path.read_text() == "old")
    image, pdf = tmp_path / "f.png", tmp_path / "f.pdf"
    pdf.write_text("old")
    with pytest.raises(InputError, match=f"{pdf}: already exists; pass --force"):
        with claimed_outputs([image, pdf], kind=note, force=False):
            pass
    with claimed_outputs([image, pdf], kind=note, force=True) as paths:
        assert paths == [image, pdf] and pdf.read_text() == "old"  # --force overwrites, never deletes
    holder = start_holder(pdf)
    try:
        with pytest.raises(InputError, match=f"pid {holder.pid}"):
            with claimed_outputs([image, pdf], kind=note, force=True):
                pass
        assert not lock_path(image).exists()  # the lock taken first is let go again
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("spelling", ["symlinked folder", "symlinked file", "dotted path"])
def test_another_name_for_a_held_output_meets_the_same_lock(tmp_path, spelling):
    real = tmp_path / "real"
    real.mkdir()
    output = real / "out.h5"
    output.write_text("results")
    if spelling == "symlinked folder":
        (tmp_path / "link").symlink_to(real)
        other = tmp_path / "link" / "out.h5"
    elif spelling == "symlinked file":
        other = tmp_path / "alias.h5"
        other.symlink_to(output)
    else:
        other = real / ".." / "real" / "." / "out.h5"
    holder = start_holder(output)
    try:
        with pytest.raises(InputError, match=f"pid {holder.pid}"):
            with exclusive_output(other):
                pass
    finally:
        holder.kill()
        holder.wait()
    with exclusive_output(other) as lock:
        assert lock == lock_path(output)
