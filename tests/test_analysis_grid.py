"""The collected grid file (analysis/grid.py): schema, round trip, seed bands, the terminal loss,
Table 3 by hand, and the grid figures (1, 2, 3-top, 5, 8; analysis/figures/grid.py) on synthetic
grids."""

import math

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scipy.stats  # noqa: E402
import xarray as xr  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from analysis.figures import figure1, figure2, figure3_loss, figure5, figure8  # noqa: E402
from analysis.grid import (  # noqa: E402
    KIND,
    format_table3,
    grid_dataset,
    mean_serving_nll,
    normalised_recall,
    open_grid,
    seed_band,
    table3,
    terminal_loss,
    terminal_window,
)
from analysis.store import write_dataset  # noqa: E402
from common.errors import InputError  # noqa: E402

SERVING = list(range(1, 17))
SCHEDULES = {
    # label: (spec, initial_depth, switch_fraction, finish, modeled FLOPs, wall time)
    "fixed4": ("fixed:4", 4, math.nan, "fixed:4", 4.0e12, 40.0),
    "ff67": ("fixed-first:k0=4,switch=0.67,finish=uniform:1-16", 4, 0.67, "uniform:1-16", 5.5e12, 60.0),
    "ff80": ("fixed-first:k0=4,switch=0.8,finish=uniform:1-16", 4, 0.8, "uniform:1-16", 5.0e12, 55.0),
    "pln67": (
        "fixed-first:k0=2,switch=0.67,finish=pln:mean=8,sigma=0.5,max=16",
        2,
        0.67,
        "pln:mean=8,sigma=0.5,max=16",
        5.2e12,
        58.0,
    ),
    "uniform": ("uniform:1-16", 0, math.nan, "uniform:1-16", 8.0e12, 100.0),
}
UPDATES = 100
STEPS = [9, 19, 29, 39, 49, 59, 69, 79, 87, 93, 99]
LINE_UPDATES = [10, 10, 10, 10, 10, 10, 10, 10, 8, 6, 6]


def cell(label: str, seed: int, *, recall: bool = True, budget: float = 1.0) -> dict:
    """One cell with numbers that depend on the schedule, the seed and the budget in known ways."""
    spec, k0, switch, finish, modeled, wall = SCHEDULES[label]
    offset = list(SCHEDULES).index(label)
    depths = np.array(SERVING, dtype=float)
    # Recall peaks at the schedule's training depth (or at depth 8).
    peak = k0 if k0 else 8
    recall_bits = (100.0 + seed + 10 * budget) * np.exp(-((np.log2(depths) - np.log2(peak)) ** 2))
    loss = 3.0 - 0.01 * np.array(STEPS) + 0.1 * offset + 0.01 * seed
    return {
        "nll": 2.0 + 0.1 * offset + 0.01 * seed + 0.001 * depths,
        "recall_bits": recall_bits if recall else None,
        "loss_steps": STEPS,
        "loss": loss,
        "loss_updates": LINE_UPDATES,
        "updates": UPDATES,
        "modeled_flops": modeled * budget,
        "flops": modeled * budget * (1 + 0.001 * seed),
        "wall_time": wall * budget + seed,
        "schedule_spec": spec,
        "initial_depth": k0,
        "switch_fraction": switch,
        "switch_step": -1 if math.isnan(switch) else round(switch * UPDATES),
        "finish": finish,
    }


def grid(schedules=tuple(SCHEDULES), seeds=(0, 1, 2), budgets=None, recall=True) -> xr.Dataset:
    axes = {"schedule": list(schedules), "seed": list(seeds)}
    if budgets is not None:
        axes["budget"] = list(budgets)
        cells = {(s, k, b): cell(s, k, recall=recall, budget=b) for s in schedules for k in seeds for b in budgets}
    else:
        cells = {(s, k): cell(s, k, recall=recall) for s in schedules for k in seeds}
    return grid_dataset(axes, cells, serving_depths=SERVING, attrs={"recall_ceiling_bits": 120.0, "note": "test"})


# --- schema -------------------------------------------------------------------------------------


