"""A prefill that must drop a request before it runs (an admission rolled back, a request aborted
between lowering and execution) has a typed path, ``Pipeline.withdraw``: the lowered plan's tickets
are cancelled (recorded with the reason), the remaining requests lowered under fresh serials, and
the dropped request's slot is named by no outstanding ticket, so it can go to another request at
once. One test per order of abort and lowering: before lowering, after lowering, while the forward
runs, after it ran. The pool's rows are compared byte for byte, not only the ledger's books."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest
import torch

from backend.executor import Executor
from backend.ledger import Ledger
from compiler.manager import PassError, PassManager
from compiler.steps import Pipeline
from compiler.testing.fakes import FakeModel, small_pool
from ir.batch import ExtendBatch
from ir.errors import PreconditionError, ResourceReplayError, TicketMismatchError, UnknownTicketError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, PoolId, RequestId
from ir.init import Op, Ticket
from ir.plan import ExtendPlan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from passes import filter_batch, lower, prepare_for_extend
from passes.lower import LowerContext

CACHE_SRC, CACHE_DST = 6, 7
"""A cached prefix's state (copied from) and the cache slot the prefill snapshots into."""


def _requests(*rids: int) -> list[AdmittedRequest]:
    """Request ``r`` in slot ``r``: 1 and 3 fresh (a clear), 2 from a cached prefix (a copy) with a
    snapshot into ``CACHE_DST``."""
    out = []
    for r in rids:
        intent = CopyFrom(src=MambaSlot(CACHE_SRC), prefix_len=2) if r == 2 else Clear()
        out.append(AdmittedRequest(rid=RequestId(r), slot=MambaSlot(r), input_ids=[4, 5], kv_locs=[10 * r, 10 * r + 1], intent=intent,
                                   snapshot_to=MambaSlot(CACHE_DST) if r == 2 else None))
    return out


