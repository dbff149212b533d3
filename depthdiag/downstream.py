"""`depthdiag lm-eval`: lm-evaluation-harness tasks at every serving depth of one checkpoint.

The checkpoint is wrapped once (trainer/export/lm_harness.py) with all the serving depths; lm-eval's
`evaluate` then runs the task list once per depth. The first run scores every
request at every depth from one pass of max(depths) core iterations per request batch;
the later runs find every request scored and only apply the task's metrics, so the
whole grid costs about one evaluation at the deepest depth (generation tasks excepted:
greedy decoding differs per depth). The tasks, few-shot examples and document order are
the same in every run (lm-eval's fixed seeds), which is what lets the scores be reused.

With exit rules (`--exit kl:5e-4`), the same first run also scores every request with real
per-token exit, one forward per rule and request batch, and lm-eval's `evaluate` runs once more
per rule.

The result is a Dataset over (task, serving_depth), and (task, exit) for the exit rules, in the
schema of analysis/downstream.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from analysis.downstream import downstream_dataset
from common.errors import EXIT_BAD_INPUT, InputError
from common.progress import progress_bar
from common.provenance import package_version
from diag.sources.hf import HfInput, read_hf_config, served_hf_model
from trainer.distributed import resolve_device


@dataclass(frozen=True)
class DownstreamConfig:
    checkpoint: Path | None
    """A checkpoint or snapshot file (trainer/checkpoint.py); None with `hf`."""
    tasks: tuple[str, ...]
    """lm-eval task, group or tag names."""
    serving_depths: tuple[int, ...]
    """The depths every task is evaluated at."""
    exits: tuple[str, ...] = ()
    """Exit rules (CRITERION:THRESHOLD, e.g. kl:5e-4) every task is also evaluated at: each token
    served with real per-token exit, at most the deepest serving depth (log-likelihood tasks)."""
    hf: HfInput | None = None
    """A Hugging Face model folder instead of `checkpoint`, served as its model family serves (diag/sources/hf.py)."""
    include_path: Path | None = None
    """A folder of task YAML files besides lm-eval's own (its --include_path)."""
    limit: int | float | None = None
    """Documents per task: a count, or a fraction of each task below 1 (None: all)."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt (None: each task's default, 0 for most)."""
    tokenizer: Path | None = None
    """A tokenizers file over the checkpoint's own tokenizer (trainer/export/lm_harness.py)."""
    batch_size: int = 32
    """Sequences per forward pass."""
    device: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (self.hf is None):
            raise InputError("give CHECKPOINT or --hf DIR (a Hugging Face model folder), one of them")
        if not self.tasks or any(not task for task in self.tasks):
            raise InputError(f"--tasks {','.join(self.tasks)!r}: expected task names separated by commas")
        repeated = sorted({task for task in self.tasks if self.tasks.count(task) > 1})
        if repeated:
            raise InputError(f"--tasks names {', '.join(repeated)} more than once")
        if not self.serving_depths:
            raise InputError("no serving depths given")
        from trainer.exits import exit_rule

        object.__setattr__(self, "exits", tuple(dict.fromkeys(self.exits)))
        for spec in self.exits:
            exit_rule(spec)  # a bad rule is refused before anything loads
        if self.limit is not None:
            limit = self.limit
            if not math.isfinite(limit) or limit <= 0 or (limit >= 1 and limit != int(limit)):
                raise InputError(f"--limit {limit}: a number of documents (1, 2, ...) or a fraction below 1")
            object.__setattr__(self, "limit", int(limit) if limit >= 1 else float(limit))


def parse_tasks(text: str) -> tuple[str, ...]:
    """'hellaswag,piqa, arc_easy' -> ('hellaswag', 'piqa', 'arc_easy')."""
    return tuple(part.strip() for part in text.split(","))


