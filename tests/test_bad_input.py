"""Bad input gets a clear, typed error and changes nothing.

Each row of ``CASES`` is one bad input: the exact exception type a caller can catch, a message
fragment naming the bad value or field, and (for ``IRValidationError``) the field it blames. Every
case runs against a fresh backend world (a target pool filled with random bytes, its ledger, slot and
KV allocators, an executor); whatever the case does, the pool's bytes, the ledger's outstanding and
consumed tickets and both allocators' state must be the same after the error as before it.

A case may have a ``setup`` that does legitimate work first (run a plan once, free a slot); the
"before" snapshot is taken after it, so "changes nothing" is about the bad call alone.
"""

from __future__ import annotations

import copy
import functools
import pickle
import re
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from typeguard import suppress_type_checks

from backend.allocator import KVAllocator, SlotAllocator
from backend.executor import Executor
from backend.hybrid.config import tiny
from backend.hybrid.model import HybridModel
from backend.ledger import Ledger
from backend.state_init import apply_op
from compiler.engine import Engine, PrefixState, RequestState, StepKind
from compiler.manager import PassError, PassManager
from compiler.prefix_cache import PrefixCache
from compiler.steps import Pipeline
from ir import results, spec
from ir.batch import DecodeBatch, ExtendBatch, MixedBatch
from ir.columns import build_unchecked
from ir.errors import (
    IRValidationError,
    IRVerificationError,
    PlanExecutionError,
    PreconditionError,
    ResourceReplayError,
    SlotError,
    UnknownTicketError,
    WrongPoolError,
)
from ir.ids import DRAFT_POOL, TARGET_POOL, DraftId, MambaSlot, PoolId, RequestId
from ir.init import InitIntent, MambaInit, MambaSnapshot, Ticket, mint_serial
from ir.mint import mint_draft_id, mint_verify_id
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.verify import verify
from passes.lower import LowerContext, lower
from passes.merge_batch import merge_batch
from passes.mix_with_running import mix_with_running
from passes.prepare_for_decode import DecodeContext, prepare_for_decode
from passes.prepare_for_draft import SpecContext
from passes.prepare_for_extend import prepare_for_extend
from tests.helpers import AFTER_NAMED, BEFORE_NAMED, OPS_NAMED, World, decode_batch, extend_plan, make_world, random_fill, request

Ctx = dict[str, Any]


@attrs.frozen
class Case:
    id: str
    act: Callable[[World, Ctx], object]
    error: type[BaseException]
    match: str
    """Regex searched in the message; ``<name>`` is replaced by ``re.escape(str(ctx[name]))``."""
    field: str | None = None
    """For ``IRValidationError``: the field the error must name."""
    setup: Callable[[World], Ctx] | None = None
    pool_id: PoolId = TARGET_POOL
    xfail: str | None = None
    """A known library bug: the row is a strict xfail until it is fixed."""


def _no_setup(w: World) -> Ctx:
    return {}


# -- setups ---------------------------------------------------------------------------------------


def _registered_clear_plan(slot: int) -> Callable[[World], Ctx]:
    def setup(w: World) -> Ctx:
        _, plan = extend_plan([request(1, slot, [5, 6, 7], 10)], ledger=w.ledger)
        return {"plan": plan, "serial": plan.tickets[0].serial}

    return setup


def _executed_clear_plan(w: World) -> Ctx:
    """Run a clear of slot 2 once, then let the 'model' write state into it (a live request's state)."""
    ctx = _registered_clear_plan(2)(w)
    w.executor.execute(ctx["plan"])
    assert torch.count_nonzero(w.pool.buffer[2]) == 0
    w.pool.buffer[2].fill_(0x5A)
    w.executor.adopt_pool_contents()  # the stand-in model's write, declared to the mutation detector
    return ctx


def _unregistered_plan(w: World) -> Ctx:
    _, plan = extend_plan([request(1, 2, [5, 6], 10)])
    return {"plan": plan, "serial": plan.tickets[0].serial}


def _freed_slot_plan(w: World) -> Ctx:
    ctx = _registered_clear_plan(3)(w)
    w.slots.free(3)
    return ctx


def _freed_checkpoint_plan(w: World) -> Ctx:
    """A COW from prefix slot 1 into slot 2, lowered and registered; then slot 1 is freed."""
    _, plan = extend_plan(
        [request(1, 2, [5, 6], 10, intent=CopyFrom(src=MambaSlot(1), prefix_len=3))], ledger=w.ledger
    )
    w.slots.free(1)
    return {"plan": plan, "serial": plan.tickets[0].serial}


def _free_slot_1(w: World) -> Ctx:
    w.slots.free(1)
    return {}


def _free_kv_5(w: World) -> Ctx:
    kv = w.kv.alloc_many(6)
    w.kv.free(int(kv[-1]))
    return {"loc": int(kv[-1])}


# -- acts -----------------------------------------------------------------------------------------


def _execute(w: World, ctx: Ctx) -> object:
    return w.executor.execute(ctx["plan"])


def _execute_deepcopy(w: World, ctx: Ctx) -> object:
    return w.executor.execute(copy.deepcopy(ctx["plan"]))


def _execute_pickled(w: World, ctx: Ctx) -> object:
    return w.executor.execute(pickle.loads(pickle.dumps(ctx["plan"])))


def _consume_on_wrong_pool(w: World, ctx: Ctx) -> object:
    ticket = ctx["plan"].tickets[0]
    with w.ledger.consuming(ticket, DRAFT_POOL):
        apply_op(w.pool, ticket.op)
    return None


def _plan_setup(build: Callable[[World], Any]) -> Callable[[World], Ctx]:
    """Lower (and register) the plan before the snapshot; the case's act then executes it."""

    def setup(w: World) -> Ctx:
        plan = build(w)
        ctx: Ctx = {"plan": plan}
        if isinstance(plan, ExtendPlan) and plan.tickets:
            ctx["serial"] = plan.tickets[0].serial
        return ctx

    return setup


_out_of_range_clear = _plan_setup(lambda w: extend_plan([request(1, 9, [5, 6], 10)], ledger=w.ledger)[1])
# no init ops: the plan's own slot column is what is out of range
_out_of_range_continue = _plan_setup(
    lambda w: extend_plan([request(1, 7, [5, 6], 10, intent=Continue(prefix_len=4))], ledger=w.ledger)[1]
)
_out_of_range_decode = _plan_setup(lambda w: lower(decode_batch([1, 2], [1, 5], [4, 4], [20, 21]), LowerContext()))
_out_of_range_cow_src = _plan_setup(
    lambda w: extend_plan(
        [request(1, 2, [5, 6], 10, intent=CopyFrom(src=MambaSlot(11), prefix_len=3))], ledger=w.ledger
    )[1]
)
# the world's pool is "draft"; the plan was lowered for the target pool only
_wrong_pool_executor = _plan_setup(
    lambda w: extend_plan([request(1, 2, [5, 6], 10)], pools=(TARGET_POOL,), ledger=w.ledger)[1]
)


def _prepare_decode_wrong_ctx(w: World, ctx: Ctx) -> object:
    running = decode_batch([1, 2], [1, 2], [4, 6], [20, 21])
    return prepare_for_decode(running, DecodeContext(next_tokens=np.array([3]), kv_locs=np.array([30])))


def _prepare_decode_counts_chunked(w: World, ctx: Ctx) -> object:
    # one of the two requests has more chunks: it does not decode, so 2 tokens are one too many
    batch = prepare_for_extend(
        [request(1, 1, [5, 6], 10), request(2, 2, [7, 8], 12, more_chunks=True)]
    )
    return prepare_for_decode(batch, DecodeContext(next_tokens=np.array([3, 4]), kv_locs=np.array([30, 31])))


def _merge_shared_rid(w: World, ctx: Ctx) -> object:
    running = decode_batch([7], [1], [4], [20])
    prefilled = prepare_for_extend([request(7, 2, [5, 6], 10)])
    return merge_batch(running, prefilled)


def _merge_shared_slot(w: World, ctx: Ctx) -> object:
    running = decode_batch([7], [3], [4], [20])
    prefilled = prepare_for_extend([request(8, 3, [5, 6], 10)])
    return merge_batch(running, prefilled)


def _mix_shared_slot(w: World, ctx: Ctx) -> object:
    extend = prepare_for_extend([request(1, 2, [5, 6], 10)])
    running = decode_batch([5], [2], [4], [20])
    return mix_with_running(extend, running)


def _mix_shared_kv(w: World, ctx: Ctx) -> object:
    extend = prepare_for_extend([request(1, 2, [5, 6], 10)])
    running = decode_batch([5], [3], [4], [11])
    return mix_with_running(extend, running)


def _prepare_extend_empty(w: World, ctx: Ctx) -> object:
    return prepare_for_extend([])


def _verify_dup_slots_decode(w: World, ctx: Ctx) -> object:
    verify(decode_batch([1, 2, 3], [1, 3, 3], [4, 4, 4], [20, 21, 22]))
    return None


def _verify_dup_slots_extend(w: World, ctx: Ctx) -> object:
    # continuations (no init ops), so only the whole-batch verifier can see the repeat
    batch = prepare_for_extend(
        [
            request(1, 2, [5], 10, intent=Continue(prefix_len=3)),
            request(2, 2, [6], 11, intent=Continue(prefix_len=3)),
        ]
    )
    verify(batch)
    return None


def _verify_dup_kv(w: World, ctx: Ctx) -> object:
    verify(decode_batch([1, 2], [1, 2], [4, 4], [20, 20]))
    return None


