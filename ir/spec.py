"""Speculative-decoding phases as frozen IR nodes.

One iteration over the running requests, each with ``c`` committed tokens and one pending token
``p`` (sampled, not yet fed), with ``k`` draft tokens:

1. ``DraftBatch``: the draft model proposes ``d1..dk`` greedily from its committed state, feeding
   ``p`` first and then each proposal, ``k + 1`` steps in all (the last feeds ``dk``); its committed
   state is not modified: each step's state is kept, under the batch's ``draft_id``, for the draft
   commit. Each row owns ``k + 1`` KV locations, for the positions ``c .. c + k`` (written by the
   draft proposal and by the verify).
   What it proposed comes back as ``Proposals`` (named by the same ``draft_id``).
2. ``VerifyBatch``: the target model scores ``[p, d1..dk]`` at positions ``c .. c + k`` in one
   forward; its recurrent layers write every position's state to intermediate buffers, identified
   by the batch's ``verify_id``, and leave the committed state alone. A ``VerifyPlan`` with
   ``keep_hidden`` also keeps the target's hidden states at those positions for a draft head's
   commit (``ir.hidden``; the head's phases are in ``ir.head``).
3. ``AcceptResult`` (from ``passes.accept``, which takes the target's tokens only as the
   ``Verified`` result of the same verify): per row, the number ``m`` of accepted draft tokens
   (longest prefix equal to the target's argmax) and the bonus token (the target's argmax after
   them), named by the ``verify_id`` and the rows (``rids``) of the verify it judged.
4. ``CommitBatch`` (from ``passes.commit``, which refuses the result of another verify or of other
   rows): per row, commit the target state at intermediate position ``m`` (after consuming
   ``p, d1..dm``); the KV locations of positions past ``c + m`` are released.
5. ``DraftCommitBatch`` (from ``passes.prepare_for_draft_commit``): per row, the draft state its
   proposal kept after consuming ``p, d1..dm`` becomes the draft's committed state, so both models
   have committed ``c + m + 1`` tokens and the bonus token is pending. The proposal computed those
   states already (the accepted drafts are the tokens it fed), so no draft forward runs.
   ``DraftExtendBatch`` is the alternative for a draft model that keeps no states: a catch-up
   forward over ``p, d1..dm`` from the draft's committed state.

None of these nodes has an init field, and none of their plans has a ticket field: a prefill's init
ops reach the draft pool through the draft executor running the prefill's own ``ExtendPlan``, and
only there. Windowed columns (``input_ids``/``kv_locs`` of draft and verify) are flattened
row-major with ``k + 1`` entries per row.

``k`` is an int in ``[1, MAX_SPEC_K]`` in every node (and in ``passes.prepare_for_draft.SpecContext``),
and each spec plan's ``batch`` is the batch type of its phase (``IRValidationError`` otherwise).
"""

from __future__ import annotations

from typing import TypeAlias, final

import attrs

from ir.batch import PREFIX_MAX
from ir.columns import (
    ANY,
    I64,
    KV_NAMES,
    MAX_SEQ_LEN,
    MAX_SEQ_LEN_WHAT,
    REQUEST,
    REQUEST_NAME,
    SLOT_NAME,
    WINDOW,
    Bound,
    ColumnNode,
    Composite,
    RequestRows,
    Shown,
    as_i64,
    check_column,
    check_int,
    column,
    per,
    shown,
    tokens_of,
)
from ir.errors import IRValidationError
from ir.ids import DraftId, HiddenId, VerifyId
from ir.linear import linear
from ir.plan import check_hidden_id
from ir.sampling import SamplingRows

__all__ = [
    "MAX_SPEC_K",
    "check_k",
    "DraftBatch",
    "Proposals",
    "VerifyBatch",
    "AcceptResult",
    "CommitBatch",
    "DraftCommitBatch",
    "DraftExtendBatch",
    "DraftPlan",
    "VerifyPlan",
    "CommitPlan",
    "DraftCommitPlan",
    "DraftExtendPlan",
    "SpecBatch",
    "SpecPlan",
]

