"""Modeled FLOPs against torch's FlopCounterMode and module parameter counts; the iso-FLOP solver by brute force."""

import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from common.errors import InputError
from trainer.config import load_config
from trainer.flops import (
    eval_flops,
    flops_report,
    format_flops_report,
    iso_flop_updates,
    mean_depth,
    nll_by_depth_flops,
    parameter_counts,
    schedule_flops,
    update_flops,
)
from trainer.model import LoopedTransformer, ModelConfig, RMSNorm
from trainer.schedules import parse_schedule

TINY = load_config("configs/tiny.toml").model
WIDE = replace(TINY, d_model=64, n_heads=2, n_prelude=2, n_coda=2, mlp="swiglu", norm="sandwich", injection="add")
"""Two prelude and two coda blocks, where TINY has one of each: a term that scales with the number of prelude or coda
blocks counts differently here. Also the other MLP, norm and injection variants."""
BATCH, SEQ = 2, 32


@dataclass(frozen=True)
class Counted:
    """What one pass costs by the model's accounting, measured without trainer/flops.py. FlopCounterMode counts
    matmuls only; the model also counts the norm weights as parameters, which hooks on every norm call add. With them
    the modeled count is exact: the 0.12% to 0.15% it is above FlopCounterMode alone is all norm weights."""

    matmuls: int
    """FlopCounterMode's total: every matmul forward and backward, attention over the full T x T scores."""
    head: int
    """The part of `matmuls` spent in the LM head."""
    norms: int
    """Norm weights at a parameter's rate: 2 FLOPs per weight per token forward, 6 with the backward."""

    def total(self, include_head: bool) -> int:
        return self.matmuls + self.norms - (0 if include_head else self.head)


def counted_flops(model: LoopedTransformer, run) -> Counted:
    norms = head = 0

    # A call with autograd on is followed by its backward in these runs (training_update), so it costs 3x its forward.
    def on_norm(module, inputs, output):
        nonlocal norms
        norms += (6 if torch.is_grad_enabled() else 2) * inputs[0].numel()  # [..., d]: weights x tokens

    def on_head(module, inputs, output):
        nonlocal head
        head += (6 if torch.is_grad_enabled() else 2) * inputs[0].numel() * module.out_features

    hooks = [m.register_forward_hook(on_norm) for m in model.modules() if isinstance(m, RMSNorm)]
    hooks.append(model.head.register_forward_hook(on_head))
    # FlopCounterMode has no formula for the fused CPU attention kernel; the math backend
    # decomposes attention into bmm calls, which it counts over the full T x T scores.
    try:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return Counted(matmuls=counter.get_total_flops(), head=head, norms=norms)


def tokens(cfg: ModelConfig, batch_size: int = BATCH, seq_len: int = SEQ) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))


def training_update(model: LoopedTransformer, batch: torch.Tensor, depth: int):
    def run():
        logits = model(batch[:, :-1], depth=depth)  # [B, T, V]
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()

    return run


def assert_matches_with_and_without_head(modeled, measured: Counted):
    """`modeled(**kwargs)` against the measured count, with the head, without it, and by default (without it)."""
    assert modeled(include_embeddings=True) == measured.total(include_head=True)
    assert modeled(include_embeddings=False) == measured.total(include_head=False)
    assert modeled() == measured.total(include_head=False)


@pytest.mark.parametrize(
    "cfg",
    [
        TINY,
        replace(TINY, mlp="swiglu", norm="sandwich"),
        replace(TINY, injection="add", tie_embeddings=True, n_prelude=0, d_ff=100),
    ],
    ids=["tiny", "swiglu-sandwich", "add-tied-no-prelude"],
)
def test_parameter_counts_match_the_modules(cfg):
    with torch.device("meta"):
        model = LoopedTransformer(cfg)
    assert parameter_counts(cfg) == model.parameter_groups()
    shared_head = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0  # counted in both roles
    assert sum(p.numel() for p in model.parameters()) == sum(parameter_counts(cfg).values()) - shared_head


