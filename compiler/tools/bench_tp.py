"""``batchc bench serve --tp N``: the compiled engine on one process (``tp = 1``, the whole models)
and on a tensor-parallel group of N (rank 0's shards, the other ranks started by the command), side
by side on the same cases (the built-in workload at k = 0 and k = 2, or the sweep's), in one run.

Every engine first serves the case's first requests unmeasured; then the runs alternate (tp = 1,
tp = N, then again) ``repeats`` times, and each (case, tp) reports the median of its repeats. Per
tensor-parallel run, rank 0's time per step in the plan broadcasts (``TPGroup.message_s``: the
message is out when every worker holds it) and in the two agreements of each plan (which include
waiting for the slowest rank to reach them). After the runs, the broadcast alone: a payload of the
mean plan message's size sent 500 times as a ping the workers only receive, with the workers idle.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import attrs

from backend.hybrid.model import HybridModel
from backend.tp.serve import TPLeader
from compiler.offline import make_engine, serve
from compiler.tools.bench_serve import WARM_REQUESTS, BenchCase


@attrs.frozen(kw_only=True)
class TPRun:
    workload: str
    k: int
    tp: int
    tokens: int
    steps: int
    wall_s: float
    message_s: float
    agree_s: float
    plans: int
    plan_bytes: int
    outputs: dict[int, tuple[int, ...]]
    ledgers_ok: bool
    """Every rank consumed the same ops and drained its ledger (always true at tp = 1)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


@attrs.frozen(kw_only=True)
class TPRow:
    workload: str
    k: int
    tp: int
    running: int
    tokens: int
    steps: int
    tokens_per_s: float
    vs_tp1: float | None
    message_ms_per_step: float | None
    agree_ms_per_step: float | None
    mean_plan_bytes: float | None
    repeats: int

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


def measure(case: BenchCase, tp: TPLeader | None, target: HybridModel, draft: HybridModel) -> TPRun:
    """Serve ``case`` once: on ``tp``'s group (``target``/``draft``: rank 0's shards) or, with
    None, in this process (the whole models)."""
    cfg = case.cfg

    def counters() -> tuple[float, float, int, int]:
        return (tp.group.message_s, tp.group.agree_s, tp.plans, tp.plan_bytes) if tp is not None else (0.0, 0.0, 0, 0)

    with make_engine(target, draft, cfg, None, cache=True, k=case.k, tp=tp) as drv:
        serve(drv, case.requests[:WARM_REQUESTS], max_running=cfg.max_running)
        drv.drop_cache()
        drv.outputs.clear()
        before = counters()
        wall, kinds = serve(drv, case.requests, max_running=cfg.max_running)
        after = counters()
        drv.drop_cache()
    m, a, n, b = (x - y for x, y in zip(after, before, strict=True))
    ledgers = drv.closing_ledgers
    return TPRun(workload=case.workload, k=case.k, tp=tp.world if tp is not None else 1, tokens=sum(map(len, drv.outputs.values())),
                 steps=sum(kinds.values()), wall_s=wall, message_s=m, agree_s=a, plans=int(n), plan_bytes=int(b),
                 outputs={int(r): tuple(o) for r, o in drv.outputs.items()},
                 ledgers_ok=ledgers is None or (ledgers.equal and ledgers.drained))


def broadcast_us(tp: TPLeader, size: int, count: int = 500) -> float:
    """Mean microseconds to broadcast a ``size``-byte payload to idle workers (``count`` times)."""
    t0 = time.perf_counter()
    for _ in range(count):
        tp.ping(bytes(size))
    return (time.perf_counter() - t0) / count * 1e6


def run_tp_bench(
    tp: TPLeader, models: tuple[HybridModel, HybridModel], shards: tuple[HybridModel, HybridModel], cases: Sequence[BenchCase], *,
    repeats: int, on_run: Callable[[int, int], None] | None = None,
) -> tuple[list[TPRow], float, float, list[str]]:
    """Every case at tp = 1 (``models``) and on ``tp`` (``shards``), alternating, ``repeats`` times;
    returns the rows (medians), the broadcast alone in microseconds per plan message, the mean
    plan message size it was measured at, and what went wrong: a group run whose tokens differ
    from the one-process run's, or whose ranks' ledgers differ or are not drained."""
    runs: list[TPRun] = []
    total = repeats * len(cases) * 2
    for _ in range(repeats):
        for case in cases:
            for leader, (t, d) in ((None, models), (tp, shards)):
                if on_run is not None:
                    on_run(len(runs), total)
                runs.append(measure(case, leader, t, d))
    problems = [
        f"k={g.k} ({g.workload}): " + ("the group generated other tokens than one process" if g.outputs != one.outputs
                                       else "the ranks' ledgers differ or are not drained")
        for one, g in zip(runs[0::2], runs[1::2], strict=True) if g.outputs != one.outputs or not g.ledgers_ok
    ]
    sent = [r for r in runs if r.tp > 1]
    mean_bytes = sum(r.plan_bytes for r in sent) / max(1, sum(r.plans for r in sent))
    alone = broadcast_us(tp, round(mean_bytes))
    rows: list[TPRow] = []
    for case in cases:
        base: float | None = None
        for world in (1, tp.world):
            mine = [r for r in runs if r.k == case.k and r.workload == case.workload and r.tp == world]
            tps = statistics.median(r.tokens_per_s for r in mine)
            steps = statistics.median(r.steps for r in mine)
            if world == 1:
                base = tps
            rows.append(TPRow(
                workload=case.workload, k=case.k, tp=world, running=case.cfg.max_running, tokens=mine[0].tokens, steps=int(steps),
                tokens_per_s=tps, vs_tp1=tps / base if base else None,
                message_ms_per_step=statistics.median(r.message_s / r.steps * 1e3 for r in mine) if world > 1 else None,
                agree_ms_per_step=statistics.median(r.agree_s / r.steps * 1e3 for r in mine) if world > 1 else None,
                mean_plan_bytes=sum(r.plan_bytes for r in mine) / max(1, sum(r.plans for r in mine)) if world > 1 else None,
                repeats=len(mine),
            ))
    return rows, alone, mean_bytes, problems
