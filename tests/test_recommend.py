"""`depthdiag recommend` (analysis/recommend.py, diag/in_training/recommend.py): F from a pilot's monitor file,
the switch for a run of N updates, the spec and its modeled compute; worked by hand on a
synthetic monitor file."""

import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner
from scipy import stats

from analysis.monitor import open_monitor
from analysis.recommend import describe_finish, finish_length, format_checks, switch_plan, switch_text
from analysis.stats import IntervalOptions
from analysis.store import write_dataset
from common.errors import InputError
from depthdiag.cli import main
from depthdiag.grid import load_grid
from diag.in_training.recommend import RecommendConfig, comparison_grid, format_recommendation, recommend
from trainer.config import load_config

# The pilot: configs/tiny-monitor.toml (fixed-first K0=4, switch at step 768 of 1,024), checked every 32
# updates from the switch on (and once in the fixed phase, which F ignores). Depth-averaged,
# batch-mean benefit of each check:
STEPS = (512, 768, 800, 832, 864, 896, 928, 960, 992, 1024)
BENEFITS = (0.01, 0.20, 0.05, 0.006, 0.004, 0.002, -0.003, 0.001, 0.0, 0.003)
# By hand, rule fraction, threshold 5%: 5% of the switch's 0.20 is 0.01. After the switch,
# 800 (0.05) is above it; 832 (0.006) and every later check are below: 7 settled checks >= 2.
# F = 832 - 768 = 64 uniform updates (the crossing lies in (32, 64]); margin 1.5 ->
# F' = ceil(1.5 x 64) = 96; N = 1024 -> switch = 1 - 96/1024 = 0.90625 (step 928).
SWITCH = 768
SPREAD = 0.001  # two batches at mean -/+ SPREAD


def pilot_monitor(benefits=BENEFITS, steps=STEPS, switch=SWITCH, spread=SPREAD, config=None) -> xr.Dataset:
    """A monitor file whose check at step i has batch benefits benefits[i] -/+ spread[i] and, across
    the three serving depths, -0.01, 0, +0.01 around that: the depth average of each batch is
    benefits[i] -/+ spread[i], so the batch mean is benefits[i]."""
    spread = np.broadcast_to(np.asarray(spread, dtype=np.float64), (len(steps),))
    per_batch = np.asarray(benefits)[:, None] + spread[:, None] * np.array([-1.0, 1.0])[None, :]
    benefit = per_batch[:, :, None] + np.array([-0.01, 0.0, 0.01])[None, None, :]  # [step, batch, serving]
    shape = benefit.shape[:2]
    nll_deep = np.full(benefit.shape, 3.0)
    ud = ("step", "batch", "update_depth")
    return xr.Dataset(
        {
            "nll": (("step", "batch", "update_depth", "serving_depth"), np.stack([nll_deep + benefit, nll_deep], 2)),
            "nll_before": (("step", "serving_depth"), np.full((len(steps), 3), 3.1)),
            "benefit": (("step", "batch", "serving_depth"), benefit),
            "update_rms": (ud, np.full(shape + (2,), 1e-3)),
            "rms_scale": (ud, np.ones(shape + (2,))),
            "train_loss": (ud, np.full(shape + (2,), 3.0)),
            "update_cosine": (("step", "batch"), np.full(shape, 0.9)),
            "lr": (("step",), np.full(len(steps), 2e-3)),
            "depth_probability": (("step", "depth"), np.full((len(steps), 16), 1 / 16)),
        },
        coords={
            "step": np.array(steps),
            "batch": np.arange(2),
            "update_depth": [4, 16],
            "serving_depth": [1, 2, 3],
            "depth": np.arange(1, 17),
        },
        attrs={
            "kind": "monitor",
            "switch_step": switch,
            "schedule": "fixed-first:k0=4,switch=0.75,finish=uniform:1-16",
            "config": (config or load_config("configs/tiny-monitor.toml", ["monitor.every=32"])).to_json(),
        },
    )


def test_f_and_the_switch_by_hand():
    finish = finish_length(pilot_monitor(), threshold=0.05, checks=2)
    assert finish.rule == "fraction" and finish.switch_step == 768
    assert finish.switch.mean == pytest.approx(0.20) and finish.switch.n == 2
    assert [check.step for check in finish.checks] == [800, 832, 864, 896, 928, 960, 992, 1024]  # not 512
    assert [check.settled for check in finish.checks] == [False] + [True] * 7
    assert (finish.finish_updates, finish.after, finish.settled_checks) == (64, 32, 7)

    plan = switch_plan(finish.finish_updates, updates=1024, margin=1.5)
    assert plan.planned_finish_updates == 96  # ceil(1.5 x 64)
    assert plan.switch == 0.90625 and plan.switch_text == "0.90625"  # 1 - 96/1024
    assert plan.switch_step == 928 and not plan.clamped


