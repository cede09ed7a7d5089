"""``filter_batch``: drop finished or aborted requests from a batch.

Pre: ``batch`` is an ``ExtendBatch`` or a ``DecodeBatch``; ``drop`` is an iterable of request ids
(Python ints or numpy integers within int64, or a 1-D integer numpy array); ``bool``, ``float``,
``str``, ``None`` and out-of-int64 entries, a ``str`` or ``bytes`` as a whole, and a non-iterable are
refused with ``PreconditionError`` naming the argument and the value (``True`` is not rid 1). Ids in
``drop`` that are not in the batch are ignored (the scheduler may pass its whole finished set).
Post: the output has the same type and keeps the order of the remaining requests; when nothing is
dropped the input object itself is returned. For an ``ExtendBatch`` the dropped requests' init ops
go with them, and the ``MambaInit`` keeps its serial (it is still "the init of this forward": if
the unfiltered batch already ran, the filtered one's ops count as a replay), or becomes ``None``
when no op is left. The sampling rows (when the batch has them) keep the remaining requests' rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar, assert_never

import numpy as np

from ir.batch import DecodeBatch, ExtendBatch
from ir.columns import I64, INT64_MAX, SMALL_COLUMN, BoolArray, build_unchecked, first_bad_int, frozen_i64
from ir.errors import PreconditionError, short_repr
from ir.ids import RequestId
from ir.init import MambaInit, MambaSnapshot
from ir.sampling import rows_take
from passes._args import bad_arg

__all__ = [
    "filter_batch",
]

B = TypeVar("B", ExtendBatch, DecodeBatch)


_DROP = "an iterable of request ids (ints)"


def _drop_ids(drop: object, pass_name: str = "filter_batch") -> I64:
    """``drop`` as an int64 array, every entry checked (``first_bad_int``: plain ints in C loops);
    a refusal names ``pass_name``."""
    if isinstance(drop, np.ndarray):
        if drop.ndim != 1 or drop.dtype.kind not in "iu":
            raise PreconditionError(
                pass_name, f"drop must be {_DROP}, got an ndarray of dtype {drop.dtype} and shape {drop.shape} ({short_repr(drop)})"
            )
        if drop.dtype.kind == "u" and drop.size and int(drop.max()) > INT64_MAX:
            raise PreconditionError(pass_name, f"drop: every entry must fit in int64 (got {int(drop.max())})")
        return drop.astype(np.int64, copy=False)
    if isinstance(drop, (str, bytes, bytearray)) or not isinstance(drop, Iterable):
        raise bad_arg(pass_name, "drop", drop, _DROP)
    items = tuple(drop)
    bad = first_bad_int(items)
    if bad is not None:
        raise PreconditionError(pass_name, f"drop: every entry {bad[1]} (got {short_repr(bad[0])})")
    return np.array(items, dtype=np.int64)


def _keep_mask(rids: I64, drop: I64) -> BoolArray:
    if rids.shape[0] + drop.shape[0] <= 2 * SMALL_COLUMN:  # a Python set (``np.isin`` sorts: its fixed cost dominates there)
        dropped = set(drop.tolist())
        return np.array([r not in dropped for r in rids.tolist()], dtype=np.bool_)
    return ~np.isin(rids, drop)


def filter_batch(batch: B, drop: Iterable[RequestId]) -> B:
    """``batch`` without the requests in ``drop`` (finished or aborted), of the same type and in the
    same order; ``batch`` itself when nothing is dropped (ids not in the batch are ignored). A prefill's
    dropped requests take their init and snapshot ops with them; what is left keeps its serial, so a
    filtered copy of a batch that already ran is still a replay to the ledger. Refused with
    ``PreconditionError``: a batch other than an ``ExtendBatch`` or a ``DecodeBatch``, a ``drop`` that
    is not an iterable of int64 integers (``True`` is not rid 1; a ``str`` is not an iterable of ids)."""
    if not isinstance(batch, (DecodeBatch, ExtendBatch)):
        raise bad_arg("filter_batch", "batch", batch, "an ExtendBatch or a DecodeBatch")
    ids = _drop_ids(drop)
    if ids.shape[0] == 0:
        return batch
    keep = _keep_mask(batch.rids, ids)
    if keep.all():
        return batch
    match batch:
        case DecodeBatch():
            # rows of a checked batch, kept whole: every local check still holds
            return build_unchecked(
                DecodeBatch,
                rids=frozen_i64(batch.rids[keep]),
                slots=frozen_i64(batch.slots[keep]),
                seq_lens=frozen_i64(batch.seq_lens[keep]),
                input_ids=frozen_i64(batch.input_ids[keep]),
                kv_locs=frozen_i64(batch.kv_locs[keep]),
                sampling=rows_take(batch.sampling, keep),
            )
        case ExtendBatch():
            return _filter_extend(batch, keep)
        case _:
            assert_never(batch)


def _filter_extend(batch: ExtendBatch, keep: BoolArray) -> ExtendBatch:
    token_keep = np.repeat(keep, batch.extend_lens)
    intents = tuple(i for i, k in zip(batch.intents, keep, strict=True) if k)
    init = batch.init
    if init is not None:
        kept_slots = frozenset(int(s) for s in batch.slots[keep])
        pairs = [(s, d) for s, d in zip(init.cow_src, init.cow_dst, strict=True) if d in kept_slots]
        clears = [s for s in init.clear_slots if s in kept_slots]
        init = (
            MambaInit(serial=init.serial, clear_slots=clears, cow_src=[p[0] for p in pairs], cow_dst=[p[1] for p in pairs])
            if clears or pairs
            else None
        )
    snapshot = batch.snapshot
    if snapshot is not None:
        kept = frozenset(int(s) for s in batch.slots[keep])
        at = snapshot.at or (0,) * len(snapshot.src)  # kept aligned with the pairs (none when all at the end)
        triples = [(a, b, t) for a, b, t in zip(snapshot.src, snapshot.dst, at, strict=True) if a in kept]
        snapshot = MambaSnapshot(
            serial=snapshot.serial, src=[a for a, _, _ in triples], dst=[b for _, b, _ in triples],
            at=[t for _, _, t in triples] if snapshot.at else (),
        ) if triples else None
    return ExtendBatch(
        rids=frozen_i64(batch.rids[keep]),
        slots=frozen_i64(batch.slots[keep]),
        prefix_lens=frozen_i64(batch.prefix_lens[keep]),
        extend_lens=frozen_i64(batch.extend_lens[keep]),
        more_chunks=batch.more_chunks[keep],
        intents=intents,
        input_ids=frozen_i64(batch.input_ids[token_keep]),
        kv_locs=frozen_i64(batch.kv_locs[token_keep]),
        init=init,
        snapshot=snapshot,
        sampling=rows_take(batch.sampling, keep),
    )
