"""``prepare_for_head_extend``: a prefill's ``ExtendBatch`` + its ``HiddenStates`` -> ``HeadExtendBatch``.

Pre: ``hidden`` is the handle the target's forward of ``batch`` handed back (``Sampled.hidden`` of
its ``ExtendPlan`` with ``keep_hidden``, or of a ``MixedPlan``'s extend part): kept by an extend,
for the batch's rows in order, from ``prefix_lens[i]`` on, ``extend_lens[i]`` positions each.
States of a verify, of other rows or of another chunk (other positions) are refused naming both
values (``PreconditionError``); anything but a ``HiddenStates`` is a mypy ``arg-type`` error and a
``PreconditionError`` at run time.
Post: the head extends over the chunk's tokens and KV locations with those states (``hidden_id``),
and carries the prefill's own one-shot ops (``init``, ``snapshot``: the same ops, same serials):
the first time the head pool sees these rows it is cleared, copied and snapshotted exactly as the
target's pool is. Lowering gives the ops to the head pool(s) only
(``passes.lower.LowerContext.head_pools``).
"""

from __future__ import annotations

from ir.batch import ExtendBatch
from ir.columns import build_unchecked
from ir.errors import PreconditionError
from ir.head import HeadExtendBatch
from ir.hidden import HiddenSource, HiddenStates
from passes._args import bad_arg
from passes._hidden import check_hidden_rows

__all__ = [
    "prepare_for_head_extend",
]


def prepare_for_head_extend(batch: ExtendBatch, hidden: HiddenStates) -> HeadExtendBatch:
    """A draft head's forward over a prefill chunk, with the target's hidden states of that chunk: it
    carries the prefill's own init and snapshot ops (same ops, same serials), so the head's pool starts
    every row exactly as the target's does; lowering addresses them to the head's pools only.
    ``hidden`` must be what the target's forward of ``batch`` handed back. Refused with
    ``PreconditionError`` naming both values: arguments of other types, hidden states of a verify,
    of other rows or of another chunk."""
    if not isinstance(batch, ExtendBatch):
        raise bad_arg("prepare_for_head_extend", "batch", batch, "an ExtendBatch (a prefill's)")
    if not isinstance(hidden, HiddenStates):
        raise bad_arg("prepare_for_head_extend", "hidden", hidden, "the HiddenStates the prefill's result handed back")
    if hidden.source is not HiddenSource.EXTEND:
        raise PreconditionError(
            "prepare_for_head_extend",
            f"{hidden.described()} cannot feed a head extend: it reads the states of the prefill chunk it follows "
            "(a verify's feed prepare_for_head_commit)",
        )
    check_hidden_rows("prepare_for_head_extend", hidden, "the extend", batch.rids, batch.prefix_lens, batch.extend_lens)
    # every column is the checked batch's own (read-only, shared), the ops are its own objects
    return build_unchecked(
        HeadExtendBatch,
        hidden_id=hidden.hidden_id,
        rids=batch.rids,
        slots=batch.slots,
        prefix_lens=batch.prefix_lens,
        extend_lens=batch.extend_lens,
        intents=batch.intents,
        input_ids=batch.input_ids,
        kv_locs=batch.kv_locs,
        init=batch.init,
        snapshot=batch.snapshot,
    )
