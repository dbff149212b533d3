"""Options several commands share."""

from __future__ import annotations

import functools

import click

from common.choices import (
    DEVICE_CHOICES,
    INTERVAL_METHOD_CHOICES,
    RESAMPLES_RANGE,
)
from common.depths import MAX_SERVING_DEPTH, SERVING_DEPTHS, depths_text


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
