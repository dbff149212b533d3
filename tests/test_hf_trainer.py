"""diag.sources.hf_trainer: the optimizer of a transformers.Trainer checkpoint, rebuilt, against a real
Trainer run on the CPU (a tiny Llama and a tiny GPT-2 built from configs, nothing downloaded),
and the estimated second moments for a checkpoint without optimizer state."""

from __future__ import annotations

import builtins
import copy
import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from common.errors import InputError
from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic
from diag.arithmetic.model_checks import BiasCorrectionWarning, bias_correction_message
from diag.arithmetic.optim_step import optimizer_step
from diag.sources.hf_trainer import (
    TRAINER_CHECKPOINT,
    estimated_adam_optimizer,
    settled_step_count,
    trainer_checkpoint_optimizer,
    trainer_parameter_groups,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 100, 16
SAVED_STEP = 10
"""The checkpoint the tests read: checkpoint-10 of a 14-step run, mid-cosine, so every step's lr differs."""


def tiny_model(architecture: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    if architecture == "llama":  # RMSNorm, found by name; no biases
        settings = dict(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB
        )
        settings.update(overrides)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(max_position_embeddings=32, **settings))
    # GPT-2: nn.LayerNorm named ln_1/ln_2/ln_f (found by type alone), biases, tied embeddings.
    settings = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB)
    settings.update(overrides)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=32, **settings))


