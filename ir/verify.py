"""Whole-node verifiers. Each raises ``IRVerificationError(path, message)`` on the first violation.

Checked here (local field checks live in the node validators):

- rids, slots and KV locations are unique within a batch or plan, across the parts of a mixed one;
- an ``ExtendBatch``'s ``MambaInit`` is exactly what its per-request intents ask for: the clear
  slots are the slots of the ``CLEAR`` requests, the COW dsts those of the ``COW`` requests, in
  request order, and ``init`` is ``None`` when no request needs an op;
- a COW src is never the live slot of a request in the same forward (it is a cached-state slot):
  not a slot of the batch or plan being prefilled, nor of the decode part of a mixed one. Clears and COW
  dsts as sources are refused by ``MambaInit`` itself. The plan-level form of this check runs at
  ``BATCHC_VERIFY=1`` (the default), which verifies each step's lowered plan; the batch-level form
  only at level 2;
- a plan's tickets write only slots of its own requests.

A draft head's extend (``HeadExtendBatch``/``HeadExtendPlan``, ``ir.head``) is checked as the
prefill it follows (its init ops against its intents, its tickets against its rows); a head commit
as the speculative phases (unique rows, slots and KV locations).

``verify(node)`` dispatches over every batch and plan type.
"""

from __future__ import annotations

import enum
import operator
import os
from collections.abc import Callable
from typing import assert_never, cast

import attrs
import numpy as np

from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.columns import I64, Composite, Node, first_common, first_missing, has_duplicates
from ir.errors import IRVerificationError, SettingsError, short_repr
from ir.head import HeadCommitBatch, HeadCommitPlan, HeadExtendBatch, HeadExtendPlan
from ir.init import InitIntent, MambaInit, MambaSnapshot, Op, Rows, Ticket, op_groups
from ir.nodes import NODE_TYPES, Batch, Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.spec import CommitBatch, SpecBatch, SpecPlan

__all__ = [
    "verify",
    "VerifyLevel",
    "parse_verify_level",
    "verify_level_from_env",
]


def _unique(path: str, arr: I64, what: str) -> None:
    if not has_duplicates(arr):
        return
    order = np.argsort(arr, kind="stable")
    sorted_ = arr[order]
    dup = np.flatnonzero(sorted_[1:] == sorted_[:-1])
    if dup.size:
        value = int(sorted_[dup[0]])
        first, second = sorted(int(i) for i in order[dup[0] : dup[0] + 2])
        raise IRVerificationError(f"{path}[{second}]", f"{what} {value} already used at index {first}")


def verify_extend_batch(batch: ExtendBatch | HeadExtendBatch, path: str = "ExtendBatch") -> None:
    _unique(f"{path}.rids", batch.rids, "request id")
    _unique(f"{path}.slots", batch.slots, "slot")
    _unique(f"{path}.kv_locs", batch.kv_locs, "KV location")
    clears = tuple(int(s) for s, i in zip(batch.slots, batch.intents, strict=True) if i is InitIntent.CLEAR)
    dsts = tuple(int(s) for s, i in zip(batch.slots, batch.intents, strict=True) if i is InitIntent.COW)
    snap = batch.snapshot
    if snap is not None:
        live = frozenset(int(s) for s in batch.slots)
        for j, (src, dst) in enumerate(zip(snap.src, snap.dst, strict=True)):
            if src not in live:
                raise IRVerificationError(f"{path}.snapshot.src[{j}]", f"slot {src} is not a request of this batch")
            if dst in live:
                raise IRVerificationError(f"{path}.snapshot.dst[{j}]", f"cache slot {dst} is the live slot of a request")
        if snap.at:
            lens = dict(zip(batch.slots.tolist(), batch.extend_lens.tolist(), strict=True))
            for j, (src, at) in enumerate(zip(snap.src, snap.at, strict=True)):
                if not 0 < at <= lens[src]:
                    raise IRVerificationError(
                        f"{path}.snapshot.at[{j}]", f"{at} is not a position in slot {src}'s chunk (1 to its extend_len {lens[src]})"
                    )
    init = batch.init
    if init is None:
        if clears or dsts:
            raise IRVerificationError(f"{path}.init", f"requests need init ops (clear {clears}, COW into {dsts}) but init is None")
        return
    if tuple(init.clear_slots) != clears:
        raise IRVerificationError(
            f"{path}.init.clear_slots", f"{tuple(init.clear_slots)} differ from the CLEAR requests' slots {clears}"
        )
    if tuple(init.cow_dst) != dsts:
        raise IRVerificationError(f"{path}.init.cow_dst", f"{tuple(init.cow_dst)} differ from the COW requests' slots {dsts}")
    live = frozenset(int(s) for s in batch.slots)
    for j, src in enumerate(init.cow_src):
        if src in live:
            raise IRVerificationError(f"{path}.init.cow_src[{j}]", f"COW src {src} is the live slot of a request in this batch")
    if snap is not None:
        _no_copy_of_a_snapshot_in_the_same_forward(f"{path}.init", batch.rids, batch.slots, init, snap)


