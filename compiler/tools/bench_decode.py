"""``batchc bench decode``: where a decode step goes, beside the memory bound of reading the weights.

For every case (dtype x threads x batch) this benchmark serves ``batch`` requests of ``prompt_len``
random prompt tokens and ``new_tokens`` greedy tokens each through the compiled engine at k = 0
(``compiler.engine.Engine``, in this process, no prefix cache), as ``batchc run --k 0`` serves them:
one prefill step of every prompt (the chunk and the step's token budget hold them all), then
``new_tokens - 1`` decode steps of every row. It reports:

- ``prompt_tokens_per_s``: the prompts' tokens over the prefill steps' wall time (host, model and
  sampler: the whole step), as ``llama-bench``'s ``pp`` test counts a prompt's evaluation;
- ``decode_ms_per_step``: the decode steps' mean wall time (the whole engine step);
- its split at the top: the model's forward (timed by ``compiler.tools.timed.TimedModel``), the
  sampler (``timing_sampler``) and the host, which is the rest of the step (scheduler, passes,
  staging, ledger, executor);
- the bound: the bytes a decode step must read at least, over the copy bandwidth the command
  measures (``copy_bandwidth``: a large torch copy in the same process, at the case's threads,
  counted as bytes read plus bytes written, the STREAM convention). ``weight_bound_ms`` counts the
  weights (each tensor once; a tied embedding once, for the LM head; an untied embedding table not
  at all, a step reads ``batch`` of its rows); ``traffic_bound_ms`` adds the rows' Mamba states,
  read and written once, and their keys and values read once at the workload's mean context;
- ``split``: where the timed rounds' decode steps went, with ``backend.parts``' clock running
  through them: every part the model code marks (layers by kind, the state pool's gathers and
  scatters, the KV cache, the LM head, the norms, the embedding, the entry point's own code) in
  exclusive milliseconds per decode step, the sampler and the host. They add up to the rounds' mean
  step (``split_step_ms``): the parts measure the forward, the host is the rest of the step, and
  ``unattributed`` is the forward's wall time no part saw (the timing wrapper's own call:
  microseconds). ``clock_ms_per_step`` estimates what the clock itself added to a step: its part
  entries per step times the cost of one entry measured in the same process (a microsecond or
  less; a few hundred entries per step of the 350M shape). ``--no-split`` times without the clock.

Why a clock and not ``torch.profiler``: the parts are the model's own structure (a Mamba layer is a
dozen ops, a state gather one), which an op-level profile does not name, and the clock costs about a
microsecond per part when it runs and one module-level read when it does not, so the split comes
from the very steps the figures time, interleaved with the other cases. On a CPU every torch op
finishes before it returns, so the wall time between two part boundaries is the work of the ops
between them (on a CUDA device it would need a synchronisation at every boundary, which this bench,
a CPU one, does not make).

Method: every case first serves a short warm-up (its prompts and two new tokens); then ``repeats``
rounds go through every case, in declaration order on even rounds and reversed on odd ones, so
drift on a shared machine touches every case alike; a round serves its case's workload again until
its decode steps have run ``min_seconds`` (at least once). Each round's copy bandwidth is measured
at each thread count in the same interleaving. Figures are medians over the rounds with their range;
the split is a mean over every round's decode steps (means add up, medians do not). Every round of a
case must produce the same tokens (the engine is deterministic at a given thread count):
``tokens_stable`` records it.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from backend.hybrid.model import HybridModel
from backend.parts import PARTS, Part, PartClock, timing_parts
from compiler.engine import Engine
from compiler.engine.report import StepKind
from compiler.tools.timed import SamplerClock, TimedModel, timing_sampler
from ir.ids import RequestId

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32}
"""The compute dtypes ``--dtype`` takes: those the model path runs on a CPU today (lower-precision
weights beside float32 compute are ``WEIGHT_DTYPES``)."""
WEIGHT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The storage dtypes ``--weight-dtype`` takes for a float32 model's matrices
(``HybridModel.with_weight_dtype``): activations, states and logits stay float32."""
AGREEMENT_PROMPTS = 4
"""Prompts of the agreement check of 16-bit weights against float32 (``weight_agreement``)."""
PROMPT_LEN = 160
NEW_TOKENS = 32
BATCHES = (1, 8)
THREADS = (1, 2)
REPEATS = 3
MIN_SECONDS = 1.0
COPY_BYTES = 256 << 20
"""Bytes of the copy that measures the bandwidth: far beyond any cache of the CPUs this runs on."""
COPY_MIN_S = 0.1
"""A bandwidth sample repeats the copy for at least this long and keeps its fastest copy."""
HOST = "host"
SAMPLER = "sampler"
UNATTRIBUTED = "unattributed"
SPLIT_PARTS = (*(p.name for p in PARTS), SAMPLER, HOST, UNATTRIBUTED)
"""The split's entries, in the order the JSON and the table list them."""
ROOT = Path(__file__).resolve().parent.parent.parent


