"""Unit tests of the backend's core pieces: allocators, ledger, init ops, executor, staging, pool views."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from itertools import pairwise

import numpy as np
import pytest
import torch

from backend.allocator import KVAllocator, SlotAllocator
from backend.executor import Executor
from backend.ledger import Ledger, PoolCounts
from backend.model import blank_logits
from backend.pool import MambaLayerSpec, MambaStatePool, PoolLayout
from backend.staging import StagedDecode, StagedExtend, stage_decode, stage_extend
from backend.state_init import apply_op
from ir.errors import PlanExecutionError, ResourceLeakError, ResourceReplayError, SlotError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, PoolId
from ir.init import InitTicket, MambaInit, Ticket, mint_serial
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.request import Continue, CopyFrom
from ir.results import Ran, Sampled
from passes.lower import LowerContext, lower
from passes.mix_with_running import mix_with_running
from passes.prepare_for_extend import prepare_for_extend
from tests.helpers import SMALL_LAYOUT, decode_batch, extend_plan, make_world, random_fill, request

ALLOCATORS = [SlotAllocator, KVAllocator]


def _ticket(pool: PoolId = TARGET_POOL, *, clear: tuple[int, ...] = (1,), src: tuple[int, ...] = (), dst: tuple[int, ...] = ()) -> InitTicket:
    return Ticket(pool=pool, op=MambaInit(serial=mint_serial(), clear_slots=clear, cow_src=src, cow_dst=dst))


# -- allocators -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_allocation_order_is_deterministic_and_reuse_is_lifo(cls: type[SlotAllocator] | type[KVAllocator]) -> None:
    a = cls(6)
    assert [int(a.alloc()) for _ in range(3)] == [1, 2, 3]
    many = a.alloc_many(2)
    assert many.tolist() == [4, 5]
    assert not many.flags.writeable
    a.free(2)
    a.free(4)
    assert int(a.alloc()) == 4  # last freed, first reused
    assert a.alloc_many(2).tolist() == [2, 6]
    assert a.live() == frozenset(range(1, 7))
    # a second allocator replaying the same calls hands out the same indices
    b = cls(6)
    [b.alloc() for _ in range(3)]
    b.alloc_many(2)
    b.free(2)
    b.free(4)
    assert int(b.alloc()) == 4


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_live_plus_free_is_capacity_and_live_is_exact(cls: type[SlotAllocator] | type[KVAllocator]) -> None:
    rng = np.random.default_rng(7)
    a = cls(9)
    live: set[int] = set()
    for _ in range(200):
        if live and rng.random() < 0.45:
            pick = sorted(live)[int(rng.integers(len(live)))]
            a.free(pick)
            live.discard(pick)
        elif rng.random() < 0.5 and a.num_free >= 2:
            got = a.alloc_many(2).tolist()
            assert not (set(got) & live)
            live |= set(got)
        elif a.num_free:
            got1 = int(a.alloc())
            assert got1 not in live
            live.add(got1)
        assert a.num_live + a.num_free == a.capacity
        assert a.live() == frozenset(live)
        assert all(a.is_live(i) == (i in live) for i in range(0, 11))


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_free_many_is_all_or_nothing(cls: type[SlotAllocator] | type[KVAllocator]) -> None:
    a = cls(5)
    a.alloc_many(3)
    for bad in ([1, 2, 4], [1, 1], [3, 0], [2, 99]):
        with pytest.raises(SlotError):
            a.free_many(bad)
        assert a.live() == frozenset({1, 2, 3})
        assert a.num_free == 2
    a.free_many([3, 1])
    assert a.live() == frozenset({2})
    assert int(a.alloc()) == 1  # freed in order 3, 1: 1 was freed last


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_a_bulk_free_is_all_or_nothing_names_the_first_bad_index_and_keeps_the_reuse_order(
    cls: type[SlotAllocator] | type[KVAllocator],
) -> None:
    """Frees of many indices at once take a vectorised path: same refusals, same messages, same
    last-freed-first reuse as one index at a time."""
    a = cls(1000)
    a.alloc_many(300)
    live = list(range(1, 301))
    base = list(range(200, 100, -1))  # 100 live indices, freed in this order
    what = "slot" if cls is SlotAllocator else "KV location"
    cases = (
        (base + [150], f"double free of {what} 150"),  # repeated
        (base + [301], f"double free of {what} 301"),  # in range, never handed out
        (base[:50] + [0] + base[50:], f"{what} 0 out of range"),
        (base + [1001], f"{what} 1001 out of range"),
    )
    for bad, message in cases:
        for given in (bad, np.array(bad, dtype=np.int64)):  # (an int64 array is checked as it is, not copied)
            with pytest.raises(SlotError, match=message):
                a.free_many(given)
            assert a.live() == frozenset(live) and a.num_free == 700
    a.free_many(np.array(base, dtype=np.int64))
    assert a.live() == frozenset(live) - frozenset(base)
    with pytest.raises(SlotError, match=f"double free of {what} 101"):
        a.free_many(list(range(30, 130)))  # 30..100 are live, 101 was just freed
    assert a.num_free == 800
    assert a.alloc_many(100).tolist() == base[::-1]  # last freed first


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_alloc_many_is_all_or_nothing(cls: type[SlotAllocator] | type[KVAllocator]) -> None:
    a = cls(4)
    a.alloc()
    with pytest.raises(SlotError, match="4 requested, 3 free"):
        a.alloc_many(4)
    assert a.num_free == 3
    assert a.alloc_many(0).tolist() == []
    assert a.alloc_many(3).tolist() == [2, 3, 4]
    with pytest.raises(SlotError, match="out of"):
        a.alloc()


def test_check_live_reports_use_after_free() -> None:
    a = SlotAllocator(3)
    a.alloc_many(2)
    a.check_live([1, 2], "probe")
    a.free(1)
    with pytest.raises(SlotError, match="use after free: probe uses slot 1"):
        a.check_live([2, 1], "probe")
    with pytest.raises(SlotError, match="out of range"):
        a.check_live([4], "probe")


@pytest.mark.parametrize("cls", [SlotAllocator, KVAllocator])
def test_generation_moves_with_every_allocation_and_free_and_nothing_else(cls: type[SlotAllocator] | type[KVAllocator]) -> None:
    a = cls(4)
    seen = [a.generation]
    a.alloc_many(2)
    seen.append(a.generation)
    a.alloc()
    seen.append(a.generation)
    a.check_live([1, 2], "probe")
    a.is_live(3)
    a.live()
    assert a.generation == seen[-1], "a read moved the generation"
    a.free(2)
    seen.append(a.generation)
    with pytest.raises(SlotError):
        a.free(2)  # a refused free changes nothing
    assert a.generation == seen[-1]
    a.free_many([1, 3])
    seen.append(a.generation)
    assert len(set(seen)) == len(seen)


def test_a_slot_freed_after_a_plan_ran_is_refused_on_the_next_plan_over_the_same_slots() -> None:
    """The executor checks a slots column once per allocator generation: a free in between is seen."""
    w = make_world()
    plan = lower(decode_batch([1, 2], [1, 2], [4, 4], [20, 21]), LowerContext())
    w.executor.execute(plan)
    w.executor.execute(plan)  # same column, same generation: still fine
    w.slots.free(2)
    before = w.pool.copy_buffer()
    with pytest.raises(SlotError, match="use after free: DecodePlan uses slot 2"):
        w.executor.execute(plan)
    assert torch.equal(w.pool.buffer, before)


def test_allocator_capacity_must_be_positive() -> None:
    with pytest.raises(SlotError, match="capacity"):
        SlotAllocator(0)


# -- ledger ---------------------------------------------------------------------------------------


def test_register_is_idempotent_for_an_outstanding_ticket() -> None:
    ledger = Ledger()
    t = _ticket()
    ledger.register([t])
    ledger.register([t, t])
    assert ledger.outstanding() == (t,)
    with ledger.consuming(t, TARGET_POOL):
        pass
    assert ledger.outstanding() == ()
    assert ledger.num_consumed == 1


def test_register_of_a_consumed_ticket_raises_and_is_all_or_nothing() -> None:
    ledger = Ledger()
    t, fresh = _ticket(), _ticket()
    ledger.register([t])
    with ledger.consuming(t, TARGET_POOL):
        pass
    with pytest.raises(ResourceReplayError, match=rf"#{t.serial} for pool 'target' was already consumed"):
        ledger.register([fresh, t])
    assert ledger.outstanding() == ()  # fresh was not registered either
    assert ledger.replays_blocked == 1


def test_consuming_returns_the_ticket_when_the_body_raises() -> None:
    ledger = Ledger()
    t = _ticket()
    ledger.register([t])
    with pytest.raises(RuntimeError, match="kernel failed"):
        with ledger.consuming(t, TARGET_POOL):
            raise RuntimeError("kernel failed")
    assert ledger.outstanding() == (t,)
    assert not ledger.is_consumed(t)
    assert ledger.counts(TARGET_POOL) == PoolCounts()
    with ledger.consuming(t, TARGET_POOL) as got:
        assert got == t
    assert ledger.is_consumed(t)
    assert ledger.num_consumed == 1


def test_consuming_twice_raises_and_counts_blocked_replays() -> None:
    ledger = Ledger()
    t = _ticket()
    ledger.register([t])
    with ledger.consuming(t, TARGET_POOL):
        with pytest.raises(ResourceReplayError, match="being consumed"):
            with ledger.consuming(t, TARGET_POOL):
                pass  # pragma: no cover
    assert ledger.replays_blocked == 1
    for _ in range(2):
        with pytest.raises(ResourceReplayError, match=rf"replay of ticket #{t.serial} for pool 'target': already consumed"):
            with ledger.consuming(t, TARGET_POOL):
                pass  # pragma: no cover
    assert ledger.replays_blocked == 3
    assert ledger.num_consumed == 1
    assert ledger.counts(TARGET_POOL).tickets == 1


def test_register_while_consuming_leaves_no_phantom_outstanding() -> None:
    ledger = Ledger()
    t = _ticket()
    ledger.register([t])
    with ledger.consuming(t, TARGET_POOL):
        try:
            ledger.register([t])  # either a no-op (same ticket) or a refused replay is acceptable
        except ResourceReplayError:
            pass
    assert ledger.is_consumed(t)
    assert ledger.outstanding() == ()
    ledger.assert_drained()


def test_outstanding_and_assert_drained_name_serial_and_pool() -> None:
    ledger = Ledger()
    a = _ticket(TARGET_POOL, clear=(2,))
    b_init = MambaInit(serial=mint_serial(), cow_src=(1,), cow_dst=(3,))
    b_target, b_draft = Ticket(pool=TARGET_POOL, op=b_init), Ticket(pool=DRAFT_POOL, op=b_init)
    ledger.register([b_target, b_draft])
    ledger.register([a])
    assert ledger.outstanding() == (a, b_draft, b_target)  # by serial, then pool name
    with pytest.raises(ResourceLeakError) as info:
        ledger.assert_drained()
    msg = str(info.value)
    assert "3 ticket(s) never consumed" in msg
    assert f"#{a.serial} for pool 'target'" in msg and "clear [2]" in msg
    assert f"#{b_init.serial} for pool 'draft'" in msg and "1->3" in msg
    with ledger.consuming(b_draft, DRAFT_POOL):
        pass
    with pytest.raises(ResourceLeakError, match=rf"#{b_init.serial} for pool 'target'") as info2:
        ledger.assert_drained()
    assert "'draft'" not in str(info2.value)
    for t in (a, b_target):
        with ledger.consuming(t, TARGET_POOL):
            pass
    ledger.assert_drained()


def test_counts_are_per_pool() -> None:
    ledger = Ledger()
    init = MambaInit(serial=mint_serial(), clear_slots=(4, 5), cow_src=(1, 1, 2), cow_dst=(3, 6, 7))
    tt, td = Ticket(pool=TARGET_POOL, op=init), Ticket(pool=DRAFT_POOL, op=init)
    other = _ticket(TARGET_POOL, clear=(2,))
    ledger.register([tt, td, other])
    for t in (tt, other):
        with ledger.consuming(t, TARGET_POOL):
            pass
    assert ledger.counts(TARGET_POOL) == PoolCounts(tickets=2, clears=3, cows=3)
    assert ledger.counts(DRAFT_POOL) == PoolCounts()
    with ledger.consuming(td, DRAFT_POOL):
        pass
    assert ledger.counts(DRAFT_POOL) == PoolCounts(tickets=1, clears=2, cows=3)
    assert ledger.num_consumed == 3


# -- apply_init -----------------------------------------------------------------------------------


def _pool(capacity: int = 7, seed: int = 3) -> MambaStatePool:
    pool = MambaStatePool(TARGET_POOL, SMALL_LAYOUT, capacity)
    random_fill(pool, seed)
    return pool


def test_clears_zero_exactly_the_cleared_rows() -> None:
    pool = _pool()
    before = pool.buffer.clone()
    apply_op(pool, MambaInit(serial=mint_serial(), clear_slots=(5, 2)))
    for row in range(pool.num_slots):
        if row in (2, 5):
            assert torch.count_nonzero(pool.buffer[row]) == 0
        else:
            assert torch.equal(pool.buffer[row], before[row]), row


def test_cow_copies_the_source_rows_bytes() -> None:
    pool = _pool()
    before = pool.buffer.clone()
    # one checkpoint feeding two requests, a second checkpoint, and a clear, in one launch
    apply_op(pool, MambaInit(serial=mint_serial(), clear_slots=(4,), cow_src=(1, 5, 1), cow_dst=(2, 3, 6)))
    assert torch.equal(pool.buffer[2], before[1])
    assert torch.equal(pool.buffer[3], before[5])
    assert torch.equal(pool.buffer[6], before[1])
    assert torch.count_nonzero(pool.buffer[4]) == 0
    for row in (0, 1, 5, 7):
        assert torch.equal(pool.buffer[row], before[row]), row


def test_apply_init_checks_every_slot_before_writing() -> None:
    pool = _pool(capacity=4)
    before = pool.buffer.clone()
    with pytest.raises(PlanExecutionError, match="cow dst slot 5 out of range"):
        apply_op(pool, MambaInit(serial=mint_serial(), clear_slots=(1, 2), cow_src=(3,), cow_dst=(5,)))
    assert torch.equal(pool.buffer, before)


# -- executor -------------------------------------------------------------------------------------


class RecordingModel:
    """Records each call and checks, at call time, the pool state the executor promised."""

    def __init__(self, check: object = None) -> None:
        self.calls: list[tuple[object, StagedExtend | None, StagedDecode | None]] = []
        self.check = check

    def forward(
        self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool
    ) -> torch.Tensor:
        if callable(self.check):
            self.check(plan, pool)
        self.calls.append((plan, extend, decode))
        return blank_logits(extend, decode)


def test_executor_runs_clears_then_copies_then_the_model() -> None:
    seen: dict[str, object] = {}
    w = make_world(capacity=6, live_slots=6, seed=11)
    before = w.pool.buffer.clone()
    _, plan = extend_plan(
        [
            request(1, 2, [5, 6, 7], 10),
            request(2, 3, [8, 9], 13, intent=CopyFrom(src=MambaSlot(1), prefix_len=4)),
            request(3, 4, [1], 15, intent=Continue(prefix_len=2)),
        ],
        ledger=w.ledger,
    )
    ticket = plan.tickets[0]

    def check(p: object, pool: MambaStatePool) -> None:
        seen["consumed"] = w.ledger.is_consumed(ticket)
        seen["cleared"] = torch.count_nonzero(pool.buffer[2]).item() == 0
        seen["copied"] = torch.equal(pool.buffer[3], before[1])
        seen["continued"] = torch.equal(pool.buffer[4], before[4])
        seen["others"] = all(torch.equal(pool.buffer[r], before[r]) for r in (0, 1, 5, 6))

    w.executor.model = RecordingModel(check)
    assert w.executor.execute(plan) == Sampled(rids=[1, 2, 3], tokens=[0, 0, 0])  # (the blank logits: token 0 per row)
    assert seen == {"consumed": True, "cleared": True, "copied": True, "continued": True, "others": True}
    model = w.executor.model
    assert isinstance(model, RecordingModel)
    [(p, ext, dec)] = model.calls
    assert p is plan and dec is None and ext is not None
    assert ext.slots.tolist() == [2, 3, 4]
    w.ledger.assert_drained()
    assert w.ledger.counts(TARGET_POOL) == PoolCounts(tickets=1, clears=1, cows=1)


def test_a_failing_model_does_not_give_the_ticket_back() -> None:
    """The init ops ran; a model error after them must not leave the ticket replayable."""

    class Boom:
        def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor:
            raise RuntimeError("model failed")

    w = make_world()
    _, plan = extend_plan([request(1, 2, [5], 10)], ledger=w.ledger)
    w.executor.model = Boom()
    with pytest.raises(RuntimeError, match="model failed"):
        w.executor.execute(plan)
    assert w.ledger.is_consumed(plan.tickets[0])
    w.ledger.assert_drained()


def test_mixed_plan_consumes_its_extend_ticket_and_stages_both_parts() -> None:
    w = make_world(capacity=6, live_slots=5, seed=5)
    before = w.pool.buffer.clone()
    model = RecordingModel()
    w.executor.model = model
    extend = prepare_for_extend([request(1, 4, [5, 6], 10), request(2, 5, [7], 12, intent=CopyFrom(src=MambaSlot(1), prefix_len=3))])
    running = decode_batch([7, 8], [2, 3], [9, 4], [30, 31])
    plan = lower(mix_with_running(extend, running), LowerContext())
    assert isinstance(plan, MixedPlan)
    w.ledger.register(plan.tickets)
    w.executor.execute(plan)
    w.ledger.assert_drained()
    assert torch.count_nonzero(w.pool.buffer[4]) == 0
    assert torch.equal(w.pool.buffer[5], before[1])
    for row in (0, 1, 2, 3, 6):
        assert torch.equal(w.pool.buffer[row], before[row]), row  # the decode rows keep their state
    [(p, ext, dec)] = model.calls
    assert p is plan and ext is not None and dec is not None
    assert ext.slots.tolist() == [4, 5]
    assert dec.slots.tolist() == [2, 3]
    assert dec.positions.tolist() == [8, 3]


def test_decode_and_idle_plans_consume_nothing() -> None:
    w = make_world(seed=9)
    model = RecordingModel()
    w.executor.model = model
    _, pending = extend_plan([request(1, 3, [5], 10)], ledger=w.ledger)  # registered, not run
    before = w.pool.buffer.clone()
    dplan = lower(decode_batch([4, 5], [1, 2], [3, 6], [20, 21]), LowerContext(pools=(TARGET_POOL, DRAFT_POOL)))
    assert isinstance(dplan, DecodePlan)
    w.executor.execute(dplan)
    assert w.executor.execute(IdlePlan()) == Ran(rids=[])
    assert torch.equal(w.pool.buffer, before)
    assert w.ledger.outstanding() == pending.tickets
    assert w.ledger.num_consumed == 0
    assert [type(c[0]) for c in model.calls] == [DecodePlan]  # idle calls no model
    (_, ext, dec) = model.calls[0]
    assert ext is None and dec is not None


def test_continuation_only_extend_consumes_nothing() -> None:
    w = make_world(seed=2)
    before = w.pool.buffer.clone()
    _, plan = extend_plan([request(1, 2, [5, 6], 10, intent=Continue(prefix_len=5))], ledger=w.ledger)
    assert plan.tickets == ()
    w.executor.execute(plan)
    assert torch.equal(w.pool.buffer, before)
    assert w.ledger.num_consumed == 0


def test_each_pool_consumes_its_own_ticket_once() -> None:
    target = make_world(pool_id=TARGET_POOL, seed=1)
    draft_pool = MambaStatePool(DRAFT_POOL, SMALL_LAYOUT, 4)
    random_fill(draft_pool, 2)
    draft = Executor(draft_pool, target.ledger)
    _, plan = extend_plan(
        [request(1, 2, [5, 6], 10), request(2, 3, [7], 12, intent=CopyFrom(src=MambaSlot(1), prefix_len=2))],
        pools=(TARGET_POOL, DRAFT_POOL),
        ledger=target.ledger,
    )
    draft_before = draft_pool.buffer.clone()
    target.executor.execute(plan)
    assert [t.pool for t in target.ledger.outstanding()] == [DRAFT_POOL]
    draft.execute(plan)
    target.ledger.assert_drained()
    assert torch.count_nonzero(draft_pool.buffer[2]) == 0
    assert torch.equal(draft_pool.buffer[3], draft_before[1])  # the draft pool's own checkpoint
    with pytest.raises(ResourceReplayError, match="'draft'"):
        draft.execute(plan)
    assert target.ledger.counts(DRAFT_POOL) == PoolCounts(tickets=1, clears=1, cows=1)


# -- staging --------------------------------------------------------------------------------------


def _extend_plan_for_staging() -> ExtendPlan:
    _, plan = extend_plan(
        [
            request(1, 2, [5, 6, 7], 10),
            request(2, 3, [8], 13, intent=Continue(prefix_len=6)),
            request(3, 4, [9, 1], 14, intent=CopyFrom(src=MambaSlot(1), prefix_len=4)),
        ]
    )
    return plan


def test_stage_extend_positions_and_cu_seqlens() -> None:
    plan = _extend_plan_for_staging()
    s = stage_extend(plan, torch.device("cpu"))
    assert s.slots.tolist() == [2, 3, 4]
    assert s.prefix_lens.tolist() == [0, 6, 4]
    assert s.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert s.input_ids.tolist() == [5, 6, 7, 8, 9, 1]
    assert s.kv_locs.tolist() == [10, 11, 12, 13, 14, 15]
    assert s.positions.tolist() == [0, 1, 2, 6, 4, 5]  # prefix_len + j
    for t in (s.slots, s.prefix_lens, s.cu_seqlens, s.input_ids, s.kv_locs, s.positions):
        assert t.dtype == torch.int64


def test_stage_decode_positions_are_seq_lens_minus_one() -> None:
    plan = lower(decode_batch([4, 5, 6], [1, 3, 2], [3, 1, 10], [20, 22, 21]), LowerContext())
    s = stage_decode(plan, torch.device("cpu"))
    assert s.slots.tolist() == [1, 3, 2]
    assert s.input_ids.tolist() == [7, 7, 7]
    assert s.positions.tolist() == [2, 0, 9]
    assert s.kv_locs.tolist() == [20, 22, 21]
    assert s.seq_lens.tolist() == [3, 1, 10]
    assert s.packed.dtype == torch.int64


def test_a_staged_plan_survives_the_next_staging() -> None:
    first = stage_decode(lower(decode_batch([1], [1], [3], [20]), LowerContext()), torch.device("cpu"))
    e1 = stage_extend(_extend_plan_for_staging(), torch.device("cpu"))
    stage_decode(lower(decode_batch([2], [2], [8], [21]), LowerContext()), torch.device("cpu"))
    _, other = extend_plan([request(9, 1, [3, 3], 40)])
    stage_extend(other, torch.device("cpu"))
    assert first.slots.tolist() == [1] and first.positions.tolist() == [2]
    assert e1.positions.tolist() == [0, 1, 2, 6, 4, 5]


# -- pool views -----------------------------------------------------------------------------------


def test_layout_is_aligned() -> None:
    for layout in (SMALL_LAYOUT, PoolLayout(layers=(MambaLayerSpec(conv_dim=3, kernel_width=2, nheads=1, head_dim=1, d_state=1),) * 3)):
        assert layout.row_bytes % layout.align == 0
        assert all(o % layout.align == 0 for o in layout.conv_offsets + layout.ssm_offsets)
    assert PoolLayout(layers=(MambaLayerSpec(conv_dim=3, kernel_width=2, nheads=1, head_dim=1, d_state=1),)).align == 256
    with pytest.raises(ValueError, match="align"):
        PoolLayout(layers=SMALL_LAYOUT.layers, align=24)


def _byte_ranges(pool: MambaStatePool) -> list[tuple[str, int, range]]:
    out = []
    for layer, spec in enumerate(pool.layout.layers):
        c, s = pool.layout.conv_offsets[layer], pool.layout.ssm_offsets[layer]
        out.append(("conv", layer, range(c, c + spec.conv_bytes)))
        out.append(("ssm", layer, range(s, s + spec.ssm_bytes)))
    return out


def test_views_alias_exactly_one_row_and_one_byte_range() -> None:
    pool = _pool(capacity=3, seed=4)
    ranges = _byte_ranges(pool)
    for kind, layer, rng in ranges:
        view = pool.conv_state(layer) if kind == "conv" else pool.ssm_state(layer)
        spec = pool.layout.layers[layer]
        assert view.shape == ((pool.num_slots,) + (spec.conv_shape if kind == "conv" else spec.ssm_shape))
        assert view.dtype == (spec.conv_dtype if kind == "conv" else spec.ssm_dtype)
        assert view.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()
        for slot in (1, 3):
            before = pool.buffer.clone()
            view[slot].fill_(1.5)
            changed = (pool.buffer != before).nonzero().tolist()
            assert changed, (kind, layer, slot)
            assert {r for r, _ in changed} == {slot}
            assert all(b in rng for _, b in changed), (kind, layer, slot)
            # read back through a fresh view: the buffer is the state
            fresh = pool.conv_state(layer) if kind == "conv" else pool.ssm_state(layer)
            assert bool((fresh[slot] == 1.5).all())


def test_sub_states_do_not_overlap() -> None:
    pool = MambaStatePool(TARGET_POOL, SMALL_LAYOUT, 2)
    spans = sorted((r.start, r.stop) for _, _, r in _byte_ranges(pool))
    assert all(a_stop <= b_start for (_, a_stop), (b_start, _) in pairwise(spans))
    assert spans[-1][1] <= pool.layout.row_bytes
    views = [(pool.conv_state(i), pool.ssm_state(i)) for i in range(len(SMALL_LAYOUT.layers))]
    for k, (c, s) in enumerate(views):
        c[2].fill_(10 + k)
        s[2].fill_(20 + k)
    for k, (c, s) in enumerate(views):
        assert bool((c[2] == 10 + k).all()) and bool((s[2] == 20 + k).all())
    assert torch.count_nonzero(pool.buffer[0]) == 0 and torch.count_nonzero(pool.buffer[1]) == 0


def test_pool_has_a_padding_row() -> None:
    pool = MambaStatePool(TARGET_POOL, SMALL_LAYOUT, 5)
    assert pool.num_slots == 6
    assert tuple(pool.buffer.shape) == (6, SMALL_LAYOUT.row_bytes)
    assert pool.buffer.dtype == torch.uint8
    with pytest.raises(ValueError, match="capacity"):
        MambaStatePool(TARGET_POOL, SMALL_LAYOUT, 0)


@pytest.mark.parametrize("cls", [SlotAllocator, KVAllocator])
def test_an_allocator_costs_memory_for_what_it_hands_out_not_for_its_capacity(cls: type[SlotAllocator] | type[KVAllocator]) -> None:
    tracemalloc.start()
    try:
        a = cls(10**12)
        taken = a.alloc_many(1000)
        a.free_many(taken[:10].tolist())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes for 1000 indices of a 10**12 capacity"
    assert a.num_live == 990 and a.num_free == 10**12 - 990
    assert [int(i) for i in a.alloc_many(12)] == [10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 1001, 1002]  # freed last-first, then fresh
    assert sorted(a.live()) == list(range(1, 1003))


def test_a_bulk_request_beyond_memory_is_refused_and_changes_nothing() -> None:
    """Run in a child whose address space is capped at 3 GB: the request cannot be held, and the
    allocator stays usable."""
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "from backend.allocator import KVAllocator\n"
        "from ir.errors import SlotError\n"
        "a = KVAllocator(2**40)\n"
        "try:\n"
        "    a.alloc_many(2**33)\n"
        "except SlotError as e:\n"
        "    print('refused:', e)\n"
        "print(a.num_free == 2**40, a.num_live, a.alloc_many(3).tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.splitlines() == ["refused: out of memory handing out 8589934592 KV locations at once", "True 0 [1, 2, 3]"]
