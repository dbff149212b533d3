"""The sequences a results file of `depthdiag attribute` ranks highest and lowest.

attribution(snapshot, batch, example, serving_depth) says how much each training sequence
pushes the deep update ahead (positive) or holds it back (negative) at each serving depth, to
first order (docs/diagnostic.md). Each unit scores its own batch's rows, then the pool's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import xarray as xr

from common.errors import InputError


def extreme_sequences(ds: xr.Dataset, k: int = 2) -> list[dict]:
    """Per snapshot and serving depth, the `k` highest and `k` lowest attributions over all of
    the snapshot's units: a row each with the batch, example, whether it is a batch row, the
    attribution, the sequence's token ids, and its rank ('top 1', ..., 'bottom 1')."""
    rows = []
    for snapshot in ds["snapshot"].values:
        here = ds.sel(snapshot=snapshot)
        values = here["attribution"].transpose("batch", "example", "serving_depth").values  # [B, N, S]
        for s, depth in enumerate(here["serving_depth"].values):
            flat = values[:, :, s].ravel()
            finite = np.flatnonzero(np.isfinite(flat))
            order = finite[np.argsort(flat[finite], kind="stable")]
            picks = [(f"top {r + 1}", i) for r, i in enumerate(order[::-1][:k])]
            picks += [(f"bottom {r + 1}", i) for r, i in enumerate(order[:k])]
            for rank, index in picks:
                batch, example = np.unravel_index(index, values.shape[:2])
                rows.append(
                    {
                        "snapshot": str(snapshot),
                        "serving_depth": int(depth),
                        "rank": rank,
                        "batch": int(here["batch"].values[batch]),
                        "example": int(here["example"].values[example]),
                        "in_batch": bool(here["in_batch"].values[example]),
                        "pool_row": int(example - here["in_batch"].values.sum()),
                        "attribution": float(flat[index]),
                        "tokens": [int(t) for t in here["example_tokens"].values[batch, example]],
                    }
                )
    return rows


def extremes_text(rows: Sequence[dict], decode: Callable[[Sequence[int]], str], width: int = 90) -> str:
    """The printed list: per snapshot and serving depth, each ranked sequence decoded."""
    lines = ["sequences that push the deep update ahead (top) or hold it back (bottom), to first order:"]
    heading = None
    for row in rows:
        if (row["snapshot"], row["serving_depth"]) != heading:
            heading = (row["snapshot"], row["serving_depth"])
            lines.append(f"{row['snapshot']}, serving depth {row['serving_depth']}:")
        where = f"batch {row['batch']} row {row['example']}"
        if not row["in_batch"]:  # the pool is scored against every batch's update
            where = f"pool {row['pool_row']} (batch {row['batch']})"
        text = decode(row["tokens"])
        text = text if len(text) <= width else text[: width - 3] + "..."
        lines.append(f"  {row['rank']:<8} {row['attribution']:+.3e}  {where:<18} {text}")
    return "\n".join(lines)


REMOVAL_CONTRASTS = {
    "random_minus_top": ("random", "top"),
    "bottom_minus_random": ("bottom", "random"),
    "full_minus_top": (None, "top"),
    "bottom_minus_full": ("bottom", None),
}
"""The removal check's paired differences at the removal depth, each expected positive when
the attribution ranks the sequences the diagnostic itself responds to: removing the quarter
ranked highest lowers the benefit more than removing a random quarter, removing the lowest
quarter raises it (None: the whole batch, benefit_counterfactual)."""


def removal_differences(ds: xr.Dataset) -> xr.Dataset:
    """Per unit, at the serving depth the removal check ranked by (`attribute --removal-depth`):
    the benefit of the whole batch and with each quarter removed (`full`, `top`, `bottom`,
    `random`) and the paired differences of REMOVAL_CONTRASTS."""
    if "removal_benefit" not in ds:
        raise InputError("the results hold no removal check (depthdiag attribute --removal-depth S)")
    depth = int(ds.attrs["removal_depth"])
    removed = ds["removal_benefit"].sel(serving_depth=depth, drop=True)
    values = {"full": ds["benefit_counterfactual"].sel(serving_depth=depth, drop=True)}
    values.update({str(r): removed.sel(removal=r, drop=True) for r in ds["removal"].values})
    for name, (minuend, subtrahend) in REMOVAL_CONTRASTS.items():
        values[name] = values[minuend or "full"] - values[subtrahend or "full"]
    result = xr.Dataset(values)
    result.attrs["removal_depth"] = depth
    return result


