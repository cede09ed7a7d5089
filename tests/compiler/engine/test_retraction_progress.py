"""Progress under KV pressure: a retraction never deadlocks the engine, and a retracted request is
never starved (``compiler.engine.chunks``).

A retracted request goes back to the head of the prefill queue, ahead of prefills already under way.
If the chunk planner stopped at the first WAITING request that cannot start, a started prefill
behind it would wait for the KV the retracted request needs, while holding KV the retracted request
needs: with nothing running, the engine would idle with requests live. The planner serves started
prefills wherever they stand in the queue, and starts WAITING requests in queue order only.

The property (``test_every_request_finishes_within_the_bound_with_the_greedy_tokens``) serves a few
requests at random KV capacities (each request fits alone, some barely), ``k``, chunk sizes, token
budgets, slot counts, scheduling policies, prefix caches (or none) and arrival orders (some arrive
just when they barely fit), and checks that no step idles while a request is live, that every
request ends within ``step_bound`` steps (derived there) and that every output equals the
from-scratch greedy reference (``tests.helpers.greedy_reference``: the target alone, one request at
a time, no pool, cache or scheduler). Its CI run is derandomized (5 drawn examples and one pinned
run) and takes a few seconds; ``BATCHC_FUZZ_PROFILE=long`` (the fuzzer's switch,
``tests/hypothesis_profiles.py``) runs 300 examples, randomized (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from backend.allocator import KVAllocator, SlotAllocator
from compiler.engine import Engine, StepKind
from compiler.engine.cache_session import NoCache
from compiler.engine.chunks import ChunkPlanner
from compiler.engine.kv_refs import KVRefs
from compiler.engine.policy import ALTERNATE, PrefillFirst
from compiler.engine.requests import Request, RequestState, RequestTable
from compiler.prefix_cache import PrefixCache
from ir.columns import frozen_i64
from ir.ids import RequestId
from tests.helpers import engine, greedy_reference
from tests.hypothesis_profiles import FUZZ_LONG


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """The tiny model's ops are microseconds long: a second intra-op thread on a busy 2-core machine
    only waits for a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the chunk planner on its own ----------------------------------------------------------------


class _OneEntryCache(NoCache):
    """A prefix cache holding one entry's KV references, which ``evict`` drops (no slot)."""

    def __init__(self, refs: KVRefs, locs: list[int]) -> None:
        self.refs, self.locs = refs, locs

    def evict(self) -> bool:
        if not self.locs:
            return False
        self.refs.unref(self.locs)
        self.locs = []
        return True


def _planner(kv_capacity: int, *, chunk_size: int, budget: int = 64, slots: int = 4) -> tuple[ChunkPlanner, RequestTable, KVRefs]:
    kv = KVAllocator(kv_capacity)
    table, refs = RequestTable(), KVRefs(kv)
    planner = ChunkPlanner(
        requests=table, slots=SlotAllocator(slots), kv=kv, kv_refs=refs, session=NoCache(),
        share_prefix=lambda src, dst, n: None, chunk_size=chunk_size, token_budget=budget,
    )
    return planner, table, refs


def _waiting(rid: int, n: int) -> Request:
    p = frozen_i64(list(range(1, n + 1)))
    return Request(rid=RequestId(rid), prompt=p, original=p, max_new_tokens=2, stop=frozenset())


def _chunks(planner: ChunkPlanner) -> list[tuple[int, int]]:
    """(request, chunk length) of the next chunks, which then run (the engine's bookkeeping of a
    chunk sent: its request's position advances, and a request whose prompt is done runs)."""
    chunks = planner.next_chunks()
    for c in chunks:
        r = planner.requests[c.rid]
        r.done = c.prefix_len + int(c.input_ids.shape[0])
        if not c.more_chunks:
            planner.requests.prefilled(r)
    return [(int(c.rid), int(c.input_ids.shape[0])) for c in chunks]


def test_a_started_prefill_behind_a_request_that_cannot_start_gets_its_chunk() -> None:
    """12 KV locations, chunks of 4: request 1 (8 tokens) takes its first chunk; request 2 (10
    tokens, a retracted request's prompt and output) comes back at the head and cannot start (8 free,
    4 owed): request 1 still gets its next chunk, the last of its prefill."""
    planner, table, refs = _planner(12, chunk_size=4)
    table.add(_waiting(1, 8))
    assert _chunks(planner) == [(1, 4)]
    table.add(_waiting(2, 10))
    table.requeue(_waiting(2, 10))  # a retracted request's fresh record, first in line
    assert table.queued == [2, 1]
    assert _chunks(planner) == [(1, 4)]
    assert table[RequestId(1)].state is RequestState.RUNNING and table.queued == [2]
    assert table[RequestId(2)].state is RequestState.WAITING and table[RequestId(2)].slot is None
    assert refs.kv.num_free == 4


