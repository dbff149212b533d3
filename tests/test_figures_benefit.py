"""analysis/figures/benefit.py: Figure 4 draws the stored intervals; and the summarize and plot
commands on results files (analysis/summary.py, depthdiag/cli/results.py)."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import xarray as xr  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from helpers import sigint_at_its_default  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from analysis.figures import figure4, plot_benefit_by_depth, plot_depth_averaged_benefit, save_figure  # noqa: E402
from analysis.finishing import with_equivalence  # noqa: E402
from analysis.stats import batch_noise, benefit_by_depth, depth_averaged_benefit, summary_table  # noqa: E402
from analysis.store import open_results, write_dataset  # noqa: E402
from common.provenance import describe_machine  # noqa: E402
from depthdiag.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
UNIFORM_UPDATES = (0, 16, 64, 256)


DENSE_GRID = (0, 4, 8, 16, 32, 64, 128, 256)


def results(
    seed: int = 0, n_batches: int = 4, n_depths: int = 6, uniform_updates=UNIFORM_UPDATES, lr=None
) -> xr.Dataset:
    """A schema-complete results Dataset whose benefit grows with serving depth at the switch
    and halves every 8 uniform updates."""
    rng = np.random.default_rng(seed)
    shape = (len(uniform_updates), n_batches, n_depths)
    decay = 0.5 ** (np.array(uniform_updates) / 8)
    trend = np.linspace(-0.1, 0.4, n_depths) * decay[:, None, None]
    benefit = trend + rng.normal(0.0, 0.05, shape)
    nll_deep = rng.normal(3.0, 0.1, shape)
    nll = np.stack([nll_deep + benefit, nll_deep], axis=2)
    dims = ("snapshot", "batch", "update_depth")
    return xr.Dataset(
        {
            "nll": (("snapshot", "batch", "update_depth", "serving_depth"), nll),
            "nll_before": (("snapshot", "serving_depth"), nll_deep.mean(axis=1) + 0.1),
            "benefit": (("snapshot", "batch", "serving_depth"), benefit),
            "update_rms": (dims, np.full(shape[:2] + (2,), 1e-3)),
            "rms_scale": (dims, np.ones(shape[:2] + (2,))),
            "update_cosine": (("snapshot", "batch"), np.full(shape[:2], 0.8)),
        },
        coords={
            "snapshot": [f"uniform-{u}" for u in uniform_updates],
            "uniform_updates": ("snapshot", list(uniform_updates)),
            "step": ("snapshot", [1200 + u for u in uniform_updates]),
            "lr": ("snapshot", np.full(len(uniform_updates), 1e-3) if lr is None else np.asarray(lr)),
            "batch": np.arange(n_batches),
            "update_depth": [4, 16],
            "serving_depth": np.arange(1, n_depths + 1),
        },
        attrs={"seed": seed},
    )


def data_lines(ax):
    """Lines other than the horizontal zero line."""
    return [line for line in ax.get_lines() if not np.array_equal(line.get_ydata(), [0.0, 0.0])]


def band_extent(collection: PolyCollection, x):
    """(lowest, highest) y of a fill_between band at each x."""
    vertices = collection.get_paths()[0].vertices
    return np.array([[vertices[vertices[:, 0] == xi, 1].min(), vertices[vertices[:, 0] == xi, 1].max()] for xi in x])


def test_benefit_by_depth_draws_the_stored_means_and_bands():
    intervals = benefit_by_depth(results())
    ax = plot_benefit_by_depth(intervals, uniform_updates=(16, 0))
    depths = intervals["serving_depth"].values

    lines = data_lines(ax)
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(lines) == len(bands) == 2
    for line, band, uniform_updates in zip(lines, bands, (16, 0)):
        stored = intervals.sel(snapshot=f"uniform-{uniform_updates}")
        np.testing.assert_array_equal(line.get_xdata(), depths)
        np.testing.assert_allclose(line.get_ydata(), stored["mean"].values)
        np.testing.assert_allclose(band_extent(band, depths)[:, 0], stored["lower"].values)
        np.testing.assert_allclose(band_extent(band, depths)[:, 1], stored["upper"].values)
        assert str(uniform_updates) in line.get_label()
    assert any(np.array_equal(line.get_ydata(), [0.0, 0.0]) for line in ax.get_lines())


def test_depth_averaged_benefit_draws_the_stored_error_bars():
    intervals = depth_averaged_benefit(results())
    ax = plot_depth_averaged_benefit(intervals)

    (container,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    points, _, (bars,) = container.lines
    stored = intervals.sel(snapshot=[f"uniform-{u}" for u in UNIFORM_UPDATES])
    np.testing.assert_allclose(points.get_ydata(), stored["mean"].values)
    segments = np.array(bars.get_segments())  # [snapshot, 2 ends, (x, y)]
    np.testing.assert_allclose(segments[:, :, 1].min(axis=1), stored["lower"].values)
    np.testing.assert_allclose(segments[:, :, 1].max(axis=1), stored["upper"].values)
    assert [label.get_text() for label in ax.get_xticklabels()] == [str(u) for u in UNIFORM_UPDATES]
    assert any(np.array_equal(line.get_ydata(), [0.0, 0.0]) for line in ax.get_lines())


def test_drawing_on_given_axes_returns_them():
    intervals = benefit_by_depth(results())
    fig = Figure()
    ax = fig.add_subplot()
    assert plot_benefit_by_depth(intervals, ax=ax) is ax


def test_missing_snapshots_warn_and_none_at_all_fails():
    intervals = depth_averaged_benefit(results())
    with pytest.warns(UserWarning, match="1000"):
        ax = plot_depth_averaged_benefit(intervals, uniform_updates=(0, 1000))
    assert len(ax.containers[0].lines[0].get_ydata()) == 1
    with pytest.raises(ValueError, match="1000"):
        plot_benefit_by_depth(benefit_by_depth(results()), uniform_updates=(1000,))


def test_figure4_from_several_seeds(tmp_path):
    paths = [tmp_path / f"seed{seed}.h5" for seed in (0, 1, 2)]
    for seed, path in enumerate(paths):
        write_dataset(results(seed=seed), path)
    ds = open_results(paths)
    fig = figure4(ds)
    left, right = fig.axes

    by_depth = benefit_by_depth(ds)
    assert by_depth.attrs["unit"] == "seed" and int(by_depth["n"].min()) == 3
    assert len(data_lines(left)) == 2
    for line, uniform_updates in zip(data_lines(left), (0, 16)):
        np.testing.assert_allclose(line.get_ydata(), by_depth.sel(snapshot=f"uniform-{uniform_updates}")["mean"])
    np.testing.assert_allclose(right.containers[0].lines[0].get_ydata(), depth_averaged_benefit(ds)["mean"])

    written = save_figure(fig, tmp_path / "out" / "figure4.png", dpi=40)
    assert [p.name for p in written] == ["figure4.png", "figure4.pdf"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert written[1].read_bytes()[:5] == b"%PDF-"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["figure4.pdf", "figure4.png"]


def test_summarize_command(tmp_path):
    path = tmp_path / "results.h5"
    write_dataset(results(), path)
    runner = CliRunner()

    # Behaviour change: the table now comes with what its interval covers and the finishing phase.
    table = runner.invoke(main, ["summarize", str(path)])
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0].startswith("headline:") and "batch noise only" in lines[0]
    assert all(f"uniform-{u}" in table.stdout for u in UNIFORM_UPDATES)
    assert sum(line.startswith("finishing phase:") for line in lines) == 2
    assert table.stderr == ""

    as_json = runner.invoke(main, ["summarize", str(path), "--json"])
    assert as_json.exit_code == 0, as_json.output
    document = json.loads(as_json.stdout)
    ds = open_results(path)
    assert document["rows"] == with_equivalence(summary_table(ds), ds)
    assert document["headline"]["unit"] == "batch" and "batch noise only" in document["headline"]["covers"]
    assert document["finishing_phase"]["per_seed"] == [] and document["warnings"] == []


def write_seeds(tmp_path, seeds=(0, 1, 2), **kwargs):
    paths = [tmp_path / f"seed{seed}.h5" for seed in seeds]
    for seed, path in zip(seeds, paths):
        write_dataset(results(seed=seed, **kwargs), path)
    return paths


def test_summarize_seeds_reports_both_intervals_and_the_finishing_phase(tmp_path):
    paths = write_seeds(tmp_path, uniform_updates=DENSE_GRID)
    runner = CliRunner()
    text = runner.invoke(main, ["summarize", *map(str, paths)])
    assert text.exit_code == 0, text.output
    assert "over training seeds" in text.stdout and "n = 3 seeds" in text.stdout
    assert "batch noise only" in text.stdout and "var(seeds)" in text.stdout
    assert "per seed: seed 0:" in text.stdout and "contains zero:" in text.stdout

    document = json.loads(runner.invoke(main, ["summarize", *map(str, paths), "--json"]).stdout)
    assert [row["uniform_updates"] for row in document["rows"]] == list(DENSE_GRID)
    assert {row["unit"] for row in document["rows"]} == {"seed"} and {row["n"] for row in document["rows"]} == {3}
    assert all(row["within_seed_variance"] >= 0 and row["between_seed_variance"] >= 0 for row in document["rows"])
    phase = document["finishing_phase"]
    assert [decay["seed"] for decay in phase["per_seed"]] == [0, 1, 2]
    assert phase["max_uniform_updates"] == 256 and phase["switch"]["unit"] == "seed"


AMX = {
    "cpu_model": "CPU A",
    "torch_cpu_capability": "AVX512",
    "bf16_matmul": "brg_matmul:avx10_1_512_amx",
    "threads": 1,
}
NO_AMX = {**AMX, "bf16_matmul": "brg_matmul:avx512_core_bf16", "onednn_max_cpu_isa": "AVX512_CORE_BF16"}


def test_summarize_names_the_machines_and_warns_when_they_differ(tmp_path):
    paths = write_seeds(tmp_path, seeds=(0, 1, 2))
    for path, trained in zip(paths, (AMX, AMX, NO_AMX)):
        ds = open_results(path)
        write_dataset(ds.assign_attrs(machine=json.dumps(AMX), trained_on=json.dumps([trained])), path)
    runner = CliRunner()
    same = runner.invoke(main, ["summarize", *map(str, paths[:2])])
    assert same.exit_code == 0 and same.stderr == ""
    assert same.stdout.splitlines()[-2:] == [
        f"trained on: {describe_machine(AMX)}",
        f"diagnosed on: {describe_machine(AMX)}",
    ]
    mixed = runner.invoke(main, ["summarize", *map(str, paths)])
    assert mixed.exit_code == 0, mixed.output
    (warning,) = mixed.stderr.splitlines()
    assert warning.startswith("depthdiag: warning: the files were trained or diagnosed on 2 different machines")
    assert mixed.stdout.splitlines()[-4:] == [
        f"trained on (seeds 0 1): {describe_machine(AMX)}",
        f"diagnosed on (seeds 0 1): {describe_machine(AMX)}",
        f"trained on (seeds 2): {describe_machine(NO_AMX)}",
        f"diagnosed on (seeds 2): {describe_machine(AMX)}",
    ]
    document = json.loads(runner.invoke(main, ["summarize", *map(str, paths), "--json"]).stdout)
    assert document["machines"] == [
        {"trained_on": [AMX], "diagnosed_on": AMX, "seeds": [0, 1]},
        {"trained_on": [NO_AMX], "diagnosed_on": AMX, "seeds": [2]},
    ]
    assert document["warnings"] == [warning.removeprefix("depthdiag: warning: ")]


def test_summarize_json_carries_each_seeds_own_values(tmp_path):
    import scipy.stats

    paths = write_seeds(tmp_path, seeds=(0, 1, 2))
    document = json.loads(CliRunner().invoke(main, ["summarize", *map(str, paths), "--json"]).stdout)
    for row in document["rows"]:
        assert [entry["seed"] for entry in row["per_seed"]] == [0, 1, 2]
        for entry, path in zip(row["per_seed"], paths):
            # The seed's own file: its batches' depth-averaged benefit, their mean and t interval.
            batches = open_results(path)["benefit"].sel(snapshot=row["snapshot"]).mean("serving_depth").values
            lower, upper = scipy.stats.t.interval(0.95, len(batches) - 1, batches.mean(), scipy.stats.sem(batches))
            assert entry["mean"] == pytest.approx(batches.mean(), rel=1e-12)
            assert (entry["lower"], entry["upper"]) == pytest.approx((lower, upper), rel=1e-12)
            assert entry["n"] == len(batches)


def test_summarize_warns_on_mixed_learning_rates(tmp_path):
    paths = write_seeds(tmp_path, seeds=(0, 1))
    write_dataset(results(seed=1, lr=[1e-3, 1e-3, 1e-3, 5e-4]), paths[1])
    result = CliRunner().invoke(main, ["summarize", *map(str, paths)])
    assert result.exit_code == 0, result.output
    (warning,) = result.stderr.splitlines()
    assert warning.startswith("depthdiag: warning: snapshots were diagnosed at different learning rates")
    assert f"{paths[0]}: lr 0.001;" in warning and f"{paths[1]}: lr 0.001 (uniform-0 uniform-16 uniform-64)" in warning
    json_result = CliRunner().invoke(main, ["summarize", *map(str, paths), "--json"])
    assert "different learning rates" in json.loads(json_result.stdout)["warnings"][0]


def test_summarize_refuses_files_that_differ_in_more_than_the_seed(tmp_path):
    paths = write_seeds(tmp_path, seeds=(0, 1))
    other = results(seed=1)
    other.attrs["isolate"] = "linear"
    write_dataset(other, paths[1])
    result = CliRunner().invoke(main, ["summarize", *map(str, paths)])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"depthdiag: error: {paths[1]}: isolate 'linear' differs from {paths[0]}'s '(absent)'; "
        "only the seed may differ between files combined as seeds"
    ]


def test_figure4_dense_grid_says_which_interval(tmp_path):
    ds = open_results(write_seeds(tmp_path, uniform_updates=DENSE_GRID))
    left, right = figure4(ds).axes
    assert [label.get_text() for label in right.get_xticklabels()] == [str(u) for u in DENSE_GRID]
    assert "over 3 seeds" in left.get_title() and "over 3 seeds" in right.get_title()
    headline, inner = [c for c in right.containers if isinstance(c, ErrorbarContainer)]
    noise = batch_noise(ds)
    segments = np.array(inner.lines[2][0].get_segments())
    np.testing.assert_allclose(np.ptp(segments[:, :, 1], axis=1) / 2, noise["batch_half_width"].values)
    legend = [text.get_text() for text in right.get_legend().get_texts()]
    assert any(text.startswith("mean < 5% of switch") for text in legend)
    assert any("CI containing 0" in text or "no CI contains 0" in text for text in legend)
    assert "batch noise only (mean within-seed CI)" in legend
    from analysis.finishing import finishing_phase

    bound = finishing_phase(ds).bound_updates
    shown = "shown < 5% of switch (one-sided 95% bound)"
    assert (f"{shown} from {bound} updates on" if bound is not None else f"{shown}: not within 256") in legend

    single_left, single_right = figure4(results(uniform_updates=DENSE_GRID)).axes
    assert "batch noise of one seed only" in single_left.get_title()
    assert "over 4 batches" in single_right.get_title()


@pytest.mark.parametrize("name", ["figure4", "figure4.bogus"])
def test_unknown_image_format_is_refused_before_writing(tmp_path, name):
    fig = figure4(results())
    with pytest.raises(ValueError, match=f"{name}: unknown image format"):
        save_figure(fig, tmp_path / "out" / name)
    assert not (tmp_path / "out").exists()


def test_a_figure_whose_pdf_fails_leaves_neither_file_nor_replaces_one(tmp_path, monkeypatch):
    fig = figure4(results())
    out = tmp_path / "figure4.png"
    real_savefig = Figure.savefig

    def disk_full_for_the_pdf(self, fname, *args, **kwargs):
        if kwargs.get("format") == "pdf":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_savefig(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", disk_full_for_the_pdf)
    with pytest.raises(OSError, match=re.escape(str(out.with_suffix(".pdf")))):
        save_figure(fig, out, dpi=40)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(Figure, "savefig", real_savefig)
    save_figure(fig, out, dpi=20)
    old = out.read_bytes(), out.with_suffix(".pdf").read_bytes()
    monkeypatch.setattr(Figure, "savefig", disk_full_for_the_pdf)
    with pytest.raises(OSError):
        save_figure(fig, out, dpi=40, force=True)
    assert (out.read_bytes(), out.with_suffix(".pdf").read_bytes()) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure4.pdf", "figure4.png"]


INTERRUPTED_SAVE = """
import os, sys, threading
import matplotlib
matplotlib.use("Agg")
from matplotlib.figure import Figure
from analysis.figures import save_figure

