"""The optimizer of a Hugging Face model's next update, for the update diagnostic.

Two routes, both returning a `CheckpointOptimizer` (the optimizer over the model's own
parameters, the learning rate of the next update, and a label of where the state came from
that a results file stores as `optimizer_state`):

    trainer_checkpoint_optimizer(model, "out/checkpoint-40")       optimizer_state "trainer-checkpoint"
    estimated_adam_optimizer(model, batches, gradient_fn, lr=...)  optimizer_state "estimated-second-moments(N=8)"

The first rebuilds the AdamW a `transformers.Trainer` saved in a checkpoint folder, for the
model loaded from the same folder (`AutoModelForCausalLM.from_pretrained(folder)`). The
second is for a published model without optimizer state: an AdamW whose second moments are
estimated from gradients at the checkpoint; docs/diagnostic.md ("Checkpoints without
optimizer state") says what that measures and what it does not.

Nothing here imports transformers: a checkpoint folder is read with torch, json and
safetensors alone, and only from the files that `torch.load(weights_only=True)` can read.
rng_state.pth and training_args.bin need full unpickling (code execution from the file), so
they are never opened; what they would tell (the Trainer's `max_grad_norm`, its bf16 flag)
is a parameter of `CheckpointOptimizer.adapted` instead.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from torch import Tensor

from common.errors import InputError
from diag.arithmetic.families import ModelFamily
from diag.sources.adapter import AdaptedModel

TRAINER_MAX_GRAD_NORM = 1.0
"""`TrainingArguments.max_grad_norm`'s default: what a Trainer run clips to unless told otherwise."""

TRAINER_CHECKPOINT = "trainer-checkpoint"
"""`optimizer_state` of an optimizer rebuilt from a Trainer checkpoint: the state training had."""

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

_NO_DECAY_NAME_PATTERNS = tuple(
    re.compile(pattern) for pattern in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
)
"""Lower-cased parameter names the Trainer (transformers 5.x) keeps out of weight decay."""

_ADAM_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
_ADAM_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class CheckpointOptimizer:
    """An optimizer ready for the diagnostic, with where its state came from."""

    model: nn.Module
    """The model whose parameters `optimizer` holds."""
    optimizer: torch.optim.Optimizer
    """A plain (neither fused nor capturable) torch AdamW or Adam over `model`'s trainable
    parameters, in the Trainer's two param groups, each group's lr set to the next update's."""
    lr: float
    """The learning rate of the next update (the first param group's; `group_lrs` has all)."""
    group_lrs: tuple[float, ...]
    """Every param group's learning rate of the next update."""
    optimizer_state: str
    """Where the state came from, for the results file: TRAINER_CHECKPOINT, or
    'estimated-second-moments(N=...)'."""
    global_step: int | None = None
    """The Trainer's global_step at the checkpoint (trainer_state.json); None when estimated."""

    def adapted(
        self,
        batches: Sequence[Tensor] | Tensor,
        eval_tokens: Tensor,
        *,
        depth_kwarg: str = "depth",
        family: ModelFamily | None = None,
        grad_clip: float | None = TRAINER_MAX_GRAD_NORM,
        precision: str = "fp32",
        name: str | None = None,
        eval_mask: Tensor | None = None,
    ) -> AdaptedModel:
        """What an adapter function for `depthdiag diagnose --adapter` returns for this optimizer.

        `grad_clip` and `precision` are the training run's clipping and precision, which a
        Trainer records only in training_args.bin (never read here): the default is the
        Trainer's default, max_grad_norm=1.0 in fp32; pass precision='bf16' for a bf16=True
        run and grad_clip=None for max_grad_norm=0. `name` (the label along `snapshot`)
        defaults to 'checkpoint-N' for a Trainer checkpoint."""
        if name is None and self.global_step is not None:
            name = f"checkpoint-{self.global_step}"
        return AdaptedModel(
            model=self.model,
            optimizer=self.optimizer,
            batches=batches,
            eval_tokens=eval_tokens,
            depth_kwarg=depth_kwarg,
            family=family,
            lr=self.lr,
            grad_clip=grad_clip or None,  # the Trainer's max_grad_norm=0 means no clipping
            name=name,
            precision=precision,
            eval_mask=eval_mask,
            optimizer_state=self.optimizer_state,
        )


