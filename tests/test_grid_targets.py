"""End to end, not one module: `make figure1`, `figure5`, `figure2`, `figure3-loss` and `table3`
end to end on very small grids: the Makefile trains every cell through `depthdiag grid run`,
collects them with `grid collect` and draws with `plot` / `grid table`, exactly as the default
targets do, with grid files of the same names over a toy bioS config (seconds per cell). Every
target together takes about three minutes on 2 cores, so that test is `slow` (CI runs it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.grid import open_grid

ROOT = Path(__file__).resolve().parent.parent

TOY = """
[model]
vocab_size = 256
max_seq_len = 32
d_model = 32
n_heads = 2
n_prelude = 1
n_core = 1
n_coda = 1
[data]
source = "bios"
bios_people = 20
eval_sequences = 8
[optim]
lr = 3e-3
warmup = 2
[train]
schedule = "uniform:1-4"
updates = 12
batch_size = 8
seq_len = 32
checkpoint_every = 0
snapshot_uniform_updates = []
device = "cpu"
log_every = 2
"""

GRIDS = {
    "figure1": """
[budget]
match = "flops"
reference = "uniform:1-4"
[axes.schedule]
fixed2 = "fixed:2"
ff80 = "fixed-first:k0=2,switch=0.8,finish=uniform:1-4"
uniform = "uniform:1-4"
[axes]
seed = [0, 1]
budget = [0.5, 1.0]
""",
    "figure5": """
[axes]
schedule = { fixed1 = "fixed:1", fixed2 = "fixed:2" }
seed = [0, 1]
""",
    "figure2": """
[axes.schedule]
uniform = "uniform:1-4"
progressive = "progressive:mean=3,sigma=0.5,max=4"
k1-67-uniform = "fixed-first:k0=1,switch=0.67,finish=uniform:1-4"
k1-80-uniform = "fixed-first:k0=1,switch=0.8,finish=uniform:1-4"
k1-67-pln = "fixed-first:k0=1,switch=0.67,finish=pln:mean=3,sigma=0.5,max=4"
[axes]
seed = [0, 1]
""",
    "schedules": """
[budget]
match = "updates"
[axes.schedule]
uniform = "uniform:1-4"
ff67 = "fixed-first:k0=2,switch=0.67,finish=uniform:1-4"
ff80 = "fixed-first:k0=2,switch=0.8,finish=uniform:1-4"
uniform-matched = { schedule = "uniform:1-4", flops_of = "ff67" }
[axes]
seed = [0, 1]
""",
}


def make(target: str, tmp: Path) -> None:
    variables = [
        f"GRIDS={tmp / 'grids'}",
        f"GRID_RUNS={tmp / 'runs'}",
        f"GRID_RESULTS={tmp / 'results'}",
        "GRID_SERVING=1-16",
        "GRID_OPTIONS=--no-progress",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    result = subprocess.run(["make", "-C", str(ROOT), target, *variables], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_every_grid_target_end_to_end(tmp_path):
    (tmp_path / "grids").mkdir()
    (tmp_path / "toy.toml").write_text(TOY, encoding="utf-8")
    for name, text in GRIDS.items():
        (tmp_path / "grids" / f"{name}.toml").write_text(f'base = "../toy.toml"\n{text}', encoding="utf-8")
    results = tmp_path / "results"

    make("figure1", tmp_path)
    assert (results / "figure1.png").stat().st_size > 0 and (results / "figure1.pdf").is_file()
    ds = open_grid(results / "figure1.h5")
    assert dict(ds["recall_bits"].sizes) == {"schedule": 3, "seed": 2, "budget": 2, "serving_depth": 16}
    # Matched budgets: every schedule spends the budget's FLOPs within one update of its own.
    spent = ds["modeled_flops"] / ds["modeled_flops"].sel(schedule="uniform")
    assert np.all(np.abs(spent.values - 1) < 0.2)

    make("figure5", tmp_path)
    assert (results / "figure5.png").is_file()

    make("figure2", tmp_path)
    assert (results / "figure2.png").is_file() and (results / "figure8.png").is_file()

    make("figure3-loss", tmp_path)
    assert (results / "figure3-loss.png").is_file()

    make("table3", tmp_path)
    table = (results / "table3.md").read_text()
    assert "uniform-matched" in table and "ff67" in table
    rows = json.loads((results / "table3.json").read_text())
    assert [row["schedule"] for row in rows] == ["uniform", "ff67", "ff80", "uniform-matched"]
    # The schedules grid was trained once for both targets, and a rerun does nothing.
    runs = sorted((tmp_path / "runs").iterdir())
    assert [p.name for p in runs] == ["figure1", "figure2", "figure5", "schedules"]
    before = (results / "schedules.h5").stat().st_mtime_ns
    make("table3", tmp_path)
    assert (results / "schedules.h5").stat().st_mtime_ns == before


# A pilot whose deep update clearly helps at the switch (+0.03 nats, interval above 0): K0=2
# for 30 of 40 updates at a high LR specialises the toy model to depth 2.
PILOT = (
    TOY.replace('schedule = "uniform:1-4"', 'schedule = "fixed-first:k0=2,switch=0.75,finish=uniform:1-4"')
    .replace("updates = 12", "updates = 40")
    .replace("lr = 3e-3", "lr = 1e-2")
    + "[monitor]\nevery = 5\nbatches = 2\nupdate_depths = [1, 4]\nserving_depths = [1, 2, 3, 4]\n"
    "eval_sequences = 4\n"
)


@pytest.mark.slow  # the make pipeline, 40 s; its parts have their own tests in make test
def test_finishing_phase_end_to_end(tmp_path):
    """Pilot with the monitor -> recommend (its grid file) -> the grid trained and collected
    -> the paired comparison, through `make finishing-phase`."""
    pilot = tmp_path / "pilot.toml"
    pilot.write_text(PILOT, encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    variables = [
        f"PILOT_CONFIG={pilot}",
        "FINISH_UPDATES=12",
        "FINISH_SEEDS=0,1",
        # A loose rule: the toy pilot's checks are noisy, and the test is of the pipeline.
        "RECOMMEND_OPTIONS=--threshold 0.99 --checks 1 --rule either",
        "GRID_OPTIONS=--no-progress",
        f"FINISHING={tmp_path / 'finishing'}",
        f"PILOT={tmp_path / 'pilot'}",
        f"FINISH_RUNS={tmp_path / 'runs'}",
    ]
    result = subprocess.run(
        ["make", "-C", str(ROOT), "finishing-phase", *variables], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    finishing = tmp_path / "finishing"
    grid = (finishing / "grid.toml").read_text()
    assert "recommended = " in grid and 'ff80 = "fixed-first:k0=2,switch=0.8' in grid
    comparison = (finishing / "comparison.md").read_text()
    assert "recommended − ff80" in comparison and "recommended − uniform" in comparison
    assert "over 2 seeds" in comparison
    ds = open_grid(finishing / "grid.h5")
    assert dict(ds["nll"].sizes) == {"schedule": 3, "seed": 2, "serving_depth": 16}
    assert (ds["updates"] == 12).all()
