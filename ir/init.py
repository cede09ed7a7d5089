"""One-shot Mamba state-init ops as linear resources.

- ``InitIntent`` is what one request of a prefill needs before its first Mamba layer runs: a fresh
  slot is cleared, a cached prefix state is copied (copy-on-write) from a cached-state slot (the
  COW source), a chunked continuation keeps the state it has. ``ExtendBatch`` keeps it per request;
  an ``AdmittedRequest`` says it with a variant of ``ir.request.Intent`` (whose ``kind`` it is).
- ``MambaInit`` is the set of ops of one prefill forward. It has a ``serial``, minted once when the
  prefill batch is built: the serial is the identity of "the init ops of this forward", so lowering
  the same batch twice, or executing a deep copy or a pickled clone of its plan, yields the same
  serial and the ledger refuses the second consumption.
- ``InitTicket`` is a ``MambaInit`` addressed to one state pool. Lowering mints one per registered
  pool (target and each draft pool); the backend's ledger consumes each exactly once.
- ``MambaSnapshot`` / ``SnapshotTicket``: the prefix cache's snapshot of a request's state into a
  cache slot after the forward that reaches the prefix end; the same linear-resource rules.

Invariants checked on construction (``IRValidationError``): slots are >= 1 (0 is the padding slot),
``len(cow_src) == len(cow_dst)``, no slot is cleared twice, no dst is written twice, a copy never
copies a slot onto itself, never reads a slot cleared in the same forward (clears run first, so the
copy would read zeros) or written by another copy of it (copies run concurrently), and clear and
copy targets are disjoint. A ticket's ``pool`` is a non-empty ``str`` and its ``init``/``snapshot`` a
``MambaInit``/``MambaSnapshot`` (``check_fields``; nothing is converted).
"""

from __future__ import annotations

import enum
import itertools
import os
import secrets
import threading
from typing import TypeAlias, final

import attrs

from ir.columns import Node, check_int, check_pool, ints, shown
from ir.errors import IRValidationError
from ir.ids import MambaSlot, PoolId, TicketSerial
from ir.linear import linear

SERIAL_COUNTER_BITS = 32
"""A serial is ``epoch << 32 | counter``: the high bits are this process's epoch, the low bits count."""
_COUNTER_MASK = (1 << SERIAL_COUNTER_BITS) - 1
EPOCH_BITS = 30
"""Epochs are drawn from ``[1, 2**30]``, so a serial stays below ``2**62`` (an int64 column can hold it)."""


