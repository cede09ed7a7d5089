"""Forward plans: what the backend executes. Lowered from batches by ``passes.lower``.

A plan holds the same immutable columns as the batch it was lowered from (shared, not copied) and
nothing the backend must not act on: ``ExtendPlan`` and ``MixedPlan`` carry their one-shot ops only
as ``ir.init.Ticket``s, one per state pool and op kind: ``tickets`` the ops that run before the
forward (``InitTicket``: a ``MambaInit``), ``snapshots`` those that run after it; ``DecodePlan``
and ``IdlePlan`` have no ticket field at all.

Invariant: per op kind, a plan's tickets all carry the same op (one serial) and distinct pools, and
each field holds only ops that run when it says (their ``DECL.when``). Every field is type-checked on construction
(``IRValidationError`` naming the field and the value).

Every plan (these and the speculative ones in ``ir.spec``) exposes its rows the same way, as a
``RequestRows``: ``rids`` and ``slots``, read-only int64 columns in row order (a mixed plan's extend
rows, then its decode rows; none for an idle plan), and ``rid_list()``/``slot_list()`` of them.
"""

from __future__ import annotations

from typing import cast, final

import attrs
import numpy as np

from ir.batch import PREFIX_MAX
from ir.columns import (
    I64,
    KV_NAMES,
    MAX_SEQ_LEN,
    MAX_SEQ_LEN_WHAT,
    REQUEST,
    REQUEST_NAME,
    SLOT_NAME,
    BoolArray,
    ColumnNode,
    Composite,
    RequestRows,
    as_bool,
    as_i64,
    check_int,
    column,
    freeze,
    frozen_i64,
    per,
    shown,
    tokens_of,
    type_names,
)
from ir.errors import IRValidationError
from ir.ids import HiddenId, PoolId, SampleId
from ir.init import OP_TYPES, InitTicket, Op, SnapshotTicket, Ticket, When, op_when
from ir.linear import linear
from ir.sampling import SamplingRows

__all__ = [
    "Ticketed",
    "ExtendPlan",
    "DecodePlan",
    "MixedPlan",
    "IdlePlan",
]


def ticket_tuple(node: str, field: str, values: object, when: When) -> tuple[object, ...]:
    """A ticket field's converter (``node.field``, holding ops that run ``when``): a tuple of checked
    entries (``check_fields`` checks them again, for plans built by ``build_unchecked``)."""
    if not isinstance(values, (tuple, list)):
        raise IRValidationError(node, field, values, f"must be a tuple of {_ticket_names(when)}")
    out = tuple(values)
    check_tickets(node, field, out, when)
    return out


def _tickets(values: object) -> tuple[InitTicket, ...]:
    """Converter of ``ExtendPlan.tickets`` (``ticket_tuple``)."""
    return cast("tuple[InitTicket, ...]", ticket_tuple("ExtendPlan", "tickets", values, When.BEFORE))


def _snapshots(values: object) -> tuple[SnapshotTicket, ...]:
    """Converter of ``ExtendPlan.snapshots``, like ``_tickets``."""
    return cast("tuple[SnapshotTicket, ...]", ticket_tuple("ExtendPlan", "snapshots", values, When.AFTER))


def _ticket_names(when: When) -> str:
    """``"a Ticket of a MambaInit"``: the tickets a field of ``when`` holds, from the declarations."""
    return "a Ticket of " + type_names(tuple(c for c in OP_TYPES if c.DECL.when is when))


def check_tickets(node: str, field: str, tickets: tuple[object, ...], when: When) -> None:
    """Every entry a ``Ticket`` (itself checked when built) of an op kind that runs ``when``; per op
    kind, one ticket per pool, all with one serial and the same op (every pool's state starts
    alike). (``tickets`` is typed ``object`` entries: the check is for callers that are not
    type-checked.)"""
    pools: dict[type, set[PoolId]] = {}
    serials: dict[type, set[int]] = {}
    ops: dict[type, set[object]] = {}
    for t in tickets:
        if not isinstance(t, Ticket) or op_when(t.op) is not when:
            got = type(t).__name__ if not isinstance(t, Ticket) else f"a Ticket of a {type(t.op).__name__}"
            raise IRValidationError(node, field, t, f"every entry must be {_ticket_names(when)}, not {got}")
        kind = type(t.op)
        if t.pool in pools.setdefault(kind, set()):
            raise IRValidationError(node, field, t.pool, "two tickets for one pool")
        pools[kind].add(t.pool)
        serials.setdefault(kind, set()).add(t.serial)
        ops.setdefault(kind, set()).add(t.op)
    for kind in pools:
        if len(serials[kind]) > 1:
            raise IRValidationError(node, field, sorted(serials[kind]), "tickets of one plan share one serial")
        if len(ops[kind]) > 1:
            raise IRValidationError(node, field, tickets, "tickets of one plan carry the same ops for every pool")


