"""``commit``: which intermediate target state each row commits after verify (step 4).

Pre: ``result`` was computed from ``batch`` (one entry per row, ``accepted <= k``).
Post: a ``CommitBatch`` committing row ``i``'s state at position ``accepted[i]`` (after consuming the
pending token and the accepted drafts) of the verify named by ``batch.verify_id``; the KV locations
of the rejected positions ``accepted[i] + 1 .. k`` are listed in ``released_kv``, in row order.
"""

from __future__ import annotations

import numpy as np

from ir.columns import build_unchecked, freeze
from ir.errors import PreconditionError
from ir.spec import AcceptResult, CommitBatch, VerifyBatch
from passes._args import bad_arg

__all__ = [
    "commit",
]


def commit(batch: VerifyBatch, result: AcceptResult) -> CommitBatch:
    """The target's commit after a verify: row ``i`` commits the state the verify kept at position
    ``result.accepted[i]`` (named by ``batch.verify_id``), and the KV locations of the positions after
    it are listed in ``released_kv`` to be freed. Refused with ``PreconditionError``: arguments of
    other types, a result with another row count, or one accepting more than ``k`` drafts."""
    if not isinstance(batch, VerifyBatch):
        raise bad_arg("commit", "batch", batch, "a VerifyBatch")
    if not isinstance(result, AcceptResult):
        raise bad_arg("commit", "result", result, "an AcceptResult")
    n, k = batch.num_requests, batch.k
    if result.accepted.shape[0] != n:
        raise PreconditionError("commit", f"accept result has {result.accepted.shape[0]} rows, the verify {n}")
    if n and int(result.accepted.max()) > k:
        raise PreconditionError("commit", f"accepted {int(result.accepted.max())} > k={k}")
    keep = np.arange(k + 1)[None, :] <= result.accepted[:, None]
    released = batch.window(batch.kv_locs)[~keep]
    return build_unchecked(
        CommitBatch,
        k=k,
        verify_id=batch.verify_id,
        draft_id=batch.draft_id,
        rids=batch.rids,
        slots=batch.slots,
        seq_lens=batch.seq_lens,
        accept_pos=result.accepted,
        input_ids=batch.input_ids,
        kv_locs=batch.kv_locs,
        released_kv=freeze(np.ascontiguousarray(released)),
        sampling=batch.sampling,
    )
