"""The benefit by group of evaluation targets (diag/arithmetic/target_groups.py,
diag/sources/groupings.py, analysis/groups.py): each group's NLL is the diagnostic's own NLL
with the evaluation restricted to that group's targets (an independent path, through
eval_mask), the groups weighted by their targets give back the headline, and the shipped
groupings, a user's, `diagnose --grouping` and `summarize --by` do what they say."""

import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import xarray as xr
from click.testing import CliRunner
from helpers import write_run
from huginn_convention import HuginnConvention

import diag
from common.errors import InputError
from depthdiag.cli import main
from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic
from diag.arithmetic.target_groups import TargetGroups, groups_of_ids
from diag.sources.groupings import position_groups
from trainer.data.bios import ATTRIBUTES
from trainer.model import LoopedTransformer, ModelConfig

VOCAB, T = 24, 10
FP32_ROUNDING = 1e-5  # two float32 evaluations of NLLs near 3, summed in different orders


def trained(model: torch.nn.Module, depth_kwarg: str, depth, rows: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        out = model(rows[:, :-1], **{depth_kwarg: depth})
        logits = getattr(out, "logits", out)
        F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
        optimizer.step()
    return model, optimizer


def tokens(rows: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, T + 1), generator=torch.Generator().manual_seed(seed))


def looped():
    torch.manual_seed(0)
    model = LoopedTransformer(
        ModelConfig(vocab_size=VOCAB, max_seq_len=T, d_model=16, n_heads=2, n_prelude=1, n_core=1, n_coda=1)
    )
    return trained(model, "depth", 2, tokens(4, 1))