@pytest.mark.parametrize(
    "cfg,depth", [(TINY, 1), (TINY, 4), (TINY, 16), (WIDE, 3)], ids=["tiny-1", "tiny-4", "tiny-16", "wide-3"]
)
def test_update_flops_are_flop_counters_count_exactly(cfg, depth):
    torch.manual_seed(0)
    model = LoopedTransformer(cfg)
    measured = counted_flops(model, training_update(model, tokens(cfg), depth))
    assert_matches_with_and_without_head(
        lambda **head: update_flops(cfg, depth, batch_size=BATCH, seq_len=SEQ, **head), measured
    )


def test_truncated_backprop_counts_forward_only_iterations_at_two_flops_per_parameter():
    cfg = replace(TINY, backprop_depth=2)
    torch.manual_seed(0)
    model = LoopedTransformer(cfg)
    measured = counted_flops(model, training_update(model, tokens(cfg), 6))
    assert_matches_with_and_without_head(
        lambda **head: update_flops(cfg, 6, batch_size=BATCH, seq_len=SEQ, **head), measured
    )
    assert update_flops(cfg, 6, batch_size=BATCH, seq_len=SEQ) < update_flops(TINY, 6, batch_size=BATCH, seq_len=SEQ)


@pytest.mark.parametrize("depth", [1, 2])
def test_truncation_deeper_than_the_depth_costs_nothing(depth):
    # backprop_depth 2: a depth of 1 or 2 backpropagates through every iteration, as without truncation.
    truncated = update_flops(replace(TINY, backprop_depth=2), depth, batch_size=BATCH, seq_len=SEQ)
    assert truncated == update_flops(TINY, depth, batch_size=BATCH, seq_len=SEQ)


@pytest.mark.parametrize("cfg", [TINY, WIDE], ids=["tiny", "wide"])
def test_eval_and_nll_by_depth_flops_are_flop_counters_count_exactly(cfg):
    torch.manual_seed(0)
    model = LoopedTransformer(cfg)
    batch = tokens(cfg)
    with torch.no_grad():
        forward = counted_flops(model, lambda: model(batch[:, :-1], depth=5))
        # Unsorted with a repeat: nll_by_depth reads out once per distinct depth, after the deepest pass's iterations.
        all_depths = counted_flops(model, lambda: model.nll_by_depth(batch[:, :-1], batch[:, 1:], [8, 1, 3, 3]))
    assert_matches_with_and_without_head(
        lambda **head: eval_flops(cfg, 5, batch_size=BATCH, seq_len=SEQ, **head), forward
    )
    assert_matches_with_and_without_head(
        lambda **head: nll_by_depth_flops(cfg, [8, 1, 3, 3], batch_size=BATCH, seq_len=SEQ, **head), all_depths
    )


def test_attention_term_matches_flop_counter_where_attention_dominates():
    # d_model 32 over 512 tokens: the QK^T and AV matmuls are 69% of the count (3.6% in the tiny model), so an error
    # in the attention term shows whole instead of diluted. The math backend computes the full T x T scores before
    # applying the causal mask, and FlopCounterMode counts what it computes: a term halved for causality fails here.
    cfg = replace(TINY, d_model=32, n_heads=2, max_seq_len=512)
    torch.manual_seed(0)
    model = LoopedTransformer(cfg)
    measured = counted_flops(model, training_update(model, tokens(cfg, batch_size=1, seq_len=512), 4))
    assert update_flops(cfg, 4, batch_size=1, seq_len=512, include_embeddings=True) == measured.total(include_head=True)