def _verify_cow_src_live(w: World, ctx: Ctx) -> object:
    batch = prepare_for_extend(
        [
            request(1, 1, [5], 10, intent=Continue(prefix_len=3)),
            request(2, 2, [6, 7], 11, intent=CopyFrom(src=MambaSlot(1), prefix_len=3)),
        ]
    )
    verify(batch)
    return None


def _verify_init_mismatch(w: World, ctx: Ctx) -> object:
    # intents say "continue" but the init clears the slot: a clear that would wipe a live state
    batch = ExtendBatch(
        rids=[1],
        slots=[2],
        prefix_lens=[3],
        extend_lens=[2],
        more_chunks=[False],
        intents=(InitIntent.CONTINUE,),
        input_ids=[5, 6],
        kv_locs=[10, 11],
        init=MambaInit(serial=mint_serial(), clear_slots=(2,)),
    )
    verify(batch)
    return None


def _verify_dup_kv_extend(w: World, ctx: Ctx) -> object:
    # request 2's only token reuses request 1's second KV location: each request is fine on its own
    verify(prepare_for_extend([request(1, 1, [5, 6], 10), request(2, 2, [7], 11)]))
    return None


def _verify_init_missing(w: World, ctx: Ctx) -> object:
    # a CLEAR request with no MambaInit: the slot would start from whatever state it holds
    batch = ExtendBatch(
        rids=[1], slots=[2], prefix_lens=[0], extend_lens=[2], more_chunks=[False],
        intents=(InitIntent.CLEAR,), input_ids=[5, 6], kv_locs=[10, 11], init=None,
    )
    verify(batch)
    return None


def _verify_mixed_shared_slot(w: World, ctx: Ctx) -> object:
    # built directly (not through mix_with_running): each part is fine, only the verifier sees slot 2 twice
    verify(MixedBatch(extend=prepare_for_extend([request(1, 2, [5, 6], 10)]), decode=decode_batch([5], [2], [4], [20])))
    return None


def _verify_dup_slots_decode_plan(w: World, ctx: Ctx) -> object:
    verify(lower(decode_batch([1, 2], [3, 3], [4, 4], [20, 21]), LowerContext()))
    return None


def _pipeline_mixed_shared_slot(w: World, ctx: Ctx) -> object:
    pipe = Pipeline(w.ledger, pm=PassManager(verify_level=2))
    running = decode_batch([5], [2], [4], [20])
    return pipe.mixed([request(1, 2, [5, 6], 10)], running, DecodeContext(next_tokens=[3], kv_locs=[30]))


def _tokens(values: Any) -> Callable[[World, Ctx], object]:
    def act(w: World, ctx: Ctx) -> object:
        return AdmittedRequest(
            rid=RequestId(1), slot=MambaSlot(2), input_ids=values, kv_locs=[10, 11], intent=Clear()
        )

    return act


def _build(fn: Callable[[], object]) -> Callable[[World, Ctx], object]:
    return lambda w, ctx: fn()


def _admitted(**kw: Any) -> Callable[[World, Ctx], object]:
    fields: dict[str, Any] = dict(rid=RequestId(1), slot=MambaSlot(2), input_ids=[5, 6], kv_locs=[10, 11], intent=Clear())
    fields.update(kw)
    return _build(lambda: AdmittedRequest(**fields))


def _init(**kw: Any) -> Callable[[World, Ctx], object]:
    return _build(lambda: MambaInit(serial=mint_serial(), **kw))


# -- node-typed fields: every attrs field of every IR node is type-checked on construction ---------


def _ticket_init() -> MambaInit:
    return MambaInit(serial=mint_serial(), clear_slots=(2,))


def _snapshot() -> MambaSnapshot:
    return MambaSnapshot(serial=mint_serial(), src=(2,), dst=(4,))


def _extend_batch(**changes: Any) -> Callable[[World, Ctx], object]:
    """A checked one-request ``ExtendBatch`` rebuilt (through its constructor) with ``changes``."""
    return _build(lambda: attrs.evolve(prepare_for_extend([request(1, 2, [5, 6], 10)]), **changes))


def _extend_plan(**changes: Any) -> Callable[[World, Ctx], object]:
    """A lowered one-request ``ExtendPlan`` (one ticket, for the target pool) rebuilt with ``changes``."""
    return _build(lambda: attrs.evolve(extend_plan([request(1, 2, [5, 6], 10)])[1], **changes))


def _spec_window(k: int) -> dict[str, Any]:
    """The fields of a one-row windowed spec batch with ``k`` draft tokens."""
    return dict(k=k, rids=[1], slots=[1], seq_lens=[5], input_ids=list(range(k + 1)), kv_locs=list(range(30, 31 + k)))


_DECODE = decode_batch([5], [3], [4], [20])
_GARBAGE = "garbage"