def test_a_dip_that_rebounds_does_not_count_and_the_run_must_be_checks_long():
    # 832 dips below 0.01, 864 rebounds to 0.012: settled for good only from 896, F = 896 - 768 = 128.
    rebound = list(BENEFITS)
    rebound[STEPS.index(864)] = 0.012
    assert finish_length(pilot_monitor(rebound)).finish_updates == 128
    # Only the last two checks (992, 1024) settle: enough for --checks 2 (F = 992 - 768 = 224),
    # not for --checks 3.
    late = [0.01, 0.20, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.005, 0.004]
    assert finish_length(pilot_monitor(late), checks=2).finish_updates == 224
    with pytest.raises(InputError, match=r"no F found; .* \(the last 2 check\(s\) settle, fewer than --checks 3"):
        finish_length(pilot_monitor(late), checks=3)


def test_the_zero_rule_reads_the_interval_over_batches():
    # At 800 the two batches are 0.05 -/+ 0.01: t interval 0.05 +- 12.706 x 0.01 (t(0.975, df=1) x s/sqrt(2),
    # s = 0.01 x sqrt(2)) contains 0, so the zero rule settles from 800 (F = 32), the fraction rule from 832.
    spread = [SPREAD] * len(STEPS)
    spread[STEPS.index(800)] = 0.01
    ds = pilot_monitor(spread=spread)
    zero = finish_length(ds, rule="zero")
    assert zero.finish_updates == 32 and zero.checks[0].contains_zero and not zero.checks[0].below_threshold
    assert finish_length(ds, rule="either").finish_updates == 32
    assert finish_length(ds, rule="fraction").finish_updates == 64


def test_refusals_name_the_file():
    with pytest.raises(InputError, match=r"^pilot\.h5: the pilot has no switch \(uniform:1-16\)"):
        ds = pilot_monitor(switch=-1)
        ds.attrs["schedule"] = "uniform:1-16"
        finish_length(ds, source="pilot.h5")
    with pytest.raises(
        InputError,
        match=r"^pilot\.h5: no F found; the finishing phase needs longer than the pilot's 256 updates after the switch",
    ):
        finish_length(pilot_monitor([0.01, 0.2] + [0.05] * 8), source="pilot.h5")
    with pytest.raises(InputError, match=r"^pilot\.h5: no check at the switch \(step 700\)"):
        finish_length(pilot_monitor(switch=700), source="pilot.h5")
    with pytest.raises(InputError, match=r"benefit at the switch .* not positive"):
        finish_length(pilot_monitor([0.01, -0.02] + [0.0] * 8), source="pilot.h5")


def test_switch_plan_clamps_and_rounds():
    clamped = switch_plan(64, updates=80, margin=1.5)  # F' = 96 > 80: the whole run finishes
    assert (clamped.switch, clamped.switch_text, clamped.switch_step, clamped.clamped) == (0.0, "0", 0, True)
    assert switch_plan(10, updates=100, margin=1.1).planned_finish_updates == 11  # not ceil(11.000000000000002)
    assert switch_plan(64, updates=96, margin=1.5).switch_step == 0  # F' = N exactly: switch 0, not clamped
    # 1 - 100/3000 = 0.9666...: six significant digits already give round(s x 3000) = 2900.
    assert switch_text(2900, 3000) == "0.966667"
    with pytest.raises(InputError, match="margin must be a number >= 1"):
        switch_plan(64, updates=1024, margin=0.5)


def test_the_hand_pilot_described_in_one_sentence():
    # Every number from the hand calculation at the top: F = 64 from step 768 + 64 = 832, 7 settled checks of the
    # 2 needed, the crossing in (32, 64], two batches per check.
    finish = finish_length(pilot_monitor())
    assert finish.checks_needed == 2 and finish.level == 0.95
    assert [check.below_threshold for check in finish.checks] == [False] + [True] * 7
    assert describe_finish(finish) == (
        "F = 64 uniform updates: from step 832 on, every check settled (mean benefit below 5% of the switch's), "
        "7 checks (needed: 2); the crossing lies in (32, 64]; intervals over 2 batches of one run (batch noise only)"
    )
    one = finish_length(pilot_monitor([0.01, 0.2] + [0.1] * 7 + [0.001]), checks=1)
    assert "1 check (needed: 1); the crossing lies in (224, 256]" in describe_finish(one)


