"""Recurrent state over rejected draft positions kept in a cached block (vLLM PR #48375,
https://github.com/vllm-project/vllm/pull/48375).

Upstream: with speculative decoding and prefix caching on a hybrid model, the Mamba state cached for
a block was taken after the verify had run the recurrence over every draft position, accepted or
not: the cached state had absorbed the rejected tokens, and every later hit on that block started
from a state that no prefill of its tokens gives.

batchc: a prefix-cache snapshot is an op carried only by a prefill's plan (``ExtendPlan.snapshots``,
taken at a block boundary inside or at the end of its chunk); the speculative phases' plans (draft,
verify, commit, draft commit, draft extend) have no field that could carry one, and a verify's
per-position states reach the slot only through the commit, at the accepted position. The scenario:

- type level: none of those plan classes, nor their batches, has a ``snapshots`` or ``tickets``
  field (``attrs.fields``), and ``attrs.evolve`` cannot add one;
- engine at ``k = 2`` with a noisy draft (``batchc ab --draft-noise``'s construction, at a noise
  high enough that most proposals are rejected) and a prefix cache: a first round of requests
  sharing a system prompt, then follow-up turns whose prompts hold the first round's speculative
  outputs (so the cache snapshots blocks over tokens that were decoded speculatively); every cache
  entry's state equals a from-scratch prefill of its tokens, each request's state after its prefill
  too, and outputs equal the ``k = 0`` reference.

The engine scenario runs on the tiny target and on the state-sensitive one (``state_checks.MODELS``),
on which a follow-up turn's tokens would change had its copied state not been a from-scratch
prefill (a zeroed state at the copy shows: ``assert_tokens_need_state``).

Every ledger drained, every slot live or free, live == 0 at the end. Immune: no fix was needed.
"""

from __future__ import annotations

import inspect

import attrs
import pytest

from backend.hybrid.model import HybridModel
from backend.hybrid.weights import perturb
from compiler.engine import Engine
from compiler.prefix_cache import PrefixCache
from ir import spec
from ir.head import HeadCommitPlan
from ir.ids import RequestId
from ir.plan import ExtendPlan
from tests.scenarios.state_checks import (
    MODELS,
    Recorder,
    assert_accounted,
    assert_states_match,
    assert_tokens_need_state,
    reference_outputs,
    scratch_states,
    state_rows,
)

K = 2
NOISE = 0.5  # (``batchc ab``'s default is 0.05: a draft close to the target; this one is mostly wrong)

SPEC_PLANS = (spec.DraftPlan, spec.VerifyPlan, spec.CommitPlan, spec.DraftCommitPlan, spec.DraftExtendPlan, HeadCommitPlan)


def _field_names(cls: type) -> set[str]:
    """Every field name of an attrs class and of the attrs classes its fields hold, recursively."""
    attrs.resolve_types(cls)
    out: set[str] = set()
    for f in attrs.fields(cls):
        out.add(f.name)
        if isinstance(f.type, type) and attrs.has(f.type):
            out |= _field_names(f.type)
    return out


@pytest.mark.parametrize("cls", SPEC_PLANS, ids=lambda c: c.__name__)
def test_no_speculative_plan_can_carry_a_snapshot(cls: type) -> None:
    found = _field_names(cls)
    assert "batch" in found and {"rids", "slots"} <= found  # (the batch's fields are looked at too)
    assert not found & {"snapshots", "tickets", "snapshot", "init"}, (cls.__name__, sorted(found))
    # the constructor takes exactly the plan's fields (no extra keyword): ``attrs.evolve`` cannot add one either
    assert set(inspect.signature(cls).parameters) == set(attrs.fields_dict(cls))
    assert {"tickets", "snapshots"} <= _field_names(ExtendPlan)  # (the one plan kind that carries them)


SYSTEM = list(b"You are a careful reviewer.\n")  # 28 tokens: a cache block boundary (16) inside
FIRST = [SYSTEM + list(b) for b in (b"def f(x):", b"import re")]  # 37 and 37 tokens
NEW = 12  # request 0's prompt and output: 49 tokens, a block boundary (48) past its prompt
NEXT = 4


def _noisy_draft(target: HybridModel) -> HybridModel:
    return HybridModel(target.config, perturb(target.weights, NOISE, seed=1))


@pytest.mark.parametrize("models", MODELS)
def test_through_the_engine_every_cache_entry_is_a_from_scratch_prefill_of_its_tokens_despite_rejections(models: str) -> None:
    target, _ = MODELS[models]()
    cache = PrefixCache(capacity=6, block=16)
    e = Engine(target, _noisy_draft(target), k=K, capacity=4, prefix_cache=cache, chunk_size=16)
    rec = Recorder(e.target)
    for i, p in enumerate(FIRST):
        e.admit(RequestId(i), p, max_new_tokens=NEW)
    e.run_until_done()
    assert e.stats.proposed > 0 and e.stats.accepted < e.stats.proposed // 2, (e.stats.accepted, e.stats.proposed)
    # two follow-up turns of request 0: their prompts share its output (decoded speculatively), so the
    # cache snapshots the block that ends at token 48, 11 tokens into that output
    follow = [FIRST[0] + e.outputs[RequestId(0)] + list(b) for b in (b"\nand then?", b"\nwhy not?")]
    for i, p in enumerate(follow):
        e.admit(RequestId(10 + i), p, max_new_tokens=NEXT)
    e.run_until_done()
    prompts = {RequestId(i): p for i, p in enumerate(FIRST)} | {RequestId(10 + i): p for i, p in enumerate(follow)}
    assert e.outputs == {rid: reference_outputs(p, NEW if rid < 10 else NEXT, target) for rid, p in prompts.items()}
    for rid, p in prompts.items():
        assert_states_match(rec.prefilled[rid], scratch_states(p, model=target), f"request {rid} after its prefill")
    entries = cache.entries()
    spanning = [en for en in entries if len(en.tokens) > len(FIRST[0])]  # blocks that cover speculatively decoded tokens
    assert spanning and all(en.tokens == tuple(follow[0][: len(en.tokens)]) for en in spanning), [len(en.tokens) for en in entries]
    for en in entries:
        assert en.pins == 0
        assert_states_match(state_rows(e.target.pool, en.slot), scratch_states(en.tokens, model=target), f"the cache entry of {len(en.tokens)} tokens")
    # where each follow-up turn started: the length of the entry it copied (its first chunk's prefix)
    copied = {rid: min(pre for plan in rec.extend_plans() for r, pre in zip(plan.rid_list(), plan.prefix_lens.tolist(), strict=True) if r == rid)
              for rid in (10, 11)}
    assert min(copied.values()) >= 16, copied  # both turns started from a cache entry
    if models == "state-sensitive":
        for i, p in enumerate(follow):  # a wrong state at either copy would show in that turn's tokens
            assert_tokens_need_state(p, copied[10 + i], NEXT, target)
    assert e.draft is not None and e.target.kept_states == () and e.draft.kept_states == ()
    e.drop_cache()
    assert_accounted(e)
    assert e.slots.num_live == 0 and e.kv.num_live == 0
    e.close()
