"""Fault injection at the four points of ``backend.faults``: an op is applied and consumed, or not
applied and still outstanding, never half; a retried step gives the output of a run without the
fault; with no retries left the affected requests are aborted, their tickets cancelled as recorded
events, and everything else completes."""

from __future__ import annotations

import pytest
import torch

from backend import faults, state_init
from backend.executor import Executor
from backend.ledger import Ledger
from backend.model import blank_logits
from backend.pool import MambaStatePool
from backend.staging import StagedDecode, StagedExtend
from compiler.engine import Engine
from compiler.manager import PassManager
from compiler.prefix_cache import PrefixCache
from compiler.steps import Pipeline
from ir.ids import TARGET_POOL, RequestId
from passes import LowerContext
from tests.helpers import LAYOUT, REVIEW_NEW, REVIEW_PROMPTS, cow, engine, fresh, review_greedy


class _Writer:
    """Writes each request's token sum into its SSM rows (a stand-in model)."""

    def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor:
        assert extend is not None
        for i, slot in enumerate(extend.slots.tolist()):
            lo, hi = int(extend.cu_seqlens[i]), int(extend.cu_seqlens[i + 1])
            pool.ssm_state(0)[slot].add_(float(extend.input_ids[lo:hi].sum()))
        return blank_logits(extend, decode)


def _prefill_world(transactional: bool) -> tuple[Ledger, MambaStatePool, Executor, object]:
    ledger = Ledger()
    pool = MambaStatePool(TARGET_POOL, LAYOUT, 8)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, generator=torch.Generator().manual_seed(0), dtype=torch.uint8))
    ex = Executor(pool, ledger, _Writer(), transactional=transactional)
    _, plan = Pipeline(ledger, LowerContext(), PassManager(verify_level=2)).prefill(
        [fresh(1, 1, [3, 4], 1), cow(2, 2, src=5, prefix=4, tokens=[5], kv_start=10)]
    )
    return ledger, pool, ex, plan


@pytest.mark.parametrize("transactional", [False, True])
def test_failed_init_launch_restores_rows_and_keeps_the_ticket(transactional: bool) -> None:
    ledger, pool, ex, plan = _prefill_world(transactional)
    before = pool.copy_buffer()
    with faults.armed(faults.FaultPoint.INIT_LAUNCH) as fired, pytest.raises(faults.InjectedFault):
        ex.execute(plan)  # type: ignore[arg-type]  # the world builder returns the plan untyped
    assert fired == {faults.FaultPoint.INIT_LAUNCH: 1}
    assert torch.equal(pool.buffer, before)  # the clear and the copy that ran were undone
    assert len(ledger.outstanding()) == 1 and ledger.num_consumed == 0
    ex.execute(plan)  # type: ignore[arg-type]  # the retry runs the whole op once
    ledger.assert_drained()