NODE_FIELD_CASES: list[Case] = [
    Case("ticket-op-none", _build(lambda: Ticket(pool=TARGET_POOL, op=None)), IRValidationError, rf"Ticket\.op: must be {OPS_NAMED}, not NoneType \(got None\)", field="op"),  # type: ignore[arg-type]
    Case("ticket-op-str", _build(lambda: Ticket(pool=TARGET_POOL, op="x")), IRValidationError, rf"Ticket\.op: must be {OPS_NAMED}, not str \(got 'x'\)", field="op"),  # type: ignore[arg-type]
    Case("ticket-op-batch", _build(lambda: Ticket(pool=TARGET_POOL, op=_DECODE)), IRValidationError, rf"Ticket\.op: must be {OPS_NAMED}, not DecodeBatch", field="op"),  # type: ignore[type-var]
    Case("ticket-pool-none", _build(lambda: Ticket(pool=None, op=_ticket_init())), IRValidationError, r"Ticket\.pool: must be a pool name \(a non-empty str\), not NoneType \(got None\)", field="pool"),  # type: ignore[arg-type]
    Case("ticket-pool-int", _build(lambda: Ticket(pool=3, op=_ticket_init())), IRValidationError, r"Ticket\.pool: .*not int \(got 3\)", field="pool"),  # type: ignore[arg-type]
    Case("ticket-pool-empty", _build(lambda: Ticket(pool=PoolId(""), op=_ticket_init())), IRValidationError, r"Ticket\.pool: must be a non-empty pool name \(got ''\)", field="pool"),
    Case("snapshot-ticket-pool-none", _build(lambda: Ticket(pool=None, op=_snapshot())), IRValidationError, r"Ticket\.pool: .*not NoneType \(got None\)", field="pool"),  # type: ignore[arg-type]
    Case("extend-batch-init-str", _extend_batch(init=_GARBAGE), IRValidationError, r"ExtendBatch\.init: must be a MambaInit or None, not str \(got 'garbage'\)", field="init"),
    Case("extend-batch-init-snapshot", _extend_batch(init=MambaSnapshot(serial=mint_serial(), src=(2,), dst=(4,))), IRValidationError, r"ExtendBatch\.init: must be a MambaInit or None, not MambaSnapshot", field="init"),
    Case("extend-batch-snapshot-str", _extend_batch(snapshot=_GARBAGE), IRValidationError, r"ExtendBatch\.snapshot: must be a MambaSnapshot or None, not str \(got 'garbage'\)", field="snapshot"),
    Case("extend-batch-snapshot-init", _extend_batch(snapshot=MambaInit(serial=mint_serial(), clear_slots=(2,))), IRValidationError, r"ExtendBatch\.snapshot: .*not MambaInit", field="snapshot"),
    Case("extend-plan-ticket-init-str", _build(lambda: attrs.evolve(extend_plan([request(1, 2, [5, 6], 10)])[1], tickets=(Ticket(pool=TARGET_POOL, op="x"),))), IRValidationError, r"Ticket\.op: .*\(got 'x'\)", field="op"),  # type: ignore[arg-type]
    Case("extend-plan-tickets-none-entry", _extend_plan(tickets=(None,)), IRValidationError, rf"ExtendPlan\.tickets: every entry must be a Ticket of {BEFORE_NAMED}, not NoneType \(got None\)", field="tickets"),
    Case("extend-plan-tickets-str", _extend_plan(tickets="ab"), IRValidationError, rf"ExtendPlan\.tickets: must be a tuple of a Ticket of {BEFORE_NAMED} \(got 'ab'\)", field="tickets"),
    Case("extend-plan-snapshots-none-entry", _extend_plan(snapshots=(None,)), IRValidationError, rf"ExtendPlan\.snapshots: every entry must be a Ticket of {AFTER_NAMED}, not NoneType \(got None\)", field="snapshots"),
    Case("extend-plan-snapshots-str", _extend_plan(snapshots="ab"), IRValidationError, rf"ExtendPlan\.snapshots: must be a tuple of a Ticket of {AFTER_NAMED} \(got 'ab'\)", field="snapshots"),
    Case("extend-plan-snapshots-none", _extend_plan(snapshots=None), IRValidationError, rf"ExtendPlan\.snapshots: must be a tuple of a Ticket of {AFTER_NAMED} \(got None\)", field="snapshots"),
    Case(
        "extend-plan-snapshots-init-ticket",
        _extend_plan(snapshots=(Ticket(pool=TARGET_POOL, op=MambaInit(serial=mint_serial(), clear_slots=(2,))),)),
        IRValidationError,
        rf"ExtendPlan\.snapshots: every entry must be a Ticket of {AFTER_NAMED}, not a Ticket of a MambaInit",
        field="snapshots",
    ),
    Case(
        "extend-plan-snapshots-two-for-one-pool",
        _build(lambda: (lambda s: attrs.evolve(extend_plan([request(1, 2, [5, 6], 10)])[1], snapshots=(Ticket(pool=TARGET_POOL, op=s), Ticket(pool=TARGET_POOL, op=s))))(_snapshot())),
        IRValidationError,
        r"ExtendPlan\.snapshots: two tickets for one pool \(got 'target'\)",
        field="snapshots",
    ),
    Case(
        "extend-plan-snapshots-two-serials",
        _extend_plan(snapshots=(Ticket(pool=TARGET_POOL, op=MambaSnapshot(serial=mint_serial(), src=(2,), dst=(4,))), Ticket(pool=DRAFT_POOL, op=MambaSnapshot(serial=mint_serial(), src=(2,), dst=(4,))))),
        IRValidationError,
        r"ExtendPlan\.snapshots: tickets of one plan share one serial",
        field="snapshots",
    ),
    Case("mixed-batch-none", _build(lambda: MixedBatch(extend=None, decode=None)), IRValidationError, r"MixedBatch\.extend: must be an ExtendBatch, not NoneType \(got None\)", field="extend"),  # type: ignore[arg-type]
    Case("mixed-batch-decode-none", _build(lambda: MixedBatch(extend=prepare_for_extend([request(1, 2, [5, 6], 10)]), decode=None)), IRValidationError, r"MixedBatch\.decode: must be a DecodeBatch, not NoneType \(got None\)", field="decode"),  # type: ignore[arg-type]
    Case("mixed-batch-parts-swapped", _build(lambda: MixedBatch(extend=_DECODE, decode=prepare_for_extend([request(1, 2, [5, 6], 10)]))), IRValidationError, r"MixedBatch\.extend: must be an ExtendBatch, not DecodeBatch", field="extend"),  # type: ignore[arg-type]
    Case("mixed-plan-none", _build(lambda: MixedPlan(extend=None, decode=None)), IRValidationError, r"MixedPlan\.extend: must be an ExtendPlan, not NoneType \(got None\)", field="extend"),  # type: ignore[arg-type]
    Case("mixed-plan-decode-is-a-batch", _build(lambda: MixedPlan(extend=extend_plan([request(1, 2, [5, 6], 10)])[1], decode=_DECODE)), IRValidationError, r"MixedPlan\.decode: must be a DecodePlan, not DecodeBatch", field="decode"),  # type: ignore[arg-type]
    Case("draft-plan-batch-none", _build(lambda: spec.DraftPlan(batch=None)), IRValidationError, r"DraftPlan\.batch: must be a DraftBatch, not NoneType \(got None\)", field="batch"),  # type: ignore[arg-type]
    Case("verify-plan-batch-none", _build(lambda: spec.VerifyPlan(batch=None)), IRValidationError, r"VerifyPlan\.batch: must be a VerifyBatch, not NoneType \(got None\)", field="batch"),  # type: ignore[arg-type]
    Case("verify-plan-batch-is-draft", _build(lambda: spec.VerifyPlan(batch=spec.DraftBatch(draft_id=mint_draft_id(), **{**_spec_window(1), "input_ids": [3]}))), IRValidationError, r"VerifyPlan\.batch: must be a VerifyBatch, not DraftBatch", field="batch"),  # type: ignore[arg-type]
    Case("commit-plan-batch-str", _build(lambda: spec.CommitPlan(batch="x")), IRValidationError, r"CommitPlan\.batch: must be a CommitBatch, not str \(got 'x'\)", field="batch"),  # type: ignore[arg-type]
    Case("draft-extend-plan-batch-none", _build(lambda: spec.DraftExtendPlan(batch=None)), IRValidationError, r"DraftExtendPlan\.batch: must be a DraftExtendBatch, not NoneType \(got None\)", field="batch"),  # type: ignore[arg-type]
    Case(
        "verify-rechecks-unchecked-mixed-plan",
        lambda w, ctx: verify(build_unchecked(MixedPlan, extend=None, decode=_DECODE)),
        IRValidationError,
        r"MixedPlan\.extend: must be an ExtendPlan, not NoneType",
        field="extend",
    ),
    Case(
        "verify-rechecks-unchecked-plan-tickets",
        lambda w, ctx: verify(build_unchecked(ExtendPlan, **{**attrs.asdict(extend_plan([request(1, 2, [5, 6], 10)])[1], recurse=False), "tickets": ("x",)})),
        IRValidationError,
        rf"ExtendPlan\.tickets: every entry must be a Ticket of {BEFORE_NAMED}, not str \(got 'x'\)",
        field="tickets",
    ),
    # pool names: non-empty str, nothing converted (None is not pool 'None')
    Case("lower-pools-none-entry", _build(lambda: LowerContext(pools=[None])), IRValidationError, r"LowerContext\.pools: every entry must be a pool name \(a non-empty str\), not NoneType \(got None\)", field="pools"),  # type: ignore[list-item]
    Case("lower-pools-int-entry", _build(lambda: LowerContext(pools=("target", 1))), IRValidationError, r"LowerContext\.pools: .*not int \(got 1\)", field="pools"),
    Case("lower-pools-empty-name", _build(lambda: LowerContext(pools=("target", ""))), IRValidationError, r"LowerContext\.pools: .*not an empty str \(got ''\)", field="pools"),
    # k is bounded: the executor allocates k + 1 positions per row
    Case("draft-batch-k-huge", _build(lambda: spec.DraftBatch(k=2**40, draft_id=mint_draft_id(), rids=[], slots=[], seq_lens=[], input_ids=[], kv_locs=[])), IRValidationError, rf"DraftBatch\.k: speculative steps must be at most MAX_SPEC_K \({spec.MAX_SPEC_K}\) \(got {2**40}\)", field="k"),
    Case("draft-batch-k-past-max", _build(lambda: spec.DraftBatch(draft_id=mint_draft_id(), **{**_spec_window(spec.MAX_SPEC_K + 1), "input_ids": [3]})), IRValidationError, rf"DraftBatch\.k: .*at most MAX_SPEC_K .*\(got {spec.MAX_SPEC_K + 1}\)", field="k"),
    Case("verify-batch-k-past-max", _build(lambda: spec.VerifyBatch(verify_id=mint_verify_id(), draft_id=mint_draft_id(), **_spec_window(spec.MAX_SPEC_K + 1))), IRValidationError, rf"VerifyBatch\.k: .*at most MAX_SPEC_K .*\(got {spec.MAX_SPEC_K + 1}\)", field="k"),
    Case(
        "commit-batch-k-huge",
        _build(lambda: spec.CommitBatch(k=2**40, verify_id=mint_verify_id(), draft_id=mint_draft_id(), rids=[], slots=[], seq_lens=[], accept_pos=[], input_ids=[], kv_locs=[], released_kv=[])),
        IRValidationError,
        rf"CommitBatch\.k: .*at most MAX_SPEC_K .*\(got {2**40}\)",
        field="k",
    ),
    Case(
        "draft-commit-batch-k-huge",
        _build(lambda: spec.DraftCommitBatch(k=2**40, draft_id=mint_draft_id(), rids=[], slots=[], seq_lens=[], accept_pos=[], input_ids=[], kv_locs=[])),
        IRValidationError,
        rf"DraftCommitBatch\.k: .*at most MAX_SPEC_K .*\(got {2**40}\)",
        field="k",
    ),
    Case("draft-commit-batch-accept-past-k", _build(lambda: spec.DraftCommitBatch(draft_id=mint_draft_id(), accept_pos=[2], **_spec_window(1))), IRValidationError, r"DraftCommitBatch\.accept_pos: must be .= k \(1\) \(got 2\)", field="accept_pos"),
    Case("draft-commit-batch-id-zero", _build(lambda: spec.DraftCommitBatch(draft_id=DraftId(0), accept_pos=[0], **_spec_window(1))), IRValidationError, r"DraftCommitBatch\.draft_id: must be positive .*\(got 0\)", field="draft_id"),
    Case("draft-batch-id-negative", _build(lambda: spec.DraftBatch(draft_id=DraftId(-4), **{**_spec_window(1), "input_ids": [3]})), IRValidationError, r"DraftBatch\.draft_id: must be positive .*\(got -4\)", field="draft_id"),
    Case("draft-commit-batch-window-short", _build(lambda: spec.DraftCommitBatch(draft_id=mint_draft_id(), accept_pos=[0], **{**_spec_window(1), "kv_locs": [30]})), IRValidationError, r"DraftCommitBatch\.kv_locs: length must equal", field="kv_locs"),
    Case("draft-commit-plan-batch-is-commit", _build(lambda: spec.DraftCommitPlan(batch=spec.CommitBatch(verify_id=mint_verify_id(), draft_id=mint_draft_id(), accept_pos=[1], released_kv=[], **_spec_window(1)))), IRValidationError, r"DraftCommitPlan\.batch: must be a DraftCommitBatch, not CommitBatch", field="batch"),  # type: ignore[arg-type]
    Case("spec-context-k-huge", _build(lambda: SpecContext(k=2**40, next_tokens=[], kv_locs=[])), IRValidationError, rf"SpecContext\.k: .*at most MAX_SPEC_K .*\(got {2**40}\)", field="k"),
    Case("spec-context-k-none", _build(lambda: SpecContext(k=None, next_tokens=[], kv_locs=[])), IRValidationError, r"SpecContext\.k: must be an int, not NoneType \(got None\)", field="k"),  # type: ignore[arg-type]
]


