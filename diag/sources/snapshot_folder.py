"""Snapshots from any training loop: `diag.save_snapshot` writes a folder that `depthdiag
diagnose FOLDER` reads as it reads depthdiag's own snapshot files.

    diag.save_snapshot("snapshots/step-1200", model, optimizer, batches, eval_tokens,
                       step=1200, family=diag.HUGINN, grad_clip=1.0)

    depthdiag diagnose snapshots/step-1200 --out results.h5

The folder (docs/formats.md, "Snapshots from any training loop"):

    snapshot.json           everything that is not a tensor: the format, the step, the learning
                            rate, how to call the model at a depth, clipping and precision, the
                            optimizer's class and param groups (parameters by name, hyperparameters),
                            where the model comes from, the SHA-256 of every model tensor, provenance
    model/                  a Hugging Face model's save_pretrained folder; a depthdiag
                            LoopedTransformer's config.json and model.safetensors; any other
                            model's model.safetensors, loaded into what an importable factory builds
    optimizer.safetensors   the optimizer's per-parameter state, keyed STATE_KEY/PARAMETER_NAME
    tokens.safetensors      batches int64 [n, B, T+1], eval_tokens int64 [E, T+1], eval_mask bool [E, T]

diag/sources/snapshot_loading.py reads the folder back. Loading never unpickles anything: the tensors
come from safetensors, the rest from JSON. Code runs only where the snapshot names it: a model
factory MODULE:FUNCTION, a family MODULE:NAME, and the code of a Hugging Face model that ships
with it (with trust_remote_code). The loaded model and optimizer are the saved ones to the bit
(each of the model's tensors is checked against the SHA-256 recorded when it was saved), so
`diagnose` on the folder equals `diag.compare_updates` on the live model and optimizer it was
saved from.
"""

from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn as nn
from torch import Tensor

from common.atomic import atomic_directory, new_file_mode
from common.errors import InputError
from common.imports import import_named, one_line
from common.lock import claimed_outputs
from common.outputs import OutputKind, check_output, json_file, only_entries
from common.provenance import provenance
from diag.arithmetic.families import SHIPPED, ModelFamily, resolve_family
from diag.sources.adapter import AdaptedModel
from trainer.export.tensor_files import naming_write_errors, unshared_tensors
from trainer.machine import machine
from trainer.model import LoopedTransformer

FORMAT_VERSION = 1
"""Bumped whenever the meaning or layout of the folder changes; folders of another version are refused."""
KIND = "depthdiag-snapshot-folder"
"""snapshot.json's `kind`: what marks the folder as one save_snapshot wrote (and `force` may replace)."""

DOCUMENT = "snapshot.json"
MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.safetensors"
TOKENS_FILE = "tokens.safetensors"
ENTRIES = (DOCUMENT, MODEL_DIR, OPTIMIZER_FILE, TOKENS_FILE)
"""Everything save_snapshot writes in the folder."""
WEIGHTS_FILE = "model.safetensors"
"""The model's state_dict in model/ (the depthdiag and factory sources)."""
MODEL_CONFIG_FILE = "config.json"
"""The LoopedTransformer's ModelConfig in model/, as `depthdiag export` writes it: {"model": {...}}."""

SOURCES = ("hf", "depthdiag", "factory")
"""Where a loaded model comes from: transformers' from_pretrained, LoopedTransformer(ModelConfig), a factory."""
TOKEN_KEYS = {"batches": torch.int64, "eval_tokens": torch.int64, "eval_mask": torch.bool}
"""The tensors of tokens.safetensors and their dtypes (eval_mask optional)."""
OPTIMIZER_STATE = "snapshot-folder"
"""The results file's `optimizer_state` for a snapshot folder: the state the training loop had."""


def builtin_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    """torch.optim's own optimizer classes by name: the ones a folder can rebuild from JSON
    hyperparameters without running code of its own. Not LBFGS, whose step needs a closure that
    evaluates the loss again (the diagnostic takes one step without)."""
    return {
        name: value
        for name, value in vars(torch.optim).items()
        if isinstance(value, type)
        and issubclass(value, torch.optim.Optimizer)
        and value is not torch.optim.Optimizer
        and name != "LBFGS"
    }


