"""The set checks behind verification and the merge/mix preconditions agree with numpy's sort-based
set operations on both sides of the small-column threshold (Python sets below it, numpy above)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ir.columns import SMALL_COLUMN, first_common, first_missing, frozen_i64, has_duplicates

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
def test_first_common_and_first_missing_match_numpy(a: np.ndarray, b: np.ndarray) -> None:
    common, missing = np.intersect1d(a, b), np.setdiff1d(a, b)
    assert first_common(a, b) == (int(common[0]) if common.size else None)
    assert first_missing(a, b) == (int(missing[0]) if missing.size else None)
