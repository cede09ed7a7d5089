"""Pass-level unit tests: each pass's postconditions, purity and identity-on-no-change."""

from __future__ import annotations

import copy

import attrs
import numpy as np
import pytest

from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.errors import IRValidationError, PreconditionError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, RequestId, SampleId
from ir.init import InitIntent, op_writes
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.printer import dump
from ir.verify import verify
from passes import (
    DecodeContext,
    LowerContext,
    filter_batch,
    lower,
    merge_batch,
    mix_with_running,
    prepare_for_decode,
    prepare_for_extend,
)
from tests.helpers import cont, cow, decode_batch, empty_decode, fresh


def _extend() -> ExtendBatch:
    return prepare_for_extend(
        [
            fresh(10, 1, [5, 6, 7], 100),
            cow(11, 2, src=9, prefix=4, tokens=[8, 9], kv_start=200),
            cont(12, 3, prefix=6, tokens=[1, 2, 3, 4], kv_start=300, more=True),
        ]
    )


# -- prepare_for_extend -------------------------------------------------------------------------


def test_prepare_for_extend_columns_follow_request_order() -> None:
    b = _extend()
    assert b.rids.tolist() == [10, 11, 12]
    assert b.slots.tolist() == [1, 2, 3]
    assert b.prefix_lens.tolist() == [0, 4, 6]
    assert b.extend_lens.tolist() == [3, 2, 4]
    assert b.more_chunks.tolist() == [False, False, True]
    assert b.intents == (InitIntent.CLEAR, InitIntent.COW, InitIntent.CONTINUE)
    assert b.input_ids.tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 4]
    assert b.kv_locs.tolist() == [100, 101, 102, 200, 201, 300, 301, 302, 303]
    verify(b)


def test_prepare_for_extend_init_has_one_op_per_intent() -> None:
    b = _extend()
    assert b.init is not None
    assert b.init.clear_slots == (1,)
    assert (b.init.cow_src, b.init.cow_dst) == ((9,), (2,))


def test_prepare_for_extend_mints_a_new_serial_per_batch() -> None:
    a, b = _extend(), _extend()
    assert a.init is not None and b.init is not None
    assert b.init.serial > a.init.serial


def test_prepare_for_extend_continuations_only_have_no_init() -> None:
    b = prepare_for_extend([cont(1, 1, prefix=3, tokens=[4], kv_start=10)])
    assert b.init is None


def test_prepare_for_extend_rejects_no_requests() -> None:
    with pytest.raises(PreconditionError, match="no admitted requests"):
        prepare_for_extend([])


def test_nodes_are_read_only() -> None:
    b = _extend()
    with pytest.raises(ValueError, match="read-only"):
        b.slots[0] = 7
    with pytest.raises(AttributeError):
        b.slots = b.rids  # type: ignore[misc]  # the point of the test: frozen at run time too


# -- prepare_for_decode -------------------------------------------------------------------------


def test_prepare_for_decode_from_extend_skips_chunked_and_advances() -> None:
    b = _extend()
    d = prepare_for_decode(b, DecodeContext(next_tokens=[40, 41], kv_locs=[103, 202]))
    assert d.rids.tolist() == [10, 11]
    assert d.slots.tolist() == [1, 2]
    assert d.seq_lens.tolist() == [3 + 1, 4 + 2 + 1]
    assert d.input_ids.tolist() == [40, 41]
    assert d.kv_locs.tolist() == [103, 202]
    verify(d)


def test_prepare_for_decode_from_decode_advances_by_one() -> None:
    d0 = decode_batch([1, 2], [3, 4], [7, 9], [70, 90], tokens=[5, 5])
    d1 = prepare_for_decode(d0, DecodeContext(next_tokens=[6, 8], kv_locs=[71, 91]))
    assert d1.seq_lens.tolist() == [8, 10]
    assert d1.input_ids.tolist() == [6, 8]
    assert d0.seq_lens.tolist() == [7, 9]  # the input is untouched


