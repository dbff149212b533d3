"""`depthdiag export`: the model as model.safetensors + config.json, loaded back by the
lines of plain PyTorch in docs/api.md to the same logits, bit for bit."""

import errno
import json
import os
import re
import resource
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from common.atomic import atomic_directory
from common.lock import exclusive_output
from depthdiag.cli import main
from trainer.checkpoint import file_sha256, load_snapshot, save_checkpoint, save_snapshot
from trainer.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from trainer.export.model_folder import EXPORT_FORMAT_VERSION, export_checkpoint
from trainer.model import LoopedTransformer, ModelConfig
from trainer.optim import build_optimizer

ROOT = Path(__file__).resolve().parent.parent
SEQ, VOCAB = 12, 200
DEPTHS = (1, 2, 5, 9)


def run_config(**model):
    return RunConfig(
        model=ModelConfig(
            **{"vocab_size": VOCAB, "max_seq_len": SEQ, "d_model": 32, "n_heads": 2, "n_core": 1, **model}
        ),
        data=DataConfig(bios_people=20, eval_sequences=4),
        optim=OptimConfig(lr=1e-2),
        train=TrainConfig(batch_size=2, seq_len=SEQ, snapshot_batches=1),
    )


def write(path: Path, kind: str, **model) -> Path:
    """A checkpoint or snapshot of a model with weights of its own (not the initialisation)."""
    config = run_config(**model)
    torch.manual_seed(len(model))
    net = LoopedTransformer(config.model)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    optimizer = build_optimizer(net, config.optim)
    eval_tokens = torch.randint(0, VOCAB, (4, SEQ + 1))
    common = dict(config=config, step=7, uniform_updates=2, model=net, optimizer=optimizer, lr=1e-3)
    if kind == "snapshot":
        batches = torch.randint(0, VOCAB, (1, 2, SEQ + 1))
        return save_snapshot(path, batches=batches, eval_tokens=eval_tokens, **common)
    return save_checkpoint(path, eval_tokens=eval_tokens, progress={"tokens": 0.0}, **common)


