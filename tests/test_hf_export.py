"""`depthdiag export --format hf`: a Hugging Face folder that transformers loads with
trust_remote_code to the checkpoint's logits at every depth, its loss, its generation and its
tokenizer, and that lm-eval's `hf` model scores as `depthdiag lm-eval` does. Offline throughout."""

from __future__ import annotations

import ast
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from hf_helpers import SEQ, VOCAB, write_checkpoint

from depthdiag.cli import main
from trainer.checkpoint import file_sha256, load_snapshot
from trainer.config import RunConfig
from trainer.model import LoopedTransformer

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "data" / "lm_eval_tasks"
PROJECT_PACKAGES = {"common", "trainer", "diag", "analysis", "depthdiag"}


@pytest.fixture(scope="module")
def transformers():
    """transformers, offline: nothing may come from the hub."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        yield pytest.importorskip("transformers")


def cli(*args):
    result = CliRunner().invoke(main, ["export", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def greedy(reference: LoopedTransformer, ids: torch.Tensor, new_tokens: int, depth: int) -> torch.Tensor:
    """Greedy decoding by hand: every token from a forward over the last max_seq_len tokens."""
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = reference(ids[:, -reference.config.max_seq_len :], depth=depth)
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


# --- the round trip -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [{"tie_embeddings": True, "injection": "add"}, {"init_state": "noise", "norm": "sandwich", "mlp": "swiglu"}],
    ids=["tied", "untied"],
)
def test_from_pretrained_gives_the_checkpoints_logits_loss_and_generation_at_every_depth(transformers, tmp_path, model):
    source = write_checkpoint(tmp_path / "model.pt", **model)
    out = tmp_path / "hf"
    code, stdout, err = cli(source, "--out", out, "--format", "hf")
    assert code == 0, err
    assert stdout.splitlines()[0] == f"wrote {out}" and "no tokenizer written" in stdout  # a bioS run
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, output_loading_info=True
    )
    # Every weight from the file, none left to a random initialisation, none ignored.
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert type(loaded).__name__ == "DepthdiagForCausalLM" and not loaded.training
    assert loaded.config.num_steps == 16  # the deepest depth of uniform:1-16
    reference = load_snapshot(source).model().eval()
    # The folder's own copy of the class (another module), with the same fields.
    assert loaded.model.config.to_dict() == reference.config.to_dict()
    tied = loaded.model.head.weight is loaded.model.embed.weight
    assert tied == bool(model.get("tie_embeddings"))  # one parameter, as in LoopedTransformer

    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        by_depth = {depth: reference(tokens, depth=depth) for depth in range(1, 17)}
        for depth, expected in by_depth.items():
            assert torch.equal(loaded(tokens, num_steps=depth).logits, expected), depth
        assert not torch.equal(by_depth[4], by_depth[16])  # the depth matters
        assert torch.equal(loaded(tokens).logits, by_depth[16])  # num_steps=None: config.num_steps

        labels = tokens.clone()
        labels[0, 3:7] = -100  # skipped, as transformers skips them
        expected_loss = F.cross_entropy(by_depth[5][:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        output = loaded(tokens, labels=labels, num_steps=5)
        assert torch.equal(output.loss, expected_loss) and torch.equal(output.logits, by_depth[5])

        # The one-pass readout the diagnostic scores it with: every depth's NLL from one forward.
        targets = torch.roll(tokens, -1, dims=1)
        one_pass = loaded.nll_by_depth(tokens, targets, [1, 4, 16])
        separate = [F.cross_entropy(by_depth[s].flatten(0, 1), targets.flatten()) for s in (1, 4, 16)]
        torch.testing.assert_close(one_pass, torch.stack(separate), rtol=0, atol=2e-6)

        # Real per-token exit: the folder's model stops the same tokens as the checkpoint's, to the bit.
        def exits(k, state, logits):  # a rule that reads the readout: stops vary by token
            return logits.argmax(-1) % 4 == k % 4

        exited, depths = loaded.forward_with_exit(tokens, 16, exits)
        expected_logits, expected_depths = reference.forward_with_exit(tokens, 16, exits)
        assert torch.equal(exited, expected_logits) and torch.equal(depths, expected_depths)
        assert len(depths.unique()) > 2, depths

        # Generation: the whole window per token, never the last token alone, whatever use_cache says.
        prompt = tokens[:1, :8]
        generated = loaded.generate(prompt, max_new_tokens=6, do_sample=False)  # 14 > max_seq_len: the window slides
        assert torch.equal(generated, greedy(reference, prompt, 6, depth=16))
        generated = loaded.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True, num_steps=3)
        assert torch.equal(generated, greedy(reference, prompt, 5, depth=3))

    deeper = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, num_steps=8)
    assert deeper.config.num_steps == 8
    with torch.no_grad():
        assert torch.equal(deeper(tokens).logits, by_depth[8])


def test_padded_rows_get_the_logits_of_their_own_tokens(transformers, tmp_path):
    source = write_checkpoint(tmp_path / "model.pt")
    out = tmp_path / "hf"
    assert cli(source, "--out", out, "--format", "hf", "--num-steps", "6")[0] == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    reference = load_snapshot(source).model().eval()
    short, long = torch.tensor([5, 6, 7]), torch.tensor([9, 8, 7, 6, 5, 4])
    with torch.no_grad():
        # Left padding (generate's) and right padding: each row is its own tokens alone.
        ids = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), short]), long])
        mask = torch.stack([torch.tensor([0, 0, 0, 1, 1, 1]), torch.ones(6, dtype=torch.long)])
        logits = loaded(ids, attention_mask=mask).logits
        assert torch.equal(logits[0, 3:], reference(short[None], depth=6)[0])
        assert torch.equal(logits[1], reference(long[None], depth=6)[0])
        assert torch.equal(logits[0, :3], torch.zeros_like(logits[0, :3]))
        right = loaded(torch.stack([torch.cat([short, short]), long]), attention_mask=mask.flip(1)).logits
        assert torch.equal(right[0, :3], reference(short[None], depth=6)[0])
        generated = loaded.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(generated[0, 3:], greedy(reference, short[None], 4, depth=6)[0])
        assert torch.equal(generated[1], greedy(reference, long[None], 4, depth=6)[0])
        with pytest.raises(ValueError, match="one run of ones"):
            loaded(ids, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]))


def test_the_folder_holds_the_model_its_code_and_its_provenance(transformers, tmp_path):
    from trainer.export.hf import MODEL_TYPE
    from trainer.export.hf.configuration_depthdiag import MODEL_TYPE as CONFIG_MODEL_TYPE

    source = write_checkpoint(tmp_path / "model.pt", tie_embeddings=True, schedule="fixed:5")
    out = tmp_path / "hf"
    before = os.umask(0o027)
    try:
        assert cli(source, "--out", out, "--format", "hf")[0] == 0
    finally:
        os.umask(before)
    names = ["config.json", "configuration_depthdiag.py", "looped_transformer.py", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == [*names, "modeling_depthdiag.py"]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {p.name: 0o640 for p in out.iterdir()}

    document = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert document["model_type"] == MODEL_TYPE == CONFIG_MODEL_TYPE
    assert document["auto_map"] == {
        "AutoConfig": "configuration_depthdiag.DepthdiagConfig",
        "AutoModelForCausalLM": "modeling_depthdiag.DepthdiagForCausalLM",
    }
    assert document["num_steps"] == 5 and document["dtype"] == "float32"
    # The transformers names of two fields, which lm-eval and transformers read.
    assert document["max_position_embeddings"] == SEQ and document["tie_word_embeddings"] is True
    provenance = document["provenance"]
    assert provenance["source"] == {
        "path": str(source),
        "sha256": file_sha256(source),
        "kind": "checkpoint",
        "step": 7,
        "uniform_updates": 0,
    }
    assert provenance["depthdiag_version"] and provenance["tokenizer"] is None
    assert RunConfig.from_dict(provenance["run_config"]) == load_snapshot(source).config

    config = transformers.AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert config.model_config().to_dict() == load_snapshot(source).config.model.to_dict()
    assert config.max_position_embeddings == config.max_seq_len == SEQ and config.tie_word_embeddings is True

    # The weights are the wrapper's state_dict: the looped transformer's under "model.", a tied
    # weight under both of its names.
    import safetensors.torch

    stored = safetensors.torch.load_file(out / "model.safetensors")
    expected = load_snapshot(source).model().state_dict()
    assert stored.keys() == {f"model.{name}" for name in expected}
    assert all(torch.equal(stored[f"model.{name}"], tensor) for name, tensor in expected.items())

    # The code imports nothing of depthdiag's: only the standard library, torch, transformers and
    # the folder's own files, relatively.
    for name in ("looped_transformer.py", "configuration_depthdiag.py", "modeling_depthdiag.py"):
        tree = ast.parse((out / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] not in PROJECT_PACKAGES, (name, node.module)
            elif isinstance(node, ast.Import):
                assert all(alias.name.split(".")[0] not in PROJECT_PACKAGES for alias in node.names), name
    assert "class InputError(ValueError)" in (out / "looped_transformer.py").read_text(encoding="utf-8")
    templates = ROOT / "trainer" / "export" / "hf"
    for name in ("configuration_depthdiag.py", "modeling_depthdiag.py"):
        assert (out / name).read_bytes() == (templates / name).read_bytes()


SELF_CONTAINED = """
import sys
import torch