CASES: list[Case] = [
    # -- slots -------------------------------------------------------------------------------------
    Case("negative-slot", _admitted(slot=MambaSlot(-3)), IRValidationError, r"slot.*-3", field="slot"),
    Case("negative-clear-slot", _init(clear_slots=(-1,)), IRValidationError, r"clear_slots.*-1", field="clear_slots"),
    Case("slot-0-request", _admitted(slot=MambaSlot(0)), IRValidationError, r"padding.*got 0", field="slot"),
    Case("slot-0-clear", _init(clear_slots=(0,)), IRValidationError, r"padding.*got 0", field="clear_slots"),
    Case(
        "slot-0-decode-batch",
        _build(lambda: decode_batch([1, 2], [2, 0], [4, 4], [20, 21])),
        IRValidationError,
        r"DecodeBatch\.slots.*>= 1.*got 0",
        field="slots",
    ),
    Case("slot-out-of-range-clear", _execute, PlanExecutionError, r"ExtendPlan: slot 9 out of range \[1, 4\] of pool 'target'", setup=_out_of_range_clear),
    Case("slot-out-of-range-extend", _execute, PlanExecutionError, r"ExtendPlan: slot 7 out of range \[1, 4\]", setup=_out_of_range_continue),
    Case("slot-out-of-range-decode", _execute, PlanExecutionError, r"DecodePlan: slot 5 out of range \[1, 4\]", setup=_out_of_range_decode),
    Case("cow-src-out-of-range", _execute, PlanExecutionError, r"cow src slot 11 out of range", setup=_out_of_range_cow_src),
    Case("dup-slots-decode-verifier", _verify_dup_slots_decode, IRVerificationError, r"DecodeBatch\.slots\[2\].*slot 3 already used at index 1"),
    Case("dup-slots-extend-verifier", _verify_dup_slots_extend, IRVerificationError, r"ExtendBatch\.slots\[1\].*slot 2"),
    Case("dup-kv-verifier", _verify_dup_kv, IRVerificationError, r"kv_locs\[1\].*KV location 20"),
    Case("cow-src-is-live-slot", _verify_cow_src_live, IRVerificationError, r"init\.cow_src\[0\].*COW src 1 is the live slot"),
    Case("init-disagrees-with-intents", _verify_init_mismatch, IRVerificationError, r"init\.clear_slots.*\(2,\)"),
    # -- init ops ----------------------------------------------------------------------------------
    Case("dup-clear-slot", _init(clear_slots=(2, 3, 2)), IRValidationError, r"slot 2 appears twice", field="clear_slots"),
    Case("dup-cow-dst", _init(cow_src=(1, 3), cow_dst=(2, 2)), IRValidationError, r"slot 2 appears twice", field="cow_dst"),
    Case("cow-src-equals-dst", _init(cow_src=(2,), cow_dst=(2,)), IRValidationError, r"slot 2 onto itself", field="cow_src"),
    Case(
        "cow-src-cleared",
        _init(clear_slots=(3,), cow_src=(3,), cow_dst=(2,)),
        IRValidationError,
        r"src slot 3 is cleared",
        field="cow_src",
    ),
    Case(
        "cleared-and-cow-dst",
        _init(clear_slots=(2,), cow_src=(3,), cow_dst=(2,)),
        IRValidationError,
        r"slot 2 is both cleared and a COW dst",
        field="cow_dst",
    ),
    Case("cow-chain", _init(cow_src=(1, 2), cow_dst=(2, 3)), IRValidationError, r"slot 2 is both a COW src and a COW dst", field="cow_src"),
    Case("cow-lengths", _init(cow_src=(1, 3), cow_dst=(2,)), IRValidationError, r"len\(cow_src\) \(2\)", field="cow_dst"),
    Case("serial-zero", _build(lambda: MambaInit(serial=0, clear_slots=(1,))), IRValidationError, r"serial.*got 0", field="serial"),  # type: ignore[arg-type]
    # -- request fields ----------------------------------------------------------------------------
    # (the combinations an intent cannot express are refused by the constructor: no such field)
    Case("cow-without-src", _build(lambda: CopyFrom(prefix_len=3)), TypeError, r"src"),  # type: ignore[call-arg]
    Case("cow-src-is-own-slot", _admitted(intent=CopyFrom(src=MambaSlot(2), prefix_len=3)), IRValidationError, r"own slot.*got 2", field="intent"),
    Case("cow-without-prefix", _build(lambda: CopyFrom(src=MambaSlot(1), prefix_len=0)), IRValidationError, r"cached prefix", field="prefix_len"),
    Case("clear-with-prefix", _build(lambda: Clear(prefix_len=4)), TypeError, r"prefix_len"),  # type: ignore[call-arg]
    Case("clear-with-src", _build(lambda: Clear(src=MambaSlot(1))), TypeError, r"src"),  # type: ignore[call-arg]
    Case("continue-with-src", _build(lambda: Continue(src=MambaSlot(1), prefix_len=3)), TypeError, r"src"),  # type: ignore[call-arg]
    Case("intent-enum-not-variant", _admitted(intent=InitIntent.COW), IRValidationError, r"must be a Clear or a CopyFrom or a Continue, not InitIntent", field="intent"),
    Case("continue-without-prefix", _build(lambda: Continue(prefix_len=0)), IRValidationError, r"earlier chunks", field="prefix_len"),
    Case("negative-prefix", _build(lambda: Continue(prefix_len=-2)), IRValidationError, r"got -2", field="prefix_len"),
    Case("no-tokens", _admitted(input_ids=[], kv_locs=[]), IRValidationError, r"at least one token", field="input_ids"),
    Case("kv-shorter-than-tokens", _admitted(input_ids=[5, 6, 7]), IRValidationError, r"len\(input_ids\) \(3\) \(got 2\)", field="kv_locs"),
    Case(
        "seq-lens-length",
        _build(lambda: DecodeBatch(rids=[1, 2], slots=[1, 2], seq_lens=[4], input_ids=[3, 3], kv_locs=[20, 21])),
        IRValidationError,
        r"DecodeBatch\.seq_lens.*len\(rids\) \(2\) \(got 1\)",
        field="seq_lens",
    ),
    Case(
        "extend-tokens-vs-lens",
        _build(
            lambda: ExtendBatch(
                rids=[1], slots=[2], prefix_lens=[0], extend_lens=[3], more_chunks=[False],
                intents=(InitIntent.CLEAR,), input_ids=[5, 6], kv_locs=[10, 11],
                init=MambaInit(serial=mint_serial(), clear_slots=(2,)),
            )
        ),
        IRValidationError,
        r"input_ids.*sum\(extend_lens\) \(3\) \(got 2\)",
        field="input_ids",
    ),
    Case("float-tokens", _tokens([1.5, 2.0]), IRValidationError, r"AdmittedRequest\.input_ids.*ints", field="input_ids"),
    Case("string-tokens", _tokens(["a", "b"]), IRValidationError, r"AdmittedRequest\.input_ids.*ints", field="input_ids"),
    Case("digit-string-tokens", _tokens(["1", "2"]), IRValidationError, r"AdmittedRequest\.input_ids.*ints", field="input_ids"),
    Case("2d-tokens", _tokens(np.array([[1, 2], [3, 4]])), IRValidationError, r"1-D.*\(2, 2\)", field="input_ids"),
    Case("float-array-tokens", _tokens(np.array([1.0, 2.0])), IRValidationError, r"AdmittedRequest\.input_ids.*float64", field="input_ids"),
    Case(
        "negative-token",
        _build(lambda: prepare_for_extend([request(1, 2, [5, -4], 10)])),
        IRValidationError,
        r"ExtendBatch\.input_ids.*got -4",
        field="input_ids",
    ),
    Case(
        "decode-context-lengths",
        _build(lambda: DecodeContext(next_tokens=[1, 2], kv_locs=[3])),
        IRValidationError,
        r"DecodeContext\.kv_locs.*len\(next_tokens\) \(2\) \(got 1\)",
        field="kv_locs",
    ),
    # -- every column check of every node, each one on its own -------------------------------------
    Case("extend-slots-length", _extend_batch(slots=[2, 3]), IRValidationError, r"ExtendBatch\.slots: length must equal len\(rids\) \(1\) \(got 2\)", field="slots"),
    Case("extend-negative-prefix-len", _extend_batch(prefix_lens=[-1]), IRValidationError, r"ExtendBatch\.prefix_lens: every value must be >= 0 \(got -1\)", field="prefix_lens"),
    Case("extend-plan-more-chunks-length", _extend_plan(more_chunks=[False, True]), IRValidationError, r"ExtendPlan\.more_chunks: length must equal len\(rids\) \(1\) \(got 2\)", field="more_chunks"),
    Case("decode-rids-not-ints", _build(lambda: DecodeBatch(rids=[None], slots=[1], seq_lens=[4], input_ids=[7], kv_locs=[20])), IRValidationError, r"DecodeBatch\.rids: .*ints.*\(got None\)", field="rids"),  # type: ignore[list-item]
    Case("decode-negative-kv-loc", _build(lambda: decode_batch([1], [1], [4], [-1])), IRValidationError, r"DecodeBatch\.kv_locs: every value must be >= 0 \(got -1\)", field="kv_locs"),
    Case("decode-plan-slot-0", _build(lambda: DecodePlan(rids=[1], slots=[0], seq_lens=[4], input_ids=[7], kv_locs=[20])), IRValidationError, r"DecodePlan\.slots: every value must be >= 1 \(got 0\)", field="slots"),
    Case("decode-plan-seq-lens-length", _build(lambda: DecodePlan(rids=[1, 2], slots=[1, 2], seq_lens=[4], input_ids=[7, 7], kv_locs=[20, 21])), IRValidationError, r"DecodePlan\.seq_lens: length must equal len\(rids\) \(2\) \(got 1\)", field="seq_lens"),
    Case("draft-batch-slots-length", _build(lambda: spec.DraftBatch(k=1, draft_id=mint_draft_id(), rids=[1], slots=[1, 2], seq_lens=[5], input_ids=[3], kv_locs=[30, 31])), IRValidationError, r"DraftBatch\.slots: length must equal len\(rids\) \(1\) \(got 2\)", field="slots"),
    Case("verified-k-zero", _build(lambda: results.Verified(k=0, verify_id=mint_verify_id(), rids=[1], tokens=[5])), IRValidationError, r"Verified\.k: speculative steps must be >= 1 \(got 0\)", field="k"),
    Case("verified-k-past-max", _build(lambda: results.Verified(k=spec.MAX_SPEC_K + 1, verify_id=mint_verify_id(), rids=[1], tokens=[5] * (spec.MAX_SPEC_K + 2))), IRValidationError, rf"Verified\.k: .*at most MAX_SPEC_K .*\(got {spec.MAX_SPEC_K + 1}\)", field="k"),
    Case("sampled-logprobs-of-other-rows", _build(lambda: results.Sampled(rids=[1, 2], tokens=[5, 6], logprobs=results.Logprobs(logprob=[-0.5], top_lens=[0], top_ids=[], top_logprobs=[]))), IRValidationError, r"Sampled\.logprobs: must hold one entry per token \(2\) \(got 1\)", field="logprobs"),
    Case("sampled-logprobs-not-logprobs", _build(lambda: results.Sampled(rids=[1], tokens=[5], logprobs=[-0.5])), IRValidationError, r"Sampled\.logprobs: must be a Logprobs or None", field="logprobs"),
    Case("accept-result-negative-bonus", _build(lambda: spec.AcceptResult(verify_id=mint_verify_id(), rids=[1], accepted=[0], bonus=[-2])), IRValidationError, r"AcceptResult\.bonus: every value must be >= -1 \(got -2\)", field="bonus"),
    Case("cow-src-0", _build(lambda: CopyFrom(src=MambaSlot(0), prefix_len=3)), IRValidationError, r"CopyFrom\.src: must be >= 1 .*\(got 0\)", field="src"),
    Case("decode-context-float-tokens", _build(lambda: DecodeContext(next_tokens=np.array([1.5]), kv_locs=[3])), IRValidationError, r"DecodeContext\.next_tokens: .*got dtype float64", field="next_tokens"),
    Case("decode-context-negative-token", _build(lambda: DecodeContext(next_tokens=[-1], kv_locs=[3])), IRValidationError, r"DecodeContext\.next_tokens: every value must be >= 0 \(got -1\)", field="next_tokens"),
    Case("decode-context-negative-kv-loc", _build(lambda: DecodeContext(next_tokens=[1], kv_locs=[-1])), IRValidationError, r"DecodeContext\.kv_locs: every value must be >= 0 \(got -1\)", field="kv_locs"),
    Case("spec-context-float-tokens", _build(lambda: SpecContext(k=1, next_tokens=np.array([1.5]), kv_locs=[3, 4])), IRValidationError, r"SpecContext\.next_tokens: .*got dtype float64", field="next_tokens"),
    Case("lower-pools-none", _build(lambda: LowerContext(pools=None)), IRValidationError, r"LowerContext\.pools: must be a tuple of pool names \(got None\)", field="pools"),
    Case("dup-kv-extend-verifier", _verify_dup_kv_extend, IRVerificationError, r"ExtendBatch\.kv_locs\[2\]: KV location 11 already used at index 1"),
    Case("init-missing-verifier", _verify_init_missing, IRVerificationError, r"ExtendBatch\.init: requests need init ops \(clear \(2,\), COW into \(\)\) but init is None"),
    Case("mixed-shared-slot-verifier", _verify_mixed_shared_slot, IRVerificationError, r"MixedBatch\.slots: slot 2 is in both the extend and the decode part"),
    Case("dup-slots-decode-plan-verifier", _verify_dup_slots_decode_plan, IRVerificationError, r"DecodePlan\.slots\[1\]: slot 3 already used at index 0"),
    # -- passes ------------------------------------------------------------------------------------
    Case("prepare-decode-ctx-too-short", _prepare_decode_wrong_ctx, PreconditionError, r"prepare_for_decode: ctx\.next_tokens has 1 entries for 2"),
    Case("prepare-decode-ctx-chunked", _prepare_decode_counts_chunked, PreconditionError, r"has 2 entries for 1 decoding"),
    Case("prepare-extend-empty", _prepare_extend_empty, PreconditionError, r"prepare_for_extend: no admitted requests"),
    Case("merge-shared-rid", _merge_shared_rid, PreconditionError, r"merge_batch: request id 7 is in both"),
    Case("merge-shared-slot", _merge_shared_slot, PreconditionError, r"merge_batch: slot 3 is in both"),
    Case("mix-shared-slot", _mix_shared_slot, PreconditionError, r"mix_with_running: slot 2 is in both"),
    Case("mix-shared-kv", _mix_shared_kv, PreconditionError, r"KV location 11 is in both"),
    Case("pipeline-names-pass", _pipeline_mixed_shared_slot, PassError, r"pass 'mix_with_running' failed: PreconditionError.*slot 2"),
    Case("lower-dup-pools", _build(lambda: LowerContext(pools=("target", "draft", "target"))), IRValidationError, r"distinct.*'target'", field="pools"),
    Case("lower-empty-pools", _build(lambda: LowerContext(pools=())), IRValidationError, r"at least one pool", field="pools"),
    Case("lower-pools-string", _build(lambda: LowerContext(pools="target")), IRValidationError, r"tuple of pool names.*'target'", field="pools"),
    *NODE_FIELD_CASES,
    # -- tickets and the ledger --------------------------------------------------------------------
    Case(
        "executor-wrong-pool",
        _execute,
        PlanExecutionError,
        r"lowered for pool\(s\) 'target', not for this executor's pool 'draft'",
        setup=_wrong_pool_executor,
        pool_id=DRAFT_POOL,
    ),
    Case("ticket-on-wrong-pool", _consume_on_wrong_pool, WrongPoolError, r"#<serial> for pool 'target' handed to pool 'draft'", setup=_registered_clear_plan(2)),
    Case("ticket-never-registered", _execute, UnknownTicketError, r"#<serial> for pool 'target' was never registered", setup=_unregistered_plan),
    Case("replay-same-plan", _execute, ResourceReplayError, r"replay of ticket #<serial> for pool 'target': already consumed", setup=_executed_clear_plan),
    Case("replay-deepcopy", _execute_deepcopy, ResourceReplayError, r"#<serial> for pool 'target'.*already consumed", setup=_executed_clear_plan),
    Case("replay-pickled", _execute_pickled, ResourceReplayError, r"#<serial> for pool 'target'.*already consumed", setup=_executed_clear_plan),
    Case(
        "relower-consumed",
        lambda w, ctx: w.ledger.register(ctx["plan"].tickets),
        ResourceReplayError,
        r"#<serial> for pool 'target' was already consumed",
        setup=_executed_clear_plan,
    ),
    # -- allocators --------------------------------------------------------------------------------
    Case("double-free", lambda w, ctx: w.slots.free(1), SlotError, r"double free of slot 1", setup=_free_slot_1),
    Case("free-slot-0", lambda w, ctx: w.slots.free(0), SlotError, r"slot 0 out of range \[1, 4\]"),
    Case("free-never-allocated", lambda w, ctx: w.slots.free(4), SlotError, r"slot 4: it is not live"),
    Case("free-many-partial", lambda w, ctx: w.slots.free_many([1, 2, 4]), SlotError, r"slot 4"),
    Case("free-many-repeat", lambda w, ctx: w.slots.free_many([1, 1]), SlotError, r"slot 1"),
    Case("kv-double-free", lambda w, ctx: w.kv.free(ctx["loc"]), SlotError, r"double free of KV location <loc>", setup=_free_kv_5),
    Case("use-after-free", _execute, SlotError, r"use after free: ExtendPlan uses slot 3", setup=_freed_slot_plan),
    Case(
        "cow-from-freed-prefix",
        _execute,
        SlotError,
        r"use after free.*slot 1",
        setup=_freed_checkpoint_plan,
    ),
    Case("alloc-many-exhausted", lambda w, ctx: w.slots.alloc_many(2), SlotError, r"2 requested, 1 free of 4"),
    Case("alloc-many-negative", lambda w, ctx: w.slots.alloc_many(-1), SlotError, r"-1"),
    Case("kv-alloc-many-exhausted", lambda w, ctx: w.kv.alloc_many(65), SlotError, r"out of KV locations: 65 requested, 64 free"),
]


