"""Hugging Face model folders as diagnostic inputs: `--hf DIR` of `diagnose`, `eval` and `lm-eval`.

    depthdiag diagnose --hf runs/hf/checkpoint-40 --data data/books --out r.h5

DIR is any folder `transformers.AutoModelForCausalLM.from_pretrained` loads (config.json and
the weights; the model's own code beside them when it is not one of transformers' models,
run only with `--trust-remote-code`). Its model family (diag/arithmetic/families.py) says how to call it
for a gradient and an evaluation at a depth: detected from config.json's `model_type`, or named
with `--family`. Training batches and evaluation tokens come from a `prepare` folder (or any
folder of nanoGPT-style train.bin / val.bin token files): batch i is the source's batch for
(seed, step i), the evaluation set its evenly spaced held-out windows, as for a run of `bin` data.

The optimizer state comes from a `transformers.Trainer` checkpoint (optimizer.pt, scheduler.pt
in DIR: diag/sources/hf_trainer.py). A folder without one (a published model) is diagnosed only with
the clearly labelled alternative `--estimate-optimizer N`: Adam's second moments estimated
from N gradient passes at the checkpoint, no step taken (docs/diagnostic.md says what that
does and does not measure). The results file records which it was (`optimizer_state`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import xarray as xr
from torch import Tensor

from common.errors import InputError
from common.provenance import provenance
from diag.arithmetic.families import ModelFamily, detect_family, resolve_family
from diag.arithmetic.random_streams import common_random_numbers
from diag.sources.adapter import AdaptedModel
from diag.sources.hf_trainer import (
    OPTIMIZER_FILE,
    STATE_FILE,
    estimated_adam_optimizer,
    trainer_checkpoint_optimizer,
    trainer_global_step,
)
from trainer.data.sources import BIN_DTYPES, WindowSource, open_bin_source
from trainer.distributed import resolve_device
from trainer.export.hf.writer import require_transformers
from trainer.machine import machine
from trainer.scoring import mean_nll_by_depth

CONFIG_FILE = "config.json"


def transformers_module():
    """`transformers`, or the one-line InputError saying which extra installs it."""
    require_transformers()
    import transformers

    return transformers


def read_hf_config(folder: str | Path) -> dict:
    """config.json of the model folder `folder` as a dict; InputError naming the file otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder (--hf takes a Hugging Face model folder)")
    path = folder / CONFIG_FILE
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; --hf takes a Hugging Face model folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: not a readable model config ({type(err).__name__}: {err})") from None
    if not isinstance(document, dict):
        raise InputError(f"{path}: not a model config (a JSON object)")
    return document


def hf_family(folder: str | Path, spec: str | None) -> ModelFamily:
    """The model family of `folder`: `spec` (a name or MODULE:NAME) when given, else detected
    from its config.json's model_type."""
    document = read_hf_config(folder)
    if spec is not None:
        return resolve_family(spec)
    return detect_family(document.get("model_type"), str(folder))


def hf_model(source: HfInput, device: torch.device | str = "cpu") -> tuple[nn.Module, ModelFamily]:
    """The model of `source`'s folder on `device` (eval mode, fp32) and its family; the family is
    known, and the sequence length checked, before the model's code runs."""
    family = hf_family(source.folder, source.family)
    if source.tokens is not None:
        check_seq_len(source.folder, source.tokens.seq_len)
    return load_hf_model(source.folder, trust_remote_code=source.trust_remote_code, device=device), family


def load_hf_model(
    folder: str | Path, *, trust_remote_code: bool = False, device: torch.device | str = "cpu"
) -> nn.Module:
    """The causal LM of `folder` in fp32 on `device`, in eval mode. Code that ships in the
    folder (config.json's `auto_map`) runs only with `trust_remote_code`; weights load without
    unpickling (safetensors, or transformers' weights-only torch.load)."""
    folder = Path(folder)
    document = read_hf_config(folder)
    if document.get("auto_map") and not trust_remote_code:
        raise InputError(
            f"{folder}: the model's code ships in the folder (config.json's auto_map); pass --trust-remote-code "
            "to run it (read it first: it runs as you)"
        )
    transformers = transformers_module()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), trust_remote_code=trust_remote_code, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError) as err:
        text = " ".join(str(err).split())[:300]
        raise InputError(f"{folder}: transformers cannot load the model ({type(err).__name__}: {text})") from None
    return model.to(device).eval()