def test_schedule_flops_is_the_expected_sum_over_sampled_depths():
    shape = dict(batch_size=BATCH, seq_len=SEQ)
    per_depth = {k: update_flops(TINY, k, **shape) for k in range(1, 17)}
    fixed = parse_schedule("fixed:7", seed=0, total_updates=100)
    assert schedule_flops(TINY, fixed, **shape) == pytest.approx(100 * per_depth[7])
    uniform = parse_schedule("uniform:1-16", seed=0, total_updates=100)
    assert schedule_flops(TINY, uniform, **shape) == pytest.approx(100 * sum(per_depth.values()) / 16)
    # Expected cost is linear in E[K]; the realised sum of a sampled run lands close to it.
    for spec in (
        "fixed-first:k0=2,switch=0.5,finish=pln:mean=6,sigma=0.5,max=16",
        "progressive:mean=8,warmup=0.75,shape=linear",
    ):
        schedule = parse_schedule(spec, seed=3, total_updates=3000)
        realised = sum(per_depth[schedule.depth_at(step)] for step in range(3000))
        assert schedule_flops(TINY, schedule, **shape) == pytest.approx(realised, rel=0.02)
        realised_depth = sum(schedule.depth_at(step) for step in range(3000)) / 3000
        assert mean_depth(schedule) == pytest.approx(realised_depth, rel=0.02)


def test_schedule_flops_of_a_prefix():
    shape = dict(batch_size=BATCH, seq_len=SEQ)
    schedule = parse_schedule("fixed-first:k0=3,switch=0.5,finish=uniform:1-16", seed=0, total_updates=100)
    assert schedule_flops(TINY, schedule, updates=40, **shape) == pytest.approx(40 * update_flops(TINY, 3, **shape))
    # 50 updates at K = 3, then uniform 1..16 (E[K] = 8.5): a prefix inside the fixed phase averages 3, one past the
    # switch averages its share of each phase.
    assert mean_depth(schedule, 40) == 3
    assert mean_depth(schedule, 80) == pytest.approx((50 * 3 + 30 * 8.5) / 80)
    assert mean_depth(schedule) == pytest.approx((50 * 3 + 50 * 8.5) / 100)
    with pytest.raises(ValueError):
        schedule_flops(TINY, schedule, updates=101, **shape)


@pytest.mark.parametrize(
    "spec,reference",
    [
        ("uniform:1-16", "fixed-first:k0=4,switch=0.67,finish=uniform:1-16"),
        ("fixed-first:k0=2,switch=0.8,finish=uniform:1-16", "uniform:1-16"),
    ],
)
def test_iso_flop_updates_lands_closest_to_the_reference_compute(spec, reference):
    shape = dict(batch_size=BATCH, seq_len=SEQ)
    budget = schedule_flops(TINY, parse_schedule(reference, seed=0, total_updates=1000), **shape)
    n = iso_flop_updates(TINY, spec, parse_schedule(reference, seed=0, total_updates=1000), **shape)

    def run(updates):
        return schedule_flops(TINY, parse_schedule(spec, seed=0, total_updates=updates), **shape)

    error = abs(run(n) - budget)
    assert error <= abs(run(n - 1) - budget) and error <= abs(run(n + 1) - budget)
    assert error <= update_flops(TINY, 16, **shape)
    assert iso_flop_updates(TINY, spec, budget, **shape) == n


def closest_run_length(run_flops, budget: float, longest: int) -> int:
    """The n in 1..longest whose compute is closest to `budget` (the first on a tie), by trying every one."""
    return min(range(1, longest + 1), key=lambda n: abs(run_flops(n) - budget))


@pytest.mark.parametrize("include_embeddings", [False, True])
def test_iso_flop_updates_is_the_brute_force_answer_for_every_budget(include_embeddings):
    # Budgets from a third of one update to about 200 updates, every third of an update apart: the answer lands on
    # each run length 1..200 and between neighbours on either side, wherever the bisection's steps fall.
    spec = "fixed-first:k0=2,switch=0.8,finish=uniform:1-16"
    shape = dict(batch_size=BATCH, seq_len=SEQ, include_embeddings=include_embeddings)
    costs = {}

    def run_flops(n):
        if n not in costs:
            costs[n] = schedule_flops(TINY, parse_schedule(spec, seed=0, total_updates=n), **shape)
        return costs[n]

    step = update_flops(TINY, 2, **shape) / 3
    for j in range(1, 600):
        budget = j * step
        assert iso_flop_updates(TINY, spec, budget, **shape) == closest_run_length(run_flops, budget, 300), budget