def token_rows(count: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=generator) for _ in range(count)]
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def names_of(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


class Capture(transformers.TrainerCallback):
    """The live optimizer at the saved step, and the step after it: its lr, gradients and result."""

    def __init__(self):
        self.live_state: dict[str, dict] = {}
        self.live_groups: list[list[str]] = []
        self.live_hyper: list[dict] = []

    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step != SAVED_STEP:
            return
        inner, names = getattr(optimizer, "optimizer", optimizer), names_of(model)
        self.live_groups = [[names[id(p)] for p in g["params"]] for g in inner.param_groups]
        self.live_hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        self.live_state = {names[id(p)]: copy.deepcopy(s) for p, s in inner.state.items()}

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == SAVED_STEP:  # step SAVED_STEP + 1, after clipping
            self.next_lrs = [g["lr"] for g in optimizer.param_groups]
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            self.before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == SAVED_STEP:
            self.after = {n: p.detach().clone() for n, p in model.named_parameters()}


@dataclass
class Run:
    """A Trainer run of one architecture: its checkpoint-10 folder and what the callback saw."""

    architecture: str
    checkpoint: Path
    capture: Capture


def train(tmp_path: Path, architecture: str, **args) -> tuple[Path, Capture]:
    model = tiny_model(architecture)
    capture = Capture()
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=14,
        save_steps=SAVED_STEP,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=3,
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(args)
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(**settings),
        train_dataset=token_rows(64, seed=1),
        callbacks=[capture],
    )
    trainer.train()
    return tmp_path / f"checkpoint-{SAVED_STEP}", capture


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Runs by architecture, each trained once for the module, when a test first asks for it."""
    runs: dict[str, Run] = {}

    def get(architecture: str) -> Run:
        if architecture not in runs:
            runs[architecture] = Run(architecture, *train(tmp_path_factory.mktemp(architecture), architecture))
        return runs[architecture]

    return get


@pytest.fixture(params=["llama", "gpt2"])
def run(request, trained) -> Run:
    return trained(request.param)


@pytest.fixture
def llama_run(trained) -> Run:
    return trained("llama")


def from_checkpoint(architecture: str, folder) -> nn.Module:
    kind = transformers.LlamaForCausalLM if architecture == "llama" else transformers.GPT2LMHeadModel
    return kind.from_pretrained(str(folder))


def load(run: Run):
    model = from_checkpoint(run.architecture, run.checkpoint)
    return model, trainer_checkpoint_optimizer(model, run.checkpoint)


# --- the rebuilt optimizer against the Trainer's live one --------------------------------------------


def test_the_trainer_uses_its_default_fused_adamw(run):
    """What the rest assumes of this transformers: the default optimizer is a fused torch AdamW."""
    assert all(h["fused"] and h["decoupled_weight_decay"] for h in run.capture.live_hyper)
    assert run.capture.live_hyper[0]["weight_decay"] == 0.1 and run.capture.live_hyper[1]["weight_decay"] == 0.0


def test_parameter_groups_are_the_trainers(run):
    model = from_checkpoint(run.architecture, run.checkpoint)
    assert list(trainer_parameter_groups(model)) == run.capture.live_groups
    # The groups matter for this model: both hold parameters.
    assert all(run.capture.live_groups)


def test_rebuilt_state_equals_the_live_state_at_the_checkpoint(run):
    model, rebuilt = load(run)
    names = names_of(model)
    state = {names[id(p)]: s for p, s in rebuilt.optimizer.state.items()}
    assert state.keys() == run.capture.live_state.keys() == set(names.values())
    for name, live in run.capture.live_state.items():
        assert state[name].keys() == live.keys(), name
        for key, value in live.items():
            assert torch.equal(state[name][key], value), (name, key)
    assert float(state[names[id(next(model.parameters()))]]["step"]) == SAVED_STEP
    assert [[names[id(p)] for p in g["params"]] for g in rebuilt.optimizer.param_groups] == run.capture.live_groups
    for group, live in zip(rebuilt.optimizer.param_groups, run.capture.live_hyper):
        for key in ("betas", "eps", "weight_decay", "amsgrad", "maximize"):
            assert group[key] == live[key], key


def test_lr_is_the_one_the_trainer_uses_for_the_next_step(run):
    _, rebuilt = load(run)
    assert list(rebuilt.group_lrs) == run.capture.next_lrs
    assert rebuilt.lr == run.capture.next_lrs[0]
    assert [g["lr"] for g in rebuilt.optimizer.param_groups] == run.capture.next_lrs
    assert rebuilt.global_step == SAVED_STEP and rebuilt.optimizer_state == TRAINER_CHECKPOINT
    # trainer_state.json's last logged rate is the one the saved step already used: another number.
    logged = json.loads((run.checkpoint / "trainer_state.json").read_text())["log_history"][-1]
    assert logged["step"] == SAVED_STEP and not math.isclose(logged["learning_rate"], rebuilt.lr)


def test_one_step_matches_the_trainers_next_step(run):
    """The rebuilt optimizer, given the gradient the Trainer's step 11 had, moves the weights as
    the Trainer's own (fused) optimizer did to 1e-8, and as a plain torch AdamW over the live
    state does to the bit, and so does the diagnostic's Delta(g)."""
    model, rebuilt = load(run)
    capture = run.capture
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), capture.before[name]), name
    assert all(not g["fused"] and not g["capturable"] for g in rebuilt.optimizer.param_groups)
    delta = optimizer_step(rebuilt.optimizer).delta(
        [capture.grads[names_of(model)[id(p)]] for g in rebuilt.optimizer.param_groups for p in g["params"]]
    )

    # A plain AdamW over the Trainer's live groups and state at the checkpoint.
    plain_model = copy.deepcopy(model)
    plain_params = dict(plain_model.named_parameters())
    plain = torch.optim.AdamW(
        [
            {"params": [plain_params[n] for n in names], "lr": lr, "weight_decay": h["weight_decay"]}
            for names, lr, h in zip(capture.live_groups, capture.next_lrs, capture.live_hyper)
        ],
        betas=capture.live_hyper[0]["betas"],
        eps=capture.live_hyper[0]["eps"],
    )
    for name, live in capture.live_state.items():
        plain.state[plain_params[name]] = copy.deepcopy(live)

    for m in (model, plain_model):
        for name, p in m.named_parameters():
            p.grad = capture.grads[name].clone()
    rebuilt.optimizer.step()
    plain.step()
    names = [names_of(model)[id(p)] for g in rebuilt.optimizer.param_groups for p in g["params"]]
    worst = 0.0
    for name, d in zip(names, delta):
        stepped = dict(model.named_parameters())[name].detach()
        assert torch.equal(stepped, plain_params[name].detach()), name
        assert torch.equal(stepped - capture.before[name], d), name
        worst = max(worst, float((stepped - capture.after[name]).abs().max()))
    assert worst < 1e-8  # rounding: about 2e-9 on these fp32 weights, for updates of about 1e-3


def test_rng_state_and_training_args_are_never_opened(run, tmp_path, monkeypatch):
    """They need full unpickling (code execution from the file): garbage and unreadable here."""
    folder = tmp_path / f"checkpoint-{SAVED_STEP}"
    shutil.copytree(run.checkpoint, folder)
    for name in ("rng_state.pth", "training_args.bin"):
        (folder / name).write_bytes(b"not a pickle")
        (folder / name).chmod(0)
    opened = []
    real_open, real_load = builtins.open, torch.load
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: opened.append(str(file)) or real_open(file, *a, **k))
    monkeypatch.setattr(torch, "load", lambda file, *a, **k: opened.append(str(file)) or real_load(file, *a, **k))
    model = from_checkpoint(run.architecture, run.checkpoint)
    opened.clear()
    rebuilt = trainer_checkpoint_optimizer(model, folder)
    assert any(path.endswith("optimizer.pt") for path in opened)
    assert not [path for path in opened if path.endswith(("rng_state.pth", "training_args.bin"))]
    assert rebuilt.lr == run.capture.next_lrs[0]