def test_the_zero_rule_ignores_a_small_benefit_that_is_clearly_positive():
    # From 832 on the benefit is 0.004 -/+ 1e-5: below 5% of the switch's 0.20, but its interval over batches
    # (0.004 +- 12.706 x 1e-5) excludes 0. The fraction and either rules settle there; the zero rule never does.
    spread = [SPREAD, SPREAD, SPREAD] + [1e-5] * 7
    ds = pilot_monitor([0.01, 0.2, 0.05] + [0.004] * 7, spread=spread)
    assert finish_length(ds, rule="fraction").finish_updates == 64
    assert finish_length(ds, rule="either").finish_updates == 64
    with pytest.raises(InputError, match="no F found"):
        finish_length(ds, rule="zero")


def test_finish_and_plan_as_dicts_carry_their_fields():
    finish = finish_length(pilot_monitor())
    plan = switch_plan(finish.finish_updates, updates=1024)
    assert finish.to_dict()["finish_updates"] == 64 and finish.to_dict()["checks"][0]["step"] == 800
    assert plan.to_dict() == {
        "finish_updates": 64,
        "margin": 1.5,
        "planned_finish_updates": 96,
        "updates": 1024,
        "switch": 0.90625,
        "switch_text": "0.90625",
        "switch_step": 928,
        "clamped": False,
    }


def test_settled_from_the_first_check_after_the_switch_brackets_from_the_switch():
    finish = finish_length(pilot_monitor([0.01, 0.2] + [0.001] * 8))
    assert (finish.finish_updates, finish.after, finish.settled_checks) == (32, 0, 8)


def test_the_default_needs_two_settled_checks():
    late = [0.01, 0.20, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.005, 0.004]  # only 992 and 1024 settle
    assert finish_length(pilot_monitor(late)).finish_updates == 224
    with pytest.raises(InputError, match="the last 1 check\\(s\\) settle, fewer than --checks 2"):
        finish_length(pilot_monitor(late[:-2] + [0.1, 0.004]))  # only 1024 settles


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(threshold=0.0), "threshold must be a fraction in"),
        (dict(threshold=1.0), "threshold must be a fraction in"),
        (dict(threshold=1.5), "threshold must be a fraction in"),
        (dict(checks=0), "checks must be a positive integer"),
        (dict(checks=True), "checks must be a positive integer"),
        (dict(checks=1.5), "checks must be a positive integer"),
    ],
)
def test_finish_length_rejects_bad_settings(kwargs, message):
    with pytest.raises(InputError, match=message):
        finish_length(pilot_monitor(), **kwargs)


def test_refusals_name_a_monitor_file_by_default():
    ds = pilot_monitor(switch=-1)
    del ds.attrs["schedule"]
    with pytest.raises(InputError, match=r"^monitor file: the pilot has no switch: recommend needs"):
        finish_length(ds)
    with pytest.raises(InputError, match=r"the switch \(step 768\) is \+0, not positive"):
        finish_length(pilot_monitor([0.01, 0.0] + [0.0] * 8))
    with pytest.raises(InputError, match=r"pilot's 256 updates after the switch \(the last check has not settled;"):
        finish_length(pilot_monitor([0.01, 0.2] + [0.001] * 7 + [0.1]))
    # A pilot that ends at its switch has no check after it.
    with pytest.raises(InputError, match=r"pilot's 0 updates after the switch \(the last check has not settled;"):
        finish_length(pilot_monitor(BENEFITS[:2], steps=STEPS[:2]))


def test_switch_plan_at_its_smallest_valid_values_and_its_defaults():
    # F = 1, margin 1, N = 1: F' = 1 = N, the whole run finishes without being clamped.
    smallest = switch_plan(1, updates=1, margin=1)
    assert (smallest.planned_finish_updates, smallest.switch_step, smallest.switch_text, smallest.clamped) == (
        1,
        0,
        "0",
        False,
    )
    assert switch_plan(64, updates=1024).planned_finish_updates == 96  # the default margin 1.5
    assert switch_plan(1, updates=100, margin=1.2).planned_finish_updates == 2  # ceil(1.2), not round(1.2)
    assert switch_plan(5, updates=100, margin=1.5).planned_finish_updates == 8  # ceil(7.5)
    for updates in (0, True, 100.0):
        with pytest.raises(InputError, match="updates must be a positive integer"):
            switch_plan(64, updates=updates)
    with pytest.raises(InputError, match="finishing-phase length must be >= 1"):
        switch_plan(0, updates=100)


