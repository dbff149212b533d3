"""Writing an hf export folder (the files are listed in trainer/export/hf/__init__.py).

transformers is imported here only inside the functions that need it, so that depthdiag imports
without the optional `hf` extra; `require_transformers` turns its absence into one line.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import safetensors.torch
import torch

import trainer.model
from common.atomic import new_file_mode
from common.errors import InputError
from trainer.checkpoint import Snapshot
from trainer.export.hf import (
    CONFIG_FILE,
    CONFIG_SOURCE,
    HF_EXPORT_FILES,
    MODEL_SOURCE,
    MODELING_SOURCE,
    TEMPLATES,
    WEIGHTS_FILE,
)
from trainer.export.tensor_files import naming_write_errors, unshared_tensors

PROJECT_IMPORT = "from common.errors import InputError\n"
"""trainer/model.py's one import from the project, which the exported copy replaces by LOCAL_INPUT_ERROR."""
LOCAL_INPUT_ERROR = '''class InputError(ValueError):
    """Bad input (depthdiag's common.errors.InputError, defined here so that the folder needs no depthdiag)."""

'''
FOLDER_IMPORTS = frozenset(sys.stdlib_module_names) | {"torch"}
"""The top-level modules the exported copy of trainer/model.py may import: the folder has no others."""


def require_transformers() -> None:
    """InputError (one line) when the `hf` extra is not installed."""
    try:
        import transformers  # noqa: F401 (imported to see that it can be)
    except ImportError:
        raise InputError("transformers is not installed; install the hf extra: pip install -e .[hf]") from None


def standalone_model_source(source: str) -> str:
    """trainer/model.py's source `source` as the folder's looped_transformer.py: its import of
    common.errors.InputError replaced by a local class. RuntimeError when the source has changed so
    that the copy would import anything but the standard library and torch: the replacement below
    must then be brought up to date, rather than the export write a folder that cannot load."""
    if source.count(PROJECT_IMPORT) != 1:
        raise RuntimeError(
            f"trainer/model.py no longer has the line {PROJECT_IMPORT.strip()!r} exactly once: "
            "update standalone_model_source in trainer/export/hf/writer.py"
        )
    standalone = source.replace(PROJECT_IMPORT, LOCAL_INPUT_ERROR)
    foreign = sorted(
        name
        for name in _imported_modules(standalone)
        if name.startswith(".") or name.split(".")[0] not in FOLDER_IMPORTS
    )
    if foreign:
        raise RuntimeError(
            f"trainer/model.py imports {', '.join(foreign)}, which an exported folder does not have: "
            "update standalone_model_source in trainer/export/hf/writer.py"
        )
    header = (
        "# depthdiag's trainer/model.py, written by `depthdiag export --format hf`: its import of\n"
        "# common.errors.InputError is replaced by a local class, so the folder needs no depthdiag.\n"
    )
    return header + standalone


def _imported_modules(source: str) -> list[str]:
    """Every module `source` imports, anywhere in it; a relative import keeps its leading dots."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def write_hf_folder(
    snap: Snapshot,
    folder: Path,
    *,
    num_steps: int,
    provenance: dict,
    tokenizer_file: Path | None = None,
    eot_token_id: int | None = None,
) -> None:
    """Fill the empty folder `folder` with the hf export of `snap` served at depth `num_steps` by
    default, with `provenance` in its config, and the tokenizer `tokenizer_file` (end-of-text id
    `eot_token_id`) when given. OS errors name the file they concern."""
    # The templates import transformers at the top: only now, after require_transformers.
    from trainer.export.hf.configuration_depthdiag import DepthdiagConfig
    from trainer.export.hf.modeling_depthdiag import DepthdiagForCausalLM

    model = snap.model()
    config = DepthdiagConfig(num_steps=num_steps, **snap.config.model.to_dict(), provenance=provenance)
    config.architectures = [DepthdiagForCausalLM.__name__]
    config.auto_map = {
        "AutoConfig": f"{Path(CONFIG_SOURCE).stem}.{DepthdiagConfig.__name__}",
        "AutoModelForCausalLM": f"{Path(MODELING_SOURCE).stem}.{DepthdiagForCausalLM.__name__}",
    }
    config.dtype = next(model.parameters()).dtype
    # The wrapper, built without memory for its own weights, around the loaded model: its
    # state_dict is what from_pretrained will load, key for key.
    with torch.device("meta"):
        wrapper = DepthdiagForCausalLM(config)
    wrapper.model = model
    tensors = unshared_tensors(wrapper.state_dict())

    with naming_write_errors(folder / WEIGHTS_FILE):
        safetensors.torch.save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    # safetensors creates the file private (0600); it should be as readable as the others.
    os.chmod(folder / WEIGHTS_FILE, new_file_mode())
    with naming_write_errors(folder / CONFIG_FILE):
        config.save_pretrained(folder)
    source = Path(trainer.model.__file__).read_text(encoding="utf-8")
    _write_text(folder / MODEL_SOURCE, standalone_model_source(source))
    for name in TEMPLATES:
        _write_text(folder / name, (Path(__file__).parent / name).read_text(encoding="utf-8"))
    if tokenizer_file is not None:
        _write_tokenizer(folder, tokenizer_file, eot_token_id, max_length=snap.config.model.max_seq_len)
    unexpected = sorted(set(os.listdir(folder)) - set(HF_EXPORT_FILES))
    if unexpected:
        # --force recognises an export by its names: a file transformers adds must be listed.
        raise RuntimeError(f"the hf export wrote {', '.join(unexpected)}, not in HF_EXPORT_FILES")


def _write_tokenizer(folder: Path, tokenizer_file: Path, eot_token_id: int | None, *, max_length: int) -> None:
    """The tokenizer file as a PreTrainedTokenizerFast (tokenizer.json, tokenizer_config.json),
    its end-of-text token as the eos token: what lm-eval's `hf` model conditions an empty
    context on, as `depthdiag lm-eval` does."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    eos = Tokenizer.from_file(str(tokenizer_file)).id_to_token(eot_token_id) if eot_token_id is not None else None
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file),
        eos_token=eos,
        model_max_length=max_length,
        # Text as `depthdiag lm-eval` and `depthdiag prepare` encode it: a special token spelled
        # out in the text is ordinary text, and decoding removes no space before punctuation.
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    with naming_write_errors(folder / "tokenizer.json"):
        tokenizer.save_pretrained(folder)


def _write_text(path: Path, text: str) -> None:
    with naming_write_errors(path):
        path.write_text(text, encoding="utf-8")
