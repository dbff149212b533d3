"""Reading a snapshot folder that `diag.save_snapshot` (diag/sources/snapshot_folder.py, which holds
the format) wrote: `read_snapshot_folder` checks snapshot.json, `SnapshotFolder.load` and
`load_snapshot_folder` rebuild the AdaptedModel `depthdiag diagnose` runs, to the bit. Nothing is
unpickled: the tensors come from safetensors, the rest from JSON.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn as nn
from safetensors import SafetensorError
from torch import Tensor

from common.errors import InputError, unreachable_input
from common.imports import one_line
from common.outputs import json_file
from diag.arithmetic.families import ModelFamily, resolve_family
from diag.sources.adapter import AdaptedModel
from diag.sources.snapshot_folder import (
    DOCUMENT,
    FORMAT_VERSION,
    KIND,
    MODEL_CONFIG_FILE,
    MODEL_DIR,
    OPTIMIZER_FILE,
    OPTIMIZER_STATE,
    SOURCES,
    TOKEN_KEYS,
    TOKENS_FILE,
    WEIGHTS_FILE,
    builtin_optimizers,
    family_from_fields,
    model_factory,
    read_hyperparameter,
    tensor_record,
)
from trainer.model import LoopedTransformer, ModelConfig


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _valid_model_entry(entry: Any) -> bool:
    if not (isinstance(entry, dict) and entry.get("source") in SOURCES and isinstance(entry.get("class"), str)):
        return False
    tensors = entry.get("tensors")
    if not isinstance(tensors, dict) or not all(
        isinstance(t, dict) and {"dtype", "shape", "sha256"} <= set(t) for t in tensors.values()
    ):
        return False
    return entry["source"] != "factory" or (
        isinstance(entry.get("factory"), str) and isinstance(entry.get("factory_kwargs"), dict)
    )


def _valid_optimizer_entry(entry: Any) -> bool:
    if not (isinstance(entry, dict) and isinstance(entry.get("class"), str)):
        return False
    groups = entry.get("param_groups")
    return (
        isinstance(groups, list)
        and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(n, str) for n in g["params"])
            for g in groups
        )
        and isinstance(entry.get("scalar_state", {}), dict)
    )


_CHECKS = {
    "name": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "step": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
    "lr": (lambda v: v is None or (_is_number(v) and v > 0), "a positive number or null"),
    "depth_kwarg": (lambda v: isinstance(v, str), "a string"),
    "family": (
        lambda v: v is None or (isinstance(v, dict) and len(v) == 1 and set(v) <= {"fields", "import"}),
        'null, {"fields": {...}} or {"import": "MODULE:NAME"}',
    ),
    "grad_clip": (lambda v: v is None or (_is_number(v) and v > 0), "a positive number or null"),
    "precision": (lambda v: isinstance(v, str), "a string"),
    "model": (
        _valid_model_entry,
        f"an object with source ({', '.join(SOURCES)}), class, tensors (and factory, factory_kwargs)",
    ),
    "optimizer": (
        _valid_optimizer_entry,
        "an object with class and param_groups (each with params, a list of parameter names)",
    ),
    "tokens": (
        lambda v: isinstance(v, dict) and all(isinstance(shape, list) for shape in v.values()),
        "an object of the token tensors' shapes",
    ),
    "metadata": (lambda v: v is None or isinstance(v, dict), "an object or null"),
}
"""snapshot.json's keys (all required) and what each must be."""