def test_prepare_for_decode_from_mixed_orders_extend_then_decode() -> None:
    running = decode_batch([1], [4], [7], [70], tokens=[5])
    mixed = MixedBatch(extend=_extend(), decode=running)
    d = prepare_for_decode(mixed, DecodeContext(next_tokens=[1, 2, 3], kv_locs=[500, 501, 502]))
    assert d.rids.tolist() == [10, 11, 1]
    assert d.seq_lens.tolist() == [4, 7, 8]


def test_prepare_for_decode_checks_context_length() -> None:
    with pytest.raises(PreconditionError, match="ctx.next_tokens has 1 entries for 2 decoding requests"):
        prepare_for_decode(_extend(), DecodeContext(next_tokens=[1], kv_locs=[2]))


def test_decode_context_rejects_mismatched_columns() -> None:
    with pytest.raises(IRValidationError, match="DecodeContext.kv_locs"):
        DecodeContext(next_tokens=[1, 2], kv_locs=[2])


def test_prepare_for_decode_output_has_no_init_field() -> None:
    d = prepare_for_decode(_extend(), DecodeContext(next_tokens=[1, 2], kv_locs=[3, 4]))
    assert "init" not in {f.name for f in DecodeBatch.__attrs_attrs__}
    assert type(d) is DecodeBatch


# -- filter_batch -------------------------------------------------------------------------------


def test_filter_batch_returns_input_when_nothing_dropped() -> None:
    b = _extend()
    assert filter_batch(b, []) is b
    assert filter_batch(b, [RequestId(999)]) is b
    d = decode_batch([1, 2], [3, 4], [7, 9], [70, 90], tokens=[5, 5])
    assert filter_batch(d, [RequestId(5)]) is d


def test_filter_decode_drops_rows_in_order() -> None:
    d = decode_batch([1, 2, 3], [3, 4, 5], [7, 9, 11], [70, 90, 110], tokens=[5, 6, 7])
    f = filter_batch(d, [RequestId(2)])
    assert f.rids.tolist() == [1, 3]
    assert f.slots.tolist() == [3, 5]
    assert f.seq_lens.tolist() == [7, 11]
    assert f.kv_locs.tolist() == [70, 110]
    assert d.rids.tolist() == [1, 2, 3]


def test_filter_extend_drops_tokens_and_init_ops_keeping_serial() -> None:
    b = _extend()
    assert b.init is not None
    f = filter_batch(b, [RequestId(10)])
    assert f.rids.tolist() == [11, 12]
    assert f.input_ids.tolist() == [8, 9, 1, 2, 3, 4]
    assert f.init is not None
    assert f.init.serial == b.init.serial
    assert f.init.clear_slots == ()
    assert f.init.cow_dst == (MambaSlot(2),)
    verify(f)
    g = filter_batch(b, [RequestId(10), RequestId(11)])
    assert g.init is None


# -- merge_batch --------------------------------------------------------------------------------


def test_merge_batch_appends_finished_prefills_in_last_forward_state() -> None:
    running = decode_batch([1], [4], [7], [70], tokens=[5])
    m = merge_batch(running, _extend())
    assert m.rids.tolist() == [1, 10, 11]
    assert m.seq_lens.tolist() == [7, 3, 6]
    assert m.input_ids.tolist() == [5, 7, 9]  # last prompt token of each
    assert m.kv_locs.tolist() == [70, 102, 201]
    verify(m)


def test_merge_then_prepare_equals_prepare_from_extend() -> None:
    b = _extend()
    ctx = DecodeContext(next_tokens=[1, 2], kv_locs=[3, 4])
    via_merge = prepare_for_decode(merge_batch(empty_decode(), b), ctx)
    direct = prepare_for_decode(b, ctx)
    assert via_merge == direct


def test_merge_batch_with_nothing_new_returns_running() -> None:
    running = decode_batch([1], [4], [7], [70], tokens=[5])
    only_chunked = prepare_for_extend([cont(12, 3, prefix=6, tokens=[1], kv_start=300, more=True)])
    assert merge_batch(running, only_chunked) is running


