"""Exit criteria from one all-depth pass (trainer/exits.py, analysis/exits.py, depthdiag exits):
a criterion that never fires is `eval` at S to the bit; the oracle at epsilon 0 is the mean of
each token's lowest NLL; no per-token choice of depths lies below the lower frontier; the ledger
and the statistics equal recomputations from separate forwards at each depth; the real-exit
forward is the ordinary forward when every token stops at S, or at 1; a criterion of the user's
own through MODULE:NAME; the command's output and one-line errors."""

import itertools
import json
import re
import textwrap

import numpy as np
import pytest
import torch
import xarray as xr
from click.testing import CliRunner
from helpers import write_run

from analysis.exits import (
    exit_depths,
    frontier_at,
    ledger,
    lower_frontier,
    oracle,
    served_mean_nll,
    sweep,
)
from common.errors import InputError
from depthdiag.cli import main
from trainer.checkpoint import load_snapshot
from trainer.exits import CRITERIA, depth_table, real_exit_nll
from trainer.model import LoopedTransformer, ModelConfig
from trainer.scoring import mean_nll_by_depth

S = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def scored(run):
    snapshot = load_snapshot(run["checkpoint"])
    model = snapshot.model("cpu").eval()
    tokens = snapshot.eval_tokens
    table = depth_table(model, tokens, S, tuple(CRITERIA.values()), batch_size=3)
    return model, tokens, table


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


# --- the arithmetic ---------------------------------------------------------------------------


def test_exit_depth_is_the_first_crossing_and_s_where_none():
    statistic = np.array([[np.nan, np.nan, 5.0], [0.5, 2.0, 5.0], [0.1, 0.1, 0.1]])  # [S=3, N=3]
    assert exit_depths(statistic, 1.0, fires_below=True).tolist() == [2, 3, 3]
    assert exit_depths(statistic, 1.0, fires_below=False).tolist() == [3, 2, 1]
    assert exit_depths(statistic, 0.0, fires_below=True).tolist() == [3, 3, 3]


def test_the_oracle_at_epsilon_zero_is_the_mean_of_each_tokens_lowest_nll():
    rng = np.random.default_rng(0)
    nll = rng.gamma(2.0, 0.5, size=(8, 50)).astype(np.float32)
    correct = rng.random((8, 50)) < 0.5
    at_max = float(nll[-1].astype(np.float64).mean())
    best = oracle(nll, correct, at_max, [0.0])
    np.testing.assert_allclose(best["nll"][0], nll.min(axis=0).astype(np.float64).mean(), rtol=1e-12)
    wider = oracle(nll, correct, at_max, [0.0, 0.1, 10.0])
    assert np.all(np.diff(wider["depth"]) <= 0) and wider["depth"][-1] == 1.0


def test_the_lower_frontier_is_attained_at_its_vertices_and_no_choice_of_depths_lies_below_it():
    rng = np.random.default_rng(1)
    nll = rng.gamma(2.0, 0.5, size=(4, 3))  # S=4 depths, 3 tokens: 64 choices of depths
    frontier = lower_frontier(nll, float(nll[-1].mean()))
    points = []
    for choice in itertools.product(range(1, 5), repeat=3):
        depths = np.array(choice)
        points.append((depths.mean(), served_mean_nll(nll, float(nll[-1].mean()), depths)))
    points = np.array(points)
    assert np.all(points[:, 1] >= frontier_at(frontier, points[:, 0]) - 1e-12)
    for depth, value in zip(*frontier):
        attained = np.abs(points[:, 0] - depth) < 1e-12
        assert np.isclose(points[attained, 1].min(), value, rtol=0, atol=1e-12), (depth, value)
    assert np.all(np.diff(frontier[1]) <= 0)


def test_no_criterion_lies_below_the_frontier(scored):
    _, _, table = scored
    at_max = float(table.mean_nll[-1])
    frontier = lower_frontier(table.nll, at_max)
    for criterion in CRITERIA.values():
        result = sweep(
            table.nll,
            table.correct,
            at_max,
            table.statistics[criterion.name],
            criterion.thresholds,
            criterion.fires_below,
        )
        assert np.all(result["nll"] >= frontier_at(frontier, result["depth"]) - 1e-9), criterion.name
    best = oracle(table.nll, table.correct, at_max, np.geomspace(1e-4, 3, 12))
    assert np.all(best["nll"] >= frontier_at(frontier, best["depth"]) - 1e-9)


# --- against separate forwards ----------------------------------------------------------------


