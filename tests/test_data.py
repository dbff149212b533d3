"""trainer/data/sources.py: the token sources."""

import json

import numpy as np
import pytest
import torch

import trainer.data.sources
from common.errors import InputError
from trainer.config import DataConfig
from trainer.data.sources import TokenSource, build_source


def write_bins(directory, train, val, dtype="uint16", meta=None):
    np.asarray(train, dtype=dtype).tofile(directory / "train.bin")
    np.asarray(val, dtype=dtype).tofile(directory / "val.bin")
    if meta is not None:
        (directory / "meta.json").write_text(json.dumps(meta))
    return build_source(DataConfig(source="bin", path=str(directory), bin_dtype=dtype))


def is_window(row: torch.Tensor, tokens: np.ndarray) -> bool:
    """Whether `row` is a contiguous slice of `tokens` (whose values are all distinct)."""
    start = int(np.flatnonzero(tokens == int(row[0]))[0])
    return np.array_equal(tokens[start : start + len(row)], row.numpy())


def test_bin_batches_are_random_windows_of_train_and_eval_windows_of_val(tmp_path):
    train, val = np.arange(1000, 3000), np.arange(5000, 5300)
    source = write_bins(tmp_path, train, val)
    assert isinstance(source, TokenSource)
    assert source.vocab_size == 65536
    batch = source.batch(0, 0, 16, 64)
    assert batch.shape == (16, 65) and batch.dtype == torch.int64
    assert all(is_window(row, train) for row in batch)
    assert len({int(row[0]) for row in batch}) > 1
    evaluation = source.eval_tokens(5, 64)
    assert evaluation.shape == (5, 65) and evaluation.dtype == torch.int64
    assert all(is_window(row, val) for row in evaluation)
    assert int(evaluation[0, 0]) == val[0] and int(evaluation[-1, -1]) == val[-1]  # spans val.bin
    assert torch.equal(evaluation, source.eval_tokens(5, 64))


