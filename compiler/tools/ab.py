"""``batchc ab``: the seed bug, side by side in one run.

The same prompts (some sharing a cached prefix, so their slots start with a COW, the rest fresh
with a clear), with continuous batching (at most ``max_running`` live, new requests join as others
finish), go through:

1. plain greedy decoding of the target (``Engine`` with ``k = 0``): the reference output;
2. the compiled pipeline with speculative decoding (``Engine``);
3. the mutable baseline (``MutableSpecEngine``), pre-fix;
4. the mutable baseline with the upstream fix, for comparison;
5. the pre-fix baseline once more with a ledger on its runners, which refuses the first replay.

Reported per run: acceptance rate, init ops executed per pool, replays, and whether the output
equals plain greedy. The draft (``draft="model"``) is a tiny target's copy plus Gaussian weight
noise (``draft_noise``); with ``draft="mtp"`` it is the upstream setting itself: the bundled target
and its trained draft head (``backend.hybrid.head``), whose pool the pre-fix baseline's draft extend
replays the stale init ops on.
"""

from __future__ import annotations

import random
import time

import attrs
import torch

from backend.hybrid.config import tiny
from backend.hybrid.head import HeadModel
from backend.hybrid.model import HybridModel
from backend.hybrid.weights import perturb
from backend.ledger import Ledger
from compiler.baselines.spec import MutableSpecEngine
from compiler.engine import Engine, ServingEngine
from compiler.offline.models import on_device
from compiler.workload import SNIPPETS, SYSTEM_PREFIXES
from ir.errors import ResourceReplayError
from ir.ids import DRAFT_POOL, TARGET_POOL, RequestId

DRAFT_NOISE = 0.05
"""Relative weight noise of the default draft: speculative acceptance about 0.6-0.8 at k = 1..4."""


@attrs.frozen(kw_only=True)
class Prompt:
    rid: RequestId
    tokens: tuple[int, ...]
    prefix: int  # index into SYSTEM_PREFIXES (shared, cached), or -1


