"""A prefill withdrawn before it ran (``Pipeline.withdraw`` is ``@retires``): no executor runs it
after, and a plan an executor ran is not withdrawn. The plugin (ir.mypy_linear) must reject each line."""

from __future__ import annotations

from backend.executor import Executor
from compiler.steps import Pipeline
from ir.batch import ExtendBatch
from ir.ids import RequestId
from ir.plan import ExtendPlan


def run_after_withdrawing(pipe: Pipeline, ex: Executor, batch: ExtendBatch, plan: ExtendPlan) -> None:
    pipe.withdraw(batch, plan, [RequestId(1)], reason="aborted")
    ex.execute(plan)  # type: ignore[linear-reuse]  # the withdrawn plan, not the one withdraw returned


def run_on_every_executor_after_withdrawing(pipe: Pipeline, executors: list[Executor], batch: ExtendBatch, plan: ExtendPlan) -> None:
    pipe.withdraw(batch, plan, [RequestId(1)], reason="aborted")
    for ex in executors:
        ex.run_prefill(plan)  # type: ignore[linear-reuse]  # retired for every executor, not only one


def withdraw_on_one_path(pipe: Pipeline, ex: Executor, batch: ExtendBatch, plan: ExtendPlan, abort: bool) -> None:
    if abort:
        pipe.withdraw(batch, plan, [RequestId(1)], reason="aborted")
    ex.execute(plan)  # type: ignore[linear-reuse]  # withdrawn on the path where abort is true


def withdraw_after_running(pipe: Pipeline, ex: Executor, batch: ExtendBatch, plan: ExtendPlan) -> None:
    ex.execute(plan)
    pipe.withdraw(batch, plan, [RequestId(1)], reason="too late")  # type: ignore[linear-reuse]  # it ran on an executor


def withdraw_twice(pipe: Pipeline, batch: ExtendBatch, plan: ExtendPlan) -> None:
    pipe.withdraw(batch, plan, [RequestId(1)], reason="aborted")
    pipe.withdraw(batch, plan, [RequestId(2)], reason="aborted")  # type: ignore[linear-reuse]  # its tickets are cancelled already
