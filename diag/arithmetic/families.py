"""Model families: how the diagnostic calls one family of looped models.

Looped models are told their depth in different ways, and train in different ways. The
diagnostic needs two calls of a model's forward, and a family says what keywords they take
and where the logits are in what the forward returns:

    gradient at depth K     the forward as the family trains: every iteration with gradient
                            (full backprop), or the first K - n without and the last n with
                            (truncated backprop: the call says so with a pair, as Huginn trains
                            with n = 8, or the forward truncates by itself, as a `bptt_k`
                            setting of the model does)
    evaluation at depth s   the forward as the family serves, under torch.no_grad

Randomness needs nothing here: every forward of the diagnostic runs from a fixed random
stream (common random numbers, diag/arithmetic/engine.py), so a family that draws a random initial state
is compared fairly and reproducibly. `forward_kwargs` switches off anything else that would
make two forwards differ (a cache, a sampled depth). `logits_from` says where the logits are
in an output that is neither a tensor nor an object with `.logits` (a tuple (logits, state)).

Shipped families: DEPTHDIAG (this project's Hugging Face export: `num_steps`, full backprop)
and HUGINN (the Huginn convention: an integer `num_steps` runs every iteration without
gradient, so the gradient call passes the pair (K - n, n)). A family of your own is a
`ModelFamily` in any importable module, named as `--family MODULE:NAME` (or passed as
`family=` in Python); nothing in the package needs editing:

    # mypkg/families.py
    from diag.arithmetic.families import ModelFamily
    OURO = ModelFamily("ouro", depth_kwarg="n_loops", model_types=("ouro",))
    # forward(ids, num_recur=K) -> (logits, state), backprop through its last 4 iterations (bptt_k=4)
    LOOPED = ModelFamily("looped", depth_kwarg="num_recur", backprop_depth=4, logits_from=0)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from common.errors import InputError
from common.imports import import_named
from trainer.scoring import output_logits

LogitsFrom = int | str | Callable[[Any], Tensor]
"""Where a forward's output holds the logits: an index (of a tuple such as (logits, state)), a
key or attribute name, or a function of the output that returns them."""


def _described(value: Any) -> str:
    """A field's value in words that are the same in every process: a function by its module
    and name (its repr holds its address)."""
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return repr(value)


@dataclass(frozen=True)
class ModelFamily:
    """How to call one family of looped models for a gradient at depth K and an evaluation at
    depth s. Subclass it and override `gradient_call` / `eval_call` for a convention the fields
    cannot say."""

    name: str
    """Short name: `--family NAME`, and the `model_family` attribute of the results file."""
    depth_kwarg: str = "depth"
    """The forward's keyword that sets the number of loop iterations."""
    backprop_depth: int | None = None
    """None: the gradient at depth K flows through all K iterations (full backprop). n: only
    through the last min(n, K); the first K - n run without gradient (truncated backprop): with
    `pair_depth` the gradient call tells the forward so, without it the forward truncates by
    itself (a setting of the model, or a keyword in `forward_kwargs`) and the family records it."""
    pair_depth: bool = False
    """The gradient call passes the depth as the pair (iterations without gradient, iterations
    with gradient), Huginn's `num_steps` convention; False: as one int."""
    forward_kwargs: tuple[tuple[str, Any], ...] = ()
    """Keywords every forward also gets, e.g. (('use_cache', False),)."""
    model_types: tuple[str, ...] = ()
    """Hugging Face `config.model_type` values that are this family (how `--hf DIR` detects it)."""
    description: str = ""
    """One line for `--help` and the docs."""
    logits_from: LogitsFrom | None = None
    """Where the forward's output holds the logits [B, T, V]: an int index (a tuple such as
    (logits, state)), a str key or attribute name, or a function of the output returning them;
    None: the output itself, or its `.logits`."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in ":/ "):
            raise InputError(f"ModelFamily.name must be a short name (no ':', '/' or space), got {self.name!r}")
        if not isinstance(self.depth_kwarg, str) or not self.depth_kwarg.isidentifier():
            raise InputError(f"ModelFamily {self.name}: depth_kwarg must be a keyword name, got {self.depth_kwarg!r}")
        if self.backprop_depth is not None and not (isinstance(self.backprop_depth, int) and self.backprop_depth >= 1):
            raise InputError(
                f"ModelFamily {self.name}: backprop_depth must be >= 1 or None, got {self.backprop_depth!r}"
            )
        where = self.logits_from
        if not (where is None or (isinstance(where, (int, str)) and not isinstance(where, bool)) or callable(where)):
            raise InputError(
                f"ModelFamily {self.name}: logits_from must be an index, a key or attribute name, or a function "
                f"of the output, got {where!r}"
            )
        if where == "":
            raise InputError(f"ModelFamily {self.name}: logits_from must not be an empty name")
        object.__setattr__(self, "forward_kwargs", tuple((str(k), v) for k, v in dict(self.forward_kwargs).items()))
        if self.depth_kwarg in dict(self.forward_kwargs):
            raise InputError(
                f"ModelFamily {self.name}: forward_kwargs must not set the depth keyword {self.depth_kwarg}"
            )
        object.__setattr__(self, "model_types", tuple(self.model_types))

    def gradient_call(self, depth: int) -> dict[str, Any]:
        """The forward's keywords for the training loss at depth `depth`, as the family trains."""
        depth = int(depth)
        if not self.pair_depth:
            return {**dict(self.forward_kwargs), self.depth_kwarg: depth}
        with_grad = depth if self.backprop_depth is None else min(depth, self.backprop_depth)
        return {**dict(self.forward_kwargs), self.depth_kwarg: (depth - with_grad, with_grad)}

    def eval_call(self, depth: int) -> dict[str, Any]:
        """The forward's keywords for serving at depth `depth` (run under torch.no_grad)."""
        return {**dict(self.forward_kwargs), self.depth_kwarg: int(depth)}

    def full_gradient_call(self, depth: int) -> dict[str, Any] | None:
        """The forward's keywords for the evaluation at depth `depth` with gradient through every
        iteration (what the evaluation NLL's gradient needs): a pair-depth family's (0, depth);
        None for a forward that truncates backprop by itself, which a call cannot undo."""
        if self.pair_depth:
            return {**dict(self.forward_kwargs), self.depth_kwarg: (0, int(depth))}
        return None if self.backprop_depth is not None else self.eval_call(depth)

    def backprop_text(self) -> str:
        """How the gradient flows, for summaries and the results file."""
        if self.backprop_depth is None:
            return "full backprop"
        if self.pair_depth:
            return f"backprop through the last {self.backprop_depth} iterations"
        return f"backprop through the last {self.backprop_depth} iterations, truncated by the model's own forward"

    def identity(self) -> str:
        """The family's class and every field, the same in every process: what an adapter's
        fingerprint (diag/sources/adapter.py) holds, so that --resume sees a changed family."""
        values = ", ".join(f"{f.name}={_described(getattr(self, f.name))}" for f in fields(self))
        return f"{type(self).__module__}.{type(self).__qualname__}({values})"

    def logits(self, output: Any) -> Tensor:
        """The logits in a forward's `output`, where `logits_from` says; InputError naming the
        family and what the output is when they are not there."""
        where = self.logits_from
        if where is None:
            return output_logits(output)
        said = f"model family {self.name}: logits_from={_described(where)}"
        if callable(where):
            logits = where(output)
        elif isinstance(where, int):
            if torch.is_tensor(output):
                raise InputError(f"{said}, but the forward returned a tensor, not a tuple to index")
            try:
                logits = output[where]
            except (IndexError, KeyError, TypeError):
                raise InputError(f"{said}, but the forward returned a {type(output).__name__} without it") from None
        elif isinstance(output, Mapping) and where in output:
            logits = output[where]
        elif hasattr(output, where):
            logits = getattr(output, where)
        else:
            raise InputError(
                f"{said}, but the forward returned a {type(output).__name__} without that key or attribute"
            )
        if not torch.is_tensor(logits):
            raise InputError(f"{said} gives a {type(logits).__name__}, not a tensor of logits")
        return logits


