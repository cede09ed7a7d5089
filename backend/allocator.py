"""Index allocators: Mamba state slots and attention KV locations.

``SlotAllocator`` hands out ``MambaSlot``s ``1..capacity`` (slot 0 is the reserved padding slot);
``KVAllocator`` hands out token-granular ``KVLoc``s ``1..capacity`` (location 0 is padding too).

Invariants: a live index is never handed out again; ``free`` of an index that is not live raises
``SlotError`` (double free, or never allocated) and changes nothing; ``check_live`` raises on use
after free; ``num_live + num_free == capacity`` at all times; a bulk allocation is all or nothing.
Allocation order is deterministic (lowest free index first after a reset; freed indices are reused
last-freed-first), so dumps of a scripted run are reproducible.

Arguments: capacities, counts and indices are ints (Python ints or numpy integer scalars, within
int64); ``bool``, ``float`` (``3.0`` too), ``str``, ``None`` and values outside int64 are refused
with ``SlotError`` naming the method's argument and the value, before anything changes. Bulk
allocations come back as IR-owned columns (``ir.columns.own``), so IR nodes take them without a copy.

Locking: every public method holds the allocator's lock, so a scheduler thread and a forward thread
may share one allocator.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Generic, TypeVar, cast

import numpy as np
import numpy.typing as npt

from ir.columns import I64, frozen_i64, has_duplicates, int_problem, plain_ints
from ir.errors import SlotError
from ir.ids import KVLoc, MambaSlot

__all__ = ["KVAllocator", "SlotAllocator"]

T = TypeVar("T", MambaSlot, KVLoc)
_BULK = 64
"""Frees of at least this many indices are checked and applied in numpy (a finished request's KV
locations); fewer go item by item, where numpy's fixed cost is the larger."""