# -- no silent coercion: bool, float, str, None and out-of-int64 values where an int is required ----

BAD_INTS: list[tuple[str, object]] = [
    ("bool", True),
    ("float", 3.5),
    ("integral-float", 3.0),  # 3.0 is not slot 3 either
    ("str", "3"),
    ("none", None),
    ("above-int64", 2**63),
    ("below-int64", -(2**64)),
]
"""One bad value per class; every table row below is built once per value."""


def _got(value: object) -> str:
    """The ``(got ...)`` tail every refusal ends with: the bad value's repr."""
    return rf"\(got {re.escape(repr(value))}\)"


def _untyped(fn: Callable[[World, Ctx], object]) -> Callable[[World, Ctx], object]:
    """The suite's typeguard would refuse an ill-typed call at the signature; production runs
    without it, so the library's own check is what these rows test."""

    def act(w: World, ctx: Ctx) -> object:
        with suppress_type_checks():
            return fn(w, ctx)

    return act


def _verify_batch(**kw: Any) -> Callable[[World, Ctx], object]:
    fields: dict[str, Any] = dict(k=1, verify_id=mint_verify_id(), draft_id=mint_draft_id(), rids=[1], slots=[1], seq_lens=[5], input_ids=[3, 4], kv_locs=[30, 31])
    fields.update(kw)
    return _build(lambda: spec.VerifyBatch(**fields))


def _draft_batch(**kw: Any) -> Callable[[World, Ctx], object]:
    fields: dict[str, Any] = dict(k=1, draft_id=mint_draft_id(), rids=[1], slots=[1], seq_lens=[5], input_ids=[3], kv_locs=[30, 31])
    fields.update(kw)
    return _build(lambda: spec.DraftBatch(**fields))