@attrs.frozen(kw_only=True)
class Case:
    """One measured configuration."""

    dtype: str
    threads: int
    batch: int


@attrs.frozen(kw_only=True)
class Spread:
    """A median over rounds with the lowest and highest round."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        return cls(median=statistics.median(samples), min=min(samples), max=max(samples))


@attrs.define
class _Round:
    """What one round of a case measured."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    model_s: float = 0.0
    sampler_s: float = 0.0
    parts: dict[str, float] = attrs.Factory(dict)
    """Exclusive seconds per part over the decode steps (with the clock on)."""
    entries: int = 0
    """Part entries over the decode steps (with the clock on)."""
    tokens: list[list[int]] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class CaseResult:
    case: Case
    prompt_tokens_per_s: Spread
    decode_ms_per_step: Spread
    decode_steps: int
    """Decode steps of every timed round together."""
    model_ms_per_step: float
    sampler_ms_per_step: float
    host_ms_per_step: float
    state_bytes_per_step: int
    copy_gb_per_s: float
    """The median copy bandwidth at this case's threads (bytes read plus written)."""
    weight_bound_ms: float
    traffic_bound_ms: float
    split_step_ms: float | None
    """The rounds' mean decode step, which the split adds up to (``None`` without the clock)."""
    split: dict[str, float] | None
    """Milliseconds per decode step of each ``SPLIT_PARTS`` entry (``None`` without the clock)."""
    clock_ms_per_step: float | None
    """What the clock added to a decode step, estimated (``None`` without the clock)."""
    tokens_stable: bool

    def to_json(self) -> dict[str, Any]:
        return {
            **attrs.asdict(self.case),
            "prompt_tokens_per_s": self.prompt_tokens_per_s.median, "prompt_tokens_per_s_min": self.prompt_tokens_per_s.min,
            "prompt_tokens_per_s_max": self.prompt_tokens_per_s.max,
            "decode_ms_per_step": self.decode_ms_per_step.median, "decode_ms_per_step_min": self.decode_ms_per_step.min,
            "decode_ms_per_step_max": self.decode_ms_per_step.max, "decode_steps": self.decode_steps,
            "model_ms_per_step": self.model_ms_per_step, "sampler_ms_per_step": self.sampler_ms_per_step,
            "host_ms_per_step": self.host_ms_per_step, "state_bytes_per_step": self.state_bytes_per_step,
            "copy_gb_per_s": self.copy_gb_per_s, "weight_bound_ms": self.weight_bound_ms, "traffic_bound_ms": self.traffic_bound_ms,
            "split_step_ms": self.split_step_ms, "split": self.split, "clock_ms_per_step": self.clock_ms_per_step,
            "tokens_stable": self.tokens_stable,
        }


