"""Shared column arithmetic of the passes (no IR construction policy here)."""

from __future__ import annotations

import numpy as np

from ir.batch import ExtendBatch
from ir.columns import I64, frozen_i64
from ir.sampling import SamplingRows, rows_take
from ir.spec import CommitBatch, DraftCommitBatch, DraftExtendBatch


def finished_prefill_rows(batch: ExtendBatch | DraftExtendBatch) -> tuple[I64, I64, I64, I64, I64]:
    """Decode-form columns of the requests whose prompt is complete after ``batch``.

    Returns ``(rids, slots, seq_lens, last_input_ids, last_kv_locs)``: each request's context holds
    ``prefix_len + extend_len`` tokens, the last of them at the end of its packed token span. A draft
    extend always completes its rows.
    """
    final = ~batch.more_chunks if isinstance(batch, ExtendBatch) else np.ones(batch.num_requests, dtype=np.bool_)
    last = np.cumsum(batch.extend_lens) - 1
    return (
        frozen_i64(batch.rids[final]),
        frozen_i64(batch.slots[final]),
        frozen_i64((batch.prefix_lens + batch.extend_lens)[final]),
        frozen_i64(batch.input_ids[last[final]]),
        frozen_i64(batch.kv_locs[last[final]]),
    )


def finished_prefill_sampling(batch: ExtendBatch | DraftExtendBatch) -> SamplingRows | None:
    """The sampling rows of ``finished_prefill_rows``'s requests (``None``: all greedy)."""
    if batch.sampling is None or not isinstance(batch, ExtendBatch):
        return batch.sampling
    return rows_take(batch.sampling, ~batch.more_chunks)


def committed_rows(batch: DraftCommitBatch | CommitBatch) -> tuple[I64, I64, I64, I64, I64]:
    """Decode-form columns after a speculative iteration: row ``i`` has committed its window's
    tokens ``0 .. accept_pos[i]``, so its context holds ``seq_lens[i] + accept_pos[i]`` tokens and
    its last fed token and KV location are the window's at ``accept_pos[i]``."""
    n, w = batch.num_requests, batch.k + 1
    at = np.arange(n, dtype=np.int64) * w + batch.accept_pos
    return (
        batch.rids,
        batch.slots,
        frozen_i64(batch.seq_lens + batch.accept_pos),
        frozen_i64(batch.input_ids[at]),
        frozen_i64(batch.kv_locs[at]),
    )