def test_a_criterion_that_never_fires_is_eval_at_s_to_the_bit(scored):
    model, tokens, table = scored
    expected = mean_nll_by_depth(model, tokens, list(range(1, S + 1)), batch_size=3).numpy()
    assert np.array_equal(table.mean_nll, expected)
    result = sweep(table.nll, table.correct, float(table.mean_nll[-1]), table.statistics["kl"], [0.0], True)
    assert result["depth"][0] == S and result["nll"][0] == expected[-1]


def test_statistics_and_the_ledger_equal_separate_forwards_at_each_depth(scored):
    model, tokens, table = scored
    with torch.no_grad():
        logits = torch.stack([model(tokens[:, :-1], depth=s).double() for s in range(1, S + 1)])  # [S, E, T, V]
    targets = tokens[:, 1:]
    log_probs = torch.log_softmax(logits, -1).flatten(1, 2)  # [S, N, V]
    nll = -log_probs.gather(2, targets.flatten()[None, :, None].expand(S, -1, 1)).squeeze(2)
    np.testing.assert_allclose(table.nll, nll.numpy(), rtol=1e-5, atol=1e-5)
    kl = (log_probs[1:].exp() * (log_probs[1:] - log_probs[:-1])).sum(-1)
    np.testing.assert_allclose(table.statistics["kl"][1:], kl.numpy(), rtol=1e-3, atol=1e-6)
    assert np.isnan(table.statistics["kl"][0]).all()
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    np.testing.assert_allclose(table.statistics["entropy"], entropy.numpy(), rtol=1e-4, atol=1e-6)
    correct = (logits.argmax(-1) == targets).flatten(1, 2).numpy()  # [S, N]
    assert np.array_equal(table.correct, correct)
    wrong_to_right, right_to_wrong = ledger(table.correct)
    for step in range(S - 1):
        assert wrong_to_right[step] == int((~correct[step] & correct[step + 1]).sum())
        assert right_to_wrong[step] == int((correct[step] & ~correct[step + 1]).sum())


def test_the_state_criterion_is_refused_for_a_model_that_does_not_expose_its_state(scored):
    model, tokens, _ = scored

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, depth):
            return self.inner(input_ids, depth=depth)

    with pytest.raises(Exception, match="criterion l2 needs the recurrent state"):
        depth_table(Plain(), tokens, S, (CRITERIA["l2"],))
    plain = depth_table(Plain(), tokens, S, (CRITERIA["kl"],), batch_size=3)
    _, _, table = scored
    np.testing.assert_allclose(plain.nll, table.nll, rtol=1e-5, atol=1e-6)


# --- the real-exit forward ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def looped():
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=64, max_seq_len=16, d_model=32, n_heads=2, n_core=2)).eval()
    with torch.no_grad():
        model.adapter.weight.normal_(0, 0.3)
    return model, torch.randint(0, 64, (3, 16))


def test_real_exit_at_the_last_or_the_first_depth_is_the_ordinary_forward_to_the_bit(looped):
    model, ids = looped
    with torch.no_grad():
        never, depth = model.forward_with_exit(
            ids, 5, lambda k, state, logits: torch.zeros(ids.shape, dtype=torch.bool)
        )
        assert torch.equal(never, model(ids, depth=5)) and bool((depth == 5).all())
        first, depth = model.forward_with_exit(ids, 5, lambda k, state, logits: torch.ones(ids.shape, dtype=torch.bool))
        assert torch.equal(first, model(ids, depth=1)) and bool((depth == 1).all())


def test_real_exit_refuses_a_max_depth_that_is_not_a_positive_integer(looped):
    model, ids = looped

    def never(k, state, logits):
        return torch.zeros(ids.shape, dtype=torch.bool)

    for bad in (0, -1, True, 2.5):
        with pytest.raises(InputError, match=re.escape(f"max_depth must be a positive integer, got {bad!r}")):
            model.forward_with_exit(ids, bad, never)
    with torch.no_grad():
        logits, depth = model.forward_with_exit(ids, 1, never)
    assert torch.equal(logits, model(ids, depth=1)) and bool((depth == 1).all())


def test_readouts_by_depth_yield_the_state_whole_or_at_the_positions_asked_for(looped):
    model, ids = looped
    positions = torch.tensor([0, 5, 17, 40])
    with torch.no_grad():
        whole = list(model.readouts_by_depth(ids, [4, 2]))
        picked = list(model.readouts_by_depth(ids, [2, 4], positions))
        assert [k for k, _, _ in whole] == [2, 4] == [k for k, _, _ in picked]
        for (depth, state, logits), (_, at, logits_at) in zip(whole, picked):
            assert state.shape == (*ids.shape, 32) and torch.equal(logits, model(ids, depth=depth))
            assert torch.equal(at, state.flatten(0, 1)[positions])
            torch.testing.assert_close(logits_at, logits.flatten(0, 1)[positions], rtol=0, atol=1e-6)


