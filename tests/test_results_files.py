"""A property of every results file, across the modules that write and read them (diag/driver/run.py,
analysis/store.py, common/provenance.py, analysis/stats.py): results files that explain
themselves: a description and units on every variable and coordinate, the training seed as a
coordinate, the versions and the source state; older files without them still open and combine;
`summarize --csv` and `depthdiag --version`."""

from __future__ import annotations

import csv
import io
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from click.testing import CliRunner
from helpers import SERVING, UPDATE_DEPTHS, run_config, write_run

from analysis.finishing import with_equivalence
from analysis.stats import format_csv, summary_table
from analysis.store import DESCRIPTIONS, open_results, write_dataset
from common.provenance import provenance
from depthdiag.cli import main
from diag.driver.run import DiagnoseConfig, diagnose
from trainer.config import replace_section

ROOT = Path(__file__).resolve().parents[1]


def diagnosed_run(directory: Path, seed: int) -> Path:
    directory.mkdir()
    paths = write_run(directory, replace_section(run_config(), "train", seed=seed))
    out = directory / "results.h5"
    config = DiagnoseConfig(
        snapshots=(str(paths[2]), str(paths[4])),
        out=str(out),
        update_depths=UPDATE_DEPTHS,
        serving_depths=SERVING,
        batches=2,
        eval_set="snapshot",
        progress=False,
    )
    return diagnose(config)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[int, Path]:
    """Results files of two runs that differ in the training seed only (3 and 5)."""
    root = tmp_path_factory.mktemp("seeds")
    return {seed: diagnosed_run(root / f"seed{seed}", seed) for seed in (3, 5)}


def stored(path: Path) -> xr.Dataset:
    """The file as written, without anything `open_results` adds."""
    with xr.open_dataset(path, engine="h5netcdf") as ds:
        return ds.load()


def test_every_variable_and_coordinate_has_a_long_name_and_units(seeds):
    ds = stored(seeds[3])
    names = list(ds.data_vars) + list(ds.coords)
    assert {"nll", "benefit", "train_loss", "snapshot", "lr", "seed", "serving_depth"} <= set(names)
    for name in names:
        assert ds[name].attrs.get("long_name"), name
        assert ds[name].attrs.get("units"), name
        assert (ds[name].attrs["long_name"], ds[name].attrs["units"]) == DESCRIPTIONS[name], name
    assert ds["nll"].attrs["units"] == "nats" and ds["update_depth"].attrs["units"] == "iterations"


def test_the_training_seed_is_a_scalar_coordinate(seeds):
    ds = stored(seeds[5])
    assert ds["seed"].ndim == 0 and int(ds["seed"]) == 5
    assert "seed" not in ds.dims and ds["benefit"].dims == ("snapshot", "batch", "serving_depth")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_versions_and_the_source_state_are_recorded(seeds):
    attrs = stored(seeds[3]).attrs
    assert attrs["python_version"] == platform.python_version()
    assert attrs["numpy_version"] == np.__version__ and attrs["torch_version"] == torch.__version__
    assert attrs["depthdiag_version"] == metadata.version("depthdiag")
    assert attrs["git_commit"] == git("rev-parse", "HEAD").strip()
    assert attrs["git_dirty"] == int(bool(git("status", "--porcelain", "--untracked-files=no").strip()))


def test_without_git_the_source_state_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable to be found
    recorded = provenance()
    assert recorded["git_commit"] == "unknown" and recorded["git_dirty"] == "unknown (no git)"
    monkeypatch.undo()
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "absent"))  # git runs, outside any repository
    assert provenance()["git_dirty"] == "unknown (not a git checkout)"


def test_seeds_combine_along_seed_with_their_descriptions(seeds):
    combined = open_results([seeds[5], seeds[3]])
    assert combined["seed"].dims == ("seed",) and combined["seed"].values.tolist() == [5, 3]
    assert combined["seed"].attrs["long_name"] == "training seed of the run"
    assert combined["benefit"].dims == ("seed", "snapshot", "batch", "serving_depth")
    for seed in (5, 3):
        np.testing.assert_array_equal(combined["nll"].sel(seed=seed).values, stored(seeds[seed])["nll"].values)
    assert all(combined[name].attrs.get("units") for name in list(combined.data_vars) + list(combined.coords))


def as_older_file(path: Path, out: Path) -> Path:
    """`path` as a results file written before the seed coordinate, the descriptions and the
    new provenance attributes existed."""
    ds = stored(path).drop_vars("seed")
    for name in ds.variables:
        ds[name].attrs = {k: v for k, v in ds[name].attrs.items() if k not in ("long_name", "units")}
    for key in ("python_version", "numpy_version", "git_dirty"):
        del ds.attrs[key]
    write_dataset(ds, out)
    return out


def test_an_older_file_opens_with_its_seed_from_the_run_config_and_combines_with_a_new_one(seeds, tmp_path):
    old = as_older_file(seeds[3], tmp_path / "old.h5")
    assert "seed" not in stored(old).coords and "long_name" not in stored(old)["nll"].attrs
    ds = open_results(old)
    assert int(ds["seed"]) == 3 and ds["nll"].attrs["units"] == "nats"
    combined = open_results([old, seeds[5]])
    assert combined["seed"].values.tolist() == [3, 5]
    result = CliRunner().invoke(main, ["summarize", str(old), str(seeds[5])])
    assert result.exit_code == 0, result.output
    assert "n = 2 seeds" in result.output


def test_summarize_csv_holds_the_summary_table(seeds, tmp_path):
    files = [str(seeds[3]), str(seeds[5])]
    result = CliRunner().invoke(main, ["summarize", *files, "--csv"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    ds = open_results(files)
    expected = with_equivalence(summary_table(ds), ds)
    assert [row["snapshot"] for row in rows] == [row["snapshot"] for row in expected]
    assert list(rows[0]) == list(expected[0])
    for row, want in zip(rows, expected):
        assert float(row["mean"]) == want["mean"] and float(row["upper"]) == want["upper"]
        assert int(row["n"]) == want["n"] == 2 and row["unit"] == "seed"

    out = tmp_path / "summary.csv"
    written = CliRunner().invoke(main, ["summarize", *files, "--csv", str(out)])
    assert written.exit_code == 0 and "mean benefit" in written.stdout  # the table still goes to stdout
    assert out.read_text() == result.stdout
    again = CliRunner().invoke(main, ["summarize", *files, "--csv", str(out)])
    assert again.exit_code == 2 and "already exists; pass --force" in again.stderr
    assert CliRunner().invoke(main, ["summarize", *files, "--csv", str(out), "--force"]).exit_code == 0
    both = CliRunner().invoke(main, ["summarize", *files, "--json", "--csv", "-"])
    assert both.exit_code == 2 and "pick one" in both.stderr
    onto = CliRunner().invoke(main, ["summarize", "--csv", files[0], files[1]])
    assert onto.exit_code == 2 and "names a results file" in onto.stderr
    assert stored(seeds[3])["nll"].size  # the results file was not written over


def test_format_csv_leaves_missing_values_empty():
    rows = [{"a": 1, "b": float("nan"), "c": None}, {"a": 2.5, "b": True, "d": "x,y"}]
    assert format_csv(rows) == 'a,b,c,d\n1,,,\n2.5,True,,"x,y"\n'


def test_version_prints_the_package_version_without_torch():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "import depthdiag.cli\n"
        "result = CliRunner().invoke(depthdiag.cli.main, ['--version'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'xarray', 'numpy'))\n"
        "print(result.exit_code, result.output.strip(), heavy[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == f"0 depthdiag {metadata.version('depthdiag')} []"
