"""One-shot Mamba state-init ops as linear resources.

- ``InitIntent`` is what one request of a prefill needs before its first Mamba layer runs: a fresh
  slot is cleared, a cached prefix state is copied (copy-on-write) from a cached-state slot (the
  COW source), a chunked continuation keeps the state it has. ``ExtendBatch`` keeps it per request;
  an ``AdmittedRequest`` says it with a variant of ``ir.request.Intent`` (whose ``kind`` it is).
- ``MambaInit`` is the set of ops of one prefill forward. It has a ``serial``, minted once when the
  prefill batch is built: the serial is the identity of "the init ops of this forward", so lowering
  the same batch twice, or executing a deep copy or a pickled clone of its plan, yields the same
  serial and the ledger refuses the second consumption.
- ``MambaSnapshot``: the prefix cache's snapshot of a request's state into a cache slot after the
  forward that reaches the prefix end (at the end of the request's chunk or, with ``at``, inside
  it); one-shot like a ``MambaInit``.
- ``Ticket[OpT]`` is one op (of any kind) addressed to one state pool, identified by
  ``(serial, pool)``. Lowering mints one per registered pool (target and each draft pool); the
  backend's ledger consumes each exactly once. ``InitTicket`` (``Ticket[BeforeOp]``) and
  ``SnapshotTicket`` (``Ticket[AfterOp]``) name the two places a prefill plan carries them.

Ops declared once: every op kind (``OP_TYPES``, the members of ``Op``) declares as data next to its
class (``DECL``, an ``OpDecl``) which slot fields it reads and writes, whether it runs before or
after the forward, what the executor requires of those slots with respect to the plan's rows, which
ledger counters it adds to and which written rows it leaves cleared. ``op_groups``, ``op_reads``,
``op_writes``, ``op_slots``, ``op_plan_rows``, ``op_resets``, ``op_counts`` and ``op_text`` answer
from it, and every consumer (the ledger, the executor's checks and ``backend.state_init``, the
executor process's liveness check, ``ir.verify``, the text and wire forms) asks them instead of
naming an op's fields. The declarations are checked at import (``_check_declarations``): they name
the kind's own fields, and ``when`` agrees with ``BeforeOp``/``AfterOp``. Applying an op is one
function per kind in ``backend.state_init.apply_op`` (a ``match`` ending in ``assert_never``).

Invariants checked on construction (``IRValidationError``): slots are >= 1 (0 is the padding slot),
``len(cow_src) == len(cow_dst)``, no slot is cleared twice, no dst is written twice, a copy never
copies a slot onto itself, never reads a slot cleared in the same forward (clears run first, so the
copy would read zeros) or written by another copy of it (copies run concurrently), and clear and
copy targets are disjoint. A ticket's ``pool`` is a non-empty ``str`` and its ``op`` one of
``OP_TYPES`` (``check_fields``; nothing is converted); which kinds a plan field takes, the plan checks.
"""

from __future__ import annotations

import enum
import itertools
import operator
import os
import secrets
import threading
import typing
from collections.abc import Callable
from typing import ClassVar, Final, Generic, TypeAlias, TypeVar, final

import attrs

from ir.columns import Node, check_int, check_pool, ints, shown, shown_of
from ir.errors import IRValidationError
from ir.ids import MambaSlot, PoolId, TicketSerial
from ir.linear import linear

__all__ = [
    "SERIAL_COUNTER_BITS",
    "EPOCH_BITS",
    "mint_serial",
    "minted_here",
    "serial_epoch",
    "this_epoch",
    "InitIntent",
    "When",
    "Rows",
    "OpDecl",
    "SlotGroup",
    "MambaInit",
    "MambaSnapshot",
    "BeforeOp",
    "AfterOp",
    "Op",
    "OP_TYPES",
    "op_decl",
    "op_groups",
    "op_reads",
    "op_writes",
    "op_slots",
    "op_plan_rows",
    "op_resets",
    "op_counts",
    "op_when",
    "op_text",
    "Ticket",
    "InitTicket",
    "SnapshotTicket",
]

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


