"""``batchc serve``'s engine process: the one place the online server runs forwards.

``python -m compiler.online.engine_process FD`` is started by the HTTP process
(``compiler.online.engine_client``) through ``backend.children.spawn`` (it dies with the server,
whatever kills the server) and talks over the connection on file descriptor ``FD`` in the
messages of ``compiler.online.messages``. It reads ``Launch``, loads the models and builds the
engine as ``batchc run`` does (``compiler.offline.models.load_served``, ``make_engine`` with the
prefix cache), answers ``Ready`` or ``StartFailed``, then loops:

1. read every message waiting (blocking only when nothing is live): ``Submit`` joins a FIFO,
   ``Abort`` ends its request now, every completion of it (queued or live, through
   ``Engine.abort``, the engine's one release path), ``Finish`` ends a live completion as finished
   at a stop string the HTTP side found (``Engine.finish``, its output and logprobs cut to the ids
   the text kept: counted as finished, not aborted, as ``batchc run`` ends it), ``Shutdown`` aborts
   everything, drops the prefix cache, answers ``Closed`` and ends the loop;
2. admit from the FIFO while fewer than ``max_running`` requests are live and, for a request of
   ``n > 1`` completions, its shared prompt state has room now (as ``batchc run``'s ``serve`` does:
   waiting requests hold no slot, no KV and no ticket);
3. run one ``Engine.step`` and send one ``StepOut``: each completion's new tokens and their logprobs
   (``Delta``), the completions that ended (``Ended``, with their last tokens and why) and the
   engine's ``Stats``.

With ``Launch.tp > 1`` this process is rank 0 of a tensor-parallel group: once every check passed
it starts the other ranks (``backend.tp.group.spawn_workers``: this module with ``--tp-worker`` and
the ``Launch`` as JSON; children of this process, dying with it), each of which loads the models as
rank 0 did and serves its plans on its shard (``compiler.offline.distributed.work``), and the engine
runs on rank 0's shards through the ``tensor_parallel`` transport, as ``batchc run --tp`` does. The
loop pings the workers between steps (``Loop.ping``), since an idle engine sends them no plans;
``Closed`` counts every rank's outstanding tickets, and the group is shut down after it.

So an ``Abort`` takes effect before the next step: a request is released within one engine step
of the HTTP side asking. SIGINT is ignored here (the server speaks for Ctrl-C and stops this
process itself); an exception escaping the loop is sent as ``Crashed`` and the process exits 1.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import attrs

from backend.tp.group import RankFailed, spawn_workers
from backend.tp.serve import TPLeader
from compiler.engine import Engine, RequestState
from compiler.engine.config import ServeConfig
from compiler.online.messages import (
    Abort,
    Closed,
    Crashed,
    Delta,
    Ended,
    EndReason,
    Finish,
    Launch,
    Ready,
    Shutdown,
    StartFailed,
    Stats,
    StepOut,
    Submit,
    ToEngine,
    TokenLogprob,
)
from ir.errors import BatchcError
from ir.ids import RequestId

if TYPE_CHECKING:
    from compiler.offline.models import Served, ServedHead

__all__ = ["IDLE_TICK_S", "PING_S", "TP_WORKER", "Loop", "build", "load", "main", "tp_worker"]

IDLE_TICK_S: Final = 0.5
"""How long an idle engine waits for a message before it sends its stats again."""
PING_S: Final = 5.0
"""How often, at most, rank 0 of a tensor-parallel group tells its workers it is alive (a worker
gives up on a rank 0 silent for ``--tp-timeout`` seconds: the pings come 4 times as often as that,
and an idle server sends no plans)."""
TP_WORKER: Final = "--tp-worker"
"""The first argument of a tensor-parallel worker rank's command line (then its ``Launch`` as JSON)."""


def load(launch: Launch) -> tuple[Served, Served | ServedHead | None, int]:
    """The target, the draft (``None`` at k = 0) and k, as ``batchc run`` resolves them (every rank
    of a tensor-parallel group loads the same way); ``ServeError`` / ``BatchcError`` in one line."""
    import torch

    from compiler.offline.models import Served, check_same_vocabulary, load_draft, load_served
    from compiler.workload import ServeError

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[launch.dtype]
    target = load_served(launch.model, role="target", dtype=dtype, bundled="target")
    k = launch.k if launch.k is not None else (0 if target.hf and launch.draft is None else ServeConfig().k)
    if launch.draft is not None and k == 0:
        raise ServeError(f"--draft {launch.draft!r} with --k 0: k = 0 turns speculative decoding off and runs no draft")
    if target.hf and k > 0 and launch.draft is None:
        raise ServeError(f"--k {k} with a Hugging Face --model needs --draft DIR (a smaller model with the same vocabulary)")
    drafted = None if k == 0 else load_draft(launch.draft, target=target, dtype=dtype)
    if isinstance(drafted, Served):
        check_same_vocabulary(target, drafted)
    return target, drafted, k


