"""``batchc bench pipeline``: decode-step host cost, compiled pipeline vs. the mutable baseline.

One decode step's host work, for a running batch of ``B`` requests:

- compiled: build the ``DecodeContext`` from the sampled tokens and the new KV locations,
  ``prepare_for_decode``, ``lower``, ``stage_decode`` (pack the plan's columns into tensors);
- baseline: set ``output_ids``, ``ScheduleBatch.prepare_for_decode`` (as upstream: the per-request
  KV counters, in-place ``add_`` on ``seq_lens``, ``seq_lens_cpu`` and ``orig_seq_lens``),
  ``get_model_worker_batch`` (the per-forward copy, positions), and move each field to the device.

Both sides get the sampled tokens and KV locations precomputed (allocation and sampling are the
same work on both sides and are left out). The two sides run interleaved, repeat by repeat, so
machine noise hits both alike; the table reports the median per-step time of each and their ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch

from backend.staging import stage_decode
from compiler.baselines.mutable import ForwardMode, Req, ScheduleBatch
from compiler.manager import PassManager
from ir.batch import DecodeBatch
from ir.columns import frozen_i64
from ir.plan import DecodePlan
from passes.lower import LowerContext, lower
from passes.prepare_for_decode import DecodeContext, prepare_for_decode


@attrs.frozen(kw_only=True)
class PipelineRow:
    batch_size: int
    compiled_us: float
    compiled_verify_us: float
    baseline_us: float

    @property
    def ratio(self) -> float:
        return self.compiled_us / self.baseline_us


def _decode_batch(b: int) -> DecodeBatch:
    idx = np.arange(b, dtype=np.int64)
    return DecodeBatch(
        rids=frozen_i64(idx), slots=frozen_i64(idx + 1), seq_lens=frozen_i64(idx % 97 + 10),
        input_ids=frozen_i64(idx % 251), kv_locs=frozen_i64(idx + 1),
    )


def _schedule_batch(b: int) -> ScheduleBatch:
    sb = ScheduleBatch(reqs=[Req(rid=i, slot=i + 1, prompt=[1]) for i in range(b)], forward_mode=ForwardMode.DECODE)
    sb.req_pool_indices = torch.arange(1, b + 1, dtype=torch.int64)
    sb.seq_lens = torch.arange(b, dtype=torch.int64) % 97 + 10
    sb.seq_lens_cpu = sb.seq_lens.clone()
    sb.orig_seq_lens = sb.seq_lens.clone()
    sb.seq_lens_sum = int(sb.seq_lens.sum())
    sb.input_ids = torch.arange(b, dtype=torch.int64) % 251
    sb.out_cache_loc = torch.arange(1, b + 1, dtype=torch.int64)
    return sb


def _compiled_step(b: int, verify_level: int) -> Callable[[], object]:
    batch = _decode_batch(b)
    toks = frozen_i64(np.arange(b) % 251)
    kv = frozen_i64(np.arange(b) + b + 1)
    lctx = LowerContext()
    pm = PassManager(verify_level=verify_level)
    cpu = torch.device("cpu")

    def step() -> object:
        ctx = DecodeContext(next_tokens=toks, kv_locs=kv)
        d = pm.run(prepare_for_decode, batch, ctx)
        plan: DecodePlan = pm.run(lower, d, lctx)
        return stage_decode(plan, cpu)

    return step


def _baseline_step(b: int) -> Callable[[], object]:
    sb = _schedule_batch(b)
    toks = torch.arange(b, dtype=torch.int64) % 251
    kv = torch.arange(b, dtype=torch.int64) + b + 1
    cpu = torch.device("cpu")

    def step() -> object:
        sb.output_ids = toks
        sb.prepare_for_decode(kv)
        fb = sb.get_model_worker_batch()
        return tuple(t.to(cpu, non_blocking=True) for t in (fb.req_pool_indices, fb.input_ids, fb.positions, fb.out_cache_loc, fb.seq_lens))

    return step


def _time(step: Callable[[], object], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters * 1e6


def run_pipeline_bench(sizes: Sequence[int] = (1, 64, 256, 1024), repeats: int = 7, min_seconds: float = 0.02) -> list[PipelineRow]:
    rows = []
    for b in sizes:
        steps = {"compiled": _compiled_step(b, 0), "verify": _compiled_step(b, 1), "baseline": _baseline_step(b)}
        for s in steps.values():  # warm-up, and size the inner loop
            s()
        iters = max(10, int(min_seconds / max(_time(steps["baseline"], 10) * 1e-6, 1e-7)))
        samples: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(repeats):
            for k, s in steps.items():
                samples[k].append(_time(s, iters))
        rows.append(
            PipelineRow(
                batch_size=b,
                compiled_us=statistics.median(samples["compiled"]),
                compiled_verify_us=statistics.median(samples["verify"]),
                baseline_us=statistics.median(samples["baseline"]),
            )
        )
    return rows


def format_pipeline(rows: Sequence[PipelineRow]) -> list[list[str]]:
    out = []
    prev: PipelineRow | None = None
    for r in rows:
        growth = "" if prev is None else f"{r.compiled_us / prev.compiled_us:.2f}x for {r.batch_size / prev.batch_size:.0f}x"
        out.append(
            [
                str(r.batch_size),
                f"{r.compiled_us:.1f}",
                f"{r.compiled_verify_us:.1f}",
                f"{r.baseline_us:.1f}",
                f"{r.ratio:.2f}",
                f"{r.compiled_verify_us / r.baseline_us:.2f}",
                growth,
            ]
        )
        prev = r
    return out


PIPELINE_HEADERS = [
    "batch",
    "compiled us/step",
    "compiled+verify us/step",
    "mutable baseline us/step",
    "ratio",
    "ratio (verify)",
    "compiled growth",
]