class DroppedLogits(torch.nn.Module):
    """A looped model with dropout on its logits, which an evaluation in eval mode leaves out."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.drop = inner, torch.nn.Dropout(0.5)

    def forward(self, input_ids, depth):
        return self.drop(self.inner(input_ids, depth=depth))


def dropped_logits():
    model, _ = looped()
    model = DroppedLogits(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def huginn():
    torch.manual_seed(0)
    return trained(HuginnConvention(VOCAB, 16), "num_steps", (1, 2), tokens(4, 1))


def groupings(eval_tokens: torch.Tensor) -> list[TargetGroups]:
    by_token = groups_of_ids("by_token", eval_tokens[:, 1:] % 3)
    # A grouping that leaves targets out: only even target tokens, by position.
    partial = torch.where(eval_tokens[:, 1:] % 2 == 0, torch.arange(T).expand(len(eval_tokens), T) // 4, -1)
    return [by_token, groups_of_ids("even_position", partial), position_groups(T, len(eval_tokens))]


@pytest.mark.parametrize(
    "build, family",
    [(looped, None), (dropped_logits, None), (huginn, diag.HUGINN)],
    ids=["depthdiag", "dropout-left-out-in-eval", "huginn-random-forward"],
)
def test_a_groups_nll_is_the_nll_of_its_targets_alone_and_the_groups_give_back_the_headline(build, family):
    model, optimizer = build()
    eval_tokens, batch = tokens(5, 2), tokens(4, 3)
    mask = torch.rand(5, T, generator=torch.Generator().manual_seed(4)) > 0.25
    options = DiagnosticOptions(update_depths=(1, 3), serving_depths=(1, 2, 4), family=family, eval_batch_size=2)
    grouped = UpdateDiagnostic(model, optimizer, eval_tokens, options, mask, eval_groups=groupings(eval_tokens))
    ds = grouped.compare(batch)
    assert grouped.random_forward == (family is not None)
    for grouping, ids in grouped.eval_groups:
        name = grouping.name
        counts = ds[f"targets_by_{name}"].values
        np.testing.assert_array_equal(counts, [int(((ids == g) & mask).sum()) for g in range(len(grouping.labels))])
        for g, label in enumerate(grouping.labels):
            alone = UpdateDiagnostic(model, optimizer, eval_tokens, options, mask & (ids == g)).compare(batch)
            np.testing.assert_allclose(
                ds[f"nll_by_{name}"].sel({name: label}).values, alone["nll"].values, rtol=0, atol=FP32_ROUNDING
            )
            np.testing.assert_allclose(
                ds[f"nll_before_by_{name}"].sel({name: label}).values, alone["nll_before"].values, atol=FP32_ROUNDING
            )
    for name in ("by_token", "position"):  # every counted target in one group: the headline back
        n = ds[f"targets_by_{name}"]
        benefit = ds[f"nll_by_{name}"].isel(update_depth=0) - ds[f"nll_by_{name}"].isel(update_depth=-1)
        np.testing.assert_allclose((benefit * n).sum(name) / n.sum(), ds["benefit"], rtol=0, atol=FP32_ROUNDING)
    # The groups add nothing to the unit's own numbers: the same unit without them, to the bit.
    plain = UpdateDiagnostic(model, optimizer, eval_tokens, options, mask).compare(batch)
    xr.testing.assert_identical(ds[list(plain.data_vars)], plain)


def test_groups_under_geomean_matching_are_the_nll_of_their_targets_alone():
    """rms_match='geomean' scales every update after all are made: the groups are evaluated there too."""
    model, optimizer = looped()
    eval_tokens, batch = tokens(5, 2), tokens(4, 3)
    options = DiagnosticOptions(update_depths=(1, 3), serving_depths=(1, 4), rms_match="geomean")
    grouping = position_groups(T, len(eval_tokens), spans=2)
    grouped = UpdateDiagnostic(model, optimizer, eval_tokens, options, eval_groups=[grouping])
    ds = grouped.compare(batch)
    ((_, ids),) = grouped.eval_groups
    for g, label in enumerate(grouping.labels):
        alone = UpdateDiagnostic(model, optimizer, eval_tokens, options, ids == g).compare(batch)
        np.testing.assert_allclose(
            ds[f"nll_by_{grouping.name}"].sel({grouping.name: label}).values,
            alone["nll"].values,
            rtol=0,
            atol=FP32_ROUNDING,
        )
    assert (
        ds[f"nll_by_{grouping.name}"].isel(update_depth=0) != ds[f"nll_by_{grouping.name}"].isel(update_depth=1)
    ).all()


def test_a_group_without_counted_targets_has_no_nll():
    model, optimizer = looped()
    eval_tokens = tokens(3, 2)
    empty = TargetGroups("half", torch.zeros(3, T, dtype=torch.long), ("all", "none"))
    options = DiagnosticOptions(update_depths=(1, 2), serving_depths=(1,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty group's 0 / 0 is expected, not a warning
        ds = UpdateDiagnostic(model, optimizer, eval_tokens, options, eval_groups=[empty]).compare(tokens(4, 3))
    assert ds["targets_by_half"].values.tolist() == [3 * T, 0] and ds["targets_by_half"].dtype == np.int64
    assert np.isnan(ds["nll_by_half"].sel(half="none")).all() and np.isfinite(ds["nll_by_half"].sel(half="all")).all()
    assert np.isnan(ds["nll_before_by_half"].sel(half="none")).all()
    # Each grouping's variables are on its own named dimension, labelled, beside the unit's depths.
    assert ds["nll_by_half"].dims == ("update_depth", "serving_depth", "half")
    assert ds["nll_before_by_half"].dims == ("serving_depth", "half") and ds["targets_by_half"].dims == ("half",)
    assert ds["half"].values.tolist() == ["all", "none"]
    assert ds["nll_by_half"]["update_depth"].values.tolist() == [1, 2]
    assert ds["nll_before_by_half"]["serving_depth"].values.tolist() == [1]


def test_groupings_are_checked():
    ids = torch.zeros(2, T, dtype=torch.long)
    with pytest.raises(InputError, match="identifier"):
        TargetGroups("serving_depth", ids, ("a",))
    with pytest.raises(InputError, match="int64"):
        TargetGroups("g", ids.float(), ("a",))
    with pytest.raises(InputError, match=r"-1\.\.0"):
        TargetGroups("g", ids + 1, ("a",))
    with pytest.raises(InputError, match=r"-1\.\.0"):
        TargetGroups("g", ids - 2, ("a",))
    assert TargetGroups("g", ids, (7,)).labels == ("7",)  # labels are text in the results
    with pytest.raises(InputError, match="distinct"):
        TargetGroups("g", ids, ("a", "a"))
    model, optimizer = looped()
    options = DiagnosticOptions(update_depths=(1, 2), serving_depths=(1,))
    with pytest.raises(InputError, match=r"shape \[2, 10\].*\[3, 10\]"):
        UpdateDiagnostic(model, optimizer, tokens(3, 2), options, eval_groups=[TargetGroups("g", ids, ("a",))])
    twice = [TargetGroups("g", torch.zeros(3, T, dtype=torch.long), ("a",))] * 2
    with pytest.raises(InputError, match="name of its own"):
        UpdateDiagnostic(model, optimizer, tokens(3, 2), options, eval_groups=twice)


def test_ids_become_groups_in_increasing_order_and_positions_split_evenly():
    grouping = groups_of_ids("g", torch.tensor([[7, -3, 2], [2, 7, 40]]))
    assert grouping.labels == ("2", "7", "40") and grouping.ids.tolist() == [[1, -1, 0], [0, 1, 2]]
    with_zero = groups_of_ids("g", torch.tensor([[0, -1, 3]]))
    assert with_zero.labels == ("0", "3") and with_zero.ids.tolist() == [[0, -1, 1]]
    nothing = groups_of_ids("g", torch.full((2, 3), -1))
    assert nothing.labels == ("none",) and nothing.ids.tolist() == [[-1] * 3] * 2
    # A target that is not counted is in no group, whatever its id says.
    targets = torch.tensor([[5, -100, 6], [-100, 1, 2]])
    assert grouping.for_targets(targets).tolist() == [[1, -1, 0], [-1, 1, 2]]
    positions = position_groups(10, 2)
    assert positions.labels == ("0-2", "3-4", "5-7", "8-9") and positions.ids[1].tolist() == [
        0,
        0,
        0,
        1,
        1,
        2,
        2,
        2,
        3,
        3,
    ]


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_diagnose_records_the_groupings_and_summarize_prints_the_benefit_by_group(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run")  # a bioS run: --eval-set auto is attributes
    monkeypatch.syspath_prepend(str(tmp_path))
    # A user's grouping (MODULE:NAME): the target token's parity; and one returning floats.
    (tmp_path / "parity_groups.py").write_text(
        "def by_parity(eval_tokens):\n    return eval_tokens[:, 1:] % 2\n\n"
        "def by_nothing(eval_tokens):\n    return eval_tokens.float()\n"
    )
    out = tmp_path / "r.h5"
    args = [run[2], run[4], "--batches", "2", "--update-depths", "2,5", "--serving", "1-3", "--no-progress"]
    groups = ["--grouping", "attribute", "--grouping", "frequency", "--grouping", "parity_groups:by_parity"]
    code, stdout, stderr = run_cli("diagnose", *args, *groups, "--out", out)
    assert code == 0, stderr
    with xr.open_dataset(out, engine="h5netcdf") as ds:
        ds = ds.load()
    assert list(ds["attribute"].values) == list(ATTRIBUTES)
    assert json.loads(ds.attrs["diagnose_manifest"])["settings"]["groupings"] == [
        "attribute",
        "frequency",
        "parity_groups:by_parity",
    ]
    for name in ("attribute", "frequency", "by_parity"):  # every counted target in one group of each
        n = ds[f"targets_by_{name}"]
        benefit = ds[f"nll_by_{name}"].isel(update_depth=0) - ds[f"nll_by_{name}"].isel(update_depth=-1)
        np.testing.assert_allclose((benefit * n).sum(name) / n.sum(name), ds["benefit"], rtol=0, atol=FP32_ROUNDING)
    # The same run without groupings: the same headline numbers, to the bit.
    code, _, stderr = run_cli("diagnose", *args, "--out", tmp_path / "plain.h5")
    assert code == 0, stderr
    with xr.open_dataset(tmp_path / "plain.h5", engine="h5netcdf") as plain:
        for name in ("nll", "benefit", "nll_before", "update_rms"):
            np.testing.assert_array_equal(plain[name].values, ds[name].values)

    code, stdout, stderr = run_cli("summarize", out, "--by", "attribute")
    assert code == 0, stderr
    assert "benefit by attribute" in stdout and all(a in stdout for a in ATTRIBUTES)
    code, stdout, stderr = run_cli("summarize", out, "--by", "attribute", "--json")
    rows = json.loads(stdout)["rows"]
    assert len(rows) == 2 * len(ATTRIBUTES) * 3
    row = next(
        r for r in rows if r["snapshot"] == "snap-u02" and r["attribute"] == "employer" and r["serving_depth"] == 2
    )
    nll = ds["nll_by_attribute"].sel(snapshot="snap-u02", attribute="employer", serving_depth=2)
    assert row["mean"] == pytest.approx(float((nll.isel(update_depth=0) - nll.isel(update_depth=1)).mean("batch")))
    assert row["n"] == 2 and row["unit"] == "batch"

    code, stdout, stderr = run_cli("plot", out, "--figure", "groups", "--by", "attribute", "--out", tmp_path / "g.png")
    assert code == 0 and (tmp_path / "g.png").is_file() and (tmp_path / "g.pdf").is_file(), stderr
    code, _, stderr = run_cli("plot", out, "--figure", "groups", "--out", tmp_path / "h.png")
    assert code == 2 and "--by GROUPING" in stderr

    code, _, stderr = run_cli("summarize", out, "--by", "position")
    assert code == 2 and "no grouping 'position'" in stderr and "recorded: attribute, frequency, by_parity" in stderr
    code, _, stderr = run_cli("diagnose", *args, "--grouping", "parity_groups:by_nothing", "--out", tmp_path / "x.h5")
    assert code == 2 and "integer tensor of group ids" in stderr and len(stderr.strip().splitlines()) == 1
    code, _, stderr = run_cli("diagnose", *args, "--grouping", "colour", "--out", tmp_path / "y.h5")
    assert code == 2 and "--grouping colour: not one of attribute, frequency, position" in stderr
    code, _, stderr = run_cli(
        "diagnose", *args, "--eval-set", "snapshot", "--grouping", "attribute", "--out", tmp_path / "z.h5"
    )
    assert code == 2 and "--eval-set attributes" in stderr


def test_frequency_quartiles_are_by_rank_over_the_counted_targets_and_ties_share_one():
    from diag.sources.groupings import quantile_ids

    values = torch.tensor([[0, 0, 0, 0, 0, 1, 2, 3, 5, 9, 7, 100]])
    counted = torch.ones_like(values, dtype=torch.bool)
    ids = quantile_ids(values, counted)
    # 12 counted, quartile = first rank * 4 // 12: the five zeros start at rank 0 (all q1), so q1
    # holds 5 targets and the value at rank 5 starts q2.
    assert ids.tolist() == [[0, 0, 0, 0, 0, 1, 2, 2, 2, 3, 3, 3]]
    counted[0, :5] = False  # the zeros not counted: 7 values, quartile = rank * 4 // 7
    assert quantile_ids(values, counted).tolist() == [[-1] * 5 + [0, 0, 1, 1, 2, 2, 3]]


class _LogitsInADict(torch.nn.Module):
    """A looped model with neither one-pass readout whose forward returns {"scores": logits}."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, depth):
        return {"scores": self.inner(input_ids, depth=depth)}


