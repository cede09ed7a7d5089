"""Requests that finish right after their prefill, with speculation on (SGLang PR #14742,
https://github.com/sgl-project/sglang/pull/14742).

Upstream: with speculative decoding on, a request whose ``max_new_tokens`` was 1 finished with the
token its prefill sampled; the draft side's work for its prefill (the draft model's extend, the
hidden states handed to the draft head) was then skipped or left behind, and the next step failed
on the mismatch (or the slot's next owner inherited it).

batchc: a prefill's init is a ticket per pool, consumed by that pool's own forward over the same
prefill (the draft's ``ExtendPlan``, the head's ``HeadExtendPlan``) whether or not the request goes
on; hidden states are kept under an id that the head's phase takes exactly once. The scenario, with
1-token requests mixed with longer ones (admitted together and while others decode):

- IR, the tiny target and its draft, two pools: one prefill for a 1-token request and a longer one;
  both pools run it (each consumes its ticket), the 1-token request leaves the running batch, the
  other drafts, verifies, commits and draft-commits on; each pool's rows equal a from-scratch
  prefill of the tokens fed; the finished request's slot is given to a new request at once;
- engine at ``k = 2`` with a separate draft and with the draft head, a prefix cache on (the later
  1-token request and a longer one start as copies of a cached block): no error, outputs equal the
  ``k = 0`` reference, every ticket minted on each pool consumed there (the draft's and the head's
  pool saw every prefill's clears, copies and snapshot), no hidden-state handle held, no verify or draft states kept, each
  request's state rows after its prefill, and the cache entry's, equal a from-scratch prefill on
  every pool (the target's; the separate draft's; the head's: its extend over the whole prompt from
  a zero state, with the cache-free target's hidden states, ``state_checks.scratch_head_states``),
  the freed slots served.

The engine scenario runs on the tiny target and on the state-sensitive one (``state_checks.MODELS``;
the head is a seeded one for whichever target): there, the copies' tokens would change had a copy
left a zeroed row (``assert_tokens_need_state``).

Every ledger drained, every slot live or free, live == 0 at the end. Immune: no fix was needed.
"""

from __future__ import annotations

from typing import Any

import pytest

from backend.executor import Executor
from backend.hybrid.head import HeadConfig, HeadModel
from backend.ledger import Ledger
from compiler.engine import Engine
from compiler.manager import PassManager
from compiler.prefix_cache import PrefixCache
from compiler.steps import Pipeline
from ir.batch import DecodeBatch
from ir.ids import DRAFT_POOL, TARGET_POOL, RequestId
from passes import LowerContext, SpecContext
from tests.helpers import fresh, tiny_models
from tests.scenarios.state_checks import (
    MODELS,
    Recorder,
    assert_accounted,
    assert_states_match,
    assert_tokens_need_state,
    reference_outputs,
    scratch_head_states,
    scratch_states,
    stale_fill,
    state_rows,
)

K = 2


def test_a_one_token_request_consumes_its_prefill_on_both_pools_and_its_slot_is_reused() -> None:
    ledger = Ledger()
    ex: dict[str, Executor[Any]] = {}
    for pool_id, model in zip((TARGET_POOL, DRAFT_POOL), tiny_models(), strict=True):
        pool = model.new_pool(4, pool_id=pool_id)
        stale_fill(pool, seed=len(ex) + 3)
        ex[pool_id] = Executor(pool, ledger, model.serving_hook(capacity=4, kv_capacity=256, max_len=96))
    target, draft = ex[TARGET_POOL], ex[DRAFT_POOL]
    pipe = Pipeline(ledger, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)), PassManager(verify_level=2))
    prompts = {1: list(b"def add(a, b):"), 2: list(b"import numpy"), 3: list(b"class K:")}
    batch, plan = pipe.prefill([fresh(1, 1, prompts[1], 1), fresh(2, 2, prompts[2], 40)])
    first = target.execute(plan)
    draft.execute(plan)
    ledger.assert_drained()  # both pools consumed their ticket, the 1-token request's rows included
    out = {rid: [tok] for rid, tok in zip(first.rids.tolist(), first.tokens.tolist(), strict=True)}
    assert_states_match(state_rows(draft.pool, 1), scratch_states(prompts[1], draft=True), "draft: the 1-token request")
    # request 1 is done (max_new_tokens 1): it leaves; request 2 speculates on
    running = pipe.filter_decode(pipe.merge(DecodeBatch.empty(), batch), [RequestId(1)])
    assert running.rid_list() == [2]
    d, dp = pipe.draft(running, SpecContext(k=K, next_tokens=[out[2][-1]], kv_locs=list(range(80, 80 + K + 1))))
    proposals = draft.execute(dp)
    v, vp = pipe.verify(d, proposals)
    result, c, cp = pipe.commit(v, target.execute(vp))
    target.execute(cp)
    _, dcp = pipe.draft_commit(c, d)
    draft.execute(dcp)
    out[2] += proposals.tokens.reshape(-1, K)[0, : int(result.accepted[0])].tolist() + [int(result.bonus[0])]
    # the finished request's slot, given at once to a new request on both pools
    _, plan3 = pipe.prefill([fresh(3, 1, prompts[3], 120)])
    out[3] = [int(target.execute(plan3).tokens[0])]
    draft.execute(plan3)
    for rid, slot in ((2, 2), (3, 1)):
        fed = prompts[rid] + out[rid][:-1]
        assert_states_match(state_rows(target.pool, slot), scratch_states(fed), f"target: request {rid}")
        assert_states_match(state_rows(draft.pool, slot), scratch_states(fed, draft=True), f"draft: request {rid}")
    assert out == {rid: reference_outputs(prompts[rid], len(toks)) for rid, toks in out.items()}
    assert target.kept_states == () and draft.kept_states == ()
    ledger.assert_drained()
    assert ledger.cancelled() == {}


