"""The one grammar of depth lists on the command line: ranges ('1-16'), lists ('1,2,4,8')
and mixes of both ('1-4,8,16').

Two readings of it: `parse_serving_depths` (a set of depths to evaluate at: sorted,
distinct) and `parse_update_depths` (the compared update depths: in the order written,
no depth twice, as the first one is the reference). Bad input raises InputError
naming the option.

Both readings stop at MAX_SERVING_DEPTH (64) unless the caller passes another `limit`
(the commands' `--max-depth N`): a deeper update costs memory and time in proportion to
its depth, so a typo such as '4,160' is refused rather than run.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from common.errors import InputError

MAX_SERVING_DEPTH = 64
"""The deepest serving or update depth the command line accepts without `--max-depth`."""
UPDATE_DEPTHS = (4, 16)
"""The compared update depths by default: the paper's K = 4 (the reference) against K = 16."""
SERVING_DEPTHS = tuple(range(1, 17))
"""The serving depths the benefit is measured at by default: 1..16, the paper's."""


def checked_depths(values: Iterable[int], name: str, *, limit: int | None = None) -> tuple[int, ...]:
    """`values` as a tuple of int depths, in their order, refused (InputError naming `name`)
    unless every one is a positive integer (numpy's included, bools not), at most `limit`, and
    none repeats. The one check of a depth list given as numbers (the API, config files)."""
    depths = tuple(values)
    allowed = "positive integers" if limit is None else f"depths in 1..{limit}"
    for depth in depths:
        if isinstance(depth, bool) or not hasattr(type(depth), "__index__") or operator.index(depth) < 1:
            raise InputError(f"{name} must be {allowed}, got {depth!r}")
    depths = tuple(operator.index(depth) for depth in depths)
    if limit is not None and any(depth > limit for depth in depths):
        raise InputError(f"{name} must be {allowed}, got {list(depths)}")
    if len(set(depths)) != len(depths):
        raise InputError(f"{name} must not repeat a depth, got {list(depths)}")
    return depths


def depths_text(depths: Iterable[int]) -> str:
    """Depths as the command line writes them, runs of three or more as ranges: (4, 16) -> '4,16',
    1..16 -> '1-16'."""
    runs: list[list[int]] = []
    for depth in depths:
        if runs and depth == runs[-1][-1] + 1:
            runs[-1].append(depth)
        else:
            runs.append([depth])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ",".join(map(str, run)) for run in runs)


def _depths_in_order(text: str, option: str, limit: int | None) -> list[int]:
    """Every depth `text` names, ranges expanded, in the order written (repeats kept)."""
    depths: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise InputError(
                f"{option} {text!r}: expected depths like '1-16', '1,2,4,8' or both ('1-4,8,16')"
            ) from None
        highest = "" if limit is None else f" <= {limit}"
        if first < 1 or first > last:
            raise InputError(f"{option} {text!r}: need 1 <= depth{highest} and ranges low-high with low <= high")
        if limit is not None and last > limit:
            raise InputError(
                f"{option} {text!r}: depth {last} is above the maximum: need 1 <= depth <= {limit} "
                "(--max-depth N allows deeper)"
            )
        depths.extend(range(first, last + 1))
    return depths


def parse_serving_depths(
    text: str, option: str = "--serving", *, limit: int | None = MAX_SERVING_DEPTH
) -> tuple[int, ...]:
    """'1-16', '1,2,4,8' or a mix ('1-4,8,16') -> sorted distinct depths in 1..limit."""
    return tuple(sorted(set(_depths_in_order(text, option, limit))))


def parse_update_depths(
    text: str, option: str = "--update-depths", *, limit: int | None = MAX_SERVING_DEPTH
) -> tuple[int, ...]:
    """'4,16' or a mix with ranges such as '4,1-2' -> depths in the order written (the order
    matters: the first is the reference) in 1..limit; a depth named twice is an error."""
    depths = _depths_in_order(text, option, limit)
    repeated = sorted({depth for depth in depths if depths.count(depth) > 1})
    if repeated:
        raise InputError(f"{option} {text!r}: names depth {', '.join(map(str, repeated))} more than once")
    return tuple(depths)
