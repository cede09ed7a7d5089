"""Prefill chunking: which waiting requests get their next prompt chunk in this step, and how long.

Requests are served in queue order. A WAITING request first gets its slot and its prefix source (a
prefix it was admitted with, or the longest prefix the cache holds), and only if the KV for its
whole prompt (but the prefix it was admitted with, whose KV that prefix holds already) fits next to
what the started prefills still need (``RequestTable.kv_owed``). Two rules
keep every request moving under any KV pressure:

- A started (PREFILLING) request is served wherever it stands in the queue: a WAITING request ahead
  of it that cannot start does not hold it back. (A retracted request goes back to the head of the
  queue, ahead of prefills already under way; if those waited behind it, the KV they hold would keep
  it from starting and it would keep them from finishing, and the engine would idle with requests
  live.) A started prefill whose next chunk does not fit the free KV first evicts unpinned
  prefix-cache entries; KV that running requests took since it started comes back when they finish
  or are retracted (KV that a prefix state made since took, when it is released), so once nothing
  runs every started prefill finishes.
- WAITING requests start strictly in queue order: once one cannot start (no slot, or its KV does not
  fit), no WAITING request behind it starts in that step, so a request at the head (a retracted one)
  is never overtaken by later arrivals and starts as soon as what runs ahead of it has finished or
  been retracted.

Each chunk is at most ``chunk_size`` tokens, all of them together at most ``token_budget``. A chunk
that reaches the prefix boundary the cache wants a snapshot of carries the snapshot: at that position
inside the chunk (``AdmittedRequest.snapshot_at``) when every served model captures states inside a
chunk (``inner_snapshots``), so the boundary costs no forward; else the chunk stops at the boundary
and the snapshot is the state it leaves.
"""

from __future__ import annotations

from collections.abc import Callable

from backend.allocator import KVAllocator, SlotAllocator
from compiler.engine.cache_session import CacheSession
from compiler.engine.kv_refs import KVRefs
from compiler.engine.requests import Request, RequestState, RequestTable
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom, Intent

__all__ = ["ChunkPlanner"]


class ChunkPlanner:
    """Chooses each step's prefill chunks (see the module): which waiting requests start, from which
    prefix source, and how many prompt tokens each prefills, within ``chunk_size`` per request and
    ``token_budget`` per forward. A request starts only when its whole prompt's KV fits beside what the
    started prefills still need, started prefills get their chunks wherever they stand in the queue,
    and WAITING requests start in queue order only, so started prefills always finish and a waiting
    request is never overtaken by one behind it."""

    def __init__(
        self,
        *,
        requests: RequestTable,
        slots: SlotAllocator,
        kv: KVAllocator,
        kv_refs: KVRefs,
        session: CacheSession,
        share_prefix: Callable[[int, int, int], None],
        chunk_size: int,
        token_budget: int,
        inner_snapshots: bool = False,
    ) -> None:
        self.requests, self.slots, self.kv, self.kv_refs, self.session = requests, slots, kv, kv_refs, session
        self.share_prefix = share_prefix
        self.chunk_size, self.token_budget = chunk_size, token_budget
        self.inner_snapshots = inner_snapshots

    def start(self, r: Request, owed: int) -> bool:
        """Give a request its slot and prefix source before its first chunk; False if none is free,
        or if the KV for its whole prompt does not fit next to what started prefills still need
        (``owed``: ``requests.kv_owed()``, which the caller keeps up to date). A prefix it was
        admitted with (a prefix state, the shared prompt of ``n`` completions) holds its KV already:
        only the rest is needed (asking for the whole prompt, such a request would never start
        where the prefix took the room)."""
        while self.kv.num_free < owed + int(r.prompt.shape[0]) - r.start:
            if not self.session.evict():
                return False
        if self.slots.num_free == 0 and not self.session.evict():
            return False
        self.requests.started(r, self.slots.alloc())
        assert r.slot is not None
        if r.source is None:
            r.source = self.session.source_for(r.prompt)
        if r.source is not None:
            self.kv_refs.ref(r.source.kv_locs)
            r.context.extend(r.source.kv_locs)
            self.share_prefix(int(r.source.slot), int(r.slot), r.start)
        r.snapshot_at = self.session.plan_snapshot(r.prompt, r.start)
        return True

    def next_chunks(self) -> list[AdmittedRequest]:
        """The next prefill chunk of each queued request, in queue order, within the token budget,
        the free slots and the free KV locations (allocated here). A started prefill gets its chunk
        even behind a WAITING request that cannot start; no WAITING request starts behind one that
        cannot (see the module)."""
        admitted: list[AdmittedRequest] = []
        budget = self.token_budget
        owed = self.requests.kv_owed()  # kept up to date below: summing it per start is quadratic in the queue
        blocked = False  # a WAITING request could not start: none behind it starts in this step
        for rid in self.requests.queued:
            r = self.requests[rid]
            if budget <= 0:
                break
            if r.state is RequestState.WAITING:
                if blocked or not self.start(r, owed):
                    blocked = True
                    continue  # the started prefills behind it are still served
                owed += int(r.prompt.shape[0]) - r.next_pos  # what kv_owed() now counts for r
            assert r.slot is not None
            pos = r.next_pos
            n = min(self.chunk_size, budget, int(r.prompt.shape[0]) - pos)
            if r.snapshot_at is not None and pos < r.snapshot_at and not self.inner_snapshots:
                n = min(n, r.snapshot_at - pos)
            while n > self.kv.num_free and self.session.evict():
                pass
            if n > self.kv.num_free:
                # running requests hold the KV it is owed until they finish or are retracted; what it
                # owes is more than is free, so nothing behind it could start either
                blocked = True
                continue
            snap_to = snap_at = None
            if r.snapshot_at is not None and pos < r.snapshot_at <= pos + n:
                snap_to = r.snapshot_slot = self.session.snapshot_slot(r.prompt, r.snapshot_at)
                if snap_to is None:
                    r.snapshot_at = None  # no room: skip this snapshot
                elif r.snapshot_at < pos + n:
                    snap_at = r.snapshot_at - pos
            kv = self.kv_refs.alloc(n)
            owed -= n  # the chunk's locations are allocated: r owes n fewer (num_free fell by n already)
            r.context.extend(kv.tolist())
            intent: Intent
            if r.done:
                intent = Continue(prefix_len=pos)
            elif r.source is not None:
                intent = CopyFrom(src=r.source.slot, prefix_len=pos)
            else:
                intent = Clear()
            admitted.append(
                AdmittedRequest(
                    rid=rid, slot=r.slot, input_ids=r.prompt[pos : pos + n], kv_locs=kv, intent=intent,
                    more_chunks=pos + n < r.prompt.shape[0], snapshot_to=snap_to, snapshot_at=snap_at,
                )
            )
            budget -= n
        return admitted
