"""``merge_batch``: running decode batch + newly prefilled requests -> ``DecodeBatch``.

Pre: ``prefilled`` has run its forward; no request id or slot is in both inputs.
Post: the running requests, then the prefilled requests whose prompt is complete, in order. Each
prefilled request enters in the state "its last forward has run": ``seq_len`` is the tokens now in
its context and ``input_ids``/``kv_locs`` are those of its last prompt token; ``prepare_for_decode``
then advances every row the same way. Chunked requests (``more_chunks``) are not merged. A
``DraftCommitBatch``, ``DraftExtendBatch`` or (with a draft head, whose commit is its own phase)
the target's ``CommitBatch`` (the end of a speculative iteration) enters the same
way: each row with the tokens it committed in the iteration. The rows' sampling parameters come
along in the same order. An empty
``prefilled`` contribution returns ``running`` itself.

The output is a ``DecodeBatch``: a prefill's ``MambaInit`` has nowhere to go (in the engine this pass
models, ``merge_batch`` carried the stale init indices into the running batch).
"""

from __future__ import annotations

import numpy as np

from ir.batch import DecodeBatch, ExtendBatch
from ir.columns import build_unchecked, first_common, freeze
from ir.errors import PreconditionError
from ir.sampling import SamplingRows, rows_joined
from ir.spec import CommitBatch, DraftCommitBatch, DraftExtendBatch
from passes._args import bad_arg
from passes._rows import committed_rows, finished_prefill_rows, finished_prefill_sampling

__all__ = [
    "merge_batch",
]


def merge_batch(running: DecodeBatch, prefilled: ExtendBatch | DraftCommitBatch | CommitBatch | DraftExtendBatch | DecodeBatch) -> DecodeBatch:
    """The running decode batch with the rows of ``prefilled`` appended, each in the state "its last
    forward has run": a prefill's requests whose prompt is complete (chunked ones are not merged), or
    the rows of the commit that ended a speculative iteration; ``running`` itself when nothing is
    added. The result is a ``DecodeBatch``, which has no field for a prefill's init ops. Refused with
    ``PreconditionError``: arguments of other types, a request id or slot in both inputs."""
    if not isinstance(running, DecodeBatch):
        raise bad_arg("merge_batch", "running", running, "a DecodeBatch")
    sampling: SamplingRows | None
    if isinstance(prefilled, (ExtendBatch, DraftExtendBatch)):
        rids, slots, seq_lens, input_ids, kv_locs = finished_prefill_rows(prefilled)
        sampling = finished_prefill_sampling(prefilled)
    elif isinstance(prefilled, (DraftCommitBatch, CommitBatch)):
        rids, slots, seq_lens, input_ids, kv_locs = committed_rows(prefilled)
        sampling = prefilled.sampling
    elif isinstance(prefilled, DecodeBatch):
        rids, slots, seq_lens = prefilled.rids, prefilled.slots, prefilled.seq_lens
        input_ids, kv_locs = prefilled.input_ids, prefilled.kv_locs
        sampling = prefilled.sampling
    else:
        raise bad_arg("merge_batch", "prefilled", prefilled, "an ExtendBatch, a DraftCommitBatch, a CommitBatch, a DraftExtendBatch or a DecodeBatch")
    if rids.shape[0] == 0:
        return running
    for name, a, b in (("request id", running.rids, rids), ("slot", running.slots, slots)):
        both = first_common(a, b)
        if both is not None:
            raise PreconditionError("merge_batch", f"{name} {both} is in both the running and the prefilled batch")
    joined = rows_joined(running.sampling, running.num_requests, sampling, rids.shape[0])
    if running.num_requests == 0:  # (a speculative step's new running batch): the rows themselves, IR-owned already
        return build_unchecked(DecodeBatch, rids=rids, slots=slots, seq_lens=seq_lens, input_ids=input_ids, kv_locs=kv_locs, sampling=joined)
    # rows of checked nodes, with no request id or slot in both (checked above): every local check
    # of the output holds, so it is built without re-running them (``ir.verify`` still does)
    return build_unchecked(
        DecodeBatch,
        rids=freeze(np.concatenate((running.rids, rids))),
        slots=freeze(np.concatenate((running.slots, slots))),
        seq_lens=freeze(np.concatenate((running.seq_lens, seq_lens))),
        input_ids=freeze(np.concatenate((running.input_ids, input_ids))),
        kv_locs=freeze(np.concatenate((running.kv_locs, kv_locs))),
        sampling=joined,
    )
