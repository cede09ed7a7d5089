"""The ledger: the runtime half of the exactly-once guarantee for one-shot tickets (init ops before a
forward, prefix-cache snapshots after it).

Every ticket is identified by ``(serial, pool)``, and the ticket registered under that key is the
truth: what the backend executes is the registered ticket's ops, never the ops of the copy a plan
carries. A ticket's life: ``register`` (when its plan is lowered) -> in flight (claimed by an
executor, all tickets of a plan at once, before the model runs) -> consumed. Rules:

- registering a serial that this process never minted (``ir.init.minted_here``) and whose epoch is
  not that of a trusted peer (``trust_peer``) raises ``UnknownTicketError``: serials cannot be
  squatted; registering a ticket whose key is outstanding with other ops raises
  ``TicketMismatchError``, with the same ops it is a no-op (the same ticket); registering one that
  was consumed, is in flight or was cancelled raises ``ResourceReplayError`` (re-lowering a batch
  that already ran);
- claiming (``claiming``, or ``consuming`` for one ticket) checks every ticket of the plan before
  any of them moves: one consumed or in flight raises ``ResourceReplayError`` naming the serial, the
  pool and the ops (a ``copy.deepcopy`` or pickled clone is the same ticket, so it is refused too);
  one addressed to another pool raises ``WrongPoolError``; one this ledger never registered raises
  ``UnknownTicketError``; one whose ops differ from the registered ticket's raises
  ``TicketMismatchError`` naming both op lists. So a plan built by hand cannot slip an op past the
  ledger, and a replayed plan is refused before its forward runs, whatever tickets it carries;
- a claim's tickets are consumed when the block succeeds, or one by one as soon as their ops are
  applied (``Claim.done``); if the block fails, every ticket not yet done returns to outstanding
  (never half consumed);
- ``outstanding()`` lists the registered tickets not yet consumed; ``assert_drained()`` raises
  ``ResourceLeakError`` listing them and any ticket stuck in flight (a dropped op);
- ``cancel(ticket, reason)`` retires an outstanding ticket whose requests were aborted before it ran,
  as a recorded event (``cancelled()``), never silently; ``cancel_all`` retires a plan's tickets,
  all or none.

Locking: one ``threading.Lock`` guards the state maps; a claim holds it only to move tickets between
states, not while the ops run, so the forward thread never blocks the scheduler thread for the
length of a kernel.
"""

from __future__ import annotations

import copy
import operator
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Final

import attrs

from ir.columns import int_problem, ints, plain_ints
from ir.errors import (
    IRValidationError,
    PreconditionError,
    ResourceLeakError,
    ResourceReplayError,
    TicketMismatchError,
    UnknownTicketError,
    WrongPoolError,
    short_repr,
)
from ir.ids import PoolId, TicketSerial
from ir.init import EPOCH_BITS, OP_TYPES, Op, Ticket, minted_here, op_counts, op_plan_rows, op_text, serial_epoch
from ir.linear import consumes_on, keeps_linear

__all__ = ["LEDGER_COUNTS_WIDTH", "Claim", "Ledger", "LedgerCounts", "PoolCounts", "RankLedgers"]

_Key = tuple[TicketSerial, PoolId]


@attrs.frozen(kw_only=True)
class PoolCounts:
    """One-shot ops consumed on one pool: each op kind adds to the counters its declaration names
    (``ir.init.OpDecl.counts``: ``tickets`` counts init tickets, ``clears``/``cows``/``snapshots``
    slots)."""

    tickets: int = 0
    clears: int = 0
    cows: int = 0
    snapshots: int = 0


