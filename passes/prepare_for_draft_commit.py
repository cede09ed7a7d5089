"""``prepare_for_draft_commit``: ``CommitBatch`` + the iteration's ``DraftBatch`` -> ``DraftCommitBatch`` (step 5).

Pre: ``batch`` is the target's commit of the verify built from ``draft``'s proposals
(``batch.draft_id == draft.draft_id``; same requests, slots, sequence lengths, ``k`` and KV window,
row for row).
Post: each row commits the draft state its proposal kept at position ``accept_pos[i]``: the state
after consuming ``[pending, d1..dm]``, the tokens the target accepted. The draft's proposal fed
exactly those tokens, so this is the state a catch-up forward over them would compute, and no draft
forward runs. ``draft_id`` names the proposal's kept states; the window columns are the verified ones.

Only a ``CommitBatch`` and a ``DraftBatch`` are accepted and the output type has no init field, so
a prefill's init indices cannot reach the draft's state through this pass (``PreconditionError``
for anything else, or for a draft of other rows).
"""

from __future__ import annotations

from ir.columns import build_unchecked, same_column
from ir.errors import PreconditionError
from ir.spec import CommitBatch, DraftBatch, DraftCommitBatch
from passes._args import bad_arg

__all__ = [
    "prepare_for_draft_commit",
]


def prepare_for_draft_commit(batch: CommitBatch, draft: DraftBatch) -> DraftCommitBatch:
    """The draft's commit of an iteration: each row's draft state becomes the one its proposal kept
    after the accepted tokens, so no draft forward runs. ``draft`` must be the ``DraftBatch`` whose
    proposals the commit's verify checked. Refused with ``PreconditionError``: arguments of other
    types, a draft of another ``draft_id`` or ``k``, or of other rows, slots, lengths or KV windows."""
    if not isinstance(batch, CommitBatch):
        raise bad_arg("prepare_for_draft_commit", "batch", batch, "a CommitBatch")
    if not isinstance(draft, DraftBatch):
        raise bad_arg("prepare_for_draft_commit", "draft", draft, "a DraftBatch")
    if batch.draft_id != draft.draft_id:
        raise PreconditionError(
            "prepare_for_draft_commit",
            f"the commit of verify #{batch.verify_id} checked the proposals of draft #{batch.draft_id}, not those of draft #{draft.draft_id}: "
            "a draft commit pairs a commit with the draft whose proposals its verify checked",
        )
    if batch.k != draft.k:
        raise PreconditionError("prepare_for_draft_commit", f"the commit has k={batch.k}, the draft #{draft.draft_id} k={draft.k}")
    pairs = (("rids", batch.rids, draft.rids), ("slots", batch.slots, draft.slots),
             ("seq_lens", batch.seq_lens, draft.seq_lens), ("kv_locs", batch.kv_locs, draft.kv_locs))
    for name, mine, theirs in pairs:
        if not same_column(mine, theirs):
            raise PreconditionError(
                "prepare_for_draft_commit",
                f"the commit's {name} {mine.tolist()[:8]} are not those of draft #{draft.draft_id} ({theirs.tolist()[:8]}): "
                "a draft commit pairs a commit with the draft of its own iteration",
            )
    # every column is the commit's or the draft's, both checked nodes of the same rows
    return build_unchecked(
        DraftCommitBatch,
        k=batch.k,
        draft_id=draft.draft_id,
        rids=batch.rids,
        slots=batch.slots,
        seq_lens=batch.seq_lens,
        accept_pos=batch.accept_pos,
        input_ids=batch.input_ids,
        kv_locs=batch.kv_locs,
        sampling=batch.sampling,
    )
