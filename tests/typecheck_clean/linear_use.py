"""What the linear-use plugin (ir.mypy_linear) must accept: mypy must report nothing here."""

from __future__ import annotations

from collections.abc import Sequence

from backend.executor import Executor
from backend.ledger import Ledger
from compiler.steps import Pipeline
from ir.batch import ExtendBatch
from ir.ids import TARGET_POOL, RequestId
from ir.linear import keeps_linear, stash
from ir.plan import ExtendPlan
from ir.request import AdmittedRequest


def one_execution_per_pool(target: Executor, draft: Executor, plan: ExtendPlan) -> None:
    target.execute(plan)
    draft.execute(plan)  # another executor: the draft pool consumes its own ticket


class Engine:
    def __init__(self, target: Executor, draft: Executor, pipeline: Pipeline) -> None:
        self.target, self.draft, self.pipeline = target, draft, pipeline
        self.inflight: list[ExtendPlan] = stash([])

    def prefill(self, requests: Sequence[AdmittedRequest]) -> None:
        _, plan = self.pipeline.prefill(requests)
        self.target.run_prefill(plan)
        self.draft.run_prefill(plan)  # receivers differ: self.target, self.draft

    def queue(self, plan: ExtendPlan) -> None:
        self.inflight.append(stash(plan))  # the explicit hatch for an engine's own queue


def fan_out(executors: Sequence[Executor], plan: ExtendPlan) -> None:
    for ex in executors:
        ex.execute(plan)  # the loop rebinds the executor: one consumption per executor


def rebinding_in_a_loop(ex: Executor, pipeline: Pipeline, chunks: Sequence[Sequence[AdmittedRequest]]) -> None:
    for chunk in chunks:
        _, plan = pipeline.prefill(chunk)
        ex.execute(plan)
    for plan in (pipeline.prefill(c)[1] for c in chunks):
        ex.execute(plan)


def conditional_on_exactly_one_path(ex: Executor, plan: ExtendPlan, now: bool) -> None:
    if now:
        ex.execute(plan)
    else:
        ex.run_prefill(plan)


def returns_early(ex: Executor, plan: ExtendPlan, now: bool) -> None:
    if now:
        ex.execute(plan)
        return
    ex.execute(plan)


def run_once(ex: Executor, plan: ExtendPlan) -> None:
    ex.execute(plan)


def hands_it_to_a_function(ex: Executor, plan: ExtendPlan) -> None:
    run_once(ex, plan)


def local_containers(ex: Executor, plans: Sequence[ExtendPlan]) -> list[ExtendPlan]:
    kept: list[ExtendPlan] = []
    for plan in plans:
        kept.append(plan)
    return kept


def claims_per_pool(ledger: Ledger, plan: ExtendPlan) -> None:
    for t in plan.tickets:
        with ledger.consuming(t, t.pool):
            pass
    ledger.claim(plan.tickets, TARGET_POOL)


@keeps_linear
class Keeper:
    """A class whose job is to hold plans across steps (like the ledger): declared, and greppable."""

    def __init__(self) -> None:
        self.plans: dict[int, ExtendPlan] = {}

    def keep(self, key: int, plan: ExtendPlan) -> None:
        self.plans[key] = plan


def withdraw_then_run_what_it_returned(pipe: Pipeline, executors: list[Executor], batch: ExtendBatch, plan: ExtendPlan) -> None:
    """A withdrawn plan's replacement is a new value: each executor runs it once."""
    batch, plan = pipe.withdraw(batch, plan, [RequestId(1)], reason="aborted")
    for ex in executors:
        ex.execute(plan)
    batch, plan = pipe.prefill([])
    batch, plan = pipe.withdraw(batch, plan, [], reason="rolled back")  # rebound: the new plan may be withdrawn in turn