class NoDepthdiag:
    # Any import of depthdiag's packages fails: the folder must load on a machine without them.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"common", "trainer", "diag", "analysis", "depthdiag"}:
            raise ImportError(f"{name}: not available here")

sys.meta_path.insert(0, NoDepthdiag())
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2]), num_steps=7).logits, sys.argv[3])
"""


def test_the_folder_loads_without_depthdiag(transformers, tmp_path):
    source = write_checkpoint(tmp_path / "model.pt")
    assert cli(source, "--out", tmp_path / "hf", "--format", "hf")[0] == 0
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    torch.save(tokens, tmp_path / "tokens.pt")
    command = [sys.executable, "-c", SELF_CONTAINED, tmp_path / "hf", tmp_path / "tokens.pt", tmp_path / "logits.pt"]
    # Run from an empty folder with no PYTHONPATH: the repository is not on the path either.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    (tmp_path / "elsewhere").mkdir()
    result = subprocess.run(command, cwd=tmp_path / "elsewhere", env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = load_snapshot(source).model().eval()(tokens, depth=7)
    assert torch.equal(torch.load(tmp_path / "logits.pt"), expected)


def api_block(marker: str) -> str:
    """The fenced python block that follows `<!-- marker -->` in docs/api.md."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {re.escape(marker)} -->\n```python\n(.*?)```", text, re.DOTALL)
    assert match, f"docs/api.md has no python block after <!-- {marker} -->"
    return match.group(1)