SYSTEM = list(b"You are terse, ok.\n")  # 19 tokens: a cache block (16) inside, shared by requests 2 to 5
PROMPTS = [list(b"def f(x):"), list(b"class K:"), SYSTEM + list(b"x = [1, 2]"), SYSTEM + list(b"import re"), SYSTEM + list(b"y"), SYSTEM + list(b"for k in d:")]
NEW = [1, 5, 1, 4, 1, 3]


@pytest.mark.parametrize("models", MODELS)
@pytest.mark.parametrize("drafter", ["draft", "head"])
def test_through_the_engine_one_token_requests_leave_no_prefill_ticket_and_no_hidden_states(drafter: str, models: str) -> None:
    target, draft = MODELS[models]()
    head = HeadModel.from_seed(HeadConfig.for_target(target.config, ("mamba", "attn")), target, 3)  # (the engine-head tests' head)
    cache = PrefixCache(capacity=2, block=16)
    e = Engine(target, draft if drafter == "draft" else head, k=K, capacity=4, chunk_size=6, prefix_cache=cache)
    assert e.draft is not None and e.head == (drafter == "head")
    rec_t, rec_d = Recorder(e.target), Recorder(e.draft)
    for i in (0, 1):  # together
        e.admit(RequestId(i), PROMPTS[i], max_new_tokens=NEW[i])
    for _ in range(3):
        e.step()
    for i in (2, 3):  # while request 1 decodes
        e.admit(RequestId(i), PROMPTS[i], max_new_tokens=NEW[i])
    e.run_until_done()
    for i in (4, 5):  # into the freed slots
        e.admit(RequestId(i), PROMPTS[i], max_new_tokens=NEW[i])
    e.run_until_done()
    assert e.outputs == {RequestId(i): reference_outputs(p, NEW[i], target) for i, p in enumerate(PROMPTS)}
    starts = {rid: min(pre for plan in rec_t.extend_plans() for r, pre in zip(plan.rid_list(), plan.prefix_lens.tolist(), strict=True) if r == rid)
              for rid in range(len(PROMPTS))}
    assert starts == {0: 0, 1: 0, 2: 0, 3: 0, 4: 16, 5: 16}, starts  # requests 4 and 5 start as copies of the entry
    if models == "state-sensitive":
        assert_tokens_need_state(PROMPTS[5], 16, NEW[5], target)  # a zeroed row at request 5's copy would show in its tokens
    assert e.stats.proposed > 0
    ledger = e.ledger
    for pool in (TARGET_POOL, DRAFT_POOL):
        assert ledger.minted(pool) == ledger.counts(pool), pool
    counts = ledger.counts(DRAFT_POOL)
    assert counts == ledger.counts(TARGET_POOL) and counts.clears + counts.cows == len(PROMPTS) and counts.cows == 2 and counts.snapshots == 1
    assert ledger.cancelled() == {}
    assert e.target.kept_states == () and e.draft.kept_states == ()
    if e.head:
        assert e.target.hidden is not None and len(e.target.hidden) == 0  # every handle taken by the head's phase
    for i, p in enumerate(PROMPTS):
        assert_states_match(rec_t.prefilled[RequestId(i)], scratch_states(p, model=target), f"request {i} on the target after its prefill")
        if e.head:
            assert_states_match(rec_d.prefilled[RequestId(i)], scratch_head_states(p, head), f"request {i} on the head after its prefill")
        else:
            assert_states_match(rec_d.prefilled[RequestId(i)], scratch_states(p, model=draft), f"request {i} on the draft after its prefill")
    (entry,) = cache.entries()
    assert entry.pins == 0
    assert_states_match(state_rows(e.target.pool, entry.slot), scratch_states(SYSTEM[:16], model=target), "the cache entry")
    drafted = scratch_head_states(SYSTEM[:16], head) if e.head else scratch_states(SYSTEM[:16], model=draft)
    assert_states_match(state_rows(e.draft.pool, entry.slot), drafted, f"the cache entry on the {drafter}'s pool")
    e.drop_cache()
    assert_accounted(e)
    assert e.slots.num_live == 0 and e.kv.num_live == 0
    e.close()
