import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import diag.cli
from diag.cli import main

ROOT = Path(__file__).resolve().parents[1]

# Six updates of the tiny config through the training loop's own step, eager at one
# thread; prints the page faults per update of the last four.
STEPS = """
import json, resource, sys
import torch
from common.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "kept" else None
from trainer.config import load_config, replace_section
from trainer.data import build_source
from trainer.model import LoopedTransformer
from trainer.train import TrainStep
torch.set_num_threads(1)
config = replace_section(load_config("configs/tiny.toml"), "train", compile=False)
torch.manual_seed(0)
step = TrainStep.for_run(LoopedTransformer(config.model), config)
batch = build_source(config.data).batch(0, 0, 32, 64)
for _ in range(2):
    step(batch, 4, 1e-3)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step(batch, 4, 1e-3)
print(json.dumps({"kept": kept, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4}))
"""


def faults_per_update(side: str) -> dict:
    done = subprocess.run([sys.executable, "-c", STEPS, side], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_kept_memory_is_reused_without_page_faults():
    default, kept = faults_per_update("default"), faults_per_update("kept")
    assert kept["kept"] is True
    # glibc's default hands a step's activations back to the kernel and faults them in
    # again every update: 7,700-12,800 faults an update here. Kept: 150-400.
    assert default["faults"] > 2000
    assert kept["faults"] < default["faults"] / 5


def test_every_command_keeps_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(diag.cli, "keep_freed_memory", lambda: calls.append(True))
    result = CliRunner().invoke(main, ["flops", "configs/tiny.toml"])
    assert result.exit_code == 0, result.output
    assert calls == [True]
