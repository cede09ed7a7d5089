"""The SGLang stale-init replay (PR #37165), restated for batchc, and reproduced on the mutable baseline.

batchc side: a prefill with one fresh slot (clear) and one cached prefix (COW) goes through
``filter_batch`` (nothing removed), ``merge_batch`` and ``prepare_for_decode``. No plan lowered from
a later batch carries a ticket; executing the extend plan again, or a deep copy or pickled copy of
it, raises ``ResourceReplayError`` naming the serial and the pool and leaves the pool untouched; a
ticket that never runs is reported by ``assert_drained``.

Baseline side: the pre-fix lifecycle keeps the three index fields on the long-lived batch, so in
speculative mode every DRAFT_EXTEND forward replays them on the draft pool; the ledger refuses the
first replay; the upstream fix stops it.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from backend.executor import Executor
from backend.ledger import Ledger
from backend.pool import MambaStatePool
from compiler.baselines.mutable import ForwardMode, ModelRunner, Req, ScheduleBatch
from compiler.manager import PassManager
from compiler.steps import Pipeline
from ir.errors import ResourceLeakError, ResourceReplayError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot
from ir.plan import DecodePlan
from passes import DecodeContext, LowerContext
from tests.helpers import LAYOUT, cow, empty_decode, fresh

CACHED = MambaSlot(5)


def _pools() -> tuple[MambaStatePool, MambaStatePool]:
    pools = MambaStatePool(TARGET_POOL, LAYOUT, 8), MambaStatePool(DRAFT_POOL, LAYOUT, 8)
    for p in pools:
        p.buffer[CACHED].fill_(7)  # the cached prefix state
        p.buffer[1].fill_(0xAB)  # stale bytes from the slot's previous owner
    return pools


def test_init_ops_cannot_follow_the_request_into_decode() -> None:
    ledger = Ledger()
    target, draft = _pools()
    pipeline = Pipeline(ledger, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)), PassManager(verify_level=2))
    ex_t, ex_d = Executor(target, ledger), Executor(draft, ledger)

    extend, plan = pipeline.prefill([fresh(1, 1, [10, 11, 12], 1), cow(2, 2, CACHED, 4, [13, 14], 10)])
    for ex in (ex_t, ex_d):
        ex.execute(plan)
    for pool in (target, draft):
        assert torch.all(pool.buffer[1] == 0)
        assert torch.equal(pool.buffer[2], pool.buffer[CACHED])
    assert ledger.outstanding() == ()
    assert ledger.counts(TARGET_POOL).tickets == ledger.counts(DRAFT_POOL).tickets == 1

    assert pipeline.filter_extend(extend, []) is extend  # nothing removed
    running = pipeline.merge(empty_decode(), extend)
    plans: list[DecodePlan] = []
    batch = running
    for step in range(4):
        ctx = DecodeContext(next_tokens=[20 + step, 30 + step], kv_locs=[100 + step, 200 + step])
        batch, dplan = pipeline.decode(batch, ctx)
        plans.append(dplan)
        # the live state evolves (stand-in for the model's writes)
        for pool in (target, draft):
            pool.buffer[1].add_(1)
            pool.buffer[2].add_(1)
        for ex in (ex_t, ex_d):
            ex.adopt_pool_contents()  # declared to the in-place mutation detector (BATCHC_VERIFY=2)
            ex.execute(dplan)
    assert all(type(p) is DecodePlan for p in plans)
    assert "tickets" not in {f.name for f in DecodePlan.__attrs_attrs__}
    assert ledger.counts(TARGET_POOL).tickets == ledger.counts(DRAFT_POOL).tickets == 1

    live = (target.copy_buffer(), draft.copy_buffer())
    assert plan.tickets
    serial = plan.tickets[0].serial
    for replay in (plan, copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))):
        for ex, pool_name in ((ex_t, "target"), (ex_d, "draft")):
            with pytest.raises(ResourceReplayError, match=rf"ticket #{serial} for pool '{pool_name}'.*already consumed"):
                ex.execute(replay)
    assert torch.equal(target.buffer, live[0]) and torch.equal(draft.buffer, live[1])
    assert ledger.replays_blocked == 6


def test_relowering_an_executed_prefill_is_refused_at_registration() -> None:
    ledger = Ledger()
    target, _ = _pools()
    pipeline = Pipeline(ledger, LowerContext(), PassManager(verify_level=2))
    extend, plan = pipeline.prefill([fresh(1, 1, [1, 2], 1)])
    Executor(target, ledger).execute(plan)
    with pytest.raises(ResourceReplayError, match="already consumed"):
        ledger.register(plan.tickets)


def test_a_ticket_never_executed_is_a_leak() -> None:
    ledger = Ledger()
    target, _ = _pools()
    pipeline = Pipeline(ledger, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)), PassManager(verify_level=2))
    _, plan = pipeline.prefill([fresh(1, 1, [1, 2], 1)])
    Executor(target, ledger).execute(plan)  # the draft pool never sees its ticket
    with pytest.raises(ResourceLeakError, match=rf"ticket #{plan.tickets[0].serial} for pool 'draft'"):
        ledger.assert_drained()


# -- the mutable baseline reproduces the bug --------------------------------------------------


def _baseline(spec: bool, fixed: bool = False, ledger: Ledger | None = None) -> tuple[ScheduleBatch, ModelRunner, ModelRunner]:
    target, draft = _pools()
    batch = ScheduleBatch(spec_enabled=spec, fixed=fixed)
    reqs = [Req(rid=1, slot=1, prompt=[10, 11, 12]), Req(rid=2, slot=2, prompt=[9, 9, 9, 9, 13, 14], prefix_len=4, cow_src=int(CACHED))]
    batch.prepare_for_extend(reqs, torch.arange(1, 6))
    runners = ModelRunner(target, ledger), ModelRunner(draft, ledger)
    for r in runners:
        r.forward(batch.get_model_worker_batch())
    batch.output_ids = torch.tensor([20, 30])
    return batch, runners[0], runners[1]


def _iterate(batch: ScheduleBatch, target: ModelRunner, draft: ModelRunner, steps: int) -> None:
    batch.filter_batch(keep=[0, 1])  # nothing finished: fields survive
    running = batch  # nothing was running: the prefill batch becomes the running batch
    for step in range(steps):
        running.output_ids = torch.tensor([20 + step, 30 + step])
        running.prepare_for_decode(torch.tensor([100 + step, 200 + step]))
        if running.spec_enabled:
            target.forward(running.get_model_worker_batch(ForwardMode.TARGET_VERIFY))
            draft.forward(running.get_model_worker_batch(ForwardMode.DRAFT_EXTEND))
        else:
            target.forward(running.get_model_worker_batch())
            draft.forward(running.get_model_worker_batch())


def test_baseline_replays_stale_init_every_draft_extend() -> None:
    batch, target, draft = _baseline(spec=True)
    draft.pool.buffer[1].fill_(3)  # live draft state after the prefill
    _iterate(batch, target, draft, steps=5)
    assert draft.replays == 5 and draft.executed == 6
    assert target.replays == 0
    assert torch.all(draft.pool.buffer[1] == 0)  # the live state was re-zeroed


def test_baseline_merge_keeps_the_running_batch_fields() -> None:
    batch, _, _ = _baseline(spec=True)
    other, _, _ = _baseline(spec=True)
    stale = batch.mamba_clear_indices
    batch.merge_batch(other)
    assert batch.mamba_clear_indices is stale and batch.init_origin != other.init_origin


def test_baseline_without_spec_does_not_replay() -> None:
    batch, target, draft = _baseline(spec=False)
    _iterate(batch, target, draft, steps=5)
    assert target.replays == draft.replays == 0


def test_upstream_fix_stops_the_replay() -> None:
    batch, target, draft = _baseline(spec=True, fixed=True)
    _iterate(batch, target, draft, steps=5)
    assert draft.replays == 0


def test_ledger_refuses_the_first_baseline_replay() -> None:
    ledger = Ledger()
    batch, target, draft = _baseline(spec=True, ledger=ledger)
    draft.pool.buffer[1].fill_(3)
    before = draft.pool.copy_buffer()
    with pytest.raises(ResourceReplayError, match=r"pool 'draft'.*already consumed"):
        _iterate(batch, target, draft, steps=5)
    assert draft.replays == 0
    assert torch.equal(draft.pool.buffer, before)
    assert ledger.replays_blocked == 1



