"""Forward plans: what the backend executes. Lowered from batches by ``passes.lower``.

A plan holds the same immutable columns as the batch it was lowered from (shared, not copied) and
nothing the backend must not act on: ``ExtendPlan`` and ``MixedPlan`` carry the init ops only as
``InitTicket``s, one per state pool; ``DecodePlan`` and ``IdlePlan`` have no ticket field at all.

Invariant: a plan's tickets all carry the same ``MambaInit`` (one serial) and distinct pools.
"""

from __future__ import annotations

from typing import final

import attrs

from ir._fields import BoolArray, I64, ColumnNode, as_bool, as_i64, check_column, column_key
from ir.batch import check_decode_columns, check_extend_columns
from ir.errors import IRValidationError
from ir.ids import PoolId
from ir.init import InitTicket, SnapshotTicket


def _tickets(values: object) -> tuple[InitTicket, ...]:
    if not isinstance(values, (tuple, list)):
        raise IRValidationError("ExtendPlan", "tickets", values, "must be a tuple of InitTicket")
    out = tuple(values)
    pools: set[PoolId] = set()
    for t in out:
        if not isinstance(t, InitTicket):
            raise IRValidationError("ExtendPlan", "tickets", t, "every entry must be an InitTicket")
        if t.pool in pools:
            raise IRValidationError("ExtendPlan", "tickets", t.pool, "two tickets for one pool")
        pools.add(t.pool)
    if len({t.serial for t in out}) > 1:
        raise IRValidationError("ExtendPlan", "tickets", [t.serial for t in out], "tickets of one plan share one serial")
    return out


@final
@attrs.frozen(kw_only=True)
class ExtendPlan(ColumnNode):
    rids: I64 = attrs.field(converter=as_i64, eq=column_key)
    slots: I64 = attrs.field(converter=as_i64, eq=column_key)
    prefix_lens: I64 = attrs.field(converter=as_i64, eq=column_key)
    extend_lens: I64 = attrs.field(converter=as_i64, eq=column_key)
    more_chunks: BoolArray = attrs.field(converter=as_bool, eq=column_key)
    input_ids: I64 = attrs.field(converter=as_i64, eq=column_key)
    kv_locs: I64 = attrs.field(converter=as_i64, eq=column_key)
    tickets: tuple[InitTicket, ...] = attrs.field(converter=_tickets)
    snapshots: tuple[SnapshotTicket, ...] = ()

    def __attrs_post_init__(self) -> None:
        self.check_fields()

    def check_fields(self) -> None:
        check_extend_columns(self)
        check_column(self, "more_chunks", self.more_chunks, self.rids.shape[0], bools=True)

    @property
    def num_requests(self) -> int:
        return int(self.rids.shape[0])

    def ticket_for(self, pool: PoolId) -> InitTicket | None:
        for t in self.tickets:
            if t.pool == pool:
                return t
        return None

    def snapshot_for(self, pool: PoolId) -> SnapshotTicket | None:
        for t in self.snapshots:
            if t.pool == pool:
                return t
        return None


@final
@attrs.frozen(kw_only=True)
class DecodePlan(ColumnNode):
    rids: I64 = attrs.field(converter=as_i64, eq=column_key)
    slots: I64 = attrs.field(converter=as_i64, eq=column_key)
    seq_lens: I64 = attrs.field(converter=as_i64, eq=column_key)
    input_ids: I64 = attrs.field(converter=as_i64, eq=column_key)
    kv_locs: I64 = attrs.field(converter=as_i64, eq=column_key)

    def __attrs_post_init__(self) -> None:
        self.check_fields()

    def check_fields(self) -> None:
        check_decode_columns(self)

    @property
    def num_requests(self) -> int:
        return int(self.rids.shape[0])


@final
@attrs.frozen(kw_only=True)
class MixedPlan:
    extend: ExtendPlan
    decode: DecodePlan

    @property
    def tickets(self) -> tuple[InitTicket, ...]:
        return self.extend.tickets

    @property
    def num_requests(self) -> int:
        return self.extend.num_requests + self.decode.num_requests


@final
@attrs.frozen(kw_only=True)
class IdlePlan:
    @property
    def num_requests(self) -> int:
        return 0


