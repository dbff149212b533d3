"""diag/arithmetic/sharded.py: the update diagnostic on an FSDP2-sharded model at 2 gloo ranks equals the
unsharded diagnostic of the same weights, optimizer state and batch within 1e-6, for every
isolation, RMS matching, clipping and a masked evaluation set whose chunks do not split evenly
over the ranks; the sharded weights and optimizer state come back bit for bit."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from click.testing import CliRunner
from helpers import free_port, run_depthdiag, write_run
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from depthdiag.cli import main
from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic
from trainer.config import OptimConfig
from trainer.loss import training_loss
from trainer.model import LoopedTransformer, ModelConfig
from trainer.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 61, 12
MODEL = dict(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_heads=2, n_prelude=1, n_core=1, n_coda=1)
OPTIM = dict(lr=1e-2, weight_decay=0.1)
OPTIONS = [
    dict(update_depths=(2, 5), serving_depths=(1, 3, 6)),
    dict(update_depths=(1, 3, 6), serving_depths=(2, 4), rms_match="per-tensor", grad_clip=0.05),
    dict(update_depths=(2, 4), serving_depths=(1, 4), isolate="linear", eval_batch_size=2),
    dict(update_depths=(2, 4), serving_depths=(3,), isolate="none", rms_match="geomean", precision="bf16"),
]


def tokens(rows, seed):
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A model after 4 AdamW updates, its evaluation set (5 rows, some targets masked), a batch."""
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(**MODEL))
    with torch.no_grad():
        model.adapter.weight.normal_(0, 0.3)  # the identity initialisation would make every depth alike
    optimizer = build_optimizer(model, OptimConfig(**OPTIM))
    for step in range(4):
        training_loss(model, tokens(4, 100 + step), 2 + step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    eval_tokens = tokens(5, 1)
    eval_mask = torch.rand(5, SEQ, generator=torch.Generator().manual_seed(2)) > 0.3
    path = tmp_path_factory.mktemp("case") / "case.pt"
    torch.save(
        {
            "model_config": MODEL,
            "optim_config": OPTIM,
            "model_state": model.state_dict(),
            "optimizer_state": get_optimizer_state_dict(
                model, optimizer, options=StateDictOptions(full_state_dict=True)
            ),
            "eval_tokens": eval_tokens,
            "eval_mask": eval_mask,
            # Rows the updates trained on: isolate='linear' refuses tokens whose embedding rows have v = 0.
            "batch": torch.cat([tokens(4, 100), tokens(4, 101)])[:6],
            "options": OPTIONS,
        },
        path,
    )
    return path, model, optimizer, eval_tokens, eval_mask


def sharded_units(case_path: Path, out: Path) -> dict:
    result = run_depthdiag(case_path, out, ranks=2, script=REPO / "tests" / "sharded_worker.py")
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out, weights_only=False)


def test_sharded_diagnostic_equals_the_unsharded_one_within_1e_6(case, tmp_path):
    case_path, model, optimizer, eval_tokens, eval_mask = case
    sharded = sharded_units(case_path, tmp_path / "units.pt")
    assert sharded["unchanged"] == [True, True]
    batch = torch.load(case_path, weights_only=True)["batch"]
    for options, unit in zip(OPTIONS, sharded["units"]):
        expected = UpdateDiagnostic(model, optimizer, eval_tokens, DiagnosticOptions(**options), eval_mask).compare(
            batch
        )
        assert set(unit["data_vars"]) == set(expected.data_vars)
        for name, variable in unit["data_vars"].items():
            got, want = np.asarray(variable["data"], dtype=np.float64), expected[name].values
            # bf16 gradients round differently when the batch is split over the ranks
            tolerance = 2e-3 if options.get("precision") == "bf16" else 1e-6
            np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance, err_msg=f"{options}: {name}")
        assert unit["attrs"] == expected.attrs
        assert not math.isnan(unit["data_vars"]["update_cosine"]["data"])


def results(path: Path) -> xr.Dataset:
    with xr.open_dataset(path, engine="h5netcdf") as ds:
        return ds.load()


def test_sharded_diagnose_at_two_ranks_writes_the_one_process_file_within_1e_6(tmp_path):
    """`torchrun ... diagnose --sharded`: every unit on both ranks, the model sharded over them;
    the results equal one process's within 1e-6, and its manifest records the sharding."""
    run = write_run(tmp_path / "run")
    snapshots = [run[2], run[4]]
    args = ["--batches", "2", "--update-depths", "2,5", "--serving", "1-3", "--no-progress"]
    single, sharded = tmp_path / "single.h5", tmp_path / "sharded.h5"
    result = CliRunner().invoke(main, ["diagnose", *map(str, snapshots), *args, "--out", str(single)])
    assert result.exit_code == 0, result.output
    result = run_depthdiag("diagnose", *snapshots, *args, "--out", sharded, "--sharded", ranks=2)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"wrote {sharded}"]
    one, two = results(single), results(sharded)
    assert set(one.data_vars) == set(two.data_vars)
    for name in one.data_vars:
        np.testing.assert_allclose(two[name].values, one[name].values, rtol=1e-6, atol=1e-6, err_msg=name)
    settings = json.loads(two.attrs["diagnose_manifest"])["settings"]
    assert (
        settings["sharded_over"] == 2 and "sharded_over" not in json.loads(one.attrs["diagnose_manifest"])["settings"]
    )


def test_sharded_without_torchrun_is_one_line(tmp_path):
    run = write_run(tmp_path / "run")
    args = ["diagnose", str(run[2]), "--out", str(tmp_path / "r.h5"), "--sharded", "--no-progress"]
    result = CliRunner().invoke(main, args, prog_name="depthdiag")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--sharded shards the model over torchrun's ranks" in result.stderr


def test_what_the_sharded_diagnostic_refuses_is_one_line(monkeypatch):
    """Outside a process group; a model whose root is not sharded; an optimizer torch's kernels
    do not step (it would be deep-copied whole, not stepped shard by shard)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from common.errors import InputError
    from diag.arithmetic.sharded import ShardedUpdateDiagnostic

    model = LoopedTransformer(ModelConfig(**MODEL))
    with pytest.raises(InputError, match="runs under torchrun"):
        ShardedUpdateDiagnostic(model, torch.optim.SGD(model.parameters(), lr=0.1), tokens(2, 0))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        fully_shard(model.core[0])
        with pytest.raises(InputError, match="root sharded too"):
            ShardedUpdateDiagnostic(model, torch.optim.SGD(model.parameters(), lr=0.1), tokens(2, 0))
        fully_shard(model)
        with pytest.raises(InputError, match="not Adagrad"):
            ShardedUpdateDiagnostic(model, torch.optim.Adagrad(model.parameters()), tokens(2, 0))
    finally:
        dist.destroy_process_group()
