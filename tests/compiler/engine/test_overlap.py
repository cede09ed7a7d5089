"""Overlap: the engine with each model's executor in its own process (``backend.remote``), fed
packed plan messages. It serves token for token what the in-process engine serves; the
scheduler's ledger refuses a replayed plan before a byte leaves the process; the executor process
refuses a malformed message (``WireError``: a refusal, not a fault), a message out of order and a
ticket whose serial the scheduler did not mint; faults in the executor process are retried or
abort their requests exactly as in process; a dead executor process fails its forwards instead of
hanging the engine.

The engines here serve the state-sensitive tiny target and its draft
(``tests.scenarios.state_checks.sensitive_models``), and their tokens are compared with that
target's from-scratch greedy reference: its tokens change when a Mamba init is wrong, stale, missing
or applied twice (a fault's rows not put back, a retracted request's re-prefill), where the tiny
target's attention layer would carry the context past such a state."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import attrs
import pytest
from typeguard import suppress_type_checks

from backend import faults
from backend.hybrid.model import HybridModel
from backend.hybrid.reference import greedy_generate_reference
from backend.ledger import Ledger
from backend.remote import ExecutorGone, ExecutorProcess, ExecutorRefused, Pending, Processes
from compiler.cli import main
from compiler.engine import Engine
from compiler.engine.report import StepKind
from compiler.manager import PassManager
from compiler.offline import ServeConfig, ServeError
from compiler.prefix_cache import PrefixCache
from compiler.steps import Pipeline
from ir.errors import IRValidationError, PlanExecutionError, PreconditionError, ResourceReplayError
from ir.ids import TARGET_POOL, RequestId
from ir.init import SERIAL_COUNTER_BITS, MambaInit, Ticket, this_epoch
from ir.mint import mint_sample_id
from ir.parse import parse
from ir.plan import DecodePlan
from ir.printer import dump
from ir.wire import WIRE_VERSION, pack
from passes import LowerContext
from passes.prepare_for_decode import DecodeContext
from tests.helpers import REVIEW_NEW, REVIEW_PROMPTS, fresh, kill_child, tiny_models
from tests.scenarios.state_checks import sensitive_models


def engine(k: int, **options: Any) -> Engine:
    """An ``Engine`` over the state-sensitive models (the draft only when ``k > 0``; the module)."""
    target, draft = sensitive_models()
    return Engine(target, draft if k else None, k=k, **options)


@cache
def review_greedy() -> dict[RequestId, list[int]]:
    """The state-sensitive target's from-scratch greedy output for each of ``REVIEW_PROMPTS``."""
    target = sensitive_models()[0]
    return {RequestId(i): greedy_generate_reference(target, p, REVIEW_NEW) for i, p in enumerate(REVIEW_PROMPTS)}


def _serve(drv: Engine, ids: range = range(4)) -> None:
    for i in ids:
        drv.admit(RequestId(i), REVIEW_PROMPTS[i], max_new_tokens=REVIEW_NEW)
    drv.run_until_done()


@pytest.mark.parametrize("k", [0, 2])
def test_overlap_serves_what_the_in_process_engine_serves(k: int) -> None:
    options = {"prefix_cache": PrefixCache(capacity=4, block=16), "chunk_size": 32}
    plain = engine(k, **options)  # type: ignore[arg-type]  # the options are Engine's keywords
    _serve(plain, range(6))
    with engine(k, transport=Processes(), prefix_cache=PrefixCache(capacity=4, block=16), chunk_size=32) as drv:
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
        assert len(ex.busy) == 1  # one reply read: the replay was never sent
        ledger.assert_drained()
        assert ex.execute(_prefill(ledger)) is not None  # type: ignore[arg-type]  # the next message still fits


def _huge_integer_message(step: int) -> bytes:
    """A plan message for ``step`` whose header is a 5,000-digit integer (``unpack`` raised ValueError)."""
    header = b"[" + b"1" * 5000 + b"]"
    header += b" " * (-(24 + len(header)) % 8)
    return struct.pack("<4sHHQII", b"BCPL", WIRE_VERSION, 0, step, len(header), 0) + header