def removal_intervals(ds: xr.Dataset, *, options=None, seed_dim: str = "seed") -> xr.Dataset:
    """Per snapshot, the mean of every `removal_differences` variable with its interval, over
    batches for one file and over per-seed means for several, as the headline's: variables
    NAME_mean, NAME_lower, NAME_upper, and n."""
    from analysis.stats import IntervalOptions, interval_over, replication_units

    options = options or IntervalOptions()
    differences = removal_differences(ds)
    columns = {}
    for name, values in differences.data_vars.items():
        units, unit_dim = replication_units(values, seed_dim=seed_dim)
        interval = interval_over(units, unit_dim, options=options)
        columns.update({f"{name}_{k}": interval[k] for k in ("mean", "lower", "upper")}, n=interval["n"])
    result = xr.Dataset(columns)
    result.attrs = {**differences.attrs, "unit": unit_dim, "level": options.level, "method": options.method}
    return result


def removal_rows(intervals: xr.Dataset) -> list[dict]:
    """One row per snapshot, for --json."""
    rows = []
    for snapshot in intervals["snapshot"].values:
        cell = intervals.sel(snapshot=snapshot)
        row = {"snapshot": str(snapshot), "serving_depth": intervals.attrs["removal_depth"], "n": int(cell["n"])}
        for name in _measured(intervals):
            row[name] = {k: _number(cell[f"{name}_{k}"]) for k in ("mean", "lower", "upper")}
        row["unit"] = intervals.attrs["unit"]
        rows.append(row)
    return rows


def removal_text(intervals: xr.Dataset) -> str:
    """The printed removal check: per snapshot, the benefit with each quarter removed and the
    paired differences with their intervals."""
    from analysis.stats import interval_coverage

    depth, unit = intervals.attrs["removal_depth"], intervals.attrs["unit"]
    n = int(intervals["n"].max()) if intervals["n"].size else 0
    lines = [
        f"removal check at serving depth {depth}: the benefit (default isolation) of the whole batch and with "
        f"the quarter ranked highest (top), lowest (bottom) or a random quarter removed; differences with their "
        f"{intervals.attrs['level']:.0%} interval ({interval_coverage(unit)}, n = {n}), each positive when the "
        "ranking holds"
    ]
    for snapshot in intervals["snapshot"].values:
        cell = intervals.sel(snapshot=snapshot)
        lines.append(
            f"{snapshot}: "
            + "  ".join(
                f"{name} {float(cell[f'{name}_mean']):+.5f}"
                for name in _measured(intervals)
                if name not in REMOVAL_CONTRASTS
            )
        )
        for name in REMOVAL_CONTRASTS:
            lower, upper = _number(cell[f"{name}_lower"]), _number(cell[f"{name}_upper"])
            bounds = "n/a" if lower is None or upper is None else f"[{lower:+.5f}, {upper:+.5f}]"
            label = name.replace("_minus_", " - ")
            lines.append(f"  {label:<15} {float(cell[f'{name}_mean']):+.5f}  {bounds}")
    return "\n".join(lines)


def _measured(intervals: xr.Dataset) -> list[str]:
    """The benefits and differences `removal_intervals` holds, in their order (full, the
    removals as recorded, the contrasts)."""
    return [str(name)[: -len("_mean")] for name in intervals.data_vars if str(name).endswith("_mean")]


def _number(value: xr.DataArray) -> float | None:
    number = float(value)
    return number if np.isfinite(number) else None


def first_order_reach(ds: xr.Dataset) -> xr.Dataset:
    """How far the attribution's first order reaches, per snapshot and serving depth, as means
    over every unit (batches, and seeds where several files are given): `linear_benefit` (what
    the attributions sum to), `benefit` (the same isolate-linear updates, second-order terms
    included) and `benefit_counterfactual` (the headline's isolation), and the ratios
    linear_benefit / benefit and linear_benefit / benefit_counterfactual of those means."""
    units = [dim for dim in ("seed", "batch") if dim in ds["linear_benefit"].dims]
    means = xr.Dataset(
        {name: ds[name].mean(units, skipna=True) for name in ("linear_benefit", "benefit", "benefit_counterfactual")}
    )
    return means.assign(
        ratio_linear=means["linear_benefit"] / means["benefit"],
        ratio_counterfactual=means["linear_benefit"] / means["benefit_counterfactual"],
    ).assign_attrs(units=int(np.prod([ds.sizes[d] for d in units])))


def first_order_text(reach: xr.Dataset) -> str:
    """The printed table: per snapshot, a row per serving depth."""
    lines = [
        f"first order: linear_benefit (the attributions' sum) against the unit's benefit under isolate linear "
        f"and under the default isolation, means over {reach.attrs['units']} units"
    ]
    for snapshot in reach["snapshot"].values:
        lines.append(f"{snapshot}\n  s   linear_benefit   benefit(linear)  ratio   benefit(default)  ratio")
        for depth in reach["serving_depth"].values:
            cell = reach.sel(snapshot=snapshot, serving_depth=depth)
            lines.append(
                f"  {int(depth):<3} {float(cell['linear_benefit']):+.4e}      {float(cell['benefit']):+.4e}  "
                f"{float(cell['ratio_linear']):5.2f}   {float(cell['benefit_counterfactual']):+.4e}   "
                f"{float(cell['ratio_counterfactual']):5.2f}"
            )
    return "\n".join(lines)