def test_grid_dataset_schema():
    ds = grid(budgets=[0.15, 1.0])
    assert ds.attrs["kind"] == KIND and ds.attrs["note"] == "test"
    assert ds["nll"].dims == ("schedule", "seed", "budget", "serving_depth")
    assert ds["loss"].dims == ("schedule", "seed", "budget", "log_step")
    assert ds["updates"].dims == ("schedule", "seed", "budget")
    assert ds["log_step"].values.tolist() == STEPS
    for name in [*ds.data_vars, *ds.coords]:
        assert {"long_name", "units"} <= set(ds[name].attrs), name
    assert float(ds["wall_time"].sel(schedule="ff80", seed=2, budget=0.15)) == pytest.approx(55.0 * 0.15 + 2)
    assert str(ds["finish"].sel(schedule="pln67", seed=0, budget=1.0).values) == "pln:mean=8,sigma=0.5,max=16"


def test_log_step_is_the_union_and_missing_lines_are_nan():
    cells = {(s,): cell(s, 0) for s in ("fixed4", "uniform")}
    cells[("uniform",)] = {**cells[("uniform",)], "loss_steps": [5, 99], "loss": [1.0, 2.0], "loss_updates": [6, 94]}
    ds = grid_dataset({"schedule": ["fixed4", "uniform"]}, cells, serving_depths=SERVING, attrs={})
    assert ds["log_step"].values.tolist() == sorted({5, *STEPS})
    row = ds.sel(schedule="uniform")
    assert row["loss"].sel(log_step=5).item() == 1.0 and row["loss_updates"].sel(log_step=5).item() == 6
    assert np.isnan(row["loss"].sel(log_step=9).item()) and row["loss_updates"].sel(log_step=9).item() == 0
    assert np.isnan(ds["loss"].sel(schedule="fixed4", log_step=5).item())


def test_missing_and_extra_cells_are_refused():
    axes = {"schedule": ["fixed4", "uniform"], "seed": [0, 1]}
    cells = {(s, k): cell(s, k) for s in axes["schedule"] for k in axes["seed"]}
    missing = {key: value for key, value in cells.items() if key != ("uniform", 1)}
    with pytest.raises(InputError, match=r"\(schedule='uniform', seed=1\) is missing"):
        grid_dataset(axes, missing, serving_depths=SERVING, attrs={})
    with pytest.raises(InputError, match=r"\(schedule='uniform', seed=2\) is not in the axes' product"):
        grid_dataset(axes, {**cells, ("uniform", 2): cell("uniform", 2)}, serving_depths=SERVING, attrs={})


def test_bad_cells_are_refused_naming_the_problem():
    axes = {"schedule": ["fixed4", "uniform"]}
    cells = {(s,): cell(s, 0) for s in axes["schedule"]}
    short = {**cells, ("uniform",): {**cells[("uniform",)], "nll": [1.0, 2.0]}}
    with pytest.raises(InputError, match="nll has 2 values, expected 16"):
        grid_dataset(axes, short, serving_depths=SERVING, attrs={})
    lines = {**cells, ("uniform",): {**cells[("uniform",)], "loss": [1.0]}}
    with pytest.raises(InputError, match="loss has 1 values, expected 11"):
        grid_dataset(axes, lines, serving_depths=SERVING, attrs={})
    mixed = {**cells, ("uniform",): {**cells[("uniform",)], "recall_bits": None}}
    with pytest.raises(InputError, match="recall_bits is None in some cells"):
        grid_dataset(axes, mixed, serving_depths=SERVING, attrs={})
    typo = {**cells, ("uniform",): {**cells[("uniform",)], "wall": 1.0}}
    with pytest.raises(InputError, match="unknown key 'wall'"):
        grid_dataset(axes, typo, serving_depths=SERVING, attrs={})


def test_without_recall_the_variable_is_omitted():
    ds = grid(recall=False)
    assert "recall_bits" not in ds


def test_round_trip_through_write_dataset(tmp_path):
    ds = grid(budgets=[0.15, 1.0])
    path = tmp_path / "grid.h5"
    write_dataset(ds, path)
    back = open_grid(path)
    xr.testing.assert_identical(back, ds)
    assert isinstance(back.attrs["recall_ceiling_bits"], float)