def test_the_docs_load_an_hf_export(transformers, tmp_path, monkeypatch):
    source = write_checkpoint(tmp_path / "model.pt", max_seq_len=16)
    monkeypatch.chdir(tmp_path)  # the block loads exported/tiny-hf, relative to where it runs
    assert cli(source, "--out", "exported/tiny-hf", "--format", "hf")[0] == 0
    namespace: dict = {}
    exec(compile(api_block("hf-export-load"), "docs/api.md", "exec"), namespace)
    reference = load_snapshot(source).model().eval()
    with torch.no_grad():
        assert torch.equal(namespace["logits"], reference(torch.tensor([[1, 2, 3]]), depth=8))
    assert torch.equal(namespace["generated"], greedy(reference, torch.tensor([[1, 2, 3]]), 5, depth=8))


# --- output rules, errors ---------------------------------------------------------------------------------


def test_force_replaces_an_export_of_either_format_and_nothing_else(transformers, tmp_path):
    source = write_checkpoint(tmp_path / "model.pt")
    out = tmp_path / "out"
    assert cli(source, "--out", out, "--format", "hf")[0] == 0
    code, _, err = cli(source, "--out", out, "--format", "hf")
    assert code == 2 and "already exists; pass --force" in err and err.count("\n") == 1
    assert cli(source, "--out", out, "--format", "hf", "--num-steps", "3", "--force")[0] == 0
    assert json.loads((out / "config.json").read_text())["num_steps"] == 3
    assert cli(source, "--out", out, "--force")[0] == 0  # an hf export replaced by a safetensors one
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert cli(source, "--out", out, "--format", "hf", "--force")[0] == 0  # and back
    assert (out / "modeling_depthdiag.py").is_file()
    (out / "notes.txt").write_text("keep me")
    code, _, err = cli(source, "--out", out, "--format", "hf", "--force")
    assert code == 2 and "notes.txt" in err and (out / "notes.txt").read_text() == "keep me"
    (out / "notes.txt").unlink()
    document = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**document, "model_type": "llama"}))
    code, _, err = cli(source, "--out", out, "--format", "hf", "--force")
    assert code == 2 and "is not a model export depthdiag wrote" in err  # another model's folder
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left


