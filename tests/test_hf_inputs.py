"""Hugging Face model folders as inputs (`--hf DIR`, diag/sources/hf.py): a Huginn-convention remote-code
folder is detected as the huginn family, evaluated and diagnosed as it trains and serves, and
a folder without optimizer state gets only the labelled estimate, checked by hand here."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from analysis.store import open_results
from depthdiag.cli import main
from diag.arithmetic.random_streams import CRN_SEED

pytest.importorskip("transformers")
from huginn_convention_hf import new_model, write_folder  # noqa: E402

VOCAB, SEQ = 48, 10
DEPTHS = ("--update-depths", "3,11", "--serving", "1,3,11")
TOKENS = ("--seq-len", str(SEQ), "--eval-sequences", "6")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A folder of nanoGPT-style token files (uint16, ids below the model's vocabulary)."""
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 600)):
        rng.integers(0, VOCAB, n).astype(np.uint16).tofile(folder / f"{split}.bin")
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("hf") / "huginn-tiny", new_model())


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], prog_name="depthdiag")
    return result.exit_code, result.output


def loaded(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32)


def test_remote_code_runs_only_when_trusted(folder, data, tmp_path):
    code, output = run("eval", "--hf", folder, "--data", data, *TOKENS, "--serving", "1,2")
    assert code == 2
    assert (
        output.strip().splitlines()[-1].endswith("pass --trust-remote-code to run it (read it first: it runs as you)")
    )


def test_eval_scores_each_depth_as_the_family_serves(folder, data):
    code, output = run("eval", "--hf", folder, "--trust-remote-code", "--data", data, *TOKENS, "--serving", "1,3,11")
    assert code == 0, output
    assert "model family huginn" in output
    printed = [float(line.split()[1]) for line in output.splitlines() if line.strip()[:1].isdigit()]
    from trainer.data.sources import open_bin_source

    eval_tokens = open_bin_source(data).eval_tokens(6, SEQ)
    model = loaded(folder).eval()
    expected = []
    with torch.no_grad():
        torch.manual_seed(CRN_SEED)  # one stream over the evaluation, depth after depth
        for depth in (1, 3, 11):
            logits = model(eval_tokens[:, :-1], num_steps=depth).logits
            expected.append(float(F.cross_entropy(logits.flatten(0, 1), eval_tokens[:, 1:].flatten())))
    np.testing.assert_allclose(printed, expected, atol=1e-4)  # the table prints 4 decimals


def test_a_folder_without_optimizer_state_needs_the_labelled_estimate(folder, data, tmp_path):
    out = tmp_path / "r.h5"
    code, output = run("diagnose", "--hf", folder, "--trust-remote-code", "--data", data, *TOKENS, "--out", out)
    assert code == 2
    assert "no optimizer.pt" in output and "--estimate-optimizer N --lr LR" in output
    code, output = run(
        "diagnose", "--hf", folder, "--trust-remote-code", "--data", data, "--estimate-optimizer", 2, "--out", out
    )
    assert code == 2 and "--estimate-optimizer needs --lr" in output
    assert not out.exists()


def test_diagnose_with_estimated_second_moments_matches_a_hand_estimate(folder, data, tmp_path):
    from diag.sources.hf import ESTIMATE_STEP_OFFSET, HfInput, TokenSpec, hf_adapted_model
    from trainer.data.sources import open_bin_source

    out = tmp_path / "r.h5"
    args = ("--train-batch-size", 4, "--estimate-optimizer", 2, "--lr", "1e-3", "--batches", 2, "--grad-clip", 1.0)
    code, output = run(
        "diagnose", "--hf", folder, "--trust-remote-code", "--data", data, *TOKENS, *DEPTHS, *args, "--out", out
    )
    assert code == 0, output
    ds = open_results(out)
    assert ds.attrs["model_family"] == "huginn" and ds.attrs["random_forward"] == 1
    assert ds.attrs["backprop"] == "backprop through the last 8 iterations"
    assert ds.attrs["optimizer_state"] == "estimated-second-moments(N=2, depths=3,11)"
    assert ds.step.values.tolist() == [0]  # unknown: the estimate's step count only settles bias correction
    assert json.loads(ds.attrs["config"])["model_family"] == "huginn"
    assert np.isfinite(ds.benefit.values).all()
    code, summary = run("summarize", out)
    assert code == 0, summary
    assert "huginn-tiny" in summary and "uniform" not in summary and "switch" not in summary

    # The second moments by hand: the held-out batches' gradients at both depths, called as
    # Huginn trains (3 - 0 and 11 - 8 iterations without gradient), clipped, squared, averaged.
    source = HfInput(
        folder=str(folder),
        tokens=TokenSpec(data=str(data), batch_size=4, seq_len=SEQ, eval_sequences=6),
        trust_remote_code=True,
        estimate_optimizer=2,
        lr=1e-3,
    )
    adapted, _ = hf_adapted_model(source, batches=2, update_depths=(3, 11), device="cpu")
    model = loaded(folder).train()
    tokens = open_bin_source(data)
    squares = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for i in range(2):
        batch = tokens.batch(0, ESTIMATE_STEP_OFFSET + i, 4, SEQ)
        for depth in (3, 11):
            model.zero_grad()
            torch.manual_seed(CRN_SEED)
            logits = model(batch[:, :-1], num_steps=(depth - min(depth, 8), min(depth, 8))).logits
            F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for name, p in model.named_parameters():
                squares[name] += p.grad.square() / 4
    params = dict(adapted.model.named_parameters())
    for name, expected in squares.items():
        state = adapted.optimizer.state[params[name]]
        torch.testing.assert_close(state["exp_avg_sq"], expected, rtol=1e-5, atol=1e-12)
        assert not state["exp_avg"].any()


def test_an_unknown_model_type_asks_for_a_family(folder, data, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    code, output = run("eval", "--hf", other, "--data", data, *TOKENS)
    assert code == 2
    assert output.strip().endswith(
        "model_type 'mystery' is no known model family [depthdiag (depthdiag_looped), huginn (huginn_raven)]; say how "
        "to call it with --family NAME or --family MODULE:NAME (a diag.ModelFamily, docs/diagnostic.md)"
    )


def test_a_family_of_ones_own_is_named_by_module(folder, data, tmp_path, monkeypatch):
    (tmp_path / "pair_families.py").write_text(
        "from diag.arithmetic.families import ModelFamily\n"
        "FULL = ModelFamily('huginn-full', depth_kwarg='num_steps', pair_depth=True)\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.h5"
    code, output = run(
        "diagnose", "--hf", folder, "--trust-remote-code", "--family", "pair_families:FULL", "--data", data, *TOKENS,
        *DEPTHS, "--estimate-optimizer", 1, "--lr", "1e-3", "--batches", 1, "--train-batch-size", 2, "--out", out,
    )  # fmt: skip
    assert code == 0, output
    ds = open_results(out)
    assert ds.attrs["model_family"] == "huginn-full" and ds.attrs["backprop"] == "full backprop"


def test_hf_options_need_hf(tmp_path):
    code, output = run("eval", tmp_path / "x.pt", "--family", "huginn", "--trust-remote-code")
    assert code == 2
    assert output.strip().endswith("--family, --trust-remote-code: only with --hf DIR (a Hugging Face model folder)")