def require_harness() -> None:
    """InputError naming the eval extra unless lm-eval can be imported."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        from trainer.data.text_tokens import eval_extra_missing

        raise eval_extra_missing("lm-eval") from None


def task_manager(include_path: Path | None, tasks: Sequence[str] = ()):
    """lm-eval's TaskManager over its own tasks and those under `include_path`. When every one
    of `tasks` is a task (not a group) defined under `include_path`, lm-eval's own 14,000 task
    files are left unindexed (half a minute of parsing); `include_path`'s tasks take precedence
    over lm-eval's of the same name either way."""
    from lm_eval.tasks import TaskManager

    if include_path is None:
        return TaskManager()
    if not include_path.is_dir():
        raise InputError(f"{include_path}: --include-path is not a folder of task files")
    local = TaskManager(include_path=str(include_path), include_defaults=False)
    if tasks and all(task in local.all_subtasks for task in tasks):
        return local
    return TaskManager(include_path=str(include_path))


def check_tasks(manager, tasks: Sequence[str], include_path: Path | None) -> None:
    """InputError naming the tasks lm-eval does not know, before anything is evaluated."""
    known = set(manager.all_tasks)
    unknown = [task for task in tasks if task not in known]
    if unknown:
        where = f"lm-eval's tasks or {include_path}" if include_path is not None else "lm-eval's tasks"
        hint = "" if include_path is not None else "; tasks in local YAML files need --include-path DIR"
        raise InputError(f"--tasks: unknown task(s) {', '.join(unknown)} (not in {where}){hint}")


def chance_accuracy(loaded: dict, limit: int | float | None) -> dict[str, float]:
    """Per multiple-choice task of lm-eval's `loaded` tasks, the accuracy of guessing uniformly:
    the mean over the documents evaluated (the first `limit` of them) of 1 / their number of choices."""
    from lm_eval.evaluator_utils import get_sample_size

    chance = {}
    for name, task in loaded["tasks"].items():
        if task.OUTPUT_TYPE != "multiple_choice":
            continue
        docs = list(task.eval_docs)
        count = get_sample_size(task, limit)
        docs = docs[:count] if count is not None else docs
        if docs:
            chance[name] = sum(1.0 / len(task.doc_to_choice(doc)) for doc in docs) / len(docs)
    return chance


def load_tasks(manager, tasks: Sequence[str], num_fewshot: int | None) -> dict:
    """lm-eval's tasks with their few-shot count set as `simple_evaluate` sets it (`num_fewshot`
    unless a task fixes 0; a task's own count, else 0, without it)."""
    loaded = manager.load(list(tasks))
    for task in loaded["tasks"].values():
        own = task.get_config("num_fewshot")
        if num_fewshot is not None and own != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif own is None:
            task.set_config(key="num_fewshot", value=0)
    return loaded


