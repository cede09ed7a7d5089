"""``batchc bench serve``: the serving workload at k = 0 and k = 2, compiled pipeline vs. the
mutable baseline, side by side in one run, on the same models.

Per run: generated tokens per second, steps, and host overhead per step: wall time minus the time
spent inside the model's forwards (measured by a timing subclass of the model), divided by the
steps. The host overhead is what batchc adds or removes; the model time is the same work on both
sides (the baseline has no prefix cache, so it prefills the shared prefixes' tails it cannot reuse).
Both engines first serve two requests unmeasured, so one-time costs (imports, lazy set-up) fall on
neither side.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.model import ForwardOut, HybridModel, VerifyOut, VerifyStates
from backend.pool import MambaStatePool
from compiler.serve import Request, ServeConfig, make_engine, serve
from compiler.tools.compare_mutable import make_mutable, serve_mutable


class TimedModel(HybridModel):
    """A ``HybridModel`` that adds the wall time of each forward to ``seconds``."""

    def __init__(self, model: HybridModel) -> None:
        super().__init__(model.config, model.weights)
        self.seconds = 0.0

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def extend(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: torch.Tensor) -> ForwardOut:
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


@attrs.frozen(kw_only=True)
class ServeRow:
    k: int
    engine: str
    tokens: int
    wall_s: float
    model_s: float
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def host_ms_per_step(self) -> float:
        return (self.wall_s - self.model_s) / self.steps * 1e3 if self.steps else 0.0


def run_serve_bench(target: HybridModel, draft: HybridModel, workload: Sequence[Request], ks: Sequence[int] = (0, 2)) -> list[ServeRow]:
    rows = []
    warm = list(workload)[:2]  # first calls pay for imports and lazy initialisation: not measured
    for k in ks:
        cfg = ServeConfig(k=k)
        serve(make_engine(target, draft, cfg, None, cache=True, k=k), warm, max_running=cfg.max_running)
        serve_mutable(make_mutable(target, draft, cfg, k=k), warm, max_running=cfg.max_running)
    for k in ks:
        cfg = ServeConfig(k=k)
        t, d = TimedModel(target), TimedModel(draft)
        drv = make_engine(t, d, cfg, None, cache=True, k=k)
        wall, steps = serve(drv, workload, max_running=cfg.max_running)
        rows.append(ServeRow(k=k, engine="compiled", tokens=sum(map(len, drv.outputs.values())), wall_s=wall,
                             model_s=t.seconds + d.seconds, steps=sum(steps.values())))
        t, d = TimedModel(target), TimedModel(draft)
        eng = make_mutable(t, d, cfg, k=k)
        wall, n = serve_mutable(eng, workload, max_running=cfg.max_running)
        rows.append(ServeRow(k=k, engine="mutable baseline", tokens=sum(map(len, eng.outputs.values())), wall_s=wall,
                             model_s=t.seconds + d.seconds, steps=n))
    return rows