def _no_copy_of_a_snapshot_in_the_same_forward(path: str, rids: I64, slots: I64, cow: MambaInit, snap: MambaSnapshot) -> None:
    """A copy-on-write runs before the forward and a snapshot after it: a row that copies the cache
    slot another row of the same forward snapshots into would read that slot's old contents, not
    the prefix the scheduler meant (the prefix is computed by this very forward)."""
    written: dict[int, int] = {int(dst): k for k, dst in enumerate(snap.dst)}
    for j, src in enumerate(cow.cow_src):
        k = written.get(int(src))
        if k is not None:
            rows = slots.tolist()
            cow_row, snap_row = rows.index(cow.cow_dst[j]), rows.index(snap.src[k])
            raise IRVerificationError(
                f"{path}.cow_src[{j}]",
                f"row {cow_row} (request {int(rids[cow_row])}, slot {cow.cow_dst[j]}) copies cache slot {src}, which row {snap_row} "
                f"(request {int(rids[snap_row])}, slot {snap.src[k]}) snapshots into in the same forward: the copy runs before "
                "the forward and would read the slot's old state; copy it in a later step",
            )


def verify_decode_batch(batch: DecodeBatch, path: str = "DecodeBatch") -> None:
    _unique(f"{path}.rids", batch.rids, "request id")
    _unique(f"{path}.slots", batch.slots, "slot")
    _unique(f"{path}.kv_locs", batch.kv_locs, "KV location")


def _disjoint(path: str, a: I64, b: I64, what: str) -> None:
    both = first_common(a, b)
    if both is not None:
        raise IRVerificationError(path, f"{what} {both} is in both the extend and the decode part")


def _cow_src_not_in(path: str, cow_src: tuple[int, ...], slots: I64, what: str) -> None:
    """A COW must not read a slot this forward also runs a request in: that is a live request's
    state, which the forward advances, not a cached one."""
    if not cow_src:
        return
    written = frozenset(slots.tolist())
    for j, src in enumerate(cow_src):
        if src in written:
            raise IRVerificationError(f"{path}[{j}]", f"COW src {src} is the live slot of a request in {what}")


def verify_mixed_batch(batch: MixedBatch, path: str = "MixedBatch") -> None:
    verify_extend_batch(batch.extend, f"{path}.extend")
    verify_decode_batch(batch.decode, f"{path}.decode")
    if batch.extend.init is not None:
        _cow_src_not_in(f"{path}.extend.init.cow_src", batch.extend.init.cow_src, batch.decode.slots, "the decode part")
    _disjoint(f"{path}.rids", batch.extend.rids, batch.decode.rids, "request id")
    _disjoint(f"{path}.slots", batch.extend.slots, batch.decode.slots, "slot")
    _disjoint(f"{path}.kv_locs", batch.extend.kv_locs, batch.decode.kv_locs, "KV location")