def test_adapted_model_carries_the_next_lr_and_the_label(run):
    _, rebuilt = load(run)
    batch = torch.randint(0, VOCAB, (2, SEQ + 1))
    adapted = rebuilt.adapted(batch[None], batch, precision="bf16")
    assert adapted.lr == rebuilt.lr and adapted.name == f"checkpoint-{SAVED_STEP}"
    assert adapted.grad_clip == 1.0 and adapted.precision == "bf16" and adapted.optimizer is rebuilt.optimizer
    assert rebuilt.adapted(batch[None], batch, grad_clip=0).grad_clip is None


# --- refusals ------------------------------------------------------------------------------------------


def one_line_error(call) -> str:
    with pytest.raises(InputError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_checkpoint_of_another_model_is_refused(llama_run):
    run = llama_run
    shallower = tiny_model("llama", num_hidden_layers=1)
    message = one_line_error(lambda: trainer_checkpoint_optimizer(shallower, run.checkpoint))
    assert "optimizer.pt" in message
    assert "param group 0 has 16 tensors" in message and "with weight decay are 9" in message
    narrower = tiny_model("llama", intermediate_size=48)
    message = one_line_error(lambda: trainer_checkpoint_optimizer(narrower, run.checkpoint))
    assert "optimizer.pt" in message and "model.layers.0.mlp.gate_proj.weight" in message
    assert "[64, 32]" in message and "[48, 32]" in message
    # The same architecture with other weights (not loaded from the checkpoint).
    message = one_line_error(lambda: trainer_checkpoint_optimizer(tiny_model("llama"), run.checkpoint))
    assert "model.safetensors" in message and "differs from the checkpoint" in message
    trainer_checkpoint_optimizer(tiny_model("llama"), run.checkpoint, check_weights=False)


def test_missing_files_are_named_with_the_folder(run, tmp_path):
    folder = tmp_path / "checkpoint-10"
    shutil.copytree(run.checkpoint, folder)
    (folder / "scheduler.pt").unlink()
    model = from_checkpoint(run.architecture, run.checkpoint)
    message = one_line_error(lambda: trainer_checkpoint_optimizer(model, folder))
    assert str(folder) in message and "scheduler.pt" in message
    # The Trainer's output folder instead of one of its checkpoints.
    message = one_line_error(lambda: trainer_checkpoint_optimizer(model, run.checkpoint.parent))
    assert "checkpoint-10" in message and "optimizer.pt" in message
    message = one_line_error(lambda: trainer_checkpoint_optimizer(model, tmp_path / "nowhere"))
    assert "no such folder" in message


def test_an_optimizer_that_cannot_be_rebuilt_is_refused_by_name(tmp_path):
    checkpoint, _ = train(tmp_path, "llama", optim="adafactor", max_steps=SAVED_STEP)
    model = from_checkpoint("llama", checkpoint)
    message = one_line_error(lambda: trainer_checkpoint_optimizer(model, checkpoint))
    assert "optimizer.pt" in message and "Adafactor" in message and "adamw_torch" in message


def test_parameter_groups_of_odd_names_and_layer_norms_match_the_trainer(tmp_path):
    """Names and module types the rule turns on, against the groups a real Trainer builds."""

    class LayerNormWithGate(nn.LayerNorm):  # a subclass, and a module inside a LayerNorm
        def __init__(self, width):
            super().__init__(width)
            self.gate = nn.Linear(width, width)

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_gain = nn.Parameter(torch.ones(4))  # 'norm' not a whole part: decayed
            self.has_bias_term = nn.Parameter(torch.ones(4))  # 'bias' anywhere: not decayed
            self.lin = nn.Linear(4, 4)
            self.ln = nn.LayerNorm(4)  # by type
            self.gated = LayerNormWithGate(4)
            self.Norm = nn.Linear(4, 4)  # by name, case-insensitively
            self.attn_norm = nn.Linear(4, 4, bias=False)
            self.final_RMSNorm = nn.Linear(4, 4, bias=False)
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            return self.lin(x)

    model = Odd()
    trainer = transformers.Trainer(
        model=model, args=transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    )
    names = names_of(model)
    expected = [[names[id(p)] for p in g["params"]] for g in trainer.create_optimizer().param_groups]
    assert list(trainer_parameter_groups(model)) == expected
    assert expected[0] == ["norm_gain", "lin.weight"]


# --- estimated second moments --------------------------------------------------------------------------


class Looped(nn.Module):
    """A small model with a depth keyword, for the diagnostic: an embedding, one block run
    `depth` times, a LayerNorm and a head."""

    def __init__(self, vocab=30, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(2 * width, width), nn.Tanh())
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, depth=2):
        e = self.embed(input_ids)
        state = torch.zeros_like(e)
        for _ in range(depth):
            state = self.block(torch.cat((state, e), dim=-1))
        return self.head(self.ln(state))


