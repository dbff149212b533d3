"""`depthdiag lm-eval` (depthdiag/downstream.py), the `depthdiag` model of lm-evaluation-harness
(trainer/export/lm_harness.py), the downstream file and Figure 3's bottom row (analysis/downstream.py,
analysis/figures/downstream.py), offline: a small local multiple-choice task
(tests/data/lm_eval_tasks) and a randomly initialised byte-level checkpoint. Every accuracy is
checked against a hand computation from plain forwards of the model at each depth."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from click.testing import CliRunner

from depthdiag.cli import main
from trainer.checkpoint import file_sha256, load_snapshot, save_checkpoint
from trainer.config import RunConfig
from trainer.model import LoopedTransformer
from trainer.optim import build_optimizer

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "data" / "lm_eval_tasks"
DOCS = [json.loads(line) for line in (TASKS / "tiny_mc.jsonl").read_text().splitlines()]
MAX_SEQ_LEN = 64
"""Shorter than two of the task's prompts, so left truncation is exercised."""
BATCH_SIZE = 8


def run(*args):
    result = CliRunner().invoke(main, [str(arg) for arg in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """lm-eval, offline, with the data set cache in a temporary folder and the repository
    root as the working directory (the task file names its data relative to it). The tests that
    run it are slow ones: `make test` does not install the `eval` extra (a quarter of its
    install time), `make test-slow` does. Imported once the environment is offline: the data set
    and hub libraries read it when they are imported."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
        patch.chdir(ROOT)
        import lm_eval

        yield lm_eval


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("lm-eval")
    corpus = directory / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog " * 20, encoding="utf-8")
    config = RunConfig.from_dict(
        {
            # A wide initialisation, so that the choices' scores and the depths differ clearly.
            "model": {"vocab_size": 256, "max_seq_len": MAX_SEQ_LEN, "d_model": 32, "n_heads": 2, "init_std": 0.2},
            "data": {"source": "text", "path": str(corpus), "eval_sequences": 2},
            "train": {"schedule": "uniform:1-4", "updates": 4, "batch_size": 2, "seq_len": 16, "device": "cpu"},
        }
    )
    torch.manual_seed(0)
    model = LoopedTransformer(config.model)
    with torch.no_grad():
        # Large core weights: each iteration moves the state far, so the depth changes the answers.
        for weight in model.core.parameters():
            if weight.ndim == 2:
                weight.normal_(0.0, 1.0)
    return save_checkpoint(
        directory / "model.pt",
        config=config,
        step=0,
        uniform_updates=0,
        model=model,
        optimizer=build_optimizer(model, config.optim),
        lr=1e-3,
        eval_tokens=torch.zeros((2, 17), dtype=torch.long),
        progress={},
    )


def hand_log_likelihoods(checkpoint: Path, depth: int, docs=DOCS, exit_rule=None, served=None) -> list[list[float]]:
    """Per document, per choice: the summed log-probability of ' choice' after the prompt, from
    one plain forward per (document, choice) at `depth` over the last MAX_SEQ_LEN + 1 bytes; with
    `exit_rule` (criterion, threshold) from one real-exit forward of at most `depth` iterations
    instead, the scored tokens' exit depths appended to `served`."""
    from trainer.exits import ExitDecisions

    model = load_snapshot(checkpoint).model().eval()
    scores = []
    for doc in docs:
        context = list(f"Question: {doc['question']}\nAnswer:".encode())
        row = []
        for choice in doc["choices"]:
            continuation = list(f" {choice}".encode())
            window = (context + continuation)[-(MAX_SEQ_LEN + 1) :]
            ids = torch.tensor([window[:-1]])
            with torch.no_grad():
                if exit_rule is None:
                    logits = model(ids, depth=depth)
                else:
                    logits, exit_depth = model.forward_with_exit(ids, depth, ExitDecisions(*exit_rule))
                    served.extend(exit_depth[0, -len(continuation) :].tolist())
            log_probs = logits[0].log_softmax(-1)
            targets = torch.tensor(window[1:][-len(continuation) :])
            row.append(float(log_probs[-len(continuation) :].gather(-1, targets[:, None]).sum()))
        scores.append(row)
    return scores


def hand_accuracies(scores: list[list[float]], docs=DOCS) -> dict[str, np.ndarray]:
    """Per document: acc (argmax of the log-likelihoods) and acc_norm (argmax of the log-likelihoods
    divided by the choices' lengths in characters), after checking no choice nearly ties."""
    acc, acc_norm = [], []
    for row, doc in zip(scores, docs):
        lengths = np.array([len(choice) for choice in doc["choices"]], dtype=float)
        for values in (np.array(row), np.array(row) / lengths):
            top_two = np.sort(values)[-2:]
            assert top_two[1] - top_two[0] > 1e-3, "a near tie would make the comparison depend on rounding"
        acc.append(float(np.argmax(row) == doc["answer"]))
        acc_norm.append(float(np.argmax(np.array(row) / lengths) == doc["answer"]))
    return {"acc": np.array(acc), "acc_norm": np.array(acc_norm)}


def stderr(values: np.ndarray) -> float:
    return float(np.std(values, ddof=1) / math.sqrt(len(values)))


@pytest.fixture(scope="module")
def evaluated(harness, checkpoint, tmp_path_factory):
    """`depthdiag lm-eval` at depths 1-3, with the one-pass readouts counted."""
    out = tmp_path_factory.mktemp("out") / "downstream.h5"
    calls = []
    original = LoopedTransformer.logits_by_depth

    def counted(self, input_ids, depths):
        calls.append(tuple(depths))
        return original(self, input_ids, depths)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LoopedTransformer, "logits_by_depth", counted)
        code, stdout, stderr_text = run(
            "lm-eval",
            checkpoint,
            "--tasks",
            "tiny_mc",
            "--include-path",
            TASKS,
            "--serving",
            "1-3",
            "--batch-size",
            BATCH_SIZE,
            "--out",
            out,
            "--no-progress",
        )
    assert code == 0, stderr_text
    return out, stdout, calls


@pytest.mark.slow
def test_accuracies_at_every_depth_equal_a_hand_computation(evaluated, checkpoint):
    from analysis.downstream import open_downstream

    out, stdout, _ = evaluated
    ds = open_downstream(out)
    assert ds["task"].values.tolist() == ["tiny_mc"] and ds["serving_depth"].values.tolist() == [1, 2, 3]
    seen = set()
    for depth in (1, 2, 3):
        hand = hand_accuracies(hand_log_likelihoods(checkpoint, depth))
        seen.add((tuple(hand["acc"]), tuple(hand["acc_norm"])))
        for metric in ("acc", "acc_norm"):
            stored = ds[metric].sel(task="tiny_mc", serving_depth=depth)
            assert float(stored) == pytest.approx(hand[metric].mean(), abs=1e-12), (metric, depth)
            stored_stderr = ds[f"{metric}_stderr"].sel(task="tiny_mc", serving_depth=depth)
            assert float(stored_stderr) == pytest.approx(stderr(hand[metric]), rel=1e-9), (metric, depth)
    assert len(seen) > 1, "the depths give the same answers: the test could not tell them apart"
    assert float(ds["chance"].sel(task="tiny_mc")) == pytest.approx(np.mean([1 / len(d["choices"]) for d in DOCS]))
    assert int(ds["n_samples"].sel(task="tiny_mc")) == len(DOCS) and int(ds["n_shot"].sel(task="tiny_mc")) == 0
    assert "tiny_mc: 8 documents, 0-shot" in stdout and f"wrote {out}" in stdout


@pytest.mark.slow
def test_exit_rules_score_each_token_at_its_real_exit_depth_as_a_hand_computation(harness, checkpoint, tmp_path):
    from analysis.downstream import open_downstream
    from trainer.exits import CRITERIA

    out = tmp_path / "exits.h5"
    rules = ("entropy:4.99", "maxprob:0", "kl:0")  # fires per token; at once (depth 1); never (depth 3)
    options = [arg for rule in rules for arg in ("--exit", rule)]
    code, stdout, stderr_text = run(
        "lm-eval", checkpoint, "--tasks", "tiny_mc", "--include-path", TASKS, "--serving", "1-3",
        "--batch-size", BATCH_SIZE, *options, "--out", out, "--no-progress",
    )  # fmt: skip
    assert code == 0, stderr_text
    assert "exit entropy:4.99 (mean depth " in stdout
    table = stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.lstrip().startswith("depth "))
    block = table[header : header + 1 + 3 + len(rules)]  # the header, depths 1-3, the rules
    assert block[-1].lstrip().startswith("exit kl:0") and len({len(line) for line in block}) == 1  # in columns
    ds = open_downstream(out).sel(task="tiny_mc")
    assert ds["exit"].values.tolist() == list(rules)
    for rule, depth in (("maxprob:0", 1), ("kl:0", 3)):
        assert float(ds["exit_mean_depth"].sel(exit=rule)) == depth
        for metric in ("acc", "acc_norm", "acc_stderr"):
            assert float(ds[f"exit_{metric}"].sel(exit=rule)) == float(ds[metric].sel(serving_depth=depth)), rule

    served: list[int] = []
    hand = hand_accuracies(hand_log_likelihoods(checkpoint, 3, exit_rule=(CRITERIA["entropy"], 4.99), served=served))
    for metric in ("acc", "acc_norm"):
        assert float(ds[f"exit_{metric}"].sel(exit="entropy:4.99")) == pytest.approx(hand[metric].mean(), abs=1e-12)
    # lm-eval asks each (document, choice) once, so the mean over its requests is the hand mean.
    assert float(ds["exit_mean_depth"].sel(exit="entropy:4.99")) == pytest.approx(np.mean(served), rel=1e-12)
    assert 1 < np.mean(served) < 3, "the rule stops no token, or every token, early: it tests nothing"

    code, _, stderr_text = run(
        "lm-eval", checkpoint, "--tasks", "tiny_mc", "--include-path", TASKS, "--exit", "kl",
        "--out", tmp_path / "bad.h5",
    )  # fmt: skip
    assert code == 2 and "--exit kl: expected CRITERION:THRESHOLD" in stderr_text, stderr_text
    assert not (tmp_path / "bad.h5").exists()