@dataclass(frozen=True)
class TokenSpec:
    """Where the diagnostic's batches and evaluation tokens come from, for a model folder."""

    data: str
    """A `prepare` folder (train.bin, val.bin, meta.json), or any folder of those token files."""
    batch_size: int = 8
    """Rows per training batch."""
    seq_len: int = 256
    """Tokens per row (inputs; a row holds seq_len + 1)."""
    eval_sequences: int = 64
    """Rows of the evaluation set: evenly spaced windows of val.bin."""
    seed: int = 0
    """Batch i is the source's batch for (seed, step i)."""

    def __post_init__(self) -> None:
        for key in ("batch_size", "seq_len", "eval_sequences"):
            if getattr(self, key) < 1:
                raise InputError(f"{key} must be >= 1, got {getattr(self, key)}")

    def source(self) -> WindowSource:
        """The token files, their dtype from meta.json when there is one (else uint16)."""
        folder = Path(self.data)
        meta = folder / "meta.json"
        dtype = "uint16"
        if meta.is_file():
            try:
                dtype = str(json.loads(meta.read_text(encoding="utf-8")).get("dtype", dtype))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
                raise InputError(f"{meta}: not a readable meta.json ({type(err).__name__})") from None
        if dtype not in BIN_DTYPES:
            raise InputError(f"{meta}: dtype {dtype!r} is not one of {', '.join(BIN_DTYPES)}")
        return open_bin_source(folder, dtype)

    def batches(self, count: int) -> Tensor:
        """int64 [count, batch_size, seq_len + 1]: batches 0..count-1."""
        source = self.source()
        return torch.stack([source.batch(self.seed, i, self.batch_size, self.seq_len) for i in range(count)])

    def eval_tokens(self) -> Tensor:
        """int64 [eval_sequences, seq_len + 1]."""
        return self.source().eval_tokens(self.eval_sequences, self.seq_len)


def context_length(document: dict) -> int | None:
    """The longest input the model's config admits, when it says (max_position_embeddings)."""
    value = document.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def check_seq_len(folder: str | Path, seq_len: int) -> None:
    """Refuse rows longer than the model's context (its positions would run past their table)."""
    longest = context_length(read_hf_config(folder))
    if longest is not None and seq_len > longest:
        raise InputError(
            f"--seq-len {seq_len}: {folder}'s model takes at most {longest} tokens (max_position_embeddings)"
        )


class ServedAtDepth(nn.Module):
    """A model of any family with this project's serving interface: `forward(input_ids, depth=s)`
    and `logits_by_depth(input_ids, depths)`, each depth's forward called as the family serves
    and from the diagnostic's fixed random stream (so a random initial state gives the same
    score on every run)."""

    def __init__(self, model: nn.Module, family: ModelFamily):
        super().__init__()
        self.model = model
        self.family = family

    def forward(self, input_ids: Tensor, depth: int) -> Tensor:
        with common_random_numbers():
            return self.family.logits(self.model(input_ids, **self.family.eval_call(depth)))

    def logits_by_depth(self, input_ids: Tensor, depths) -> Iterator[tuple[int, Tensor]]:
        for depth in sorted({int(d) for d in depths}):
            yield depth, self(input_ids, depth=depth)

    @property
    def serves_exits(self) -> bool:
        """Whether the model has a real per-token exit (depthdiag's export: LoopedTransformer.forward_with_exit)."""
        return callable(getattr(self.model, "forward_with_exit", None))

    def forward_with_exit(self, input_ids: Tensor, max_depth: int, exits) -> tuple[Tensor, Tensor]:
        """The model's own real per-token exit; InputError for a model without one."""
        if not self.serves_exits:
            raise InputError(f"model family {self.family.name}: no real per-token exit (forward_with_exit)")
        with common_random_numbers():
            return self.model.forward_with_exit(input_ids, max_depth, exits)


DEFAULT_BATCHES = 4
"""Diagnosed batches of a model folder when --batches is not given."""
ESTIMATE_STEP_OFFSET = 1_000_000
"""The gradient passes of an estimated optimizer state use batches (seed, ESTIMATE_STEP_OFFSET + i),
none of the diagnosed batches (seed, i): the curvature estimate does not see the batch it steps on."""


