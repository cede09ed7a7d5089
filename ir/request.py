"""Request nodes: what the scheduler hands to ``prepare_for_extend`` for each admitted request.

An ``AdmittedRequest`` is one request's share of a prefill forward: its slot, the tokens to
process now, where their KV goes, and how its Mamba state starts (its ``intent``).

The intent is a sum type, so that a combination the forward cannot run is not representable:

- ``Clear()``: a fresh slot starts from zero (no prefix);
- ``CopyFrom(src=, prefix_len=)``: a cached prefix: the slot starts as a copy (COW) of ``src``, the
  cached-state slot holding the state after ``prefix_len > 0`` tokens (``src >= 1``, never the
  request's own slot);
- ``Continue(prefix_len=)``: a chunked continuation keeps the state of its ``prefix_len > 0``
  earlier tokens.

Each variant's ``kind`` is its ``InitIntent`` (the per-request tag an ``ExtendBatch`` keeps), and
callers dispatch with ``match request.intent: case Clear(): ... case CopyFrom(src=src): ...``.

Invariants (``IRValidationError``):

- ``len(kv_locs) == len(input_ids) >= 1``; ``prefix_len + len(input_ids) <= MAX_SEQ_LEN``;
- ``snapshot_at`` only with ``snapshot_to``, in ``[1, len(input_ids)]``;
- ``rid``, ``slot``, ``snapshot_to``, ``snapshot_at`` and the intents' ``src``/``prefix_len`` are ints (Python or
  numpy integers within int64: not ``bool``, ``float``, ``str`` or ``None`` where an id is
  required), ``intent`` is a ``Clear``, ``CopyFrom`` or ``Continue`` and ``more_chunks`` a ``bool``.
"""

from __future__ import annotations

from typing import ClassVar, TypeAlias, final

import attrs
import numpy as np

from ir.columns import ANY, I64, KV_NAMES, MAX_SEQ_LEN, ColumnNode, Node, as_i64, check_int, check_opt_int, column, length_of, per, shown
from ir.errors import IRValidationError
from ir.ids import MambaSlot, RequestId
from ir.init import InitIntent

__all__ = [
    "Clear",
    "CopyFrom",
    "Continue",
    "Intent",
    "AdmittedRequest",
]


def _check_prefix_len(node: Node, prefix_len: object, what: str) -> None:
    value = check_int(node, "prefix_len", prefix_len)
    if value < 1:
        raise IRValidationError(type(node).__name__, "prefix_len", prefix_len, f"{what} (> 0 tokens)")
    if value > MAX_SEQ_LEN:
        raise IRValidationError(type(node).__name__, "prefix_len", prefix_len, "must be <= MAX_SEQ_LEN (2**31 - 1)")


@final
@attrs.frozen(kw_only=True)
class Clear(Node):
    """Fresh slot: its state must start at zero."""

    kind: ClassVar[InitIntent] = InitIntent.CLEAR

    @property
    def prefix_len(self) -> int:
        """0: a fresh slot holds none of the request's tokens."""
        return 0


@final
@attrs.frozen(kw_only=True)
class CopyFrom(Node):
    """Cached prefix: the slot starts as a copy (COW) of the cached-state slot ``src``, which holds
    the state after the first ``prefix_len`` tokens."""

    kind: ClassVar[InitIntent] = InitIntent.COW
    src: MambaSlot = attrs.field(metadata=shown("src", "s"))
    prefix_len: int = attrs.field(metadata=shown("prefix"))

    def _check(self) -> None:
        if check_int(self, "src", self.src) < 1:
            raise IRValidationError("CopyFrom", "src", self.src, "must be >= 1 (slot 0 is the padding slot)")
        _check_prefix_len(self, self.prefix_len, "a COW starts after a cached prefix")


@final
@attrs.frozen(kw_only=True)
class Continue(Node):
    """Chunked-prefill continuation: the slot already holds this request's state after its first
    ``prefix_len`` tokens."""

    kind: ClassVar[InitIntent] = InitIntent.CONTINUE
    prefix_len: int = attrs.field(metadata=shown("prefix"))

    def _check(self) -> None:
        _check_prefix_len(self, self.prefix_len, "a continuation follows earlier chunks")


