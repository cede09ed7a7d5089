"""The ledger: the runtime half of the exactly-once guarantee for one-shot tickets (init ops before a
forward, prefix-cache snapshots after it).

Every ticket is identified by ``(serial, pool)``. Its life: ``register`` (when its plan is lowered)
-> ``consuming`` (while the backend applies its ops) -> consumed. Rules:

- consuming a ticket already consumed, or being consumed on another thread, raises
  ``ResourceReplayError`` naming the serial and the pool; a ``copy.deepcopy`` or pickled clone is the
  same ticket, so it is refused too;
- consuming on a pool the ticket is not addressed to raises ``WrongPoolError``;
- consuming a ticket this ledger never registered raises ``UnknownTicketError``: every op goes
  through lowering, so a plan built by hand cannot slip an op past the ledger;
- registering a ticket that was already consumed, or is being consumed, raises
  ``ResourceReplayError`` (re-lowering a batch that already ran); registering one that is
  outstanding is a no-op (same ticket);
- if the ops fail while being applied, the ticket returns to outstanding (never half consumed);
- ``outstanding()`` lists the registered tickets not yet consumed; ``assert_drained()`` raises
  ``ResourceLeakError`` listing them (a dropped op);
- ``cancel(ticket, reason)`` retires an outstanding ticket whose requests were aborted before it ran,
  as a recorded event (``cancelled()``), never silently.

Locking: one ``threading.Lock`` guards the three state maps; ``consuming`` holds it only to move a
ticket between states, not while the ops run, so the forward thread never blocks the scheduler
thread for the length of a kernel.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import attrs

from ir.errors import ResourceLeakError, ResourceReplayError, UnknownTicketError, WrongPoolError
from ir.ids import PoolId, TicketSerial
from ir.init import InitTicket, SnapshotTicket, Ticket

_Key = tuple[TicketSerial, PoolId]


@attrs.frozen(kw_only=True)
class PoolCounts:
    """One-shot ops consumed on one pool (``tickets`` counts init tickets; snapshots are counted
    per copied slot)."""

    tickets: int = 0
    clears: int = 0
    cows: int = 0
    snapshots: int = 0


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outstanding: dict[_Key, Ticket] = {}
        self._in_flight: dict[_Key, Ticket] = {}
        self._consumed: set[_Key] = set()
        self._cancelled: dict[_Key, str] = {}
        self._counts: Counter[tuple[PoolId, str]] = Counter()
        self._minted: dict[PoolId, PoolCounts] = {}
        self.replays_blocked = 0

    def register(self, tickets: Iterable[Ticket]) -> None:
        """Expect each ticket to be consumed exactly once; all or nothing."""
        items = list(tickets)
        with self._lock:
            for t in items:
                key = (t.serial, t.pool)
                if key in self._consumed or key in self._in_flight or key in self._cancelled:
                    self.replays_blocked += 1
                    state = (
                        "was already consumed" if key in self._consumed
                        else "is being consumed right now" if key in self._in_flight
                        else "was cancelled"
                    )
                    raise ResourceReplayError(f"{t} {state}; the batch it came from already ran")
            for t in items:
                key = (t.serial, t.pool)
                if key not in self._outstanding:
                    self._outstanding[key] = t
                    self._minted[t.pool] = _add(self._minted.get(t.pool, PoolCounts()), t)

    @contextmanager
    def consuming(self, ticket: Ticket, pool: PoolId) -> Iterator[Ticket]:
        """Hold ``ticket`` while its ops are applied to ``pool``; consumed only if the block succeeds."""
        key = (ticket.serial, ticket.pool)
        with self._lock:
            if ticket.pool != pool:
                raise WrongPoolError(f"{ticket} handed to pool {pool!r}")
            if key in self._cancelled:
                raise ResourceReplayError(f"{ticket} was cancelled ({self._cancelled[key]})")
            if key in self._consumed or key in self._in_flight:
                self.replays_blocked += 1
                state = "already consumed" if key in self._consumed else "being consumed on another thread"
                raise ResourceReplayError(f"replay of {ticket}: {state} (ops {_ops(ticket)})")
            registered = self._outstanding.pop(key, None)
            if registered is None:
                raise UnknownTicketError(f"{ticket} was never registered with this ledger (lower plans through the compiler)")
            self._in_flight[key] = registered
        try:
            yield registered
        except BaseException:
            with self._lock:
                del self._in_flight[key]
                self._outstanding[key] = registered
            raise
        with self._lock:
            del self._in_flight[key]
            self._consumed.add(key)
            if isinstance(ticket, InitTicket):
                self._counts[(pool, "tickets")] += 1
                self._counts[(pool, "clears")] += len(ticket.init.clear_slots)
                self._counts[(pool, "cows")] += len(ticket.init.cow_dst)
            else:
                self._counts[(pool, "snapshot_tickets")] += 1
                self._counts[(pool, "snapshots")] += len(ticket.snapshot.dst)

    def cancel(self, ticket: Ticket, reason: str) -> None:
        """Record that an outstanding ticket will never run (its requests were aborted before its
        forward). A cancellation is an event with a reason, not a silent drop; it is refused for a
        ticket that is consumed or being consumed."""
        key = (ticket.serial, ticket.pool)
        with self._lock:
            if key in self._consumed or key in self._in_flight:
                raise ResourceReplayError(f"cannot cancel {ticket}: it has run or is running")
            if key not in self._outstanding:
                raise UnknownTicketError(f"cannot cancel {ticket}: not outstanding in this ledger")
            del self._outstanding[key]
            self._cancelled[key] = reason

    def cancelled(self) -> dict[tuple[TicketSerial, PoolId], str]:
        """Cancelled tickets and why."""
        with self._lock:
            return dict(self._cancelled)

    def is_consumed(self, ticket: Ticket) -> bool:
        with self._lock:
            return (ticket.serial, ticket.pool) in self._consumed

    def outstanding(self) -> tuple[Ticket, ...]:
        """Registered tickets not yet consumed, oldest serial first."""
        with self._lock:
            return tuple(sorted(self._outstanding.values(), key=lambda t: (t.serial, t.pool)))

    def assert_drained(self) -> None:
        left = self.outstanding()
        if left:
            listed = ", ".join(f"{t} (ops {_ops(t)})" for t in left[:10])
            more = f" and {len(left) - 10} more" if len(left) > 10 else ""
            raise ResourceLeakError(f"{len(left)} init ticket(s) never consumed: {listed}{more}")

    def counts(self, pool: PoolId) -> PoolCounts:
        with self._lock:
            return PoolCounts(
                tickets=self._counts[(pool, "tickets")],
                clears=self._counts[(pool, "clears")],
                cows=self._counts[(pool, "cows")],
                snapshots=self._counts[(pool, "snapshots")],
            )

    def minted(self, pool: PoolId) -> PoolCounts:
        """Ops registered for ``pool`` (consumed or not): compare with ``counts`` for exactly-once."""
        with self._lock:
            return self._minted.get(pool, PoolCounts())

    @property
    def num_consumed(self) -> int:
        with self._lock:
            return len(self._consumed)


def _add(c: PoolCounts, t: Ticket) -> PoolCounts:
    if isinstance(t, InitTicket):
        return attrs.evolve(c, tickets=c.tickets + 1, clears=c.clears + len(t.init.clear_slots), cows=c.cows + len(t.init.cow_dst))
    return attrs.evolve(c, snapshots=c.snapshots + len(t.snapshot.dst))


def _ops(ticket: Ticket) -> str:
    if isinstance(ticket, SnapshotTicket):
        snap = ticket.snapshot
        return "snapshot [" + ", ".join(f"{s}->{d}" for s, d in zip(snap.src, snap.dst, strict=True)) + "]"
    init = ticket.init
    cows = ", ".join(f"{s}->{d}" for s, d in zip(init.cow_src, init.cow_dst, strict=True))
    return f"clear {list(init.clear_slots)}, cow [{cows}]"