def test_no_waiting_request_starts_before_one_ahead_of_it_that_cannot() -> None:
    """16 KV locations, chunks of 4: the head (10 tokens) cannot start beside the 4 locations request
    1 still owes (12 free); request 3 (2 tokens) would fit, but does not start before it: a retracted
    request at the head is never overtaken by a later arrival. Once request 1 is done and its KV back,
    the head starts, and request 3 beside it."""
    planner, table, refs = _planner(16, chunk_size=4)
    table.add(_waiting(1, 8))
    assert _chunks(planner) == [(1, 4)]
    table.add(_waiting(2, 10))
    table.requeue(_waiting(2, 10))
    table.add(_waiting(3, 2))
    assert table.queued == [2, 1, 3]
    assert _chunks(planner) == [(1, 4)]
    assert table[RequestId(3)].state is RequestState.WAITING and table[RequestId(3)].slot is None
    r1 = table.remove(RequestId(1))  # its prefill done, it ran and finished: its KV goes back
    refs.unref(r1.context)
    assert _chunks(planner) == [(2, 4), (3, 2)]


def test_prompts_that_fit_the_kv_together_all_start_in_one_step() -> None:
    """16 KV locations, chunks of 8: two prompts of 8 tokens fit together exactly. Request 1 starts
    and its whole prompt is allocated in this step's chunk, so it owes nothing more: request 2 starts
    beside it in the same step (counting request 1's chunk both as owed and as taken from the free
    locations started only one prompt a step), and a third cannot start until KV comes back."""
    planner, table, refs = _planner(16, chunk_size=8)
    for rid in (1, 2, 3):
        table.add(_waiting(rid, 8))
    assert _chunks(planner) == [(1, 8), (2, 8)]
    assert refs.kv.num_free == 0 and table[RequestId(3)].state is RequestState.WAITING
    assert table.kv_owed() == 0


def test_a_started_prefill_short_of_kv_evicts_prefix_cache_entries_for_its_chunk() -> None:
    """A started prefill whose next chunk does not fit the free KV evicts unpinned prefix-cache
    entries first (here one entry holding 4 locations), rather than wait for KV nobody will free."""
    planner, table, refs = _planner(10, chunk_size=4)
    table.add(_waiting(1, 8))
    assert _chunks(planner) == [(1, 4)]
    held = refs.alloc(4).tolist()  # an entry inserted since holds 4 locations: 2 are free
    planner.session = _OneEntryCache(refs, held)
    assert _chunks(planner) == [(1, 4)]
    assert refs.kv.num_free == 2 and not planner.session.evict()


# -- the engine ----------------------------------------------------------------------------------


def _not_idle(eng: Engine, kind: StepKind, n: int) -> None:
    """A step taken while requests are live must run a forward or retract, never idle."""
    assert kind is not StepKind.IDLE, (
        f"step {n} idled with {eng.live} requests live: "
        + ", ".join(f"{r.rid} {r.state.value} ({r.done}/{r.prompt.shape[0]} prefilled)" for r in eng.requests)
        + f"; queue {eng.requests.queued}, {eng.kv.num_free} KV locations free"
    )


def test_a_retraction_ahead_of_a_started_prefill_does_not_idle_the_engine() -> None:
    """k = 2, 24 KV locations: request 0 (4 tokens + 16 new, at most 21 locations) runs alone for
    four steps, then request 1 (12 tokens + 4 new, 17 at most) starts its prefill in chunks of 2,
    alternating with speculative steps. Request 0's growth leaves no room for its next window: it
    is retracted to the head of the queue while request 1 is half prefilled, and it cannot start
    again (17 tokens to prefill beside the 6 request 1 still owes, 18 free). Request 1's prefill goes
    on behind it, both finish with the greedy tokens, and nothing leaks."""
    eng = engine(2, capacity=4, kv_capacity=24, max_len=32, chunk_size=2, policy=ALTERNATE)
    prompts = {0: [3, 4, 5, 6], 1: list(range(10, 22))}
    news = {0: 16, 1: 4}
    kinds: list[StepKind] = []
    blocked = False  # seen: request 0 waiting at the head, request 1 half prefilled behind it
    eng.admit(RequestId(0), prompts[0], max_new_tokens=news[0])
    for _ in range(4):
        kinds.append(eng.step().kind)
    eng.admit(RequestId(1), prompts[1], max_new_tokens=news[1])
    while eng.live and len(kinds) < 60:
        kinds.append(eng.step().kind)
        _not_idle(eng, kinds[-1], len(kinds))
        states = {int(r.rid): r.state for r in eng.requests}
        blocked |= eng.requests.queued == [0, 1] and states == {0: RequestState.WAITING, 1: RequestState.PREFILLING}
    assert eng.live == 0, f"{eng.live} requests still live after {len(kinds)} steps"
    assert blocked and eng.stats.retractions >= 1 and StepKind.RETRACT in kinds
    assert eng.outputs == {RequestId(i): greedy_reference(p, news[i]) for i, p in prompts.items()}
    eng.ledger.assert_drained()
    assert eng.slots.num_live == 0 and eng.kv.num_live == 0


