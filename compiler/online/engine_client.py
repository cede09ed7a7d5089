"""The HTTP process's side of the engine process: start it, talk to it, account for its requests.

``EngineClient`` starts ``compiler.online.engine_process`` through ``backend.children.spawn`` (a
fresh interpreter that dies with this process, whatever kills it) connected by a socket pair, sends
``Launch`` and waits for ``Ready``. Then two daemon threads carry the messages: a writer (so that
the event loop never blocks on a full socket while the engine runs a step) and a reader, which
hands every ``StepOut`` to the event loop (``call_soon_threadsafe``). On the loop, the ``Delta``
and ``Ended`` messages of each request's completions (one, or ``n``: ids ``completion_ids``) go to
its ``Tracked`` queue, and its metrics (time to first token, inter-token latency, end-to-end
latency, tokens of all its completions, outcome) are recorded here, whether or not its HTTP handler
is still there to read them: a client that went away still has its request counted when the
engine's last ``Ended`` of it arrives.

If the engine process ends without ``Closed`` (a crash, a kill), ``gone`` says how, in one line,
every tracked request gets an ``Ended`` with reason ``failed`` at once, and ``on_gone`` is called:
the server answers 503 from then on and exits non-zero.
"""

from __future__ import annotations

import asyncio
import queue
import subprocess
import threading
import time
from collections.abc import Callable

import attrs

from backend import children
from compiler.online.messages import (
    Abort,
    Closed,
    Crashed,
    Delta,
    Ended,
    Finish,
    FromEngine,
    Launch,
    Ready,
    Shutdown,
    StartFailed,
    Stats,
    StepOut,
    Submit,
    ToEngine,
)
from compiler.online.metrics import Metrics
from compiler.workload import ServeError, completion_rid
from ir.ids import RequestId

__all__ = ["EngineClient", "EngineGone", "Tracked", "completion_ids"]


class EngineGone(ServeError):
    """The engine process ended before it was ready."""


def completion_ids(rid: int, n: int) -> tuple[int, ...]:
    """The engine ids of request ``rid``'s ``n`` completions, in index order: ``rid`` itself, then
    the offline runner's fork ids (``compiler.workload.completion_rid``: above every request id the
    server hands out, so never another request's)."""
    return tuple(int(completion_rid(RequestId(rid), i)) for i in range(n))


@attrs.define(kw_only=True)
class Tracked:
    """One request in flight, as the HTTP side sees it."""

    rid: int
    completions: tuple[int, ...]
    """Its completions' engine ids, in index order (``rid`` first)."""
    queue: asyncio.Queue[Delta | Ended]
    arrived: float
    """``time.perf_counter()`` when its HTTP request arrived."""
    last: float | None = None
    """When its tokens last arrived (``None``: none yet)."""
    note: str | None = None
    """Why the HTTP side sent ``Abort`` (``cancelled``, ``timeout``, ``aborted``, ``error``), read
    when its last ``Ended`` arrives."""
    finishing: set[int] = attrs.Factory(set)
    """Its completions the HTTP side finished at a stop string (``Finish`` sent)."""
    ended: dict[int, Ended] = attrs.Factory(dict)
    """Its completions' ``Ended``, by id, as they arrive."""
    done: bool = False
    """Every completion ended."""
    replica: int = 0
    """The engine process (``compiler.online.router``'s replica) it was submitted to."""

    def index(self, rid: int) -> int:
        """The choice index of completion ``rid``."""
        return self.completions.index(rid)