def build(launch: Launch) -> tuple[Engine, Ready, ServeConfig, TPLeader | None]:
    """The engine ``launch`` describes, with ``batchc run``'s checks (``ServeError`` / ``BatchcError``,
    one line); with ``launch.tp > 1``, on the tensor-parallel group this process leads (its workers
    started here, ``tp_worker``), whose leader is returned for the caller to shut down."""
    from compiler.offline import distributed
    from compiler.offline.budget import MemoryBudget, gib, memory_budget, resident_memory
    from compiler.offline.memory import fit_serving, memory_estimate, weight_bytes
    from compiler.offline.models import Served, draft_config, on_device
    from compiler.offline.run import make_engine
    from compiler.workload import DEFAULT_CONTEXT, MAX_CONTEXT, ServeError

    # the budget before the models are loaded (their memory is counted in the estimate)
    budget = (MemoryBudget(device="cpu", available=launch.memory_available, fraction=launch.memory_fraction)
              if launch.memory_available is not None and launch.device == "cpu"
              else memory_budget(launch.device, launch.memory_fraction)).share(launch.replicas)
    resident = resident_memory()
    target, drafted, k = load(launch)
    limits = [(m.name, m.max_positions) for m in (target, drafted) if isinstance(m, Served) and m.max_positions is not None]
    for name, limit in limits:
        if launch.max_len is not None and launch.max_len > limit:
            raise ServeError(f"--max-len {launch.max_len} is over the max_position_embeddings {limit} of {name}")
    max_len = launch.max_len if launch.max_len is not None else (min(min(lim for _, lim in limits), MAX_CONTEXT) if limits else DEFAULT_CONTEXT)
    if max_len < k + 3:
        raise ServeError(f"--max-len {max_len} leaves no room for a prompt token and a new token next to the k + 1 = {k + 1} positions of a step")
    cfg = ServeConfig(seed=launch.seed, k=k, max_running=launch.max_running, max_len=max_len, overlap=launch.overlap, chunk_size=launch.chunk_size,
                      token_budget=launch.token_budget, cache_entries=launch.cache_entries, penalties=True)
    # (penalties on: any request may carry presence, frequency or repetition penalties, and the
    # target's per-slot token counts cost slots x vocab x 5 bytes, counted by check_serving)
    tokenizer = target.tokenizer if target.hf else None
    draft_model = (drafted.model if isinstance(drafted, Served) else drafted.head) if drafted is not None else None
    weights = max(weight_bytes([target.model, draft_model]), resident_memory() - resident)  # (the models as loaded)
    draft_shape = draft_config(draft_model) if draft_model is not None else None
    cfg = fit_serving(target.model.config, draft_shape, cfg, sized=launch.sized, names=(target.name, drafted.name if drafted is not None else "draft"),
                      vocab=tokenizer.vocab_size if tokenizer is not None else None, budget=budget, weights=weights)
    if launch.device != "cpu":  # the engine serves on the device, its models moved there once
        for option, on in (("--tp", launch.tp > 1), ("--overlap", launch.overlap)):
            if on:
                raise ServeError(f"--device {launch.device} with {option}: on a CUDA device the engine serves in its own process only so far")
        placed, draft_model = on_device(target.model, draft_model, launch.device)
        target = attrs.evolve(target, model=placed)
    estimate = sum(memory_estimate(target.model.config, draft_shape, cfg, weights=weights).values())
    sizes = (f"max-running {cfg.max_running}, token-budget {cfg.token_budget}, cache-entries {cfg.cache_entries}"
             f"{' (lowered to fit)' if any(attrs.asdict(cfg)[n] != attrs.asdict(launch)[n] for n in launch.sized) else ''}; "
             f"about {gib(estimate)} of a budget of {budget.describe()}")
    target_model = target.model
    leader: TPLeader | None = None
    if launch.tp > 1:  # every check passed: start the group (the workers load the models as this process did)
        # (a draft head is not split: every rank holds it whole)
        distributed.check_splits(launch.tp, [(target.name, target.model.config)] + ([(drafted.name, drafted.model.config)]
                                                                                     if isinstance(drafted, Served) else []))
        try:
            group = spawn_workers(launch.tp, [sys.executable, "-m", "compiler.online.engine_process", TP_WORKER, json.dumps(attrs.asdict(launch))],
                                  timeout_s=launch.tp_timeout, start_timeout_s=distributed.START_TIMEOUT_S)
        except ValueError as exc:
            raise ServeError(str(exc)) from None
        leader = TPLeader(group)
        try:
            target_model, draft_model = distributed.shards(group, target_model, draft_model)
        except BaseException:
            leader.shutdown()
            raise
    try:
        engine = make_engine(target_model, draft_model, cfg, None, cache=True, k=k, tp=leader)
    except BaseException:
        if leader is not None:
            leader.shutdown()
        raise
    ready = Ready(name=target.name, vocab=target.model.config.vocab, eos=tuple(target.eos), max_len=max_len, k=k, reserve=cfg.reserve,
                  hf_dir=launch.model if target.hf else None, pid=os.getpid(), sizes=sizes)
    return engine, ready, cfg, leader