def test_a_retracted_request_starts_no_later_than_an_arrival_behind_it_that_would_fit() -> None:
    """The same squeeze, and a third request (2 tokens) admitted right after the retraction: it
    would fit beside request 1's prefill, but it does not start before the retracted request 0."""
    eng = engine(2, capacity=4, kv_capacity=24, max_len=32, chunk_size=2, policy=ALTERNATE)
    eng.admit(RequestId(0), [3, 4, 5, 6], max_new_tokens=16)
    for _ in range(4):
        eng.step()
    eng.admit(RequestId(1), list(range(10, 22)), max_new_tokens=4)
    n = 4
    while not eng.stats.retractions:
        n += 1
        _not_idle(eng, eng.step().kind, n)
    assert eng.requests[RequestId(0)].state is RequestState.WAITING
    eng.admit(RequestId(2), [7, 8], max_new_tokens=2)
    started: dict[int, int] = {}  # request -> the step after which it first held a slot (or had ended)
    while eng.live and n < 80:
        n += 1
        _not_idle(eng, eng.step().kind, n)
        for rid in (0, 2):
            if rid not in started and (RequestId(rid) in eng.live_slots() or RequestId(rid) in eng.outputs):
                started[rid] = n
    assert eng.live == 0 and started[0] <= started[2]
    assert eng.outputs[RequestId(0)] == greedy_reference([3, 4, 5, 6], 16)
    assert eng.outputs[RequestId(2)] == greedy_reference([7, 8], 2)


# -- the property --------------------------------------------------------------------------------

