"""Scheduler batches as frozen IR nodes: one class per phase, a closed union ``Batch``.

Layout: a batch is columnar. Per-request data is one read-only int64 column per field (``rids``,
``slots``, ...); per-token data of prefills is packed (``input_ids``, ``kv_locs``; request ``i`` owns
``extend_lens[i]`` consecutive entries). Columns are compared by contents.

Local invariants (checked on construction, ``IRValidationError`` naming the field):

- every per-request column has the same length; packed token columns sum to ``extend_lens``;
- slots are >= 1 (slot 0 is padding), lengths are positive, prefix lengths are >= 0, KV locations
  and token ids are >= 0;
- node-typed fields hold their declared type: ``ExtendBatch.init`` a ``MambaInit`` or ``None``,
  ``ExtendBatch.snapshot`` a ``MambaSnapshot`` or ``None``, ``MixedBatch.extend``/``decode`` an
  ``ExtendBatch``/``DecodeBatch`` (``check_instance``: the error names the node, field and value).

Whole-node invariants (uniqueness of rids, slots and KV locations; consistency between the
per-request ``intents`` and the ``MambaInit``) live in ``ir.verify``.

The type-level half of the exactly-once guarantee is here: only ``ExtendBatch`` (and so
``MixedBatch`` through its extend part) has an ``init`` field. ``DecodeBatch`` has none, so code that
carries a prefill's init ops into a decode batch does not type-check.
"""

from __future__ import annotations

from typing import Protocol, final

import attrs

from ir.columns import I64, MAX_SEQ_LEN, BoolArray, ColumnNode, as_bool, as_i64, check_column, check_instance, check_max, check_min, column_key
from ir.errors import IRValidationError
from ir.init import InitIntent, MambaInit, MambaSnapshot


def _intents(values: object) -> tuple[InitIntent, ...]:
    if not isinstance(values, (tuple, list)):
        raise IRValidationError("ExtendBatch", "intents", values, "must be a tuple of InitIntent")
    out = tuple(values)
    for v in out:
        if not isinstance(v, InitIntent):
            raise IRValidationError("ExtendBatch", "intents", v, "every entry must be an InitIntent")
    return out


class _ExtendColumns(Protocol):
    @property
    def rids(self) -> I64: ...
    @property
    def slots(self) -> I64: ...
    @property
    def prefix_lens(self) -> I64: ...
    @property
    def extend_lens(self) -> I64: ...
    @property
    def input_ids(self) -> I64: ...
    @property
    def kv_locs(self) -> I64: ...


class _DecodeColumns(Protocol):
    @property
    def rids(self) -> I64: ...
    @property
    def slots(self) -> I64: ...
    @property
    def seq_lens(self) -> I64: ...
    @property
    def input_ids(self) -> I64: ...
    @property
    def kv_locs(self) -> I64: ...


def check_extend_columns(node: _ExtendColumns) -> None:
    """Local checks shared by the extend-shaped nodes (``ExtendBatch``, ``ExtendPlan``,
    ``DraftExtendBatch``)."""
    check_column(node, "rids", node.rids, None)
    n = node.rids.shape[0]
    for name, col in (("slots", node.slots), ("prefix_lens", node.prefix_lens), ("extend_lens", node.extend_lens)):
        check_column(node, name, col, n)
    check_min(node, "slots", node.slots, 1)
    check_min(node, "prefix_lens", node.prefix_lens, 0)
    check_min(node, "extend_lens", node.extend_lens, 1)
    check_max(node, "extend_lens", node.extend_lens, MAX_SEQ_LEN, "MAX_SEQ_LEN (2**31 - 1)")
    check_max(node, "prefix_lens", node.prefix_lens, MAX_SEQ_LEN - node.extend_lens, "MAX_SEQ_LEN - extend_lens")
    total = int(node.extend_lens.sum())
    check_column(node, "input_ids", node.input_ids, total, "sum(extend_lens)")
    check_column(node, "kv_locs", node.kv_locs, total, "sum(extend_lens)")
    check_min(node, "input_ids", node.input_ids, 0)
    check_min(node, "kv_locs", node.kv_locs, 0)


def check_decode_columns(node: _DecodeColumns) -> None:
    """Local checks shared by ``DecodeBatch`` and ``DecodePlan``."""
    check_column(node, "rids", node.rids, None)
    n = node.rids.shape[0]
    for name, col in (
        ("slots", node.slots),
        ("seq_lens", node.seq_lens),
        ("input_ids", node.input_ids),
        ("kv_locs", node.kv_locs),
    ):
        check_column(node, name, col, n)
    check_min(node, "slots", node.slots, 1)
    check_min(node, "seq_lens", node.seq_lens, 1)
    check_max(node, "seq_lens", node.seq_lens, MAX_SEQ_LEN, "MAX_SEQ_LEN (2**31 - 1)")
    check_min(node, "input_ids", node.input_ids, 0)
    check_min(node, "kv_locs", node.kv_locs, 0)