class Loop:
    """The engine loop (see the module); ``run`` returns after ``Shutdown``."""

    def __init__(self, engine: Engine, conn: multiprocessing.connection.Connection, max_running: int,
                 ping: Callable[[], None] | None = None, ping_s: float = PING_S) -> None:
        self.engine = engine
        self.conn = conn
        self.max_running = max_running
        self.ping = ping
        """Called between steps every ``ping_s`` seconds or so, busy or idle (a tensor-parallel
        group's ``TPLeader.ping``)."""
        self.ping_s = ping_s
        self.last_ping = time.monotonic()
        self.queued: deque[Submit] = deque()
        self.sent: dict[int, int] = {}
        """Tokens already sent, by every submitted completion not yet ended."""
        self.stops: dict[int, frozenset[int]] = {}
        self.groups: dict[int, tuple[int, ...]] = {}
        """The completions' ids of every submitted request with one not yet ended, by request id."""
        self.deltas: list[Delta] = []
        self.ended: list[Ended] = []
        self.steps = 0
        self.last_stats: Stats | None = None
        self.last_sent = 0.0

    def run(self) -> None:
        """Serve until ``Shutdown``: read the waiting messages, admit from the FIFO, run one step, send
        what it produced (see the module). Blocks for a message only when nothing is live."""
        while True:
            busy = bool(self.queued) or self.engine.live > 0
            if self.conn.poll(0 if busy else IDLE_TICK_S):
                while True:
                    if self._handle(self.conn.recv()):
                        return
                    if not self.conn.poll(0):
                        break
            self._admit()
            if self.engine.live:
                self.engine.step()
                self.steps += 1
                if not self.engine.live:
                    self.engine.sync()  # (overlap: the last pipelined forward's tokens)
            self._collect()
            self._send()
            if self.ping is not None and time.monotonic() - self.last_ping >= self.ping_s:
                self.ping()
                self.last_ping = time.monotonic()

    def _handle(self, msg: ToEngine) -> bool:
        """Act on one message; True on ``Shutdown``."""
        match msg:
            case Submit():
                self.queued.append(msg)
                self.groups[msg.rid] = msg.completions
                for member in msg.completions:
                    self.sent[member] = 0
                    self.stops[member] = frozenset(msg.stop)
            case Abort(rid=rid):
                self._abort(rid)
            case Finish(rid=rid, keep=keep):
                if RequestId(rid) in self.engine.requests:
                    self.engine.finish(RequestId(rid), length=keep)
                    self._collect_one(rid, reason="stop")
                # else: it ended already (its Ended is sent or on its way); a Finish follows tokens, so never a queued one
            case Shutdown():
                for rid in list(self.groups):
                    self._abort(rid)
                self.engine.sync()
                self._collect()
                self.engine.drop_cache()
                self._send(force=True)
                self.engine.close()  # (a tensor-parallel session ends here: every rank's ledger counts gathered)
                outstanding = len(self.engine.ledger.outstanding())
                ranks = self.engine.closing_ledgers
                if ranks is not None:
                    outstanding += sum(c.outstanding + c.in_flight for counts in ranks.ranks[1:] for c in counts.values())
                self.conn.send(Closed(outstanding_tickets=outstanding, slots_live=self.engine.slots.num_live, kv_live=self.engine.kv.num_live,
                                      ranks_equal=ranks is None or ranks.equal))
                return True
            case _:
                raise TypeError(f"unexpected message {type(msg).__name__}")
        return False

    def _abort(self, rid: int) -> None:
        """End request ``rid``: every completion of it still queued here or live in the engine."""
        for i, sub in enumerate(self.queued):
            if sub.rid == rid:
                del self.queued[i]
                for member in sub.completions:
                    self._end(member, (), "abort")
                return
        for member in self.groups.get(rid, ()):
            if RequestId(member) in self.engine.requests:
                self.engine.abort(RequestId(member))
                self._collect_one(member, reason="abort")
            # else: it ended already (its Ended is sent or on its way)

    def _room_for(self, sub: Submit) -> bool:
        """Whether ``sub`` can be admitted now: ``n > 1`` completions prefill their shared prompt
        state at admission (``Engine.admit``), which needs a free slot and KV locations now."""
        if not sub.forks or len(sub.prompt) < 2:
            return True
        return self.engine.slots.num_free >= 1 and self.engine.kv.num_free >= len(sub.prompt) - 1

    def _admit(self) -> None:
        while self.queued and self.engine.live < self.max_running and self._room_for(self.queued[0]):
            sub = self.queued.popleft()
            try:
                self.engine.admit(RequestId(sub.rid), list(sub.prompt), max_new_tokens=sub.max_new_tokens, stop=list(sub.stop) or None,
                                  sampling=sub.sampling, forks=[RequestId(f) for f in sub.forks])
            except BatchcError as exc:  # checked on the HTTP side first: a refusal here is that check's bug, said per request
                for member in sub.completions:
                    self._end(member, (), "refused", " ".join(str(exc).split()))

    def _end(self, rid: int, ids: tuple[int, ...], reason: EndReason, message: str | None = None,
             logprobs: tuple[TokenLogprob, ...] | None = None) -> None:
        self.sent.pop(rid, None)
        self.stops.pop(rid, None)
        for group, members in list(self.groups.items()):
            if rid in members and not any(m in self.sent for m in members):
                del self.groups[group]
        self.ended.append(Ended(rid=rid, ids=ids, reason=reason, message=message, logprobs=logprobs))

    def _collect_one(self, rid: int, reason: EndReason | None = None) -> None:
        """Send what completion ``rid`` emitted since last time (and its logprobs); end it if it left the engine."""
        engine, key, sent = self.engine, RequestId(rid), self.sent[rid]
        live = engine.requests.get(key)
        if live is not None:
            new = live.output[sent : live.max_new_tokens]
            if new:
                entries = None if live.logprobs is None else _logprobs(live.logprobs[sent : sent + len(new)], len(new))
                self.deltas.append(Delta(rid, tuple(int(t) for t in new), entries))
                self.sent[rid] = sent + len(new)
            return
        if key not in engine.outputs:
            return  # still queued here
        out = engine.outputs.pop(key)  # (a long-running server keeps no record of ended requests)
        recorded = engine.logprobs.pop(key, None)
        last = None if recorded is None else _logprobs(recorded[sent : len(out)], max(0, len(out) - sent))
        message: str | None = None
        if reason is None:
            if key in engine.aborted_by_failure:
                reason, message = "failed", engine.first_failure
            elif key in engine.errored:
                from compiler.engine.nonfinite import ERROR_MESSAGE

                reason, message = "error", ERROR_MESSAGE
            elif out and out[-1] in self.stops[rid]:
                reason = "stop"
            else:
                reason = "length"
        engine.aborted_by_failure.discard(key)
        engine.errored.discard(key)
        self._end(rid, tuple(int(t) for t in out[sent:]), reason, message, last)

    def _collect(self) -> None:
        for rid in list(self.sent):
            self._collect_one(rid)

    def stats(self) -> Stats:
        """The engine's figures now, as the HTTP side's metrics read them: requests running and waiting,
        slots, KV locations, cache entries, outstanding tickets, draft tokens proposed and accepted, steps."""
        engine = self.engine
        running = sum(1 for r in engine.requests if r.state is RequestState.RUNNING)
        return Stats(
            running=running, waiting=sum(len(s.completions) for s in self.queued) + engine.live - running, slots_live=engine.slots.num_live,
            slots_capacity=engine.slots.capacity, request_slots=len(engine.live_slots()), kv_live=engine.kv.num_live,
            kv_capacity=engine.kv.capacity, cache_entries=len(engine.cache) if engine.cache is not None else 0,
            outstanding_tickets=len(engine.ledger.outstanding()), proposed=engine.stats.proposed, accepted=engine.stats.accepted,
            steps=self.steps,
        )

    def _send(self, force: bool = False) -> None:
        stats = self.stats()
        now = time.monotonic()
        if not (force or self.deltas or self.ended or stats != self.last_stats or now - self.last_sent >= IDLE_TICK_S):
            return
        self.conn.send(StepOut(deltas=tuple(self.deltas), ended=tuple(self.ended), stats=stats))
        self.deltas.clear()
        self.ended.clear()
        self.last_stats, self.last_sent = stats, now


