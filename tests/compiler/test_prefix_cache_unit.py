"""The prefix cache on its own (``compiler.prefix_cache``): its arguments at their bounds, and its
protocol (observe, plan, reserve, insert, look up, pin, evict) step by step, each refusal with its
message and the cache unchanged."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from typeguard import suppress_type_checks

from compiler.prefix_cache import CacheEntry, PrefixCache, PrefixCacheError
from ir.ids import MambaSlot

P = list(range(1, 9))  # 8 tokens: boundaries 4 (block 4), or 2, 4, 6 (block 2)


def _entry(n: int, slot: int = 3, **over: object) -> CacheEntry:
    fields: dict[str, object] = {"slot": MambaSlot(slot), "tokens": tuple(P[:n]), "kv_locs": tuple(range(10, 10 + n))}
    fields.update(over)
    return CacheEntry(**fields)  # type: ignore[arg-type]  # some cases are malformed on purpose


def test_sizes_of_one_are_accepted_and_below_refused() -> None:
    pc = PrefixCache(capacity=1, block=1)
    assert (pc.capacity, pc.block) == (1, 1)
    for kw, shown in (({"capacity": 0}, r"PrefixCache\(capacity\): must be >= 1 \(got 0\)"), ({"capacity": 2, "block": 0}, r"PrefixCache\(block\): must be >= 1 \(got 0\)")):
        with pytest.raises(PrefixCacheError, match=rf"^{shown}$"):
            PrefixCache(**kw)  # type: ignore[arg-type]  # the refusal under test
    with pytest.raises(PrefixCacheError, match=r"^PrefixCache\(capacity\): .*\(got True\)$"):
        PrefixCache(capacity=True)


TOKENS: list[tuple[object, str]] = [
    (np.ones((2, 2), dtype=np.int64), r"must be a 1-D integer array, got dtype int64 and shape \(2, 2\)"),
    (np.array([1.0]), r"must be a 1-D integer array, got dtype float64 and shape \(1,\)"),
    (np.array([3, -2]), r"token ids must be >= 0 \(got -2\)"),
    ([3, -2], r"token ids must be >= 0 \(got -2\)"),
    ([1, 1.5], r"every token id .*\(got 1\.5\)"),
    ("abc", r"must be a sequence of token ids, not str \(got 'abc'\)"),
]


@pytest.mark.parametrize(("tokens", "shown"), TOKENS)
def test_bad_tokens_are_refused_by_name(tokens: object, shown: str) -> None:
    pc = PrefixCache(capacity=2, block=2)
    with suppress_type_checks(), pytest.raises(PrefixCacheError, match=rf"^lookup\(tokens\): {shown}"):
        pc.lookup(tokens)  # type: ignore[arg-type]  # the refusal under test
    assert pc.stats.lookups == 0


def test_token_zero_and_integer_arrays_are_tokens() -> None:
    pc = PrefixCache(capacity=2, block=2)
    with suppress_type_checks():  # arrays are accepted, though the signature says Sequence
        for tokens in (np.array([0, 5, 6], dtype=np.int64), np.array([0, 5, 6], dtype=np.uint8), [0, 5, 6], (0, 5, 6), bytes([0, 5, 6])):
            pc.observe(tokens)  # type: ignore[arg-type]  # every accepted kind
    assert pc.plan_snapshot([0, 5, 6], 0) == 2  # the prefix (0, 5), seen five times


def test_the_protocol_from_observation_to_eviction() -> None:
    pc = PrefixCache(capacity=1, block=4)
    pc.observe(P)
    assert pc.plan_snapshot(P, 0) is None  # seen once: not worth a snapshot
    pc.observe(P[:6])
    assert pc.plan_snapshot(P, 0) == 4 and pc.plan_snapshot(P, 0) is None  # promised once
    pc.cancel_plan(P[:4])
    assert pc.plan_snapshot(P, 0) == 4
    assert pc.plan_snapshot(P, 4) is None  # nothing past the hit
    with pytest.raises(PrefixCacheError, match=r"^release_room without a reservation$"):
        pc.release_room()
    with pytest.raises(PrefixCacheError, match=r"^release_room without a reservation$"):
        pc.insert(_entry(4))  # no room was reserved
    assert pc.reserve_room() and not pc.reserve_room()  # capacity 1
    for bad, shown in (
        (_entry(0), r"a prefix of 0 tokens does not end at a block boundary \(block 4\)"),
        (_entry(3), r"a prefix of 3 tokens does not end at a block boundary \(block 4\)"),
        (_entry(4, kv_locs=(1, 2, 3)), r"3 KV locations for 4 tokens"),
        (_entry(4, pins=1), r"a new entry must not be pinned \(got pins=1\)"),
        (_entry(4, slot=0), r"slot must be a cache slot >= 1 \(slot 0 is the padding slot\), got 0"),
        ({"slot": 3}, r"must be a CacheEntry, not dict"),
    ):
        with suppress_type_checks(), pytest.raises(PrefixCacheError, match=rf"^insert\(entry\): {shown}"):
            pc.insert(bad)  # type: ignore[arg-type]  # the refusals under test
    entry = _entry(4)
    pc.insert(entry)
    assert len(pc) == 1 and pc.stats.snapshots == 1 and not pc.reserve_room()
    with pytest.raises(PrefixCacheError, match=r"^prefix of 4 tokens is already cached in slot 3$"):
        pc.insert(_entry(4, slot=5))
    assert pc.lookup(P) is entry and pc.lookup(P[:4]) is None  # strictly shorter than the prompt
    assert (pc.stats.lookups, pc.stats.hits, pc.stats.hit_tokens) == (2, 1, 4)
    pc.pin(entry)
    assert pc.evict_lru() is None  # pinned
    pc.unpin(entry)
    with pytest.raises(PrefixCacheError, match=r"^unpin of cache slot 3, which is not pinned$"):
        pc.unpin(entry)
    with pytest.raises(PrefixCacheError, match=r"^pin\(entry\): the entry of slot 3 \(4 tokens\) is not in this cache$"):
        pc.pin(_entry(4))  # an equal record, not the cache's own
    assert pc.evict_lru() is entry and len(pc) == 0 and pc.stats.evictions == 1


def test_a_reservation_can_be_released_once() -> None:
    pc = PrefixCache(capacity=2)
    assert pc.reserve_room() and pc.reserve_room() and not pc.reserve_room()
    pc.release_room()
    pc.release_room()
    release: Callable[[], None] = pc.release_room
    with pytest.raises(PrefixCacheError, match=r"^release_room without a reservation$"):
        release()


def test_an_entry_whose_pins_are_not_a_count_is_refused() -> None:
    """``pins`` is a count (an int >= 0): an entry whose count went negative (a caller's unpin of
    its own) or is not an int is refused by name, by ``insert`` and by ``pin``, never counted on."""
    pc = PrefixCache(capacity=1, block=4)
    for bad, shown in ((-1, "-1"), ("1", "'1'")):
        with suppress_type_checks(), pytest.raises(PrefixCacheError, match=rf"^insert\(entry\): pins must be an int >= 0 \(got {shown}\)$"):
            pc.insert(_entry(4, pins=bad))
    assert len(pc) == 0 and pc.reserve_room()
    entry = _entry(4)
    pc.insert(entry)
    entry.pins = -1  # the caller's own record, changed behind the cache's back
    with pytest.raises(PrefixCacheError, match=r"^pin\(entry\): pins must be an int >= 0 \(got -1\)$"):
        pc.pin(entry)
    assert entry.pins == -1 and pc.evict_lru() is None  # not counted up to an unpinned 0