def test_iso_flop_updates_matches_a_reference_schedule_with_the_head_counted():
    # 1,000 updates at K = 1 sized as K = 16: the LM head costs the same at both depths, so the matched length with it
    # counted (more K = 16 updates) differs from the one without it.
    shape = dict(batch_size=BATCH, seq_len=SEQ)
    reference = parse_schedule("fixed:1", seed=0, total_updates=1000)
    matched = {}
    for include_embeddings in (False, True):
        k1, k16 = (update_flops(TINY, k, **shape, include_embeddings=include_embeddings) for k in (1, 16))
        matched[include_embeddings] = iso_flop_updates(
            TINY, "fixed:16", reference, **shape, include_embeddings=include_embeddings
        )
        assert matched[include_embeddings] == closest_run_length(lambda n, k16=k16: n * k16, 1000 * k1, 1000)
    assert matched[True] > matched[False]


@pytest.mark.parametrize("budget", [0.5, 1.0, 1e6])
def test_iso_flop_updates_sizes_a_budget_below_one_update_as_one_update(budget):
    assert budget < update_flops(TINY, 1, batch_size=BATCH, seq_len=SEQ)
    assert iso_flop_updates(TINY, "uniform:1-16", budget, batch_size=BATCH, seq_len=SEQ) == 1


# An infinite budget would double the run length until the compute overflows.
@pytest.mark.parametrize("budget", [0.0, -1.0, math.nan, math.inf])
def test_iso_flop_updates_rejects_a_budget_that_is_not_finite_and_positive(budget):
    with pytest.raises(InputError, match="the FLOP budget must be a finite number > 0"):
        iso_flop_updates(TINY, "uniform:1-16", budget, batch_size=BATCH, seq_len=SEQ)


@pytest.mark.parametrize("include_embeddings", [False, True])
def test_flops_report_rows_and_match_with_and_without_the_head(include_embeddings):
    # fixed:4 against uniform:1-16 over 40 updates, and the run at K = 16 that matches the first row's compute.
    head = 6 * BATCH * SEQ * TINY.vocab_size * TINY.d_model  # the LM head matmul of one update, forward and backward
    shape = dict(batch_size=BATCH, seq_len=SEQ, include_embeddings=include_embeddings)
    report = flops_report(TINY, ["fixed:4", "uniform"], updates=40, match="fixed:16", **shape)
    assert (report.updates, report.batch_size, report.seq_len) == (40, BATCH, SEQ)
    assert report.include_embeddings is include_embeddings
    per_update = {k: update_flops(TINY, k, batch_size=BATCH, seq_len=SEQ) + include_embeddings * head for k in (4, 16)}
    uniform_per_update = sum(update_flops(TINY, k, **shape) for k in range(1, 17)) / 16
    fixed, uniform = report.schedules
    assert (fixed.spec, fixed.mean_depth, uniform.spec, uniform.mean_depth) == ("fixed:4", 4, "uniform:1-16", 8.5)
    assert fixed.modeled_flops == pytest.approx(40 * per_update[4])
    assert fixed.relative_to_uniform == pytest.approx(per_update[4] / uniform_per_update)
    assert uniform.relative_to_uniform == 1.0
    n = closest_run_length(lambda n: n * per_update[16], 40 * per_update[4], 40)
    assert (report.match.spec, report.match.reference, report.match.updates) == ("fixed:16", "fixed:4", n)
    assert report.match.modeled_flops == pytest.approx(n * per_update[16])
    assert report.match.reference_flops == fixed.modeled_flops


