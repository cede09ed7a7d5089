"""The engine's side of the prefix-cache protocol, in one object.

A request that starts from a cached prefix pins the entry until its COW has run (``source_for``,
``copied``); a prefill chunk that ends at a prefix worth caching reserves room and a slot first
(``snapshot_slot``), and after the forward the snapshot becomes an entry (``insert``); a request that
ends before any of that happened gives back what it reserved (``abandon``). Evicting an entry
returns its slot and its KV references. With caching off the engine holds ``NoCache``, which
answers every question with "nothing", so the engine has no ``if cache is not None`` branches.
"""

from __future__ import annotations

from typing import Protocol

from backend.allocator import SlotAllocator
from compiler.engine.kv_refs import KVRefs
from compiler.engine.requests import Request
from compiler.prefix_cache import CacheEntry, PrefixCache
from ir.columns import I64
from ir.ids import MambaSlot

__all__ = ["CacheSession", "NoCache", "PrefixCacheSession"]


class CacheSession(Protocol):
    """What the engine asks of the prefix cache over a request's life (see the module): one object,
    ``NoCache`` when caching is off, ``PrefixCacheSession`` when it is on."""

    def observe(self, prompt: I64) -> None:
        """A request with this prompt was admitted (prefixes seen twice are worth a snapshot)."""
        ...

    def source_for(self, prompt: I64) -> CacheEntry | None:
        """The entry of the longest cached prefix of ``prompt``, pinned until ``copied``, or None."""
        ...

    def plan_snapshot(self, prompt: I64, start: int) -> int | None:
        """Where to snapshot ``prompt``'s prefix (a position after ``start``), or None."""
        ...

    def snapshot_slot(self, prompt: I64, at: int) -> MambaSlot | None:
        """Room and a slot for the snapshot planned at ``at`` (evicting if needed), or None: then
        the plan is cancelled and the chunk runs without a snapshot."""
        ...

    def copied(self, source: object) -> None:
        """The first chunk of a request ran: its COW from ``source`` is done (unpins a cache entry)."""
        ...

    def insert(self, slot: MambaSlot, tokens: tuple[int, ...], kv_locs: tuple[int, ...]) -> None:
        """The snapshot into ``slot`` ran: it becomes an entry holding references on ``kv_locs``."""
        ...

    def abandon(self, r: Request) -> None:
        """``r`` leaves (any ending): give back its pin, its reserved room and slot, its plan."""
        ...

    def evict(self) -> bool:
        """Evict the least recently used unpinned entry (its slot and KV go back); False if none."""
        ...


class NoCache:
    """Caching off."""

    def observe(self, prompt: I64) -> None:
        """Nothing is counted."""
        pass

    def source_for(self, prompt: I64) -> CacheEntry | None:
        """Always None: no request starts from a cached prefix."""
        return None

    def plan_snapshot(self, prompt: I64, start: int) -> int | None:
        """Always None: no snapshot is planned."""
        return None

    def snapshot_slot(self, prompt: I64, at: int) -> MambaSlot | None:
        """Never called (no snapshot is planned); raises ``AssertionError`` if it is."""
        raise AssertionError("no snapshot is ever planned without a cache")

    def copied(self, source: object) -> None:
        """Nothing is pinned, so nothing to unpin."""
        pass

    def insert(self, slot: MambaSlot, tokens: tuple[int, ...], kv_locs: tuple[int, ...]) -> None:
        """Never called (no snapshot is planned); raises ``AssertionError`` if it is."""
        raise AssertionError("no snapshot is ever planned without a cache")

    def abandon(self, r: Request) -> None:
        """Nothing was reserved for ``r``."""
        assert r.snapshot_at is None and r.snapshot_slot is None

    def evict(self) -> bool:
        """Always False: there is no entry."""
        return False


class PrefixCacheSession:
    """The protocol over a ``PrefixCache``, the engine's slot allocator and its KV references."""

    def __init__(self, cache: PrefixCache, slots: SlotAllocator, refs: KVRefs) -> None:
        self.cache, self.slots, self.refs = cache, slots, refs

    def observe(self, prompt: I64) -> None:
        """Count ``prompt``'s prefixes (``PrefixCache.observe``)."""
        self.cache.observe(prompt.tolist())

    def source_for(self, prompt: I64) -> CacheEntry | None:
        """The longest cached prefix of ``prompt``, pinned (not evictable) until ``copied``; None if none."""
        entry = self.cache.lookup(prompt.tolist())
        if entry is not None:
            self.cache.pin(entry)  # not evictable until the COW has run
        return entry

    def plan_snapshot(self, prompt: I64, start: int) -> int | None:
        """``PrefixCache.plan_snapshot``: where to snapshot ``prompt``'s prefix after ``start``, or None."""
        return self.cache.plan_snapshot(prompt.tolist(), start)

    def snapshot_slot(self, prompt: I64, at: int) -> MambaSlot | None:
        """Reserve room in the cache and a free slot for the snapshot at ``at``, evicting unpinned entries if
        needed; None (the plan cancelled, nothing kept) when either cannot be had."""
        room = self.cache.reserve_room() or (self.evict() and self.cache.reserve_room())
        if room and (self.slots.num_free or self.evict()):
            return self.slots.alloc()
        if room:
            self.cache.release_room()
        self.cache.cancel_plan(prompt[:at].tolist())
        return None

    def copied(self, source: object) -> None:
        """Unpin ``source`` when it is a cache entry (its COW has run); anything else is ignored."""
        if isinstance(source, CacheEntry):
            self.cache.unpin(source)

    def insert(self, slot: MambaSlot, tokens: tuple[int, ...], kv_locs: tuple[int, ...]) -> None:
        """The snapshot into ``slot`` ran: add the entry, taking a reference on each of ``kv_locs``."""
        self.refs.ref(kv_locs)
        self.cache.insert(CacheEntry(slot=slot, tokens=tokens, kv_locs=kv_locs))

    def abandon(self, r: Request) -> None:
        """Give back what ``r`` holds: the pin of a source it never copied, its reserved snapshot slot and
        room, and its planned snapshot."""
        if r.done == 0 and r.slot is not None:
            self.copied(r.source)  # its COW never ran
        if r.snapshot_slot is not None:
            self.slots.free(r.snapshot_slot)
            self.cache.release_room()
        if r.snapshot_at is not None:
            self.cache.cancel_plan(r.prompt[: r.snapshot_at].tolist())

    def evict(self) -> bool:
        """Evict the least recently used unpinned entry, freeing its slot and its KV references; False if
        there is none."""
        entry = self.cache.evict_lru()
        if entry is None:
            return False
        self.slots.free(entry.slot)
        self.refs.unref(entry.kv_locs)
        return True
