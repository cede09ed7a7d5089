"""Reference counts on KV locations.

A request holds one reference on every location of its context; a prefix state or a
prefix-cache entry holds one on each location of its prefix, which the requests starting from it
share. A location goes back to the allocator when its last reference is dropped. Counts live in one
numpy array indexed by location, grown to the highest location referenced (not to the allocator's
capacity, which may be 2**31), so a step's references are taken and dropped with one vectorised
call each instead of a Python loop.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from backend.allocator import KVAllocator
from ir.columns import I64, has_duplicates
from ir.errors import SlotError

__all__ = ["KVRefs"]

_SMALL = 64
"""Up to this many locations, ``ref`` and ``unref`` loop in Python: numpy's ``add.at`` and
``unique`` have a fixed cost larger than the loop at a decode or speculative step's sizes."""


class KVRefs:
    """Reference counts on the KV locations of one ``KVAllocator`` (see the module): locations are
    allocated with one reference (``alloc``), shared by taking more (``ref``) and freed when the last
    is dropped (``unref``, which refuses to drop a reference nobody holds)."""

    def __init__(self, kv: KVAllocator) -> None:
        self.kv = kv
        self._counts: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)

    @staticmethod
    def _array(locs: Iterable[int] | I64) -> npt.NDArray[np.int64]:
        if isinstance(locs, np.ndarray):
            return locs.astype(np.int64, copy=False)
        return np.fromiter(locs, dtype=np.int64)

    def _grow(self, hi: int) -> None:
        if hi > self._counts.shape[0]:
            grown = np.zeros(max(hi, 2 * self._counts.shape[0]), dtype=np.int64)
            grown[: self._counts.shape[0]] = self._counts
            self._counts = grown

    def ref(self, locs: Iterable[int] | I64) -> None:
        """Take one more reference on every entry of ``locs`` (a location repeated counts once per entry)."""
        arr = self._array(locs)
        if not arr.size:
            return
        if arr.shape[0] <= _SMALL:
            items = arr.tolist()
            self._grow(max(items) + 1)
            counts = self._counts
            for loc in items:  # (repeats count once each, as np.add.at does)
                counts[loc] += 1
            return
        self._grow(int(arr.max()) + 1)
        np.add.at(self._counts, arr, 1)

    def unref(self, locs: Iterable[int] | I64) -> None:
        """Drop one reference per entry; locations left with none go back to the allocator (in the
        order they appear in ``locs``). Dropping a reference nobody holds is a bookkeeping bug:
        ``SlotError`` naming the location, and nothing changes."""
        arr = self._array(locs)
        if not arr.size:
            return
        if int(arr.min()) >= 0:
            if arr.shape[0] <= _SMALL:
                self._unref_small(arr.tolist())
                return
            if int(arr.max()) < self._counts.shape[0] and not has_duplicates(arr):  # (a request's context): one reference each
                self._unref_once(arr)
                return
        uniq, first, times = np.unique(arr, return_index=True, return_counts=True)
        held = self._counts[uniq] if int(uniq[-1]) < self._counts.shape[0] else None
        if held is None or bool((held < times).any()):
            bad = int(uniq[-1]) if held is None else int(uniq[held < times][0])
            raise SlotError(f"KV location {bad}: a reference was dropped that nobody holds")
        self._counts[uniq] -= times
        freed = uniq[self._counts[uniq] == 0]
        if freed.size:
            order = np.argsort(first[self._counts[uniq] == 0], kind="stable")
            self.kv.free_many(freed[order].tolist())

    def _unref_once(self, arr: npt.NDArray[np.int64]) -> None:
        """``unref`` of distinct locations, all below the counts' length: the same check, error and
        order of the freed locations, without ``np.unique``'s bookkeeping."""
        held = self._counts[arr]
        short = held < 1
        if bool(short.any()):
            raise SlotError(f"KV location {int(arr[short].min())}: a reference was dropped that nobody holds")
        left = held - 1
        self._counts[arr] = left
        freed = arr[left == 0]
        if freed.size:
            self.kv.free_many(freed)

    def _unref_small(self, items: list[int]) -> None:
        """``unref`` of a few non-negative locations (a speculative step's rejected window tail) in
        Python: ``np.unique``'s sort costs more than the whole loop there. The same checks, the same
        error and the same order of the freed locations (first appearance in ``items``)."""
        times: dict[int, int] = {}
        for loc in items:  # (a dict keeps first-appearance order)
            times[loc] = times.get(loc, 0) + 1
        counts = self._counts
        top = max(times)
        if top >= counts.shape[0]:
            raise SlotError(f"KV location {top}: a reference was dropped that nobody holds")
        short = [loc for loc, t in times.items() if counts.item(loc) < t]
        if short:
            raise SlotError(f"KV location {min(short)}: a reference was dropped that nobody holds")
        freed = []
        for loc, t in times.items():
            left = counts.item(loc) - t
            counts[loc] = left
            if not left:
                freed.append(loc)
        if freed:
            self.kv.free_many(freed)

    def alloc(self, n: int) -> I64:
        """``n`` fresh locations, one reference each."""
        locs = self.kv.alloc_many(n)
        if locs.shape[0]:  # (fresh locations are distinct: one reference each, no repeats to count)
            self._grow(int(locs.max()) + 1)
            self._counts[locs] += 1
        return locs

    def count(self, loc: int) -> int:
        """References held on ``loc``."""
        return int(self._counts[loc]) if 0 <= loc < self._counts.shape[0] else 0

    @property
    def nbytes(self) -> int:
        """Host memory the counts take: they grow with the highest location referenced, not with
        the KV capacity."""
        return int(self._counts.nbytes)

    def held(self) -> dict[int, int]:
        """Every referenced location and its count."""
        nz = np.flatnonzero(self._counts)
        return dict(zip(nz.tolist(), self._counts[nz].tolist(), strict=True))
