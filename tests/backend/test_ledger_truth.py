"""The registered ticket is the truth, and every ticket of a plan is claimed before its forward.

Each hostile plan below is refused with a typed error before a byte of the pool moves (pool bytes,
ledger, allocators and the model's call count unchanged), and the genuine plan still runs after it:

- a forged-ops plan (the outstanding serial, other ops: ``attrs.evolve(plan, tickets=...)``, or a
  fresh ``MambaInit`` with that serial);
- a swapped-tickets plan (plan A carrying plan B's outstanding ticket);
- a replay of a plan whose only one-shot op is a snapshot (a CONTINUE chunk ending at a cache
  boundary), on a plain and on a transactional executor, as an extend and inside a MIXED forward;
- a commit naming other slots than its verify ran on.

Plus the ledger's own rules: re-registration with other ops, squatted serials, trusted peers,
tickets stuck in flight, and serials that differ across processes.
"""

from __future__ import annotations

import multiprocessing
import pickle
import re
import secrets
from collections.abc import Callable

import attrs
import numpy as np
import pytest
import torch
from typeguard import suppress_type_checks

import ir.init
from backend.executor import Executor
from backend.ledger import Ledger
from backend.model import blank_logits
from backend.pool import MambaStatePool
from backend.staging import StagedDecode, StagedExtend
from ir.errors import IRValidationError, PlanExecutionError, ResourceLeakError, ResourceReplayError, SlotError, TicketMismatchError, UnknownTicketError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, PoolId, TicketSerial
from ir.init import InitTicket, MambaInit, MambaSnapshot, Ticket, mint_serial, minted_here, serial_epoch, this_epoch
from ir.plan import ExtendPlan, MixedPlan
from ir.request import Continue, CopyFrom
from ir.spec import AcceptResult, CommitPlan
from passes.accept import accept
from passes.commit import commit
from passes.lower import LowerContext, lower
from passes.mix_with_running import mix_with_running
from passes.prepare_for_decode import DecodeContext, prepare_for_decode
from passes.prepare_for_draft import SpecContext, prepare_for_draft
from passes.prepare_for_extend import prepare_for_extend
from passes.prepare_for_verify import prepare_for_verify
from tests.helpers import ToySpecModel, World, decode_batch, extend_plan, make_world, proposed, request, verified


class CountingModel(ToySpecModel):
    """The toy speculative hook, counting forwards and writing a marker into every row it runs on
    (so a forward that ran shows in the pool bytes)."""

    def __init__(self) -> None:
        self.forwards = 0

    def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor:
        self.forwards += 1
        for staged in (extend, decode):
            if staged is not None:
                for s in staged.slots.tolist():
                    pool.buffer[s].add_(1)
        return blank_logits(extend, decode)


def _world(*, transactional: bool = False) -> tuple[World, CountingModel]:
    model = CountingModel()
    w = make_world(capacity=6, live_slots=5, model=model)
    w.executor = Executor(w.pool, w.ledger, model, slots=w.slots, transactional=transactional)
    return w, model


def _refused(w: World, model: CountingModel, run: Callable[[], object], error: type[Exception] | tuple[type[Exception], ...], match: str) -> None:
    """``run`` raises ``error`` (message matching ``match``) and changes nothing."""
    before, forwards = w.state(), model.forwards
    with pytest.raises(error, match=match):
        run()
    after = w.state()
    assert torch.equal(before[0], after[0]), "pool bytes changed"
    assert before[1:] == after[1:], "ledger or allocators changed"
    assert model.forwards == forwards, "the model ran"


def _two_prefills(w: World) -> tuple[ExtendPlan, ExtendPlan]:
    """Plan A (fresh request in slot 1) and plan B (slot 2 starts as a copy of cache slot 4), both
    registered and outstanding."""
    _, a = extend_plan([request(1, 1, [5, 6], 0)], ledger=w.ledger)
    _, b = extend_plan([request(2, 2, [7], 8, intent=CopyFrom(src=MambaSlot(4), prefix_len=3))], ledger=w.ledger)
    return a, b


# -- the registered ticket is the truth ---------------------------------------------------------


@pytest.mark.parametrize("transactional", [False, True])
def test_forged_ops_under_an_outstanding_serial_are_refused_and_the_registered_ops_run(transactional: bool) -> None:
    w, model = _world(transactional=transactional)
    _, b = _two_prefills(w)
    serial = b.tickets[0].serial
    # same serial, same pool, other ops: clear the plan's own row instead of copying the checkpoint
    forged_init = MambaInit(serial=serial, clear_slots=(2,))
    forged = attrs.evolve(b, tickets=(Ticket(pool=TARGET_POOL, op=forged_init),))
    match = rf"ticket #{serial} for pool 'target' handed to the executor with other ops.*registered ops clear \[\], cow \[4->2\]; these ops clear \[2\], cow \[\]"
    _refused(w, model, lambda: w.executor.execute(forged), TicketMismatchError, match)
    # the genuine plan runs the registered COW
    before = w.pool.buffer.clone()
    w.executor.execute(b)
    assert torch.equal(w.pool.buffer[2], before[4] + 1)  # copied from slot 4, then the forward's marker
    assert w.ledger.is_consumed(b.tickets[0])


