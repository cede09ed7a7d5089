"""What ``backend.ledger`` promises at its edges, beside ``test_ledger_truth.py``: the bounds of a
trusted peer's epoch, a cancellation's reason and its all-or-nothing rule, the per-pool books
(``counts``, ``minted``, ``LedgerCounts``, ``RankLedgers``), and a claim's end (consumed on success,
outstanding again on failure, ``done`` tickets consumed whatever follows)."""

from __future__ import annotations

import pytest
from typeguard import suppress_type_checks

from backend.ledger import LEDGER_COUNTS_WIDTH, Ledger, LedgerCounts, PoolCounts, RankLedgers
from ir.errors import (
    IRValidationError,
    PreconditionError,
    ResourceReplayError,
    TicketMismatchError,
    UnknownTicketError,
    WrongPoolError,
)
from ir.ids import DRAFT_POOL, TARGET_POOL, PoolId, TicketSerial
from ir.init import EPOCH_BITS, SERIAL_COUNTER_BITS, MambaInit, MambaSnapshot, Ticket, mint_serial, this_epoch


def _init(*slots: int, serial: int | None = None, pool: PoolId = TARGET_POOL) -> Ticket[MambaInit]:
    s = TicketSerial(mint_serial() if serial is None else serial)
    return Ticket(pool=pool, op=MambaInit(serial=s, clear_slots=slots))


def _snapshot(src: int, dst: int, pool: PoolId = TARGET_POOL) -> Ticket[MambaSnapshot]:
    return Ticket(pool=pool, op=MambaSnapshot(serial=mint_serial(), src=(src,), dst=(dst,)))


def _foreign_epoch() -> int:
    return this_epoch() % (1 << EPOCH_BITS) + 1


def test_a_trusted_peers_epoch_lies_in_1_to_2_pow_30_and_its_serials_register() -> None:
    ledger = Ledger()
    ledger.trust_peer(1, "rank 1")
    ledger.trust_peer(1 << EPOCH_BITS, "rank 2")
    for bad in (0, (1 << EPOCH_BITS) + 1):
        with pytest.raises(IRValidationError) as info:
            ledger.trust_peer(bad, "rank 3")
        assert (info.value.node, info.value.field, info.value.value) == ("Ledger.trust_peer", "epoch", bad)
    with suppress_type_checks(), pytest.raises(IRValidationError) as info:  # production runs without typeguard
        ledger.trust_peer(5, 5)  # type: ignore[arg-type]
    assert info.value.field == "peer"
    epoch = _foreign_epoch()
    foreign = _init(1, serial=epoch << SERIAL_COUNTER_BITS | 7)
    with pytest.raises(UnknownTicketError, match="was not minted by this process"):
        Ledger().register([foreign])
    trusting = Ledger()
    trusting.trust_peer(epoch, "rank 0")
    trusting.register([foreign])
    assert trusting.outstanding() == (foreign,)


def test_a_cancellation_needs_a_reason_and_cancels_all_or_nothing() -> None:
    ledger = Ledger()
    a, b = _init(1), _init(2)
    ledger.register([a, b])
    for reason in ("", None, 3):
        with suppress_type_checks(), pytest.raises(PreconditionError, match=r"^Ledger\.cancel: reason must be a non-empty str"):
            ledger.cancel(a, reason)  # type: ignore[arg-type]
    with pytest.raises(PreconditionError, match=r"^Ledger\.cancel_all: reason must be a non-empty str"):
        ledger.cancel_all([a], "")
    never = _init(3)
    with pytest.raises(UnknownTicketError, match="not outstanding in this ledger"):
        ledger.cancel_all([a, never], "aborted")
    assert set(ledger.outstanding()) == {a, b} and ledger.cancelled() == {}
    forged = Ticket(pool=TARGET_POOL, op=MambaInit(serial=b.serial, clear_slots=(5,)))
    with pytest.raises(TicketMismatchError, match="to be cancelled with other ops"):
        ledger.cancel_all([a, forged], "aborted")
    assert set(ledger.outstanding()) == {a, b}
    ledger.cancel_all([a, a], "aborted")  # the same ticket twice is one cancellation
    assert ledger.cancelled() == {(a.serial, TARGET_POOL): "aborted"} and ledger.outstanding() == (b,)
    with pytest.raises(UnknownTicketError, match="it was cancelled already"):
        ledger.cancel(a, "again")
    with ledger.claiming([b], TARGET_POOL):
        with pytest.raises(ResourceReplayError, match="it has run or is running"):
            ledger.cancel(b, "late")
    with pytest.raises(ResourceReplayError, match="it has run or is running"):
        ledger.cancel(b, "late")
    ledger.assert_drained()