@dataclass(frozen=True)
class HfInput:
    """A Hugging Face model folder with what its diagnostic needs besides the folder itself."""

    folder: str
    """The model folder; a transformers.Trainer checkpoint-N/ also supplies the optimizer state."""
    tokens: TokenSpec | None = None
    """Where the batches and the evaluation set come from (None for lm-eval, which has its tasks')."""
    family: str | None = None
    """A family name or MODULE:NAME; None: detected from config.json's model_type."""
    trust_remote_code: bool = False
    """Run the model code that ships in the folder (config.json's auto_map)."""
    estimate_optimizer: int | None = None
    """Without a Trainer state: estimate Adam's second moments from this many gradient passes."""
    lr: float | None = None
    """The estimated state's learning rate (a Trainer checkpoint's comes from its scheduler.pt)."""
    grad_clip: float | None = 1.0
    """Clip the gradient's global norm to this, as training did (1.0: the Trainer's default
    max_grad_norm, which lives in training_args.bin, a pickle never loaded); None: no clipping."""
    precision: str = "fp32"
    """'fp32' or 'bf16' gradients, as the model trained."""

    def __post_init__(self) -> None:
        if self.estimate_optimizer is not None and self.estimate_optimizer < 1:
            raise InputError(f"--estimate-optimizer must be >= 1 gradient passes, got {self.estimate_optimizer}")
        if self.lr is not None and not self.lr > 0:
            raise InputError(f"--lr must be positive, got {self.lr}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise InputError(f"--grad-clip must be positive (or none), got {self.grad_clip}")


def evaluate_hf(
    source: HfInput, serving_depths: Sequence[int], *, device: str = "auto", batch_size: int = 32, progress: bool = True
) -> xr.Dataset:
    """Mean token NLL of a model folder at each serving depth on the evaluation set of
    `source.tokens`, called as its family serves, from the diagnostic's fixed random stream;
    a Dataset over `serving_depth` like `depthdiag eval`'s of a checkpoint."""
    target = resolve_device(device)
    model, family = hf_model(source, target)
    depths = tuple(int(s) for s in serving_depths)
    eval_tokens = source.tokens.eval_tokens()
    with common_random_numbers():
        nll = mean_nll_by_depth(
            model,
            eval_tokens,
            depths,
            batch_size=batch_size,
            device=target,
            progress=progress,
            depth_call=family.eval_call,
            logits_of=family.logits,
        )
    state = Path(source.folder) / STATE_FILE
    step = trainer_global_step(state) if state.is_file() else None
    return xr.Dataset(
        {
            "nll": (
                ("serving_depth",),
                nll.cpu().numpy(),
                {"long_name": "mean token NLL on the evaluation set", "units": "nats"},
            )
        },
        coords={"serving_depth": list(depths)},
        attrs={
            "hf_folder": str(source.folder),
            "model_family": family.name,
            **({"step": step} if step is not None else {}),
            "data": str(source.tokens.data),
            "seq_len": source.tokens.seq_len,
            "eval_sequences": int(eval_tokens.shape[0]),
            **provenance(),
            "machine": machine(target.type),
        },
    )


DEFAULT_CONTEXT = 2048
"""The context length of a model whose config names none (lm-eval's default too)."""


def served_hf_model(source: HfInput, tokenizer: str | Path | None, device: torch.device | str):
    """The model folder for lm-eval (trainer/export/lm_harness.py): served at a depth as its family
    serves, with `tokenizer` (a tokenizers file) or the folder's tokenizer.json, its context
    length from its config. Needs lm-eval installed (the eval extra)."""
    from trainer.data.text_tokens import FileTokenizer
    from trainer.export.lm_harness import ServedModel

    folder = Path(source.folder)
    path = Path(tokenizer) if tokenizer is not None else folder / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{folder}: no tokenizer.json beside the model; pass --tokenizer FILE (a tokenizers file)")
    model, family = hf_model(source, device)
    text_tokens = FileTokenizer(path)
    document = read_hf_config(folder)
    vocab = document.get("vocab_size")
    if isinstance(vocab, int) and text_tokens.vocab_size > vocab:
        raise InputError(
            f"{path}: {text_tokens.vocab_size} tokens, more than the model's vocab_size {vocab} ({folder})"
        )
    return ServedModel(
        name=str(folder),
        model=ServedAtDepth(model, family).eval(),
        tokenizer=text_tokens,
        max_length=context_length(document) or DEFAULT_CONTEXT,
        info={"hf_folder": str(folder), "model_family": family.name},
    )


def _estimate_label(passes: int, depths: Sequence[int]) -> str:
    """The results file's `optimizer_state` of an estimated state: N batches, at which depths."""
    return f"estimated-second-moments(N={passes}, depths={','.join(str(d) for d in depths)})"


def hf_adapted_model(
    source: HfInput, *, batches: int, update_depths: Sequence[int], device: str = "auto"
) -> tuple[AdaptedModel, int | None]:
    """(the AdaptedModel `depthdiag diagnose --hf` runs on, the Trainer's global step or None).

    A folder with optimizer.pt is a transformers.Trainer checkpoint: its AdamW is rebuilt over
    the model's parameters with the learning rate of the next update (diag/sources/hf_trainer.py). A
    folder without one needs `source.estimate_optimizer`: then N held-out batches (steps
    ESTIMATE_STEP_OFFSET + i) each give a gradient at every update depth, called as the family
    trains, clipped and in the precision of the diagnostic, and the mean of their squares is
    Adam's second moment, with no momentum (docs/diagnostic.md)."""
    from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic

    if source.tokens is None:
        raise InputError(f"--hf {source.folder}: the diagnostic needs --data, the model's token files")
    folder = Path(source.folder)
    has_state = (folder / OPTIMIZER_FILE).is_file()
    if not has_state and source.estimate_optimizer is None:
        raise InputError(
            f"{folder}: no {OPTIMIZER_FILE}, so no optimizer state to diagnose the next update of (a published "
            "model, not a transformers.Trainer checkpoint); --estimate-optimizer N --lr LR estimates Adam's "
            "second moments from N gradient passes instead (docs/diagnostic.md)"
        )
    if has_state and source.estimate_optimizer is not None:
        raise InputError(
            f"{folder}: holds the Trainer's {OPTIMIZER_FILE}; diagnose with it, or drop --estimate-optimizer"
        )
    model, family = hf_model(source, resolve_device(device))
    eval_tokens = source.tokens.eval_tokens()
    if has_state:
        rebuilt = trainer_checkpoint_optimizer(model, folder)
    else:
        if source.lr is None:
            raise InputError(f"--hf {folder}: --estimate-optimizer needs --lr, the learning rate of the step")
        passes = source.estimate_optimizer
        trainable = [p for p in model.parameters() if p.requires_grad]
        options = DiagnosticOptions(
            update_depths=tuple(update_depths), family=family, grad_clip=source.grad_clip, precision=source.precision
        )
        # The gradient pass of the diagnostic itself (family call, loss, clipping, precision,
        # common random numbers); its optimizer only orders the gradients and never steps.
        gradients = UpdateDiagnostic(model, torch.optim.SGD(trainable, lr=1.0), eval_tokens, options)
        spec, data = source.tokens, source.tokens.source()
        items = [
            (data.batch(spec.seed, ESTIMATE_STEP_OFFSET + i, spec.batch_size, spec.seq_len), depth)
            for i in range(passes)
            for depth in update_depths
        ]
        rebuilt = estimated_adam_optimizer(
            model, items, lambda item: gradients.gradient(*item)[1], lr=source.lr, passes=len(items)
        )
        rebuilt = replace(rebuilt, optimizer_state=_estimate_label(passes, update_depths))
    adapted = rebuilt.adapted(
        source.tokens.batches(batches),
        eval_tokens,
        family=family,
        grad_clip=source.grad_clip,
        precision=source.precision,
        name=folder.resolve().name,
    )
    step = rebuilt.global_step
    return adapted, step


def hf_config_json(source: HfInput, adapted: AdaptedModel) -> str:
    """What stands in a results file's `config` attribute for a model folder's run."""
    return json.dumps(
        {
            "hf_folder": str(source.folder),
            "hf_config": read_hf_config(source.folder),
            "model_family": adapted.family.name,
            "family": repr(adapted.family),
            "data": str(source.tokens.data),
            "batch_size": source.tokens.batch_size,
            "seq_len": source.tokens.seq_len,
            "eval_sequences": source.tokens.eval_sequences,
            "data_seed": source.tokens.seed,
            "optimizer_state": adapted.optimizer_state,
            "grad_clip": adapted.grad_clip,
            "precision": adapted.precision,
            "transformers_version": transformers_module().__version__,
        },
        sort_keys=True,
        default=str,
    )
