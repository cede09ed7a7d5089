"""Pass-level unit tests: each pass's postconditions, purity and identity-on-no-change."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.errors import IRValidationError, PreconditionError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, RequestId
from ir.init import InitIntent
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
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
from tests.core import cont, cow, decode_batch, empty_decode, fresh


def _extend() -> ExtendBatch:
    return prepare_for_extend(
        [
            fresh(10, 1, [5, 6, 7], 100),
            cow(11, 2, checkpoint=9, prefix=4, tokens=[8, 9], kv_start=200),
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
    d0 = decode_batch([1, 2], [3, 4], [7, 9], [5, 5], [70, 90])
    d1 = prepare_for_decode(d0, DecodeContext(next_tokens=[6, 8], kv_locs=[71, 91]))
    assert d1.seq_lens.tolist() == [8, 10]
    assert d1.input_ids.tolist() == [6, 8]
    assert d0.seq_lens.tolist() == [7, 9]  # the input is untouched


def test_prepare_for_decode_from_mixed_orders_extend_then_decode() -> None:
    running = decode_batch([1], [4], [7], [5], [70])
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
    d = decode_batch([1, 2], [3, 4], [7, 9], [5, 5], [70, 90])
    assert filter_batch(d, [RequestId(5)]) is d


def test_filter_decode_drops_rows_in_order() -> None:
    d = decode_batch([1, 2, 3], [3, 4, 5], [7, 9, 11], [5, 6, 7], [70, 90, 110])
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
    running = decode_batch([1], [4], [7], [5], [70])
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
    running = decode_batch([1], [4], [7], [5], [70])
    only_chunked = prepare_for_extend([cont(12, 3, prefix=6, tokens=[1], kv_start=300, more=True)])
    assert merge_batch(running, only_chunked) is running


def test_merge_batch_rejects_shared_request() -> None:
    running = decode_batch([10], [7], [7], [5], [70])
    with pytest.raises(PreconditionError, match="request id 10 is in both"):
        merge_batch(running, _extend())


# -- mix_with_running ---------------------------------------------------------------------------


def test_mix_with_running_keeps_init_on_extend_part() -> None:
    running = decode_batch([1], [4], [7], [5], [70])
    b = _extend()
    m = mix_with_running(b, running)
    assert m.extend is b and m.decode is running
    assert m.init == b.init
    verify(m)


def test_mix_with_running_rejects_shared_kv() -> None:
    running = decode_batch([1], [4], [7], [5], [100])
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
    d = decode_batch([1], [4], [7], [5], [70])
    assert isinstance(lower(d, LowerContext()), DecodePlan)
    assert isinstance(lower(MixedBatch(extend=_extend(), decode=d), LowerContext()), MixedPlan)
    assert isinstance(lower(IdleBatch(), LowerContext()), IdlePlan)


# -- purity -------------------------------------------------------------------------------------


def test_passes_never_mutate_inputs() -> None:
    b = _extend()
    running = decode_batch([1], [4], [7], [5], [70])
    snapshot = copy.deepcopy((b, running))
    prepare_for_decode(b, DecodeContext(next_tokens=[1, 2], kv_locs=[3, 4]))
    filter_batch(b, [RequestId(10)])
    merge_batch(running, b)
    mix_with_running(b, running)
    lower(b, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)))
    assert (b, running) == snapshot
    assert all(not a.flags.writeable for a in (b.rids, b.input_ids, running.seq_lens))
    assert np.array_equal(b.kv_locs, snapshot[0].kv_locs)
