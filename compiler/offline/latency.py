"""Per-request latency of a served run: time to first token and time per output token.

A request's clock starts when it *arrives* (its arrival step comes: queueing for a free place among
``max_running`` counts, as a client would see it), its first token is the end of the first step that
names it in ``StepReport.emitted``, and it ends at the end of the step that reports it finished.
Time per output token is (end - first token) / (output tokens - 1), over requests with at least two.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from compiler.engine import StepReport
from compiler.workload import Request
from ir.ids import RequestId

__all__ = ["Latencies"]


class Latencies:
    """The clocks of a served run's requests (see the module): when each arrived, got its first token and
    ended, and each step's wall time by kind. Fed by the serving loop (``arrive_due`` or ``arrive``,
    then ``step`` with each report); read with ``ttft_ms`` and ``tpot_ms``. Times are
    ``time.perf_counter`` seconds."""

    def __init__(self) -> None:
        self.arrived: dict[RequestId, float] = {}
        self.first: dict[RequestId, float] = {}
        self.ended: dict[RequestId, float] = {}
        self.step_ms: dict[str, list[float]] = {}
        """Each step's wall time by its kind (``StepKind.value``), in milliseconds: from the top of
        the serving loop's turn (``arrive_due``: admissions included) to the step's report."""
        self._turn: float | None = None

    def arrive(self, rids: Iterable[RequestId], now: float) -> None:
        """``rids`` arrive at ``now`` (one that arrived already keeps its first time)."""
        for rid in rids:
            self.arrived.setdefault(rid, now)

    def arrive_due(self, queue: Sequence[Request], step: int) -> None:
        """Every request at the head of ``queue`` (sorted by arrival step, not yet admitted) whose
        arrival step has come arrives now, unless it arrived at an earlier step."""
        now = time.perf_counter()
        self._turn = now
        for r in queue:
            if r.arrival > step:
                break
            self.arrived.setdefault(r.rid, now)

    def step(self, report: StepReport, now: float) -> None:
        """Record a step's report at ``now``: its wall time since the turn began (``arrive_due``), the first
        token of every request it names in ``emitted``, and the end of every request it finished, aborted
        or errored."""
        if self._turn is not None:
            self.step_ms.setdefault(report.kind.value, []).append(1000 * (now - self._turn))
            self._turn = None
        for rid in report.emitted:
            self.first.setdefault(rid, now)
        for rid in (*report.finished, *report.aborted, *report.errored):
            self.ended[rid] = now

    def ttft_ms(self) -> list[float]:
        """Time to first token of every request that got one, in milliseconds."""
        return [1000 * (t - self.arrived[rid]) for rid, t in self.first.items() if rid in self.arrived]

    def tpot_ms(self, outputs: Mapping[RequestId, Sequence[int]]) -> list[float]:
        """Time per output token after the first, of every ended request with two tokens or more."""
        out = []
        for rid, end in self.ended.items():
            n = len(outputs.get(rid, ()))
            if n >= 2 and rid in self.first:
                out.append(1000 * (end - self.first[rid]) / (n - 1))
        return out