Intent: TypeAlias = Clear | CopyFrom | Continue
"""How a request's slot starts before the forward that starts (or continues) its prefill."""


@final
@attrs.frozen(kw_only=True)
class AdmittedRequest(ColumnNode):
    """A request the scheduler admitted for a prefill forward: its id, its Mamba slot, how that slot
    starts (``intent``), and this forward's chunk of its prompt (``input_ids``, with one KV location
    per token in ``kv_locs``). ``passes.prepare_for_extend`` builds an ``ExtendBatch`` from a list of them.

    Refused on construction (``IRValidationError`` naming the field): a slot below 1, an empty chunk,
    a prefix and chunk longer than ``MAX_SEQ_LEN``, ``more_chunks`` that is not a bool, a
    ``snapshot_to`` that is the request's own slot, a ``snapshot_at`` without ``snapshot_to`` or
    outside ``[1, len(input_ids)]``."""

    rid: RequestId = attrs.field(metadata=shown(name="r"))
    slot: MambaSlot = attrs.field(metadata=shown(name="s"))
    intent: Intent = attrs.field(metadata=shown("intent", tags={c.kind.value: c for c in (Clear, CopyFrom, Continue)}))
    more_chunks: bool = attrs.field(default=False, metadata=shown("more"))
    snapshot_to: MambaSlot | None = attrs.field(default=None, metadata=shown("snapshot_to", "s"))
    """After this forward, copy the request's state into this prefix-cache slot."""
    snapshot_at: int | None = attrs.field(default=None, metadata=shown("snapshot_at"))
    """With ``snapshot_to``: the state copied is the one after this many of the chunk's tokens
    (``1`` to ``len(input_ids)``; ``None``: all of them, the state the forward leaves)."""
    input_ids: I64 = column(converter=as_i64, metadata=per(ANY, text="tokens"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(length_of("input_ids"), text=KV_NAMES))

    @property
    def snapshot_len(self) -> int:
        """Tokens of this chunk before the snapshot's state (the whole chunk unless ``snapshot_at``)."""
        return int(self.input_ids.shape[0]) if self.snapshot_at is None else self.snapshot_at

    @property
    def prefix_len(self) -> int:
        """Tokens of the request already in its state and KV cache (its intent's)."""
        return self.intent.prefix_len

    def _check_first(self) -> None:
        name = "AdmittedRequest"
        check_int(self, "rid", self.rid)
        check_int(self, "slot", self.slot)
        check_opt_int(self, "snapshot_to", self.snapshot_to)
        check_opt_int(self, "snapshot_at", self.snapshot_at)
        more: object = self.more_chunks
        if not isinstance(more, (bool, np.bool_)):
            raise IRValidationError(name, "more_chunks", more, f"must be a bool, not {type(more).__name__}")
        if self.slot < 1:
            raise IRValidationError(name, "slot", self.slot, "must be >= 1 (slot 0 is the padding slot)")

    def _check(self) -> None:
        name = "AdmittedRequest"
        if self.input_ids.shape[0] < 1:
            raise IRValidationError(name, "input_ids", (), "a prefill processes at least one token")
        if self.prefix_len + self.input_ids.shape[0] > MAX_SEQ_LEN:
            raise IRValidationError(
                name, "prefix_len", self.prefix_len, "prefix_len + len(input_ids) must be <= MAX_SEQ_LEN (2**31 - 1)"
            )
        if self.snapshot_to is not None and (self.snapshot_to < 1 or self.snapshot_to == self.slot):
            raise IRValidationError(name, "snapshot_to", self.snapshot_to, "must be a cache slot >= 1 other than the request's own")
        if self.snapshot_at is not None and (self.snapshot_to is None or not 1 <= self.snapshot_at <= self.input_ids.shape[0]):
            raise IRValidationError(
                name, "snapshot_at", self.snapshot_at, f"must come with snapshot_to and lie in [1, len(input_ids)] ([1, {self.input_ids.shape[0]}])"
            )
        if isinstance(self.intent, CopyFrom) and self.intent.src == self.slot:
            raise IRValidationError(name, "intent", self.intent.src, "COW src equals the request's own slot")