def test_merge_batch_rejects_shared_request() -> None:
    running = decode_batch([10], [7], [7], [70], tokens=[5])
    with pytest.raises(PreconditionError, match="request id 10 is in both"):
        merge_batch(running, _extend())


# -- mix_with_running ---------------------------------------------------------------------------


def test_mix_with_running_keeps_init_on_extend_part() -> None:
    running = decode_batch([1], [4], [7], [70], tokens=[5])
    b = _extend()
    m = mix_with_running(b, running)
    assert m.extend is b and m.decode is running
    assert m.init == b.init
    verify(m)


def test_mix_with_running_rejects_shared_kv() -> None:
    running = decode_batch([1], [4], [7], [100], tokens=[5])
    with pytest.raises(PreconditionError, match="KV location 100"):
        mix_with_running(_extend(), running)


# -- lower --------------------------------------------------------------------------------------


def test_lower_extend_mints_one_ticket_per_pool_sharing_columns() -> None:
    b = _extend()
    p = lower(b, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)))
    assert isinstance(p, ExtendPlan)
    assert [t.pool for t in p.tickets] == [TARGET_POOL, DRAFT_POOL]
    assert b.init is not None
    assert {t.serial for t in p.tickets} == {b.init.serial}
    assert p.input_ids is b.input_ids  # shared, not copied
    verify(p)


def test_lower_twice_gives_equal_tickets() -> None:
    b = _extend()
    assert lower(b, LowerContext()).tickets == lower(b, LowerContext()).tickets


def test_lower_without_init_has_no_tickets() -> None:
    p = lower(prepare_for_extend([cont(1, 1, prefix=3, tokens=[4], kv_start=10)]), LowerContext())
    assert p.tickets == ()


def test_lower_each_kind() -> None:
    d = decode_batch([1], [4], [7], [70], tokens=[5])
    assert isinstance(lower(d, LowerContext()), DecodePlan)
    assert isinstance(lower(MixedBatch(extend=_extend(), decode=d), LowerContext()), MixedPlan)
    assert isinstance(lower(IdleBatch(), LowerContext()), IdlePlan)
    assert IdleBatch().num_requests == lower(IdleBatch(), LowerContext()).num_requests == 0


def test_lower_returns_a_pipelined_plan_finished() -> None:
    """A pipelined step's sample ids are arguments of ``lower``: the plans come out carrying them (a
    mixed plan's two parts under the one sample), equal to the plans built field by field."""
    sid, src = SampleId(7), SampleId(3)
    d = prepare_for_decode(decode_batch([1], [4], [7], [70], tokens=[5]), DecodeContext(next_tokens=[0], kv_locs=[71]))
    e = _extend()
    plan = lower(d, LowerContext(), sample_id=sid, inputs_from=src)
    assert plan == DecodePlan(rids=d.rids, slots=d.slots, seq_lens=d.seq_lens, input_ids=d.input_ids, kv_locs=d.kv_locs, sample_id=sid, inputs_from=src)
    assert lower(d, LowerContext(), inputs_from=src).sample_id is None
    eplan = lower(e, LowerContext(), sample_id=sid)
    assert eplan.sample_id == sid and eplan.tickets == lower(e, LowerContext()).tickets
    mixed = lower(MixedBatch(extend=e, decode=d), LowerContext(), sample_id=sid, inputs_from=src)
    assert (mixed.extend.sample_id, mixed.decode.sample_id, mixed.decode.inputs_from) == (sid, sid, src)
    for p in (plan, eplan, mixed):
        verify(p)
    assert (lower(d, LowerContext()).sample_id, lower(d, LowerContext()).inputs_from, lower(e, LowerContext()).sample_id) == (None, None, None)


