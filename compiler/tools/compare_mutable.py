"""``batchc run --compare-mutable``: the same workload through the mutable baseline, before and
after the upstream fix, with the same admission loop (system prefixes are prefix states it COWs
from: it has no prefix cache)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from backend.hybrid.model import HybridModel
from compiler.baselines.spec import MutableSpecEngine
from compiler.serve import MutableRun, Request, ServeConfig
from compiler.workload import SYSTEM_PREFIXES


def make_mutable(target: HybridModel, draft: HybridModel, cfg: ServeConfig, *, k: int) -> MutableSpecEngine:
    return MutableSpecEngine(target, draft, k=k, capacity=cfg.max_running + len(SYSTEM_PREFIXES) + 2,
                             kv_capacity=cfg.max_running * cfg.max_len + 1024, max_len=cfg.max_len)


def serve_mutable(engine: MutableSpecEngine, workload: Sequence[Request], *, max_running: int) -> tuple[float, int]:
    """The same admission loop for the mutable baseline; system prefixes are prefix states it COWs from
    (it has no prefix cache). Returns wall seconds and steps."""
    cps = [engine.make_prefix(list(p)) for p in SYSTEM_PREFIXES]
    queue = sorted(workload, key=lambda r: r.arrival)
    t0 = time.perf_counter()
    steps = 0
    while queue or engine.live:
        while queue and queue[0].arrival <= steps and engine.live < max_running:
            r = queue.pop(0)
            cp = next((c for c in cps if r.prompt.startswith(bytes(c.tokens)) and len(r.prompt) > len(c.tokens)), None)
            engine.admit(r.rid, list(r.prompt), max_new_tokens=r.max_new_tokens, prefix=cp)
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    for cp in cps:
        engine.release_prefix(cp)
    return wall, steps


def run_mutable(workload: Sequence[Request], target: HybridModel, draft: HybridModel, cfg: ServeConfig, *, fixed: bool) -> MutableRun:
    """The same workload through the mutable baseline, pre-fix or with the upstream fix."""
    engine = make_mutable(target, draft, cfg, k=cfg.k)
    engine.fixed = fixed
    wall, _ = serve_mutable(engine, workload, max_running=cfg.max_running)
    generated = sum(len(v) for v in engine.outputs.values())
    return MutableRun(
        acceptance_rate=engine.stats.acceptance_rate,
        mean_accepted_length=engine.stats.mean_accepted_length,
        init_ops_target=engine.t.runner.clears_executed + engine.t.runner.cows_executed,
        init_ops_draft=engine.d.runner.clears_executed + engine.d.runner.cows_executed,
        replays=engine.replays,
        stale_ops_run=engine.t.runner.stale_ops + engine.d.runner.stale_ops,
        wall_s=wall,
        tokens_per_s=generated / wall if wall else 0.0,
    )
