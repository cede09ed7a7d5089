"""``accept``: greedy verification of a ``VerifyBatch`` (step 3).

Pre: ``target_tokens`` holds the target's argmax at each of the ``k + 1`` verified positions of each
row, row-major (position ``j`` predicts the token after ``input_ids[j]``).
Post: ``accepted[i]`` is the length of the longest prefix of row ``i``'s draft tokens equal to the
target's predictions, and ``bonus[i]`` the target's prediction after that prefix, so the row emits
``d1..dm, bonus``: exactly what plain greedy decoding of the target would emit (lossless).
"""

from __future__ import annotations

import numpy as np

from ir._fields import I64, freeze
from ir.errors import PreconditionError
from ir.spec import AcceptResult, VerifyBatch


def accept(batch: VerifyBatch, target_tokens: I64) -> AcceptResult:
    n, k = batch.num_requests, batch.k
    if target_tokens.shape != (n * (k + 1),):
        raise PreconditionError("accept", f"expected {n * (k + 1)} target tokens, got shape {target_tokens.shape}")
    predicted = target_tokens.reshape(n, k + 1)
    drafts = batch.window(batch.input_ids)[:, 1:]
    matches = drafts == predicted[:, :k]
    # length of the all-True prefix: index of the first mismatch, or k
    accepted = np.where(matches.all(axis=1), k, np.argmin(matches, axis=1)).astype(np.int64)
    bonus = predicted[np.arange(n), accepted].astype(np.int64)
    return AcceptResult(accepted=freeze(accepted), bonus=freeze(bonus))