@final
class When(enum.Enum):
    """When an op runs, relative to the forward of the plan that carries it."""

    BEFORE = "before"
    """Before the model runs (the state a request's forward starts from)."""
    AFTER = "after"
    """After the model ran (the state the forward left)."""


@final
class Rows(enum.Enum):
    """What the executor requires of a group of an op's slots with respect to its plan's rows."""

    OF_PLAN = "of the plan"
    """Every slot is a row of the plan (and a plan over that row must carry the op: ``Ledger.check_rows``)."""
    NOT_OF_PLAN = "not of the plan"
    """No slot is a row of the plan (a cache slot is never a request's row)."""


@final
@attrs.frozen(kw_only=True)
class OpDecl:
    """What one op kind touches, declared once next to its class (``DECL``); every consumer (the
    ledger, the executor's checks, staging, the executor process's liveness check, the text and
    wire forms) reads it through the ``op_*`` functions below.

    ``reads``/``writes``: the op's slot fields (``tuple[MambaSlot, ...]``) it reads and writes;
    ``reads_rows``/``writes_rows``: what the executor requires of them w.r.t. the plan's rows;
    ``labels``: each slot field's word in messages (``clear slot 9 out of range``); ``counts``:
    the ledger counters (``backend.ledger.PoolCounts`` fields) the op adds to, each by the length of
    a slot field or, for ``""``, by one per ticket; ``resets``: the written fields whose rows start
    from a cleared state (a row at token 0 must be among them); ``name``: the op in messages
    (``init #5``) and its tag in the text form; ``ticket``: its ticket in messages."""

    name: str
    ticket: str
    when: When
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    reads_rows: Rows
    writes_rows: Rows
    labels: tuple[tuple[str, str], ...]
    counts: tuple[tuple[str, str], ...]
    resets: tuple[str, ...] = ()


@final
@attrs.frozen
class SlotGroup:
    """One slot field of an op, with its declaration: what ``op_groups`` yields."""

    field: str
    label: str
    writes: bool
    rows: Rows
    slots: tuple[MambaSlot, ...]


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


def _snapshot_at(values: object) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list, range)):
        raise IRValidationError("MambaSnapshot", "at", values, "must be a tuple or list of ints")
    return tuple(ints(values, "MambaSnapshot", "at"))


def _check_serial(node: str, serial: object) -> None:
    value = check_int(node, "serial", serial)
    if value <= 0:
        raise IRValidationError(node, "serial", serial, "must be positive (use ir.init.mint_serial())")


@final
@attrs.frozen(kw_only=True)
class MambaInit(Node):
    """The clear and copy-on-write ops of one prefill forward. Clears run first, then copies."""

    DECL: ClassVar[OpDecl] = OpDecl(
        name="init", ticket="ticket", when=When.BEFORE,
        reads=("cow_src",), writes=("clear_slots", "cow_dst"),
        reads_rows=Rows.NOT_OF_PLAN, writes_rows=Rows.OF_PLAN,
        labels=(("clear_slots", "clear"), ("cow_src", "cow src"), ("cow_dst", "cow dst")),
        counts=(("tickets", ""), ("clears", "clear_slots"), ("cows", "cow_dst")),
        resets=("clear_slots",),
    )

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
        _slots_positive(self)
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
        """No slot is cleared and none is copied. A prefill node refuses an empty ``MambaInit``: it
        holds ``None`` instead."""
        return not self.clear_slots and not self.cow_dst

    @property
    def num_ops(self) -> int:
        """The ops of this forward: one per cleared slot and one per copy."""
        return len(self.clear_slots) + len(self.cow_dst)


def _no_repeat(node: str, field: str, slots: tuple[MambaSlot, ...]) -> None:
    seen: set[int] = set()
    for s in slots:
        if s in seen:
            raise IRValidationError(node, field, s, f"slot {s} appears twice")
        seen.add(s)


