"""``prepare_for_verify``: ``DraftBatch`` + that draft's ``Proposals`` -> ``VerifyBatch`` (step 2).

Pre: ``proposals`` are what the draft step of ``batch`` proposed (``Proposals.draft_id ==
batch.draft_id``, ``k`` tokens for each of its rows): the value the draft executor returned for the
batch's ``DraftPlan``. Tokens from anywhere else are not ``Proposals`` (a mypy ``arg-type`` error,
``PreconditionError`` at run time), and another draft's proposals are refused naming both drafts.
Post: each row verifies ``[pending, d1..dk]`` at positions ``seq_lens[i] - 1 ..`` over the same KV
window; a fresh ``verify_id`` names the intermediate states this verify will produce, so a commit
can only ever apply the states of the verify it was computed from, and ``draft_id`` names the draft
it checks, so the draft commit after it can only commit that draft's states. No init field exists here.
"""

from __future__ import annotations

import numpy as np

from ir.columns import build_unchecked, freeze
from ir.errors import PreconditionError
from ir.mint import mint_verify_id
from ir.spec import DraftBatch, Proposals, VerifyBatch
from passes._args import bad_arg

__all__ = [
    "prepare_for_verify",
]


def prepare_for_verify(batch: DraftBatch, proposals: Proposals) -> VerifyBatch:
    """The target's verify of a draft step: each row scores ``[pending, d1..dk]`` over the draft's KV
    window, under a freshly minted ``verify_id`` that names the intermediate states it produces, and
    ``draft_id`` names the draft it checks. ``proposals`` must be what the draft step of ``batch``
    returned. Refused with ``PreconditionError``: arguments of other types, the proposals of another
    draft, or of another ``k`` or row count."""
    if not isinstance(batch, DraftBatch):
        raise bad_arg("prepare_for_verify", "batch", batch, "a DraftBatch")
    if not isinstance(proposals, Proposals):
        raise bad_arg("prepare_for_verify", "proposals", proposals, "the Proposals the draft step returned")
    if proposals.draft_id != batch.draft_id:
        raise PreconditionError(
            "prepare_for_verify",
            f"the proposals of draft #{proposals.draft_id} cannot be verified against draft #{batch.draft_id}: "
            "a verify checks the proposals of the draft it follows",
        )
    n, k = batch.num_requests, batch.k
    draft_tokens = proposals.tokens
    if proposals.k != k or draft_tokens.shape != (n * k,):
        raise PreconditionError(
            "prepare_for_verify",
            f"the proposals of draft #{proposals.draft_id} hold {draft_tokens.shape[0]} tokens with k={proposals.k}; "
            f"the draft has {n} rows x k={k}",
        )
    # (Proposals checked its tokens: int64, non-negative)
    window = np.concatenate((batch.input_ids.reshape(n, 1), draft_tokens.reshape(n, k)), axis=1).reshape(-1)
    return build_unchecked(
        VerifyBatch,
        k=k,
        verify_id=mint_verify_id(),
        draft_id=batch.draft_id,
        rids=batch.rids,
        slots=batch.slots,
        seq_lens=batch.seq_lens,
        input_ids=freeze(window),
        kv_locs=batch.kv_locs,
        sampling=batch.sampling,
    )