@attrs.frozen(kw_only=True)
class DecodeReport:
    model: str
    prompt_len: int
    new_tokens: int
    repeats: int
    min_seconds: float
    copy_bytes: int
    """Bytes of the copy that measured the bandwidth."""
    weight_bytes: dict[str, int]
    """Per dtype, the bytes of weights a decode step reads (``weight_bytes``)."""
    copy_gb_per_s: dict[int, tuple[float, ...]]
    """Per thread count, every round's copy bandwidth sample (GB/s, bytes read plus written)."""
    results: tuple[CaseResult, ...]
    provenance: dict[str, Any]
    agreement: dict[str, Agreement] = attrs.Factory(dict)
    """Per case dtype with 16-bit weights, its agreement with the float32 model (``weight_agreement``)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "prompt_len": self.prompt_len, "new_tokens": self.new_tokens, "repeats": self.repeats,
            "min_seconds": self.min_seconds, "copy_bytes": self.copy_bytes, "weight_bytes": self.weight_bytes,
            "copy_gb_per_s": [{"threads": t, "median": statistics.median(s), "max": max(s), "samples": list(s)}
                              for t, s in self.copy_gb_per_s.items()],
            "split_parts": list(SPLIT_PARTS), "rows": [r.to_json() for r in self.results],
            "agreement": {d: a.to_json() for d, a in self.agreement.items()}, "provenance": self.provenance,
        }


def weight_bytes(model: HybridModel) -> int:
    """Bytes of weights one decode step reads at least: every weight tensor once, but an untied
    embedding table, of which a step reads only its rows' entries (a tied one is the LM head)."""
    tied = model.config.tie_embeddings
    return sum(t.numel() * t.element_size() for name, t in model.weights.items() if name != "embed" or tied)


def state_bytes(model: HybridModel, batch: int, context: float) -> int:
    """Bytes of per-row state a decode step of ``batch`` rows at a mean ``context`` moves at least:
    each row's Mamba states read and written once, its keys and values read once."""
    c = model.config
    layout = model.pool_layout()
    mamba = sum(spec.conv_bytes + spec.ssm_bytes for spec in layout.layers)
    kv_token = 2 * c.n_attn * c.kv_heads * c.attn_head_dim * model.dtype.itemsize
    return int(batch * (2 * mamba + context * kv_token))


def copy_bandwidth(nbytes: int = COPY_BYTES, min_s: float = COPY_MIN_S) -> float:
    """GB/s of one large ``Tensor.copy_`` at the current thread count: (bytes read + bytes written)
    over the fastest of the copies made in ``min_s`` seconds (at least three)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # (pages touched)
    best, start, n = math.inf, time.perf_counter(), 0
    while n < 3 or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
        n += 1
    return 2 * src.numel() * 4 / best / 1e9


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(threads: Sequence[int]) -> dict[str, Any]:
    """Where the figures come from: date, commit, CPU, versions, threads, load."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": None if status is None else bool(status), "cpu_model": cpu_model(), "cores": os.cpu_count(),
        "torch": torch.__version__, "python": platform.python_version(), "threads": list(threads),
        "load_average_before": round(os.getloadavg()[0], 2),
    }


class _Side:
    """One (dtype, batch) engine, reused by every thread count and round."""

    def __init__(self, model: HybridModel, batch: int, prompt_len: int, new_tokens: int) -> None:
        self.model = TimedModel(model)
        self.batch, self.new_tokens = batch, new_tokens
        max_len = prompt_len + new_tokens + 2
        # twice the KV the rows use: the chunk planner starts a prompt only when the KV it still owes fits
        # beside the chunks allocated in the same step, so every prompt prefills in the first step
        self.engine = Engine(self.model, None, k=0, capacity=batch, kv_capacity=2 * batch * max_len, max_len=max_len,
                             chunk_size=prompt_len, token_budget=batch * prompt_len)
        gen = torch.Generator().manual_seed(batch)
        self.prompts = torch.randint(0, model.vocab, (batch, prompt_len), generator=gen).tolist()
        self.next_rid = 0

    def serve(self, r: _Round, new_tokens: int, sampler: SamplerClock, clock: PartClock | None) -> None:
        """The workload once (``new_tokens`` per request), its steps added to ``r``."""
        rids = [RequestId(self.next_rid + i) for i in range(self.batch)]
        self.next_rid += self.batch
        for rid, prompt in zip(rids, self.prompts, strict=True):
            self.engine.admit(rid, prompt, max_new_tokens=new_tokens)
        while self.engine.live:
            model0, sampler0 = self.model.seconds, sampler.seconds
            if clock is not None:
                clock.reset()
            report = self.engine.step()
            if report.kind is StepKind.DECODE:
                r.decode_steps += 1
                r.decode_s += report.seconds
                r.model_s += self.model.seconds - model0
                r.sampler_s += sampler.seconds - sampler0
                if clock is not None:
                    for name, s in clock.seconds.items():
                        r.parts[name] = r.parts.get(name, 0.0) + s
                    r.entries += sum(clock.calls.values())
            elif report.kind is StepKind.EXTEND:
                r.prefill_tokens += report.prefill_tokens
                r.prefill_s += report.seconds
            else:
                raise RuntimeError(f"bench decode: a {report.kind.value} step; the workload should run one prefill step and decode steps")
        r.tokens.extend(self.engine.outputs.pop(rid) for rid in rids)


