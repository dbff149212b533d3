"""Modules that moved keep their old import paths (common/moved.py): the old name gives the
moved module itself, which keeps its own name and spec."""

import importlib
import sys

import pytest


@pytest.mark.parametrize(
    "old, new",
    [
        ("diag.engine", "diag.arithmetic.engine"),
        ("diag.run", "diag.driver.run"),
        ("diag.families", "diag.arithmetic.families"),
        # It imports lm-eval: the eval extra, which only make test-slow installs.
        pytest.param("trainer.lm_harness", "trainer.export.lm_harness", marks=pytest.mark.slow),
    ],
)
def test_an_old_path_gives_the_moved_module_itself(old, new):
    moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert moved.__name__ == new and moved.__spec__.name == new
    assert sys.modules[old] is moved


def test_names_import_from_the_old_path_and_a_patch_of_either_is_seen_by_both(monkeypatch):
    import diag.driver.run
    import diag.run
    from diag.families import HUGINN
    from diag.run import DiagnoseConfig

    assert HUGINN is importlib.import_module("diag.arithmetic.families").HUGINN
    assert DiagnoseConfig is diag.driver.run.DiagnoseConfig
    monkeypatch.setattr(diag.run, "run_entries", "patched")
    assert diag.driver.run.run_entries == "patched"


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("diag.no_such_module")
