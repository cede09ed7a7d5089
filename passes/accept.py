"""``accept``: greedy verification of a ``VerifyBatch`` (step 3).

Pre: ``target_tokens`` holds the target's argmax at each of the ``k + 1`` verified positions of each
row, row-major (position ``j`` predicts the token after ``input_ids[j]``).
``batch`` must be a ``VerifyBatch`` and ``target_tokens`` a 1-D int64 numpy array of non-negative
token ids (a list, a float or unsigned array is refused, not converted: ``PreconditionError``).
Post: ``accepted[i]`` is the length of the longest prefix of row ``i``'s draft tokens equal to the
target's predictions, and ``bonus[i]`` the target's prediction after that prefix, so the row emits
``d1..dm, bonus``: exactly what plain greedy decoding of the target would emit (lossless). The
result is named by the batch's ``verify_id`` and rows (``rids``, in its order), so ``commit``
applies it to that verify only.
"""

from __future__ import annotations

import numpy as np

from ir.columns import I64, SMALL_COLUMN, build_unchecked, freeze, frozen_i64
from ir.errors import PreconditionError
from ir.spec import AcceptResult, VerifyBatch
from passes._args import bad_arg

__all__ = [
    "accept",
]


def accept(batch: VerifyBatch, target_tokens: I64) -> AcceptResult:
    """Greedy acceptance of a verify: per row, how many draft tokens the target agrees with and the
    target's token after them (``AcceptResult``, named by ``batch.verify_id`` and ``batch.rids``), so
    a row emits exactly what plain greedy decoding of the target would. ``target_tokens`` is the
    target's argmax at each of the ``k + 1`` positions of every row, row-major. Refused with
    ``PreconditionError``: a ``batch`` that is not a ``VerifyBatch``, ``target_tokens`` that is not
    a 1-D int64 numpy array of ``num_requests * (k + 1)`` non-negative ids (nothing is converted)."""
    if not isinstance(batch, VerifyBatch):
        raise bad_arg("accept", "batch", batch, "a VerifyBatch")
    if not isinstance(target_tokens, np.ndarray):
        raise bad_arg("accept", "target_tokens", target_tokens, "a 1-D int64 numpy array")
    n, k = batch.num_requests, batch.k
    if target_tokens.shape != (n * (k + 1),):
        raise PreconditionError("accept", f"expected {n * (k + 1)} target tokens, got shape {target_tokens.shape} for target_tokens")
    if target_tokens.dtype != np.int64:
        raise PreconditionError("accept", f"target_tokens must hold int64 token ids, got dtype {target_tokens.dtype}")
    if n and int(target_tokens.min()) < 0:
        raise PreconditionError("accept", f"negative target token {int(target_tokens.min())} in target_tokens")
    if n <= SMALL_COLUMN:
        return _accept_rows(batch, target_tokens.tolist())
    predicted = target_tokens.reshape(n, k + 1)
    drafts = batch.window(batch.input_ids)[:, 1:]
    matches = drafts == predicted[:, :k]
    # length of the all-True prefix: index of the first mismatch, or k
    accepted = np.where(matches.all(axis=1), k, np.argmin(matches, axis=1)).astype(np.int64)
    bonus = predicted[np.arange(n), accepted].astype(np.int64)
    # accepted is in [0, k] and bonus a subset of the checked (non-negative) target tokens, both
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