def test_dotted_axis_names_round_trip(tmp_path):
    axes = {"optim.lr": [0.001, 0.003], "seed": [0]}
    cells = {(lr, 0): cell("uniform", 0, recall=False) for lr in axes["optim.lr"]}
    ds = grid_dataset(axes, cells, serving_depths=SERVING, attrs={})
    write_dataset(ds, tmp_path / "lr.h5")
    xr.testing.assert_identical(open_grid(tmp_path / "lr.h5"), ds)


def test_open_grid_refuses_other_files(tmp_path):
    path = tmp_path / "other.h5"
    write_dataset(xr.Dataset({"x": ("a", [1.0])}, attrs={"kind": "monitor"}), path)
    with pytest.raises(InputError, match=f"{path}: not a grid file"):
        open_grid(path)
    with pytest.raises(InputError, match="no such file"):
        open_grid(tmp_path / "absent.h5")


# --- statistics ---------------------------------------------------------------------------------


def test_seed_band_t95_and_range_by_hand():
    ds = grid()
    values = ds["nll"].sel(serving_depth=3)
    t95 = seed_band(values)
    rng = seed_band(values, band="range")
    for label in SCHEDULES:
        seeds = values.sel(schedule=label).values
        mean, sd = seeds.mean(), seeds.std(ddof=1)
        half = scipy.stats.t.ppf(0.975, df=2) * sd / math.sqrt(3)
        row = t95.sel(schedule=label)
        assert float(row["mean"]) == pytest.approx(mean)
        assert float(row["lower"]) == pytest.approx(mean - half)
        assert float(row["upper"]) == pytest.approx(mean + half)
        assert int(row["n"]) == 3
        assert float(rng.sel(schedule=label)["lower"]) == seeds.min()
        assert float(rng.sel(schedule=label)["upper"]) == seeds.max()
    assert t95["mean"].attrs["units"] == "nats" and rng.attrs["band"] == "range"


def test_seed_band_without_seeds_has_no_bounds():
    band = seed_band(grid(seeds=(0,))["nll"].isel(seed=0), band="range")
    assert (band["n"] == 1).all() and band["lower"].isnull().all() and band["upper"].isnull().all()


def test_terminal_loss_by_hand():
    ds = grid()
    # W = round(0.1 * 100) = 10: steps 90..99. The line at 87 (steps 80..87) lies outside,
    # the line at 93 (steps 88..93) has 4 of its 6 updates inside, the line at 99 all 6.
    loss = terminal_loss(ds, fraction=0.1)
    lines = ds["loss"].sel(schedule="ff80", seed=1)
    expected = (4 * lines.sel(log_step=93).item() + 6 * lines.sel(log_step=99).item()) / 10
    assert loss.sel(schedule="ff80", seed=1).item() == pytest.approx(expected)
    assert loss.dims == ("schedule", "seed")
    # W = 6: exactly the last line.
    assert terminal_loss(ds, fraction=0.06).sel(schedule="ff80", seed=1).item() == pytest.approx(
        lines.sel(log_step=99).item()
    )
    assert terminal_window(4800) == 200 and terminal_window(10) == 1


def test_mean_serving_nll():
    ds = grid()
    expected = ds["nll"].sel(schedule="ff67", seed=2, serving_depth=range(1, 17)).values.mean()
    assert mean_serving_nll(ds).sel(schedule="ff67", seed=2).item() == pytest.approx(expected)
    with pytest.raises(InputError, match="serving depth 64"):
        mean_serving_nll(ds, serving=[1, 64])


def test_table3_by_hand():
    ds = grid()
    rows = {row["schedule"]: row for row in table3(ds, terminal_fraction=0.1)}
    ff80, uniform = rows["ff80"], rows["uniform"]
    # Wall time: ff80 55 + seed, uniform 100 + seed.
    reductions = [1 - (55 + s) / (100 + s) for s in range(3)]
    assert ff80["wall_reduction_mean"] == pytest.approx(np.mean(reductions))
    assert ff80["wall_reduction_sd"] == pytest.approx(np.std(reductions, ddof=1))
    assert ff80["flops_ratio_mean"] == pytest.approx(5.0 / 8.0) and ff80["flops_ratio_sd"] == pytest.approx(0.0)
    assert uniform["wall_reduction_mean"] is None and uniform["flops_ratio_mean"] == pytest.approx(1.0)
    terminal = terminal_loss(ds, fraction=0.1).sel(schedule="ff80").values
    assert ff80["terminal_nll_mean"] == pytest.approx(terminal.mean())
    assert ff80["terminal_nll_sd"] == pytest.approx(terminal.std(ddof=1))
    serving = [2.0 + 0.1 * 2 + 0.01 * s + 0.001 * np.mean(SERVING) for s in range(3)]
    assert ff80["serving_nll_mean"] == pytest.approx(np.mean(serving))
    assert ff80["serving_nll_sd"] == pytest.approx(0.01)
    assert ff80["n_seeds"] == 3 and ff80["updates"] == 100 and ff80["terminal_window"] == 10
    assert list(rows) == list(SCHEDULES)