@pytest.mark.parametrize("transactional", [False, True])
def test_an_op_changed_in_place_after_registration_is_refused(transactional: bool) -> None:
    """The ledger keeps its own copy of what was registered: a plan whose op object is changed in
    place afterwards (a frozen node written through ``object.__setattr__``) no longer matches it."""
    w, model = _world(transactional=transactional)
    a, _ = _two_prefills(w)
    serial = a.tickets[0].serial
    op = a.tickets[0].op
    assert op.clear_slots == (1,)
    with suppress_type_checks():
        object.__setattr__(op, "clear_slots", (MambaSlot(5),))  # slot 5 is another request's live row
    mismatch = rf"ticket #{serial} for pool 'target' handed to the executor with other ops.*registered ops clear \[1\], cow \[\]; these ops clear \[5\], cow \[\]"
    stray = rf"init #{serial} writes slot 5, which is not a row of this plan \(rows \[1\]\)"
    # the ledger's check, or the executor's own check of the op's rows where it runs first (the
    # transactional executor, once its cache of the op's rows has seen the changed op)
    _refused(w, model, lambda: w.executor.execute(a), (TicketMismatchError, PlanExecutionError), f"(?:{mismatch})|(?:{stray})")
    assert w.ledger.outstanding() and not w.ledger.is_consumed(a.tickets[0])
    # the snapshot's ops are kept the same way
    r = attrs.evolve(request(3, 3, [5, 6], 10, intent=Continue(prefix_len=3)), snapshot_to=MambaSlot(4))
    plan = lower(prepare_for_extend([r]), LowerContext())
    w.ledger.register(plan.snapshots)
    with suppress_type_checks():
        object.__setattr__(plan.snapshots[0].op, "dst", (MambaSlot(6),))
    # refused by the ledger (its copy), or first by the executor's live-slot check where the changed op's
    # slots are read afresh (ir.init.op_groups caches an op's slots by identity, so which check
    # reads the change first depends on that cache): either way before anything moves
    mismatch = r"registered ops snapshot \[3->4\]; these ops snapshot \[3->6\]"
    stale = rf"use after free: snapshot #{plan.snapshots[0].serial} uses slot 6, which is not live"
    _refused(w, model, lambda: w.executor.execute(plan), (TicketMismatchError, SlotError), f"(?:{mismatch})|(?:{stale})")


def test_forged_snapshot_ops_are_refused() -> None:
    w, model = _world()
    r = attrs.evolve(request(1, 1, [5, 6], 10, intent=Continue(prefix_len=3)), snapshot_to=MambaSlot(4))
    plan = lower(prepare_for_extend([r]), LowerContext())
    w.ledger.register(plan.snapshots)
    snap = plan.snapshots[0].op
    forged = attrs.evolve(plan, snapshots=(Ticket(pool=TARGET_POOL, op=attrs.evolve(snap, dst=(5,))),))
    _refused(w, model, lambda: w.executor.execute(forged), TicketMismatchError, r"registered ops snapshot \[1->4\]; these ops snapshot \[1->5\]")


def test_swapped_tickets_are_refused_before_anything_moves() -> None:
    w, model = _world()
    a, b = _two_prefills(w)
    swapped = attrs.evolve(a, tickets=b.tickets)  # A's rows, B's outstanding COW into slot 2
    _refused(w, model, lambda: w.executor.execute(swapped), PlanExecutionError, r"init #\d+ writes slot 2, which is not a row of this plan \(rows \[1\]\)")
    for plan in (a, b):
        w.executor.execute(plan)
    w.ledger.assert_drained()


@pytest.mark.parametrize("transactional", [False, True])
def test_a_plan_stripped_of_its_outstanding_tickets_is_refused(transactional: bool) -> None:
    """Dropping the ticket (``attrs.evolve(plan, tickets=())``) does not drop the op: a registered
    ticket over a plan's row must travel with the plan, and a row starting at token 0 needs the
    plan's own clear."""
    w, model = _world(transactional=transactional)
    a, b = _two_prefills(w)
    a_serial, b_serial = a.tickets[0].serial, b.tickets[0].serial
    _refused(w, model, lambda: w.executor.execute(attrs.evolve(b, tickets=())), TicketMismatchError,
             rf"ExtendPlan over slot 2 of pool 'target' does not carry ticket #{b_serial} .*cow \[4->2\]")
    _refused(w, model, lambda: w.executor.execute(attrs.evolve(a, tickets=())), TicketMismatchError,
             rf"ExtendPlan over slot 1 of pool 'target' does not carry ticket #{a_serial}")
    # plan A carrying B's ticket with a row of B's: B's COW would run on A's forward, A's clear never
    a2 = ExtendPlan(rids=[1, 2], slots=[1, 2], prefix_lens=[0, 3], extend_lens=[2, 1], more_chunks=[False, False],
                    input_ids=[5, 6, 7], kv_locs=[0, 1, 8], tickets=b.tickets)
    _refused(w, model, lambda: w.executor.execute(a2), TicketMismatchError, rf"over slot 1 of pool 'target' does not carry ticket #{a_serial}")
    # a decode over a row whose clear has not run yet
    d = lower(decode_batch([1], [1], [2], [9]), LowerContext())
    _refused(w, model, lambda: w.executor.execute(d), TicketMismatchError, rf"DecodePlan over slot 1 .* does not carry ticket #{a_serial}")
    for plan in (a, b):
        w.executor.execute(plan)
    w.ledger.assert_drained()
    # once consumed, a stripped replay of A is still refused: its row starts at token 0 and nothing clears it
    _refused(w, model, lambda: w.executor.execute(attrs.evolve(a, tickets=())), PlanExecutionError,
             r"ExtendPlan: slot 1 starts at token 0 but the plan's init does not clear it \(init: none for this pool\)")


