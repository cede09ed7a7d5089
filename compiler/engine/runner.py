"""Running one plan on one executor, with retries: the engine's forward runner.

With ``retries > 0`` the executors are transactional (a failed forward leaves nothing behind), so a
forward that raises is simply executed again. A ``BatchcError`` is never retried: a plan that does
not fit its backend is a bug, not a fault. When every attempt fails, ``StepFailed`` carries the
plan's requests; the engine aborts them through its release path and serving goes on.
"""

from __future__ import annotations

from typing import assert_never

import torch

from backend.executor import AnyExecutor
from compiler.engine.report import SpecStats
from ir.errors import BatchcError
from ir.ids import RequestId
from ir.nodes import Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.spec import CommitPlan, DraftCommitPlan, DraftExtendPlan, DraftPlan, VerifyPlan


class StepFailed(Exception):
    """A forward failed on every attempt; ``rids`` are the requests it carried."""

    def __init__(self, rids: tuple[RequestId, ...], cause: Exception) -> None:
        super().__init__(f"forward of requests {list(rids)} failed: {cause!r}")
        self.rids = rids
        self.cause = cause


def plan_rids(plan: Plan) -> tuple[RequestId, ...]:
    """The requests a plan carries."""
    match plan:
        case ExtendPlan() | DecodePlan():
            cols = [plan.rids]
        case MixedPlan():
            cols = [plan.extend.rids, plan.decode.rids]
        case DraftPlan() | VerifyPlan() | CommitPlan() | DraftCommitPlan() | DraftExtendPlan():
            cols = [plan.batch.rids]
        case IdlePlan():
            cols = []
        case _:
            assert_never(plan)
    return tuple(RequestId(r) for col in cols for r in col.tolist())


class ForwardRunner:
    def __init__(self, retries: int, stats: SpecStats) -> None:
        self.retries = retries
        self.stats = stats

    def run(self, ex: AnyExecutor, plan: Plan) -> torch.Tensor | None:
        for attempt in range(self.retries + 1):
            try:
                return ex.execute(plan)
            except BatchcError:
                raise  # a plan that does not fit is a bug, not a fault to retry
            except Exception as exc:
                if attempt < self.retries:
                    self.stats.retries += 1
                    continue
                raise StepFailed(plan_rids(plan), exc) from exc
        raise AssertionError("unreachable")
