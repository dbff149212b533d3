"""Options several commands share."""

from __future__ import annotations

import functools

import click

from common.choices import (
    DEVICE_CHOICES,
    INTERVAL_METHOD_CHOICES,
    PRECISION_CHOICES,
    RESAMPLES_RANGE,
)
from common.depths import MAX_SERVING_DEPTH, SERVING_DEPTHS, depths_text
from common.errors import InputError


def stacked(*options):
    """One decorator that applies `options` as if they were written in this order above a command."""

    def apply(function):
        for option in reversed(options):
            function = option(function)
        return function

    return apply


serving_option = click.option(
    "--serving",
    default=depths_text(SERVING_DEPTHS),
    show_default=True,
    help=f"Serving depths: a range (1-16), a list (1,2,4,8) or both (1-4,8,16); at most {MAX_SERVING_DEPTH} "
    "unless --max-depth says otherwise.",
)
max_depth_option = click.option(
    "--max-depth",
    type=click.IntRange(min=1),
    default=MAX_SERVING_DEPTH,
    show_default=True,
    help="The deepest depth accepted in the depth lists (a guard against typos such as '4,160'); raise it on purpose.",
)
device_option = click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True)
no_progress_option = click.option("--no-progress", is_flag=True, help="No progress bar.")


def eval_batch_size_option(name: str):
    """The evaluation minibatch size, under the option name the command uses."""
    return click.option(
        name, type=click.IntRange(min=1), default=32, show_default=True, help="Evaluation sequences per forward pass."
    )


_interval_option_declarations = stacked(
    click.option("--level", type=float, default=0.95, show_default=True, help="Confidence level."),
    click.option(
        "--method",
        type=click.Choice(INTERVAL_METHOD_CHOICES),
        default="t",
        show_default=True,
        help="Student-t interval, or BCa bootstrap as a check.",
    ),
    click.option(
        "--resamples",
        "n_resamples",
        type=click.IntRange(*RESAMPLES_RANGE),
        default=9999,
        show_default=True,
        help=f"Bootstrap resamples (bca), {RESAMPLES_RANGE[0]} to {RESAMPLES_RANGE[1]:,}: fewer leave the interval's "
        "tails resting on a handful of resamples, more take over a gigabyte and seconds per interval.",
    ),
)


def interval_options(command):
    """--level, --method and --resamples, handed to `command` as one `options`
    (analysis.stats.IntervalOptions). Goes below `reports_errors`, which reports a bad level."""

    @functools.wraps(command)
    def with_options(*args, level: float, method: str, n_resamples: int, **kwargs):
        from analysis.stats import IntervalOptions

        return command(*args, options=IntervalOptions(level=level, method=method, n_resamples=n_resamples), **kwargs)

    return _interval_option_declarations(with_options)


fraction_option = click.option(
    "--fraction",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=0.05,
    show_default=True,
    help="The fraction of the switch benefit the finishing phase is measured against: where the benefit "
    "falls below it for good, and whether it is shown below it (the one-sided bound over seeds).",
)
"""--fraction of `summarize` and `machines`."""


