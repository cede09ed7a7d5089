"""The draft head's phases as frozen IR nodes (MTP/EAGLE heads that read the target's hidden states).

A draft head has a state pool of its own (its Mamba layers' states and the hidden state it carries
per row), and its committed length is always the target's. Besides its proposal (the speculative
``DraftBatch``/``DraftPlan`` of ``ir.spec``, unchanged: the head reads its carried state) it runs
two phases, each consuming one ``ir.hidden.HiddenStates`` handle of the target's, once:

1. ``HeadExtendBatch`` (``passes.prepare_for_head_extend``, after every target prefill chunk): the
   prefill's tokens and KV locations, paired with the target's hidden states of that chunk (hidden
   ``hidden_id``, kept by the prefill's ``ExtendPlan.keep_hidden``). It is the first time the head
   pool sees these rows, so it carries the prefill's own one-shot ops (``init``: clears and COWs;
   ``snapshot``: prefix-cache snapshots), the very ``MambaInit``/``MambaSnapshot`` of the
   ``ExtendBatch``, same serial. Lowered to ``HeadExtendPlan``, which carries them only as tickets
   addressed to the head pool(s) (``passes.lower.LowerContext.head_pools``), registered with the
   ledger and consumed there exactly like the target's.
2. ``HeadCommitBatch`` (``passes.prepare_for_head_commit``, after the target's commit): per row, a
   head extend over the committed window tokens ``[p, d1..dm]`` (``m = accept_pos[i]``) from the
   head's committed state after ``prefix_lens[i] = seq_len - 1`` tokens (the ``DraftExtendBatch``
   shape), paired with the verify's hidden states at window positions ``0..m`` (hidden
   ``hidden_id``, kept by the ``VerifyPlan.keep_hidden``; the row holds ``k + 1`` of them). It has
   no init field, so a head commit built from a prefill's batch (the upstream bug: a draft extend
   that replayed the prefill's stale clear/COW indices on the live draft pool) does not
   type-check. Lowered to ``HeadCommitPlan`` (no ticket field).

Both head plans are ``@linear``: each reads a one-shot hidden handle (and a head extend's tickets),
so submitting one twice to the same backend, or keeping it past the step, is a mypy error. Both
give back ``ir.results.Ran`` (the head samples nothing in these phases).

Invariants (on construction, ``IRValidationError`` naming the field): ``hidden_id`` positive; a head
extend's intents one per row and a non-empty ``init`` or ``None``; the ticket fields as
``ExtendPlan``'s (``ir.plan.check_tickets``); a head commit's ``k`` in ``[1, MAX_SPEC_K]``,
``accept_pos[i] <= k`` and ``extend_lens[i] == accept_pos[i] + 1``. Whole-node invariants (unique
rows, slots and KV locations; the init ops match the intents; tickets write only the plan's own
rows) are ``ir.verify``'s, as for the target's nodes.
"""

from __future__ import annotations

from typing import TypeAlias, cast, final

import attrs

from ir.batch import PREFIX_MAX, check_intents_and_init, intents_tuple
from ir.columns import (
    I64,
    KV_NAMES,
    MAX_SEQ_LEN,
    MAX_SEQ_LEN_WHAT,
    REQUEST,
    REQUEST_NAME,
    SLOT_NAME,
    ColumnNode,
    Composite,
    RequestRows,
    as_i64,
    check_int,
    column,
    per,
    shown,
    tokens_of,
)
from ir.errors import IRValidationError
from ir.ids import HiddenId
from ir.init import InitIntent, InitTicket, MambaInit, MambaSnapshot, SnapshotTicket, When
from ir.linear import linear
from ir.plan import Ticketed, check_tickets, ticket_tuple
from ir.spec import check_k

__all__ = [
    "HeadExtendBatch",
    "HeadExtendPlan",
    "HeadCommitBatch",
    "HeadCommitPlan",
    "HeadBatch",
    "HeadPlan",
]


def _check_hidden(node: str, value: object) -> None:
    if check_int(node, "hidden_id", value) < 1:
        raise IRValidationError(node, "hidden_id", value, "must be positive (the HiddenId of the target forward that kept the states)")


def _intents(values: object) -> tuple[InitIntent, ...]:
    return intents_tuple("HeadExtendBatch", values)


def _tickets(values: object) -> tuple[InitTicket, ...]:
    return cast("tuple[InitTicket, ...]", ticket_tuple("HeadExtendPlan", "tickets", values, When.BEFORE))


def _snapshots(values: object) -> tuple[SnapshotTicket, ...]:
    return cast("tuple[SnapshotTicket, ...]", ticket_tuple("HeadExtendPlan", "snapshots", values, When.AFTER))