def test_books_count_each_op_on_its_own_pool() -> None:
    ledger = Ledger()
    init = _init(1, 2)
    draft = Ticket(pool=DRAFT_POOL, op=init.op)
    cow = Ticket(pool=TARGET_POOL, op=MambaInit(serial=mint_serial(), clear_slots=(3,), cow_src=(9,), cow_dst=(4,)))
    snap = _snapshot(1, 8)
    ledger.register([init, draft, cow, snap])
    assert ledger.minted(TARGET_POOL) == PoolCounts(tickets=2, clears=3, cows=1, snapshots=1)
    assert ledger.minted(DRAFT_POOL) == PoolCounts(tickets=1, clears=2)
    assert ledger.counts(TARGET_POOL) == PoolCounts() and ledger.num_consumed == 0
    with ledger.claiming([init, snap], TARGET_POOL):
        pass
    assert ledger.counts(TARGET_POOL) == PoolCounts(tickets=1, clears=2, snapshots=1) and ledger.counts(DRAFT_POOL) == PoolCounts()
    assert ledger.is_consumed(init) and not ledger.is_consumed(draft) and ledger.num_consumed == 2
    target = LedgerCounts.of(ledger, TARGET_POOL)
    assert (target.outstanding, target.in_flight, target.cancelled) == (1, 0, 0)
    ledger.cancel(cow, "aborted")
    with ledger.claiming([draft], DRAFT_POOL) as claim:
        assert claim.tickets == (draft,)
        d = LedgerCounts.of(ledger, DRAFT_POOL)
        assert (d.outstanding, d.in_flight, d.cancelled) == (0, 1, 0)
    t = LedgerCounts.of(ledger, TARGET_POOL)
    assert (t.outstanding, t.in_flight, t.cancelled) == (0, 0, 1) and t.minted.cows == 1 and t.consumed.cows == 0
    flat = t.to_ints()
    assert len(flat) == LEDGER_COUNTS_WIDTH == 11 and LedgerCounts.from_ints(flat) == t
    assert flat == [2, 3, 1, 1, 1, 2, 0, 1, 0, 0, 1]


def test_rank_ledgers_compare_what_every_rank_consumed() -> None:
    a = LedgerCounts(minted=PoolCounts(tickets=2), consumed=PoolCounts(tickets=1), outstanding=0, in_flight=0, cancelled=1)
    b = LedgerCounts(minted=PoolCounts(tickets=1), consumed=PoolCounts(tickets=1), outstanding=0, in_flight=0, cancelled=0)
    same = RankLedgers(pools=(TARGET_POOL,), ranks=({TARGET_POOL: a}, {TARGET_POOL: b}))
    assert same.equal and same.drained  # minted may differ, consumed may not
    c = LedgerCounts(minted=PoolCounts(tickets=2), consumed=PoolCounts(tickets=2), outstanding=0, in_flight=0, cancelled=0)
    assert not RankLedgers(pools=(TARGET_POOL,), ranks=({TARGET_POOL: a}, {TARGET_POOL: c})).equal
    stuck = LedgerCounts(minted=PoolCounts(tickets=1), consumed=PoolCounts(tickets=1), outstanding=0, in_flight=1, cancelled=0)
    left = LedgerCounts(minted=PoolCounts(tickets=1), consumed=PoolCounts(tickets=1), outstanding=1, in_flight=0, cancelled=0)
    assert not RankLedgers(pools=(TARGET_POOL,), ranks=({TARGET_POOL: a}, {TARGET_POOL: stuck})).drained
    assert not RankLedgers(pools=(TARGET_POOL,), ranks=({TARGET_POOL: left}, {TARGET_POOL: a})).drained
    report = same.to_json()
    assert report["equal"] is True and report["drained"] is True
    assert report["ranks"] == [{TARGET_POOL: {"minted": {"tickets": 2, "clears": 0, "cows": 0, "snapshots": 0},
                                              "consumed": {"tickets": 1, "clears": 0, "cows": 0, "snapshots": 0},
                                              "outstanding": 0, "in_flight": 0, "cancelled": 1}},
                               {TARGET_POOL: {"minted": {"tickets": 1, "clears": 0, "cows": 0, "snapshots": 0},
                                              "consumed": {"tickets": 1, "clears": 0, "cows": 0, "snapshots": 0},
                                              "outstanding": 0, "in_flight": 0, "cancelled": 0}}]


