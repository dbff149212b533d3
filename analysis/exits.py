"""Exit criteria against the oracle, and the overthinking ledger: arithmetic on the per-token
table of every depth 1..S (trainer/exits.py records it; `depthdiag exits` writes the results).

Arrays are [S, N]: depth s = 1..S along the first axis (index s - 1), one counted evaluation
target per column. A served depth is 1-based.

Mean NLLs are written as the mean NLL at S exactly as `depthdiag eval` computes it, plus the
mean over tokens of (NLL at the served depth - NLL at S), in float64: a criterion that never
fires then reproduces `eval` at S to the bit, and every other point is the same mean up to
float rounding.
"""

from __future__ import annotations

import os

import numpy as np
import xarray as xr

from analysis.stats import t_interval
from analysis.store import file_attribute, open_checked
from common.errors import InputError


def exit_depths(statistic: np.ndarray, threshold: float, fires_below: bool) -> np.ndarray:
    """The depth each token is served at, int64 [N]: the first s where the statistic [S, N]
    crosses `threshold` (below it, or above it when not `fires_below`; NaN never crosses),
    S where it never does."""
    with np.errstate(invalid="ignore"):
        fires = statistic < threshold if fires_below else statistic > threshold
    fires[-1] = True  # at S every token stops
    return fires.argmax(axis=0).astype(np.int64) + 1


