"""`depthdiag export`: a checkpoint's or snapshot's model as a folder other tools load
without depthdiag's file format and without unpickling anything.

    OUT/model.safetensors   the model's state_dict (safetensors.torch.save_file)
    OUT/config.json         {"model": the ModelConfig as a dict, "format_version", and for
                            provenance "source" (path, sha256, kind, step, uniform_updates),
                            "run_config", "depthdiag_version", "torch_version"}

Loading it back is plain PyTorch (docs/api.md shows the lines, and a test runs them):

    cfg = ModelConfig.from_dict(json.load(open("OUT/config.json"))["model"])
    model = LoopedTransformer(cfg)
    model.load_state_dict(safetensors.torch.load_file("OUT/model.safetensors"))

OUT appears complete or not at all (common/atomic.py `atomic_directory`), under OUT's lock,
its files with the permissions of every other output (0666 less the umask). A full disk or a
file-size limit is an OSError naming the file (the CLI's one line, exit 2).
An existing OUT is replaced only with `force`, and only when it holds nothing but an export's
two files: a folder with anything else in it is never deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError

from common.atomic import atomic_directory, new_file_mode
from common.lock import claimed_outputs
from common.outputs import OutputKind, check_output, json_file, only_entries
from common.provenance import package_version
from trainer.checkpoint import Snapshot, load_snapshot

EXPORT_FORMAT_VERSION = 1
"""Bumped whenever the meaning or layout of the exported files changes."""

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
EXPORT_FILES = (WEIGHTS_FILE, CONFIG_FILE)


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


def export_document(snap: Snapshot) -> dict:
    """The config.json of an export of `snap`."""
    return {
        "format_version": EXPORT_FORMAT_VERSION,
        "model": snap.config.model.to_dict(),
        "source": {
            "path": str(snap.path),
            "sha256": snap.sha256,
            "kind": "snapshot" if snap.batches is not None else "checkpoint",
            "step": snap.step,
            "uniform_updates": snap.uniform_updates,
        },
        "run_config": json.loads(snap.config.to_json()),
        "depthdiag_version": package_version(),
        "torch_version": str(torch.__version__),
    }


def _is_export(out: Path) -> bool:
    """An export folder depthdiag wrote: its files alone, the config naming a model."""
    document = json_file(out / CONFIG_FILE)
    return (
        out.is_dir()
        and only_entries(out, EXPORT_FILES)
        and document is not None
        and {"format_version", "model"} <= document.keys()
    )


EXPORT_FOLDER = OutputKind("model export", _is_export, folder=True, entries=EXPORT_FILES)


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write the model of `checkpoint` (a checkpoint or a snapshot) to the folder `out` as
    model.safetensors and config.json; returns `out`."""
    out = Path(out)
    check_output(out, kind=EXPORT_FOLDER, inputs=[checkpoint], force=force)
    snap = load_snapshot(checkpoint)
    tensors = unshared_tensors(snap.model().state_dict())
    document = export_document(snap)
    with claimed_outputs([out], kind=EXPORT_FOLDER, inputs=[checkpoint], force=force):
        with atomic_directory(out) as tmp:
            with _naming_write_errors(tmp / WEIGHTS_FILE):
                safetensors.torch.save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
            # safetensors creates the file private (0600); it should be as readable as config.json.
            os.chmod(tmp / WEIGHTS_FILE, new_file_mode())
            with _naming_write_errors(tmp / CONFIG_FILE):
                (tmp / CONFIG_FILE).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


@contextlib.contextmanager
def _naming_write_errors(path: Path) -> Iterator[None]:
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
