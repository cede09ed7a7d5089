"""``batchc bench serve``: the serving workload at k = 0 and k = 2, compiled pipeline vs. the
mutable baseline, side by side in one run, on the same models.

Per run: generated tokens per second, steps, and host overhead per step: wall time minus the time
spent inside the model's forwards (measured by ``TimedModel``), divided by the
steps. The host overhead is what batchc adds or removes; the model time is the same work on both
sides (the baseline has no prefix cache, so it prefills the shared prefixes' tails it cannot reuse).
Both engines first serve two requests unmeasured, so one-time costs (imports, lazy set-up) fall on
neither side.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from backend.hybrid.model import HybridModel
from compiler.serve import Request, ServeConfig, make_engine, serve
from compiler.tools.compare_mutable import make_mutable, serve_mutable
from compiler.tools.timed import TimedModel


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