@final
@attrs.frozen(kw_only=True)
class HeadExtendBatch(ColumnNode, RequestRows):
    """The head's extend over a target prefill chunk: the chunk's rows, tokens and KV locations,
    the target's hidden states ``hidden_id`` at those positions, and the prefill's one-shot ops
    for the head pool (``init``, ``snapshot``: the ``ExtendBatch``'s own, per its ``intents``)."""

    hidden_id: HiddenId = attrs.field(metadata=shown("hidden", "#"))
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    prefix_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, max=PREFIX_MAX, text="prefix"))
    extend_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=MAX_SEQ_LEN, max_what=MAX_SEQ_LEN_WHAT, text="extend"))
    intents: tuple[InitIntent, ...] = attrs.field(converter=_intents, metadata=shown("init"))
    input_ids: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text="tokens"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text=KV_NAMES))
    init: MambaInit | None = attrs.field(metadata=shown(line="init"))
    snapshot: MambaSnapshot | None = attrs.field(default=None, metadata=shown(line="snapshot"))

    def _check_first(self) -> None:
        _check_hidden("HeadExtendBatch", self.hidden_id)

    def _check(self) -> None:
        check_intents_and_init("HeadExtendBatch", self.intents, int(self.rids.shape[0]), self.init)

    @property
    def num_tokens(self) -> int:
        """The tokens this forward of the head processes, over all rows: ``sum(extend_lens)``, the
        length of ``input_ids``."""
        return int(self.input_ids.shape[0])


@final
@linear
@attrs.frozen(kw_only=True)
class HeadExtendPlan(ColumnNode, RequestRows, Ticketed):
    """The columns of a ``HeadExtendBatch`` and its ops as tickets for the head pool(s): one per
    pool and op kind, with the prefill's serial (the ledger keys a ticket by serial and pool, so the
    target's and the head's are two tickets of one op, each consumed once)."""

    hidden_id: HiddenId = attrs.field(metadata=shown("hidden", "#"))
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    prefix_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, max=PREFIX_MAX, text="prefix"))
    extend_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=MAX_SEQ_LEN, max_what=MAX_SEQ_LEN_WHAT, text="extend"))
    input_ids: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text="tokens"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text=KV_NAMES))
    tickets: tuple[InitTicket, ...] = attrs.field(converter=_tickets, metadata=shown(line="ticket"))
    snapshots: tuple[SnapshotTicket, ...] = attrs.field(default=(), converter=_snapshots, metadata=shown(line="snapshot ticket"))

    def _check_first(self) -> None:
        _check_hidden("HeadExtendPlan", self.hidden_id)

    def _check(self) -> None:
        check_tickets("HeadExtendPlan", "tickets", self.tickets, When.BEFORE)
        check_tickets("HeadExtendPlan", "snapshots", self.snapshots, When.AFTER)


@final
@attrs.frozen(kw_only=True)
class HeadCommitBatch(ColumnNode, RequestRows):
    """The head's catch-up over the committed window of a speculative iteration: row ``i`` feeds
    ``[p, d1..dm]`` (``m = accept_pos[i]``, ``extend_lens[i] = m + 1`` tokens) from its committed
    state after ``prefix_lens[i]`` tokens, paired with the verify's hidden states ``hidden_id`` at
    window positions ``0..m`` (of the ``k + 1`` the verify kept per row). Extend-shaped, without an
    init field."""

    k: int
    hidden_id: HiddenId = attrs.field(metadata=shown("hidden", "#"))
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    prefix_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, max=PREFIX_MAX, text="prefix"))
    accept_pos: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text="accept"))
    extend_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=MAX_SEQ_LEN, max_what=MAX_SEQ_LEN_WHAT, text="extend"))
    input_ids: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text="tokens"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text=KV_NAMES))

    def _check_first(self) -> None:
        check_k(self, self.k)
        _check_hidden("HeadCommitBatch", self.hidden_id)

    def _check(self) -> None:
        if self.accept_pos.size and int(self.accept_pos.max()) > self.k:
            raise IRValidationError("HeadCommitBatch", "accept_pos", int(self.accept_pos.max()), f"must be <= k ({self.k})")
        bad = (self.extend_lens != self.accept_pos + 1).nonzero()[0]
        if bad.size:
            i = int(bad[0])
            raise IRValidationError(
                "HeadCommitBatch", "extend_lens", int(self.extend_lens[i]), f"row {i} must feed accept_pos + 1 ({int(self.accept_pos[i]) + 1}) tokens"
            )


@final
@linear
@attrs.frozen(kw_only=True)
class HeadCommitPlan(Composite, RequestRows):
    """A ``HeadCommitBatch`` for the head's backend (it holds no one-shot ops, so lowering adds
    only the phase; linear for its hidden handle). Its rows are its batch's."""

    batch: HeadCommitBatch

    @property
    def rids(self) -> I64:
        return self.batch.rids

    @property
    def slots(self) -> I64:
        return self.batch.slots


HeadBatch: TypeAlias = HeadExtendBatch | HeadCommitBatch
HeadPlan: TypeAlias = HeadExtendPlan | HeadCommitPlan