def test_a_claim_consumes_on_success_and_releases_on_failure_except_what_is_done() -> None:
    ledger = Ledger()
    a, b = _init(1), _init(2)
    ledger.register([a, b])
    with pytest.raises(RuntimeError, match="boom"), ledger.claiming([a, b], TARGET_POOL, rows=[1, 2]) as claim:
        assert claim.open and ledger.in_flight() == (a, b) and ledger.outstanding() == ()
        claim.done(a)
        assert ledger.is_consumed(a) and claim.open
        with pytest.raises(UnknownTicketError, match="is not held by this claim"):
            claim.done(a)
        raise RuntimeError("boom")
    assert ledger.is_consumed(a) and ledger.outstanding() == (b,) and ledger.in_flight() == ()
    with pytest.raises(ResourceReplayError, match=r"already consumed"):
        ledger.claim([a], TARGET_POOL)
    with pytest.raises(WrongPoolError, match="handed to pool 'draft'"):
        ledger.claim([b], DRAFT_POOL)
    with ledger.consuming(b, TARGET_POOL) as registered:
        assert registered == b
    assert ledger.is_consumed(b) and ledger.outstanding() == ()
    ledger.assert_drained()


def test_a_ticket_binds_the_rows_its_op_needs_until_it_is_consumed_or_cancelled() -> None:
    ledger = Ledger()
    a = _init(1, 2)
    ledger.register([a], starts={1: 0, 2: 4, 7: 9})
    with pytest.raises(TicketMismatchError, match=r"decode over slot 2 of pool 'target' does not carry"):
        ledger.rows_free([3, 2], TARGET_POOL, "decode")
    ledger.rows_free([3], TARGET_POOL, "decode")
    ledger.rows_free([1, 2], DRAFT_POOL, "decode")  # another pool's rows are free
    claim = ledger.claim([a], TARGET_POOL, rows=[1, 2])
    assert claim.starts == ({1: 0, 2: 4},)  # the rows its op needs, as registered
    with pytest.raises(TicketMismatchError):
        ledger.check_rows([1], TARGET_POOL, "decode")
    ledger.check_rows([1], TARGET_POOL, "decode", ordered=True)  # runs after the claimed plan on an ordered backend
    claim.settle([(a.serial, TARGET_POOL)])
    assert not claim.open and ledger.is_consumed(a)
    ledger.rows_free([1, 2], TARGET_POOL, "decode")
    b = _init(5)
    ledger.register([b])
    ledger.cancel(b, "aborted")
    ledger.rows_free([5], TARGET_POOL, "decode")


def test_settle_returns_what_the_backend_did_not_consume() -> None:
    ledger = Ledger()
    a, b = _init(1), _snapshot(1, 9)
    ledger.register([a, b])
    claim = ledger.claim([a, b], TARGET_POOL)
    with pytest.raises(UnknownTicketError, match=r"is not held by this claim"):
        claim.settle([(a.serial, DRAFT_POOL)])
    assert claim.open and ledger.in_flight() == (a, b)
    claim.settle([(a.serial, TARGET_POOL)])
    assert ledger.is_consumed(a) and ledger.outstanding() == (b,) and ledger.in_flight() == ()
    assert ledger.counts(TARGET_POOL) == PoolCounts(tickets=1, clears=1)


def test_registering_the_same_ticket_again_is_one_ticket() -> None:
    ledger = Ledger()
    a = _init(1, 2)
    ledger.register([a])
    ledger.register([a, Ticket(pool=a.pool, op=MambaInit(serial=a.serial, clear_slots=(1, 2)))])  # an equal copy
    assert ledger.outstanding() == (a,) and ledger.minted(TARGET_POOL) == PoolCounts(tickets=1, clears=2)
    with ledger.claiming([a], TARGET_POOL):
        pass
    assert ledger.counts(TARGET_POOL) == ledger.minted(TARGET_POOL)


def test_a_row_stays_bound_while_any_ticket_on_it_is_pending() -> None:
    ledger = Ledger()
    init, snap = _init(1), _snapshot(1, 9)
    ledger.register([init, snap])
    with ledger.claiming([init], TARGET_POOL):
        pass
    with pytest.raises(TicketMismatchError, match=r"does not carry snapshot ticket"):
        ledger.rows_free([1], TARGET_POOL, "decode")
    with ledger.claiming([snap], TARGET_POOL, rows=[1]):
        pass
    ledger.rows_free([1], TARGET_POOL, "decode")
    ledger.assert_drained()
