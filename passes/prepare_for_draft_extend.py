"""``prepare_for_draft_extend``: ``CommitBatch`` -> ``DraftExtendBatch`` (step 5).

Pre: the commit has run on the target.
Post: each row extends the draft model over the tokens the target committed in this iteration,
``[pending, d1..dm]`` (``m = accept_pos[i]``), at positions ``seq_lens[i] - 1 ..``, with their KV
locations, starting from the draft's committed state after ``seq_lens[i] - 1`` tokens.

Only a ``CommitBatch`` is accepted: a draft extend built from a prefill batch (the engine bug this
library exists for copied a prefill's init indices into it) does not type-check, and the output
type has no init field.
"""

from __future__ import annotations

import numpy as np

from ir.columns import build_unchecked, freeze
from ir.spec import CommitBatch, DraftExtendBatch
from passes._args import bad_arg

__all__ = [
    "prepare_for_draft_extend",
]


def prepare_for_draft_extend(batch: CommitBatch) -> DraftExtendBatch:
    """The draft model's catch-up forward after the target's commit, for a draft that keeps no
    per-step states: each row extends over the tokens the target committed in this iteration, from
    the draft's committed state. Only a ``CommitBatch`` is accepted (``PreconditionError`` otherwise),
    and the output has no init field."""
    if not isinstance(batch, CommitBatch):
        raise bad_arg("prepare_for_draft_extend", "batch", batch, "a CommitBatch")
    k = batch.k
    keep = (np.arange(k + 1)[None, :] <= batch.accept_pos[:, None]).reshape(-1)
    return build_unchecked(
        DraftExtendBatch,
        rids=batch.rids,
        slots=batch.slots,
        prefix_lens=freeze(batch.seq_lens - 1),
        extend_lens=freeze(batch.accept_pos + 1),
        input_ids=freeze(batch.input_ids[keep]),
        kv_locs=freeze(batch.kv_locs[keep]),
        sampling=batch.sampling,
    )