def run(*args):
    result = CliRunner().invoke(main, ["recommend", *args])
    return result.exit_code, result.stdout, result.stderr


def modeled_compute(depth_sum: float, *, updates: int = 1024, head: bool = False) -> float:
    """Modeled FLOPs of `updates` updates of the pilot's model (tiny-monitor.toml: d = 128, gelu MLP of width
    4d = 512, pre-norm, concat adapter, 1/2/1 prelude/core/coda blocks, vocabulary 512) whose depths sum to
    `depth_sum`, worked from the parameter counts: 6 FLOPs per parameter per token forward and backward, norm
    weights included, the LM head (128 x 512) only with `head`, plus the QK^T and AV matmuls over the full 64 x 64
    scores (4 x 64 x 128 per token forward per block, three times that with the backward)."""
    block = 4 * 128**2 + 2 * 128 * 512 + 2 * 128  # qkv and proj, MLP, two norms: 196,864
    attention = 3 * 4 * 64 * 128
    once = 6 * (2 * block + 2 * 128) + 2 * attention  # prelude, coda, the loop and final norms: 2,560,512 per token
    if head:
        once += 6 * 128 * 512
    per_iteration = 6 * (2 * 128**2 + 2 * block) + 2 * attention  # the adapter (2d -> d), two core blocks: 2,755,584
    return 32 * 64 * (updates * once + depth_sum * per_iteration)  # 32 x 64 tokens per update


def test_recommend_command(tmp_path):
    path = tmp_path / "monitor.h5"
    write_dataset(pilot_monitor(), path)
    code, out, err = run(str(path), "--updates", "1024")
    assert code == 0, err
    assert "F = 64 uniform updates" in out and "F' = ceil(1.5 x 64) = 96" in out
    assert "switch = 1 - 96/1,024 = 0.90625" in out
    assert "recommended: fixed-first:k0=4,switch=0.90625,finish=uniform:1-16" in out
    # The percentages of the hand calculation below.
    assert "fixed-first:k0=4,switch=0.90625,finish=uniform:1-16: 56.75% of uniform:1-16 (saves 43.25%)" in out
    assert (
        "fixed-first:k0=4,switch=0.8,finish=uniform:1-16 (the paper's 80% switch): 61.83% of uniform:1-16; "
        "the recommendation needs 91.78% of its compute (saves 8.22%)"
    ) in out

    code, out, err = run(str(path), "--updates", "1024", "--json")
    assert code == 0, err
    document = json.loads(out)
    assert document["finish"]["finish_updates"] == 64 and document["plan"]["planned_finish_updates"] == 96
    assert document["plan"]["switch"] == 0.90625 and document["plan"]["switch_step"] == 928
    assert document["spec"] == "fixed-first:k0=4,switch=0.90625,finish=uniform:1-16"
    assert document["paper"]["spec"] == "fixed-first:k0=4,switch=0.8,finish=uniform:1-16"
    # Expected depth sums over the 1,024 updates (E[K] = 8.5 under uniform:1-16): K0 = 4 up to the switch step,
    # 928 for the recommendation and round(0.8 x 1,024) = 819 for the paper's switch, uniform after it.
    recommended = modeled_compute(928 * 4 + 96 * 8.5)
    paper = modeled_compute(819 * 4 + 205 * 8.5)
    uniform = modeled_compute(1024 * 8.5)
    assert document["recommended"]["modeled_flops"] == pytest.approx(recommended)
    assert document["paper"]["modeled_flops"] == pytest.approx(paper)
    assert document["uniform_flops"] == pytest.approx(uniform)
    assert document["recommended"]["relative_to_uniform"] == pytest.approx(recommended / uniform)
    assert document["paper"]["relative_to_uniform"] == pytest.approx(paper / uniform)
    assert document["saving_vs_uniform"] == pytest.approx(1 - recommended / uniform)
    assert document["saving_vs_paper"] == pytest.approx(1 - recommended / paper)

    late = tmp_path / "late.h5"
    write_dataset(pilot_monitor([0.01, 0.2] + [0.05] * 8), late)
    code, out, err = run(str(late), "--updates", "1024")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"depthdiag: error: {late}: no F found; the finishing phase needs longer than")

    uniform = tmp_path / "uniform.h5"
    from_scratch = pilot_monitor(switch=-1, config=load_config("configs/tiny-uniform-monitor.toml"))
    from_scratch.attrs["schedule"] = "uniform:1-16"
    write_dataset(from_scratch, uniform)
    code, out, err = run(str(uniform), "--updates", "1024")
    assert code == 2 and err.strip().splitlines() == [
        f"depthdiag: error: {uniform}: the pilot has no switch (uniform:1-16): "
        "recommend needs a fixed-first pilot monitored at its switch"
    ]