MAX_SPEC_K = 64
"""Largest ``k`` (draft tokens per speculative iteration) a node or ``SpecContext`` accepts.

Every row of a draft, verify and commit owns ``k + 1`` KV locations and the verify forward keeps
``k + 1`` intermediate recurrent states per row, so the executor allocates memory in proportion to
``k``: an unbounded ``k`` (``2**40`` in an otherwise empty batch) would make it try to allocate
terabytes. Greedy acceptance of ``k`` drafted tokens stops paying long before 64 (each further draft
token is accepted only if all before it were), so the bound refuses nothing useful."""


def check_k(node: object, k: object) -> int:
    """``k`` as an int in ``[1, MAX_SPEC_K]``, else ``IRValidationError`` naming ``node.k``."""
    value = check_int(node, "k", k)
    name = node if isinstance(node, str) else type(node).__name__
    if value < 1:
        raise IRValidationError(name, "k", k, "speculative steps must be >= 1")
    if value > MAX_SPEC_K:
        raise IRValidationError(name, "k", k, f"speculative steps must be at most MAX_SPEC_K ({MAX_SPEC_K})")
    return value


WINDOW_SEQ_MAX = Bound("MAX_SEQ_LEN - k - 1", lambda node: MAX_SEQ_LEN - int(node.k) - 1)
"""A row's sequence and its window of ``k + 1`` positions fit in ``MAX_SEQ_LEN``."""


def _check_ids(node: object, k: object, id_name: str, serial: object) -> int:
    """``k`` (returned, as an int) and the phase's id (``verify_id`` or ``draft_id``)."""
    value = check_k(node, k)
    _check_id(node, id_name, serial)
    return value


def _check_id(node: object, id_name: str, serial: object) -> None:
    """The phase's id (``verify_id`` or ``draft_id``): a positive int."""
    if check_int(node, id_name, serial) < 1:
        raise IRValidationError(type(node).__name__, id_name, serial, f"must be positive (use ir.mint.mint_{id_name}())")


def _check_accept_pos(node: object, accept_pos: I64, k: int) -> None:
    """A commit's positions lie in the window: ``accept_pos[i] <= k``."""
    if accept_pos.size and int(accept_pos.max()) > k:
        raise IRValidationError(type(node).__name__, "accept_pos", int(accept_pos.max()), f"must be <= k ({k})")


@final
@attrs.frozen(kw_only=True)
class DraftBatch(ColumnNode, RequestRows):
    """Draft proposal: ``input_ids[i]`` is row ``i``'s pending token, at position ``seq_lens[i] - 1``.
    ``draft_id`` names the per-step states the proposal keeps for the draft commit."""

    k: int
    draft_id: DraftId = attrs.field(metadata=shown("draft", "#"))
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    seq_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=WINDOW_SEQ_MAX, text="seq"))
    input_ids: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text="token"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(WINDOW, min=0, text=KV_NAMES))
    sampling: SamplingRows | None = attrs.field(default=None)
    """Its rows' sampling parameters, aligned with them (``None``: every row greedy)."""

    def _check_first(self) -> None:
        _check_ids(self, self.k, "draft_id", self.draft_id)  # k an int in [1, MAX_SPEC_K] before the window lengths use it


@final
@linear
@attrs.frozen(kw_only=True)
class Proposals(ColumnNode):
    """What a draft step proposed: ``k`` tokens per row of draft ``draft_id``, row-major. The draft
    executor's run of a ``DraftPlan`` produces it (``backend``), and ``prepare_for_verify`` consumes
    it: a verify checks exactly the proposals of the draft it follows, once. A linear value: a
    second verify of the same proposals, or keeping them past the step, is a mypy error
    (``ir.mypy_linear``); tokens from anywhere else are not ``Proposals`` (``arg-type``), and
    proposals of another draft are refused by ``prepare_for_verify`` naming both drafts."""

    k: int
    draft_id: DraftId = attrs.field(metadata=shown("draft", "#"))
    tokens: I64 = column(converter=as_i64, metadata=per(ANY, min=0))

    def _check_first(self) -> None:
        _check_ids(self, self.k, "draft_id", self.draft_id)

    def _check(self) -> None:
        if self.tokens.shape[0] % self.k:
            raise IRValidationError(type(self).__name__, "tokens", self.tokens.shape[0], f"must hold k ({self.k}) tokens per row")