class _IndexAllocator(Generic[T]):
    _what = "index"

    def __init__(self, capacity: int) -> None:
        capacity = self._int("(capacity)", capacity)
        if capacity <= 0:
            raise SlotError(f"{type(self).__name__}: capacity must be positive, got {capacity!r}")
        self.capacity = capacity
        # Memory grows with the indices handed out, not with the capacity (a capacity of 10**9
        # costs nothing until used): indices above ``_fresh`` were never handed out, ``_free``
        # holds the freed ones (reused last-freed-first, before fresh ones), ``_live[i]`` is
        # known for ``i <= _fresh``.
        self._fresh = 0
        self._free: list[int] = []
        self._live = bytearray(1)
        self._lock = threading.Lock()
        self._generation = 0

    @property
    def generation(self) -> int:
        """Bumped by every allocation and free: a liveness check made at one generation still
        holds while the generation is the same."""
        return self._generation

    @property
    def num_free(self) -> int:
        """How many indices can still be handed out: ``capacity - num_live``."""
        return len(self._free) + self.capacity - self._fresh

    @property
    def num_live(self) -> int:
        """How many indices are handed out and not yet freed."""
        return self._fresh - len(self._free)

    def _take(self, n: int) -> list[int]:
        """``n`` free indices (the caller checked there are), marked live: freed ones first (last
        freed first), then fresh ones in increasing order. Everything that allocates memory happens
        before any state changes, so a ``MemoryError`` (a bulk request far beyond what the process
        can hold) leaves the allocator as it was and comes back as ``SlotError``."""
        k = min(n, len(self._free))
        fresh = self._fresh + n - k
        try:
            taken = self._free[len(self._free) - k :][::-1]
            taken += range(self._fresh + 1, fresh + 1)
            grow = min(self.capacity + 1, max(fresh + 1, 2 * len(self._live))) - len(self._live) if fresh >= len(self._live) else 0
            self._live.extend(bytes(grow))
        except MemoryError:
            raise SlotError(f"out of memory handing out {n} {self._what}s at once") from None
        del self._free[len(self._free) - k :]
        self._fresh = fresh
        for i in taken:
            self._live[i] = 1
        self._generation += 1
        return taken

    def _is_live(self, i: int) -> bool:
        return 1 <= i <= self._fresh and bool(self._live[i])

    def _int(self, call: str, value: object) -> int:
        """``value`` as an ``int``, or ``SlotError`` naming the call and argument (``call`` is
        ``".free(index)"``) and the value."""
        problem = int_problem(value)
        if problem is not None:
            raise SlotError(f"{type(self).__name__}{call}: {problem} (got {value!r})")
        return int(cast(int, value))

    def _ints(self, call: str, values: object) -> list[int]:
        """Every entry as an ``int`` (``_int``'s rules); plain ``int`` lists and int arrays in one pass."""
        if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind == "i":
            return cast(list[int], values.tolist())  # signed numpy ints: every value is an int64 int
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise SlotError(f"{type(self).__name__}{call}: must be an iterable of {self._what}s (got {values!r})")
        items = list(values)
        if plain_ints(items):
            return cast(list[int], items)
        return [self._int(call, v) for v in items]

    def _check_range(self, i: int) -> None:
        if not 1 <= i <= self.capacity:
            raise SlotError(f"{self._what} {i} out of range [1, {self.capacity}]")

    def alloc(self) -> T:
        """One free index, marked live; ``SlotError`` when every index is live."""
        with self._lock:
            if not self.num_free:
                raise SlotError(f"out of {self._what}s: all {self.capacity} are live")
            return self._make(self._take(1)[0])

    def alloc_many(self, n: int) -> I64:
        """``n`` indices as an IR-owned (read-only) int64 column; all or nothing."""
        n = self._int(".alloc_many(n)", n)
        with self._lock:
            if n < 0:
                raise SlotError(f"cannot allocate {n} {self._what}s")
            if n > self.num_free:
                raise SlotError(f"out of {self._what}s: {n} requested, {self.num_free} free of {self.capacity}")
            taken = self._take(n)
        return frozen_i64(np.array(taken, dtype=np.int64))

    def free(self, index: int) -> None:
        """Free one live index; ``SlotError`` (and no change) if it is out of range or not live."""
        self._free_items([self._int(".free(index)", index)])

    def free_many(self, indices: Iterable[int]) -> None:
        """Free every index, or none if any is not live (or repeated)."""
        arr = indices if isinstance(indices, np.ndarray) and indices.ndim == 1 and indices.dtype == np.int64 else None
        self._free_items(self._ints(".free_many(indices)", indices), arr)

    def _free_items(self, items: list[int], arr: npt.NDArray[np.int64] | None = None) -> None:
        """``arr``: ``items`` as an int64 array when the caller has one (the bulk path uses it)."""
        with self._lock:
            if len(items) >= _BULK and self._free_bulk(items, arr):
                return
            seen: set[int] = set()
            for i in items:
                self._check_range(i)
                if not self._is_live(i) or i in seen:
                    raise SlotError(f"double free of {self._what} {i}: it is not live")
                seen.add(i)
            for i in items:
                self._live[i] = 0
                self._free.append(i)
            self._generation += 1

    def _free_bulk(self, items: list[int], arr: npt.NDArray[np.int64] | None) -> bool:
        """``_free_items`` for many indices at once, in numpy: frees them and returns True if every
        one is in range, live and not repeated; otherwise changes nothing and returns False (the
        item-by-item loop then names the first bad index)."""
        if arr is None:
            arr = np.array(items, dtype=np.int64)
        if int(arr.min()) < 1 or int(arr.max()) > self._fresh:
            return False
        live = np.frombuffer(self._live, dtype=np.uint8)  # a view: released before the bytearray can grow
        try:
            if not bool(live[arr].all()) or has_duplicates(arr):
                return False
            live[arr] = 0
        finally:
            del live
        self._free.extend(items)
        self._generation += 1
        return True

    def is_live(self, index: int) -> bool:
        """Whether ``index`` is handed out and not yet freed (an index out of range is not live)."""
        i = self._int(".is_live(index)", index)
        with self._lock:
            return self._is_live(i)

    def check_live(self, indices: Iterable[int], use: str) -> None:
        """Raise ``SlotError`` naming the first index that is not live (use after free)."""
        items = self._ints(".check_live(indices)", indices)
        with self._lock:
            for i in items:
                self._check_range(i)
                if not self._is_live(i):
                    raise SlotError(f"use after free: {use} uses {self._what} {i}, which is not live")

    def live(self) -> frozenset[int]:
        """Every live index, as a snapshot taken under the lock."""
        with self._lock:
            return frozenset(i for i in range(1, self._fresh + 1) if self._live[i])

    def _make(self, i: int) -> T:
        raise NotImplementedError


class SlotAllocator(_IndexAllocator[MambaSlot]):
    """Hands out Mamba state slots ``MambaSlot(1..capacity)``; slot 0 is the pool's padding slot and is
    never handed out. The scheduler allocates from it; an ``Executor`` given the same allocator
    (``slots``) refuses a plan that names a slot that is not live (use after free), COW sources
    included."""

    _what = "slot"

    def _make(self, i: int) -> MambaSlot:
        return MambaSlot(i)


class KVAllocator(_IndexAllocator[KVLoc]):
    """Hands out token-granular attention KV locations ``KVLoc(1..capacity)``; location 0 is padding and
    is never handed out. A prefill allocates one location per new token (``alloc_many``), a finished
    request frees them all at once (``free_many``, checked and applied in numpy for large frees)."""

    _what = "KV location"

    def _make(self, i: int) -> KVLoc:
        return KVLoc(i)
