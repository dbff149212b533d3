"""Bring your own corpus: text files into nanoGPT-style token files for data.source = "bin".

    depthdiag prepare corpus/ --out data/mycorpus --vocab-size 8192

writes, in the output folder, `train.bin` and `val.bin` (flat arrays of token ids, uint16
when the vocabulary fits in 65,536 ids, else uint32), `tokenizer.json` (the Hugging Face
`tokenizers` file the ids come from) and `meta.json` (what trainer/data/sources.py reads: vocab_size,
max_token_id, dtype; and how the files were made).

Inputs: files, folders (every file below them that is not hidden, in sorted order of the
relative path) and glob patterns (their matches in sorted order, a folder as above), in the
order given; a file reached twice is read once, where it is first reached. Symbolic links are
followed, to files and to folders (a folder reached twice is read once); a link that leads
back to a folder it is in (a loop), or to nothing, is refused, as input or below one.

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

A small corpus (a book of 30 paragraphs, a few whole files) can leave a split without a
document at val_fraction 0.01, and the bin source needs both. Then, and only then, the split
falls back to pieces (PIECE_RULE): every document is cut at line ends into pieces of at most
PIECE_CHARS characters (a longer line is a piece of its own), and the side left empty takes
the pieces of the lowest hashes (val) or the highest (train), duplicates together, until it
holds its share of the characters (val_fraction, or 1 - val_fraction), one piece at least,
leaving the other side one at least. The pieces are the documents of the token files from
then on (each followed by the end-of-text id). Still deterministic and independent of the
order, it now depends on the other pieces; meta.json's "split" records it and the CLI says
so. Text that gives a single distinct piece cannot be split: InputError.

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
under the output's lock; an OS error while writing (a full disk) names the output file it
was writing. A file that changes between the passes is refused.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import heapq
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from common.atomic import atomic_directory
from common.choices import DOCUMENT_CHOICES
from common.digest import file_sha256
from common.errors import InputError, unreachable_input
from common.lock import claimed_outputs
from common.outputs import OutputKind, check_output, json_file, only_entries
from common.progress import progress_bar

FORMAT = "depthdiag prepare"
"""meta.json's "format", by which --force recognises a folder prepare wrote."""

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
MAX_VOCAB_SIZE = 1 << 21
"""The largest --vocab-size trained. The tokenizers trainer reserves its tables for the size
asked up front (about 100 bytes a token) and aborts the process when that allocation fails
(10**9 asks for 71 GB at once); 2**21 reserves about 200 MB and is 8x the largest
vocabularies in use. A larger tokenizer.json can still be given with --tokenizer."""
PIECE_CHARS = 1000
"""The longest piece (in characters) the fallback split cuts from a document at line ends:
a long paragraph."""
SPLIT_RULE = (
    "a document is in val when int.from_bytes(sha256(text.encode('utf-8')).digest()[:8], 'big') "
    "< val_fraction * 2**64, else in train"
)
PIECE_RULE = (
    "when the document split leaves a side without a document: each document cut at line ends "
    f"into pieces of at most {PIECE_CHARS} characters (a longer line alone), and the empty side "
    "takes the pieces of the lowest (val) or highest (train) hashes, duplicates together, until "
    "it holds its share (val_fraction, or 1 - val_fraction) of their characters, one piece at "
    "least and one left to the other side; a piece is in val when its hash < threshold"
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
        if self.vocab_size is not None and not smallest <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise InputError(
                f"--vocab-size {self.vocab_size}: must be in [{smallest}, {MAX_VOCAB_SIZE}] "
                f"(the 256 byte symbols and the end-of-text token come first; the trainer reserves "
                f"memory for every token asked)"
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


def _folder_files(folder: Path, skip: Path) -> list[Path]:
    """Every regular file below `folder` that is neither hidden nor inside `skip` (the output
    folder), sorted by relative path, following symbolic links."""
    found = []
    if folder.resolve() == skip:
        return found
    # The real paths of a walked folder and of the folders it is in: a link to one of them
    # would walk forever. Sorted names make the walk reach a folder first by its smallest path,
    # where the sort below puts its files, so a folder reached again is skipped.
    inside = {os.fspath(folder): frozenset([os.path.realpath(folder)])}
    walked = set(inside[os.fspath(folder)])
    for root, dirs, files in os.walk(folder, followlinks=True):
        chain = inside.pop(root)
        kept = []
        for name in sorted(dirs):
            path = os.path.join(root, name)
            real = os.path.realpath(path)
            if name.startswith(".") or Path(real) == skip:
                continue
            if real in chain:
                raise InputError(f"{path}: symbolic link loop (leads back to {real}, a folder it is in)")
            if real not in walked:
                walked.add(real)
                inside[path] = chain | {real}
                kept.append(name)
        dirs[:] = kept
        for name in files:
            path = Path(root, name)
            if name.startswith("."):
                continue
            if path.is_file():
                found.append(path)
            elif not path.exists():
                raise unreachable_input(path, "file or folder")
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
            matched = []
            for match in sorted(glob.glob(given, recursive=True)):
                if Path(match).is_dir():
                    matched.extend(_folder_files(Path(match), skip))
                elif Path(match).exists():
                    matched.append(Path(match))
                else:
                    raise unreachable_input(match, "file or folder")
            if not matched:
                raise InputError(f"{given}: no files match")
        elif path.exists():
            raise InputError(f"{given}: neither a file nor a folder")
        else:
            raise unreachable_input(given, "file or folder")
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


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def in_val(text: str, val_fraction: float) -> bool:
    """Whether a document is held out (see SPLIT_RULE)."""
    return _hash(text) < val_fraction * 2**64


def _pieces(text: str) -> Iterator[str]:
    """`text` cut at line ends into its non-empty pieces of at most PIECE_CHARS characters, a
    longer line alone (see PIECE_RULE)."""
    piece: list[str] = []
    size = -1
    for line in text.split("\n"):
        if piece and size + 1 + len(line) > PIECE_CHARS:
            if size > 0:
                yield "\n".join(piece)
            piece, size = [], -1
        piece.append(line)
        size += 1 + len(line)
    if size > 0:
        yield "\n".join(piece)


class Corpus:
    """The documents of the input files, one pass at a time, each pass checking that the
    files are the ones the first pass read."""

    def __init__(self, files: list[InputFile], config: PrepareConfig, progress: bool):
        self.files = files
        self.config = config
        self.progress = progress
        self.file_sha256: list[str] | None = None
        """Each file's sha256, from the first pass."""
        self.threshold: float | int = config.val_fraction * 2**64
        """A document (or piece) is in val when its hash is below this."""
        self.fallback: dict | None = None
        """How the split fell back to pieces (PIECE_RULE), or None: it is by document."""
        self.counts: dict[str, int] | None = None
        """Documents (or pieces) in each split in the last pass."""

    def _texts(self, desc: str) -> Iterator[str]:
        digests = []
        with progress_bar(sum(f.size for f in self.files), desc, "B", enabled=self.progress) as bar:
            for file in self.files:
                digest = hashlib.sha256()
                yield from _file_documents(file, self.config, digest, bar.update)
                digests.append(digest.hexdigest())
                if self.file_sha256 is not None and self.file_sha256[len(digests) - 1] != digests[-1]:
                    raise InputError(f"{file.path}: changed while it was being prepared")
        self.file_sha256 = digests

    def documents(self, desc: str) -> Iterator[tuple[str, bool]]:
        """(text, in val) for every document (or piece) in processing order."""
        counts = {"train": 0, "val": 0}
        for document in self._texts(desc):
            for text in _pieces(document) if self.fallback else (document,):
                is_val = _hash(text) < self.threshold
                counts["val" if is_val else "train"] += 1
                yield text, is_val
        self.counts = counts

    def fall_back_to_pieces(self) -> bool:
        """When the last pass left a split without a document, switch to the piece split (one
        more pass chooses its threshold) and return True."""
        if self.fallback is not None or min(self.counts.values()) > 0:
            return False
        empty = "val" if self.counts["val"] == 0 else "train"
        share = self.config.val_fraction if empty == "val" else 1 - self.config.val_fraction
        # Sorting keys: the empty side takes the smallest. Characters are at least a byte each,
        # so a key is never needed once the smaller ones hold `bound`: the candidates stay few.
        flip = 0 if empty == "val" else 2**64 - 1
        bound = share * sum(f.size for f in self.files)
        chars: dict[int, int] = {}
        largest: list[int] = []
        held = total = documents = count = 0
        dropped = False
        for document in self._texts("prepare: cutting documents into pieces"):
            documents += 1
            for text in _pieces(document):
                key = _hash(text) ^ flip
                if key not in chars:
                    chars[key] = 0
                    heapq.heappush(largest, -key)
                chars[key] += len(text)
                held += len(text)
                total += len(text)
                count += 1
                while len(largest) > 1 and held - chars[-largest[0]] >= bound:
                    held -= chars.pop(-heapq.heappop(largest))
                    dropped = True
        keys = sorted(chars)
        if len(keys) < 2 and not dropped:
            raise InputError(
                f"{' '.join(self.config.inputs)}: too little text to split into train and val (its "
                f"{documents} document(s) cut at line ends give {len(keys)} distinct piece(s)); give more text"
            )
        last, taken = 0, chars[keys[0]]
        while taken < share * total and last < len(keys) - 1:
            last += 1
            taken += chars[keys[last]]
        if last == len(keys) - 1 and not dropped:
            last -= 1
        self.threshold = keys[last] + 1 if empty == "val" else keys[last] ^ flip
        self.fallback = {
            "because": f"no document of {documents:,} fell in {empty} at val_fraction {self.config.val_fraction}",
            "rule": PIECE_RULE,
            "piece_chars": PIECE_CHARS,
            "pieces": count,
            "threshold": self.threshold,
        }
        return True

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


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Name `path` in an OS error raised while writing it: a failed write names no file, and
    a full disk should say which file it stopped."""
    try:
        yield
    except OSError as err:
        raise OSError(err.errno, err.strerror or str(err), str(path)) from None


def _dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _encode(corpus: Corpus, tokenizer, eot_id: int, dtype: str, folder: Path) -> dict:
    """Append every document's ids and eot_id to folder/{train,val}.bin; the counts."""
    counts = {"documents": {"train": 0, "val": 0}, "tokens": {"train": 0, "val": 0}}
    top = eot_id
    # A document that spells out a special token is text like any other: only the end of a
    # document may produce eot_id, or the boundaries in the token files would lie.
    tokenizer.encode_special_tokens = True
    paths = {split: folder / f"{split}.bin" for split in ("train", "val")}
    with open(paths["train"], "wb") as train, open(paths["val"], "wb") as val:
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
                # Not ndarray.tofile, whose failed write gives neither the errno nor the reason.
                # Flushed at once, so that closing the files never writes: an error there
                # would replace the one that names its file.
                with _writing(paths[split]):
                    handles[split].write(array.astype(dtype))
                    handles[split].flush()
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
        for split, handle in handles.items():
            with _writing(paths[split]):
                os.fsync(handle.fileno())
    counts["max_token_id"] = top
    return counts


OUTPUT_FILES = ("train.bin", "val.bin", "tokenizer.json", "meta.json")


def _is_prepared_data(out: Path) -> bool:
    """A data folder depthdiag prepare wrote: its files alone, meta.json saying so."""
    meta = json_file(out / "meta.json")
    return out.is_dir() and only_entries(out, OUTPUT_FILES) and meta is not None and meta.get("format") == FORMAT


PREPARED_DATA = OutputKind("prepared data folder", _is_prepared_data, folder=True, entries=OUTPUT_FILES)


def prepare(config: PrepareConfig, *, progress: bool = True) -> PrepareSummary:
    """Build config.out from config.inputs (see the module docstring)."""
    out = config.out
    files = find_inputs(config.inputs, out)
    inputs = [file.path for file in files] + ([config.tokenizer] if config.tokenizer is not None else [])
    check_output(out, kind=PREPARED_DATA, inputs=inputs, force=config.force)
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
    with claimed_outputs([out], kind=PREPARED_DATA, inputs=inputs, force=config.force), atomic_directory(out) as folder:
        corpus = Corpus(files, config, progress)
        if tokenizer is None:
            tokenizer = train_tokenizer(corpus, config.vocab_size, config.eot)
            if corpus.fall_back_to_pieces():
                tokenizer = train_tokenizer(corpus, config.vocab_size, config.eot)
            # What Tokenizer.save writes; its failed write is a bare Exception, not an OSError.
            text = tokenizer.to_str(pretty=True)
            with _writing(folder / "tokenizer.json"):
                (folder / "tokenizer.json").write_text(text, encoding="utf-8")
        else:
            # Not shutil.copyfile: on a full disk its error names the source, not the copy.
            data = config.tokenizer.read_bytes()
            with _writing(folder / "tokenizer.json"):
                (folder / "tokenizer.json").write_bytes(data)
        eot_id = tokenizer.token_to_id(config.eot)
        dtype = _dtype(tokenizer.get_vocab_size(with_added_tokens=True))
        counts = _encode(corpus, tokenizer, eot_id, dtype, folder)
        if corpus.fall_back_to_pieces():
            counts = _encode(corpus, tokenizer, eot_id, dtype, folder)
        for split in ("train", "val"):
            if counts["tokens"][split] < 2:
                raise InputError(
                    f"{' '.join(config.inputs)}: {counts['documents'][split]} documents fell in the {split} "
                    "split, and the bin source needs at least 2 tokens in each; give more text or change "
                    "--val-fraction"
                )
        meta = _meta(config, files, corpus, tokenizer, eot_id, dtype, counts, folder)
        with _writing(folder / "meta.json"):
            (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return PrepareSummary(out=out, meta=meta)


def _meta(config: PrepareConfig, files, corpus: Corpus, tokenizer, eot_id: int, dtype: str, counts, folder) -> dict:
    """meta.json: the keys trainer/data/sources.py reads (vocab_size, max_token_id, dtype), the
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
        "format": FORMAT,
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
        "split": {"unit": "document", "val_fraction": config.val_fraction, "rule": SPLIT_RULE}
        if corpus.fallback is None
        else {"unit": "piece", "val_fraction": config.val_fraction, "rule": SPLIT_RULE, "fallback": corpus.fallback},
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
