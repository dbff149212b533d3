"""The whole Hugging Face route: a depthdiag model exported with `--format hf`, trained for a few
dozen steps by a real transformers.Trainer on CPU, then `depthdiag diagnose --hf checkpoint-N`,
against `compare_updates` on the Trainer's own live model and optimizer at that step."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import TokenRows
from hf_helpers import write_checkpoint

import diag
from analysis.store import open_results
from depthdiag.cli import main
from diag.arithmetic.families import DEPTHDIAG
from trainer.data.sources import open_bin_source

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings(
    "ignore::diag.arithmetic.engine.BiasCorrectionWarning"
)  # 20 steps: young, on purpose
SEQ, ROWS, SAVE_AT = 12, 4, 20


class LiveState(transformers.TrainerCallback):
    """Copies of the Trainer's model and optimizer when it saves: the optimizer has stepped
    and the scheduler with it, so its groups hold the learning rate of the next update."""

    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step != SAVE_AT:
            return
        self.step = state.global_step
        # One deepcopy for both, so the optimizer's copy holds the model copy's parameters.
        self.model, self.optimizer = copy.deepcopy((model, getattr(optimizer, "optimizer", optimizer)))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], prog_name="depthdiag")
    assert result.exit_code == 0, result.output
    return result.output


def test_diagnose_hf_on_a_trainer_checkpoint_equals_compare_updates_on_the_live_state(tmp_path):
    from trainer.data.prepare import PrepareConfig, prepare

    # A depthdiag model of a `bin` run, exported with its tokenizer.
    corpus = tmp_path / "corpus.txt"
    words = "sky cat apple bee water giraffe pole cold moss river".split()
    sentences = [f"The {a} is not the {b}, said the {c}." for a, b, c in zip(words, words[3:] * 2, words[5:] * 2)]
    corpus.write_text("\n\n".join(sentences) * 8)
    run_data = tmp_path / "run-data"
    prepare(PrepareConfig(inputs=(str(corpus),), out=run_data, vocab_size=300, val_fraction=0.3), progress=False)
    vocab = json.loads((run_data / "meta.json").read_text())["vocab_size"]
    source = write_checkpoint(
        tmp_path / "model.pt", data={"source": "bin", "path": str(run_data), "eval_sequences": 2}, vocab_size=vocab
    )
    exported = tmp_path / "hf"
    run("export", source, "--out", exported, "--format", "hf", "--num-steps", 4)

    model = transformers.AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(exported)
    train_rows = torch.stack([open_bin_source(run_data).batch(1, i, 1, SEQ - 1)[0] for i in range(200)])
    live = LiveState()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=SAVE_AT + 4,
        save_steps=SAVE_AT,
        per_device_train_batch_size=ROWS,
        learning_rate=3e-3,
        warmup_steps=5,
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        max_grad_norm=1.0,
        use_cpu=True,
        report_to=[],
        logging_steps=1000,
        save_strategy="steps",
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=TokenRows(train_rows),
        processing_class=tokenizer,  # saved into every checkpoint
        data_collator=transformers.default_data_collator,  # rows of one length: no padding
        callbacks=[live],
    )
    trainer.train()
    checkpoint = tmp_path / "out" / f"checkpoint-{SAVE_AT}"
    assert live.step == SAVE_AT and (checkpoint / "optimizer.pt").is_file()
    assert (checkpoint / "tokenizer.json").is_file()  # the Trainer saved its processing_class

    # The README's three commands: tokens with the model's tokenizer, the diagnostic, the summary.
    data, out = tmp_path / "data", tmp_path / "r.h5"
    run("prepare", corpus, "--out", data, "--tokenizer", checkpoint / "tokenizer.json")
    small = ("--seq-len", SEQ, "--train-batch-size", ROWS, "--eval-sequences", 6, "--batches", 2)
    depths = ("--update-depths", "2,6", "--serving", "1,2,4,6")
    run("diagnose", "--hf", checkpoint, "--trust-remote-code", "--data", data, *small, *depths, "--out", out)
    summary = run("summarize", out)
    assert f"checkpoint-{SAVE_AT}" in summary and "uniform" not in summary
    ds = open_results(out)
    assert ds.attrs["model_family"] == "depthdiag" and ds.attrs["optimizer_state"] == "trainer-checkpoint"
    assert list(ds.snapshot.values) == [f"checkpoint-{SAVE_AT}"] and ds.step.values.tolist() == [SAVE_AT]

    tokens = open_bin_source(data)
    eval_tokens = tokens.eval_tokens(6, SEQ)
    for b in range(2):
        expected = diag.compare_updates(
            live.model,
            live.optimizer,
            tokens.batch(0, b, ROWS, SEQ),
            eval_tokens,
            update_depths=(2, 6),
            serving_depths=(1, 2, 4, 6),
            family=DEPTHDIAG,
            grad_clip=1.0,
        )
        np.testing.assert_allclose(ds.nll.isel(snapshot=0, batch=b).values, expected.nll.values, rtol=0, atol=1e-6)
        np.testing.assert_allclose(ds.benefit.isel(snapshot=0, batch=b).values, expected.benefit.values, atol=1e-6)
        assert float(ds.lr.isel(snapshot=0)) == pytest.approx(live.optimizer.param_groups[0]["lr"], rel=1e-12)
    assert np.abs(ds.benefit.values).max() > 1e-5  # the depths' updates differ: the comparison means something
