"""Running one plan on one executor, with retries: the engine's forward runner.

With ``retries > 0`` the executors are transactional (a failed forward leaves nothing behind), so a
forward that raises is simply executed again. A ``BatchcError`` is never retried: a plan that does
not fit its backend is a bug, not a fault; nor is ``backend.tp``'s ``RankFailed``: a rank that failed
breaks its tensor-parallel group, and the engine stops. When every attempt fails, ``StepFailed`` carries the
plan's requests; the engine aborts them through its release path and serving goes on.

``submit`` and ``wait`` split a run in two, so the scheduler can do host work while the forward
runs: on an ``ExecutorProcess`` the plan is sent and the call returns; an in-process executor runs it
at once (``wait`` hands back what it gave). Retries happen at ``wait``.
"""

from __future__ import annotations

from typing import TypeAlias, assert_never

import torch

from backend.executor import AnyExecutor, ForwardOut
from backend.remote import ExecutorGone, ExecutorProcess, Pending
from backend.tp.group import RankFailed
from backend.tp.serve import TPExecutor
from compiler.engine.report import SpecStats
from ir.errors import BatchcError, PlanExecutionError
from ir.ids import RequestId
from ir.linear import consumes_on, keeps_linear
from ir.nodes import Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.spec import CommitPlan, DraftCommitPlan, DraftExtendPlan, DraftPlan, Proposals, VerifyPlan

Backend: TypeAlias = AnyExecutor | ExecutorProcess | TPExecutor
"""Where the engine's plans run: an executor in this process, one in its own process, or rank 0's of
a tensor-parallel group."""


def cause_words(cause: BaseException) -> str:
    """How a failure's cause is named to a user: its kind and its own message (``ExecutorGone:
    executor process for pool 'target' killed by signal 9``), not a repr with quotes and escapes."""
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


class StepFailed(Exception):
    """A forward failed on every attempt; ``rids`` are the requests it carried."""

    def __init__(self, rids: tuple[RequestId, ...], cause: Exception) -> None:
        super().__init__(f"forward of requests {list(rids)} failed: {cause_words(cause)}")
        self.rids = rids
        self.cause = cause


def logits_of(out: ForwardOut, what: str) -> torch.Tensor:
    """A forward's logits (or a verify's tokens), or ``PlanExecutionError`` saying what came back."""
    if not isinstance(out, torch.Tensor):
        raise PlanExecutionError(f"{what} returned {type(out).__name__}, not a tensor")
    return out


def proposals_of(out: ForwardOut, plan: DraftPlan) -> Proposals:
    """The ``Proposals`` a draft plan's run returned, or ``PlanExecutionError``."""
    if not isinstance(out, Proposals) or out.draft_id != plan.batch.draft_id:
        got = f"the proposals of draft #{out.draft_id}" if isinstance(out, Proposals) else type(out).__name__
        raise PlanExecutionError(f"draft #{plan.batch.draft_id} returned {got}, not its Proposals")
    return out


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


@keeps_linear  # a plan in flight, until ``wait`` reads it back (or retries it)
class Submitted:
    """A plan handed to ``ForwardRunner.submit``: its result or failure, or the pending reply of an
    executor process."""

    def __init__(self, ex: Backend, plan: Plan) -> None:
        self.ex, self.plan = ex, plan
        self.pending: Pending | None = None
        self.out: ForwardOut = None
        self.failure: StepFailed | None = None


class ForwardRunner:
    def __init__(self, retries: int, stats: SpecStats) -> None:
        self.retries = retries
        self.stats = stats

    @consumes_on("ex")
    def run(self, ex: Backend, plan: Plan) -> ForwardOut:
        return self._attempts(ex, plan, self.retries + 1)

    @consumes_on("ex")
    def submit(self, ex: Backend, plan: Plan) -> Submitted:
        """Start ``plan`` on ``ex``; a refusal on this side (a ``BatchcError``) is raised here."""
        s = Submitted(ex, plan)
        if isinstance(ex, ExecutorProcess):
            try:
                s.pending = ex.submit(plan)
                return s
            except ExecutorGone:
                pass  # a failed forward: run below fails it (retried, then StepFailed)
        try:
            s.out = self.run(ex, plan)  # type: ignore[linear-reuse]  # after ExecutorGone: the plan never reached the process
        except StepFailed as failure:
            s.failure = failure
        return s

    def wait(self, s: Submitted) -> ForwardOut:
        """The result of a submitted plan, retried as ``run`` would; ``StepFailed`` when every
        attempt failed."""
        if s.pending is None:
            if s.failure is not None:
                raise s.failure
            return s.out
        assert isinstance(s.ex, ExecutorProcess)
        try:
            return s.ex.wait(s.pending)
        except BatchcError:
            raise
        except Exception as exc:
            if not self.retries:
                raise StepFailed(plan_rids(s.plan), exc) from exc
            self.stats.retries += 1
            return self._attempts(s.ex, s.plan, self.retries)

    def _attempts(self, ex: Backend, plan: Plan, attempts: int) -> ForwardOut:
        for attempt in range(attempts):
            try:
                return ex.execute(plan)  # type: ignore[linear-reuse]  # a retry: the failed attempt left its tickets outstanding
            except (BatchcError, RankFailed):
                raise  # a plan that does not fit is a bug, and a failed rank breaks its group: neither is retried
            except Exception as exc:
                if attempt < attempts - 1:
                    self.stats.retries += 1
                    continue
                raise StepFailed(plan_rids(plan), exc) from exc
        raise AssertionError("unreachable")
