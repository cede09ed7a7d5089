"""``batchc bench serve``: a serving workload at k = 0 and k = 2 through the compiled engine and the
mutable baseline, pre-fix (``mutable``: it replays stale init ops) and with the upstream fix
(``mutable-fixed``), on the same models, in one run.

Per run: generated tokens per second, steps, and host time per step: wall time minus the time
spent inside the models' forwards (``TimedModel``), divided by the steps. The host time is what
batchc adds or removes; the model time is much the same work on every side (the baseline has no
prefix cache: it builds the system prefixes' states at the start of its run and COWs from them, and
prefills the prompts' tails whole, in one forward).

Every engine first serves a couple of requests of every case unmeasured (``warm_up``), so one-time
costs fall on no measured run. With ``overlap`` the compiled engine is also measured with each
executor in its own process (rows with ``overlap`` true): each such run builds its engine, waits for
the processes to start and warms them on the case's first requests before the clock starts; its
model time is the time during which an executor process ran a plan. Then the runs go round the engines (compiled, mutable,
mutable-fixed, then again) ``repeats`` times, so drifting machine load falls on all of them alike,
and each (workload, k, engine, running) reports the median of its repeats, with its tokens/s over
the fixed baseline's and over its own at k = 0 (ratios of the medians).

Workloads: the built-in one (``builtin_cases``), or the running-batch sweep (``sweep_cases``): B
short requests arriving together at step 0, for each B, with the engines sized for B.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

import attrs

from backend.hybrid.model import HybridModel
from compiler.serve import Request, ServeConfig, builtin_workload, make_engine, serve
from compiler.serve.summary import host_ms_per_step
from compiler.tools.compare_mutable import make_mutable, serve_mutable, warm_up
from compiler.tools.timed import TimedModel
from compiler.workload import SNIPPETS, SWEEP_NEW_TOKENS, SYSTEM_PREFIXES
from ir.ids import RequestId

ENGINES = ("compiled", "mutable", "mutable-fixed")
"""The engines of every case, in the order each repeat runs them."""
KS = (0, 2)
WARM_REQUESTS = 2
"""Requests of its case an overlapped engine serves, unmeasured, before its measured run."""


@attrs.frozen(kw_only=True)
class BenchCase:
    """One workload at one k, and the configuration every engine is sized by."""

    workload: str
    """``"builtin"`` or ``"sweep"``."""
    k: int
    cfg: ServeConfig
    requests: tuple[Request, ...]


def builtin_cases(*, requests: int, max_new_tokens: int, ks: Sequence[int] = KS) -> list[BenchCase]:
    """The built-in workload (bursts, shared prefixes, chunked prompts) at each k, with
    ``batchc run``'s default configuration."""
    workload = tuple(builtin_workload(num_requests=requests, max_new_tokens=max_new_tokens))
    return [BenchCase(workload="builtin", k=k, cfg=ServeConfig(k=k), requests=workload) for k in ks]


def sweep_workload(running: int, *, new_tokens: int = SWEEP_NEW_TOKENS, seed: int = 0) -> list[Request]:
    """``running`` requests arriving together at step 0, each asking for exactly ``new_tokens``:
    one bundled snippet, two thirds of them behind one of the shared system prefixes."""
    rng = random.Random(seed)
    out = []
    for i in range(running):
        prefix = rng.choice((-1, 0, 1))
        prompt = (SYSTEM_PREFIXES[prefix] if prefix >= 0 else b"") + rng.choice(SNIPPETS)
        out.append(Request(rid=RequestId(i), prompt=prompt, max_new_tokens=new_tokens, arrival=0))
    return out