@keeps_linear  # the tickets of one plan while it runs
class Claim:
    """The tickets of one plan, held in flight by ``Ledger.claiming``. ``tickets`` are the registered
    tickets (the ones to execute), in the order they were claimed."""

    def __init__(self, ledger: Ledger, tickets: tuple[Ticket[Op], ...], starts: tuple[Mapping[int, int], ...] = ()) -> None:
        self._ledger = ledger
        self.tickets = tickets
        self.starts = starts or tuple({} for _ in tickets)
        """Per ticket (aligned with ``tickets``), the token at which each plan row its op requires
        started in the plan it was registered with (``Ledger.register``'s ``starts``; empty: not
        given): a plan whose rows start elsewhere is not the one the ticket was lowered with
        (``backend.state_store.check_fresh_rows``)."""
        self._held = {_key(t) for t in tickets}

    def done(self, ticket: Ticket[Op]) -> None:
        """Consume ``ticket`` now (its ops are applied), whatever happens later in the block."""
        key = _key(ticket)
        if key not in self._held:
            raise UnknownTicketError(f"{ticket} is not held by this claim")
        self._held.discard(key)
        self._ledger._finish((key,))

    def settle(self, consumed: Iterable[tuple[TicketSerial, PoolId]]) -> None:
        """End a claim taken with ``Ledger.claim``: the tickets whose ``(serial, pool)`` is in
        ``consumed`` (those the backend that ran the plan reports as consumed) are consumed, every
        other one held returns to outstanding. A key this claim does not hold raises
        ``UnknownTicketError`` and settles nothing."""
        keys = set(consumed)
        stray = keys - self._held
        if stray:
            raise UnknownTicketError(f"ticket {min(stray)} is not held by this claim")
        self._ledger._finish(tuple(k for k in self._held if k in keys))
        self._ledger._unclaim(tuple(k for k in self._held if k not in keys))
        self._held.clear()

    @property
    def open(self) -> bool:
        """True until every held ticket is consumed or released."""
        return bool(self._held)

    def _release(self) -> None:
        self._ledger._unclaim(tuple(self._held))
        self._held.clear()

    def _consume_rest(self) -> None:
        self._ledger._finish(tuple(self._held))
        self._held.clear()


def _own_copy(ticket: Ticket[Op]) -> Ticket[Op]:
    """The ledger's own copy of a registered ticket: a new ticket around a new op object (every op
    field is a tuple of ints, so a shallow copy shares nothing that can change). The caller's objects
    stay the caller's: an op changed in place after registration (``object.__setattr__`` on a frozen
    node) then differs from the copy, and ``claiming`` refuses it as a ticket with other ops."""
    return Ticket(op=copy.copy(ticket.op), pool=ticket.pool)