def served(values: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """values [S, N] at each token's served depth (1-based) [N]."""
    return values[depths - 1, np.arange(values.shape[1])]


def served_mean_nll(nll: np.ndarray, mean_nll_at_max: float, depths: np.ndarray) -> float:
    """The mean NLL when each token is served at `depths` [N] (see the module docstring)."""
    difference = served(nll, depths).astype(np.float64) - nll[-1].astype(np.float64)
    return float(mean_nll_at_max + difference.mean())


def sweep(
    nll: np.ndarray,
    correct: np.ndarray,
    mean_nll_at_max: float,
    statistic: np.ndarray,
    thresholds,
    fires_below: bool,
) -> dict[str, np.ndarray]:
    """One criterion at each threshold: mean served depth, mean NLL and top-1 accuracy at the
    served depth, float64 [len(thresholds)] each."""
    result = {name: np.empty(len(thresholds)) for name in ("depth", "nll", "accuracy")}
    for i, threshold in enumerate(thresholds):
        depths = exit_depths(statistic, float(threshold), fires_below)
        result["depth"][i] = depths.mean()
        result["nll"][i] = served_mean_nll(nll, mean_nll_at_max, depths)
        result["accuracy"][i] = served(correct, depths).mean()
    return result


def oracle_depths(nll: np.ndarray, epsilon: float) -> np.ndarray:
    """Per token, the smallest depth whose NLL is within `epsilon` of its lowest NLL over the
    depths, int64 [N]."""
    return (nll <= nll.min(axis=0) + epsilon).argmax(axis=0).astype(np.int64) + 1


def oracle(nll: np.ndarray, correct: np.ndarray, mean_nll_at_max: float, epsilons) -> dict[str, np.ndarray]:
    """The oracle at each epsilon: mean depth, mean NLL, top-1 accuracy, float64 [len(epsilons)]."""
    result = {name: np.empty(len(epsilons)) for name in ("depth", "nll", "accuracy")}
    for i, epsilon in enumerate(epsilons):
        depths = oracle_depths(nll, float(epsilon))
        result["depth"][i] = depths.mean()
        result["nll"][i] = served_mean_nll(nll, mean_nll_at_max, depths)
        result["accuracy"][i] = served(correct, depths).mean()
    return result


def lower_frontier(nll: np.ndarray, mean_nll_at_max: float) -> tuple[np.ndarray, np.ndarray]:
    """(mean depth, mean NLL) at the vertices of the lowest mean NLL any per-token choice of
    depths reaches at a mean depth of at most D, a convex, non-increasing, piecewise linear
    function of D from 1 to S.

    Exact: the lower bound is the linear relaxation of choosing one depth per token, whose
    optimum at every budget is the sum of the tokens' own lower convex hulls over (s, NLL at s);
    taking their falling segments steepest first traces it. Every per-token exit rule, the
    oracle's at each epsilon included, lies on or above it."""
    S, N = nll.shape
    values = nll.astype(np.float64)
    tokens = np.arange(N)
    at = np.zeros(N, dtype=np.int64)  # each token's current hull vertex (depth index)
    ahead = np.arange(S)[:, None]  # [S, 1]
    slopes, steps, drops = [], [], []
    while True:
        # every token at once: the next hull vertex is the later depth with the steepest fall
        with np.errstate(divide="ignore", invalid="ignore"):
            gains = (values - values[at, tokens]) / (ahead - at)  # [S, N]
        gains[ahead <= at] = np.inf
        best = gains.argmin(axis=0)
        falling = gains[best, tokens] < 0
        if not falling.any():
            break
        step = best[falling] - at[falling]
        slopes.append(gains[best, tokens][falling])
        steps.append(step)
        drops.append(gains[best, tokens][falling] * step)
        at[falling] = best[falling]
    slopes = np.concatenate(slopes) if slopes else np.zeros(0)
    steps = np.concatenate(steps) if steps else np.zeros(0, dtype=np.int64)
    drops = np.concatenate(drops) if drops else np.zeros(0)
    order = np.argsort(np.asarray(slopes), kind="stable")
    depth = 1.0 + np.concatenate(([0.0], np.cumsum(np.asarray(steps, dtype=np.float64)[order]) / N))
    start = mean_nll_at_max + (values[0] - values[-1]).mean()
    mean = start + np.concatenate(([0.0], np.cumsum(np.asarray(drops)[order]) / N))
    return depth, mean


def frontier_at(frontier: tuple[np.ndarray, np.ndarray], depth) -> np.ndarray:
    """The frontier's mean NLL at mean depth(s) `depth` (flat beyond its last vertex)."""
    depths, nlls = frontier
    return np.interp(depth, depths, nlls)


def ledger(correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(wrong -> right, right -> wrong) token counts at each step s -> s + 1, int64 [S - 1] each."""
    before, after = correct[:-1], correct[1:]
    return (~before & after).sum(axis=1), (before & ~after).sum(axis=1)


def best_depth(nll: np.ndarray) -> np.ndarray:
    """Each token's best depth (the smallest with its lowest NLL), int64 [N]."""
    return oracle_depths(nll, 0.0)


def ledger_by_group(correct: np.ndarray, nll: np.ndarray, groups: np.ndarray, n_groups: int) -> dict[str, np.ndarray]:
    """The ledger per group of `groups` int64 [N] (-1: none): wrong -> right and right -> wrong
    counts [S - 1, n_groups], the group's targets [n_groups] and how many of them have their
    best depth below S [n_groups]."""
    S = correct.shape[0]
    member = groups >= 0
    ids = groups[member]
    before, after = correct[:-1, member], correct[1:, member]
    per_step = np.zeros((2, S - 1, n_groups), dtype=np.int64)
    for step in range(S - 1):
        per_step[0, step] = np.bincount(ids[~before[step] & after[step]], minlength=n_groups)
        per_step[1, step] = np.bincount(ids[before[step] & ~after[step]], minlength=n_groups)
    below = best_depth(nll[:, member]) < S
    return {
        "wrong_to_right": per_step[0],
        "right_to_wrong": per_step[1],
        "targets": np.bincount(ids, minlength=n_groups),
        "best_below_max": np.bincount(ids[below], minlength=n_groups),
    }


# --- reading a results file ------------------------------------------------------------------

KIND = "exits"
"""The `kind` attribute of a `depthdiag exits` results file."""


def is_exits(ds: xr.Dataset) -> bool:
    """Whether `ds` is a results file of `depthdiag exits`."""
    return ds.attrs.get("kind") == KIND


def _interval_text(values: np.ndarray, digits: int) -> str:
    mean, lower, upper, n = t_interval(values)
    if n < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{lower:.{digits}f}, {upper:.{digits}f}]"


def swept(ds: xr.Dataset):
    """(criterion, the file at that criterion and threshold) for every threshold swept; NaN
    thresholds pad a criterion given fewer than another and are skipped."""
    for criterion in ds["criterion"].values:
        for i in ds["threshold_index"].values:
            at = ds.sel(criterion=criterion, threshold_index=i)
            if np.isfinite(float(at["threshold"])):
                yield str(criterion), at


def frontier_rows(ds: xr.Dataset) -> list[dict]:
    """One row per fixed depth, oracle epsilon and criterion threshold: mean depth, FLOPs per
    token, mean NLL, top-1 accuracy and the NLL above the lower frontier at that depth, each
    with its values over the file's runs (seeds)."""
    rows = []

    def add(kind: str, setting: str, depth, nll, accuracy, gap):
        rows.append(
            {
                "kind": kind,
                "setting": setting,
                "depth": np.asarray(depth, dtype=np.float64),
                "flops_per_token": _flops(ds, np.asarray(depth, dtype=np.float64)),
                "nll": np.asarray(nll, dtype=np.float64),
                "accuracy": np.asarray(accuracy, dtype=np.float64),
                "gap": np.asarray(gap, dtype=np.float64),
            }
        )

    for s in ds["serving_depth"].values:
        at = ds.sel(serving_depth=s)
        add(
            "fixed",
            f"s={int(s)}",
            np.full(ds.sizes["run"], float(s)),
            at["fixed_nll"],
            at["fixed_accuracy"],
            at["fixed_gap"],
        )
    for epsilon in ds["epsilon"].values:
        at = ds.sel(epsilon=epsilon)
        add("oracle", f"eps={epsilon:g}", at["oracle_depth"], at["oracle_nll"], at["oracle_accuracy"], at["oracle_gap"])
    for criterion, at in swept(ds):
        tau = f"tau={float(at['threshold']):.3g}"
        add(criterion, tau, at["exit_depth"], at["exit_nll"], at["exit_accuracy"], at["exit_gap"])
    return rows


def _flops(ds: xr.Dataset, depth: np.ndarray) -> np.ndarray:
    """Modeled forward FLOPs per token at mean depth(s) `depth` (fixed + depth x per iteration),
    NaN where the file has no FLOPs model (a model from elsewhere: read the depth as core iterations)."""
    if "flops_fixed" not in ds.attrs:
        return np.full(depth.shape, np.nan)
    return ds.attrs["flops_fixed"] + depth * ds.attrs["flops_per_iteration"]


def format_frontier(ds: xr.Dataset) -> str:
    """The frontier table `depthdiag summarize` prints for an exits file."""
    runs = ds.sizes["run"]
    over = f"mean over {runs} run(s)" + (", 95% t interval over runs (seeds)" if runs > 1 else "")
    targets, deepest = int(ds.attrs["targets"]), ds.sizes["serving_depth"]
    header = ("criterion", "setting", "mean depth", "GFLOPs/token", "NLL", "top-1", "gap")
    lines = [
        f"Exit criteria on {targets} evaluation targets per run, depths 1..{deepest} ({over}). "
        "gap: NLL above the lowest any per-token choice of depths reaches at that mean depth.",
        "{:<10} {:<14} {:>26} {:>12} {:>26} {:>8} {:>8}".format(*header),
    ]
    for row in frontier_rows(ds):
        flops = np.nanmean(row["flops_per_token"]) if np.isfinite(row["flops_per_token"]).any() else np.nan
        lines.append(
            f"{row['kind']:<10} {row['setting']:<14} {_interval_text(row['depth'], 2):>26} "
            f"{flops / 1e9:>12.4f} {_interval_text(row['nll'], 4):>26} {np.mean(row['accuracy']):>8.4f} "
            f"{np.mean(row['gap']):>8.4f}"
        )
    lines.append("")
    lines.append(format_ledger(ds))
    if "real_exit_nll" in ds:
        lines.append("")
        lines.append(format_real_exits(ds))
    return "\n".join(lines)


def format_ledger(ds: xr.Dataset) -> str:
    """The overthinking ledger: per step s -> s+1, tokens turning wrong -> right and right -> wrong."""
    targets = ds["targets"].values.astype(np.float64)  # [run]
    lines = [
        "Overthinking ledger (top-1 at s -> s+1, fraction of targets, mean over runs):",
        f"{'step':>7} {'wrong->right':>13} {'right->wrong':>13}",
    ]
    for step in ds["step"].values:
        at = ds.sel(step=step)
        gain = (at["wrong_to_right"].values / targets).mean()
        loss = (at["right_to_wrong"].values / targets).mean()
        lines.append(f"{int(step):>3}->{int(step) + 1:<3} {gain:>13.4f} {loss:>13.4f}")
    below = _interval_text(ds["best_below_max"].values / targets, 4)
    lines.append(f"targets whose best depth is below {ds.sizes['serving_depth']}: {below}")
    for name in ds.attrs.get("groupings", "").split():
        lines.append(f"by {name}: right->wrong over all steps / targets; best depth below the deepest / targets")
        for group in ds[name].values:
            at = ds.sel({name: group})
            group_targets = at[f"targets_by_{name}"].values.astype(np.float64)
            with np.errstate(invalid="ignore", divide="ignore"):
                flips = (at[f"right_to_wrong_by_{name}"].sum("step").values / group_targets).mean()
                best = (at[f"best_below_max_by_{name}"].values / group_targets).mean()
            lines.append(
                f"  {str(group):<14} {flips:>8.4f} {best:>8.4f}  ({int(group_targets.mean())} targets per run)"
            )
    return "\n".join(lines)


def format_real_exits(ds: xr.Dataset) -> str:
    """The real-exit forward's NLL beside the one-pass simulation's, per criterion and threshold."""
    lines = [
        "Real exit (stopped tokens frozen, later iterations attend to them) against the one-pass simulation "
        "(mean over runs):",
        f"{'criterion':<10} {'threshold':>10} {'depth sim':>10} {'depth real':>10} {'NLL sim':>9} {'NLL real':>9}",
    ]
    for criterion, at in swept(ds):
        lines.append(
            f"{criterion:<10} {float(at['threshold']):>10.3g} {float(at['exit_depth'].mean()):>10.2f} "
            f"{float(at['real_exit_depth'].mean()):>10.2f} {float(at['exit_nll'].mean()):>9.4f} "
            f"{float(at['real_exit_nll'].mean()):>9.4f}"
        )
    return "\n".join(lines)


def is_exits_file(path: str | os.PathLike) -> bool:
    """Whether `path` is an HDF5 file marked as a `depthdiag exits` file (False for anything
    else); `open_exits` checks the rest."""
    return file_attribute(path, "kind") == KIND


REQUIRED = {
    "fixed_nll": ("run", "serving_depth"),
    "exit_nll": ("run", "criterion", "threshold_index"),
    "exit_depth": ("run", "criterion", "threshold_index"),
    "oracle_nll": ("run", "epsilon"),
    "frontier_nll": ("run", "frontier_depth"),
    "right_to_wrong": ("run", "step"),
}


def validate_exits(ds: xr.Dataset, source) -> None:
    """Raise InputError("SOURCE: problem") unless `ds` is a `depthdiag exits` file."""
    if not is_exits(ds):
        raise InputError(f"{source}: not a depthdiag exits file (no kind = {KIND!r} attribute)")
    for name, dims in REQUIRED.items():
        if name not in ds.data_vars or ds[name].dims != dims:
            raise InputError(f"{source}: no variable {name!r} over {dims}")


def open_exits(path: str | os.PathLike) -> xr.Dataset:
    """A `depthdiag exits` file, loaded into memory and validated."""
    return open_checked(path, "depthdiag exits file", validate_exits)


def mean_over_runs(ds: xr.Dataset) -> xr.Dataset:
    """The curves `plot --figure exits` draws: each point's mean over the file's runs (seeds),
    with the modeled GFLOPs per token of each mean depth where the file has a FLOPs model."""
    numeric = [name for name in ds.data_vars if "run" in ds[name].dims and ds[name].dtype.kind in "fiub"]
    means = ds[numeric].mean("run")
    for name, depth in (
        ("fixed", means["serving_depth"].astype(float)),
        ("exit", means["exit_depth"]),
        ("oracle", means["oracle_depth"]),
        ("frontier", means["frontier_depth"]),
    ):
        means[f"{name}_gflops"] = depth.copy(data=_flops(ds, np.asarray(depth, dtype=np.float64)) / 1e9)
    means.attrs = {**ds.attrs, "runs": ds.sizes["run"]}
    return means