# --- the Trainer's parameter groups -------------------------------------------------------------


def _under_layer_norm(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` belongs to an nn.LayerNorm (or a module inside one)."""
    module = model
    for part in name.split(".")[:-1]:
        module = module.get_submodule(part)
        if isinstance(module, nn.LayerNorm):
            return True
    return False


def trainer_parameter_groups(model: nn.Module) -> tuple[list[str], list[str]]:
    """The names of the parameters in the two param groups a `transformers.Trainer` builds
    (transformers 5.x): (with weight decay, without), each in `model.named_parameters()`
    order, trainable parameters only.

    Without weight decay: every parameter of an nn.LayerNorm (subclasses included, found by
    type whatever its name) and every parameter whose lower-cased name contains 'bias',
    'layernorm' or 'rmsnorm', or has a part 'norm' or ending in '_norm' ('model.norm.weight',
    'layers.0.attn_norm.weight'; not 'norm_gain'). An RMSNorm module is found by its name
    alone, as the Trainer finds it. The optimizer file records only the groups' sizes, so this
    rule is what maps its tensors to the model's parameters."""
    decay, rest = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lowered = name.lower()
        excluded = any(p.search(lowered) for p in _NO_DECAY_NAME_PATTERNS) or _under_layer_norm(model, name)
        (rest if excluded else decay).append(name)
    return decay, rest


# --- reading a checkpoint folder ----------------------------------------------------------------


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:200] if text else type(err).__name__


def _check_folder(folder: Path, check_weights: bool) -> None:
    """InputError naming the folder unless it holds the files a Trainer checkpoint's optimizer needs."""
    if not folder.is_dir():
        raise InputError(f"{folder}: {'not a folder' if folder.exists() else 'no such folder'}")
    required = [OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE]
    if check_weights and not (folder / WEIGHTS_INDEX_FILE).is_file():
        required.append(WEIGHTS_FILE)
    missing = [name for name in required if not (folder / name).is_file()]
    if not missing:
        return
    inner = sorted(p.name for p in folder.glob("checkpoint-*") if (p / OPTIMIZER_FILE).is_file())
    shown = ", ".join(inner[:3]) + (", ..." if len(inner) > 3 else "")
    hint = (
        f"a Trainer's output folder: pass one of its checkpoints ({shown})"
        if inner
        else "not a transformers.Trainer checkpoint folder, or one saved with save_only_model=True"
    )
    raise InputError(f"{folder}: no {', '.join(missing)} ({hint})")


def _torch_file(path: Path) -> Any:
    # weights_only: these two files hold tensors and plain containers only; anything else is refused unread.
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError... for damaged files
        raise InputError(f"{path}: truncated or not a torch.save file of tensors ({_one_line(err)})") from None


def trainer_global_step(path: Path) -> int:
    """The global_step of a trainer_state.json; InputError naming it when it has none."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: not readable as JSON ({_one_line(err)})") from None
    step = state.get("global_step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InputError(f"{path}: no global_step (a non-negative integer); not a Trainer's trainer_state.json")
    return step


def _next_lrs(path: Path, groups: int) -> list[float]:
    """The learning rate of every param group's next update: the scheduler's `_last_lr`. The
    Trainer steps the scheduler right after each optimizer step, so at a checkpoint it holds
    the rate of the update to come; the last 'learning_rate' in trainer_state.json's log is
    the one the update before the checkpoint used."""
    state = _torch_file(path)
    lrs = state.get("_last_lr") if isinstance(state, dict) else None
    if not isinstance(lrs, (list, tuple)) or len(lrs) != groups:
        got = f"{len(lrs)} learning rates" if isinstance(lrs, (list, tuple)) else "no _last_lr"
        raise InputError(f"{path}: {got}, the optimizer has {groups} param groups; not a torch LR scheduler's state")
    values = [float(lr) for lr in lrs]
    if not all(math.isfinite(lr) and lr >= 0 for lr in values):
        raise InputError(f"{path}: learning rates {values}; each must be finite and >= 0")
    return values


def _optimizer_name(group: dict, entry: dict | None) -> str | None:
    """A name for the optimizer whose state this is, when it is not torch's Adam/AdamW; None when it is."""
    if all(key in group for key in _ADAM_GROUP_KEYS) and (entry is None or all(k in entry for k in _ADAM_STATE_KEYS)):
        return None
    signatures = (
        ("Adafactor", ("scale_parameter", "relative_step")),
        ("SGD", ("momentum", "dampening", "nesterov")),
        ("Adagrad", ("lr_decay", "initial_accumulator_value")),
        ("RMSprop", ("alpha", "centered")),
        ("a bitsandbytes optimizer", ("optim_bits",)),
    )
    for name, keys in signatures:
        if all(key in group for key in keys):
            return name
    settings = ", ".join(sorted(key for key in group if key != "params"))
    return f"an optimizer with param-group settings {settings}" + (
        f" and per-parameter state {', '.join(sorted(entry))}" if entry else ""
    )


def _state_tensor(path: Path, name: str, key: str, value: Any, param: Tensor) -> Tensor:
    """One saved moment of `param`, checked, on the parameter's device and in its dtype (as torch's
    own load_state_dict casts them)."""
    if not torch.is_tensor(value) or not value.is_floating_point():
        raise InputError(f"{path}: the {key} of {name} is not a floating-point tensor")
    if value.shape != param.shape:
        raise InputError(
            f"{path}: the {key} of {name} has shape {list(value.shape)}, the model's parameter {list(param.shape)} "
            "(a checkpoint of another model)"
        )
    if not bool(torch.isfinite(value).all()):
        raise InputError(f"{path}: the {key} of {name} holds non-finite values (NaN or inf)")
    return value.to(device=param.device, dtype=param.dtype)


def _step_tensor(path: Path, name: str, value: Any) -> Tensor:
    step = float(value) if torch.is_tensor(value) and value.numel() == 1 else math.nan
    if not (math.isfinite(step) and step >= 0):
        raise InputError(f"{path}: the step count of {name} is not one finite non-negative number")
    # A plain (not capturable) Adam keeps its step count as a CPU float32 scalar, on any device.
    return torch.tensor(step, dtype=torch.float32)


def _check_weights(folder: Path, model: nn.Module) -> None:
    """InputError unless the model's parameters are the checkpoint's weights (the model loaded
    from this folder): a state rebuilt onto other weights would diagnose a step nobody took."""
    index = folder / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise InputError(f"{index}: not a safetensors index ({_one_line(err)})") from None
        files = [folder / shard for shard in shards]
    else:
        files = [folder / WEIGHTS_FILE]
    params = dict(model.named_parameters())
    compared = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as weights:
                for key in weights.keys():
                    if key not in params:
                        continue  # a tied weight saved once, or a buffer
                    saved, param = weights.get_tensor(key), params[key].detach()
                    if saved.shape != param.shape or not torch.equal(saved.to(param.dtype), param.cpu()):
                        raise InputError(
                            f"{file}: the model's {key} differs from the checkpoint's; load the model from "
                            f"{folder} (from_pretrained), or pass check_weights=False for weights changed on purpose"
                        )
                    compared += 1
        except (SafetensorError, OSError) as err:
            raise InputError(f"{file}: not a readable safetensors file ({_one_line(err)})") from None
    if compared == 0:
        raise InputError(f"{folder}: none of the model's parameter names are in {', '.join(f.name for f in files)}")


def _saved_adam(path: Path) -> tuple[list[dict], dict]:
    """optimizer.pt's param groups and per-parameter state, once they are known to be torch
    Adam/AdamW's; any other optimizer is refused by name."""
    saved = _torch_file(path)
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)):
        raise InputError(f"{path}: not an optimizer state_dict (no 'state' and 'param_groups')")
    groups, state = saved.get("param_groups"), saved["state"]
    if not (
        isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    ):
        raise InputError(f"{path}: not an optimizer state_dict (its param_groups are no list of groups)")
    for group in groups:
        first = next((state[pid] for pid in group["params"] if pid in state), None)
        refused = _optimizer_name(group, first if isinstance(first, dict) else None)
        if refused is not None:
            raise InputError(
                f"{path}: the state of {refused}, which cannot be rebuilt; only a Trainer's "
                "optim='adamw_torch_fused' or 'adamw_torch' (torch's AdamW) can"
            )
    return groups, state


def _names_by_group(path: Path, groups: list[dict], model: nn.Module) -> tuple[list[str], list[str]]:
    """The model's parameter names for the saved groups' tensors, in order, once the counts agree."""
    if len(groups) != 2:
        raise InputError(
            f"{path}: {len(groups)} param groups, a Trainer's optimizer has 2 (weight decay, none); "
            "a Trainer with its own create_optimizer cannot be mapped onto the model's parameters"
        )
    names = trainer_parameter_groups(model)
    for index, (group, group_names, what) in enumerate(zip(groups, names, ("with", "without"))):
        if len(group["params"]) != len(group_names):
            raise InputError(
                f"{path}: param group {index} has {len(group['params'])} tensors, the model's trainable "
                f"parameters {what} weight decay are {len(group_names)} (a checkpoint of another model, or of a "
                "Trainer that grouped its parameters otherwise)"
            )
    return names


def trainer_checkpoint_optimizer(
    model: nn.Module, checkpoint_dir: str | Path, *, check_weights: bool = True
) -> CheckpointOptimizer:
    """The AdamW a `transformers.Trainer` saved in `checkpoint_dir` (a 'checkpoint-N' folder),
    rebuilt over `model`'s parameters with the state of the update after step N.

    Read: optimizer.pt (the moments and step counts, mapped onto the parameters by
    `trainer_parameter_groups`, checked against their count and shapes), scheduler.pt (the
    learning rate of the next update), trainer_state.json (global_step, for the label) and,
    with `check_weights`, model.safetensors (the model's parameters must equal it). Never
    read: rng_state.pth and training_args.bin, which need full unpickling.

    The Trainer's default optimizer (optim='adamw_torch_fused' on torch >= 2.8) is fused; the
    rebuilt one is a plain torch.optim.AdamW (fused=False, foreach chosen by torch), whose step
    the diagnostic's own Delta(g) reproduces bit for bit. The two agree to rounding (about
    1e-9 on fp32 weights), not to the bit. torch's `load_state_dict` would carry fused=True
    over from the file, so the state is set directly instead. An optimizer other than torch's
    AdamW/Adam (adafactor, SGD, bitsandbytes...) is refused, naming it."""
    folder = Path(checkpoint_dir)
    _check_folder(folder, check_weights)
    optimizer_path = folder / OPTIMIZER_FILE
    saved_groups, saved_state = _saved_adam(optimizer_path)
    names = _names_by_group(optimizer_path, saved_groups, model)
    lrs = _next_lrs(folder / SCHEDULER_FILE, len(saved_groups))
    global_step = trainer_global_step(folder / STATE_FILE)

    params = dict(model.named_parameters())
    groups = [
        {
            "params": [params[n] for n in group_names],
            "lr": lr,
            "betas": tuple(float(b) for b in group["betas"]),
            "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
            "amsgrad": bool(group["amsgrad"]),
            "maximize": bool(group.get("maximize", False)),
        }
        for group, group_names, lr in zip(saved_groups, names, lrs)
    ]
    # A file without the key predates torch's merged Adam/AdamW; the Trainer's torch optimizers are AdamW.
    decoupled = all(group.get("decoupled_weight_decay", True) for group in saved_groups)
    optimizer = (torch.optim.AdamW if decoupled else torch.optim.Adam)(groups, fused=False)
    for group, group_names in zip(saved_groups, names):
        required = _ADAM_STATE_KEYS + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        for pid, name in zip(group["params"], group_names):
            entry = saved_state.get(pid)
            if entry is None:
                continue  # never stepped (no gradient yet): torch starts its state afresh, as the Trainer would
            missing = [key for key in required if key not in entry] if isinstance(entry, dict) else list(required)
            if missing:
                raise InputError(f"{optimizer_path}: the state of {name} lacks {', '.join(missing)}")
            optimizer.state[params[name]] = {
                key: _step_tensor(optimizer_path, name, entry[key])
                if key == "step"
                else _state_tensor(optimizer_path, name, key, entry[key], params[name])
                for key in required
            }
    if check_weights:
        _check_weights(folder, model)
    return CheckpointOptimizer(
        model=model,
        optimizer=optimizer,
        lr=lrs[0],
        group_lrs=tuple(lrs),
        optimizer_state=TRAINER_CHECKPOINT,
        global_step=global_step,
    )


# --- a checkpoint without optimizer state -------------------------------------------------------


def settled_step_count(betas: tuple[float, float]) -> int:
    """A step count at which Adam's bias corrections are 1 to within e^-20 (about 2e-9):
    ceil(20 / (1 - max(beta1, beta2))), far above the 3 / (1 - beta2) below which the
    diagnostic warns (diag.arithmetic.engine.bias_correction_message)."""
    return math.ceil(20 / (1 - max(betas)))


def estimated_adam_optimizer(
    model: nn.Module,
    batches: Iterable[Tensor],
    gradient_fn: Callable[[Tensor], Sequence[Tensor]],
    *,
    lr: float,
    passes: int = 8,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> CheckpointOptimizer:
    """An AdamW for a checkpoint published without optimizer state, its second moments
    estimated at the checkpoint (docs/diagnostic.md, "Checkpoints without optimizer state").

    `gradient_fn(batch)` returns the training gradient on one batch, one tensor per trainable
    parameter of `model` in `model.named_parameters()` order, computed as the model family
    trains (its depth convention, loss, clipping, precision) and without changing the model.
    It runs on the first `passes` of `batches`, which should be batches of the training batch
    size that the diagnostic does not then use. Nothing is stepped. The state:

        exp_avg_sq = mean over the passes of g * g     (an estimate of E[g^2], which Adam's v tracks)
        exp_avg    = 0                                 (momentum is not estimated)
        step       = settled_step_count(betas)         (bias correction negligible)

    exp_avg is zero rather than the mean gradient: momentum averages gradients along the
    trajectory training took, which the gradients at one point do not recover, and a mean
    gradient would put the depth `gradient_fn` uses into the update of every depth compared;
    the counterfactual isolation subtracts most of what momentum contributes anyway.

    The param groups are the Trainer's (`trainer_parameter_groups`): `weight_decay` for the
    first, none for biases and normalisation weights. optimizer_state is
    'estimated-second-moments(N=passes)'."""
    if not (isinstance(passes, int) and passes >= 1):
        raise InputError(f"passes must be a positive integer, got {passes!r}")
    if not (math.isfinite(lr) and lr > 0):
        raise InputError(f"lr must be a positive number, got {lr!r}")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise InputError(f"betas must be two numbers in [0, 1), got {betas!r}")
    decay, rest = trainer_parameter_groups(model)
    params = dict(model.named_parameters())
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    sums = {name: torch.zeros_like(params[name], dtype=torch.float32) for name in trainable}
    done = 0
    for batch in batches:
        if done == passes:
            break
        grads = list(gradient_fn(batch))
        if len(grads) != len(trainable):
            raise InputError(
                f"gradient_fn returned {len(grads)} gradients, the model has {len(trainable)} trainable parameters"
            )
        for name, grad in zip(trainable, grads):
            if not torch.is_tensor(grad) or grad.shape != params[name].shape:
                got = list(grad.shape) if torch.is_tensor(grad) else type(grad).__name__
                raise InputError(
                    f"gradient_fn's gradient of {name} is {got}, the parameter's shape {list(params[name].shape)}"
                )
            if not bool(torch.isfinite(grad).all()):
                raise InputError(f"gradient_fn's gradient of {name} on batch {done} holds non-finite values")
            grad = grad.detach().to(device=sums[name].device, dtype=torch.float32)
            sums[name].addcmul_(grad, grad)
        done += 1
    if done < passes:
        raise InputError(f"batches gave {done} batches, passes={passes} needs {passes}")

    optimizer = torch.optim.AdamW(
        [
            {"params": [params[n] for n in decay], "weight_decay": float(weight_decay)},
            {"params": [params[n] for n in rest], "weight_decay": 0.0},
        ],
        lr=float(lr),
        betas=tuple(float(b) for b in betas),
        eps=float(eps),
        fused=False,
    )
    step = float(settled_step_count(betas))
    for name in trainable:
        param = params[name]
        optimizer.state[param] = {
            "step": torch.tensor(step, dtype=torch.float32),
            "exp_avg": torch.zeros_like(param),
            "exp_avg_sq": (sums[name] / passes).to(param.dtype),
        }
    return CheckpointOptimizer(
        model=model,
        optimizer=optimizer,
        lr=float(lr),
        group_lrs=(float(lr), float(lr)),
        optimizer_state=f"estimated-second-moments(N={passes})",
    )
