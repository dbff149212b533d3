"""Token sources: where training batches and the evaluation set come from.

Every source answers two questions:

- `batch(seed, step, batch_size, seq_len, rank=, world_size=)`: int64
  [batch_size // world_size, seq_len + 1], a pure function of (seed, step) and
  the data. Randomness is drawn for the whole global batch and each rank keeps
  its contiguous slice of rows (trainer/rng.py), so concatenating the ranks'
  slices in rank order gives exactly the one-process batch; resume and every
  rank agree without communication.
- `eval_tokens(n, seq_len)`: int64 [n, seq_len + 1], a fixed evaluation set
  that depends on the data config alone.

Sources (DataConfig.source):

- 'bin': nanoGPT-style `train.bin` / `val.bin` in `data.path`, flat token ids
  as uint16 or uint32 (`data.bin_dtype`). Batches are random windows of
  train.bin; the evaluation set is evenly spaced windows of val.bin.
  vocab_size comes from a `meta.json` beside the files (`{"vocab_size": N}`)
  when there is one; otherwise 65536 for uint16 (the dtype's range: finding
  the true maximum would read the whole file) and max id + 1 for uint32 (one
  pass over both files). Token ids are checked against a meta.json vocab_size
  before anything is trained or written: meta.json may record the largest id
  (`{"vocab_size": N, "max_token_id": M}`), which must be below N; without it the
  first SCAN_TOKENS (2**24) tokens of each file are read at open. Every batch and the
  evaluation set are checked as they are drawn (one max over a few thousand
  ids), so an id past the scanned prefix never reaches the model: InputError
  names the file and the id. A meta.json `dtype` ('uint16' or 'uint32', as `depthdiag
  prepare` writes, trainer/data/prepare.py) must equal data.bin_dtype; its `tokenizer` names the
  tokenizer.json the ids come from, relative to `data.path`.
- 'text': one UTF-8 file with byte-level tokens (vocab 256); the last 10% of
  the bytes is held out for evaluation.
- 'bios': the synthetic factual-recall task of trainer/data/bios.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from common.errors import InputError
from trainer.config import DataConfig
from trainer.data.bios import BiosSource
from trainer.rng import batch_rng, rank_rows

TEXT_HELD_OUT_FRACTION = 0.1
"""Fraction of a text file's bytes (at its end) held out for evaluation."""

BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}

SCAN_TOKENS = 1 << 24
"""Tokens at the start of each of train.bin and val.bin read at open to check them against
meta.json's vocab_size when it records no max_token_id (32 MiB of uint16: a fraction of a
second); ids beyond are checked batch by batch."""
SCAN_CHUNK = 1 << 20
"""Tokens read at a time by that scan."""


@runtime_checkable
class TokenSource(Protocol):
    vocab_size: int
    """Token ids lie in [0, vocab_size)."""

    def batch(
        self, seed: int, step: int, batch_size: int, seq_len: int, *, rank: int = 0, world_size: int = 1
    ) -> torch.Tensor:
        """This rank's rows of the global training batch for (seed, step):
        int64 [batch_size // world_size, seq_len + 1]."""
        ...

    def eval_tokens(self, n: int, seq_len: int) -> torch.Tensor:
        """The fixed evaluation set: int64 [n, seq_len + 1]."""
        ...