def test_real_exit_freezes_a_stopped_token_for_the_tokens_after_it_only(looped):
    model, ids = looped
    last = torch.zeros(ids.shape, dtype=torch.bool)
    last[:, -1] = True  # only the last position stops at 1: causal attention keeps the others' at 5
    with torch.no_grad():
        logits, depth = model.forward_with_exit(ids, 5, lambda k, state, out: last)
        full = model(ids, depth=5)
    assert torch.equal(logits[:, :-1], full[:, :-1]) and depth[:, -1].eq(1).all() and depth[:, :-1].eq(5).all()
    assert not torch.allclose(logits[:, -1], full[:, -1])
    middle = torch.zeros(ids.shape, dtype=torch.bool)
    middle[:, 4] = True  # position 4 stops at 1: the tokens after it attend to its frozen keys
    with torch.no_grad():
        logits, _ = model.forward_with_exit(ids, 5, lambda k, state, out: middle)
    assert torch.equal(logits[:, :4], full[:, :4]) and not torch.allclose(logits[:, 5:], full[:, 5:])


def test_a_stopped_tokens_keys_and_values_stay_those_of_its_last_iteration(looped):
    model, ids = looped
    recorded = {i: [] for i in range(len(model.core))}
    hooks = [
        block.attn.qkv.register_forward_hook(lambda module, args, out, i=i: recorded[i].append(out[:, 4].clone()))
        for i, block in enumerate(model.core)
    ]
    stops = torch.zeros(ids.shape, dtype=torch.bool)
    stops[:, 4] = True  # position 4 stops after iteration 2
    try:
        with torch.no_grad():
            model.forward_with_exit(ids, 5, lambda k, state, out: stops if k == 2 else torch.zeros_like(stops))
    finally:
        for hook in hooks:
            hook.remove()
    for outputs in recorded.values():  # one per iteration (the readouts run the coda, not the core)
        assert len(outputs) == 5 and not torch.equal(outputs[0], outputs[1])
        assert all(torch.equal(outputs[1], later) for later in outputs[2:])


def test_real_exit_nll_with_a_never_firing_threshold_is_the_nll_at_s(scored):
    model, tokens, table = scored
    nll, depth = real_exit_nll(model, tokens, CRITERIA["kl"], [0.0, 1e9], S, batch_size=3)
    np.testing.assert_allclose(nll[0], table.mean_nll[-1], rtol=1e-6)
    assert depth[0] == S and depth[1] == 2  # kl fires at 2 at the earliest
    np.testing.assert_allclose(nll[1], table.mean_nll[1], rtol=1e-6)


# --- the command --------------------------------------------------------------------------------

USER_CRITERION = """
import torch
from trainer.exits import Criterion

def top_two_margin(readout, previous):
    top = readout.log_probs.exp().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]

margin = Criterion("margin", top_two_margin, fires_below=False, thresholds=(0.2, 0.5, 0.9))
"""