def _coercion_cases(kind: str, v: object) -> list[Case]:
    got = _got(v)
    rows = [
        # an IR int column given as a list holding the bad value
        Case(
            f"{kind}-in-int-column",
            _build(lambda: DecodeBatch(rids=[1, 2], slots=[1, v], seq_lens=[4, 4], input_ids=[7, 7], kv_locs=[20, 21])),
            IRValidationError,
            rf"DecodeBatch\.slots: .*{got}",
            field="slots",
        ),
        Case(f"{kind}-token", _tokens([5, v]), IRValidationError, rf"AdmittedRequest\.input_ids: .*{got}", field="input_ids"),
        # IR scalar id fields
        Case(f"{kind}-rid", _admitted(rid=v), IRValidationError, rf"AdmittedRequest\.rid: .*{got}", field="rid"),
        Case(f"{kind}-slot", _admitted(slot=v), IRValidationError, rf"AdmittedRequest\.slot: .*{got}", field="slot"),
        Case(f"{kind}-prefix-len", _build(lambda: Continue(prefix_len=v)), IRValidationError, rf"Continue\.prefix_len: .*{got}", field="prefix_len"),
        Case(f"{kind}-cow-prefix-len", _build(lambda: CopyFrom(src=MambaSlot(1), prefix_len=v)), IRValidationError, rf"CopyFrom\.prefix_len: .*{got}", field="prefix_len"),
        Case(f"{kind}-verify-id", _verify_batch(verify_id=v), IRValidationError, rf"VerifyBatch\.verify_id: .*{got}", field="verify_id"),
        Case(f"{kind}-k", _draft_batch(k=v), IRValidationError, rf"DraftBatch\.k: .*{got}", field="k"),
        # MambaInit slots (the converter is not told which slot field it converts: it names "slots")
        Case(f"{kind}-clear-slot", _init(clear_slots=(2, v)), IRValidationError, rf"MambaInit\.clear_slots: .*{got}", field="clear_slots"),
        Case(f"{kind}-cow-src", _init(cow_src=(v,), cow_dst=(2,)), IRValidationError, rf"MambaInit\.cow_src: .*{got}", field="cow_src"),
        # allocator arguments: SlotError naming the call, the argument and the value
        Case(f"{kind}-capacity", _untyped(lambda w, ctx: SlotAllocator(v)), SlotError, rf"SlotAllocator\(capacity\): .*{got}"),
        Case(f"{kind}-kv-capacity", _untyped(lambda w, ctx: KVAllocator(v)), SlotError, rf"KVAllocator\(capacity\): .*{got}"),
        Case(f"{kind}-free", _untyped(lambda w, ctx: w.slots.free(v)), SlotError, rf"SlotAllocator\.free\(index\): .*{got}"),
        Case(f"{kind}-alloc-many", _untyped(lambda w, ctx: w.kv.alloc_many(v)), SlotError, rf"KVAllocator\.alloc_many\(n\): .*{got}"),
        # slot 1 is live: all or nothing, so it must still be live afterwards
        Case(f"{kind}-free-many", _untyped(lambda w, ctx: w.slots.free_many([1, v])), SlotError, rf"SlotAllocator\.free_many\(indices\): .*{got}"),
        Case(f"{kind}-check-live", _untyped(lambda w, ctx: w.slots.check_live([1, v], "a plan")), SlotError, rf"SlotAllocator\.check_live\(indices\): .*{got}"),
        Case(f"{kind}-is-live", _untyped(lambda w, ctx: w.kv.is_live(v)), SlotError, rf"KVAllocator\.is_live\(index\): .*{got}"),
    ]
    rows += [
        Case(f"{kind}-init-serial", _build(lambda: MambaInit(serial=v, clear_slots=(2,))), IRValidationError, rf"MambaInit\.serial: .*{got}", field="serial"),
        Case(
            f"{kind}-snapshot-serial",
            _build(lambda: MambaSnapshot(serial=v, src=(2,), dst=(4,))),
            IRValidationError,
            rf"MambaSnapshot\.serial: .*{got}",
            field="serial",
        ),
    ]
    rows.append(  # (None too: a COW always has a source)
        Case(
            f"{kind}-copy-from-src",
            _build(lambda: CopyFrom(src=v, prefix_len=3)),
            IRValidationError,
            rf"CopyFrom\.src: .*{got}",
            field="src",
        )
    )
    return rows


COERCION_CASES: list[Case] = [case for kind, v in BAD_INTS for case in _coercion_cases(kind, v)] + [
    # arrays of the wrong kind given to int columns
    Case("bool-array-column", _tokens(np.array([True, False])), IRValidationError, r"AdmittedRequest\.input_ids: .*got dtype bool", field="input_ids"),
    Case(
        "uint64-array-above-int64",
        _tokens(np.array([5, 2**63], dtype=np.uint64)),
        IRValidationError,
        rf"AdmittedRequest\.input_ids: .*within int64.*{_got(2**63)}",
        field="input_ids",
    ),
    Case("object-array-column", _tokens(np.array([5, 6], dtype=object)), IRValidationError, r"AdmittedRequest\.input_ids: .*dtype object", field="input_ids"),
    Case("none-as-column", _tokens(None), IRValidationError, rf"AdmittedRequest\.input_ids: .*{_got(None)}", field="input_ids"),
    Case("int-as-column", _tokens(5), IRValidationError, rf"AdmittedRequest\.input_ids: .*{_got(5)}", field="input_ids"),
    Case("float-in-bool-column", _build(lambda: ExtendBatch(
        rids=[1], slots=[2], prefix_lens=[0], extend_lens=[1], more_chunks=[0.0], intents=(InitIntent.CLEAR,),
        input_ids=[5], kv_locs=[10], init=MambaInit(serial=mint_serial(), clear_slots=(2,)),
    )), IRValidationError, rf"ExtendBatch\.more_chunks: .*{_got(0.0)}", field="more_chunks"),
    Case("int-more-chunks", _admitted(more_chunks=1), IRValidationError, rf"AdmittedRequest\.more_chunks: .*{_got(1)}", field="more_chunks"),
    Case("str-intent", _admitted(intent="clear"), IRValidationError, rf"AdmittedRequest\.intent: .*{_got('clear')}", field="intent"),
    Case("str-as-slot-tuple", _init(clear_slots="12"), IRValidationError, r"MambaInit\.clear_slots: .*'12'", field="clear_slots"),
    Case("free-many-str", _untyped(lambda w, ctx: w.slots.free_many("12")), SlotError, r"SlotAllocator\.free_many\(indices\): must be an iterable of slots \(got '12'\)"),
    Case("check-live-none", _untyped(lambda w, ctx: w.slots.check_live(None, "a plan")), SlotError, r"check_live\(indices\): .*\(got None\)"),
    Case("float-array-free-many", _untyped(lambda w, ctx: w.slots.free_many(np.array([1.0]))), SlotError, r"free_many\(indices\): must be an int, not float64"),
]
CASES += COERCION_CASES

def _pattern(case: Case, ctx: Ctx) -> str:
    pattern = case.match
    for name, value in ctx.items():
        pattern = pattern.replace(f"<{name}>", re.escape(str(value)))
    assert "<" not in pattern, f"unfilled placeholder in {case.match!r}"
    return pattern


def test_table_is_large_and_ids_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 24


PARAMS = [
    pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [])
    for c in CASES
]


@pytest.mark.parametrize("case", PARAMS)
def test_bad_input_is_refused_and_changes_nothing(case: Case) -> None:
    w = make_world(pool_id=case.pool_id)
    ctx = (case.setup or _no_setup)(w)
    before = w.state()
    with pytest.raises(case.error, match=_pattern(case, ctx)) as info:
        case.act(w, ctx)
    assert type(info.value) is case.error, f"expected exactly {case.error.__name__}, got {type(info.value).__name__}"
    if case.field is not None:
        assert isinstance(info.value, IRValidationError)
        assert info.value.field == case.field
    after = w.state()
    assert torch.equal(before[0], after[0]), "pool bytes changed"
    assert before[1:3] == after[1:3], "ledger changed"
    assert before[3:] == after[3:], "allocator state changed"


# -- a few refusals whose "changes nothing" needs more than the world snapshot -----------------------


def test_replay_keeps_live_state_and_counts_block() -> None:
    """A replayed clear must not re-zero the live state written after the first run."""
    w = make_world()
    ctx = _executed_clear_plan(w)
    row = w.pool.buffer[2].clone()
    for attempt in (_execute, _execute_deepcopy, _execute_pickled):
        with pytest.raises(ResourceReplayError):
            attempt(w, ctx)
    assert torch.equal(w.pool.buffer[2], row)
    assert w.ledger.replays_blocked == 3
    assert w.ledger.counts(TARGET_POOL).tickets == 1
    w.ledger.assert_drained()


def test_wrong_pool_executor_leaves_ticket_for_the_right_pool() -> None:
    """The refused draft executor must not eat the target's ticket: the target still runs it."""
    target = make_world(pool_id=TARGET_POOL, seed=1)
    draft = make_world(pool_id=DRAFT_POOL, seed=2)
    draft_exec = Executor(draft.pool, target.ledger)
    _, plan = extend_plan([request(1, 2, [5, 6], 10)], ledger=target.ledger)
    with pytest.raises(PlanExecutionError):
        draft_exec.execute(plan)
    assert target.ledger.outstanding() == plan.tickets
    target.executor.execute(plan)
    assert torch.count_nonzero(target.pool.buffer[2]) == 0
    target.ledger.assert_drained()