class EngineClient:
    """One engine process, seen from the HTTP process (see the module): it starts the process with
    ``launch`` (``wait_ready`` until it is built), then, once ``attach``ed to the event loop, sends it
    requests (``submit``, ``abort``, ``finish``), delivers each request's deltas and endings to its
    ``Tracked`` queue and records them in ``metrics``. ``submit``, ``abort``, ``finish`` and
    ``abort_all`` run on the event loop."""

    def __init__(self, launch: Launch, metrics: Metrics, *, replica: int = 0, report: Callable[[], None] | None = None) -> None:
        self.metrics = metrics
        self.replica = replica
        self.report = report if report is not None else self._report
        """Called on the event loop when this engine's ``stats`` or ``requests`` changed (the
        router's, which sums its replicas into the metrics; by default this one's own, as is)."""
        self.stats: Stats | None = None
        """The last ``Stats`` the engine process sent."""
        self.proc, self.conn = children.spawn_module("compiler.online.engine_process")
        self.conn.send(launch)
        self.tracked: dict[int, Tracked] = {}
        """The requests in flight, by the id of each of their completions not yet ended."""
        self.requests = 0
        """Requests in flight (each with one or more entries in ``tracked``)."""
        self.next_rid = 0
        self.gone: str | None = None
        self.closed: Closed | None = None
        self.finished = 0
        self.aborted = 0
        self.on_gone: Callable[[], None] = lambda: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue[ToEngine | None] = queue.SimpleQueue()
        self._closed_event = threading.Event()

    def _report(self) -> None:
        if self.stats is not None:
            self.metrics.engine(self.stats)
        self.metrics.in_flight.set(self.requests)

    def _how_it_ended(self) -> str:
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return "the engine process stopped answering"
        return f"the engine process {children.ended(code)}"

    def wait_ready(self, timeout_s: float) -> Ready:
        """Block until the engine is built: ``Ready``, or ``ServeError`` (its one line) / ``EngineGone``."""
        try:
            if not self.conn.poll(timeout_s):
                children.kill(self.proc)
                raise EngineGone(f"the engine process {children.no_answer(timeout_s)} (loading the models)")
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise EngineGone(f"{self._how_it_ended()} while loading the models") from None
        if isinstance(msg, StartFailed):
            raise ServeError(msg.message)
        if not isinstance(msg, Ready):
            raise EngineGone(f"the engine process answered {type(msg).__name__} instead of Ready")
        return msg

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the reader and writer threads, delivering to ``loop``."""
        self._loop = loop
        threading.Thread(target=self._reader, name="batchc-engine-reader", daemon=True).start()
        threading.Thread(target=self._writer, name="batchc-engine-writer", daemon=True).start()

    # -- threads -------------------------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                return  # the engine is gone: the reader says so

    def _reader(self) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                msg: FromEngine = self.conn.recv()
            except (EOFError, OSError):
                reason = self._how_it_ended()
                break
            match msg:
                case StepOut():
                    try:
                        loop.call_soon_threadsafe(self._on_step, msg)
                    except RuntimeError:  # the event loop is closed: the server has stopped already
                        return
                case Closed():
                    self.closed = msg
                    self._closed_event.set()
                    return
                case Crashed(message=message):
                    reason = f"the engine process failed: {message}"
                    self._how_it_ended()
                    break
                case _:
                    reason = f"the engine process sent {type(msg).__name__} unexpectedly"
                    break
        self._closed_event.set()
        try:
            loop.call_soon_threadsafe(self._on_gone, reason)
        except RuntimeError:  # the event loop is closed: the server has stopped already
            pass

    # -- on the event loop ---------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Completions in flight (a request of ``n`` counts ``n``)."""
        return len(self.tracked)

    def submit(self, sub: Submit, arrived: float) -> Tracked:
        """Send ``sub`` to the engine and track it (``arrived``: when its HTTP request came,
        ``time.perf_counter()``); returns the record whose queue gets its deltas and endings."""
        t = Tracked(rid=sub.rid, completions=sub.completions, queue=asyncio.Queue(), arrived=arrived, replica=self.replica)
        for member in sub.completions:
            self.tracked[member] = t
        self.requests += 1
        self.metrics.prompt_tokens.inc(len(sub.prompt))
        self.report()
        self._outbox.put(sub)
        return t

    def new_rid(self) -> int:
        """A fresh request id for this engine (0, 1, 2, ...)."""
        self.next_rid += 1
        return self.next_rid - 1

    def abort(self, t: Tracked, note: str) -> None:
        """Ask the engine to end ``t`` now, every completion of it (``note``: why, for its
        outcome); once only, and not once every completion ended or was finished."""
        if t.note is None and not t.done and set(t.completions) - t.finishing - set(t.ended):
            t.note = note
            if self.gone is None:
                self._outbox.put(Abort(t.rid))

    def finish(self, t: Tracked, rid: int, keep: int) -> None:
        """Ask the engine to end ``t``'s completion ``rid`` as finished with its first ``keep`` ids
        (a stop string); once only, and not after an ``Abort``."""
        if t.note is None and rid not in t.finishing and rid not in t.ended:
            t.finishing.add(rid)
            if self.gone is None:
                self._outbox.put(Finish(rid, keep))

    def abort_all(self, note: str) -> None:
        """``abort`` every tracked request, with ``note``."""
        for t in {id(t): t for t in self.tracked.values()}.values():
            self.abort(t, note)

    def _on_step(self, out: StepOut) -> None:
        now = time.perf_counter()
        self.stats = out.stats
        delivered: set[int] = set()  # (requests given tokens in this step: one latency each, however many completions)
        for d in out.deltas:
            t = self.tracked.get(d.rid)
            if t is not None:
                self._tokens(t, len(d.ids), now, delivered)
                t.queue.put_nowait(d)
        for e in out.ended:
            t = self.tracked.pop(e.rid, None)
            if t is not None:
                self._tokens(t, len(e.ids), now, delivered)
                self._end(t, e, now)
        self.report()

    def _tokens(self, t: Tracked, n: int, now: float, delivered: set[int]) -> None:
        if not n:
            return
        self.metrics.generation_tokens.inc(n)
        if t.rid in delivered:
            return
        delivered.add(t.rid)
        if t.last is None:
            self.metrics.ttft.observe(now - t.arrived)
        else:
            self.metrics.itl.observe(now - t.last)
        t.last = now

    def _end(self, t: Tracked, e: Ended, now: float) -> None:
        """Completion ``e.rid`` of ``t`` ended; with the last of them, ``t`` is counted."""
        t.ended[e.rid] = e
        t.queue.put_nowait(e)
        if len(t.ended) < len(t.completions):
            return
        t.done = True
        self.requests -= 1
        reasons = {r: x.reason for r, x in t.ended.items()}
        if t.note is not None:
            outcome = t.note
        elif all(r in t.finishing or reason in ("stop", "length") for r, reason in reasons.items()):
            outcome = "finished"
        elif "abort" in reasons.values():
            outcome = "aborted"
        elif "refused" in reasons.values():
            outcome = "refused"
        else:
            outcome = "error"
        self.metrics.requests.labels(outcome).inc()
        self.metrics.e2e.observe(now - t.arrived)
        if outcome == "finished":
            self.finished += 1
        else:
            self.aborted += 1

    def _on_gone(self, reason: str) -> None:
        if self.closed is not None or self.gone is not None:
            return
        self.gone = reason
        self.metrics.engine_up.set(0)
        now = time.perf_counter()
        for rid, t in list(self.tracked.items()):
            self._end(t, Ended(rid=rid, ids=(), reason="failed", message=reason), now)
        self.tracked.clear()
        self.report()
        self.on_gone()

    # -- stopping ------------------------------------------------------------------------------

    async def shutdown(self, timeout_s: float) -> Closed | None:
        """Ask the engine process to close (it aborts whatever is live) and wait for ``Closed`` and
        its exit; a process that does not close in time is killed. ``None`` when it was gone or killed."""
        if self.gone is None:
            self._outbox.put(Shutdown())
            await asyncio.to_thread(self._closed_event.wait, timeout_s)
        self._outbox.put(None)
        try:
            await asyncio.to_thread(self.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            pass
        children.kill(self.proc)
        self.conn.close()
        return self.closed

    def kill(self) -> None:
        """SIGKILL the engine process (and its group), and reap it."""
        children.kill(self.proc)
