"""Model time of a serving run: ``TimedModel`` adds the wall time of every forward to a running
total, so a run's host time (wall minus model time) can be told apart from the model's work. The
benchmarks and ``batchc run`` measure every engine, compiled and mutable, through it."""

from __future__ import annotations

import time
from typing import Any

import torch

from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.model import HybridModel
from backend.hybrid.outputs import ForwardOut, VerifyOut, VerifyStates
from backend.pool import MambaStatePool


class TimedModel(HybridModel):
    """A ``HybridModel`` (the same config and weights; a tensor-parallel shard stays one) that adds the wall time of each forward
    (extend, decode, verify, both proposals, commit) to ``seconds``."""

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