def test_the_executor_process_refuses_a_malformed_message_one_out_of_order_and_a_serial_it_does_not_trust() -> None:
    ledger = Ledger()
    with _process(ledger) as ex:
        plan = _prefill(ledger)
        ex.wait_ready()
        ex._send(("plan", _huge_integer_message(0)))
        p = Pending(0, None, None)
        ex._pending.append(p)
        with pytest.raises(ExecutorRefused, match=r"^WireError in the executor process: plan message: integer of 5000 characters"):
            ex.wait(p)  # a refusal (never retried), not a ForwardFailed fault; and it did not count (step 0 is still expected)
        ex._send(("plan", pack(5, plan)))  # type: ignore[arg-type]  # a skipped message number
        p = Pending(5, None, None)
        ex._pending.append(p)
        with pytest.raises(ExecutorRefused, match="expected step 0"):
            ex.wait(p)
        # a serial minted by no process the executor trusts, sent past the scheduler's ledger
        other = (this_epoch() % (1 << 30) + 1) << SERIAL_COUNTER_BITS | 1
        forged = Ticket(pool=TARGET_POOL, op=MambaInit(serial=other, clear_slots=(1,)))
        bad = attrs.evolve(plan, tickets=(forged,))  # type: ignore[misc]  # the plan is untyped here
        ex._send(("plan", pack(0, bad)))
        p = Pending(0, None, None)
        ex._pending.append(p)
        with pytest.raises(ExecutorRefused, match="UnknownTicketError"):
            ex.wait(p)


_FAULTED: dict[tuple[int, bool], Engine] = {}
"""The fault tests' engines, one per (k, retries), built by the first test that needs one: each test
serves on an engine that earlier faults have hit (its own requests, with request ids no earlier test
used), so a recovery that left anything behind (a row, a ticket, a cached entry, an executor
process's pending state) fails the tests after it; and each such engine starts its two executor
processes once, not once per fault point (a process start is an interpreter importing torch)."""


@pytest.fixture(scope="module", autouse=True)
def _faulted_engines_closed() -> Iterator[None]:
    yield
    for drv in _FAULTED.values():
        drv.close()
    _FAULTED.clear()


def _faulted(k: int, *, retries: bool) -> Engine:
    """The shared engine for (k, retries), idle, with no cached entry and nothing live."""
    key = (k, retries)
    if key not in _FAULTED:
        options = {"retries": 1} if retries else {}
        _FAULTED[key] = engine(k, transport=Processes(), prefix_cache=PrefixCache(capacity=4, block=16), chunk_size=32, **options)
    drv = _FAULTED[key]
    assert drv.live == 0 and drv.slots.num_live == 0 and drv.kv.num_live == 0, "an earlier fault test left rows behind"
    return drv


