"""`depthdiag diagnose --adapter`: a model from another codebase (Huginn-style: the depth as
`num_steps`, an output object with `.logits`, no `nll_by_depth`) through the same run and
results file as snapshots, equal to `compare_updates` on the same inputs."""

import copy
import functools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from click.testing import CliRunner

import diag
from analysis.store import open_results
from common.errors import InputError
from depthdiag.cli import main
from diag.arithmetic.families import ModelFamily
from diag.sources.adapter import AdaptedModel, load_adapter, parse_adapter_args

VOCAB, SEQ = 40, 10
UPDATE_DEPTHS, SERVING = (1, 4), (1, 2, 3, 6)


@dataclass
class Output:
    logits: torch.Tensor


class HuginnStyle(nn.Module):
    """Not this project's model: the depth as `num_steps`, an output object, no nll_by_depth."""

    def __init__(self, d=24):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.core = nn.Sequential(nn.Linear(2 * d, d), nn.Tanh())
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, num_steps=4):
        e = self.embed(input_ids)
        state = torch.zeros_like(e)
        for _ in range(num_steps):
            state = self.core(torch.cat((state, e), dim=-1))
        return Output(logits=self.head(state))


def tokens(shape, seed):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@functools.cache
def huginn(
    steps: str = "3", depth_kwarg: str = "num_steps", precision: str = "fp32", masked: str = "no"
) -> AdaptedModel:
    """The adapter the tests name: cached, so a test holds the very objects the command used."""
    torch.manual_seed(0)
    model = HuginnStyle()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(int(steps)):
        batch = tokens((4, SEQ + 1), 100 + step)
        logits = model(batch[:, :-1], num_steps=1 + step % 4).logits
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return AdaptedModel(
        model=model,
        optimizer=optimizer,
        batches=tokens((3, 4, SEQ + 1), 1),
        eval_tokens=tokens((5, SEQ + 1), 2),
        depth_kwarg=depth_kwarg,
        lr=2e-3,
        grad_clip=0.5,
        name="huginn",
        precision=precision,
        eval_mask=EVAL_MASK if masked == "yes" else None,
    )


EVAL_MASK = torch.arange(SEQ).expand(5, SEQ) >= SEQ // 2
"""The second half of every evaluation row's targets: as an answers-only evaluation counts."""


def not_adapted():
    return {"model": None}