@pytest.mark.parametrize(
    ("sample_id", "inputs_from", "tokens", "words"),
    [
        (0, None, [5], "positive sample id"),
        (None, -2, [0], "positive sample id"),
        (None, 3, [5], "placeholders"),
        (3, 3, [0], "own sample_id"),
    ],
)
def test_lower_checks_the_sample_ids_it_is_given(sample_id: int | None, inputs_from: int | None, tokens: list[int], words: str) -> None:
    """The sample ids are the caller's, not the checked batch's: the plan runs its own checks on them."""
    d = prepare_for_decode(decode_batch([1], [4], [7], [70], tokens=[5]), DecodeContext(next_tokens=tokens, kv_locs=[71]))
    with pytest.raises(IRValidationError, match=words):
        lower(d, LowerContext(), sample_id=None if sample_id is None else SampleId(sample_id), inputs_from=None if inputs_from is None else SampleId(inputs_from))
    if inputs_from is None:
        with pytest.raises(IRValidationError, match=words):
            lower(_extend(), LowerContext(), sample_id=SampleId(sample_id or 0))


# -- purity -------------------------------------------------------------------------------------


def test_passes_never_mutate_inputs() -> None:
    b = _extend()
    running = decode_batch([1], [4], [7], [70], tokens=[5])
    snapshot = copy.deepcopy((b, running))
    prepare_for_decode(b, DecodeContext(next_tokens=[1, 2], kv_locs=[3, 4]))
    filter_batch(b, [RequestId(10)])
    merge_batch(running, b)
    mix_with_running(b, running)
    lower(b, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)))
    assert (b, running) == snapshot
    assert all(not a.flags.writeable for a in (b.rids, b.input_ids, running.seq_lens))
    assert np.array_equal(b.kv_locs, snapshot[0].kv_locs)


# -- row pairing by raw value ---------------------------------------------------------------------
# Golden dumps renumber request ids, slots and KV locations per dump, so two rows that swapped their
# slots (or KV locations) print the same. These tests compare raw values: every pass must keep each
# request's own slot, sequence length, token and KV locations, whatever order its rows come in.

# slots and KV locations deliberately not in request order, so a swap cannot look like the original
_EXT_REQS = (
    fresh(10, 7, [5, 6, 7], 100),
    cow(11, 3, src=9, prefix=4, tokens=[8, 9], kv_start=200),
    cont(12, 5, prefix=6, tokens=[1, 2, 3, 4], kv_start=300, more=True),
)
_EXT_ROWS = {  # rid -> (slot, prefix_len, tokens, KV locations)
    10: (7, 0, (5, 6, 7), (100, 101, 102)),
    11: (3, 4, (8, 9), (200, 201)),
    12: (5, 6, (1, 2, 3, 4), (300, 301, 302, 303)),
}
_RUN_ROWS = {1: (8, 7, 55, 70), 2: (4, 9, 66, 90), 3: (6, 11, 77, 110)}  # rid -> (slot, seq_len, token, kv)


def _running(rids: tuple[int, ...] = (1, 2, 3)) -> DecodeBatch:
    rows = [_RUN_ROWS[r] for r in rids]
    return decode_batch(list(rids), [r[0] for r in rows], [r[1] for r in rows], [r[3] for r in rows], tokens=[r[2] for r in rows])


def _decode_rows(b: DecodeBatch | DecodePlan) -> dict[int, tuple[int, int, int, int]]:
    """rid -> (slot, seq_len, input token, KV location), by raw value."""
    cols = (b.rids, b.slots, b.seq_lens, b.input_ids, b.kv_locs)
    assert len({c.shape[0] for c in cols}) == 1
    return {int(r): (int(s), int(n), int(t), int(k)) for r, s, n, t, k in zip(*cols, strict=True)}


