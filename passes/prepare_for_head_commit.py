"""``prepare_for_head_commit``: ``CommitBatch`` + its verify's ``HiddenStates`` -> ``HeadCommitBatch``.

Pre: the commit has been computed from the verify whose result handed back ``hidden``
(``Verified.hidden`` of a ``VerifyPlan`` with ``keep_hidden``): kept by verify
``batch.verify_id``, for the commit's rows in order, from ``seq_lens[i] - 1`` on, ``k + 1``
positions each. States of another verify, of an extend, or of other rows or positions are refused
naming both values (``PreconditionError``).
Post: each row extends the head over the tokens the target committed in this iteration,
``[pending, d1..dm]`` (``m = accept_pos[i]``), at positions ``seq_lens[i] - 1 ..``, with their KV
locations, from the head's committed state after ``seq_lens[i] - 1`` tokens, paired with the
verify's hidden states at window positions ``0..m`` (``hidden_id``; the head carries position
``m``'s afterwards).

Only a ``CommitBatch`` is accepted, and the output type has no init field: a head commit built
from a prefill's batch (the upstream bug copied a prefill's clear/COW indices into the draft's
extend after verify) does not type-check, and is a ``PreconditionError`` at run time.
"""

from __future__ import annotations

import numpy as np

from ir.columns import build_unchecked, freeze
from ir.errors import PreconditionError
from ir.head import HeadCommitBatch
from ir.hidden import HiddenSource, HiddenStates
from ir.spec import CommitBatch
from passes._args import bad_arg
from passes._hidden import check_hidden_rows

__all__ = [
    "prepare_for_head_commit",
]


def prepare_for_head_commit(batch: CommitBatch, hidden: HiddenStates) -> HeadCommitBatch:
    """A draft head's commit of an iteration: each row extends the head over the tokens the target
    committed, paired with the hidden states its verify kept at those positions. ``hidden`` must be
    what the result of that verify handed back. Refused with ``PreconditionError`` naming both
    values: arguments of other types, hidden states of another verify or of an extend, or of other
    rows or positions."""
    if not isinstance(batch, CommitBatch):
        raise bad_arg("prepare_for_head_commit", "batch", batch, "a CommitBatch")
    if not isinstance(hidden, HiddenStates):
        raise bad_arg("prepare_for_head_commit", "hidden", hidden, "the HiddenStates the verify's result handed back")
    if hidden.source is not HiddenSource.VERIFY or hidden.verify_id != batch.verify_id:
        raise PreconditionError(
            "prepare_for_head_commit",
            f"{hidden.described()} cannot feed the head commit of verify #{batch.verify_id}: "
            "a head commit reads the hidden states of the verify its commit was computed from",
        )
    k = batch.k
    window = np.full(batch.num_requests, k + 1, dtype=np.int64)
    check_hidden_rows("prepare_for_head_commit", hidden, f"the commit of verify #{batch.verify_id}", batch.rids, batch.seq_lens - 1, window)
    keep = (np.arange(k + 1)[None, :] <= batch.accept_pos[:, None]).reshape(-1)
    return build_unchecked(
        HeadCommitBatch,
        k=k,
        hidden_id=hidden.hidden_id,
        rids=batch.rids,
        slots=batch.slots,
        prefix_lens=freeze(batch.seq_lens - 1),
        accept_pos=batch.accept_pos,
        extend_lens=freeze(batch.accept_pos + 1),
        input_ids=freeze(batch.input_ids[keep]),
        kv_locs=freeze(batch.kv_locs[keep]),
    )
