"""A plan that carries one-shot tickets, consumed twice on one executor: the plugin (ir.mypy_linear) must reject each line."""

from __future__ import annotations

from backend.boundary import Backend
from backend.executor import Executor
from backend.ledger import Ledger
from ir.ids import TARGET_POOL
from ir.plan import ExtendPlan, MixedPlan


def twice_in_sequence(ex: Executor, plan: ExtendPlan) -> None:
    ex.execute(plan)
    ex.execute(plan)  # type: ignore[linear-reuse]  # the same tickets again on the same pool


def twice_in_a_loop(ex: Executor, plan: MixedPlan) -> None:
    for _ in range(2):
        ex.run_prefill(plan)  # type: ignore[linear-reuse]  # every iteration replays the tickets


def in_both_branches_then_after(ex: Executor, plan: ExtendPlan, first: bool) -> None:
    if first:
        ex.execute(plan)
    else:
        ex.run_prefill(plan)
    ex.execute(plan)  # type: ignore[linear-reuse]  # one of the branches consumed it already


def again_in_except(ex: Executor, plan: ExtendPlan) -> None:
    try:
        ex.execute(plan)
    except RuntimeError:
        ex.execute(plan)  # type: ignore[linear-reuse]  # the failed try may have consumed it


def after_an_early_return_path(ex: Executor, plan: ExtendPlan, skip: bool) -> None:
    if skip:
        return
    ex.execute(plan)
    while True:
        ex.execute(plan)  # type: ignore[linear-reuse]  # reached from the line above, and from itself
        break


def the_ledgers_claims(ledger: Ledger, plan: ExtendPlan) -> None:
    tickets = plan.tickets
    with ledger.consuming(tickets[0], TARGET_POOL):
        pass
    ledger.claim(tickets, TARGET_POOL)
    ledger.claim(tickets, TARGET_POOL)  # type: ignore[linear-reuse]  # claimed twice on one pool


def twice_on_any_backend(backend: Backend, plan: ExtendPlan) -> None:
    backend.wait(backend.submit(plan))
    backend.submit(plan)  # type: ignore[linear-reuse]  # whatever runs it, the tickets are spent
