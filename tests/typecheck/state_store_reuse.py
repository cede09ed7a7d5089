"""A plan's ops applied to an engine's own state store (``StateOps.applying`` consumes the plan on
``store``): twice on one store is a replay; once on each of two stores is not. The plugin
(ir.mypy_linear) must reject each marked line."""

from __future__ import annotations

from backend.state_store import StateOps, StateStore
from ir.plan import ExtendPlan


def twice_on_one_store(ops: StateOps, store: StateStore, plan: ExtendPlan) -> None:
    with ops.applying(plan, store):
        pass
    with ops.applying(plan, store):  # type: ignore[linear-reuse]  # the same tickets again on the same store
        pass


def once_on_each_store(ops: StateOps, target: StateStore, draft: StateStore, plan: ExtendPlan) -> None:
    with ops.applying(plan, target):
        pass
    with ops.applying(plan, draft):
        pass
    with ops.applying(plan, target):  # type: ignore[linear-reuse]  # target's tickets a second time
        pass