class World:
    """A pipeline over two pools (target and draft), an executor per pool whose every row holds
    bytes of its own before the test (row ``r`` filled with ``r + 1``)."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.pipe = Pipeline(self.ledger, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)), PassManager(verify_level=2))
        self.executors = [Executor(small_pool(str(p), 8), self.ledger, FakeModel(), watch=False) for p in (TARGET_POOL, DRAFT_POOL)]
        for ex in self.executors:
            for row in range(ex.pool.num_slots):
                ex.pool.buffer[row] = row + 1

    def rows(self) -> list[torch.Tensor]:
        return [ex.pool.buffer.clone() for ex in self.executors]

    def run(self, plan: ExtendPlan) -> None:
        for ex in self.executors:
            ex.execute(plan)


@pytest.fixture
def world() -> Iterator[World]:
    w = World()
    yield w
    w.ledger.assert_drained()  # every ticket consumed or cancelled, none stuck in flight


def _changed_rows(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    rows = {int(r) for b, a in zip(before, after, strict=True) for r in (b != a).any(dim=1).nonzero().flatten().tolist()}
    return rows


def _assert_ran(world: World, before: list[torch.Tensor], cleared: set[int], copied: set[int]) -> None:
    """After a prefill ran: exactly the ``cleared`` rows zeroed, each ``copied`` row the cached
    prefix's state, the snapshot's cache row the copied state when request 2 ran, nothing else moved."""
    after = world.rows()
    snap = {CACHE_DST} if copied else set()
    assert _changed_rows(before, after) == cleared | copied | snap
    for pool in after:
        for r in cleared:
            assert not pool[r].any()
        for r in copied | snap:
            assert torch.equal(pool[r], pool[CACHE_SRC])


def test_abort_before_lowering_is_a_filter_and_the_dropped_slot_is_never_touched(world: World) -> None:
    pm = world.pipe.pm
    batch = pm.run(filter_batch, pm.run(prepare_for_extend, _requests(1, 2, 3), None), [RequestId(2)])
    plan: ExtendPlan = pm.run(lower, batch, world.pipe.lower_ctx)
    world.ledger.register((*plan.tickets, *plan.snapshots))
    before = world.rows()
    world.run(plan)
    _assert_ran(world, before, cleared={1, 3}, copied=set())
    assert world.ledger.cancelled() == {}


def test_abort_after_lowering_cancels_the_plan_and_runs_the_rest_under_fresh_serials(world: World) -> None:
    batch, plan = world.pipe.prefill(_requests(1, 2, 3))
    tickets: list[Ticket[Op]] = [*plan.tickets, *plan.snapshots]
    old = {(t.serial, t.pool) for t in tickets}
    assert len(old) == 4  # an init and a snapshot ticket per pool
    new_batch, new_plan = world.pipe.withdraw(batch, plan, [RequestId(2)], reason="request 2 aborted before its prefill")
    assert world.ledger.cancelled() == dict.fromkeys(old, "request 2 aborted before its prefill")
    assert new_batch.rids.tolist() == [1, 3] and new_plan.rids.tolist() == [1, 3] and new_plan.snapshots == ()
    assert {t.serial for t in new_plan.tickets}.isdisjoint({s for s, _ in old})
    assert {(t.serial, t.pool) for t in world.ledger.outstanding()} == {(t.serial, t.pool) for t in new_plan.tickets}
    before = world.rows()
    with pytest.raises(TicketMismatchError, match=r"does not carry ticket .*which must run on that row first"):
        world.executors[0].execute(plan)  # type: ignore[linear-reuse]  # the withdrawn plan, before the new one ran: refused, the pool unmoved
    assert _changed_rows(before, world.rows()) == set()
    world.run(new_plan)
    _assert_ran(world, before, cleared={1, 3}, copied=set())  # slot 2 and both cache rows untouched
    after = world.rows()
    for ex in world.executors:
        with pytest.raises(ResourceReplayError, match=r"was cancelled"):
            ex.execute(plan)  # type: ignore[linear-reuse]  # and after it: a cancelled ticket is a replay
    assert _changed_rows(after, world.rows()) == set()


def test_the_dropped_slot_goes_to_another_request_at_once(world: World) -> None:
    batch, plan = world.pipe.prefill(_requests(1, 2))
    _, rest = world.pipe.withdraw(batch, plan, [RequestId(2)], reason="admission rolled back")
    for ex in world.executors:
        world.ledger.rows_free([2], ex.pool.pool_id, "the next prefill")  # no outstanding ticket names slot 2
    newcomer = AdmittedRequest(rid=RequestId(9), slot=MambaSlot(2), input_ids=[7], kv_locs=[90], intent=Clear())
    _, next_plan = world.pipe.prefill([newcomer])
    before = world.rows()
    world.run(rest)
    world.run(next_plan)
    _assert_ran(world, before, cleared={1, 2}, copied=set())


def test_abort_while_the_forward_runs_is_refused_and_changes_nothing(world: World) -> None:
    batch, plan = world.pipe.prefill(_requests(1, 2))
    target = world.executors[0]
    own = [t for t in plan.tickets if t.pool == target.pool.pool_id]
    with pytest.raises(RuntimeError, match="the forward failed"), world.ledger.claiming(own, target.pool.pool_id, plan="the prefill"):
        outstanding = world.ledger.outstanding()
        with pytest.raises(ResourceReplayError, match="cannot cancel .*: it has run or is running"):
            world.pipe.withdraw(batch, plan, [RequestId(2)], reason="too late")
        assert world.ledger.cancelled() == {} and world.ledger.outstanding() == outstanding
        raise RuntimeError("the forward failed")
    # the claim's block failed: its tickets are outstanding again, and the plan runs whole
    world.run(plan)


def test_abort_after_the_forward_ran_is_refused_and_changes_nothing(world: World) -> None:
    batch, plan = world.pipe.prefill(_requests(1, 2))
    world.run(plan)
    with pytest.raises(ResourceReplayError, match="cannot cancel .*: it has run or is running"):
        world.pipe.withdraw(batch, plan, [RequestId(1)], reason="too late")
    assert world.ledger.cancelled() == {} and world.ledger.outstanding() == ()


def test_withdrawing_every_request_leaves_an_empty_plan_and_no_ticket(world: World) -> None:
    batch, plan = world.pipe.prefill(_requests(1, 2))
    empty, empty_plan = world.pipe.withdraw(batch, plan, [RequestId(1), RequestId(2)], reason="all aborted")
    assert empty.num_requests == 0 and empty_plan.num_requests == 0 and empty_plan.tickets == () and empty_plan.snapshots == ()
    assert world.ledger.outstanding() == () and len(world.ledger.cancelled()) == 4


def test_withdrawing_twice_in_a_row(world: World) -> None:
    batch, plan = world.pipe.prefill(_requests(1, 2, 3))
    batch, plan = world.pipe.withdraw(batch, plan, [RequestId(3)], reason="first abort")
    batch, plan = world.pipe.withdraw(batch, plan, [RequestId(1)], reason="second abort")
    assert plan.rids.tolist() == [2] and len(world.ledger.cancelled()) == 4 + 4
    before = world.rows()
    world.run(plan)
    _assert_ran(world, before, cleared=set(), copied={2})


def test_a_bad_withdrawal_is_refused_before_anything_is_cancelled(world: World) -> None:
    batch, plan = world.pipe.prefill(_requests(1, 2))
    other_batch, other_plan = world.pipe.prefill(_requests(3))
    outstanding = world.ledger.outstanding()
    with pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: the plan's requests \[3\] are not the batch's \[1, 2\]$"):
        world.pipe.withdraw(batch, other_plan, [RequestId(1)], reason="x")
    with pytest.raises(PassError, match=r"^pass 'withdraw' failed: PreconditionError: withdraw: drop: request 5 is not in this prefill \(its requests: \[1, 2\]\)"):
        world.pipe.withdraw(batch, plan, [RequestId(5)], reason="x")
    with pytest.raises(PassError, match=r"withdraw: drop names request 1 twice"):
        world.pipe.withdraw(batch, plan, [RequestId(1), RequestId(1)], reason="x")  # type: ignore[linear-reuse]  # each refused withdrawal leaves the plan as it was
    with pytest.raises(PassError, match=r"withdraw: drop must be an iterable of request ids"):
        world.pipe.withdraw(batch, plan, "1", reason="x")  # type: ignore[arg-type, linear-reuse]  # the wrong type is the test; refused, it leaves the plan as it was
    with pytest.raises(PreconditionError, match=r"^Ledger\.cancel_all: reason must be a non-empty str, got ''$"):
        world.pipe.withdraw(batch, plan, [RequestId(1)], reason="")  # type: ignore[linear-reuse]  # each refused withdrawal leaves the plan as it was
    assert world.ledger.cancelled() == {} and world.ledger.outstanding() == outstanding
    world.run(plan)
    world.run(other_plan)


def test_a_plan_from_a_batch_of_the_same_requests_lowered_again_is_not_the_batchs() -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, pm=PassManager(verify_level=2))
    batch, plan = pipe.prefill(_requests(1))
    again: ExtendBatch = prepare_for_extend(_requests(1), None)  # the same requests, another serial
    with pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: .* is not of this batch's init \(serial \d+\): the plan was not lowered from it$"):
        pipe.withdraw(again, plan, [RequestId(1)], reason="x")
    ledger.cancel_all(plan.tickets, "test over")


def test_cancel_all_is_all_or_nothing() -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, LowerContext(pools=(TARGET_POOL, PoolId("other"))))
    _, first = pipe.prefill(_requests(1))
    _, second = pipe.prefill(_requests(3))
    ledger.cancel(second.tickets[0], "one of them")
    with pytest.raises(UnknownTicketError, match=r"cannot cancel .*: it was cancelled already"):
        ledger.cancel_all((*first.tickets, *second.tickets), "both plans")
    assert set(ledger.outstanding()) == {*first.tickets, second.tickets[1]}  # the first plan's tickets not cancelled
    ledger.cancel_all((*first.tickets, second.tickets[1]), "both plans")
    assert ledger.outstanding() == () and len(ledger.cancelled()) == 4
    with pytest.raises(UnknownTicketError, match=r"not outstanding in this ledger"):
        Ledger().cancel_all(first.tickets, "a ledger that never saw them")


def test_a_ticketless_plan_of_another_batch_is_refused(world: World) -> None:
    """A continuation chunk's plan carries no ticket: the batch it belongs to is told by its columns
    and by the ops the batch declares, not by tickets alone."""
    first = AdmittedRequest(rid=RequestId(1), slot=MambaSlot(1), input_ids=[4, 5], kv_locs=[10, 11], intent=Clear(), more_chunks=True)
    batch_a, plan_a = world.pipe.prefill([first])
    world.run(plan_a)
    cont_req = AdmittedRequest(rid=RequestId(1), slot=MambaSlot(1), input_ids=[6], kv_locs=[12], intent=Continue(prefix_len=2))
    _, plan_b = world.pipe.prefill([cont_req])
    assert plan_b.tickets == () and plan_b.snapshots == ()
    with pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: the plan's prefix_lens are not the batch's: the plan was not lowered from it$"):
        world.pipe.withdraw(batch_a, plan_b, [], reason="mixed up")
    assert world.ledger.outstanding() == () and world.ledger.cancelled() == {}


def test_cancel_all_refuses_a_ticket_with_other_ops_than_the_registered_one(world: World) -> None:
    _, plan = world.pipe.prefill(_requests(1))
    forged = attrs.evolve(plan.tickets[0], op=attrs.evolve(plan.tickets[0].op, clear_slots=(MambaSlot(7),)))
    with pytest.raises(TicketMismatchError, match=r"to be cancelled with other ops: .*registered ops clear \[1\], cow \[\]; these ops clear \[7\], cow \[\]"):
        world.ledger.cancel_all([forged], "forged")
    assert world.ledger.cancelled() == {}
    world.run(plan)