def readme_block(marker: str) -> str:
    """The fenced code block that follows `<!-- marker -->` in docs/api.md."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {re.escape(marker)} -->\n```python\n(.*?)```", text, re.DOTALL)
    assert match, f"docs/api.md has no python block after <!-- {marker} -->"
    return match.group(1)


@pytest.mark.parametrize(
    ("kind", "model"), [("checkpoint", {}), ("snapshot", {"tie_embeddings": True, "injection": "add"})]
)
def test_the_readme_loads_the_export_to_bit_identical_logits(tmp_path, monkeypatch, kind, model):
    source = write(tmp_path / f"{kind}.pt", kind, **model)
    # The docs' block loads from exported/tiny, relative to where it runs.
    monkeypatch.chdir(tmp_path)
    assert export_checkpoint(source, tmp_path / "exported" / "tiny") == tmp_path / "exported" / "tiny"
    namespace: dict = {}
    exec(compile(readme_block("export-load"), "docs/api.md", "exec"), namespace)
    loaded = namespace["model"]
    reference = load_snapshot(source).model().eval()
    assert type(loaded) is LoopedTransformer and loaded.config == reference.config
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for depth in DEPTHS:
            assert torch.equal(loaded(tokens, depth=depth), reference(tokens, depth=depth)), depth
        assert torch.equal(namespace["logits"], reference(torch.tensor([[1, 2, 3]]), depth=8))
    if model.get("tie_embeddings"):
        assert loaded.head.weight is loaded.embed.weight  # still one parameter after loading


def test_config_json_records_the_model_and_its_provenance(tmp_path):
    source = write(tmp_path / "snap.pt", "snapshot")
    out = export_checkpoint(source, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    document = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert document["format_version"] == EXPORT_FORMAT_VERSION
    assert ModelConfig.from_dict(document["model"]) == run_config().model
    assert document["source"] == {
        "path": str(source),
        "sha256": file_sha256(source),
        "kind": "snapshot",
        "step": 7,
        "uniform_updates": 2,
    }
    assert RunConfig.from_dict(document["run_config"]) == run_config()
    assert document["depthdiag_version"] and document["torch_version"] == str(torch.__version__)
    # The weights file is the state_dict, key for key, value for value.
    stored = safetensors.torch.load_file(out / "model.safetensors")
    expected = load_snapshot(source).model().state_dict()
    assert stored.keys() == expected.keys()
    assert all(torch.equal(stored[name], expected[name]) for name in expected)


def cli(*args):
    result = CliRunner().invoke(main, ["export", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def test_an_existing_export_is_refused_unless_forced_and_other_folders_never(tmp_path):
    first, second = write(tmp_path / "a.pt", "checkpoint"), write(tmp_path / "b.pt", "checkpoint", n_core=2)
    out = tmp_path / "out"
    code, stdout, _ = cli(first, "--out", out)
    assert code == 0 and stdout == f"wrote {out}\n"
    code, _, err = cli(second, "--out", out)
    assert code == 2 and "already exists; pass --force" in err and err.count("\n") == 1
    assert json.loads((out / "config.json").read_text())["source"]["sha256"] == file_sha256(first)
    assert cli(second, "--out", out, "--force")[0] == 0
    assert json.loads((out / "config.json").read_text())["source"]["sha256"] == file_sha256(second)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    code, _, err = cli(first, "--out", tmp_path / "mine", "--force")
    assert code == 2 and "notes.txt" in err and (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    assert cli(first, "--out", tmp_path / "empty")[0] == 0  # an empty folder holds nothing to overwrite


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(write(tmp_path / "good.pt", "checkpoint").read_bytes()[:500])
    for source, words in ((tmp_path / "missing.pt", "no such file"), (damaged, "truncated")):
        code, stdout, err = cli(source, "--out", tmp_path / "out")
        assert code == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err
        assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("")
    code, _, err = cli(tmp_path / "good.pt", "--out", tmp_path / "file")
    assert code == 2 and "not a folder" in err
    with exclusive_output(tmp_path / "held"):
        code, _, err = cli(tmp_path / "good.pt", "--out", tmp_path / "held")
    assert code == 2 and "in use by another depthdiag process" in err and not (tmp_path / "held").exists()


KILLED_EXPORT = """
import os, signal, sys
from common.atomic import atomic_directory
with atomic_directory(sys.argv[1]) as tmp:
    (tmp / "model.safetensors").write_text("half of it")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_folder_appears_complete_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_directory(out) as tmp:
        (tmp / "a").write_text("first file")
        raise RuntimeError("the second file failed")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(out) as tmp:
        (tmp / "a").write_text("old")
    with atomic_directory(out) as tmp:
        (tmp / "b").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["b"]
    # kill -9 leaves the temporary folder; the next writer to take the lock removes it.
    killed = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(out)], cwd=ROOT)
    assert killed.returncode < 0
    assert len(list(tmp_path.iterdir())) == 2
    with exclusive_output(out):
        assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == ["out"]


def limit_file_size(limit: int):
    """A preexec_fn: files of the child grow to `limit` bytes at most, and a write past it
    fails with EFBIG rather than killing the child with SIGXFSZ."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_file_size_limit_is_one_line_naming_the_file_and_leaves_nothing(tmp_path):
    source = write(tmp_path / "a.pt", "checkpoint")
    out = tmp_path / "out"
    # Room for the lock file's pid, not for the weights (tens of kilobytes).
    export = subprocess.run(
        [sys.executable, "-m", "depthdiag", "export", str(source), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size(4096),
    )
    assert export.returncode == 2, export.stderr
    assert export.stderr == f"depthdiag: error: {out / 'model.safetensors'}: {os.strerror(errno.EFBIG)}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]


def test_a_full_disk_writing_the_config_is_one_line_naming_it(tmp_path, monkeypatch):
    source = write(tmp_path / "a.pt", "checkpoint")
    out = tmp_path / "out"
    real_write_text = Path.write_text

    def disk_full_for_the_config(self, *args, **kwargs):
        if self.name == "config.json":
            # As a failed write raises it: with no file name.
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", disk_full_for_the_config)
    code, stdout, err = cli(source, "--out", out)
    assert (code, stdout) == (2, "")
    assert err == f"depthdiag: error: {out / 'config.json'}: {os.strerror(errno.ENOSPC)}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]


def test_the_weights_get_the_permissions_of_every_other_output(tmp_path):
    source = write(tmp_path / "a.pt", "checkpoint")
    before = os.umask(0o027)
    try:
        out = export_checkpoint(source, tmp_path / "out")
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"model.safetensors": 0o640, "config.json": 0o640}
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
