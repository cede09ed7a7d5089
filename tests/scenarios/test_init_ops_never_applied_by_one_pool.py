"""A backend that never applies the deferred copy-on-write (SGLang PR #32450,
https://github.com/sgl-project/sglang/pull/32450).

Upstream: a slot's Mamba init (the copy from a cached prefix, or the clear) was deferred to the
forward, and one backend path ran the model without ever applying it: the request went on from
whatever the slot held, and nothing noticed.

batchc: a slot's init is a ticket registered in the ledger when the plan is lowered, one per pool,
and an executor claims the plan's tickets together with its rows (``Ledger.claiming`` runs
``Ledger.check_rows``): a registered ticket over one of the rows that the plan's claim does not carry
refuses the plan, naming the slot, the pool and the ticket, before the pool moves; a plan without
tickets (a decode) over that row is refused the same way (``Ledger.rows_free``). The scenario's
backend is an ``Executor`` subclass that runs the model but drops its pool's tickets before the
claim (as if it never applied them):

- IR, the tiny target and its draft, two pools, one ledger: the target's executor runs the prefill
  (a clear and a copy from a cached prefix); the draft's skipping executor is refused, naming the
  ticket and the pool, its pool untouched; a decode on the draft over those rows is refused; an
  honest executor over the same draft pool then runs the very plan, and serving goes on to tokens
  equal to the reference run, each pool's rows equal to a from-scratch prefill of the tokens fed;
- engine at ``k = 2`` whose draft executor skips its tickets: the engine stops at the first prefill
  (``Engine.stopped_by`` the ``TicketMismatchError`` naming the draft's ticket and slot); the draft
  ran no plan at all (no decode, no draft on that slot); the only outstanding ticket is that one, and
  once it is cancelled (recorded) and the request's slot freed the books balance.

Immune: no fix was needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from backend.executor import Executor
from backend.ledger import Ledger
from compiler.engine import Engine
from compiler.manager import PassManager
from compiler.steps import Pipeline
from ir.batch import DecodeBatch
from ir.errors import TicketMismatchError
from ir.ids import DRAFT_POOL, TARGET_POOL, PoolId, RequestId
from ir.init import MambaInit, Ticket
from ir.plan import ExtendPlan
from passes import DecodeContext, LowerContext
from tests.helpers import cow, fresh, tiny_models
from tests.scenarios.state_checks import (
    Recorder,
    assert_accounted,
    assert_states_match,
    reference_outputs,
    scratch_states,
    stale_fill,
    state_rows,
)

PREFIX = list(b"You are terse.\n")  # 15 tokens: the cached prefix (slot CACHE on each pool)
BODY = list(b"def add(a, b):")
OTHER = list(b"x = [1, 2, 3]")
CACHE, SLOT_COPY, SLOT_FRESH = 4, 1, 2


class SkipsInitOps(Executor[Any]):
    """Runs the model but never applies its pool's init ops: drops the plan's tickets for this pool
    before the claim (the backend of the upstream bug)."""

    def _own_tickets(self, plan: Any, own: frozenset[int]) -> list[Ticket[Any]]:
        return []


class _TwoPools:
    def __init__(self) -> None:
        self.ledger = Ledger()
        self.models = dict(zip((TARGET_POOL, DRAFT_POOL), tiny_models(), strict=True))
        self.pools = {}
        self.hooks = {}
        for i, (pool_id, model) in enumerate(self.models.items()):
            self.pools[pool_id] = model.new_pool(5, pool_id=PoolId(pool_id))
            stale_fill(self.pools[pool_id], seed=10 + i)
            self.hooks[pool_id] = model.serving_hook(capacity=5, kv_capacity=256, max_len=96)
        self.target = Executor(self.pools[TARGET_POOL], self.ledger, self.hooks[TARGET_POOL])
        self.pipeline = Pipeline(self.ledger, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)), PassManager(verify_level=2))
        self._kv = 1

    def kv(self, n: int) -> int:
        start = self._kv
        self._kv += n
        return start


def test_an_executor_that_skips_its_pools_init_ops_is_refused_naming_the_ticket_and_the_pool() -> None:
    w = _TwoPools()
    honest_draft = Executor(w.pools[DRAFT_POOL], w.ledger, w.hooks[DRAFT_POOL])
    # the cached prefix on each pool, from a cleared slot
    _, entry = w.pipeline.prefill([fresh(100, CACHE, PREFIX, w.kv(len(PREFIX)))])
    w.target.execute(entry)
    honest_draft.execute(entry)
    for pool_id in (TARGET_POOL, DRAFT_POOL):
        w.hooks[pool_id].share_prefix(CACHE, SLOT_COPY, len(PREFIX))
    # the served prefill: a copy from the cache into SLOT_COPY, a clear of SLOT_FRESH
    batch, plan = w.pipeline.prefill([cow(1, SLOT_COPY, CACHE, len(PREFIX), BODY, w.kv(len(BODY))), fresh(2, SLOT_FRESH, OTHER, w.kv(len(OTHER)))])
    draft_ticket = next(t for t in plan.tickets if t.pool == DRAFT_POOL)
    assert isinstance(draft_ticket.op, MambaInit) and draft_ticket.op.cow_dst == (SLOT_COPY,) and draft_ticket.op.clear_slots == (SLOT_FRESH,)
    sampled = w.target.execute(plan)  # the target applies its own ticket

    skipping = SkipsInitOps(w.pools[DRAFT_POOL], w.ledger, w.hooks[DRAFT_POOL])
    before = w.pools[DRAFT_POOL].buffer.clone()
    with pytest.raises(
        TicketMismatchError,
        match=rf"^ExtendPlan over slot {SLOT_COPY} of pool 'draft' does not carry ticket #{draft_ticket.op.serial} for pool 'draft' "
        rf"\(ops clear \[{SLOT_FRESH}\], cow \[{CACHE}->{SLOT_COPY}\]\), which must run on that row first",
    ):
        skipping.execute(plan)
    assert torch.equal(w.pools[DRAFT_POOL].buffer, before)  # the model never ran on the un-initialised rows
    assert w.ledger.outstanding() == (draft_ticket,)
    # no decode on those rows either, until the init runs
    running = w.pipeline.merge(DecodeBatch.empty(), batch)
    tokens = {rid: [tok] for rid, tok in zip(sampled.rids.tolist(), sampled.tokens.tolist(), strict=True)}
    _, decode = w.pipeline.decode(running, DecodeContext(next_tokens=[tokens[r][-1] for r in running.rid_list()], kv_locs=[w.kv(1), w.kv(1)]))
    with pytest.raises(TicketMismatchError, match=rf"^DecodePlan over slot {SLOT_COPY} of pool 'draft' does not carry ticket #{draft_ticket.op.serial}"):
        skipping.execute(decode)
    with pytest.raises(TicketMismatchError, match=rf"^check over slot {SLOT_FRESH} of pool 'draft'"):
        w.ledger.rows_free([SLOT_FRESH], DRAFT_POOL, "check")
    assert torch.equal(w.pools[DRAFT_POOL].buffer, before)

    # an honest executor over the draft pool runs the very plan, then the decode, on both pools
    honest_draft.execute(plan)
    assert_states_match(state_rows(w.pools[DRAFT_POOL], SLOT_COPY), scratch_states(PREFIX + BODY, draft=True), "draft: the copied slot")
    assert_states_match(state_rows(w.pools[DRAFT_POOL], SLOT_FRESH), scratch_states(OTHER, draft=True), "draft: the cleared slot")
    honest_draft.execute(decode)
    res = w.target.execute(decode)
    for rid, tok in zip(res.rids.tolist(), res.tokens.tolist(), strict=True):
        tokens[rid].append(tok)
    prompts = {1: PREFIX + BODY, 2: OTHER}
    assert tokens == {rid: reference_outputs(prompts[rid], 2) for rid in tokens}
    slots = {1: SLOT_COPY, 2: SLOT_FRESH}
    for rid, toks in tokens.items():
        fed = prompts[rid] + toks[:-1]
        assert_states_match(state_rows(w.pools[TARGET_POOL], slots[rid]), scratch_states(fed), f"target: request {rid}")
        assert_states_match(state_rows(w.pools[DRAFT_POOL], slots[rid]), scratch_states(fed, draft=True), f"draft: request {rid}")
    w.ledger.assert_drained()
    assert w.ledger.cancelled() == {}


def test_through_the_engine_a_draft_backend_skipping_its_init_stops_the_engine_before_any_decode() -> None:
    target, draft = tiny_models()
    e = Engine(target, draft, k=2, capacity=3)
    assert e.draft is not None
    e.draft.__class__ = SkipsInitOps  # the engine's own draft executor, its init ops now skipped
    rec_t, rec_d = Recorder(e.target), Recorder(e.draft)
    e.admit(RequestId(0), list(b"def f(x):"), max_new_tokens=4)
    with pytest.raises(TicketMismatchError, match=r"^ExtendPlan over slot (\d+) of pool 'draft' does not carry ticket #\d+ for pool 'draft' \(ops clear \[\1\], cow \[\]\)"):
        e.run_until_done()
    assert isinstance(e.stopped_by, TicketMismatchError)
    assert rec_d.ran == []  # the draft never ran a plan: no decode, no draft on the un-initialised slot
    (stuck,) = e.ledger.outstanding()
    assert stuck.pool == DRAFT_POOL
    assert isinstance(stuck.op, MambaInit)
    slot = stuck.op.clear_slots[0]
    # nothing ran on the target over that slot after its prefill (the step stopped there)
    assert all(isinstance(r.plan, ExtendPlan) for r in rec_t.ran)
    assert slot in np.concatenate([r.plan.slots for r in rec_t.ran]).tolist()
    # the books: only that ticket is outstanding; cancelled (recorded) and the slot freed, they balance
    e.ledger.cancel(stuck, "the draft backend skipped its init: the engine stopped")
    e.slots.free(slot)
    e.requests.remove(RequestId(0))
    assert_accounted(e)
    assert list(e.ledger.cancelled().values()) == ["the draft backend skipped its init: the engine stopped"]
    e.close()
