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
from compiler.serve.latency import Latencies
from compiler.serve.summary import host_ms_per_step
from compiler.tools.compare_mutable import make_mutable, serve_mutable, warm_up
from compiler.tools.timed import TimedModel
from compiler.workload import ARRIVALS, SNIPPETS, SWEEP_NEW_TOKENS, SYSTEM_PREFIXES
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
    arrivals: str
    """The built-in workload's arrival pattern (``"bursts"`` or ``"trickle"``; the sweep: ``"together"``)."""
    k: int
    cfg: ServeConfig
    requests: tuple[Request, ...]


def builtin_cases(
    *, requests: int, max_new_tokens: int, ks: Sequence[int] = KS, arrivals: Sequence[str] = ARRIVALS, cfg: ServeConfig | None = None,
) -> list[BenchCase]:
    """The built-in workload (shared prefixes, chunked prompts) for each arrival pattern at each k,
    with ``batchc run``'s default configuration (``cfg``: another one, its k replaced)."""
    base = cfg if cfg is not None else ServeConfig()
    cases = []
    for pattern in arrivals:
        workload = tuple(builtin_workload(num_requests=requests, max_new_tokens=max_new_tokens, arrivals=pattern))
        cases += [BenchCase(workload="builtin", arrivals=pattern, k=k, cfg=attrs.evolve(base, k=k), requests=workload) for k in ks]
    return cases


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
            cases.append(BenchCase(workload="sweep", arrivals="together", k=k, cfg=cfg, requests=workload))
    return cases


@attrs.frozen(kw_only=True)
class ServeRun:
    """One measured run of one engine on one case."""

    workload: str
    arrivals: str
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
    max_running: int
    """The case's ``max_running`` (what rows are grouped and compared by; ``running`` is what one run reached)."""
    ttft_ms: tuple[float, ...] = ()
    """Time to first token of every request (``compiler.serve.latency``)."""
    tpot_ms: tuple[float, ...] = ()
    """Time per output token after the first, of every request with two or more."""

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
    latency = Latencies()
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
            wall, kinds = serve(drv, case.requests, max_running=cfg.max_running, on_step=sample, latency=latency)
            model_s = drv.busy_seconds(start, time.perf_counter()) if overlap else target.seconds + draft.seconds
            steps, outputs = sum(kinds.values()), drv.outputs
    elif engine in ("mutable", "mutable-fixed"):
        if overlap:
            raise ValueError("only the compiled engine runs with overlap")
        eng = make_mutable(target, draft, cfg, k=case.k, fixed=engine == "mutable-fixed")

        def sample() -> None:
            nonlocal peak
            peak = max(peak, eng.live)

        wall, steps = serve_mutable(eng, case.requests, max_running=cfg.max_running, on_step=sample, latency=latency)
        outputs = eng.outputs
        model_s = target.seconds + draft.seconds
    else:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return ServeRun(
        workload=case.workload, arrivals=case.arrivals, k=case.k, engine=engine, overlap=overlap, running=peak,
        tokens=sum(map(len, outputs.values())), steps=steps, wall_s=wall, model_s=model_s, repeat=repeat, max_running=cfg.max_running,
        ttft_ms=tuple(latency.ttft_ms()), tpot_ms=tuple(latency.tpot_ms(outputs)),
    )


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values`` by linear interpolation, or None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@attrs.frozen(kw_only=True)
class ServeRow:
    """The median of the repeats of one (workload, arrivals, k, engine, max_running), its spread and its
    ratios, and the latencies of every request of every repeat."""

    workload: str
    arrivals: str
    k: int
    engine: str
    overlap: bool
    """Whether the engine ran its executors in their own processes (``Engine(overlap=True)``)."""
    max_running: int
    """The case's ``max_running``."""
    running: int
    """Most requests live at once in any of its runs."""
    tokens: int
    steps: int
    tokens_per_s: float
    tokens_per_s_min: float
    tokens_per_s_max: float
    host_ms_per_step: float
    wall_s: float
    model_s: float
    vs_mutable_fixed: float | None
    """Median tokens/s over the ``mutable-fixed`` row's at the same workload, arrivals, k and running."""
    vs_k0: float | None
    """Median tokens/s over the same engine's at k = 0 on the same workload, arrivals and running."""
    runs: tuple[ServeRun, ...]

    @property
    def repeats(self) -> int:
        return len(self.runs)

    def latency(self, which: str, q: float) -> float | None:
        """The ``q``-quantile of ``"ttft"`` or ``"tpot"`` (ms) over every request of every repeat."""
        return percentile([x for r in self.runs for x in (r.ttft_ms if which == "ttft" else r.tpot_ms)], q)

    def to_json(self) -> dict[str, object]:
        return {
            "workload": self.workload, "arrivals": self.arrivals, "k": self.k, "engine": self.engine, "overlap": self.overlap,
            "max_running": self.max_running, "running": self.running, "tokens_per_s": self.tokens_per_s, "tokens_per_s_min": self.tokens_per_s_min,
            "tokens_per_s_max": self.tokens_per_s_max, "host_ms_per_step": self.host_ms_per_step, "steps": self.steps,
            "tokens": self.tokens, "wall_s": self.wall_s, "model_s": self.model_s,
            "tokens_per_s_vs_mutable_fixed": self.vs_mutable_fixed, "tokens_per_s_vs_k0": self.vs_k0,
            "ttft_ms_p50": self.latency("ttft", 0.5), "ttft_ms_p90": self.latency("ttft", 0.9),
            "tpot_ms_p50": self.latency("tpot", 0.5), "tpot_ms_p90": self.latency("tpot", 0.9),
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
    """One row per (workload, arrivals, k, engine, overlap, max_running): the medians of its runs and
    their range, in the order the keys first appear."""
    groups: dict[tuple[str, str, int, str, bool, int], list[ServeRun]] = {}
    for r in runs:
        groups.setdefault((r.workload, r.arrivals, r.k, r.engine, r.overlap, r.max_running), []).append(r)
    tps = {key: statistics.median(r.tokens_per_s for r in g) for key, g in groups.items()}
    rows = []
    for (workload, arrivals, k, engine, overlap, running), g in groups.items():
        mine = tps[(workload, arrivals, k, engine, overlap, running)]
        rows.append(ServeRow(
            workload=workload, arrivals=arrivals, k=k, engine=engine, overlap=overlap, max_running=running,
            running=max(r.running for r in g),
            tokens=statistics.median_low(r.tokens for r in g), steps=statistics.median_low(r.steps for r in g),
            tokens_per_s=mine, tokens_per_s_min=min(r.tokens_per_s for r in g), tokens_per_s_max=max(r.tokens_per_s for r in g),
            host_ms_per_step=statistics.median(r.host_ms_per_step for r in g),
            wall_s=statistics.median(r.wall_s for r in g), model_s=statistics.median(r.model_s for r in g),
            vs_mutable_fixed=_ratio(mine, tps.get((workload, arrivals, k, "mutable-fixed", False, running))),
            vs_k0=_ratio(mine, tps.get((workload, arrivals, 0, engine, overlap, running))), runs=tuple(g),
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
