"""The same experiment on several machines or kernel sets, side by side (pure numpy/scipy/xarray).

bf16 kernels differ by CPU, and a training run amplifies their rounding: one seed's results
move with the kernel set about as much as from seed to seed. Given the per-seed results files
of one experiment computed on several machines (their `machine` and `trained_on` records,
trainer/machine.py, tell them apart), `machine_comparison` sets the machines' headline
numbers side by side, measures the machine-to-machine spread of one seed beside the seed
spread, pools every machine into one seed-level interval, and says for each snapshot how
likely a fresh run of n seeds on an unknown machine is to reach each verdict ("the interval
excludes zero", "the benefit is shown below 5% of the switch benefit"): the number of seeds a
conclusion needs before it travels.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from os import PathLike

import numpy as np
import scipy.stats
import xarray as xr

from analysis.finishing import equivalence_bounds
from analysis.stats import IntervalOptions, depth_averaged_benefit, depth_averaged_per_batch, format_bounds, t_interval
from analysis.store import combine_seeds, machines_by_seed, open_results
from common.errors import InputError
from common.provenance import describe_machine, describe_machines

SEED_COUNTS = (5, 10, 20)
"""The seed counts whose verdict probabilities the comparison shows."""
MOST_SEEDS = 200
"""The largest seed count `seeds_needed` searches."""


def _upper_tail(n: int, shift: float, critical: float) -> float:
    """P(T > critical) for the t statistic T of a mean over `n` units whose true mean is `shift`
    standard errors from zero (noncentral t, n - 1 degrees of freedom). A lower tail P(T < -c) is
    the upper tail of the opposite shift: scipy's noncentral cdf returns NaN far out in the lower
    tail (a switch benefit 3 SD from zero at 10 seeds), its sf never did over 1 to 199 degrees of
    freedom and shifts within +-200."""
    return float(scipy.stats.nct(df=n - 1, nc=shift).sf(critical))


def excludes_zero_probability(mean: float, sd: float, n: int, level: float = 0.95) -> float:
    """The probability that a Student-t interval over `n` independent units of mean `mean` and
    standard deviation `sd` excludes zero: P(|T| > t_crit), T noncentral t with n - 1 degrees of
    freedom and noncentrality mean * sqrt(n) / sd."""
    if n < 2 or not sd > 0:
        return math.nan
    critical = scipy.stats.t.ppf(0.5 + level / 2, df=n - 1)
    shift = mean * math.sqrt(n) / sd
    return _upper_tail(n, shift, critical) + _upper_tail(n, -shift, critical)


def below_bound_probability(mean: float, sd: float, n: int, level: float = 0.95) -> float:
    """The probability that the one-sided `level` upper bound of a mean over `n` units of mean
    `mean` and standard deviation `sd` lies below zero (the equivalence bound of
    analysis.finishing, on margins b(N) - fraction * b(0)): P(T < -t_crit), the upper tail of
    the opposite noncentrality."""
    if n < 2 or not sd > 0:
        return math.nan
    critical = scipy.stats.t.ppf(level, df=n - 1)
    return _upper_tail(n, -mean * math.sqrt(n) / sd, critical)


def seeds_needed(probability, *, target: float = 0.9) -> int | None:
    """The fewest seeds n >= 2 (up to MOST_SEEDS) at which `probability(n)` reaches `target`;
    None when none does."""
    return next((n for n in range(2, MOST_SEEDS + 1) if probability(n) >= target), None)


@dataclasses.dataclass(frozen=True)
class MachineGroup:
    """The files of one machine (the same trained_on and diagnosing records)."""

    label: str
    """'machine 1', 'machine 2', ... in the order the files came."""
    trained_on: list
    """The machine records that trained its snapshots."""
    diagnosed_on: dict
    """The machine record that diagnosed them."""
    files: list[str]
    """Its results files, one per seed."""
    seeds: list[int]
    """Their seeds."""


@dataclasses.dataclass(frozen=True)
class MachineComparison:
    """`machine_comparison`'s result; every interval is over seeds (per-seed means of batch means)."""

    groups: list[MachineGroup]
    """The machines."""
    fraction: float
    """The fraction of the switch benefit the equivalence verdict is about."""
    level: float
    """The confidence level."""
    rows: list[dict]
    """Per snapshot: uniform_updates, and per machine (`machines`, in group order) mean, lower,
    upper, n, excludes_zero and shown_below; the seed SD within machines (`seed_sd`, pooled over
    those with two seeds or more), the machine SD of one seed (`machine_sd`, pooled over seeds run
    on several machines, with `paired_seeds`), the pooled interval over seeds each averaged over
    its machines (`pooled`), and the verdict probabilities of a fresh run on an unknown machine
    (`excludes_zero_probability` and `shown_below_probability`, by seed count, with
    `seeds_needed_*` for 90%)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _group_files(paths: Sequence[str | PathLike]) -> list[MachineGroup]:
    groups: dict[str, dict] = {}
    for path in paths:
        ((seed, diagnosed, trained),) = machines_by_seed(open_results([path]))
        if not diagnosed and not trained:
            raise InputError(f"{path}: records no machine (written before depthdiag recorded it); diagnose it again")
        key = json.dumps([trained, diagnosed], sort_keys=True)
        group = groups.setdefault(key, {"trained_on": trained, "diagnosed_on": diagnosed, "files": [], "seeds": []})
        group["files"].append(str(path))
        group["seeds"].append(seed)
    if len(groups) < 2:
        raise InputError(
            f"{paths[0]}: every file was computed on the same machine and kernels; "
            "give the files of at least two (e.g. a run under ONEDNN_MAX_CPU_ISA, docs/results.md)"
        )
    return [MachineGroup(label=f"machine {i}", **group) for i, group in enumerate(groups.values(), start=1)]


def _seed_means(ds: xr.Dataset) -> xr.DataArray:
    """Each seed's depth-averaged benefit over (seed, snapshot), sorted by uniform updates."""
    return depth_averaged_per_batch(ds).mean("batch", skipna=True).sortby("uniform_updates")