@pytest.mark.slow
def test_exit_rules_refuse_generation_tasks_before_evaluating(harness, checkpoint, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    generation = (TASKS / "tiny_mc.yaml").read_text().replace("task: tiny_mc", "task: tiny_gen")
    generation = generation.replace("output_type: multiple_choice", "output_type: generate_until")
    generation = generation.replace('doc_to_choice: "{{choices}}"', "generation_kwargs:\n  until: ['\\n']")
    (tasks / "tiny_gen.yaml").write_text(generation.replace("metric: acc_norm", "metric: exact_match"))
    code, _, stderr_text = run(
        "lm-eval", checkpoint, "--tasks", "tiny_gen", "--include-path", tasks, "--exit", "kl:1e-3",
        "--out", tmp_path / "gen.h5",
    )  # fmt: skip
    assert code == 2 and "--exit: scores log-likelihood tasks only; tiny_gen generate text" in stderr_text
    assert stderr_text.strip().splitlines()[-1].startswith("depthdiag: error: --exit: scores log-likelihood")
    assert not (tmp_path / "gen.h5").exists()


@pytest.mark.slow
def test_every_depth_comes_from_one_pass_per_request_batch(evaluated):
    from analysis.downstream import open_downstream

    out, _, calls = evaluated
    requests = sum(len(doc["choices"]) for doc in DOCS)
    batches = math.ceil(requests / BATCH_SIZE)
    assert calls == [(1, 2, 3)] * batches
    assert open_downstream(out).attrs["forward_passes"] == batches


@pytest.mark.slow
def test_the_file_records_where_its_numbers_come_from(evaluated, checkpoint, harness):
    out, _, _ = evaluated
    with xr.open_dataset(out, engine="h5netcdf") as ds:
        attrs = dict(ds.attrs)
        for name in ds.variables:
            assert {"long_name", "units"} <= set(ds[name].attrs), name
    assert attrs["kind"] == "lm_eval"
    assert attrs["checkpoint_sha256"] == file_sha256(checkpoint)
    assert json.loads(attrs["config"])["data"]["source"] == "text" and attrs["tokenizer"] == "bytes (UTF-8)"
    assert attrs["lm_eval_version"] == harness.__version__
    assert json.loads(attrs["task_versions"]) == {"tiny_mc": 1.0}
    assert json.loads(attrs["task_configs"])["tiny_mc"]["doc_to_text"] == "Question: {{question}}\nAnswer:"
    assert json.loads(attrs["n_shot"]) == {"tiny_mc": 0} and attrs["limit"] == "none"


@pytest.mark.slow
def test_limit_evaluates_the_first_documents(harness, checkpoint, tmp_path):
    from analysis.downstream import open_downstream

    out = tmp_path / "limited.h5"
    args = ["--tasks", "tiny_mc", "--include-path", TASKS, "--serving", "2", "--limit", "5", "--no-progress"]
    code, _, err = run("lm-eval", checkpoint, *args, "--out", out)
    assert code == 0, err
    ds = open_downstream(out)
    hand = hand_accuracies(hand_log_likelihoods(checkpoint, 2, DOCS[:5]), DOCS[:5])
    assert float(ds["acc"].sel(task="tiny_mc", serving_depth=2)) == pytest.approx(hand["acc"].mean(), abs=1e-12)
    assert int(ds["n_samples"].sel(task="tiny_mc")) == 5 and ds.attrs["limit"] == 5
    assert float(ds["chance"].sel(task="tiny_mc")) == pytest.approx(np.mean([1 / len(d["choices"]) for d in DOCS[:5]]))
    code, _, err = run("lm-eval", checkpoint, *args, "--out", out)
    assert code == 2 and "already exists; pass --force" in err


@pytest.mark.slow
def test_plot_draws_figure_3_bottom_row(evaluated, tmp_path):
    from analysis.downstream import open_downstream
    from analysis.figures import figure3_downstream

    out, _, _ = evaluated
    code, stdout, err = run("plot", out, "--figure", "3-downstream", "--out", tmp_path / "figure3.png")
    assert code == 0, err
    assert (tmp_path / "figure3.png").stat().st_size > 0 and (tmp_path / "figure3.pdf").stat().st_size > 0
    fig = figure3_downstream(open_downstream(out))
    (ax,) = fig.axes
    drawn = {line.get_label(): line for line in ax.get_lines()}
    assert drawn["acc"].get_ydata().tolist() == open_downstream(out)["acc"].sel(task="tiny_mc").values.tolist()
    chance = next(line for label, line in drawn.items() if label.startswith("chance"))
    assert chance.get_linestyle() == "--" and "1.96" in fig.get_suptitle()


def test_accuracy_bands_are_the_normal_95_interval_over_documents():
    from analysis.downstream import accuracy_bands, downstream_dataset

    per_depth = {
        1: {"t": {"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": "t"}},
        2: {"t": {"acc,none": 0.75, "acc_stderr,none": "N/A"}},
    }
    ds = downstream_dataset(per_depth, chance={"t": 0.25}, n_samples={"t": 4}, n_shot={"t": 0}, attrs={})
    bands = accuracy_bands(ds, "acc").sel(task="t")
    assert bands["lower"].values[0] == pytest.approx(0.5 - 1.959964 * 0.1, abs=1e-6)
    assert bands["upper"].values[0] == pytest.approx(0.5 + 1.959964 * 0.1, abs=1e-6)
    assert np.isnan(bands["lower"].values[1]) and bands["mean"].values[1] == 0.75
    per_depth[1]["t"]["acc_stderr,none"] = 0.3
    ds = downstream_dataset(per_depth, chance={"t": 0.25}, n_samples={"t": 4}, n_shot={"t": 0}, attrs={})
    bands = accuracy_bands(ds, "acc").sel(task="t")
    assert (bands["lower"].values[0], bands["upper"].values[0]) == (0.0, 1.0)
    assert "alias" not in ds and "acc_norm" not in ds


def test_several_seeds_are_drawn_as_their_mean_and_range(tmp_path):
    from analysis.downstream import accuracy_bands, downstream_dataset, open_downstream
    from analysis.store import write_dataset
    from common.errors import InputError

    paths = []
    for seed, values in ((0, (0.25, 0.5)), (1, (0.75, 0.5)), (2, (0.5, 0.25))):
        per_depth = {depth: {"t": {"acc,none": value, "acc_stderr,none": 0.1}} for depth, value in zip((1, 2), values)}
        attrs = {"config": json.dumps({"train": {"seed": seed}}), "tasks": "t", "limit": "none"}
        ds = downstream_dataset(per_depth, chance={"t": 0.25}, n_samples={"t": 4}, n_shot={"t": 0}, attrs=attrs)
        paths.append(tmp_path / f"seed{seed}.h5")
        write_dataset(ds, paths[-1])
    combined = open_downstream(paths)
    assert combined["seed"].values.tolist() == [0, 1, 2]
    bands = accuracy_bands(combined, "acc").sel(task="t")
    assert bands["mean"].values.tolist() == pytest.approx([0.5, 1.25 / 3])
    assert bands["lower"].values.tolist() == [0.25, 0.25] and bands["upper"].values.tolist() == [0.75, 0.5]
    assert "across 3 seeds" in bands.attrs["band"]
    with pytest.raises(InputError, match="seed 0 again"):
        open_downstream([paths[0], paths[0]])
    code, _, err = run("plot", *paths, "--figure", "3-downstream", "--out", tmp_path / "seeds.png")
    assert code == 0, err


@pytest.mark.slow
def test_lm_eval_command_line_runs_the_registered_model(harness, checkpoint, tmp_path):
    """`depthdiag-lm-eval --model depthdiag ...`: lm-eval's own command line with the model registered
    (slow: lm-eval's command line indexes its 14,000 task files, half a minute)."""
    model_args = f"checkpoint={checkpoint},depth=2"
    command = [sys.executable, "-m", "depthdiag.downstream", "--model", "depthdiag", "--model_args", model_args]
    command += ["--tasks", "tiny_mc", "--include_path", str(TASKS), "--batch_size", str(BATCH_SIZE)]
    command += ["--output_path", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (results_file,) = tmp_path.rglob("results_*.json")
    acc = json.loads(results_file.read_text())["results"]["tiny_mc"]["acc,none"]
    assert acc == pytest.approx(hand_accuracies(hand_log_likelihoods(checkpoint, 2))["acc"].mean(), abs=1e-12)


def unknown_task(checkpoint: Path, tmp_path: Path) -> None:
    args = ["--tasks", "tiny_mc,no_such_task", "--include-path", TASKS, "--out", tmp_path / "x.h5"]
    code, out, err = run("lm-eval", checkpoint, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "unknown task(s) no_such_task (" in err
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.slow
def test_an_unknown_task_is_one_line_and_exit_2(harness, checkpoint, tmp_path, monkeypatch):
    """With lm-eval's own task files left out of the index (half a minute to parse; the slow test
    below reads them): the refusal is the same."""
    import lm_eval.tasks

    class LocalTasksOnly(lm_eval.tasks.TaskManager):
        def __init__(self, *args, include_defaults: bool = True, **kwargs):
            super().__init__(*args, include_defaults=False, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasksOnly)
    unknown_task(checkpoint, tmp_path)


@pytest.mark.slow
def test_an_unknown_task_is_refused_against_all_of_lm_evals_tasks(harness, checkpoint, tmp_path):
    unknown_task(checkpoint, tmp_path)


def test_a_bios_checkpoint_has_no_text_tokenizer(tmp_path):
    from common.errors import InputError
    from trainer.data.text_tokens import resolve_tokenizer

    with pytest.raises(InputError, match="bioS"):
        resolve_tokenizer(RunConfig(), None, tmp_path / "bios.pt")


def test_a_bin_checkpoint_reads_the_tokenizer_its_meta_json_names(tmp_path):
    from common.errors import InputError
    from trainer.data.prepare import PrepareConfig, load_tokenizer, prepare
    from trainer.data.text_tokens import resolve_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"the cat {i} sat on the mat of dog {i}\n\n" for i in range(40)), encoding="utf-8")
    data = tmp_path / "data"
    # An end-of-text token of its own: the loader must take the id prepare recorded, not a default.
    prepare(
        PrepareConfig(inputs=(str(corpus),), out=data, vocab_size=300, eot="</s>", val_fraction=0.3), progress=False
    )
    meta = json.loads((data / "meta.json").read_text())
    written = load_tokenizer(data / "tokenizer.json")

    def config(vocab_size: int) -> RunConfig:
        return RunConfig.from_dict({"model": {"vocab_size": vocab_size}, "data": {"source": "bin", "path": str(data)}})

    loaded = resolve_tokenizer(config(meta["vocab_size"]), None, tmp_path / "ckpt.pt")
    assert loaded.prefix_token_id == meta["eot_id"] == written.token_to_id("</s>")
    text = "the dog sat on the cat"
    assert loaded.encode(text) == written.encode(text, add_special_tokens=False).ids
    # As in the token files, text that spells out the end-of-text token is ordinary text.
    assert meta["eot_id"] not in loaded.encode("a </s> b")
    with pytest.raises(InputError, match=f"more than the model's vocab_size {meta['vocab_size'] - 1}"):
        resolve_tokenizer(config(meta["vocab_size"] - 1), None, tmp_path / "ckpt.pt")
    (data / "meta.json").write_text(json.dumps({"vocab_size": meta["vocab_size"]}))
    with pytest.raises(InputError, match="names no tokenizer file"):
        resolve_tokenizer(config(meta["vocab_size"]), None, tmp_path / "ckpt.pt")
    override = resolve_tokenizer(config(meta["vocab_size"]), data / "tokenizer.json", tmp_path / "ckpt.pt")
    assert override.encode(text) == loaded.encode(text)


def test_without_the_eval_extra_the_command_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    code, out, err = run("lm-eval", tmp_path / "model.pt", "--tasks", "piqa", "--out", tmp_path / "x.h5")
    assert code == 2 and out == ""
    assert err == "depthdiag: error: lm-eval is not installed; install the eval extra: pip install -e .[eval]\n"


def test_help_imports_neither_lm_eval_nor_torch():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "import depthdiag.cli\n"
        "for args in (['--help'], ['lm-eval', '--help'], ['plot', '--help']):\n"
        "    assert CliRunner().invoke(depthdiag.cli.main, args).exit_code == 0, args\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('lm_eval', 'torch', 'xarray', 'numpy'))\n"
        "print(heavy[:3])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]"


class Request:
    """The part of lm-eval's Instance the model reads."""

    def __init__(self, *args):
        self.args = args


@pytest.mark.slow
def test_rolling_log_likelihood_scores_every_byte_once_with_the_context_that_fits(harness, checkpoint):
    from trainer.export.lm_harness import DepthdiagLM

    short, long = "a short text", "a longer text that does not fit in one window of sixty-four bytes, so it is cut"
    model = DepthdiagLM(checkpoint, depths=(1, 3), batch_size=BATCH_SIZE, progress=False)
    plain = load_snapshot(checkpoint).model().eval()

    def scored(inputs: list[int], targets: list[int], depth: int) -> float:
        with torch.no_grad():
            log_probs = plain(torch.tensor([inputs]), depth=depth)[0].log_softmax(-1)
        return float(log_probs[-len(targets) :].gather(-1, torch.tensor(targets)[:, None]).sum())

    for depth in (3, 1):
        model.set_depth(depth)
        got = model.loglikelihood_rolling([Request(short), Request(long)])
        tokens = list(short.encode())
        assert got[0] == pytest.approx(scored([ord("\n")] + tokens[:-1], tokens, depth), abs=1e-4)
        tokens = list(long.encode())
        assert len(tokens) > MAX_SEQ_LEN
        first = scored([ord("\n")] + tokens[: MAX_SEQ_LEN - 1], tokens[:MAX_SEQ_LEN], depth)
        rest = scored(tokens[-MAX_SEQ_LEN - 1 : -1], tokens[MAX_SEQ_LEN:], depth)
        assert got[1] == pytest.approx(first + rest, abs=1e-4)
    assert model.forward_passes == 1


@pytest.mark.slow
def test_generation_is_greedy_at_the_depth_and_stops_before_the_stop_string(harness, checkpoint):
    from trainer.export.lm_harness import DepthdiagLM

    model = DepthdiagLM(checkpoint, depth=2, progress=False)
    plain = load_snapshot(checkpoint).model().eval()
    context = "Question: What do bees make?\nAnswer:"
    tokens = list(context.encode())
    for _ in range(12):
        with torch.no_grad():
            tokens.append(int(plain(torch.tensor([tokens[-MAX_SEQ_LEN:]]), depth=2)[0, -1].argmax()))
    greedy = bytes(tokens[len(context) :]).decode("utf-8", errors="replace")
    (text,) = model.generate_until([Request(context, {"until": [], "max_gen_toks": 12})])
    assert text == greedy
    stop = greedy[5:7]
    (text,) = model.generate_until([Request(context, {"until": [stop], "max_gen_toks": 12})])
    assert text == greedy[: greedy.index(stop)]


@pytest.mark.slow
def test_exit_rules_refuse_a_served_model_without_a_real_exit(harness):
    from huginn_convention import HuginnConvention

    from common.errors import InputError
    from diag import HUGINN
    from diag.sources.hf import ServedAtDepth
    from trainer.export.lm_harness import DepthdiagLM, ServedModel

    served = ServedModel("huginn-folder", ServedAtDepth(HuginnConvention(vocab=16, d=8), HUGINN), None, 8, {})
    assert not served.model.serves_exits
    with pytest.raises(InputError, match="huginn-folder: its model family has no real per-token exit"):
        DepthdiagLM(served=served, depth=2, exits=["kl:1e-3"])
    DepthdiagLM(served=served, depth=2)  # without exit rules it serves
