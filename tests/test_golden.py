"""The golden run (tests/golden_run.py): the short pipeline reproduces the numbers committed in
tests/golden/golden.json, within tolerances that hold under the kernel sets measured when they
were written. A change of what the code computes fails here; an intended one rewrites the file
(`make golden GOLDEN_OPTIONS=--write`) with a line in docs/log.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from golden_run import GOLDEN, PRECISIONS, deviations, differences, golden_numbers

HERE = Path(__file__).resolve().parent


# bf16 takes 100 s on a CPU without bf16 instructions (autocast emulates the matmuls there): the
# slow set runs it; make test keeps fp32 and the bf16 paths' own tests.
@pytest.mark.parametrize(
    "precision", [pytest.param(p, marks=pytest.mark.slow) if p == "bf16" else p for p in PRECISIONS]
)
def test_the_golden_run_reproduces_its_committed_numbers(tmp_path, precision):
    golden = json.loads(GOLDEN.read_text())[precision]
    numbers = golden_numbers(tmp_path, precision)
    assert differences(numbers, golden) == [], deviations(numbers, golden)


def test_a_number_outside_its_tolerance_is_named():
    golden = json.loads(GOLDEN.read_text())["bf16"]
    numbers = json.loads(json.dumps(golden["numbers"]))
    tolerance = golden["tolerances"]["summary_mean_benefit"]
    numbers["summary_mean_benefit"] += 0.9 * tolerance
    assert differences(numbers, golden) == []
    numbers["summary_mean_benefit"] += 0.2 * tolerance
    assert differences(numbers, golden) == [
        f"summary_mean_benefit: differs by up to {1.1 * tolerance:.3g}, tolerance {tolerance:.3g}"
    ]
    numbers["nll"] = numbers["nll"][:1]  # another shape: another pipeline
    assert any(line.startswith("nll: differs by up to inf") for line in differences(numbers, golden))


@pytest.mark.slow
def test_the_golden_run_holds_under_onednns_kernels_without_the_bf16_matrix_units():
    # As on a CPU with bf16 instructions but no AMX: the other kernel set the tolerances cover.
    environment = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(HERE / "golden_run.py")], capture_output=True, text=True, env=environment
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
