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

from common.errors import InputError

MAX_SERVING_DEPTH = 64
"""The deepest serving or update depth the command line accepts without `--max-depth`."""


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