def _serve_fresh(drv: Engine, prompts: range) -> dict[RequestId, RequestId]:
    """Serve ``REVIEW_PROMPTS[i]`` for ``i`` in ``prompts`` under request ids this engine has not
    seen; returns each new id's prompt index as a ``RequestId`` (the key of ``review_greedy``)."""
    base = 1000 * (1 + max((int(r) // 1000 for r in drv.outputs), default=0))
    ids = {RequestId(base + i): RequestId(i) for i in prompts}
    for rid, i in ids.items():
        drv.admit(rid, REVIEW_PROMPTS[int(i)], max_new_tokens=REVIEW_NEW)
    drv.run_until_done()
    return ids


@pytest.mark.parametrize("point", faults.POINTS)
def test_a_fault_in_the_executor_process_is_retried_to_the_fault_free_output(point: faults.FaultPoint) -> None:
    drv = _faulted(2, retries=True)
    assert isinstance(drv.target, ExecutorProcess)
    retries, failed = drv.stats.retries, drv.stats.failed_steps
    drv.target.arm_fault(point)
    ids = _serve_fresh(drv, range(4))
    assert drv.stats.retries == retries + 1 and drv.stats.failed_steps == failed
    assert {rid: drv.outputs[rid] for rid in ids} == {rid: review_greedy()[i] for rid, i in ids.items()}
    drv.ledger.assert_drained()
    assert drv.ledger.cancelled() == {}
    drv.drop_cache()  # the next test starts from an empty cache, as a fresh engine does


@pytest.mark.parametrize(
    ("k", "point", "after"),
    [(2, p, 0) for p in faults.POINTS] + [(0, faults.FaultPoint.MODEL_FORWARD, a) for a in (0, 5, 7)],  # 7: a late decode (the run has 9 forwards)
)
def test_without_retries_a_fault_in_the_executor_process_aborts_its_requests_and_serving_goes_on(
    k: int, point: faults.FaultPoint, after: int
) -> None:
    # k = 0: the decodes are pipelined, so the failed forward has a decode in flight behind it
    drv = _faulted(k, retries=False)
    assert isinstance(drv.target, ExecutorProcess)
    assert drv.forwards.pipelined == (k == 0)
    failed, aborts, cancelled = drv.stats.failed_steps, drv.stats.aborts, dict(drv.ledger.cancelled())
    drv.target.arm_fault(point, after=after)
    ids = _serve_fresh(drv, range(4))
    assert drv.stats.failed_steps == failed + 1 and drv.stats.aborts >= aborts + 1
    for rid, i in ids.items():
        out = drv.outputs.get(rid, [])
        assert out == review_greedy()[i][: len(out)]
    drv.ledger.assert_drained()
    new = {t: why for t, why in drv.ledger.cancelled().items() if t not in cancelled}
    # (a fault after the requests' tickets were consumed, at a commit or a late decode, cancels none)
    assert all("its forward failed" in why for why in new.values())
    # the executor processes cancelled their copies too: the freed rows serve new requests
    again = _serve_fresh(drv, range(4, 6))
    assert all(drv.outputs[rid] == review_greedy()[i] for rid, i in again.items())
    drv.ledger.assert_drained()
    drv.drop_cache()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def test_a_dead_executor_process_fails_its_forwards_instead_of_hanging() -> None:
    with engine(2, transport=Processes()) as drv:
        drv.admit(RequestId(0), REVIEW_PROMPTS[0], max_new_tokens=REVIEW_NEW)
        drv.step()
        assert isinstance(drv.draft, ExecutorProcess)
        kill_child(drv.draft)
        report = drv.step()
        assert report.kind is StepKind.FAILED and drv.live == 0
        assert drv.aborted_by_failure == {RequestId(0)}
        drv.ledger.assert_drained()
        with pytest.raises(ExecutorGone):
            drv.draft.execute(_prefill(drv.ledger))  # type: ignore[arg-type]


class _Unpicklable(HybridModel):
    """A served model that cannot travel to an executor process (it holds, say, a lock)."""

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("holds a lock")


def test_closed_engine_and_bad_arguments() -> None:
    target, draft = tiny_models()
    with suppress_type_checks():  # a hostile caller, as an untyped one would be
        with pytest.raises(PreconditionError, match=r"^Engine: transport must be a backend.boundary.Transport, not int \(got 1\)$"):
            Engine(target, None, k=0, transport=1)  # type: ignore[arg-type]  # the bad value is the point
        for name, bad in (("capacity", True), ("threads", 0), ("max_len", 2.0)):
            args = {"capacity": 4, "kv_capacity": 64, "max_len": 32, "threads": 1, name: bad}
            with pytest.raises(IRValidationError, match=f"ExecutorProcess.{name}"):
                ExecutorProcess(target, pool_id=TARGET_POOL, ledger=Ledger(), **args)  # type: ignore[arg-type]
    with pytest.raises(IRValidationError, match="ExecutorProcess.model: must pickle"):
        ExecutorProcess(_Unpicklable(target.config, target.weights), pool_id=TARGET_POOL, capacity=4, kv_capacity=64,
                        max_len=32, ledger=Ledger())
    drv = Engine(target, None, k=0, transport=Processes())
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


# -- pipelined decodes (k = 0): each decode built while the previous one runs ---------------------


def _pipelined(**options: object) -> Engine:
    """An in-process engine whose decodes are pipelined as ``overlap`` pipelines them (the same
    plans, without the processes)."""
    drv = engine(0, **options)  # type: ignore[arg-type]  # the options are Engine's keywords
    drv.forwards.pipelined = True
    return drv


@pytest.mark.parametrize("in_process", [True, False])
def test_pipelined_decodes_emit_what_plain_decodes_emit_stops_and_aborts_included(in_process: bool) -> None:
    greedy = review_greedy()
    stop = greedy[RequestId(2)][3]  # request 2 emits it before its limit: it finishes one decode late
    options: dict[str, object] = {"prefix_cache": PrefixCache(capacity=4, block=16), "chunk_size": 32}
    drv = _pipelined(**options) if in_process else engine(0, transport=Processes(), **options)  # type: ignore[arg-type]
    with drv:
        for i in range(5):
            drv.admit(RequestId(i), REVIEW_PROMPTS[i], max_new_tokens=REVIEW_NEW, stop=stop if i == 2 else None)
        while drv.live and RequestId(4) not in drv.outputs:
            drv.step()
            r3 = drv.requests[RequestId(3)] if RequestId(3) in drv.requests else None
            if drv.in_flight is not None and r3 is not None and len(r3.output) >= 3 and RequestId(3) in drv.in_flight.rids:
                drv.abort(RequestId(3))  # aborted while its next decode is in flight: that token is dropped
        drv.run_until_done()
        assert drv.in_flight is None
        expected = {RequestId(i): greedy[RequestId(i)] for i in (0, 1, 4)}
        expected[RequestId(2)] = greedy[RequestId(2)][: greedy[RequestId(2)].index(stop) + 1]
        assert {rid: out for rid, out in drv.outputs.items() if rid != RequestId(3)} == expected
        assert drv.outputs[RequestId(3)] == greedy[RequestId(3)][: len(drv.outputs[RequestId(3)])]
        assert len(drv.outputs[RequestId(3)]) < REVIEW_NEW
        drv.drop_cache()
        drv.ledger.assert_drained()
        assert drv.slots.num_live == 0 and drv.kv.num_live == 0


@pytest.mark.parametrize("in_process", [True, False])
def test_pipelined_decodes_under_kv_pressure_retract_and_complete(in_process: bool) -> None:
    # all three prompts fit (157 locations), their growth does not: the newest is retracted, its
    # decode in flight dropped, and it re-prefills its prompt and output so far
    drv = _pipelined(kv_capacity=170) if in_process else engine(0, transport=Processes(), kv_capacity=170)
    with drv:
        _serve(drv, range(3))
        assert drv.stats.retractions >= 1
        assert drv.outputs == {RequestId(i): review_greedy()[RequestId(i)] for i in range(3)}
        drv.ledger.assert_drained()
        assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def test_a_pipelined_decode_takes_its_inputs_once_and_only_from_a_forward_that_ran() -> None:
    drv = _pipelined()
    drv.admit(RequestId(0), REVIEW_PROMPTS[0], max_new_tokens=REVIEW_NEW)
    drv.step()  # prefill
    drv.step()  # the first decode, sent with its input known and its sample kept
    drv.step()  # the second, naming the first one's sample: in flight
    assert drv.in_flight is not None
    ex = drv.target
    assert not isinstance(ex, ExecutorProcess)
    running = drv.running
    prev = drv.in_flight.sample_id
    # the token of `prev` is still kept for the decode after it; a plan naming a sample that never
    # ran, or naming `prev` twice, is refused before the model runs
    _, plan = drv.pipeline.decode(
        running, DecodeContext(next_tokens=[0], kv_locs=drv.kv_refs.alloc(1)), sample_id=mint_sample_id(), inputs_from=mint_sample_id()
    )
    with pytest.raises(PlanExecutionError, match="holds the token of sample"):
        ex.execute(plan)
    kept = mint_sample_id()
    _, plan = drv.pipeline.decode(
        running, DecodeContext(next_tokens=[0], kv_locs=drv.kv_refs.alloc(1)), sample_id=kept, inputs_from=prev
    )
    _, after = drv.pipeline.decode(running, DecodeContext(next_tokens=[0], kv_locs=drv.kv_refs.alloc(1)), inputs_from=kept)
    ex.execute(plan)
    with pytest.raises(PlanExecutionError, match=f"holds the token of sample #{kept}"):
        ex.execute(plan)  # a replay: the token it names was used (the slot holds the plan's own now)
    # after an abort the executor forgets every kept token: a plan built on one before finds none
    ex.forget_verifies()
    with pytest.raises(PlanExecutionError, match="holds no token"):
        ex.execute(after)


def test_a_pipelined_decode_plan_checks_its_ids_and_prints_them() -> None:
    cols = {"rids": [7, 8], "slots": [1, 2], "seq_lens": [5, 9], "kv_locs": [10, 11]}
    a, b = mint_sample_id(), mint_sample_id()
    plan = DecodePlan(**cols, input_ids=[0, 0], sample_id=b, inputs_from=a)
    text = dump(plan, exact=True)
    assert f"sample=#{b} inputs=#{a}" in text.splitlines()[0]
    assert parse(text) == plan
    with suppress_type_checks():  # hostile values, as an untyped caller would pass them
        for bad, match in (
            ({"input_ids": [3, 0], "inputs_from": a}, "placeholders"),
            ({"input_ids": [0, 0], "inputs_from": a, "sample_id": a}, "own sample_id"),
            ({"input_ids": [1, 2], "sample_id": 0}, "positive sample id"),
            ({"input_ids": [1, 2], "sample_id": True}, "sample_id"),
            ({"input_ids": [0, 0], "inputs_from": "1"}, "inputs_from"),
        ):
            with pytest.raises(IRValidationError, match=match):
                DecodePlan(**cols, **bad)  # type: ignore[arg-type]  # the bad value is the point


def test_overlap_without_mixed_forwards_or_with_retries_runs_each_step_to_the_end() -> None:
    # not pipelined: an extend-only step would skip the running rows, and a retried forward would
    # have to replay the one sent after it
    for options in ({"mixed": False}, {"retries": 1}):
        with engine(0, transport=Processes(), **options) as drv:  # type: ignore[arg-type]  # Engine's keywords
            assert not drv.forwards.pipelined
            _serve(drv, range(3))
            assert drv.outputs == {RequestId(i): review_greedy()[RequestId(i)] for i in range(3)}
            drv.ledger.assert_drained()


def test_closing_with_plans_in_flight_reads_their_replies_and_stops() -> None:
    ledger = Ledger()
    ex = _process(ledger)
    pending = [ex.submit(_prefill(ledger)) for _ in range(20)]  # type: ignore[arg-type]  # untyped builder
    ex.close()
    assert ex.closed and all(p.done for p in pending) and ex.exit_code is not None
    ledger.assert_drained()