@final
@attrs.frozen(kw_only=True)
class ExtendBatch(ColumnNode):
    """A prefill forward (EXTEND): each request processes ``extend_lens[i]`` prompt tokens.

    ``snapshot`` (optional) copies some requests' states into prefix-cache slots after the forward.

    ``prefix_lens[i]`` tokens of request ``i`` are already in its state and KV cache (a cached
    prefix or earlier chunks). ``more_chunks[i]`` is true when the prompt continues after this
    chunk, so the request does not sample a token and does not join the decode batch.
    """

    rids: I64 = attrs.field(converter=as_i64, eq=column_key)
    slots: I64 = attrs.field(converter=as_i64, eq=column_key)
    prefix_lens: I64 = attrs.field(converter=as_i64, eq=column_key)
    extend_lens: I64 = attrs.field(converter=as_i64, eq=column_key)
    more_chunks: BoolArray = attrs.field(converter=as_bool, eq=column_key)
    intents: tuple[InitIntent, ...] = attrs.field(converter=_intents)
    input_ids: I64 = attrs.field(converter=as_i64, eq=column_key)
    kv_locs: I64 = attrs.field(converter=as_i64, eq=column_key)
    init: MambaInit | None
    snapshot: MambaSnapshot | None = None

    def __attrs_post_init__(self) -> None:
        self.check_fields()

    def check_fields(self) -> None:
        """The local invariants (run on construction, and again by ``ir.verify`` at level 2)."""
        check_instance(self, "init", self.init, MambaInit, optional=True)
        check_instance(self, "snapshot", self.snapshot, MambaSnapshot, optional=True)
        check_extend_columns(self)
        check_column(self, "more_chunks", self.more_chunks, self.rids.shape[0], bools=True)
        if len(self.intents) != self.rids.shape[0]:
            raise IRValidationError(
                "ExtendBatch", "intents", len(self.intents), f"length must equal len(rids) ({self.rids.shape[0]})"
            )
        if self.init is not None and self.init.is_empty:
            raise IRValidationError("ExtendBatch", "init", self.init, "an empty MambaInit must be None")

    @property
    def num_requests(self) -> int:
        return int(self.rids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])



@final
@attrs.frozen(kw_only=True)
class DecodeBatch(ColumnNode):
    """One new token per request (DECODE). There is no init field: decode never runs init ops.

    ``seq_lens[i]`` counts the tokens in request ``i``'s context after this forward, the fed token
    ``input_ids[i]`` included; its KV goes to ``kv_locs[i]`` at position ``seq_lens[i] - 1``.
    """

    rids: I64 = attrs.field(converter=as_i64, eq=column_key)
    slots: I64 = attrs.field(converter=as_i64, eq=column_key)
    seq_lens: I64 = attrs.field(converter=as_i64, eq=column_key)
    input_ids: I64 = attrs.field(converter=as_i64, eq=column_key)
    kv_locs: I64 = attrs.field(converter=as_i64, eq=column_key)

    def __attrs_post_init__(self) -> None:
        self.check_fields()

    def check_fields(self) -> None:
        """The local invariants (run on construction, and again by ``ir.verify`` at level 2)."""
        check_decode_columns(self)

    @classmethod
    def empty(cls) -> DecodeBatch:
        """The running batch before any request has finished its prefill."""
        none: list[int] = []
        return cls(rids=none, slots=none, seq_lens=none, input_ids=none, kv_locs=none)

    @property
    def num_requests(self) -> int:
        return int(self.rids.shape[0])


@final
@attrs.frozen(kw_only=True)
class MixedBatch:
    """An extend part and the running decodes in one forward (MIXED, the chunked-prefill case)."""

    extend: ExtendBatch
    decode: DecodeBatch

    def __attrs_post_init__(self) -> None:
        self.check_fields()

    def check_fields(self) -> None:
        """The parts' types (each part checked its own fields when it was built; ``ir.verify``
        re-runs the parts' checks at level 2)."""
        check_instance(self, "extend", self.extend, ExtendBatch)
        check_instance(self, "decode", self.decode, DecodeBatch)

    @property
    def init(self) -> MambaInit | None:
        return self.extend.init

    @property
    def num_requests(self) -> int:
        return self.extend.num_requests + self.decode.num_requests


@final
@attrs.frozen(kw_only=True)
class IdleBatch:
    """Nothing to run on this rank (data-parallel padding)."""

    @property
    def num_requests(self) -> int:
        return 0