def cli(*args):
    result = CliRunner().invoke(main, ["diagnose", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def state_of(adapted: AdaptedModel):
    return copy.deepcopy((adapted.model.state_dict(), adapted.optimizer.state_dict()))


def assert_same_state(before, after):
    (model_a, opt_a), (model_b, opt_b) = before, after
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a) and model_a.keys() == model_b.keys()
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for key, state in opt_a["state"].items():
        assert all(torch.equal(value, opt_b["state"][key][name]) for name, value in state.items())


def test_adapter_results_equal_compare_updates_and_leave_the_model_alone(tmp_path):
    adapted = huginn(steps="3")  # called as the command calls it: the same cached objects
    before = state_of(adapted)
    out = tmp_path / "huginn.h5"
    args = ["--adapter", f"{__name__}:huginn", "--adapter-arg", "steps=3", "--out", out, "--no-progress"]
    code, stdout, err = cli(*args, "--update-depths", "1,4", "--serving", "1-3,6")
    assert code == 0, err
    assert stdout == f"wrote {out}\n"
    # Adam after 3 steps is far from the 3 / (1 - beta2) steps the diagnostic needs: said once.
    assert err.count("bias correction") == 1 and err.startswith(f"warning: {__name__}:huginn: ")
    assert_same_state(before, state_of(adapted))
    ds = open_results(out)
    assert list(ds.snapshot.values) == ["huginn"] and ds.sizes["batch"] == 3
    assert ds.step.values.tolist() == [3] and ds.uniform_updates.values.tolist() == [0]
    assert ds.lr.values.tolist() == [2e-3] and ds.attrs["grad_clip"] == 0.5
    assert ds.attrs["batch_source"] == '{"huginn": "adapter"}' and ds.attrs["eval_set"] == "snapshot"
    assert f"{__name__}:huginn" in ds.attrs["config"] and "num_steps" in ds.attrs["config"]
    for b in range(3):
        with pytest.warns(diag.BiasCorrectionWarning):
            unit = diag.compare_updates(
                adapted.model,
                adapted.optimizer,
                adapted.batches[b],
                adapted.eval_tokens,
                update_depths=UPDATE_DEPTHS,
                serving_depths=SERVING,
                depth_kwarg="num_steps",
                lr=2e-3,
                grad_clip=0.5,
            )
        for name in ("nll", "benefit", "update_rms", "rms_scale", "update_cosine", "train_loss"):
            np.testing.assert_array_equal(ds[name].values[0, b], unit[name].values, err_msg=name)
        np.testing.assert_array_equal(ds.nll_before.values[0], unit.nll_before.values)
    assert np.abs(ds.benefit.values).max() > 0
    assert_same_state(before, state_of(adapted))
    summary = CliRunner().invoke(main, ["summarize", str(out)])
    assert summary.exit_code == 0 and "huginn" in summary.stdout, summary.output
    # No depth schedule behind an adapter's model: no uniform-updates column, no finishing phase.
    assert "uniform updates" not in summary.stdout and "finishing phase" not in summary.stdout
    assert "step" in summary.stdout.splitlines()[1]
    # The same inputs resume as the finished run; other inputs are another run.
    assert cli(*args, "--update-depths", "1,4", "--serving", "1-3,6", "--resume")[0] == 0
    code, _, err = cli(*args[:3], "steps=4", *args[4:], "--update-depths", "1,4", "--serving", "1-3,6", "--resume")
    assert code == 2 and "already exists" in err


def one_line_error(*args, out):
    code, _, err = cli(*args, "--out", out, "--no-progress")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists() and not out.with_name(out.name + ".parts").exists()
    return err


def test_adapter_problems_are_one_line_errors(tmp_path, monkeypatch):
    out = tmp_path / "r.h5"
    err = one_line_error("--adapter", "no_such_module_anywhere:load", out=out)
    assert "cannot import 'no_such_module_anywhere'" in err
    (tmp_path / "broken_adapter.py").write_text("raise RuntimeError('the module body fails')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = one_line_error("--adapter", "broken_adapter:load", out=out)
    assert "RuntimeError: the module body fails" in err
    assert "has no 'missing'" in one_line_error("--adapter", f"{__name__}:missing", out=out)
    assert "expected MODULE:FUNCTION" in one_line_error("--adapter", "no_colon", out=out)
    err = one_line_error("--adapter", f"{__name__}:not_adapted", out=out)
    assert "returned a dict, not a diag.AdaptedModel" in err
    err = one_line_error("--adapter", f"{__name__}:huginn", "--adapter-arg", "stpes=3", out=out)
    assert "stpes" in err
    err = one_line_error("--adapter", f"{__name__}:huginn", "--adapter-arg", "depth_kwarg=depth", out=out)
    assert "takes no keyword 'depth'" in err and "num_steps" in err
    err = one_line_error("--adapter", f"{__name__}:huginn", "--batches", "4", out=out)
    assert "returned 3 batches" in err
    err = one_line_error("--adapter", f"{__name__}:huginn", "--device", "cuda", out=out)
    assert "on cpu" in err
    assert "exclude each other" in one_line_error("x.pt", "--adapter", f"{__name__}:huginn", out=out)
    assert "needs --adapter" in one_line_error("x.pt", "--adapter-arg", "a=1", out=out)


def test_adapted_model_and_its_arguments_are_checked():
    assert parse_adapter_args(["a=1", "path=x=y"]) == (("a", "1"), ("path", "x=y"))
    for bad in (["novalue"], ["1a=2"], ["a=1", "a=2"]):
        with pytest.raises(InputError):
            parse_adapter_args(bad)
    adapted = huginn("3")
    fields = dict(model=adapted.model, optimizer=adapted.optimizer, eval_tokens=adapted.eval_tokens)
    assert len(AdaptedModel(batches=tokens((2, 4, SEQ + 1), 3), **fields).batches) == 2
    for batches in ([], [tokens((4, SEQ + 1), 3).float()], tokens((4, SEQ + 1), 3)):
        with pytest.raises(InputError, match="batches"):
            AdaptedModel(batches=batches, **fields)
    with pytest.raises(InputError, match="optimizer"):
        AdaptedModel(**{**fields, "optimizer": "adamw"}, batches=adapted.batches)
    with pytest.raises(InputError, match="name"):
        AdaptedModel(**fields, batches=adapted.batches, name="a/b")
    with pytest.raises(InputError, match="returned a dict"):
        load_adapter(f"{__name__}:not_adapted")


@pytest.mark.filterwarnings("ignore::diag.BiasCorrectionWarning")
def test_an_adapter_carries_its_training_precision_and_evaluation_mask(tmp_path):
    out = tmp_path / "bf16.h5"
    args = ["--adapter", f"{__name__}:huginn", "--adapter-arg", "steps=3", "--adapter-arg", "precision=bf16"]
    args += ["--adapter-arg", "masked=yes", "--batches", "1", "--update-depths", "1,4", "--serving", "1-3,6"]
    code, _, err = cli(*args, "--out", out, "--no-progress")
    assert code == 0, err
    ds = open_results(out)
    assert ds.attrs["precision"] == "bf16"
    adapted = huginn(steps="3", precision="bf16", masked="yes")
    settings = dict(
        update_depths=UPDATE_DEPTHS, serving_depths=SERVING, depth_kwarg="num_steps", lr=2e-3, grad_clip=0.5
    )
    batch = adapted.batches[0]
    unit = diag.compare_updates(
        adapted.model, adapted.optimizer, batch, adapted.eval_tokens, precision="bf16", eval_mask=EVAL_MASK, **settings
    )
    np.testing.assert_array_equal(ds.nll.values[0, 0], unit.nll.values)
    plain = diag.compare_updates(adapted.model, adapted.optimizer, batch, adapted.eval_tokens, **settings)
    assert not np.array_equal(plain.nll.values, unit.nll.values)  # both settings change the measurement
    with pytest.raises(InputError, match="AdaptedModel.precision must be one of fp32, bf16"):
        AdaptedModel(adapted.model, adapted.optimizer, adapted.batches, adapted.eval_tokens, precision="fp16")
    with pytest.raises(
        InputError, match=r"AdaptedModel.eval_mask must be a bool tensor of the targets' shape \[5, 10\]"
    ):
        AdaptedModel(adapted.model, adapted.optimizer, adapted.batches, adapted.eval_tokens, eval_mask=EVAL_MASK[:, 1:])


def test_figure4_of_an_adapters_results_draws_only_what_applies(tmp_path):
    out = tmp_path / "huginn.h5"
    args = ["--adapter", f"{__name__}:huginn", "--adapter-arg", "steps=3", "--out", out, "--no-progress"]
    assert cli(*args, "--update-depths", "1,4", "--serving", "1-3,6")[0] == 0
    from analysis.figures import figure4

    fig = figure4(open_results(out))
    (panel,) = fig.axes  # benefit by serving depth only: no uniform updates to count, no finishing phase
    assert [text.get_text() for text in panel.get_legend().get_texts()] == ["huginn"]
    assert panel.get_xlabel() == "serving depth"
    result = CliRunner().invoke(main, ["plot", str(out), "--out", str(tmp_path / "huginn.png")])
    assert result.exit_code == 0, result.output


STEPS = ModelFamily("steps", depth_kwarg="num_steps")
"""How HuginnStyle takes its depth, as a family --family names."""


def test_family_calls_an_adapters_model_in_place_of_the_keyword_it_says(tmp_path):
    depths = ["--update-depths", "1,4", "--serving", "1-3,6", "--no-progress"]
    said = ["--adapter", f"{__name__}:huginn", "--adapter-arg", "depth_kwarg=num_steps", *depths]
    assert cli(*said, "--out", tmp_path / "said.h5")[0] == 0
    wrong = ["--adapter", f"{__name__}:huginn", "--adapter-arg", "depth_kwarg=depth", *depths]
    assert "takes no keyword 'depth'" in one_line_error(*wrong, out=tmp_path / "wrong.h5")
    code, _, err = cli(*wrong, "--family", f"{__name__}:STEPS", "--out", tmp_path / "family.h5")
    assert code == 0, err
    said, family = open_results(tmp_path / "said.h5"), open_results(tmp_path / "family.h5")
    assert family.attrs["model_family"] == "steps" and family.attrs["backprop"] == "full backprop"
    assert '"model_family": "steps"' in family.attrs["config"]
    for name in ("nll", "nll_before", "benefit", "update_rms"):
        np.testing.assert_array_equal(family[name].values, said[name].values, err_msg=name)
