"""`depthdiag recommend`: F from a pilot's monitor file, the switch for a run of N updates, the
spec and its modeled compute; worked by hand on a synthetic monitor file."""

import json

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner

from analysis.recommend import describe_finish, finish_length, switch_plan, switch_text
from analysis.store import write_dataset
from common.errors import InputError
from diag.cli import main
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


def modeled_compute(depth_sum: float) -> float:
    """Modeled FLOPs of 1,024 updates of the pilot's model (tiny-monitor.toml: d = 128, gelu MLP of width 4d = 512,
    pre-norm, concat adapter, 1/2/1 prelude/core/coda blocks) whose depths sum to `depth_sum`, worked from the
    parameter counts: 6 FLOPs per parameter per token forward and backward, norm weights included, the LM head
    excluded, plus the QK^T and AV matmuls over the full 64 x 64 scores (4 x 64 x 128 per token forward per block,
    three times that with the backward)."""
    block = 4 * 128**2 + 2 * 128 * 512 + 2 * 128  # qkv and proj, MLP, two norms: 196,864
    attention = 3 * 4 * 64 * 128
    once = 6 * (2 * block + 2 * 128) + 2 * attention  # prelude, coda, the loop and final norms: 2,560,512 per token
    per_iteration = 6 * (2 * 128**2 + 2 * block) + 2 * attention  # the adapter (2d -> d), two core blocks: 2,755,584
    return 32 * 64 * (1024 * once + depth_sum * per_iteration)  # 32 x 64 tokens per update


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