def machine_comparison(
    paths: Sequence[str | PathLike], *, fraction: float = 0.05, options: IntervalOptions = IntervalOptions()
) -> MachineComparison:
    """Compare the per-seed results files `paths` of one experiment computed on two or more
    machines (see the module docstring). The files of each machine combine as seeds
    (analysis.store.combine_seeds: they must differ in the seed only); the machines must share
    the snapshot grid."""
    groups = _group_files(paths)
    datasets = [combine_seeds([open_results([p]) for p in group.files], group.files) for group in groups]
    counts = [int(u) for u in datasets[0]["uniform_updates"].sortby(datasets[0]["uniform_updates"]).values]
    for group, ds in zip(groups[1:], datasets[1:]):
        if sorted(int(u) for u in ds["uniform_updates"].values) != counts:
            raise InputError(f"{group.files[0]}: its snapshots' uniform updates differ from {groups[0].files[0]}'s")
    if 0 not in counts:
        raise InputError(f"{paths[0]}: no snapshot at the switch (0 uniform updates) to compare against")
    means = [_seed_means(ds) for ds in datasets]  # per machine [seed, snapshot]
    headline = [depth_averaged_benefit(ds, options=options).sortby("uniform_updates") for ds in datasets]
    bounds = [equivalence_bounds(ds, fraction=fraction, options=options).sortby("uniform_updates") for ds in datasets]
    by_seed: dict[int, list[np.ndarray]] = {}
    for values in means:
        for seed in values["seed"].values:
            by_seed.setdefault(int(seed), []).append(values.sel(seed=seed).values)
    # Every (seed, machine) run, each a replicate a stranger's one run on some machine would be.
    replicates = np.array([curve for curves in by_seed.values() for curve in curves])  # [runs, snapshots]
    margins = replicates - fraction * replicates[:, :1]
    seed_level = np.array([np.mean(curves, axis=0) for curves in by_seed.values()])  # each seed over its machines
    paired = [np.array(curves) for curves in by_seed.values() if len(curves) >= 2]
    rows = []
    for index, count in enumerate(counts):
        machines = []
        for intervals, bound in zip(headline, bounds):
            row = intervals.isel(snapshot=index)
            lower, upper = float(row["lower"]), float(row["upper"])
            below = bool(bound["below"].values[index]) if count else None
            machines.append(
                {
                    "mean": float(row["mean"]),
                    "lower": lower,
                    "upper": upper,
                    "n": int(row["n"]),
                    "excludes_zero": bool(lower > 0 or upper < 0),
                    "shown_below": below,
                }
            )
        within = [values.isel(snapshot=index).values for values in means]
        finite = [v[np.isfinite(v)] for v in within]
        spreads = [np.var(v, ddof=1) for v in finite if v.size >= 2]
        seed_sd = math.sqrt(np.mean(spreads)) if spreads else math.nan
        machine_sd = math.sqrt(np.mean([np.var(p[:, index], ddof=1) for p in paired])) if paired else math.nan
        mean, lower, upper, n = t_interval(seed_level[:, index], options.level)
        total_mean, total_sd = float(np.mean(replicates[:, index])), float(np.std(replicates[:, index], ddof=1))
        margin_mean, margin_sd = float(np.mean(margins[:, index])), float(np.std(margins[:, index], ddof=1))

        def excludes(n, m=total_mean, s=total_sd):
            return excludes_zero_probability(m, s, n, options.level)

        def shown_below(n, m=margin_mean, s=margin_sd):
            return below_bound_probability(m, s, n, options.level)

        rows.append(
            {
                "uniform_updates": count,
                "machines": machines,
                "seed_sd": seed_sd,
                "machine_sd": machine_sd,
                "paired_seeds": len(paired),
                "pooled": {"mean": mean, "lower": lower, "upper": upper, "n": n},
                "run_sd": total_sd,
                "excludes_zero_probability": {str(k): excludes(k) for k in SEED_COUNTS},
                "seeds_needed_excludes_zero": seeds_needed(excludes),
                "shown_below_probability": {str(k): shown_below(k) for k in SEED_COUNTS} if count else None,
                "seeds_needed_shown_below": seeds_needed(shown_below) if count else None,
            }
        )
    return MachineComparison(groups=groups, fraction=fraction, level=options.level, rows=rows)