def _verify_tickets(path: str, plan: ExtendPlan | HeadExtendPlan, slots: I64, what: str, own: bool) -> None:
    """Every ticket's slots against ``slots``, as its op kind declares (``ir.init.OpDecl``): with
    ``own`` (the plan's own rows), an ``OF_PLAN`` slot must be one of them; whatever ``slots`` are, a
    ``NOT_OF_PLAN`` slot must not be (a COW that read a live request's row would copy a state the
    forward advances, not a cached one)."""
    if not plan.tickets and not plan.snapshots:
        return
    live = frozenset(slots.tolist())
    fields: tuple[tuple[str, tuple[Ticket[Op], ...]], ...] = (("tickets", plan.tickets), ("snapshots", plan.snapshots))
    for field, tickets in fields:
        for k, t in enumerate(tickets):
            for g in op_groups(t.op):
                verb = "writes" if g.writes else "reads"
                for j, s in enumerate(g.slots):
                    if own and g.rows is Rows.OF_PLAN and s not in live:
                        raise IRVerificationError(f"{path}.{field}[{k}]", f"{t} {verb} slot {s}, which no request of the plan owns")
                    if g.rows is Rows.NOT_OF_PLAN and s in live:
                        raise IRVerificationError(
                            f"{path}.{field}[{k}].op.{g.field}[{j}]", f"{g.label} {s} is the live slot of a request in {what}"
                        )


def verify_extend_plan(plan: ExtendPlan | HeadExtendPlan, path: str = "ExtendPlan") -> None:
    _unique(f"{path}.rids", plan.rids, "request id")
    _unique(f"{path}.slots", plan.slots, "slot")
    _unique(f"{path}.kv_locs", plan.kv_locs, "KV location")
    _verify_tickets(path, plan, plan.slots, "this plan", own=True)
    if plan.snapshots and plan.tickets:  # (every pool's ticket carries its serial's one set of ops: the first of each tells)
        _no_copy_of_a_snapshot_in_the_same_forward(f"{path}.tickets[0].op", plan.rids, plan.slots, plan.tickets[0].op, plan.snapshots[0].op)


def verify_decode_plan(plan: DecodePlan, path: str = "DecodePlan") -> None:
    _unique(f"{path}.rids", plan.rids, "request id")
    _unique(f"{path}.slots", plan.slots, "slot")
    _unique(f"{path}.kv_locs", plan.kv_locs, "KV location")


def check_fields(node: Batch | Plan) -> None:
    """Re-run the local field checks of ``node`` and of the nodes it is made of (a mixed node's
    parts, a speculative plan's batch) and of the rows aligned with theirs (``sampling``, which
    passes build without checks too) (``IRValidationError``)."""
    nodes: tuple[Node, ...] = (node, *node.parts()) if isinstance(node, Composite) else (node,)
    for n in nodes:
        n.check_fields()
        for value in (_FIELD_VALUES.get(type(n)) or _field_values(type(n)))(n):
            if isinstance(value, Node) and type(value).ALIGNED:
                value.check_fields()


_FIELD_VALUES: dict[type, Callable[[object], tuple[object, ...]]] = {}


def _field_values(cls: type) -> Callable[[object], tuple[object, ...]]:
    """A getter of every attrs field's value of a ``cls`` node, in field order (one ``attrgetter``
    per class, made once: ``attrs.asdict`` built a dict per node per verify)."""
    getter = _FIELD_VALUES.get(cls)
    if getter is None:
        names = [a.name for a in attrs.fields(cast("type[attrs.AttrsInstance]", cls))]
        if not names:
            getter = _no_fields
        else:
            get = operator.attrgetter(*names)
            getter = (lambda n: (get(n),)) if len(names) == 1 else get
        _FIELD_VALUES[cls] = getter
    return getter


