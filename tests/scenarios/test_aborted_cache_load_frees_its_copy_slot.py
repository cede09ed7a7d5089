"""A prefix-cache load that aborts after its copy slot was allocated (SGLang PR #30986,
https://github.com/sgl-project/sglang/pull/30986).

Upstream: a request hitting the prefix cache was given a Mamba slot for the copy of the cached state;
when the load failed (or the request was aborted) between that allocation and its first forward,
the slot, the cache entry's lock and the pending copy leaked, and the slot's next owner could start
from the half-loaded row.

batchc: the copy is an op of the forward that starts the request, carried as a ticket; a fault in
it leaves the ticket outstanding (never half: ``backend.faults``), the engine aborts the request
(no retries), cancels the ticket with a recorded reason, unpins the entry and frees the slot; the
slot's next owner is lowered with a clear of its own, which runs before its forward. The scenario:

- IR, the tiny target: a copy from a cached prefix whose init launch fails after writing the row;
  the ticket is still outstanding (not consumed), withdrawn (cancelled, recorded); the slot's next
  owner (a fresh request) is cleared and its state equals a from-scratch prefill;
- engine, prefix cache on, ``k = 0``: the fault fires on the forward that copies the cache hit;
  the request is aborted, its ticket cancelled, the entry's pins back to 0, the slot free; the
  slot's next owner starts from a cleared row (its state after its prefill equals a from-scratch
  prefill), a later hit on the same entry is served; outputs equal the reference run;
- engine: ``Engine.abort`` between admission and the first step, and between two chunks of a
  prompt: the books balance at once, and the slot's next owner is served from a cleared row.

Every ledger drained (or its cancellations recorded), every slot live or free, live == 0 at the end.
The engine scenario with the cache hits runs on the tiny target and on the state-sensitive one
(``state_checks.MODELS``), on which the later hit's tokens would change had its copy left a zeroed
(half-loaded, cleared) row (``assert_tokens_need_state``). Immune: no fix was needed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backend import faults
from compiler.engine import Engine
from compiler.prefix_cache import PrefixCache
from ir.ids import RequestId
from ir.init import MambaInit
from ir.plan import ExtendPlan, MixedPlan
from ir.results import Result
from tests.helpers import cow, fresh, tiny_models
from tests.scenarios.state_checks import (
    MODELS,
    Recorder,
    TinyWorld,
    assert_accounted,
    assert_states_match,
    assert_tokens_need_state,
    distance,
    reference_outputs,
    scratch_states,
    state_rows,
)

PREFIX = list(b"You are terse.\n")
BODY = list(b"def add(a, b):")
OTHER = list(b"x = [1, 2, 3]")
CACHE, SLOT = 5, 1


def test_a_failed_copy_leaves_its_ticket_outstanding_and_the_slots_next_owner_is_cleared() -> None:
    w = TinyWorld()
    _, entry = w.pipeline.prefill([fresh(100, CACHE, PREFIX, w.kv(len(PREFIX)))])
    w.executor.execute(entry)
    w.hook.share_prefix(CACHE, SLOT, len(PREFIX))
    batch, plan = w.pipeline.prefill([cow(1, SLOT, CACHE, len(PREFIX), BODY, w.kv(len(BODY)))])
    before = w.pool.buffer.clone()
    with faults.armed(faults.FaultPoint.INIT_LAUNCH) as fired, pytest.raises(faults.InjectedFault):
        w.executor.execute(plan)
    assert fired == {faults.FaultPoint.INIT_LAUNCH: 1}
    assert w.ledger.outstanding() == plan.tickets  # not consumed: the copy counts as not done
    assert torch.equal(w.pool.buffer, before)  # the launch wrote the row, then failed: the row is restored, never half-loaded
    assert distance(state_rows(w.pool, SLOT), scratch_states(PREFIX)) > 1e-2  # (the previous owner's bytes, not the entry's)
    w.pipeline.withdraw(batch, plan, [RequestId(1)], reason="request 1 aborted: its cache load failed")
    assert list(w.ledger.cancelled().values()) == ["request 1 aborted: its cache load failed"]
    # the slot's next owner: a fresh request, cleared by its own ticket
    _, nxt = w.pipeline.prefill([fresh(2, SLOT, OTHER, w.kv(len(OTHER)))])
    op = nxt.tickets[0].op
    assert isinstance(op, MambaInit) and op.clear_slots == (SLOT,)
    w.executor.execute(nxt)
    assert_states_match(state_rows(w.pool, SLOT), scratch_states(OTHER), "the slot's next owner", exact=True)
    assert distance(state_rows(w.pool, SLOT), scratch_states(PREFIX + OTHER)) > 1e-2  # (what the loaded row would have given)
    assert_states_match(state_rows(w.pool, CACHE), scratch_states(PREFIX), "the cache entry", exact=True)
    w.ledger.assert_drained()
    w.release_all()


SHARED = list(b"You are a careful reviewer.\n")  # 28 tokens: a cache block boundary (16) inside
PROMPTS = [SHARED + list(b) for b in (b"def f(x):", b"import re", b"class K:", b"x = 1")]
LONE = list(b"print('hello')")
NEW = 3


def _copies(plan: Any) -> tuple[int, ...]:
    ext = plan if isinstance(plan, ExtendPlan) else plan.extend if isinstance(plan, MixedPlan) else None
    if ext is None:
        return ()
    return tuple(s for t in ext.tickets if isinstance(t.op, MambaInit) for s in t.op.cow_dst)


def _fault_on_the_copy(e: Engine) -> list[int]:
    """Arm the init-launch fault for the first forward whose init copies a cache hit; returns the
    list that will hold that forward's copy slots."""
    failed_slots: list[int] = []
    inner = e.target.execute

    def execute(plan: Any) -> Result:
        if _copies(plan) and not getattr(execute, "armed", False):
            execute.armed = True  # type: ignore[attr-defined]
            failed_slots.extend(_copies(plan))
            faults.arm(faults.FaultPoint.INIT_LAUNCH)
        return inner(plan)

    e.target.execute = execute  # type: ignore[method-assign]
    return failed_slots


