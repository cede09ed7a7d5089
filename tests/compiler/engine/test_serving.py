"""The serving engine's scheduler features on the seeded tiny hybrid model made state-sensitive
(``tests.scenarios.state_checks.sensitive_models``: its tokens change when a request's Mamba state is
wrong, stale or missing, where the tiny target's attention layer would carry the context past it;
float32, CPU): prefix cache (hit, miss, eviction under pressure, snapshot exactly once per pool,
pinned entries kept), chunked prefill equivalence, retraction and abort, stop tokens. Every run's
output is compared, token for token, with greedy decoding by the from-scratch reference model
(``backend.hybrid.reference``: no pool, KV cache, token table, kernel or scheduler), never with the
engine itself at k = 0, so a bug the engine has at every k cannot hide in the reference."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from backend.hybrid.reference import greedy_generate_reference
from compiler.engine import Engine
from compiler.prefix_cache import CacheEntry, PrefixCache
from ir.errors import PreconditionError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, RequestId
from tests.helpers import REVIEW_NEW, REVIEW_PROMPTS, SYSTEM
from tests.scenarios.state_checks import sensitive_models

PROMPTS, NEW = REVIEW_PROMPTS, REVIEW_NEW


def engine(k: int, **options: Any) -> Engine:
    """An ``Engine`` over the state-sensitive models (the draft only when ``k > 0``)."""
    target, draft = sensitive_models()
    return Engine(target, draft if k else None, k=k, **options)


@cache
def _reference(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(greedy_generate_reference(sensitive_models()[0], list(prompt), n))


def greedy_reference(prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of the state-sensitive target after ``prompt`` (the from-scratch reference)."""
    return list(_reference(tuple(prompt), n))


def review_greedy() -> dict[RequestId, list[int]]:
    """The reference's output for each of ``PROMPTS`` (request ``i`` is prompt ``i``)."""
    return {RequestId(i): greedy_reference(p, NEW) for i, p in enumerate(PROMPTS)}


def _serve(drv: Engine, prompts: list[list[int]], *, wave: int = 2) -> None:
    """Admit ``wave`` requests at a time; the next wave joins when the previous has finished."""
    for start in range(0, len(prompts), wave):
        for i in range(start, min(start + wave, len(prompts))):
            drv.admit(RequestId(i), prompts[i], max_new_tokens=NEW)
        drv.run_until_done()


@pytest.mark.parametrize("k", [0, 2])
def test_prefix_cache_hits_and_snapshots_once_per_pool(k: int) -> None:
    pc = PrefixCache(capacity=4, block=16)
    drv = engine(k, prefix_cache=pc, chunk_size=64)
    _serve(drv, PROMPTS)
    assert drv.outputs == review_greedy()
    # the first two share the system prompt: the second one snapshots at 32; later ones hit
    assert pc.stats.snapshots >= 1 and pc.stats.hits >= 3
    assert pc.stats.hit_tokens >= 3 * 32
    assert drv.ledger.counts(TARGET_POOL).snapshots == pc.stats.snapshots
    if k:
        assert drv.ledger.counts(DRAFT_POOL).snapshots == pc.stats.snapshots
    assert drv.ledger.counts(TARGET_POOL).cows == pc.stats.hits
    drv.ledger.assert_drained()
    drv.drop_cache()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def test_prefix_cache_miss_on_unshared_prompts() -> None:
    pc = PrefixCache(capacity=4, block=16)
    drv = engine(0, prefix_cache=pc)
    _serve(drv, [PROMPTS[5]], wave=1)
    assert pc.stats.hits == 0 and pc.stats.snapshots == 0 and pc.stats.lookups == 1


OTHER = list(b"Translate this comment to plain English:\n")


def test_prefix_cache_eviction_under_pressure_keeps_output() -> None:
    # two prompt families, one cache entry, two slots: each family's snapshot evicts the other's
    prompts = [SYSTEM + list(b"a = 1"), SYSTEM + list(b"b = 2"), OTHER + list(b"# x"), OTHER + list(b"# y"),
               SYSTEM + list(b"c = 3"), SYSTEM + list(b"d = 4")]
    pc = PrefixCache(capacity=1, block=16)
    drv = engine(2, prefix_cache=pc, capacity=2)
    _serve(drv, prompts, wave=1)
    assert drv.outputs == {RequestId(i): greedy_reference(p, NEW) for i, p in enumerate(prompts)}
    assert pc.stats.evictions >= 1 and pc.stats.hits >= 1
    drv.ledger.assert_drained()
    drv.drop_cache()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0