@keeps_linear  # the one place tickets live across steps: registered, in flight, consumed
class Ledger:
    """The books of every one-shot ticket of an engine: registered when its plan is lowered, claimed by
    the executor that runs the plan, consumed once (see the module for the rules).

    One ledger per engine, shared by the compiler (``register``, ``cancel``) and the executors of its
    pools (``claiming``; an executor process keeps its own and the engine's ``claim`` mirrors it).
    It is what makes a replayed, forged, misaddressed or altered ticket fail before a forward runs,
    and a dropped one visible (``assert_drained``). Thread-safe: a scheduler thread and a forward
    thread may share one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outstanding: dict[_Key, Ticket[Op]] = {}
        self._in_flight: dict[_Key, Ticket[Op]] = {}
        self._consumed: set[_Key] = set()
        self._cancelled: dict[_Key, str] = {}
        self._counts: dict[PoolId, PoolCounts] = {}
        self._minted: dict[PoolId, PoolCounts] = {}
        self._peers: dict[int, str] = {}
        self._ops: dict[tuple[TicketSerial, type], Ticket[Op]] = {}
        """The first ticket registered under each (serial, op kind): one serial carries the same
        ops for every pool."""
        self._starts: dict[_Key, Mapping[int, int]] = {}
        """Per registered ticket given ``starts``, the token at which each plan row its op requires
        starts in the plan it was lowered with."""
        self._rows: dict[PoolId, dict[int, set[_Key]]] = {}
        """Per pool, the plan rows each registered, not yet consumed ticket's op requires of its
        plan (``ir.init.op_plan_rows``: an init's targets, a snapshot's sources): a plan over such
        a row must carry that ticket."""
        self.replays_blocked = 0

    def trust_peer(self, epoch: int, peer: str) -> None:
        """Accept tickets minted by the process whose serial epoch is ``epoch`` (``ir.init.this_epoch()``
        there), e.g. the scheduling rank of a tensor-parallel group."""
        problem = int_problem(epoch)
        if problem is not None:
            raise IRValidationError("Ledger.trust_peer", "epoch", epoch, problem)
        if not 1 <= int(epoch) <= 1 << EPOCH_BITS:
            raise IRValidationError("Ledger.trust_peer", "epoch", epoch, f"must be in [1, 2**{EPOCH_BITS}] (an epoch of ir.init.this_epoch())")
        if not isinstance(peer, str):
            raise IRValidationError("Ledger.trust_peer", "peer", peer, "must be a str naming the peer")
        epoch = int(epoch)
        with self._lock:
            self._peers[epoch] = peer

    def register(self, tickets: Iterable[Ticket[Op]], starts: Mapping[int, int] | None = None) -> None:
        """Expect each ticket to be consumed exactly once; all or nothing. ``starts``: the rows of the
        plan the tickets were lowered with, each slot mapped to the token its row starts at
        (``prefix_lens``); a ticket is then bound to those rows: a claim hands them on
        (``Claim.starts``), and a plan whose rows start elsewhere (another chunk of the same
        request) is refused before its ops run (``backend.state_store.check_fresh_rows``)."""
        items = _tickets_arg("register", tickets)
        bound = None if starts is None else {int(k): int(v) for k, v in starts.items()}
        with self._lock:
            seen: dict[_Key, Ticket[Op]] = {}
            for t in items:
                key = _key(t)
                if not minted_here(t.serial) and serial_epoch(t.serial) not in self._peers:
                    raise UnknownTicketError(
                        f"{t}: serial {t.serial} was not minted by this process and no trusted peer sent it "
                        "(mint serials with ir.init.mint_serial)"
                    )
                if key in self._consumed or key in self._in_flight or key in self._cancelled:
                    self.replays_blocked += 1
                    state = (
                        "was already consumed" if key in self._consumed
                        else "is being consumed right now" if key in self._in_flight
                        else "was cancelled"
                    )
                    raise ResourceReplayError(f"{t} {state}; the batch it came from already ran")
                known = self._outstanding.get(key, seen.get(key))
                if known is not None and known != t:
                    raise _mismatch(known, t, "registered again with other ops")
                sibling = self._ops.get(_ops_key(t)) or next((o for o in seen.values() if _ops_key(o) == _ops_key(t)), None)
                if sibling is not None and not _same_ops(sibling, t):
                    raise _mismatch(sibling, t, f"registered for pool {t.pool!r} with other ops than for pool {sibling.pool!r}")
                seen[key] = _own_copy(t)
            for key, t in seen.items():
                self._ops.setdefault(_ops_key(t), t)
                if bound is not None:
                    self._starts[key] = {s: bound[s] for s in _ticket_rows(t) if s in bound}
                if key not in self._outstanding:
                    self._outstanding[key] = t
                    self._minted[t.pool] = _add(self._minted.get(t.pool, PoolCounts()), t)
                    rows = self._rows.setdefault(t.pool, {})
                    for slot in _ticket_rows(t):
                        rows.setdefault(slot, set()).add(key)

    def _forget_rows(self, key: _Key, t: Ticket[Op]) -> None:
        self._starts.pop(key, None)
        rows = self._rows.get(t.pool, {})
        for slot in _ticket_rows(t):
            keys = rows.get(slot)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del rows[slot]

    def check_rows(
        self, rows: Iterable[int], pool: PoolId, plan: str, carried: Iterable[Ticket[Op]] = (), *, ordered: bool = False
    ) -> None:
        """Refuse a plan over ``rows`` of ``pool`` while a registered ticket that the plan does not
        carry still has to write one of those rows (a clear or a COW into it) or read it (a
        snapshot): the plan would run on a state its init never reached, or move it before its
        snapshot was taken (``TicketMismatchError`` naming the row and the ticket). ``ordered``: the
        plan goes to a backend that runs plans in the order it gets them (an executor process), so
        a ticket already claimed by an earlier plan (in flight) runs before it and does not count."""
        _pool_arg("check_rows", pool)
        carried = _tickets_arg("check_rows", carried)
        slots = ints(rows, "Ledger.check_rows", "rows")
        self._check_rows(slots, pool, plan, carried, ordered)

    def rows_free(self, rows: list[int], pool: PoolId, plan: str) -> None:
        """``check_rows`` of a plan that carries no ticket (the executor's, per plan): no registered
        ticket may still have to run on one of ``rows``. The arguments are checked as there, the
        common case (a list of plain ints, a pool name) in C loops; with no ticket pending on the
        pool there is nothing more to look at."""
        if type(pool) is not str or not pool:
            _pool_arg("rows_free", pool)
        if type(rows) is not list or not plain_ints(rows):
            rows = list(ints(rows, "Ledger.rows_free", "rows"))
        if self._rows.get(pool):
            self._check_rows(rows, pool, plan, (), False)

    def _check_rows(self, slots: Sequence[int], pool: PoolId, plan: str, carried: Sequence[Ticket[Op]], ordered: bool) -> None:
        with self._lock:
            pending = self._rows.get(pool)
            if not pending:
                return
            carried_keys = {_key(t) for t in carried}
            for slot in slots:
                for key in pending.get(slot, ()):
                    if key not in carried_keys and not (ordered and key in self._in_flight):
                        t = self._outstanding.get(key) or self._in_flight[key]
                        raise TicketMismatchError(
                            f"{plan} over slot {slot} of pool {pool!r} does not carry {t} (ops {_ops(t)}), which must run "
                            "on that row first: execute the plan it was lowered with"
                        )

    @consumes_on("pool")
    @contextmanager
    def claiming(self, tickets: Sequence[Ticket[Op]], pool: PoolId, rows: Iterable[int] = (), plan: str = "plan") -> Iterator[Claim]:
        """Hold every ticket of one plan in flight on ``pool`` while the block runs (the init ops,
        the model, the snapshots). All are checked before any moves; the block gets a ``Claim``
        whose ``tickets`` are the registered tickets (execute their ops, not those of the copies
        passed in); those not consumed early (``Claim.done``) are consumed if the block succeeds
        and return to outstanding if it raises. With ``rows`` (the plan's slots), ``check_rows``
        runs first: a registered ticket over one of them must be among ``tickets``."""
        claim = self._claim("claiming", tickets, pool, rows, plan)
        try:
            yield claim
        except BaseException:
            claim._release()
            raise
        claim._consume_rest()

    @consumes_on("pool")
    def claim(
        self, tickets: Sequence[Ticket[Op]], pool: PoolId, rows: Iterable[int] = (), plan: str = "plan", *, ordered: bool = False
    ) -> Claim:
        """``claiming`` without the block, for a plan that runs somewhere else (an executor
        process): the same checks, the tickets held in flight until the caller ends the claim with
        ``Claim.settle``, naming the tickets that backend consumed. ``ordered`` as in ``check_rows``
        (the backend's own ledger checks the rows again when the plan gets there)."""
        return self._claim("claim", tickets, pool, rows, plan, ordered=ordered)

    def _claim(
        self, method: str, tickets: Sequence[Ticket[Op]], pool: PoolId, rows: Iterable[int], plan: str, *, ordered: bool = False
    ) -> Claim:
        items = _tickets_arg(method, tickets)
        _pool_arg(method, pool)
        self.check_rows(rows, pool, plan, items, ordered=ordered)
        with self._lock:
            registered = tuple(self._check_claim(t, pool) for t in items)
            keys = [_key(t) for t in registered]
            if len(set(keys)) != len(keys):
                dup = next(t for i, t in enumerate(registered) if keys.index(keys[i]) != i)
                self.replays_blocked += 1
                raise ResourceReplayError(f"replay of {dup}: claimed twice by one plan (ops {_ops(dup)})")
            for key, t in zip(keys, registered, strict=True):
                del self._outstanding[key]
                self._in_flight[key] = t
            starts = tuple(self._starts.get(key, {}) for key in keys)
        return Claim(self, registered, starts)

    @consumes_on("pool")
    @contextmanager
    def consuming(self, ticket: Ticket[Op], pool: PoolId) -> Iterator[Ticket[Op]]:
        """Hold one ticket while its ops are applied to ``pool``; consumed only if the block succeeds.
        Yields the registered ticket: apply its ops, not the ones of the copy passed in."""
        with self.claiming(_tickets_arg("consuming", (ticket,)), pool) as claim:
            yield claim.tickets[0]

    def _check_claim(self, ticket: Ticket[Op], pool: PoolId) -> Ticket[Op]:
        key = _key(ticket)
        if ticket.pool != pool:
            raise WrongPoolError(f"{ticket} handed to pool {pool!r}")
        if key in self._cancelled:
            raise ResourceReplayError(f"{ticket} was cancelled ({self._cancelled[key]})")
        if key in self._consumed or key in self._in_flight:
            self.replays_blocked += 1
            state = "already consumed" if key in self._consumed else "being consumed on another thread"
            raise ResourceReplayError(f"replay of {ticket}: {state} (ops {_ops(ticket)})")
        registered = self._outstanding.get(key)
        if registered is None:
            raise UnknownTicketError(f"{ticket} was never registered with this ledger (lower plans through the compiler)")
        if registered != ticket:
            raise _mismatch(registered, ticket, "handed to the executor with other ops")
        return registered

    def _finish(self, keys: tuple[_Key, ...]) -> None:
        with self._lock:
            for key in keys:
                t = self._in_flight.pop(key)
                self._forget_rows(key, t)
                self._consumed.add(key)
                self._counts[t.pool] = _add(self._counts.get(t.pool, PoolCounts()), t)

    def _unclaim(self, keys: tuple[_Key, ...]) -> None:
        with self._lock:
            for key in keys:
                self._outstanding[key] = self._in_flight.pop(key)

    def cancel(self, ticket: Ticket[Op], reason: str) -> None:
        """Record that an outstanding ticket will never run (its requests were aborted before its
        forward). A cancellation is an event with a reason, not a silent drop; it is refused for a
        ticket that is consumed or being consumed."""
        self.cancel_all((ticket,), reason, method="cancel")

    def cancel_all(self, tickets: Iterable[Ticket[Op]], reason: str, *, method: str = "cancel_all") -> None:
        """``cancel`` for every one of ``tickets`` (a plan's, which never ran), all or nothing: one
        that has run or is running (``ResourceReplayError``), or is not outstanding here (cancelled
        already, or never registered: ``UnknownTicketError``) cancels none of them."""
        items = _tickets_arg(method, tickets)
        keys = [_key(t) for t in items]
        why: object = reason  # typed str; checked because callers need not be typed
        if not isinstance(why, str) or not why:
            raise PreconditionError(f"Ledger.{method}", f"reason must be a non-empty str, got {short_repr(reason)}")
        with self._lock:
            for t, key in zip(items, keys, strict=True):
                if key in self._consumed or key in self._in_flight:
                    raise ResourceReplayError(f"cannot cancel {t}: it has run or is running")
                if key not in self._outstanding:
                    state = "it was cancelled already" if key in self._cancelled else "not outstanding in this ledger"
                    raise UnknownTicketError(f"cannot cancel {t}: {state}")
                if not _same_ops(self._outstanding[key], t):
                    raise _mismatch(self._outstanding[key], t, "to be cancelled with other ops")
            for key in dict.fromkeys(keys):
                self._forget_rows(key, self._outstanding.pop(key))
                self._cancelled[key] = reason

    def cancelled(self) -> dict[tuple[TicketSerial, PoolId], str]:
        """Cancelled tickets and why."""
        with self._lock:
            return dict(self._cancelled)

    def is_consumed(self, ticket: Ticket[Op]) -> bool:
        """Whether ``ticket`` (by its serial and pool) was consumed on this ledger."""
        key = _key(_tickets_arg("is_consumed", (ticket,))[0])
        with self._lock:
            return key in self._consumed

    def outstanding(self) -> tuple[Ticket[Op], ...]:
        """Registered tickets not yet consumed nor in flight, oldest serial first."""
        with self._lock:
            return tuple(sorted(self._outstanding.values(), key=_key))

    def in_flight(self) -> tuple[Ticket[Op], ...]:
        """Tickets claimed by an executor whose block has not finished, oldest serial first."""
        with self._lock:
            return tuple(sorted(self._in_flight.values(), key=_key))

    def assert_drained(self) -> None:
        """Raise ``ResourceLeakError`` if any registered ticket is outstanding or stuck in flight."""
        parts = []
        for what, left in (("never consumed", self.outstanding()), ("stuck in flight", self.in_flight())):
            if left:
                listed = ", ".join(f"{t} (ops {_ops(t)})" for t in left[:10])
                more = f" and {len(left) - 10} more" if len(left) > 10 else ""
                parts.append(f"{len(left)} ticket(s) {what}: {listed}{more}")
        if parts:
            raise ResourceLeakError("; ".join(parts))

    def counts(self, pool: PoolId) -> PoolCounts:
        """Ops consumed on ``pool``."""
        with self._lock:
            return self._counts.get(pool, PoolCounts())

    def minted(self, pool: PoolId) -> PoolCounts:
        """Ops registered for ``pool`` (consumed or not): compare with ``counts`` for exactly-once."""
        with self._lock:
            return self._minted.get(pool, PoolCounts())

    @property
    def num_consumed(self) -> int:
        """How many tickets were consumed, over every pool."""
        with self._lock:
            return len(self._consumed)


def _tickets_arg(method: str, tickets: object) -> list[Ticket[Op]]:
    """The tickets a caller passed, checked to be tickets (a typed error naming the method and the
    value, not an ``AttributeError`` from inside)."""
    if isinstance(tickets, (str, bytes)) or not isinstance(tickets, Iterable):
        raise IRValidationError(f"Ledger.{method}", "tickets", tickets, "must be an iterable of Tickets")
    items = list(tickets)
    for t in items:
        if not isinstance(t, Ticket):
            raise IRValidationError(f"Ledger.{method}", "tickets", t, "every entry must be a Ticket")
    return items


def _pool_arg(method: str, pool: object) -> None:
    if not isinstance(pool, str) or not pool:
        raise IRValidationError(f"Ledger.{method}", "pool", pool, "must be a pool name (a non-empty str)")


def _key(t: Ticket[Op]) -> _Key:
    return (t.serial, t.pool)


def _add(c: PoolCounts, t: Ticket[Op]) -> PoolCounts:
    """``c`` with ``t``'s op counted, by the counters its kind declares (``ir.init.op_counts``)."""
    added = op_counts(t.op)
    return PoolCounts(**{name: n + added.get(name, 0) for name, n in zip(_COUNTERS, _counts_of(c), strict=True)})


_COUNTERS: Final[tuple[str, ...]] = tuple(f.name for f in attrs.fields(PoolCounts))
"""``PoolCounts``' fields, in order (``_add`` builds the next counts from them)."""
_counts_of: Final[Callable[[PoolCounts], tuple[int, ...]]] = operator.attrgetter(*_COUNTERS)
"""``PoolCounts``' values in ``_COUNTERS``' order (it has several fields: a tuple)."""


def _check_counters() -> None:
    """Every counter an op kind declares is a ``PoolCounts`` field: checked at import, so a new
    kind's counter fails at once rather than at its first consumption."""
    fields = {f.name for f in attrs.fields(PoolCounts)}
    for cls in OP_TYPES:
        stray = [c for c, _ in cls.DECL.counts if c not in fields]
        if stray:
            raise TypeError(f"{cls.__name__}.DECL counts {stray}, which are not PoolCounts fields")


_check_counters()


def _ops_key(t: Ticket[Op]) -> tuple[TicketSerial, type]:
    return t.serial, type(t.op)


def _same_ops(a: Ticket[Op], b: Ticket[Op]) -> bool:
    return a.op == b.op  # (attrs equality: the same kind and the same fields)


def _ticket_rows(t: Ticket[Op]) -> tuple[int, ...]:
    """The plan rows a ticket requires of its plan (its op's ``Rows.OF_PLAN`` slots)."""
    return op_plan_rows(t.op)


def _mismatch(registered: Ticket[Op], other: Ticket[Op], how: str) -> TicketMismatchError:
    return TicketMismatchError(
        f"{registered} {how}: serial {registered.serial}, pool {registered.pool!r}; "
        f"registered ops {_ops(registered)}; these ops {_ops(other)}"
    )


def _ops(ticket: Ticket[Op]) -> str:
    return op_text(ticket.op)


# -- end-of-session reports (every rank of a tensor-parallel group, or one process) ------------


@attrs.frozen(kw_only=True)
class LedgerCounts:
    """One rank's ledger on one pool at the end of a session."""

    minted: PoolCounts
    consumed: PoolCounts
    outstanding: int
    in_flight: int
    cancelled: int

    def to_ints(self) -> list[int]:
        """The counts as a flat list of ``LEDGER_COUNTS_WIDTH`` ints (minted, consumed, then the three
        ticket counts), to send between ranks."""
        return [*attrs.astuple(self.minted), *attrs.astuple(self.consumed), self.outstanding, self.in_flight, self.cancelled]

    @classmethod
    def from_ints(cls, v: Sequence[int]) -> LedgerCounts:
        """The counts ``to_ints`` flattened, back."""
        names = [f.name for f in attrs.fields(PoolCounts)]
        n = len(names)
        return cls(minted=PoolCounts(**dict(zip(names, v[0:n], strict=True))), consumed=PoolCounts(**dict(zip(names, v[n : 2 * n], strict=True))),
                   outstanding=v[2 * n], in_flight=v[2 * n + 1], cancelled=v[2 * n + 2])

    @classmethod
    def of(cls, ledger: Ledger, pool: PoolId) -> LedgerCounts:
        """``ledger``'s counts on ``pool`` now."""
        return cls(
            minted=ledger.minted(pool), consumed=ledger.counts(pool),
            outstanding=sum(t.pool == pool for t in ledger.outstanding()), in_flight=sum(t.pool == pool for t in ledger.in_flight()),
            cancelled=sum(p == pool for _, p in ledger.cancelled()),
        )


LEDGER_COUNTS_WIDTH: Final = 2 * len(attrs.fields(PoolCounts)) + 3
"""How many ints ``LedgerCounts.to_ints`` gives."""


@attrs.frozen(kw_only=True)
class RankLedgers:
    """Every rank's ledger counts at the end of a session: ``ranks[r][pool]``."""

    pools: tuple[PoolId, ...]
    ranks: tuple[Mapping[PoolId, LedgerCounts], ...]

    @property
    def equal(self) -> bool:
        """Every rank consumed the same ops on every pool. (What they minted may differ: rank 0
        registers a forward's tickets when it lowers it, a worker when the plan reaches it, so a
        ticket cancelled before its plan was sent is on rank 0's books only.)"""
        return all(r[p].consumed == self.ranks[0][p].consumed for r in self.ranks for p in self.pools)

    @property
    def drained(self) -> bool:
        """No rank holds a ticket that is outstanding or in flight."""
        return all(c.outstanding == 0 and c.in_flight == 0 for r in self.ranks for c in r.values())

    def to_json(self) -> dict[str, object]:
        """The report as JSON-ready data: ``equal``, ``drained`` and each rank's counts by pool."""
        return {
            "equal": self.equal, "drained": self.drained,
            "ranks": [{p: attrs.asdict(c) for p, c in r.items()} for r in self.ranks],
        }
