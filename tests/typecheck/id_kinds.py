"""Ids that name different things share one minter but not one type: a sample id, a draft id, a
verify id and a ticket serial are each refused where another (or a bare int) is expected. Each
offending line carries the expected code."""

from __future__ import annotations

from typing import Any

from compiler.steps import Pipeline
from ir.batch import DecodeBatch
from ir.ids import SampleId, TicketSerial
from ir.init import MambaInit, mint_serial
from ir.mint import mint_draft_id, mint_sample_id, mint_verify_id
from ir.plan import DecodePlan
from ir.spec import CommitBatch, DraftBatch, VerifyBatch
from passes.prepare_for_decode import DecodeContext


def samples(pipeline: Pipeline, running: DecodeBatch, ctx: DecodeContext, plan: DecodePlan, draft: DraftBatch) -> None:
    pipeline.decode(running, ctx, sample_id=mint_sample_id(), inputs_from=plan.sample_id)  # the right kinds pass
    pipeline.decode(running, ctx, sample_id=mint_serial())  # type: ignore[arg-type]  # a ticket serial is not a sample id
    pipeline.decode(running, ctx, inputs_from=draft.draft_id)  # type: ignore[arg-type]  # nor is a draft id
    pipeline.decode(running, ctx, inputs_from=7)  # type: ignore[arg-type]  # nor a bare int
    MambaInit(serial=mint_sample_id(), clear_slots=(1,))  # type: ignore[arg-type]  # a sample id is not a ticket serial
    kept: SampleId = mint_draft_id()  # type: ignore[assignment]  # a draft id is not a sample id
    serial: TicketSerial = mint_verify_id()  # type: ignore[assignment]  # nor is a verify id a ticket serial
    del kept, serial


def phases(verify: VerifyBatch, window: dict[str, Any]) -> None:
    VerifyBatch(verify_id=mint_verify_id(), draft_id=verify.draft_id, **window)  # the right kinds pass
    VerifyBatch(verify_id=verify.draft_id, draft_id=verify.draft_id, **window)  # type: ignore[arg-type]  # a draft id named as the verify's
    CommitBatch(verify_id=verify.verify_id, draft_id=verify.verify_id, **window)  # type: ignore[arg-type]  # ids swapped
    DraftBatch(draft_id=mint_verify_id(), **window)  # type: ignore[arg-type]  # a verify id is not a draft id
    DraftBatch(draft_id=mint_serial(), **window)  # type: ignore[arg-type]  # nor is a ticket serial
