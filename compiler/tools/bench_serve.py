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
the fixed baseline's and over its own at k = 0 (ratios of the medians), and those ratios repeat by
repeat (``ServeRow.paired_vs_mutable_fixed``, ``paired_vs_k0``): within one repeat the runs follow
one another, so their ratio cancels the machine's slower drift, and the spread of the paired
ratios says whether a difference stands out of the machine's noise.

Replay (``--replay``, ``measure(replay=True)``): every in-process run records what its models'
forwards returned (``compiler.tools.timed.Tape``), and the case is served once more with those
outputs handed back instead of computed, a few times (``REPLAY_MIN_TIMES``); the least host time
per step of those replays (``ServeRun.replayed_host_ms``) is the engine's own work alone, with none
of the cache misses a forward leaves behind it and none of the model's time. Each replay must ask
for the same forwards and serve the same tokens in the same steps (else ``ReplayDiverged``).

Workloads: the built-in one (``builtin_cases``), or the running-batch sweep (``sweep_cases``): B
short requests arriving together at step 0, for each B, with the engines sized for B.

Drafts: at k > 0 each case is served with each draft kind asked for (``--draft``): ``model``, a
separate draft model (the bundled one by default), and ``mtp``, a draft head
(``backend.hybrid.head``: the bundled target's trained one, or a head file), every engine with the
same draft (the mutable baselines run a head as upstream does: a draft extend after each target
prefill and after each verify, the pre-fix one replaying stale init ops on the head's pool); k = 0
runs no draft (``none``). Rows name their kind
(``draft``); ``vs k=0`` compares with the same engine's k = 0 row.

Targets: the bundled byte-level model by default; with ``Tokens`` (a Hugging Face checkpoint's
tokenizer, ``--model DIR``) the built-in prompts are served as its token ids, on the compiled
engine only (the baselines speak bytes).

Sampling: every case is greedy unless it is given a temperature > 0 (``--temperature``,
``--top-p``): then each workload is measured twice at each k, greedy and with every request sampled
(the same prompts, lengths and arrivals; each request's seed derived from the run's seed and its
request id, as ``batchc run`` does). The mutable baselines decode greedily only: a sampled case runs
on the compiled engine alone (its rows compare with the compiled greedy row of the same workload, k
and running limit: ``vs_greedy``), in the same warm-up and the same interleaved repeats as the
greedy cases. Acceptance at k > 0 is accepted proposals over proposed ones in the measured runs
(the engine's ``SpecStats``, warm-up excluded). The sampler's time is the wall time of the
in-process executor's sampler calls (``compiler.tools.timed.timing_sampler``), reported over the
run's model time; it is not known for the baselines (they pick the argmax inside their own loop)
nor with overlap (the executors are other processes).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

import attrs

from backend.hybrid.head import HeadModel
from backend.hybrid.model import HybridModel
from compiler.engine import SpecStats
from compiler.offline import Request, ServeConfig, builtin_workload, make_engine, serve
from compiler.offline.latency import Latencies
from compiler.offline.load import sampling_params, tokenize_workload
from compiler.offline.summary import host_ms_per_step
from compiler.offline.tokenizer import Tokenizer
from compiler.tools.compare_mutable import WARM_UP_REQUESTS, make_mutable, serve_mutable, warm_up
from compiler.tools.timed import ReplayDiverged, SamplerClock, Tape, TimedHead, TimedModel, recording, replaying, timing_sampler
from compiler.workload import ARRIVALS, SNIPPETS, SWEEP_NEW_TOKENS, SYSTEM_PREFIXES
from ir.columns import int_problem
from ir.ids import RequestId

ENGINES = ("compiled", "mutable", "mutable-fixed")
"""The engines of every case, in the order each repeat runs them."""
KS = (0, 2)
DRAFT_KINDS = ("model", "mtp")
"""The draft kinds a case at k > 0 can be served with (k = 0: ``"none"``)."""
WARM_REQUESTS = 2
"""Requests of its case an overlapped engine serves, unmeasured, before its measured run."""
GREEDY_LABEL = "greedy"


@attrs.frozen
class Sampling:
    """A case's sampling settings: every request of a sampled case has this temperature and top_p
    (the greedy case: temperature 0)."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def label(self) -> str:
        """``"greedy"`` or ``"t=1 p=0.9"`` (``p`` left out at 1)."""
        if not self.sampled:
            return GREEDY_LABEL
        return f"t={self.temperature:g}" + (f" p={self.top_p:g}" if self.top_p < 1 else "")

    def of(self, r: Request) -> Request:
        """``r`` sampled with these settings (its seed left to the engine: derived from the run's seed
        and ``r``'s id); ``r`` itself when greedy."""
        if not self.sampled:
            return r
        given = {"temperature": self.temperature, "top_p": self.top_p}
        return attrs.evolve(r, sampling=sampling_params({}, given, max_new_tokens=r.max_new_tokens))


GREEDY_SAMPLING = Sampling()


def samplings(sampled: Sampling | None) -> tuple[Sampling, ...]:
    """The settings every workload is measured with: greedy, then ``sampled`` if it samples."""
    return (GREEDY_SAMPLING, sampled) if sampled is not None and sampled.sampled else (GREEDY_SAMPLING,)


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
    sampling: Sampling = GREEDY_SAMPLING
    """How every request of the case chooses its tokens (``requests`` carry it)."""
    draft: str = "model"
    """``"none"`` (k = 0), ``"model"`` (the separate draft) or ``"mtp"`` (the draft head)."""
    baselines: bool = True
    """Whether the mutable baselines can serve its requests: they speak bytes, so a target with a
    tokenizer of its own (a Hugging Face checkpoint: ``requests`` carry its token ids) is served by
    the compiled engine only."""

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines that can serve the case: all of them greedy with a separate draft (or none)
        on byte prompts, the compiled one sampled, with a head or on a tokenizer's ids."""
        return ("compiled",) if self.sampling.sampled or not self.baselines else ENGINES


def _drafts(k: int, drafts: Sequence[str]) -> tuple[str, ...]:
    """The draft kinds a case at ``k`` is served with."""
    return ("none",) if k == 0 else tuple(drafts)


@attrs.frozen
class Tokens:
    """A target's own tokenizer (a Hugging Face checkpoint's) and its model's vocabulary size: the
    built-in prompts (UTF-8 text) are served as its token ids."""

    tokenizer: Tokenizer
    vocab: int


def _tokenized(workload: list[Request], tokens: Tokens | None) -> list[Request]:
    """``workload`` on ``tokens``' tokenizer (``tokenize_workload``), or as it is (byte prompts)."""
    return workload if tokens is None else tokenize_workload(workload, tokens.tokenizer, vocab=tokens.vocab)


def builtin_cases(
    *, requests: int, max_new_tokens: int, ks: Sequence[int] = KS, arrivals: Sequence[str] = ARRIVALS, cfg: ServeConfig | None = None,
    sampled: Sampling | None = None, drafts: Sequence[str] = ("model",), tokens: Tokens | None = None,
) -> list[BenchCase]:
    """The built-in workload (shared prefixes, chunked prompts) for each arrival pattern at each k,
    with ``batchc run``'s default configuration (``cfg``: another one, its k replaced); with a
    ``sampled`` temperature > 0, each pattern again at each k with every request sampled; with
    ``tokens``, the prompts as that tokenizer's ids (the compiled engine only)."""
    base = cfg if cfg is not None else ServeConfig()
    cases = []
    for pattern in arrivals:
        workload = _tokenized(builtin_workload(num_requests=requests, max_new_tokens=max_new_tokens, arrivals=pattern, seed=base.seed), tokens)
        cases += [BenchCase(workload="builtin", arrivals=pattern, k=k, cfg=attrs.evolve(base, k=k), requests=tuple(map(s.of, workload)),
                            sampling=s, draft=d, baselines=tokens is None) for s in samplings(sampled) for k in ks for d in _drafts(k, drafts)]
    return cases


def sweep_workload(running: int, *, new_tokens: int = SWEEP_NEW_TOKENS, seed: int = 0, prompt_len: int | None = None) -> list[Request]:
    """``running`` requests arriving together at step 0, each asking for exactly ``new_tokens``:
    one bundled snippet, two thirds of them behind one of the shared system prefixes. With
    ``prompt_len``, every prompt is exactly that many bytes: more snippets appended, the last one
    cut (the default prompts' draws come first, so they stay what they are without it)."""
    if prompt_len is not None and (int_problem(prompt_len) is not None or prompt_len < 1):
        raise ValueError(f"prompt_len must be a positive int, got {prompt_len!r}")
    rng = random.Random(seed)
    out = []
    for i in range(running):
        prefix = rng.choice((-1, 0, 1))
        prompt = (SYSTEM_PREFIXES[prefix] if prefix >= 0 else b"") + rng.choice(SNIPPETS)
        if prompt_len is not None:
            more = random.Random(seed * 1_000_003 + i)  # (its own stream: the default draws stay as they are)
            while len(prompt) < prompt_len:
                prompt += b"\n" + more.choice(SNIPPETS)
            prompt = prompt[:prompt_len]
        out.append(Request(rid=RequestId(i), prompt=prompt, max_new_tokens=new_tokens, arrival=0))
    return out


def sweep_cases(sizes: Sequence[int], *, ks: Sequence[int] = KS, new_tokens: int = SWEEP_NEW_TOKENS,
                sampled: Sampling | None = None, drafts: Sequence[str] = ("model",), tokens: Tokens | None = None,
                prompt_len: int | None = None) -> list[BenchCase]:
    """The sweep workload for each running batch ``B`` in ``sizes`` at each k (with a ``sampled``
    temperature > 0, again sampled; with ``tokens``, as that tokenizer's ids; with ``prompt_len``,
    prompts of that many bytes: ``sweep_workload``). Every engine is sized
    for ``B`` requests at once (``max_running = B``, the context limit cut to what the prompts
    need, so the KV caches hold ``B`` contexts), and the compiled engine's prefill budget is ``B``
    chunks, so the whole batch prefills in its first steps as the baseline's does in one forward."""
    base = ServeConfig()
    cases = []
    for b in sizes:
        workload = tuple(_tokenized(sweep_workload(b, new_tokens=new_tokens, prompt_len=prompt_len), tokens))
        need = max(len(r.token_ids) for r in workload) + new_tokens + max(ks) + 1
        max_len = -(-need // base.cache_block) * base.cache_block
        for s in samplings(sampled):
            for k in ks:
                cfg = ServeConfig(k=k, max_running=b, token_budget=b * base.chunk_size, max_len=max_len, lossless_sample=0)
                cases += [BenchCase(workload="sweep", arrivals="together", k=k, cfg=cfg, requests=tuple(map(s.of, workload)), sampling=s,
                                    draft=d, baselines=tokens is None) for d in _drafts(k, drafts)]
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
    """Time to first token of every request (``compiler.offline.latency``)."""
    tpot_ms: tuple[float, ...] = ()
    """Time per output token after the first, of every request with two or more."""
    sampling: Sampling = GREEDY_SAMPLING
    proposed: int = 0
    """Draft tokens proposed in the run (0 at k = 0)."""
    accepted: int = 0
    """Of them, accepted by the target."""
    sampler_s: float | None = None
    """Wall time of the run's sampler calls; ``None`` where not measured (the baselines, overlap)."""
    draft: str = "model"
    """The case's draft kind (``BenchCase.draft``)."""
    iterations: int = 0
    """Speculative iterations' rows (one per running request per iteration) in the run."""
    decode_ms: tuple[float, ...] = ()
    """Wall time of each decode step (k = 0: one token per running request), admissions included."""
    spec_ms: tuple[float, ...] = ()
    """Wall time of each speculative step (one iteration: proposal, verify, commits), admissions included."""
    outputs: dict[RequestId, tuple[int, ...]] = attrs.field(factory=dict, repr=False)
    """Every request's output tokens (what a replay of the run must serve again)."""
    replayed_host_ms: float | None = None
    """Host time per step of the same case served again with the run's forwards replayed
    (``measure(replay=True)``; the least over ``replays`` replays): the engine's own work, with the
    caches the forwards would evict kept warm; ``None`` where not measured."""
    replays: int = 0
    """How many times the run was replayed (0: not replayed)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def sampler_share(self) -> float | None:
        """The sampler's time over the time inside the models' forwards."""
        return self.sampler_s / self.model_s if self.sampler_s is not None and self.model_s else None

    @property
    def host_ms_per_step(self) -> float:
        return host_ms_per_step(self.wall_s, self.model_s, self.steps)


REPLAY_MIN_TIMES = 3
REPLAY_MIN_SECONDS = 0.5
REPLAY_MAX_TIMES = 100
"""``measure(replay=True)`` replays a run at least ``REPLAY_MIN_TIMES`` times and until the replays
have taken ``REPLAY_MIN_SECONDS`` of wall time (at most ``REPLAY_MAX_TIMES``), and keeps the least
host time per step: a replay is host work alone, a tenth of a second or less on the default
workload, which one hiccup of a shared machine moves by tens of percent, and noise only ever adds
time."""


def measure(
    case: BenchCase, engine: str, target: TimedModel, draft: TimedModel | None, *, repeat: int = 0, overlap: bool = False,
    sampler: SamplerClock | None = None, head: TimedHead | None = None, replay: bool = False,
) -> ServeRun:
    """Serve ``case`` once on ``engine`` (one of ``ENGINES``; a sampled case: the compiled one only),
    timing the models' forwards and, with ``sampler`` (the clock of an open ``timing_sampler``), the
    compiled engine's sampler calls; ``overlap`` (compiled only): with its executors in their own
    processes (the sampler is not timed there). ``replay`` (not with ``overlap``): the run records
    its forwards (``compiler.tools.timed.Tape``), then the case is served again with them replayed,
    for ``ServeRun.replayed_host_ms`` (the least of several replays: ``REPLAY_MIN_TIMES``);
    ``ReplayDiverged`` if a replay's forwards or outputs are not the recorded run's."""
    if engine not in case.engines:
        raise ValueError(f"engine must be one of {case.engines} for a {case.sampling.label} case, got {engine!r}")
    if case.draft == "mtp" and head is None:
        raise ValueError("a case with the draft head (draft 'mtp') needs the head")
    if draft is None and (engine != "compiled" or (case.k and case.draft == "model")):
        raise ValueError(f"a case of draft kind {case.draft!r} at k = {case.k} on engine {engine!r} needs the separate draft")
    if replay and overlap:
        raise ValueError("a run with overlap cannot be replayed: its forwards run in the executor processes")
    if engine != "compiled" and overlap:
        raise ValueError("only the compiled engine runs with overlap")
    models = (target, draft, head)
    if not replay:
        return _serve_once(case, engine, target, draft, head, repeat=repeat, overlap=overlap, sampler=sampler)
    tape = Tape()
    with recording(models, tape):
        run = _serve_once(case, engine, target, draft, head, repeat=repeat, overlap=False, sampler=sampler)
    host: list[float] = []
    spent = 0.0
    while len(host) < REPLAY_MIN_TIMES or (spent < REPLAY_MIN_SECONDS and len(host) < REPLAY_MAX_TIMES):
        with replaying(models, tape):
            again = _serve_once(case, engine, target, draft, head, repeat=repeat, overlap=False, sampler=None)
        tape.check_done()
        if again.outputs != run.outputs or again.steps != run.steps:
            raise ReplayDiverged(f"{engine} served other tokens or steps with its forwards replayed ({again.steps} steps, {run.steps} recorded)")
        host.append(again.host_ms_per_step)
        spent += again.wall_s
    return attrs.evolve(run, replayed_host_ms=min(host), replays=len(host))


def _serve_once(
    case: BenchCase, engine: str, target: TimedModel, draft: TimedModel | None, head: TimedHead | None, *, repeat: int, overlap: bool,
    sampler: SamplerClock | None,
) -> ServeRun:
    """``measure`` without its replay."""
    cfg = case.cfg
    drafting: TimedModel | TimedHead | None = head if case.draft == "mtp" and head is not None else draft
    target.seconds = 0.0
    for timed_draft in (draft, head):
        if timed_draft is not None:
            timed_draft.seconds = 0.0
    peak = 0
    latency = Latencies()
    stats: SpecStats
    before: tuple[int, int, int]
    sampler_s: float | None = None
    if engine == "compiled":
        with make_engine(target, drafting, cfg, None, cache=True, k=case.k, overlap=overlap) as drv:
            if overlap:  # warm the processes themselves: an in-process warm-up does not reach them
                serve(drv, case.requests[:WARM_REQUESTS], max_running=cfg.max_running)
                drv.drop_cache()
                drv.outputs.clear()

            def sample() -> None:
                nonlocal peak
                peak = max(peak, drv.live)

            stats = drv.stats
            before = (stats.proposed, stats.accepted, stats.row_iterations)
            if sampler is not None:
                sampler.seconds = 0.0
            start = time.perf_counter()
            wall, kinds = serve(drv, case.requests, max_running=cfg.max_running, on_step=sample, latency=latency)
            model_s = drv.busy_seconds(start, time.perf_counter()) if overlap else target.seconds + (drafting.seconds if drafting else 0.0)
            steps, outputs = sum(kinds.values()), drv.outputs
            if sampler is not None and not overlap:
                sampler_s = sampler.seconds
    else:
        assert drafting is not None  # (checked by ``measure``)
        eng = make_mutable(target, drafting, cfg, k=case.k, fixed=engine == "mutable-fixed")

        def sample() -> None:
            nonlocal peak
            peak = max(peak, eng.live)

        stats = eng.stats
        before = (stats.proposed, stats.accepted, stats.row_iterations)
        wall, steps = serve_mutable(eng, case.requests, max_running=cfg.max_running, on_step=sample, latency=latency)
        outputs = eng.outputs
        model_s = target.seconds + drafting.seconds
    return ServeRun(
        workload=case.workload, arrivals=case.arrivals, k=case.k, engine=engine, overlap=overlap, running=peak,
        tokens=sum(map(len, outputs.values())), steps=steps, wall_s=wall, model_s=model_s, repeat=repeat, max_running=cfg.max_running,
        ttft_ms=tuple(latency.ttft_ms()), tpot_ms=tuple(latency.tpot_ms(outputs)), sampling=case.sampling,
        proposed=stats.proposed - before[0], accepted=stats.accepted - before[1], sampler_s=sampler_s, draft=case.draft,
        iterations=stats.row_iterations - before[2], decode_ms=tuple(latency.step_ms.get("decode", ())),
        spec_ms=tuple(latency.step_ms.get("spec", ())), outputs={rid: tuple(out) for rid, out in outputs.items()},
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
    """The median of the repeats of one (workload, arrivals, k, engine, max_running, sampling), its
    spread and its ratios, its acceptance and sampler share, and the latencies of every request of
    every repeat."""

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
    """Median tokens/s over the same engine's at k = 0 on the same workload, arrivals, running and sampling."""
    runs: tuple[ServeRun, ...]
    sampling: Sampling = GREEDY_SAMPLING
    draft: str = "model"
    """``"none"`` (k = 0), ``"model"`` or ``"mtp"``."""
    vs_greedy: float | None = None
    """A sampled row: its median tokens/s over the greedy row's of the same engine, workload,
    arrivals, k and running (``None`` for a greedy row)."""
    iteration_decodes: float | None = None
    """At k > 0: ``step_ms("spec")`` over the same engine's ``step_ms("decode")`` at k = 0 (same
    workload, arrivals, running, sampling and overlap): what one speculative iteration costs in
    decode steps as served, host time included (``None`` at k = 0 or without both)."""
    paired_vs_mutable_fixed: tuple[float, ...] = ()
    """Per repeat, its run's tokens/s over the ``mutable-fixed`` run's of the same repeat (same
    workload, arrivals, k, running, sampling and draft), in repeat order; empty without them. The
    runs of a repeat are interleaved, so a ratio within a repeat cancels the machine's slower drift
    that a ratio of medians taken over the whole run does not."""
    paired_vs_k0: tuple[float, ...] = ()
    """Per repeat, its run's tokens/s over the same engine's k = 0 run of the same repeat."""

    @staticmethod
    def _spread(ratios: tuple[float, ...]) -> tuple[float, float, float] | None:
        return (statistics.median(ratios), min(ratios), max(ratios)) if ratios else None

    @property
    def paired_fixed(self) -> tuple[float, float, float] | None:
        """The median, lowest and highest of ``paired_vs_mutable_fixed`` (``None`` when empty)."""
        return self._spread(self.paired_vs_mutable_fixed)

    @property
    def paired_k0(self) -> tuple[float, float, float] | None:
        """The median, lowest and highest of ``paired_vs_k0`` (``None`` when empty)."""
        return self._spread(self.paired_vs_k0)

    def step_ms(self, kind: str) -> float | None:
        """The median wall time (ms) of its ``"decode"`` or ``"spec"`` steps over all its runs."""
        times = [x for r in self.runs for x in (r.decode_ms if kind == "decode" else r.spec_ms)]
        return statistics.median(times) if times else None

    @property
    def acceptance(self) -> float | None:
        """Accepted proposals over proposed ones in all its runs; ``None`` at k = 0."""
        proposed = sum(r.proposed for r in self.runs)
        return sum(r.accepted for r in self.runs) / proposed if self.k and proposed else None

    @property
    def accepted_length(self) -> float | None:
        """Tokens each row emitted per speculative iteration (accepted proposals + the bonus), over
        all its runs; ``None`` at k = 0."""
        rows = sum(r.iterations for r in self.runs)
        return (sum(r.accepted for r in self.runs) + rows) / rows if self.k and rows else None

    @property
    def sampler_share(self) -> float | None:
        """The median over its runs of the sampler's time over the model time, where it was measured."""
        shares = [r.sampler_share for r in self.runs]
        known = [x for x in shares if x is not None]
        return statistics.median(known) if known and len(known) == len(shares) else None

    @property
    def replayed_host_ms(self) -> float | None:
        """The median over its runs of the host time per step with their forwards replayed
        (``ServeRun.replayed_host_ms``); ``None`` unless every run was replayed."""
        known = [r.replayed_host_ms for r in self.runs if r.replayed_host_ms is not None]
        return statistics.median(known) if known and len(known) == len(self.runs) else None

    @property
    def repeats(self) -> int:
        return len(self.runs)

    def latency(self, which: str, q: float) -> float | None:
        """The ``q``-quantile of ``"ttft"`` or ``"tpot"`` (ms) over every request of every repeat."""
        return percentile([x for r in self.runs for x in (r.ttft_ms if which == "ttft" else r.tpot_ms)], q)

    def to_json(self) -> dict[str, object]:
        return {
            "workload": self.workload, "arrivals": self.arrivals, "k": self.k, "engine": self.engine, "draft": self.draft, "overlap": self.overlap,
            "max_running": self.max_running, "running": self.running, "tokens_per_s": self.tokens_per_s, "tokens_per_s_min": self.tokens_per_s_min,
            "tokens_per_s_max": self.tokens_per_s_max, "host_ms_per_step": self.host_ms_per_step,
            "host_ms_per_step_replayed": self.replayed_host_ms, "steps": self.steps,
            "tokens": self.tokens, "wall_s": self.wall_s, "model_s": self.model_s,
            "tokens_per_s_vs_mutable_fixed": self.vs_mutable_fixed, "tokens_per_s_vs_k0": self.vs_k0,
            "paired_vs_mutable_fixed": list(self.paired_vs_mutable_fixed), "paired_vs_k0": list(self.paired_vs_k0),
            "sampling": self.sampling.label, "temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
            "tokens_per_s_vs_greedy": self.vs_greedy, "acceptance": self.acceptance, "accepted_length": self.accepted_length,
            "decode_step_ms": self.step_ms("decode"), "spec_step_ms": self.step_ms("spec"), "iteration_decodes": self.iteration_decodes,
            "proposed": sum(r.proposed for r in self.runs), "accepted": sum(r.accepted for r in self.runs),
            "sampler_share": self.sampler_share,
            "ttft_ms_p50": self.latency("ttft", 0.5), "ttft_ms_p90": self.latency("ttft", 0.9),
            "tpot_ms_p50": self.latency("tpot", 0.5), "tpot_ms_p90": self.latency("tpot", 0.9),
            "statistic": "median", "repeats": self.repeats,
            "runs": [
                {"repeat": r.repeat, "tokens_per_s": r.tokens_per_s, "host_ms_per_step": r.host_ms_per_step,
                 "wall_s": r.wall_s, "model_s": r.model_s, "steps": r.steps, "tokens": r.tokens, "proposed": r.proposed,
                 "accepted": r.accepted, "sampler_s": r.sampler_s, "host_ms_per_step_replayed": r.replayed_host_ms, "replays": r.replays}
                for r in self.runs
            ],
        }


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def summarise(runs: Sequence[ServeRun]) -> list[ServeRow]:
    """One row per (workload, arrivals, k, engine, overlap, max_running, sampling): the medians of its
    runs and their range, in the order the keys first appear."""
    groups: dict[tuple[str, str, int, str, bool, int, Sampling, str], list[ServeRun]] = {}
    for r in runs:  # (k = 0 runs no draft, whatever the run was labelled)
        groups.setdefault((r.workload, r.arrivals, r.k, r.engine, r.overlap, r.max_running, r.sampling, r.draft if r.k else "none"), []).append(r)
    tps = {key: statistics.median(r.tokens_per_s for r in g) for key, g in groups.items()}
    by_repeat = {key: {r.repeat: r.tokens_per_s for r in g} for key, g in groups.items()}

    def paired(g: list[ServeRun], other: tuple[str, str, int, str, bool, int, Sampling, str]) -> tuple[float, ...]:
        """Each run's tokens/s over ``other``'s run of the same repeat (the repeats both have)."""
        theirs = by_repeat.get(other, {})
        return tuple(r.tokens_per_s / theirs[r.repeat] for r in sorted(g, key=lambda r: r.repeat) if theirs.get(r.repeat))

    decode = {key: statistics.median(x) for key, g in groups.items() if (x := [t for r in g for t in r.decode_ms])}
    rows = []
    for (workload, arrivals, k, engine, overlap, running, sampling, drafted), g in groups.items():
        mine = tps[(workload, arrivals, k, engine, overlap, running, sampling, drafted)]
        rows.append(ServeRow(
            workload=workload, arrivals=arrivals, k=k, engine=engine, overlap=overlap, max_running=running,
            running=max(r.running for r in g),
            tokens=statistics.median_low(r.tokens for r in g), steps=statistics.median_low(r.steps for r in g),
            tokens_per_s=mine, tokens_per_s_min=min(r.tokens_per_s for r in g), tokens_per_s_max=max(r.tokens_per_s for r in g),
            host_ms_per_step=statistics.median(r.host_ms_per_step for r in g),
            wall_s=statistics.median(r.wall_s for r in g), model_s=statistics.median(r.model_s for r in g),
            vs_mutable_fixed=_ratio(mine, tps.get((workload, arrivals, k, "mutable-fixed", False, running, sampling, drafted))),
            vs_k0=_ratio(mine, tps.get((workload, arrivals, 0, engine, overlap, running, sampling, "none"))), runs=tuple(g), sampling=sampling,
            vs_greedy=_ratio(mine, tps.get((workload, arrivals, k, engine, overlap, running, GREEDY_SAMPLING, drafted))) if sampling.sampled else None,
            draft=drafted,
            iteration_decodes=_ratio(statistics.median(spec), decode.get((workload, arrivals, 0, engine, overlap, running, sampling, "none")))
            if k and (spec := [t for r in g for t in r.spec_ms]) else None,
            paired_vs_mutable_fixed=paired(g, (workload, arrivals, k, "mutable-fixed", False, running, sampling, drafted)),
            paired_vs_k0=paired(g, (workload, arrivals, 0, engine, overlap, running, sampling, "none")),
        ))
    return rows


def run_serve_bench(
    target: HybridModel,
    draft: HybridModel | None,
    cases: Sequence[BenchCase],
    *,
    repeats: int,
    engines: Sequence[str] = ENGINES,
    overlap: bool = False,
    on_run: Callable[[int, int, ServeRun | None], None] | None = None,
    head: HeadModel | None = None,
    replay: bool = False,
) -> list[ServeRow]:
    """Warm every engine up on every case, then serve every case on every engine ``repeats`` times,
    interleaved (each repeat runs every case's engines in turn; with ``overlap``, the compiled
    engine with overlap right after it; a sampled case, the compiled engine only), timing the
    sampler calls of the in-process compiled runs, and summarise the medians. ``draft``: the
    separate draft (``None`` when no case drafts with one and no baseline runs: the baselines'
    k = 0 runs hold a draft too).
    ``on_run(done, total, run)`` reports progress (``run`` is None before the first). ``replay``:
    every in-process run is also served with its forwards replayed (``measure``)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    t, d = TimedModel(target), (TimedModel(draft) if draft is not None else None)
    h = TimedHead(head) if head is not None else None
    for case in cases:
        if case.draft == "mtp" and h is None:
            raise ValueError("a case with the draft head (draft 'mtp') needs head=")
        if d is None and (case.engines != ("compiled",) or (case.k and case.draft == "model")):
            raise ValueError(f"a case of draft kind {case.draft!r} at k = {case.k} needs draft= (a separate draft)")
        if case.engines == ("compiled",):  # the baselines do not serve it
            serve(make_engine(t, h if case.draft == "mtp" and h is not None else d, case.cfg, None, cache=True, k=case.k, overlap=False),
                  case.requests[:WARM_UP_REQUESTS], max_running=case.cfg.max_running)
        else:
            warm_up(case.requests, t, h if case.draft == "mtp" else d, case.cfg)

    def kinds(case: BenchCase) -> list[tuple[str, bool]]:
        return [(e, o) for e in engines if e in case.engines for o in ((False, True) if overlap and e == "compiled" else (False,))]

    total = repeats * sum(len(kinds(case)) for case in cases)
    if on_run is not None:
        on_run(0, total, None)
    runs = []
    with timing_sampler() as sampler:
        for repeat in range(repeats):
            for case in cases:
                for engine, over in kinds(case):
                    runs.append(measure(case, engine, t, d, repeat=repeat, overlap=over, sampler=sampler, head=h, replay=replay and not over))
                    if on_run is not None:
                        on_run(len(runs), total, runs[-1])
    return summarise(runs)
