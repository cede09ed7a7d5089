"""``SamplingRows``: the per-row sampling columns of batches and plans, and the passes that keep them
aligned with the rows through filtering, merging, decoding and a whole speculative iteration."""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.testing.strategies import sampling_rows
from ir.errors import IRValidationError
from ir.sampling import GREEDY, SamplingParams, SamplingRows, rows_joined
from passes.accept import accept
from passes.commit import commit
from passes.filter_batch import filter_batch
from passes.merge_batch import merge_batch
from passes.prepare_for_decode import DecodeContext, prepare_for_decode
from passes.prepare_for_draft import SpecContext, prepare_for_draft
from passes.prepare_for_draft_commit import prepare_for_draft_commit
from passes.prepare_for_draft_extend import prepare_for_draft_extend
from passes.prepare_for_extend import prepare_for_extend
from passes.prepare_for_verify import prepare_for_verify
from tests.helpers import decode_batch, fresh, proposed, verified


def _row(rows: SamplingRows | None, i: int) -> tuple[Any, ...]:
    """Row ``i`` of ``rows`` as a tuple of its values, its banned ids last (a ``None`` batch's rows
    are ``GREEDY``'s)."""
    if rows is None:
        rows = SamplingRows.greedy(i + 1)
    cols = attrs.asdict(rows, recurse=False)
    end = int(rows.banned_lens[: i + 1].sum())
    banned = tuple(rows.banned[end - int(rows.banned_lens[i]) : end].tolist())
    return (*(col[i].item() for name, col in cols.items() if name != "banned"), banned)


def _by_rid(rids: Any, rows: SamplingRows | None) -> dict[int, tuple[Any, ...]]:
    return {int(r): _row(rows, i) for i, r in enumerate(rids.tolist())}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", math.nan, "must be >= 0 and finite"),
        ("temperature", -0.5, "must be >= 0 and finite"),
        ("temperature", math.inf, "must be >= 0 and finite"),
        ("top_p", 0.0, r"must be in \(0, 1\]"),
        ("top_p", 1.5, r"must be in \(0, 1\]"),
        ("min_p", -0.1, r"must be in \[0, 1\]"),
        ("presence_penalty", 2.5, r"must be in \[-2, 2\]"),
        ("repetition_penalty", 0.0, "must be > 0 and finite"),
        ("top_k", -2, "must be >= -1"),
        ("seed", -1, "must be >= 0"),
        ("index", 16, "must be <= 15"),
        ("logprobs", 21, "must be <= 20"),
    ],
)
def test_rows_refuse_values_outside_the_ranges_naming_the_field(field: str, value: object, message: str) -> None:
    cols = attrs.asdict(SamplingRows.greedy(2), recurse=False)
    cols[field] = np.array([cols[field][0], value], dtype=cols[field].dtype)  # (a per-request column)
    with pytest.raises(IRValidationError, match=rf"^SamplingRows\.{field}.*{message}"):
        SamplingRows(**cols)


def test_a_bool_is_not_a_number_and_a_sampled_row_needs_a_seed() -> None:
    cols = attrs.asdict(SamplingRows.greedy(1), recurse=False)
    with pytest.raises(IRValidationError, match=r"SamplingRows\.temperature.*numbers, got a bool entry"):
        SamplingRows(**{**cols, "temperature": [True]})
    with pytest.raises(IRValidationError, match=r"row 0 is sampled .* and has no seed"):
        SamplingRows.of([SamplingParams(temperature=1.0)])


def test_of_reads_each_field_and_greedy_rows_ask_for_nothing() -> None:
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=42, logprobs=3)
    rows = SamplingRows.of([GREEDY, p], [0, 2])
    assert _row(rows, 1) == (0.7, 5, 0.9, 0.1, 0.0, 0.0, 1.0, 42, 2, 3, 0, 0, ())
    assert _row(rows, 0) == (0.0, -1, 1.0, 0.0, 0.0, 0.0, 1.0, 0, 0, -1, 0, 0, ())
    assert not rows.all_greedy and SamplingRows.greedy(3).all_greedy


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 6))
def test_filter_keeps_each_request_its_own_parameters(data: st.DataObject, n: int) -> None:
    rows = data.draw(st.none() | sampling_rows(n))
    batch = attrs.evolve(decode_batch(list(range(10, 10 + n)), list(range(1, 1 + n)), [5] * n, list(range(n))), sampling=rows)
    drop = data.draw(st.sets(st.integers(10, 10 + n - 1)))
    out = filter_batch(batch, drop)
    before = _by_rid(batch.rids, batch.sampling)
    assert _by_rid(out.rids, out.sampling) == {r: v for r, v in before.items() if r not in drop}
    assert (out.sampling is None) == (rows is None)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(0, 4), m=st.integers(1, 4))
