"""Writing a model's tensors to a file other tools read (safetensors), for both export formats."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError


def unshared_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every tensor on the CPU, contiguous, and a copy of its own where it
    shares memory with an earlier one: safetensors refuses shared tensors, and a tied
    weight stored twice loads back into the one parameter with the same values."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            tensor = tensor.clone()
        seen.add(storage)
        out[name] = tensor
    return out


@contextlib.contextmanager
def naming_write_errors(path: Path) -> Iterator[None]:
    """Raise an OS error of writing `path` as an OSError that names it, so that the CLI reports
    a full disk or a file-size limit on one line: a failed write says no file name, and
    safetensors puts the OS error into the message of an exception of its own."""
    try:
        yield
    except SafetensorError as err:
        # Rust's text for an OS error, e.g. "I/O error: File too large (os error 27)".
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(path)) from None
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror or str(err).splitlines()[0], str(path)) from None