class _Minter:
    """This process's serials. The epoch is random (``secrets``), drawn again in a forked child and
    when the counter runs out, so serials minted by two processes never collide (1 in 2**30 per pair
    of processes, where a counter alone would collide at once), and a serial can be traced to the
    process that minted it: ``Ledger.register`` refuses one this process never minted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, int] = {}
        self._new_epoch()

    def _new_epoch(self) -> None:
        epoch = secrets.randbits(EPOCH_BITS) + 1
        while epoch in self._last:
            epoch = secrets.randbits(EPOCH_BITS) + 1
        self.epoch, self._count = epoch, itertools.count(1)
        self._last[epoch] = 0

    def mint(self) -> TicketSerial:
        with self._lock:
            n = next(self._count)
            if n > _COUNTER_MASK:
                self._new_epoch()
                n = next(self._count)
            self._last[self.epoch] = n
            return TicketSerial(self.epoch << SERIAL_COUNTER_BITS | n)

    def minted(self, serial: int) -> bool:
        with self._lock:
            return 1 <= serial & _COUNTER_MASK <= self._last.get(serial >> SERIAL_COUNTER_BITS, 0)

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self._last = {}
        self._new_epoch()


_minter = _Minter()
os.register_at_fork(after_in_child=_minter.after_fork)


def mint_serial() -> TicketSerial:
    """Next serial of this process: unique across processes, monotonic within one epoch, never
    reused, never derived from ``id()``."""
    return _minter.mint()


def minted_here(serial: int) -> bool:
    """Whether this process minted ``serial`` (a forged or foreign serial is not)."""
    return _minter.minted(serial)


def serial_epoch(serial: int) -> int:
    """The epoch of the process that minted ``serial`` (the key a ledger trusts a peer by)."""
    return serial >> SERIAL_COUNTER_BITS


def this_epoch() -> int:
    """The epoch this process mints serials in now (a peer's ledger trusts it to admit our tickets)."""
    return _minter.epoch


@final
class InitIntent(enum.Enum):
    """What a request's slot needs before the forward that starts (or continues) its prefill."""

    CLEAR = "clear"
    """Fresh slot: its state must start at zero."""
    COW = "cow"
    """Cached prefix: the slot starts as a copy of the cached-state slot (the COW source) holding
    the prefix state."""
    CONTINUE = "continue"
    """Chunked-prefill continuation: the slot already holds this request's state."""


def _slots(values: object, node: str, field: str) -> tuple[MambaSlot, ...]:
    """Slot tuples. ``IRValidationError`` names the field and the first entry that is not an int64
    integer (``bool``, ``float``, ``str``, ``None``, out of int64). An attrs converter is not told its
    field (and mypy's attrs plugin supports no ``attrs.Converter``), hence one converter per field."""
    if not isinstance(values, (tuple, list, range)):
        raise IRValidationError(node, field, values, "must be a tuple or list of ints")
    return tuple(MambaSlot(v) for v in ints(values, node, field))


def _clear_slots(values: object) -> tuple[MambaSlot, ...]:
    return _slots(values, "MambaInit", "clear_slots")


def _cow_src(values: object) -> tuple[MambaSlot, ...]:
    return _slots(values, "MambaInit", "cow_src")


def _cow_dst(values: object) -> tuple[MambaSlot, ...]:
    return _slots(values, "MambaInit", "cow_dst")


def _snapshot_src(values: object) -> tuple[MambaSlot, ...]:
    return _slots(values, "MambaSnapshot", "src")


def _snapshot_dst(values: object) -> tuple[MambaSlot, ...]:
    return _slots(values, "MambaSnapshot", "dst")


def _check_serial(node: str, serial: object) -> None:
    value = check_int(node, "serial", serial)
    if value <= 0:
        raise IRValidationError(node, "serial", serial, "must be positive (use ir.init.mint_serial())")


@final
@attrs.frozen(kw_only=True)
class MambaInit(Node):
    """The clear and copy-on-write ops of one prefill forward. Clears run first, then copies."""

    serial: TicketSerial = attrs.field(metadata=shown(name="#"))
    clear_slots: tuple[MambaSlot, ...] = attrs.field(default=(), converter=_clear_slots, metadata=shown("clear", "s"))
    cow_src: tuple[MambaSlot, ...] = attrs.field(default=(), converter=_cow_src, metadata=shown("cow", "s", pair="cow_dst"))
    cow_dst: tuple[MambaSlot, ...] = attrs.field(default=(), converter=_cow_dst)

    def _check(self) -> None:
        name = "MambaInit"
        _check_serial(name, self.serial)
        if len(self.cow_src) != len(self.cow_dst):
            raise IRValidationError(
                name, "cow_dst", self.cow_dst, f"length must equal len(cow_src) ({len(self.cow_src)})"
            )
        for field, slots in (("clear_slots", self.clear_slots), ("cow_src", self.cow_src), ("cow_dst", self.cow_dst)):
            for s in slots:
                if s < 1:
                    raise IRValidationError(name, field, s, "slot must be >= 1 (slot 0 is the padding slot)")
        _no_repeat(name, "clear_slots", self.clear_slots)
        _no_repeat(name, "cow_dst", self.cow_dst)
        cleared = frozenset(self.clear_slots)
        for src, dst in zip(self.cow_src, self.cow_dst, strict=True):
            if src == dst:
                raise IRValidationError(name, "cow_src", src, f"COW copies slot {src} onto itself")
            if src in cleared:
                raise IRValidationError(
                    name, "cow_src", src, f"COW src slot {src} is cleared in the same forward (clears run first)"
                )
            if dst in cleared:
                raise IRValidationError(name, "cow_dst", dst, f"slot {dst} is both cleared and a COW dst")
        chained = frozenset(self.cow_src) & frozenset(self.cow_dst)
        if chained:
            s = min(chained)
            raise IRValidationError(name, "cow_src", s, f"slot {s} is both a COW src and a COW dst (copies run concurrently)")

    @property
    def is_empty(self) -> bool:
        return not self.clear_slots and not self.cow_dst

    @property
    def num_ops(self) -> int:
        return len(self.clear_slots) + len(self.cow_dst)

    def targets(self) -> frozenset[MambaSlot]:
        """Every slot this init writes."""
        return frozenset(self.clear_slots) | frozenset(self.cow_dst)


def _no_repeat(node: str, field: str, slots: tuple[MambaSlot, ...]) -> None:
    seen: set[int] = set()
    for s in slots:
        if s in seen:
            raise IRValidationError(node, field, s, f"slot {s} appears twice")
        seen.add(s)


@final
@linear
@attrs.frozen(kw_only=True)
class InitTicket(Node):
    """A ``MambaInit`` addressed to one state pool: a linear resource, consumed exactly once there.

    The identity of a ticket is ``(serial, pool)``; copies of a ticket are the same ticket.
    ``pool`` is a non-empty pool name and ``init`` a ``MambaInit`` (itself checked when built).
    """

    pool: PoolId
    init: MambaInit = attrs.field(metadata=shown())

    def _check_first(self) -> None:
        check_pool(self, "pool", self.pool)

    @property
    def serial(self) -> TicketSerial:
        return self.init.serial

    def __str__(self) -> str:
        return f"ticket #{self.serial} for pool {self.pool!r}"


@final
@attrs.frozen(kw_only=True)
class MambaSnapshot(Node):
    """Prefix-cache snapshots of one forward: after the model runs, copy slot ``src[i]`` (a request's
    live state at the end of this forward's tokens) into cache slot ``dst[i]``. One-shot like a
    ``MambaInit``: its serial is its identity."""

    serial: TicketSerial = attrs.field(metadata=shown(name="#"))
    src: tuple[MambaSlot, ...] = attrs.field(converter=_snapshot_src, metadata=shown(name="s", pair="dst"))
    dst: tuple[MambaSlot, ...] = attrs.field(converter=_snapshot_dst)

    def _check(self) -> None:
        name = "MambaSnapshot"
        _check_serial(name, self.serial)
        if not self.dst:
            raise IRValidationError(name, "dst", self.dst, "a snapshot copies at least one slot")
        if len(self.src) != len(self.dst):
            raise IRValidationError(name, "dst", self.dst, f"length must equal len(src) ({len(self.src)})")
        for field, slots in (("src", self.src), ("dst", self.dst)):
            for s in slots:
                if s < 1:
                    raise IRValidationError(name, field, s, "slot must be >= 1 (slot 0 is the padding slot)")
        _no_repeat(name, "dst", self.dst)
        both = frozenset(self.src) & frozenset(self.dst)
        if both:
            s = min(both)
            raise IRValidationError(name, "dst", s, f"slot {s} is both a snapshot source and a snapshot target")


@final
@linear
@attrs.frozen(kw_only=True)
class SnapshotTicket(Node):
    """A ``MambaSnapshot`` addressed to one state pool; consumed exactly once there, after the
    forward. ``pool`` is a non-empty pool name and ``snapshot`` a ``MambaSnapshot``."""

    pool: PoolId
    snapshot: MambaSnapshot = attrs.field(metadata=shown())

    def _check_first(self) -> None:
        check_pool(self, "pool", self.pool)

    @property
    def serial(self) -> TicketSerial:
        return self.snapshot.serial

    def __str__(self) -> str:
        return f"snapshot ticket #{self.serial} for pool {self.pool!r}"


Ticket: TypeAlias = InitTicket | SnapshotTicket
"""Every one-shot resource the ledger tracks."""
