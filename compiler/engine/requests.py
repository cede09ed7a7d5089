"""The engine's request table: every live request, its state, and the order prefills are served in.

A request moves through these states (``RequestState``)::

    admit --> WAITING --(slot + prefix source)--> PREFILLING --(last chunk)--> RUNNING
                 ^                                     |                          |
                 +------------- retract ---------------+--------------------------+
    any live state --(finish | abort | failed forward | non-finite logits)--> gone (its output is recorded)

WAITING requests have no slot yet; PREFILLING ones hold a slot and have part of their prompt in
their state; RUNNING ones decode. Retraction sends a PREFILLING or RUNNING request back to WAITING
(first in line, its prompt extended by the output so far): no WAITING request starts before it, and
prefills already started keep getting their chunks (``compiler.engine.chunks``). The table only
keeps the records; what a request holds (slot, KV references, prefix-cache reservations) is freed by
the engine's one release path, which every ending (finish, abort, retraction, failure) goes through.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from compiler.engine.report import PrefixState
from compiler.prefix_cache import CacheEntry
from ir.columns import I64
from ir.ids import MambaSlot, RequestId
from ir.sampling import GREEDY, SamplingParams

__all__ = ["Ending", "Request", "RequestState", "RequestTable"]


class RequestState(enum.Enum):
    """Where a live request is (see the module): waiting for its slot, prefilling its prompt, or
    running (decoding or speculating)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"


class Ending(enum.Enum):
    """Why a request left the running set: the one release path is told which."""

    FINISHED = "finished"  # max_new_tokens, its stop token, or Engine.finish (a stop string)
    ABORTED = "aborted"  # the user's abort
    FAILED = "failed"  # a forward carrying it failed after every retry
    ERROR = "error"  # the logits for its next token were not finite (NaN or infinity)
    RETRACTED = "retracted"  # out of KV: back to WAITING, re-prefilled later


@attrs.define(kw_only=True)
class Request:
    """One live request's record in the engine's table: its prompt and bounds, where its state comes
    from, its slot and context (KV locations), its output so far and how its tokens are chosen.
    Mutable: the engine's parts update it as the request moves through its states."""

    rid: RequestId
    prompt: I64
    """The tokens to prefill: the prompt, plus the output so far after a retraction."""
    original: I64
    """The prompt as admitted."""
    max_new_tokens: int
    stop: frozenset[int]
    """Token ids that end the request once emitted (empty: none)."""
    source: PrefixState | CacheEntry | None = None
    """Where the slot's first state comes from (a COW), or ``None`` (a clear)."""
    state: RequestState = RequestState.WAITING
    slot: MambaSlot | None = None
    done: int = 0
    """Prompt tokens already in the state."""
    snapshot_at: int | None = None
    """Prefix boundary to snapshot into the prefix cache."""
    snapshot_slot: MambaSlot | None = None
    context: list[int] = attrs.Factory(list)
    """KV location of every context position (one reference each)."""
    output: list[int] = attrs.Factory(list)
    pending: int | None = None
    """The last emitted token: the next decode's input."""
    retractions: int = 0
    sampling: SamplingParams = GREEDY
    """How its tokens are chosen (seeded when sampled: ``SamplingParams.seeded``)."""
    index: int = 0
    """Its completion index among its prompt's ``n`` (the random stream's key has it)."""
    logprobs: list[dict[str, Any]] | None = None
    """With ``sampling.logprobs`` set: one entry per output token (``ir.results.Logprobs.entry``
    with the token's ``id``), kept in step with ``output``."""

    @property
    def start(self) -> int:
        """The first prompt position this request computes (the length of its prefix source)."""
        return len(self.source.tokens) if self.source is not None else 0

    @property
    def next_pos(self) -> int:
        """Where its next prefill chunk starts."""
        return self.done if self.done else self.start

    def _first_stop(self, out: list[int]) -> int | None:
        """Where the first stop id that ends ``out`` is: at an index >= ``sampling.min_tokens``
        (a stop id before ``min_tokens`` tokens ends nothing), or ``None``. The sampler bans the
        stop ids before ``min_tokens`` (``Forwards._sampling``), so with the bundled models none
        comes there; this keeps the rule for a model hook whose verify returns tokens instead of
        logits, which no ban reaches."""
        if not self.stop:
            return None
        return next((i for i in range(self.sampling.min_tokens, len(out)) if out[i] in self.stop), None)

    def is_done(self) -> bool:
        """Whether the request has what it needs: ``max_new_tokens`` tokens, or a stop id at an index at or
        past ``sampling.min_tokens``."""
        return len(self.output) >= self.max_new_tokens or (bool(self.stop) and self._first_stop(self.output) is not None)

    def final_output(self) -> list[int]:
        """The output as reported: cut at ``max_new_tokens`` and after the first stop token that
        ends it (at an index >= ``sampling.min_tokens``)."""
        out = self.output[: self.max_new_tokens]
        at = self._first_stop(out)
        return out if at is None else out[: at + 1]


