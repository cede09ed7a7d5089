"""A verify window that is not the draft's (issue: tokens from anywhere verified, then the draft
commit commits the draft pool to a state that matches nothing): the draft step's ``Proposals`` are
the only thing a verify takes, once, and they do not outlive the step; likewise the target's tokens
reach the accept pass only as the verify's ``Verified`` result. Each line must be rejected."""

from __future__ import annotations

import numpy as np

from compiler.steps import Pipeline
from ir.columns import frozen_i64
from ir.spec import DraftBatch, Proposals, VerifyBatch
from passes.accept import accept
from passes.prepare_for_verify import prepare_for_verify


class Scheduler:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def verify_tokens_from_anywhere(self, draft: DraftBatch) -> None:
        self.pipeline.verify(draft, frozen_i64([7, 7]))  # type: ignore[arg-type]  # a token array is not Proposals
        prepare_for_verify(draft, np.zeros(2, dtype=np.int64))  # type: ignore[arg-type]  # nor at the pass

    def accept_tokens_from_anywhere(self, verify: VerifyBatch) -> None:
        self.pipeline.commit(verify, frozen_i64([7, 7, 7]))  # type: ignore[arg-type]  # target tokens are the verify's Verified result, not an array
        accept(verify, np.zeros(3, dtype=np.int64))  # type: ignore[arg-type]  # nor at the pass

    def verify_twice(self, draft: DraftBatch, proposals: Proposals) -> None:
        self.pipeline.verify(draft, proposals)
        self.pipeline.verify(draft, proposals)  # type: ignore[linear-reuse]  # the same proposals verified again

    def keep_for_later(self, proposals: Proposals) -> None:
        self.stale = proposals  # type: ignore[linear-escape]  # kept past the step, like the upstream deferred indices
