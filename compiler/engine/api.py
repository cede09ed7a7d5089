"""``ServingEngine``: what a harness needs from a serving engine. The compiled ``Engine`` and the
mutable baseline (``compiler.baselines.spec.MutableSpecEngine``) both provide it, so the A/B
harness, the benchmarks and the tests drive them through the same calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from compiler.engine.report import PrefixState, SpecStats, StepReport
from ir.ids import RequestId

__all__ = ["ServingEngine"]


class ServingEngine(Protocol):
    """What a harness needs from a serving engine, as a structural protocol: admit requests, step, read
    outputs and counters, make and release prefix states. ``compiler.engine.Engine`` is one; so is the
    mutable baseline, so an A/B comparison, a benchmark or a test drives either through the same calls."""

    @property
    def stats(self) -> SpecStats:
        """Counters over the engine's life (forwards, speculative acceptance, retractions, ...)."""
        ...

    @property
    def outputs(self) -> Mapping[RequestId, list[int]]:
        """Outputs by request id: complete for every request that has left (an engine may also
        show the partial output of live ones)."""
        ...

    @property
    def live(self) -> int:
        """Requests admitted and not finished or aborted."""
        ...

    def admit(
        self,
        rid: RequestId,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        prefix: PrefixState | None = None,
        stop: int | Sequence[int] | None = None,
    ) -> None:
        """Queue a request: ``max_new_tokens`` greedy tokens after ``prompt``, fewer if a ``stop`` id
        (one, or a list or tuple of them) is emitted; with ``prefix`` it starts from that prefix state."""
        ...

    def make_prefix(self, tokens: Sequence[int]) -> PrefixState:
        """Prefill ``tokens`` once into a slot that requests can start from."""
        ...

    def release_prefix(self, cp: PrefixState) -> None:
        """Give a prefix state's slot and KV locations back."""
        ...

    def step(self) -> StepReport:
        """One scheduler iteration."""
        ...

    def run_until_done(self, max_steps: int = 100_000) -> None:
        """Step until no request is live."""
        ...
