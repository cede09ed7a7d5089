"""``prepare_for_extend``: admitted requests -> ``ExtendBatch`` with its ``MambaInit``.

Pre: ``requests`` is a list or tuple (any ``Sequence`` but a ``str``/``bytes``) of at least one
``AdmittedRequest`` (else ``PreconditionError`` naming the argument and what it got); rids, slots
and KV locations distinct (checked by the verifier).
Post: the batch's columns follow the request order; ``init`` holds one clear per ``Clear()``
request and one COW ``src -> slot`` per ``CopyFrom(src=...)`` request, in request order, under a
freshly minted serial, or is ``None`` when every request is a chunked continuation (``Continue``).

Requests with ``snapshot_to`` contribute a ``MambaSnapshot`` (their slot -> that cache slot, after
the forward) under its own serial; its ``at`` is empty when every snapshot is at its chunk's end,
else every request's ``snapshot_len``.

``sampling`` (optional) is the requests' sampling parameters, one row per request in their order:
the batch carries it (its constructor refuses another row count); ``None``: every row greedy.

Minting serials is the pass's one impurity: it is what makes the init ops of this forward a
linear resource with an identity that survives copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import assert_never

import numpy as np

from ir.batch import ExtendBatch
from ir.columns import frozen_i64
from ir.errors import PreconditionError
from ir.ids import MambaSlot
from ir.init import MambaInit, MambaSnapshot, mint_serial
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.sampling import SamplingRows
from passes._args import bad_arg

__all__ = [
    "prepare_for_extend",
]


def prepare_for_extend(requests: Sequence[AdmittedRequest], sampling: SamplingRows | None = None) -> ExtendBatch:
    """The prefill batch of admitted requests, in their order, with its one-shot ops: a ``MambaInit``
    under a freshly minted serial (one clear per ``Clear()``, one copy per ``CopyFrom``; ``None`` when
    every request continues a chunked prefill) and a ``MambaSnapshot`` for the requests with
    ``snapshot_to``. ``sampling``: one row per request (``None``: every row greedy). Refused with
    ``PreconditionError``: a ``requests`` that is not a non-empty sequence of ``AdmittedRequest``, a
    ``sampling`` of another type."""
    arg: object = requests  # typed; checked because callers need not be typed
    kind = type(arg)
    if kind is not list and kind is not tuple and (isinstance(arg, (str, bytes, bytearray)) or not isinstance(arg, Sequence)):
        raise bad_arg("prepare_for_extend", "requests", arg, "a sequence of AdmittedRequest")
    _check_requests(requests)
    if not requests:
        raise PreconditionError("prepare_for_extend", "no admitted requests (schedule an IdleBatch instead)")
    if sampling is not None and not isinstance(sampling, SamplingRows):
        raise bad_arg("prepare_for_extend", "sampling", sampling, "SamplingRows (one row per request) or None")
    clears: list[MambaSlot] = []
    src: list[MambaSlot] = []
    dst: list[MambaSlot] = []
    for r in requests:
        match r.intent:
            case Clear():
                clears.append(r.slot)
            case CopyFrom(src=cow_src):
                src.append(cow_src)
                dst.append(r.slot)
            case Continue():
                pass
            case _:
                assert_never(r.intent)
    init = MambaInit(serial=mint_serial(), clear_slots=clears, cow_src=src, cow_dst=dst) if clears or dst else None
    snap = [r for r in requests if r.snapshot_to is not None]
    inner = any(r.snapshot_len != r.input_ids.shape[0] for r in snap)
    snapshot = (
        MambaSnapshot(
            serial=mint_serial(), src=[r.slot for r in snap], dst=[r.snapshot_to for r in snap if r.snapshot_to is not None],
            at=[r.snapshot_len for r in snap] if inner else (),
        )
        if snap
        else None
    )
    return ExtendBatch(
        rids=frozen_i64([r.rid for r in requests]),
        slots=frozen_i64([r.slot for r in requests]),
        prefix_lens=frozen_i64([r.intent.prefix_len for r in requests]),
        extend_lens=frozen_i64([r.input_ids.shape[0] for r in requests]),
        more_chunks=np.array([r.more_chunks for r in requests], dtype=np.bool_),
        intents=tuple(r.intent.kind for r in requests),
        input_ids=np.concatenate([r.input_ids for r in requests]),
        kv_locs=np.concatenate([r.kv_locs for r in requests]),
        init=init,
        snapshot=snapshot,
        sampling=sampling,
    )


def _check_requests(requests: Sequence[object]) -> None:
    """Every entry an ``AdmittedRequest``: the entries' types are collected in C
    (``set(map(type, ...))``); only a bad batch is searched entry by entry, for the message."""
    kinds = set(map(type, requests))
    if kinds <= {AdmittedRequest} or all(issubclass(t, AdmittedRequest) for t in kinds):
        return
    i, bad = next((i, r) for i, r in enumerate(requests) if not isinstance(r, AdmittedRequest))
    raise bad_arg("prepare_for_extend", f"requests[{i}]", bad, "an AdmittedRequest")