class WindowSource:
    """Random windows of a flat training token array; evenly spaced windows of
    a flat evaluation array. Shared by the 'bin' and 'text' sources."""

    def __init__(
        self,
        train: np.ndarray,
        val: np.ndarray,
        vocab_size: int,
        train_origin: str,
        val_origin: str,
        vocab_origin: str = "the data's vocabulary",
    ):
        self.train = train
        self.val = val
        self.vocab_size = vocab_size
        self.train_origin = train_origin
        """Names the training tokens in error messages (a path, or 'path (first 90%)')."""
        self.val_origin = val_origin
        self.vocab_origin = vocab_origin
        """Where vocab_size comes from, for error messages (e.g. the meta.json)."""

    def batch(
        self, seed: int, step: int, batch_size: int, seq_len: int, *, rank: int = 0, world_size: int = 1
    ) -> torch.Tensor:
        rows = rank_rows(batch_size, rank, world_size)
        last_start = self._last_start(self.train, self.train_origin, seq_len)
        starts = batch_rng(seed, step).integers(0, last_start + 1, size=batch_size)[rows]
        return self._checked(self._windows(self.train, starts, seq_len), self.train_origin)

    def eval_tokens(self, n: int, seq_len: int) -> torch.Tensor:
        if n < 1:
            raise InputError(f"n must be >= 1, got {n}")
        last_start = self._last_start(self.val, self.val_origin, seq_len)
        starts = np.linspace(0, last_start, n).round().astype(np.int64)
        return self._checked(self._windows(self.val, starts, seq_len), self.val_origin)

    def _checked(self, tokens: torch.Tensor, origin: str) -> torch.Tensor:
        """`tokens`, once every id is known to be below vocab_size (one max: cheap next to a
        training step; the scan at open reads only a prefix of large files)."""
        top = int(tokens.max()) if tokens.numel() else 0
        if top >= self.vocab_size:
            raise InputError(
                f"{origin}: token id {top} is not below vocab_size {self.vocab_size} ({self.vocab_origin})"
            )
        return tokens

    @staticmethod
    def _last_start(tokens: np.ndarray, origin: str, seq_len: int) -> int:
        if seq_len < 1:
            raise InputError(f"seq_len must be >= 1, got {seq_len}")
        if len(tokens) < seq_len + 1:
            raise InputError(f"{origin}: {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        return len(tokens) - seq_len - 1

    @staticmethod
    def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
        index = starts[:, None] + np.arange(seq_len + 1)  # [rows, seq_len + 1]
        return torch.from_numpy(tokens[index].astype(np.int64))


def open_bin_source(directory: str | Path, bin_dtype: str = "uint16") -> WindowSource:
    """train.bin / val.bin (and optionally meta.json) in `directory`."""
    directory = Path(directory)
    dtype = np.dtype(BIN_DTYPES[bin_dtype])
    arrays = {}
    for split in ("train", "val"):
        path = directory / f"{split}.bin"
        if not path.is_file():
            raise InputError(f"{path}: no such token file (expected train.bin and val.bin)")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise InputError(
                f"{path}: size {size} bytes is not a multiple of {dtype.itemsize} ({bin_dtype}); wrong data.bin_dtype?"
            )
        if size < 2 * dtype.itemsize:
            raise InputError(f"{path}: fewer than 2 tokens")
        arrays[split] = np.memmap(path, dtype=dtype, mode="r")
    vocab_size = _bin_vocab_size(directory, bin_dtype, arrays)
    meta = directory / "meta.json"
    return WindowSource(
        arrays["train"],
        arrays["val"],
        vocab_size,
        str(directory / "train.bin"),
        str(directory / "val.bin"),
        f"from {meta}" if meta.is_file() else f"the {bin_dtype} range or the files' largest id",
    )


def _bin_vocab_size(directory: Path, bin_dtype: str, arrays: dict[str, np.ndarray]) -> int:
    """vocab_size from meta.json, once the ids are known to lie below it (its max_token_id, or
    a scan of each file's first SCAN_TOKENS); without meta.json, one that covers every id."""
    meta = directory / "meta.json"
    dtype_range = int(np.iinfo(BIN_DTYPES[bin_dtype]).max) + 1
    if meta.is_file():
        try:
            record = json.loads(meta.read_text(encoding="utf-8"))
            vocab_size = record["vocab_size"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise InputError(f"{meta}: expected JSON with an integer vocab_size ({err!r})") from None
        recorded_dtype = record.get("dtype", bin_dtype)
        if recorded_dtype != bin_dtype:
            raise InputError(
                f"{meta}: the token files are {recorded_dtype!r}, but data.bin_dtype is {bin_dtype!r}; "
                f"set data.bin_dtype = {json.dumps(recorded_dtype)}"
            )
        if not _is_int(vocab_size) or not 1 <= vocab_size <= dtype_range:
            raise InputError(f"{meta}: vocab_size must be an integer in [1, {dtype_range}], got {vocab_size!r}")
        max_token_id = record.get("max_token_id")
        if max_token_id is None:
            for split, tokens in arrays.items():
                _scan_ids(tokens, directory / f"{split}.bin", vocab_size, meta)
        elif not _is_int(max_token_id) or not 0 <= max_token_id < vocab_size:
            raise InputError(
                f"{meta}: max_token_id must be an integer in [0, vocab_size={vocab_size}), got {max_token_id!r}"
            )
        return vocab_size
    if bin_dtype == "uint16":
        return dtype_range
    return int(max(array.max() for array in arrays.values())) + 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _scan_ids(tokens: np.ndarray, path: Path, vocab_size: int, meta: Path) -> None:
    """Raise InputError naming the first id in `tokens[:SCAN_TOKENS]` that is not below `vocab_size`."""
    end = min(len(tokens), SCAN_TOKENS)
    for start in range(0, end, SCAN_CHUNK):
        chunk = np.asarray(tokens[start : min(start + SCAN_CHUNK, end)])
        if int(chunk.max()) >= vocab_size:
            at = int(np.argmax(chunk >= vocab_size))
            raise InputError(
                f"{path}: token id {int(chunk[at])} at position {start + at} is not below "
                f"vocab_size {vocab_size} (from {meta})"
            )


def open_text_source(path: str | Path) -> WindowSource:
    """A UTF-8 file as byte tokens; the last TEXT_HELD_OUT_FRACTION is the evaluation split."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such text file") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror})") from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    tokens = np.frombuffer(raw, dtype=np.uint8)
    split = int(len(tokens) * (1 - TEXT_HELD_OUT_FRACTION))
    if split < 2 or len(tokens) - split < 2:
        raise InputError(f"{path}: {len(tokens)} bytes is too short to split into training and evaluation text")
    return WindowSource(
        tokens[:split],
        tokens[split:],
        256,
        f"{path} (first {1 - TEXT_HELD_OUT_FRACTION:.0%})",
        f"{path} (last {TEXT_HELD_OUT_FRACTION:.0%})",
    )


def build_source(data: DataConfig) -> TokenSource:
    """The token source a data config describes; bad files raise InputError naming the file."""
    if data.source == "bin":
        return open_bin_source(data.path, data.bin_dtype)
    if data.source == "text":
        return open_text_source(data.path)
    return BiosSource.generate(
        people=data.bios_people,
        seed=data.seed,
        planted_fraction=data.planted_fraction,
        planted_unit=data.planted_unit,
        planted_queries=data.planted_queries,
        planted_max_hops=data.planted_max_hops,
    )
