"""End to end, not one module: bench/gpu_check.sh, the short check to run on a GPU machine, run
small on the CPU so that it keeps working where no GPU is lent (minutes on 2 cores, so only under
`make test-slow`). In bf16 where the CPU has bf16 units; in fp32 where bf16 is emulated, which
made the compiled steps run past half an hour."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.distributed import native_bf16

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path):
    bin_dir = Path(sys.executable).parent
    precision = "bf16" if native_bf16(torch.device("cpu")) else "fp32"
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "UPDATES": "24",
        "D_MODEL": "64",
        "PRECISION": precision,
        "PY": sys.executable,
        "DEPTHDIAG": str(bin_dir / "depthdiag"),
    }
    result = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path / "check")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "gpu check: all steps ran" in output
    # The throughput of the compiled model, as tokens/s and a fraction of the measured peak.
    throughput = re.findall(
        rf"^(fixed:4|uniform:1-16): [\d,]+ tokens/s, .* = [\d.]+% of the {precision} matmul peak", output, re.M
    )
    assert throughput == ["fixed:4", "uniform:1-16"], output[-4000:]
    # Resume is bit-exact on the CPU.
    assert "resumed vs straight final weights: max |difference| 0 " in output
    assert (tmp_path / "check" / "results.h5").is_file()
