"""Every plan exposes its rows the same way, and ``NODE_TYPES`` is the unions' members.

- ``plan.rids`` / ``plan.slots`` of every plan type (hypothesis strategies of ``compiler.testing.strategies``):
  read-only IR-owned int64 columns, one entry per request, in row order: the rows of the plan's
  column-holding parts in field order (a mixed plan's extend rows, then its decode rows; an idle plan
  none), and ``rid_list()``/``slot_list()`` are their values.
- ``NODE_TYPES`` holds every batch and plan class of ``ir.batch``, ``ir.plan``, ``ir.spec`` and ``ir.head`` once
  (a phase class left out of the unions would be missing from it).
"""

from __future__ import annotations

import inspect
from typing import Any, get_args

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import ir.batch
import ir.head
import ir.plan
import ir.spec
from compiler.testing.strategies import NODE_STRATEGIES
from ir.columns import ColumnNode, Composite, RequestRows, is_owned
from ir.nodes import NODE_TYPES, Batch, Plan

PLAN_KINDS = sorted(t.__name__ for t in get_args(Plan))


def _rows(node: Any, column: str) -> list[int]:
    """``column`` of ``node``'s rows, walking its node-typed fields in declaration order."""
    if isinstance(node, ColumnNode):
        return list(getattr(node, column).tolist())
    parts = (getattr(node, f.name) for f in attrs.fields(type(node)))
    return [v for part in parts if isinstance(part, (ColumnNode, Composite)) for v in _rows(part, column)]  # (not an id field)


@pytest.mark.parametrize("kind", PLAN_KINDS)
def test_every_plan_exposes_its_rows_in_row_order(kind: str) -> None:
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(NODE_STRATEGIES[kind])
    def check(plan: Any) -> None:
        assert isinstance(plan, RequestRows)
        for column, listed in (("rids", plan.rid_list()), ("slots", plan.slot_list())):
            values = getattr(plan, column)
            assert values.dtype == np.int64 and values.ndim == 1 and is_owned(values)
            with pytest.raises(ValueError, match="read-only"):
                values[:1] = 0
            assert values.tolist() == _rows(plan, column) == listed
            assert values.shape[0] == plan.num_requests

    check()


def test_an_idle_plan_has_no_rows() -> None:
    plan = ir.plan.IdlePlan()
    assert plan.rids.shape == (0,) and plan.slots.shape == (0,) and plan.rid_list() == []


def test_node_types_are_every_phase_class_once() -> None:
    phases = {
        cls
        for module in (ir.batch, ir.plan, ir.spec, ir.head)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__ and "__attrs_attrs__" in cls.__dict__
        and (issubclass(cls, Composite) or issubclass(cls, RequestRows))
    }
    assert len(NODE_TYPES) == len(set(NODE_TYPES))
    assert set(NODE_TYPES) == phases
    assert NODE_TYPES == (*get_args(Batch), *get_args(Plan))
