"""The update-depth x serving-depth map (analysis/figures/update_depth_map.py): its numbers, its
figure, `plot --figure map` and `make figure-map`."""

import shutil
import subprocess
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import xarray as xr  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from matplotlib.collections import QuadMesh  # noqa: E402

from analysis.figures import plot_update_depth_map, update_depth_map_figure  # noqa: E402
from analysis.stats import IntervalOptions, t_interval, update_depth_map  # noqa: E402
from analysis.store import open_results, write_dataset  # noqa: E402
from depthdiag.cli import main  # noqa: E402

UPDATE_DEPTHS = (4, 1, 2, 8, 16)  # the first is the reference
COMPARED = (1, 2, 8, 16)
REPO = Path(__file__).resolve().parents[1]


def multi_depth_results(seed: int = 0, n_batches: int = 4, n_serving: int = 6, uniform_updates=(0, 16)):
    """A results Dataset as `diagnose --update-depths 4,1,2,8,16` writes it: nll per update depth,
    benefit (first minus last depth) and benefit_all (first minus each)."""
    rng = np.random.default_rng(seed)
    n_snap = len(uniform_updates)
    nll = rng.normal(3.0, 0.05, (n_snap, n_batches, len(UPDATE_DEPTHS), n_serving))
    # Deeper updates help deeper serving depths at the switch, less so after 16 updates.
    depth = np.array(UPDATE_DEPTHS)[:, None] / 16
    serving = np.arange(1, n_serving + 1)[None, :] / n_serving
    nll -= np.array([0.2, 0.05])[:n_snap, None, None, None] * (depth * serving)[None, None]
    shape = (n_snap, n_batches)
    return xr.Dataset(
        {
            "nll": (("snapshot", "batch", "update_depth", "serving_depth"), nll),
            "nll_before": (("snapshot", "serving_depth"), nll.mean(axis=(1, 2)) + 0.1),
            "benefit": (("snapshot", "batch", "serving_depth"), nll[:, :, 0] - nll[:, :, -1]),
            "benefit_all": (("snapshot", "batch", "update_depth", "serving_depth"), nll[:, :, :1] - nll),
            "update_rms": (("snapshot", "batch", "update_depth"), np.full(shape + (5,), 1e-3)),
            "rms_scale": (("snapshot", "batch", "update_depth"), np.ones(shape + (5,))),
            "update_cosine": (("snapshot", "batch"), np.full(shape, 0.8)),
        },
        coords={
            "snapshot": [f"u{u:04d}" for u in uniform_updates],
            "uniform_updates": ("snapshot", list(uniform_updates)),
            "step": ("snapshot", [768 + u for u in uniform_updates]),
            "batch": np.arange(n_batches),
            "update_depth": list(UPDATE_DEPTHS),
            "serving_depth": np.arange(1, n_serving + 1),
        },
        attrs={"seed": seed},
    )


def seed_files(tmp_path, seeds=(0, 1, 2)):
    paths = [tmp_path / f"map-seed{seed}.h5" for seed in seeds]
    for seed, path in zip(seeds, paths):
        write_dataset(multi_depth_results(seed), path)
    return paths


def test_one_file_map_is_the_batch_mean_of_benefit_all_with_the_reference_left_out():
    ds = multi_depth_results()
    cells = update_depth_map(ds)
    assert cells["mean"].dims == ("snapshot", "update_depth", "serving_depth")
    assert list(cells["update_depth"].values) == list(COMPARED)
    assert cells.attrs["unit"] == "batch" and cells.attrs["reference_depth"] == 4
    expected = ds["benefit_all"].sel(update_depth=list(COMPARED)).mean("batch")
    np.testing.assert_allclose(cells["mean"].values, expected.values)
    assert (cells["n"].values == 4).all()
    # One cell by hand: the t interval over the four batches of NLL(K=4) - NLL(K=16) at serving depth 3.
    values = ds["nll"].values[1, :, 0, 2] - ds["nll"].values[1, :, 4, 2]
    mean, lower, upper, n = t_interval(values)
    cell = cells.isel(snapshot=1).sel(update_depth=16, serving_depth=3)
    assert (float(cell["mean"]), float(cell["lower"]), float(cell["upper"]), int(cell["n"])) == pytest.approx(
        (mean, lower, upper, n)
    )
    # Without the stored benefit_all (two-depth files) the same numbers come from nll.
    derived = update_depth_map(ds.drop_vars("benefit_all"))
    np.testing.assert_allclose(derived["mean"].values, cells["mean"].values)


def test_the_map_reads_the_stored_benefit_all_rather_than_rederiving_it_from_nll():
    # benefit_all is written from the float64 NLLs; a file whose nll was rounded to float32 still shows it exactly.
    ds = multi_depth_results()
    rounded = ds.assign(nll=ds["nll"].astype(np.float32))
    cells = update_depth_map(rounded)
    expected = ds["benefit_all"].sel(update_depth=list(COMPARED)).mean("batch")
    np.testing.assert_allclose(cells["mean"].values, expected.values, rtol=1e-12)


