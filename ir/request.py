"""Request nodes: what the scheduler hands to ``prepare_for_extend`` for each admitted request.

An ``AdmittedRequest`` is one request's share of a prefill forward: its slot, the tokens to
process now, where their KV goes, and how its Mamba state starts (``InitIntent``).

Invariants (``IRValidationError``):

- ``CLEAR`` starts from zero, so ``prefix_len == 0`` and no checkpoint;
- ``COW`` starts from the checkpoint slot holding the state after ``prefix_len`` tokens, so
  ``prefix_len > 0`` and ``checkpoint`` is a slot other than ``slot``;
- ``CONTINUE`` keeps the slot's state after ``prefix_len`` earlier tokens: ``prefix_len > 0``,
  no checkpoint;
- ``len(kv_locs) == len(input_ids) >= 1``;
- ``rid``, ``slot``, ``prefix_len``, ``checkpoint`` and ``snapshot_to`` are ints (Python or numpy
  integers within int64: not ``bool``, ``float``, ``str`` or ``None`` where an id is required),
  ``intent`` is an ``InitIntent`` and ``more_chunks`` a ``bool``.
"""

from __future__ import annotations

from typing import final

import attrs
import numpy as np

from ir.columns import I64, MAX_SEQ_LEN, ColumnNode, as_i64, check_column, check_int, check_opt_int, column_key
from ir.errors import IRValidationError
from ir.ids import MambaSlot, RequestId
from ir.init import InitIntent


@final
@attrs.frozen(kw_only=True)
class AdmittedRequest(ColumnNode):
    rid: RequestId
    slot: MambaSlot
    input_ids: I64 = attrs.field(converter=as_i64, eq=column_key)
    kv_locs: I64 = attrs.field(converter=as_i64, eq=column_key)
    prefix_len: int = 0
    intent: InitIntent
    checkpoint: MambaSlot | None = None
    more_chunks: bool = False
    snapshot_to: MambaSlot | None = None
    """After this forward, copy the request's state into this prefix-cache slot."""

    def __attrs_post_init__(self) -> None:
        self.check_fields()

    def check_fields(self) -> None:
        """The local invariants (run on construction, and again by ``ir.verify`` at level 2)."""
        name = "AdmittedRequest"
        check_int(self, "rid", self.rid)
        check_int(self, "slot", self.slot)
        check_int(self, "prefix_len", self.prefix_len)
        check_opt_int(self, "checkpoint", self.checkpoint)
        check_opt_int(self, "snapshot_to", self.snapshot_to)
        intent: object = self.intent  # typed InitIntent; checked because callers need not be typed
        if not isinstance(intent, InitIntent):
            raise IRValidationError(name, "intent", intent, "must be an InitIntent")
        more: object = self.more_chunks
        if not isinstance(more, (bool, np.bool_)):
            raise IRValidationError(name, "more_chunks", more, f"must be a bool, not {type(more).__name__}")
        check_column(self, "input_ids", self.input_ids, None)
        check_column(self, "kv_locs", self.kv_locs, None)
        if self.slot < 1:
            raise IRValidationError(name, "slot", self.slot, "must be >= 1 (slot 0 is the padding slot)")
        if self.input_ids.shape[0] < 1:
            raise IRValidationError(name, "input_ids", (), "a prefill processes at least one token")
        if self.kv_locs.shape[0] != self.input_ids.shape[0]:
            raise IRValidationError(
                name, "kv_locs", self.kv_locs.shape[0], f"length must equal len(input_ids) ({self.input_ids.shape[0]})"
            )
        if self.prefix_len < 0:
            raise IRValidationError(name, "prefix_len", self.prefix_len, "must be >= 0")
        if self.prefix_len + self.input_ids.shape[0] > MAX_SEQ_LEN:
            raise IRValidationError(
                name, "prefix_len", self.prefix_len, "prefix_len + len(input_ids) must be <= MAX_SEQ_LEN (2**31 - 1)"
            )
        if self.snapshot_to is not None and (self.snapshot_to < 1 or self.snapshot_to == self.slot):
            raise IRValidationError(name, "snapshot_to", self.snapshot_to, "must be a cache slot >= 1 other than the request's own")
        match self.intent:
            case InitIntent.CLEAR:
                if self.prefix_len != 0:
                    raise IRValidationError(name, "prefix_len", self.prefix_len, "a cleared slot starts at token 0")
                if self.checkpoint is not None:
                    raise IRValidationError(name, "checkpoint", self.checkpoint, "a cleared slot copies no checkpoint")
            case InitIntent.COW:
                if self.checkpoint is None:
                    raise IRValidationError(name, "checkpoint", None, "COW needs the checkpoint slot to copy from")
                if self.checkpoint < 1:
                    raise IRValidationError(name, "checkpoint", self.checkpoint, "must be >= 1")
                if self.checkpoint == self.slot:
                    raise IRValidationError(name, "checkpoint", self.checkpoint, "COW src equals the request's own slot")
                if self.prefix_len == 0:
                    raise IRValidationError(name, "prefix_len", 0, "a COW starts after a cached prefix (> 0 tokens)")
            case InitIntent.CONTINUE:
                if self.prefix_len == 0:
                    raise IRValidationError(name, "prefix_len", 0, "a continuation follows earlier chunks (> 0 tokens)")
                if self.checkpoint is not None:
                    raise IRValidationError(name, "checkpoint", self.checkpoint, "a continuation copies no checkpoint")