def is_snapshot_folder(path: Path) -> bool:
    """A folder save_snapshot wrote: its entries alone, snapshot.json of this kind."""
    document = json_file(path / DOCUMENT) if path.is_dir() else None
    return document is not None and document.get("kind") == KIND and only_entries(path, ENTRIES)


SNAPSHOT_FOLDER = OutputKind(
    "snapshot folder", is_snapshot_folder, folder=True, existing_hint="pass force=True to replace it", entries=ENTRIES
)
"""What `save_snapshot(force=True)` may replace."""


# --- values as JSON -----------------------------------------------------------------------------


def tensor_record(tensor: Tensor) -> dict[str, Any]:
    """dtype, shape and SHA-256 of the bytes of `tensor`: what the loaded model's tensor must match."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "sha256": hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest(),
    }


def _json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _hyperparameter(value: Any, what: str) -> Any:
    """A param group's setting as JSON: a scalar, or a tuple of scalars (betas) as an array."""
    if _json_scalar(value):
        return value
    if isinstance(value, (tuple, list)) and all(_json_scalar(item) for item in value):
        return list(value)
    raise InputError(
        f"{what} is a {type(value).__name__}; a snapshot folder stores hyperparameters as JSON numbers, "
        "strings, bools or tuples of them (a tensor learning rate: pass a float)"
    )


def read_hyperparameter(value: Any) -> Any:
    # JSON has no tuples: every array of a param group is one of torch's tuples (betas, etas, eps pairs).
    return tuple(value) if isinstance(value, list) else value


def _family_record(family: ModelFamily | str | None) -> tuple[ModelFamily | None, dict | None]:
    """(the family object, how snapshot.json records it). A plain ModelFamily is recorded by its
    fields, so it loads without importing anything; a subclass (its own gradient_call or
    eval_call) or a family whose logits_from is a function only by the MODULE:NAME it was named as."""
    if family is None:
        return None, None
    spec = family if isinstance(family, str) else None
    if spec is not None:
        family = resolve_family(spec)
    if not isinstance(family, ModelFamily):
        raise InputError(f"family must be a diag.ModelFamily, a name or MODULE:NAME, got {family!r}")
    if type(family) is not ModelFamily:
        holds_code = f"a {type(family).__name__}, a subclass of ModelFamily"
    elif callable(family.logits_from):
        holds_code = "a family whose logits_from is a function"
    else:
        holds_code = None
    if holds_code is not None:
        if spec is None:
            raise InputError(
                f"family {family.name!r} is {holds_code}, which a snapshot folder can name but not store: "
                "pass it as family='MODULE:NAME'"
            )
        return family, {"import": spec}
    record = json.loads(json.dumps(asdict(family)))
    if family_from_fields(record) != family:
        raise InputError(
            f"family {family.name!r}: its forward_kwargs are not JSON values (str, numbers, bools, None), "
            "so a snapshot folder cannot store them"
        )
    return family, {"fields": record}


def family_from_fields(record: dict) -> ModelFamily:
    known = {f.name for f in fields(ModelFamily)}
    if not isinstance(record, dict) or not {"name"} <= set(record) <= known:
        raise InputError(f"family fields must be an object of ModelFamily's fields ({', '.join(sorted(known))})")
    values = dict(record)
    try:
        values["forward_kwargs"] = tuple((key, value) for key, value in values.get("forward_kwargs", ()))
        values["model_types"] = tuple(values.get("model_types", ()))
    except (TypeError, ValueError):
        raise InputError("family fields: forward_kwargs must be [KEY, VALUE] pairs, model_types a list") from None
    family = ModelFamily(**values)
    shipped = SHIPPED.get(family.name)
    return shipped if shipped == family else family


# --- saving -------------------------------------------------------------------------------------