LONG = (os.environ.get("BATCHC_FUZZ_PROFILE") or settings.get_current_profile_name()) == FUZZ_LONG
BASES = [[(37 * b + 11 * j) % 250 + 1 for j in range(8)] for b in range(2)]
"""Prompts are prefixes of these (so the references are computed once per base and length)."""
MAX_NEW = 8
MAX_LEN = 24  # >= 8 prompt tokens + 8 new + the k + 1 <= 4 speculative positions
PROPERTY = settings(
    max_examples=300 if LONG else 5,
    derandomize=not LONG,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
Arrival = tuple[int, int, int, int, int | None]
"""(base, prompt length, max new tokens, steps before it arrives, squeeze)."""


def step_bound(requests: Sequence[tuple[int, int]], chunk: int) -> int:
    """A bound on the steps taken while a request is live, for ``(prompt length P, max new tokens M)``
    per request, every one fitting the KV capacity alone, and ``chunk`` the smaller of the chunk size
    and the token budget. Every such step runs a forward or retracts (none idles), and:

    - a request is retracted only while RUNNING, and its prefill's last chunk emitted a token, so
      each retraction follows a token of its own: it is retracted at most ``M - 1`` times, prefilled
      at most ``M`` times, each time at most ``P + M - 1`` tokens (its prompt and output so far);
    - the first chunk of an extend or mixed step has the whole budget, so it is ``chunk`` tokens or
      the rest of that prefill: a prefill of ``L`` tokens comes first in at most ``ceil(L / chunk)``
      steps;
    - a decode or speculative step gives every running row at least one token, and a request takes
      at most ``M``; a retract step retracts at least one request.

    So at most ``sum(M * ceil((P + M - 1) / chunk) + M + (M - 1))`` steps."""
    return sum(m * math.ceil((p + m - 1) / chunk) + m + (m - 1) for p, m in requests)


def _serve(eng: Engine, arrivals: Sequence[tuple[list[int], int, int, int | None]], bound: int) -> set[StepKind]:
    """Admit each ``(prompt, max_new_tokens, gap, squeeze)`` (request ``i`` is the ``i``-th) after
    ``gap`` more steps and then, with a ``squeeze``, once the free KV locations beside what the
    started prefills owe are at most its prompt length plus ``squeeze`` (it arrives when it barely
    fits: the pressure under which a retraction meets a half-done prefill); then step until no
    request is live. Steps are taken only while a request is live; none may idle, and ``bound``
    must suffice. Returns the kinds of step taken."""
    kinds: list[StepKind] = []

    def step() -> None:
        kinds.append(eng.step().kind)
        _not_idle(eng, kinds[-1], len(kinds))
        assert len(kinds) <= bound, f"{eng.live} requests still live after {bound} steps"

    for rid, (prompt, new, gap, squeeze) in enumerate(arrivals):
        for _ in range(gap):
            if eng.live:
                step()
        while squeeze is not None and eng.live and eng.kv.num_free - eng.requests.kv_owed() > len(prompt) + squeeze:
            step()
        eng.admit(RequestId(rid), prompt, max_new_tokens=new)
    while eng.live:
        step()
    return set(kinds)


ARRIVALS = st.lists(
    st.tuples(
        st.integers(0, len(BASES) - 1), st.integers(1, 8), st.integers(1, MAX_NEW), st.integers(0, 3),
        st.sampled_from([None, 0, 1, 2]),
    ),
    min_size=2, max_size=3,
)


@PROPERTY
@given(
    k=st.sampled_from([0, 1, 2, 3]),
    chunk_size=st.integers(1, 4),
    token_budget=st.none() | st.integers(1, 8),
    capacity=st.integers(1, 3),
    slack=st.integers(0, 2),
    streak=st.sampled_from([None, 1, 2]),
    cache_block=st.sampled_from([None, 2, 3]),
    arrivals=ARRIVALS,
)
# a run that idled forever when the planner stopped at the first request that could not start, at
# k = 0 (mixed forwards; test_a_retraction_ahead_of_a_started_prefill_does_not_idle_the_engine pins
# one at k = 2)
@example(
    k=0, chunk_size=2, token_budget=None, capacity=2, slack=0, streak=2, cache_block=None, arrivals=[(1, 8, 7, 1, 2), (0, 3, 4, 3, 1)]
)
def test_every_request_finishes_within_the_bound_with_the_greedy_tokens(
    k: int, chunk_size: int, token_budget: int | None, capacity: int, slack: int, streak: int | None, cache_block: int | None,
    arrivals: list[Arrival],
) -> None:
    """With ``cache_block``, a prefix cache of two entries snapshots the prompts' shared prefixes
    (prompts are prefixes of two bases) at that block size: its entries hold slots and KV that
    starting requests and chunks evict, and a hit shortens a prefill (the tiny models capture states
    inside a chunk, so a snapshot never cuts one: ``step_bound`` holds as it is)."""
    # alone, a request holds at most P + M - 1 + k locations (its context before its last
    # speculative window, and the window): the capacity is the largest of these plus ``slack``
    kv_capacity = max(p + m - 1 + k for _, p, m, _, _ in arrivals) + slack
    eng = engine(
        k, capacity=capacity, kv_capacity=kv_capacity, max_len=MAX_LEN, chunk_size=chunk_size, token_budget=token_budget,
        policy=PrefillFirst(max_streak=streak), prefix_cache=PrefixCache(capacity=2, block=cache_block) if cache_block else None,
    )
    assert eng.planner.inner_snapshots
    chunk = min(chunk_size, token_budget if token_budget is not None else chunk_size)
    kinds = _serve(eng, [(BASES[b][:p], m, gap, sq) for b, p, m, gap, sq in arrivals], step_bound([(p, m) for _, p, m, _, _ in arrivals], chunk))
    assert eng.outputs == {RequestId(rid): greedy_reference(BASES[b][:p], MAX_NEW)[:m] for rid, (b, p, m, _, _) in enumerate(arrivals)}
    eng.ledger.assert_drained()
    eng.drop_cache()
    assert eng.slots.num_live == 0 and eng.kv.num_live == 0 and not eng.kv_refs.held()
    if eng.cache is not None:
        event(f"cache snapshots {min(eng.cache.stats.snapshots, 2)}+, evictions {min(eng.cache.stats.evictions, 2)}+")
        event(f"cache hits {min(eng.cache.stats.hits, 2)}+")
    event(f"retractions {min(eng.stats.retractions, 3)}+")
    for kind in sorted(kd.value for kd in kinds):
        event(f"step kind {kind}")
