"""``batchc bench sampler``: the sampler's time per call against the bundled model's decode step.

The goal is a sampler costing at most 5% of a decode step at 8 and 128 running rows. For
each row count this benchmark times:

- ``decode``: one decode of the bundled target over that many rows, prompts already in their
  context (``compiler.tools.bench_iteration``'s setup, the model call alone);
- the sampler, ``backend.sampling.distribution`` then ``sample_rows`` on random logits of that
  many rows, for each case in ``CASES`` (greedy; temperature 1; temperature 1 with top_p 0.9;
  top_k 50; temperature 1 with repetition, frequency and presence penalties over a row's counts),
  at the bundled model's vocabulary and at each vocabulary of ``vocabs`` (131,072 by default, a
  large production vocabulary). Each call starts from a fresh ``RowParams`` built from prepared
  columns, so its host-side summary (``RowParams.uses``) is recomputed at every call: the cost of
  a batch whose rows are new. Serving works the summary out once for equal rows
  (``backend.plan_sampling``) and skips that part of the cost.

Every timed item is called once to warm up; then ``repeats`` rounds take one sample of each
item (``MIN_SAMPLE_S``), in declaration order on even rounds and reversed on odd ones
(interleaved, so drift touches every item alike). Each row of the report is the median of its repeats with their minimum and maximum;
``share`` is the sampler's median over the decode's median at the same rows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from backend.hybrid.model import HybridModel
from backend.sampling import RowParams, distribution, sample_rows
from compiler.tools.bench_iteration import PROMPT_LEN, _Side
from ir.sampling import GREEDY, SamplingParams

CASES: dict[str, SamplingParams] = {
    "greedy": GREEDY,
    "temperature 1": SamplingParams(temperature=1.0, seed=0),
    "temperature 1, top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9, seed=0),
    "top_k 50": SamplingParams(temperature=1.0, top_k=50, seed=0),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5, seed=0),
}
"""The sampled settings, every row of a call alike (each row seeded by its index)."""

LARGE_VOCAB = 131_072
MIN_SAMPLE_S = 0.002
"""A sample of a fast item is the mean of as many back-to-back calls as fill this many seconds (at
most ``MAX_CALLS``), so the timer's resolution and one preemption do not decide a median."""
MAX_CALLS = 100


@attrs.frozen(kw_only=True)
class Timing:
    median_s: float
    min_s: float
    max_s: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        ordered = sorted(samples)
        return cls(median_s=ordered[len(ordered) // 2], min_s=ordered[0], max_s=ordered[-1])


@attrs.frozen(kw_only=True)
class SamplerRow:
    rows: int
    vocab: int
    case: str
    time: Timing
    share: float
    """The sampler's median over the decode step's median at the same rows."""


@attrs.frozen(kw_only=True)
class SamplerReport:
    model_vocab: int
    repeats: int
    decode: dict[int, Timing]
    """The bundled target's decode step per row count."""
    rows: tuple[SamplerRow, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "model_vocab": self.model_vocab,
            "repeats": self.repeats,
            "decode": [{"rows": n, **attrs.asdict(t)} for n, t in self.decode.items()],
            "sampler": [{"rows": r.rows, "vocab": r.vocab, "case": r.case, **attrs.asdict(r.time), "share": r.share} for r in self.rows],
        }


def _sampler_call(rows: int, vocab: int, params: SamplingParams) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    columns = attrs.asdict(RowParams.of([attrs.evolve(params, seed=i) if params.seed is not None else params for i in range(rows)]), recurse=False)
    position = torch.full((rows,), 40, dtype=torch.int64)
    counts: torch.Tensor | None = None
    prompt: torch.Tensor | None = None
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        counts = torch.zeros(rows, vocab, dtype=torch.int64)
        counts.scatter_add_(1, torch.randint(0, vocab, (rows, 40), generator=gen), torch.ones(rows, 40, dtype=torch.int64))
        prompt = torch.zeros(rows, vocab, dtype=torch.bool).scatter_(1, torch.randint(0, vocab, (rows, 40), generator=gen), True)

    def call() -> object:
        p = RowParams(**columns)
        return sample_rows(distribution(logits, p, output_counts=counts, prompt_mask=prompt), p, position)

    return call


def run_sampler_bench(target: HybridModel, *, rows: Sequence[int] = (8, 128), vocabs: Sequence[int] = (LARGE_VOCAB,),
                      repeats: int = 5) -> SamplerReport:
    model_vocab = target.config.vocab
    all_vocabs = [model_vocab, *(v for v in vocabs if v != model_vocab)]
    items: dict[tuple[int, int, str], Callable[[], object]] = {}
    for n in rows:
        side = _Side(target, n, 1, PROMPT_LEN)
        ids = torch.randint(0, model_vocab, (n,), generator=torch.Generator().manual_seed(n))
        pos = torch.full((n,), PROMPT_LEN, dtype=torch.int64)
        locs = side.locs(n, 1)[:, 0].contiguous()
        items[(n, 0, "decode")] = lambda side=side, ids=ids, pos=pos, locs=locs: target.decode(  # type: ignore[misc]  # bound per row count
            side.pool, side.kv, side.table, slots=side.slots, input_ids=ids, positions=pos, kv_locs=locs
        )
        for v in all_vocabs:
            for name, params in CASES.items():
                items[(n, v, name)] = _sampler_call(n, v, params)
    samples: dict[tuple[int, int, str], list[float]] = {key: [] for key in items}
    calls: dict[tuple[int, int, str], int] = {}
    with torch.inference_mode():
        for key, fn in items.items():  # warm-up, which also sizes each sample
            t0 = time.perf_counter()
            fn()
            calls[key] = min(MAX_CALLS, max(1, math.ceil(MIN_SAMPLE_S / max(time.perf_counter() - t0, 1e-9))))
        for r in range(repeats):
            for key in list(items) if r % 2 == 0 else list(reversed(items)):
                fn, k = items[key], calls[key]
                t0 = time.perf_counter()
                for _ in range(k):
                    fn()
                samples[key].append((time.perf_counter() - t0) / k)
    decode = {n: Timing.of(samples[(n, 0, "decode")]) for n in rows}
    out = tuple(
        SamplerRow(rows=n, vocab=v, case=name, time=(t := Timing.of(samples[(n, v, name)])), share=t.median_s / decode[n].median_s)
        for n in rows for v in all_vocabs for name in CASES
    )
    return SamplerReport(model_vocab=model_vocab, repeats=repeats, decode=decode, rows=out)