def model_factory(spec: str, kwargs: dict[str, Any]) -> Any:
    """The function `spec` ('MODULE:FUNCTION') names, once it is known to take `kwargs`."""
    factory = import_named(spec, "model_factory", "MODULE:FUNCTION", "mypkg.models:build")
    if not callable(factory):
        raise InputError(
            f"model_factory {spec}: {spec.partition(':')[2]!r} is a {type(factory).__name__}, not callable"
        )
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as err:
        raise InputError(f"model_factory {spec}: factory_kwargs do not fit its parameters ({err})") from None
    except ValueError:
        pass  # no readable signature: the call will tell
    return factory


def _is_hf_model(model: nn.Module) -> bool:
    """Whether `model` is a transformers.PreTrainedModel (looked up only if the caller imported
    transformers: a model of it cannot exist otherwise)."""
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    return pretrained is not None and isinstance(model, pretrained)


def _model_record(model: nn.Module, factory: str | None, factory_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where the loaded model will come from, checked now so that a folder that cannot load is never written."""
    record: dict[str, Any] = {"class": f"{type(model).__module__}.{type(model).__qualname__}"}
    if factory is not None:
        if factory.partition(":")[0] == "__main__":
            raise InputError(
                f"model_factory {factory}: a function of the running script cannot be imported by diagnose; "
                "put it in a module"
            )
        kwargs = dict(factory_kwargs or {})
        try:
            same = json.loads(json.dumps(kwargs)) == kwargs
        except (TypeError, ValueError):
            same = False
        if not same or not all(isinstance(key, str) for key in kwargs):
            raise InputError(
                "factory_kwargs must be JSON values keyed by strings (str, numbers, bools, None, lists, dicts), "
                "which the factory gets back as they are"
            )
        model_factory(factory, kwargs)  # importable, and takes these arguments
        return {"source": "factory", **record, "factory": factory, "factory_kwargs": kwargs}
    if factory_kwargs is not None:
        raise InputError("factory_kwargs needs model_factory, the function they are passed to")
    if type(model) is LoopedTransformer:
        return {"source": "depthdiag", **record}
    if _is_hf_model(model):
        built_in = type(model).__module__.startswith("transformers.")
        if not built_in and getattr(model, "_auto_class", None) is None:
            raise InputError(
                f"a {type(model).__name__} is a Hugging Face model of code outside transformers that is registered "
                "for no auto class, so its saved folder would not load; load it with "
                "AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True), call "
                f"{type(model).__name__}.register_for_auto_class('AutoModelForCausalLM'), or pass model_factory"
            )
        wide = sorted({str(t.dtype) for t in model.state_dict().values() if t.is_floating_point()} - {"torch.float32"})
        if wide:
            raise InputError(
                f"the Hugging Face model holds {', '.join(wide)} tensors; diagnose loads it in float32, which would "
                "not be the model saved: save it in float32 (model.float()), or pass model_factory"
            )
        return {"source": "hf", **record}
    raise InputError(
        f"a {type(model).__name__} is neither a depthdiag LoopedTransformer nor a Hugging Face PreTrainedModel; "
        "pass model_factory='MODULE:FUNCTION' (and factory_kwargs), a function that builds it again"
    )


def _optimizer_record(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, Tensor]]:
    """(snapshot.json's optimizer entry, optimizer.safetensors' tensors): `optimizer.state_dict()`
    with every parameter by its name in `model.named_parameters()` (a tied parameter by its
    first name, the one that lists it)."""
    cls = type(optimizer)
    if builtin_optimizers().get(cls.__name__) is not cls:
        inner = getattr(optimizer, "optimizer", None)
        hint = (
            f"; it wraps a torch.optim.{type(inner).__name__}: pass that (optimizer.optimizer)"
            if isinstance(inner, torch.optim.Optimizer)
            else ""
        )
        raise InputError(
            f"optimizer {cls.__module__}.{cls.__qualname__} is not one of torch.optim's built-in optimizers "
            f"(Adam, AdamW, SGD, ...; not LBFGS), the only ones a snapshot folder rebuilds without running code{hint}"
        )
    names_by_id = {id(p): name for name, p in model.named_parameters()}
    names = []
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        if id(p) not in names_by_id:
            raise InputError(
                "the optimizer holds a parameter that is not one of the model's (model.named_parameters())"
            )
        names.append(names_by_id[id(p)])
    saved = optimizer.state_dict()  # parameters as indices into the flat order of `names`
    groups = []
    for index, group in enumerate(saved["param_groups"]):
        # param_names (torch >= 2.6, an optimizer built from named_parameters) repeats `params`.
        settings = {
            key: _hyperparameter(value, f"param group {index}'s {key}")
            for key, value in group.items()
            if key not in ("params", "param_names")
        }
        groups.append({"params": [names[i] for i in group["params"]], **settings})
    tensors: dict[str, Tensor] = {}
    values: dict[str, dict[str, Any]] = {}
    for index, entry in saved["state"].items():
        name = names[index]
        for key, value in entry.items():
            if not isinstance(key, str) or "/" in key:
                raise InputError(
                    f"the optimizer's state of {name} has the key {key!r}; keys must be strings without '/'"
                )
            if torch.is_tensor(value):
                tensors[f"{key}/{name}"] = value
            elif _json_scalar(value) and not isinstance(value, str):
                values.setdefault(name, {})[key] = value
            else:
                raise InputError(
                    f"the optimizer's state {key} of {name} is a {type(value).__name__}, neither a tensor nor a number"
                )
    return {"class": cls.__name__, "param_groups": groups, "scalar_state": values}, unshared_tensors(tensors)


def _token_tensors(adapted: AdaptedModel) -> dict[str, Tensor]:
    shapes = {tuple(batch.shape) for batch in adapted.batches}
    if len(shapes) > 1:
        raise InputError(
            f"batches have shapes {', '.join(str(list(s)) for s in sorted(shapes))}; a snapshot folder stores "
            "batches of one shape [B, T+1]"
        )
    tensors = {
        "batches": torch.stack([batch.detach().to("cpu", torch.int64) for batch in adapted.batches]),
        "eval_tokens": adapted.eval_tokens.detach().to("cpu", torch.int64),
    }
    if adapted.eval_mask is not None:
        tensors["eval_mask"] = adapted.eval_mask.detach().cpu()
    return unshared_tensors(tensors)


def _hf_inputs(model: nn.Module) -> list[Path]:
    """The folder a Hugging Face model was loaded from, when it is on this machine: the snapshot
    must not be written over it (a snapshot's own model/ folder, say)."""
    source = getattr(getattr(model, "config", None), "_name_or_path", None)
    return [Path(source)] if isinstance(source, str) and source and Path(source).is_dir() else []


def save_snapshot(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Tensor] | Tensor,
    eval_tokens: Tensor,
    *,
    step: int,
    lr: float | None = None,
    family: ModelFamily | str | None = None,
    depth_kwarg: str | None = None,
    grad_clip: float | None = None,
    precision: str = "fp32",
    eval_mask: Tensor | None = None,
    model_factory: str | None = None,
    factory_kwargs: Mapping[str, Any] | None = None,
    name: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Path:
    """Write the state of a training loop's next update to the folder `path`, for `depthdiag
    diagnose PATH`; returns `path`. Call it after the optimizer (and the LR scheduler) stepped:
    the model, the optimizer with its state and each param group's learning rate are those of
    the update to diagnose, `step` the number of updates taken.

    The arguments are those of a diag.AdaptedModel (`batches` of one shape): `family` (a
    ModelFamily, a shipped name or MODULE:NAME) or `depth_kwarg` (default 'depth') says how
    the model takes its depth, `lr` overrides every group's rate (None: their own),
    `grad_clip` and `precision` are training's, `name` labels the snapshot in results (None:
    the folder's name). The model is a Hugging Face PreTrainedModel (saved with
    save_pretrained, in float32), a depthdiag LoopedTransformer, or anything `model_factory`
    ('MODULE:FUNCTION', called with the JSON `factory_kwargs`) builds again; the optimizer is
    one of torch.optim's own. `metadata` (JSON) is kept in snapshot.json for the user.

    The folder appears complete or not at all, under its lock. An existing one is replaced
    only with `force`, and only if save_snapshot wrote it; bad input is one InputError."""
    path = Path(path)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise InputError(f"{path}: step must be the number of updates taken (an int >= 0), got {step!r}")
    if family is not None and depth_kwarg is not None:
        raise InputError(f"{path}: give family or depth_kwarg, not both (a family names its depth keyword)")
    try:
        json.dumps(None if metadata is None else dict(metadata))
    except (TypeError, ValueError) as err:
        raise InputError(f"{path}: metadata must be JSON values ({one_line(err)})") from None
    try:
        family_object, family_entry = _family_record(family)
        adapted = AdaptedModel(
            model,
            optimizer,
            batches,
            eval_tokens,
            depth_kwarg=depth_kwarg or "depth",
            family=family_object,
            lr=lr,
            grad_clip=grad_clip,
            name=name if name is not None else path.resolve().name,
            precision=precision,
            eval_mask=eval_mask,
        )
        model_entry = _model_record(model, model_factory, factory_kwargs)
        optimizer_entry, optimizer_tensors = _optimizer_record(model, optimizer)
        tokens = _token_tensors(adapted)
    except InputError as err:
        raise InputError(f"{path}: {err}") from None
    inputs = _hf_inputs(model) if model_entry["source"] == "hf" else []
    check_output(path, kind=SNAPSHOT_FOLDER, inputs=inputs, force=force)
    state = model.state_dict()
    model_entry["tensors"] = {key: tensor_record(tensor) for key, tensor in state.items()}
    # save_pretrained writes a Hugging Face model's tensors itself; the others go to model.safetensors.
    weights = unshared_tensors(state) if model_entry["source"] != "hf" else {}
    document = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "name": name,
        "step": int(step),
        "lr": None if lr is None else float(lr),
        "depth_kwarg": adapted.depth_kwarg,
        "family": family_entry,
        "grad_clip": None if grad_clip is None else float(grad_clip),
        "precision": precision,
        "model": model_entry,
        "optimizer": optimizer_entry,
        "tokens": {key: list(tensor.shape) for key, tensor in tokens.items()},
        "provenance": {
            **provenance(),
            # The machine of the loop that saved it: what trained the model, as far as it knows.
            "machine": machine(next(model.parameters()).device.type),
            **(
                {"transformers_version": sys.modules["transformers"].__version__}
                if model_entry["source"] == "hf"
                else {}
            ),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
        "metadata": None if metadata is None else dict(metadata),
    }
    text = json.dumps(document, indent=1) + "\n"
    with claimed_outputs([path], kind=SNAPSHOT_FOLDER, inputs=inputs, force=force):
        with atomic_directory(path) as tmp:
            _write_model(tmp / MODEL_DIR, model, model_entry["source"], weights)
            for file, tensors in ((OPTIMIZER_FILE, optimizer_tensors), (TOKENS_FILE, tokens)):
                with naming_write_errors(path / file):
                    safetensors.torch.save_file(tensors, tmp / file)
            # Last: a folder is a snapshot once its document is there.
            with naming_write_errors(path / DOCUMENT):
                (tmp / DOCUMENT).write_text(text, encoding="utf-8")
            # safetensors creates its files private (0600); they should be as readable as the rest.
            for file in tmp.rglob("*"):
                if file.is_file():
                    os.chmod(file, new_file_mode())
    return path


def _write_model(folder: Path, model: nn.Module, source: str, weights: dict[str, Tensor]) -> None:
    if source == "hf":
        from transformers.utils import logging as transformers_logging

        # A training loop's snapshot needs no progress bar of the write.
        shown = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        try:
            with naming_write_errors(folder):
                model.save_pretrained(folder)
        finally:
            if shown:
                transformers_logging.enable_progress_bar()
        return
    folder.mkdir()
    if source == "depthdiag":
        text = json.dumps({"model": model.config.to_dict()}, indent=2, sort_keys=True) + "\n"
        (folder / MODEL_CONFIG_FILE).write_text(text, encoding="utf-8")
    with naming_write_errors(folder / WEIGHTS_FILE):
        safetensors.torch.save_file(weights, folder / WEIGHTS_FILE, metadata={"format": "pt"})
