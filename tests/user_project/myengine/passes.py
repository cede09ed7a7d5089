"""``cap_running``: the engine's own admission-control pass over batchc's IR.

A decode batch holds at most ``limit`` requests: the newest ones (the rows past the first
``limit``) are retracted, in order, to be scheduled again later. The pass is pure, as batchc's are:
it returns a new batch (or its input when nothing is dropped) and the retracted request ids.
Declared with ``declare_pass``, it runs through batchc's pass manager as batchc's passes do (its
output verified, dumped and timed under its name; an error names it).
"""

from __future__ import annotations

import numpy as np

from ir.batch import DecodeBatch
from ir.ids import RequestId
from passes import filter_batch
from passes.registry import declare_pass

__all__ = ["cap_running"]


@declare_pass
def cap_running(batch: DecodeBatch, limit: int) -> tuple[DecodeBatch, list[RequestId]]:
    """The first ``limit`` rows of ``batch`` and the ids of the rows retracted past them."""
    if type(limit) is not int or limit < 0:  # typed, and checked (bools too): a caller need not be typed
        raise ValueError(f"cap_running: limit must be an int >= 0, got {limit!r}")
    dropped = [RequestId(int(r)) for r in np.asarray(batch.rids)[limit:]]
    return filter_batch(batch, dropped), dropped
