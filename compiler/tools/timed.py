"""Model time of a serving run: ``TimedModel`` adds the wall time of every forward to a running
total, so a run's host time (wall minus model time) can be told apart from the model's work. The
benchmarks and ``batchc run`` measure every engine, compiled and mutable, through it.

Sampler time: within ``timing_sampler()``, every call an in-process executor (``backend.executor``)
makes to the sampler (``backend.plan_sampling``'s ``sample_logits`` after a prefill or decode,
``verify_tokens`` after a verify) adds its wall time to the clock it yields. Those calls are made
by the executor after the forward, outside ``TimedModel``'s timer, so model and sampler time never
overlap. Executors in other processes (``--overlap``) are not timed. On leaving, the executor's
own functions are back in place, whatever happened."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from backend.hybrid.head import HeadModel
from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.model import HybridModel
from backend.hybrid.outputs import ForwardOut, VerifyOut, VerifyStates
from backend.pool import MambaStatePool


class TimedModel(HybridModel):
    """A ``HybridModel`` (the same config and weights; a tensor-parallel shard stays one) that adds the wall time of each forward
    (extend, decode, mixed, verify, both proposals, commit) to ``seconds``."""

    def __init__(self, model: HybridModel) -> None:
        super().__init__(model.config, model.weights, collective=model.collective, norm_split=model.norm_split, origin=model.origin)
        self.seconds = 0.0

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def extend(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> ForwardOut:  # tensors and the captures
        out: ForwardOut = self._timed(super().extend, pool, kv, table, **kw)
        return out

    def decode(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: torch.Tensor) -> ForwardOut:
        out: ForwardOut = self._timed(super().decode, pool, kv, table, **kw)
        return out

    def mixed(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> ForwardOut:  # tensors and the captures
        out: ForwardOut = self._timed(super().mixed, pool, kv, table, **kw)
        return out

    def verify(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: torch.Tensor) -> VerifyOut:
        out: VerifyOut = self._timed(super().verify, pool, kv, table, **kw)
        return out

    def propose(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> torch.Tensor:
        out: torch.Tensor = self._timed(super().propose, pool, kv, table, **kw)
        return out

    def propose_keeping_states(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> tuple[torch.Tensor, VerifyStates]:
        out: tuple[torch.Tensor, VerifyStates] = self._timed(super().propose_keeping_states, pool, kv, table, **kw)
        return out

    def commit(self, pool: MambaStatePool, states: VerifyStates, **kw: torch.Tensor) -> None:
        self._timed(super().commit, pool, states, **kw)


def timed(model: HybridModel) -> TimedModel:
    """``model`` itself when it is already timed, else a ``TimedModel`` of it."""
    return model if isinstance(model, TimedModel) else TimedModel(model)


class TimedHead(HeadModel):
    """A draft head (the same config and weights, bound to the same target) that adds the wall time
    of each of its forwards (extend, which is also its commit, and propose) to ``seconds``."""

    def __init__(self, head: HeadModel) -> None:
        super().__init__(head.config, head.weights, head.target)
        self.seconds = 0.0

    def extend(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> ForwardOut:  # tensors and the captures
        t0 = time.perf_counter()
        try:
            return super().extend(pool, kv, table, **kw)
        finally:
            self.seconds += time.perf_counter() - t0

    def propose(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return super().propose(pool, kv, table, **kw)
        finally:
            self.seconds += time.perf_counter() - t0


def timed_draft(model: HybridModel | HeadModel) -> TimedModel | TimedHead:
    """A timed copy of a draft of either kind (a separate model or a head), or the draft itself if
    it is timed already."""
    if isinstance(model, (TimedModel, TimedHead)):
        return model
    return TimedHead(model) if isinstance(model, HeadModel) else TimedModel(model)


SAMPLER_CALLS = ("sample_logits", "verify_tokens")
"""The sampler functions ``backend.executor`` calls by these names, as ``backend.plan_sampling`` defines them."""


@attrs.define
class SamplerClock:
    """Wall seconds spent in the sampler calls of in-process executors (``timing_sampler``)."""

    seconds: float = 0.0


def _timed_call(fn: Callable[..., Any], clock: SamplerClock) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.seconds += time.perf_counter() - t0

    return call


@contextlib.contextmanager
def timing_sampler() -> Iterator[SamplerClock]:
    """A clock of the sampler calls in-process executors make while the block runs (module
    docstring). Refused (``RuntimeError``) inside another one, or if the executor no longer calls
    ``backend.plan_sampling``'s functions under these names (the clock would read 0)."""
    import backend.executor as executor
    import backend.plan_sampling as plan_sampling

    # (module namespaces, read and swapped by name: the executor's module-level names of the sampler)
    calls, names = vars(plan_sampling), vars(executor)
    originals = {name: calls[name] for name in SAMPLER_CALLS}
    for name, fn in originals.items():
        if names.get(name) is not fn:
            raise RuntimeError(f"backend.executor.{name} is not backend.plan_sampling.{name} (already timed, or no longer called so)")
    clock = SamplerClock()
    try:
        for name, fn in originals.items():
            names[name] = _timed_call(fn, clock)
        yield clock
    finally:
        for name, fn in originals.items():
            names[name] = fn
