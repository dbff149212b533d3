"""Results files: schema validation, atomic compressed writes, opening and combining seeds."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import xarray as xr

from analysis.store import VARIABLE_DIMS, file_attribute, open_results, validate_results, write_dataset
from common.errors import InputError

UNIFORM_UPDATES = (0, 16, 64, 256)


def synthetic_results(seed: int = 0, n_batches: int = 3, serving_depths=range(1, 9), attrs=None) -> xr.Dataset:
    """A small results Dataset following the schema, with random numbers."""
    rng = np.random.default_rng(seed)
    n_snapshots, depths = len(UNIFORM_UPDATES), list(serving_depths)
    nll = rng.normal(3.0, 0.1, (n_snapshots, n_batches, 2, len(depths)))
    return xr.Dataset(
        {
            "nll": (VARIABLE_DIMS["nll"], nll),
            "nll_before": (VARIABLE_DIMS["nll_before"], rng.normal(3.0, 0.1, (n_snapshots, len(depths)))),
            "benefit": (VARIABLE_DIMS["benefit"], nll[:, :, 0] - nll[:, :, 1]),
            "update_rms": (VARIABLE_DIMS["update_rms"], rng.random((n_snapshots, n_batches, 2))),
            "rms_scale": (VARIABLE_DIMS["rms_scale"], rng.random((n_snapshots, n_batches, 2))),
            "update_cosine": (VARIABLE_DIMS["update_cosine"], rng.random((n_snapshots, n_batches))),
        },
        coords={
            "snapshot": [f"seed{seed}/uniform-{u:04d}" for u in UNIFORM_UPDATES],
            "uniform_updates": ("snapshot", list(UNIFORM_UPDATES)),
            "step": ("snapshot", [100 + u for u in UNIFORM_UPDATES]),
            "batch": np.arange(n_batches),
            "update_depth": [4, 16],
            "serving_depth": depths,
        },
        attrs={"seed": seed} if attrs is None else attrs,
    )


def test_round_trip_keeps_data_coords_and_attrs(tmp_path):
    ds = synthetic_results()
    ds.attrs = {"seed": 3, "isolate": "counterfactual", "lr": 2e-3, "bf16": True, "config": {"train": {"seed": 3}}}
    path = tmp_path / "results.h5"
    write_dataset(ds, path)
    back = open_results(path)

    for name in VARIABLE_DIMS:
        np.testing.assert_array_equal(back[name].values, ds[name].values)
        assert back[name].dims == ds[name].dims
    assert list(back["snapshot"].values) == list(ds["snapshot"].values)
    for coord in ("uniform_updates", "step", "batch", "update_depth", "serving_depth"):
        np.testing.assert_array_equal(back[coord].values, ds[coord].values)
    assert back["uniform_updates"].dims == ("snapshot",)
    assert back.attrs["seed"] == 3 and back.attrs["isolate"] == "counterfactual" and back.attrs["lr"] == 2e-3
    assert back.attrs["bf16"] == 1
    assert json.loads(back.attrs["config"]) == {"train": {"seed": 3}}
    # The caller's Dataset is not changed by the attribute conversion.
    assert ds.attrs["bf16"] is True


def test_numeric_variables_are_compressed(tmp_path):
    path = tmp_path / "results.h5"
    write_dataset(synthetic_results(), path)
    with h5py.File(path, "r") as handle:
        for name in VARIABLE_DIMS:
            assert handle[name].compression == "gzip", name
            assert handle[name].compression_opts == 4, name
            assert handle[name].shuffle, name


def test_unsupported_attribute_is_rejected_by_name(tmp_path):
    ds = synthetic_results()
    ds.attrs["started"] = object()
    with pytest.raises(TypeError, match="started"):
        write_dataset(ds, tmp_path / "results.h5")
    assert not list(tmp_path.iterdir())


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "results.h5"
    write_dataset(synthetic_results(seed=0), path)
    before = path.read_bytes()
    broken = synthetic_results(seed=1)
    broken["unwritable"] = ("batch", np.array([object(), object(), object()], dtype=object))
    with pytest.raises(ValueError):
        write_dataset(broken, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["results.h5"]


def test_missing_file_names_it(tmp_path):
    missing = tmp_path / "nope.h5"
    with pytest.raises(InputError, match="nope.h5: no such file"):
        open_results(missing)


def test_non_results_files_name_the_file(tmp_path):
    text = tmp_path / "notes.h5"
    text.write_text("not hdf5")
    with pytest.raises(InputError, match="notes.h5"):
        open_results(text)

    other = tmp_path / "other.h5"
    xr.Dataset({"loss": ("step", np.arange(3.0))}).to_netcdf(other, engine="h5netcdf")
    with pytest.raises(InputError, match=r"other.h5: not a results file \(no variable 'nll'\)"):
        open_results(other)


def test_a_files_text_attribute_is_read_without_opening_the_dataset(tmp_path):
    """What the kind checks of summarize and plot read: the attribute as written, and None for
    a missing file, a file that is not HDF5, a folder, a missing or non-text attribute."""
    path = tmp_path / "r.h5"
    write_dataset(xr.Dataset(attrs={"kind": "monitor", "steps": 3}), path)
    with h5py.File(tmp_path / "bytes.h5", "w") as file:
        file.attrs["kind"] = np.bytes_(b"exits")
    (tmp_path / "text.h5").write_text("kind = monitor\n")
    assert file_attribute(path, "kind") == "monitor" and file_attribute(tmp_path / "bytes.h5", "kind") == "exits"
    for where, name in ((path, "steps"), (path, "absent"), (tmp_path / "text.h5", "kind"), (tmp_path, "kind")):
        assert file_attribute(where, name) is None, (where, name)
    assert file_attribute(tmp_path / "absent.h5", "kind") is None


def test_validate_rejects_wrong_dims_and_missing_snapshot_coords():
    ds = synthetic_results()
    with pytest.raises(InputError, match="src: variable 'benefit'"):
        validate_results(ds.assign(benefit=ds["benefit"].isel(serving_depth=0)), "src")
    with pytest.raises(InputError, match="uniform_updates"):
        validate_results(ds.drop_vars("uniform_updates"), "src")
    validate_results(ds, "src")


def test_several_files_combine_along_seed(tmp_path):
    paths = []
    for seed in (7, 3):
        paths.append(tmp_path / f"seed{seed}.h5")
        write_dataset(synthetic_results(seed=seed), paths[-1])
    combined = open_results(paths)

    assert list(combined["seed"].values) == [7, 3]
    assert combined["benefit"].dims == ("seed", *VARIABLE_DIMS["benefit"])
    for seed, path in zip((7, 3), paths):
        single = open_results(path)
        np.testing.assert_array_equal(combined["nll"].sel(seed=seed).values, single["nll"].values)
    # Seeds are matched by uniform updates; labels come from the first file.
    assert list(combined["snapshot"].values) == [f"seed7/uniform-{u:04d}" for u in UNIFORM_UPDATES]
    assert combined["uniform_updates"].dims == ("snapshot",)
    assert "seed" not in combined.attrs  # differs between files


def test_seeds_default_to_positions(tmp_path):
    first, second = tmp_path / "a.h5", tmp_path / "b.h5"
    write_dataset(synthetic_results(seed=0, attrs={"tag": "x"}), first)
    write_dataset(synthetic_results(seed=1, attrs={"tag": "x"}), second)
    combined = open_results([first, second])
    assert list(combined["seed"].values) == [0, 1]
    assert combined.attrs == {"tag": "x"}


def run_config(seed: int, lr: float = 2e-3) -> str:
    return json.dumps({"model": {"d_model": 32}, "optim": {"lr": lr}, "train": {"seed": seed, "updates": 40}})


def diagnosed(seed: int, **changes) -> xr.Dataset:
    """A per-seed results file as `diagnose` writes it: run config, settings and provenance attributes."""
    attrs = {
        "config": run_config(seed),
        "isolate": "counterfactual",
        "rms_match": "reference",
        "lr_override": "none",
        "created": f"2026-01-0{seed + 1}T00:00:00+00:00",
        "snapshot_sha256": json.dumps({"uniform-0000": f"{seed:064d}"}),
    }
    return synthetic_results(seed=seed, attrs={**attrs, **changes})


def test_files_differing_only_in_seed_and_provenance_combine(tmp_path):
    paths = [tmp_path / f"seed{seed}.h5" for seed in (0, 1)]
    for seed, path in enumerate(paths):
        ds = diagnosed(seed)
        write_dataset(ds.assign_coords(lr=("snapshot", [1e-3, 1e-3, 1e-3, 5e-4 * (seed + 1)])), path)
    combined = open_results(paths)
    assert list(combined["seed"].values) == [0, 1]  # from the run config's train.seed
    assert combined.attrs["isolate"] == "counterfactual" and "created" not in combined.attrs
    # Each seed keeps the learning rates its snapshots were diagnosed at.
    assert combined["lr"].dims == ("seed", "snapshot")
    np.testing.assert_array_equal(combined["lr"].sel(seed=1).values, [1e-3, 1e-3, 1e-3, 1e-3])
    np.testing.assert_array_equal(combined["lr"].sel(seed=0).values, [1e-3, 1e-3, 1e-3, 5e-4])


def test_files_differing_only_in_keys_that_observe_the_run_combine(tmp_path):
    observed = json.loads(run_config(1))
    observed["train"].update(log_every=5, eval_every=20, eval_depths="1-4")
    observed["logging"] = {"tensorboard": True}
    base, other = tmp_path / "seed0.h5", tmp_path / "seed1.h5"
    write_dataset(diagnosed(0), base)
    write_dataset(diagnosed(1, config=json.dumps(observed)), other)
    assert list(open_results([base, other])["seed"].values) == [0, 1]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"config": run_config(1, lr=1e-3)}, r"run config key optim\.lr 0\.001 differs from .*seed0\.h5's 0\.002"),
        ({"isolate": "linear"}, r"isolate 'linear' differs from .*seed0\.h5's 'counterfactual'"),
        ({"rms_match": "geomean"}, "rms_match 'geomean' differs"),
        ({"lr_override": 1e-3}, "lr_override 0.001 differs"),
    ],
)
def test_files_differing_in_more_than_the_seed_are_refused(tmp_path, changes, message):
    base, other = tmp_path / "seed0.h5", tmp_path / "seed1.h5"
    write_dataset(diagnosed(0), base)
    write_dataset(diagnosed(1, **changes), other)
    with pytest.raises(InputError, match=f"^{re.escape(str(other))}: {message}.*only the seed may differ"):
        open_results([base, other])


def test_different_batch_counts_are_refused(tmp_path):
    first, second = tmp_path / "a.h5", tmp_path / "b.h5"
    write_dataset(synthetic_results(seed=0, n_batches=3), first)
    write_dataset(synthetic_results(seed=1, n_batches=2), second)
    expected = r"b.h5: batches per snapshot \[2, 2, 2, 2\] differ from .*a.h5's \[3, 3, 3, 3\]"
    with pytest.raises(InputError, match=expected):
        open_results([first, second])


def test_incompatible_or_duplicate_seeds_are_refused(tmp_path):
    base, shallow, twin = tmp_path / "base.h5", tmp_path / "shallow.h5", tmp_path / "twin.h5"
    write_dataset(synthetic_results(seed=0), base)
    write_dataset(synthetic_results(seed=1, serving_depths=range(1, 5)), shallow)
    write_dataset(synthetic_results(seed=0), twin)
    with pytest.raises(InputError, match="shallow.h5: coordinate 'serving_depth'"):
        open_results([base, shallow])
    with pytest.raises(InputError, match="twin.h5: has the same seed"):
        open_results([base, twin])
    with pytest.raises(InputError, match="missing.h5: no such file"):
        open_results([base, tmp_path / "missing.h5"])


def test_analysis_never_imports_torch():
    code = (
        "import sys, analysis, analysis.store, analysis.stats, analysis.figures, analysis.sensitivity; "
        "print('torch' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MPLBACKEND": "Agg"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env)
    assert out.stdout.strip() == "False"