# The hand pilot's checks after the switch: batch means BENEFITS[2:], each +- t(0.975, df=1) x 0.001 = 0.0127
# (two batches 0.001 either side of the mean: s/sqrt(2) = 0.001); "< 5% of switch": mean < 0.01.
HAND_CHECKS = """\
step  uniform updates  mean benefit    95% CI (batches)  < 5% of switch  CI contains 0   settled
 800               32       +0.0500  [+0.0373, +0.0627]              no             no        no
 832               64       +0.0060  [-0.0067, +0.0187]             yes            yes  yes <- F
 864               96       +0.0040  [-0.0087, +0.0167]             yes            yes       yes
 896              128       +0.0020  [-0.0107, +0.0147]             yes            yes       yes
 928              160       -0.0030  [-0.0157, +0.0097]             yes            yes       yes
 960              192       +0.0010  [-0.0117, +0.0137]             yes            yes       yes
 992              224       +0.0000  [-0.0127, +0.0127]             yes            yes       yes
1024              256       +0.0030  [-0.0097, +0.0157]             yes            yes       yes"""


def test_the_checks_table_written_out_in_full():
    assert format_checks(finish_length(pilot_monitor())) == HAND_CHECKS
    # At the 90% level the half-width is t(0.95, df=1) x 0.001 = 0.0063; 0.5 x the switch's 0.20 is 0.10, which
    # only 800 (0.05) is below besides the later checks: every check settles, the table says so in every column.
    finish = finish_length(pilot_monitor(), threshold=0.5, options=IntervalOptions(level=0.9))
    half = stats.t.ppf(0.95, df=1) * SPREAD
    assert finish.checks[0].lower == pytest.approx(0.05 - half) and finish.checks[0].upper == pytest.approx(0.05 + half)
    assert format_checks(finish).splitlines()[:3] == [
        "step  uniform updates  mean benefit    90% CI (batches)  < 50% of switch  CI contains 0   settled",
        " 800               32       +0.0500  [+0.0437, +0.0563]              yes             no  yes <- F",
        " 832               64       +0.0060  [-0.0003, +0.0123]              yes            yes       yes",
    ]


def test_the_interval_is_over_batches_at_the_level_asked():
    finish = finish_length(pilot_monitor(), options=IntervalOptions(level=0.9))
    assert finish.level == 0.9 and finish.switch.unit == "batch" and finish.switch.n == 2
    low, high = stats.t.interval(0.9, df=1, loc=0.2, scale=SPREAD)
    assert (finish.switch.lower, finish.switch.upper) == (pytest.approx(low), pytest.approx(high))


def test_settling_at_the_exact_threshold_and_an_interval_touching_zero():
    # Batches without spread: the switch 0.25, the first check after it 0.125 = 0.5 x 0.25 exactly (not below
    # half the switch's benefit), every later one exactly 0 (its interval [0, 0] contains 0, at both ends).
    ds = pilot_monitor()
    ds["benefit"][:] = np.array([0.01, 0.25, 0.125] + [0.0] * 7)[:, None, None]
    for rule in ("fraction", "zero", "either"):
        finish = finish_length(ds, threshold=0.5, rule=rule)
        assert finish.finish_updates == 64 and finish.after == 32, rule
        first, second = finish.checks[:2]
        assert (first.below_threshold, first.contains_zero, first.settled) == (False, False, False)
        assert (second.lower, second.upper) == (0.0, 0.0) and second.contains_zero and second.below_threshold


