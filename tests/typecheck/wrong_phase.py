"""Phase-order misuse that mypy must reject: each offending line carries the expected error code."""

from __future__ import annotations

from backend.executor import Executor
from compiler.steps import Pipeline
from ir.batch import DecodeBatch
from ir.plan import DecodePlan, ExtendPlan
from ir.request import AdmittedRequest
from passes.filter_batch import filter_batch
from passes.lower import LowerContext, lower
from passes.merge_batch import merge_batch
from passes.prepare_for_extend import prepare_for_extend


def misuse(decode: DecodeBatch, pipeline: Pipeline, executor: Executor, requests: list[AdmittedRequest]) -> None:
    pipeline.filter_extend(decode, [])  # type: ignore[arg-type]  # a DecodeBatch where an ExtendBatch is required
    plan: ExtendPlan = lower(decode, LowerContext())  # type: ignore[assignment]  # decode lowered to a plan with tickets
    lower(decode, LowerContext()).tickets  # type: ignore[attr-defined]  # a DecodePlan has no tickets
    executor.run_prefill(lower(decode, LowerContext()))  # type: ignore[arg-type]  # decode plan to the prefill entry
    extend = prepare_for_extend(requests)
    merge_batch(extend, decode)  # type: ignore[arg-type]  # the running batch must be a DecodeBatch
    filtered: DecodeBatch = filter_batch(extend, [])  # type: ignore[assignment]  # filter keeps the phase
    prepare_for_extend([decode])  # type: ignore[list-item]  # batches are not admitted requests
    d_plan: DecodePlan = lower(extend, LowerContext())  # type: ignore[assignment]  # extend lowers to ExtendPlan
