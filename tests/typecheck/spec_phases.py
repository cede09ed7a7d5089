"""Speculative-decoding misuse that mypy must reject: each offending line carries the expected code."""

from __future__ import annotations

import attrs

from backend.executor import Executor
from ir.batch import ExtendBatch
from ir.spec import CommitBatch, DraftExtendBatch, VerifyBatch
from passes.lower import LowerContext, lower
from passes.prepare_for_draft_extend import prepare_for_draft_extend


def misuse(verify: VerifyBatch, committed: CommitBatch, extend: ExtendBatch, executor: Executor) -> None:
    verify.init  # type: ignore[attr-defined]  # a verify batch has no init field
    draft_extend = prepare_for_draft_extend(committed)
    draft_extend.init  # type: ignore[attr-defined]  # nor has a draft-extend batch
    prepare_for_draft_extend(extend)  # type: ignore[arg-type]  # a draft extend built from a prefill batch
    attrs.evolve(draft_extend, init=extend.init)  # type: ignore[call-arg]  # evolve cannot add one
    DraftExtendBatch(  # type: ignore[call-arg]  # nor can the constructor
        rids=draft_extend.rids,
        slots=draft_extend.slots,
        prefix_lens=draft_extend.prefix_lens,
        extend_lens=draft_extend.extend_lens,
        input_ids=draft_extend.input_ids,
        kv_locs=draft_extend.kv_locs,
        init=extend.init,
    )
    lower(verify, LowerContext()).tickets  # type: ignore[attr-defined]  # a verify plan has no tickets
    executor.run_prefill(lower(draft_extend, LowerContext()))  # type: ignore[arg-type]  # not a prefill plan
    executor.run_prefill(lower(verify, LowerContext()))  # type: ignore[arg-type]  # nor is a verify plan
