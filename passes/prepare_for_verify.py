"""``prepare_for_verify``: ``DraftBatch`` + the draft's proposals -> ``VerifyBatch`` (step 2).

Pre: ``draft_tokens`` holds ``k`` proposed tokens per row, row-major: a 1-D int64 numpy array of
non-negative token ids (a list or another dtype is refused, not converted: ``PreconditionError``).
Post: each row verifies ``[pending, d1..dk]`` at positions ``seq_lens[i] - 1 ..`` over the same KV
window; a fresh ``verify_id`` names the intermediate states this verify will produce, so a commit
can only ever apply the states of the verify it was computed from. No init field exists here.
"""

from __future__ import annotations

import numpy as np

from ir.columns import I64, build_unchecked, freeze
from ir.errors import PreconditionError
from ir.init import mint_serial
from ir.spec import DraftBatch, VerifyBatch
from passes._args import bad_arg


def prepare_for_verify(batch: DraftBatch, draft_tokens: I64) -> VerifyBatch:
    if not isinstance(batch, DraftBatch):
        raise bad_arg("prepare_for_verify", "batch", batch, "a DraftBatch")
    if not isinstance(draft_tokens, np.ndarray):
        raise bad_arg("prepare_for_verify", "draft_tokens", draft_tokens, "a 1-D int64 numpy array")
    n, k = batch.num_requests, batch.k
    if draft_tokens.shape != (n * k,) or draft_tokens.dtype != np.int64:
        raise PreconditionError(
            "prepare_for_verify",
            f"expected {n * k} int64 draft tokens ({n} rows x k={k}), got {draft_tokens.dtype} {draft_tokens.shape} for draft_tokens",
        )
    if n and int(draft_tokens.min()) < 0:
        raise PreconditionError("prepare_for_verify", f"negative draft token {int(draft_tokens.min())} in draft_tokens")
    window = np.concatenate((batch.input_ids.reshape(n, 1), draft_tokens.reshape(n, k)), axis=1).reshape(-1)
    return build_unchecked(
        VerifyBatch,
        k=k,
        verify_id=mint_serial(),
        rids=batch.rids,
        slots=batch.slots,
        seq_lens=batch.seq_lens,
        input_ids=freeze(window),
        kv_locs=batch.kv_locs,
    )