def _needed(value: int | None) -> str:
    return f"> {MOST_SEEDS}" if value is None else str(value)


def format_machine_comparison(comparison: MachineComparison) -> str:
    """The comparison as Markdown: the machines, the side-by-side table, the spreads and the pooled
    interval, then how many seeds each verdict needs to travel."""
    level = f"{comparison.level:.0%}"
    fraction = f"{comparison.fraction:.0%}"
    lines = ["Machines (what trained each file's snapshots; what diagnosed them):", ""]
    for group in comparison.groups:
        seeds = " ".join(str(s) for s in group.seeds)
        lines.append(
            f"- **{group.label}** (seeds {seeds}): trained on {describe_machines(group.trained_on)}; "
            f"diagnosed on {describe_machine(group.diagnosed_on)}"
        )
    labels = [group.label for group in comparison.groups]
    lines += [
        "",
        f"Depth-averaged benefit per snapshot, {level} Student-t CI over each machine's seeds; "
        f"seed SD = the spread of seed means within a machine (pooled), machine SD = the spread of one "
        f"seed's mean across machines (pooled over the seeds run on several); pooled = over seeds, each "
        f"the mean of its machines. Verdicts: 0 = the CI excludes zero, < {fraction} = the benefit is shown "
        f"below {fraction} of the switch benefit (one-sided {level} bound, paired by seed).",
        "",
        "| uniform updates | "
        + " | ".join(labels)
        + " | verdicts (0 / < "
        + fraction
        + ") | seed SD | machine SD | pooled |",
        "|---:|" + "---|" * len(labels) + "---|---:|---:|---|",
    ]
    for row in comparison.rows:
        cells = [f"{m['mean']:+.4f} {format_bounds(m['lower'], m['upper'])}" for m in row["machines"]]
        verdicts = " ; ".join(
            ("yes" if m["excludes_zero"] else "no") + " / " + {True: "yes", False: "no", None: "-"}[m["shown_below"]]
            for m in row["machines"]
        )
        pooled = row["pooled"]
        lines.append(
            f"| {row['uniform_updates']} | "
            + " | ".join(cells)
            + f" | {verdicts} | {row['seed_sd']:.4f} | {row['machine_sd']:.4f} | "
            f"{pooled['mean']:+.4f} {format_bounds(pooled['lower'], pooled['upper'])} ({pooled['n']} seeds) |"
        )
    counts = " / ".join(str(k) for k in SEED_COUNTS)
    lines += [
        "",
        "How likely a fresh run of n seeds on any of these machines is to reach each verdict, from the "
        "mean and SD of every (seed, machine) run (noncentral t), and the seeds a verdict needs to come "
        "out the same way 90% of the time:",
        "",
        f"| uniform updates | run SD | P(CI excludes 0), n = {counts} | seeds for 90% | "
        f"P(shown < {fraction}), n = {counts} | seeds for 90% |",
        "|---:|---:|---|---:|---|---:|",
    ]
    for row in comparison.rows:
        excludes = " / ".join(f"{p:.2f}" for p in row["excludes_zero_probability"].values())
        below = row["shown_below_probability"]
        below_text = " / ".join(f"{p:.2f}" for p in below.values()) if below is not None else "-"
        below_needed = _needed(row["seeds_needed_shown_below"]) if below is not None else "-"
        lines.append(
            f"| {row['uniform_updates']} | {row['run_sd']:.4f} | {excludes} | "
            f"{_needed(row['seeds_needed_excludes_zero'])} | {below_text} | {below_needed} |"
        )
    return "\n".join(lines)
