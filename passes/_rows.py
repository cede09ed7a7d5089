"""Shared column arithmetic of the passes (no IR construction policy here)."""

from __future__ import annotations

import numpy as np

from ir.batch import ExtendBatch
from ir.columns import I64, IntColumn, as_i64, check_column, column_key, frozen_i64, same_column
from ir.errors import PreconditionError
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


def rows_differ(theirs: I64, mine: I64, whose: str) -> str:
    """How the rows ``theirs`` (of a result or context) differ from ``mine`` (of ``whose``: "the
    verify", "the batch"), naming both: the counts, or the first row that differs (the lists shown
    are cut at 8 rows)."""
    a: list[int] = theirs.tolist()
    b: list[int] = mine.tolist()
    if len(a) != len(b):
        return f"{_count(len(a))} {a[:8]}, {whose} has {_count(len(b))} {b[:8]}"
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 0)
    return f"rows {a[:8]}, {whose}'s are {b[:8]} (row {i}: request {a[i]}, {whose}'s {b[i]})"


def _count(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def bound_rows(value: IntColumn | None) -> I64 | None:
    """Converter of a context's optional ``rids`` (the requests its columns are for): an int column,
    or ``None`` (a context not bound to rows)."""
    return None if value is None else as_i64(value)


def bound_rows_key(value: I64 | None) -> object:
    """Equality key of a context's optional ``rids`` (by contents, as a column's)."""
    return None if value is None else column_key(value)


def check_bound_rows(node: object, rids: I64 | None, n: int, what: str) -> None:
    """A context's ``rids``, when given: one int64 request id per row (``n`` = ``len(what)``)."""
    if rids is not None:
        check_column(node, "rids", rids, n, f"len({what})")


def refuse_other_rows(pass_name: str, ctx_rids: I64 | None, rids: I64, what: str) -> None:
    """``PreconditionError`` from ``pass_name`` when a context bound to rows (``ctx_rids``) is
    applied to a batch of other rows (another count, other requests or another order), naming both:
    its ``what`` (the pending tokens) would be fed to the wrong requests."""
    if ctx_rids is not None and not same_column(ctx_rids, rids):
        raise PreconditionError(
            pass_name, f"the context's {what} are for {rows_differ(ctx_rids, rids, 'the batch')}: each row is fed its own request's {what}"
        )
