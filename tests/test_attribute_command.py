"""`depthdiag attribute` (diag/driver/run.py with attribution units, analysis/attribution.py):
the results file holds every unit's attribution, equal to `diag.attribute_benefit` on the same
snapshot and batch; the pool is the run's own stream right after the diagnosed batches; the
batch rows sum to linear_benefit; summarize lists the top and bottom sequences decoded; the
usual output rules and one-line errors hold."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import xarray as xr
from click.testing import CliRunner
from helpers import BATCH, run_config, write_run

import diag
from depthdiag.cli import main
from trainer.checkpoint import load_snapshot
from trainer.data.sources import build_source

POOL = 5
ARGS = ["--batches", "2", "--update-depths", "2,5", "--serving", "1-3", "--no-progress"]


@pytest.fixture(scope="module")
def sgd_run(tmp_path_factory):
    """A short bioS run trained with SGD (isolate='linear' refuses Adam states younger than every
    token's first gradient; SGD's step is linear everywhere)."""
    config = run_config()
    return write_run(tmp_path_factory.mktemp("run"), replace(config, optim=replace(config.optim, name="sgd")))


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_attribute_writes_each_units_attribution_as_the_api_computes_it(sgd_run, tmp_path):
    out = tmp_path / "a.h5"
    code, stdout, stderr = run_cli("attribute", sgd_run[2], sgd_run[4], *ARGS, "--pool", POOL, "--out", out)
    assert (code, stdout.strip()) == (0, f"wrote {out}"), stderr
    with xr.open_dataset(out, engine="h5netcdf") as ds:
        ds = ds.load()
    assert dict(ds["attribution"].sizes) == {"snapshot": 2, "batch": 2, "example": BATCH + POOL, "serving_depth": 3}
    assert ds.attrs["isolate"] == "linear" and json.loads(ds.attrs["diagnose_manifest"])["settings"]["pool"] == POOL
    assert ds["in_batch"].values.tolist() == [True] * BATCH + [False] * POOL
    in_batch = ds["attribution"].where(ds["in_batch"]).sum("example")
    np.testing.assert_allclose(
        in_batch, ds["linear_benefit"], rtol=1e-6, atol=1e-6 * float(abs(ds["linear_benefit"]).max())
    )

    snap = load_snapshot(sgd_run[4])
    model = snap.model("cpu")
    optimizer = snap.optimizer(model)
    source = build_source(snap.config.data)
    pool = np.concatenate(
        [source.batch(snap.config.train.seed, snap.step + 2 + i, BATCH, snap.config.train.seq_len) for i in range(2)]
    )[:POOL]
    unit = ds.sel(snapshot="snap-u02", batch=1)
    np.testing.assert_array_equal(unit["example_tokens"].values[BATCH:], pool)  # the stream after the batches
    eval_tokens, eval_mask = source.attribute_eval(snap.config.data.eval_sequences, snap.config.train.seq_len)
    expected = diag.attribute_benefit(
        model,
        optimizer,
        snap.batches[1],
        eval_tokens,
        update_depths=(2, 5),
        serving_depths=(1, 2, 3),
        grad_clip=snap.config.optim.grad_clip,
        eval_mask=eval_mask,
        lr=float(snap.lr),
        pool=torch.from_numpy(unit["example_tokens"].values[BATCH:].astype(np.int64)),
    )
    np.testing.assert_allclose(unit["attribution"].values, expected["attribution"].values, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(unit["benefit"].values, expected["benefit"].values, rtol=1e-6, atol=1e-9)

    assert all({"long_name", "units"} <= set(ds[name].attrs) for name in ds.variables)
    # How far the first order reaches: the unit's benefit under diagnose's default isolation beside it.
    code, _, stderr = run_cli("diagnose", sgd_run[2], sgd_run[4], *ARGS, "--out", tmp_path / "d.h5")
    assert code == 0, stderr
    with xr.open_dataset(tmp_path / "d.h5", engine="h5netcdf") as default:
        np.testing.assert_array_equal(ds["benefit_counterfactual"].values, default["benefit"].values)

    code, stdout, stderr = run_cli("summarize", out)
    assert code == 0, stderr
    listed = stdout[stdout.index("sequences that push the deep update ahead") :]
    assert "snap-u02, serving depth 3:" in listed and "bottom 2" in listed and "[SEP] N" in listed
    code, stdout, _ = run_cli("summarize", out, "--json")
    extremes = json.loads(stdout)["attribution_extremes"]
    assert len(extremes) == 2 * 3 * 4
    top = max(
        (float(v), b, e)
        for b, row in enumerate(ds.sel(snapshot="snap-u00")["attribution"].sel(serving_depth=1).values)
        for e, v in enumerate(row)
    )
    assert extremes[0]["rank"] == "top 1" and extremes[0]["attribution"] == pytest.approx(top[0])
    assert (extremes[0]["batch"], extremes[0]["example"]) == top[1:]

    code, _, stderr = run_cli("attribute", sgd_run[2], *ARGS, "--out", out)
    assert code == 2 and "--force" in stderr  # an existing results file is not overwritten


def test_what_attribute_refuses_is_one_line(sgd_run, tmp_path):
    code, _, stderr = run_cli("attribute", sgd_run[2], *ARGS, "--update-depths", "1,2,4", "--out", tmp_path / "a.h5")
    assert code == 2 and "two update depths" in stderr and len(stderr.strip().splitlines()) == 1
    code, _, stderr = run_cli("attribute", sgd_run[2], *ARGS, "--isolate", "none", "--out", tmp_path / "a.h5")
    assert code == 2 and "No such option '--isolate'" in stderr
    adam_run = write_run(tmp_path / "adam")  # 2 updates of Adam: most embedding rows have no second moment yet
    code, _, stderr = run_cli("attribute", adam_run[2], *ARGS, "--out", tmp_path / "b.h5")
    error = stderr.strip().splitlines()[-1]  # after the warning that this Adam state is young
    assert code == 2 and error.startswith(f"depthdiag: error: {adam_run[2]}, batch 0: isolate='linear': Adam's second")
    assert error.endswith("attribute a later snapshot, where every value the sequences reach has been updated")
    assert not (tmp_path / "b.h5").exists()


def test_summarize_renders_sequences_as_the_run_tokenized_them(tmp_path):
    from depthdiag.cli.results import _token_decoder

    bios = run_config()
    text = replace(
        bios, data=replace(bios.data, source="text", path="corpus.txt"), model=replace(bios.model, vocab_size=256)
    )
    assert _token_decoder(text.to_json(), tmp_path / "a.h5")([104, 105, 10]) == "'hi\\n'"  # UTF-8 bytes
    assert _token_decoder(bios.to_json(), tmp_path / "a.h5")([0, 5]) == "[SEP] [major]"
    assert _token_decoder(None, tmp_path / "a.h5")([3, 4]) == "3 4"  # no run config: the ids


def test_the_removal_check_reruns_the_diagnostic_without_each_quarter(sgd_run, tmp_path):
    out = tmp_path / "r.h5"
    code, stdout, stderr = run_cli("attribute", sgd_run[4], *ARGS, "--removal-depth", 3, "--out", out)
    assert code == 0, stderr
    with xr.open_dataset(out, engine="h5netcdf") as ds:
        ds = ds.load()
    assert ds.attrs["removal_depth"] == 3 and ds["removal"].values.tolist() == ["top", "bottom", "random"]
    assert all({"long_name", "units"} <= set(ds[name].attrs) for name in ds.variables)
    snap = load_snapshot(sgd_run[4])
    source = build_source(snap.config.data)
    eval_tokens, eval_mask = source.attribute_eval(snap.config.data.eval_sequences, snap.config.train.seq_len)
    quarter = round(BATCH / 4)
    for b in range(2):
        unit = ds.sel(snapshot="snap-u02", batch=b)
        scores = unit["attribution"].sel(serving_depth=3).values[:BATCH]
        removed = unit["removed_rows"].values
        assert sorted(removed[0]) == sorted(np.argsort(scores)[-quarter:].tolist())  # the highest
        assert sorted(removed[1]) == sorted(np.argsort(scores)[:quarter].tolist())  # the lowest
        assert len(set(removed[2])) == quarter
        for r, rows in enumerate(removed):
            model = snap.model("cpu")
            kept = snap.batches[b][np.setdiff1d(np.arange(BATCH), rows)]
            expected = diag.compare_updates(
                model,
                snap.optimizer(model),
                kept,
                eval_tokens,
                update_depths=(2, 5),
                serving_depths=(1, 2, 3),
                grad_clip=snap.config.optim.grad_clip,
                eval_mask=eval_mask,
                lr=float(snap.lr),
            )
            np.testing.assert_allclose(
                unit["removal_benefit"].isel(removal=r).values, expected["benefit"].values, rtol=1e-6, atol=1e-9
            )
    code, stdout, stderr = run_cli("summarize", out)
    assert code == 0, stderr
    assert "removal check at serving depth 3" in stdout and "random - top" in stdout
    top = ds["removal_benefit"].sel(removal="top", serving_depth=3)
    random = ds["removal_benefit"].sel(removal="random", serving_depth=3)
    code, stdout, stderr = run_cli("summarize", out, "--json")
    check = json.loads(stdout)["removal_check"][0]
    assert check["random_minus_top"]["mean"] == pytest.approx(float((random - top).isel(snapshot=0).mean()))
    assert check["n"] == 2 and check["unit"] == "batch"
    reach = {(r["snapshot"], r["serving_depth"]): r for r in json.loads(stdout)["first_order"]}
    linear = float(ds["linear_benefit"].sel(snapshot="snap-u02", serving_depth=2).mean())
    default = float(ds["benefit_counterfactual"].sel(snapshot="snap-u02", serving_depth=2).mean())
    assert reach["snap-u02", 2]["ratio_counterfactual"] == pytest.approx(linear / default)

    # Several seeds: the interval over the seeds' means over batches.
    from analysis.attribution import removal_intervals
    from analysis.stats import t_interval

    shifted = ds.assign(removal_benefit=ds["removal_benefit"] + 1e-3 * ds["removal_benefit"].sum("removal"))
    seeds = xr.concat([ds, shifted.assign_coords(seed=4)], dim="seed")
    intervals = removal_intervals(seeds).sel(snapshot="snap-u02")
    per_seed = (seeds["removal_benefit"].sel(removal="random") - seeds["removal_benefit"].sel(removal="top")).sel(
        snapshot="snap-u02", serving_depth=3
    )
    mean, lower, upper, n = t_interval(per_seed.mean("batch").values)
    assert (int(intervals["n"]), float(intervals["random_minus_top_lower"])) == (n, pytest.approx(lower))
    assert float(intervals["random_minus_top_upper"]) == pytest.approx(upper)
    code, _, stderr = run_cli("attribute", sgd_run[4], *ARGS, "--removal-depth", 4, "--out", tmp_path / "x.h5")
    assert code == 2 and "--removal-depth 4" in stderr


def test_planted_runs_get_the_aurocs_of_their_attributions(sgd_run, tmp_path):
    """A run with planted sequences: summarize and plot --figure planted rank its batch rows'
    attributions against the rows that hold a planted answer, which the labels find in the tokens."""
    from analysis.attribution import auroc

    config = run_config()
    length = 2 * build_source(config.data).spec.bio_length - 1  # rows of two whole slots
    config = replace(
        config,
        model=replace(config.model, max_seq_len=length),
        optim=replace(config.optim, name="sgd"),
        train=replace(config.train, seq_len=length),
        data=replace(config.data, planted_fraction=0.2),
    )
    run = write_run(tmp_path / "run", config)
    out = tmp_path / "p.h5"
    code, _, stderr = run_cli("attribute", run[2], *ARGS, "--out", out)
    assert code == 0, stderr
    code, stdout, stderr = run_cli("summarize", out)
    assert code == 0 and "attribution ranking planted sequences above the rest" in stdout, stderr
    with xr.open_dataset(out, engine="h5netcdf") as ds:
        ds = ds.load()
    source = build_source(config.data)
    tokens = ds["example_tokens"].sel(snapshot="snap-u00").values  # [batch, example, token]
    # A row is planted when a [hops h] token stands two before one of its targets.
    labels = np.array([[any(source.chain_token < t < source.vocab_size for t in r[:-2]) for r in b] for b in tokens])
    assert 0 < labels.sum() < labels.size
    scores = ds["attribution"].sel(snapshot="snap-u00", serving_depth=3).values
    code, stdout, _ = run_cli("summarize", out, "--json")
    rows = {(r["snapshot"], r["serving_depth"]): r for r in json.loads(stdout)["planted_auroc"]}
    assert rows["snap-u00", 3]["auroc"] == pytest.approx(auroc(scores.ravel(), labels.ravel()))
    assert rows["snap-u00", 3]["positives"] == labels.sum() and 0 <= rows["snap-u00", 3]["shuffled"] <= 1
    code, _, stderr = run_cli("plot", out, "--figure", "planted", "--out", tmp_path / "p.png")
    assert code == 0 and (tmp_path / "p.png").is_file(), stderr
    code, _, stderr = run_cli("attribute", sgd_run[2], *ARGS, "--out", tmp_path / "plain.h5")
    code, _, stderr = run_cli("plot", tmp_path / "plain.h5", "--figure", "planted", "--out", tmp_path / "q.png")
    assert code == 2 and "data.planted_fraction" in stderr