def clock_cost(entries: int = 20_000) -> float:
    """Seconds one part's entry and exit take while a clock runs (the mean of ``entries``)."""
    part = Part("clock cost")
    with timing_parts():
        t0 = time.perf_counter()
        for _ in range(entries):
            with part:
                pass
        return (time.perf_counter() - t0) / entries


def run_decode_bench(
    models: Mapping[str, HybridModel], *, name: str, batches: Sequence[int] = BATCHES, threads: Sequence[int] = THREADS,
    prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS, repeats: int = REPEATS, min_seconds: float = MIN_SECONDS,
    split: bool = True, copy_bytes: int = COPY_BYTES, progress: Callable[[str], None] | None = None,
    references: Mapping[str, HybridModel] | None = None,
) -> DecodeReport:
    """Measure every (dtype of ``models``, thread count, batch) case (module docstring); the caller's
    thread count is back in place on return. ``references``: for a dtype of ``models`` (one with
    16-bit weights), the float32 model its ``weight_agreement`` is measured against, after the
    timed rounds, at the first thread count, on ``AGREEMENT_PROMPTS`` prompts of ``prompt_len``
    tokens and ``new_tokens`` new tokens each."""
    if not models or not batches or not threads:
        raise ValueError("run_decode_bench needs at least one dtype, batch and thread count")
    if prompt_len < 1 or new_tokens < 2 or repeats < 1 or not min_seconds >= 0 or copy_bytes < 4:
        raise ValueError(f"prompt_len >= 1, new_tokens >= 2, repeats >= 1, min_seconds >= 0 and copy_bytes >= 4, got {prompt_len}, "
                         f"{new_tokens}, {repeats}, {min_seconds}, {copy_bytes}")
    unknown = sorted(set(references or {}) - set(models))
    if unknown:
        raise ValueError(f"run_decode_bench: references name dtypes not measured: {unknown}")
    said = progress or (lambda text: None)
    before = torch.get_num_threads()
    prov = provenance(threads)
    cases = [Case(dtype=d, threads=t, batch=b) for d in models for t in threads for b in batches]
    sides = {(d, b): _Side(m, b, prompt_len, new_tokens) for d, m in models.items() for b in batches}
    rounds: dict[Case, list[_Round]] = {c: [] for c in cases}
    copies: dict[int, list[float]] = {t: [] for t in threads}
    cost = clock_cost() if split else 0.0
    try:
        with timing_sampler() as sampler, torch.inference_mode(), timing_parts() if split else contextlib.nullcontext() as clock:
            for c in cases:
                said(f"warming up {c.dtype}, {c.threads} threads, batch {c.batch}")
                torch.set_num_threads(c.threads)
                sides[(c.dtype, c.batch)].serve(_Round(), 2, sampler, None)
            for i in range(repeats):
                for t in threads if i % 2 == 0 else reversed(threads):
                    torch.set_num_threads(t)
                    copies[t].append(copy_bandwidth(copy_bytes))
                for c in cases if i % 2 == 0 else reversed(cases):
                    said(f"round {i + 1}/{repeats}: {c.dtype}, {c.threads} threads, batch {c.batch}")
                    torch.set_num_threads(c.threads)
                    r = _Round()
                    while r.decode_steps == 0 or r.decode_s < min_seconds:
                        sides[(c.dtype, c.batch)].serve(r, new_tokens, sampler, clock)
                    rounds[c].append(r)
            torch.set_num_threads(threads[0])
            agreement = {}
            for d, ref in (references or {}).items():
                said(f"agreement of {d} with float32")
                agreement[d] = weight_agreement(ref, models[d], agreement_prompts(ref.vocab, prompt_len), new_tokens)
    finally:
        torch.set_num_threads(before)
        for side in sides.values():
            side.engine.close()
    prov["load_average_after"] = round(os.getloadavg()[0], 2)
    context = prompt_len + (new_tokens - 1) / 2  # a decode step's mean context
    results = []
    for c in cases:
        rs = rounds[c]
        steps = sum(r.decode_steps for r in rs)
        decode_s = sum(r.decode_s for r in rs)
        model_s, sampler_s = sum(r.model_s for r in rs), sum(r.sampler_s for r in rs)
        bandwidth = statistics.median(copies[c.threads])
        model = models[c.dtype]
        moved = state_bytes(model, c.batch, context)
        weights = weight_bytes(model)
        results.append(CaseResult(
            case=c, prompt_tokens_per_s=Spread.of([r.prefill_tokens / r.prefill_s for r in rs]),
            decode_ms_per_step=Spread.of([r.decode_s / r.decode_steps * 1e3 for r in rs]), decode_steps=steps,
            model_ms_per_step=model_s / steps * 1e3, sampler_ms_per_step=sampler_s / steps * 1e3,
            host_ms_per_step=(decode_s - model_s - sampler_s) / steps * 1e3, state_bytes_per_step=moved, copy_gb_per_s=bandwidth,
            weight_bound_ms=weights / (bandwidth * 1e9) * 1e3, traffic_bound_ms=(weights + moved) / (bandwidth * 1e9) * 1e3,
            split_step_ms=decode_s / steps * 1e3 if split else None, split=_split(rs) if split else None,
            clock_ms_per_step=sum(r.entries for r in rs) * cost / steps * 1e3 if split else None,
            tokens_stable=all(r.tokens == rs[0].tokens for r in rs),
        ))
    return DecodeReport(
        model=name, prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, min_seconds=min_seconds, copy_bytes=copy_bytes,
        weight_bytes={d: weight_bytes(m) for d, m in models.items()}, copy_gb_per_s={t: tuple(s) for t, s in copies.items()},
        results=tuple(results), provenance=prov, agreement=agreement,
    )


