"""Draft-head misuse that mypy must reject (the upstream bug in its own setting: a draft
extend after verify that carried a prefill's clear/COW indices onto the live draft pool). A head
commit has no init field, and only a ``CommitBatch`` builds one. Each offending line carries the
expected code."""

from __future__ import annotations

import attrs

from backend.executor import Executor
from compiler.steps import Pipeline
from ir.batch import DecodeBatch, ExtendBatch, MixedBatch
from ir.head import HeadCommitBatch
from ir.hidden import HiddenStates
from ir.spec import CommitBatch
from passes.lower import LowerContext, lower
from passes.prepare_for_head_commit import prepare_for_head_commit
from passes.prepare_for_head_extend import prepare_for_head_extend


def misuse(committed: CommitBatch, extend: ExtendBatch, decode: DecodeBatch, mixed: MixedBatch, hidden: HiddenStates,
           pipeline: Pipeline, executor: Executor) -> None:
    head_commit = prepare_for_head_commit(committed, hidden)
    head_commit.init  # type: ignore[attr-defined]  # a head commit has no init field to read
    attrs.evolve(head_commit, init=extend.init)  # type: ignore[call-arg]  # evolve cannot add one
    HeadCommitBatch(  # type: ignore[call-arg]  # nor can the constructor
        k=head_commit.k,
        hidden_id=head_commit.hidden_id,
        rids=head_commit.rids,
        slots=head_commit.slots,
        prefix_lens=head_commit.prefix_lens,
        accept_pos=head_commit.accept_pos,
        extend_lens=head_commit.extend_lens,
        input_ids=head_commit.input_ids,
        kv_locs=head_commit.kv_locs,
        init=extend.init,
    )
    prepare_for_head_commit(extend, hidden)  # type: ignore[arg-type]  # a head commit built from a prefill (the upstream bug)
    prepare_for_head_commit(decode, hidden)  # type: ignore[arg-type]  # nor from a decode batch
    pipeline.head_commit(mixed.extend, hidden)  # type: ignore[arg-type]  # nor through the pipeline
    prepare_for_head_extend(committed, hidden)  # type: ignore[arg-type]  # a head extend follows a prefill, not a commit
    prepare_for_head_extend(mixed, hidden)  # type: ignore[arg-type]  # a mixed step's head extend takes its extend part
    lower(head_commit, LowerContext()).tickets  # type: ignore[attr-defined]  # a head commit plan has no tickets
    executor.run_prefill(lower(head_commit, LowerContext()))  # type: ignore[arg-type]  # nor is it a prefill plan