@final
@attrs.frozen(kw_only=True)
class MambaSnapshot(Node):
    """Prefix-cache snapshots of one forward: after the model runs, copy slot ``src[i]``'s state
    (a request's state after its first ``at[i]`` tokens of this forward) into cache slot ``dst[i]``.
    One-shot like a ``MambaInit``: its serial is its identity.

    ``at`` is empty when every snapshot is at the end of its request's chunk (the state the forward
    leaves in ``src[i]``; the text form then omits it), else one token count per entry, each in
    ``[1, extend_len]`` of its request (``ir.verify``); below ``extend_len`` the forward captures
    the state inside the chunk and the snapshot copies that capture (``backend.state_init``)."""

    DECL: ClassVar[OpDecl] = OpDecl(
        name="snapshot", ticket="snapshot ticket", when=When.AFTER,
        reads=("src",), writes=("dst",),
        reads_rows=Rows.OF_PLAN, writes_rows=Rows.NOT_OF_PLAN,
        labels=(("src", "src"), ("dst", "dst")),
        counts=(("snapshots", "dst"),),
    )

    serial: TicketSerial = attrs.field(metadata=shown(name="#"))
    src: tuple[MambaSlot, ...] = attrs.field(converter=_snapshot_src, metadata=shown(name="s", pair="dst"))
    dst: tuple[MambaSlot, ...] = attrs.field(converter=_snapshot_dst)
    at: tuple[int, ...] = attrs.field(default=(), converter=_snapshot_at, metadata=shown("at"))

    def _check(self) -> None:
        name = "MambaSnapshot"
        _check_serial(name, self.serial)
        if not self.dst:
            raise IRValidationError(name, "dst", self.dst, "a snapshot copies at least one slot")
        if len(self.src) != len(self.dst):
            raise IRValidationError(name, "dst", self.dst, f"length must equal len(src) ({len(self.src)})")
        if self.at and len(self.at) != len(self.src):
            raise IRValidationError(name, "at", self.at, f"length must be 0 (every snapshot at its chunk's end) or len(src) ({len(self.src)})")
        for a in self.at:
            if a < 1:
                raise IRValidationError(name, "at", a, "a snapshot is taken after at least one token of its chunk")
        _slots_positive(self)
        _no_repeat(name, "dst", self.dst)
        both = frozenset(self.src) & frozenset(self.dst)
        if both:
            s = min(both)
            raise IRValidationError(name, "dst", s, f"slot {s} is both a snapshot source and a snapshot target")




BeforeOp: TypeAlias = MambaInit
"""Every op kind that runs before the forward (declares ``When.BEFORE``): what ``ExtendPlan.tickets`` carry."""
AfterOp: TypeAlias = MambaSnapshot
"""Every op kind that runs after the forward (declares ``When.AFTER``): what ``ExtendPlan.snapshots`` carry."""
Op: TypeAlias = BeforeOp | AfterOp
"""Every one-shot op kind. A new kind: its class with its ``DECL`` here, a member of ``BeforeOp``
or ``AfterOp``, and its application in ``backend.state_init.apply_op``."""
OP_TYPES: Final[tuple[type[Op], ...]] = tuple(typing.get_args(Op))
"""The op classes (the wire and text forms know a node kind by its class name)."""


def op_decl(op: Op) -> OpDecl:
    """The declaration of ``op``'s kind."""
    return type(op).DECL


def op_groups(op: Op) -> tuple[SlotGroup, ...]:
    """Every slot field ``op`` reads or writes, in field order, with its declaration (fields read
    through attrs, as ``ir.wire`` reads nodes; each kind's fields and declaration read once)."""
    known = _GROUPS.get(id(op))
    if known is not None and known[0] is op:
        return known[1]
    fields, values = _group_fields(type(op))
    groups = tuple(SlotGroup(name, label, writes, rows, v) for (name, label, writes, rows), v in zip(fields, values(op), strict=True))
    if len(_GROUPS) >= _GROUPS_KEPT:
        _GROUPS.clear()
    _GROUPS[id(op)] = (op, groups)
    return groups