def test_bad_options_are_one_line(transformers, tmp_path):
    from depthdiag.cli.export import FORMATS
    from trainer.export.model_folder import EXPORT_FORMATS

    assert FORMATS == EXPORT_FORMATS  # the CLI spells them out so that --help imports no torch
    source = write_checkpoint(tmp_path / "model.pt")
    code, _, err = cli(source, "--out", tmp_path / "out", "--num-steps", "4")
    assert code == 2 and err == "depthdiag: error: --num-steps and --tokenizer are options of --format hf\n"
    code, _, err = cli(source, "--out", tmp_path / "out", "--format", "onnx")
    assert code == 2 and "'onnx' is not one of" in err
    code, _, err = cli(source, "--out", tmp_path / "out", "--format", "hf", "--tokenizer", tmp_path / "none.json")
    assert code == 2 and "none.json" in err and err.count("\n") == 1
    # An output that holds an input: the tokenizer file given.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tokenizer.json").write_text("{}")
    code, _, err = cli(
        source, "--out", tmp_path / "data", "--format", "hf", "--tokenizer", tmp_path / "data/tokenizer.json"
    )
    assert code == 2 and "holds an input of this command" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "model.pt"]


def test_without_transformers_the_hf_format_says_how_to_install_it(tmp_path, monkeypatch):
    source = write_checkpoint(tmp_path / "model.pt")
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, stdout, err = cli(source, "--out", tmp_path / "out", "--format", "hf")
    assert (code, stdout) == (2, "")
    assert err == "depthdiag: error: transformers is not installed; install the hf extra: pip install -e .[hf]\n"
    assert not (tmp_path / "out").exists()
    assert cli(source, "--out", tmp_path / "out")[0] == 0  # the safetensors format needs none


def test_depthdiag_imports_and_exports_safetensors_without_importing_transformers(tmp_path):
    source = write_checkpoint(tmp_path / "model.pt")
    code = (
        "import sys\n"
        "from trainer.export.model_folder import export_checkpoint\n"
        "import trainer.export.hf\n"
        f"export_checkpoint({str(source)!r}, {str(tmp_path / 'out')!r})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]"


def test_the_model_source_must_keep_its_one_project_import():
    import trainer.model
    from trainer.export.hf.writer import standalone_model_source

    source = Path(trainer.model.__file__).read_text(encoding="utf-8")
    copy = standalone_model_source(source)
    assert "from common" not in copy and "class InputError(ValueError)" in copy
    compile(copy, "looped_transformer.py", "exec")
    with pytest.raises(RuntimeError, match="no longer has the line"):
        standalone_model_source(source.replace("from common.errors import InputError\n", ""))
    added = source.replace("import torch\n", "import torch\nfrom common.digest import file_sha256\n", 1)
    with pytest.raises(RuntimeError, match="imports common.digest"):
        standalone_model_source(added)
    with pytest.raises(RuntimeError, match="imports numpy"):
        standalone_model_source(source.replace("import math\n", "import math\nimport numpy\n", 1))


# --- the tokenizer and lm-eval --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bin_run(tmp_path_factory, transformers):
    """A checkpoint of a `bin` run (a tokenizer `depthdiag prepare` trained), exported with --format hf."""
    from trainer.data.prepare import PrepareConfig, prepare

    directory = tmp_path_factory.mktemp("bin-run")
    corpus = directory / "corpus.txt"
    lines = [
        f"Question: what is {word}? Answer: the {word} is {other}, not {word}."
        for word, other in zip(
            "sky cat apple bee water giraffe pole cold".split(), "blue four red honey ice neck".split()
        )
    ]
    corpus.write_text("\n\n".join(lines * 6), encoding="utf-8")
    data = directory / "data"
    prepare(PrepareConfig(inputs=(str(corpus),), out=data, vocab_size=300, val_fraction=0.3), progress=False)
    meta = json.loads((data / "meta.json").read_text())
    source = write_checkpoint(
        directory / "model.pt",
        data={"source": "bin", "path": str(data), "eval_sequences": 2},
        schedule="uniform:1-8",  # served at 8 by default: lm-eval's num_steps=4 must take effect
        vocab_size=meta["vocab_size"],
        max_seq_len=64,  # shorter than two of the task's prompts: left truncation is exercised
    )
    out = directory / "hf"
    code, stdout, err = cli(source, "--out", out, "--format", "hf")
    assert code == 0 and stdout == f"wrote {out}\n", err
    return source, out, meta, data


def test_the_runs_tokenizer_loads_beside_the_model(bin_run, transformers):
    from trainer.data.text_tokens import resolve_tokenizer

    source, out, meta, data = bin_run
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("tokenizer")) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((out / "config.json").read_text())["provenance"]["tokenizer"] == str(data / "tokenizer.json")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    ours = resolve_tokenizer(load_snapshot(source).config, None, source)
    # The end-of-text token, what lm-eval conditions an empty context on, as depthdiag lm-eval does.
    assert tokenizer.eos_token_id == meta["eot_id"] == ours.prefix_token_id and tokenizer.bos_token_id is None
    assert tokenizer.model_max_length == 64
    for text in ("Question: What do bees make?\nAnswer: honey", "  two  spaces , then <|endoftext|> as text ."):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == ours.encode(text) and tokenizer.decode(ids) == ours.decode(ids) == text