def test_flops_report_without_a_match_and_by_default_without_the_head():
    report = flops_report(TINY, ["fixed:4"], updates=10, batch_size=BATCH, seq_len=SEQ)
    assert report.match is None and report.include_embeddings is False
    assert report.schedules[0].modeled_flops == pytest.approx(10 * update_flops(TINY, 4, batch_size=BATCH, seq_len=SEQ))
    assert report.to_dict()["match"] is None


@pytest.mark.parametrize("depth", [0, -1, True, 2.0])
def test_a_depth_that_is_not_a_positive_integer_is_refused(depth):
    with pytest.raises(InputError, match="depth must be a positive integer"):
        update_flops(TINY, depth, batch_size=BATCH, seq_len=SEQ)


@pytest.mark.parametrize("shape", [(0, SEQ), (BATCH, 0)])
def test_an_empty_batch_is_refused_and_one_token_is_not(shape):
    batch_size, seq_len = shape
    with pytest.raises(InputError, match="batch_size and seq_len must be >= 1"):
        update_flops(TINY, 2, batch_size=batch_size, seq_len=seq_len)
    assert update_flops(TINY, 2, batch_size=1, seq_len=1) > 0


def test_the_flops_table_written_out_in_full():
    # The tiny-monitor model (test_recommend.py works its FLOPs by hand: 2,560,512 per token once and 2,755,584 per
    # iteration): fixed:4 over 1,024 updates of 32 x 64 tokens is 2,048 x (1,024 x 2,560,512 + 4,096 x 2,755,584)
    # = 2.8485e13, uniform:1-16 (depth sum 8,704) 5.4490e13; 535 uniform updates come closest to fixed:4's compute.
    config = load_config("configs/tiny-monitor.toml")
    report = flops_report(
        config.model, ["fixed:4", "uniform:1-16"], updates=1024, batch_size=32, seq_len=64, match="uniform:1-16"
    )
    assert format_flops_report(report, config.model, source="tiny.toml") == "\n".join(
        [
            "tiny.toml: 0.8M non-embedding parameters; 1,024 updates x 32 x 64 tokens (2.10M tokens); LM head excluded",
            "schedule      modeled FLOPs  mean depth  vs uniform:1-16",
            "fixed:4          2.8485e+13       4.000           52.28%",
            "uniform:1-16     5.4490e+13       8.500          100.00%",
            "match: uniform:1-16 over 535 updates (2.8469e+13 FLOPs) matches fixed:4 over 1,024 updates "
            "(2.8485e+13 FLOPs)",
        ]
    )
    with_head = flops_report(
        config.model, ["fixed:4"], updates=1024, batch_size=32, seq_len=64, include_embeddings=True
    )
    first, header, row = format_flops_report(with_head, config.model, source="tiny.toml").splitlines()
    assert first.endswith("LM head included") and header.startswith("schedule  modeled FLOPs")
    # A billion tokens and more are counted in billions, fewer in millions.
    billion = flops_report(config.model, ["fixed:4"], updates=1_000_000, batch_size=1, seq_len=1000)
    assert "1,000,000 updates x 1 x 1000 tokens (1.00B tokens)" in format_flops_report(
        billion, config.model, source="x"
    )
    fewer = flops_report(config.model, ["fixed:4"], updates=999_999, batch_size=1, seq_len=1000)
    assert "(1000.00M tokens)" in format_flops_report(fewer, config.model, source="x")
    # Just past a rounding boundary (1.005000001): divided by anything but 1e9 or 1e6 it rounds down.
    for updates, text in ((1_005_000_001, "(1.01B tokens)"), (1_005_001, "(1.01M tokens)")):
        report = flops_report(config.model, ["fixed:4"], updates=updates, batch_size=1, seq_len=1)
        assert text in format_flops_report(report, config.model, source="x")
