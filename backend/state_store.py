"""The state-store contract: batchc's one-shot ops applied to recurrent state an engine owns, under
the ledger's exactly-once check.

An engine that keeps its own state tensors (its own pool layout, its own model code) implements
``StateStore`` over them: rows ``1..capacity`` of one pool, each a request's (or a prefix cache
entry's) recurrent state, and two operations, ``clear_rows`` and ``copy_rows``. It then runs every
plan that touches those rows inside ``StateOps.applying(plan, store)``:

    with ops.applying(plan, store) as applied:   # the plan's clears and copy-on-writes applied first
        logits = my_forward(plan, my_state)       # the engine's own forward advances applied.rows
    # the plan's snapshots (cache entries) applied after the block; its tickets consumed

What ``applying`` guarantees, the same as batchc's own executor (``backend.executor.Executor``),
for any store:

- Before a byte of the store moves: every ticket the plan carries for ``store.pool_id`` is claimed
  from the ledger (``backend.ledger.Ledger.claiming``): a replayed ticket (consumed, in flight or
  cancelled), a forged one (never registered, or registered with other ops), one addressed to
  another pool, and a plan over a row whose registered ticket it does not carry (a dropped op) are
  refused with the ledger's errors; every slot an op names is checked against the store's capacity
  and against the plan's rows (an init writes rows of the plan, a copy reads a cache slot that is
  not one), a row starting at token 0 must be cleared by the plan's own init, a row that continues
  a state (past token 0, or a mixed plan's decode row) must not be cleared, and a plan whose ops
  were lowered for other pools only is refused (``PlanExecutionError``). The store sees only the
  registered tickets' ops, never the copies a plan carries.
- The init ops run before the block: clears, then copies (``copy_rows`` reads every source as it
  was before the call; the IR guarantees a copy source is never a row the same forward writes).
- The snapshots run after the block succeeds, then every ticket is consumed.
- If the block (or a snapshot) raises, every ticket of the plan returns to outstanding, and with a
  ``RestorableStore`` every row the plan could have written (its rows, its init's and its
  snapshots' targets) is put back as it was, so the same plan can simply run again. With a plain
  ``StateStore`` the rows the init wrote hold the init's result (running the plan again re-applies
  it exactly: clears and copies from rows the plan never writes), and the plan's other rows (chunk
  continuations, decodes) hold what the failed forward left: retry only after restoring them, or
  abort those requests.
- mypy's linear-use plugin checks the call like an executor's: ``applying`` consumes the plan on
  ``store``, so the same plan applied twice to one store is ``linear-reuse``.

A snapshot taken inside a chunk (``AdmittedRequest.snapshot_at``: an inner snapshot) needs the
state the forward captured at that position, which only batchc's executor records; ``applying``
refuses such a plan before claiming anything. ``backend.pool.MambaStatePool`` is one
``RestorableStore``; ``DictStore`` below, a store of named tensors with the slot as their first
dimension, is another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Protocol, TypeAlias, runtime_checkable

import attrs
import torch

from backend.ledger import Ledger
from ir.errors import PlanExecutionError, short_repr
from ir.head import HeadExtendPlan
from ir.ids import PoolId
from ir.init import MambaInit, MambaSnapshot, Op, Rows, Ticket, When, op_decl, op_groups, op_resets, op_when
from ir.linear import consumes_on
from ir.plan import DecodePlan, ExtendPlan, MixedPlan

__all__ = [
    "Applied",
    "DictStore",
    "RestorableStore",
    "StateOps",
    "StateStore",
    "StorePlan",
    "check_fresh_rows",
    "own_tickets",
]

StorePlan: TypeAlias = ExtendPlan | MixedPlan | DecodePlan | HeadExtendPlan
"""The plans ``StateOps.applying`` runs: the ones whose rows a forward advances from the state
batchc's one-shot ops set up (a prefill, a mixed forward, a decode, a draft head's extend)."""


@runtime_checkable
class StateStore(Protocol):
    """Recurrent state an engine owns, one pool's worth: rows ``1..capacity`` (row 0 is never named
    by a plan: padding, if the store has one)."""

    @property
    def pool_id(self) -> PoolId:
        """The pool the plan's tickets are addressed to (``LowerContext.pools``)."""
        ...

    @property
    def capacity(self) -> int:
        """The highest row a plan may name."""
        ...

    def clear_rows(self, slots: Sequence[int]) -> None:
        """Put each row of ``slots`` in the state of a sequence that has seen no token (zeros)."""
        ...

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Row ``dst[i]`` becomes a copy of row ``src[i]``, every source read as it was before the
        call (no destination is a source)."""
        ...


@runtime_checkable
class RestorableStore(StateStore, Protocol):
    """A ``StateStore`` that can put rows back: ``applying`` saves the rows a plan may write before
    its first op and restores them if the forward fails, so a failed plan leaves the store as it was."""

    def save_rows(self, slots: Sequence[int]) -> object:
        """A copy of the rows of ``slots`` (whatever ``restore_rows`` reads back)."""
        ...

    def restore_rows(self, slots: Sequence[int], saved: object) -> None:
        """Put the rows of ``slots`` back as ``save_rows(slots)`` saw them."""
        ...


@attrs.frozen
class Applied:
    """What ``applying`` did before the block: the plan's ``rows`` (the slots the forward advances,
    in plan order), the rows its init ``cleared``, its copy-on-writes ``copied`` (source, destination)
    and the ``snapshots`` (source, cache slot) it applies after the block."""

    rows: tuple[int, ...]
    cleared: tuple[int, ...]
    copied: tuple[tuple[int, int], ...]
    snapshots: tuple[tuple[int, int], ...]


def _rows_of(plan: StorePlan) -> list[int]:
    match plan:
        case MixedPlan():
            return [*plan.extend.slots.tolist(), *plan.decode.slots.tolist()]
        case ExtendPlan() | DecodePlan() | HeadExtendPlan():
            rows: list[int] = plan.slots.tolist()
            return rows
        case _:
            raise PlanExecutionError(
                f"StateOps.applying: plan must be an ExtendPlan, MixedPlan, DecodePlan or HeadExtendPlan, got {short_repr(plan)} ({type(plan).__name__})"
            )


def own_tickets(
    plan: ExtendPlan | HeadExtendPlan, pool: PoolId, capacity: int, own: frozenset[int],
    live: Callable[[tuple[int, ...], str], None] | None = None, whose: str = "this store's pool",
) -> list[Ticket[Op]]:
    """The plan's tickets for ``pool``, each checked as its op kind declares (``ir.init.OpDecl``):
    every slot in ``[1, capacity]``, ``OF_PLAN`` slots rows of the plan (``own``), ``NOT_OF_PLAN``
    ones not, and (with ``live``, an allocator's check) every slot live. A kind the plan carries for
    other pools only is refused: running the plan here would skip this pool's op. Every refusal is a
    ``PlanExecutionError`` naming the op, its serial and the slot."""
    mine = plan.tickets_for(pool)
    kinds = {type(t.op) for t in mine}
    for t in plan.all_tickets():
        if type(t.op) not in kinds:
            pools = ", ".join(repr(o.pool) for o in plan.all_tickets() if type(o.op) is type(t.op))
            raise PlanExecutionError(f"plan with {op_decl(t.op).name} #{t.serial} was lowered for pool(s) {pools}, not for {whose} {pool!r}")
    for t in mine:
        op, what = t.op, f"{op_decl(t.op).name} #{t.serial}"
        groups = op_groups(op)
        for g in groups:
            for s in g.slots:
                if not 1 <= s <= capacity:
                    raise PlanExecutionError(f"{what}: {g.label} slot {s} out of range [1, {capacity}] of pool {pool!r}")
        for g in sorted(groups, key=lambda g: g.rows is not Rows.OF_PLAN):  # (stable: field order within each)
            verb = "writes" if g.writes else "reads"
            if g.rows is Rows.OF_PLAN:
                stray = frozenset(g.slots) - own
                if stray:
                    raise PlanExecutionError(f"{what} {verb} slot {min(stray)}, which is not a row of this plan (rows {sorted(own)})")
            else:
                inside = frozenset(g.slots) & own
                if inside:
                    raise PlanExecutionError(f"{what} {verb} slot {min(inside)}, a row of this plan (a cache slot is never a request's row)")
        if live is not None:
            live(tuple(s for g in groups for s in g.slots), what)
    return list(mine)


def check_fresh_rows(
    plan: StorePlan, ext: ExtendPlan | HeadExtendPlan, tickets: Sequence[Ticket[Op]], starts: Sequence[Mapping[int, int]] = ()
) -> None:
    """A row that starts at token 0 starts from a cleared state, and only the plan's own ops (the
    registered ones, claimed) can clear it (``ir.init.op_resets``): a plan stripped of its ticket
    would run on whatever the slot held. Conversely, a row that continues a state (a chunk after a
    copied prefix or earlier chunks, ``prefix_lens > 0``; a mixed plan's decode row) is never
    cleared: a clear spliced onto its plan would wipe the state transferred into it (SGLang PR
    #32995's stale clear). ``starts`` (``backend.ledger.Claim.starts``, aligned with ``tickets``):
    where each ticket's rows started in the plan it was registered with; a row of this plan that
    starts elsewhere is refused (a copy-on-write of a request's first chunk spliced onto its own
    continuation chunk would put the copied prefix's state under a row that continues from later
    tokens). Called inside the claim, before any op, so a refusal leaves the state as it was."""
    before = [t.op for t in tickets if op_when(t.op) is When.BEFORE]
    cleared = frozenset(s for op in before for s in op_resets(op))
    if cleared:
        _check_no_reset_of_continued(plan, ext, cleared)
    _check_registered_starts(plan, ext, tickets, starts)
    fresh = ext.slots[ext.prefix_lens == 0]
    if not fresh.size:
        return
    missing = [s for s in fresh.tolist() if s not in cleared]
    if missing:
        raise PlanExecutionError(
            f"{type(plan).__name__}: slot {missing[0]} starts at token 0 but the plan's init does not clear it "
            f"(init: {'none for this pool' if not before else ', '.join(map(str, before))})"
        )


def _check_registered_starts(
    plan: StorePlan, ext: ExtendPlan | HeadExtendPlan, tickets: Sequence[Ticket[Op]], starts: Sequence[Mapping[int, int]]
) -> None:
    """Each ticket's rows start in ``ext`` where they started in the plan it was registered with."""
    if not any(starts):
        return
    here = dict(zip(ext.slots.tolist(), ext.prefix_lens.tolist(), strict=True))
    for t, bound in zip(tickets, starts, strict=True):
        for slot, start in bound.items():
            if slot in here and here[slot] != start:
                raise PlanExecutionError(
                    f"{type(plan).__name__}: {t} was lowered for slot {slot} starting at token {start}, and this plan's row "
                    f"starts at token {here[slot]}: its ops belong to another plan (another chunk of the request)"
                )


def _check_no_reset_of_continued(plan: StorePlan, ext: ExtendPlan | HeadExtendPlan, cleared: frozenset[int]) -> None:
    """No slot in ``cleared`` is a row that continues a state: an extend row past token 0, or a
    mixed plan's decode row (``check_fresh_rows``)."""
    starts = dict(zip(ext.slots.tolist(), ext.prefix_lens.tolist(), strict=True))
    if isinstance(plan, MixedPlan):
        starts.update(zip(plan.decode.slots.tolist(), (plan.decode.seq_lens - 1).tolist(), strict=True))
    continued = sorted(s for s in cleared if starts.get(s, 0) > 0)
    if continued:
        s = continued[0]
        raise PlanExecutionError(
            f"{type(plan).__name__}: the init clears slot {s}, whose row continues a state from token {starts[s]} "
            "(a copied prefix, earlier chunks or decodes): a clear would wipe it"
        )


def _apply(store: StateStore, op: Op) -> None:
    match op:
        case MambaInit():
            if op.clear_slots:
                store.clear_rows(op.clear_slots)
            if op.cow_dst:
                store.copy_rows(op.cow_src, op.cow_dst)
        case MambaSnapshot():
            if op.dst:
                store.copy_rows(op.src, op.dst)


class StateOps:
    """Runs plans' one-shot ops on state stores an engine owns, under ``ledger`` (the engine's, where
    its plans' tickets are registered): see the module for what ``applying`` guarantees."""

    def __init__(self, ledger: Ledger) -> None:
        """``ledger``: a ``backend.ledger.Ledger`` (``TypeError`` naming it otherwise)."""
        if not isinstance(ledger, Ledger):
            raise TypeError(f"StateOps: ledger must be a backend.ledger.Ledger, got {short_repr(ledger)}")
        self.ledger = ledger

    @consumes_on("store")
    @contextmanager
    def applying(self, plan: StorePlan, store: StateStore) -> Iterator[Applied]:
        """Apply ``plan``'s ops for ``store.pool_id`` around the block: its init ops before, its
        snapshots after, each ticket claimed from the ledger first and consumed once the block and
        the snapshots succeed (the module says what a failure leaves)."""
        if not isinstance(store, StateStore):
            raise PlanExecutionError(f"StateOps.applying: store must implement backend.state_store.StateStore, got {short_repr(store)}")
        capacity: object = store.capacity
        if type(capacity) is not int or capacity < 1:
            raise PlanExecutionError(f"StateOps.applying: the store's capacity must be an int >= 1, got {short_repr(capacity)}")
        rows = _rows_of(plan)
        ext = plan.extend if isinstance(plan, MixedPlan) else plan
        pool = store.pool_id
        tickets: list[Ticket[Op]] = []
        if isinstance(ext, (ExtendPlan, HeadExtendPlan)):
            tickets = own_tickets(ext, pool, store.capacity, frozenset(rows))
            inner = [t for t in tickets if isinstance(t.op, MambaSnapshot) and t.op.at]
            if inner:
                raise PlanExecutionError(
                    f"{type(plan).__name__}: snapshot #{inner[0].serial} is taken inside a chunk (at {list(inner[0].op.at)}), "  # type: ignore[union-attr]  # the filter above kept snapshots only
                    "which needs the forward's captured states: only batchc's executor records them (lower without inner snapshots)"
                )
        bad = [r for r in rows if not 1 <= r <= store.capacity]
        if bad:
            raise PlanExecutionError(f"{type(plan).__name__}: slot {bad[0]} out of range [1, {store.capacity}] of pool {pool!r}")
        with self.ledger.claiming(tickets, pool, rows, type(plan).__name__) as claim:
            ops = [t.op for t in claim.tickets]  # the registered tickets' ops, never the plan's copies
            if isinstance(ext, (ExtendPlan, HeadExtendPlan)):
                check_fresh_rows(plan, ext, claim.tickets, claim.starts)
            before = [op for op in ops if op_when(op) is When.BEFORE]
            after = [op for op in ops if op_when(op) is When.AFTER]
            applied = Applied(
                rows=tuple(rows),
                cleared=tuple(s for op in before if isinstance(op, MambaInit) for s in op.clear_slots),
                copied=tuple(p for op in before if isinstance(op, MambaInit) for p in zip(op.cow_src, op.cow_dst, strict=True)),
                snapshots=tuple(p for op in after if isinstance(op, MambaSnapshot) for p in zip(op.src, op.dst, strict=True)),
            )
            touched = sorted({*rows, *(s for op in ops for g in op_groups(op) if g.writes for s in g.slots)})
            saved = store.save_rows(touched) if isinstance(store, RestorableStore) else None
            try:
                for op in before:
                    _apply(store, op)
                yield applied
                for op in after:
                    _apply(store, op)
            except BaseException:
                if saved is not None and isinstance(store, RestorableStore):
                    store.restore_rows(touched, saved)
                raise


class DictStore:
    """A ``RestorableStore`` of named tensors whose first dimension is the slot (``capacity + 1``
    rows: row 0 is padding), e.g. an engine's per-layer conv and SSM states. Arguments checked:
    ``pool_id`` a non-empty str, ``tensors`` a non-empty mapping of names to tensors that share
    their first dimension, at least 2 (``ValueError``/``TypeError`` naming the value)."""

    def __init__(self, pool_id: str, tensors: Mapping[str, torch.Tensor]) -> None:
        args: tuple[object, object] = (pool_id, tensors)  # typed; checked because callers need not be typed
        if not isinstance(args[0], str) or not args[0]:
            raise TypeError(f"DictStore: pool_id must be a non-empty str, got {short_repr(pool_id)}")
        if not isinstance(args[1], Mapping) or not args[1]:
            raise TypeError(f"DictStore: tensors must be a non-empty mapping of names to tensors, got {short_repr(tensors)}")
        firsts = set()
        for name, value in args[1].items():
            t: object = value
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                raise TypeError(f"DictStore: tensors[{name!r}] must be a tensor with a slot dimension, got {short_repr(t)}")
            firsts.add(int(t.shape[0]))
        if len(firsts) != 1 or min(firsts) < 2:
            raise ValueError(f"DictStore: every tensor's first dimension must be the same (slots + 1 >= 2), got {sorted(firsts)}")
        self._pool_id = PoolId(pool_id)
        self.tensors: dict[str, torch.Tensor] = dict(tensors)
        self._capacity = firsts.pop() - 1

    @property
    def pool_id(self) -> PoolId:
        """The pool this store's tickets are addressed to."""
        return self._pool_id

    @property
    def capacity(self) -> int:
        """Rows ``1..capacity`` (the tensors' first dimension minus the padding row)."""
        return self._capacity

    def _index(self, slots: Iterable[int], t: torch.Tensor) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64, device=t.device)

    def clear_rows(self, slots: Sequence[int]) -> None:
        """Zero the rows of ``slots`` in every tensor."""
        for t in self.tensors.values():
            t.index_fill_(0, self._index(slots, t), 0)

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Row ``dst[i]`` of every tensor becomes row ``src[i]`` (sources read before any write)."""
        for t in self.tensors.values():
            t.index_copy_(0, self._index(dst, t), t.index_select(0, self._index(src, t)))

    def save_rows(self, slots: Sequence[int]) -> object:
        """Copies of the rows of ``slots``, per tensor."""
        return {name: t.index_select(0, self._index(slots, t)) for name, t in self.tensors.items()}

    def restore_rows(self, slots: Sequence[int], saved: object) -> None:
        """Put back what ``save_rows(slots)`` returned."""
        if not isinstance(saved, dict):
            raise TypeError(f"DictStore.restore_rows: saved must be what save_rows returned, got {short_repr(saved)}")
        for name, t in self.tensors.items():
            t.index_copy_(0, self._index(slots, t), saved[name])
