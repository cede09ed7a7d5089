"""``lower``: each batch type -> its plan type.

Pre: ``ctx.pools`` names every state pool that must see a prefill's init ops through its
``ExtendPlan``: the target pool, and each separate draft model's pool in speculative mode; distinct
names, at least one. ``ctx.head_pools`` names the pools of a draft head (MTP/EAGLE), which see the
prefill's init ops through the head's own phase instead (``HeadExtendPlan``): distinct, none of them
in ``pools`` (a pool seeing both would run the ops twice), and at least one for lowering a
``HeadExtendBatch`` (none would drop the head pool's ops: ``PreconditionError``).
Post: ``ExtendBatch -> ExtendPlan``, ``MixedBatch -> MixedPlan``, ``DecodeBatch -> DecodePlan``,
``IdleBatch -> IdlePlan``, each speculative phase to its plan (``DraftPlan``, ``VerifyPlan``,
``CommitPlan``, ``DraftCommitPlan``, ``DraftExtendPlan``: none has a ticket field), and a draft
head's phases to theirs (``HeadExtendPlan``: tickets for ``ctx.head_pools``; ``HeadCommitPlan``:
none). A batch with a ``MambaInit`` yields one ``InitTicket`` per pool, all with
the init's serial (lowering the same batch twice yields the same tickets, which the ledger then
refuses to consume twice). Plans share the batch's immutable columns; nothing is copied.

``keep_hidden`` (extend, mixed: its extend part; verify): the ``HiddenId`` under which the forward
keeps the target's hidden states for a draft head (``ir.hidden``), an argument like ``sample_id``.

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
from ir.errors import IRValidationError, PreconditionError
from ir.head import HeadCommitBatch, HeadCommitPlan, HeadExtendBatch, HeadExtendPlan
from ir.ids import TARGET_POOL, HiddenId, PoolId, SampleId
from ir.init import Ticket
from ir.nodes import Batch, Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from passes._args import bad_arg, unexpected_arg

__all__ = [
    "LowerContext",
    "lower",
]


def _pool_names(field: str, values: object) -> tuple[PoolId, ...]:
    """A tuple of non-empty ``str`` pool names, distinct. Nothing is converted (``None`` is not pool
    ``'None'``)."""
    if isinstance(values, str) or not isinstance(values, (tuple, list, frozenset, set)):
        raise IRValidationError("LowerContext", field, values, "must be a tuple of pool names")
    out = tuple(values)
    for v in out:
        if not isinstance(v, str) or not v:
            what = "an empty str" if isinstance(v, str) else type(v).__name__
            raise IRValidationError("LowerContext", field, v, f"every entry must be a pool name (a non-empty str), not {what}")
    if len(set(out)) != len(out):
        raise IRValidationError("LowerContext", field, values, "pool names must be distinct")
    return out


def _pools(values: object) -> tuple[PoolId, ...]:
    """Converter of ``LowerContext.pools``: pool names (``_pool_names``), at least one."""
    out = _pool_names("pools", values)
    if not out:
        raise IRValidationError("LowerContext", "pools", values, "at least one pool must be registered")
    return out


def _head_pools(values: object) -> tuple[PoolId, ...]:
    """Converter of ``LowerContext.head_pools``: pool names (``_pool_names``), possibly none."""
    return _pool_names("head_pools", values)


@final
@attrs.frozen(kw_only=True)
class LowerContext:
    """Which state pools a prefill's one-shot ops are addressed to when a batch is lowered: each pool
    gets its own ticket of the same op. Refused on construction (``IRValidationError``): no pool in
    ``pools``, a pool name that is not a non-empty ``str``, a name twice, a pool in both fields (it
    would run the ops twice)."""

    pools: tuple[PoolId, ...] = attrs.field(default=(TARGET_POOL,), converter=_pools)
    """The pools that see a prefill's ops through its ``ExtendPlan`` (target, separate draft)."""
    head_pools: tuple[PoolId, ...] = attrs.field(default=(), converter=_head_pools)
    """The draft head's pools, which see them through the ``HeadExtendPlan`` (none without a head)."""

    def __attrs_post_init__(self) -> None:
        both = sorted(set(self.pools) & set(self.head_pools))
        if both:
            raise IRValidationError(
                "LowerContext", "head_pools", both, f"a head pool must not be in pools {list(self.pools)} (it would run the prefill's ops twice)"
            )


def _extend_plan(batch: ExtendBatch, ctx: LowerContext, sample_id: SampleId | None, keep_hidden: HiddenId | None) -> ExtendPlan:
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
        keep_hidden=keep_hidden,
    )
    if sample_id is not None or keep_hidden is not None:  # the caller's ids: checked as the constructor would
        plan.check_fields()
    return plan


