"""A depthdiag checkpoint as an lm-evaluation-harness model, registered as `depthdiag`.

    lm_eval model_args: checkpoint=PATH, depth=K (the serving depth), tokenizer=PATH (optional)

The wrapper answers lm-eval's three request types at serving depth `depth`:

- `loglikelihood` (what multiple-choice tasks such as hellaswag, piqa and arc_easy ask
  for) and `loglikelihood_rolling`: every distinct (context, continuation) token pair is
  scored at every depth in `depths` from ONE pass of max(depths) core iterations
  (`LoopedTransformer.logits_by_depth`) and kept, so answering the same requests at
  another of those depths costs no forward at all. `depthdiag lm-eval` relies on it to
  run a task list at serving depths 1..16 for the price of one 16-iteration pass per
  request batch.
- `generate_until`: greedy decoding at `depth`, one request at a time, the full window
  recomputed per token (the model keeps no key-value cache).

With `exits` (e.g. ["kl:5e-4"]: CRITERION:THRESHOLD, trainer/exits.py), the log-likelihoods are
also computed with real per-token exit (`forward_with_exit`: each token served at the first
iteration where the criterion fires, a stopped token frozen for the tokens after it, at most
the deepest of `depths`), one forward per rule and request batch; `set_depth("kl:5e-4")` then
answers at that adaptive depth, and `mean_exit_depth` says how deep the scored tokens went.

A context longer than the model's max_seq_len is truncated from the left, as lm-eval's
Hugging Face wrapper does: the last max_seq_len + 1 tokens of context + continuation are
kept. A continuation that alone is longer than the window has its first tokens dropped
from the score, with a warning.

Text becomes tokens as the checkpoint's data did (trainer/data/text_tokens.py): bytes for
`data.source = 'text'`, the Hugging Face `tokenizers` file named by the data folder's
meta.json ("tokenizer") for `bin`, or `tokenizer=PATH` over either.

lm-eval 0.4 finds models only in its own registry and offers other packages no hook
into it, so `lm_eval --model depthdiag` needs this module imported first: the
`depthdiag-lm-eval` command (depthdiag/downstream.py's `harness_main`) imports it and then runs
lm-eval's own command line with the arguments it was given.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from common.errors import InputError
from common.progress import progress_bar
from trainer.checkpoint import load_snapshot
from trainer.data.text_tokens import FileTokenizer, resolve_tokenizer
from trainer.distributed import resolve_device
from trainer.exits import ExitDecisions, exit_rule

MODEL_NAME = "depthdiag"
"""The name the wrapper is registered under (`lm_eval --model depthdiag`)."""

DEFAULT_BATCH_SIZE = 32
"""Sequences per forward pass when lm-eval passes none (or 'auto')."""
DEFAULT_MAX_GEN_TOKS = 256
"""Generated tokens per request when the task sets no max_gen_toks (lm-eval's default)."""

log = logging.getLogger(__name__)


# --- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    """A model from elsewhere (a Hugging Face folder, diag/sources/hf.py) for the wrapper to serve."""

    name: str
    """What it is called in messages (its folder)."""
    model: torch.nn.Module
    """Served at depth s as `model(input_ids, depth=s)` -> logits, with `model.logits_by_depth(ids, depths)`."""
    tokenizer: FileTokenizer
    """Its text tokenizer."""
    max_length: int
    """The longest input it takes."""
    info: dict
    """What lm-eval stores about it (get_model_info) and results files record."""


RequestKey = tuple[tuple[int, ...], tuple[int, ...]]
"""A log-likelihood request as (context token ids, continuation token ids)."""


@dataclass(frozen=True)
class _Row:
    """One scored sequence: the model input, its targets, and how many trailing targets to score."""

    inputs: list[int]
    targets: list[int]
    scored: int


@register_model(MODEL_NAME)
class DepthdiagLM(TemplateLM):
    """A depthdiag checkpoint or snapshot served at depth `depth` (see the module docstring).

    `depths`: the serving depths every log-likelihood is computed at from one pass (default:
    `depth` alone); `depth` may be changed afterwards to any of them (`set_depth`), and the
    requests answered before are then answered again without a forward. `exits`: exit rules
    (CRITERION:THRESHOLD) every log-likelihood is also computed at, served by `set_depth(rule)`.
    """

    def __init__(
        self,
        checkpoint: str | Path | None = None,
        depth: int | None = None,
        *,
        served: ServedModel | None = None,
        depths: Sequence[int] | None = None,
        exits: Sequence[str] = (),
        tokenizer: str | Path | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        progress: bool = True,
    ):
        super().__init__()
        if (checkpoint is None) == (served is None):
            raise InputError("give a checkpoint (model_args checkpoint=PATH) or a served model, one of them")
        if depth is None and not depths:
            raise InputError(f"{checkpoint or served.name}: give the serving depth (model_args depth=K)")
        wanted = sorted({int(d) for d in (depths or ())} | ({int(depth)} if depth is not None else set()))
        if wanted[0] < 1:
            raise InputError(f"serving depths must be >= 1, got {wanted}")
        self.depths = tuple(wanted)
        self._device = _device(device)
        self.served = served
        """The model from elsewhere served, or None for a checkpoint."""
        if served is None:
            snapshot = load_snapshot(checkpoint)
            self.snapshot = snapshot
            self.model = snapshot.model(self._device).eval()
            self.tokenizer = resolve_tokenizer(snapshot.config, tokenizer, snapshot.path)
            self._max_length = snapshot.config.model.max_seq_len
        else:
            self.snapshot = None
            self.model, self.tokenizer, self._max_length = served.model, served.tokenizer, served.max_length
        self.batch_size = _batch_size(batch_size)
        self.progress = progress
        self.exit_rules = {spec: exit_rule(spec) for spec in dict.fromkeys(exits)}
        """CRITERION:THRESHOLD -> (criterion, threshold): the adaptive depths served besides `depths`."""
        if self.exit_rules and not getattr(self.model, "serves_exits", True):
            raise InputError(
                f"{served.name}: its model family has no real per-token exit (forward_with_exit), so --exit cannot "
                "serve it; depthdiag's own checkpoints and export --format hf folders have one"
            )
        self.depth: int | str = int(depth) if depth is not None else self.depths[-1]
        self._scores: dict[RequestKey, dict[int | str, tuple[float, bool]]] = {}
        self._exit_depths: dict[RequestKey, dict[str, tuple[int, int]]] = {}
        self._served: dict[str, list[int]] = {spec: [0, 0] for spec in self.exit_rules}
        self.forward_passes = 0
        """One-pass forwards run so far (every requested depth read out of each); the exit rules'
        forwards, one per rule and request batch, are counted in `exit_forward_passes`."""
        self.exit_forward_passes = 0
        self._warned_truncation = False

    def set_depth(self, depth: int | str) -> None:
        """Answer from now on at serving depth `depth`, one of `depths`, or at the adaptive depth
        of one of `exits` (its CRITERION:THRESHOLD)."""
        if depth not in self.depths and depth not in self.exit_rules:
            computed = [*self.depths, *self.exit_rules]
            raise InputError(f"serving depth {depth} is not among the depths and exit rules computed ({computed})")
        self.depth = depth

    def mean_exit_depth(self, spec: str) -> float:
        """The mean depth at which the exit rule `spec` stopped the positions that predict the
        scored continuation tokens of the requests answered with it, pooled over all tasks (each
        request as often as lm-eval asked it); NaN before any."""
        total, tokens = self._served[spec]
        return total / tokens if tokens else float("nan")

    # lm-eval's interface -----------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.prefix_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int], **kwargs) -> str:
        return self.tokenizer.decode(tokens)

    def get_model_info(self) -> dict:
        """What lm-eval stores in its results' config about the model."""
        source = (
            dict(self.served.info)
            if self.snapshot is None
            else {"checkpoint": str(self.snapshot.path), "checkpoint_sha256": self.snapshot.sha256}
        )
        return {**source, "serving_depth": self.depth, "tokenizer": self.tokenizer.name}

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # Tokenizing is quick; the progress worth showing is the scoring's own bar.
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each ((context, continuation), context_ids, continuation_ids)
        at the current depth; pairs not seen before are scored at every depth first."""
        keys = [(tuple(context), tuple(continuation)) for _, context, continuation in requests]
        new = list(dict.fromkeys(key for key in keys if key not in self._scores))
        # Longest first, so a batch pads its rows to similar lengths.
        new.sort(key=lambda key: -min(len(key[0]) + len(key[1]), self.max_length + 1))
        batches = [new[i : i + self.batch_size] for i in range(0, len(new), self.batch_size)]
        if batches:
            depths = f"{self.depths[0]}-{self.depths[-1]}" if len(self.depths) > 1 else str(self.depths[0])
            with progress_bar(
                len(batches), f"log-likelihoods at depth(s) {depths}", "batch", enabled=self.progress
            ) as bar:
                for batch in batches:
                    self._score(batch)
                    bar.update(1)
        answers = []
        for (strings, _, _), key in zip(requests, keys):
            answer = self._scores[key][self.depth]
            if self.depth in self.exit_rules:
                total, tokens = self._exit_depths[key][self.depth]
                self._served[self.depth][0] += total
                self._served[self.depth][1] += tokens
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
            answers.append(answer)
        return answers

    def _row(self, context: tuple[int, ...], continuation: tuple[int, ...]) -> _Row:
        window = (context + continuation)[-(self.max_length + 1) :]
        inputs, targets = list(window[:-1]), list(window[1:])
        scored = min(len(continuation), len(targets))
        if scored < len(continuation) and not self._warned_truncation:
            self._warned_truncation = True
            log.warning(
                "a continuation of %d tokens is longer than the model's window (max_seq_len %d): "
                "its first tokens are left out of the log-likelihood",
                len(continuation),
                self.max_length,
            )
        return _Row(inputs, targets, scored)

    @torch.inference_mode()
    def _score(self, batch: list[RequestKey]) -> None:
        rows = [self._row(*key) for key in batch]
        width = max(len(row.inputs) for row in rows)
        # Right padding: causal attention keeps the padding out of every real position.
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row.inputs)] = torch.tensor(row.inputs)
        ids = ids.to(self._device)
        results: list[dict[int | str, tuple[float, bool]]] = [{} for _ in rows]
        self.forward_passes += 1
        for depth, logits in self.model.logits_by_depth(ids, self.depths):
            for result, answer in zip(results, _answers(logits, rows)):
                result[depth] = answer
        served: list[dict[str, tuple[int, int]]] = [{} for _ in rows]
        for spec, (criterion, threshold) in self.exit_rules.items():
            logits, exit_depth = self.model.forward_with_exit(ids, self.depths[-1], ExitDecisions(criterion, threshold))
            self.exit_forward_passes += 1
            for i, (row, answer) in enumerate(zip(rows, _answers(logits, rows))):
                results[i][spec] = answer
                end = len(row.inputs)
                served[i][spec] = (int(exit_depth[i, end - row.scored : end].sum()), row.scored)
        for key, result, depths in zip(batch, results, served):
            self._scores[key] = result
            self._exit_depths[key] = depths

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in disjoint windows of max_seq_len tokens each
        conditioned on the tokens before it (lm-eval's rolling windows)."""
        windows, counts = [], []
        for (text,) in [request.args for request in requests]:
            pieces = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            text_windows = [(None, *lm_utils.make_disjoint_window(piece)) for piece in pieces]
            windows.extend(text_windows)
            counts.append(len(text_windows))
        scores = self._loglikelihood_tokens(windows)
        totals, start = [], 0
        for request, count in zip(requests, counts):
            total = sum(log_likelihood for log_likelihood, _ in scores[start : start + count])
            start += count
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            totals.append(total)
        return totals

    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations at the current depth, cut before the first stop string."""
        outputs = []
        with progress_bar(len(requests), f"generating at depth {self.depth}", "request", enabled=self.progress) as bar:
            for request in requests:
                context, options = request.args
                text = self._generate(context, dict(options or {}))
                self.cache_hook.add_partial("generate_until", request.args, text)
                outputs.append(text)
                bar.update(1)
        return outputs

    def _generate(self, context: str, options: dict) -> str:
        if self.depth in self.exit_rules:
            raise InputError(f"exit rule {self.depth}: scores log-likelihood tasks only, not generation")
        until = options.pop("until", None) or []
        stops = [until] if isinstance(until, str) else list(until)
        max_tokens = int(options.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        if options.get("do_sample"):
            log.warning("depthdiag decodes greedily; do_sample and its settings are ignored")
        tokens = self.tok_encode(context) or [self.prefix_token_id]
        generated: list[int] = []
        text = ""
        for _ in range(max_tokens):
            window = torch.tensor([(tokens + generated)[-self.max_length :]], device=self._device)
            logits = self.model(window, depth=self.depth)[0, -1]
            generated.append(int(logits.argmax()))
            text = self.tok_decode(generated)
            cuts = [text.find(stop) for stop in stops if stop and stop in text]
            if cuts:
                return text[: min(cuts)]
        return text


def _answers(logits: torch.Tensor, rows: list[_Row]) -> list[tuple[float, bool]]:
    """(log-likelihood of its scored targets, whether each is the greedy choice) of every row,
    from logits [B, T, V] of the padded batch."""
    answers = []
    for i, row in enumerate(rows):
        end = len(row.inputs)
        log_probs = logits[i, end - row.scored : end].float().log_softmax(-1)
        targets = torch.tensor(row.targets[-row.scored :], device=log_probs.device)
        log_likelihood = log_probs.gather(-1, targets[:, None]).sum()
        answers.append((float(log_likelihood), bool((log_probs.argmax(-1) == targets).all())))
    return answers


def _device(device: str | None) -> torch.device:
    """lm-eval's --device (None, 'cpu', 'cuda', 'cuda:1', ...). lm-eval's command line passes
    'cuda:0' unless told otherwise, so a machine without CUDA runs on the CPU, as lm-eval's
    Hugging Face wrapper does."""
    if device is None or device == "auto":
        return resolve_device("auto")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s asked for, but no CUDA device is available: running on the CPU", device)
        return torch.device("cpu")
    return torch.device(device)


def _batch_size(value: int | str | None) -> int:
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH_SIZE
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise InputError(f"batch_size must be a positive integer or 'auto', got {value!r}") from None
    if size < 1:
        raise InputError(f"batch_size must be a positive integer or 'auto', got {value!r}")
    return size