# Like numpy's BLAS threads, a thread that blocks no signal, to which the kernel may hand one.
threading.Thread(target=threading.Event().wait, daemon=True).start()
real_replace = os.replace

def replace_then_signal(src, dst):
    real_replace(src, dst)
    os.kill(os.getpid(), int(sys.argv[2]))

os.replace = replace_then_signal
fig = Figure()
fig.add_subplot().plot([0, 1])
save_figure(fig, sys.argv[1], dpi=20)
print("not interrupted")
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_renames_cannot_split_the_figure(tmp_path, signum):
    out = tmp_path / "figure.png"
    saved = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_SAVE, str(out), str(int(signum))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=sigint_at_its_default,
    )
    # The signal takes effect, once both files are in place.
    assert saved.returncode == -signum and "not interrupted" not in saved.stdout, saved.stderr
    assert out.read_bytes()[:4] == b"\x89PNG" and out.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_a_figure_found_in_part_is_refused_naming_the_missing_file(tmp_path):
    fig = figure4(results())
    out = tmp_path / "figure4.png"
    for present, missing in ((out, out.with_suffix(".pdf")), (out.with_suffix(".pdf"), out)):
        save_figure(fig, out, dpi=20)
        missing.unlink()  # as an interrupted write of an older version could leave it
        left = present.read_bytes()
        with pytest.raises(ValueError, match=rf"{re.escape(str(present))}: already exists without {missing.name} "):
            save_figure(fig, out, dpi=40, force=False)
        assert present.read_bytes() == left and not missing.exists()
        present.unlink()
    save_figure(fig, out, dpi=20)
    out.with_suffix(".pdf").unlink()
    save_figure(fig, out, dpi=40, force=True)
    assert out.read_bytes()[:4] == b"\x89PNG" and out.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"


