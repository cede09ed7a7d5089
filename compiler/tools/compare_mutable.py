"""``batchc run --compare-mutable``: the same workload through the mutable baseline, before and
after the upstream fix, with the same admission loop (system prefixes are prefix states it COWs
from: it has no prefix cache). Every engine is warmed up first (``warm_up``), and the model time of
every run is measured the same way (``TimedModel``), so the runs' host time per step compares."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from backend.hybrid.head import HeadModel
from backend.hybrid.model import HybridModel
from compiler.baselines.spec import MutableSpecEngine
from compiler.offline import MutableRun, Request, ServeConfig, make_engine, serve
from compiler.offline.latency import Latencies
from compiler.offline.summary import host_ms_per_step
from compiler.tools.timed import TimedModel
from compiler.workload import SYSTEM_PREFIXES

WARM_UP_REQUESTS = 2
"""Requests each engine serves unmeasured before its measured runs: first calls pay for imports
and lazy initialisation."""


def make_mutable(target: HybridModel, draft: HybridModel | HeadModel, cfg: ServeConfig, *, k: int, fixed: bool = False) -> MutableSpecEngine:
    """The mutable baseline sized like ``make_engine``'s engine for ``cfg`` (``cfg.max_running``
    requests of up to ``cfg.max_len`` tokens, and the system prefixes); pre-fix unless ``fixed``."""
    return MutableSpecEngine(target, draft, k=k, capacity=cfg.max_running + len(SYSTEM_PREFIXES) + 2,
                             kv_capacity=cfg.max_running * cfg.max_len + 1024, max_len=cfg.max_len, fixed=fixed)


def serve_mutable(
    engine: MutableSpecEngine, workload: Sequence[Request], *, max_running: int, on_step: Callable[[], None] | None = None,
    latency: Latencies | None = None,
) -> tuple[float, int]:
    """The same admission loop for the mutable baseline; system prefixes are prefix states it COWs from
    (it has no prefix cache). The clock starts before they are built, as the compiled engine builds
    its cached prefixes within its run, so the wall time holds every forward of the run. ``on_step``
    is called before each step, after that step's admissions; ``latency`` records each request's arrival,
    first token and end. Returns wall seconds and steps."""
    queue = sorted(workload, key=lambda r: r.arrival)
    t0 = time.perf_counter()
    cps = [engine.make_prefix(list(p)) for p in SYSTEM_PREFIXES]
    steps = 0
    while queue or engine.live:
        if latency is not None:
            latency.arrive_due(queue, steps)
        while queue and queue[0].arrival <= steps and engine.live < max_running:
            r = queue.pop(0)
            cp = next((c for c in cps if r.prompt.startswith(bytes(c.tokens)) and len(r.prompt) > len(c.tokens)), None)
            engine.admit(r.rid, list(r.prompt), max_new_tokens=r.max_new_tokens, prefix=cp, stop=list(r.sampling.stop_token_ids) or None)
        if on_step is not None:
            on_step()
        report = engine.step()
        if latency is not None:
            latency.step(report, time.perf_counter())
        steps += 1
    wall = time.perf_counter() - t0
    for cp in cps:
        engine.release_prefix(cp)
    return wall, steps


def warm_up(workload: Sequence[Request], target: HybridModel, draft: HybridModel | HeadModel | None, cfg: ServeConfig) -> None:
    """Serve the first ``WARM_UP_REQUESTS`` requests of ``workload``, unmeasured, through the compiled
    engine and (with a draft) both mutable baselines, at ``cfg.k``."""
    warm = list(workload)[:WARM_UP_REQUESTS]
    serve(make_engine(target, draft, cfg, None, cache=True, k=cfg.k, overlap=False), warm, max_running=cfg.max_running)
    if draft is not None:
        for fixed in (False, True):
            serve_mutable(make_mutable(target, draft, cfg, k=cfg.k, fixed=fixed), warm, max_running=cfg.max_running)


def run_mutable(workload: Sequence[Request], target: HybridModel, draft: HybridModel, cfg: ServeConfig, *, fixed: bool) -> MutableRun:
    """The same workload through the mutable baseline, pre-fix or with the upstream fix; model time
    measured by ``TimedModel``."""
    t, d = TimedModel(target), TimedModel(draft)
    engine = make_mutable(t, d, cfg, k=cfg.k, fixed=fixed)
    wall, steps = serve_mutable(engine, workload, max_running=cfg.max_running)
    generated = sum(len(v) for v in engine.outputs.values())
    model_s = t.seconds + d.seconds
    return MutableRun(
        acceptance_rate=engine.stats.acceptance_rate,
        mean_accepted_length=engine.stats.mean_accepted_length,
        init_ops_target=engine.t.runner.clears_executed + engine.t.runner.cows_executed,
        init_ops_draft=engine.d.runner.clears_executed + engine.d.runner.cows_executed,
        replays=engine.replays,
        stale_ops_run=engine.t.runner.stale_ops + engine.d.runner.stale_ops,
        wall_s=wall,
        tokens_per_s=generated / wall if wall else 0.0,
        steps=steps,
        model_s=model_s,
        host_ms_per_step=host_ms_per_step(wall, model_s, steps),
    )