@pytest.mark.parametrize("models", MODELS)
def test_through_the_engine_a_failed_cache_load_aborts_unpins_and_frees_the_slot_for_a_cleared_owner(models: str) -> None:
    model = MODELS[models]()[0]
    cache = PrefixCache(capacity=2, block=16)
    e = Engine(model, None, k=0, capacity=3, prefix_cache=cache)
    failed_slots = _fault_on_the_copy(e)
    rec = Recorder(e.target)
    for rid in (0, 1):
        e.admit(RequestId(rid), PROMPTS[rid], max_new_tokens=NEW)
    e.run_until_done()
    (entry,) = cache.entries()
    assert entry.tokens == tuple(SHARED[:16]) and entry.pins == 0
    try:
        e.admit(RequestId(2), PROMPTS[2], max_new_tokens=NEW)  # a hit: its forward copies the entry, and fails
        e.run_until_done()
    finally:
        faults.disarm()
    assert [p for p in (r.plan for r in rec.ran) if _copies(p)] == []  # the failed forward is not recorded as run
    assert faults._fired == {faults.FaultPoint.INIT_LAUNCH: 1}
    assert e.stats.failed_steps == 1 and e.aborted_by_failure == {RequestId(2)} and e.outputs[RequestId(2)] == []
    assert entry.pins == 0 and cache.entries() == (entry,)
    reasons = list(e.ledger.cancelled().values())
    assert len(reasons) == 1 and reasons[0].startswith("aborted: its forward failed")
    e.ledger.assert_drained()
    assert e.slots.num_live == 1 and e.slots.num_free == e.slots.capacity - 1  # only the entry's slot is held
    # the slot's next owner (no hit): cleared by its own init, its state a from-scratch prefill
    e.admit(RequestId(3), LONE, max_new_tokens=NEW)
    e.run_until_done()
    last = rec.extend_plans()[-1]
    assert len(failed_slots) == 1 and last.rid_list() == [3] and last.slot_list() == failed_slots  # the aborted request's slot
    (clear,) = [t.op for t in last.tickets if isinstance(t.op, MambaInit)]
    assert clear.clear_slots == tuple(last.slot_list()) and clear.cow_dst == ()
    assert_states_match(rec.prefilled[RequestId(3)], scratch_states(LONE, model=model), "the next owner of the freed slot")
    # a later hit on the same entry is served
    e.admit(RequestId(4), PROMPTS[3], max_new_tokens=NEW)
    e.run_until_done()
    assert len([p for p in (r.plan for r in rec.ran) if _copies(p)]) == 1
    assert_states_match(rec.prefilled[RequestId(4)], scratch_states(PROMPTS[3], model=model), "a later hit on the entry")
    expected = {RequestId(i): reference_outputs(p, NEW, model) for i, p in enumerate(PROMPTS[:2])}
    expected |= {RequestId(2): [], RequestId(3): reference_outputs(LONE, NEW, model), RequestId(4): reference_outputs(PROMPTS[3], NEW, model)}
    assert e.outputs == expected
    if models == "state-sensitive":
        assert_tokens_need_state(PROMPTS[3], len(entry.tokens), NEW, model)  # a zeroed copy would show in request 4's tokens
    assert entry.pins == 0
    e.drop_cache()
    assert_accounted(e)
    assert e.slots.num_live == 0 and e.kv.num_live == 0
    e.close()


def test_through_the_engine_an_abort_before_the_first_step_or_between_chunks_frees_everything() -> None:
    e = Engine(tiny_models()[0], None, k=0, capacity=1, chunk_size=8)
    rec = Recorder(e.target)
    # between admission and the first step
    e.admit(RequestId(0), PROMPTS[0], max_new_tokens=NEW)
    e.abort(RequestId(0))
    assert rec.ran == [] and e.outputs[RequestId(0)] == []
    assert_accounted(e)
    # between two chunks: the first of 5 chunks runs, then the abort
    e.admit(RequestId(1), PROMPTS[1], max_new_tokens=NEW)
    e.step()
    (first,) = rec.extend_plans()
    assert first.rid_list() == [1] and first.more_chunks.tolist() == [True]
    slot = first.slot_list()[0]
    e.abort(RequestId(1))
    assert e.outputs[RequestId(1)] == []
    assert_accounted(e)
    # the slot's next owner (the pool has one slot: the same one) starts from a cleared row
    e.admit(RequestId(2), LONE, max_new_tokens=NEW)
    e.run_until_done()
    nxt = rec.extend_plans()[1]
    assert nxt.rid_list() == [2] and nxt.slot_list() == [slot] and nxt.prefix_lens.tolist() == [0]
    (clear,) = [t.op for t in nxt.tickets if isinstance(t.op, MambaInit)]
    assert clear.clear_slots == (slot,)
    assert_states_match(rec.prefilled[RequestId(2)], scratch_states(LONE), "the next owner after an abort between chunks")
    assert e.outputs[RequestId(2)] == reference_outputs(LONE, NEW)
    assert_accounted(e)
    assert e.slots.num_live == 0 and e.kv.num_live == 0
    e.close()