def _extend_rows(b: ExtendBatch | ExtendPlan) -> dict[int, tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """rid -> (slot, prefix_len, tokens, KV locations), by raw value."""
    ends = np.cumsum(b.extend_lens)
    starts = ends - b.extend_lens
    return {
        int(r): (int(s), int(p), tuple(b.input_ids[lo:hi].tolist()), tuple(b.kv_locs[lo:hi].tolist()))
        for r, s, p, lo, hi in zip(b.rids, b.slots, b.prefix_lens, starts, ends, strict=True)
    }


def _advanced(rows: dict[int, tuple[int, int, int, int]], ctx: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int, int, int]]:
    """Each row one step on: same slot, seq_len + 1, the token and KV location ``ctx`` gives its rid."""
    return {rid: (slot, n + 1, *ctx[rid]) for rid, (slot, n, _, _) in rows.items()}


def _ctx(rids_in_order: list[int], per_rid: dict[int, tuple[int, int]]) -> DecodeContext:
    return DecodeContext(next_tokens=[per_rid[r][0] for r in rids_in_order], kv_locs=[per_rid[r][1] for r in rids_in_order])


_NEXT = {10: (40, 103), 11: (41, 202), 1: (56, 71), 2: (67, 91), 3: (78, 111)}  # rid -> (next token, its KV)
_PREFILLED = {10: (7, 3, 7, 102), 11: (3, 6, 9, 201)}  # finished prefills in "last forward ran" form


def test_prepare_for_extend_and_lower_keep_each_requests_slot_tokens_and_kv() -> None:
    b = prepare_for_extend(list(_EXT_REQS))
    assert _extend_rows(b) == _EXT_ROWS
    plan = lower(b, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)))
    assert _extend_rows(plan) == _EXT_ROWS
    for t in plan.tickets:  # the init ops name the raw slots of their requests
        assert t.op.clear_slots == (MambaSlot(7),)
        assert (t.op.cow_src, t.op.cow_dst) == ((MambaSlot(9),), (MambaSlot(3),))


def test_prepare_for_decode_keeps_each_requests_slot_by_raw_value() -> None:
    e = prepare_for_extend(list(_EXT_REQS))
    from_extend = prepare_for_decode(e, _ctx([10, 11], _NEXT))
    assert _decode_rows(from_extend) == _advanced(_PREFILLED, _NEXT)
    from_decode = prepare_for_decode(_running(), _ctx([1, 2, 3], _NEXT))
    assert _decode_rows(from_decode) == _advanced(_RUN_ROWS, _NEXT)
    from_mixed = prepare_for_decode(MixedBatch(extend=e, decode=_running()), _ctx([10, 11, 1, 2, 3], _NEXT))
    assert from_mixed.rids.tolist() == [10, 11, 1, 2, 3]
    assert _decode_rows(from_mixed) == _advanced({**_PREFILLED, **_RUN_ROWS}, _NEXT)
    for d in (from_extend, from_decode, from_mixed):
        assert _decode_rows(lower(d, LowerContext())) == _decode_rows(d)


def test_filter_batch_keeps_each_remaining_requests_rows_by_raw_value() -> None:
    for drop in ([1], [2], [3], [1, 3]):
        kept = filter_batch(_running(), [RequestId(r) for r in drop])
        assert _decode_rows(kept) == {r: v for r, v in _RUN_ROWS.items() if r not in drop}
        assert _decode_rows(lower(kept, LowerContext())) == _decode_rows(kept)
    e = prepare_for_extend(list(_EXT_REQS))
    for drop in ([10], [11], [12], [10, 12]):
        kept_e = filter_batch(e, [RequestId(r) for r in drop])
        assert _extend_rows(kept_e) == {r: v for r, v in _EXT_ROWS.items() if r not in drop}
        init = kept_e.init
        clears = () if 10 in drop else (MambaSlot(7),)
        cows = ((), ()) if 11 in drop else ((MambaSlot(9),), (MambaSlot(3),))
        if clears or cows[0]:
            assert init is not None and init.clear_slots == clears and (init.cow_src, init.cow_dst) == cows
        else:
            assert init is None