@pytest.mark.parametrize("transactional", [False, True])
def test_an_init_launch_failing_midway_restores_rows_and_keeps_the_ticket(
    transactional: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch itself fails after writing part of its rows (the clears, not the copies): the
    rows it wrote are put back, the ticket stays outstanding, and a retry applies the whole op."""
    ledger, pool, ex, plan = _prefill_world(transactional)
    clean_ledger, clean_pool, clean_ex, clean_plan = _prefill_world(transactional)
    clean_ex.execute(clean_plan)  # type: ignore[arg-type]  # same world, no failure
    before = pool.copy_buffer()
    real = state_init.init_rows

    def clears_then_fail(buffer: torch.Tensor, clear: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        real(buffer, clear, src[:0], dst[:0])
        assert bool(clear.numel()) and not torch.equal(buffer, before), "the clears wrote nothing: nothing to restore"
        raise RuntimeError("launch failed after the clears")

    monkeypatch.setattr(state_init, "init_rows", clears_then_fail)
    with pytest.raises(RuntimeError, match="after the clears"):
        ex.execute(plan)  # type: ignore[arg-type]  # see above
    assert torch.equal(pool.buffer, before)  # the clears were undone: not half applied
    assert len(ledger.outstanding()) == 1 and ledger.num_consumed == 0
    monkeypatch.setattr(state_init, "init_rows", real)
    ex.execute(plan)  # type: ignore[arg-type]  # the retry runs the whole op once
    assert torch.equal(pool.buffer, clean_pool.buffer)
    ledger.assert_drained()


def test_failed_forward_in_a_transactional_executor_rolls_the_whole_forward_back() -> None:
    ledger, pool, ex, plan = _prefill_world(True)
    clean_ledger, clean_pool, clean_ex, clean_plan = _prefill_world(True)
    clean_ex.execute(clean_plan)  # type: ignore[arg-type]  # same world, no fault
    before = pool.copy_buffer()
    with faults.armed(faults.FaultPoint.MODEL_FORWARD), pytest.raises(faults.InjectedFault):
        ex.execute(plan)  # type: ignore[arg-type]  # see above
    assert torch.equal(pool.buffer, before) and len(ledger.outstanding()) == 1
    ex.execute(plan)  # type: ignore[arg-type]  # see above
    assert torch.equal(pool.buffer, clean_pool.buffer)
    ledger.assert_drained()


def test_failed_forward_in_a_plain_executor_leaves_the_init_applied_and_consumed() -> None:
    ledger, pool, ex, plan = _prefill_world(False)
    before = pool.copy_buffer()  # random bytes: a cleared row is zeros, a rolled-back row is not
    with faults.armed(faults.FaultPoint.MODEL_FORWARD), pytest.raises(faults.InjectedFault):
        ex.execute(plan)  # type: ignore[arg-type]  # see above
    assert ledger.outstanding() == () and ledger.num_consumed == 1  # applied and consumed
    # the exact pool a consumed init leaves: slot 1 cleared, slot 2 a copy of checkpoint 5, then the
    # stand-in model's write (it ran; the fault fired after it), every other row untouched
    expected = MambaStatePool(TARGET_POOL, LAYOUT, 8)
    expected.buffer.copy_(before)
    expected.buffer[1].zero_()
    expected.buffer[2].copy_(before[5])
    expected.ssm_state(0)[1].add_(3.0 + 4.0)  # request 1's tokens [3, 4]
    expected.ssm_state(0)[2].add_(5.0)  # request 2's token [5]
    assert torch.all(pool.conv_state(0)[1] == 0), "the clear of slot 1 was rolled back"
    assert torch.equal(pool.conv_state(0)[2], pool.conv_state(0)[5]), "the COW 5 -> 2 was rolled back"
    assert torch.equal(pool.buffer, expected.buffer)


def _serve(drv: Engine, ids: range = range(4)) -> None:
    for i in ids:
        drv.admit(RequestId(i), REVIEW_PROMPTS[i], max_new_tokens=REVIEW_NEW)
    drv.run_until_done()


@pytest.mark.parametrize(("point", "after"), [(p, 0) for p in faults.POINTS] + [(faults.FaultPoint.MODEL_FORWARD, 3), (faults.FaultPoint.COMMIT, 2)])
def test_a_retried_step_gives_the_fault_free_output(point: faults.FaultPoint, after: int) -> None:
    drv = engine(2, prefix_cache=PrefixCache(capacity=4, block=16), chunk_size=32, retries=1)
    with faults.armed(point, after=after) as fired:
        _serve(drv)
    assert fired == {point: 1}
    assert drv.stats.retries == 1 and drv.stats.failed_steps == 0
    assert drv.outputs == {RequestId(i): review_greedy()[RequestId(i)] for i in range(4)}
    drv.ledger.assert_drained()
    assert drv.ledger.cancelled() == {}
    drv.drop_cache()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0


@pytest.mark.parametrize("point", faults.POINTS)
def test_without_retries_the_affected_requests_are_aborted_and_serving_goes_on(point: faults.FaultPoint) -> None:
    drv = engine(2, prefix_cache=PrefixCache(capacity=4, block=16), chunk_size=32)
    with faults.armed(point) as fired:
        _serve(drv)
    assert fired == {point: 1}
    assert drv.stats.failed_steps == 1 and drv.stats.aborts >= 1
    for rid, out in drv.outputs.items():
        assert out == review_greedy()[rid][: len(out)]  # aborted ones stop early, the rest are complete
    drv.ledger.assert_drained()  # nothing outstanding: what never ran was cancelled, with a reason
    assert all("its forward failed" in why for why in drv.ledger.cancelled().values())
    _serve(drv, range(4, 6))  # the driver keeps serving after the failure
    assert all(drv.outputs[RequestId(i)] == review_greedy()[RequestId(i)] for i in (4, 5))
    drv.ledger.assert_drained()
    drv.drop_cache()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def test_an_aborted_prefill_gives_back_its_cache_reservation() -> None:
    """A chunk ending at a snapshot boundary reserves a prefix-cache entry for its snapshot. When
    its forward fails and the request is aborted, the reservation goes back with it: a one-entry
    cache still takes the next snapshot."""
    drv = engine(0, prefix_cache=PrefixCache(capacity=1, block=16))
    for i in range(2):  # both share the system prompt: the first one's chunk plans a snapshot
        drv.admit(RequestId(i), REVIEW_PROMPTS[i], max_new_tokens=1)
    with faults.armed(faults.FaultPoint.MODEL_FORWARD) as fired:
        drv.run_until_done()
    assert fired == {faults.FaultPoint.MODEL_FORWARD: 1} and drv.stats.failed_steps == 1 and drv.live == 0
    assert drv.cache is not None and len(drv.cache) == 0
    drv.admit(RequestId(2), REVIEW_PROMPTS[2], max_new_tokens=1)  # the shared prefix, seen a third time
    drv.run_until_done()
    assert drv.cache.stats.snapshots == 1 and len(drv.cache) == 1
    assert len(drv.outputs[RequestId(2)]) == 1
    drv.ledger.assert_drained()
    drv.drop_cache()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0
