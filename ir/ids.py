"""Typed ids of the IR.

Every id is a ``NewType`` over ``int`` (or ``str`` for pools), so mypy refuses a ``MambaSlot`` where a
token count or a ``KVLoc`` is expected, and a ``SampleId``, ``DraftId``, ``VerifyId`` or ``HiddenId`` where a
``TicketSerial`` or one of the others is expected: they share one minter (``ir.mint``), but
not one meaning. Ids carry no behaviour; ranges are checked by the node
validators and by the backend, which knows capacities.

Conventions kept here and everywhere else:

- ``MambaSlot(0)`` is the reserved padding slot of every state pool: never allocated to a request,
  never the target of an init op.
- ``-1`` is the kernel-side "skip this row" index. It never appears in IR nodes; the backend
  produces it when it pads a staged index tensor.
"""

from __future__ import annotations

from typing import NewType

__all__ = [
    "RequestId",
    "MambaSlot",
    "KVLoc",
    "PoolId",
    "TicketSerial",
    "SampleId",
    "DraftId",
    "VerifyId",
    "HiddenId",
    "PADDING_SLOT",
    "TARGET_POOL",
    "DRAFT_POOL",
]

RequestId = NewType("RequestId", int)
"""Engine-assigned id of a request; unique among live requests."""

MambaSlot = NewType("MambaSlot", int)
"""Row of a Mamba state pool. The same slot id addresses the target pool and every draft pool."""

KVLoc = NewType("KVLoc", int)
"""Token-granular location in an attention KV pool."""

PoolId = NewType("PoolId", str)
"""Name of a registered Mamba state pool (``"target"``, ``"draft"``, ...)."""

TicketSerial = NewType("TicketSerial", int)
"""Process-unique, monotonically increasing identity of an ``InitTicket``."""

SampleId = NewType("SampleId", int)
"""Names the tokens a forward samples and the backend keeps per slot (``DecodePlan.sample_id``),
for the pipelined decode that reads them (``DecodePlan.inputs_from``). Minted by
``ir.mint.mint_sample_id``."""

DraftId = NewType("DraftId", int)
"""Names the per-step states a speculative draft keeps and the proposals it returns
(``DraftBatch.draft_id``); the verify and the draft commit after it name the same one. Minted by
``ir.mint.mint_draft_id``."""

VerifyId = NewType("VerifyId", int)
"""Names the intermediate states a verify forward keeps (``VerifyBatch.verify_id``), which only the
commit naming it applies. Minted by ``ir.mint.mint_verify_id``."""

HiddenId = NewType("HiddenId", int)
"""Names the target hidden states a forward keeps for the draft head (``ExtendPlan.keep_hidden``,
``VerifyPlan.keep_hidden``), which one head phase reads, once (``ir.hidden``). Minted by
``ir.mint.mint_hidden_id``."""

PADDING_SLOT = MambaSlot(0)
TARGET_POOL = PoolId("target")
DRAFT_POOL = PoolId("draft")