def _state_rows(drv: Engine, slot: int) -> dict[str, torch.Tensor]:
    """The recurrent state in ``slot`` of every Mamba layer of both pools (target and draft)."""
    rows: dict[str, torch.Tensor] = {}
    for ex in (drv.target, drv.draft):
        assert ex is not None
        pool = ex.pool
        for layer in range(len(pool.layout.layers)):
            rows[f"{pool.pool_id} conv {layer}"] = pool.conv_state(layer)[slot].clone()
            rows[f"{pool.pool_id} ssm {layer}"] = pool.ssm_state(layer)[slot].clone()
    return rows


def _state_from_scratch(prompt: list[int]) -> dict[str, torch.Tensor]:
    """The same state computed without any cache: ``prompt`` prefilled into a fresh slot of a new driver."""
    drv = engine(2)
    drv.admit(RequestId(0), prompt, max_new_tokens=2)
    assert drv.step().kind.value == "extend"
    return _state_rows(drv, drv.live_slots()[RequestId(0)])


def _assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys()
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], atol=2e-5, rtol=2e-5, msg=lambda m: f"{what}, {name}: {m}")


def test_a_prefix_cache_hit_starts_from_its_own_entrys_state() -> None:
    # two prompt families, each leaving its own entry: a COW from the wrong slot is possible, and
    # would show in the state even when a few greedy tokens of a tiny model happen to agree
    pc = PrefixCache(capacity=4, block=16)
    drv = engine(2, prefix_cache=pc, chunk_size=64)
    _serve(drv, [SYSTEM + list(b"a = 1"), SYSTEM + list(b"b = 2"), OTHER + list(b"# x"), OTHER + list(b"# y")], wave=1)
    entries = {e.tokens: e for e in pc.entries()}
    assert set(entries) == {tuple(SYSTEM[:32]), tuple(OTHER[:32])}
    for tokens, entry in entries.items():  # each snapshot holds its own prefix's state, in both pools
        _assert_same_state(_state_rows(drv, entry.slot), _state_from_scratch(list(tokens)), f"cache entry in slot {entry.slot}")
    # one request per family, in one forward: two COWs from two entries in one init op
    hits = {RequestId(10): SYSTEM + list(b"c = 3"), RequestId(11): OTHER + list(b"# z")}
    for rid, prompt in hits.items():
        drv.admit(rid, prompt, max_new_tokens=2)
    before = (pc.stats.hits, drv.ledger.counts(TARGET_POOL).cows, drv.ledger.counts(DRAFT_POOL).cows)
    assert drv.step().kind.value == "extend"  # each whole prompt: a COW from its entry, then the rest
    after = (pc.stats.hits, drv.ledger.counts(TARGET_POOL).cows, drv.ledger.counts(DRAFT_POOL).cows)
    assert after == tuple(n + 2 for n in before)
    for rid, prompt in hits.items():
        got = _state_rows(drv, drv.live_slots()[rid])
        _assert_same_state(got, _state_from_scratch(prompt), f"request {rid} after its cache hit")
    drv.run_until_done()
    assert {rid: drv.outputs[rid] for rid in hits} == {rid: greedy_reference(p, 2) for rid, p in hits.items()}
    drv.ledger.assert_drained()
    drv.drop_cache()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0

def test_pinned_entry_is_never_evicted() -> None:
    pc = PrefixCache(capacity=2, block=4)
    a = CacheEntry(slot=MambaSlot(1), tokens=(1, 2, 3, 4), kv_locs=(1, 2, 3, 4))
    b = CacheEntry(slot=MambaSlot(2), tokens=(5, 6, 7, 8), kv_locs=(5, 6, 7, 8))
    assert pc.reserve_room() and pc.reserve_room() and not pc.reserve_room()
    pc.insert(a)
    pc.insert(b)
    pc.pin(a)
    assert pc.evict_lru() is b
    assert pc.evict_lru() is None  # a is pinned
    pc.unpin(a)
    assert pc.evict_lru() is a


@pytest.mark.parametrize(("k", "chunk"), [(0, 5), (2, 7), (2, 16)])
def test_chunked_prefill_equals_unchunked(k: int, chunk: int) -> None:
    drv = engine(k, chunk_size=chunk, token_budget=24)
    _serve(drv, PROMPTS, wave=3)
    assert drv.outputs == review_greedy()
    drv.ledger.assert_drained()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def _staggered(drv: Engine, prompts: list[list[int]]) -> list[str]:
    """One new request per step while earlier ones run; returns the step kinds."""
    kinds = []
    for i, p in enumerate(prompts):
        drv.admit(RequestId(i), p, max_new_tokens=NEW)
        kinds.append(drv.step().kind.value)
    while drv.live:
        kinds.append(drv.step().kind.value)
    return kinds


