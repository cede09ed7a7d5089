"""The set checks behind verification and the merge/mix preconditions agree with numpy's sort-based
set operations on both sides of the small-column threshold (Python sets below it, numpy above); so
do the bound checks and the lengths sum of the nodes' local checks (Python ``min``/``max``/``sum``
below it)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ir.columns import (
    SMALL_COLUMN,
    check_max,
    check_min,
    column_total,
    first_common,
    first_missing,
    frozen_i64,
    has_duplicates,
    same_column,
)
from ir.errors import IRValidationError

_sizes = st.sampled_from([0, 1, 2, 7, SMALL_COLUMN // 2, SMALL_COLUMN - 1, SMALL_COLUMN, SMALL_COLUMN + 1, 3 * SMALL_COLUMN])


@st.composite
def _column(draw: st.DrawFn) -> np.ndarray:
    n = draw(_sizes)
    hi = draw(st.sampled_from([2, n + 1, 4 * n + 4, 2**40]))
    seed = draw(st.integers(0, 2**32 - 1))
    return frozen_i64(np.random.default_rng(seed).integers(-hi, hi, size=n))


@given(_column())
def test_has_duplicates_matches_numpy(a: np.ndarray) -> None:
    assert has_duplicates(a) == (np.unique(a).size != a.size)


@given(_column(), _column())
def test_same_column_matches_array_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert same_column(a, b) == np.array_equal(a, b)
    assert same_column(a, frozen_i64(a.copy())) and same_column(a, a)
    # another dtype compares by value, as np.array_equal does
    assert same_column(a, a.astype(np.int32, copy=True)) == np.array_equal(a, a.astype(np.int32, copy=True))
    if a.size:
        assert not same_column(a, frozen_i64(a[:-1])) and not same_column(a, frozen_i64(np.concatenate((a[:-1], a[-1:] + 1))))


@given(_column(), _column())
def test_first_common_and_first_missing_match_numpy(a: np.ndarray, b: np.ndarray) -> None:
    common, missing = np.intersect1d(a, b), np.setdiff1d(a, b)
    assert first_common(a, b) == (int(common[0]) if common.size else None)
    assert first_missing(a, b) == (int(missing[0]) if missing.size else None)


@given(_column(), st.data())
def test_bound_checks_match_numpy(a: np.ndarray, data: st.DataObject) -> None:
    """``check_min``/``check_max`` refuse exactly when numpy finds a value past the bound (one next
    to the column's extremes, mostly), naming the first such value; ``column_total`` is numpy's sum."""
    near = [int(v) + d for v in (a.min(), a.max()) for d in (-1, 0, 1)] if a.size else [0]
    bound = data.draw(st.sampled_from(near) | st.integers(-(2**41), 2**41))
    assert column_total(a) == int(a.sum())
    below, above = a[a < bound], a[a > bound]
    if below.size:
        with pytest.raises(IRValidationError, match=re.escape(f"(got {int(below[0])})")):
            check_min("Node", "col", a, bound)
    else:
        check_min("Node", "col", a, bound)
    if above.size:
        with pytest.raises(IRValidationError, match=re.escape(f"(got {int(above[0])})")):
            check_max("Node", "col", a, bound)
    else:
        check_max("Node", "col", a, bound)