@dataclass(frozen=True)
class SnapshotFolder:
    """A snapshot folder's snapshot.json, read and checked; `load` builds what it describes."""

    path: Path
    """The folder."""
    document: dict
    """snapshot.json, checked against `_CHECKS`."""

    @property
    def step(self) -> int:
        """Updates taken at the snapshot: the update diagnosed has index `step`."""
        return self.document["step"]

    @property
    def name(self) -> str:
        """The label along `snapshot` in results: the saved name, or the folder's."""
        return self.document["name"] or self.path.resolve().name

    def where(self, name: str = DOCUMENT) -> Path:
        """The folder's entry `name`, for messages and reading."""
        return self.path / name

    def settings(self) -> dict[str, Any]:
        """What snapshots diagnosed into one results file must share: the model (its class and
        every tensor's name, dtype and shape), how it is called, clipping and precision."""
        model = self.document["model"]
        return {
            "model class": model["class"],
            "model tensors": {key: (t["dtype"], t["shape"]) for key, t in model["tensors"].items()},
            "optimizer class": self.document["optimizer"]["class"],
            **{key: self.document[key] for key in ("depth_kwarg", "family", "grad_clip", "precision")},
        }

    def config_json(self) -> str:
        """What stands in a results file's `config` attribute: snapshot.json without the lists
        that grow with the model (its tensors, each group's parameter names)."""
        document = dict(self.document)
        document["model"] = {key: value for key, value in document["model"].items() if key != "tensors"}
        optimizer = document["optimizer"]
        document["optimizer"] = {
            "class": optimizer["class"],
            "param_groups": [
                {**{k: v for k, v in group.items() if k != "params"}, "parameters": len(group["params"])}
                for group in optimizer["param_groups"]
            ],
        }
        return json.dumps({"snapshot_folder": str(self.path), **document}, sort_keys=True)

    def load(self, *, trust_remote_code: bool = False, device: torch.device | str = "cpu") -> AdaptedModel:
        """The saved model (on `device`), its optimizer with the saved state, the tokens and the
        settings, as the AdaptedModel diagnose runs on; InputError naming the file for anything
        that is not as saved. `trust_remote_code` runs the code a Hugging Face model ships with."""
        device = torch.device(device)
        try:
            family = self._family()
            model = self._model(trust_remote_code, device)
            self._check_model(model)
            optimizer = self._optimizer(model)
            tokens = {key: tensor.to(device) for key, tensor in self._tokens().items()}
            return AdaptedModel(
                model=model,
                optimizer=optimizer,
                batches=tokens["batches"],
                eval_tokens=tokens["eval_tokens"],
                depth_kwarg=self.document["depth_kwarg"],
                family=family,
                lr=self.document["lr"],
                grad_clip=self.document["grad_clip"],
                name=self.name,
                precision=self.document["precision"],
                eval_mask=tokens.get("eval_mask"),
                optimizer_state=OPTIMIZER_STATE,
            )
        except InputError as err:
            message = str(err)
            named = message.startswith((f"{self.path}:", f"{self.path}{os.sep}"))
            raise InputError(message if named else f"{self.path}: {message}") from None

    def _family(self) -> ModelFamily | None:
        entry = self.document["family"]
        if entry is None:
            return None
        if "import" in entry:
            return resolve_family(str(entry["import"]))
        return family_from_fields(entry["fields"])

    def _model(self, trust_remote_code: bool, device: torch.device) -> nn.Module:
        entry, folder = self.document["model"], self.where(MODEL_DIR)
        if entry["source"] == "hf":
            from diag.sources.hf import load_hf_model

            return load_hf_model(folder, trust_remote_code=trust_remote_code, device=device)
        # Building a model draws its initial weights: from a fork of the RNG, so that loading
        # leaves the caller's random stream where it was.
        with torch.random.fork_rng(devices=[]):
            if entry["source"] == "depthdiag":
                config = json_file(folder / MODEL_CONFIG_FILE)
                if config is None or not isinstance(config.get("model"), dict):
                    raise InputError(f"{folder / MODEL_CONFIG_FILE}: no readable ModelConfig (an object under 'model')")
                model, built_by = LoopedTransformer(ModelConfig.from_dict(config["model"])), "its ModelConfig"
            else:
                model, built_by = self._factory_model(entry["factory"], entry["factory_kwargs"]), entry["factory"]
        weights = read_tensors(folder / WEIGHTS_FILE)
        expected = model.state_dict()
        missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
        wrong = [key for key in expected.keys() & weights.keys() if expected[key].shape != weights[key].shape]
        if missing or unexpected or wrong:
            what = "; ".join(
                f"{label} {', '.join(sorted(keys)[:3])}{' ...' if len(keys) > 3 else ''}"
                for label, keys in (("without", missing), ("not in the model:", unexpected), ("other shape:", wrong))
                if keys
            )
            raise InputError(f"{folder / WEIGHTS_FILE}: not the weights of the model {built_by} builds ({what})")
        model.load_state_dict(weights)
        return model.to(device)

    def _factory_model(self, spec: str, kwargs: dict) -> nn.Module:
        factory = model_factory(spec, kwargs)
        try:
            model = factory(**kwargs)
        except InputError as err:
            raise InputError(f"model_factory {spec}: {err}") from None
        if not isinstance(model, nn.Module):
            raise InputError(f"model_factory {spec}: returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    def _check_model(self, model: nn.Module) -> None:
        """InputError unless every tensor of the loaded model's state_dict is the one saved, to the bit."""
        saved, state = self.document["model"]["tensors"], model.state_dict()
        source = self.document["model"]
        hint = {
            "factory": f"does {source.get('factory')} build the model it built when the snapshot was saved?",
            "hf": "the model's code or transformers changed since the snapshot was saved",
            "depthdiag": "this depthdiag builds another model from its ModelConfig",
        }[source["source"]]
        if saved.keys() != state.keys():
            other = sorted(saved.keys() ^ state.keys())
            raise InputError(
                f"{self.where(MODEL_DIR)}: the loaded model's tensors are not the saved ones "
                f"({', '.join(other[:3])}{' ...' if len(other) > 3 else ''} in one and not the other; {hint})"
            )
        for key, tensor in state.items():
            record = tensor_record(tensor)
            if record != {k: saved[key][k] for k in ("dtype", "shape", "sha256")}:
                got = f"{record['dtype']} {record['shape']}"
                was = f"{saved[key]['dtype']} {saved[key]['shape']}"
                what = f"is {got}, saved as {was}" if got != was else "has other values than saved"
                raise InputError(f"{self.where(MODEL_DIR)}: the loaded model's {key} {what} ({hint})")

    def _optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer of the snapshot over `model`'s parameters, its state loaded with torch's
        own load_state_dict (which puts every state tensor on its parameter's device)."""
        entry, where = self.document["optimizer"], self.where()
        cls = builtin_optimizers()[entry["class"]]  # checked by read_snapshot_folder
        params = dict(model.named_parameters())
        names = [name for group in entry["param_groups"] for name in group["params"]]
        unknown = [name for name in names if name not in params]
        if unknown:
            raise InputError(f"{where}: the optimizer's param groups name {unknown[0]!r}, not a parameter of the model")
        if len(set(names)) != len(names):
            raise InputError(f"{where}: the optimizer's param groups name a parameter more than once")
        settings = [
            {key: read_hyperparameter(value) for key, value in group.items() if key != "params"}
            for group in entry["param_groups"]
        ]
        # The constructor gets the first group's settings as its defaults, as the optimizer saved
        # was most likely built; load_state_dict then sets every group's own.
        accepted = inspect.signature(cls).parameters
        defaults = {key: value for key, value in (settings[0] if settings else {}).items() if key in accepted}
        try:
            optimizer = cls(
                [{"params": [params[n] for n in group["params"]]} for group in entry["param_groups"]], **defaults
            )
        except (TypeError, ValueError, RuntimeError) as err:
            raise InputError(
                f"{where}: torch.optim.{cls.__name__} refuses the saved param groups ({one_line(err)})"
            ) from None
        index = {name: i for i, name in enumerate(names)}
        tensors = read_tensors(self.where(OPTIMIZER_FILE))
        state: dict[int, dict[str, Any]] = {}
        for key, tensor in tensors.items():
            state_key, _, name = key.partition("/")
            if name not in index:
                raise InputError(
                    f"{self.where(OPTIMIZER_FILE)}: {key!r} is not STATE_KEY/PARAMETER of a parameter in the "
                    "optimizer's param groups"
                )
            state.setdefault(index[name], {})[state_key] = tensor
        for name, values in entry.get("scalar_state", {}).items():
            if name not in index or not isinstance(values, dict):
                raise InputError(
                    f"{where}: the optimizer's scalar_state names {name!r}, not a parameter of its param groups"
                )
            state.setdefault(index[name], {}).update(values)
        groups = [
            {**group_settings, "params": [index[n] for n in group["params"]]}
            for group_settings, group in zip(settings, entry["param_groups"])
        ]
        try:
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (TypeError, ValueError, RuntimeError, KeyError) as err:
            raise InputError(f"{where}: the optimizer's state does not load ({one_line(err)})") from None
        for key, tensor in tensors.items():
            state_key, _, name = key.partition("/")
            loaded = optimizer.state[params[name]][state_key]
            if loaded.dtype != tensor.dtype:
                # load_state_dict casts a floating state to its parameter's dtype: not the state saved.
                raise InputError(
                    f"{self.where(OPTIMIZER_FILE)}: {key} is {tensor.dtype}, its parameter {params[name].dtype}"
                )
        return optimizer

    def _tokens(self) -> dict[str, Tensor]:
        path = self.where(TOKENS_FILE)
        tokens = read_tensors(path)
        unexpected = sorted(tokens.keys() - TOKEN_KEYS.keys())
        if unexpected:
            raise InputError(f"{path}: unexpected tensor {unexpected[0]!r} (it holds {', '.join(TOKEN_KEYS)})")
        for key, dtype in TOKEN_KEYS.items():
            if key not in tokens and key != "eval_mask":
                raise InputError(f"{path}: no {key!r} tensor")
            if key in tokens and tokens[key].dtype != dtype:
                raise InputError(f"{path}: {key!r} is {tokens[key].dtype}, it must be {dtype}")
        shapes = {key: list(tensor.shape) for key, tensor in tokens.items()}
        if shapes != self.document["tokens"]:
            raise InputError(f"{path}: tensors of shapes {shapes}, {DOCUMENT} says {self.document['tokens']}")
        return tokens


def read_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of the safetensors file `path` (on the CPU); InputError naming it otherwise."""
    if not path.is_file():
        raise unreachable_input(path)
    try:
        return safetensors.torch.load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise InputError(f"{path}: not a readable safetensors file ({one_line(err)})") from None


def read_snapshot_folder(path: str | os.PathLike) -> SnapshotFolder:
    """The snapshot folder `path`, its snapshot.json read and checked (nothing else is opened);
    InputError naming the file for anything that is not a snapshot folder of this format."""
    path = Path(path)
    if not path.is_dir():
        raise unreachable_input(path, "folder") if not path.exists() else InputError(f"{path}: not a folder")
    file = path / DOCUMENT
    if not file.is_file():
        hint = "; a Hugging Face model folder is diagnosed with --hf DIR" if (path / "config.json").is_file() else ""
        raise InputError(f"{path}: no {DOCUMENT}, so not a snapshot folder (diag.save_snapshot writes them){hint}")
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{file}: not readable JSON ({one_line(err)})") from None
    if not isinstance(document, dict) or document.get("kind") != KIND:
        raise InputError(f"{file}: not the {DOCUMENT} of a snapshot folder (its kind is not {KIND!r})")
    version = document.get("format_version")
    if version != FORMAT_VERSION:
        raise InputError(f"{file}: format_version {version!r}, this depthdiag reads format_version {FORMAT_VERSION}")
    for key, (valid, what) in _CHECKS.items():
        if key not in document:
            raise InputError(f"{file}: no {key!r}")
        if not valid(document[key]):
            raise InputError(f"{file}: {key!r} must be {what}")
    optimizer_class = document["optimizer"]["class"]
    if optimizer_class not in builtin_optimizers():
        raise InputError(
            f"{file}: optimizer class {optimizer_class!r} is not one of torch.optim's built-in optimizers "
            f"({', '.join(sorted(builtin_optimizers()))}), the only ones a snapshot folder rebuilds"
        )
    return SnapshotFolder(path=path, document=document)


def load_snapshot_folder(
    path: str | os.PathLike, *, trust_remote_code: bool = False, device: torch.device | str = "cpu"
) -> AdaptedModel:
    """The AdaptedModel of the snapshot folder `path` (save_snapshot's): what `depthdiag diagnose
    PATH` runs on, the model on `device`. `trust_remote_code` runs the code a Hugging Face
    model's folder ships with (its config.json's auto_map)."""
    return read_snapshot_folder(path).load(trust_remote_code=trust_remote_code, device=device)
