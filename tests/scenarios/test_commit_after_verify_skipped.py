"""The commit after a verify skipped (SGLang PR #26351, https://github.com/sgl-project/sglang/pull/26351).

Upstream: after a speculative verify, the step that writes each request's Mamba state at its
accepted position (the commit) could be skipped; the next draft and verify then ran from the state
before the verify, as if the accepted tokens had never been fed, and the tokens went wrong.

batchc: a verify leaves its per-position states with the target's executor under its id, bound to
its rows, for exactly one ``CommitPlan`` naming it. Until that commit runs, any other plan over
those rows on that pool (the next verify, a decode, a prefill; a draft, where the draft runs on the
target's own pool) is refused before the pool moves, naming the slot and the verify
(``backend.executor.Executor._check_committed``: that refusal is the fix this scenario brought;
before it the next verify ran on the stale state and left the first verify's states behind). The
scenario:

- IR, on the tiny target and its draft, two pools: a draft and verify whose commit never runs, then
  the next draft and verify on the same slots: the draft pool drafts (it holds no verify state), the
  target refuses the verify, a decode and a prefill over those rows; the skipped commit then runs,
  the draft (whose kept states the second draft dropped) catches up by a forward, and serving goes
  on to tokens equal to the reference run, each pool's state rows equal to a from-scratch prefill
  of the tokens fed;
- IR, one pool (``compiler.testing.fakes.FakeBackend``, the draft on the target's pool): the next
  draft itself is refused;
- engine at ``k = 2``: every verify is followed by its commit before any other plan on the target;
  a commit that fails is retried (its verify's states waited for it: the output is the fault-free
  one) or, without retries, its requests are aborted and the kept states dropped, so the next
  requests on those slots are served; the retried commit's run is made on the tiny target and on
  the state-sensitive one (``state_checks.MODELS``), whose tokens a state gone wrong after the
  prompt changes (``assert_tokens_need_state``).

Every ledger drained (or its cancellations recorded), every slot live or free.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backend import faults
from backend.executor import Executor
from backend.ledger import Ledger
from compiler.engine import Engine
from compiler.manager import PassManager
from compiler.steps import Pipeline
from compiler.testing.fakes import FakeBackend
from ir.batch import DecodeBatch
from ir.errors import PlanExecutionError
from ir.ids import DRAFT_POOL, TARGET_POOL, RequestId
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from ir.spec import CommitPlan, VerifyPlan
from passes import DecodeContext, LowerContext, SpecContext
from tests.helpers import fresh, tiny_models
from tests.scenarios.state_checks import (
    MODELS,
    Recorder,
    assert_accounted,
    assert_states_match,
    assert_tokens_need_state,
    reference_outputs,
    scratch_states,
    stale_fill,
    state_rows,
)

K = 2
PROMPTS = {1: list(b"def add(a, b):"), 2: list(b"import numpy")}


class _Spec:
    """The tiny target and its default draft, each with its pool, hook and executor, one ledger."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.executors: dict[str, Executor[Any]] = {}
        for pool_id, model in zip((TARGET_POOL, DRAFT_POOL), tiny_models(), strict=True):
            pool = model.new_pool(4, pool_id=pool_id)
            stale_fill(pool, seed=len(self.executors))
            self.executors[pool_id] = Executor(pool, self.ledger, model.serving_hook(capacity=4, kv_capacity=256, max_len=96))
        self.target, self.draft = self.executors[TARGET_POOL], self.executors[DRAFT_POOL]
        self.pipeline = Pipeline(self.ledger, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)), PassManager(verify_level=2))
        self._kv = 1

    def kv(self, n: int) -> list[int]:
        out = list(range(self._kv, self._kv + n))
        self._kv += n
        return out


def _states_after(w: _Spec, out: dict[int, list[int]], what: str) -> None:
    """Each pool's row of each request holds the state after its prompt and every emitted token but
    the pending (last) one: a from-scratch prefill of those tokens."""
    for rid, toks in out.items():
        fed = PROMPTS[rid] + toks[:-1]
        assert_states_match(state_rows(w.target.pool, rid), scratch_states(fed), f"{what}: request {rid} on the target")
        assert_states_match(state_rows(w.draft.pool, rid), scratch_states(fed, draft=True), f"{what}: request {rid} on the draft")


