"""The ranks of the tensor-parallel serving tests, as a program: ``python -m tests.backend.tp.ranks
SCENARIO OUT``. Rank 0 (started by the test) spawns one worker running this same program (which
sees ``RANK`` set), serves a small workload on the tiny models' shards, and writes what happened
to ``OUT`` as JSON: the outputs, the unsharded engine's outputs, every rank's ledger counts, and the
error it stopped on. Scenarios:

- ``serve``: rank 0 hands an engine its whole models (refused before the group hears of it), then
  serves the workload on the shards; then a second engine (a second session of the same group), in
  which the worker's draft executor skips its init ops (SGLang PR #32450 on one rank only; rank 0's
  executors are honest): what it raised, the plans the group ran and every rank's ledger counts;
- ``messages``: after steps 4, 5 and 6, a plan message with an old step number (``replay``), with a
  step number ahead of the next one (``ahead``), and with a ticket whose serial no trusted process
  minted (``forged``) is sent raw (rank 0 does not run it); the refusals are recorded by name and
  serving goes on (after the replay, a malformed message for the right step too: a 5,000-digit
  integer for a header);
- ``raise``: a fault armed in the worker's model forward;
- ``kill``: the worker is killed mid-run;
- ``idle``: rank 0 pauses longer than the group's timeout (3 s here) between two steps;
- ``fault1``: the worker's own checks of its third prefill with tickets raise (a fault, not a
  refusal): the same outcome as ``refuse0``, decided by the worker;
- ``mismatch``: the worker serves a model of another seed: the session start is refused, naming
  rank 1 and the fingerprints;
- ``refuse0``: rank 0's own checks of its third prefill with tickets raise (not a ``BatchcError``): every rank
  refuses the plan, the engine aborts its requests and cancels their tickets on every rank, and
  serving goes on.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import time
from typing import Any

import attrs

K = 2
PROMPTS = [[5, 17, 33, 8, 60, 3, 44, 90, 12], [7, 71, 25, 38, 2, 9], [5, 17, 33, 8, 60, 3, 11], [40, 41, 42]]


def _models(rank: int, world: int, group: Any, seed: int = 1) -> tuple[Any, Any, Any, Any]:
    from backend.tp import shard_model
    from tests.helpers import tiny_models

    target, draft = tiny_models(seed=seed)
    return target, draft, shard_model(target, rank, world, group), shard_model(draft, rank, world, group)


def _fail_third_ticketed_check(message: str) -> None:
    """Make this process's executors raise ``RuntimeError(message)`` in the checks of the third
    prefill that carries tickets (before anything is written)."""
    import backend.executor

    check = backend.executor.check_fresh_rows
    calls = [0]

    def failing(plan: Any, ext: Any, tickets: Any, *rest: Any) -> None:
        calls[0] += bool(tickets)
        if tickets and calls[0] == 3:
            raise RuntimeError(message)
        check(plan, ext, tickets, *rest)

    backend.executor.check_fresh_rows = failing  # (the name the executor calls, imported from backend.state_store)


def _skip_init_ops_in_second_session() -> None:
    """Make this worker's draft executor of its second session one that runs the model but never
    applies its pool's init ops: it drops the plan's tickets before the claim (the backend of
    ``tests/scenarios/test_init_ops_never_applied_by_one_pool.py``)."""
    import backend.tp.serve
    from backend.executor import Executor

    class SkipsInitOps(Executor[Any]):
        def _own_tickets(self, plan: Any, own: frozenset[int]) -> list[Any]:
            return []

    build = backend.tp.serve._Session.__init__
    sessions = [0]

    def building(self: Any, *args: Any, **kw: Any) -> None:
        build(self, *args, **kw)
        sessions[0] += 1
        if sessions[0] == 2:
            self.executors[self.pools.index("draft")].__class__ = SkipsInitOps

    backend.tp.serve._Session.__init__ = building  # type: ignore[method-assign]  # the test's skipping backend, on this rank only


def _one_rank_skips(t: Any, d: Any, lead: Any) -> dict[str, Any]:
    """A second engine on the group whose worker skips its draft init ops: one request admitted and
    stepped until the engine stops (or, wrongly, serves it)."""
    before = lead.plans
    e = _engine(t, d, tp=lead)
    e.admit(0, PROMPTS[0], max_new_tokens=10)
    out: dict[str, Any] = {}
    try:
        while e.live:
            e.step()
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["stopped_by"] = type(e.stopped_by).__name__
    out["plans"] = lead.plans - before
    out["outputs"] = {str(k): v for k, v in e.outputs.items()}
    out["rank0_outstanding"] = [str(t.pool) for t in e.ledger.outstanding()]
    e.close()
    out["ledgers"] = e.closing_ledgers.to_json() if e.closing_ledgers is not None else None
    return out


def _engine(target: Any, draft: Any, tp: Any = None) -> Any:
    from backend.local import IN_PROCESS
    from backend.tp.serve import TensorParallel
    from compiler.engine import Engine
    from compiler.prefix_cache import PrefixCache

    return Engine(target, draft, k=K, capacity=8, kv_capacity=512, max_len=64, chunk_size=4,
                  prefix_cache=PrefixCache(capacity=2, block=4), transport=TensorParallel(tp) if tp is not None else IN_PROCESS)


def _serve(e: Any, on_step: Any = None) -> None:
    """One request arrives every third step (so later ones find earlier prompts in the prefix cache)."""
    n = 0
    while n < 3 * len(PROMPTS) or e.live:
        if n % 3 == 0 and n // 3 < len(PROMPTS):
            e.admit(n // 3, PROMPTS[n // 3], max_new_tokens=10)
        e.step()
        n += 1
        if on_step is not None:
            on_step(n)
    e.drop_cache()


def _timeout(scenario: str) -> int:
    return 3 if scenario == "idle" else 20


def worker() -> None:
    from backend.tp.group import RankFailed, connect, launched_rank
    from backend.tp.serve import serve_worker
    from ir.ids import DRAFT_POOL, TARGET_POOL

    where = launched_rank()
    assert where is not None
    rank, world = where
    scenario = sys.argv[1]
    group = connect(rank, world, timeout_s=_timeout(scenario))
    _, _, t, d = _models(rank, world, group, seed=2 if scenario == "mismatch" else 1)
    if scenario == "fault1":
        _fail_third_ticketed_check("the worker's checks failed")
    if scenario == "serve":
        _skip_init_ops_in_second_session()
    try:
        serve_worker(group, {TARGET_POOL: t, DRAFT_POOL: d})
    except RankFailed as exc:
        print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    group.close()


def leader(scenario: str, out: str) -> None:
    from backend import faults
    from backend.tp.group import Msg, RankFailed, spawn_workers
    from backend.tp.serve import TPLeader
    from ir.ids import TARGET_POOL
    from ir.init import SERIAL_COUNTER_BITS
    from ir.plan import ExtendPlan, MixedPlan
    from ir.wire import WIRE_VERSION, pack, unpack

    result: dict[str, Any] = {"scenario": scenario}
    group = spawn_workers(2, [sys.executable, "-m", "tests.backend.tp.ranks", scenario, out], timeout_s=_timeout(scenario),
                          start_timeout_s=120)
    result["worker_pid"] = group.procs[1].pid
    target, draft, t, d = _models(0, 2, group)
    lead = TPLeader(group)
    sent: list[bytes] = []
    send = group.send

    def recording(kind: Msg, payload: bytes = b"", arg: int = 0) -> None:
        if kind is Msg.PLAN and arg == 0:
            sent.append(payload)
        send(kind, payload, arg)

    group.send = recording  # type: ignore[method-assign]  # a test's tap on the messages rank 0 sends

    def on_step(n: int) -> None:
        bad = {4: "replay", 5: "ahead", 6: "forged"}.get(n) if scenario == "messages" else None
        if bad is not None:
            last = unpack(sent[-1]).plan
            if bad == "replay":
                data = sent[-1]
            elif bad == "ahead":
                data = pack(lead.step + 1, last)
            else:
                exts = [p if isinstance(p, ExtendPlan) else p.extend for p in map(lambda m: unpack(m).plan, sent)
                        if isinstance(p, (ExtendPlan, MixedPlan))]
                ext = [x for x in exts if x.tickets][-1]
                forged = tuple(attrs.evolve(x, op=attrs.evolve(x.op, serial=x.serial ^ (1 << SERIAL_COUNTER_BITS))) for x in ext.tickets)
                data = pack(lead.step, attrs.evolve(ext, tickets=forged, snapshots=()))
            ran = len(sent)
            result.setdefault("refusals", {})[bad] = lead.send_raw(TARGET_POOL, data)
            if bad == "replay":  # and a message for the right step that no encoder writes: a 5,000-digit integer
                header = b"[" + b"1" * 5000 + b"]"
                header += b" " * (-(24 + len(header)) % 8)  # the columns' 8-byte alignment
                result["malformed"] = lead.send_raw(TARGET_POOL, struct.pack("<4sHHQII", b"BCPL", WIRE_VERSION, 0, lead.step, len(header), 0) + header)
            del sent[ran:]  # (the tap keeps the plans that ran: the next bad message is built from them)
        if n == 4 and scenario == "kill":
            os.kill(group.procs[1].pid, signal.SIGKILL)
        if n == 4 and scenario == "idle":
            time.sleep(5)

    if scenario == "raise":
        lead.arm_fault(1, faults.FaultPoint.MODEL_FORWARD, after=5)
    if scenario == "refuse0":
        _fail_third_ticketed_check("rank 0's checks failed")
    if scenario == "serve":  # first an engine on the whole models: refused before the group hears of it
        from ir.errors import PreconditionError

        try:
            _engine(target, draft, tp=lead)
        except PreconditionError as exc:
            result["refused"] = str(exc)
    if scenario == "mismatch":
        from backend.tp.group import RankRefused

        try:
            _engine(t, d, tp=lead)
        except RankRefused as exc:
            result["refused"] = str(exc)
        lead.shutdown()
        result["worker_exit"] = group.procs[1].poll()
        with open(out, "w") as f:
            json.dump(result, f)
        return
    t0 = time.monotonic()
    try:
        with _engine(t, d, tp=lead) as e:
            _serve(e, on_step)
        result["outputs"] = {str(k): v for k, v in sorted(e.outputs.items())}
        result["aborted"] = sorted(int(r) for r in e.aborted_by_failure)
        result["ledgers"] = e.closing_ledgers.to_json() if e.closing_ledgers is not None else None
        result["rank0_outstanding"] = len(e.ledger.outstanding())
        if scenario == "serve":
            result["skip"] = _one_rank_skips(t, d, lead)
        lead.shutdown()
    except RankFailed as exc:
        result["error"] = str(exc)
        result["failed_rank"] = exc.rank
        result["seconds_to_error"] = time.monotonic() - t0
        lead.shutdown()
    result["worker_exit"] = group.procs[1].poll()
    with _engine(target, draft) as plain:
        _serve(plain)
    result["unsharded"] = {str(k): v for k, v in sorted(plain.outputs.items())}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if os.environ.get("RANK") not in (None, "0"):
        worker()
    else:
        leader(sys.argv[1], sys.argv[2])