def test_table3_one_seed_and_other_axes():
    rows = table3(grid(seeds=(0,)), rows=["ff67", "uniform"])
    assert [row["schedule"] for row in rows] == ["ff67", "uniform"]
    assert rows[0]["terminal_nll_sd"] is None and rows[0]["n_seeds"] == 1
    with pytest.raises(InputError, match="axis 'budget' has 2 values"):
        table3(grid(budgets=[0.15, 1.0]))
    assert len(table3(grid(budgets=[0.15, 1.0]).sel(budget=[1.0]))) == len(SCHEDULES)
    with pytest.raises(InputError, match="reference schedule 'nope'"):
        table3(grid(), reference="nope")


def test_format_table3():
    text = format_table3(table3(grid()))
    lines = text.splitlines()
    assert lines[0] == (
        "| schedule | updates | terminal NLL | mean serving NLL (1-16) | modeled FLOPs | wall-clock reduction |"
    )
    assert "| ff80 | 100 |" in text and "62.5%" in text and "| 100.0% | – |" in text
    assert " ± 0.01000 |" in text
    assert lines[-1].startswith(
        "Mean ± SD (ddof 1) over 3 seeds; terminal NLL: mean training loss over the final 4 of 100"
    )


def test_normalised_recall_peaks_at_one():
    peaks = normalised_recall(grid()).max("serving_depth")
    np.testing.assert_array_equal(peaks.values, 1.0)


# --- figures ------------------------------------------------------------------------------------


def test_figure1_one_panel_per_budget():
    ds = grid(schedules=("fixed4", "ff80", "uniform"), budgets=[0.15, 0.45, 1.0])
    fig = figure1(ds)
    assert isinstance(fig, Figure) and len(fig.axes) == 3
    for ax, percent in zip(fig.axes, ("15%", "45%", "100%")):
        # One mean line per schedule and the dashed ceiling.
        assert len(ax.lines) == 3 + 1
        assert ax.get_title() == f"{percent} of the FLOP budget"
        assert ax.get_xscale() == "log"
        band = seed_band(ds["recall_bits"].sel(budget=float(percent[:-1]) / 100, schedule="ff80"))
        np.testing.assert_allclose(ax.lines[1].get_ydata(), band["mean"].values)
    assert "mean and 95% CI (Student-t) over 3 seeds" in fig.get_suptitle()
    assert len(figure1(ds, schedules=["uniform"]).axes[0].lines) == 2


def test_figure1_refuses_a_grid_without_budget_or_recall():
    with pytest.raises(InputError, match="figure 1 needs a grid axis 'budget'"):
        figure1(grid())
    with pytest.raises(InputError, match="figure 1 needs the variable 'recall_bits'"):
        figure1(grid(budgets=[1.0], recall=False))
    with pytest.raises(InputError, match="schedule 'nope' is not in the grid"):
        figure1(grid(budgets=[1.0]), schedules=["nope"])


def test_figure5_curves_peak_at_one():
    fig = figure5(grid(), schedules=["fixed4", "ff80", "uniform"])
    (ax,) = fig.axes
    curves = [line for line in ax.lines if line.get_label() in ("fixed4", "ff80", "uniform")]
    assert len(curves) == 3
    for line in curves:
        assert np.max(line.get_ydata()) == 1.0
    # Training depths: fixed4 and ff80 at 4 (uniform has none): two dotted lines at x = 4.
    dotted = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert [line.get_xdata()[0] for line in dotted] == [4, 4]
    assert "divided by its own peak" in ax.get_title() and "3 seeds" in ax.get_title()