def test_failed_pipeline_step_registers_nothing() -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, pm=PassManager(verify_level=2))
    with pytest.raises(PassError) as info:
        pipe.mixed(
            [request(1, 2, [5, 6], 10)],
            decode_batch([5], [2], [4], [20]),
            DecodeContext(next_tokens=[3], kv_locs=[30]),
        )
    assert isinstance(info.value.error, PreconditionError)
    assert isinstance(info.value.__cause__, PreconditionError)
    assert ledger.outstanding() == ()


def test_caller_mutation_cannot_reach_a_node() -> None:
    """The converter copies: mutating the caller's list or array later changes nothing in the node."""
    tokens = [5, 6]
    arr = np.array([10, 11], dtype=np.int64)
    r = AdmittedRequest(rid=RequestId(1), slot=MambaSlot(2), input_ids=tokens, kv_locs=arr, intent=Clear())
    tokens[0] = 99
    arr[0] = 99
    assert r.input_ids.tolist() == [5, 6]
    assert r.kv_locs.tolist() == [10, 11]
    with pytest.raises(ValueError, match="read-only"):
        r.input_ids[0] = 1


def test_decode_plan_has_no_tickets() -> None:
    plan = lower(decode_batch([1], [1], [4], [20]), LowerContext(pools=(TARGET_POOL, DRAFT_POOL)))
    assert isinstance(plan, DecodePlan)
    assert "tickets" not in attrs.fields_dict(DecodePlan)


# -- the serving engine at k = 0: admission refusals and a step short of slots -------------------


def _engine(capacity: int = 2, seed: int = 5) -> Engine:
    """The engine at k = 0 on the tiny target, its target pool filled with random bytes (so a slot
    that is not cleared on first use shows in its state)."""
    e = Engine(_tiny_target(), None, k=0, capacity=capacity, kv_capacity=64, max_len=16, chunk_size=4)
    random_fill(e.target.pool, seed)
    return e


def _holdings(e: Engine) -> tuple[object, ...]:
    return (e.live, e.slots.live(), e.kv.live(), e.kv_refs.held(), e.requests.queued)


def test_engine_admit_refuses_a_reused_id_a_prompt_not_extending_its_checkpoint_and_no_new_tokens() -> None:
    e = _engine(capacity=3)
    cp = e.make_prefix([1, 2, 3])
    e.admit(RequestId(1), [1, 2, 3, 4], max_new_tokens=1, prefix=cp)
    before = _holdings(e)
    with pytest.raises(PreconditionError, match="request id 1 is already in use"):
        e.admit(RequestId(1), [4], max_new_tokens=1)
    with pytest.raises(PreconditionError, match="prompt does not extend the prefix state's 3 tokens"):
        e.admit(RequestId(2), [1, 2, 3], max_new_tokens=1, prefix=cp)  # the whole prompt is the prefix
    with pytest.raises(PreconditionError, match="prompt does not extend the prefix state's 3 tokens"):
        e.admit(RequestId(2), [1, 2, 4, 5], max_new_tokens=1, prefix=cp)
    with pytest.raises(PreconditionError, match="max_new_tokens must be >= 1, got 0"):
        e.admit(RequestId(2), [1, 2, 3], max_new_tokens=0)
    assert _holdings(e) == before and e.live == 1


@pytest.mark.parametrize("prompt", [[1.5, 2.7], ["7", "8"]], ids=["floats", "digit-strings"])
def test_engine_admit_refuses_non_integer_tokens(prompt: list[object]) -> None:
    e = _engine()
    before = _holdings(e)
    # the test suite's typeguard would refuse this call at the signature; production runs without it
    with suppress_type_checks():
        with pytest.raises((PreconditionError, IRValidationError), match=re.escape(repr(prompt[0]))):
            e.admit(RequestId(1), prompt, max_new_tokens=1)  # type: ignore[arg-type]
    assert _holdings(e) == before and e.live == 0


def test_engine_admit_refuses_a_negative_token() -> None:
    e = _engine()
    before = _holdings(e)
    with pytest.raises((PreconditionError, IRValidationError), match="-2"):
        e.admit(RequestId(1), [1, -2], max_new_tokens=1)
    assert _holdings(e) == before and e.live == 0


def test_engine_step_short_of_slots_defers_a_request_and_takes_nothing_for_it() -> None:
    e, other = _engine(capacity=2, seed=5), _engine(capacity=2, seed=6)  # different stale bytes
    for engine in (e, other):
        for rid in range(3):
            engine.admit(RequestId(rid), [1, 2, 3], max_new_tokens=2)
        report = engine.step()
        assert report.kind is StepKind.EXTEND and report.requests == 2
    # two slots, three requests: the third waits, holding no slot and no KV location
    assert sorted(e.live_slots()) == [0, 1] and e.slots.num_free == 0
    waiting = e.requests[RequestId(2)]
    assert waiting.state is RequestState.WAITING and waiting.slot is None and waiting.context == []
    assert e.kv.num_live == 6 and e.requests.queued == [RequestId(2)]
    # the two that ran started from a cleared state: the stale bytes they found left no trace
    assert e.ledger.counts(TARGET_POOL).clears == 2
    for rid, slot in e.live_slots().items():
        assert other.live_slots()[rid] == slot
        assert torch.equal(e.target.pool.buffer[slot], other.target.pool.buffer[slot]), f"request {rid} saw stale bytes"
    e.run_until_done()
    assert sorted(e.outputs) == [0, 1, 2] and all(len(out) == 2 for out in e.outputs.values())
    assert e.slots.num_live == 0 and e.kv.num_live == 0
    e.ledger.assert_drained()


# -- Engine.admit: every argument checked before anything changes --------------------------------


@functools.cache
def _tiny_target() -> HybridModel:
    return HybridModel.from_seed(tiny(), seed=0)


ADMIT_PREFIX = list(b"You are terse.\n")


@attrs.define
class AdmitWorld:
    """A ``Engine`` (tiny target, prefix cache) holding a prefix, with two requests that have
    run their prefill (so they hold slots and KV references) and one waiting."""

    driver: Engine
    prefix: PrefixState


def _admit_world() -> AdmitWorld:
    drv = Engine(_tiny_target(), None, k=0, capacity=5, kv_capacity=128, max_len=64, prefix_cache=PrefixCache(capacity=2, block=8))
    cp = drv.make_prefix(ADMIT_PREFIX)
    drv.admit(RequestId(1), ADMIT_PREFIX + list(b"hi"), max_new_tokens=4, prefix=cp)
    drv.admit(RequestId(2), list(b"def f(x):"), max_new_tokens=4)
    assert drv.step().kind.value == "extend"
    drv.admit(RequestId(3), list(b"abc"), max_new_tokens=4)
    return AdmitWorld(driver=drv, prefix=cp)


def _admit_state(w: AdmitWorld) -> tuple[torch.Tensor, tuple[object, ...]]:
    drv = w.driver
    cache_ = drv.cache
    assert cache_ is not None
    return drv.target.pool.buffer.clone(), (
        drv.ledger.outstanding(), drv.ledger.num_consumed,
        drv.slots.num_free, drv.slots.live(), drv.kv.num_free, drv.kv.live(),
        dict(drv.kv_refs.held()), tuple(drv.requests.queued), {q.rid: (q.slot, q.done, list(q.context)) for q in drv.requests},
        drv.live, drv.live_slots(), {r: list(o) for r, o in drv.outputs.items()},
        tuple(attrs.asdict(e) for e in cache_.entries()), cache_.observed(),  # cache bookkeeping
    )


@attrs.frozen
class AdmitCase:
    id: str
    kwargs: Callable[[AdmitWorld], dict[str, Any]]
    """``admit``'s arguments, built from the world (so a row can forge a prefix from a live one)."""
    error: type[BaseException]
    match: str
    field: str | None = None


def _args(rid: object = 9, prompt: object = (5, 6, 7), **kw: object) -> Callable[[AdmitWorld], dict[str, Any]]:
    def build(w: AdmitWorld) -> dict[str, Any]:
        return {"rid": rid, "prompt": list(prompt) if isinstance(prompt, tuple) else prompt, "max_new_tokens": 2, **kw}

    return build


def _with_checkpoint(**changes: object) -> Callable[[AdmitWorld], dict[str, Any]]:
    """A prefix argument: the world's live one with ``changes`` (a forged or malformed one)."""

    def build(w: AdmitWorld) -> dict[str, Any]:
        cp = attrs.evolve(w.prefix, **changes)
        return {"rid": 9, "prompt": ADMIT_PREFIX + [1, 2], "max_new_tokens": 2, "prefix": cp}

    return build


def _live_request_slot(w: AdmitWorld) -> dict[str, Any]:
    slot = w.driver.live_slots()[RequestId(2)]
    return _with_checkpoint(slot=slot)(w)


def _admit_cases(kind: str, v: object) -> list[AdmitCase]:
    got = _got(v)
    rows = [
        AdmitCase(f"admit-{kind}-rid", _args(rid=v), PreconditionError, rf"admit: rid .*{got}"),
        AdmitCase(f"admit-{kind}-max-new-tokens", _args(max_new_tokens=v), PreconditionError, rf"admit: request 9: max_new_tokens .*{got}"),
        AdmitCase(f"admit-{kind}-prompt-token", _args(prompt=(5, v)), IRValidationError, rf"request 9\.prompt: .*{got}", field="prompt"),
        AdmitCase(f"admit-{kind}-prefix-slot", _with_checkpoint(slot=v), PreconditionError, rf"admit: request 9: prefix slot .*{got}"),
        AdmitCase(
            f"admit-{kind}-prefix-token",
            _with_checkpoint(tokens=(*ADMIT_PREFIX[:-1], v)),
            PreconditionError,
            rf"admit: request 9: every prefix tokens entry .*{got}",
        ),
    ]
    if v is not None:  # None is a valid "no stop token" and "no prefix"
        rows += [
            AdmitCase(f"admit-{kind}-stop", _args(stop=v), PreconditionError, rf"admit: request 9: stop .*{re.escape(repr(v))}"),
            AdmitCase(f"admit-{kind}-as-prefix", _args(prefix=v), PreconditionError, rf"admit: request 9: prefix must be a PrefixState.*{re.escape(repr(v))}"),
        ]
    return rows


