"""The machine and kernels a process computes with, as results files record them.

bf16 autocast on a CPU runs oneDNN's matmul kernels, and which kernels oneDNN picks depends
on the CPU (bf16 matrix units, bf16 vector instructions, neither) and on
ONEDNN_MAX_CPU_ISA. The kernels round differently, a training run amplifies the rounding,
and one seed's switch benefit moves with the kernel set about as much as it moves from seed
to seed (docs/results.md). So every result says which kernels produced it: `machine()`
asks oneDNN which bf16 matmul it dispatches (its verbose report of one tiny matmul), not
which instructions the CPU advertises, since the environment can restrict them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import sys
import tempfile
from pathlib import Path

import torch

ISA_VARIABLE = "ONEDNN_MAX_CPU_ISA"
"""The environment variable that caps the instruction set oneDNN dispatches to."""


def cpu_model() -> str:
    """The CPU's model name, with its family and model numbers where Linux's /proc/cpuinfo gives
    them (virtual machines often show a generic name); else what the platform module says."""
    cpuinfo = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), " ".join(value.split()))
    name = fields.get("model name") or fields.get("Model") or fields.get("Hardware")
    if not name:
        return platform.processor() or platform.machine() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def _cpu_bf16_instructions() -> str:
    """The bf16 instructions the CPU has: 'matrix units (AMX)', 'vector (AVX512_BF16)' or 'none'."""
    if torch.cpu._is_amx_tile_supported():
        return "matrix units (AMX)"
    if torch.cpu._is_avx512_bf16_supported():
        return "vector (AVX512_BF16)"
    return "none"


def _onednn_report() -> str:
    """oneDNN's verbose lines for one 64x64 bf16 matmul (torch sends smaller ones to its own
    kernels): oneDNN's version, the ISA it dispatches to and the kernel it ran. oneDNN prints
    them with C stdio to file descriptor 1, so the descriptor is pointed at a temporary file for
    the one call, C's buffers flushed on both sides. The operands are constants: the probe draws
    nothing from any random stream."""
    operand = torch.ones(64, 64, dtype=torch.bfloat16)
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    with tempfile.TemporaryFile() as report:
        libc.fflush(None)
        saved = os.dup(1)
        os.dup2(report.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                torch.mm(operand, operand)
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        report.seek(0)
        return report.read().decode(errors="replace")


@functools.cache
def _onednn() -> dict[str, str]:
    """oneDNN's version, the ISA it dispatches to and its bf16 matmul kernel. A CPU without
    bf16 instructions has its bf16 matmuls done by torch's own kernels, which oneDNN then
    does not report: 'aten' for the kernel, 'unknown' for the ISA. Probed once per process:
    oneDNN reports its version and ISA at the first verbose call only."""
    if not torch.backends.mkldnn.is_available():
        return {"onednn_version": "none", "onednn_isa": "none", "bf16_matmul": "aten"}
    built_with = re.search(r"MKL-DNN v([\w.]+)", torch.__config__.show())
    found = {
        "onednn_version": built_with.group(1) if built_with else "unknown",
        "onednn_isa": "unknown",
        "bf16_matmul": "aten",
    }
    for line in _onednn_report().splitlines():
        if m := re.search(r",info,oneDNN v([\w.]+)", line):
            found["onednn_version"] = m.group(1)
        elif m := re.search(r",info,cpu,isa:(.+)$", line):
            found["onednn_isa"] = m.group(1).strip()
        elif m := re.search(r",exec,cpu,matmul,([^,]+),", line):
            found["bf16_matmul"] = m.group(1)
    return found


def machine(device: str = "cpu") -> dict[str, str | int]:
    """What computes a result on `device` ('cpu' or 'cuda'): the CPU model, the bf16
    instructions it has, torch's CPU kernel level (ATen's dispatch, ATEN_CPU_CAPABILITY), the
    oneDNN version, ISA and bf16 matmul kernel it dispatches to, whether those are the bf16
    matrix units, ONEDNN_MAX_CPU_ISA as set ('' when not), torch's thread count now (it changes
    how kernels split their sums), and on a GPU its name and compute capability."""
    return {**_kernels(device), "threads": torch.get_num_threads()}


@functools.cache
def _kernels(device: str) -> dict[str, str | int]:
    """`machine` but the threads: probed once per process and device."""
    onednn = _onednn()
    record: dict[str, str | int] = {
        "cpu_model": cpu_model(),
        "cpu_bf16": _cpu_bf16_instructions(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **onednn,
        "bf16_matrix_units": int("amx" in onednn["bf16_matmul"].lower()),
        "onednn_max_cpu_isa": os.environ.get(ISA_VARIABLE, ""),
    }
    if device == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        record.update(
            cuda_device=torch.cuda.get_device_name(index),
            cuda_capability=f"{major}.{minor}",
            cuda_version=str(torch.version.cuda),
        )
    return record
