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

OUT appears complete or not at all (common/atomic.py `atomic_directory`), under OUT's lock.
An existing OUT is replaced only with `force`, and only when it holds nothing but an export's
two files: a folder with anything else in it is never deleted.
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

from common.atomic import atomic_directory
from common.errors import InputError
from common.lock import exclusive_output
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


def _check_out(out: Path, force: bool) -> None:
    """Refuse an OUT that is not a folder, an existing export unless `force`, and a folder
    holding anything but an export's files always."""
    if not out.exists():
        return
    if not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder; --out names the folder to write the export to")
    names = sorted(p.name for p in out.iterdir())
    others = [name for name in names if name not in EXPORT_FILES]
    if others:
        raise InputError(
            f"{out}: holds other files than an export ({', '.join(others[:3])}); export into a new or empty folder"
        )
    if names and not force:
        raise InputError(f"{out}: already exists; pass --force to overwrite it")


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write the model of `checkpoint` (a checkpoint or a snapshot) to the folder `out` as
    model.safetensors and config.json; returns `out`."""
    out = Path(out)
    _check_out(out, force)
    snap = load_snapshot(checkpoint)
    tensors = unshared_tensors(snap.model().state_dict())
    document = export_document(snap)
    with exclusive_output(out):
        _check_out(out, force)
        with atomic_directory(out) as tmp:
            safetensors.torch.save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
            (tmp / CONFIG_FILE).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