ADMIT_CASES: list[AdmitCase] = [c for kind, v in BAD_INTS for c in _admit_cases(kind, v)] + [
    AdmitCase("admit-stop-past-vocab", _args(stop=256), PreconditionError, r"stop must be a token id in \[0, 256\), got 256"),
    AdmitCase("admit-negative-stop", _args(stop=-1), PreconditionError, r"stop must be a token id in \[0, 256\), got -1"),
    AdmitCase("admit-none-prompt", _args(prompt=None), IRValidationError, rf"request 9\.prompt: .*{_got(None)}", field="prompt"),
    AdmitCase("admit-bool-array-prompt", _args(prompt=np.array([True, False])), IRValidationError, r"request 9\.prompt: must be a 1-D sequence of int token ids", field="prompt"),
    AdmitCase("admit-rid-list", _args(rid=[9]), PreconditionError, r"admit: rid must be an int, not list \(got \[9\]\)"),
    AdmitCase("admit-slot-as-prefix", _args(prefix=MambaSlot(4)), PreconditionError, r"prefix must be a PrefixState \(from make_prefix\), got 4"),
    AdmitCase("admit-prefix-of-live-request", _live_request_slot, PreconditionError, r"prefix slot \d+ is a slot of live request 2"),
    AdmitCase("admit-prefix-kv-not-held", _with_checkpoint(kv_locs=tuple(range(100, 115))), PreconditionError, r"prefix KV location 100 is not held"),
    AdmitCase("admit-prefix-lengths", _with_checkpoint(kv_locs=(1, 2)), PreconditionError, r"prefix has 2 KV locations for 15 tokens"),
    AdmitCase("admit-prefix-tokens-list", _with_checkpoint(tokens=list(ADMIT_PREFIX)), PreconditionError, r"prefix tokens must be a tuple of ints"),
]


@pytest.mark.parametrize("case", ADMIT_CASES, ids=[c.id for c in ADMIT_CASES])
def test_spec_driver_admit_refuses_before_changing_anything(case: AdmitCase) -> None:
    w = _admit_world()
    kwargs = case.kwargs(w)
    before = _admit_state(w)
    with suppress_type_checks():  # production runs without typeguard: admit's own checks must hold
        with pytest.raises(case.error, match=case.match) as info:
            w.driver.admit(kwargs.pop("rid"), kwargs.pop("prompt"), **kwargs)
    assert type(info.value) is case.error, f"expected exactly {case.error.__name__}, got {type(info.value).__name__}"
    if case.field is not None:
        assert isinstance(info.value, IRValidationError) and info.value.field == case.field
    after = _admit_state(w)
    assert torch.equal(before[0], after[0]), "pool bytes changed"
    assert before[1] == after[1], "driver, allocators, ledger or prefix cache changed"
    # the refused admission left a driver that still serves its requests
    w.driver.run_until_done()
    assert set(w.driver.outputs) == {RequestId(1), RequestId(2), RequestId(3)}


def test_admit_tables_cover_every_bad_value() -> None:
    ids = [c.id for c in ADMIT_CASES] + [c.id for c in COERCION_CASES]
    assert len(ids) == len(set(ids))
    for kind, _ in BAD_INTS:
        assert sum(i.startswith(f"{kind}-") or i.startswith(f"admit-{kind}-") for i in ids) >= 20, kind


# -- the lower bounds are inclusive ---------------------------------------------------------------


def test_smallest_legal_values_are_accepted() -> None:
    """Token id 0, KV location 0 and a sequence length of 1 are legal in every windowed node."""
    d = spec.DraftBatch(k=1, draft_id=mint_draft_id(), rids=[1], slots=[1], seq_lens=[1], input_ids=[0], kv_locs=[0, 1])
    assert d.seq_lens.tolist() == [1] and d.input_ids.tolist() == [0] and d.kv_locs.tolist() == [0, 1]
    v = spec.VerifyBatch(k=1, verify_id=mint_verify_id(), draft_id=mint_draft_id(), rids=[1], slots=[1], seq_lens=[1], input_ids=[0, 0], kv_locs=[0, 1])
    assert v.input_ids.tolist() == [0, 0] and v.kv_locs.tolist() == [0, 1]
    r = spec.AcceptResult(verify_id=v.verify_id, rids=[1], accepted=[0], bonus=[0])
    assert r.bonus.tolist() == [0]


# -- numpy integer scalars stay accepted -------------------------------------------------------------


@pytest.mark.parametrize("np_int", [np.int64, np.int32, np.uint8], ids=lambda t: t.__name__)
def test_numpy_integer_scalars_are_accepted(np_int: Callable[[int], object]) -> None:
    w = make_world()
    with suppress_type_checks():  # typeguard holds the annotations to plain int; the library takes numpy ints
        r = AdmittedRequest(rid=np_int(1), slot=np_int(2), input_ids=[np_int(5), 6], kv_locs=np.array([10, 11], dtype=np.int32), intent=Clear())
        assert r.input_ids.tolist() == [5, 6] and r.input_ids.dtype == np.int64
        assert MambaInit(serial=mint_serial(), clear_slots=(np_int(2),)).clear_slots == (2,)
        assert spec.DraftBatch(k=np_int(1), draft_id=np_int(1), rids=[1], slots=[1], seq_lens=[5], input_ids=[3], kv_locs=[30, 31]).num_requests == 1
        assert w.slots.is_live(np_int(1))
        w.slots.free(np_int(1))
        w.slots.free_many([np_int(2)])
        w.slots.check_live(np.array([3], dtype=np.int32), "a plan")
        assert w.kv.alloc_many(np_int(2)).tolist() == [1, 2]
        assert SlotAllocator(np_int(3)).capacity == 3
        adw = _admit_world()
        adw.driver.admit(np_int(9), [np_int(5), 6], max_new_tokens=np_int(2), stop=np_int(7))
    assert all(type(r.rid) is int for r in adw.driver.requests)  # ids are stored as Python ints
    assert RequestId(9) in adw.driver.requests
    assert w.slots.live() == frozenset({3}) and w.kv.live() == frozenset({1, 2})


# -- lengths are bounded, so no sum a pass forms wraps around int64 ----------------------------------


def _extend_cols(cls: type, extend_lens: list[int]) -> dict[str, Any]:
    n = len(extend_lens)
    cols: dict[str, Any] = {"rids": list(range(1, n + 1)), "slots": list(range(2, n + 2)), "prefix_lens": [0] * n,
                            "extend_lens": extend_lens, "input_ids": [], "kv_locs": []}
    if cls is ExtendBatch:
        cols.update(more_chunks=[False] * n, intents=(InitIntent.CLEAR,) * n,
                    init=MambaInit(serial=mint_serial(), clear_slots=tuple(range(2, n + 2))))
    return cols


def test_extend_lengths_whose_sum_would_wrap_are_refused() -> None:
    # 4 x 2**62 sums to 0 in int64: without the bound the node had no tokens and filter_batch's
    # np.repeat crashed the interpreter
    from passes.filter_batch import filter_batch  # noqa: F401 - the pass the wrapped node used to crash

    for cls in (ExtendBatch, spec.DraftExtendBatch):
        with pytest.raises(IRValidationError, match=rf"^{cls.__name__}\.extend_lens: every value must be <= MAX_SEQ_LEN \(2\*\*31 - 1\) \(got 4611686018427387904\)"):
            cls(**_extend_cols(cls, [2**62] * 4))
    with pytest.raises(IRValidationError, match=r"^DraftExtendBatch\.prefix_lens: every value must be <= MAX_SEQ_LEN - extend_lens \(got 2147483647\)"):
        spec.DraftExtendBatch(**{**_extend_cols(spec.DraftExtendBatch, [1]), "prefix_lens": [2**31 - 1], "input_ids": [5], "kv_locs": [7]})


def test_sequences_at_the_length_bound_cannot_grow() -> None:
    top = 2**31 - 1
    with pytest.raises(IRValidationError, match=r"^DecodeBatch\.seq_lens: every value must be <= MAX_SEQ_LEN"):
        DecodeBatch(rids=[1], slots=[1], seq_lens=[top + 1], input_ids=[3], kv_locs=[4])
    full = DecodeBatch(rids=[1], slots=[1], seq_lens=[top], input_ids=[3], kv_locs=[4])
    with pytest.raises(PreconditionError, match=r"^prepare_for_decode: a sequence of 2147483647 tokens cannot grow"):
        prepare_for_decode(full, DecodeContext(next_tokens=[5], kv_locs=[6]))
    from passes.prepare_for_draft import prepare_for_draft

    with pytest.raises(PreconditionError, match=r"^prepare_for_draft: a sequence of 2147483647 tokens has no room for k \+ 1 = 3"):
        prepare_for_draft(full, SpecContext(k=2, next_tokens=[5], kv_locs=[6, 7, 8]))
    with pytest.raises(IRValidationError, match=r"^AdmittedRequest\.prefix_len: prefix_len \+ len\(input_ids\) must be <= MAX_SEQ_LEN"):
        AdmittedRequest(rid=RequestId(1), slot=MambaSlot(1), input_ids=[1], kv_locs=[2], intent=Continue(prefix_len=top))