def _no_fields(node: object) -> tuple[object, ...]:
    return ()


def _verify_spec(node: SpecBatch | HeadCommitBatch, path: str) -> None:
    _unique(f"{path}.rids", node.rids, "request id")
    _unique(f"{path}.slots", node.slots, "slot")
    _unique(f"{path}.kv_locs", node.kv_locs, "KV location")
    if isinstance(node, CommitBatch):
        stray = first_missing(node.released_kv, node.kv_locs)
        if stray is not None:
            raise IRVerificationError(f"{path}.released_kv", f"KV location {stray} is not in any row's window")


def verify(node: Batch | Plan) -> None:
    """Verify any batch or plan: its local field checks again, then the whole-node invariants.
    Raises ``IRValidationError`` or ``IRVerificationError`` on the first violation (``TypeError`` for
    what is not a batch or a plan). The speculative phases (``SpecBatch``, ``SpecPlan``) share their
    invariants: one check serves them all."""
    if not isinstance(node, NODE_TYPES):
        raise TypeError(f"verify: node must be an IR batch or plan, got {short_repr(node)} ({type(node).__name__})")
    check_fields(node)
    if isinstance(node, SpecBatch):
        _verify_spec(node, type(node).__name__)
        return
    if isinstance(node, SpecPlan):
        _verify_spec(node.batch, f"{type(node).__name__}.batch")
        return
    match node:
        case ExtendBatch():
            verify_extend_batch(node)
        case DecodeBatch():
            verify_decode_batch(node)
        case MixedBatch():
            verify_mixed_batch(node)
        case ExtendPlan():
            verify_extend_plan(node)
        case DecodePlan():
            verify_decode_plan(node)
        case MixedPlan():
            verify_extend_plan(node.extend, "MixedPlan.extend")
            verify_decode_plan(node.decode, "MixedPlan.decode")
            _verify_tickets("MixedPlan.extend", node.extend, node.decode.slots, "the decode part", own=False)
            _disjoint("MixedPlan.slots", node.extend.slots, node.decode.slots, "slot")
            _disjoint("MixedPlan.kv_locs", node.extend.kv_locs, node.decode.kv_locs, "KV location")
        case HeadExtendBatch():
            verify_extend_batch(node, "HeadExtendBatch")
        case HeadExtendPlan():
            verify_extend_plan(node, "HeadExtendPlan")
        case HeadCommitBatch():
            _verify_spec(node, "HeadCommitBatch")
        case HeadCommitPlan():
            _verify_spec(node.batch, "HeadCommitPlan.batch")
        case IdleBatch() | IdlePlan():
            pass
        case _:
            assert_never(node)


class VerifyLevel(enum.IntEnum):
    """How much a pass manager verifies (``BATCHC_VERIFY``)."""

    OFF = 0
    LAST = 1
    """After the last pass of each step (the default)."""
    EVERY_PASS = 2
    """After every pass, plus the executor's in-place mutation detector (the test setting)."""


def parse_verify_level(value: str | None) -> VerifyLevel:
    """``BATCHC_VERIFY``: exactly ``"0"``, ``"1"`` or ``"2"``; unset or empty means 1. Nothing is
    stripped or coerced (``" 1"`` and ``"yes"`` are refused with ``SettingsError``). The one parser
    of the variable: the pass manager and the executor's mutation detector both read it here."""
    if value is None or value == "":
        return VerifyLevel.LAST
    if value not in ("0", "1", "2"):
        raise SettingsError(f"BATCHC_VERIFY must be 0, 1 or 2, got {value[:40]!r}")
    return VerifyLevel(int(value))


def verify_level_from_env() -> VerifyLevel:
    """``parse_verify_level`` of this process's ``BATCHC_VERIFY``."""
    return parse_verify_level(os.environ.get("BATCHC_VERIFY"))