def ab_prompts(n: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prefix = rng.choice((-1, 0, 1))
        body = rng.choice(SNIPPETS)[: rng.randint(8, 24)]
        text = (SYSTEM_PREFIXES[prefix] if prefix >= 0 else b"") + body
        out.append(Prompt(rid=RequestId(i), tokens=tuple(text), prefix=prefix))
    return out


AB_KV_CAPACITY = 4096
"""KV locations of each of ``batchc ab``'s engines (``Engine``'s and ``MutableSpecEngine``'s default)."""


def ab_problem(*, k: int, requests: int, max_new_tokens: int, max_running: int, seed: int, max_len: int = 512) -> str | None:
    """Why ``run_ab`` with these options would run out of context or KV locations mid-run, or
    ``None``. Checked on the actual prompts: the longest prompt, ``max_new_tokens`` and the k + 1
    positions of a step must fit ``max_len``, and the running requests' whole contexts, next to the
    shared prefixes' own, the engines' KV cache (a bound: a request never holds more locations)."""
    longest = max(len(p.tokens) for p in ab_prompts(requests, seed))
    context = longest + max_new_tokens + k + 1
    if context > max_len:
        return (f"--max-new-tokens {max_new_tokens} is over {max_len - longest - k - 1}: the context limit {max_len} minus the "
                f"longest prompt ({longest} tokens) minus k + 1 = {k + 1}")
    running = min(max_running, requests)
    kv = running * context + sum(len(p) for p in SYSTEM_PREFIXES)
    if kv > AB_KV_CAPACITY:
        return (f"--max-running {max_running} with --max-new-tokens {max_new_tokens}: {running} running requests of up to {context} "
                f"positions each, with the shared prefixes, can need {kv} KV locations, over the engines' {AB_KV_CAPACITY}")
    return None


def serve(engine: ServingEngine, prompts: list[Prompt], *, max_new_tokens: int, max_running: int) -> float:
    """Continuous batching: keep at most ``max_running`` requests live; returns wall seconds."""
    t0 = time.perf_counter()
    cps = [engine.make_prefix(list(p)) for p in SYSTEM_PREFIXES]
    queue = list(prompts)
    while queue or engine.live:
        while queue and engine.live < max_running:
            p = queue.pop(0)
            engine.admit(p.rid, list(p.tokens), max_new_tokens=max_new_tokens, prefix=cps[p.prefix] if p.prefix >= 0 else None)
        engine.step()
    for cp in cps:
        engine.release_prefix(cp)
    return time.perf_counter() - t0


@attrs.frozen(kw_only=True)
class AbRun:
    """One engine's run of the A/B workload."""

    acceptance_rate: float
    mean_accepted_length: float
    init_ops_target: int
    """Clears and COWs executed on the target pool."""
    init_ops_draft: int
    """Clears and COWs executed on the draft pool (more than the target's: replays)."""
    replays: int
    """Init ops executed again from a stale batch (the compiled engine's ledger refuses them)."""
    outstanding_tickets: int | None
    """Tickets never consumed (``None``: the baseline has no ledger)."""
    equals_greedy: bool
    """Every output equals plain greedy decoding of the target."""
    wall_s: float


@attrs.frozen(kw_only=True)
class AbReport:
    """``batchc ab``'s result; ``to_json`` is its ``--json`` file."""

    k: int
    requests: int
    max_new_tokens: int
    draft_noise: float | None
    """The separate draft's weight noise (``None`` with the draft head)."""
    runs: dict[str, AbRun]
    """By run: ``compiled``, ``mutable_baseline`` (pre-fix), ``mutable_baseline_fixed``."""
    ledger_on_baseline: str
    """What the pre-fix baseline did with a ledger on its runners (the refusal of its first replay)."""

    @property
    def compiled(self) -> AbRun:
        return self.runs["compiled"]

    draft: str = "model"
    """``"model"`` (a noisy copy of a tiny target) or ``"mtp"`` (the bundled target's draft head)."""

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


def ab_models(*, draft_kind: str = "model", draft_noise: float = DRAFT_NOISE, seed: int = 0,
              device: str | torch.device = "cpu") -> tuple[HybridModel, HybridModel | HeadModel]:
    """The target and the draft ``run_ab`` serves with (``draft_kind``: ``"model"``, a tiny target
    and a noisy copy of it; ``"mtp"``, the bundled target and its draft head), on ``device``
    (``compiler.offline.models.on_device``: ``ServeError`` in one line when they cannot go there)."""
    draft: HybridModel | HeadModel
    if draft_kind == "mtp":
        from backend.hybrid.checkpoint import HEAD_FILE, bundled_path, default_target
        from backend.hybrid.head import load_head

        target = default_target()
        draft = load_head(bundled_path(HEAD_FILE), target)
    elif draft_kind == "model":
        target = HybridModel.from_seed(tiny(), seed=seed)
        draft = HybridModel(target.config, perturb(target.weights, draft_noise, seed=seed + 1))
    else:
        raise ValueError(f"draft_kind must be 'model' or 'mtp', got {draft_kind!r}")
    placed, moved = on_device(target, draft, device)
    assert moved is not None  # (a draft was given)
    return placed, moved


def run_ab(
    *, k: int = 2, requests: int = 12, max_new_tokens: int = 24, max_running: int = 4, draft_noise: float = DRAFT_NOISE, seed: int = 0,
    draft_kind: str = "model", models: tuple[HybridModel, HybridModel | HeadModel] | None = None,
) -> AbReport:
    """Serve the A/B workload through every run (the module's docstring) on ``models`` (default:
    ``ab_models`` of ``draft_kind``, ``draft_noise`` and ``seed`` on the CPU; given, they must be
    ``ab_models``' of the same arguments, placed on the device the runs use)."""
    target, draft = models if models is not None else ab_models(draft_kind=draft_kind, draft_noise=draft_noise, seed=seed)
    prompts = ab_prompts(requests, seed)
    kw = {"max_new_tokens": max_new_tokens, "max_running": max_running}

    greedy = Engine(target, None, k=0)
    serve(greedy, prompts, **kw)
    compiled = Engine(target, draft, k=k)
    t_c = serve(compiled, prompts, **kw)
    compiled.ledger.assert_drained()
    tc, dc = compiled.ledger.counts(TARGET_POOL), compiled.ledger.counts(DRAFT_POOL)
    runs = {
        "compiled": AbRun(
            acceptance_rate=compiled.stats.acceptance_rate, mean_accepted_length=compiled.stats.mean_accepted_length,
            init_ops_target=tc.clears + tc.cows, init_ops_draft=dc.clears + dc.cows, replays=compiled.ledger.replays_blocked,
            outstanding_tickets=len(compiled.ledger.outstanding()), equals_greedy=compiled.outputs == greedy.outputs, wall_s=t_c,
        )
    }
    for name, fixed in (("mutable_baseline", False), ("mutable_baseline_fixed", True)):
        base = MutableSpecEngine(target, draft, k=k, fixed=fixed)
        t_b = serve(base, prompts, **kw)
        runs[name] = AbRun(
            acceptance_rate=base.stats.acceptance_rate, mean_accepted_length=base.stats.mean_accepted_length,
            init_ops_target=base.t.runner.clears_executed + base.t.runner.cows_executed,
            init_ops_draft=base.d.runner.clears_executed + base.d.runner.cows_executed, replays=base.replays,
            outstanding_tickets=None, equals_greedy=base.outputs == greedy.outputs, wall_s=t_b,
        )
    guarded = MutableSpecEngine(target, draft, k=k, ledger=Ledger())
    try:
        serve(guarded, prompts, **kw)
        refusal = "no replay happened"
    except ResourceReplayError as exc:
        refusal = f"ResourceReplayError: {exc}"
    return AbReport(k=k, requests=requests, max_new_tokens=max_new_tokens, draft_noise=draft_noise if draft_kind == "model" else None,
                    runs=runs, ledger_on_baseline=refusal, draft=draft_kind)


_ENGINES: tuple[type[ServingEngine], ...] = (Engine, MutableSpecEngine)
"""Both engines this harness drives provide ``ServingEngine`` (checked by mypy here)."""