def test_merge_and_decode_keep_each_request_its_own_parameters(data: st.DataObject, n: int, m: int) -> None:
    running = attrs.evolve(
        decode_batch(list(range(100, 100 + n)), list(range(1, 1 + n)), [9] * n, list(range(n))), sampling=data.draw(st.none() | sampling_rows(n))
    )
    more = data.draw(st.lists(st.booleans(), min_size=m, max_size=m))
    requests = [fresh(200 + i, 50 + i, [3, 4], 1000 + 10 * i, more=more[i]) for i in range(m)]
    extend = prepare_for_extend(requests, data.draw(st.none() | sampling_rows(m)))
    merged = merge_batch(running, extend)
    expected = _by_rid(running.rids, running.sampling) | {
        r: v for r, v in _by_rid(extend.rids, extend.sampling).items() if not more[r - 200]
    }
    assert _by_rid(merged.rids, merged.sampling) == expected
    assert (merged.sampling is None) == (running.sampling is None and (extend.sampling is None or all(more)))
    # prepare_for_decode of the prefill gives the same rows as merging it into an empty batch
    done = int((~extend.more_chunks).sum())
    dec = prepare_for_decode(extend, DecodeContext(next_tokens=[1] * done, kv_locs=list(range(5000, 5000 + done))))
    assert _by_rid(dec.rids, dec.sampling) == {r: v for r, v in expected.items() if r >= 200}


@settings(max_examples=30, deadline=None)
@given(data=st.data(), n=st.integers(1, 4))
def test_a_speculative_iteration_carries_the_rows_to_the_next_running_batch(data: st.DataObject, n: int) -> None:
    k = 2
    rows = data.draw(st.none() | sampling_rows(n))
    running = attrs.evolve(decode_batch(list(range(1, 1 + n)), list(range(1, 1 + n)), [6] * n, list(range(n))), sampling=rows)
    draft = prepare_for_draft(running, SpecContext(k=k, next_tokens=[3] * n, kv_locs=list(range(100, 100 + n * (k + 1)))))
    verify = prepare_for_verify(draft, proposed(draft, [5] * (n * k)))
    accepted = data.draw(st.lists(st.integers(0, k), min_size=n, max_size=n))
    targets = np.array([[5] * a + [9] * (k + 1 - a) for a in accepted], dtype=np.int64).reshape(-1)
    committed = commit(verify, accept(verify, verified(verify, targets)))
    for node in (draft, verify, committed, prepare_for_draft_commit(committed, draft), prepare_for_draft_extend(committed)):
        assert node.sampling == rows, type(node).__name__
    after = merge_batch(running.empty(), prepare_for_draft_commit(committed, draft))
    assert after.sampling == rows


def test_rows_joined_fills_a_greedy_side() -> None:
    a = SamplingRows.of([SamplingParams(temperature=1.0, seed=3)])
    assert rows_joined(None, 2, None, 3) is None
    both = rows_joined(None, 2, a, 1)
    assert both is not None and [_row(both, i)[0] for i in range(3)] == [0.0, 0.0, 1.0]
    assert rows_joined(a, 1, None, 0) is a


def test_verify_rechecks_sampling_rows_a_pass_built_without_checks() -> None:
    from ir.columns import build_unchecked
    from ir.verify import verify

    rows = attrs.asdict(SamplingRows.greedy(2), recurse=False)
    bad = build_unchecked(SamplingRows, **{**rows, "top_p": np.array([1.0, 7.0])})
    batch = attrs.evolve(decode_batch([1, 2], [1, 2], [5, 5], [0, 1]), sampling=None)
    object.__setattr__(batch, "sampling", bad)  # (as a pass that skipped the checks would have left it)
    with pytest.raises(IRValidationError, match=r"SamplingRows\.top_p.*must be in \(0, 1\]"):
        verify(batch)