def test_figure8_full_and_zoom():
    fig = figure8(grid())
    left, right = fig.axes
    assert len(left.lines) == len(right.lines) == len(SCHEDULES)
    assert right.get_xlim() == (4, 16)
    assert "range (min-max) across 3 seeds" in fig.get_suptitle()


def test_figure3_loss_marks_the_switches():
    fig = figure3_loss(grid(), terminal_fraction=0.1)
    left, right = fig.axes
    # Five loss curves and a dotted switch for each of the three fixed-first schedules.
    switched = [line for line in left.lines if line.get_linestyle() == ":"]
    assert len(left.lines) == 5 + 3 and sorted(line.get_xdata()[0] for line in switched) == [67, 67, 80]
    assert right.get_xlim() == (90, 99)
    assert "range (min-max) across 3 seeds" in fig.get_suptitle()


def test_figure2_rows_by_finishing_family():
    fig = figure2(grid())
    # Rows: uniform (ff67, ff80), pln (pln67), fixed (fixed4); the reference star in every row.
    assert len(fig.axes) == 6
    (uniform_left, uniform_right, pln_left, pln_right, fixed_left, fixed_right) = fig.axes
    assert len(uniform_left.lines) == 3 and len(pln_left.lines) == 2 and len(fixed_left.lines) == 2
    # Right: the 67% schedule's difference and the zero line; none in the fixed row.
    assert len(uniform_right.lines) == 2 and len(pln_right.lines) == 2 and len(fixed_right.lines) == 1
    difference = uniform_right.lines[0]
    assert difference.get_label() == "ff67"
    # ff67 minus uniform: 0.1 * (1 - 4) at every depth and seed.
    np.testing.assert_allclose(difference.get_ydata(), -0.3)
    filled = {bars.get_label(): bars.lines[0].get_markerfacecolor() for bars in uniform_left.containers}
    assert filled["ff80 (K0=4, switch 80%)"] == "none" and filled["ff67 (K0=4, switch 67%)"] != "none"
    assert "positive = worse than uniform" in uniform_right.get_title()


def test_grid_figures_render(tmp_path):
    from analysis.figures import save_figure

    ds = grid(budgets=[0.15, 1.0])
    save_figure(figure1(ds), tmp_path / "figure1.png", dpi=40)
    single = ds.sel(budget=[1.0])
    for name, make in (("figure2", figure2), ("figure3", figure3_loss), ("figure5", figure5), ("figure8", figure8)):
        save_figure(make(single), tmp_path / f"{name}.png", dpi=40)
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_paired_comparison_by_hand():
    from analysis.grid import format_comparison, paired_comparison

    ds = grid(schedules=("ff80", "uniform", "ff67"), seeds=(0, 1, 2))
    # Make the seeds differ in the paired difference: ff80 - uniform = -0.2 + (0.00, 0.03, 0.09).
    ds["nll"].loc[{"schedule": "ff80"}] = ds["nll"].sel(schedule="ff80") + xr.DataArray(
        [0.0, 0.03, 0.09], dims="seed", coords={"seed": [0, 1, 2]}
    )
    comparison = paired_comparison(ds, schedule="ff80", serving=range(1, 17))
    differences = np.array([-0.2, -0.17, -0.11])  # ff80 (offset 2) - uniform (offset 4), by seed
    half = scipy.stats.t.ppf(0.975, 2) * differences.std(ddof=1) / math.sqrt(3)
    at_depth = comparison.sel(other="uniform", serving_depth=5)
    assert at_depth["difference"].item() == pytest.approx(differences.mean())
    assert at_depth["lower"].item() == pytest.approx(differences.mean() - half)
    assert at_depth["upper"].item() == pytest.approx(differences.mean() + half)
    assert comparison["depth_mean"].sel(other="uniform").item() == pytest.approx(differences.mean())
    # ff67 (offset 1) vs ff80: ff80 - ff67 = 0.1 + the seed shifts.
    assert comparison["depth_mean"].sel(other="ff67").item() == pytest.approx(0.1 + 0.04)
    assert comparison["flops_ratio"].sel(schedule="uniform").item() == pytest.approx(8.0 / 5.0)
    text = format_comparison(comparison)
    assert "ff80 − uniform" in text and "over 3 seeds" in text and "uniform 160.0%" in text
    assert f"[{differences.mean() - half:+.4f}, {differences.mean() + half:+.4f}]" in text
