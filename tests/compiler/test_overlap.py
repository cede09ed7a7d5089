"""Overlap: the engine with each model's executor in its own process (``backend.remote``), fed
packed plan messages. It serves token for token what the in-process engine serves; the
scheduler's ledger refuses a replayed plan before a byte leaves the process; the executor process
refuses a message out of order and a ticket whose serial the scheduler did not mint; faults in the
executor process are retried or abort their requests exactly as in process; a dead executor process
fails its forwards instead of hanging the engine."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import attrs
import pytest
from typeguard import suppress_type_checks

from backend import faults
from backend.ledger import Ledger
from backend.remote import ExecutorGone, ExecutorProcess, ExecutorRefused, Pending
from compiler.cli import main
from compiler.engine import Engine
from compiler.engine.report import StepKind
from compiler.manager import PassManager
from compiler.prefix_cache import PrefixCache
from compiler.serve import ServeConfig, ServeError
from compiler.steps import Pipeline
from ir.errors import IRValidationError, PreconditionError, ResourceReplayError
from ir.ids import TARGET_POOL, RequestId
from ir.init import SERIAL_COUNTER_BITS, InitTicket, MambaInit, this_epoch
from ir.wire import pack
from passes import LowerContext
from tests.helpers import REVIEW_NEW, REVIEW_PROMPTS, engine, fresh, review_greedy, tiny_models


def _serve(drv: Engine, ids: range = range(4)) -> None:
    for i in ids:
        drv.admit(RequestId(i), REVIEW_PROMPTS[i], max_new_tokens=REVIEW_NEW)
    drv.run_until_done()


def _child(ex: ExecutorProcess) -> int:
    return ex._proc.pid


@pytest.mark.parametrize("k", [0, 2])
def test_overlap_serves_what_the_in_process_engine_serves(k: int) -> None:
    options = {"prefix_cache": PrefixCache(capacity=4, block=16), "chunk_size": 32}
    plain = engine(k, **options)  # type: ignore[arg-type]  # the options are Engine's keywords
    _serve(plain, range(6))
    with engine(k, overlap=True, prefix_cache=PrefixCache(capacity=4, block=16), chunk_size=32) as drv:
        cp = drv.make_prefix(REVIEW_PROMPTS[0][:20])
        drv.admit(RequestId(99), REVIEW_PROMPTS[1], max_new_tokens=3, prefix=cp)
        drv.run_until_done()
        drv.release_prefix(cp)
        del drv.outputs[RequestId(99)]
        _serve(drv, range(6))
        assert drv.outputs == plain.outputs == {RequestId(i): review_greedy()[RequestId(i)] for i in range(6)}
        drv.drop_cache()
        drv.ledger.assert_drained()
        assert drv.ledger.counts(TARGET_POOL).clears > 0 and drv.ledger.cancelled() == {}
        assert drv.slots.num_live == 0 and drv.kv.num_live == 0
        assert drv.busy_intervals()  # the forwards ran in the executor processes


def _prefill(ledger: Ledger) -> object:
    _, plan = Pipeline(ledger, LowerContext(), PassManager(verify_level=2)).prefill([fresh(1, 1, [3, 4], 1)])
    return plan


def _process(ledger: Ledger) -> ExecutorProcess:
    target, _ = tiny_models()
    return ExecutorProcess(target, pool_id=TARGET_POOL, capacity=4, kv_capacity=64, max_len=32, ledger=ledger)


def test_the_scheduler_refuses_a_replayed_plan_before_sending_it() -> None:
    ledger = Ledger()
    with _process(ledger) as ex:
        plan = _prefill(ledger)
        assert ex.execute(plan) is not None  # type: ignore[arg-type]  # _prefill returns the plan untyped
        with pytest.raises(ResourceReplayError):
            ex.execute(plan)  # type: ignore[arg-type]
        assert ex._next == 1  # nothing was sent
        ledger.assert_drained()
        assert ex.execute(_prefill(ledger)) is not None  # type: ignore[arg-type]  # the next message still fits


def test_the_executor_process_refuses_a_message_out_of_order_and_a_serial_it_does_not_trust() -> None:
    ledger = Ledger()
    with _process(ledger) as ex:
        plan = _prefill(ledger)
        ex.wait_ready()
        ex._send(("plan", pack(5, plan)))  # type: ignore[arg-type]  # a skipped message number
        p = Pending(5, None, None)
        ex._pending.append(p)
        with pytest.raises(ExecutorRefused, match="expected step 0"):
            ex.wait(p)
        # a serial minted by no process the executor trusts, sent past the scheduler's ledger
        other = (this_epoch() % (1 << 30) + 1) << SERIAL_COUNTER_BITS | 1
        forged = InitTicket(pool=TARGET_POOL, init=MambaInit(serial=other, clear_slots=(1,)))
        bad = attrs.evolve(plan, tickets=(forged,))  # type: ignore[misc]  # the plan is untyped here
        ex._send(("plan", pack(0, bad)))
        p = Pending(0, None, None)
        ex._pending.append(p)
        with pytest.raises(ExecutorRefused, match="UnknownTicketError"):
            ex.wait(p)


@pytest.mark.parametrize("point", faults.POINTS)
def test_a_fault_in_the_executor_process_is_retried_to_the_fault_free_output(point: faults.FaultPoint) -> None:
    with engine(2, overlap=True, prefix_cache=PrefixCache(capacity=4, block=16), chunk_size=32, retries=1) as drv:
        assert isinstance(drv.target, ExecutorProcess)
        drv.target.arm_fault(point)
        _serve(drv)
        assert drv.stats.retries == 1 and drv.stats.failed_steps == 0
        assert drv.outputs == {RequestId(i): review_greedy()[RequestId(i)] for i in range(4)}
        drv.ledger.assert_drained()
        assert drv.ledger.cancelled() == {}


@pytest.mark.parametrize("point", faults.POINTS)
def test_without_retries_a_fault_in_the_executor_process_aborts_its_requests_and_serving_goes_on(point: faults.FaultPoint) -> None:
    with engine(2, overlap=True, prefix_cache=PrefixCache(capacity=4, block=16), chunk_size=32) as drv:
        assert isinstance(drv.target, ExecutorProcess)
        drv.target.arm_fault(point)
        _serve(drv)
        assert drv.stats.failed_steps == 1 and drv.stats.aborts >= 1
        for rid, out in drv.outputs.items():
            assert out == review_greedy()[rid][: len(out)]
        drv.ledger.assert_drained()
        assert all("its forward failed" in why for why in drv.ledger.cancelled().values())
        # the executor processes cancelled their copies too: the freed rows serve new requests
        _serve(drv, range(4, 6))
        assert all(drv.outputs[RequestId(i)] == review_greedy()[RequestId(i)] for i in (4, 5))
        drv.ledger.assert_drained()
        drv.drop_cache()
        assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def test_a_dead_executor_process_fails_its_forwards_instead_of_hanging() -> None:
    with engine(2, overlap=True) as drv:
        drv.admit(RequestId(0), REVIEW_PROMPTS[0], max_new_tokens=REVIEW_NEW)
        drv.step()
        assert isinstance(drv.draft, ExecutorProcess)
        os.kill(_child(drv.draft), signal.SIGKILL)
        drv._executors()[1]._proc.wait()  # type: ignore[union-attr]  # both are ExecutorProcess here
        report = drv.step()
        assert report.kind is StepKind.FAILED and drv.live == 0
        assert drv.aborted_by_failure == {RequestId(0)}
        drv.ledger.assert_drained()
        with pytest.raises(ExecutorGone):
            drv.draft.execute(_prefill(drv.ledger))  # type: ignore[arg-type]


def test_closed_engine_and_bad_arguments() -> None:
    target, draft = tiny_models()
    with suppress_type_checks():  # a hostile caller, as an untyped one would be
        with pytest.raises(PreconditionError, match="overlap must be a bool"):
            Engine(target, None, k=0, overlap=1)  # type: ignore[arg-type]  # the bad value is the point
        for name, bad in (("capacity", True), ("threads", 0), ("max_len", 2.0)):
            args = {"capacity": 4, "kv_capacity": 64, "max_len": 32, "threads": 1, name: bad}
            with pytest.raises(IRValidationError, match=f"ExecutorProcess.{name}"):
                ExecutorProcess(target, pool_id=TARGET_POOL, ledger=Ledger(), **args)  # type: ignore[arg-type]
    drv = Engine(target, None, k=0, overlap=True)
    drv.close()
    drv.close()  # idempotent
    assert isinstance(drv.target, ExecutorProcess) and drv.target.closed
    drv.admit(RequestId(0), REVIEW_PROMPTS[0], max_new_tokens=2)
    assert drv.step().kind is StepKind.FAILED and drv.aborted_by_failure == {RequestId(0)}


def test_batchc_run_with_overlap(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    assert main(["run", "--requests", "6", "--max-new-tokens", "6", "--overlap", "--json", str(path)]) == 0
    summary = json.loads(path.read_text())
    assert summary["lossless_ok"] is True and summary["outstanding_tickets"] == 0
    assert summary["slots_live_after"] == 0 and summary["kv_live_after"] == 0
    minted, consumed = summary["target_clears_minted_consumed"].split("/")
    assert int(minted) == int(consumed) > 0
    # the model time is the time an executor process ran a plan: within the wall time
    assert 0.0 < summary["model_s"] < summary["wall_s"] and summary["host_ms_per_step"] > 0.0
    with pytest.raises(ServeError, match="overlap must be a bool"):
        ServeConfig(overlap=1)  # type: ignore[arg-type]  # an untyped caller's switch
