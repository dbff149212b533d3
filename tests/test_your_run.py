"""docs/your-run.md's plain PyTorch loop, run as printed: its model block saved as looped.py and its
loop run from that folder, as a user runs it. With diag.DepthMonitor the run is bit-identical to
the run without it, its monitor file reads back and `recommend` sizes a finishing phase from it,
and `depthdiag diagnose` on its switch snapshot (which rebuilds the model from looped.py in the
current directory) equals `compare_updates` on the state the snapshot was saved from."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import diag
from analysis.monitor import open_monitor
from analysis.store import open_results
from depthdiag.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "your-run.md").read_text()
MODEL, EXAMPLE = (
    re.search(rf"<!-- plain-loop-{name} -->\n```python\n(.*?)```", DOC, re.S).group(1) for name in ("model", "example")
)
MONITOR_CALL = "monitor.after_update(step + 1, model, optimizer)"


@pytest.fixture
def fresh_imports(monkeypatch):
    """sys.path comes back as it was, and the example's `looped` module is imported afresh by
    each run (and by diagnose) and forgotten after."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.modules.pop("looped", None)
    yield
    sys.modules.pop("looped", None)


def run_example(folder: Path, monkeypatch, *, monitored: bool) -> dict:
    """The model block as folder/looped.py, the loop run as `python train.py` in folder (the
    script's folder first on sys.path)."""
    folder.mkdir()
    (folder / "looped.py").write_text(MODEL)
    monkeypatch.chdir(folder)
    assert EXAMPLE.count(MONITOR_CALL) == 1
    code = EXAMPLE if monitored else EXAMPLE.replace(MONITOR_CALL, "pass")
    namespace: dict = {"__name__": "__main__"}
    sys.path.insert(0, str(folder))
    try:
        exec(compile(code, "docs/your-run.md", "exec"), namespace)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("looped", None)
    assert type(namespace["model"]).__module__ == "looped"  # the model of the doc's looped.py
    return namespace


def test_the_plain_loop_example_is_unchanged_by_the_monitor_and_its_snapshot_diagnoses(
    tmp_path, monkeypatch, fresh_imports
):
    saved = {}
    real_save = diag.save_snapshot

    def saving(path, model, optimizer, batches, eval_tokens, **kwargs):
        saved["model"], saved["optimizer"] = copy.deepcopy((model, optimizer))
        saved["batches"], saved["eval_tokens"] = [b.clone() for b in batches], eval_tokens.clone()
        return real_save(path, model, optimizer, batches, eval_tokens, **kwargs)

    monkeypatch.setattr(diag, "save_snapshot", saving)
    monitored = run_example(tmp_path / "monitored", monkeypatch, monitored=True)
    plain = run_example(tmp_path / "plain", monkeypatch, monitored=False)

    # The monitor changed no bit of the training.
    for name, tensor in plain["model"].state_dict().items():
        assert torch.equal(monitored["model"].state_dict()[name], tensor), name
    a, b = monitored["optimizer"].state_dict()["state"], plain["optimizer"].state_dict()["state"]
    assert all(torch.equal(a[p][key], b[p][key]) for p in b for key in b[p])

    ds = open_monitor(tmp_path / "monitored" / "run" / "monitor.h5")
    assert ds.step.values.tolist() == [10, 20, 30, 40] and ds.attrs["switch_step"] == 20
    # The model takes its depth as `depth=` (no family), full backprop, as the loop trains it.
    assert json.loads(ds.attrs["monitor"])["depth_kwarg"] == "depth" and "model_family" not in ds.attrs
    runner = CliRunner()
    monkeypatch.chdir(tmp_path / "monitored")
    result = runner.invoke(main, ["summarize", "run/monitor.h5"], prog_name="depthdiag")
    assert result.exit_code == 0, result.output
    # recommend reads the file; 20 updates after the switch are too few for the benefit to settle.
    result = runner.invoke(main, ["recommend", "run/monitor.h5", "--updates", "4000"], prog_name="depthdiag")
    assert result.exit_code == 2, result.output
    assert "no F found; the finishing phase needs longer than the pilot's 20 updates" in result.output

    # diagnose on the switch snapshot = compare_updates on the state it was saved from.
    out = tmp_path / "switch.h5"
    result = runner.invoke(
        main,
        ["diagnose", "run/switch", "--out", str(out), "--update-depths", "2,8", "--serving", "1-8", "--no-progress"],
        prog_name="depthdiag",
    )
    assert result.exit_code == 0, result.output
    # It built the model again from the looped.py of the folder it ran in, as a user's would.
    assert Path(sys.modules["looped"].__file__).resolve() == (tmp_path / "monitored" / "looped.py").resolve()
    results = open_results(out)
    for i, batch in enumerate(saved["batches"]):
        with pytest.warns(diag.BiasCorrectionWarning):  # 20 steps of Adam: young, and said so
            expected = diag.compare_updates(
                saved["model"],
                saved["optimizer"],
                batch,
                saved["eval_tokens"],
                update_depths=(2, 8),
                serving_depths=range(1, 9),
                depth_kwarg="depth",
                grad_clip=1.0,
            )
        np.testing.assert_array_equal(results.nll.isel(snapshot=0, batch=i).values, expected.nll.values)
