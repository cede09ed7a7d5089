"""Every one-shot op kind, through what derives from its declaration (``ir.init.OpDecl``).

Parametrized over ``ir.init.OP_TYPES``, with each kind's strategy from ``compiler.testing.strategies``
(``NODE_STRATEGIES``, which ``tests/ir/test_parse.py`` requires for every printable node): a new
kind runs here without a line of this file, and a kind whose application, counters or rows
disagree with its declaration fails here. Checked per kind: ``apply_op`` writes only the rows the
kind declares it writes and refuses an out-of-range slot before writing; the ledger counts exactly
``op_counts``; a plan over a row the op requires of its plan is refused while the op is pending; the
ticket's text form and a plan's wire message round-trip.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings

from backend.ledger import Ledger, PoolCounts
from backend.pool import MambaStatePool
from backend.state_init import apply_op
from compiler.testing.strategies import NODE_STRATEGIES
from ir.errors import PlanExecutionError, TicketMismatchError
from ir.ids import TARGET_POOL, MambaSlot, PoolId
from ir.init import (
    OP_TYPES,
    MambaInit,
    MambaSnapshot,
    Op,
    Rows,
    Ticket,
    When,
    mint_serial,
    op_counts,
    op_groups,
    op_plan_rows,
    op_reads,
    op_resets,
    op_slots,
    op_text,
    op_when,
    op_writes,
)
from ir.parse import parse
from ir.printer import dump
from ir.wire import pack, unpack
from tests.helpers import SMALL_LAYOUT, extend_plan, fresh, random_fill

KINDS = sorted(OP_TYPES, key=lambda c: c.__name__)


def _compact(op: Op) -> Op:
    """``op`` with its slots renumbered 2, 3, ... in order of appearance (a pool one row short still
    has rows) and a serial of this process, through the declaration (no kind's field named here)."""
    names: dict[int, int] = {}
    fields: dict[str, Any] = {g.field: tuple(MambaSlot(names.setdefault(s, len(names) + 2)) for s in g.slots) for g in op_groups(op)}
    return attrs.evolve(op, serial=mint_serial(), **fields)


def test_the_declarations_answer_what_each_op_touches() -> None:
    init = MambaInit(serial=mint_serial(), clear_slots=(1, 2), cow_src=(7,), cow_dst=(3,))
    snap = MambaSnapshot(serial=mint_serial(), src=(1,), dst=(9,))
    assert (op_reads(init), op_writes(init), op_slots(init)) == ((7,), (1, 2, 3), (1, 2, 7, 3))
    assert (op_plan_rows(init), op_resets(init), op_when(init)) == ((1, 2, 3), (1, 2), When.BEFORE)
    assert op_counts(init) == {"tickets": 1, "clears": 2, "cows": 1}
    assert op_text(init) == "clear [1, 2], cow [7->3]"
    assert [(g.label, g.rows) for g in op_groups(init)] == [("clear", Rows.OF_PLAN), ("cow src", Rows.NOT_OF_PLAN), ("cow dst", Rows.OF_PLAN)]
    assert (op_reads(snap), op_writes(snap), op_plan_rows(snap), op_resets(snap)) == ((1,), (9,), (1,), ())
    assert (op_counts(snap), op_text(snap), op_when(snap)) == ({"snapshots": 1}, "snapshot [1->9]", When.AFTER)


@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.__name__)
def test_every_op_kind_applies_what_it_declares(kind: type[Op]) -> None:
    @settings(max_examples=25, deadline=None)
    @given(NODE_STRATEGIES[kind.__name__])
    def check(drawn: Op) -> None:
        op = _compact(drawn)
        capacity = max(op_slots(op))
        pool = MambaStatePool(TARGET_POOL, SMALL_LAYOUT, capacity)
        random_fill(pool, seed=1)
        before = pool.buffer.clone()
        apply_op(pool, op)
        written = set(op_writes(op))
        for row in range(capacity + 1):
            if row not in written:
                assert torch.equal(pool.buffer[row], before[row]), f"{kind.__name__} wrote row {row}, which it does not declare"
        small = MambaStatePool(TARGET_POOL, SMALL_LAYOUT, capacity - 1)
        random_fill(small, seed=2)
        kept = small.buffer.clone()
        with pytest.raises(PlanExecutionError, match=rf"#{op.serial}: .* slot {capacity} out of range \[1, {capacity - 1}\]"):
            apply_op(small, op)
        assert torch.equal(small.buffer, kept)

    check()


@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.__name__)
def test_every_op_kind_counts_and_guards_its_rows_in_the_ledger(kind: type[Op]) -> None:
    @settings(max_examples=25, deadline=None)
    @given(NODE_STRATEGIES[kind.__name__])
    def check(drawn: Op) -> None:
        op = _compact(drawn)
        ledger = Ledger()
        ticket = Ticket(pool=TARGET_POOL, op=op)
        ledger.register([ticket])
        counts = PoolCounts(**op_counts(op))
        assert ledger.minted(TARGET_POOL) == counts
        for row in op_plan_rows(op):
            with pytest.raises(TicketMismatchError, match=rf"over slot {row} of pool 'target' does not carry {ticket}"):
                ledger.check_rows([row], TARGET_POOL, "DecodePlan")
        with ledger.consuming(ticket, TARGET_POOL) as registered:
            assert registered == ticket
        assert ledger.counts(TARGET_POOL) == counts
        ledger.check_rows(op_slots(op), TARGET_POOL, "DecodePlan")  # consumed: nothing pending
        ledger.assert_drained()

    check()


@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.__name__)
def test_every_op_kind_travels_in_text_and_on_the_wire(kind: type[Op]) -> None:
    @settings(max_examples=25, deadline=None)
    @given(NODE_STRATEGIES[kind.__name__])
    def check(op: Op) -> None:
        ticket = Ticket(pool=PoolId("target"), op=op)
        assert parse(dump(ticket, exact=True)) == ticket
        _, plan = extend_plan([fresh(1, 1, [5], 10)])
        field = "tickets" if op_when(op) is When.BEFORE else "snapshots"
        carrying = attrs.evolve(plan, **{field: (ticket,)})
        assert unpack(pack(3, carrying), expect_step=3).plan == carrying

    check()