def _split(rounds: Sequence[_Round]) -> dict[str, float]:
    """Milliseconds per decode step of every ``SPLIT_PARTS`` entry over the rounds' decode steps."""
    per = 1e3 / sum(r.decode_steps for r in rounds)
    parts = {name: sum(r.parts.get(name, 0.0) for r in rounds) for name in SPLIT_PARTS[: len(PARTS)]}
    decode_s, model_s, sampler_s = (sum(r.decode_s for r in rounds), sum(r.model_s for r in rounds), sum(r.sampler_s for r in rounds))
    out = {name: s * per for name, s in parts.items()}
    out[SAMPLER] = sampler_s * per
    out[HOST] = (decode_s - model_s - sampler_s) * per
    out[UNATTRIBUTED] = (model_s - sum(parts.values())) * per
    return out


def case_label(dtype: str, weight_dtype: str) -> str:
    """A case's ``dtype`` in the report: the compute dtype, or ``"float16 weights"`` (16-bit matrices
    beside float32 compute) when the weights' differs."""
    return dtype if weight_dtype == dtype else f"{weight_dtype} weights"


@attrs.frozen(kw_only=True)
class Agreement:
    """How closely a model with 16-bit weights follows its float32 original (``weight_agreement``)."""

    prompts: int
    new_tokens: int
    greedy_match: float
    """Of the float32 model's greedy tokens, the share the other model's own greedy run repeats at
    the same position."""
    first_divergence: tuple[int | None, ...]
    """Per prompt, the index of the first generated token that differs (``None``: none does)."""
    forced_top1: float
    """Fed the float32 model's tokens, the share of positions whose argmax is the float32 model's."""
    logit_max_abs_diff: float
    """Largest absolute difference of a logit over the teacher-forced positions."""
    logit_mean_abs_diff: float
    logit_std: float
    """The float32 model's logits' standard deviation over the same positions (the scale)."""
    kernel: str
    """The product path the 16-bit matrices took (``backend.kernels.lowp.kernel_status``)."""

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _greedy_logits(model: HybridModel, prompt: Sequence[int], new_tokens: int, feed: Sequence[int] | None) -> tuple[list[int], torch.Tensor]:
    """The model's greedy tokens after ``prompt`` through its own entry points (one request in slot 1:
    the prompt's prefill, then one decode per token) and the logits that chose them, ``[new_tokens,
    vocab]``; ``feed``: decode these tokens instead of its own (teacher forcing)."""
    total = len(prompt) + new_tokens
    pool, kv, table = model.new_pool(2), model.new_kv_cache(total + 1), model.new_token_table(2, total)
    slot = torch.ones(1, dtype=torch.int64)

    def ids(values: Sequence[int] | range) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64)

    n = len(prompt)
    logits = [model.extend(pool, kv, table, slots=slot, cu_seqlens=ids([0, n]), prefix_lens=ids([0]), input_ids=ids(prompt),
                           positions=ids(range(n)), kv_locs=ids(range(1, 1 + n))).logits[-1:].float()]
    out = [int(logits[-1].argmax(dim=-1)[0])]
    for pos in range(n, total - 1):
        token = out[-1] if feed is None else feed[pos - n]
        logits.append(model.decode(pool, kv, table, slots=slot, input_ids=ids([token]), positions=ids([pos]), kv_locs=ids([1 + pos])).logits.float())
        out.append(int(logits[-1].argmax(dim=-1)[0]))
    return out, torch.cat(logits)


