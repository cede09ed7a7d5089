"""``ir.sampling.SamplingRows``'s ``min_tokens`` columns (``ban_until``, ``banned_lens`` and the
packed ``banned``):

- the printer, the parser and the wire carry them (derived from their declarations): a batch and a
  plan with bans dump, parse and pack back to equal nodes;
- property: ``take`` (indices in any order, repeats, masks) and ``joined`` keep each row's banned ids
  with the row, and the result passes the node's checks;
- the checks refuse a packed column of the wrong length and a negative id.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ir.errors import IRValidationError
from ir.parse import parse
from ir.printer import dump
from ir.sampling import GREEDY, SamplingParams, SamplingRows, rows_joined, rows_take
from ir.wire import pack, unpack
from tests.helpers import extend_plan, fresh

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Ban = tuple[int, list[int]]


def _rows(bans: list[Ban]) -> SamplingRows:
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.5 + i, seed=i) for i in range(len(bans))]
    return SamplingRows.of(params, [i % 3 for i in range(len(bans))], bans)


def _bans_of(rows: SamplingRows) -> list[Ban]:
    ends = np.cumsum(rows.banned_lens)
    return [(int(u), rows.banned[e - n : e].tolist()) for u, n, e in zip(rows.ban_until, rows.banned_lens, ends, strict=True)]


bans = st.lists(st.tuples(st.integers(0, 500), st.lists(st.integers(0, 2**40), max_size=4)), max_size=7)


def test_printer_parser_and_wire_carry_the_bans() -> None:
    rows = _rows([(7, [2, 0]), (0, []), (12, [5])])
    batch, plan = extend_plan([fresh(1, 1, [5, 6, 7], 10), fresh(2, 2, [8, 9], 20), fresh(3, 3, [4], 30)])
    batch, plan = attrs.evolve(batch, sampling=rows), attrs.evolve(plan, sampling=rows)
    text = dump(batch, exact=True)
    assert "ban_until=7 bans=2 banned=[2 0]" in text and "ban_until=0 bans=0 banned=[]" in text
    assert parse(text) == batch
    assert parse(dump(plan, exact=True)) == plan
    got = unpack(pack(4, plan), expect_step=4).plan
    assert got == plan
    assert got.sampling is not None and _bans_of(got.sampling) == [(7, [2, 0]), (0, []), (12, [5])]


@FAST
@given(bans, st.data())
def test_take_keeps_each_rows_bans_with_it(given_bans: list[Ban], data: st.DataObject) -> None:
    rows = _rows(given_bans)
    n = len(given_bans)
    picked = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=8)) if n else []
    taken = rows.take(np.array(picked, dtype=np.int64))
    assert _bans_of(taken) == [given_bans[i] for i in picked]
    assert taken == SamplingRows.of([GREEDY if i % 2 else SamplingParams(temperature=0.5 + i, seed=i) for i in picked],
                                    [i % 3 for i in picked], [given_bans[i] for i in picked])
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_)
    masked = rows_take(rows, mask)
    assert masked is not None and _bans_of(masked) == [b for b, keep in zip(given_bans, mask.tolist(), strict=True) if keep]
    attrs.evolve(masked)  # (the constructor's checks pass)


@FAST
@given(bans, bans)
def test_joined_keeps_both_sides_bans_in_order(a: list[Ban], b: list[Ban]) -> None:
    ra, rb = _rows(a), _rows(b)
    joined = rows_joined(ra, len(a), rb, len(b))
    assert joined is not None and _bans_of(joined) == a + b
    attrs.evolve(joined)
    greedy_side = rows_joined(None, 2, rb, len(b))
    assert greedy_side is not None and _bans_of(greedy_side) == [(0, []), (0, []), *b]


def test_checks_refuse_a_packed_column_of_the_wrong_length_and_a_negative_id() -> None:
    rows = _rows([(3, [1, 2])])
    with pytest.raises(IRValidationError, match="banned"):
        attrs.evolve(rows, banned=[1])
    with pytest.raises(IRValidationError, match="banned"):
        attrs.evolve(rows, banned=[1, -4])
    with pytest.raises(IRValidationError, match="ban_until"):
        attrs.evolve(rows, ban_until=[-1])
