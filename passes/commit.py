"""``commit``: which intermediate target state each row commits after verify (step 4).

Pre: ``result`` was computed from ``batch`` (``passes.accept`` of it: the same ``verify_id``, the
same rows in the same order, ``accepted <= k``). A result of another verify, or of other rows
(another count, other requests, another order), is refused naming both values
(``PreconditionError``): applying it would commit one request's accepted position in another's slot.
Post: a ``CommitBatch`` committing row ``i``'s state at position ``accepted[i]`` (after consuming the
pending token and the accepted drafts) of the verify named by ``batch.verify_id``; the KV locations
of the rejected positions ``accepted[i] + 1 .. k`` are listed in ``released_kv``, in row order.
"""

from __future__ import annotations

import numpy as np

from ir.columns import build_unchecked, freeze, same_column
from ir.errors import PreconditionError
from ir.spec import AcceptResult, CommitBatch, VerifyBatch
from passes._args import bad_arg
from passes._rows import rows_differ

__all__ = [
    "commit",
]


def commit(batch: VerifyBatch, result: AcceptResult) -> CommitBatch:
    """The target's commit after a verify: row ``i`` commits the state the verify kept at position
    ``result.accepted[i]`` (named by ``batch.verify_id``), and the KV locations of the positions after
    it are listed in ``released_kv`` to be freed. ``result`` must be ``accept``'s of ``batch``.
    Refused with ``PreconditionError`` naming both values: arguments of other types, the result of
    another verify (``verify_id``), of other rows (``rids``: another count, other requests or
    another order), or one accepting more than ``k`` drafts."""
    if not isinstance(batch, VerifyBatch):
        raise bad_arg("commit", "batch", batch, "a VerifyBatch")
    if not isinstance(result, AcceptResult):
        raise bad_arg("commit", "result", result, "an AcceptResult")
    if result.verify_id != batch.verify_id:
        raise PreconditionError(
            "commit",
            f"the accept result of verify #{result.verify_id} cannot commit verify #{batch.verify_id}: "
            "a commit applies the result of the verify it judged",
        )
    if not same_column(result.rids, batch.rids):
        raise PreconditionError(
            "commit",
            f"the accept result of verify #{result.verify_id} judged {rows_differ(result.rids, batch.rids, 'the verify')}: "
            "a commit applies each row's result to that row",
        )
    n, k = batch.num_requests, batch.k
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

