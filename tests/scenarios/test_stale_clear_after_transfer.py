"""A transferred Mamba state cleared by a stale "needs clear" flag (SGLang PR #32995,
https://github.com/sgl-project/sglang/pull/32995).

Upstream: a request's slot was flagged "needs clear" when it was allocated; the request's state was
then written by another path (a copy from a cached prefix, or its earlier prefill chunks), and the
flag, never reset, cleared the slot afterwards: the request went on from a zero state.

batchc: a clear is not a flag on the slot but an op of the forward that starts the request, derived
from its intent (``Clear`` only: a ``CopyFrom`` gives a copy, a ``Continue`` nothing) and carried as
a ticket that the ledger lets run once. The scenario, at the IR level on the tiny target and through
the engine with a prefix cache and small chunks:

- no lowered plan clears a slot after the copy into it or after the request's first chunk (the
  plans' ops and their dumped text), and each request's state rows after its prefill, and each
  cache entry's, equal a from-scratch prefill of the same tokens;
- a chunk's tickets spliced onto another chunk's plan (``attrs.evolve``) are refused before the pool
  moves (its bytes compared): after the first chunk ran, as a replay; before it ran, because the
  clear would land on a row that continues a state (``backend.state_store.check_fresh_rows``; that
  refusal is the fix this scenario brought: before it, the spliced plan ran and cleared the row); a
  copy-on-write spliced onto its own request's continuation chunk before the first chunk ran,
  because the ledger binds each ticket to the rows of the plan it was registered with and the row
  starts at another token (``Ledger.register``'s ``starts``; the second fix: before it, the copy ran
  and the continuation went on from the copied prefix's state, skipping the first chunk's tokens); a
  clear of another request's slot, because that slot is no row of the plan;
- a clear lowered for a slot's previous owner that never ran (the stale flag) blocks every plan over
  the slot until it runs or is cancelled (recorded), so it cannot fire after a transfer.

Outputs equal the reference run (``state_checks.reference_outputs``), every ledger is drained (or
its cancellations recorded), every slot is live or free. The tests that compare tokens after a copy
run on the tiny target and on the state-sensitive one (``state_checks.MODELS``), on which a state
zeroed at the copy (what the stale clear leaves) changes those very tokens (``assert_tokens_need_state``).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from compiler.engine import Engine
from compiler.prefix_cache import PrefixCache
from ir.batch import DecodeBatch
from ir.errors import PlanExecutionError, ResourceReplayError, TicketMismatchError
from ir.ids import RequestId
from ir.init import MambaInit
from ir.plan import ExtendPlan
from ir.printer import dump
from passes import DecodeContext
from tests.helpers import cont, cow, fresh
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

PREFIX = list(b"You are terse.\n")  # 15 tokens: the cached prefix
BODY = list(b"def add(a, b):")  # 14 tokens after it, in two chunks (5 + 9)
OTHER = list(b"x = [1, 2, 3]")  # 13 tokens from a fresh slot, in two chunks (4 + 9)
CACHE, SLOT_COPY, SLOT_FRESH, SLOT_OTHER = 5, 1, 2, 3


def _clears(plan: ExtendPlan) -> set[int]:
    return {s for t in plan.tickets if isinstance(t.op, MambaInit) for s in t.op.clear_slots}


def _cache_entry(w: TinyWorld) -> None:
    """The cached prefix in ``CACHE``: its own prefill from a cleared slot (what a snapshot holds)."""
    _, plan = w.pipeline.prefill([fresh(100, CACHE, PREFIX, w.kv(len(PREFIX)))])
    w.executor.execute(plan)
    # the same computation as the from-scratch prefill (the tokens in one chunk, one row, the same
    # kernels): bit for bit
    assert_states_match(state_rows(w.pool, CACHE), scratch_states(PREFIX, model=w.model), "cache entry", exact=True)
    w.hook.share_prefix(CACHE, SLOT_COPY, len(PREFIX))  # a copy's attention reads the entry's KV


@pytest.mark.parametrize("models", MODELS)
def test_a_copied_or_continued_slot_is_never_cleared_and_its_state_is_a_from_scratch_prefill(models: str) -> None:
    w = TinyWorld(model=MODELS[models]()[0])
    _cache_entry(w)
    kv_copy, kv_fresh = w.kv(len(BODY)), w.kv(len(OTHER))
    copy_first = attrs.evolve(cow(1, SLOT_COPY, CACHE, len(PREFIX), BODY[:5], kv_copy), more_chunks=True)
    _, p1 = w.pipeline.prefill([copy_first, fresh(2, SLOT_FRESH, OTHER[:4], kv_fresh, more=True)])
    batch2, p2 = w.pipeline.prefill([cont(1, SLOT_COPY, len(PREFIX) + 5, BODY[5:], kv_copy + 5), cont(2, SLOT_FRESH, 4, OTHER[4:], kv_fresh + 4)])
    # the first chunks' ops: the fresh slot's clear and the copy into the other, never a clear of the copy
    op = p1.tickets[0].op
    assert isinstance(op, MambaInit)
    assert (op.clear_slots, op.cow_src, op.cow_dst) == ((SLOT_FRESH,), (CACHE,), (SLOT_COPY,))
    assert f"clear[s{SLOT_FRESH}] cow[s{CACHE}->s{SLOT_COPY}]" in dump(p1, exact=True)
    # the continuation chunks: no op at all, so no clear of either slot after its copy or first chunk
    assert p2.tickets == () and batch2.init is None and "tickets none" in dump(p2, exact=True)
    w.executor.execute(p1)
    sampled = w.executor.execute(p2)
    assert_states_match(state_rows(w.pool, SLOT_COPY), scratch_states(PREFIX + BODY, model=w.model), "copied prefix, then 2 chunks")
    assert_states_match(state_rows(w.pool, SLOT_FRESH), scratch_states(OTHER, model=w.model), "fresh slot, 2 chunks")
    # what a stale clear before the second chunk would have left is far outside the tolerance
    assert distance(state_rows(w.pool, SLOT_COPY), scratch_states(BODY[5:], model=w.model)) > 1e-2
    assert_states_match(state_rows(w.pool, CACHE), scratch_states(PREFIX, model=w.model), "cache entry after the copy read it", exact=True)
    # decode on: the tokens are the reference run's
    tokens = {rid: [tok] for rid, tok in zip(sampled.rids.tolist(), sampled.tokens.tolist(), strict=True)}
    running = w.pipeline.merge(DecodeBatch.empty(), batch2)
    for _ in range(2):
        ctx = DecodeContext(next_tokens=[tokens[r][-1] for r in running.rid_list()], kv_locs=[w.kv(1) for _ in running.rid_list()])
        running, dplan = w.pipeline.decode(running, ctx)
        res = w.executor.execute(dplan)
        for rid, tok in zip(res.rids.tolist(), res.tokens.tolist(), strict=True):
            tokens[rid].append(tok)
    assert tokens == {1: reference_outputs(PREFIX + BODY, 3, w.model), 2: reference_outputs(OTHER, 3, w.model)}
    if models == "state-sensitive":
        assert_tokens_need_state(PREFIX + BODY, len(PREFIX), 3, w.model)  # a stale clear at the copy would show in the tokens
    w.ledger.assert_drained()
    w.release_all()


def test_a_chunks_tickets_spliced_onto_another_chunks_plan_are_refused_before_the_pool_moves() -> None:
    w = TinyWorld()
    _cache_entry(w)
    # a fresh request's two chunks, both lowered before either runs
    kv = w.kv(len(OTHER))
    _, a1 = w.pipeline.prefill([fresh(1, SLOT_FRESH, OTHER[:4], kv, more=True)])
    _, a2 = w.pipeline.prefill([cont(1, SLOT_FRESH, 4, OTHER[4:], kv + 4)])
    before = w.pool.buffer.clone()
    with pytest.raises(PlanExecutionError, match=rf"^ExtendPlan: the init clears slot {SLOT_FRESH}, whose row continues a state from token 4 "):
        w.executor.execute(attrs.evolve(a2, tickets=a1.tickets))  # the first chunk's clear on the second chunk
    assert torch.equal(w.pool.buffer, before)
    assert w.ledger.outstanding() == a1.tickets  # claimed, refused, given back: not consumed
    with pytest.raises(TicketMismatchError, match=rf"over slot {SLOT_FRESH} .* does not carry"):
        w.executor.execute(a2)  # the second chunk before the first: its row's clear has not run
    w.executor.execute(a1)
    before = w.pool.buffer.clone()
    with pytest.raises(ResourceReplayError, match=r"^replay of ticket #\d+ for pool 'target': already consumed \(ops clear \[2\], cow \[\]\)$"):
        w.executor.execute(attrs.evolve(a2, tickets=a1.tickets))
    assert torch.equal(w.pool.buffer, before)

    # a copy from the cache, then its continuation; and another request's clear, lowered, not run
    kv = w.kv(len(BODY))
    _, c1 = w.pipeline.prefill([attrs.evolve(cow(2, SLOT_COPY, CACHE, len(PREFIX), BODY[:5], kv), more_chunks=True)])
    _, c2 = w.pipeline.prefill([cont(2, SLOT_COPY, len(PREFIX) + 5, BODY[5:], kv + 5)])
    _, other = w.pipeline.prefill([fresh(3, SLOT_OTHER, PREFIX, w.kv(len(PREFIX)))])
    before = w.pool.buffer.clone()
    with pytest.raises(PlanExecutionError, match=(
        rf"^ExtendPlan: ticket #\d+ for pool 'target' was lowered for slot {SLOT_COPY} starting at token {len(PREFIX)}, "
        rf"and this plan's row starts at token {len(PREFIX) + 5}: its ops belong to another plan"
    )):
        w.executor.execute(attrs.evolve(c2, tickets=c1.tickets))  # the copy on its own continuation, before the first chunk ran
    assert torch.equal(w.pool.buffer, before)
    assert set(w.ledger.outstanding()) == {*c1.tickets, *other.tickets}  # refused, given back: not consumed
    w.executor.execute(c1)
    before = w.pool.buffer.clone()
    with pytest.raises(ResourceReplayError, match=r"already consumed \(ops clear \[\], cow \[5->1\]\)"):
        w.executor.execute(attrs.evolve(c2, tickets=c1.tickets))  # the copy again, over the first chunk's state
    with pytest.raises(PlanExecutionError, match=rf"^init #\d+ writes slot {SLOT_OTHER}, which is not a row of this plan \(rows \[{SLOT_COPY}\]\)$"):
        w.executor.execute(attrs.evolve(c2, tickets=other.tickets))  # another request's clear
    assert torch.equal(w.pool.buffer, before)
    assert w.ledger.outstanding() == other.tickets

    w.executor.execute(c2)
    w.executor.execute(a2)
    w.executor.execute(other)
    assert_states_match(state_rows(w.pool, SLOT_FRESH), scratch_states(OTHER), "fresh slot after the refused splices")
    assert_states_match(state_rows(w.pool, SLOT_COPY), scratch_states(PREFIX + BODY), "copied slot after the refused splices")
    assert_states_match(state_rows(w.pool, SLOT_OTHER), scratch_states(PREFIX), "the other request", exact=True)
    w.ledger.assert_drained()
    w.release_all()


def test_a_previous_owners_clear_that_never_ran_blocks_the_slot_until_it_is_cancelled() -> None:
    w = TinyWorld()
    _cache_entry(w)
    stale_batch, stale = w.pipeline.prefill([fresh(7, SLOT_COPY, OTHER, w.kv(len(OTHER)))])  # aborted before its forward
    _, new = w.pipeline.prefill([cow(8, SLOT_COPY, CACHE, len(PREFIX), BODY, w.kv(len(BODY)))])  # the slot's next owner
    before = w.pool.buffer.clone()
    with pytest.raises(TicketMismatchError, match=rf"^ExtendPlan over slot {SLOT_COPY} of pool 'target' does not carry ticket #\d+ .*clear \[{SLOT_COPY}\]"):
        w.executor.execute(new)
    assert torch.equal(w.pool.buffer, before)
    w.pipeline.withdraw(stale_batch, stale, [RequestId(7)], reason="request 7 aborted before its forward")
    assert list(w.ledger.cancelled().values()) == ["request 7 aborted before its forward"]
    w.executor.execute(new)
    assert_states_match(state_rows(w.pool, SLOT_COPY), scratch_states(PREFIX + BODY), "the new owner's copied state")
    w.ledger.assert_drained()  # the stale clear is cancelled (recorded), never run
    w.release_all()


SHARED = list(b"You are a careful reviewer.\n")  # 28 tokens: one cache block boundary (16) inside
PROMPTS = [SHARED + list(b) for b in (b"def f(x):", b"import re", b"class K:", b"x = 1")]
NEW = 4


@pytest.mark.parametrize("models", MODELS)
def test_through_the_engine_no_clear_follows_a_copy_or_a_first_chunk(models: str) -> None:
    """Requests 0 and 1 share the prefix (the cache snapshots it at 16 tokens); requests 2 and 3,
    admitted after, start as copies of that entry; every prompt goes in chunks of 8."""
    model = MODELS[models]()[0]
    cache = PrefixCache(capacity=2, block=16)
    e = Engine(model, None, k=0, capacity=4, prefix_cache=cache, chunk_size=8)
    rec = Recorder(e.target)
    for rid in (0, 1):
        e.admit(RequestId(rid), PROMPTS[rid], max_new_tokens=NEW)
    e.run_until_done()
    for rid in (2, 3):
        e.admit(RequestId(rid), PROMPTS[rid], max_new_tokens=NEW)
    e.run_until_done()
    plans = rec.extend_plans()
    copies = [s for p in plans for t in p.tickets if isinstance(t.op, MambaInit) for s in t.op.cow_dst]
    continued = [(p, s) for p in plans for s, pre in zip(p.slots.tolist(), p.prefix_lens.tolist(), strict=True) if pre > 0]
    assert len(copies) == 2 and len(continued) >= 8, "the scenario must copy from the cache and continue chunks"
    for p in plans:
        starts = dict(zip(p.slots.tolist(), p.prefix_lens.tolist(), strict=True))
        assert all(starts[s] == 0 for s in _clears(p)), f"a clear of a row past token 0:\n{dump(p, exact=True)}"
    assert e.outputs == {RequestId(i): reference_outputs(p, NEW, model) for i, p in enumerate(PROMPTS)}
    if models == "state-sensitive":
        # a clear after request 3's copy would show in its tokens (request 2's 4 tokens happen to
        # come out the same from a zeroed state: one copy that shows is what the comparison needs)
        assert_tokens_need_state(PROMPTS[3], 16, NEW, model)
    for i, p in enumerate(PROMPTS):
        assert_states_match(rec.prefilled[RequestId(i)], scratch_states(p, model=model), f"request {i} after its prefill")
    (entry,) = cache.entries()
    assert entry.tokens == tuple(SHARED[:16])
    assert_states_match(state_rows(e.target.pool, entry.slot), scratch_states(SHARED[:16], model=model), "the cache entry")
    e.drop_cache()
    assert_accounted(e)
    assert e.slots.num_live == 0 and e.kv.num_live == 0
    e.close()