@final
@attrs.frozen(kw_only=True)
class VerifyBatch(ColumnNode, RequestRows):
    """Target verify over ``k + 1`` positions per row: ``[pending, d1..dk]`` from position
    ``seq_lens[i] - 1``. ``verify_id`` names the intermediate states this forward produces;
    ``draft_id`` the draft whose ``Proposals`` it checks (the draft commit after it must name the
    same draft)."""

    k: int
    verify_id: VerifyId = attrs.field(metadata=shown("verify", "#"))
    draft_id: DraftId = attrs.field(metadata=shown("draft", "#"))
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    seq_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=WINDOW_SEQ_MAX, text="seq"))
    input_ids: I64 = column(converter=as_i64, metadata=per(WINDOW, min=0, text="tokens"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(WINDOW, min=0, text=KV_NAMES))
    sampling: SamplingRows | None = attrs.field(default=None)
    """Its rows' sampling parameters, aligned with them (``None``: every row greedy)."""

    def _check_first(self) -> None:
        _check_ids(self, self.k, "verify_id", self.verify_id)
        _check_ids(self, self.k, "draft_id", self.draft_id)

    def window(self, column: I64) -> I64:
        """A windowed column as ``[n, k + 1]`` (a read-only view)."""
        return column.reshape(self.num_requests, self.k + 1)


@final
@attrs.frozen(kw_only=True)
class AcceptResult(ColumnNode):
    """Greedy verification outcome of verify ``verify_id``: ``accepted[i]`` draft tokens of row
    ``i`` (request ``rids[i]``, the verify's rows in its order) were accepted (``0..k``) and
    ``bonus[i]`` is the target's token after them (``ir.results.NON_FINITE``, -1, where the target's
    logits there were not finite: whoever emits it ends the request). ``passes.accept`` sets ``verify_id`` and
    ``rids`` from the verify it judged, and ``passes.commit`` refuses a result whose ``verify_id``
    or ``rids`` are not its verify's, naming both: one verify's outcome never lands in another's
    rows."""

    verify_id: VerifyId = attrs.field(metadata=shown("verify", "#"))
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    accepted: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text="accepted"))
    bonus: I64 = column(converter=as_i64, metadata=per(REQUEST, min=-1, text="bonus"))  # (-1: ir.results.NON_FINITE, which imports this module)

    def _check_first(self) -> None:
        _check_id(self, "verify_id", self.verify_id)


@final
@attrs.frozen(kw_only=True)
class CommitBatch(ColumnNode, RequestRows):
    """Per row, commit the target state at intermediate position ``accept_pos[i]`` of verify
    ``verify_id``, which checked the proposals of draft ``draft_id``. ``released_kv`` are the KV
    locations of rejected positions, to be freed."""

    k: int
    verify_id: VerifyId = attrs.field(metadata=shown("verify", "#"))
    draft_id: DraftId = attrs.field(metadata=shown("draft", "#"))
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    seq_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=WINDOW_SEQ_MAX, text="seq"))
    accept_pos: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text="accept"))
    input_ids: I64 = column(converter=as_i64, metadata=per(WINDOW, min=0, text="tokens"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(WINDOW, min=0, text=KV_NAMES))
    released_kv: I64 = column(converter=as_i64, metadata=per(ANY, text=Shown("kv", "k", line="released")))
    """As many as the rejected positions (``len(rids) * k - sum(accept_pos)``: checked by ``_check``)."""
    sampling: SamplingRows | None = attrs.field(default=None)
    """Its rows' sampling parameters, aligned with them (``None``: every row greedy)."""

    def _check_first(self) -> None:
        _check_ids(self, self.k, "verify_id", self.verify_id)
        _check_ids(self, self.k, "draft_id", self.draft_id)

    def _check(self) -> None:
        _check_accept_pos(self, self.accept_pos, self.k)
        expected = int(self.rids.shape[0] * self.k - self.accept_pos.sum())
        check_column(self, "released_kv", self.released_kv, expected, "the rejected positions")


@final
@attrs.frozen(kw_only=True)
class DraftCommitBatch(ColumnNode, RequestRows):
    """Per row, commit the draft state that draft ``draft_id`` kept at position ``accept_pos[i]``
    (after consuming the window's tokens ``0 .. accept_pos[i]``). The window columns are the verified
    ones (``[pending, d1..dk]`` and their KV locations); the KV locations of rejected positions were
    released by the target's commit, which shares them."""

    k: int
    draft_id: DraftId = attrs.field(metadata=shown("draft", "#"))
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    seq_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=WINDOW_SEQ_MAX, text="seq"))
    accept_pos: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text="accept"))
    input_ids: I64 = column(converter=as_i64, metadata=per(WINDOW, min=0, text="tokens"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(WINDOW, min=0, text=KV_NAMES))
    sampling: SamplingRows | None = attrs.field(default=None)
    """Its rows' sampling parameters, aligned with them (``None``: every row greedy)."""

    def _check_first(self) -> None:
        _check_ids(self, self.k, "draft_id", self.draft_id)

    def _check(self) -> None:
        _check_accept_pos(self, self.accept_pos, self.k)


@final
@attrs.frozen(kw_only=True)
class DraftExtendBatch(ColumnNode, RequestRows):
    """The draft model's catch-up forward over the accepted tokens ``p, d1..dm`` of each row, from
    its committed state after ``prefix_lens[i]`` tokens. Extend-shaped, without an init field."""

    rids: I64 = column(converter=as_i64, metadata=per(REQUEST, text=REQUEST_NAME))
    slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
    prefix_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, max=PREFIX_MAX, text="prefix"))
    extend_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, max=MAX_SEQ_LEN, max_what=MAX_SEQ_LEN_WHAT, text="extend"))
    input_ids: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text="tokens"))
    kv_locs: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text=KV_NAMES))
    sampling: SamplingRows | None = attrs.field(default=None)
    """Its rows' sampling parameters, aligned with them (``None``: every row greedy)."""


