"""Serving a workload on ``Engine`` (``serve``) and the whole ``batchc run`` job (``run``): the run,
its ticket counts, the lossless check against plain greedy decoding, and the summary."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from backend.boundary import Transport
from backend.hf.transformers_backend import TransformersModel, transformers_transport
from backend.hybrid.model import HybridModel
from backend.model import ServedModel
from backend.tp.serve import TPLeader
from backend.transports import in_process, processes, tensor_parallel
from compiler.engine import Engine, prefill_first
from compiler.engine.config import ServeConfig
from compiler.manager import PassManager
from compiler.offline.budget import MemoryBudget
from compiler.offline.latency import Latencies
from compiler.offline.memory import check_serving, weight_bytes
from compiler.offline.models import DraftModel, draft_config
from compiler.offline.stops import StopScanner, scan
from compiler.offline.summary import Sample, ServeSummary, host_ms_per_step
from compiler.offline.tokenizer import ByteTokenizer, Tokenizer
from compiler.prefix_cache import PrefixCache
from compiler.workload import Request
from ir.errors import PreconditionError
from ir.ids import DRAFT_POOL, TARGET_POOL, PoolId, RequestId

__all__ = ["make_engine", "run", "serve", "stop_ids"]


def make_engine(
    target: HybridModel, draft: DraftModel | None, cfg: ServeConfig, pm: PassManager | None, cache: bool, k: int,
    chunk_size: int | None = None, overlap: bool | None = None, tp: TPLeader | None = None, transformers: TransformersModel | None = None,
) -> Engine:
    """The engine ``cfg`` describes (``chunk_size`` and ``overlap`` override the config's); with
    ``tp``, rank 0's engine of that tensor-parallel group (``target`` and ``draft`` its shards);
    with ``transformers``, an engine serving that model with transformers' own modeling code in
    place of ``target`` (``backend.hf.transformers_backend``: in this process, at k = 0)."""
    total = cfg.max_running + (cfg.cache_entries if cache else 0) + 2
    transport: Transport = in_process()
    served: ServedModel[Any] = target
    if transformers is not None:
        transport, served = transformers_transport(), transformers
    elif tp is not None:
        transport = tensor_parallel(tp)
    elif cfg.overlap if overlap is None else overlap:
        transport = processes()
    return Engine(
        served, draft if k else None, k=k, capacity=total, kv_capacity=cfg.max_running * cfg.max_len + cfg.cache_entries * 128,
        max_len=cfg.max_len, chunk_size=chunk_size if chunk_size is not None else cfg.chunk_size, token_budget=cfg.token_budget,
        prefix_cache=PrefixCache(capacity=cfg.cache_entries, block=cfg.cache_block) if cache else None, pm=pm,
        transport=transport, policy=prefill_first(cfg.prefill_streak), seed=cfg.seed, penalties=cfg.penalties,
    )


def stop_ids(r: Request, eos: Sequence[int]) -> list[int]:
    """The ids ``serve`` passes to ``Engine.admit`` as ``r``'s ``stop``: the model's end-of-sequence
    ids, none with ``ignore_eos`` (``sampling.stop_token_ids`` the engine adds itself)."""
    return [] if r.sampling.ignore_eos else list(eos)


def _cut_at_stops(driver: Engine, scanners: dict[RequestId, StopScanner]) -> list[RequestId]:
    """Look for each watched request's stop strings in its output so far: a live request in which
    one appeared is finished there (``Engine.finish``, its output cut); a request that finished in
    the meantime (at its ``max_new_tokens`` or a stop id) has its recorded output cut, and is no
    longer watched, nor is one that was aborted or errored. Returns the live requests it finished."""
    finished = []
    for rid, scanner in list(scanners.items()):
        live = driver.requests.get(rid)
        if live is not None:
            cut = scanner.feed(live.output[: live.max_new_tokens])
            if cut is not None:
                driver.finish(rid, length=cut.keep)
                finished.append(rid)
                del scanners[rid]
        elif rid in driver.outputs:
            if rid not in driver.aborted_by_failure and rid not in driver.errored:
                cut = scanner.feed(driver.outputs[rid])
                if cut is not None:
                    del driver.outputs[rid][cut.keep :]
                    if rid in driver.logprobs:
                        del driver.logprobs[rid][cut.keep :]
            del scanners[rid]
    return finished


def _completion(r: Request, output: Sequence[int], tokenizer: Tokenizer, driver: Engine) -> str:
    """A served request's text, as its ``--outputs`` line has it: before the stop string that ended it."""
    served = r.rid not in driver.aborted_by_failure and r.rid not in driver.errored
    cut = scan(tokenizer, r.sampling.stop, output, min_tokens=r.sampling.min_tokens) if served else None
    return cut.text if cut is not None else tokenizer.decode(output)


def _room_for(driver: Engine, r: Request) -> bool:
    """Whether ``r`` can be admitted now: a request of ``n > 1`` completions prefills its shared
    prompt state at admission (``Engine.admit``), which needs a free slot and KV locations now."""
    if r.sampling.n == 1 or len(r.token_ids) < 2:
        return True
    return driver.slots.num_free >= 1 and driver.kv.num_free >= len(r.token_ids) - 1


def serve(
    driver: Engine, workload: Sequence[Request], *, max_running: int, on_finish: Callable[[int], None] | None = None,
    on_step: Callable[[], None] | None = None, eos: Sequence[int] = (), latency: Latencies | None = None,
    tokenizer: Tokenizer | None = None,
) -> tuple[float, dict[str, int]]:
    """Admit requests as they arrive (scheduler steps) and while fewer than ``max_running`` are live,
    each with its ``sampling``; each ends at its ``max_new_tokens``, a ``sampling.stop_token_ids`` id,
    any of the ``eos`` ids (unless ``sampling.ignore_eos``; no stop id ends it before
    ``sampling.min_tokens`` tokens) or its first ``sampling.stop`` string in its text as
    ``tokenizer`` (default: bytes) decodes it, after each step (``compiler.offline.stops``: the request
    is finished and its output cut after the token that completed the stop string). ``on_finish``
    gets the number of finished requests whenever it changes; ``on_step`` is called before each step,
    after that step's admissions (to sample ``driver.live``, say); ``latency`` records each
    request's arrival, first token and end. Returns the wall seconds and the steps by kind. A
    refused request (``Request.refused``) is never admitted."""
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    queue = sorted((r for r in workload if r.refused is None), key=lambda r: r.arrival)
    steps: dict[str, int] = {}
    scanners: dict[RequestId, StopScanner] = {}
    step_no = 0
    t0 = time.perf_counter()
    done = 0
    while queue or driver.live:
        if latency is not None:
            latency.arrive_due(queue, step_no)
        while queue and queue[0].arrival <= step_no and driver.live < max_running and _room_for(driver, queue[0]):
            r = queue.pop(0)
            stops = stop_ids(r, eos)
            members = r.completions()
            driver.admit(
                r.rid, list(r.token_ids), max_new_tokens=r.max_new_tokens, stop=stops if stops else None, sampling=r.sampling,
                forks=members[1:],
            )
            if r.sampling.stop:
                for member in members:
                    scanners[member] = StopScanner(tok, r.sampling.stop, min_tokens=r.sampling.min_tokens)
        if on_step is not None:
            on_step()
        report = driver.step()
        stopped = _cut_at_stops(driver, scanners) if scanners else []
        if latency is not None:
            now = time.perf_counter()
            latency.step(report, now)
            latency.ended.update(dict.fromkeys(stopped, now))
        kind = report.kind.value
        steps[kind] = steps.get(kind, 0) + 1
        step_no += 1
        if on_finish is not None and len(driver.outputs) != done:
            done = len(driver.outputs)
            on_finish(done)
    driver.sync()  # the last commits still running in executor processes (overlap) are part of the run
    if scanners:
        _cut_at_stops(driver, scanners)
    return time.perf_counter() - t0, steps


def run(
    workload: Sequence[Request],
    target: HybridModel,
    draft: DraftModel | None,
    cfg: ServeConfig,
    *,
    on_finish: Callable[[int], None] | None = None,
    compare_mutable: bool = False,
    model_clock: Callable[[], float] | None = None,
    tokenizer: Tokenizer | None = None,
    eos: Sequence[int] = (),
    tp: TPLeader | None = None,
    transformers: TransformersModel | None = None,
    budget: MemoryBudget | None = None,
) -> ServeSummary:
    """Serve ``workload`` on the engine and summarise the run. ``compare_mutable`` only sizes the
    memory check for the baseline runs that ``compiler.tools.compare_mutable`` adds afterwards.
    ``model_clock``: the seconds spent inside the models' forwards so far (a timing wrapper's
    running total), read before and after the served run; with it the summary reports the run's
    model time and its host time per step (wall minus model time, per step). The lossless check
    after the run is not counted. With ``cfg.overlap`` the model time is the time during which an
    executor process ran a plan (``Engine.busy_seconds``), so the host time per step is the host
    time the forwards did not hide. ``tokenizer`` (default: bytes) renders the samples; ``eos``: the
    model's end-of-sequence ids, which end every request. ``tp``: serve on that tensor-parallel group
    (``target`` and ``draft`` are rank 0's shards; the lossless check runs on the group too, after
    the served run's session ended with every rank's ledger counts gathered). ``transformers``: serve
    (and check) on that model with transformers' own modeling code instead (``make_engine``; at
    k = 0, without ``tp``: ``PreconditionError`` otherwise); ``target`` still sizes the memory check.
    ``budget``: the memory the run may use (``check_serving``, the models' weights counted; default:
    the machine's memory available now plus those weights, which the run already holds)."""
    if transformers is not None and (cfg.k or tp is not None):
        raise PreconditionError("run", "a transformers model is served at k = 0 in this process (no draft, no tensor parallelism)")
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    if not cfg.penalties and any(r.sampling.penalised for r in workload if r.refused is None):
        cfg = attrs.evolve(cfg, penalties=True)  # (the engines keep token counts; the memory check counts them)
    # (transformers' model holds its own copy of the target's weights, of the same size in the same dtype)
    weights = weight_bytes([target, draft]) + (weight_bytes([target]) if transformers is not None else 0)
    check_serving(target.config, draft_config(draft) if draft is not None else None, cfg, compare_mutable=compare_mutable,
                  vocab=None if tokenizer is None else tok.vocab_size, budget=budget, weights=weights)
    pm = PassManager.from_env()
    with make_engine(target, draft, cfg, pm, cache=True, k=cfg.k, tp=tp, transformers=transformers) as driver:
        return _run(driver, workload, target, cfg, pm, on_finish=on_finish, model_clock=model_clock, tokenizer=tok, eos=eos, tp=tp,
                    transformers=transformers)


def _run(
    driver: Engine, workload: Sequence[Request], target: HybridModel, cfg: ServeConfig, pm: PassManager, *,
    on_finish: Callable[[int], None] | None, model_clock: Callable[[], float] | None, tokenizer: Tokenizer,
    eos: Sequence[int], tp: TPLeader | None, transformers: TransformersModel | None = None,
) -> ServeSummary:
    model_before = model_clock() if model_clock is not None else 0.0
    tp_before = (tp.group.message_s, tp.group.agree_s) if tp is not None else (0.0, 0.0)
    start = time.perf_counter()
    wall, steps = serve(driver, workload, max_running=cfg.max_running, on_finish=on_finish, eos=eos, tokenizer=tokenizer)
    model_s = model_clock() - model_before if model_clock is not None else None
    n_steps = sum(steps.values())
    busy_ms: float | None = None
    hidden: float | None = None
    if driver.backends.concurrent:
        model_s = driver.busy_seconds(start, time.perf_counter())
        busy_ms = host_ms_per_step(wall, driver.waited_seconds(), n_steps)
        exposed = host_ms_per_step(wall, model_s, n_steps)
        hidden = max(0.0, 1.0 - exposed / busy_ms) if busy_ms > 0 else None
    driver.drop_cache()
    ledger = driver.ledger
    generated = sum(len(v) for v in driver.outputs.values())

    def minted_consumed(pool: PoolId) -> tuple[str, str, str]:
        """Clears, COWs and snapshots of ``pool``, each as "minted/consumed"."""
        m, c = ledger.minted(pool), ledger.counts(pool)
        return f"{m.clears}/{c.clears}", f"{m.cows}/{c.cows}", f"{m.snapshots}/{c.snapshots}"

    target_counts = minted_consumed(TARGET_POOL)
    draft_counts: tuple[str | None, str | None, str | None] = minted_consumed(DRAFT_POOL) if cfg.k else (None, None, None)
    message_ms = agree_ms = None
    if tp is not None:  # the session ends here: every rank's ledger counts are gathered
        message_ms = (tp.group.message_s - tp_before[0]) / n_steps * 1e3 if n_steps else 0.0
        agree_ms = (tp.group.agree_s - tp_before[1]) / n_steps * 1e3 if n_steps else 0.0
        driver.close()

    lossless_check: str | None = None
    lossless_ok: bool | None = None
    lossless_ledgers_ok: bool | None = None
    served = [r for r in workload if r.refused is None]
    # a sampled request's tokens are a function of its seed at k = 0 only: speculation keeps their
    # distribution (rejection sampling), not the tokens themselves, so at k > 0 only greedy ones compare
    comparable = served if not cfg.k else [r for r in served if r.sampling.greedy]
    sample = comparable[: cfg.lossless_sample]
    # an aborted request's output is cut short; an errored one's stops where its logits were not finite
    checked = [r for r in sample if r.rid not in driver.aborted_by_failure and r.rid not in driver.errored]
    if sample:
        with make_engine(target, None, cfg, None, cache=False, k=0, chunk_size=cfg.max_len, overlap=False, tp=tp, transformers=transformers) as plain:
            serve(plain, [attrs.evolve(r, arrival=0) for r in checked], max_running=cfg.max_running, eos=eos, tokenizer=tokenizer)
        if plain.closing_ledgers is not None:
            lossless_ledgers_ok = plain.closing_ledgers.equal and plain.closing_ledgers.drained
        same = not plain.aborted_by_failure and not plain.errored and all(plain.outputs[r.rid] == driver.outputs[r.rid] for r in checked)
        aborted = sum(1 for r in sample if r.rid in driver.aborted_by_failure)
        skipped = f" ({aborted} aborted requests not compared)" if aborted else ""
        if len(checked) + aborted < len(sample):
            errored = len(sample) - len(checked) - aborted
            skipped += f" ({errored} request{'s' if errored != 1 else ''} that ended in error not compared)"
        what = "plain greedy of the target" if all(r.sampling.greedy for r in checked) else "the target alone at k = 0 with their seeds"
        lossless_check = f"{'passed' if same else 'FAILED'}: {len(checked)} requests equal {what}{skipped}"
        lossless_ok = same
        if not checked:  # nothing left to compare: no verdict either way
            lossless_check, lossless_ok = f"not run: none of the {len(sample)} sampled requests ended normally{skipped}", None
    elif served and cfg.k:
        lossless_check = "not run: every request samples, and at k > 0 only greedy ones have the target's own tokens to compare"
    cache = driver.cache
    return ServeSummary(
        requests=len(workload),
        prompt_tokens=sum(len(r.token_ids) for r in served),
        refused_requests=len(workload) - len(served),
        max_len=cfg.max_len,
        generated_tokens=generated,
        k=cfg.k,
        steps=n_steps,
        steps_by_kind=", ".join(f"{k}={v}" for k, v in sorted(steps.items())),
        wall_s=wall,
        tokens_per_s=generated / wall if wall else 0.0,
        model_s=model_s,
        host_ms_per_step=host_ms_per_step(wall, model_s, n_steps) if model_s is not None else None,
        overlap=driver.backends.concurrent, host_busy_ms_per_step=busy_ms, host_hidden_fraction=hidden,
        acceptance_rate=driver.stats.acceptance_rate,
        mean_accepted_length=driver.stats.mean_accepted_length,
        prefix_cache_hit_rate=cache.stats.hit_rate if cache is not None else 0.0,
        prefix_cache_hit_tokens=cache.stats.hit_tokens if cache is not None else 0,
        prefix_cache_evictions=cache.stats.evictions if cache is not None else 0,
        retractions=driver.stats.retractions,
        aborted_requests=len(driver.aborted_by_failure),
        errored_requests=len(driver.errored),
        failed_forwards=driver.stats.failed_steps,
        first_failure=driver.first_failure,
        replays_blocked=ledger.replays_blocked,
        outstanding_tickets=len(ledger.outstanding()),
        slots_live_after=driver.slots.num_live,
        kv_live_after=driver.kv.num_live,
        pass_us_per_step={name: (t.calls, t.seconds / t.calls * 1e6) for name, t in pm.timings().items()},
        samples=tuple(
            Sample(rid=r.rid, prompt=r.prompt.decode("utf-8", "replace")[-40:],
                   completion=_completion(r, driver.outputs[r.rid], tokenizer, driver))
            for r in served[:3]
        ),
        outputs={rid: tuple(out) for rid, out in driver.outputs.items()},
        logprobs=dict(driver.logprobs),
        aborted=tuple(sorted(driver.aborted_by_failure)),
        errored=tuple(sorted(driver.errored)),
        target_clears_minted_consumed=target_counts[0],
        target_cows_minted_consumed=target_counts[1],
        target_snapshots_minted_consumed=target_counts[2],
        draft_clears_minted_consumed=draft_counts[0],
        draft_cows_minted_consumed=draft_counts[1],
        draft_snapshots_minted_consumed=draft_counts[2],
        lossless_check=lossless_check,
        lossless_ok=lossless_ok,
        tp=tp.world if tp is not None else 1,
        tp_ledgers=driver.closing_ledgers.to_json() if driver.closing_ledgers is not None else None,
        tp_lossless_ledgers_ok=lossless_ledgers_ok,
        tp_message_ms_per_step=message_ms,
        tp_agree_ms_per_step=agree_ms,
    )
