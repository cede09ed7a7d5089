"""The ledger and the allocators under the overlap-scheduler shape: scheduler threads mint and
register tickets and allocate slots while forward threads consume; every ticket is contested by
several threads at once, so each consumption races its replays.

Locking (documented in ``backend/ledger.py`` and ``backend/allocator.py``): each object has one
``threading.Lock``; every public method takes it for its whole state change, and
``Ledger.claiming`` holds it only to move tickets between outstanding, in flight and consumed, not
while the ops run. The invariants: each ticket consumed exactly once, every duplicate refused, no
count lost, no live index handed out twice, ``live + free == capacity``.

How the tests make a missing lock show within a few seconds: the threads start together (a
``threading.Barrier``, again at every round), the interpreter switches threads every microsecond
(``sys.setswitchinterval``, restored afterwards), and an exception in any worker thread fails the
test (``_run_together`` re-raises it) rather than surfacing as a warning. Checked by replacing the
lock with a no-op context manager (``contextlib.nullcontext()``) in a scratch run: without
``Ledger._lock`` both ledger tests fail (a ``KeyError`` in a worker, a ticket consumed twice, a lost
count); without an allocator's ``_lock`` the allocator tests fail (an index handed to two threads, or
a contested ``free_many`` succeeding twice). Under CPython's GIL an allocator race needs long critical
sections running side by side, hence the large bulk operations there.
"""

from __future__ import annotations

import copy
import queue
import random
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from typeguard import suppress_type_checks

from backend.allocator import KVAllocator, SlotAllocator
from backend.ledger import Ledger
from ir.errors import ResourceReplayError, SlotError
from ir.ids import TARGET_POOL, MambaSlot, TicketSerial
from ir.init import InitTicket, MambaInit, Ticket, mint_serial


@contextmanager
def _fast_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _run_together(workers: list[Callable[[threading.Barrier], None]]) -> None:
    """Run each worker on its own thread, all released at once; the first exception raised in any
    worker is re-raised here (a failing worker breaks the barrier, so the others stop waiting)."""
    barrier = threading.Barrier(len(workers), timeout=60)

    def start(fn: Callable[[threading.Barrier], None]) -> None:
        try:
            barrier.wait()
            fn(barrier)
        except BaseException:
            barrier.abort()
            raise

    # (typeguard off while the threads run: its protocol checks parse builtins' signatures with
    # ast.parse, which CPython 3.11 does not make safe across threads switching every microsecond,
    # "SystemError: AST constructor recursion depth mismatch"; the types are checked single-threaded
    # everywhere else)
    with suppress_type_checks(), _fast_switching(), ThreadPoolExecutor(len(workers)) as pool:
        futures = [pool.submit(start, fn) for fn in workers]
        errors = [e for f in futures if (e := f.exception(timeout=120)) is not None]
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]


def _ticket(slot: int) -> InitTicket:
    return Ticket(pool=TARGET_POOL, op=MambaInit(serial=mint_serial(), clear_slots=[MambaSlot(slot)]))


THREADS = 4
ROUNDS = 10
PER_THREAD = 40  # tickets each thread registers per round; every thread then claims all of them


def test_contested_tickets_are_consumed_exactly_once_and_no_count_is_lost() -> None:
    ledger = Ledger()
    rounds: list[list[list[InitTicket]]] = [[[] for _ in range(THREADS)] for _ in range(ROUNDS)]
    won: list[list[TicketSerial]] = [[] for _ in range(THREADS)]
    refused = [0] * THREADS

    def worker(j: int) -> Callable[[threading.Barrier], None]:
        rng = random.Random(j)

        def run(barrier: threading.Barrier) -> None:
            for r in range(ROUNDS):
                mine = [_ticket(1 + i % 60) for i in range(PER_THREAD)]
                ledger.register(mine)  # concurrent registrations: no minted count may be lost
                rounds[r][j] = mine
                barrier.wait()
                contested = [t for part in rounds[r] for t in part]
                rng.shuffle(contested)
                for t in contested:
                    # a deep copy is the same ticket: only one claim of each serial may win
                    claimed = t if rng.random() < 0.5 else copy.deepcopy(t)
                    try:
                        with ledger.consuming(claimed, TARGET_POOL):
                            won[j].append(t.serial)
                    except ResourceReplayError:
                        refused[j] += 1
                    if rng.random() < 0.1:  # readers iterate the state maps while others change them
                        ledger.outstanding()
                        ledger.in_flight()
                barrier.wait()

        return run

    _run_together([worker(j) for j in range(THREADS)])

    total = ROUNDS * THREADS * PER_THREAD
    per_serial = Counter(s for part in won for s in part)
    assert len(per_serial) == total and set(per_serial.values()) == {1}  # exactly once each
    assert sum(refused) == (THREADS - 1) * total == ledger.replays_blocked  # every replay refused, none lost
    assert ledger.num_consumed == total
    assert ledger.minted(TARGET_POOL).tickets == ledger.counts(TARGET_POOL).tickets == total
    assert ledger.counts(TARGET_POOL).clears == total
    assert ledger.outstanding() == () and ledger.in_flight() == ()
    ledger.assert_drained()