# Spec plans wrap their batch: each of these batches already holds exactly what its forward needs
# and nothing the backend must not act on (no init ops), so lowering adds only the phase's name.
# Their checks are the batch's type (``ir.verify`` re-runs the batch's own checks).


class _BatchPlan(Composite, RequestRows):
    """A speculative plan: its rows are its batch's (``rids``, ``slots``)."""

    __slots__ = ()

    @property
    def batch(self) -> SpecBatch:
        """The batch the plan was lowered from, of its phase's type: everything its forward needs."""
        raise NotImplementedError  # the plan's field

    @property
    def rids(self) -> I64:
        return self.batch.rids

    @property
    def slots(self) -> I64:
        return self.batch.slots


@final
@attrs.frozen(kw_only=True)
class DraftPlan(_BatchPlan):
    """The plan of a ``DraftBatch``: the draft model proposes ``k`` tokens per row, and keeps the
    state of each step under the batch's ``draft_id``."""

    batch: DraftBatch


@final
@attrs.frozen(kw_only=True)
class VerifyPlan(_BatchPlan):
    """The plan of a ``VerifyBatch``: the target scores the ``k + 1`` window positions of every row
    in one forward, keeping each position's state under the batch's ``verify_id``."""

    batch: VerifyBatch
    keep_hidden: HiddenId | None = attrs.field(default=None, metadata=shown("hidden", "#"))
    """The target's hidden states at every window position are kept under this id for the draft
    head's commit, and the result hands back their handle (``ir.hidden``); ``None``: none kept."""

    def _check(self) -> None:
        check_hidden_id("VerifyPlan", "keep_hidden", self.keep_hidden)


@final
@attrs.frozen(kw_only=True)
class CommitPlan(_BatchPlan):
    """The plan of a ``CommitBatch``: the target's state at each row's accepted position becomes its
    committed state."""

    batch: CommitBatch


@final
@attrs.frozen(kw_only=True)
class DraftCommitPlan(_BatchPlan):
    """The plan of a ``DraftCommitBatch``: the draft state its proposal kept at each row's accepted
    position becomes the draft's committed state (no forward runs)."""

    batch: DraftCommitBatch


@final
@attrs.frozen(kw_only=True)
class DraftExtendPlan(_BatchPlan):
    """The plan of a ``DraftExtendBatch``: the draft model's catch-up forward over each row's accepted
    tokens, for a draft that keeps no per-step states."""

    batch: DraftExtendBatch


SpecBatch: TypeAlias = DraftBatch | VerifyBatch | CommitBatch | DraftCommitBatch | DraftExtendBatch
SpecPlan: TypeAlias = DraftPlan | VerifyPlan | CommitPlan | DraftCommitPlan | DraftExtendPlan