def test_plot_command_writes_png_and_pdf(tmp_path):
    paths = [tmp_path / f"seed{seed}.h5" for seed in (0, 1)]
    for seed, path in enumerate(paths):
        write_dataset(results(seed=seed), path)
    out = tmp_path / "figures" / "figure4.png"
    result = CliRunner().invoke(main, ["plot", *map(str, paths), "--figure", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x89PNG" and out.with_suffix(".pdf").exists()


@pytest.mark.parametrize("name", ["summarize", "plot"])
def test_bad_results_files_exit_2_with_one_line(tmp_path, name):
    figure = tmp_path / "figure.png"
    command = ["summarize"] if name == "summarize" else ["plot", "--out", str(figure)]
    runner = CliRunner()
    missing = runner.invoke(main, [*command, str(tmp_path / "missing.h5")])
    assert missing.exit_code == 2
    assert missing.stderr.strip().splitlines() == [f"depthdiag: error: {tmp_path / 'missing.h5'}: no such file"]

    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"\x00" * 64)
    bad = runner.invoke(main, [*command, str(garbage)])
    assert bad.exit_code == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and str(garbage) in bad.stderr
    assert not figure.exists()


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("name", ["summarize", "plot"])
def test_results_without_finite_benefit_data_are_refused_naming_the_file(tmp_path, name, bad):
    path = tmp_path / "diverged.h5"
    ds = results()
    if bad == "nan":
        ds["benefit"][...] = np.nan  # every unit missing: it printed "0 batches", drew an empty figure
    else:
        ds["benefit"][1, 2, 3] = np.inf
    write_dataset(ds, path)
    figure = tmp_path / "figure.png"
    command = ["summarize"] if name == "summarize" else ["plot", "--out", str(figure)]
    result = CliRunner().invoke(main, [*command, str(path)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"depthdiag: error: {path}: ") and ("no finite benefit" in line or "infinite" in line)
    assert result.stdout == "" and not figure.exists() and not figure.with_suffix(".pdf").exists()


def test_every_plot_error_names_the_results_file(tmp_path):
    path = tmp_path / "late.h5"
    write_dataset(results(uniform_updates=(4, 8)), path)  # no switch snapshot to draw
    result = CliRunner().invoke(main, ["plot", str(path), "--out", str(tmp_path / "f.png")])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"depthdiag: error: {path}: no snapshot after 0, 16 uniform updates")


def test_plot_refuses_an_existing_image_or_pdf_unless_forced_and_a_held_one(tmp_path):
    from helpers import start_holder

    path = tmp_path / "results.h5"
    write_dataset(results(), path)
    out = tmp_path / "figure4.png"
    pdf = out.with_suffix(".pdf")
    runner = CliRunner()

    def plot(*flags):
        return runner.invoke(main, ["plot", str(path), "--out", str(out), *flags])

    assert plot().exit_code == 0
    out.unlink()  # as an interrupted write of an older version could leave it
    older = pdf.read_bytes()
    result = plot()
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"depthdiag: error: {pdf}: already exists without figure4.png (an interrupted earlier write?); "
        "pass --force to overwrite it and write the whole figure"
    ]
    assert pdf.read_bytes() == older and not out.exists()
    assert plot("--force").exit_code == 0 and out.read_bytes()[:4] == b"\x89PNG"
    pdf.write_bytes(b"%PDF- a figure depthdiag did not draw")
    result = plot("--force")
    assert result.exit_code == 2 and f"{pdf}: exists and is not a figure depthdiag wrote; --force" in result.stderr
    assert pdf.read_bytes() == b"%PDF- a figure depthdiag did not draw"
    pdf.write_bytes(older)
    assert plot().exit_code == 2  # now the image exists too
    holder = start_holder(pdf)
    try:
        result = plot("--force")
        assert (
            result.exit_code == 2 and f"{pdf}: in use by another depthdiag process (pid {holder.pid})" in result.stderr
        )
    finally:
        holder.kill()
        holder.wait()
    assert plot("--force").exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure4.pdf", "figure4.png", "results.h5"]


def test_summarize_measures_the_finishing_phase_against_the_fraction_asked_for(tmp_path):
    from analysis.finishing import finishing_phase

    paths = write_seeds(tmp_path, uniform_updates=DENSE_GRID)
    document = json.loads(
        CliRunner().invoke(main, ["summarize", *map(str, paths), "--json", "--fraction", "0.3"]).stdout
    )
    ds = open_results(paths)
    assert document["finishing_phase"] == json.loads(json.dumps(finishing_phase(ds, fraction=0.3).to_dict()))
    rows = [{key: value for key, value in row.items() if key != "per_seed"} for row in document["rows"]]
    assert rows == json.loads(json.dumps(with_equivalence(summary_table(ds), ds, fraction=0.3)))
    text = CliRunner().invoke(main, ["summarize", *map(str, paths), "--fraction", "0.3"]).stdout
    assert "< 30% of switch" in text and "mean benefit below 30% of it for good from" in text
    assert CliRunner().invoke(main, ["summarize", *map(str, paths), "--fraction", "1.5"]).exit_code == 2