def sweep_cases(sizes: Sequence[int], *, ks: Sequence[int] = KS, new_tokens: int = SWEEP_NEW_TOKENS) -> list[BenchCase]:
    """The sweep workload for each running batch ``B`` in ``sizes`` at each k. Every engine is sized
    for ``B`` requests at once (``max_running = B``, the context limit cut to what the short prompts
    need, so the KV caches hold ``B`` contexts), and the compiled engine's prefill budget is ``B``
    chunks, so the whole batch prefills in its first steps as the baseline's does in one forward."""
    base = ServeConfig()
    cases = []
    for b in sizes:
        workload = tuple(sweep_workload(b, new_tokens=new_tokens))
        need = max(len(r.prompt) for r in workload) + new_tokens + max(ks) + 1
        max_len = -(-need // base.cache_block) * base.cache_block
        for k in ks:
            cfg = ServeConfig(k=k, max_running=b, token_budget=b * base.chunk_size, max_len=max_len, lossless_sample=0)
            cases.append(BenchCase(workload="sweep", k=k, cfg=cfg, requests=workload))
    return cases


@attrs.frozen(kw_only=True)
class ServeRun:
    """One measured run of one engine on one case."""

    workload: str
    k: int
    engine: str
    overlap: bool
    running: int
    """Most requests live at once (admitted, not finished), sampled before every step."""
    tokens: int
    steps: int
    wall_s: float
    model_s: float
    repeat: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def host_ms_per_step(self) -> float:
        return host_ms_per_step(self.wall_s, self.model_s, self.steps)


def measure(case: BenchCase, engine: str, target: TimedModel, draft: TimedModel, *, repeat: int = 0, overlap: bool = False) -> ServeRun:
    """Serve ``case`` once on ``engine`` (one of ``ENGINES``), timing the models' forwards;
    ``overlap`` (compiled only): with its executors in their own processes."""
    cfg = case.cfg
    target.seconds = draft.seconds = 0.0
    peak = 0
    if engine == "compiled":
        with make_engine(target, draft, cfg, None, cache=True, k=case.k, overlap=overlap) as drv:
            if overlap:  # warm the processes themselves: an in-process warm-up does not reach them
                serve(drv, case.requests[:WARM_REQUESTS], max_running=cfg.max_running)
                drv.drop_cache()
                drv.outputs.clear()

            def sample() -> None:
                nonlocal peak
                peak = max(peak, drv.live)

            start = time.perf_counter()
            wall, kinds = serve(drv, case.requests, max_running=cfg.max_running, on_step=sample)
            model_s = drv.busy_seconds(start, time.perf_counter()) if overlap else target.seconds + draft.seconds
            steps, outputs = sum(kinds.values()), drv.outputs
    elif engine in ("mutable", "mutable-fixed"):
        if overlap:
            raise ValueError("only the compiled engine runs with overlap")
        eng = make_mutable(target, draft, cfg, k=case.k, fixed=engine == "mutable-fixed")

        def sample() -> None:
            nonlocal peak
            peak = max(peak, eng.live)

        wall, steps = serve_mutable(eng, case.requests, max_running=cfg.max_running, on_step=sample)
        outputs = eng.outputs
        model_s = target.seconds + draft.seconds
    else:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return ServeRun(
        workload=case.workload, k=case.k, engine=engine, overlap=overlap, running=peak, tokens=sum(map(len, outputs.values())),
        steps=steps, wall_s=wall, model_s=model_s, repeat=repeat,
    )


@attrs.frozen(kw_only=True)
class ServeRow:
    """The median of the repeats of one (workload, k, engine, running), and its ratios."""

    workload: str
    k: int
    engine: str
    overlap: bool
    """Whether the engine ran its executors in their own processes (``Engine(overlap=True)``)."""
    running: int
    tokens: int
    steps: int
    tokens_per_s: float
    host_ms_per_step: float
    wall_s: float
    model_s: float
    vs_mutable_fixed: float | None
    """Median tokens/s over the ``mutable-fixed`` row's at the same workload, k and running."""
    vs_k0: float | None
    """Median tokens/s over the same engine's at k = 0 on the same workload and running."""
    runs: tuple[ServeRun, ...]

    @property
    def repeats(self) -> int:
        return len(self.runs)

    def to_json(self) -> dict[str, object]:
        return {
            "workload": self.workload, "k": self.k, "engine": self.engine, "overlap": self.overlap, "running": self.running,
            "tokens_per_s": self.tokens_per_s, "host_ms_per_step": self.host_ms_per_step, "steps": self.steps,
            "tokens": self.tokens, "wall_s": self.wall_s, "model_s": self.model_s,
            "tokens_per_s_vs_mutable_fixed": self.vs_mutable_fixed, "tokens_per_s_vs_k0": self.vs_k0,
            "statistic": "median", "repeats": self.repeats,
            "runs": [
                {"repeat": r.repeat, "tokens_per_s": r.tokens_per_s, "host_ms_per_step": r.host_ms_per_step,
                 "wall_s": r.wall_s, "model_s": r.model_s, "steps": r.steps, "tokens": r.tokens}
                for r in self.runs
            ],
        }


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def summarise(runs: Sequence[ServeRun]) -> list[ServeRow]:
    """One row per (workload, k, engine, overlap, running): the medians of its runs, in the order the
    keys first appear."""
    groups: dict[tuple[str, int, str, bool, int], list[ServeRun]] = {}
    for r in runs:
        groups.setdefault((r.workload, r.k, r.engine, r.overlap, r.running), []).append(r)
    tps = {key: statistics.median(r.tokens_per_s for r in g) for key, g in groups.items()}
    rows = []
    for (workload, k, engine, overlap, running), g in groups.items():
        mine = tps[(workload, k, engine, overlap, running)]
        rows.append(ServeRow(
            workload=workload, k=k, engine=engine, overlap=overlap, running=running,
            tokens=statistics.median_low(r.tokens for r in g), steps=statistics.median_low(r.steps for r in g),
            tokens_per_s=mine, host_ms_per_step=statistics.median(r.host_ms_per_step for r in g),
            wall_s=statistics.median(r.wall_s for r in g), model_s=statistics.median(r.model_s for r in g),
            vs_mutable_fixed=_ratio(mine, tps.get((workload, k, "mutable-fixed", False, running))),
            vs_k0=_ratio(mine, tps.get((workload, 0, engine, overlap, running))), runs=tuple(g),
        ))
    return rows


def run_serve_bench(
    target: HybridModel,
    draft: HybridModel,
    cases: Sequence[BenchCase],
    *,
    repeats: int,
    engines: Sequence[str] = ENGINES,
    overlap: bool = False,
    on_run: Callable[[int, int, ServeRun | None], None] | None = None,
) -> list[ServeRow]:
    """Warm every engine up on every case, then serve every case on every engine ``repeats`` times,
    interleaved (each repeat runs every case's engines in turn; with ``overlap``, the compiled
    engine with overlap right after it), and summarise the medians. ``on_run(done, total, run)``
    reports progress (``run`` is None before the first)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    t, d = TimedModel(target), TimedModel(draft)
    for case in cases:
        warm_up(case.requests, t, d, case.cfg)
    kinds = [(e, o) for e in engines for o in ((False, True) if overlap and e == "compiled" else (False,))]
    total = repeats * len(cases) * len(kinds)
    if on_run is not None:
        on_run(0, total, None)
    runs = []
    for repeat in range(repeats):
        for case in cases:
            for engine, over in kinds:
                runs.append(measure(case, engine, t, d, repeat=repeat, overlap=over))
                if on_run is not None:
                    on_run(len(runs), total, runs[-1])
    return summarise(runs)
