"""trainer/machine.py: the machine and kernels a process computes with, as oneDNN itself reports
them, and common/provenance.py's words for a record."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from common.provenance import describe_machine, describe_machines
from trainer.machine import _kernels, cpu_model, machine

PROBE = "import json; from trainer.machine import machine; print(json.dumps(machine()))"
# oneDNN reports its version and ISA at the first verbose call of a process only: the CUDA
# record (the CPU's alone on a machine without CUDA) shares the first probe, in a fresh process.
BOTH_DEVICES = "import json; from trainer.machine import machine; print(json.dumps([machine('cpu'), machine('cuda')]))"
ONEDNN_KERNEL = """
import torch
operand = torch.ones(64, 64, dtype=torch.bfloat16)
torch.mm(operand, operand)
"""


def record_in_a_process(**environment) -> dict:
    """machine() of a fresh process with `environment` added (oneDNN reads its settings once)."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env={**os.environ, **environment}
    )
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def fresh_records() -> tuple[dict, dict]:
    """machine('cpu') and machine('cuda') of one fresh process in this environment."""
    result = subprocess.run([sys.executable, "-c", BOTH_DEVICES], capture_output=True, text=True, check=True)
    cpu, cuda = json.loads(result.stdout)
    return cpu, cuda


def test_the_record_names_the_cpu_and_torchs_kernels():
    _kernels.cache_clear()
    record = machine()
    assert record["cpu_model"] == cpu_model() and record["cpu_model"] != "unknown"
    assert record["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert record["threads"] == torch.get_num_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        assert machine()["threads"] == before + 1  # read at each call, not at the probe
    finally:
        torch.set_num_threads(before)
    assert record["onednn_max_cpu_isa"] == os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    assert record["bf16_matrix_units"] == int("amx" in record["bf16_matmul"].lower())
    assert "cuda_device" not in record  # a CPU run
    assert all(isinstance(value, (str, int)) for value in record.values())  # a flat record, storable anywhere


def test_the_probe_draws_no_random_numbers_and_prints_nothing(capfd):
    _kernels.cache_clear()
    cpu_state = torch.get_rng_state()
    machine()
    assert torch.equal(torch.get_rng_state(), cpu_state)
    captured = capfd.readouterr()
    assert captured.out == "" and "onednn_verbose" not in captured.err


def test_the_kernel_is_the_one_onednn_runs_for_a_bf16_matmul(fresh_records):
    # Independently of the probe: oneDNN's own verbose report of the same matmul in a fresh process.
    report = subprocess.run(
        [sys.executable, "-c", ONEDNN_KERNEL],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "ONEDNN_VERBOSE": "1"},
    ).stdout
    kernels = re.findall(r",exec,cpu,matmul,([^,]+),", report)
    assert fresh_records[0]["bf16_matmul"] == (kernels[0] if kernels else "aten")


def test_capping_onednns_isa_shows_in_the_record(fresh_records):
    native = fresh_records[0]
    capped = record_in_a_process(ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    assert capped["onednn_max_cpu_isa"] == "AVX512_CORE_BF16" and native["onednn_max_cpu_isa"] == ""
    assert capped["bf16_matrix_units"] == 0  # the cap excludes AMX, whatever the CPU has
    if native["bf16_matrix_units"]:  # a CPU with AMX: the cap changes the kernel, so the record does
        assert capped["bf16_matmul"] != native["bf16_matmul"]
        assert {key for key in native if native[key] != capped[key]} >= {"bf16_matmul", "onednn_isa"}


def test_a_record_in_words():
    record = {
        "cpu_model": "Some CPU (family 6, model 143)",
        "cpu_bf16": "matrix units (AMX)",
        "torch_cpu_capability": "AVX512",
        "onednn_version": "3.12.0",
        "onednn_isa": "Intel AVX-512 with Intel DL Boost and bfloat16 support",
        "bf16_matmul": "brg_matmul:avx512_core_bf16",
        "bf16_matrix_units": 0,
        "onednn_max_cpu_isa": "AVX512_CORE_BF16",
        "threads": 1,
    }
    assert describe_machine(record) == (
        "Some CPU (family 6, model 143); torch CPU kernels AVX512; oneDNN 3.12.0 bf16 matmul "
        "brg_matmul:avx512_core_bf16; 1 thread; ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"
    )
    amx = {**record, "bf16_matmul": "brg_matmul:avx10_1_512_amx", "bf16_matrix_units": 1, "onednn_max_cpu_isa": ""}
    gpu = {**amx, "threads": 2, "cuda_device": "NVIDIA H200", "cuda_capability": "9.0"}
    assert describe_machine(gpu).endswith(
        "bf16 matmul brg_matmul:avx10_1_512_amx (bf16 matrix units); 2 threads; CUDA NVIDIA H200 (capability 9.0)"
    )
    assert describe_machine(None) == describe_machine({}) == "unknown (not recorded)"
    assert describe_machines([record, amx]) == f"{describe_machine(record)} then {describe_machine(amx)}"
    assert describe_machines([]) == "unknown (not recorded)"


def test_every_devices_record_holds_the_cpu_kernels(fresh_records):
    cpu, cuda = fresh_records
    assert {key: cuda[key] for key in cpu} == cpu
