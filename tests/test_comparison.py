"""``assert_close`` / ``max_diff`` (tests/scripts/_common.py), the comparison about 20 checks of
the suite use, tested by itself, without processes: a comparison that cannot fail would let
every test that uses it pass. Each case below passed the helper before issue 40."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import assert_close, max_diff

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "got,expected",
    [
        ([[NAN, 0.2], [1.0, 2.0]], [[0.1, 0.2], [1.0, 2.0]]),  # NaN first
        ([[0.1, 0.2], [NAN, NAN]], [[0.1, 0.2], [1.0, 2.0]]),  # NaN last: max() dropped it
        ([0.1, 0.2], [0.1, NAN]),  # NaN in the reference
        ([0.1, INF], [0.1, 0.2]),  # an infinity
        ([0.1, INF], [0.1, INF]),  # the same infinity on both sides: inf - inf is NaN
        ({"a": [1.0], "b": [NAN]}, {"a": [1.0], "b": [2.0]}),  # in a dict
    ],
    ids=["nan-first", "nan-last", "nan-reference", "inf", "inf-both", "nan-in-dict"],
)
def test_a_non_finite_value_anywhere_fails(got, expected):
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(got, expected, 1.0, "params")
    with pytest.raises(AssertionError, match="non-finite"):
        max_diff(got, expected)  # so `max_diff(...) == 0.0` cannot pass either


@pytest.mark.parametrize(
    "empty",
    [[], {}, (), [[], []], [[1.0], []], {"a": [1.0], "b": []}],
    ids=["list", "dict", "tuple", "nested", "one-leaf", "dict-leaf"],
)
def test_an_empty_reference_or_leaf_fails(empty):
    with pytest.raises(AssertionError, match="the reference is empty"):
        assert_close(empty, empty, 1.0, "params")


@pytest.mark.parametrize(
    "got,expected,match",
    [
        ([1.0, 2.0], [1.0, 2.0, 3.0], "2 items, expected 3"),  # a shortened list
        ([[1.0, 2.0], [3.0]], [[1.0], [2.0, 3.0]], r"params\[0\]: 2 items, expected 1"),  # same total, other shape
        ({"a": 1.0}, {"a": 1.0, "b": 2.0}, "keys"),
        ([1.0], [[1.0]], "expected a list"),
        ([[1.0]], [1.0], "expected a number"),
        ([True], [1.0], "expected a number"),
        ([1.0], [None], "not a number"),
    ],
    ids=["short", "shape", "keys", "list", "number", "bool", "none"],
)
def test_a_structure_that_differs_fails(got, expected, match):
    with pytest.raises(AssertionError, match=match):
        assert_close(got, expected, 1.0, "params")


def test_the_worst_difference_is_reported_and_judged():
    assert max_diff([[0.0, 1.0], [2.0]], [[0.0, 1.0], [2.0]]) == 0.0  # exact is still exactly 0.0
    assert max_diff({"a": [1.0, 5.0], "b": (2,)}, {"a": [1.0, 2.0], "b": (2.5,)}) == 3.0
    assert max_diff([1.1, 2.0], [1.0, 4.0], relative=True) == pytest.approx(0.5)
    assert_close([1.0, 2.0 + 1e-7], [1.0, 2.0], 1e-6)
    with pytest.raises(AssertionError, match=r"w: differs from the reference by 0\.001"):
        assert_close([1.0, 2.001], [1.0, 2.0], 1e-6, "w")
    with pytest.raises(AssertionError, match="relative difference to a reference of 0"):
        max_diff([1.0], [0.0], relative=True)
