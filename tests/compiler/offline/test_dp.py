"""``batchc run --dp N``: the prefix-aware router keeps a shared prefix on one replica and the load
even; the replicas' outputs equal one engine's; a failing replica fails the run naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compiler.engine.config import ServeConfig
from compiler.offline import builtin_workload
from compiler.offline.dp import ReplicaFailed, route, serve_replicas
from compiler.workload import Request, ServeError
from ir.ids import RequestId
from tests import forkserver
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[3]


def _req(rid: int, prompt: bytes, new: int = 4) -> Request:
    return Request(rid=RequestId(rid), prompt=prompt, max_new_tokens=new)


def test_prefix_routing_keeps_each_first_block_on_one_replica_and_balances_the_rest() -> None:
    workload = builtin_workload(num_requests=64)
    parts = route(workload, 3, block=16)
    assert sorted(int(r.rid) for p in parts for r in p) == list(range(64))
    homes: dict[bytes, set[int]] = {}
    for i, p in enumerate(parts):
        assert [int(r.rid) for r in p] == sorted(int(r.rid) for r in p)  # workload order kept
        for r in p:
            homes.setdefault(bytes(r.token_ids[:16]), set()).add(i)
    assert all(len(h) == 1 for h in homes.values())
    loads = [sum(len(r.token_ids) + r.max_new_tokens for r in p) for p in parts]
    assert max(loads) < 2 * min(loads), loads
    # round-robin deals in turn, and so splits a shared first block over replicas
    rr = route(workload, 3, block=16, routing="round-robin")
    assert [int(r.rid) for r in rr[1]] == list(range(1, 64, 3))
    spread: dict[bytes, set[int]] = {}
    for i, p in enumerate(rr):
        for r in p:
            spread.setdefault(bytes(r.token_ids[:16]), set()).add(i)
    assert any(len(h) > 1 for h in spread.values())


def test_a_new_key_goes_to_the_least_loaded_replica() -> None:
    a, b = b"A" * 20, b"B" * 20
    parts = route([_req(0, a, 100), _req(1, b), _req(2, a), _req(3, b"C" * 20)], 2, block=16)
    assert [[int(r.rid) for r in p] for p in parts] == [[0, 2], [1, 3]]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"replicas": 0}, "replicas must be an int >= 1, got 0"),
    ({"replicas": True}, "replicas must be an int >= 1, got True"),
    ({"block": 0}, "block must be an int >= 1, got 0"),
    ({"routing": "random"}, "routing must be one of ('prefix', 'round-robin'), got 'random'"),
])
def test_route_refuses_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    import typeguard

    args: dict[str, object] = {"replicas": 2, "block": 16, "routing": "prefix"} | kwargs
    with typeguard.suppress_type_checks(), pytest.raises(ServeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        route([], args["replicas"], block=args["block"], routing=args["routing"])  # type: ignore[arg-type]


def test_dp2_outputs_equal_one_engine(tmp_path: Path) -> None:
    """Two replicas give one engine's greedy outputs, with the separate draft and with the draft
    head (each replica loads the head beside its target)."""
    small = ["--requests", "8", "--max-new-tokens", "8", "--lossless-sample", "2"]
    one, two, summary = tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "dp.json"
    head, head_summary = tmp_path / "head.jsonl", tmp_path / "head.json"
    # (independent runs: started together, they share the machine's cores)
    procs = [forkserver.Popen([sys.executable, "-m", "compiler.cli", "run", *args], cwd=ROOT, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for args in ([*small, "--outputs", str(one)], [*small, "--dp", "2", "--outputs", str(two), "--json", str(summary)],
                          [*small, "--dp", "2", "--draft", "mtp", "--outputs", str(head), "--json", str(head_summary)])]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert two.read_text() == one.read_text() == head.read_text()
    for path in (summary, head_summary):
        total = json.loads(path.read_text())
        assert total["dp"] == 2 and total["requests"] == 8 and total["outstanding_tickets"] == 0 and total["lossless_ok"] is True
        assert [r["requests"] for r in total["replicas"]] != [8, 0] and all(r["outstanding_tickets"] == 0 for r in total["replicas"])


@pytest.mark.parametrize(("verdicts", "want"), [
    ([None, None], None), ([True, None], True), ([None, False], False), ([True, True], True), ([True, False], False),
])
def test_the_merged_lossless_verdict_is_true_only_where_a_replica_compared_and_none_failed(
    verdicts: list[bool | None], want: bool | None,
) -> None:
    """A replica whose sampled requests all ended in error (non-finite logits) ran no comparison and
    has no lossless_ok; the merged summary used to say true over replicas that compared nothing."""
    from compiler.offline.dp import ReplicaResult, merged

    figures = {"generated_tokens": 0, "wall_s": 1.0, "requests": 1, "outstanding_tickets": 0, "aborted_requests": 0,
               "errored_requests": 1, "prefix_cache_hit_tokens": 0}
    results = [ReplicaResult(index=i, summary=figures | ({} if v is None else {"lossless_ok": v}), outputs={}, aborted=())
               for i, v in enumerate(verdicts)]
    total = merged(results, 1.0)
    assert total.get("lossless_ok", None) is want and ("lossless_ok" in total) == (want is not None)


def test_a_failing_replica_fails_the_run_naming_it() -> None:
    bad = Request(rid=RequestId(0), prompt=b"x", max_new_tokens=4, ids=(10**6,))  # an id past the vocabulary: refused in the replica
    good = _req(1, b"fine prompt")
    with pytest.raises(ReplicaFailed, match=r"^replica 1 exited with status 1: .*10+"):
        serve_replicas([[good], [bad]], model=None, draft=None, dtype="float32", cfg=ServeConfig(k=0, lossless_sample=0), threads=1)


@pytest.mark.parametrize(("args", "message"), [
    (["--dp", "2", "--tp", "2"], "batchc: error: --dp 2 with --tp: each replica is one plain engine process"),
    (["--dp", "2", "--overlap"], "batchc: error: --dp 2 with --overlap: each replica is one plain engine process"),
    (["--dp", "0"], "batchc run: error: argument --dp: expected a positive integer, got 0"),
    (["--dp-routing", "round-robin"], "batchc: error: --dp-routing round-robin without --dp: one engine needs no router"),
    (["--dp", "2", "--dp-routing", "hash"], "batchc run: error: argument --dp-routing: invalid choice: 'hash' (choose from "),
])
def test_bad_dp_is_refused_in_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert run_cli(["run", *args]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == message or (message.endswith("(choose from ") and line.startswith(message)), line