def keyword_family(depth_kwarg: str) -> ModelFamily:
    """The plain convention: the depth as one int keyword, full backprop (an AdaptedModel's
    `depth_kwarg`, or `compare_updates(depth_kwarg=...)`)."""
    return ModelFamily(f"keyword-{depth_kwarg}", depth_kwarg=depth_kwarg)


DEPTHDIAG = ModelFamily(
    "depthdiag",
    depth_kwarg="num_steps",
    model_types=("depthdiag_looped",),
    description="depthdiag's own `export --format hf`: num_steps, full backprop, as it trained",
)
HUGINN = ModelFamily(
    "huginn",
    depth_kwarg="num_steps",
    pair_depth=True,
    backprop_depth=8,
    model_types=("huginn_raven",),
    description="the Huginn convention: num_steps, a pair (no-grad, with-grad) for training, "
    "backprop through the last 8 iterations, a random initial state",
)
SHIPPED = {family.name: family for family in (DEPTHDIAG, HUGINN)}
"""The families the package knows by name."""


def resolve_family(spec: str) -> ModelFamily:
    """A family by name (one of SHIPPED) or as MODULE:NAME, a ModelFamily in an importable
    module (the current directory first, as `python -m` has it)."""
    if spec in SHIPPED:
        return SHIPPED[spec]
    if ":" not in spec:
        raise InputError(
            f"--family {spec!r}: not a known family ({', '.join(SHIPPED)}) nor MODULE:NAME naming a diag.ModelFamily"
        )
    target = import_named(spec, "--family", "MODULE:NAME", "mypkg.families:OURO")
    if not isinstance(target, ModelFamily):
        raise InputError(
            f"--family {spec}: {spec.partition(':')[2]!r} is a {type(target).__name__}, not a diag.ModelFamily"
        )
    return target


def detect_family(model_type: str | None, where: str) -> ModelFamily:
    """The shipped family whose `model_types` holds `model_type`; InputError naming `where`
    (the folder) and the way out when none does."""
    for family in SHIPPED.values():
        if model_type in family.model_types:
            return family
    known = ", ".join(f"{f.name} ({', '.join(f.model_types)})" for f in SHIPPED.values())
    raise InputError(
        f"{where}: model_type {model_type!r} is no known model family [{known}]; say how to call it with "
        "--family NAME or --family MODULE:NAME (a diag.ModelFamily, docs/diagnostic.md)"
    )
