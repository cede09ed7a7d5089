"""One vocabulary for failures in every mode (``backend.children``): "rank 1 killed by signal 9",
"replica 0 killed by signal 9", "rank 1 did not answer within 2 s", "replica 1 exited with status 1:
<its last stderr line>", "executor process for pool 'target' killed by signal 9"; never a transport
library's own text. And an executor process killed mid-run (``--overlap``) aborts its requests the
same way whichever call of the scheduler first meets the dead process: a plan, or a request that is
not one (``share_prefix``, ``forget_verifies``, ``cancel_outstanding``, ``drain``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from backend import children
from backend.ledger import Ledger
from backend.remote import ExecutorGone, ExecutorProcess, Processes
from compiler.manager import PassManager
from compiler.offline import ServeConfig
from compiler.offline.dp import ReplicaFailed, serve_replicas
from compiler.prefix_cache import PrefixCache
from compiler.steps import Pipeline
from compiler.workload import Request
from ir.ids import TARGET_POOL, RequestId
from passes import LowerContext
from tests.compiler.cli.test_lifetimes import RUN, alive, descendants, kill_left, paused
from tests.helpers import REVIEW_PROMPTS, engine, fresh, kill_child, tiny_models


def test_how_a_process_ended_is_said_one_way() -> None:
    assert children.ended(-9) == "killed by signal 9"
    assert children.ended(3) == "exited with status 3"
    assert children.no_answer(600) == "did not answer within 600 s"


def test_a_dead_executor_process_is_raised_by_its_plans_only() -> None:
    ledger = Ledger()
    target, _ = tiny_models()
    with ExecutorProcess(target, pool_id=TARGET_POOL, capacity=4, kv_capacity=64, max_len=32, ledger=ledger) as ex:
        ex.wait_ready()
        kill_child(ex)
        # the requests that are not plans change nothing in a dead process: none raises
        ex.share_prefix(0, 1, 0)
        ex.forget_verifies()
        ex.cancel_outstanding("gone")
        ex.drain()
        _, plan = Pipeline(ledger, LowerContext(), PassManager(verify_level=2)).prefill([fresh(1, 1, [3, 4], 1)])
        with pytest.raises(ExecutorGone, match=r"^executor process for pool 'target' killed by signal 9$"):
            ex.execute(plan)


def test_an_executor_process_killed_mid_run_aborts_its_requests_at_any_step() -> None:
    # one request arrives per step, as in batchc run: a kill before step 3 is first met by a
    # share_prefix (the third prompt shares the first one's cached prefix), one before step 4 by
    # the pipelined decode's wait, whose failure drops the forward sent after it
    for at in (3, 4):
        with engine(0, transport=Processes(), prefix_cache=PrefixCache(capacity=4, block=16), chunk_size=32) as drv:
            assert drv.forwards.pipelined
            for n in range(12):
                if n < 5:
                    drv.admit(RequestId(n), REVIEW_PROMPTS[n], max_new_tokens=4)
                if n == at:
                    assert isinstance(drv.target, ExecutorProcess)
                    kill_child(drv.target)
                drv.step()  # never raises: the engine aborts the forwards that cannot run
            assert drv.live == 0 and drv.aborted_by_failure, at
            assert drv.first_failure is not None and "executor process for pool 'target' killed by signal 9" in drv.first_failure
            drv.ledger.assert_drained()


def _one_line(tmp_path: Path, args: list[str]) -> tuple[int, str]:
    """``batchc ARGS`` with every child it started sent a signal at the engine's third step
    (``tests/compiler/cli/paused.py``): its status and stderr; nothing is left running."""
    marker = tmp_path / "marker"
    proc = paused(args[0], marker, args[1:])
    try:
        _, err = proc.communicate(timeout=120)
        assert marker.exists(), err
        assert not [p for p in descendants(proc.pid) if alive(p)]
        return proc.returncode, err
    finally:
        kill_left(descendants(proc.pid), proc)


def test_batchc_run_overlap_with_its_executor_process_killed_mid_run_fails_in_one_line(tmp_path: Path) -> None:
    code, err = _one_line(tmp_path, ["signal-SIGKILL", *RUN, "--overlap"])
    assert code == 1 and len(err.splitlines()) == 1, err
    assert re.fullmatch(r"batchc: run failed: \d+ requests aborted by \d+ failed forwards, first: forward of requests \[[\d, ]+\] "
                        r"failed: ExecutorGone: executor process for pool 'target' killed by signal 9\n", err), err


def test_batchc_run_tp_with_a_worker_that_stops_answering_fails_in_the_common_words(tmp_path: Path) -> None:
    code, err = _one_line(tmp_path, ["signal-SIGSTOP", *RUN, "--tp", "2", "--tp-timeout", "2"])
    assert code == 1 and err.splitlines() == ["batchc: run failed: rank 1 did not answer within 2 s"], err  # not gloo's text


def test_a_killed_replica_is_named_in_the_common_words(monkeypatch: pytest.MonkeyPatch) -> None:
    spawn = children.spawn

    def spawn_and_kill_the_first(*a: Any, **kw: Any) -> subprocess.Popen[bytes]:
        proc = spawn(*a, **kw)
        if not started:
            os.kill(proc.pid, signal.SIGKILL)
        started.append(proc)
        return proc

    started: list[subprocess.Popen[bytes]] = []
    monkeypatch.setattr(children, "spawn", spawn_and_kill_the_first)
    parts = [[Request(rid=RequestId(i), prompt=b"a prompt", max_new_tokens=4)] for i in range(2)]
    with pytest.raises(ReplicaFailed, match=r"^replica 0 killed by signal 9$"):
        serve_replicas(parts, model=None, draft=None, dtype="float32", cfg=ServeConfig(k=0, lossless_sample=0), threads=1)
    assert all(p.returncode is not None for p in started)  # the other replica was stopped and reaped
