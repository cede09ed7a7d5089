"""The Mamba prefix cache: the recurrent states of shared prompt prefixes.

An entry is a pool slot (the same slot id in the target and draft pools) holding the state
after a prefix, plus the KV locations of that prefix (shared read-only through the token tables:
attention pages of a cached prefix are reused, not recomputed). Prefixes are cut at multiples of
``block`` tokens.

Policy (decided by the scheduler through this object):

- ``observe`` counts, for each block boundary of a prompt, how many prompts started with that
  prefix; a prefix seen twice is worth caching;
- ``lookup`` finds the longest cached prefix strictly shorter than a prompt (a hit: the request's
  slot starts as a COW of the entry's slot); ``plan_snapshot`` picks where to take a new one: the
  longest shared, uncached boundary past the hit;
- an entry is created by a snapshot op after the forward whose chunk ends exactly at that
  boundary (the scheduler aligns the chunk), through the same tickets and ledger as init ops;
- entries are evicted least recently used first; an entry pinned by a request whose COW has not
  run yet is never evicted.

The cache holds no tensors and allocates nothing: the scheduler owns slots and KV references.

Arguments are checked before anything changes (``PrefixCacheError`` naming the method, the argument
and the bad value): token sequences are lists, tuples, ``range``s, ``bytes`` or 1-D integer arrays of
ints >= 0 (numpy integers too; never ``bool``, ``float``, ``str`` or ``None``); entries are
``CacheEntry`` records whose slot is an int, whose tokens and KV locations are tuples of ints of one
length, and whose prefix ends at a block boundary; ``pin`` and ``unpin`` take an entry of this cache.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import cast

import attrs
import numpy as np

from ir.columns import first_bad_int, int_problem, plain_ints
from ir.errors import BatchcError, short_repr
from ir.ids import MambaSlot

__all__ = ["CacheEntry", "CacheStats", "PrefixCache", "PrefixCacheError"]


class PrefixCacheError(BatchcError, ValueError):
    """The prefix cache's protocol was misused (an unpin of an entry not pinned, an insert without
    a reservation or of a prefix already cached); the cache is unchanged."""


@attrs.define(kw_only=True)
class CacheEntry:
    """One cached prefix: the cache ``slot`` holding the state after ``tokens`` (in every pool), the KV
    locations of those tokens, and how many requests pin it (a pinned entry is never evicted)."""

    slot: MambaSlot
    tokens: tuple[int, ...]
    kv_locs: tuple[int, ...]
    pins: int = 0


@attrs.define
class CacheStats:
    """The cache's counters: ``lookups`` and their ``hits`` (and the prompt tokens the hits covered),
    ``snapshots`` inserted and ``evictions``."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    snapshots: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """The share of lookups that hit (0.0 before any lookup)."""
        return self.hits / self.lookups if self.lookups else 0.0


class PrefixCache:
    """The prefix cache's bookkeeping (see the module): which prefixes are worth a snapshot, which are
    cached in which slot, in LRU order, and which are pinned. ``capacity`` entries at most (reserved
    ones count), prefixes cut at multiples of ``block`` tokens; both ints >= 1, else
    ``PrefixCacheError``. It holds no tensor and allocates nothing: the engine owns the slots and KV
    references and calls it through ``compiler.engine.cache_session``."""

    def __init__(self, *, capacity: int, block: int = 16) -> None:
        for name, value in (("capacity", capacity), ("block", block)):
            problem = int_problem(value)
            if problem is not None:
                raise PrefixCacheError(f"PrefixCache({name}): {problem} (got {value!r})")
            if value < 1:
                raise PrefixCacheError(f"PrefixCache({name}): must be >= 1 (got {value!r})")
        self.capacity = int(capacity)
        self.block = int(block)
        self._entries: OrderedDict[tuple[int, ...], CacheEntry] = OrderedDict()  # LRU order: oldest first
        self._seen: Counter[tuple[int, ...]] = Counter()
        self._planned: set[tuple[int, ...]] = set()  # snapshots promised to a request, not yet taken
        self._reserved = 0  # entries promised to snapshots in flight
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> tuple[CacheEntry, ...]:
        """The cached entries, least recently used first."""
        return tuple(self._entries.values())

    def observed(self) -> dict[tuple[int, ...], int]:
        """A copy of how many observed prompts started with each block-boundary prefix (what
        ``plan_snapshot`` decides by)."""
        return dict(self._seen)

    def planned(self) -> frozenset[tuple[int, ...]]:
        """The prefixes ``plan_snapshot`` promised to a request and no ``insert`` or
        ``cancel_plan`` has settled yet."""
        return frozenset(self._planned)

    @property
    def reserved(self) -> int:
        """Entries promised to snapshots in flight (``reserve_room`` not yet followed by ``insert``
        or ``release_room``): they count against ``capacity``."""
        return self._reserved

    def _boundaries(self, n: int) -> range:
        """Block boundaries strictly inside a prompt of ``n`` tokens, longest first."""
        return range((n - 1) // self.block * self.block, 0, -self.block)

    def _tokens(self, method: str, name: str, tokens: object) -> tuple[int, ...]:
        """``tokens`` as a tuple of Python ints, or ``PrefixCacheError`` naming ``method(name)`` and
        the bad value (nothing is converted silently: ``'abc'``, ``[1.5]``, ``[True]``, ``None`` are
        refused)."""
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise PrefixCacheError(f"{method}({name}): must be a 1-D integer array, got dtype {tokens.dtype} and shape {tokens.shape}")
            # an integer array holds ints by its dtype: only the sign is left to check
            if tokens.size and int(tokens.min()) < 0:
                raise PrefixCacheError(f"{method}({name}): token ids must be >= 0 (got {int(tokens.min())})")
            return tuple(tokens.tolist())
        items: Sequence[object]
        if isinstance(tokens, (list, tuple, range, bytes)):
            items = tokens
        else:
            raise PrefixCacheError(f"{method}({name}): must be a sequence of token ids, not {type(tokens).__name__} (got {short_repr(tokens)})")
        if plain_ints(items):
            values = tuple(cast("Sequence[int]", items))  # the common case, decided in C loops
        else:
            bad = first_bad_int(items)
            if bad is not None:
                raise PrefixCacheError(f"{method}({name}): every token id {bad[1]} (got {short_repr(bad[0])})")
            values = tuple(int(cast(int, v)) for v in items)
        if values and min(values) < 0:
            raise PrefixCacheError(f"{method}({name}): token ids must be >= 0 (got {min(values)})")
        return values

    def _entry(self, method: str, entry: object) -> CacheEntry:
        """``entry`` when it is a well-formed ``CacheEntry``, else ``PrefixCacheError``."""
        if not isinstance(entry, CacheEntry):
            raise PrefixCacheError(f"{method}(entry): must be a CacheEntry, not {type(entry).__name__} (got {short_repr(entry)})")
        problem = int_problem(entry.slot)
        if problem is not None:
            raise PrefixCacheError(f"{method}(entry): slot {problem} (got {short_repr(entry.slot)})")
        for name, values in (("tokens", entry.tokens), ("kv_locs", entry.kv_locs)):
            if type(values) is not tuple:
                raise PrefixCacheError(f"{method}(entry): {name} must be a tuple of ints, not {type(values).__name__} (got {short_repr(values)})")
            bad = first_bad_int(values)
            if bad is not None:
                raise PrefixCacheError(f"{method}(entry): every {name} entry {bad[1]} (got {short_repr(bad[0])})")
        if entry.slot < 1:
            raise PrefixCacheError(f"{method}(entry): slot must be a cache slot >= 1 (slot 0 is the padding slot), got {entry.slot}")
        for name, values in (("tokens", entry.tokens), ("kv_locs", entry.kv_locs)):
            if values and min(values) < 0:
                raise PrefixCacheError(f"{method}(entry): every {name} entry must be >= 0 (got {min(values)})")
        problem = int_problem(entry.pins)
        if problem is not None or entry.pins < 0:
            raise PrefixCacheError(f"{method}(entry): pins must be an int >= 0 (got {short_repr(entry.pins)})")
        return entry

    def _cached(self, method: str, entry: object) -> CacheEntry:
        """``entry`` when it is one of this cache's entries (the very record), else ``PrefixCacheError``."""
        e = self._entry(method, entry)
        if self._entries.get(e.tokens) is not e:
            raise PrefixCacheError(f"{method}(entry): the entry of slot {e.slot} ({len(e.tokens)} tokens) is not in this cache")
        return e

    def observe(self, tokens: Sequence[int]) -> None:
        """Count ``tokens``'s block-boundary prefixes (a prefix seen twice is worth a snapshot)."""
        values = self._tokens("observe", "tokens", tokens)
        for m in self._boundaries(len(values)):
            self._seen[values[:m]] += 1

    def lookup(self, tokens: Sequence[int]) -> CacheEntry | None:
        """The entry of the longest cached prefix strictly shorter than ``tokens``, or ``None``."""
        tokens = self._tokens("lookup", "tokens", tokens)
        self.stats.lookups += 1
        for m in self._boundaries(len(tokens)):
            entry = self._entries.get(tuple(tokens[:m]))
            if entry is not None:
                self._entries.move_to_end(entry.tokens)
                self.stats.hits += 1
                self.stats.hit_tokens += m
                return entry
        return None

    def plan_snapshot(self, tokens: Sequence[int], after: int) -> int | None:
        """The boundary to snapshot at (> ``after``, shared by at least two prompts, neither cached
        nor promised to another request); the caller then owes ``insert`` or ``cancel_plan``."""
        tokens = self._tokens("plan_snapshot", "tokens", tokens)
        problem = int_problem(after)
        if problem is not None:
            raise PrefixCacheError(f"plan_snapshot(after): {problem} (got {short_repr(after)})")
        if after < 0:
            raise PrefixCacheError(f"plan_snapshot(after): must be >= 0 (got {after})")
        for m in self._boundaries(len(tokens)):
            if m <= after:
                return None
            key = tuple(tokens[:m])
            if self._seen[key] >= 2 and key not in self._entries and key not in self._planned:
                self._planned.add(key)
                return m
        return None

    def cancel_plan(self, tokens: Sequence[int]) -> None:
        """Drop the promise ``plan_snapshot`` made for the prefix ``tokens`` (nothing if there is none)."""
        self._planned.discard(self._tokens("cancel_plan", "tokens", tokens))

    def reserve_room(self) -> bool:
        """Promise one entry to a snapshot in flight; False when the cache is full."""
        if len(self._entries) + self._reserved >= self.capacity:
            return False
        self._reserved += 1
        return True

    def release_room(self) -> None:
        """Give back a reservation ``reserve_room`` made (``PrefixCacheError`` when there is none)."""
        if self._reserved <= 0:
            raise PrefixCacheError("release_room without a reservation")
        self._reserved -= 1

    def insert(self, entry: CacheEntry) -> None:
        """Add the entry a reservation was made for (its prefix ends at a block boundary and it has
        one KV location per token, not pinned)."""
        entry = self._entry("insert", entry)
        n = len(entry.tokens)
        if n == 0 or n % self.block:
            raise PrefixCacheError(f"insert(entry): a prefix of {n} tokens does not end at a block boundary (block {self.block})")
        if len(entry.kv_locs) != n:
            raise PrefixCacheError(f"insert(entry): {len(entry.kv_locs)} KV locations for {n} tokens")
        if entry.pins:
            raise PrefixCacheError(f"insert(entry): a new entry must not be pinned (got pins={entry.pins})")
        if entry.tokens in self._entries:
            raise PrefixCacheError(f"prefix of {len(entry.tokens)} tokens is already cached in slot {self._entries[entry.tokens].slot}")
        self.release_room()
        self._entries[entry.tokens] = entry
        self._planned.discard(entry.tokens)
        self.stats.snapshots += 1

    def evict_lru(self) -> CacheEntry | None:
        """Remove and return the least recently used unpinned entry (``None`` if all are pinned)."""
        for key, entry in self._entries.items():
            if entry.pins == 0:
                del self._entries[key]
                self.stats.evictions += 1
                return entry
        return None

    def pin(self, entry: CacheEntry) -> None:
        """Keep ``entry`` (one of this cache's) from eviction until ``unpin``."""
        entry = self._cached("pin", entry)
        entry.pins += 1

    def unpin(self, entry: CacheEntry) -> None:
        """Undo one ``pin`` of ``entry`` (one of this cache's); ``PrefixCacheError`` if it is not pinned."""
        entry = self._cached("unpin", entry)
        if entry.pins <= 0:
            raise PrefixCacheError(f"unpin of cache slot {entry.slot}, which is not pinned")
        entry.pins -= 1
