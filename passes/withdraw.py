"""``withdraw``: take requests out of a prefill that has not run (admission rolled back, a request
aborted between lowering and execution).

Pre: ``batch`` is an ``ExtendBatch``; ``drop`` names requests of it (each id at most once; an id not
in the batch is refused: withdrawing a request that is not there is a scheduler's bug, unlike
``filter_batch``, which ignores ids of requests that already left).
Post: an ``ExtendBatch`` of the remaining requests in order, their init and snapshot ops kept and the
dropped requests' ops gone, both under freshly minted serials. The fresh serials are the difference
from ``filter_batch``: the withdrawn batch's tickets are other tickets than the original's, so the
original's (cancelled in the ledger by ``compiler.steps.Pipeline.withdraw``) stay a replay if its
plan is ever run, and the withdrawn batch lowers and registers as a new forward. Minting serials is
the pass's one impurity, as in ``prepare_for_extend``.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from ir.batch import ExtendBatch
from ir.errors import PreconditionError
from ir.ids import RequestId
from ir.init import mint_serial
from passes._args import bad_arg
from passes.filter_batch import _drop_ids, filter_batch

__all__ = [
    "withdraw",
]


def withdraw(batch: ExtendBatch, drop: Iterable[RequestId]) -> ExtendBatch:
    """``batch`` without the requests in ``drop``, its remaining init and snapshot ops under fresh
    serials (see the module). Refused with ``PreconditionError``: a batch other than an
    ``ExtendBatch``; a ``drop`` that is not an iterable of request ids, names one twice or names a
    request that is not in the batch."""
    if not isinstance(batch, ExtendBatch):
        raise bad_arg("withdraw", "batch", batch, "an ExtendBatch")
    ids = _drop_ids(drop, "withdraw")
    present = set(batch.rids.tolist())
    seen: set[int] = set()
    for rid in ids.tolist():
        if rid in seen:
            raise PreconditionError("withdraw", f"drop names request {rid} twice")
        if rid not in present:
            raise PreconditionError("withdraw", f"drop: request {rid} is not in this prefill (its requests: {sorted(present)[:16]})")
        seen.add(rid)
    out = filter_batch(batch, [RequestId(r) for r in seen])
    init = None if out.init is None else attrs.evolve(out.init, serial=mint_serial())
    snapshot = None if out.snapshot is None else attrs.evolve(out.snapshot, serial=mint_serial())
    return attrs.evolve(out, init=init, snapshot=snapshot)
