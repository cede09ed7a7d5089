"""Prefix-cache snapshots: a one-shot op after the forward, through tickets and the ledger."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from backend.executor import Executor
from backend.ledger import Ledger
from backend.model import blank_logits
from backend.pool import MambaStatePool
from backend.staging import StagedDecode, StagedExtend
from compiler.manager import PassManager
from compiler.steps import Pipeline
from ir.errors import IRValidationError, IRVerificationError, PlanExecutionError, ResourceLeakError, ResourceReplayError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, RequestId
from ir.printer import dump
from ir.request import AdmittedRequest, Clear
from ir.verify import verify
from passes import LowerContext, filter_batch, prepare_for_extend
from tests.helpers import LAYOUT, fresh


def _snapshotting(rid: int, slot: int, cache: int, tokens: list[int], kv: int) -> AdmittedRequest:
    return AdmittedRequest(
        rid=RequestId(rid), slot=MambaSlot(slot), input_ids=tokens, kv_locs=list(range(kv, kv + len(tokens))),
        intent=Clear(), snapshot_to=MambaSlot(cache), more_chunks=True,
    )


class _Writer:
    """Writes the forward's token sum into each request row, and records what the cache row held then."""

    def __init__(self) -> None:
        self.cache_at_forward: list[torch.Tensor] = []

    def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor:
        assert extend is not None
        self.cache_at_forward.append(pool.buffer[7].clone())
        for i, slot in enumerate(extend.slots.tolist()):
            lo, hi = extend.cu_seqlens[i].item(), extend.cu_seqlens[i + 1].item()
            pool.ssm_state(0)[slot].fill_(float(extend.input_ids[lo:hi].sum()))
        return blank_logits(extend, decode)


def test_snapshot_is_lowered_per_pool_and_applied_after_the_forward() -> None:
    ledger = Ledger()
    pools = MambaStatePool(TARGET_POOL, LAYOUT, 8), MambaStatePool(DRAFT_POOL, LAYOUT, 8)
    writer = _Writer()
    execs = [Executor(p, ledger, writer) for p in pools]
    pipe = Pipeline(ledger, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)), PassManager(verify_level=2))
    batch, plan = pipe.prefill([_snapshotting(1, 1, 7, [3, 4], 1), fresh(2, 2, [5], 10)])
    assert batch.snapshot is not None and batch.snapshot.src == (1,) and batch.snapshot.dst == (7,)
    assert [t.pool for t in plan.snapshots] == [TARGET_POOL, DRAFT_POOL]
    assert "snapshot ticket op=snapshot #2 [s1->s3] pool=target" in dump(plan)
    for ex, pool in zip(execs, pools, strict=True):
        ex.execute(plan)
        assert torch.equal(pool.buffer[7], pool.buffer[1])  # the state after the forward
        assert float(pool.ssm_state(0)[7].flatten()[0]) == 7.0
    assert all(torch.all(c == 0) for c in writer.cache_at_forward)  # not yet written while the model ran
    ledger.assert_drained()
    assert ledger.counts(TARGET_POOL).snapshots == ledger.counts(DRAFT_POOL).snapshots == 1
    for replay in (plan, copy.deepcopy(plan)):
        with pytest.raises(ResourceReplayError, match="ticket #"):
            execs[0].execute(replay)


def test_unconsumed_snapshot_is_a_leak() -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)), PassManager(verify_level=2))
    _, plan = pipe.prefill([_snapshotting(1, 1, 7, [3, 4], 1)])
    Executor(MambaStatePool(TARGET_POOL, LAYOUT, 8), ledger).execute(plan)
    with pytest.raises(ResourceLeakError, match=rf"snapshot ticket #{plan.snapshots[0].serial} for pool 'draft'"):
        ledger.assert_drained()


def test_snapshot_into_a_live_request_slot_is_a_verification_error() -> None:
    batch = prepare_for_extend([_snapshotting(1, 1, 2, [3, 4], 1), fresh(2, 2, [5], 10)])
    with pytest.raises(IRVerificationError, match="snapshot.dst"):
        verify(batch)


def test_snapshot_to_own_slot_is_refused() -> None:
    with pytest.raises(IRValidationError, match="snapshot_to"):
        _snapshotting(1, 1, 1, [3], 1)


def test_filter_drops_the_snapshot_of_a_dropped_request() -> None:
    batch = prepare_for_extend([_snapshotting(1, 1, 7, [3, 4], 1), fresh(2, 2, [5], 10)])
    assert filter_batch(batch, [RequestId(1)]).snapshot is None
    kept = filter_batch(batch, [RequestId(2)]).snapshot
    assert kept is not None and batch.snapshot is not None and kept.serial == batch.snapshot.serial


def test_snapshot_out_of_pool_range_changes_nothing() -> None:
    ledger = Ledger()
    pool = MambaStatePool(TARGET_POOL, LAYOUT, 4)
    pipe = Pipeline(ledger, LowerContext(), PassManager(verify_level=2))
    _, plan = pipe.prefill([_snapshotting(1, 1, 9, [3, 4], 1)])
    before = pool.copy_buffer()
    with pytest.raises(PlanExecutionError, match=r"snapshot #\d+: dst slot 9 out of range"):
        Executor(pool, ledger).execute(plan)
    assert torch.equal(pool.buffer, before)
    assert len(ledger.outstanding()) == 2
    assert np.array_equal(plan.slots, [1])