def check_hidden_id(node: str, field: str, value: object) -> None:
    """An optional ``HiddenId``: ``None`` or a positive int."""
    if value is not None and check_int(node, field, value) <= 0:
        raise IRValidationError(node, field, value, "must be a positive hidden id (ir.mint.mint_hidden_id())")


def _check_sample(node: str, field: str, value: object) -> None:
    if value is not None and check_int(node, field, value) <= 0:
        raise IRValidationError(node, field, value, "must be a positive sample id (ir.mint.mint_sample_id())")


class Ticketed:
    """Ticket access of the plans that carry one-shot ops (``ExtendPlan``, ``ir.head.HeadExtendPlan``)."""

    __slots__ = ()

    @property
    def tickets(self) -> tuple[InitTicket, ...]:
        """The tickets of the ops that run before the forward (a ``MambaInit`` each), one per state
        pool, all of one serial; empty when the forward needs no init op."""
        raise NotImplementedError  # the plan's field

    @property
    def snapshots(self) -> tuple[SnapshotTicket, ...]:
        """The tickets of the ops that run after the forward (a ``MambaSnapshot`` each), one per state
        pool, all of one serial; empty when the forward snapshots nothing."""
        raise NotImplementedError  # the plan's field

    def all_tickets(self) -> tuple[Ticket[Op], ...]:
        """Every ticket of the plan, in the order their ops run: ``tickets``, then ``snapshots``."""
        return (*self.tickets, *self.snapshots)

    def tickets_for(self, pool: PoolId) -> tuple[Ticket[Op], ...]:
        """The tickets addressed to ``pool``, in the order their ops run."""
        return tuple(t for t in self.all_tickets() if t.pool == pool)

    def ticket_for(self, pool: PoolId) -> InitTicket | None:
        """The init ticket addressed to ``pool`` (``None``: the plan runs no init op on that pool)."""
        return next((t for t in self.tickets if t.pool == pool), None)

    def snapshot_for(self, pool: PoolId) -> SnapshotTicket | None:
        """The snapshot ticket addressed to ``pool`` (``None``: the plan snapshots nothing on that pool)."""
        return next((t for t in self.snapshots if t.pool == pool), None)


@final
@linear
@attrs.frozen(kw_only=True)
class ExtendPlan(ColumnNode, RequestRows, Ticketed):
    """The columns of an ``ExtendBatch`` (declared alike) and its ops as tickets."""

    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    prefix_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, max=PREFIX_MAX, text="prefix"))
    extend_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=MAX_SEQ_LEN, max_what=MAX_SEQ_LEN_WHAT, text="extend"))
    more_chunks: BoolArray = column(converter=as_bool, metadata=per(REQUEST, text="more"))
    input_ids: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text="tokens"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text=KV_NAMES))
    tickets: tuple[InitTicket, ...] = attrs.field(converter=_tickets, metadata=shown(line="ticket"))
    snapshots: tuple[SnapshotTicket, ...] = attrs.field(default=(), converter=_snapshots, metadata=shown(line="snapshot ticket"))
    sample_id: SampleId | None = attrs.field(default=None, metadata=shown("sample", "#"))
    """As ``DecodePlan.sample_id``, for the rows whose prompt this forward completes (``more_chunks``
    false): the backend keeps their first token per slot, for the pipelined decode that names it."""
    sampling: SamplingRows | None = attrs.field(default=None)
    """Its rows' sampling parameters, aligned with them (``None``: every row greedy)."""
    keep_hidden: HiddenId | None = attrs.field(default=None, metadata=shown("hidden", "#"))
    """The target's hidden states at every position of the chunk are kept under this id for the
    draft head's extend, and the result hands back their handle (``ir.hidden``); ``None``: none kept."""

    def _check(self) -> None:
        check_tickets("ExtendPlan", "tickets", self.tickets, When.BEFORE)
        check_tickets("ExtendPlan", "snapshots", self.snapshots, When.AFTER)
        _check_sample("ExtendPlan", "sample_id", self.sample_id)
        check_hidden_id("ExtendPlan", "keep_hidden", self.keep_hidden)