def test_the_next_verify_on_uncommitted_slots_is_refused_and_the_skipped_commit_still_runs() -> None:
    w = _Spec()
    pipe = w.pipeline
    batch, plan = pipe.prefill([fresh(rid, rid, p, w.kv(len(p))[0]) for rid, p in PROMPTS.items()])
    first = w.target.execute(plan)
    w.draft.execute(plan)
    out = {rid: [tok] for rid, tok in zip(first.rids.tolist(), first.tokens.tolist(), strict=True)}
    _states_after(w, out, "after the prefill")
    running = pipe.merge(DecodeBatch.empty(), batch)

    # iteration 1: draft and verify; the commit is lowered and never run
    d1, dp1 = pipe.draft(running, SpecContext(k=K, next_tokens=[out[r][-1] for r in running.rid_list()], kv_locs=w.kv(2 * (K + 1))))
    p1 = w.draft.execute(dp1)
    v1, vp1 = pipe.verify(d1, p1)
    verified = w.target.execute(vp1)
    result, c1, cp1 = pipe.commit(v1, verified)
    assert w.target.kept_states == (v1.verify_id,)

    # iteration 2 on the same slots: the draft pool holds no verify state and drafts; the target refuses
    d2, dp2 = pipe.draft(running, SpecContext(k=K, next_tokens=[out[r][-1] for r in running.rid_list()], kv_locs=w.kv(2 * (K + 1))))
    p2 = w.draft.execute(dp2)
    _, vp2 = pipe.verify(d2, p2)
    before = w.target.pool.buffer.clone()
    waits = rf"over slot 1 of pool 'target': the states of verify #{v1.verify_id} on that row wait for their commit"
    with pytest.raises(PlanExecutionError, match=rf"^VerifyPlan {waits} \(a CommitPlan naming verify #{v1.verify_id}\), which has not run$"):
        w.target.execute(vp2)
    _, decode = pipe.decode(running, DecodeContext(next_tokens=[out[r][-1] for r in running.rid_list()], kv_locs=w.kv(2)))
    with pytest.raises(PlanExecutionError, match=rf"^DecodePlan {waits}"):
        w.target.execute(decode)
    other_batch, other = pipe.prefill([fresh(9, 1, [1, 2, 3], w.kv(3)[0])])  # a prefill naming one of the rows
    with pytest.raises(PlanExecutionError, match=rf"^ExtendPlan {waits}"):
        w.target.execute(other)
    pipe.withdraw(other_batch, other, [RequestId(9)], reason="never meant to run: slot 1 is request 1's")
    assert torch.equal(w.target.pool.buffer, before) and w.target.kept_states == (v1.verify_id,)

    # the skipped commit runs now; the draft's kept states went with its newer draft: it catches up by a forward
    w.target.execute(cp1)
    assert w.target.kept_states == ()
    _, dcp1 = pipe.draft_commit(c1, d1)
    with pytest.raises(PlanExecutionError, match=rf"no kept states of draft #{d1.draft_id} on pool 'draft': .*dropped by a newer draft"):
        w.draft.execute(dcp1)
    caught_up, ep1 = pipe.draft_extend(c1)
    w.draft.execute(ep1)
    for i, rid in enumerate(c1.rid_list()):
        m = int(result.accepted[i])
        out[rid] += p1.tokens.reshape(-1, K)[i, :m].tolist() + [int(result.bonus[i])]
    running = pipe.merge(DecodeBatch.empty(), caught_up)
    _states_after(w, out, "after the late commit")

    # a whole iteration on: draft, verify, commit, draft commit
    d3, dp3 = pipe.draft(running, SpecContext(k=K, next_tokens=[out[r][-1] for r in running.rid_list()], kv_locs=w.kv(2 * (K + 1))))
    p3 = w.draft.execute(dp3)
    v3, vp3 = pipe.verify(d3, p3)
    result3, c3, cp3 = pipe.commit(v3, w.target.execute(vp3))
    w.target.execute(cp3)
    _, dcp3 = pipe.draft_commit(c3, d3)
    w.draft.execute(dcp3)
    for i, rid in enumerate(c3.rid_list()):
        m = int(result3.accepted[i])
        out[rid] += p3.tokens.reshape(-1, K)[i, :m].tolist() + [int(result3.bonus[i])]
    _states_after(w, out, "after the next iteration")
    assert out == {rid: reference_outputs(PROMPTS[rid], len(toks)) for rid, toks in out.items()}
    assert w.target.kept_states == () and w.draft.kept_states == ()
    w.ledger.assert_drained()
    assert list(w.ledger.cancelled().values()) == ["never meant to run: slot 1 is request 1's"] * 2  # its clear, on each pool


def test_with_the_draft_on_the_targets_pool_the_next_draft_is_refused() -> None:
    fb = FakeBackend(pools=("target",))
    pipe = Pipeline(fb.ledger, LowerContext(), PassManager(verify_level=2))
    batch, plan = pipe.prefill([fresh(1, 1, [1, 2, 3], 1), fresh(2, 2, [4, 5], 4)])
    pending = fb.execute(plan).tokens.tolist()
    running = pipe.merge(DecodeBatch.empty(), batch)
    d1, dp1 = pipe.draft(running, SpecContext(k=K, next_tokens=pending, kv_locs=list(range(10, 16))))
    v1, vp1 = pipe.verify(d1, fb.execute(dp1))
    _, _, cp1 = pipe.commit(v1, fb.execute(vp1))
    _, dp2 = pipe.draft(running, SpecContext(k=K, next_tokens=pending, kv_locs=list(range(20, 26))))
    before = fb.target.pool.buffer.clone()
    with pytest.raises(PlanExecutionError, match=rf"^DraftPlan over slot 1 of pool 'target': the states of verify #{v1.verify_id} on that row wait"):
        fb.execute(dp2)
    assert torch.equal(fb.target.pool.buffer, before) and fb.target.kept_states == (d1.draft_id, v1.verify_id)
    fb.execute(cp1)
    assert fb.target.kept_states == (d1.draft_id,)  # (a draft's states wait for no one: the next draft drops them)
    fb.execute(dp2)  # once committed, the next draft runs
    assert fb.target.kept_states == (dp2.batch.draft_id,)
    fb.ledger.assert_drained()