def test_one_batch_per_check_serves_the_fraction_rule_only():
    one = pilot_monitor().isel(batch=[0])
    finish = finish_length(one)
    assert finish.finish_updates == 64 and {check.n for check in finish.checks} == {1}
    assert "intervals over 1 batches of one run" in describe_finish(finish)
    for rule in ("zero", "either"):
        with pytest.raises(InputError, match=rf"^pilot\.h5: one batch per check gives no interval .* '{rule}' rule"):
            finish_length(one, source="pilot.h5", rule=rule)


def test_checks_with_different_batch_counts_are_described_as_a_range():
    ds = pilot_monitor()
    ds["benefit"][STEPS.index(832), 1, :] = np.nan  # one batch of the check at 832 lost
    finish = finish_length(ds)
    assert [check.n for check in finish.checks] == [2, 1, 2, 2, 2, 2, 2, 2]
    assert describe_finish(finish).endswith("intervals over 1-2 batches of one run (batch noise only)")


def test_a_margin_is_read_to_nine_decimals():
    # 1.10000000003 x 10 = 11.0000000003: 11 to nine decimals, so F' = 11 (to ten decimals it would ask for 12).
    assert switch_plan(10, updates=100, margin=1.10000000003).planned_finish_updates == 11
    assert switch_plan(10, updates=100, margin=1.1000000003).planned_finish_updates == 12


def hand_pilot(tmp_path, **monitor_kwargs):
    path = tmp_path / "monitor.h5"
    write_dataset(pilot_monitor(**monitor_kwargs), path)
    return path


def test_the_printed_recommendation_written_out_in_full(tmp_path):
    path = hand_pilot(tmp_path)
    rec = recommend(RecommendConfig(monitor=path, updates=1024))
    assert format_recommendation(rec) == "\n".join(
        [
            f"pilot: {path} (fixed-first:k0=4,switch=0.75,finish=uniform:1-16 over 1,024 updates, switch at step 768)",
            "depth-averaged benefit at the switch: +0.2000 [+0.1873, +0.2127] over 2 batches; after it:",
            HAND_CHECKS,
            "F = 64 uniform updates: from step 832 on, every check settled (mean benefit below 5% of the switch's), "
            "7 checks (needed: 2); the crossing lies in (32, 64]; intervals over 2 batches of one run "
            "(batch noise only)",
            "F' = ceil(1.5 x 64) = 96 finishing updates (safety margin 1.5)",
            "for 1,024 updates: switch = 1 - 96/1,024 = 0.90625, the switch at step 928 (96 finishing updates)",
            "recommended: fixed-first:k0=4,switch=0.90625,finish=uniform:1-16",
            "modeled training compute (the pilot's model, 32 x 64 tokens per update, LM head excluded), "
            "over 1,024 updates:",
            "  fixed-first:k0=4,switch=0.90625,finish=uniform:1-16: 56.75% of uniform:1-16 (saves 43.25%)",
            "  fixed-first:k0=4,switch=0.8,finish=uniform:1-16 (the paper's 80% switch): 61.83% of uniform:1-16; "
            "the recommendation needs 91.78% of its compute (saves 8.22%)",
        ]
    )
    assert (rec.monitor, rec.pilot_schedule, rec.pilot_updates) == (
        str(path),
        "fixed-first:k0=4,switch=0.75,finish=uniform:1-16",
        1024,
    )
    assert (rec.batch_size, rec.seq_len, rec.include_embeddings) == (32, 64, False)


def test_a_recommendation_that_costs_more_than_the_paper_and_counts_the_head(tmp_path):
    # N = 200: F' = 96 leaves 104 updates at K0 = 4, fewer than the paper's round(0.8 x 200) = 160.
    rec = recommend(RecommendConfig(monitor=hand_pilot(tmp_path), updates=200, include_embeddings=True))
    recommended = modeled_compute(104 * 4 + 96 * 8.5, updates=200, head=True)
    paper = modeled_compute(160 * 4 + 40 * 8.5, updates=200, head=True)
    uniform = modeled_compute(200 * 8.5, updates=200, head=True)
    assert rec.recommended.modeled_flops == pytest.approx(recommended) and rec.uniform_flops == pytest.approx(uniform)
    assert rec.saving_vs_paper == pytest.approx(1 - recommended / paper) and rec.saving_vs_paper < 0
    lines = format_recommendation(rec).splitlines()
    assert lines[-5:] == [
        "for 200 updates: switch = 1 - 96/200 = 0.52, the switch at step 104 (96 finishing updates)",
        "recommended: fixed-first:k0=4,switch=0.52,finish=uniform:1-16",
        "modeled training compute (the pilot's model, 32 x 64 tokens per update, LM head included), over 200 updates:",
        f"  fixed-first:k0=4,switch=0.52,finish=uniform:1-16: {recommended / uniform:.2%} of uniform:1-16 "
        f"(saves {1 - recommended / uniform:.2%})",
        f"  fixed-first:k0=4,switch=0.8,finish=uniform:1-16 (the paper's 80% switch): {paper / uniform:.2%} of "
        f"uniform:1-16; the recommendation needs {recommended / paper:.2%} of its compute "
        f"(costs {recommended / paper - 1:.2%} more)",
    ]
    assert lines[-1].endswith("needs 121.10% of its compute (costs 21.10% more)")


