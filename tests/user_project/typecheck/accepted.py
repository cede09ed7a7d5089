"""Correct use: both checkers, and mypy's linear-use plugin, accept every line."""

from __future__ import annotations

from backend.executor import Executor
from backend.ledger import Ledger
from compiler.steps import Pipeline
from ir.batch import DecodeBatch
from ir.ids import RequestId
from ir.plan import DecodePlan, ExtendPlan
from ir.request import AdmittedRequest
from passes import DecodeContext


def step(pipeline: Pipeline, target: Executor, draft: Executor, requests: list[AdmittedRequest], ctx: DecodeContext) -> DecodeBatch:
    extend, plan = pipeline.prefill(requests)
    target.execute(plan)  # each executor consumes the plan's ticket for its own pool once
    draft.execute(plan)
    decode, decode_plan = pipeline.decode(extend, ctx)
    target.execute(decode_plan)
    draft.execute(decode_plan)
    return decode


def run_phases(executor: Executor, prefill: ExtendPlan, decode: DecodePlan) -> None:
    executor.run_prefill(prefill)
    executor.run_decode(decode)


def retry(executor: Executor, pipeline: Pipeline, requests: list[AdmittedRequest]) -> None:
    _, plan = pipeline.prefill(requests)
    executor.execute(plan)
    _, plan = pipeline.prefill(requests)  # rebound to a new plan: a new ticket, a new use
    executor.execute(plan)


def drained(ledger: Ledger) -> None:
    ledger.assert_drained()


def roll_back_one(pipeline: Pipeline, target: Executor, requests: list[AdmittedRequest], aborted: RequestId) -> None:
    batch, plan = pipeline.prefill(requests)
    batch, plan = pipeline.withdraw(batch, plan, [aborted], reason="aborted before its forward")
    target.execute(plan)  # the plan withdraw returned: new tickets, its first use