_GROUPS: dict[int, tuple[Op, tuple[SlotGroup, ...]]] = {}
"""``op_groups`` of the ops asked about last, by identity (an op is immutable; the entry holds the
op, so its id is not reused while it is here): a plan's few ops are asked about many times."""
_GROUPS_KEPT = 16


_GroupFields: TypeAlias = tuple[tuple[tuple[str, str, bool, Rows], ...], Callable[[Op], tuple[tuple[MambaSlot, ...], ...]]]


def _group_fields(kind: type[Op]) -> _GroupFields:
    """Per op kind, each slot field it reads or writes (its name, label, whether it writes, and its
    rows' declaration) and a reader of those fields' values, in the same order (``op_groups`` asks
    for every op, several times per plan)."""
    known = _GROUP_FIELDS.get(kind)
    if known is None:
        d = kind.DECL
        labels = dict(d.labels)
        fields = tuple(
            (a.name, labels[a.name], a.name in d.writes, d.writes_rows if a.name in d.writes else d.reads_rows)
            for a in attrs.fields(kind)
            if a.name in d.reads or a.name in d.writes
        )
        known = _GROUP_FIELDS[kind] = (fields, _reader(tuple(f[0] for f in fields)))
    return known


def _reader(names: tuple[str, ...]) -> Callable[[Op], tuple[tuple[MambaSlot, ...], ...]]:
    """The values of the declared fields ``names`` of an op, as a tuple (``operator.attrgetter``
    gives a bare value for one name)."""
    if not names:
        return lambda op: ()
    get = operator.attrgetter(*names)
    return (lambda op: (get(op),)) if len(names) == 1 else get


_GROUP_FIELDS: dict[type, _GroupFields] = {}


def op_reads(op: Op) -> tuple[MambaSlot, ...]:
    """Every slot ``op`` reads."""
    return tuple(s for g in op_groups(op) if not g.writes for s in g.slots)


def op_writes(op: Op) -> tuple[MambaSlot, ...]:
    """Every slot ``op`` writes."""
    return tuple(s for g in op_groups(op) if g.writes for s in g.slots)


def op_slots(op: Op) -> tuple[MambaSlot, ...]:
    """Every slot ``op`` names (read or written), in field order."""
    return tuple(s for g in op_groups(op) for s in g.slots)


def op_plan_rows(op: Op) -> tuple[MambaSlot, ...]:
    """The slots ``op`` requires to be rows of its plan (``Rows.OF_PLAN``): a plan over one of them
    must carry the op while it is pending (an init's targets, a snapshot's sources)."""
    return tuple(s for g in op_groups(op) if g.rows is Rows.OF_PLAN for s in g.slots)


def op_resets(op: Op) -> tuple[MambaSlot, ...]:
    """The slots ``op`` leaves in the cleared state a request at token 0 starts from."""
    d = op_decl(op)
    return tuple(s for g in op_groups(op) if g.field in d.resets for s in g.slots)


def op_counts(op: Op) -> dict[str, int]:
    """What ``op``'s ticket adds to each ledger counter it declares."""
    counts = _COUNTS.get(type(op))
    if counts is None:
        counts = _COUNTS[type(op)] = tuple((counter, operator.attrgetter(field) if field else None) for counter, field in op_decl(op).counts)
    return {counter: len(get(op)) if get is not None else 1 for counter, get in counts}


_COUNTS: dict[type, tuple[tuple[str, Callable[[Op], tuple[MambaSlot, ...]] | None], ...]] = {}
"""Per op kind, each counter it declares and a reader of the field it counts (``None``: one per op)."""