class _LogitsReadoutOnly(_LogitsInADict):
    """`logits_by_depth` without `nll_by_depth`: scored one forward per depth, never in one pass."""

    def logits_by_depth(self, input_ids, depths):
        raise AssertionError("a model without nll_by_depth is scored one forward per depth")


class _NllReadoutOnly(_LogitsInADict):
    """`nll_by_depth` without `logits_by_depth`: scored one forward per depth too."""

    def nll_by_depth(self, input_ids, targets, depths):
        raise AssertionError("token NLLs come from forwards, not from a mean")


def test_token_nlls_come_from_one_pass_only_for_a_model_with_both_readouts():
    """trainer.scoring.token_nll_by_depth: one `logits_by_depth` pass for a model that has it and
    `nll_by_depth`, one forward per depth otherwise (`logits_of` finding the logits in the
    output), both equal to plain forwards' token NLLs; nll_by_depth takes `logits_of` too."""
    from trainer.model import IGNORE_INDEX
    from trainer.scoring import nll_by_depth, token_nll_by_depth

    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=VOCAB, max_seq_len=T, d_model=32, n_heads=2)).eval()
    with torch.no_grad():
        model.adapter.weight.normal_(0, 0.3)  # the identity initialisation would make every depth alike
    tokens = torch.randint(0, VOCAB, (3, T + 1), generator=torch.Generator().manual_seed(1))
    input_ids, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :4] = IGNORE_INDEX
    depths = [3, 1, 2]
    with torch.no_grad():
        expected = torch.stack(
            [
                F.cross_entropy(
                    model(input_ids, depth=d).flatten(0, 1),
                    targets.flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="none",
                ).view(targets.shape)
                for d in depths
            ]
        )
        passes = []
        one_pass = model.logits_by_depth
        model.logits_by_depth = lambda *args: passes.append(args) or one_pass(*args)
        torch.testing.assert_close(token_nll_by_depth(model, input_ids, targets, depths), expected, rtol=0, atol=1e-6)
        assert len(passes) == 1
        for wrapped in (_LogitsInADict(model), _LogitsReadoutOnly(model), _NllReadoutOnly(model)):
            got = token_nll_by_depth(wrapped, input_ids, targets, depths, logits_of=lambda out: out["scores"])
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        means = nll_by_depth(_LogitsInADict(model), input_ids, targets, depths, logits_of=lambda out: out["scores"])
        counted = targets != IGNORE_INDEX
        torch.testing.assert_close(means, (expected * counted).sum((1, 2)) / counted.sum(), rtol=1e-6, atol=1e-6)
    assert len(passes) == 1