def test_the_map_honours_the_interval_options_and_a_renamed_seed_dimension():
    ds = multi_depth_results()
    cells = update_depth_map(ds, options=IntervalOptions(level=0.9))
    assert cells.attrs == {"level": 0.9, "method": "t", "unit": "batch", "reference_depth": 4}
    values = ds["benefit_all"].values[0, :, 2, 4]  # switch snapshot, update depth 2, serving depth 5
    cell = cells.isel(snapshot=0).sel(update_depth=2, serving_depth=5)
    assert (float(cell["lower"]), float(cell["upper"])) == pytest.approx(t_interval(values, 0.9)[1:3], rel=1e-12)
    runs = xr.concat([multi_depth_results(seed) for seed in (0, 1)], dim="run")
    by_run = update_depth_map(runs, seed_dim="run")
    assert by_run.attrs["unit"] == "run" and (by_run["n"].values == 2).all()


def test_several_seeds_map_is_the_mean_of_per_seed_batch_means(tmp_path):
    ds = open_results(seed_files(tmp_path))
    cells = update_depth_map(ds)
    assert cells.attrs["unit"] == "seed" and (cells["n"].values == 3).all()
    per_seed = np.stack(
        [multi_depth_results(seed)["benefit_all"].values.mean(axis=1) for seed in (0, 1, 2)]
    )  # [seed, snapshot, update_depth, serving_depth]
    expected = per_seed.mean(axis=0)[:, 1:]  # drop the reference row; 1, 2, 8, 16 are already sorted
    np.testing.assert_allclose(cells["mean"].values, expected)


def test_map_figure_draws_the_means_on_a_scale_centred_at_zero(tmp_path):
    ds = open_results(seed_files(tmp_path))
    cells = update_depth_map(ds)
    fig = update_depth_map_figure(ds)
    left, right = fig.axes[:2]
    limits = set()
    for ax, snapshot in ((left, 0), (right, 1)):
        mesh = next(c for c in ax.collections if isinstance(c, QuadMesh))
        drawn = np.asarray(mesh.get_array()).reshape(len(COMPARED), 6)
        np.testing.assert_allclose(drawn, cells["mean"].isel(snapshot=snapshot).values)
        assert mesh.norm.vmin == -mesh.norm.vmax
        limits.add(mesh.norm.vmax)
        np.testing.assert_array_equal(ax.get_yticks(), np.arange(len(COMPARED)))  # one row per update depth
        # The dots mark exactly the cells whose interval excludes zero.
        stored = cells.isel(snapshot=snapshot)
        excluding = int(((stored["lower"] > 0) | (stored["upper"] < 0)).sum())
        assert len(ax.get_lines()[0].get_xdata()) == excluding
    assert [t.get_text() for t in left.get_yticklabels()] == [str(d) for d in COMPARED]  # shared with the right
    assert len(limits) == 1  # one colour scale for both panels
    assert limits.pop() == pytest.approx(np.abs(cells["mean"].values).max())
    assert left.get_title() == "switch (0 uniform updates)" and right.get_title() == "16 uniform updates"
    caption = fig.get_suptitle()
    assert "mean over 3 seeds (per-seed batch means)" in caption and "95% Student-t CI over seeds excludes 0" in caption
    assert len(fig.axes) == 3  # two panels and the shared colour bar

    single = plot_update_depth_map(update_depth_map(multi_depth_results()).isel(snapshot=0))
    assert "mean over 4 batches" in single.get_title() and "batch noise of one seed only" in single.get_title()


def test_plot_command_draws_the_map(tmp_path):
    paths = seed_files(tmp_path)
    out = tmp_path / "figure-map.png"
    result = CliRunner().invoke(main, ["plot", *map(str, paths), "--figure", "map", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.with_suffix(".pdf").exists()

    late = tmp_path / "late.h5"
    write_dataset(multi_depth_results(uniform_updates=(4, 8)), late)
    refused = CliRunner().invoke(main, ["plot", str(late), "--figure", "map", "--out", str(tmp_path / "x.png")])
    assert refused.exit_code == 2
    assert refused.stderr.strip().splitlines() == [
        f"depthdiag: error: {late}: no snapshot after 0, 16 uniform updates (the results have 4, 8)"
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_figure_map_diagnoses_the_switch_and_16_update_snapshots_then_plots():
    # -n: print, run nothing; -B: as if every file were out of date, whatever this checkout holds.
    result = subprocess.run(
        ["make", "-n", "-B", "figure-map", "SEEDS=0 1"], cwd=REPO, capture_output=True, text=True, check=True
    )
    # Continued recipe lines joined, runs of spaces as one.
    lines = [" ".join(line.split()) for line in result.stdout.replace("\\\n", " ").splitlines()]
    for seed in (0, 1):
        (diagnose,) = [line for line in lines if "diagnose" in line and f"results/tiny/map-seed{seed}.h5" in line]
        assert f"runs/tiny/seed{seed}/snapshots/u0000_*.pt runs/tiny/seed{seed}/snapshots/u0016_*.pt" in diagnose
        assert "--update-depths 4,1,2,8,16" in diagnose and "--resume" in diagnose
        assert f"rm -f results/tiny/map-seed{seed}.h5" in lines
    (plot,) = [line for line in lines if " plot " in line]
    assert "results/tiny/map-seed0.h5 results/tiny/map-seed1.h5 --figure map" in plot
    assert "--out results/tiny/figure-map.png --force" in plot