def test_a_plan_stripped_of_its_snapshot_is_refused() -> None:
    w, model = _world()
    r = attrs.evolve(request(1, 1, [5, 6], 10, intent=Continue(prefix_len=3)), snapshot_to=MambaSlot(4))
    plan = lower(prepare_for_extend([r]), LowerContext())
    w.ledger.register(plan.snapshots)
    serial = plan.snapshots[0].serial
    _refused(w, model, lambda: w.executor.execute(attrs.evolve(plan, snapshots=())), TicketMismatchError,
             rf"ExtendPlan over slot 1 of pool 'target' does not carry snapshot ticket #{serial}")
    w.executor.execute(plan)
    w.ledger.assert_drained()


def test_one_serial_carries_the_same_ops_for_every_pool() -> None:
    serial = mint_serial()
    target = Ticket(pool=TARGET_POOL, op=MambaInit(serial=serial, clear_slots=(1,)))
    draft = Ticket(pool=DRAFT_POOL, op=MambaInit(serial=serial, clear_slots=(2,)))
    with pytest.raises(IRValidationError, match=r"ExtendPlan\.tickets: tickets of one plan carry the same ops for every pool"):
        ExtendPlan(rids=[1], slots=[1], prefix_lens=[0], extend_lens=[1], more_chunks=[False], input_ids=[5], kv_locs=[0],
                   tickets=(target, draft))


def test_a_snapshot_must_read_the_plans_rows_and_write_outside_them() -> None:
    w, model = _world()
    r = attrs.evolve(request(1, 1, [5, 6], 10, intent=Continue(prefix_len=3)), snapshot_to=MambaSlot(4))
    plan = lower(prepare_for_extend([r]), LowerContext())
    other = ExtendPlan(
        rids=[2], slots=[3], prefix_lens=[3], extend_lens=[2], more_chunks=[False], input_ids=[5, 6], kv_locs=[20, 21],
        tickets=(), snapshots=plan.snapshots,
    )
    w.ledger.register(plan.snapshots)
    _refused(w, model, lambda: w.executor.execute(other), PlanExecutionError, r"snapshot #\d+ reads slot 1, which is not a row of this plan")


def test_register_refuses_another_ticket_under_an_outstanding_key() -> None:
    ledger = Ledger()
    serial = mint_serial()
    t = Ticket(pool=DRAFT_POOL, op=MambaInit(serial=serial, clear_slots=(1,)))
    ledger.register([t])
    ledger.register([t])  # the same ticket again: a no-op
    other = Ticket(pool=DRAFT_POOL, op=MambaInit(serial=serial, cow_src=(3,), cow_dst=(1,)))
    with pytest.raises(TicketMismatchError, match=rf"#{serial} for pool 'draft' registered again with other ops.*clear \[1\].*cow \[3->1\]"):
        ledger.register([other])
    with pytest.raises(TicketMismatchError):
        ledger.register([Ticket(pool=TARGET_POOL, op=other.op), Ticket(pool=TARGET_POOL, op=t.op)])
    assert ledger.outstanding() == (t,)
    assert ledger.minted(DRAFT_POOL).tickets == 1 and ledger.minted(TARGET_POOL).tickets == 0


def test_one_serial_is_registered_with_one_set_of_ops_for_every_pool() -> None:
    ledger = Ledger()
    serial = mint_serial()
    target = Ticket(pool=TARGET_POOL, op=MambaInit(serial=serial, clear_slots=(1,)))
    ledger.register([target])
    other = Ticket(pool=DRAFT_POOL, op=MambaInit(serial=serial, clear_slots=(2,)))
    with pytest.raises(TicketMismatchError, match=r"registered for pool 'draft' with other ops than for pool 'target'.*clear \[1\].*clear \[2\]"):
        ledger.register([other])
    assert ledger.outstanding() == (target,)
    same = Ticket(pool=DRAFT_POOL, op=target.op)
    ledger.register([same])  # the same ops for the draft pool: the normal case
    assert set(ledger.outstanding()) == {target, same}


