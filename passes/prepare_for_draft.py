"""``prepare_for_draft``: running requests -> ``DraftBatch`` (speculative iteration, step 1).

Pre: ``batch`` is the running batch in its "last forward has run" state (``merge_batch`` output:
``seq_lens[i]`` tokens committed); ``ctx`` has, per row, the pending token (sampled after that
forward) and ``k + 1`` fresh KV locations for positions ``seq_lens[i] .. seq_lens[i] + k``; a
context bound to its rows (``ctx.rids``) is refused for a batch of other rows, naming both.
Post: a ``DraftBatch`` feeding each pending token at position ``seq_lens[i]`` (so its ``seq_lens``
are one larger), with the KV window flattened row-major; a fresh ``draft_id`` names the states its
proposal will keep, so a draft commit can only ever apply the states of the draft it pairs with.
"""

from __future__ import annotations

from typing import final

import attrs

from ir.batch import DecodeBatch
from ir.columns import I64, MAX_SEQ_LEN, REQUEST, WINDOW, ColumnNode, as_i64, build_unchecked, column, freeze, per
from ir.errors import PreconditionError
from ir.mint import mint_draft_id
from ir.spec import DraftBatch, check_k
from passes._args import bad_arg
from passes._rows import bound_rows, bound_rows_key, check_bound_rows, refuse_other_rows

__all__ = [
    "SpecContext",
    "prepare_for_draft",
]


@final
@attrs.frozen(kw_only=True)
class SpecContext(ColumnNode):
    """Per row, the pending token and the ``k + 1`` fresh KV locations of its window. ``rids``, when
    given, binds them to those requests, in that order (the engine always gives it):
    ``prepare_for_draft`` refuses the context for a running batch of other rows, naming both.
    Without it (a context written by hand) only the row count is checked."""

    k: int
    next_tokens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0))
    kv_locs: I64 = column(converter=as_i64, metadata=per(WINDOW, min=0))
    rids: I64 | None = attrs.field(default=None, converter=bound_rows, eq=bound_rows_key)
    """The requests whose pending tokens these are, in row order (``None``: not bound)."""

    def _check_first(self) -> None:
        check_k(self, self.k)  # an int in [1, MAX_SPEC_K], before any arithmetic on it

    def _check(self) -> None:
        check_bound_rows(self, self.rids, int(self.next_tokens.shape[0]), "next_tokens")


def prepare_for_draft(batch: DecodeBatch, ctx: SpecContext) -> DraftBatch:
    """The draft step of a speculative iteration over the running batch: each row feeds its pending
    token (``ctx.next_tokens``) at the position after its committed tokens, with the ``k + 1`` KV
    locations of its window flattened row-major, under a freshly minted ``draft_id`` that names the
    states the proposal keeps. Refused with ``PreconditionError``: arguments of other types, a ``ctx``
    bound to other rows (``ctx.rids``: named with the batch's), a ``ctx`` of another row count, a sequence with no room for ``k + 1`` more tokens under ``MAX_SEQ_LEN``."""
    if not isinstance(batch, DecodeBatch):
        raise bad_arg("prepare_for_draft", "batch", batch, "a DecodeBatch")
    if not isinstance(ctx, SpecContext):
        raise bad_arg("prepare_for_draft", "ctx", ctx, "a SpecContext")
    refuse_other_rows("prepare_for_draft", ctx.rids, batch.rids, "next tokens")
    n = batch.num_requests
    if ctx.next_tokens.shape[0] != n:
        raise PreconditionError("prepare_for_draft", f"ctx has {ctx.next_tokens.shape[0]} pending tokens for {n} rows")
    if n and int(batch.seq_lens.max()) > MAX_SEQ_LEN - ctx.k - 2:
        raise PreconditionError(
            "prepare_for_draft", f"a sequence of {int(batch.seq_lens.max())} tokens has no room for k + 1 = {ctx.k + 1} more under MAX_SEQ_LEN"
        )
    return build_unchecked(
        DraftBatch,
        k=ctx.k,
        draft_id=mint_draft_id(),
        rids=batch.rids,
        slots=batch.slots,
        seq_lens=freeze(batch.seq_lens + 1),
        input_ids=ctx.next_tokens,
        kv_locs=ctx.kv_locs,
        sampling=batch.sampling,
    )