def evaluate_once(model, loaded: dict, limit: int | float | None) -> dict:
    """lm-eval's results of `loaded` tasks for `model` at its current depth. The seeds
    `simple_evaluate` sets by default are set anew before every run, so every run builds the
    same prompts and few-shot examples (and needs no forward the first run did not make);
    `evaluate` is called directly, without `simple_evaluate`'s environment report (seconds per call)."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.evaluator import evaluate

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    for task in loaded["tasks"].values():
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    return evaluate(lm=model, task_dict=loaded, limit=limit, log_samples=False)


def evaluate_downstream(config: DownstreamConfig) -> xr.Dataset:
    """Run `config.tasks` at every serving depth of `config.checkpoint`; see the module docstring."""
    require_harness()
    from trainer.export.lm_harness import DepthdiagLM

    manager = task_manager(config.include_path, config.tasks)
    check_tasks(manager, config.tasks, config.include_path)
    loaded = load_tasks(manager, config.tasks, config.num_fewshot)
    generating = [name for name, task in loaded["tasks"].items() if task.OUTPUT_TYPE == "generate_until"]
    if config.exits and generating:
        raise InputError(
            f"--exit: scores log-likelihood tasks only; {', '.join(generating)} generate text "
            "(evaluate them without --exit)"
        )
    device = resolve_device(config.device)
    served = None if config.hf is None else served_hf_model(config.hf, config.tokenizer, device)
    model = DepthdiagLM(
        config.checkpoint,
        served=served,
        depths=config.serving_depths,
        exits=config.exits,
        tokenizer=config.tokenizer,
        batch_size=config.batch_size,
        device=str(device),
        progress=config.progress,
    )
    started = time.time()
    per_depth: dict[int, dict] = {}
    first: dict = {}
    with progress_bar(len(config.serving_depths), "lm-eval serving depths", "depth", enabled=config.progress) as bar:
        for depth in config.serving_depths:
            model.set_depth(depth)
            results = evaluate_once(model, loaded, config.limit)
            per_depth[depth] = results["results"]
            first = first or results
            bar.update(1)
            bar.set_postfix_str(_headline(results["results"], depth))
    per_exit: dict[str, dict] = {}
    for spec in config.exits:
        model.set_depth(spec)
        per_exit[spec] = evaluate_once(model, loaded, config.limit)["results"]
    snapshot = model.snapshot
    if snapshot is None:
        source = {**model.served.info, "config": json.dumps(read_hf_config(config.hf.folder), sort_keys=True)}
    else:
        source = {
            "checkpoint": str(snapshot.path),
            "checkpoint_sha256": snapshot.sha256,
            "step": snapshot.step,
            "uniform_updates": snapshot.uniform_updates,
            "config": snapshot.config.to_json(),
        }
    attrs = {
        **source,
        "tokenizer": model.tokenizer.name,
        "lm_eval_version": metadata.version("lm_eval"),
        "task_versions": json.dumps(first.get("versions", {}), sort_keys=True, default=str),
        "task_configs": json.dumps(first.get("configs", {}), sort_keys=True, default=str),
        "n_shot": json.dumps(first.get("n-shot", {}), sort_keys=True),
        "limit": "none" if config.limit is None else config.limit,
        "tasks": ",".join(config.tasks),
        "forward_passes": model.forward_passes,
        "exit_forward_passes": model.exit_forward_passes,
        "eval_seconds": round(time.time() - started, 3),
        "settings": json.dumps(
            {key: str(value) for key, value in dataclasses.asdict(config).items() if key != "progress"}, sort_keys=True
        ),
        "torch_version": str(torch.__version__),
        "depthdiag_version": package_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    n_samples = {task: int(count.get("effective", 0)) for task, count in first.get("n-samples", {}).items()}
    n_shot = {task: int(value) for task, value in first.get("n-shot", {}).items()}
    return downstream_dataset(
        per_depth,
        chance=chance_accuracy(loaded, config.limit),
        n_samples=n_samples,
        n_shot=n_shot,
        attrs=attrs,
        per_exit=per_exit,
        exit_depth={spec: model.mean_exit_depth(spec) for spec in config.exits},
    )


def _headline(results: dict, depth: int) -> str:
    """'depth 4: hellaswag acc 0.262, piqa acc 0.541' for the progress line."""
    parts = [f"{task} acc {metrics['acc,none']:.3f}" for task, metrics in results.items() if "acc,none" in metrics]
    return f"depth {depth}: " + ", ".join(parts)


def harness_main(argv: Sequence[str] | None = None) -> None:
    """`depthdiag-lm-eval ARGS`: lm-eval's own command line (`lm_eval ARGS`) with the
    `depthdiag` model registered (trainer/export/lm_harness.py), e.g.

        depthdiag-lm-eval --model depthdiag --model_args checkpoint=runs/x/checkpoints/latest.pt,depth=8 \\
            --tasks hellaswag,piqa,arc_easy
    """
    try:
        require_harness()
        from lm_eval.__main__ import cli_evaluate

        import trainer.export.lm_harness  # noqa: F401 (registers the model)

        if argv is not None:
            sys.argv = [sys.argv[0], *argv]
        cli_evaluate()
    except InputError as err:
        print(f"depthdiag-lm-eval: error: {err}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    harness_main()
