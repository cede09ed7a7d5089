"""Serving over a 2-rank tensor-parallel group (gloo, two processes; ``tests/backend/tp/ranks.py`` is
the ranks' program): the same tokens as the unsharded engine with every rank's ledger drained and
equal; a replayed, an out-of-order, a forged and a malformed plan message refused on the worker (and
serving goes on); a worker raising in its forward and a worker killed mid-run reported by rank 0 naming
rank 1 and the cause, in seconds, with no process left behind; a worker whose draft executor skips
its init ops (scenario 2 on one rank only) stopping the engine at its first prefill."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import forkserver

ROOT = Path(__file__).resolve().parents[3]


def _scenario(name: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    proc = forkserver.run([sys.executable, "-m", "tests.backend.tp.ranks", name, str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    pid = result["worker_pid"]
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z", (
        f"worker {pid} outlived its group"
    )
    result["stderr"] = proc.stderr
    return result


def _served_like_unsharded(r: dict[str, Any]) -> None:
    assert "error" not in r, r.get("error")
    assert r["outputs"] == r["unsharded"] and len(r["outputs"]) == 4
    ledgers = r["ledgers"]
    assert ledgers["equal"] and ledgers["drained"], ledgers
    rank0, rank1 = ledgers["ranks"]
    for pool in ("target", "draft"):
        assert rank0[pool] == rank1[pool]
        assert rank0[pool]["consumed"] == rank0[pool]["minted"] and rank0[pool]["consumed"]["tickets"] == 4
    assert r["rank0_outstanding"] == 0 and r["worker_exit"] == 0


@pytest.fixture(scope="module")
def bad_messages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One group's run that is sent a replayed, an out-of-order and a forged plan message (one
    program start for the three: each start is two processes importing torch)."""
    return _scenario("messages", tmp_path_factory.mktemp("messages"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plain run (after rank 0's refused attempt on the whole models), shared by two tests."""
    return _scenario("serve", tmp_path_factory.mktemp("serve"))


def test_tp2_serves_the_unsharded_tokens_with_every_ledger_drained(served: dict[str, Any]) -> None:
    _served_like_unsharded(served)


@pytest.mark.parametrize(("scenario", "why"), [
    # (the step numbers follow the scheduling: a replay names an earlier step, "ahead" the one after the next)
    ("replay", r"WireError: plan message: message for step (\d+), expected step (\d+) \(replayed"),
    ("ahead", r"WireError: plan message: message for step (\d+), expected step (\d+) \(replayed, skipped or out of order\)"),
    ("forged", r"UnknownTicketError: ticket #\d+ for pool 'target': serial \d+ was not minted by this process and no trusted peer sent it"),
])
def test_a_bad_plan_message_is_refused_on_the_worker_and_serving_goes_on(scenario: str, why: str, bad_messages: dict[str, Any]) -> None:
    r = bad_messages
    [(rank, said)] = r["refusals"][scenario]
    found = re.search(why, said)
    assert rank == 1 and found, said
    if scenario in ("replay", "ahead"):
        step, expected = int(found[1]), int(found[2])
        assert step < expected if scenario == "replay" else step == expected + 1, said
    if scenario == "replay":  # a malformed message is refused as such (a WireError, not a fault), and serving goes on
        [(rank, said)] = r["malformed"]
        assert rank == 1 and said.startswith("WireError: plan message: integer of 5000 characters"), said
    _served_like_unsharded(r)  # nothing of the refused message ran anywhere


@pytest.mark.parametrize(("scenario", "cause", "exit_code"), [
    ("raise", "rank 1 failed: InjectedFault: injected fault at model_forward in ExtendPlan (plan message 5)", 1),
    ("kill", "rank 1 killed by signal 9", -9),
    ("idle", "rank 1 gave up waiting for rank 0's next message: rank 0 did not answer within 3 s", 1),
])
def test_a_failed_worker_stops_rank_0_naming_the_rank_and_cause(scenario: str, cause: str, exit_code: int, tmp_path: Path) -> None:
    r = _scenario(scenario, tmp_path)
    assert r["error"] == cause and r["failed_rank"] == 1, r["error"]  # the common words, never the transport's text
    assert r["seconds_to_error"] < 10, "noticed at once (a closed connection), not after the group's 20 s timeout (3 s when idle)"
    assert r["worker_exit"] == exit_code
    if scenario == "raise":  # the worker says it too, in one line
        assert f"rank 1: {cause}" in r["stderr"].splitlines()


def test_a_plan_rank_0_refuses_is_refused_everywhere_and_its_tickets_cancelled_on_every_rank(tmp_path: Path) -> None:
    r = _scenario("refuse0", tmp_path)
    assert "error" not in r and r["aborted"] == [1]
    assert {k: v for k, v in r["outputs"].items() if k != "1"} == {k: v for k, v in r["unsharded"].items() if k != "1"}
    ledgers = r["ledgers"]
    assert ledgers["equal"] and ledgers["drained"]
    for rank in ledgers["ranks"]:  # the refused prefill's target ticket: cancelled on both ranks, run on neither
        assert rank["target"]["cancelled"] == 1 and rank["target"]["consumed"]["tickets"] == rank["target"]["minted"]["tickets"] - 1
    assert r["rank0_outstanding"] == 0 and r["worker_exit"] == 0


def test_a_fault_on_the_worker_before_anything_ran_aborts_the_requests_and_serving_goes_on(tmp_path: Path) -> None:
    r = _scenario("fault1", tmp_path)  # the worker's checks raise a RuntimeError: a fault, not a refusal
    assert "error" not in r and r["aborted"] == [1]
    assert {k: v for k, v in r["outputs"].items() if k != "1"} == {k: v for k, v in r["unsharded"].items() if k != "1"}
    assert r["ledgers"]["equal"] and r["ledgers"]["drained"]
    assert [rank["target"]["cancelled"] for rank in r["ledgers"]["ranks"]] == [1, 1]


def test_ranks_serving_different_models_are_refused_at_the_session_start(tmp_path: Path) -> None:
    r = _scenario("mismatch", tmp_path)
    assert re.fullmatch(
        r"the session start refused by the tensor-parallel group \(rank 1: ValueError: rank 1's draft model is not rank 0's "
        r"\(fingerprint [0-9a-f]{24}, rank 0's [0-9a-f]{24}\): another checkpoint, seed or dtype\)", r["refused"]), r["refused"]
    assert r["worker_exit"] == 0


def test_one_rank_skipping_its_pools_init_ops_stops_the_engine_before_any_plan_over_that_row(served: dict[str, Any]) -> None:
    """Scenario 2 under ``--tp 2`` (SGLang PR #32450, a backend that never applies the deferred
    copy-on-write, here on rank 1 only; ``tests/scenarios/test_init_ops_never_applied_by_one_pool.py``
    in one process): the group's second engine, whose worker drops its draft tickets before the claim,
    stops at its first prefill with the refusal naming rank 1, the slot, the ticket and the pool (a
    ``BatchcError``: the engine stops rather than abort the request and serve on). The group ran the
    target's prefill only: no rank ran the draft's prefill nor anything after it; every rank's books
    agree, the draft's ticket outstanding on each."""
    s = served["skip"]
    assert re.fullmatch(r"RankRefused: ExtendPlan \(plan message \d+\) refused by the tensor-parallel group \(rank 1: TicketMismatchError: "
                        r"ExtendPlan over slot (\d+) of pool 'draft' does not carry ticket #\d+ for pool 'draft' \(ops clear \[\1\], cow \[\]\), "
                        r"which must run on that row first.*\)", s["error"]), s["error"]
    assert (s["stopped_by"], s["plans"], s["outputs"], s["rank0_outstanding"]) == ("RankRefused", 1, {}, ["draft"])
    ledgers = s["ledgers"]
    assert ledgers["equal"] and not ledgers["drained"]
    for rank in ledgers["ranks"]:
        assert (rank["target"]["consumed"]["tickets"], rank["draft"]["minted"]["tickets"], rank["draft"]["consumed"]["tickets"],
                rank["draft"]["outstanding"]) == (1, 1, 0, 1), rank
    assert served["worker_exit"] == 0  # (the group itself serves on: the refusal is agreed before anything runs)


def test_an_engine_on_whole_models_is_refused_before_the_group_hears_of_it(served: dict[str, Any]) -> None:
    r = served
    assert r["refused"].startswith("Engine: tp: the target model must be a shard cut by backend.tp.shard_model, got ")
    _served_like_unsharded(r)  # and the group serves on
