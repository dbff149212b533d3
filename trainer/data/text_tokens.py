"""Text to tokens and back for a depthdiag checkpoint, as its training data made them:

- `data.source = 'text'`: UTF-8 bytes, tokens 0..255 (trainer/data/sources.py);
- `data.source = 'bin'`: the Hugging Face `tokenizers` file that the data folder's meta.json
  names (key "tokenizer", a file name relative to the folder; its end-of-text id "eot_id",
  as `depthdiag prepare` writes them);
- a tokenizer file given explicitly, over either;
- bioS checkpoints have a synthetic vocabulary with no text form: an error.

Each tokenizer also names the token an empty context is conditioned on (`prefix_token_id`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from common.errors import InputError
from trainer.config import RunConfig
from trainer.data.prepare import EOT, load_tokenizer


def eval_extra_missing(package: str) -> InputError:
    """The one-line error for a package of the optional `eval` extra that is not installed."""
    return InputError(f"{package} is not installed; install the eval extra: pip install -e .[eval]")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, the tokenizer of `data.source = 'text'` (trainer/data/sources.py)."""

    name = "bytes (UTF-8)"
    vocab_size = 256
    # The text source has no document token; a newline is the closest thing to a boundary
    # in plain text, so an empty context (the first token of a rolling log-likelihood) is
    # conditioned on one.
    prefix_token_id = ord("\n")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face `tokenizers` tokenizer file (tokenizer.json), encoding as `depthdiag prepare`
    writes the token files of a `bin` data folder: no special tokens added, and text that spells
    one out encoded as ordinary text."""

    def __init__(self, path: Path, eot_token_id: int | None = None):
        self._tokenizer = load_tokenizer(path)
        self._tokenizer.encode_special_tokens = True
        self.name = str(path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        if eot_token_id is None:
            eot_token_id = self._tokenizer.token_to_id(EOT)
        if eot_token_id is None:
            eot_token_id = self.encode("\n")[0]
        self.prefix_token_id = int(eot_token_id)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.decode(list(tokens), skip_special_tokens=False)


def resolve_tokenizer(config: RunConfig, override: str | Path | None, source: Path) -> ByteTokenizer | FileTokenizer:
    """The tokenizer of a checkpoint's data (see the module docstring); InputError naming `source`
    (the checkpoint) or the tokenizer file when there is none or it does not fit the model."""
    data = config.data
    if override is not None:
        tokenizer = FileTokenizer(Path(override))
    elif data.source == "text":
        tokenizer = ByteTokenizer()
    elif data.source == "bin":
        tokenizer = _bin_tokenizer(Path(data.path), source)
    else:
        raise InputError(
            f"{source}: a bioS checkpoint (data.source='bios') has a synthetic vocabulary with no text form; "
            "downstream tasks need a 'text' or 'bin' checkpoint (or tokenizer=PATH)"
        )
    if tokenizer.vocab_size > config.model.vocab_size:
        raise InputError(
            f"{tokenizer.name}: {tokenizer.vocab_size} tokens, more than the model's vocab_size "
            f"{config.model.vocab_size} ({source})"
        )
    return tokenizer


def _bin_tokenizer(folder: Path, source: Path) -> FileTokenizer:
    meta = folder / "meta.json"
    try:
        record = json.loads(meta.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(
            f"{source}: its data folder has no {meta} naming a tokenizer; pass tokenizer=PATH (--tokenizer)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{meta}: not readable JSON ({err})") from None
    name = record.get("tokenizer") if isinstance(record, dict) else None
    if not isinstance(name, str) or not name:
        raise InputError(f"{meta}: names no tokenizer file (key 'tokenizer'); pass tokenizer=PATH (--tokenizer)")
    eot = record.get("eot_id")
    if eot is not None and (isinstance(eot, bool) or not isinstance(eot, int)):
        raise InputError(f"{meta}: eot_id must be an integer, got {eot!r}")
    path = folder / name
    if not path.is_file():
        raise InputError(f"{path}: no such tokenizer file (named by {meta}); pass tokenizer=PATH (--tokenizer)")
    return FileTokenizer(path, eot_token_id=eot)