@pytest.mark.parametrize("cached", [False, True])
def test_mixed_forwards_at_k0_equal_greedy_and_unmixed(cached: bool) -> None:
    # a newcomer's chunks share the forward with the running decodes: clears, COWs from the cache
    # and snapshots all run inside MIXED forwards, exactly once
    def make(mixed: bool) -> Engine:
        pc = PrefixCache(capacity=4, block=16) if cached else None
        return engine(0, chunk_size=16, token_budget=24, prefix_cache=pc, mixed=mixed)

    on, off = make(True), make(False)
    kinds_on, kinds_off = _staggered(on, PROMPTS), _staggered(off, PROMPTS)
    assert on.outputs == off.outputs == review_greedy()
    assert kinds_on.count("mixed") >= 3 and on.stats.mixed == kinds_on.count("mixed")
    assert "mixed" not in kinds_off and off.stats.mixed == 0
    assert len(kinds_on) < len(kinds_off)  # prefills no longer pause the decodes
    assert on.ledger.counts(TARGET_POOL) == off.ledger.counts(TARGET_POOL)
    if cached:
        assert on.cache is not None and on.cache.stats.hits >= 1 and on.cache.stats.snapshots >= 1
    for drv in (on, off):
        drv.ledger.assert_drained()
        drv.drop_cache()
        assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def test_mixed_forward_with_retraction_under_kv_pressure() -> None:
    drv = engine(0, kv_capacity=170, chunk_size=16)
    kinds = _staggered(drv, PROMPTS[:3])
    assert "mixed" in kinds and drv.stats.retractions >= 1
    assert drv.outputs == {RequestId(i): review_greedy()[RequestId(i)] for i in range(3)}
    drv.ledger.assert_drained()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def test_mixed_step_needs_one_kv_location_per_running_request() -> None:
    """Before a MIXED step each running request needs one KV location for its decode. With exactly
    that many free, nothing is retracted: the step decodes, and the waiting prompt (whose chunk does
    not fit) is prefilled once the running request has finished."""
    first, second = list(b"print('hello world')"), list(b"def f(x):")
    drv = engine(0, kv_capacity=len(first) + 1)  # the first prompt and its one decode, nothing more
    drv.admit(RequestId(0), first, max_new_tokens=2)
    drv.admit(RequestId(1), second, max_new_tokens=2)
    assert [drv.step().kind.value for _ in range(3)] == ["extend", "decode", "extend"]
    drv.run_until_done()
    assert drv.stats.retractions == 0
    assert drv.outputs == {RequestId(0): greedy_reference(first, 2), RequestId(1): greedy_reference(second, 2)}
    drv.ledger.assert_drained()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0


@pytest.mark.parametrize("k", [0, 2])
def test_retraction_frees_and_the_request_completes_after_re_prefill(k: int) -> None:
    # all three prompts fit (157 locations), their growth does not: the newest is retracted
    drv = engine(k, kv_capacity=170)
    for i in range(3):
        drv.admit(RequestId(i), PROMPTS[i], max_new_tokens=NEW)
    drv.run_until_done()
    assert drv.stats.retractions >= 1
    assert drv.outputs == {RequestId(i): review_greedy()[RequestId(i)] for i in range(3)}
    drv.ledger.assert_drained()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def test_abort_frees_everything_and_others_complete() -> None:
    drv = engine(2)
    for i in range(3):
        drv.admit(RequestId(i), PROMPTS[i], max_new_tokens=NEW)
    drv.step()  # prefill
    drv.step()  # one speculative iteration
    drv.abort(RequestId(1))
    with pytest.raises(PreconditionError, match="request 1 is not live"):
        drv.abort(RequestId(1))
    drv.run_until_done()
    for i in (0, 2):
        assert drv.outputs[RequestId(i)] == review_greedy()[RequestId(i)]
    assert drv.outputs[RequestId(1)] == review_greedy()[RequestId(1)][: len(drv.outputs[RequestId(1)])]
    drv.ledger.assert_drained()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def test_stop_token_ends_the_request_after_emitting_it() -> None:
    full = review_greedy()[RequestId(0)]
    stop = full[3]
    drv = engine(2)
    drv.admit(RequestId(0), PROMPTS[0], max_new_tokens=NEW, stop=stop)
    drv.run_until_done()
    assert drv.outputs[RequestId(0)] == full[: full.index(stop) + 1]