def first_order_rows(reach: xr.Dataset) -> list[dict]:
    """One row per (snapshot, serving depth), for --json."""
    return [
        {"snapshot": str(snapshot), "serving_depth": int(depth), "units": reach.attrs["units"]}
        | {name: _number(reach[name].sel(snapshot=snapshot, serving_depth=depth)) for name in reach.data_vars}
        for snapshot in reach["snapshot"].values
        for depth in reach["serving_depth"].values
    ]


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The area under the ROC curve of `scores` ranking the rows with `labels` True above the
    others: the probability that a labelled row outscores an unlabelled one, ties counted half
    (the Mann-Whitney U of the labelled rows over n_pos n_neg); NaN when either class is empty."""
    from scipy.stats import mannwhitneyu

    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    positives, negatives = scores[labels], scores[~labels]
    if not len(positives) or not len(negatives):
        return float("nan")
    return float(mannwhitneyu(positives, negatives).statistic) / (len(positives) * len(negatives))


def labelled_auroc(ds: xr.Dataset, labels: xr.DataArray, *, seed: int = 0) -> xr.Dataset:
    """How well the attributions find labelled sequences (a planted kind): per snapshot and
    serving depth (and seed, where `ds` has several), `auroc` of the batch rows' attributions
    over all of the snapshot's units against `labels` (bool, over the dims of `example_tokens`
    without `token`), and `shuffled`, the same against the labels permuted over the rows by a
    generator seeded with `seed` (the control: about 0.5). `positives`, `rows`: how many."""
    attribution = ds["attribution"].where(ds["in_batch"], drop=True)
    labels = labels.sel(example=attribution["example"]).astype(bool)
    outer = [dim for dim in ("seed", "snapshot") if dim in attribution.dims]
    attribution = attribution.transpose(*outer, "serving_depth", "batch", "example")
    labels = labels.transpose(*outer, "batch", "example")
    rng = np.random.default_rng(seed)
    shape = tuple(attribution.sizes[d] for d in outer)
    found = np.full((*shape, attribution.sizes["serving_depth"]), np.nan)
    shuffled, positives, rows = np.full_like(found, np.nan), np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    for index in np.ndindex(*shape):
        scores = attribution.values[index].reshape(attribution.sizes["serving_depth"], -1)  # [S, rows]
        truth = labels.values[index].ravel()
        kept = np.isfinite(scores).all(0)
        scores, truth = scores[:, kept], truth[kept]
        permuted = rng.permutation(truth)
        found[index] = [auroc(row, truth) for row in scores]
        shuffled[index] = [auroc(row, permuted) for row in scores]
        positives[index], rows[index] = int(truth.sum()), int(len(truth))
    coords = {d: attribution[d] for d in (*outer, "serving_depth")}
    return xr.Dataset(
        {
            "auroc": ((*outer, "serving_depth"), found),
            "shuffled": ((*outer, "serving_depth"), shuffled),
            "positives": (tuple(outer), positives),
            "rows": (tuple(outer), rows),
        },
        coords=coords,
    )


def auroc_text(found: xr.Dataset, *, options=None, what: str = "planted") -> str:
    """The printed AUROCs: per snapshot and serving depth, the mean over seeds with its interval
    (several seeds) or the one file's value, beside the shuffled-label control."""
    from analysis.stats import IntervalOptions, interval_over

    options = options or IntervalOptions()
    seeds = "seed" in found.dims
    lines = [
        f"attribution ranking {what} sequences above the rest (AUROC over each snapshot's batch rows; control: the "
        "labels shuffled)"
        + (f", mean over {found.sizes['seed']} seeds with its {options.level:.0%} interval over seeds" if seeds else "")
    ]
    for snapshot in found["snapshot"].values:
        cell = found.sel(snapshot=snapshot)
        rows, positives = int(cell["rows"].sum()), int(cell["positives"].sum())
        lines.append(f"{snapshot}: {positives} of {rows} rows {what}\n  s   AUROC                      shuffled")
        intervals = (
            {name: interval_over(cell[name], "seed", options=options) for name in ("auroc", "shuffled")}
            if seeds
            else {}
        )
        for depth in found["serving_depth"].values:
            columns = []
            for name in ("auroc", "shuffled"):
                if seeds:
                    at = intervals[name].sel(serving_depth=depth)
                    lower, upper = _number(at["lower"]), _number(at["upper"])
                    bounds = "n/a" if lower is None or upper is None else f"[{lower:.3f}, {upper:.3f}]"
                    columns.append(f"{float(at['mean']):.3f} {bounds:<16}")
                else:
                    columns.append(f"{float(cell[name].sel(serving_depth=depth)):.3f}{'':<17}")
            lines.append(f"  {int(depth):<3} " + "     ".join(columns))
    return "\n".join(lines)