_hf_model_declarations = (
    click.option(
        "--hf",
        "hf_folder",
        type=click.Path(file_okay=False),
        default=None,
        help="Instead of CHECKPOINT, a Hugging Face model folder (config.json and weights; for diagnose a "
        "transformers.Trainer checkpoint-N/ supplies the optimizer state too). docs/diagnostic.md.",
    ),
    click.option(
        "--family",
        default=None,
        metavar="NAME|MODULE:NAME",
        help="How to call the --hf model at a depth: depthdiag, huginn, or a diag.ModelFamily of "
        "your own [default: from config.json's model_type]. diagnose, exits: also in place of the family a "
        "snapshot folder's (or diagnose's --adapter's) model says.",
    ),
    click.option(
        "--trust-remote-code",
        is_flag=True,
        help="Run the model code that ships in the --hf folder (diagnose, exits: or with a snapshot folder's model).",
    ),
)
_hf_token_declarations = (
    click.option(
        "--data",
        type=click.Path(file_okay=False),
        default=None,
        help="With --hf: a prepare folder (train.bin, val.bin) giving the batches and the evaluation set.",
    ),
    click.option(
        "--seq-len", type=click.IntRange(min=1), default=256, show_default=True, help="With --hf: tokens per row."
    ),
    click.option(
        "--eval-sequences",
        type=click.IntRange(min=1),
        default=64,
        show_default=True,
        help="With --hf: rows of the evaluation set, evenly spaced windows of val.bin.",
    ),
)
_hf_training_declarations = (
    click.option(
        "--train-batch-size",
        type=click.IntRange(min=1),
        default=8,
        show_default=True,
        help="With --hf: rows per diagnosed batch (batch i is the data's batch for seed 0, step i).",
    ),
    click.option(
        "--estimate-optimizer",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="With --hf and no Trainer optimizer state: estimate Adam's second moments from N gradient passes "
        "(a labelled alternative, recorded in the results; docs/diagnostic.md). Needs --lr.",
    ),
    click.option(
        "--grad-clip",
        type=click.FloatRange(min=0),
        default=1.0,
        show_default=True,
        help="With --hf: clip the gradient's norm as training did (the Trainer's default; 0: none).",
    ),
    click.option(
        "--precision",
        type=click.Choice(PRECISION_CHOICES),
        default="fp32",
        show_default=True,
        help="With --hf: the gradients' precision, as the model trained.",
    ),
)


def hf_input_options(*, training: bool = False, tokens: bool = True, snapshot_folders: bool = False):
    """--hf DIR and what a model folder needs besides (its family, remote code; with `tokens` the
    token data; with `training` the batch size, optimizer alternative, clipping and precision of
    the gradients), handed to the command as one `hf`: a diag.sources.hf.HfInput, or None without --hf.
    With `snapshot_folders` the command also gets `trust_remote_code` and `family` of its own
    without --hf, for the model of a snapshot folder or an adapter (diagnose SNAPSHOT_DIR); with
    --hf they are False and None there, the folder's being in `hf`."""

    def decorate(command):
        @functools.wraps(command)
        def with_hf(*args, hf_folder, family, trust_remote_code, data=None, seq_len=0, eval_sequences=0, **kwargs):
            training_values = {
                key: kwargs.pop(key)
                for key in ("train_batch_size", "estimate_optimizer", "grad_clip", "precision")
                if key in kwargs
            }
            if hf_folder is None:
                given = ["--family"] if family is not None and not snapshot_folders else []
                given += ["--data"] if data is not None else []
                given += ["--trust-remote-code"] if trust_remote_code and not snapshot_folders else []
                given += ["--estimate-optimizer"] if training_values.get("estimate_optimizer") is not None else []
                if given:
                    raise InputError(f"{', '.join(given)}: only with --hf DIR (a Hugging Face model folder)")
                if snapshot_folders:
                    kwargs.update(trust_remote_code=trust_remote_code, family=family)
                return command(*args, hf=None, **kwargs)
            from diag.sources.hf import HfInput, TokenSpec

            token_spec = None
            if tokens:
                if data is None:
                    raise InputError(f"--hf {hf_folder}: give --data DIR, a prepare folder of the model's tokens")
                token_spec = TokenSpec(
                    data=data,
                    batch_size=training_values.get("train_batch_size", 8),
                    seq_len=seq_len,
                    eval_sequences=eval_sequences,
                )
            hf = HfInput(
                folder=hf_folder,
                tokens=token_spec,
                family=family,
                trust_remote_code=trust_remote_code,
                estimate_optimizer=training_values.get("estimate_optimizer"),
                grad_clip=training_values.get("grad_clip") or None,
                precision=training_values.get("precision", "fp32"),
            )
            if snapshot_folders:
                kwargs.update(trust_remote_code=False, family=None)
            return command(*args, hf=hf, **kwargs)

        declarations = (
            *_hf_model_declarations,
            *(_hf_token_declarations if tokens else ()),
            *(_hf_training_declarations if training else ()),
        )
        return stacked(*declarations)(with_hf)

    return decorate
