"""`depthdiag flops`: the paper's modeled-compute ratios, the matched run, and bad input."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from depthdiag.cli import main

# The paper's Table 3 and section 4 numbers, used only as references with tolerances.
PAPER_200M = {
    "fixed-first:k0=2,switch=0.67,finish=uniform:1-16": 0.547,
    "fixed-first:k0=2,switch=0.8,finish=uniform:1-16": 0.457,
    "fixed-first:k0=4,switch=0.67,finish=uniform:1-16": 0.687,
    "fixed-first:k0=4,switch=0.8,finish=uniform:1-16": 0.624,
}
PAPER_1B = {
    "fixed-first:k0=4,switch=0.67,finish=uniform:1-16": 0.692,
    "fixed-first:k0=4,switch=0.8,finish=uniform:1-16": 0.631,
}
PAPER_MATCHED_UNIFORM_UPDATES = 3296
ONE_POINT = 0.01  # one percentage point of uniform's compute
MATCH_TOLERANCE = 0.01  # relative, on the matched run's update count


def paper_200m_relative_to_uniform(k0: int, switch_step: int) -> float:
    """Modeled compute of fixed-first (K0 = k0 for `switch_step` of 4,800 updates, then uniform:1-16, E[K] = 8.5)
    relative to 4,800 uniform updates, for configs/paper-200m.toml worked by hand from its parameter counts: d = 1024,
    swiglu width 64 x ceil(8 x 1024 / 3 / 64) = 2752, sandwich norms, 2/4/2 prelude/core/coda blocks, a concat
    adapter, 2048 tokens. Per token, 6 FLOPs per parameter (forward and backward, LM head excluded) plus the QK^T
    and AV matmuls over the full 2048 x 2048 scores, 4 x 2048 x 1024 per block forward and three times that with
    the backward; every update costs once + K x per_iteration."""
    block = 4 * 1024**2 + 3 * 1024 * 2752 + 4 * 1024  # qkv and proj, the three MLP matrices, four norms
    attention = 3 * 4 * 2048 * 1024
    once = 6 * (4 * block + 2 * 1024) + 4 * attention  # prelude and coda blocks, the loop and final norms
    per_iteration = 6 * (2 * 1024**2 + 4 * block) + 4 * attention  # the adapter (2d -> d) and four core blocks
    depth_sum = switch_step * k0 + (4800 - switch_step) * 8.5
    return (4800 * once + depth_sum * per_iteration) / (4800 * (once + 8.5 * per_iteration))


def run(*args):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def flops_json(config, *args):
    code, out, err = run("flops", config, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def schedule_args(specs):
    return [arg for spec in specs for arg in ("--schedule", spec)]


def test_paper_200m_ratios_within_one_point():
    report = flops_json("configs/paper-200m.toml", "--updates", "4800", *schedule_args(PAPER_200M))
    relative = {row["spec"]: row["relative_to_uniform"] for row in report["schedules"]}
    assert relative.keys() == PAPER_200M.keys()
    for spec, paper in PAPER_200M.items():
        assert relative[spec] == pytest.approx(paper, abs=ONE_POINT), spec


def test_paper_200m_ratios_are_the_hand_calculation_and_the_readme_prints_them():
    # The switch steps: round(0.67 x 4800) = 3216, round(0.8 x 4800) = 3840.
    by_hand = {
        "fixed-first:k0=2,switch=0.67,finish=uniform:1-16": paper_200m_relative_to_uniform(2, 3216),
        "fixed-first:k0=2,switch=0.8,finish=uniform:1-16": paper_200m_relative_to_uniform(2, 3840),
        "fixed-first:k0=4,switch=0.67,finish=uniform:1-16": paper_200m_relative_to_uniform(4, 3216),
        "fixed-first:k0=4,switch=0.8,finish=uniform:1-16": paper_200m_relative_to_uniform(4, 3840),
    }
    report = flops_json("configs/paper-200m.toml", "--updates", "4800", *schedule_args(by_hand))
    readme = Path("docs/flops.md").read_text()
    for row in report["schedules"]:
        expected = by_hand[row["spec"]]
        assert row["relative_to_uniform"] == pytest.approx(expected, rel=1e-9), row["spec"]
        # docs/flops.md's table: ours, then the paper's in brackets.
        assert f" {expected:.1%} ({PAPER_200M[row['spec']]:.1%}) " in readme, row["spec"]


def test_paper_1b_ratios_within_one_point():
    report = flops_json("configs/paper-1b.toml", *schedule_args(PAPER_1B))
    assert report["updates"] == 20000
    for row in report["schedules"]:
        assert row["relative_to_uniform"] == pytest.approx(PAPER_1B[row["spec"]], abs=ONE_POINT), row["spec"]


def test_matched_uniform_run_for_the_200m_config_schedule():
    report = flops_json("configs/paper-200m.toml", "--updates", "4800", "--match", "uniform:1-16")
    first, uniform = report["schedules"]
    assert first["spec"] == "fixed-first:k0=4,switch=0.67,finish=uniform:1-16"
    assert uniform["spec"] == "uniform:1-16" and uniform["relative_to_uniform"] == 1.0
    assert uniform["mean_depth"] == pytest.approx(8.5)
    match = report["match"]
    assert match["reference"] == first["spec"]
    assert match["updates"] == pytest.approx(PAPER_MATCHED_UNIFORM_UPDATES, rel=MATCH_TOLERANCE)
    # Uniform costs the same per update on average, so the matched count is 4800 x the hand ratio 0.68162, rounded.
    assert match["updates"] == round(4800 * paper_200m_relative_to_uniform(4, 3216)) == 3272
    assert "3,272 updates (the paper: 3,296)" in Path("docs/flops.md").read_text()


def test_table_output_lists_every_schedule_and_the_match():
    code, out, err = run(
        "flops",
        "configs/tiny.toml",
        "--schedule",
        "fixed:4",
        "--schedule",
        "uniform",
        "--match",
        "fixed:16",
        "--include-embeddings",
    )
    assert code == 0, err
    assert "fixed:4" in out and "uniform:1-16" in out and "match: fixed:16 over" in out
    assert "LM head included" in out


@pytest.mark.parametrize("spec", ["fixed:0", "uniform:5-2", "fixed-first:switch=1.5", "warp:3"])
def test_bad_spec_exits_2_with_one_line(spec):
    code, out, err = run("flops", "configs/tiny.toml", "--schedule", spec)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and spec in err and "Traceback" not in err


def test_bad_match_spec_and_missing_config_exit_2():
    code, _, err = run("flops", "configs/tiny.toml", "--match", "uniform:0-3")
    assert code == 2 and err.count("\n") == 1
    code, _, err = run("flops", "configs/does-not-exist.toml")
    assert code == 2 and err.count("\n") == 1 and "does-not-exist.toml" in err
