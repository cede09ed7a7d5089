"""``accept``: greedy verification of a ``VerifyBatch`` (step 3).

Pre: ``verified`` is the ``Verified`` result of ``batch``'s own forward (the same ``verify_id``,
the same rows in the same order, the same ``k``): the target's argmax at each of the ``k + 1``
verified positions of each row, row-major (position ``j`` predicts the token after
``input_ids[j]``), ``NON_FINITE`` where the logits there were not finite. The target tokens of
another verify, of other rows or of another window are refused in one ``PreconditionError`` naming
both values: judging a verify with them would accept one request's drafts by another's predictions.
Post: ``accepted[i]`` is the length of the longest prefix of row ``i``'s draft tokens equal to the
target's predictions, and ``bonus[i]`` the target's prediction after that prefix, so the row emits
``d1..dm, bonus``: exactly what plain greedy decoding of the target would emit (lossless). A
``NON_FINITE`` prediction never equals a draft token (ids are >= 0), so acceptance stops there at
the latest and that row's bonus is ``NON_FINITE``. The result is named by the batch's
``verify_id`` and rows (``rids``, in its order), so ``commit`` applies it to that verify only.
"""

from __future__ import annotations

import numpy as np

from ir.columns import SMALL_COLUMN, build_unchecked, freeze, frozen_i64, same_column
from ir.errors import PreconditionError
from ir.results import Verified
from ir.spec import AcceptResult, VerifyBatch
from passes._args import bad_arg
from passes._rows import rows_differ

__all__ = [
    "accept",
]


def accept(batch: VerifyBatch, verified: Verified) -> AcceptResult:
    """Greedy acceptance of a verify: per row, how many draft tokens the target agrees with and the
    target's token after them (``AcceptResult``, named by ``batch.verify_id`` and ``batch.rids``), so
    a row emits exactly what plain greedy decoding of the target would. ``verified`` is what the
    target's run of ``batch``'s plan gave back: its argmax at each of the ``k + 1`` positions of
    every row, row-major (``NON_FINITE`` is never accepted, and is the bonus where it is reached).
    Refused with ``PreconditionError``: arguments of other types, and in one error naming both
    values, the target tokens of another verify (``verify_id``), of other rows (``rids``: another
    count, other requests or another order) or of another window (``k``)."""
    if not isinstance(batch, VerifyBatch):
        raise bad_arg("accept", "batch", batch, "a VerifyBatch")
    if not isinstance(verified, Verified):
        raise bad_arg("accept", "verified", verified, "the Verified result of the batch's verify")
    mine = f"verify #{batch.verify_id}"
    if verified.verify_id != batch.verify_id:
        raise PreconditionError(
            "accept",
            f"the target tokens of verify #{verified.verify_id} cannot judge {mine}: a verify's drafts are judged by its own target tokens",
        )
    if not same_column(verified.rids, batch.rids):
        raise PreconditionError(
            "accept",
            f"the target tokens of verify #{verified.verify_id} are for {rows_differ(verified.rids, batch.rids, 'the verify')}: "
            "each row's drafts are judged by that row's target tokens",
        )
    if verified.k != batch.k:
        raise PreconditionError("accept", f"the target tokens of verify #{verified.verify_id} have a window of k={verified.k}, {mine} has k={batch.k}")
    n, k = batch.num_requests, batch.k
    target_tokens = verified.tokens
    if target_tokens.shape != (n * (k + 1),):  # (a node built unchecked: the checked one holds n * (k + 1))
        raise PreconditionError("accept", f"expected {n * (k + 1)} target tokens, got shape {target_tokens.shape}")
    if n <= SMALL_COLUMN:
        return _accept_rows(batch, target_tokens.tolist())
    predicted = target_tokens.reshape(n, k + 1)
    drafts = batch.window(batch.input_ids)[:, 1:]
    matches = drafts == predicted[:, :k]
    # length of the all-True prefix: index of the first mismatch, or k
    accepted = np.where(matches.all(axis=1), k, np.argmin(matches, axis=1)).astype(np.int64)
    bonus = predicted[np.arange(n), accepted].astype(np.int64)
    # accepted is in [0, k] and bonus a subset of the checked target tokens (>= NON_FINITE), both
    # IR-owned, and the id and rows are the checked batch's: the local checks hold by construction
    return build_unchecked(AcceptResult, verify_id=batch.verify_id, rids=batch.rids, accepted=freeze(accepted), bonus=freeze(bonus))


def _accept_rows(batch: VerifyBatch, targets: list[int]) -> AcceptResult:
    """``accept`` of a few rows in Python (numpy's dozen calls cost more than the loop there), the
    same result: row ``i``'s window is ``batch.input_ids[i * (k + 1) :]`` (``[pending, d1..dk]``) and its
    predictions ``targets[i * (k + 1) :]``; draft ``j + 1`` is accepted while it equals prediction ``j``."""
    window: list[int] = batch.input_ids.tolist()
    n, k = batch.num_requests, batch.k
    w = k + 1
    accepted: list[int] = []
    bonus: list[int] = []
    for base in range(0, n * w, w):
        m = 0
        while m < k and window[base + 1 + m] == targets[base + m]:
            m += 1
        accepted.append(m)
        bonus.append(targets[base + m])
    return build_unchecked(AcceptResult, verify_id=batch.verify_id, rids=batch.rids, accepted=frozen_i64(accepted), bonus=frozen_i64(bonus))