def op_when(op: Op) -> When:
    """Whether ``op`` runs before the forward of its plan (``When.BEFORE``) or after it (``When.AFTER``),
    as its kind declares."""
    return op_decl(op).when


def op_text(op: Op) -> str:
    """``op``'s slots for messages: ``clear [2], cow [4->2]``, ``snapshot [1->4]`` (its printed
    fields: a paired one as copies, words keyed by their text key or the op's name)."""
    d = op_decl(op)
    values = attrs.asdict(op, recurse=False)
    parts = []
    for a in attrs.fields(type(op)):
        shown_ = shown_of(a)[1]
        if shown_ is None or shown_.name != "s":
            continue
        key = shown_.key or d.name
        if shown_.pair:
            copies = ", ".join(f"{x}->{y}" for x, y in zip(values[a.name], values[shown_.pair], strict=True))
            parts.append(f"{key} [{copies}]")
        else:
            parts.append(f"{key} {list(values[a.name])}")
    return ", ".join(parts)


def _slots_positive(op: Op) -> None:
    for g in op_groups(op):
        for s in g.slots:
            if s < 1:
                raise IRValidationError(type(op).__name__, g.field, s, "slot must be >= 1 (slot 0 is the padding slot)")


def _check_declarations() -> None:
    """Every op kind's ``DECL`` names its own slot fields, and its ``when`` agrees with the alias
    (``BeforeOp``/``AfterOp``) it belongs to: checked once, at import, so a new kind that
    contradicts itself fails at once."""
    before = typing.get_args(BeforeOp) or (BeforeOp,)
    for cls in OP_TYPES:
        d = cls.DECL
        names = {a.name for a in attrs.fields(cls)}
        declared = (*d.reads, *d.writes, *(f for f, _ in d.labels), *(f for _, f in d.counts if f), *d.resets)
        unknown = [f for f in declared if f not in names]
        if unknown:
            raise TypeError(f"{cls.__name__}.DECL names {unknown}, not fields of {cls.__name__}")
        if {f for f, _ in d.labels} != {*d.reads, *d.writes} or set(d.reads) & set(d.writes) or not set(d.resets) <= set(d.writes):
            raise TypeError(f"{cls.__name__}.DECL: every read or written field has one label, none is both, resets are written")
        if (d.when is When.BEFORE) != (cls in before):
            raise TypeError(f"{cls.__name__}.DECL.when is {d.when.value}, but it is {'not ' if cls not in before else ''}a BeforeOp")


_check_declarations()


OpT = TypeVar("OpT", bound=Op, covariant=True)


@final
@linear
@attrs.frozen(kw_only=True)
class Ticket(Node, Generic[OpT]):
    """One op addressed to one state pool: a linear resource, consumed exactly once there.

    The identity of a ticket is ``(serial, pool)``; copies of a ticket are the same ticket.
    ``pool`` is a non-empty pool name and ``op`` one of ``OP_TYPES`` (itself checked when built).
    ``Ticket[MambaInit]`` (``InitTicket``) and ``Ticket[MambaSnapshot]`` keep apart, for mypy,
    what runs before and after the forward; at run time a plan's fields check it (``ir.plan``).
    """

    op: OpT = attrs.field(metadata=shown("op", tags={c.DECL.name: c for c in OP_TYPES}))
    pool: PoolId

    def _check_first(self) -> None:
        check_pool(self, "pool", self.pool)

    @property
    def serial(self) -> TicketSerial:
        """The serial of the ticket's op: with ``pool``, the key the ledger knows the ticket by."""
        return self.op.serial

    def __str__(self) -> str:
        return f"{op_decl(self.op).ticket} #{self.serial} for pool {self.pool!r}"


InitTicket: TypeAlias = Ticket[BeforeOp]
"""A ticket of an op run before the forward (``ExtendPlan.tickets``)."""
SnapshotTicket: TypeAlias = Ticket[AfterOp]
"""A ticket of an op run after the forward (``ExtendPlan.snapshots``)."""