def test_bin_uint32_vocab_from_meta_json_or_the_data(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    big = np.array([70000, 1, 2, 3, 4, 5])
    assert write_bins(tmp_path / "a", big, [0, 1, 99999], dtype="uint32").vocab_size == 100000
    with_meta = write_bins(tmp_path / "b", big, [0, 1, 2], dtype="uint32", meta={"vocab_size": 131072})
    assert with_meta.vocab_size == 131072
    assert int(with_meta.batch(0, 0, 4, 3).max()) == 70000


@pytest.mark.parametrize("kind", ["bin", "text", "bios"])
def test_batch_is_pure_in_seed_and_step_and_ranks_concatenate(tmp_path, kind):
    if kind == "bin":
        source = write_bins(tmp_path, np.arange(4000), np.arange(500))
    elif kind == "bios":
        source = build_source(DataConfig(source="bios", bios_people=60, seed=3))
    else:
        (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
        source = build_source(DataConfig(source="text", path=str(tmp_path / "t.txt")))
    batch = source.batch(7, 3, 8, 32)
    assert torch.equal(batch, source.batch(7, 3, 8, 32))
    assert not torch.equal(batch, source.batch(7, 4, 8, 32))
    assert not torch.equal(batch, source.batch(8, 3, 8, 32))
    for world_size in (2, 4):
        parts = [source.batch(7, 3, 8, 32, rank=r, world_size=world_size) for r in range(world_size)]
        assert torch.equal(torch.cat(parts), batch)
    with pytest.raises(ValueError):
        source.batch(7, 3, 8, 32, rank=2, world_size=2)
    with pytest.raises(ValueError, match="multiple"):
        source.batch(7, 3, 6, 32, rank=0, world_size=4)


def test_text_is_byte_level_with_the_last_tenth_held_out(tmp_path):
    text = "".join(chr(0x41 + i % 26) + "é" for i in range(300))  # multi-byte UTF-8 included
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    split = int(len(raw) * 0.9)
    source = build_source(DataConfig(source="text", path=str(path)))
    assert source.vocab_size == 256
    train_text, val_text = bytes(raw[:split]), bytes(raw[split:])
    for row in source.batch(0, 0, 16, 20):
        assert bytes(row.numpy().astype(np.uint8)) in train_text
    for row in source.eval_tokens(4, 20):
        assert bytes(row.numpy().astype(np.uint8)) in val_text


def test_bad_bin_files_raise_input_errors_naming_the_file(tmp_path):
    with pytest.raises(InputError, match=r"train\.bin"):
        build_source(DataConfig(source="bin", path=str(tmp_path)))
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(InputError, match=r"val\.bin"):
        build_source(DataConfig(source="bin", path=str(tmp_path)))
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
    source = build_source(DataConfig(source="bin", path=str(tmp_path)))
    with pytest.raises(InputError, match=r"val\.bin.*fewer than seq_len \+ 1"):
        source.eval_tokens(2, 10)
    with pytest.raises(InputError, match=r"train\.bin.*fewer than seq_len \+ 1"):
        source.batch(0, 0, 2, 100)
    (tmp_path / "val.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(InputError, match=r"val\.bin.*multiple of 4"):
        build_source(DataConfig(source="bin", path=str(tmp_path), bin_dtype="uint32"))
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(InputError, match=r"meta\.json"):
        build_source(DataConfig(source="bin", path=str(tmp_path)))


def test_bad_text_files_raise_input_errors_naming_the_file(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(InputError, match="missing.txt: no such"):
        build_source(DataConfig(source="text", path=str(missing)))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 ".encode("latin-1") * 50)
    with pytest.raises(InputError, match="latin1.txt: not UTF-8"):
        build_source(DataConfig(source="text", path=str(latin1)))
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc", encoding="utf-8")
    with pytest.raises(InputError, match="tiny.txt"):
        build_source(DataConfig(source="text", path=str(tiny)))
    short = tmp_path / "short.txt"
    short.write_text("x" * 100, encoding="utf-8")
    with pytest.raises(InputError, match="short.txt.*fewer than seq_len"):
        build_source(DataConfig(source="text", path=str(short))).batch(0, 0, 2, 95)


def test_bin_ids_past_meta_json_vocab_size_are_refused_at_open_naming_the_file_and_the_id(tmp_path):
    good = np.arange(300) % 128
    bad = good.copy()
    bad[10] = 150
    with pytest.raises(InputError, match=r"train\.bin: token id 150 at position 10 is not below vocab_size 128"):
        write_bins(tmp_path, bad, good, meta={"vocab_size": 128})
    with pytest.raises(InputError, match=r"val\.bin: token id 150 at position 10 is not below vocab_size 128"):
        write_bins(tmp_path, good, bad, meta={"vocab_size": 128})
    with pytest.raises(InputError, match=r"meta\.json: max_token_id must be an integer in \[0, vocab_size=128\)"):
        write_bins(tmp_path, good, good, meta={"vocab_size": 128, "max_token_id": 128})
    assert write_bins(tmp_path, good, good, meta={"vocab_size": 128, "max_token_id": 127}).vocab_size == 128


def test_bin_ids_past_the_scanned_prefix_are_caught_in_every_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer.data.sources, "SCAN_TOKENS", 16)
    tokens = np.full(400, 200)
    tokens[:16] = np.arange(16)  # the scanned prefix is clean
    source = write_bins(tmp_path, tokens, tokens, meta={"vocab_size": 128})
    with pytest.raises(InputError, match=r"train\.bin: token id 200 is not below vocab_size 128 \(from .*meta\.json\)"):
        source.batch(0, 0, 4, 16)
    with pytest.raises(InputError, match=r"val\.bin: token id 200 is not below vocab_size 128"):
        source.eval_tokens(2, 16)
    # A meta.json whose max_token_id is wrong is caught the same way.
    monkeypatch.undo()
    source = write_bins(tmp_path, tokens, tokens, meta={"vocab_size": 128, "max_token_id": 127})
    with pytest.raises(InputError, match=r"train\.bin: token id 200"):
        source.batch(0, 0, 4, 16)
