"""common/atomic.py `atomic_outputs`: what a set of files is left as when a rename fails part-way
(the figures' tests cover a failed write and signals, through save_figure)."""

import errno
import os

import pytest

from common.atomic import atomic_outputs


def test_a_rename_failing_part_way_leaves_each_file_complete_old_or_new(tmp_path, monkeypatch):
    first, second = tmp_path / "a.png", tmp_path / "a.pdf"
    first.write_text("old a")
    second.write_text("old b")
    real_replace = os.replace

    def second_rename_fails(src, dst):
        if dst == second:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), src)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", second_rename_fails)
    with pytest.raises(OSError) as raised, atomic_outputs([first, second]) as (tmp_first, tmp_second):
        tmp_first.write_text("new a")
        tmp_second.write_text("new b")
    # As the docstring says: the members before the failed rename are new, the rest old.
    assert raised.value.filename == str(second) and raised.value.errno == errno.EROFS
    assert (first.read_text(), second.read_text()) == ("new a", "old b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pdf", "a.png"]
