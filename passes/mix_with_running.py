"""``mix_with_running``: an extend batch and the running decodes -> one ``MixedBatch`` forward.

Pre: ``running`` is already prepared for its next step (``prepare_for_decode`` ran on it); the two
parts share no request id, slot or KV location.
Post: a ``MixedBatch`` whose extend part keeps its ``MambaInit`` (the new requests still need their
init ops in this forward) and whose decode part has none.
"""

from __future__ import annotations

from ir.batch import DecodeBatch, ExtendBatch, MixedBatch
from ir.columns import first_common
from ir.errors import PreconditionError
from passes._args import bad_arg

__all__ = [
    "mix_with_running",
]


def mix_with_running(extend: ExtendBatch, running: DecodeBatch) -> MixedBatch:
    """One ``MixedBatch`` forward of a prefill and the running decodes (chunked prefill): the extend
    part keeps its ``MambaInit``, the decode part has none. ``running`` must already be prepared for
    its next step. Refused with ``PreconditionError``: arguments of other types, a request id, slot
    or KV location in both parts."""
    if not isinstance(extend, ExtendBatch):
        raise bad_arg("mix_with_running", "extend", extend, "an ExtendBatch")
    if not isinstance(running, DecodeBatch):
        raise bad_arg("mix_with_running", "running", running, "a DecodeBatch")
    for name, a, b in (
        ("request id", extend.rids, running.rids),
        ("slot", extend.slots, running.slots),
        ("KV location", extend.kv_locs, running.kv_locs),
    ):
        both = first_common(a, b)
        if both is not None:
            raise PreconditionError("mix_with_running", f"{name} {both} is in both the extend and the running part")
    return MixedBatch(extend=extend, decode=running)
