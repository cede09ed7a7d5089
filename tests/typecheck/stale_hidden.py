"""A hidden-state handle read twice or kept past its step (a stale or reused handle is a
mypy error, the same guarantee as the one-shot ops): the target's ``HiddenStates`` feed one head
phase, once, and neither they nor the result holding them outlive the step. Each line must be
rejected."""

from __future__ import annotations

from compiler.steps import Pipeline
from ir.batch import ExtendBatch
from ir.hidden import HiddenStates
from ir.plan import ExtendPlan
from ir.results import Sampled, Verified
from ir.spec import CommitBatch


class Scheduler:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def extend_twice(self, prefill: ExtendBatch, hidden: HiddenStates) -> None:
        self.pipeline.head_extend(prefill, hidden)
        self.pipeline.head_extend(prefill, hidden)  # type: ignore[linear-reuse]  # the same states extend the head again

    def extend_then_commit(self, prefill: ExtendBatch, committed: CommitBatch, hidden: HiddenStates) -> None:
        self.pipeline.head_extend(prefill, hidden)
        self.pipeline.head_commit(committed, hidden)  # type: ignore[linear-reuse]  # one handle, two head phases

    def from_the_result_twice(self, committed: CommitBatch, verified: Verified) -> None:
        if verified.hidden is not None:
            self.pipeline.head_commit(committed, verified.hidden)
            self.pipeline.head_commit(committed, verified.hidden)  # type: ignore[linear-reuse]  # the result's field, read twice

    def in_a_loop(self, committed: CommitBatch, hidden: HiddenStates) -> None:
        for _ in range(2):
            self.pipeline.head_commit(committed, hidden)  # type: ignore[linear-reuse]  # every iteration, the same handle

    def keep_for_later(self, hidden: HiddenStates) -> None:
        self.stale = hidden  # type: ignore[linear-escape]  # kept past the step, like the upstream deferred indices

    def keep_the_result(self, sampled: Sampled) -> None:
        self.last = sampled  # type: ignore[linear-escape]  # a result holding a handle does not outlive the step either

    def an_id_is_not_the_handle(self, prefill: ExtendBatch, plan: ExtendPlan) -> None:
        self.pipeline.head_extend(prefill, plan.keep_hidden)  # type: ignore[arg-type]  # a HiddenId is not the states
