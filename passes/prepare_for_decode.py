"""``prepare_for_decode``: ``ExtendBatch | MixedBatch | DecodeBatch -> DecodeBatch``.

Pre: ``ctx`` has one next token and one fresh KV location per output request (the order below);
``DecodeContext`` checks that its columns have equal lengths and no negative entries. A context
bound to its rows (``ctx.rids``) is refused for other rows (another count, other requests, another
order), naming both: it would feed one request's token into another's slot.
Post: the output holds, in order, the requests of the extend part whose prompt is complete
(chunked requests stay with the scheduler for their next chunk), then the running decodes. Each
request's sequence length advances by one and it feeds ``ctx.next_tokens[i]`` with its KV at
``ctx.kv_locs[i]``.

The output type has no init field, so a prefill's one-shot init ops cannot follow the request into
decode: this is the type-level half of the fix for the stale-replay bug (init indices of a
finished prefill replayed on live state at every later step).
"""

from __future__ import annotations

from typing import final

import attrs
import numpy as np

from ir.batch import DecodeBatch, ExtendBatch, MixedBatch
from ir.columns import I64, MAX_SEQ_LEN, REQUEST, ColumnNode, as_i64, build_unchecked, column, freeze, per
from ir.errors import PreconditionError
from ir.sampling import rows_joined
from passes._args import bad_arg, unexpected_arg
from passes._rows import bound_rows, bound_rows_key, check_bound_rows, finished_prefill_rows, finished_prefill_sampling, refuse_other_rows

__all__ = [
    "DecodeContext",
    "prepare_for_decode",
]


@final
@attrs.frozen(kw_only=True)
class DecodeContext(ColumnNode):
    """What the forward that just ran produced: the sampled tokens and the KV locations allocated
    for them, one per request of the resulting decode batch. ``rids``, when given, binds them to
    those requests, in that order (the engine always gives it): ``prepare_for_decode`` refuses the
    context for a batch whose output rows are others, naming both. Without it (a context written
    by hand) only the row count is checked."""

    next_tokens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0))
    kv_locs: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0))
    rids: I64 | None = attrs.field(default=None, converter=bound_rows, eq=bound_rows_key)
    """The requests whose pending tokens these are, in row order (``None``: not bound)."""

    def _check(self) -> None:
        check_bound_rows(self, self.rids, int(self.next_tokens.shape[0]), "next_tokens")


def prepare_for_decode(batch: ExtendBatch | MixedBatch | DecodeBatch, ctx: DecodeContext) -> DecodeBatch:
    """The decode batch after the forward of ``batch``: the prefill rows whose prompt is complete,
    then the running decodes, each one token further, feeding ``ctx.next_tokens[i]`` with its KV at
    ``ctx.kv_locs[i]``. The output type has no init field, so a prefill's one-shot ops cannot follow
    its requests into decode. Refused with ``PreconditionError``: arguments of other types, a ``ctx``
    bound to other rows than the output's (``ctx.rids``: named with the output's), a ``ctx`` whose
    row count is not the output's, a sequence that would grow past ``MAX_SEQ_LEN``."""
    if not isinstance(ctx, DecodeContext):
        raise bad_arg("prepare_for_decode", "ctx", ctx, "a DecodeContext")
    match batch:
        case DecodeBatch():
            rids, slots, seq_lens = batch.rids, batch.slots, batch.seq_lens
            sampling = batch.sampling
        case ExtendBatch():
            rids, slots, seq_lens, _, _ = finished_prefill_rows(batch)
            sampling = finished_prefill_sampling(batch)
        case MixedBatch():
            e_rids, e_slots, e_lens, _, _ = finished_prefill_rows(batch.extend)
            d = batch.decode
            sampling = rows_joined(finished_prefill_sampling(batch.extend), e_rids.shape[0], d.sampling, d.num_requests)
            rids = freeze(np.concatenate((e_rids, d.rids)))
            slots = freeze(np.concatenate((e_slots, d.slots)))
            seq_lens = np.concatenate((e_lens, d.seq_lens))
        case _:
            unexpected_arg("prepare_for_decode", "batch", batch, "an ExtendBatch, a MixedBatch or a DecodeBatch")
    refuse_other_rows("prepare_for_decode", ctx.rids, rids, "next tokens")
    n = rids.shape[0]
    for name, col in (("next_tokens", ctx.next_tokens), ("kv_locs", ctx.kv_locs)):
        if col.shape[0] != n:
            raise PreconditionError(
                "prepare_for_decode", f"ctx.{name} has {col.shape[0]} entries for {n} decoding requests"
            )
    if n and int(seq_lens.max()) >= MAX_SEQ_LEN:
        raise PreconditionError("prepare_for_decode", f"a sequence of {int(seq_lens.max())} tokens cannot grow: MAX_SEQ_LEN is {MAX_SEQ_LEN}")
    # Every column comes from a checked node or context and ``seq_lens + 1`` stays in [1,
    # MAX_SEQ_LEN], so the local checks hold by construction (re-run by ``ir.verify``).
    return build_unchecked(
        DecodeBatch,
        rids=rids,
        slots=slots,
        seq_lens=freeze(seq_lens + 1),
        input_ids=ctx.next_tokens,
        kv_locs=ctx.kv_locs,
        sampling=sampling,
    )
