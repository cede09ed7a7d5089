"""Small units of the engine, each checked on its own without running a model: the forward runner's
retries and ``StepFailed`` (``compiler.engine.runner``), the speculative figures
(``compiler.engine.report.SpecStats``), prefill chunking (``compiler.engine.chunks``) and the
engine's check of a tensor-parallel leader's models.

The runner is driven through a stand-in backend (``backend.boundary.Backend``) whose forwards fail a
chosen number of times, so every path of ``run``, ``submit`` and ``wait`` is reached in a few
milliseconds.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from typeguard import suppress_type_checks

from backend import faults
from backend.allocator import KVAllocator, SlotAllocator
from backend.boundary import Pending, checked
from backend.ledger import Ledger
from backend.remote import ExecutorGone, ExecutorProcess, ProcessBackends, Processes
from backend.tp.serve import TensorParallel, TPLeader
from compiler.engine import Engine, StepKind
from compiler.engine.cache_session import NoCache
from compiler.engine.chunks import ChunkPlanner
from compiler.engine.kv_refs import KVRefs
from compiler.engine.report import SpecStats
from compiler.engine.requests import Request, RequestState, RequestTable
from compiler.engine.runner import ForwardRunner, StepFailed
from compiler.prefix_cache import PrefixCache
from compiler.steps import Pipeline
from ir.columns import frozen_i64
from ir.errors import EngineStoppedError, PlanExecutionError, PreconditionError, SlotError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, PoolId, RequestId, SampleId
from ir.nodes import Plan
from ir.plan import DecodePlan
from ir.results import Result, Sampled, Verified
from ir.spec import DraftPlan, VerifyPlan
from passes.lower import LowerContext, lower
from passes.prepare_for_decode import DecodeContext
from passes.prepare_for_draft import SpecContext, prepare_for_draft
from passes.prepare_for_verify import prepare_for_verify
from tests.helpers import BODIES, SYSTEM, decode_batch, engine, greedy_reference, proposed, request, tiny_models


class FlakyBackend:
    """A backend whose plans fail with the queued errors, then succeed (every token 0); ``submit``
    raises ``ExecutorGone`` for the first ``gone_on_submit`` plans (gone before the plan left)."""

    def __init__(self, *errors: Exception, gone_on_submit: int = 0) -> None:
        self.errors = list(errors)
        self.gone_on_submit = gone_on_submit
        self.calls: list[str] = []
        self.results: list[Result] = []

    @property
    def pool_id(self) -> PoolId:
        return TARGET_POOL

    @property
    def usable(self) -> bool:
        return True

    def submit(self, plan: Plan) -> Pending:
        self.calls.append("submit")
        if self.gone_on_submit:
            self.gone_on_submit -= 1
            raise ExecutorGone("executor process for pool 'target' is gone: it died")
        p = Pending(plan)
        if self.errors:
            p.error = self.errors.pop(0)
        else:
            p.result = Sampled(rids=plan.rids, tokens=[0] * len(plan.rids))
            self.results.append(p.result)
        p.done = True
        return p

    def wait(self, pending: Pending) -> Result:
        self.calls.append("wait")
        return pending.outcome()

    def forget_verifies(self) -> None:
        pass


def _plan() -> DecodePlan:
    plan = lower(decode_batch([4, 9], [1, 2], [3, 3], [10, 11]), LowerContext())
    assert isinstance(plan, DecodePlan)
    return plan


def _runner(retries: int) -> ForwardRunner:
    return ForwardRunner(retries, SpecStats())


def test_a_forward_that_fails_every_attempt_is_a_step_failure_naming_its_requests() -> None:
    for retries in (0, 1, 2):
        runner, ex = _runner(retries), FlakyBackend(*(RuntimeError(f"boom {i}") for i in range(retries + 1)))
        with pytest.raises(StepFailed, match=r"^forward of requests \[4, 9\] failed: RuntimeError: boom " + str(retries) + r"$") as info:
            runner.run(ex, _plan())
        assert info.value.rids == (RequestId(4), RequestId(9))
        assert isinstance(info.value.cause, RuntimeError)
        assert ex.calls == ["submit", "wait"] * (retries + 1)  # every attempt, no more
        assert runner.stats.retries == retries


def test_a_forward_that_fails_fewer_times_than_the_retries_succeeds() -> None:
    runner, ex = _runner(2), FlakyBackend(RuntimeError("once"), RuntimeError("twice"))
    assert runner.run(ex, _plan()) is ex.results[0]
    assert ex.calls == ["submit", "wait"] * 3 and runner.stats.retries == 2


def test_a_plan_that_does_not_fit_is_never_retried() -> None:
    runner, ex = _runner(3), FlakyBackend(PlanExecutionError("slot 9 out of range"))
    with pytest.raises(PlanExecutionError, match="slot 9 out of range"):
        runner.run(ex, _plan())
    assert ex.calls == ["submit", "wait"] and runner.stats.retries == 0


def test_wait_on_a_process_fails_the_step_or_retries_it() -> None:
    runner, ex = _runner(0), FlakyBackend(RuntimeError("child crashed"))
    s = runner.submit(ex, _plan())
    with pytest.raises(StepFailed, match=r"^forward of requests \[4, 9\] failed: RuntimeError: child crashed$"):
        runner.wait(s)
    assert ex.calls == ["submit", "wait"] and runner.stats.retries == 0
    # with retries, the failed wait counts one retry and the plan is submitted again
    runner, ex = _runner(1), FlakyBackend(RuntimeError("child crashed"))
    assert runner.wait(runner.submit(ex, _plan())) is ex.results[0]
    assert ex.calls == ["submit", "wait", "submit", "wait"] and runner.stats.retries == 1
    # a refusal read back from the process is the plan's bug: raised as it is, not retried
    runner, ex = _runner(2), FlakyBackend(PlanExecutionError("refused there"))
    with pytest.raises(PlanExecutionError, match="refused there"):
        runner.wait(runner.submit(ex, _plan()))
    assert ex.calls == ["submit", "wait"] and runner.stats.retries == 0


def test_a_failure_at_submit_is_kept_for_wait() -> None:
    """A backend gone before the plan reached it: the failure is kept by ``submit`` and raised by
    ``wait`` (a failed attempt like any other: retried when there are retries), not lost."""
    runner, ex = _runner(0), FlakyBackend(gone_on_submit=1)
    s = runner.submit(ex, _plan())
    assert ex.calls == ["submit"]
    with pytest.raises(StepFailed, match=r"^forward of requests \[4, 9\] failed: ExecutorGone: executor process for pool 'target' is gone: it died$"):
        runner.wait(s)
    runner, ex = _runner(1), FlakyBackend(gone_on_submit=1)
    assert runner.wait(runner.submit(ex, _plan())) is ex.results[0]
    assert ex.calls == ["submit", "submit", "wait"] and runner.stats.retries == 1


def test_a_draft_run_must_return_the_proposals_of_that_draft() -> None:
    """What a draft forward hands back is checked before the verify uses it (``checked``): the
    ``Proposals`` of another draft, or a result of another kind, is refused naming the draft."""
    def draft_plan() -> DraftPlan:
        running = decode_batch([4, 9], [1, 2], [3, 3], [10, 11])
        return DraftPlan(batch=prepare_for_draft(running, SpecContext(k=2, next_tokens=[5, 6], kv_locs=list(range(20, 26)))))

    plan, newer = draft_plan(), draft_plan()
    own = proposed(plan.batch, [1, 2, 3, 4])
    assert checked(plan, own) is own
    did, other = plan.batch.draft_id, newer.batch.draft_id
    with pytest.raises(PlanExecutionError, match=rf"^draft #{did} \(2 rows, k=2\) came back as the proposals of draft #{other} \(4 tokens, k=2\)$"):
        checked(plan, proposed(newer.batch, [1, 2, 3, 4]))
    with pytest.raises(PlanExecutionError, match=r"^DraftPlan came back as Sampled, not Proposals$"):
        checked(plan, Sampled(rids=[4, 9], tokens=[1, 2]))
    # a forward's tokens must be for the plan's rows, in its order
    dec = _plan()
    assert checked(dec, Sampled(rids=[4, 9], tokens=[1, 2])).tokens.tolist() == [1, 2]
    with pytest.raises(PlanExecutionError, match=r"^DecodePlan of requests \[4, 9\] came back for requests \[9, 4\]$"):
        checked(dec, Sampled(rids=[9, 4], tokens=[1, 2]))
    # a verify's tokens must cover its own window
    vplan = VerifyPlan(batch=prepare_for_verify(plan.batch, own))
    vid = vplan.batch.verify_id
    assert checked(vplan, Verified(k=2, verify_id=vid, rids=[4, 9], tokens=[1, 2, 3, 4, 5, 6])).tokens.tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(PlanExecutionError, match=rf"^verify #{vid} \(k=2\) came back as the target tokens of verify #{vid} \(k=1\)$"):
        checked(vplan, Verified(k=1, verify_id=vid, rids=[4, 9], tokens=[1, 2, 3, 4]))
    # and be the target tokens of that verify (not another's of the same rows and window)
    with pytest.raises(PlanExecutionError, match=rf"^verify #{vid} \(k=2\) came back as the target tokens of verify #{vid + 1} \(k=2\)$"):
        checked(vplan, Verified(k=2, verify_id=vid + 1, rids=[4, 9], tokens=[1, 2, 3, 4, 5, 6]))


def test_the_speculative_figures() -> None:
    s = SpecStats()
    assert (s.acceptance_rate, s.mean_accepted_length) == (0.0, 0.0)  # nothing proposed yet
    # 3 rows over 2 iterations (6 row-iterations), k = 4: 24 proposed, 9 accepted; each
    # row-iteration emits its accepted drafts plus the bonus token: (9 + 6) / 6
    s = SpecStats(iterations=2, row_iterations=6, proposed=24, accepted=9)
    assert s.acceptance_rate == pytest.approx(9 / 24)
    assert s.mean_accepted_length == pytest.approx(2.5)
    assert SpecStats(row_iterations=4, proposed=8, accepted=0).mean_accepted_length == 1.0  # only bonus tokens


# -- prefill chunking (``compiler.engine.chunks``) ------------------------------------------------


def _planner(kv_capacity: int, *, chunk_size: int = 64, budget: int = 64, slots: int = 4) -> tuple[ChunkPlanner, RequestTable, KVAllocator]:
    kv = KVAllocator(kv_capacity)
    table = RequestTable()
    planner = ChunkPlanner(
        requests=table, slots=SlotAllocator(slots), kv=kv, kv_refs=KVRefs(kv), session=NoCache(),
        share_prefix=lambda src, dst, n: None, chunk_size=chunk_size, token_budget=budget,
    )
    return planner, table, kv


def _waiting(rid: int, n: int) -> Request:
    p = frozen_i64(list(range(1, n + 1)))
    return Request(rid=RequestId(rid), prompt=p, original=p, max_new_tokens=2, stop=None)


def test_a_prompt_that_needs_exactly_the_free_kv_is_prefilled() -> None:
    planner, table, kv = _planner(6)
    table.add(_waiting(1, 6))
    [chunk] = planner.next_chunks()
    assert (chunk.rid, chunk.input_ids.tolist(), len(set(chunk.kv_locs.tolist()))) == (1, [1, 2, 3, 4, 5, 6], 6)
    assert kv.num_free == 0 and not chunk.more_chunks


def test_a_prompt_waits_while_the_started_prefills_still_need_its_kv() -> None:
    """Chunks of 4: request 1 (8 tokens) starts and owes 4 more after its first chunk, which leaves 10
    free; request 2 (7 tokens) would fit them only if nothing were owed (6 are left once request 1's
    4 are set aside), so it waits. (A 6-token request 2 starts: the chunk already allocated is not
    owed twice, tests/compiler/engine/test_retraction_progress.py.)"""
    planner, table, kv = _planner(14, chunk_size=4, budget=8)
    table.add(_waiting(1, 8))
    table.add(_waiting(2, 7))
    chunks = planner.next_chunks()
    assert [(c.rid, c.input_ids.shape[0]) for c in chunks] == [(1, 4)]
    assert table[RequestId(2)].state is RequestState.WAITING and table[RequestId(2)].slot is None
    assert kv.num_free == 10
    planner, table, kv = _planner(14, chunk_size=4, budget=8)
    table.add(_waiting(1, 8))
    table.add(_waiting(2, 6))
    assert [(c.rid, c.input_ids.shape[0]) for c in planner.next_chunks()] == [(1, 4), (2, 4)]
    assert kv.num_free == 6


def test_chunks_respect_the_chunk_size_and_the_token_budget() -> None:
    planner, table, _ = _planner(64, chunk_size=3, budget=5)
    table.add(_waiting(1, 7))
    table.add(_waiting(2, 7))
    chunks = planner.next_chunks()
    assert [(c.rid, c.input_ids.tolist(), c.more_chunks) for c in chunks] == [(1, [1, 2, 3], True), (2, [1, 2], True)]


# -- a tensor-parallel leader is checked before anything starts ----------------------------------


class StandInLeader(TPLeader):
    """A ``TPLeader`` with no group behind it: enough for the engine's argument checks."""

    def __init__(self, world: int) -> None:  # no ranks are started
        self.pools = None
        self.group = SimpleNamespace(world=world, closed=False, broken=None)  # type: ignore[assignment]  # a stand-in