def test_serials_cannot_be_squatted() -> None:
    ledger = Ledger()
    mine = mint_serial()
    assert minted_here(mine) and serial_epoch(mine) == this_epoch()
    future = TicketSerial(mine + 1000)  # the right epoch, but not minted yet
    foreign = TicketSerial(((this_epoch() % (1 << 30)) + 1) << 32 | 1)  # another process's epoch
    for serial in (future, foreign):
        t = Ticket(pool=TARGET_POOL, op=MambaInit(serial=serial, clear_slots=(1,)))
        with pytest.raises(UnknownTicketError, match=rf"serial {serial} was not minted by this process and no trusted peer sent it"):
            ledger.register([t])
        assert ledger.outstanding() == ()
    ledger.trust_peer(serial_epoch(foreign), "rank 0")
    t = Ticket(pool=TARGET_POOL, op=MambaInit(serial=foreign, clear_slots=(1,)))
    ledger.register([t])
    assert ledger.outstanding() == (t,)
    with pytest.raises(IRValidationError, match=r"epoch: must be an int, not bool \(got True\)"):
        ledger.trust_peer(True, "rank 1")


def _mint_in_child(queue: multiprocessing.Queue[tuple[int, int]]) -> None:
    s = mint_serial()
    queue.put((s, this_epoch()))


def test_serials_differ_across_processes_even_after_fork() -> None:
    parent = mint_serial()
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[tuple[int, int]] = ctx.Queue()
    proc = ctx.Process(target=_mint_in_child, args=(queue,))
    proc.start()
    child, child_epoch = queue.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert child_epoch != this_epoch() and serial_epoch(child) == child_epoch
    assert child != parent + 1 and not minted_here(child)


def _fresh_epoch_in_child(queue: multiprocessing.Queue[tuple[int, bool, int, bool, bool]]) -> None:
    epoch = this_epoch()
    first = TicketSerial(epoch << 32 | 1)
    trusted_before = minted_here(first)  # the child has minted nothing yet
    s = mint_serial()
    try:
        MambaInit(serial=s, clear_slots=(1,))
        valid = True
    except IRValidationError:
        valid = False
    queue.put((epoch, trusted_before, s, minted_here(s), valid))