def _head_extend_plan(batch: HeadExtendBatch, ctx: LowerContext) -> HeadExtendPlan:
    if not ctx.head_pools:
        raise PreconditionError(
            "lower", f"a HeadExtendBatch needs the head's pools in LowerContext.head_pools (none given; pools {list(ctx.pools)}): "
            "without them the head pool would never run the prefill's init ops"
        )
    init, snap = batch.init, batch.snapshot
    return build_unchecked(
        HeadExtendPlan,
        hidden_id=batch.hidden_id,
        rids=batch.rids,
        slots=batch.slots,
        prefix_lens=batch.prefix_lens,
        extend_lens=batch.extend_lens,
        input_ids=batch.input_ids,
        kv_locs=batch.kv_locs,
        tickets=tuple(Ticket(pool=p, op=init) for p in ctx.head_pools) if init is not None else (),
        snapshots=tuple(Ticket(pool=p, op=snap) for p in ctx.head_pools) if snap is not None else (),
    )


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
def lower(batch: ExtendBatch, ctx: LowerContext, *, sample_id: SampleId | None = None, keep_hidden: HiddenId | None = None) -> ExtendPlan: ...
@overload
def lower(
    batch: DecodeBatch, ctx: LowerContext, *, sample_id: SampleId | None = None, inputs_from: SampleId | None = None
) -> DecodePlan: ...
@overload
def lower(
    batch: MixedBatch, ctx: LowerContext, *, sample_id: SampleId | None = None, inputs_from: SampleId | None = None,
    keep_hidden: HiddenId | None = None,
) -> MixedPlan: ...
@overload
def lower(batch: IdleBatch, ctx: LowerContext) -> IdlePlan: ...
@overload
def lower(batch: spec.DraftBatch, ctx: LowerContext) -> spec.DraftPlan: ...
@overload
def lower(batch: spec.VerifyBatch, ctx: LowerContext, *, keep_hidden: HiddenId | None = None) -> spec.VerifyPlan: ...
@overload
def lower(batch: spec.CommitBatch, ctx: LowerContext) -> spec.CommitPlan: ...
@overload
def lower(batch: spec.DraftCommitBatch, ctx: LowerContext) -> spec.DraftCommitPlan: ...
@overload
def lower(batch: spec.DraftExtendBatch, ctx: LowerContext) -> spec.DraftExtendPlan: ...
@overload
def lower(batch: HeadExtendBatch, ctx: LowerContext) -> HeadExtendPlan: ...
@overload
def lower(batch: HeadCommitBatch, ctx: LowerContext) -> HeadCommitPlan: ...
def lower(
    batch: Batch, ctx: LowerContext, *, sample_id: SampleId | None = None, inputs_from: SampleId | None = None,
    keep_hidden: HiddenId | None = None,
) -> Plan:
    """The plan of ``batch``, of its phase's plan type (the overloads say which), sharing the batch's
    columns. A prefill's ``MambaInit`` and ``MambaSnapshot`` become one ticket per pool of
    ``ctx.pools`` (a draft head's: of ``ctx.head_pools``), all under the op's serial, so lowering a
    batch twice yields the same tickets and the ledger refuses the second consumption.
    ``sample_id``, ``inputs_from`` and ``keep_hidden`` are the caller's ids, checked like a
    constructor's. Refused with ``PreconditionError``: a ``ctx`` that is not a ``LowerContext``, an
    id given to a batch whose plan has no such field, a ``HeadExtendBatch`` with no head pool."""
    if not isinstance(ctx, LowerContext):
        raise bad_arg("lower", "ctx", ctx, "a LowerContext")
    if inputs_from is not None and not isinstance(batch, (DecodeBatch, MixedBatch)):
        raise bad_arg("lower", "inputs_from", inputs_from, f"None for a {type(batch).__name__} (only decode rows read a sample)")
    if sample_id is not None and not isinstance(batch, (ExtendBatch, DecodeBatch, MixedBatch)):
        raise bad_arg("lower", "sample_id", sample_id, f"None for a {type(batch).__name__} (only a forward keeps a sample)")
    if keep_hidden is not None and not isinstance(batch, (ExtendBatch, MixedBatch, spec.VerifyBatch)):
        raise bad_arg(
            "lower", "keep_hidden", keep_hidden, f"None for a {type(batch).__name__} (only a prefill or a verify keeps hidden states for a head)"
        )
    match batch:
        case ExtendBatch():
            return _extend_plan(batch, ctx, sample_id, keep_hidden)
        case DecodeBatch():
            return _decode_plan(batch, sample_id, inputs_from)
        case MixedBatch():
            return MixedPlan(
                extend=_extend_plan(batch.extend, ctx, sample_id, keep_hidden), decode=_decode_plan(batch.decode, sample_id, inputs_from)
            )
        case IdleBatch():
            return IdlePlan()
        case spec.DraftBatch():
            return spec.DraftPlan(batch=batch)
        case spec.VerifyBatch():
            return spec.VerifyPlan(batch=batch, keep_hidden=keep_hidden)
        case spec.CommitBatch():
            return spec.CommitPlan(batch=batch)
        case spec.DraftCommitBatch():
            return spec.DraftCommitPlan(batch=batch)
        case spec.DraftExtendBatch():
            return spec.DraftExtendPlan(batch=batch)
        case HeadExtendBatch():
            return _head_extend_plan(batch, ctx)
        case HeadCommitBatch():
            return HeadCommitPlan(batch=batch)
        case _:
            unexpected_arg("lower", "batch", batch, "a batch (ir.nodes.Batch)")
