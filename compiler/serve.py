"""``batchc run``: the main job. A workload of requests served by ``SpecDriver`` on a target and a
draft model, with the prefix cache, chunked prefill, continuous batching and speculative decoding,
and a summary an engine author can judge the library by.

Workloads: the built-in one (``builtin_workload``: requests built from a bundled prompt set, with
shared system prefixes, arrivals in bursts or a trickle, and mixed lengths) or a JSONL file (``load_workload``), one
request per line: ``{"prompt": str, "max_new_tokens": int, "arrival": int (optional, scheduler step),
"stop": str (optional, one character)}``. A malformed file raises ``WorkloadError`` naming the line.

The lossless check re-runs a sample of the requests with plain greedy decoding of the target alone
(no draft, no cache, no chunking) and compares the outputs token for token.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from backend.hybrid.model import HybridModel
from compiler.baseline_spec import MutableSpecEngine
from compiler.manager import PassManager
from compiler.prefix_cache import PrefixCache
from compiler.spec_driver import SpecDriver
from compiler.workload import ARRIVALS, BURST_EVERY, BURST_SIZE, SNIPPETS, SYSTEM_PREFIXES
from ir.errors import BatchcError
from ir.ids import DRAFT_POOL, TARGET_POOL, RequestId


MAX_ARRIVAL = 1_000_000
"""Latest arrival step a workload may ask for (a larger one would idle the scheduler for ever)."""


class WorkloadError(BatchcError, ValueError):
    """A workload file that cannot be served; the message names the file and line."""


@attrs.frozen(kw_only=True)
class Request:
    rid: RequestId
    prompt: bytes
    max_new_tokens: int
    arrival: int = 0
    stop: int | None = None


@attrs.frozen(kw_only=True)
class ServeConfig:
    k: int = 2
    max_running: int = 8
    chunk_size: int = 64
    token_budget: int = 256
    cache_entries: int = 8
    cache_block: int = 16
    max_len: int = 512
    lossless_sample: int = 4


def builtin_workload(
    *, num_requests: int = 64, max_new_tokens: int = 32, seed: int = 0, arrivals: str = "bursts"
) -> list[Request]:
    """Byte prompts from the bundled snippets: about two thirds start with one of the shared system
    prefixes; bodies of 1 to 6 snippets (long ones are prefilled in chunks); generation lengths vary
    from a quarter of ``max_new_tokens`` to all of it.

    ``arrivals``: ``"bursts"`` (default): ``BURST_SIZE`` requests arrive together every
    ``BURST_EVERY`` scheduler steps, as when clients submit batches of prompts (evaluation
    harnesses, agent fan-out, batch APIs). ``"trickle"``: one request at a time, 0 to 2 steps
    apart. The pattern decides how far the pre-fix engine's stale-init bug reaches: its stale
    indices ride on the running batch from the moment a prefill batch becomes the running batch
    (nothing else was running) until that batch's first request finishes. Each burst opens that
    window over all of its requests; a trickle opens it over one request at a time."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {ARRIVALS}, got {arrivals!r}")
    rng = random.Random(seed)
    out = []
    arrival = 0
    for i in range(num_requests):
        prefix = rng.choice((-1, 0, 1))
        body = b"".join(rng.choice(SNIPPETS) for _ in range(rng.randint(1, 6)))
        prompt = (SYSTEM_PREFIXES[prefix] if prefix >= 0 else b"") + body
        step = rng.choice((0, 0, 1, 2))  # drawn under both patterns: prompts and lengths stay the same
        arrival = (i // BURST_SIZE) * BURST_EVERY if arrivals == "bursts" else arrival + step
        out.append(
            Request(rid=RequestId(i), prompt=prompt, max_new_tokens=rng.randint(max(1, max_new_tokens // 4), max_new_tokens), arrival=arrival)
        )
    return out


def load_workload(path: str | Path, *, max_len: int, default_max_new_tokens: int = 32) -> list[Request]:
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{p}: cannot read workload file ({exc})") from None
    out: list[Request] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: bad JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = set(obj) - {"prompt", "max_new_tokens", "arrival", "stop"}
        if unknown:
            raise WorkloadError(f"{where}: unknown field(s) {sorted(unknown)}")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise WorkloadError(f"{where}: 'prompt' must be a non-empty string")
        try:
            data = prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise WorkloadError(f"{where}: 'prompt' is not valid Unicode ({exc.reason} at character {exc.start})") from None
        new = obj.get("max_new_tokens", default_max_new_tokens)
        if not isinstance(new, int) or isinstance(new, bool) or new < 1:
            raise WorkloadError(f"{where}: 'max_new_tokens' must be a positive integer, got {new!r}")
        if len(data) + new + 8 > max_len:
            raise WorkloadError(f"{where}: prompt of {len(data)} bytes + {new} new tokens exceeds the context limit {max_len}")
        arrival = obj.get("arrival", 0)
        if not isinstance(arrival, int) or isinstance(arrival, bool) or not 0 <= arrival <= MAX_ARRIVAL:
            raise WorkloadError(f"{where}: 'arrival' must be an integer step in [0, {MAX_ARRIVAL}], got {arrival!r}")
        stop = obj.get("stop")
        if stop is not None and (not isinstance(stop, str) or len(stop.encode("utf-8")) != 1):
            raise WorkloadError(f"{where}: 'stop' must be a single one-byte character, got {stop!r}")
        out.append(
            Request(rid=RequestId(len(out)), prompt=data, max_new_tokens=new, arrival=arrival,
                    stop=stop.encode("utf-8")[0] if stop is not None else None)
        )
    if not out:
        raise WorkloadError(f"{p}: no requests")
    return out


def _driver(target: HybridModel, draft: HybridModel | None, cfg: ServeConfig, pm: PassManager | None, cache: bool, k: int) -> SpecDriver:
    total = cfg.max_running + (cfg.cache_entries if cache else 0) + 2
    return SpecDriver(
        target, draft if k else None, k=k, capacity=total, kv_capacity=cfg.max_running * cfg.max_len + cfg.cache_entries * 128,
        max_len=cfg.max_len, chunk_size=cfg.chunk_size, token_budget=cfg.token_budget,
        prefix_cache=PrefixCache(capacity=cfg.cache_entries, block=cfg.cache_block) if cache else None, pm=pm,
    )


def serve(
    driver: SpecDriver, workload: Sequence[Request], *, max_running: int, on_finish: Callable[[int], None] | None = None
) -> tuple[float, dict[str, int]]:
    """Admit requests as they arrive (scheduler steps) and while fewer than ``max_running`` are live."""
    queue = sorted(workload, key=lambda r: r.arrival)
    steps: dict[str, int] = {}
    step_no = 0
    t0 = time.perf_counter()
    done = 0
    while queue or driver.live:
        while queue and queue[0].arrival <= step_no and driver.live < max_running:
            r = queue.pop(0)
            driver.admit(r.rid, list(r.prompt), max_new_tokens=r.max_new_tokens, stop=r.stop)
        kind = driver.step()
        steps[kind] = steps.get(kind, 0) + 1
        step_no += 1
        if on_finish is not None and len(driver.outputs) != done:
            done = len(driver.outputs)
            on_finish(done)
    return time.perf_counter() - t0, steps


def run(
    workload: Sequence[Request],
    target: HybridModel,
    draft: HybridModel | None,
    cfg: ServeConfig,
    *,
    on_finish: Callable[[int], None] | None = None,
    compare_mutable: bool = False,
) -> dict[str, object]:
    pm = PassManager.from_env()
    driver = _driver(target, draft, cfg, pm, cache=True, k=cfg.k)
    wall, steps = serve(driver, workload, max_running=cfg.max_running, on_finish=on_finish)
    driver.drop_cache()
    ledger = driver.ledger
    generated = sum(len(v) for v in driver.outputs.values())
    summary: dict[str, object] = {
        "requests": len(workload),
        "prompt_tokens": sum(len(r.prompt) for r in workload),
        "generated_tokens": generated,
        "k": cfg.k,
        "steps": sum(steps.values()),
        "steps_by_kind": ", ".join(f"{k}={v}" for k, v in sorted(steps.items())),
        "wall_s": wall,
        "tokens_per_s": generated / wall if wall else 0.0,
        "acceptance_rate": driver.stats.acceptance_rate,
        "mean_accepted_length": driver.stats.mean_accepted_length,
        "prefix_cache_hit_rate": driver.cache.stats.hit_rate if driver.cache is not None else 0.0,
        "prefix_cache_hit_tokens": driver.cache.stats.hit_tokens if driver.cache is not None else 0,
        "prefix_cache_evictions": driver.cache.stats.evictions if driver.cache is not None else 0,
        "retractions": driver.stats.retractions,
    }
    pools = (TARGET_POOL, DRAFT_POOL) if cfg.k else (TARGET_POOL,)
    for pool in pools:
        minted, consumed = ledger.minted(pool), ledger.counts(pool)
        summary[f"{pool}_clears_minted_consumed"] = f"{minted.clears}/{consumed.clears}"
        summary[f"{pool}_cows_minted_consumed"] = f"{minted.cows}/{consumed.cows}"
        summary[f"{pool}_snapshots_minted_consumed"] = f"{minted.snapshots}/{consumed.snapshots}"
    summary["replays_blocked"] = ledger.replays_blocked
    summary["outstanding_tickets"] = len(ledger.outstanding())
    summary["slots_live_after"] = driver.slots.num_live
    summary["kv_live_after"] = driver.kv.num_live
    summary["pass_us_per_step"] = {name: [t.calls, t.seconds / t.calls * 1e6] for name, t in pm.timings().items()}
    summary["samples"] = [
        {"rid": int(r.rid), "prompt": r.prompt[-40:].decode("utf-8", "replace"), "completion": bytes(driver.outputs[r.rid]).decode("utf-8", "replace")}
        for r in list(workload)[:3]
    ]
    sample = list(workload)[: cfg.lossless_sample]
    if sample:
        plain = _driver(target, None, cfg, None, cache=False, k=0)
        plain.chunk_size = cfg.max_len
        serve(plain, [attrs.evolve(r, arrival=0) for r in sample], max_running=cfg.max_running)
        same = all(plain.outputs[r.rid] == driver.outputs[r.rid] for r in sample)
        summary["lossless_check"] = f"{'passed' if same else 'FAILED'}: {len(sample)} requests equal plain greedy of the target"
        summary["lossless_ok"] = same
    if compare_mutable and draft is not None and cfg.k:
        summary["mutable_baseline"] = _mutable(workload, target, draft, cfg, fixed=False)
        summary["mutable_baseline_fixed"] = _mutable(workload, target, draft, cfg, fixed=True)
    return summary


def make_mutable(target: HybridModel, draft: HybridModel, cfg: ServeConfig, *, k: int) -> MutableSpecEngine:
    return MutableSpecEngine(target, draft, k=k, capacity=cfg.max_running + len(SYSTEM_PREFIXES) + 2,
                             kv_capacity=cfg.max_running * cfg.max_len + 1024, max_len=cfg.max_len)


def serve_mutable(engine: MutableSpecEngine, workload: Sequence[Request], *, max_running: int) -> tuple[float, int]:
    """The same admission loop for the mutable baseline; system prefixes are checkpoints it COWs from
    (it has no prefix cache). Returns wall seconds and steps."""
    cps = [engine.make_checkpoint(list(p)) for p in SYSTEM_PREFIXES]
    queue = sorted(workload, key=lambda r: r.arrival)
    t0 = time.perf_counter()
    steps = 0
    while queue or engine.live:
        while queue and queue[0].arrival <= steps and engine.live < max_running:
            r = queue.pop(0)
            cp = next((c for c in cps if r.prompt.startswith(bytes(c.tokens)) and len(r.prompt) > len(c.tokens)), None)
            engine.admit(int(r.rid), list(r.prompt), max_new_tokens=r.max_new_tokens, checkpoint=cp)
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    for cp in cps:
        engine.release_checkpoint(cp)
    return wall, steps


def _mutable(workload: Sequence[Request], target: HybridModel, draft: HybridModel, cfg: ServeConfig, *, fixed: bool) -> dict[str, object]:
    """The same workload through the mutable baseline, pre-fix or with the upstream fix."""
    engine = make_mutable(target, draft, cfg, k=cfg.k)
    engine.fixed = fixed
    wall, _ = serve_mutable(engine, workload, max_running=cfg.max_running)
    generated = sum(len(v) for v in engine.outputs.values())
    return {
        "acceptance_rate": engine.stats.acceptance_rate,
        "mean_accepted_length": engine.stats.mean_accepted_length,
        "init_ops_target": engine.t.runner.clears_executed + engine.t.runner.cows_executed,
        "init_ops_draft": engine.d.runner.clears_executed + engine.d.runner.cows_executed,
        "replays": engine.replays,
        "stale_ops_run": engine.t.runner.stale_ops + engine.d.runner.stale_ops,
        "wall_s": wall,
        "tokens_per_s": generated / wall if wall else 0.0,
    }