def test_a_fresh_epoch_trusts_exactly_the_serials_it_mints(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked child draws a new epoch. Even the lowest draw (``randbits`` -> 0) is epoch 1: its
    serials are positive and accepted by ``MambaInit``; a serial of the new epoch is trusted only
    once minted, and the first one minted is."""
    monkeypatch.setattr(secrets, "randbits", lambda bits: 0)
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[tuple[int, bool, int, bool, bool]] = ctx.Queue()
    proc = ctx.Process(target=_fresh_epoch_in_child, args=(queue,))
    proc.start()
    epoch, trusted_before, serial, trusted_after, valid = queue.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert epoch == 1 and serial == (1 << 32 | 1)
    assert not trusted_before, "a serial of the child's epoch was trusted before the child minted it"
    assert trusted_after and valid


def test_an_exhausted_counter_moves_to_a_new_valid_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the counter runs out the minter draws a new epoch, drawing again while the draw is an
    epoch it already used; serials stay positive, valid and trusted across the change. (The counter
    is shrunk to 2 bits to get there: the real one runs out after 2**32 serials.)"""
    draws = iter([0, 0, 0, 6])  # epoch 1; at exhaustion two draws of the used epoch 1, then 7
    monkeypatch.setattr(secrets, "randbits", lambda bits: next(draws))
    monkeypatch.setattr(ir.init, "_COUNTER_MASK", 3)
    minter = ir.init._Minter()
    serials = [minter.mint() for _ in range(4)]
    assert serials == [1 << 32 | 1, 1 << 32 | 2, 1 << 32 | 3, 7 << 32 | 1]
    for s in serials:
        assert minter.minted(s)
        assert MambaInit(serial=s, clear_slots=(1,)).serial == s
    assert not minter.minted(7 << 32 | 2)


# -- claim everything before the forward ----------------------------------------------------------


@pytest.mark.parametrize("transactional", [False, True])
def test_a_snapshot_only_replay_is_refused_before_the_model_runs(transactional: bool) -> None:
    w, model = _world(transactional=transactional)
    r = attrs.evolve(request(1, 1, [5, 6], 10, intent=Continue(prefix_len=3)), snapshot_to=MambaSlot(4))
    plan = lower(prepare_for_extend([r]), LowerContext())
    assert plan.tickets == () and len(plan.snapshots) == 1
    w.ledger.register(plan.snapshots)
    w.executor.execute(plan)
    assert model.forwards == 1 and torch.equal(w.pool.buffer[4], w.pool.buffer[1])
    _refused(w, model, lambda: w.executor.execute(plan), ResourceReplayError, rf"replay of snapshot ticket #{plan.snapshots[0].serial} for pool 'target'")


def test_a_mixed_replay_without_an_init_ticket_is_refused_before_the_model_runs() -> None:
    w, model = _world()
    r = attrs.evolve(request(1, 1, [5, 6], 10, intent=Continue(prefix_len=3)), snapshot_to=MambaSlot(4))
    running = decode_batch([2], [2], [4], [30])
    decode = prepare_for_decode(running, DecodeContext(next_tokens=[9], kv_locs=[31]))
    plan = lower(mix_with_running(prepare_for_extend([r]), decode), LowerContext())
    assert isinstance(plan, MixedPlan) and plan.tickets == ()
    w.ledger.register(plan.extend.snapshots)
    w.executor.execute(plan)
    _refused(w, model, lambda: w.executor.execute(plan), ResourceReplayError, "replay of snapshot ticket")


def test_a_failed_forward_consumes_the_applied_init_and_returns_the_snapshot() -> None:
    """Plain executor: the init ran and stays consumed; the snapshot never ran and is outstanding."""

    class Failing(CountingModel):
        def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor:
            raise RuntimeError("forward failed")

    model = Failing()
    w = make_world(capacity=6, live_slots=5, model=model)
    r = attrs.evolve(request(1, 1, [5, 6], 0), snapshot_to=MambaSlot(4))
    plan = lower(prepare_for_extend([r]), LowerContext())
    w.ledger.register((*plan.tickets, *plan.snapshots))
    with pytest.raises(RuntimeError, match="forward failed"):
        w.executor.execute(plan)
    assert w.ledger.is_consumed(plan.tickets[0]) and bool((w.pool.buffer[1] == 0).all())
    assert w.ledger.outstanding() == plan.snapshots and w.ledger.in_flight() == ()


def test_assert_drained_reports_tickets_stuck_in_flight() -> None:
    ledger = Ledger()
    t = Ticket(pool=TARGET_POOL, op=MambaInit(serial=mint_serial(), clear_slots=(2,)))
    ledger.register([t])
    with ledger.consuming(t, TARGET_POOL):
        with pytest.raises(ResourceLeakError, match=rf"1 ticket\(s\) stuck in flight: ticket #{t.serial} for pool 'target' \(ops clear \[2\]"):
            ledger.assert_drained()
    ledger.assert_drained()


def test_one_plan_cannot_claim_a_ticket_twice() -> None:
    ledger = Ledger()
    t = Ticket(pool=TARGET_POOL, op=MambaInit(serial=mint_serial(), clear_slots=(2,)))
    ledger.register([t])
    with pytest.raises(ResourceReplayError, match="claimed twice by one plan"):
        with ledger.claiming([t, t], TARGET_POOL):
            pass
    assert ledger.outstanding() == (t,) and ledger.in_flight() == ()


# -- a verify's states are bound to its rows --------------------------------------------------------


def test_a_commit_naming_other_slots_is_refused_and_the_right_one_runs() -> None:
    w, model = _world()
    running = decode_batch([1, 2], [1, 2], [4, 4], [20, 21])
    draft = prepare_for_draft(running, SpecContext(k=2, next_tokens=[3, 3], kv_locs=list(range(30, 36))))
    v = prepare_for_verify(draft, proposed(draft, np.full(4, 7, dtype=np.int64)))
    w.executor.execute(lower(v, LowerContext()))
    c = commit(v, accept(v, verified(v, np.full(6, 7, dtype=np.int64))))
    swapped = CommitPlan(batch=attrs.evolve(c, slots=c.slots[::-1].copy()))
    other = CommitPlan(batch=attrs.evolve(c, slots=[1, 3]))
    shorter = commit(attrs.evolve(v, k=1, input_ids=[3, 7, 3, 7], kv_locs=[30, 31, 33, 34]), AcceptResult(verify_id=v.verify_id, rids=v.rids, accepted=[1, 1], bonus=[7, 7]))
    for bad, shown in ((swapped, r"\[2, 1\] with k=2"), (other, r"\[1, 3\] with k=2"), (CommitPlan(batch=shorter), r"\[1, 2\] with k=1")):
        _refused(w, model, lambda bad=bad: w.executor.execute(bad), PlanExecutionError, rf"commit of verify #{v.verify_id} names slots {shown}; the verify ran on slots \[1, 2\] with k=2")
    w.executor.execute(lower(c, LowerContext()))
    assert bool((w.pool.buffer[1] == 0x11).all()) and bool((w.pool.buffer[2] == 0x11).all())


# -- the rest of the ledger's protocol (each of these closed a survivor of the mutation run) -------


def _registered(*clears: int, pool: PoolId = TARGET_POOL, ledger: Ledger | None = None) -> tuple[Ledger, list[InitTicket]]:
    ledger = ledger if ledger is not None else Ledger()
    tickets = [Ticket(pool=pool, op=MambaInit(serial=mint_serial(), clear_slots=(c,))) for c in clears]
    ledger.register(tickets)
    return ledger, tickets


def test_registering_a_ticket_in_flight_or_cancelled_is_a_replay() -> None:
    ledger, (t, u) = _registered(2, 3)
    with ledger.consuming(t, TARGET_POOL):
        with pytest.raises(ResourceReplayError, match=rf"#{t.serial} for pool 'target' is being consumed right now"):
            ledger.register([t])
    ledger.cancel(u, "aborted")
    with pytest.raises(ResourceReplayError, match=rf"#{u.serial} for pool 'target' was cancelled; the batch it came from already ran"):
        ledger.register([u])
    assert ledger.replays_blocked == 2


def test_a_cancelled_ticket_cannot_be_claimed_and_cancel_checks_its_ticket() -> None:
    ledger, (t, u) = _registered(2, 3)
    ledger.cancel(t, "aborted: its forward failed")
    with pytest.raises(ResourceReplayError, match=rf"#{t.serial} for pool 'target' was cancelled \(aborted: its forward failed\)"):
        with ledger.consuming(t, TARGET_POOL):
            pass
    with pytest.raises(UnknownTicketError, match=rf"^cannot cancel ticket #{t.serial} for pool 'target': it was cancelled already$"):
        ledger.cancel(t, "again")
    with ledger.consuming(u, TARGET_POOL):
        with pytest.raises(ResourceReplayError, match="it has run or is running"):
            ledger.cancel(u, "mid-flight")
    with pytest.raises(ResourceReplayError, match="it has run or is running"):
        ledger.cancel(u, "after")
    assert ledger.cancelled() == {(t.serial, TARGET_POOL): "aborted: its forward failed"}
    assert ledger.is_consumed(u) and ledger.outstanding() == ()


def test_claim_done_takes_only_its_own_tickets() -> None:
    ledger, (t, u) = _registered(2, 3)
    with pytest.raises(UnknownTicketError, match=rf"#{u.serial} for pool 'target' is not held by this claim"):
        with ledger.claiming([t], TARGET_POOL) as claim:
            claim.done(u)
    assert ledger.outstanding() == (t, u) and ledger.in_flight() == ()


def test_a_duplicate_claim_counts_as_a_blocked_replay() -> None:
    ledger, (t,) = _registered(2)
    with pytest.raises(ResourceReplayError, match=rf"replay of ticket #{t.serial} for pool 'target': claimed twice by one plan \(ops clear \[2\]"):
        with ledger.claiming([t, t], TARGET_POOL):
            pass
    assert ledger.replays_blocked == 1


def test_assert_drained_lists_ten_tickets_and_counts_the_rest() -> None:
    ledger, tickets = _registered(*range(1, 13))
    with pytest.raises(ResourceLeakError) as info:
        ledger.assert_drained()
    msg = str(info.value)
    assert msg.startswith("12 ticket(s) never consumed: ") and msg.endswith(" and 2 more")
    assert msg.count("(ops clear [") == 10 and f"#{tickets[9].serial} " in msg and f"#{tickets[10].serial} " not in msg


@pytest.mark.parametrize("epoch", [0, -1, True, 2.0, "7"])
def test_trust_peer_takes_a_positive_int_epoch(epoch: object) -> None:
    with suppress_type_checks(), pytest.raises(IRValidationError, match=rf"Ledger\.trust_peer\.epoch: must be (an int|in \[1, 2\*\*30\]).* \(got {re.escape(repr(epoch))}\)"):
        Ledger().trust_peer(epoch, "rank 0")  # type: ignore[arg-type]


# -- the executor's other refusals --------------------------------------------------------------------


def test_a_mixed_plans_decode_rows_are_checked_before_anything_moves() -> None:
    w, model = _world()
    running = decode_batch([2], [6], [4], [30])  # slot 6 is not live (slots 1..5 are)
    w.slots.free(5)
    plan = lower(mix_with_running(prepare_for_extend([request(1, 1, [5, 6], 0)]), running), LowerContext())
    w.ledger.register(plan.tickets)
    _refused(w, model, lambda: w.executor.execute(plan), SlotError, r"use after free: MixedPlan.decode uses slot 6")


def test_a_snapshot_lowered_for_another_pool_is_refused() -> None:
    w, model = _world()
    r = attrs.evolve(request(1, 1, [5, 6], 10, intent=Continue(prefix_len=3)), snapshot_to=MambaSlot(4))
    plan = lower(prepare_for_extend([r]), LowerContext(pools=(DRAFT_POOL,)))
    w.ledger.register(plan.snapshots)
    _refused(w, model, lambda: w.executor.execute(plan), PlanExecutionError, r"plan with snapshot #\d+ was lowered for pool\(s\) 'draft', not for this executor's pool 'target'")


def test_a_snapshot_may_not_write_a_row_of_its_own_plan() -> None:
    w, model = _world()
    r = attrs.evolve(request(1, 1, [5, 6], 10, intent=Continue(prefix_len=3)), snapshot_to=MambaSlot(2))
    plan = lower(prepare_for_extend([r, request(2, 2, [7], 20, intent=Continue(prefix_len=1))]), LowerContext())
    w.ledger.register(plan.snapshots)
    _refused(w, model, lambda: w.executor.execute(plan), PlanExecutionError, r"snapshot #\d+ writes slot 2, a row of this plan")


def test_forgotten_verifies_cannot_be_committed() -> None:
    w, model = _world()
    running = decode_batch([1], [1], [4], [20])
    draft = prepare_for_draft(running, SpecContext(k=1, next_tokens=[3], kv_locs=[30, 31]))
    v = prepare_for_verify(draft, proposed(draft, np.full(1, 7, dtype=np.int64)))
    w.executor.execute(lower(v, LowerContext()))
    w.executor.forget_verifies()
    c = commit(v, accept(v, verified(v, np.full(2, 7, dtype=np.int64))))
    _refused(w, model, lambda: w.executor.execute(lower(c, LowerContext())), PlanExecutionError, r"no intermediate states of verify")


@pytest.mark.parametrize("not_a_plan", [None, "plan", 3])
def test_something_that_is_not_a_plan_is_refused_by_name(not_a_plan: object) -> None:
    w, model = _world()
    with suppress_type_checks():
        _refused(w, model, lambda: w.executor.execute(not_a_plan), PlanExecutionError, rf"Executor.execute: a {type(not_a_plan).__name__} is not a plan")  # type: ignore[arg-type]


@pytest.mark.parametrize(("level", "watching"), [("0", False), ("1", False), ("2", True), ("", False)])
def test_the_mutation_detector_follows_batchc_verify(monkeypatch: pytest.MonkeyPatch, level: str, watching: bool) -> None:
    monkeypatch.setenv("BATCHC_VERIFY", level)
    w = make_world()
    assert Executor(w.pool, w.ledger).watch is watching
    assert Executor(w.pool, w.ledger, watch=not watching).watch is not watching


def test_a_verify_and_its_commit_cannot_run_again_even_after_the_commit() -> None:
    w, model = _world()
    running = decode_batch([1, 2], [1, 2], [4, 4], [20, 21])
    draft = prepare_for_draft(running, SpecContext(k=2, next_tokens=[3, 3], kv_locs=list(range(30, 36))))
    v = prepare_for_verify(draft, proposed(draft, np.full(4, 7, dtype=np.int64)))
    vplan = lower(v, LowerContext())
    cplan = lower(commit(v, accept(v, verified(v, np.full(6, 7, dtype=np.int64)))), LowerContext())
    w.executor.execute(vplan)
    w.executor.execute(cplan)
    for replay in (vplan, pickle.loads(pickle.dumps(vplan))):
        _refused(w, model, lambda replay=replay: w.executor.execute(replay), PlanExecutionError, rf"verify #{v.verify_id} already ran on pool 'target'")
    _refused(w, model, lambda: w.executor.execute(cplan), PlanExecutionError, rf"no intermediate states of verify #{v.verify_id}")
    # a second verify of the same draft's proposals (a fresh verify id) is refused naming both serials
    again = prepare_for_verify(draft, proposed(draft, np.full(4, 7, dtype=np.int64)))
    _refused(
        w, model, lambda: w.executor.execute(lower(again, LowerContext())), PlanExecutionError,
        rf"verify #{again.verify_id} checks the proposals of draft #{draft.draft_id}, which a verify on pool 'target' already checked",
    )
    newer_draft = prepare_for_draft(running, SpecContext(k=2, next_tokens=[3, 3], kv_locs=list(range(30, 36))))
    newer = prepare_for_verify(newer_draft, proposed(newer_draft, np.full(4, 7, dtype=np.int64)))  # minted later: it runs
    w.executor.execute(lower(newer, LowerContext()))
    _refused(w, model, lambda: w.executor.execute(vplan), PlanExecutionError, "already ran")


@pytest.mark.parametrize(
    ("call", "shown"),
    [
        (lambda ledger: ledger.register(None), r"Ledger\.register\.tickets: must be an iterable of Tickets \(got None\)"),
        (lambda ledger: ledger.register("ab"), r"Ledger\.register\.tickets: must be an iterable .*\(got 'ab'\)"),
        (lambda ledger: ledger.register([None]), r"Ledger\.register\.tickets: every entry must be a Ticket \(got None\)"),
        (lambda ledger: ledger.claiming(None, TARGET_POOL).__enter__(), r"Ledger\.claiming\.tickets: .*\(got None\)"),
        (lambda ledger: ledger.claiming([], None).__enter__(), r"Ledger\.claiming\.pool: must be a pool name \(a non-empty str\) \(got None\)"),
        (lambda ledger: ledger.consuming(None, TARGET_POOL).__enter__(), r"Ledger\.consuming\.tickets: every entry .*\(got None\)"),
        (lambda ledger: ledger.cancel(None, "x"), r"Ledger\.cancel\.tickets: every entry .*\(got None\)"),
        (lambda ledger: ledger.is_consumed(None), r"Ledger\.is_consumed\.tickets: every entry .*\(got None\)"),
        (lambda ledger: ledger.trust_peer(2**70, "rank 0"), r"Ledger\.trust_peer\.epoch: must fit in int64"),
        (lambda ledger: ledger.trust_peer(2**31, "rank 0"), r"Ledger\.trust_peer\.epoch: must be in \[1, 2\*\*30\]"),
        (lambda ledger: ledger.trust_peer(7, None), r"Ledger\.trust_peer\.peer: must be a str naming the peer \(got None\)"),
    ],
)
def test_ledger_arguments_are_checked_before_anything_changes(call: Callable[[Ledger], object], shown: str) -> None:
    ledger, (t,) = _registered(2)
    with suppress_type_checks(), pytest.raises(IRValidationError, match=shown):
        call(ledger)
    assert ledger.outstanding() == (t,) and ledger.in_flight() == () and ledger.num_consumed == 0


def test_trust_peer_takes_numpy_integers() -> None:
    ledger = Ledger()
    with suppress_type_checks():  # annotated int; numpy integers are accepted at run time
        ledger.trust_peer(np.int64(12345), "rank 0")
    t = Ticket(pool=TARGET_POOL, op=MambaInit(serial=TicketSerial(12345 << 32 | 1), clear_slots=(1,)))
    ledger.register([t])
    assert ledger.outstanding() == (t,)


def test_check_rows_checks_its_arguments() -> None:
    ledger = Ledger()
    with suppress_type_checks():
        with pytest.raises(IRValidationError, match=r"Ledger\.check_rows\.pool: must be a pool name"):
            ledger.check_rows([1], None, "plan")  # type: ignore[arg-type]
        with pytest.raises(IRValidationError, match=r"Ledger\.check_rows\.rows: every entry must be an int, not float \(got 1\.5\)"):
            ledger.check_rows([1.5], TARGET_POOL, "plan")  # type: ignore[list-item]
        with pytest.raises(IRValidationError, match=r"Ledger\.check_rows\.tickets: "):
            ledger.check_rows([1], TARGET_POOL, "plan", [None])  # type: ignore[list-item]
    ledger.check_rows([1, 2], TARGET_POOL, "plan")  # nothing registered: nothing to carry


def test_rows_free_refuses_a_row_a_pending_ticket_names_on_that_pool_only() -> None:
    """``Ledger.rows_free`` (the executor's check of a plan without tickets, its arguments its own)
    refuses a row that a registered ticket still has to write, on that ticket's pool only, as
    ``check_rows`` does, and lets it through once the ticket is consumed."""
    ledger = Ledger()
    init = Ticket(pool=TARGET_POOL, op=MambaInit(serial=mint_serial(), clear_slots=(2,)))
    ledger.register([init])
    for rows in ([2], [1, 2]):
        with pytest.raises(TicketMismatchError, match=rf"DecodePlan over slot 2 of pool 'target' does not carry ticket #{init.serial}"):
            ledger.rows_free(rows, TARGET_POOL, "DecodePlan")
        with pytest.raises(TicketMismatchError, match="over slot 2"):
            ledger.check_rows(rows, TARGET_POOL, "DecodePlan")
    ledger.rows_free([1, 3], TARGET_POOL, "DecodePlan")
    ledger.rows_free([2], DRAFT_POOL, "DecodePlan")
    with ledger.claiming([init], TARGET_POOL, [2], "ExtendPlan"):
        pass
    ledger.rows_free([2], TARGET_POOL, "DecodePlan")
    with suppress_type_checks():
        for pool in (None, "", 5):  # not a str, an empty one, a true value that is no str
            with pytest.raises(IRValidationError, match=r"Ledger\.rows_free\.pool: must be a pool name"):
                ledger.rows_free([1], pool, "plan")  # type: ignore[arg-type]
        with pytest.raises(IRValidationError, match=r"Ledger\.rows_free\.rows: every entry must be an int, not bool \(got True\)"):
            ledger.rows_free([True], TARGET_POOL, "plan")


def test_a_claim_settled_by_a_remote_backend_consumes_exactly_what_it_reports() -> None:
    """``Ledger.claim`` holds a plan's tickets in flight until ``Claim.settle`` names the ones the
    backend that ran the plan consumed (an executor process): those are consumed, the rest return
    to outstanding, and a key the claim does not hold is refused with nothing settled."""
    ledger = Ledger()
    serial = mint_serial()
    init = Ticket(pool=TARGET_POOL, op=MambaInit(serial=serial, clear_slots=(1,)))
    snap = Ticket(pool=TARGET_POOL, op=MambaSnapshot(serial=mint_serial(), src=(1,), dst=(2,)))
    ledger.register([init, snap])
    claim = ledger.claim([init, snap], TARGET_POOL, [1], "plan")
    assert set(ledger.in_flight()) == {init, snap} and claim.open
    with pytest.raises(ResourceReplayError):
        ledger.claim([init], TARGET_POOL)  # held by the first claim
    with pytest.raises(UnknownTicketError, match="not held"):
        claim.settle([(mint_serial(), TARGET_POOL)])
    assert set(ledger.in_flight()) == {init, snap}
    claim.settle([(init.serial, TARGET_POOL)])  # the forward failed after its init ops ran
    assert not claim.open and ledger.is_consumed(init) and ledger.outstanding() == (snap,)
    with pytest.raises(ResourceReplayError):
        ledger.claim([init], TARGET_POOL)
    ledger.claim([snap], TARGET_POOL).settle([(snap.serial, TARGET_POOL)])
    ledger.assert_drained()