def weight_agreement(reference: HybridModel, other: HybridModel, prompts: Sequence[Sequence[int]], new_tokens: int) -> Agreement:
    """``other`` (the same model with 16-bit matrices) against ``reference`` (float32), each through
    its own prefill and decode entry points, one prompt at a time: its own greedy tokens against the
    reference's, and, fed the reference's tokens, its logits against the reference's at every
    generated position."""
    from backend.kernels.lowp import kernel_status

    if not prompts or new_tokens < 1:
        raise ValueError(f"weight_agreement needs prompts and new_tokens >= 1, got {len(prompts)} prompts and {new_tokens}")
    match, forced, diverged = 0, 0, []
    diffs, refs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ref_tokens, ref_logits = _greedy_logits(reference, prompt, new_tokens, None)
            own, _ = _greedy_logits(other, prompt, new_tokens, None)
            fed, fed_logits = _greedy_logits(other, prompt, new_tokens, ref_tokens)
            match += sum(a == b for a, b in zip(own, ref_tokens, strict=True))
            forced += sum(a == b for a, b in zip(fed, ref_tokens, strict=True))
            diverged.append(next((i for i, (a, b) in enumerate(zip(own, ref_tokens, strict=True)) if a != b), None))
            diffs.append((fed_logits - ref_logits).abs())
            refs.append(ref_logits)
    diff, ref = torch.cat(diffs), torch.cat(refs)
    total = len(prompts) * new_tokens
    return Agreement(prompts=len(prompts), new_tokens=new_tokens, greedy_match=match / total, first_divergence=tuple(diverged),
                     forced_top1=forced / total, logit_max_abs_diff=float(diff.max()), logit_mean_abs_diff=float(diff.mean()),
                     logit_std=float(ref.std()), kernel=kernel_status())


def agreement_prompts(vocab: int, prompt_len: int, count: int = AGREEMENT_PROMPTS) -> list[list[int]]:
    """``count`` seeded random prompts of ``prompt_len`` tokens below ``vocab`` (the agreement check's)."""
    gen = torch.Generator().manual_seed(47)
    return torch.randint(0, vocab, (count, prompt_len), generator=gen).tolist()
