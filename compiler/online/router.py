"""``batchc serve --dp N``: the HTTP side's router over N engine processes (replicas), each with its
own models, pools, prefix cache and ledger (``compiler.online.engine_client.EngineClient``).

The server talks to one ``EngineRouter`` whatever ``--dp`` is (one replica by default), in the
vocabulary of one engine: ``submit``, ``abort``, ``finish``, ``abort_all``, ``shutdown``.

Routing: a request (all of its ``n`` completions: they share their prompt's state) goes to the
replica with the fewest completions in flight now (submitted and not ended), ties dealt out in turn.
Live counts, not a prefix key (``batchc run --dp``'s router knows the whole workload in advance; an
online request's load is unknown until it ends): a replica slowed by long requests gets fewer new
ones. Request ids are numbered here, once for every replica, so a request's id (and the seed a
sampled request without one derives from it) does not depend on where it went.

Each replica drains, aborts and reports on its own: an ``Abort`` or ``Finish`` goes to the replica
holding the request; ``shutdown`` closes every replica at once and sums their ``Closed``. The
metrics' engine gauges are the sum over the replicas' last ``Stats``; ``batchc_replica_*`` gauges
give each replica's own. If one replica's engine process dies, its requests fail, ``gone`` says
which replica and how, and the server stops (the others are shut down, their requests aborted), as
with one engine.

Invariants: every ``Tracked`` is handled by the replica named by its ``replica``; request ids are
distinct over every replica; ``outstanding`` and ``requests`` are sums over the replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import attrs

from compiler.online.engine_client import EngineClient, EngineGone, Tracked
from compiler.online.messages import Closed, Launch, Ready, Stats, Submit
from compiler.online.metrics import Metrics

__all__ = ["EngineRouter", "choose"]


def choose(loads: Sequence[int], turn: int) -> int:
    """The replica a new request goes to: of those with the least ``loads`` (completions in flight),
    the first from ``turn`` on, cyclically (the router's next ``turn`` is the one after it)."""
    if not loads or not 0 <= turn < len(loads):
        raise ValueError(f"turn {turn!r} is not an index of {len(loads)} replicas")
    least = min(loads)
    return next(i % len(loads) for i in range(turn, turn + len(loads)) if loads[i % len(loads)] == least)


class EngineRouter:
    """The server's one view of its engine processes (see the module): ``replicas`` ``EngineClient``s
    started at once with ``launch``, spoken to as one engine. Request ids are numbered here, over every
    replica; each request goes to the replica with the fewest completions in flight."""

    def __init__(self, launch: Launch, metrics: Metrics, replicas: int = 1) -> None:
        if type(replicas) is not int or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        self.metrics = metrics
        self.clients: list[EngineClient] = []
        try:
            for i in range(replicas):  # (all started now: their models load at the same time)
                self.clients.append(EngineClient(launch, metrics, replica=i, report=self._report))
        except BaseException:
            self.kill()
            raise
        self.next_rid = 0
        self._turn = 0
        self.on_gone: Callable[[], None] = lambda: None
        self.pids: tuple[int, ...] = ()

    def wait_ready(self, timeout_s: float) -> Ready:
        """Every replica built: the first one's ``Ready`` (they differ only in their process id,
        ``pids``, and in ``sizes``, whose memory each replica measures in its own process: when those
        differ, ``sizes`` names each replica's); ``ServeError`` / ``EngineGone`` (naming the replica
        when there are several)."""
        readies = []
        for i, c in enumerate(self.clients):
            try:
                readies.append(c.wait_ready(timeout_s))
            except EngineGone as exc:
                raise EngineGone(self._named(i, str(exc))) from None
        first = attrs.evolve(readies[0], pid=0, sizes="")
        for i, r in enumerate(readies[1:], 1):
            if attrs.evolve(r, pid=0, sizes="") != first:  # (the same Launch: only a bug or a changed file between loads gets here)
                raise EngineGone(f"replica {i} built another engine than replica 0: {r} != {readies[0]}")
        self.pids = tuple(r.pid for r in readies)
        said = [r.sizes for r in readies]
        if len(set(said)) > 1:  # (a model's resident memory as loaded is measured: it can differ by a page or two)
            return attrs.evolve(readies[0], sizes="; ".join(f"replica {i}: {s}" for i, s in enumerate(said)))
        return readies[0]

    def _named(self, i: int, what: str) -> str:
        return what if len(self.clients) == 1 else f"replica {i}: {what}"

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach every replica's client to ``loop`` (their reader and writer threads start), each calling
        ``on_gone_of`` if its engine process dies."""
        for c in self.clients:
            c.on_gone = self.on_gone_of
            c.attach(loop)

    def on_gone_of(self) -> None:
        """A replica's engine process ended without ``Closed``: call ``on_gone`` (the server stops)."""
        self.on_gone()

    # -- on the event loop ---------------------------------------------------------------------

    @property
    def gone(self) -> str | None:
        """How the first replica to end without ``Closed`` ended (``None``: none did)."""
        for i, c in enumerate(self.clients):
            if c.gone is not None:
                return self._named(i, c.gone)
        return None

    @property
    def outstanding(self) -> int:
        """Completions in flight, every replica's."""
        return sum(c.outstanding for c in self.clients)

    @property
    def finished(self) -> int:
        """Requests finished, over every replica."""
        return sum(c.finished for c in self.clients)

    @property
    def aborted(self) -> int:
        """Requests aborted, over every replica."""
        return sum(c.aborted for c in self.clients)

    def new_rid(self) -> int:
        """A fresh request id (0, 1, 2, ...), distinct over every replica."""
        self.next_rid += 1
        return self.next_rid - 1

    def submit(self, sub: Submit, arrived: float) -> Tracked:
        """Send ``sub`` to the replica with the fewest completions in flight (ties in turn) and track it
        there."""
        i = choose([c.outstanding for c in self.clients], self._turn)
        self._turn = (i + 1) % len(self.clients)
        c = self.clients[i]
        self.metrics.replica_requests.labels(str(c.replica)).inc()
        return c.submit(sub, arrived)

    def abort(self, t: Tracked, note: str) -> None:
        """Ask the replica holding ``t`` to end it now (``EngineClient.abort``)."""
        self.clients[t.replica].abort(t, note)

    def finish(self, t: Tracked, rid: int, keep: int) -> None:
        """Ask the replica holding ``t`` to end its completion ``rid`` as finished with its first ``keep``
        ids (``EngineClient.finish``)."""
        self.clients[t.replica].finish(t, rid, keep)

    def abort_all(self, note: str) -> None:
        """``abort`` every tracked request of every replica, with ``note``."""
        for c in self.clients:
            c.abort_all(note)

    def _report(self) -> None:
        """The metrics: the engine gauges summed over the replicas, and each replica's own."""
        m = self.metrics
        known = [c.stats for c in self.clients if c.stats is not None]
        if known:
            m.engine(Stats(**{f: sum(attrs.asdict(s)[f] for s in known) for f in attrs.fields_dict(Stats)}))
        m.in_flight.set(sum(c.requests for c in self.clients))
        for c in self.clients:
            label = str(c.replica)
            m.replica_in_flight.labels(label).set(c.requests)
            m.replica_up.labels(label).set(1 if c.gone is None else 0)
            if c.stats is not None:
                m.replica_running.labels(label).set(c.stats.running)
                m.replica_outstanding.labels(label).set(c.stats.outstanding_tickets)

    # -- stopping ------------------------------------------------------------------------------

    async def shutdown(self, timeout_s: float) -> Closed | None:
        """Close every replica at once (each aborts what it still runs): their ``Closed`` summed,
        or ``None`` when any was gone or killed."""
        closed = await asyncio.gather(*(c.shutdown(timeout_s) for c in self.clients))
        if any(c is None for c in closed):
            return None
        done = [c for c in closed if c is not None]
        return Closed(outstanding_tickets=sum(c.outstanding_tickets for c in done), slots_live=sum(c.slots_live for c in done),
                      kv_live=sum(c.kv_live for c in done), ranks_equal=all(c.ranks_equal for c in done))

    def kill(self) -> None:
        """SIGKILL every replica's engine process."""
        for c in self.clients:
            c.kill()