def _logprobs(entries: list[dict[str, Any]], n: int) -> tuple[TokenLogprob, ...]:
    """``Engine.logprobs`` entries as messages; ``n`` of them (the ids they go with)."""
    if len(entries) != n:
        raise AssertionError(f"{n} new tokens but {len(entries)} logprob entries")  # (the engine keeps them in step with the output)
    return tuple(TokenLogprob(int(e["id"]), e["logprob"], tuple((int(x["id"]), x["logprob"]) for x in e["top"])) for e in entries)


def main(argv: list[str]) -> int:
    """The engine process (see the module): ``argv`` is ``[FD]``, the connection to the HTTP process.
    Reads ``Launch``, builds the engine, answers ``Ready`` (or ``StartFailed``, exit status 2) and runs
    the loop; exits 0 after ``Shutdown``, 1 when the server went away or the loop crashed (sent as
    ``Crashed``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server speaks for Ctrl-C and stops this process itself
    conn = multiprocessing.connection.Connection(int(argv[0]))
    try:
        launch = conn.recv()
    except (EOFError, OSError):
        return 1  # the server is gone
    if not isinstance(launch, Launch):
        conn.send(StartFailed(f"expected Launch first, got {type(launch).__name__}"))
        return 2
    import torch

    torch.set_num_threads(launch.threads)
    try:
        engine, ready, cfg, leader = build(launch)
    except (BatchcError, OSError, ValueError, RankFailed) as exc:
        conn.send(StartFailed(" ".join(str(exc).split())))
        return 2
    try:
        conn.send(ready)
        Loop(engine, conn, cfg.max_running, ping=leader.ping if leader is not None else None,
             ping_s=min(PING_S, launch.tp_timeout / 4)).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 1  # the server is gone (the parent-death signal ends this process too)
    except BaseException as exc:  # noqa: BLE001 - said to the server in one line, then this process exits
        try:
            conn.send(Crashed(f"{type(exc).__name__}: {' '.join(str(exc).split())}"))
        except OSError:
            pass
        return 1
    finally:
        if leader is not None:
            leader.shutdown()  # (the workers return; a broken group's are left to the parent-death signal)
    return 0


def tp_worker(spec: str) -> int:
    """A tensor-parallel worker rank of the engine process (started by ``build`` with ``RANK`` and
    ``WORLD_SIZE`` set): load the models as rank 0 did, join the group, serve rank 0's plans on this
    rank's shards until it shuts the group down (``compiler.offline.distributed.work``)."""
    from compiler.offline import distributed
    from compiler.offline.models import ServedHead

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (as rank 0: the server stops the group)
    launch = Launch(**json.loads(spec))
    import torch

    torch.set_num_threads(launch.threads)
    rank, world, launched = distributed.placement(launch.tp)
    try:
        target, drafted, _ = load(launch)
    except (BatchcError, OSError, ValueError) as exc:  # (rank 0 loaded the same models first: said once, here too)
        print(f"batchc: rank {rank}: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 2
    draft = drafted.head if isinstance(drafted, ServedHead) else drafted.model if drafted is not None else None
    return distributed.work(rank, world, launched, (), launch.tp_timeout, target.model, draft)


if __name__ == "__main__":
    sys.exit(tp_worker(sys.argv[2]) if sys.argv[1:2] == [TP_WORKER] else main(sys.argv[1:]))