def made_up_gradients(model: nn.Module, batch: torch.Tensor) -> list[torch.Tensor]:
    """A gradient that depends on the batch only, one per trainable parameter."""
    generator = torch.Generator().manual_seed(int(batch.sum()))
    return [torch.randn(p.shape, generator=generator) for p in model.parameters() if p.requires_grad]


def test_estimated_second_moments_are_the_mean_squared_gradient():
    model = Looped()
    batches = [torch.full((2, 5), i) for i in range(5)]
    calls = []

    def gradient_fn(batch):
        calls.append(batch)
        return made_up_gradients(model, batch)

    estimated = estimated_adam_optimizer(model, iter(batches), gradient_fn, lr=1e-3, passes=3, weight_decay=0.1)
    assert len(calls) == 3  # the first `passes` batches only
    by_hand = [torch.stack(g).square().mean(0) for g in zip(*(made_up_gradients(model, b) for b in batches[:3]))]
    params = list(model.parameters())
    for p, expected in zip(params, by_hand):
        state = estimated.optimizer.state[p]
        torch.testing.assert_close(state["exp_avg_sq"], expected, rtol=1e-6, atol=0)
        assert torch.equal(state["exp_avg"], torch.zeros_like(p))
        assert float(state["step"]) == settled_step_count((0.9, 0.999)) == 20000
    assert estimated.optimizer_state == "estimated-second-moments(N=3)" and estimated.global_step is None
    assert bias_correction_message(estimated.optimizer) is None
    decayed, rest = estimated.optimizer.param_groups
    assert [g["weight_decay"] for g in (decayed, rest)] == [0.1, 0.0]
    assert len(rest["params"]) == 4  # block and head biases, the LayerNorm's weight and bias
    assert all(g["lr"] == 1e-3 and not g["fused"] for g in (decayed, rest))
    for p in model.parameters():
        assert p.grad is None


def test_estimated_optimizer_refuses_bad_gradients_and_too_few_batches():
    model = Looped()
    batches = [torch.full((2, 5), i) for i in range(2)]
    message = one_line_error(
        lambda: estimated_adam_optimizer(model, batches, lambda b: made_up_gradients(model, b), lr=1e-3, passes=3)
    )
    assert "passes=3" in message and "2 batches" in message
    message = one_line_error(
        lambda: estimated_adam_optimizer(model, batches, lambda b: made_up_gradients(model, b)[1:], lr=1e-3, passes=1)
    )
    assert "6 gradients" in message and "7 trainable" in message
    nan = lambda b: [g * math.nan for g in made_up_gradients(model, b)]  # noqa: E731
    message = one_line_error(lambda: estimated_adam_optimizer(model, batches, nan, lr=1e-3, passes=1))
    assert "embed.weight" in message and "non-finite" in message


def test_estimated_optimizer_in_the_diagnostic():
    """Gradients through the diagnostic's own gradient pass (the model's depth keyword, clipping);
    the diagnosed update is the closed form of Adam with that curvature and no momentum."""
    torch.manual_seed(0)
    model = Looped()
    rows = lambda seed: torch.randint(0, 30, (4, 9), generator=torch.Generator().manual_seed(seed))  # noqa: E731
    eval_tokens = rows(99)
    options = DiagnosticOptions(update_depths=(1, 3), serving_depths=(1, 2, 3), grad_clip=1.0)
    provisional = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])  # fixes the order only
    passes = UpdateDiagnostic(model, provisional, eval_tokens, options)
    lr, betas, eps = 1e-3, (0.9, 0.95), 1e-8
    estimated = estimated_adam_optimizer(
        model, (rows(i) for i in range(100)), lambda b: passes.gradient(b, depth=3)[1], lr=lr, passes=4, betas=betas
    )
    diagnostic = UpdateDiagnostic(model, estimated.optimizer, eval_tokens, options)
    _, grads = diagnostic.gradient(rows(500), depth=1)
    update = diagnostic.update(grads)
    flat = [p for g in estimated.optimizer.param_groups for p in g["params"]]
    for p, g, u in zip(flat, grads, update):
        v = estimated.optimizer.state[p]["exp_avg_sq"]
        closed = -lr * (1 - betas[0]) * g / ((betas[1] * v + (1 - betas[1]) * g * g).sqrt() + eps)
        # Delta(g) is theta' - theta in fp32: exact up to the rounding of theta' (an ulp of theta).
        ulp = torch.finfo(torch.float32).eps * float(p.detach().abs().max())
        torch.testing.assert_close(u, closed, rtol=1e-5, atol=2 * ulp)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BiasCorrectionWarning)
        ds = diagnostic.compare(rows(500))
    assert bool(torch.isfinite(torch.as_tensor(ds["nll"].values)).all())