def test_exits_writes_the_frontier_and_summarize_and_plot_read_it(run, tmp_path, monkeypatch):
    (tmp_path / "my_exits.py").write_text(textwrap.dedent(USER_CRITERION))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "e.h5"
    code, stdout, stderr = run_cli(
        "exits", run["checkpoint"], run["checkpoint"], "--out", out, "--max-depth", S, "--eval-set", "snapshot",
        "--criteria", "kl,entropy,my_exits:margin", "--thresholds", "kl=0,1e-3", "--grouping", "position",
        "--real-exit", "--batch-size", 3, "--no-progress",
    )  # fmt: skip
    assert (code, stdout.strip()) == (0, f"wrote {out}"), stderr
    with xr.open_dataset(out, engine="h5netcdf") as ds:
        ds = ds.load()
    assert ds.attrs["kind"] == "exits" and ds["criterion"].values.tolist() == ["kl", "entropy", "margin"]
    assert ds.sizes["run"] == 2 and ds.sizes["threshold_index"] == 20 and ds.attrs["batch_size"] == 3
    snapshot = load_snapshot(run["checkpoint"])
    eval_nll = mean_nll_by_depth(snapshot.model("cpu").eval(), snapshot.eval_tokens, [S], batch_size=3)
    assert float(ds["exit_nll"].sel(criterion="kl", threshold_index=0)[0]) == float(eval_nll[0])
    assert float(ds["fixed_nll"].sel(serving_depth=S)[0]) == float(eval_nll[0])
    assert np.isnan(ds["threshold"].sel(criterion="margin").values[3:]).all()
    assert int(ds["targets_by_position"].sum("position")[0]) == int(ds["targets"][0])
    assert np.all(ds["exit_gap"].fillna(0) >= -1e-9) and np.all(ds["oracle_gap"] >= -1e-9)
    assert np.isfinite(ds["real_exit_nll"].sel(criterion="kl", threshold_index=[0, 1])).all()

    code, stdout, _ = run_cli("summarize", out)
    assert code == 0 and "oracle     eps=0 " in stdout and "margin" in stdout and "Overthinking ledger" in stdout
    assert "by position" in stdout and "Real exit" in stdout
    code, stdout, _ = run_cli("summarize", out, "--json")
    rows = json.loads(stdout)["rows"]
    assert {row["kind"] for row in rows} == {"fixed", "oracle", "kl", "entropy", "margin"}
    code, stdout, stderr = run_cli("plot", out, "--figure", "exits", "--out", tmp_path / "e.png")
    assert code == 0 and (tmp_path / "e.png").is_file(), stderr
    code, _, stderr = run_cli("plot", out, "--figure", "4", "--out", tmp_path / "f.png")
    assert code == 2 and "--figure 4 draws results files" in stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--criteria", "kl,nope"], "--criteria nope: not one of kl, l2, entropy, maxprob"),
        (["--thresholds", "kl"], "--thresholds 'kl': expected CRITERION=T1,T2"),
        (["--criteria", "kl", "--thresholds", "maxprob=0.5"], "--thresholds maxprob: not among --criteria"),
    ],
)
def test_exits_refuses_bad_input_in_one_line(run, tmp_path, args, message):
    out = tmp_path / "e.h5"
    code, _, stderr = run_cli("exits", run["checkpoint"], "--out", out, *args)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not out.exists()


def test_a_snapshot_folder_of_the_same_model_gives_the_checkpoints_results(run, tmp_path):
    import diag

    snapshot = load_snapshot(run["checkpoint"])
    model = snapshot.model("cpu")
    folder = diag.save_snapshot(
        tmp_path / "folder", model, snapshot.optimizer(model), torch.zeros((1, 2, 5), dtype=torch.long),
        snapshot.eval_tokens, step=snapshot.step,
    )  # fmt: skip
    options = ("--max-depth", S, "--eval-set", "snapshot", "--criteria", "kl,l2", "--batch-size", 3, "--real-exit")
    results = {}
    for name, source in (("file", run["checkpoint"]), ("folder", folder)):
        out = tmp_path / f"{name}.h5"
        code, _, stderr = run_cli("exits", source, "--out", out, *options, "--no-progress")
        assert code == 0, stderr
        with xr.open_dataset(out, engine="h5netcdf") as ds:
            results[name] = ds.load()
    file, folder_ds = results["file"], results["folder"]
    assert folder_ds["snapshot_folder"].values.tolist() == [str(folder)]
    assert folder_ds["model_family"].values.tolist() == ["keyword-depth"]
    assert json.loads(str(folder_ds["config"].values[0]))["snapshot_folder"] == str(folder)
    for name in (
        "fixed_nll",
        "exit_nll",
        "exit_depth",
        "oracle_nll",
        "frontier_nll",
        "right_to_wrong",
        "real_exit_nll",
    ):
        xr.testing.assert_identical(folder_ds[name].drop_vars("run"), file[name].drop_vars("run"))
    assert folder_ds.attrs["flops_per_iteration"] == file.attrs["flops_per_iteration"]

    code, _, stderr = run_cli("exits", folder, run["checkpoint"], "--out", tmp_path / "mixed.h5")
    assert code == 2 and "a snapshot folder, among checkpoint files" in stderr, stderr
    code, _, stderr = run_cli("exits", run["checkpoint"], "--family", "huginn", "--out", tmp_path / "f.h5")
    assert code == 2 and "--family huginn: only with --hf DIR or snapshot folders" in stderr, stderr


def test_a_sharded_checkpoint_folder_is_read_as_a_checkpoint_not_a_snapshot_folder(tmp_path):
    (tmp_path / "step_000008.dcp").mkdir()
    code, _, stderr = run_cli("exits", tmp_path / "step_000008.dcp", "--out", tmp_path / "e.h5")
    assert code == 2 and "no meta.pt, so not a complete sharded depthdiag checkpoint" in stderr, stderr
