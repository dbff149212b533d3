"""Bring your own corpus: text files into nanoGPT-style token files for data.source = "bin".

    depthdiag prepare corpus/ --out data/mycorpus --vocab-size 8192

writes, in the output folder, `train.bin` and `val.bin` (flat arrays of token ids, uint16
when the vocabulary fits in 65,536 ids, else uint32), `tokenizer.json` (the Hugging Face
`tokenizers` file the ids come from) and `meta.json` (what trainer/data.py reads: vocab_size,
max_token_id, dtype; and how the files were made).

Inputs: files, folders (every file below them that is not hidden, in sorted order of the
relative path) and glob patterns (their matches in sorted order, a folder as above), in the
order given; a file reached twice is read once, where it is first reached.

Documents:

- A `.jsonl` file holds one document per line: a JSON object whose `text_field` is a string.
  Blank lines are skipped; an empty string is an empty document.
- Any other file is UTF-8 text (a leading byte-order mark is dropped, '\\r\\n' reads as '\\n').
  With document = "paragraph" (the default) its documents are its paragraphs: runs of lines
  that are not blank (empty or whitespace only), joined with '\\n'. With document = "file"
  the whole file is one document, its trailing whitespace dropped (it is held in memory).
- Empty documents are dropped.

Split: a document goes to val.bin when the first 8 bytes of the sha256 of its UTF-8 text,
read as a big-endian integer, are below val_fraction * 2**64, else to train.bin. The split
depends on a document's content alone: not on the order, the other documents or the
machine, and duplicates of a document all land on the same side. Each split's documents
keep their input order; each document's ids are followed by the end-of-text token's id.

Tokenizer: byte-level BPE (GPT-2's pre-tokenizer regex, no prefix space, the 256 byte
symbols as the initial alphabet, so any UTF-8 text encodes and decodes back to itself),
either trained here on the training documents only (none of val.bin's text is seen) with
the end-of-text token as id 0, or loaded from a given tokenizer.json, which must know the
end-of-text token. Text that spells a special token (a literal '<|endoftext|>') is encoded as
ordinary text, so the end-of-text id in the token files marks the ends of documents only.
Training is deterministic: the trainer's pair counts are sums over the
documents and its ties are broken by token ids, so neither the order in which its threads
see the documents nor their number (RAYON_NUM_THREADS) changes the result; two runs on the
same input write byte-identical files (a test runs it with one and with two threads).

Memory: the corpus is read line by line (twice when the tokenizer is trained: once to
train it, once to encode) and encoded in batches appended to the token files, so neither
the corpus nor its token ids are ever held whole; the tokenizer trainer holds the
distinct pre-tokenized words and their counts.

The output appears complete or not at all: everything is written in a hidden folder beside
it, which replaces the output only when finished (an existing output only with force),
under the output's lock. A file that changes between the two passes is refused.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from common.atomic import atomic_directory
from common.choices import DOCUMENT_CHOICES
from common.digest import file_sha256
from common.errors import InputError
from common.lock import claimed_outputs, refuse_existing
from common.progress import progress_bar

FORMAT_VERSION = 1
EOT = "<|endoftext|>"
"""The default end-of-text token (GPT-2's name for it)."""
MIN_FREQUENCY = 2
"""A trained merge must occur at least this often in the training documents."""
BYTE_SYMBOLS = 256
ENCODE_BATCH_CHARS = 1 << 22
"""Characters of text encoded in one batch (the ids of one batch are in memory at once)."""
PROGRESS_BYTES = 1 << 20
"""Bytes read between progress updates."""
SPLIT_RULE = (
    "a document is in val when int.from_bytes(sha256(text.encode('utf-8')).digest()[:8], 'big') "
    "< val_fraction * 2**64, else in train"
)
CORPUS_SHA256_RULE = (
    "sha256 of the listing that `sha256sum NAME...` prints for the input files in processing "
    "order (one '<sha256>  <name>\\n' line each), names relative to input_root"
)


@dataclass(frozen=True)
class PrepareConfig:
    inputs: tuple[str, ...]
    """Files, folders (read recursively) and glob patterns, in processing order."""
    out: Path
    """The output folder (train.bin, val.bin, tokenizer.json, meta.json)."""
    vocab_size: int | None = None
    """Train a byte-level BPE tokenizer of this many tokens (end-of-text included) on the corpus..."""
    tokenizer: Path | None = None
    """...or encode with this tokenizer.json (exactly one of the two)."""
    text_field: str = "text"
    """The field of a .jsonl line that holds the document."""
    val_fraction: float = 0.01
    """Expected fraction of the documents held out in val.bin (chosen by their content's hash)."""
    document: str = "paragraph"
    """What a document of a plain-text file is: 'paragraph' (blank-line separated) or 'file'."""
    eot: str = EOT
    """The end-of-text token appended to every document."""
    force: bool = False
    """Replace an existing output folder."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(str(i) for i in self.inputs))
        object.__setattr__(self, "out", Path(self.out))
        if self.tokenizer is not None:
            object.__setattr__(self, "tokenizer", Path(self.tokenizer))
        if not self.inputs:
            raise InputError("prepare: no input given")
        if (self.vocab_size is None) == (self.tokenizer is None):
            raise InputError(
                "give exactly one of --vocab-size N (train a tokenizer on the corpus) and "
                "--tokenizer FILE (use a tokenizer.json)"
            )
        smallest = BYTE_SYMBOLS + 1
        if self.vocab_size is not None and not smallest <= self.vocab_size <= 1 << 32:
            raise InputError(
                f"--vocab-size {self.vocab_size}: must be in [{smallest}, 2**32] "
                f"(the 256 byte symbols and the end-of-text token come first)"
            )
        if not 0 < self.val_fraction < 1:
            raise InputError(f"--val-fraction {self.val_fraction}: must be between 0 and 1")
        if self.document not in DOCUMENT_CHOICES:
            raise InputError(f"--document {self.document!r}: must be one of {', '.join(DOCUMENT_CHOICES)}")
        if not self.text_field or not self.eot:
            raise InputError("--text-field and --eot must not be empty")


@dataclass(frozen=True)
class PrepareSummary:
    out: Path
    meta: dict
    """The meta.json written."""


@dataclass(frozen=True)
class InputFile:
    path: Path
    """As found (an argument, a glob match or a file below a folder argument)."""
    name: str
    """Relative to the deepest folder that holds every input file (POSIX separators)."""
    size: int


# --- finding the input files -----------------------------------------------------------------


def _is_hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _folder_files(folder: Path, skip: Path) -> list[Path]:
    """Every regular file below `folder` that is neither hidden nor inside `skip` (the output
    folder), sorted by relative path."""
    found = []
    if folder.resolve() == skip:
        return found
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if Path(root, d).resolve() != skip]
        for name in files:
            path = Path(root, name)
            if not _is_hidden(path.relative_to(folder)) and path.is_file():
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(folder).parts)


def find_inputs(inputs: tuple[str, ...], out: Path) -> list[InputFile]:
    """The input files in processing order; InputError names an input that matches nothing."""
    skip = out.resolve()
    paths: list[Path] = []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            matched = _folder_files(path, skip)
            if not matched:
                raise InputError(f"{given}: no files in this folder")
        elif path.is_file():
            matched = [path]
        elif glob.has_magic(given):
            matched = [
                file
                for match in sorted(glob.glob(given, recursive=True))
                for file in (_folder_files(Path(match), skip) if Path(match).is_dir() else [Path(match)])
            ]
            if not matched:
                raise InputError(f"{given}: no files match")
        elif path.exists():
            raise InputError(f"{given}: neither a file nor a folder")
        else:
            raise InputError(f"{given}: no such file or folder")
        paths.extend(matched)
    unique: dict[str, Path] = {}
    for path in paths:
        unique.setdefault(os.path.realpath(path), path)
    absolute = [os.path.abspath(p) for p in unique.values()]
    root = os.path.commonpath([os.path.dirname(a) for a in absolute])
    return [
        InputFile(path=p, name=Path(os.path.relpath(a, root)).as_posix(), size=p.stat().st_size)
        for p, a in zip(unique.values(), absolute)
    ]


# --- reading documents -----------------------------------------------------------------------


def _lines(file: InputFile, digest, on_bytes: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    """(line number, text without its line end) of `file`, feeding its bytes to `digest`."""
    pending = 0
    try:
        with open(file.path, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                digest.update(raw)
                pending += len(raw)
                if pending >= PROGRESS_BYTES:
                    on_bytes(pending)
                    pending = 0
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise InputError(f"{file.path}: line {number} is not UTF-8 ({err.reason})") from None
                yield number, line.removesuffix("\n").removesuffix("\r")
    except OSError as err:
        raise InputError(f"{file.path}: cannot read ({err.strerror or err})") from None
    on_bytes(pending)


def _file_documents(file: InputFile, config: PrepareConfig, digest, on_bytes) -> Iterator[str]:
    """The non-empty documents of one input file, in order."""
    lines = _lines(file, digest, on_bytes)
    if file.path.suffix == ".jsonl":
        for number, line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{file.path}: line {number} is not JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise InputError(f"{file.path}: line {number} is not a JSON object")
            if config.text_field not in record:
                raise InputError(f"{file.path}: line {number} has no {config.text_field!r} field")
            text = record[config.text_field]
            if not isinstance(text, str):
                raise InputError(f"{file.path}: line {number}: {config.text_field!r} is not a string")
            if text:
                yield text
    elif config.document == "file":
        text = "\n".join(line for _, line in lines).rstrip()
        if text:
            yield text
    else:
        paragraph: list[str] = []
        for _, line in lines:
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "\n".join(paragraph)
                paragraph = []
        if paragraph:
            yield "\n".join(paragraph)


def in_val(text: str, val_fraction: float) -> bool:
    """Whether a document is held out (see SPLIT_RULE)."""
    head = hashlib.sha256(text.encode("utf-8")).digest()[:8]
    return int.from_bytes(head, "big") < val_fraction * 2**64


class Corpus:
    """The documents of the input files, one pass at a time, each pass checking that the
    files are the ones the first pass read."""

    def __init__(self, files: list[InputFile], config: PrepareConfig, progress: bool):
        self.files = files
        self.config = config
        self.progress = progress
        self.file_sha256: list[str] | None = None
        """Each file's sha256, from the first pass."""

    def documents(self, desc: str) -> Iterator[tuple[str, bool]]:
        """(text, in val) for every document in processing order."""
        digests = []
        with progress_bar(sum(f.size for f in self.files), desc, "B", enabled=self.progress) as bar:
            for file in self.files:
                digest = hashlib.sha256()
                for text in _file_documents(file, self.config, digest, bar.update):
                    yield text, in_val(text, self.config.val_fraction)
                digests.append(digest.hexdigest())
                if self.file_sha256 is not None and self.file_sha256[len(digests) - 1] != digests[-1]:
                    raise InputError(f"{file.path}: changed while it was being prepared")
        self.file_sha256 = digests

    def sha256(self) -> str:
        listing = "".join(f"{h}  {f.name}\n" for h, f in zip(self.file_sha256, self.files))
        return hashlib.sha256(listing.encode("utf-8")).hexdigest()


# --- the tokenizer ---------------------------------------------------------------------------


def train_tokenizer(corpus: Corpus, vocab_size: int, eot: str):
    """A byte-level BPE tokenizer trained on the training documents of `corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=[eot],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    training = (text for text, val in corpus.documents("prepare: training the tokenizer") if not val)
    tokenizer.train_from_iterator(training, trainer)
    return tokenizer


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    if not path.is_file():
        raise InputError(f"{path}: no such tokenizer file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises a bare Exception for every parse error
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise InputError(f"{path}: not a tokenizers tokenizer.json ({reason})") from None


# --- writing ---------------------------------------------------------------------------------


def _dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _encode(corpus: Corpus, tokenizer, eot_id: int, dtype: str, folder: Path) -> dict:
    """Append every document's ids and eot_id to folder/{train,val}.bin; the counts."""
    counts = {"documents": {"train": 0, "val": 0}, "tokens": {"train": 0, "val": 0}}
    top = eot_id
    # A document that spells out a special token is text like any other: only the end of a
    # document may produce eot_id, or the boundaries in the token files would lie.
    tokenizer.encode_special_tokens = True
    with open(folder / "train.bin", "wb") as train, open(folder / "val.bin", "wb") as val:
        handles = {"train": train, "val": val}
        batch: list[tuple[str, bool]] = []
        chars = 0

        def flush() -> None:
            nonlocal top
            encodings = tokenizer.encode_batch_fast([text for text, _ in batch], add_special_tokens=False)
            for split in ("train", "val"):
                ids = [e.ids + [eot_id] for e, (_, v) in zip(encodings, batch) if v == (split == "val")]
                if not ids:
                    continue
                array = np.fromiter((i for doc in ids for i in doc), dtype=np.int64)
                top = max(top, int(array.max()))
                array.astype(dtype).tofile(handles[split])
                counts["documents"][split] += len(ids)
                counts["tokens"][split] += len(array)
            batch.clear()

        for text, is_val in corpus.documents("prepare: encoding"):
            batch.append((text, is_val))
            chars += len(text)
            if chars >= ENCODE_BATCH_CHARS:
                flush()
                chars = 0
        if batch:
            flush()
        for handle in handles.values():
            handle.flush()
            os.fsync(handle.fileno())
    counts["max_token_id"] = top
    return counts


def prepare(config: PrepareConfig, *, progress: bool = True) -> PrepareSummary:
    """Build config.out from config.inputs (see the module docstring)."""
    out = config.out
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    refuse_existing([out], force=config.force)
    files = find_inputs(config.inputs, out)
    tokenizer = None
    if config.tokenizer is not None:
        tokenizer = load_tokenizer(config.tokenizer)
        if tokenizer.token_to_id(config.eot) is None:
            raise InputError(
                f"{config.tokenizer}: has no {config.eot!r} token to end documents with; "
                "name its end-of-text token with --eot"
            )
    # The lock clears what a killed prepare left beside `out`; the folder is built beside it and
    # takes its place complete, or not at all.
    with claimed_outputs([out], force=config.force), atomic_directory(out) as folder:
        corpus = Corpus(files, config, progress)
        if tokenizer is None:
            tokenizer = train_tokenizer(corpus, config.vocab_size, config.eot)
            tokenizer.save(str(folder / "tokenizer.json"))
        else:
            shutil.copyfile(config.tokenizer, folder / "tokenizer.json")
        eot_id = tokenizer.token_to_id(config.eot)
        dtype = _dtype(tokenizer.get_vocab_size(with_added_tokens=True))
        counts = _encode(corpus, tokenizer, eot_id, dtype, folder)
        for split in ("train", "val"):
            if counts["tokens"][split] < 2:
                raise InputError(
                    f"{' '.join(config.inputs)}: {counts['documents'][split]} documents fell in the {split} "
                    "split, and the bin source needs at least 2 tokens in each; give more text or change "
                    "--val-fraction"
                )
        meta = _meta(config, files, corpus, tokenizer, eot_id, dtype, counts, folder)
        (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return PrepareSummary(out=out, meta=meta)


def _meta(config: PrepareConfig, files, corpus: Corpus, tokenizer, eot_id: int, dtype: str, counts, folder) -> dict:
    """meta.json: the keys trainer/data.py reads (vocab_size, max_token_id, dtype), the
    tokenizer's file name relative to the folder, and how the files were made."""
    import tokenizers

    training = None
    if config.tokenizer is None:
        training = {
            "model": "byte-level BPE",
            "vocab_size_asked": config.vocab_size,
            "min_frequency": MIN_FREQUENCY,
            "trained_on": "the train split's documents",
        }
    return {
        "format": "depthdiag prepare",
        "format_version": FORMAT_VERSION,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "max_token_id": counts["max_token_id"],
        "dtype": dtype,
        "tokenizer": "tokenizer.json",
        "tokenizer_sha256": file_sha256(folder / "tokenizer.json"),
        "tokenizers_version": tokenizers.__version__,
        "tokenizer_training": training,
        "eot_token": config.eot,
        "eot_id": eot_id,
        "tokens": counts["tokens"],
        "documents": counts["documents"],
        "document": "a line of a .jsonl file; in other files, a "
        + ("blank-line separated paragraph" if config.document == "paragraph" else "whole file"),
        "split": {"unit": "document", "val_fraction": config.val_fraction, "rule": SPLIT_RULE},
        "corpus_sha256": corpus.sha256(),
        "corpus_sha256_rule": CORPUS_SHA256_RULE,
        "input_root": "the deepest folder that holds every input file",
        "input_files": len(files),
        "input_bytes": sum(f.size for f in files),
        "options": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in asdict(config).items()
            if key not in ("out", "force")
        },
    }