def test_merge_batch_keeps_each_requests_rows_by_raw_value() -> None:
    e = prepare_for_extend(list(_EXT_REQS))
    merged = merge_batch(_running((2, 1)), e)
    assert merged.rids.tolist() == [2, 1, 10, 11]
    assert _decode_rows(merged) == {**{r: _RUN_ROWS[r] for r in (1, 2)}, **_PREFILLED}
    assert _decode_rows(prepare_for_decode(merged, _ctx([2, 1, 10, 11], _NEXT))) == _advanced(
        {**{r: _RUN_ROWS[r] for r in (1, 2)}, **_PREFILLED}, _NEXT
    )
    assert _decode_rows(lower(merged, LowerContext())) == _decode_rows(merged)


def test_mix_with_running_and_lower_keep_both_parts_rows_by_raw_value() -> None:
    e = prepare_for_extend(list(_EXT_REQS))
    running = prepare_for_decode(_running(), _ctx([1, 2, 3], _NEXT))
    m = mix_with_running(e, running)
    assert _extend_rows(m.extend) == _EXT_ROWS
    assert _decode_rows(m.decode) == _advanced(_RUN_ROWS, _NEXT)
    plan = lower(m, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)))
    assert _extend_rows(plan.extend) == _EXT_ROWS
    assert _decode_rows(plan.decode) == _advanced(_RUN_ROWS, _NEXT)


def _no_one_shot_ops(text: str) -> bool:
    return not any(word in text for word in ("ticket", "init", "snapshot", "cow", "clear"))


def test_a_decode_derived_batch_lowers_without_tickets() -> None:
    """The init of a prefill does not follow its requests into decode: every batch derived from it
    (prepared, merged, filtered, or the decode part of a later MIXED forward) lowers to a plan with
    no ticket, and a MIXED forward's tickets are its new extend part's init, targeting only those rows."""
    e = prepare_for_extend(list(_EXT_REQS))
    assert e.init is not None
    decoded = prepare_for_decode(e, _ctx([10, 11], _NEXT))
    derived = [
        decoded,
        prepare_for_decode(MixedBatch(extend=e, decode=_running()), _ctx([10, 11, 1, 2, 3], _NEXT)),
        merge_batch(_running(), e),
        filter_batch(merge_batch(_running(), e), [RequestId(1)]),
        prepare_for_decode(decoded, _ctx([10, 11], {10: (42, 104), 11: (43, 203)})),
    ]
    ctx = LowerContext(pools=(TARGET_POOL, DRAFT_POOL))
    for d in derived:
        plan = lower(d, ctx)
        assert type(d) is DecodeBatch and type(plan) is DecodePlan
        assert "init" not in {f.name for f in attrs.fields(DecodeBatch)}
        assert "tickets" not in {f.name for f in attrs.fields(DecodePlan)}
        assert _no_one_shot_ops(dump(d)) and _no_one_shot_ops(dump(plan)), dump(plan)

    # a later MIXED forward: the running part came from `e`; only the newcomers' init is lowered
    newcomers = prepare_for_extend([fresh(20, 2, [9, 9], 400), cow(21, 1, src=9, prefix=4, tokens=[7], kv_start=500)])
    assert newcomers.init is not None and newcomers.init.serial != e.init.serial
    m = mix_with_running(newcomers, prepare_for_decode(merge_batch(_running(), e), _ctx([1, 2, 3, 10, 11], _NEXT)))
    plan = lower(m, ctx)
    assert [t.pool for t in plan.tickets] == [TARGET_POOL, DRAFT_POOL]
    for t in plan.tickets:
        assert t.op == newcomers.init  # the newcomers' serial and ops, not the stale ones of `e`
        assert set(op_writes(t.op)) == {MambaSlot(2), MambaSlot(1)}  # the newcomers' rows, no decode row
        assert not set(op_writes(t.op)) & set(plan.decode.slots.tolist())
    assert _no_one_shot_ops(dump(plan.decode))
    text = dump(plan)
    assert text.count("ticket") == 2, text  # one per pool, in the extend part only