@pytest.mark.slow  # lm-eval: the eval extra, which only make test-slow installs
def test_lm_evals_hf_model_scores_the_export_as_depthdiag_lm_eval_does(bin_run, transformers, tmp_path, monkeypatch):
    import lm_eval
    import lm_eval.models  # noqa: F401 (registers "hf": lm-eval looks only when its registry is empty)
    from lm_eval.tasks import TaskManager

    from analysis.downstream import open_downstream
    from trainer.data.text_tokens import resolve_tokenizer

    source, out, _, _ = bin_run
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.chdir(ROOT)  # the task file names its data relative to the repository
    code = CliRunner().invoke(
        main,
        ["lm-eval", str(source), "--tasks", "tiny_mc", "--include-path", str(TASKS), "--serving", "4"]
        + ["--out", str(tmp_path / "downstream.h5"), "--no-progress"],
    )
    assert code.exit_code == 0, code.stderr
    ours = open_downstream(tmp_path / "downstream.h5").sel(task="tiny_mc", serving_depth=4)

    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={out},trust_remote_code=True,num_steps=4",
        tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        batch_size=8,
        device="cpu",
        log_samples=True,
    )
    theirs = results["results"]["tiny_mc"]
    for metric in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
        assert theirs[f"{metric},none"] == pytest.approx(float(ours[metric]), abs=1e-6), metric

    # And each choice's log-likelihood is the checkpoint's at depth 4 (not at depth 1).
    tokenizer = resolve_tokenizer(load_snapshot(source).config, None, source)
    model = load_snapshot(source).model().eval()

    def log_likelihood(context: str, continuation: str, depth: int) -> float:
        context_ids, continuation_ids = tokenizer.encode(context), tokenizer.encode(continuation)
        window = (context_ids + continuation_ids)[-65:]
        with torch.no_grad():
            log_probs = model(torch.tensor([window[:-1]]), depth=depth)[0].log_softmax(-1)
        targets = torch.tensor(window[1:][-len(continuation_ids) :])
        return float(log_probs[-len(continuation_ids) :].gather(-1, targets[:, None]).sum())

    largest, shallow = 0.0, 0.0
    for sample in results["samples"]["tiny_mc"]:
        for (context, continuation), ((scored, _),) in zip(sample["arguments"], sample["resps"]):
            largest = max(largest, abs(scored - log_likelihood(context, continuation, 4)))
            shallow = max(shallow, abs(scored - log_likelihood(context, continuation, 1)))
    assert largest < 1e-4 and shallow > 1e-2, (largest, shallow)


@pytest.mark.slow  # lm-eval: the eval extra, which only make test-slow installs
def test_lm_eval_hf_serves_the_export_as_the_checkpoint_at_every_depth(bin_run, transformers, tmp_path, monkeypatch):
    """`depthdiag lm-eval --hf DIR` (the depthdiag family, the folder's tokenizer.json) gives the
    checkpoint's own `depthdiag lm-eval` numbers at each serving depth."""
    from analysis.downstream import open_downstream

    source, out, _, _ = bin_run
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.chdir(ROOT)  # the task file names its data relative to the repository
    common = ["--tasks", "tiny_mc", "--include-path", str(TASKS), "--serving", "1,4", "--exit", "kl:1e-2"]
    common += ["--no-progress"]
    results = {}
    for name, model in (("checkpoint", [str(source)]), ("hf", ["--hf", str(out), "--trust-remote-code"])):
        code = CliRunner().invoke(main, ["lm-eval", *model, *common, "--out", str(tmp_path / f"{name}.h5")])
        assert code.exit_code == 0, code.stderr
        results[name] = open_downstream(tmp_path / f"{name}.h5").sel(task="tiny_mc")
    for metric in ("acc", "acc_norm", "exit_acc", "exit_acc_norm", "exit_mean_depth"):
        assert results["hf"][metric].values.tolist() == pytest.approx(
            results["checkpoint"][metric].values.tolist(), abs=1e-9
        ), metric
    assert results["hf"].attrs["model_family"] == "depthdiag" and results["hf"].attrs["hf_folder"] == str(out)
