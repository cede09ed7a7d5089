"""The engine's parts on their own: KV reference counts, the request table's state machine, and the
typed report each step returns."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest

from backend.allocator import KVAllocator
from backend.hybrid.config import tiny
from backend.hybrid.model import HybridModel
from compiler.engine import Engine, RequestState, StepKind
from compiler.engine.kv_refs import KVRefs
from compiler.engine.requests import Request, RequestTable
from ir.columns import frozen_i64
from ir.errors import SlotError
from ir.ids import MambaSlot, RequestId


class _Recording(KVAllocator):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.freed: list[list[int]] = []

    def free_many(self, indices: Iterable[int]) -> None:
        items = list(indices)
        self.freed.append(items)
        super().free_many(items)


def test_kv_refs_free_a_location_with_its_last_reference_in_order() -> None:
    kv = _Recording(16)
    refs = KVRefs(kv)
    a = refs.alloc(4)  # one reference each
    refs.ref(a[:2])  # a prefix shared by a second holder
    assert refs.held() == {int(a[0]): 2, int(a[1]): 2, int(a[2]): 1, int(a[3]): 1}
    refs.unref([int(a[3]), int(a[0]), int(a[2]), int(a[1])])
    assert refs.held() == {int(a[0]): 1, int(a[1]): 1}
    assert kv.live() == frozenset({int(a[0]), int(a[1])})
    assert kv.freed == [[int(a[3]), int(a[2])]]  # freed together, in the order they were dropped
    refs.unref(a[:2])
    assert refs.held() == {} and refs.count(int(a[0])) == 0


def test_kv_refs_refuse_dropping_a_reference_nobody_holds_and_change_nothing() -> None:
    kv = KVAllocator(8)
    refs = KVRefs(kv)
    a = refs.alloc(2)
    before = (refs.held(), kv.live())
    for bad in ([int(a[0]), int(a[0])], [7], [int(a[1]), 100]):
        with pytest.raises(SlotError, match="a reference was dropped that nobody holds"):
            refs.unref(bad)
        assert (refs.held(), kv.live()) == before


def test_kv_refs_grow_with_the_highest_location_not_the_capacity() -> None:
    refs = KVRefs(KVAllocator(2**31))
    refs.ref([5, 1_000_000])
    assert refs.count(1_000_000) == 1 and refs.count(5) == 1 and refs.count(6) == 0
    assert refs.nbytes < 64 * 1024 * 1024  # the counts are sized by use (about 8 MB here), not by the 2**31 capacity


def _req(rid: int) -> Request:
    p = frozen_i64([1, 2, 3])
    return Request(rid=RequestId(rid), prompt=p, original=p, max_new_tokens=2, stop=None)


def test_request_table_moves_requests_through_their_states() -> None:
    table = RequestTable()
    r1, r2 = _req(1), _req(2)
    table.add(r1)
    table.add(r2)
    assert table.queued == [1, 2] and r1.state is RequestState.WAITING
    table.started(r1, MambaSlot(0))
    assert r1.state is RequestState.PREFILLING and r1.slot == 0 and table.kv_owed() == 3
    r1.done = 3
    table.prefilled(r1)
    assert r1.state is RequestState.RUNNING and table.queued == [2]
    fresh = _req(1)
    table.requeue(fresh)  # a retraction: back to WAITING, first in line
    assert table.queued == [1, 2] and table[RequestId(1)] is fresh and len(table) == 2
    assert table.remove(RequestId(2)) is r2 and table.queued == [1] and RequestId(2) not in table


def test_each_step_reports_what_it_did() -> None:
    target = HybridModel.from_seed(tiny(), seed=0)
    drv = Engine(target, None, k=0, capacity=4, kv_capacity=128, max_len=32, mixed=False)
    drv.admit(RequestId(1), list(b"abc"), max_new_tokens=2)
    drv.admit(RequestId(2), list(b"de"), max_new_tokens=1)
    first = drv.step()
    assert first.kind is StepKind.EXTEND
    assert (first.requests, first.prefill_tokens, first.tokens) == (2, 5, 2)
    assert first.finished == (RequestId(2),) and first.aborted == () and first.seconds >= 0
    second = drv.step()
    assert second.kind is StepKind.DECODE and (second.requests, second.prefill_tokens, second.tokens) == (1, 0, 1)
    assert second.finished == (RequestId(1),)
    assert drv.step().kind is StepKind.IDLE
    assert sorted(drv.outputs) == [1, 2] and len(drv.outputs[RequestId(1)]) == 2
    assert drv.kv_refs.held() == {} and drv.slots.num_live == 0 and np.asarray(drv.running.rids).size == 0
