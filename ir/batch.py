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

from typing import final

import attrs

from ir.columns import (
    I64,
    KV_NAMES,
    MAX_SEQ_LEN,
    MAX_SEQ_LEN_WHAT,
    REQUEST,
    REQUEST_NAME,
    SLOT_NAME,
    BoolArray,
    Bound,
    ColumnNode,
    Composite,
    RequestRows,
    as_bool,
    as_i64,
    column,
    per,
    shown,
    tokens_of,
)
from ir.errors import IRValidationError
from ir.init import InitIntent, MambaInit, MambaSnapshot
from ir.sampling import SamplingRows

__all__ = [
    "ExtendBatch",
    "DecodeBatch",
    "MixedBatch",
    "IdleBatch",
]


def intents_tuple(node: str, values: object) -> tuple[InitIntent, ...]:
    """Converter of a prefill-shaped node's ``intents``: a tuple of ``InitIntent`` (errors name ``node``)."""
    if not isinstance(values, (tuple, list)):
        raise IRValidationError(node, "intents", values, "must be a tuple of InitIntent")
    out = tuple(values)
    for v in out:
        if not isinstance(v, InitIntent):
            raise IRValidationError(node, "intents", v, "every entry must be an InitIntent")
    return out


def _intents(values: object) -> tuple[InitIntent, ...]:
    return intents_tuple("ExtendBatch", values)


def check_intents_and_init(node: str, intents: tuple[InitIntent, ...], rows: int, init: MambaInit | None) -> None:
    """A prefill-shaped node's local checks: one intent per row, and an empty ``MambaInit`` is ``None``."""
    if len(intents) != rows:
        raise IRValidationError(node, "intents", len(intents), f"length must equal len(rids) ({rows})")
    if init is not None and init.is_empty:
        raise IRValidationError(node, "init", init, "an empty MambaInit must be None")


PREFIX_MAX = Bound("MAX_SEQ_LEN - extend_lens", lambda node: MAX_SEQ_LEN - node.extend_lens)
"""A prefix and the chunk after it fit in ``MAX_SEQ_LEN``."""


@final
@attrs.frozen(kw_only=True)
class ExtendBatch(ColumnNode, RequestRows):
    """A prefill forward (EXTEND): each request processes ``extend_lens[i]`` prompt tokens.

    ``snapshot`` (optional) copies some requests' states into prefix-cache slots after the forward.

    ``prefix_lens[i]`` tokens of request ``i`` are already in its state and KV cache (a cached
    prefix or earlier chunks). ``more_chunks[i]`` is true when the prompt continues after this
    chunk, so the request does not sample a token and does not join the decode batch.
    """

    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    prefix_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, max=PREFIX_MAX, text="prefix"))
    extend_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=MAX_SEQ_LEN, max_what=MAX_SEQ_LEN_WHAT, text="extend"))
    intents: tuple[InitIntent, ...] = attrs.field(converter=_intents, metadata=shown("init"))
    more_chunks: BoolArray = column(converter=as_bool, metadata=per(REQUEST, text="more"))
    input_ids: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text="tokens"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text=KV_NAMES))
    init: MambaInit | None = attrs.field(metadata=shown(line="init"))
    snapshot: MambaSnapshot | None = attrs.field(default=None, metadata=shown(line="snapshot"))
    sampling: SamplingRows | None = attrs.field(default=None)
    """Its rows' sampling parameters, aligned with them (``None``: every row greedy)."""

    def _check(self) -> None:
        check_intents_and_init("ExtendBatch", self.intents, int(self.rids.shape[0]), self.init)

    @property
    def num_tokens(self) -> int:
        """The prompt tokens this forward processes, over all rows: ``sum(extend_lens)``, the length
        of ``input_ids`` and ``kv_locs``."""
        return int(self.input_ids.shape[0])



@final
@attrs.frozen(kw_only=True)
class DecodeBatch(ColumnNode, RequestRows):
    """One new token per request (DECODE). There is no init field: decode never runs init ops.

    ``seq_lens[i]`` counts the tokens in request ``i``'s context after this forward, the fed token
    ``input_ids[i]`` included; its KV goes to ``kv_locs[i]`` at position ``seq_lens[i] - 1``.
    """

    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    seq_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=MAX_SEQ_LEN, max_what=MAX_SEQ_LEN_WHAT, text="seq"))
    input_ids: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text="token"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text=KV_NAMES))
    sampling: SamplingRows | None = attrs.field(default=None)
    """Its rows' sampling parameters, aligned with them (``None``: every row greedy)."""

    @classmethod
    def empty(cls) -> DecodeBatch:
        """The running batch before any request has finished its prefill (one shared node: it is
        immutable, and a speculative step asks for it every iteration)."""
        return _EMPTY_DECODE


_NONE: list[int] = []
_EMPTY_DECODE = DecodeBatch(rids=_NONE, slots=_NONE, seq_lens=_NONE, input_ids=_NONE, kv_locs=_NONE)


@final
@attrs.frozen(kw_only=True)
class MixedBatch(Composite):
    """An extend part and the running decodes in one forward (MIXED, the chunked-prefill case).
    Its checks are its parts' types (each part checked its own fields when it was built;
    ``ir.verify`` re-runs the parts' checks at level 2)."""

    extend: ExtendBatch
    decode: DecodeBatch

    @property
    def init(self) -> MambaInit | None:
        """The extend part's ``MambaInit`` (``None`` when its rows need no init op): a mixed batch
        runs the init ops of its prefills only, never of its decodes."""
        return self.extend.init


@final
@attrs.frozen(kw_only=True)
class IdleBatch(Composite):
    """Nothing to run on this rank (data-parallel padding)."""