def test_a_recommendation_equal_to_the_papers_saves_nothing_and_a_clamped_one_finishes_throughout(tmp_path):
    path = hand_pilot(tmp_path)
    # N = 480: F' = 96 is exactly the paper's last 20%: the same schedule, the same compute.
    same = recommend(RecommendConfig(monitor=path, updates=480))
    assert same.spec == same.paper.spec == "fixed-first:k0=4,switch=0.8,finish=uniform:1-16"
    assert same.saving_vs_paper == 0.0
    assert format_recommendation(same).endswith("the recommendation needs 100.00% of its compute (saves 0.00%)")
    # N = 80 < F' = 96: the whole run finishes.
    clamped = format_recommendation(recommend(RecommendConfig(monitor=path, updates=80))).splitlines()
    assert clamped[-5] == (
        "for 80 updates: switch = 0 (clamped from 1 - 96/80 < 0: the whole run is the finishing phase and still "
        "shorter than F'), the switch at step 0 (80 finishing updates)"
    )
    assert clamped[-4] == "recommended: fixed-first:k0=4,switch=0,finish=uniform:1-16"


def test_recommend_passes_every_setting_on(tmp_path):
    path = hand_pilot(tmp_path)
    options = IntervalOptions(level=0.9)
    config = RecommendConfig(
        monitor=path, updates=1024, threshold=0.3, checks=3, margin=2.0, rule="either", options=options
    )
    rec = recommend(config)
    expected = finish_length(open_monitor(path), threshold=0.3, checks=3, rule="either", options=options)
    assert rec.finish == expected
    assert (rec.finish.rule, rec.finish.checks_needed, rec.finish.level) == ("either", 3, 0.9)
    # 0.3 x 0.20 = 0.06: every check after the switch is below it, F = 32; F' = 2 x 32 = 64.
    assert rec.finish.finish_updates == 32
    assert (rec.plan.margin, rec.plan.planned_finish_updates, rec.plan.switch_step) == (2.0, 64, 960)


def test_the_pilots_config_is_read_and_refused_by_file(tmp_path):
    path = tmp_path / "monitor.h5"
    broken = pilot_monitor()
    broken.attrs["config"] = "{not json"
    write_dataset(broken, path)
    with pytest.raises(InputError, match=rf"^{path}: config is not valid JSON"):
        recommend(RecommendConfig(monitor=path, updates=1024))
    # A uniform pilot that still records a switch step: the schedule has no switch to move.
    write_dataset(pilot_monitor(config=load_config("configs/tiny-uniform-monitor.toml")), path)
    with pytest.raises(InputError, match=rf"^{path}: the pilot's schedule uniform:1-16 is not fixed-first"):
        recommend(RecommendConfig(monitor=path, updates=1024))


def depth_monitor_pilot(tmp_path, **settings):
    """The hand pilot as diag.DepthMonitor writes it in a loop of another codebase: its config
    attribute is the monitor's settings, with no depthdiag run config."""
    path = tmp_path / "monitor.h5"
    ds = pilot_monitor()
    ds.attrs["config"] = json.dumps({"depth_monitor": settings, "model": "elsewhere"})
    write_dataset(ds, path)
    return path


