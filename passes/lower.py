"""``lower``: each batch type -> its plan type.

Pre: ``ctx.pools`` names every state pool that must see this model's init ops: the target pool,
and each draft pool in speculative mode; distinct names, at least one.
Post: ``ExtendBatch -> ExtendPlan``, ``MixedBatch -> MixedPlan``, ``DecodeBatch -> DecodePlan``,
``IdleBatch -> IdlePlan``, and each speculative phase to its plan (``DraftPlan``, ``VerifyPlan``,
``CommitPlan``, ``DraftCommitPlan``, ``DraftExtendPlan``: none has a ticket field). A batch with a ``MambaInit`` yields one ``InitTicket`` per pool, all with
the init's serial (lowering the same batch twice yields the same tickets, which the ledger then
refuses to consume twice). Plans share the batch's immutable columns; nothing is copied.

A pipelined step (``compiler.steps.Pipeline``) names the sample its forward keeps and the sample its
decode rows read their inputs from: ``sample_id`` (extend, decode, mixed) and ``inputs_from``
(decode, mixed: its decode part) are arguments of ``lower``, which returns the finished plan; a
mixed plan's two parts keep their tokens under the one ``sample_id``. The overloads give them only
to the batches whose plans have them (at run time another batch given one is refused), and a plan
given one runs its own checks (they are the caller's ids, not the checked batch's columns).
"""

from __future__ import annotations

from typing import final, overload

import attrs

from ir import spec
from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.columns import build_unchecked
from ir.errors import IRValidationError
from ir.ids import TARGET_POOL, PoolId, SampleId
from ir.init import Ticket
from ir.nodes import Batch, Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from passes._args import bad_arg, unexpected_arg


def _pools(values: object) -> tuple[PoolId, ...]:
    """Converter of ``LowerContext.pools``: a tuple of non-empty ``str`` pool names, distinct, at
    least one. Nothing is converted (``None`` is not pool ``'None'``)."""
    if isinstance(values, str) or not isinstance(values, (tuple, list, frozenset, set)):
        raise IRValidationError("LowerContext", "pools", values, "must be a tuple of pool names")
    out = tuple(values)
    for v in out:
        if not isinstance(v, str) or not v:
            what = "an empty str" if isinstance(v, str) else type(v).__name__
            raise IRValidationError("LowerContext", "pools", v, f"every entry must be a pool name (a non-empty str), not {what}")
    if not out:
        raise IRValidationError("LowerContext", "pools", values, "at least one pool must be registered")
    if len(set(out)) != len(out):
        raise IRValidationError("LowerContext", "pools", values, "pool names must be distinct")
    return out


@final
@attrs.frozen(kw_only=True)
class LowerContext:
    pools: tuple[PoolId, ...] = attrs.field(default=(TARGET_POOL,), converter=_pools)


def _extend_plan(batch: ExtendBatch, ctx: LowerContext, sample_id: SampleId | None) -> ExtendPlan:
    init, snap = batch.init, batch.snapshot
    # The columns are the checked batch's own read-only arrays: no copy, no re-check.
    plan = build_unchecked(
        ExtendPlan,
        rids=batch.rids,
        slots=batch.slots,
        prefix_lens=batch.prefix_lens,
        extend_lens=batch.extend_lens,
        more_chunks=batch.more_chunks,
        input_ids=batch.input_ids,
        kv_locs=batch.kv_locs,
        tickets=tuple(Ticket(pool=p, op=init) for p in ctx.pools) if init is not None else (),
        snapshots=tuple(Ticket(pool=p, op=snap) for p in ctx.pools) if snap is not None else (),
        sample_id=sample_id,
        sampling=batch.sampling,
    )
    if sample_id is not None:  # the caller's sample id: checked as the constructor would
        plan.check_fields()
    return plan


def _decode_plan(batch: DecodeBatch, sample_id: SampleId | None, inputs_from: SampleId | None) -> DecodePlan:
    plan = build_unchecked(
        DecodePlan,
        rids=batch.rids,
        slots=batch.slots,
        seq_lens=batch.seq_lens,
        input_ids=batch.input_ids,
        kv_locs=batch.kv_locs,
        sample_id=sample_id,
        inputs_from=inputs_from,
        sampling=batch.sampling,
    )
    if sample_id is not None or inputs_from is not None:  # the caller's sample ids (and placeholder inputs)
        plan.check_fields()
    return plan


@overload
def lower(batch: ExtendBatch, ctx: LowerContext, *, sample_id: SampleId | None = None) -> ExtendPlan: ...
@overload
def lower(
    batch: DecodeBatch, ctx: LowerContext, *, sample_id: SampleId | None = None, inputs_from: SampleId | None = None
) -> DecodePlan: ...
@overload
def lower(
    batch: MixedBatch, ctx: LowerContext, *, sample_id: SampleId | None = None, inputs_from: SampleId | None = None
) -> MixedPlan: ...
@overload
def lower(batch: IdleBatch, ctx: LowerContext) -> IdlePlan: ...
@overload
def lower(batch: spec.DraftBatch, ctx: LowerContext) -> spec.DraftPlan: ...
@overload
def lower(batch: spec.VerifyBatch, ctx: LowerContext) -> spec.VerifyPlan: ...
@overload
def lower(batch: spec.CommitBatch, ctx: LowerContext) -> spec.CommitPlan: ...
@overload
def lower(batch: spec.DraftCommitBatch, ctx: LowerContext) -> spec.DraftCommitPlan: ...
@overload
def lower(batch: spec.DraftExtendBatch, ctx: LowerContext) -> spec.DraftExtendPlan: ...
def lower(batch: Batch, ctx: LowerContext, *, sample_id: SampleId | None = None, inputs_from: SampleId | None = None) -> Plan:
    if not isinstance(ctx, LowerContext):
        raise bad_arg("lower", "ctx", ctx, "a LowerContext")
    if inputs_from is not None and not isinstance(batch, (DecodeBatch, MixedBatch)):
        raise bad_arg("lower", "inputs_from", inputs_from, f"None for a {type(batch).__name__} (only decode rows read a sample)")
    if sample_id is not None and not isinstance(batch, (ExtendBatch, DecodeBatch, MixedBatch)):
        raise bad_arg("lower", "sample_id", sample_id, f"None for a {type(batch).__name__} (only a forward keeps a sample)")
    match batch:
        case ExtendBatch():
            return _extend_plan(batch, ctx, sample_id)
        case DecodeBatch():
            return _decode_plan(batch, sample_id, inputs_from)
        case MixedBatch():
            return MixedPlan(extend=_extend_plan(batch.extend, ctx, sample_id), decode=_decode_plan(batch.decode, sample_id, inputs_from))
        case IdleBatch():
            return IdlePlan()
        case spec.DraftBatch():
            return spec.DraftPlan(batch=batch)
        case spec.VerifyBatch():
            return spec.VerifyPlan(batch=batch)
        case spec.CommitBatch():
            return spec.CommitPlan(batch=batch)
        case spec.DraftCommitBatch():
            return spec.DraftCommitPlan(batch=batch)
        case spec.DraftExtendBatch():
            return spec.DraftExtendPlan(batch=batch)
        case _:
            unexpected_arg("lower", "batch", batch, "a batch (ir.nodes.Batch)")