SERVED = [list(b"def f(x):"), list(b"class K:"), list(b"x = [1, 2]")]
NEW = 6


def _engine(models: str = "tiny", **options: Any) -> tuple[Engine, Recorder, Recorder]:
    target, draft = MODELS[models]()
    e = Engine(target, draft, k=K, capacity=3, **options)
    assert e.draft is not None
    return e, Recorder(e.target), Recorder(e.draft)


def _verify_then_its_commit(rec: Recorder) -> int:
    """On the target, every verify is followed at once by the commit that names it; returns how many."""
    plans = [r.plan for r in rec.ran]
    verifies = [i for i, p in enumerate(plans) if isinstance(p, VerifyPlan)]
    for i in verifies:
        nxt = plans[i + 1]
        v = plans[i]
        assert isinstance(v, VerifyPlan) and isinstance(nxt, CommitPlan) and nxt.batch.verify_id == v.batch.verify_id, (i, type(nxt).__name__)
    assert all(isinstance(p, (ExtendPlan, MixedPlan, DecodePlan, VerifyPlan, CommitPlan)) for p in plans)
    return len(verifies)


@pytest.mark.parametrize("models", MODELS)
def test_through_the_engine_each_verify_waits_for_its_commit_and_a_failed_one_is_retried(models: str) -> None:
    e, rec_t, rec_d = _engine(models, retries=1)
    target, draft = MODELS[models]()
    for i, p in enumerate(SERVED):
        e.admit(RequestId(i), p, max_new_tokens=NEW)
    with faults.armed(faults.FaultPoint.COMMIT, after=1) as fired:  # the second commit fails once
        e.run_until_done()
    assert fired == {faults.FaultPoint.COMMIT: 1} and e.stats.retries == 1 and e.stats.failed_steps == 0
    assert _verify_then_its_commit(rec_t) >= 2
    assert e.target.kept_states == ()
    assert e.outputs == {RequestId(i): reference_outputs(p, NEW, target) for i, p in enumerate(SERVED)}
    for i, p in enumerate(SERVED):
        assert_states_match(rec_t.prefilled[RequestId(i)], scratch_states(p, model=target), f"request {i} on the target after its prefill")
        assert_states_match(rec_d.prefilled[RequestId(i)], scratch_states(p, model=draft), f"request {i} on the draft after its prefill")
    if models == "state-sensitive":
        for p in (SERVED[0], SERVED[2]):  # a state gone wrong after the prompt (as a lost commit leaves it) shows in their tokens
            assert_tokens_need_state(p, len(p), NEW, target)  # (request 1's 6 tokens happen to come out the same from a zero state)
    assert_accounted(e)
    e.close()


def test_through_the_engine_a_commit_that_fails_without_retries_drops_the_verifys_states() -> None:
    e, rec_t, _ = _engine()
    for i, p in enumerate(SERVED[:2]):
        e.admit(RequestId(i), p, max_new_tokens=NEW)
    with faults.armed(faults.FaultPoint.COMMIT) as fired:
        e.run_until_done()
    assert fired == {faults.FaultPoint.COMMIT: 1} and e.stats.failed_steps == 1 and e.aborted_by_failure == {RequestId(0), RequestId(1)}
    assert e.target.kept_states == ()  # the failed commit's verify states went with its requests
    for rid, toks in e.outputs.items():
        assert toks == reference_outputs(SERVED[rid], NEW)[: len(toks)]
    aborted_slots = {s for p in rec_t.extend_plans() for s in p.slot_list()}
    e.admit(RequestId(2), SERVED[2], max_new_tokens=NEW)
    e.run_until_done()
    assert rec_t.extend_plans()[-1].rid_list() == [2] and rec_t.extend_plans()[-1].slot_list()[0] in aborted_slots  # an aborted request's slot
    assert e.outputs[RequestId(2)] == reference_outputs(SERVED[2], NEW)
    assert_states_match(rec_t.prefilled[RequestId(2)], scratch_states(SERVED[2]), "the next request after the failed commit")
    assert_accounted(e)
    assert all("its forward failed" in why for why in e.ledger.cancelled().values())
    e.close()
