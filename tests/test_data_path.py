"""A behaviour across modules (trainer/config.py, depthdiag/grid.py, the commands): a relative
data.path is relative to the file that gives it (a run config or a grid file) and to the working
directory on the command line; runs store it absolute, so a run resumes and is evaluated from
any working directory."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from click.testing import CliRunner

from depthdiag.cli import main
from depthdiag.grid import grid_cells, load_grid
from trainer.config import load_config

RUN = """
[model]
vocab_size = 256
max_seq_len = 16
d_model = 32
n_heads = 2

[data]
source = "text"
path = "../data/corpus.txt"
eval_sequences = 4

[optim]
lr = 3e-3
warmup = 3

[train]
schedule = "fixed:2"
updates = 8
batch_size = 8
seq_len = 16
checkpoint_every = 4
snapshot_uniform_updates = []
device = "cpu"
"""


def project(tmp_path: Path) -> Path:
    """tmp/project/{configs/run.toml, data/corpus.txt}, and two other working directories."""
    root = tmp_path / "project"
    (root / "configs").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "configs" / "run.toml").write_text(RUN, encoding="utf-8")
    rng = random.Random(0)
    words = "a few words of plain text for a tiny run".split()
    (root / "data" / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(3000)), encoding="utf-8")
    for name in ("elsewhere", "deeper/still"):
        (tmp_path / name).mkdir(parents=True)
    return root


def test_a_config_files_data_path_is_relative_to_its_folder(tmp_path, monkeypatch):
    root = project(tmp_path)
    corpus = str((root / "data" / "corpus.txt").resolve())
    monkeypatch.chdir(tmp_path / "elsewhere")
    config = load_config("../project/configs/run.toml")
    assert config.data.path == corpus
    monkeypatch.chdir(tmp_path / "deeper" / "still")
    again = load_config(root / "configs" / "run.toml")
    assert again.to_json() == config.to_json()  # what runs store and grids compare
    # On the command line a relative path is the working directory's.
    assert load_config(root / "configs" / "run.toml", ["data.path='here.txt'"]).data.path == str(
        (tmp_path / "deeper" / "still" / "here.txt").resolve()
    )
    assert load_config(root / "configs" / "run.toml", ["train.updates=9"]).data.path == corpus


def test_a_run_resumes_and_evaluates_from_other_working_directories(tmp_path, monkeypatch):
    root = project(tmp_path)
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = CliRunner().invoke(main, ["train", "../project/configs/run.toml", "--out", str(run), "--no-progress"])
    assert result.exit_code == 0, result.output
    stored = json.loads((run / "config.json").read_text())
    assert stored["data"]["path"] == str((root / "data" / "corpus.txt").resolve())

    # An interrupted run: its newest checkpoint is at step 4.
    (run / "checkpoints" / "step_000008.pt").unlink()
    (run / "checkpoints" / "latest").unlink(missing_ok=True)
    (run / "summary.json").unlink()
    monkeypatch.chdir(tmp_path / "deeper" / "still")
    config = str(root / "configs" / "run.toml")
    result = CliRunner().invoke(main, ["train", config, "--resume", str(run), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "resumed from 4" in result.stdout
    result = CliRunner().invoke(main, ["eval", str(run / "checkpoints" / "step_000008.pt"), "--serving", "1-2"])
    assert result.exit_code == 0, result.output


def test_a_grid_files_data_path_is_relative_to_the_grid_file(tmp_path, monkeypatch):
    root = project(tmp_path)
    shutil.copy(root / "data" / "corpus.txt", root / "data" / "other.txt")
    (root / "grids").mkdir()
    base = 'base = "../configs/run.toml"\n'
    (root / "grids" / "set.toml").write_text(
        base + '[set]\n"data.path" = "../data/other.txt"\n[axes]\nseed = [0]\n', encoding="utf-8"
    )
    (root / "grids" / "axis.toml").write_text(
        base + '[axes."data.path"]\nfirst = "../data/corpus.txt"\nsecond = { "data.path" = "../data/other.txt" }\n',
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path / "elsewhere")
    data = root.resolve() / "data"
    assert [cell.config.data.path for cell in grid_cells(load_grid("../project/grids/set.toml"))] == [
        str(data / "other.txt")
    ]
    assert [cell.config.data.path for cell in grid_cells(load_grid("../project/grids/axis.toml"))] == [
        str(data / "corpus.txt"),
        str(data / "other.txt"),
    ]
