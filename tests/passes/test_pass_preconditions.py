"""Every precondition a pass checks, one case each: the pass refuses input outside it with
``PreconditionError`` naming the pass and the bad value, and input just inside it is accepted.

The spec iteration below has 3 running rows and k = 2 (a window of 9 positions), so a message that
shows at most 8 entries of a column shows a cut one.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import pytest
from typeguard import suppress_type_checks

from ir.columns import MAX_SEQ_LEN
from ir.errors import PreconditionError
from ir.request import AdmittedRequest
from ir.results import NON_FINITE, Verified
from ir.spec import AcceptResult, CommitBatch, DraftBatch, Proposals, VerifyBatch
from passes.accept import accept
from passes.commit import commit
from passes.filter_batch import filter_batch
from passes.merge_batch import merge_batch
from passes.mix_with_running import mix_with_running
from passes.prepare_for_decode import DecodeContext, prepare_for_decode
from passes.prepare_for_draft import SpecContext, prepare_for_draft
from passes.prepare_for_draft_commit import prepare_for_draft_commit
from passes.prepare_for_extend import prepare_for_extend
from passes.prepare_for_verify import prepare_for_verify
from tests.helpers import decode_batch, proposed, request, verified

RUNNING = decode_batch([1, 2, 3], [1, 2, 3], [4, 4, 4], [20, 21, 22])


def _draft(kv0: int = 30, k: int = 2, running: object = RUNNING) -> DraftBatch:
    n = 3
    return prepare_for_draft(running, SpecContext(k=k, next_tokens=[3] * n, kv_locs=list(range(kv0, kv0 + n * (k + 1)))))  # type: ignore[arg-type]  # a DecodeBatch


DRAFT = _draft()


def _naming(draft: DraftBatch) -> tuple[CommitBatch, DraftBatch]:
    """``COMMIT`` forged to name ``draft`` (so the checks after the draft-id one are reached)."""
    return attrs.evolve(COMMIT, draft_id=draft.draft_id), draft
VERIFY: VerifyBatch = prepare_for_verify(DRAFT, proposed(DRAFT, np.full(6, 7, dtype=np.int64)))
OTHER_VERIFY: VerifyBatch = prepare_for_verify(DRAFT, proposed(DRAFT, np.full(6, 7, dtype=np.int64)))
"""A second verify of the same draft: the same rows, another ``verify_id``."""
COMMIT: CommitBatch = commit(VERIFY, accept(VERIFY, verified(VERIFY, np.full(9, 7, dtype=np.int64))))


def _result(*, rids: list[int] | None = None, accepted: list[int] | None = None) -> AcceptResult:
    """An ``AcceptResult`` naming ``VERIFY`` (its rows unless ``rids``), 1 accepted per row unless ``accepted``."""
    rows = rids if rids is not None else VERIFY.rid_list()
    return AcceptResult(verify_id=VERIFY.verify_id, rids=rows, accepted=accepted or [1] * len(rows), bonus=[7] * len(rows))
EXTEND = prepare_for_extend([request(9, 5, [3, 4], 50)])


def _ctx(n: int, rids: list[int] | None = None) -> DecodeContext:
    return DecodeContext(next_tokens=[7] * n, kv_locs=list(range(60, 60 + n)), rids=rids)


def _targets(*, rids: list[int] | None = None, k: int = 2) -> Verified:
    """Target tokens (all 7) naming ``VERIFY`` (its rows unless ``rids``, a window of ``k``)."""
    rows = rids if rids is not None else VERIFY.rid_list()
    return Verified(k=k, verify_id=VERIFY.verify_id, rids=rows, tokens=[7] * (len(rows) * (k + 1)))


def _i64(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


CASES: list[tuple[str, Callable[[], object], str]] = [
    ("accept: the target tokens of another verify", lambda: accept(VERIFY, verified(OTHER_VERIFY, np.full(9, 7, dtype=np.int64))), (
        r"^accept: the target tokens of verify #(\d+) cannot judge verify #(?!\1)\d+: a verify's drafts are judged by its own target tokens$"
    )),
    ("accept: target tokens of rows in another order", lambda: accept(VERIFY, _targets(rids=[1, 3, 2])), (
        r"^accept: the target tokens of verify #\d+ are for rows \[1, 3, 2\], the verify's are \[1, 2, 3\] \(row 1: request 3, the verify's 2\): "
        r"each row's drafts are judged by that row's target tokens$"
    )),
    ("accept: target tokens of fewer rows", lambda: accept(VERIFY, _targets(rids=[1, 2])), (
        r"^accept: the target tokens of verify #\d+ are for 2 rows \[1, 2\], the verify has 3 rows \[1, 2, 3\]: "
    )),
    ("accept: target tokens of another window", lambda: accept(VERIFY, _targets(k=1)), (
        r"^accept: the target tokens of verify #(\d+) have a window of k=1, verify #\1 has k=2$"
    )),
    ("decode: a context bound to other rows", lambda: prepare_for_decode(RUNNING, attrs.evolve(_ctx(3), rids=[1, 2, 4])), (
        r"^prepare_for_decode: the context's next tokens are for rows \[1, 2, 4\], the batch's are \[1, 2, 3\] \(row 2: request 4, the batch's 3\): "
        r"each row is fed its own request's next tokens$"
    )),
    ("decode: a context bound to rows in another order", lambda: prepare_for_decode(RUNNING, attrs.evolve(_ctx(3), rids=[2, 1, 3])), (
        r"^prepare_for_decode: the context's next tokens are for rows \[2, 1, 3\], the batch's are \[1, 2, 3\] \(row 0: request 2, the batch's 1\)"
    )),
    ("decode: a context bound to fewer rows", lambda: prepare_for_decode(RUNNING, _ctx(2, rids=[1, 2])), (
        r"^prepare_for_decode: the context's next tokens are for 2 rows \[1, 2\], the batch has 3 rows \[1, 2, 3\]"
    )),
    ("draft: a context bound to other rows", lambda: prepare_for_draft(RUNNING, SpecContext(k=2, next_tokens=[3] * 3, kv_locs=range(30, 39), rids=[3, 2, 1])), (
        r"^prepare_for_draft: the context's next tokens are for rows \[3, 2, 1\], the batch's are \[1, 2, 3\] \(row 0: request 3, the batch's 1\): "
        r"each row is fed its own request's next tokens$"
    )),
    ("commit: rows", lambda: commit(VERIFY, _result(rids=[1, 2], accepted=[1, 1])), (
        r"^commit: the accept result of verify #\d+ judged 2 rows \[1, 2\], the verify has 3 rows \[1, 2, 3\]: "
        r"a commit applies each row's result to that row$"
    )),
    ("commit: rows in another order", lambda: commit(VERIFY, _result(rids=[1, 3, 2])), (
        r"^commit: the accept result of verify #\d+ judged rows \[1, 3, 2\], the verify's are \[1, 2, 3\] \(row 1: request 3, the verify's 2\): "
        r"a commit applies each row's result to that row$"
    )),
    ("commit: other rows", lambda: commit(VERIFY, _result(rids=[1, 2, 4])), (
        r"^commit: the accept result of verify #\d+ judged rows \[1, 2, 4\], the verify's are \[1, 2, 3\] \(row 2: request 4, the verify's 3\)"
    )),
    ("commit: the result of another verify", lambda: commit(VERIFY, accept(OTHER_VERIFY, verified(OTHER_VERIFY, np.full(9, 7, dtype=np.int64)))), (
        r"^commit: the accept result of verify #(\d+) cannot commit verify #(?!\1)\d+: a commit applies the result of the verify it judged$"
    )),
    ("commit: accepted > k", lambda: commit(VERIFY, _result(accepted=[0, 3, 1])), r"^commit: accepted 3 > k=2$"),
    ("filter: float array", lambda: filter_batch(RUNNING, np.array([1.0])), r"^filter_batch: drop must be an iterable of request ids \(ints\), got an ndarray of dtype float64 and shape \(1,\)"),
    ("filter: 2-D array", lambda: filter_batch(RUNNING, np.ones((1, 1), dtype=np.int64)), r"^filter_batch: drop must be an iterable of request ids \(ints\), got an ndarray of dtype int64 and shape \(1, 1\)"),
    ("filter: past int64", lambda: filter_batch(RUNNING, np.array([1, 2**63], dtype=np.uint64)), r"^filter_batch: drop: every entry must fit in int64 \(got 9223372036854775808\)$"),
    ("filter: a str", lambda: filter_batch(RUNNING, "12"), r"^filter_batch: drop must be an iterable of request ids \(ints\), got str \('12'\)$"),
    ("filter: a float entry", lambda: filter_batch(RUNNING, [1, 2.5]), r"^filter_batch: drop: every entry .* \(got 2\.5\)$"),
    ("merge: rid in both", lambda: merge_batch(RUNNING, prepare_for_extend([request(2, 5, [3], 50)])), r"^merge_batch: request id 2 is in both the running and the prefilled batch$"),
    ("merge: slot in both", lambda: merge_batch(RUNNING, prepare_for_extend([request(9, 3, [3], 50)])), r"^merge_batch: slot 3 is in both the running and the prefilled batch$"),
    ("mix: rid in both", lambda: mix_with_running(prepare_for_extend([request(3, 5, [3], 50)]), RUNNING), r"^mix_with_running: request id 3 is in both the extend and the running part$"),
    ("mix: slot in both", lambda: mix_with_running(prepare_for_extend([request(9, 1, [3], 50)]), RUNNING), r"^mix_with_running: slot 1 is in both the extend and the running part$"),
    ("decode: context short", lambda: prepare_for_decode(RUNNING, _ctx(2)), r"^prepare_for_decode: ctx\.next_tokens has 2 entries for 3 decoding requests$"),
    ("decode: context long", lambda: prepare_for_decode(RUNNING, _ctx(4)), r"^prepare_for_decode: ctx\.next_tokens has 4 entries for 3 decoding requests$"),
    ("decode: full sequence", lambda: prepare_for_decode(decode_batch([1], [1], [MAX_SEQ_LEN], [5]), _ctx(1)), rf"^prepare_for_decode: a sequence of {MAX_SEQ_LEN} tokens cannot grow: MAX_SEQ_LEN is {MAX_SEQ_LEN}$"),
    ("draft: pending short", lambda: prepare_for_draft(RUNNING, SpecContext(k=2, next_tokens=[3, 3], kv_locs=list(range(30, 36)))), r"^prepare_for_draft: ctx has 2 pending tokens for 3 rows$"),
    ("draft: no room", lambda: _draft(running=decode_batch([1, 2, 3], [1, 2, 3], [4, MAX_SEQ_LEN - 3, 4], [20, 21, 22])), rf"^prepare_for_draft: a sequence of {MAX_SEQ_LEN - 3} tokens has no room for k \+ 1 = 3 more under MAX_SEQ_LEN$"),
    ("draft commit: the proposals of another draft", lambda: prepare_for_draft_commit(COMMIT, _draft()), (
        r"^prepare_for_draft_commit: the commit of verify #\d+ checked the proposals of draft #(\d+), not those of draft #(?!\1)\d+: "
        r"a draft commit pairs a commit with the draft whose proposals its verify checked$"
    )),
    # (a commit forged to name the other draft: its rows and k are still checked)
    ("draft commit: k", lambda: prepare_for_draft_commit(*_naming(_draft(k=1))), r"^prepare_for_draft_commit: the commit has k=2, the draft #\d+ k=1$"),
    ("draft commit: another draft", lambda: prepare_for_draft_commit(*_naming(_draft(kv0=40))), (
        r"^prepare_for_draft_commit: the commit's kv_locs \[30, 31, 32, 33, 34, 35, 36, 37\] are not those of draft #\d+ "
        r"\(\[40, 41, 42, 43, 44, 45, 46, 47\]\): a draft commit pairs a commit with the draft of its own iteration$"
    )),
    ("draft commit: other rows", lambda: prepare_for_draft_commit(COMMIT, attrs.evolve(DRAFT, rids=[1, 2, 4])), r"^prepare_for_draft_commit: the commit's rids \[1, 2, 3\] are not those of draft #\d+ \(\[1, 2, 4\]\)"),
    ("extend: nothing", lambda: prepare_for_extend([]), r"^prepare_for_extend: no admitted requests \(schedule an IdleBatch instead\)$"),
    ("verify: count", lambda: prepare_for_verify(DRAFT, proposed(DRAFT, np.full(4, 7, dtype=np.int64))), (
        r"^prepare_for_verify: the proposals of draft #\d+ hold 4 tokens with k=2; the draft has 3 rows x k=2$"
    )),
    ("verify: k", lambda: prepare_for_verify(DRAFT, Proposals(k=3, draft_id=DRAFT.draft_id, tokens=np.full(6, 7, dtype=np.int64))), (
        r"^prepare_for_verify: the proposals of draft #\d+ hold 6 tokens with k=3; the draft has 3 rows x k=2$"
    )),
    ("verify: another draft", lambda: prepare_for_verify(DRAFT, proposed(_draft(), np.full(6, 7, dtype=np.int64))), (
        r"^prepare_for_verify: the proposals of draft #(\d+) cannot be verified against draft #(?!\1)\d+: a verify checks the proposals of the draft it follows$"
    )),
]


@pytest.mark.parametrize(("call", "match"), [pytest.param(c, m, id=i) for i, c, m in CASES])
def test_a_pass_refuses_input_outside_its_precondition(call: Callable[[], object], match: str) -> None:
    with pytest.raises(PreconditionError, match=match):
        call()


def test_input_at_the_edge_of_each_precondition_is_accepted() -> None:
    assert commit(VERIFY, _result(accepted=[2, 2, 0])).accept_pos.tolist() == [2, 2, 0]  # k accepted: fine
    assert filter_batch(RUNNING, np.array([2, 2**62], dtype=np.uint64)).rid_list() == [1, 3]
    assert filter_batch(RUNNING, (r for r in [3])).rid_list() == [1, 2]
    assert prepare_for_decode(decode_batch([1], [1], [MAX_SEQ_LEN - 1], [5]), _ctx(1)).seq_lens.tolist() == [MAX_SEQ_LEN]
    edge = decode_batch([1, 2, 3], [1, 2, 3], [4, MAX_SEQ_LEN - 4, 4], [20, 21, 22])
    assert _draft(running=edge).k == 2  # k + 1 = 3 more positions still fit
    assert prepare_for_draft_commit(COMMIT, DRAFT).accept_pos.tolist() == COMMIT.accept_pos.tolist()
    ok = np.full(9, 7, dtype=np.int64)
    ok[4] = 0
    assert accept(VERIFY, verified(VERIFY, ok)).accepted.tolist() == [2, 1, 2]  # a token id 0 is a token (one the draft did not propose)
    assert prepare_for_verify(DRAFT, proposed(DRAFT, _i64(0, 7, 7, 7, 7, 7))).k == 2
    # a context bound to exactly the batch's rows, in its order, is fed as an unbound one is
    assert prepare_for_decode(RUNNING, _ctx(3, rids=[1, 2, 3])) == prepare_for_decode(RUNNING, _ctx(3))
    bound = SpecContext(k=2, next_tokens=[3] * 3, kv_locs=range(30, 39), rids=[1, 2, 3])
    assert prepare_for_draft(RUNNING, bound).input_ids.tolist() == [3, 3, 3]
    # a target token whose logits were not finite (NON_FINITE, -1) is never accepted, and is the bonus it reaches
    flagged = np.full(9, 7, dtype=np.int64)
    flagged[[1, 3, 8]] = NON_FINITE  # row 0's second prediction, row 1's first, row 2's bonus position
    result = accept(VERIFY, verified(VERIFY, flagged))
    assert result.accepted.tolist() == [1, 0, 2] and result.bonus.tolist() == [NON_FINITE, NON_FINITE, NON_FINITE]


def test_prepare_for_extend_takes_any_admitted_request_and_names_the_first_that_is_not() -> None:
    class Tagged(AdmittedRequest):  # a caller's own record type (the class is final for mypy only)
        pass

    r = request(4, 2, [5], 9)
    tagged = Tagged(rid=r.rid, slot=r.slot, input_ids=r.input_ids, kv_locs=r.kv_locs, intent=r.intent)
    assert prepare_for_extend([tagged, request(5, 3, [6], 10)]).rid_list() == [4, 5]
    with suppress_type_checks(), pytest.raises(PreconditionError, match=r"^prepare_for_extend: requests\[1\] must be an AdmittedRequest, got str \('x'\)$"):
        prepare_for_extend([r, "x"])  # type: ignore[list-item]  # the refusal under test


def test_a_verified_result_is_named_by_a_positive_verify_id() -> None:
    # the id binds the target tokens to the verify that produced them (accept and the boundary compare it)
    from ir.errors import IRValidationError
    from ir.ids import VerifyId

    assert Verified(k=1, verify_id=VerifyId(1), rids=[3], tokens=[5, 6]).verify_id == 1
    for bad in (0, -4):
        with pytest.raises(IRValidationError, match=rf"Verified\.verify_id: must be positive .*\(got {bad}\)"):
            Verified(k=1, verify_id=VerifyId(bad), rids=[3], tokens=[5, 6])
