"""The one depth-list grammar (common/depths.py) in both its readings."""

import numpy as np
import pytest

from common.depths import (
    MAX_SERVING_DEPTH,
    checked_depths,
    depths_text,
    parse_serving_depths,
    parse_update_depths,
)
from common.errors import InputError


def test_serving_depths_are_sorted_and_distinct():
    assert parse_serving_depths("1-16") == tuple(range(1, 17))
    assert parse_serving_depths("8,1,2,4") == (1, 2, 4, 8)
    assert parse_serving_depths("1-4, 8,16,3") == (1, 2, 3, 4, 8, 16)
    assert parse_serving_depths(f"1-{MAX_SERVING_DEPTH}")[-1] == MAX_SERVING_DEPTH


def test_update_depths_keep_the_order_written():
    assert parse_update_depths("16,4") == (16, 4)
    assert parse_update_depths("4,1-3") == (4, 1, 2, 3)
    assert parse_update_depths("4") == (4,)


@pytest.mark.parametrize("text", ["", "x", "1-", "-3", "0", "4-2", "1-2-3", "1.5"])
def test_both_readings_refuse_what_the_grammar_does_not_allow(text):
    with pytest.raises(InputError, match="--serving"):
        parse_serving_depths(text)
    with pytest.raises(InputError, match="--update-depths"):
        parse_update_depths(text)


def test_serving_depths_have_a_ceiling_and_update_depths_no_repeats():
    with pytest.raises(InputError, match=f"<= {MAX_SERVING_DEPTH}"):
        parse_serving_depths(f"1-{MAX_SERVING_DEPTH + 1}")
    with pytest.raises(InputError, match="depth 4 more than once"):
        parse_update_depths("4,1-4")
    with pytest.raises(InputError, match="--serving-depths"):
        parse_serving_depths("x", "--serving-depths")


def test_update_depths_share_the_ceiling_and_an_explicit_limit_lifts_both():
    with pytest.raises(InputError, match=f"depth {MAX_SERVING_DEPTH + 1} is above the maximum.*--max-depth"):
        parse_update_depths(f"4,{MAX_SERVING_DEPTH + 1}")
    assert parse_update_depths("4,100", limit=100) == (4, 100)
    assert parse_serving_depths("1-2,100", limit=100) == (1, 2, 100)


def test_checked_depths_keeps_the_order_and_refuses_what_is_not_a_depth_list():
    assert checked_depths([np.int64(16), 4], "update_depths") == (16, 4)
    for bad, message in [
        ((4, True), r"update_depths must be depths in 1..64, got True"),
        ((4, 2.0), r"update_depths must be depths in 1..64, got 2.0"),
        ((0, 4), r"update_depths must be depths in 1..64, got 0"),
        ((4, 65), r"update_depths must be depths in 1..64, got \[4, 65\]"),
        ((4, 16, 4), r"update_depths must not repeat a depth, got \[4, 16, 4\]"),
    ]:
        with pytest.raises(InputError, match=message):
            checked_depths(bad, "update_depths", limit=64)
    assert checked_depths((4, 65), "update_depths") == (4, 65)  # no limit
    with pytest.raises(InputError, match="update_depths must be positive integers, got 0"):
        checked_depths((0, 4), "update_depths")


@pytest.mark.parametrize(
    "depths,text",
    [((4, 16), "4,16"), (range(1, 17), "1-16"), ((1, 2, 4, 8), "1,2,4,8"), ((1, 2, 3, 5, 9, 10, 11), "1-3,5,9-11")],
)
def test_depths_text_is_read_back_as_the_same_depths(depths, text):
    assert depths_text(depths) == text
    assert parse_update_depths(text) == tuple(depths)
