"""`depthdiag plot RUN --figure curves` (depthdiag/curves.py, analysis/figures/curves.py): a run's
metrics.jsonl read without torch (analysis/training.py), the smoothed loss, the figure and the
command on a real run."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from helpers import text_corpus, tiny_config  # noqa: E402

from analysis.figures import curves_figure, plot_training_loss, plot_validation_nll  # noqa: E402
from analysis.stats import trailing_mean  # noqa: E402
from analysis.training import read_metrics, run_switch  # noqa: E402
from common.errors import InputError  # noqa: E402
from depthdiag.cli import main  # noqa: E402
from depthdiag.curves import training_curves  # noqa: E402
from trainer.train import train  # noqa: E402

LINES = [
    {"step": 1, "depth": 4, "depth_counts": {"4": 2}, "loss": 5.0, "lr": 1e-3, "flops": 10.0},
    {"step": 3, "depth": 4, "depth_counts": {"4": 2}, "loss": 4.0, "lr": 2e-3, "flops": 20.0, "val_nll_1": 4.5},
    {"step": 5, "depth": 2, "depth_counts": {"1": 1, "2": 1}, "loss": 3.0, "lr": 2e-3, "flops": 25.0},
    {"step": 7, "depth": 3, "depth_counts": {"3": 2}, "loss": 3.5, "lr": 1e-3, "flops": 32.0, "val_nll_1": 3.9},
]
for line in LINES:
    if "val_nll_1" in line:
        line["val_nll_4"] = line["val_nll_1"] - 0.5


def write_metrics(directory: Path, lines=LINES, tail: str = "") -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + tail)
    return directory


def test_read_metrics_lays_the_lines_out_by_updates(tmp_path):
    ds = read_metrics(write_metrics(tmp_path / "run", tail='{"step": 9, "lo'), switch_step=4)  # a line being written
    assert ds["updates"].values.tolist() == [2, 4, 6, 8]
    assert ds["loss"].values.tolist() == [5.0, 4.0, 3.0, 3.5] and ds["depth"].values.tolist() == [4, 4, 2, 3]
    assert ds["serving_depth"].values.tolist() == [1, 4]
    np.testing.assert_array_equal(ds["val_nll"].values, [[np.nan, np.nan], [4.5, 4.0], [np.nan, np.nan], [3.9, 3.4]])
    assert "grad_norm" not in ds  # not in these lines
    assert run_switch(ds) == 4 and run_switch(read_metrics(tmp_path / "run" / "metrics.jsonl")) is None
    for name in list(ds.data_vars) + list(ds.coords):
        assert ds[name].attrs["long_name"] and ds[name].attrs["units"], name


def test_read_metrics_refuses_what_is_not_a_run(tmp_path):
    with pytest.raises(InputError, match=r"nowhere/metrics.jsonl: no such file"):
        read_metrics(tmp_path / "nowhere")
    bad = write_metrics(tmp_path / "bad", tail="")
    (bad / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\nnot json\n{"step": 1, "loss": 1.0}\n')
    with pytest.raises(InputError, match=r"metrics.jsonl: line 2 is not a metrics line"):
        read_metrics(bad)
    with pytest.raises(InputError, match="no metrics lines yet"):
        read_metrics(write_metrics(tmp_path / "empty", lines=[]))


def test_trailing_mean_by_hand():
    np.testing.assert_allclose(trailing_mean([5.0, 4.0, 3.0, 3.5], 2), [5.0, 4.5, 3.5, 3.25])
    np.testing.assert_allclose(trailing_mean([5.0, 4.0, 3.0, 3.5], 3), [5.0, 4.5, 4.0, 3.5])
    np.testing.assert_allclose(trailing_mean([1.0, np.nan, 3.0], 2), [1.0, 1.0, 3.0])
    np.testing.assert_allclose(trailing_mean([2.0, 4.0], 1), [2.0, 4.0])
    with pytest.raises(InputError):
        trailing_mean([1.0], 0)


def test_the_plots_draw_the_numbers_and_mark_the_switch(tmp_path):
    ds = read_metrics(write_metrics(tmp_path / "run"), switch_step=4)
    ax = plot_training_loss(ds, window=2, switch_step=4)
    raw, smoothed, switch = ax.get_lines()
    assert raw.get_xdata().tolist() == [2, 4, 6, 8] and raw.get_ydata().tolist() == [5.0, 4.0, 3.0, 3.5]
    np.testing.assert_allclose(smoothed.get_ydata(), [5.0, 4.5, 3.5, 3.25])
    assert list(switch.get_xdata()) == [4, 4]
    ax = plot_validation_nll(ds, switch_step=None)
    lines = ax.get_lines()
    assert len(lines) == 2  # one per serving depth, no switch line
    assert lines[1].get_xdata().tolist() == [4, 8] and lines[1].get_ydata().tolist() == [4.0, 3.4]
    assert len(curves_figure(ds).axes) == 3  # loss, validation NLL and its colour bar
    without_validation = ds.drop_vars(["val_nll", "serving_depth"])
    assert len(curves_figure(without_validation).axes) == 1


def test_plot_curves_of_a_run_directory(tmp_path):
    config = tiny_config(text_corpus(tmp_path), log_every=2).with_overrides(["train.eval_every=4"])
    run = tmp_path / "run"
    train(config, run, progress=False)
    ds = training_curves(run)
    assert run_switch(ds) == 6  # fixed-first switch=0.5 of 12 updates
    assert ds["serving_depth"].values.tolist() == list(range(1, 17))
    assert ds["val_nll"].dropna("updates", how="all")["updates"].values.tolist() == [4, 8, 12]

    out = tmp_path / "curves.png"
    result = CliRunner().invoke(main, ["plot", str(run), "--figure", "curves", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 0 and out.with_suffix(".pdf").exists()
    again = CliRunner().invoke(main, ["plot", str(run), "--figure", "curves", "--out", str(out)])
    assert again.exit_code == 2 and "already exists" in again.stderr
    two = CliRunner().invoke(main, ["plot", str(run), str(run), "--figure", "curves", "--out", str(tmp_path / "x.png")])
    assert two.exit_code == 2 and "one run directory" in two.stderr
    (run / "config.json").unlink()
    lone = CliRunner().invoke(main, ["plot", str(run), "--figure", "curves", "--out", str(tmp_path / "y.png")])
    assert lone.exit_code == 0 and "the schedule's switch is not marked" in lone.stderr