def test_an_engine_over_tp_refuses_a_model_that_is_not_a_shard() -> None:
    target, draft = tiny_models()
    with pytest.raises(PreconditionError, match=r"^Engine: tp: the target model must be a shard cut by backend\.tp\.shard_model, got "):
        Engine(target, None, k=0, transport=TensorParallel(StandInLeader(2)))


class SessionLeader(StandInLeader):
    """A stand-in that opens and closes sessions (no group behind it) and records the closes."""

    def __init__(self, world: int) -> None:
        super().__init__(world)
        self.gate = None  # type: ignore[assignment]  # no executor is ever built through it here
        self.closed_sessions = 0

    def open_session(self, models: object, **sizes: object) -> None:  # type: ignore[override]  # the sizes are not used
        self.pools = tuple(models)  # type: ignore[call-overload]  # a mapping of pools

    def close_session(self, ledger: Ledger) -> object:  # type: ignore[override]  # no rank ledgers to gather
        self.pools = None
        self.closed_sessions += 1
        return None


class _NoSum:
    def all_reduce_sum(self, t: torch.Tensor) -> None:
        pass


@pytest.mark.parametrize("failing", ["target", "draft"])
def test_an_engine_whose_executor_cannot_be_built_ends_its_tp_session(failing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers built their pools for the session: an engine that fails before serving ends it,
    whichever executor failed (the target's or the draft's), so the group can serve the next engine."""
    from backend.tp import shard_model

    target, draft = tiny_models()
    shards = {"target": shard_model(target, 0, 2, _NoSum()), "draft": shard_model(draft, 0, 2, _NoSum())}

    def no_pool(*args: object, **kwargs: object) -> object:
        raise RuntimeError(f"no memory for the {failing} pool")

    monkeypatch.setattr(shards[failing], "new_pool", no_pool)
    leader = SessionLeader(2)
    with pytest.raises(RuntimeError, match=f"^no memory for the {failing} pool$"):
        Engine(shards["target"], shards["draft"] if failing == "draft" else None, k=2 if failing == "draft" else 0, transport=TensorParallel(leader))
    assert leader.closed_sessions == 1 and leader.pools is None


class SharingLeader(SessionLeader):
    """A session stand-in that records the prefixes it is told to share with the workers."""

    def __init__(self, world: int) -> None:
        super().__init__(world)
        self.shared: list[tuple[int, int, int]] = []

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        self.shared.append((src, dst, length))


def test_every_tp_worker_hears_of_a_shared_prefix() -> None:
    """With tensor parallelism the workers hold their own token tables: a request that starts from
    a cached prefix must have its prefix rows shared there too, not only in rank 0's hook."""
    from backend.tp import shard_model

    target, _ = tiny_models()
    leader = SharingLeader(2)
    eng = Engine(shard_model(target, 0, 2, _NoSum()), None, k=0, transport=TensorParallel(leader))
    eng.planner.share_prefix(2, 5, 9)
    assert leader.shared == [(2, 5, 9)]
    eng.close()


class StandInProcess(ExecutorProcess):
    """An executor process that is not one (no child): it records what it is told."""

    def __init__(self, pool_id: PoolId = TARGET_POOL) -> None:  # no child process
        self.pool_id = pool_id
        self._gone: str | None = None
        self.closes = 0
        self.shared: list[tuple[int, int, int]] = []

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        self.shared.append((src, dst, length))

    def close(self) -> None:
        self.closes += 1
        self._gone = "closed"


def test_processes_that_cannot_all_start_are_all_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """With executor processes the target's child runs by the time the draft's fails to start: the
    transport closes it, so no child outlives an engine that was not built."""
    import backend.remote

    started: list[StandInProcess] = []

    def process(model: object, *, pool_id: PoolId, **options: object) -> StandInProcess:
        if pool_id == DRAFT_POOL:
            raise RuntimeError("no memory for the draft pool")
        started.append(StandInProcess(pool_id))
        return started[-1]

    monkeypatch.setattr(backend.remote, "ExecutorProcess", process)
    target, draft = tiny_models()
    with pytest.raises(RuntimeError, match="^no memory for the draft pool$"):
        Engine(target, draft, k=2, transport=Processes())
    assert [p.closes for p in started] == [1]


def test_every_executor_process_hears_of_a_shared_prefix() -> None:
    """With executor processes (``overlap``), the serving hooks live in the children: a request
    that starts from a cached prefix must have its prefix rows shared there, for both pools."""
    target, draft = StandInProcess(), StandInProcess(DRAFT_POOL)
    ProcessBackends(target, draft).share_prefix(2, 5, 9)
    assert target.shared == [(2, 5, 9)] and draft.shared == [(2, 5, 9)]


class RecordingBackends:
    """The engine's in-process backends, recording what the engine asks of the group."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.shared: list[tuple[int, int, int]] = []
        self.closes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        self.shared.append((src, dst, length))
        self.inner.share_prefix(src, dst, length)

    def close(self) -> None:
        self.closes += 1


def test_an_engine_tells_its_backends_of_a_shared_prefix_and_closes_them_once() -> None:
    eng = engine(1)
    backends = RecordingBackends(eng.backends)
    eng.backends = eng.forwards.backends = backends  # type: ignore[assignment]  # a recording stand-in
    eng.planner.share_prefix(2, 5, 9)
    assert backends.shared == [(2, 5, 9)]
    eng.close()
    eng.close()
    assert backends.closes == 1


# -- KV references and prefix states -------------------------------------------------------------


def test_kv_refs_count_every_location_and_name_the_one_dropped_too_often() -> None:
    refs = KVRefs(KVAllocator(16))
    refs.ref([0, 3, 3])
    assert (refs.count(0), refs.count(3), refs.count(1), refs.count(99), refs.count(-1)) == (1, 2, 0, 0, 0)
    # location 3 is dropped as often as it is held (fine), 0 once more than held: 0 is named
    with pytest.raises(SlotError, match=r"^KV location 0: a reference was dropped that nobody holds$"):
        refs.unref([3, 0, 3, 0])
    # and the other way round: 0 as often as held, 3 once more
    with pytest.raises(SlotError, match=r"^KV location 3: a reference was dropped that nobody holds$"):
        refs.unref([0, 3, 3, 3])
    with pytest.raises(SlotError, match=r"^KV location 7: a reference was dropped that nobody holds$"):
        refs.unref([3, 7])
    # 4: the first location past the highest one ever referenced
    with pytest.raises(SlotError, match=r"^KV location 4: a reference was dropped that nobody holds$"):
        refs.unref([4])
    assert refs.held() == {0: 1, 3: 2}


@pytest.mark.parametrize(("size", "repeats"), [(3, True), (64, True), (65, True), (150, True), (65, False), (150, False)])
def test_kv_refs_agree_on_both_sides_of_the_small_path(size: int, repeats: bool) -> None:
    """``ref``/``unref`` of up to 64 locations loop in Python, larger ones run in numpy (distinct
    locations, as a request's context, without counting repeats): random rounds of both (with
    repeats or without) keep the same counts as a plain count, free exactly the locations whose
    last reference went, in first-appearance order, and refuse a drop of a reference nobody holds
    naming the same location, changing nothing."""
    rng = np.random.default_rng(size)
    kv = KVAllocator(512)
    refs = KVRefs(kv)
    held: dict[int, int] = {}
    locs = kv.alloc_many(256).tolist()
    refs.ref(locs)
    for loc in locs:
        held[loc] = 1
    for _ in range(20):
        extra = rng.choice(locs, size=size).tolist()
        refs.ref(extra)
        for loc in extra:
            held[loc] += 1
        live = [loc for loc in locs if held.get(loc)]
        drop = rng.choice(live, size=min(size, len(live)), replace=repeats).tolist()
        want = dict(held)
        for loc in drop:
            want[loc] -= 1
        short = sorted({loc for loc in drop if want[loc] < 0})
        free_before = kv.num_free
        if short:
            with pytest.raises(SlotError, match=rf"^KV location {short[0]}: a reference was dropped that nobody holds$"):
                refs.unref(drop)
            assert kv.num_free == free_before
        else:
            refs.unref(drop)
            freed = [loc for loc in dict.fromkeys(drop) if want[loc] == 0]
            assert kv.num_free == free_before + len(freed)
            if freed:  # the last freed is handed out first
                assert kv.alloc_many(len(freed)).tolist() == freed[::-1]
                refs.ref(freed)
                for loc in freed:
                    want[loc] = 1
            held = want
        assert refs.held() == {loc: n for loc, n in held.items() if n}


def test_kv_refs_refuse_a_large_drop_of_distinct_locations_naming_the_lowest_unheld_one() -> None:
    """A drop of more than 64 distinct locations (a finished request's context) that names
    locations nobody holds names the lowest of them and changes nothing: no count, no free."""
    kv = KVAllocator(512)
    refs = KVRefs(kv)
    locs = kv.alloc_many(200).tolist()
    refs.ref(locs)
    refs.unref(locs[150:])  # 150..199 freed: nobody holds them now
    before, free_before = refs.held(), kv.num_free
    drop = locs[100:180][::-1]  # 179..150 unheld, 149..100 held
    with pytest.raises(SlotError, match=rf"^KV location {locs[150]}: a reference was dropped that nobody holds$"):
        refs.unref(drop)
    assert (refs.held(), kv.num_free) == (before, free_before)
    refs.unref(locs[:100][::-1])  # distinct and held: freed in the order given
    assert kv.alloc_many(2).tolist() == [locs[0], locs[1]]


def test_a_prefix_must_leave_room_for_a_request_extending_it() -> None:
    """A prefix of n tokens needs n + 1 prompt tokens, 1 new token and k + 1 speculative positions
    under ``max_len``: n + k + 3 <= max_len."""
    eng = engine(2, max_len=20, capacity=3, kv_capacity=64)
    with pytest.raises(PreconditionError, match=(
        r"^make_prefix: tokens: a prefix of 16 tokens leaves no room under max_len 20 for a request extending it "
        r"\(at least 16 \+ 1 prompt tokens, 1 new token and k \+ 1 = 3 speculative positions\)$"
    )):
        eng.make_prefix(list(range(1, 17)))
    assert len(eng.make_prefix(list(range(1, 16))).tokens) == 15  # 15 + 2 + 3 = 20: just fits
    eng.close()


def test_a_prefix_needs_a_free_slot_and_its_kv_locations() -> None:
    eng = engine(0, capacity=1, kv_capacity=8)
    cp = eng.make_prefix([1, 2, 3, 4, 5])
    with pytest.raises(PreconditionError, match=r"^make_prefix: no room for a 1-token prefix \(0 free slots, 3 free KV locations\)$"):
        eng.make_prefix([1])
    eng.release_prefix(cp)
    with pytest.raises(PreconditionError, match=r"^make_prefix: no room for a 9-token prefix \(1 free slots, 8 free KV locations\)$"):
        eng.make_prefix(list(range(1, 10)))
    cp = eng.make_prefix(list(range(1, 9)))  # the last slot and every KV location
    assert (eng.slots.num_free, eng.kv.num_free) == (0, 0)
    eng.release_prefix(cp)
    assert (eng.slots.num_free, eng.kv.num_free) == (1, 8)
    eng.close()


def test_a_snapshot_whose_forward_failed_is_planned_again() -> None:
    """The forward that was to take a prefix-cache snapshot fails (no retries): its requests are
    aborted, and the prefix is free to be planned and snapshotted by the next requests sharing it."""
    pc = PrefixCache(capacity=4, block=16)
    eng = engine(0, prefix_cache=pc, chunk_size=64)
    for i in (0, 1):
        eng.admit(RequestId(i), SYSTEM + list(BODIES[i]), max_new_tokens=2)
    with faults.armed(faults.FaultPoint.MODEL_FORWARD) as fired:
        report = eng.step()
    assert fired == {faults.FaultPoint.MODEL_FORWARD: 1} and report.kind is StepKind.FAILED
    assert pc.stats.snapshots == 0
    for i in (2, 3):
        eng.admit(RequestId(i), SYSTEM + list(BODIES[i]), max_new_tokens=2)
    eng.run_until_done(max_steps=50)
    assert eng.aborted_by_failure == {0, 1} and {2, 3} <= set(eng.outputs)
    assert pc.stats.snapshots >= 1  # the shared prefix, taken by the later requests
    eng.drop_cache()
    eng.ledger.assert_drained()
    assert eng.slots.num_live == 0 and eng.kv.num_live == 0
    eng.close()


# -- the pipeline's sample ids (``compiler.steps``) ----------------------------------------------


@pytest.mark.parametrize(("sample", "inputs"), [(None, None), (21, None), (None, 20), (21, 20)])
def test_the_pipeline_puts_sample_ids_on_every_part_it_lowers(sample: int | None, inputs: int | None) -> None:
    """A pipelined step's plans keep their tokens under ``sample_id`` and (decodes) read their
    inputs from ``inputs_from``; a mixed plan's two parts keep them under the one id. The prefill's
    and the mixed plan's tickets are registered (outstanding until an executor consumes them)."""
    ledger = Ledger()
    pipe = Pipeline(ledger)
    sid = SampleId(sample) if sample is not None else None
    src = SampleId(inputs) if inputs is not None else None
    running = decode_batch([7], [3], [5], [40], tokens=[0] if inputs is not None else [9])
    ctx = DecodeContext(next_tokens=[0] if inputs is not None else [9], kv_locs=[41])
    _, mplan = pipe.mixed([request(1, 1, [5, 6], 0)], running, ctx, sample_id=sid, inputs_from=src)
    assert (mplan.extend.sample_id, mplan.decode.sample_id, mplan.decode.inputs_from) == (sid, sid, src)
    _, dplan = pipe.decode(running, ctx, sample_id=sid, inputs_from=src)
    assert (dplan.sample_id, dplan.inputs_from) == (sid, src)
    _, eplan = pipe.prefill([request(2, 2, [8], 10)], sample_id=sid)
    assert eplan.sample_id == sid
    assert set(ledger.outstanding()) == {*mplan.extend.tickets, *eplan.tickets}


def test_a_request_must_fit_max_len_with_its_new_tokens_and_the_speculative_window() -> None:
    """prompt + max_new_tokens + k + 1 <= max_len; the engine's own max_len leaves room for at
    least one prompt token, one new token and the k + 1 speculative positions."""
    eng = engine(2, max_len=20)
    eng.admit(RequestId(1), list(range(1, 12)), max_new_tokens=6)  # 11 + 6 + 2 + 1 = 20
    with pytest.raises(PreconditionError, match=r"^admit: request 2: prompt 12 \+ 6 new tokens exceed max_len 20$"):
        eng.admit(RequestId(2), list(range(1, 13)), max_new_tokens=6)
    assert [r.rid for r in eng.requests] == [1]
    eng.close()
    target, draft = tiny_models()
    with pytest.raises(PreconditionError, match=(
        r"^Engine: max_len 4 leaves no room for a prompt token and a new token next to the k \+ 1 = 3 speculative positions$"
    )):
        Engine(target, draft, k=2, max_len=4)
    Engine(target, draft, k=2, max_len=5).close()
    with pytest.raises(PreconditionError, match=r"^Engine: max_len 1 leaves no room .* k \+ 1 = 1 speculative positions$"):
        Engine(target, None, k=0, max_len=1)


def test_a_cache_hit_whose_first_forward_failed_unpins_its_entry() -> None:
    """A request that starts from a cached prefix pins the entry until its COW has run; when its
    first forward fails (no retries) and it is aborted, the pin goes: the entry is evictable again."""
    pc = PrefixCache(capacity=4, block=16)
    eng = engine(0, prefix_cache=pc, chunk_size=64)
    for i in (0, 1):
        eng.admit(RequestId(i), SYSTEM + list(BODIES[i]), max_new_tokens=1)
    eng.run_until_done(max_steps=50)
    assert pc.stats.snapshots >= 1
    eng.admit(RequestId(2), SYSTEM + list(BODIES[2]), max_new_tokens=1)
    with faults.armed(faults.FaultPoint.MODEL_FORWARD):
        report = eng.step()
    assert report.kind is StepKind.FAILED and report.aborted == (RequestId(2),) and pc.stats.hits >= 1
    assert [e.pins for e in pc.entries()] == [0] * len(pc)
    eng.drop_cache()  # every entry evictable
    assert len(pc) == 0 and eng.slots.num_live == 0 and eng.kv.num_live == 0
    eng.ledger.assert_drained()
    eng.close()


def test_a_retracted_request_comes_back_and_finishes() -> None:
    """Out of KV room, the newest running request is retracted to the head of the queue; it is
    prefilled again (prompt and output so far) and ends with the output it would have had."""
    prompts = {0: [3, 4, 5, 6, 7], 1: [8, 9, 10, 11, 12]}
    tight = engine(0, capacity=2, kv_capacity=12)
    roomy = engine(0, capacity=2)
    for eng in (tight, roomy):
        for i, p in prompts.items():
            eng.admit(RequestId(i), p, max_new_tokens=4)
        eng.run_until_done(max_steps=60)
    assert tight.stats.retractions >= 1 and roomy.stats.retractions == 0
    assert tight.outputs == roomy.outputs and all(len(o) == 4 for o in tight.outputs.values())
    tight.ledger.assert_drained()
    assert tight.slots.num_live == 0 and tight.kv.num_live == 0


def test_a_requeued_record_replaces_the_old_one_once_in_the_queue() -> None:
    table = RequestTable()
    for rid in (1, 2):
        table.add(_waiting(rid, 3))
    table.started(table[RequestId(2)], MambaSlot(1))  # PREFILLING: still queued
    fresh = _waiting(2, 3)
    table.requeue(fresh)
    assert table.queued == [2, 1] and table[RequestId(2)] is fresh
    running = table[RequestId(1)]
    table.started(running, MambaSlot(2))
    running.done = 3
    table.prefilled(running)  # RUNNING: out of the queue
    table.requeue(_waiting(1, 3))
    assert table.queued == [1, 2]


def test_the_reported_output_is_cut_at_max_new_tokens_and_after_the_first_stop() -> None:
    p = frozen_i64([1, 2])
    r = Request(rid=RequestId(1), prompt=p, original=p, max_new_tokens=5, stop=frozenset({9}), output=[4, 9, 6, 9, 7, 8])
    assert r.final_output() == [4, 9] and r.is_done()
    r = Request(rid=RequestId(1), prompt=p, original=p, max_new_tokens=3, stop=frozenset({9}), output=[4, 5, 6, 9])
    assert r.final_output() == [4, 5, 6] and r.is_done()
    r = Request(rid=RequestId(1), prompt=p, original=p, max_new_tokens=3, stop=frozenset(), output=[4, 5])
    assert r.final_output() == [4, 5] and not r.is_done()


def test_a_stop_token_is_any_id_of_the_vocabulary_and_nothing_else() -> None:
    """Token id 0 and the last id are stop tokens like any other; -1 and the vocabulary size are not."""
    eng = engine(0)
    eng.admit(RequestId(0), list(b"def f(x):"), max_new_tokens=2, stop=[0, eng.vocab - 1])
    for rid, bad in ((1, -1), (2, eng.vocab)):
        with pytest.raises(PreconditionError, match=rf"^admit: request {rid}: stop must be a token id in \[0, {eng.vocab}\), got {bad}$"):
            eng.admit(RequestId(rid), list(b"def f(x):"), max_new_tokens=2, stop=[bad])


@pytest.mark.parametrize("where", ["step", "sync"])
def test_an_engine_whose_abort_of_a_failed_forward_raises_stops_serving(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Aborting a failed forward's requests can itself fail (an executor process that cannot be
    drained): the bookkeeping is then half done, so the engine stops as for any other exception
    escaping a step, instead of serving on."""
    eng = engine(0)
    eng.admit(RequestId(0), SYSTEM + list(BODIES[0]), max_new_tokens=2)

    def drain_fails(failure: StepFailed) -> list[RequestId]:
        raise RuntimeError("the executor process could not be drained")

    monkeypatch.setattr(eng.forwards, "abort_failed", drain_fails)
    if where == "step":
        with faults.armed(faults.FaultPoint.MODEL_FORWARD), pytest.raises(RuntimeError, match="could not be drained"):
            eng.step()
    else:
        failure = StepFailed((RequestId(0),), RuntimeError("a commit failed"))
        monkeypatch.setattr(eng.forwards, "settle", lambda: (_ for _ in ()).throw(failure))
        with pytest.raises(RuntimeError, match="could not be drained"):
            eng.sync()
    with pytest.raises(EngineStoppedError, match="could not be drained"):
        eng.step()


class OpeningLeader(SessionLeader):
    """A session stand-in that records the pools of every session it opens."""

    def __init__(self, world: int) -> None:
        super().__init__(world)
        self.opened: list[object] = []

    def open_session(self, models: object, **sizes: object) -> None:
        super().open_session(models, **sizes)
        self.opened.append(self.pools)


def test_a_tp_engine_without_speculation_opens_no_draft_pool_even_when_given_a_draft() -> None:
    """At ``k = 0`` the draft model is never run: the workers must not build (and hold memory for)
    a draft pool for it, only the target's."""
    from backend.tp import shard_model
    from ir.ids import TARGET_POOL

    target, draft = tiny_models()
    leader = OpeningLeader(2)
    eng = Engine(shard_model(target, 0, 2, _NoSum()), shard_model(draft, 0, 2, _NoSum()), k=0, transport=TensorParallel(leader))
    assert leader.opened == [(TARGET_POOL,)] and eng.draft is None
    eng.close()


def test_an_engine_refuses_a_tp_leader_whose_session_another_engine_holds() -> None:
    """One engine at a time per group: the second is refused by name before it builds anything,
    and the first one's session stays open."""
    from backend.tp import shard_model

    target, _ = tiny_models()
    leader = SessionLeader(2)
    first = Engine(shard_model(target, 0, 2, _NoSum()), None, k=0, transport=TensorParallel(leader))
    pools = leader.pools
    with pytest.raises(PreconditionError, match=r"^Engine: tp: the leader's session is in use by another engine \(close that engine first\)$"):
        Engine(shard_model(target, 0, 2, _NoSum()), None, k=0, transport=TensorParallel(leader))
    assert leader.pools == pools and leader.closed_sessions == 0
    first.close()
    assert leader.pools is None and leader.closed_sessions == 1


def test_closing_executor_processes_closes_each_once() -> None:
    """``ProcessBackends.close`` stops both children, the draft's too."""
    target, draft = StandInProcess(), StandInProcess(DRAFT_POOL)
    ProcessBackends(target, draft).close()
    assert (target.closes, draft.closes) == (1, 1)


def test_a_request_counts_its_retractions() -> None:
    """Each retraction (out of KV room) sends the request back to the queue with its count of
    retractions one up; it comes back and ends with the greedy tokens."""
    eng = engine(0)
    rid = RequestId(0)
    eng.admit(rid, [3, 4, 5, 6, 7], max_new_tokens=6)
    for n in (1, 2):
        while eng.requests[rid].state is not RequestState.RUNNING:
            eng.step()
        eng.step()
        eng.forwards.retract(rid)
        assert eng.requests[rid].state is RequestState.WAITING and eng.requests[rid].retractions == n
    eng.run_until_done(max_steps=50)
    assert eng.outputs[rid] == greedy_reference([3, 4, 5, 6, 7], 6) and eng.stats.retractions == 2
    eng.ledger.assert_drained()
    assert eng.slots.num_live == 0 and eng.kv.num_live == 0
    eng.close()


def test_a_step_that_retracts_a_request_still_decodes_those_left_running() -> None:
    """Out of KV room, the newest running request is retracted and, in the same step, the ones
    left running decode: a retraction costs the others no step."""
    eng = engine(0, capacity=2, kv_capacity=12)
    prompts = {0: [3, 4, 5, 6, 7], 1: [8, 9, 10, 11, 12]}
    for i, p in prompts.items():
        eng.admit(RequestId(i), p, max_new_tokens=4)
    for _ in range(10):
        report = eng.step()
        if eng.stats.retractions:
            break
    assert eng.stats.retractions == 1 and report.kind is StepKind.DECODE and report.emitted == (RequestId(0),)
    eng.run_until_done(max_steps=50)
    assert all(eng.outputs[RequestId(i)] == greedy_reference(p, 4) for i, p in prompts.items())
    eng.ledger.assert_drained()
    eng.close()


def test_admit_takes_sampling_params_and_seeds_a_sampled_request_from_the_engine_seed() -> None:
    from ir.sampling import GREEDY, SamplingParams, derive_seed

    eng = engine(0, seed=7)
    eng.admit(RequestId(1), [1, 2, 3], max_new_tokens=2)
    eng.admit(RequestId(2), [1, 2, 3], max_new_tokens=2, sampling=SamplingParams(temperature=0.5))
    eng.admit(RequestId(3), [1, 2, 3], max_new_tokens=2, sampling=SamplingParams(temperature=0.5, seed=11, stop_token_ids=[9]))
    assert eng.requests[RequestId(1)].sampling == GREEDY
    assert eng.requests[RequestId(2)].sampling.seed == derive_seed(7, 2)
    assert eng.requests[RequestId(3)].sampling.seed == 11
    assert eng.requests[RequestId(3)].stop == frozenset({9})
    with suppress_type_checks(), pytest.raises(PreconditionError, match=r"request 4: sampling must be an ir.sampling.SamplingParams or None, not dict"):
        eng.admit(RequestId(4), [1, 2, 3], max_new_tokens=2, sampling={"temperature": 0.5})  # type: ignore[arg-type]  # the refusal is the point
    assert RequestId(4) not in eng.requests


@pytest.mark.parametrize("seed", [-1, 2**63, True, 1.0, "0"])
def test_engine_refuses_a_seed_outside_its_range_naming_it(seed: object) -> None:
    with suppress_type_checks(), pytest.raises(PreconditionError, match=r"seed must be an int in \[0, 2\*\*63 - 1\]"):
        engine(0, seed=seed)
