"""`depthdiag export`: a checkpoint's or snapshot's model as a folder other tools load
without depthdiag's file format and without unpickling anything, in one of two formats.

`format="safetensors"` (the default):

    OUT/model.safetensors   the model's state_dict (safetensors.torch.save_file)
    OUT/config.json         {"model": the ModelConfig as a dict, "format_version", and for
                            provenance "source" (path, sha256, kind, step, uniform_updates),
                            "run_config", "depthdiag_version", "torch_version"}

Loading it back is plain PyTorch (docs/api.md shows the lines, and a test runs them):

    cfg = ModelConfig.from_dict(json.load(open("OUT/config.json"))["model"])
    model = LoopedTransformer(cfg)
    model.load_state_dict(safetensors.torch.load_file("OUT/model.safetensors"))

`format="hf"`: a Hugging Face folder with the model's code in it, which
`AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)` loads and lm-eval's `hf`
model evaluates (trainer/export/hf/__init__.py lists its files). It serves at `num_steps`
iterations unless told otherwise (default: the deepest depth of the run's training schedule),
and carries the run's tokenizer file when the run has one (`data.source = 'bin'`, or `tokenizer`).
It needs the optional `hf` extra (transformers).

OUT appears complete or not at all (common/atomic.py `atomic_directory`), under OUT's lock,
its files with the permissions of every other output (0666 less the umask). A full disk or a
file-size limit is an OSError naming the file (the CLI's one line, exit 2).
An existing OUT is replaced only with `force`, and only when it holds nothing but the files of
an export (of either format): a folder with anything else in it is never deleted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors.torch
import torch

from common.atomic import atomic_directory, new_file_mode
from common.errors import InputError
from common.lock import claimed_outputs
from common.outputs import OutputKind, check_output, json_file, only_entries
from common.provenance import package_version
from trainer.checkpoint import Snapshot, load_snapshot
from trainer.data.text_tokens import resolve_tokenizer
from trainer.export.hf import CONFIG_FILE, HF_EXPORT_FILES, MODEL_TYPE, WEIGHTS_FILE
from trainer.export.tensor_files import naming_write_errors, unshared_tensors
from trainer.schedules import parse_schedule

EXPORT_FORMAT_VERSION = 1
"""Bumped whenever the meaning or layout of the exported files changes."""

EXPORT_FORMATS = ("safetensors", "hf")
"""`depthdiag export --format`: the two-file folder of plain PyTorch, or a Hugging Face folder."""

EXPORT_FILES = (WEIGHTS_FILE, CONFIG_FILE)
"""The files of a safetensors export."""


def export_document(snap: Snapshot) -> dict:
    """The config.json of a safetensors export of `snap`."""
    return {"model": snap.config.model.to_dict(), **_provenance(snap)}


def _provenance(snap: Snapshot) -> dict:
    """Where an export comes from: its format version, the source file, the run, the versions."""
    return {
        "format_version": EXPORT_FORMAT_VERSION,
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


def _is_safetensors_export(out: Path) -> bool:
    """A safetensors export depthdiag wrote: its files alone, the config naming a model."""
    document = json_file(out / CONFIG_FILE)
    return only_entries(out, EXPORT_FILES) and document is not None and {"format_version", "model"} <= document.keys()


def _is_hf_export(out: Path) -> bool:
    """An hf export depthdiag wrote: its files alone, the config of its model type with provenance."""
    document = json_file(out / CONFIG_FILE)
    if document is None:
        return False
    provenance = document.get("provenance")
    return (
        only_entries(out, HF_EXPORT_FILES)
        and document.get("model_type") == MODEL_TYPE
        and isinstance(provenance, dict)
        and "format_version" in provenance
    )


def _is_export(out: Path) -> bool:
    """An export of either format: `--force` may replace one by the other."""
    return out.is_dir() and (_is_safetensors_export(out) or _is_hf_export(out))


EXPORT_FOLDER = OutputKind(
    "model export", _is_export, folder=True, entries=tuple(dict.fromkeys(EXPORT_FILES + HF_EXPORT_FILES))
)


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    force: bool = False,
    format: str = "safetensors",
    num_steps: int | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write the model of `checkpoint` (a checkpoint or a snapshot) to the folder `out`; returns
    `out`. `format` "safetensors": model.safetensors and config.json. "hf": a Hugging Face folder
    (see the module docstring) serving at `num_steps` by default, with the tokenizer file
    `tokenizer` (default: the run's own, when it has one)."""
    if format not in EXPORT_FORMATS:
        raise InputError(f"--format {format!r}: must be one of {', '.join(EXPORT_FORMATS)}")
    if format != "hf" and (num_steps is not None or tokenizer is not None):
        raise InputError("--num-steps and --tokenizer are options of --format hf")
    if format == "hf":
        # transformers is the optional hf extra: imported only now, and missing it is one line.
        from trainer.export.hf.writer import require_transformers, write_hf_folder

        require_transformers()
    out = Path(out)
    inputs = [checkpoint, *([tokenizer] if tokenizer is not None else [])]
    check_output(out, kind=EXPORT_FOLDER, inputs=inputs, force=force)
    snap = load_snapshot(checkpoint)
    if format == "hf":
        tokenizer_file, eot_token_id = _hf_tokenizer(snap, tokenizer)
        inputs += [tokenizer_file] if tokenizer_file is not None else []
        depth = _serving_depth(snap, num_steps)
        provenance = {**_provenance(snap), "tokenizer": None if tokenizer_file is None else str(tokenizer_file)}

        def write(folder: Path) -> None:
            write_hf_folder(
                snap,
                folder,
                num_steps=depth,
                provenance=provenance,
                tokenizer_file=tokenizer_file,
                eot_token_id=eot_token_id,
            )
    else:
        tensors = unshared_tensors(snap.model().state_dict())
        document = export_document(snap)

        def write(folder: Path) -> None:
            with naming_write_errors(folder / WEIGHTS_FILE):
                safetensors.torch.save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
            # safetensors creates the file private (0600); it should be as readable as config.json.
            os.chmod(folder / WEIGHTS_FILE, new_file_mode())
            with naming_write_errors(folder / CONFIG_FILE):
                text = json.dumps(document, indent=2, sort_keys=True) + "\n"
                (folder / CONFIG_FILE).write_text(text, encoding="utf-8")

    with claimed_outputs([out], kind=EXPORT_FOLDER, inputs=inputs, force=force):
        with atomic_directory(out) as tmp:
            write(tmp)
    return out


def _serving_depth(snap: Snapshot, num_steps: int | None) -> int:
    """`num_steps`, or by default the deepest depth the run's training schedule reaches."""
    if num_steps is None:
        train = snap.config.train
        return parse_schedule(train.schedule, seed=train.seed, total_updates=train.updates).max_depth
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise InputError(f"--num-steps must be a positive integer, got {num_steps!r}")
    return num_steps


def _hf_tokenizer(snap: Snapshot, override: str | Path | None) -> tuple[Path | None, int | None]:
    """The tokenizer file an hf export carries and its end-of-text id: `override`, or the one
    named by a 'bin' run's data folder; (None, None) for a 'text' run (its tokens are UTF-8
    bytes) and a bioS run (a synthetic vocabulary with no text form)."""
    if override is None and snap.config.data.source != "bin":
        return None, None
    # The tokenizer `depthdiag lm-eval` would use, checked against the model's vocabulary;
    # a FileTokenizer is named by its file's path.
    found = resolve_tokenizer(snap.config, override, snap.path)
    return Path(found.name), found.prefix_token_id
