"""Misuse that must not type-check. Each line carries the error its checker must report: mypy's code
in `# type: ignore[...]`, pyright's rule in `# pyright: ignore[...]`. An ignore that is no longer
needed is an error for both (warn_unused_ignores, reportUnnecessaryTypeIgnoreComment), so a checker
that stops rejecting a line fails the project's check."""

from __future__ import annotations

from backend.executor import Executor
from ir.batch import DecodeBatch, ExtendBatch
from ir.ids import RequestId
from ir.plan import DecodePlan, ExtendPlan
from compiler.manager import PassManager
from compiler.steps import Pipeline
from myengine.passes import cap_running
from passes import LowerContext, lower


class Deferred:
    def __init__(self) -> None:
        self.kept: ExtendPlan | None = None

    def keep(self, plan: ExtendPlan) -> None:
        self.kept = plan  # type: ignore[linear-escape]  # a plan kept on an object that outlives the step


def stale_init(decode: DecodeBatch) -> None:
    # the upstream bug's shape: a prefill's init ops read off the running batch (no such field)
    decode.init  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType]


def replay(executor: Executor, plan: ExtendPlan) -> None:
    executor.execute(plan)
    executor.execute(plan)  # type: ignore[linear-reuse]  # the same one-shot ops twice on one executor


def wrong_phase(executor: Executor, decode_plan: DecodePlan, decode: DecodeBatch, ctx: LowerContext) -> None:
    executor.run_prefill(decode_plan)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    # lowering a running batch gives a plan without tickets, never a prefill's
    plan: ExtendPlan = lower(decode, ctx)  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
    executor.run_prefill(plan)


def own_pass_misused(pm: PassManager, decode: DecodeBatch, plan: DecodePlan) -> None:
    # a declared pass keeps its signature through the pass manager: each argument is checked
    pm.run(cap_running, decode, "2")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    pm.run(cap_running, plan, 2)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def run_a_withdrawn_prefill(pipeline: Pipeline, executor: Executor, batch: ExtendBatch, plan: ExtendPlan) -> None:
    pipeline.withdraw(batch, plan, [RequestId(1)], reason="aborted before its forward")
    executor.execute(plan)  # type: ignore[linear-reuse]  # withdrawn: only the plan withdraw returned runs