def test_a_pilot_monitored_in_another_loop_is_costed_in_core_iterations(tmp_path):
    path = depth_monitor_pilot(tmp_path, schedule="fixed-first:k0=4,switch=0.75,finish=uniform:1-16", updates=1024)
    rec = recommend(RecommendConfig(monitor=path, updates=1024))
    # By hand: the switch at step 928 (as with the depthdiag pilot), then 96 updates of mean depth 8.5;
    # the paper's switch at round(0.8 x 1024) = 819; uniform:1-16 costs 8.5 an update throughout.
    recommended, paper, uniform = 928 * 4 + 96 * 8.5, 819 * 4 + 205 * 8.5, 1024 * 8.5
    assert rec.cost_model == "core iterations" and (rec.batch_size, rec.seq_len) == (None, None)
    assert rec.spec == "fixed-first:k0=4,switch=0.90625,finish=uniform:1-16" and rec.pilot_updates == 1024
    assert rec.recommended.modeled_flops == pytest.approx(recommended)
    assert rec.recommended.relative_to_uniform == pytest.approx(recommended / uniform)
    assert rec.paper.spec == "fixed-first:k0=4,switch=0.8,finish=uniform:1-16"
    assert rec.paper.modeled_flops == pytest.approx(paper)
    assert rec.paper.relative_to_uniform == pytest.approx(paper / uniform)
    assert rec.uniform_flops == pytest.approx(uniform)
    assert rec.saving_vs_paper == pytest.approx(1 - recommended / paper)
    assert "training compute as core iterations" in format_recommendation(rec)
    # The pilot's own length and seed are read (a pilot of 2,048 updates switches at step 1,536).
    path = depth_monitor_pilot(
        tmp_path, schedule="fixed-first:k0=2,switch=0.75,finish=uniform:1-8", updates=2048, seed=3
    )
    rec = recommend(RecommendConfig(monitor=path, updates=1024))
    assert rec.pilot_updates == 2048 and rec.pilot_schedule == "fixed-first:k0=2,switch=0.75,finish=uniform:1-8"
    assert rec.recommended.modeled_flops == pytest.approx(928 * 2 + 96 * 4.5)
    assert rec.uniform_flops == pytest.approx(uniform)  # always against uniform:1-16


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"updates": 1024}, "no depth schedule"),
        ({"schedule": "", "updates": 1024}, "no depth schedule"),
        ({"schedule": "fixed-first:k0=4,switch=0.75,finish=uniform:1-16"}, "no depth schedule"),
        ({"schedule": "fixed-first:k0=4,switch=0.75,finish=uniform:1-16", "updates": 1024.0}, "no depth schedule"),
        ({"schedule": "uniform:1-16", "updates": 1024}, "is not fixed-first"),
    ],
)
def test_a_pilot_monitored_in_another_loop_is_refused_by_file(tmp_path, settings, message):
    path = depth_monitor_pilot(tmp_path, **settings)
    with pytest.raises(InputError, match=rf"^{path}: .*{message}"):
        recommend(RecommendConfig(monitor=path, updates=1024))
    ds = pilot_monitor()
    del ds.attrs["config"]
    write_dataset(ds, path)
    with pytest.raises(InputError, match=rf"^{path}: no run config"):
        recommend(RecommendConfig(monitor=path, updates=1024))


def test_the_comparison_grid_written_out_in_full_reads_back(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "grids").mkdir()
    base = tmp_path / "configs" / "base.toml"
    base.write_text(Path("configs/tiny-monitor.toml").read_text())
    out = tmp_path / "grids" / "compare.toml"
    rec = recommend(RecommendConfig(monitor=hand_pilot(tmp_path), updates=1024))
    text = comparison_grid(rec, base=base, out=out, seeds=(0, 1))
    assert text == "\n".join(
        [
            f"# Written by depthdiag recommend from {tmp_path / 'monitor.h5'}:",
            "# F = 64 uniform updates, F' = 96 with the margin 1.5. The recommended schedule",
            "# against the paper's 80% switch and uniform:1-16 over the same updates, for every seed.",
            'base = "../configs/base.toml"',
            'serving = "1-16"',
            "",
            "[set]",
            '"train.updates" = 1024',
            '"train.snapshot_uniform_updates" = []',
            '"monitor.every" = 0',
            "",
            "[axes.schedule]",
            'recommended = "fixed-first:k0=4,switch=0.90625,finish=uniform:1-16"',
            'ff80 = "fixed-first:k0=4,switch=0.8,finish=uniform:1-16"',
            'uniform = "uniform:1-16"',
            "",
            "[axes]",
            "seed = [0, 1]",
            "",
        ]
    )
    out.write_text(text)
    spec = load_grid(out)
    assert spec.base.resolve() == base.resolve() and spec.serving == "1-16"
    assert [axis.name for axis in spec.axes] == ["schedule", "seed"]
