"""End to end, not one module: the whole pipeline of `make figure4` at toy scale through the
command line: train with a switch, diagnose the snapshots, summarize, plot."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import TOY_CONFIG

from analysis.store import open_results
from depthdiag.cli import main


def invoke(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout  # stderr may carry warnings (e.g. snapshots at different LRs)


# Slow: make test's golden run (test_golden.py) goes the same way through train, diagnose and
# summarize and checks their numbers; figure 4's plot has its own tests (test_figures_benefit.py).
@pytest.mark.slow
def test_train_diagnose_summarize_plot(tmp_path):
    config = tmp_path / "toy.toml"
    config.write_text(TOY_CONFIG)
    run_dir, results, figure = tmp_path / "run", tmp_path / "toy.h5", tmp_path / "figure4.png"

    invoke("train", str(config), "--out", str(run_dir), "--no-progress")
    snapshots = sorted(str(p) for p in (run_dir / "snapshots").glob("*.pt"))
    assert len(snapshots) == 3

    invoke(
        "diagnose",
        *snapshots,
        "--out",
        str(results),
        "--update-depths",
        "2,8",
        "--serving",
        "1-8",
        "--batches",
        "3",
        "--no-progress",
    )
    ds = open_results([results])
    assert ds["nll"].sizes == {"snapshot": 3, "batch": 3, "update_depth": 2, "serving_depth": 8}
    assert list(ds["uniform_updates"].values) == [0, 4, 16]
    assert np.isfinite(ds["nll"].values).all()
    # The stored benefit is the reference update's NLL minus the deeper update's.
    np.testing.assert_allclose(ds["benefit"], ds["nll"].sel(update_depth=2) - ds["nll"].sel(update_depth=8))

    rows = json.loads(invoke("summarize", str(results), "--json"))["rows"]
    assert [row["uniform_updates"] for row in rows] == [0, 4, 16]
    assert all(row["n"] == 3 for row in rows)

    invoke("plot", str(results), "--figure", "4", "--out", str(figure))
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figure.with_suffix(".pdf").read_bytes()[:4] == b"%PDF"