@final
@attrs.frozen(kw_only=True)
class DecodePlan(ColumnNode, RequestRows):
    """The columns of a ``DecodeBatch`` (declared alike), and what a pipelined decode (a plan built
    while the previous forward runs) names instead of tokens it cannot know yet:

    - ``sample_id`` (a ``SampleId``, or ``None``): the backend keeps this forward's greedy token of every
      row under this id, per slot;
    - ``inputs_from`` (a ``SampleId``, or ``None``): every row's input token is the one the plan with
      ``sample_id == inputs_from`` sampled for the row's slot, resolved when the backend stages the
      plan; ``input_ids`` are then placeholders, all 0. A kept token is used once: a plan naming it
      again (a replay) finds none and is refused, and so is one naming a forward that never ran.

    A plan never changes after it is built: the backend resolves the symbolic inputs while staging."""

    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    seq_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=MAX_SEQ_LEN, max_what=MAX_SEQ_LEN_WHAT, text="seq"))
    input_ids: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text="token"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text=KV_NAMES))
    sample_id: SampleId | None = attrs.field(default=None, metadata=shown("sample", "#"))
    inputs_from: SampleId | None = attrs.field(default=None, metadata=shown("inputs", "#"))
    sampling: SamplingRows | None = attrs.field(default=None)
    """Its rows' sampling parameters, aligned with them (``None``: every row greedy)."""

    def _check(self) -> None:
        _check_sample("DecodePlan", "sample_id", self.sample_id)
        _check_sample("DecodePlan", "inputs_from", self.inputs_from)
        if self.inputs_from is not None:
            if self.sample_id is not None and int(self.sample_id) == int(self.inputs_from):
                raise IRValidationError("DecodePlan", "inputs_from", self.inputs_from, "names this plan's own sample_id")
            if self.input_ids.any():
                raise IRValidationError(
                    "DecodePlan", "input_ids", self.input_ids.tolist()[:8], "must be placeholders (all 0) when inputs_from names them"
                )


def _joined(a: I64, b: I64) -> I64:
    """``a`` then ``b``, IR-owned (either one itself when the other is empty: no copy)."""
    return b if not a.shape[0] else a if not b.shape[0] else freeze(np.concatenate((a, b)))


_NO_ROWS = frozen_i64([])


@final
@linear
@attrs.frozen(kw_only=True)
class MixedPlan(Composite, RequestRows):
    """Its checks are its parts' types (``ir.verify`` re-runs the parts' own checks), and one
    forward has one sample: when both parts keep their tokens (``sample_id``), under the same id."""

    extend: ExtendPlan
    decode: DecodePlan

    def _check(self) -> None:
        a, b = self.extend.sample_id, self.decode.sample_id
        if a is not None and b is not None and int(a) != int(b):
            raise IRValidationError("MixedPlan", "decode", b, f"keeps its tokens under sample #{b}, the extend part under #{a}")

    @property
    def tickets(self) -> tuple[InitTicket, ...]:
        """The extend part's init tickets: a mixed forward runs the init ops of its prefills, and its
        decode part has none."""
        return self.extend.tickets

    @property
    def rids(self) -> I64:
        """The extend part's request ids, then the decode part's."""
        return _joined(self.extend.rids, self.decode.rids)

    @property
    def slots(self) -> I64:
        """The extend part's slots, then the decode part's."""
        return _joined(self.extend.slots, self.decode.slots)


@final
@attrs.frozen(kw_only=True)
class IdlePlan(Composite, RequestRows):
    """Nothing to run (the plan of an ``IdleBatch``): no rows."""

    @property
    def rids(self) -> I64:
        return _NO_ROWS

    @property
    def slots(self) -> I64:
        return _NO_ROWS