class RequestTable:
    """Live requests by id, and the prefill queue (WAITING and PREFILLING, in serving order)."""

    def __init__(self) -> None:
        self._reqs: dict[RequestId, Request] = {}
        self._queue: list[RequestId] = []

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def __getitem__(self, rid: RequestId) -> Request:
        return self._reqs[rid]

    def records(self, rids: Iterable[RequestId]) -> list[Request]:
        """The live records of ``rids``, in order (``KeyError`` for one that is not live): one call
        for a step's rows instead of one lookup each."""
        return list(map(self._reqs.__getitem__, rids))

    def get(self, rid: RequestId) -> Request | None:
        """The live record of ``rid``, or None."""
        return self._reqs.get(rid)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs.values())

    def add(self, r: Request) -> None:
        """A new WAITING request, at the end of the queue (a retracted one comes back through
        ``requeue``, at its head)."""
        assert r.state is RequestState.WAITING and r.slot is None
        self._reqs[r.rid] = r
        self._queue.append(r.rid)

    @property
    def queued(self) -> list[RequestId]:
        """Requests waiting for (more of) their prefill, in the order they are served."""
        return list(self._queue)

    @property
    def has_queued(self) -> bool:
        """Whether any request waits for (more of) its prefill."""
        return bool(self._queue)

    @property
    def num_queued(self) -> int:
        """How many requests wait for (more of) their prefill."""
        return len(self._queue)

    def started(self, r: Request, slot: MambaSlot) -> None:
        """``r`` got its ``slot``: it goes from WAITING to PREFILLING (it stays in the queue)."""
        assert r.state is RequestState.WAITING
        r.slot, r.state = slot, RequestState.PREFILLING

    def prefilled(self, r: Request) -> None:
        """Its last prompt chunk ran: it decodes from now on."""
        assert r.state is RequestState.PREFILLING
        r.state = RequestState.RUNNING
        self._queue.remove(r.rid)

    def requeue(self, r: Request) -> None:
        """A retracted request's fresh WAITING record, replacing its old one, first in the queue: the
        chunk planner starts WAITING requests in queue order, so no later arrival starts before it,
        while the prefills already started behind it are still served."""
        assert r.rid in self._reqs and r.state is RequestState.WAITING and r.slot is None
        if self._reqs[r.rid].state is not RequestState.RUNNING:
            self._queue.remove(r.rid)
        self._reqs[r.rid] = r
        self._queue.insert(0, r.rid)

    def remove(self, rid: RequestId) -> Request:
        """Drop ``rid``'s record (and its place in the queue) and return it; ``KeyError`` if it is not live."""
        r = self._reqs.pop(rid)
        if r.state is not RequestState.RUNNING:
            self._queue.remove(rid)
        return r

    def kv_owed(self) -> int:
        """KV locations that started, unfinished prefills still need for the rest of their prompts
        (from ``next_pos``: a prefix source's positions hold their KV already)."""
        return sum(int(r.prompt.shape[0]) - r.next_pos for r in map(self._reqs.__getitem__, self._queue) if r.state is RequestState.PREFILLING)