PRODUCERS = CONSUMERS = 4
TICKETS_PER_PRODUCER = 500


def test_producers_and_consumers_overlap_exactly_once() -> None:
    """The scheduler/forward split: producers register tickets (and allocate a slot each), consumers
    consume each ticket and its replay (a deep copy) as they arrive, and query the ledger."""
    ledger = Ledger()
    slots = SlotAllocator(64)
    work: queue.Queue[InitTicket | None] = queue.Queue()
    consumed: list[list[TicketSerial]] = [[] for _ in range(CONSUMERS)]
    refused = [0] * CONSUMERS
    queried = [0] * CONSUMERS

    def producer(barrier: threading.Barrier) -> None:
        try:
            for i in range(TICKETS_PER_PRODUCER):
                t = _ticket(1 + i % 60)
                ledger.register([t])
                work.put(t)
                work.put(copy.deepcopy(t))  # the replay: the same serial, another object
                s = slots.alloc()
                slots.free(s)
        finally:
            done.wait()  # even after a failure, so the consumers are told to stop

    def consumer(j: int) -> Callable[[threading.Barrier], None]:
        def run(barrier: threading.Barrier) -> None:
            while (t := work.get()) is not None:
                try:
                    with ledger.consuming(t, TARGET_POOL):
                        consumed[j].append(t.serial)
                except ResourceReplayError:
                    refused[j] += 1
                queried[j] += int(ledger.is_consumed(t))

        return run

    done = threading.Barrier(PRODUCERS + 1, timeout=60)  # the producers and the closer

    def closer(barrier: threading.Barrier) -> None:
        done.wait()  # every producer has put all its tickets
        for _ in range(CONSUMERS):
            work.put(None)

    _run_together([producer] * PRODUCERS + [consumer(j) for j in range(CONSUMERS)] + [closer])

    total = PRODUCERS * TICKETS_PER_PRODUCER
    per_serial = Counter(s for part in consumed for s in part)
    assert len(per_serial) == total and set(per_serial.values()) == {1}  # exactly once each
    assert sum(refused) == total == ledger.replays_blocked  # every duplicate refused, none lost
    assert ledger.num_consumed == total and ledger.outstanding() == ()
    assert ledger.counts(TARGET_POOL).clears == total
    assert total <= sum(queried) <= 2 * total  # the winner always sees its consumption; a loser may race it
    assert slots.num_live == 0 and slots.num_free == slots.capacity


ALLOC_THREADS = 4
ALLOC_ROUNDS = 30
ALLOC_PER_THREAD = 768  # indices each thread allocates per round; every thread then frees all of them


@pytest.mark.parametrize("kind", [SlotAllocator, KVAllocator])
def test_allocators_hand_out_each_index_once_and_a_contested_free_succeeds_once(
    kind: type[SlotAllocator] | type[KVAllocator],
) -> None:
    """Each round, every thread allocates (bulk and single) at the same time, then every thread frees
    the round's whole set in one ``free_many``: the allocations never overlap, and exactly one of the
    frees succeeds, the others are refused as double frees and change nothing."""
    capacity = ALLOC_THREADS * ALLOC_PER_THREAD
    alloc = kind(capacity)
    rounds: list[list[list[int]]] = [[[] for _ in range(ALLOC_THREADS)] for _ in range(ALLOC_ROUNDS)]
    winners: list[list[int]] = [[] for _ in range(ALLOC_ROUNDS)]

    def worker(j: int) -> Callable[[threading.Barrier], None]:
        def run(barrier: threading.Barrier) -> None:
            for r in range(ALLOC_ROUNDS):
                mine = [int(i) for i in alloc.alloc_many(ALLOC_PER_THREAD - 2)]
                mine += [int(alloc.alloc()), int(alloc.alloc())]
                rounds[r][j] = mine
                barrier.wait()
                everything = sorted(i for part in rounds[r] for i in part)
                assert len(set(everything)) == capacity, f"round {r}: an index was handed to two threads"
                try:
                    alloc.free_many(everything)
                    winners[r].append(j)  # list.append is atomic
                except SlotError as exc:
                    assert "double free" in str(exc), exc
                barrier.wait()

        return run

    _run_together([worker(j) for j in range(ALLOC_THREADS)])

    assert [len(w) for w in winners] == [1] * ALLOC_ROUNDS  # each contested free succeeded exactly once
    assert alloc.num_live == 0 and alloc.num_free == capacity and alloc.live() == frozenset()
    # the free list holds every index exactly once: all of them can be allocated again, distinct
    assert sorted(int(i) for i in alloc.alloc_many(capacity)) == list(range(1, capacity + 1))
    with pytest.raises(SlotError, match="out of"):
        alloc.alloc()
