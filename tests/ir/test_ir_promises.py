"""What the IR modules promise in their docstrings, at each bound: a value just inside is accepted,
one just outside is refused with the node, the field and the value named (``IRValidationError``).

One small node per case (a well-formed neighbour of it is accepted in the same test), so each check
has a case that only it refuses: the speculative nodes (``ir.spec``), the draft head's nodes
(``ir.head``), the hidden-state handle (``ir.hidden``), the results (``ir.results``), the sampling
rows (``ir.sampling``) and the plans (``ir.plan``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ir.errors import IRValidationError
from ir.head import HeadCommitBatch, HeadExtendBatch, HeadExtendPlan
from ir.hidden import HiddenSource, HiddenStates, asked_hidden
from ir.ids import TARGET_POOL, DraftId, HiddenId, PoolId, SampleId, TicketSerial, VerifyId
from ir.init import InitIntent, MambaInit, MambaSnapshot, Ticket, When
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from ir.results import NON_FINITE, Logprobs, Ran, Sampled, Verified
from ir.sampling import MAX_LOGPROBS, SamplingRows
from ir.spec import (
    MAX_SPEC_K,
    CommitBatch,
    DraftBatch,
    DraftCommitBatch,
    Proposals,
    VerifyBatch,
    VerifyPlan,
    check_k,
)

CLEAR = InitIntent.CLEAR


def refused(build: Callable[[], object], node: str, field: str) -> IRValidationError:
    """``build()`` raises ``IRValidationError`` naming ``node.field`` (one line); returned for more checks."""
    with pytest.raises(IRValidationError) as info:
        build()
    err = info.value
    assert (err.node, err.field) == (node, field), str(err)
    assert str(err).startswith(f"{node}.{field}: ") and "\n" not in str(err)
    return err


# -- ir.spec -------------------------------------------------------------------------------------


def _window(k: int, n: int = 1) -> dict[str, Any]:
    return {"input_ids": [1] * (n * (k + 1)), "kv_locs": list(range(n * (k + 1)))}


def draft(k: int = 2, **over: Any) -> DraftBatch:
    f: dict[str, Any] = {"k": k, "draft_id": DraftId(1), "rids": [1], "slots": [1], "seq_lens": [4], "input_ids": [3], "kv_locs": list(range(k + 1))}
    f.update(over)
    return DraftBatch(**f)


def verify_batch(k: int = 2, **over: Any) -> VerifyBatch:
    f: dict[str, Any] = {"k": k, "verify_id": VerifyId(1), "draft_id": DraftId(1), "rids": [1], "slots": [1], "seq_lens": [4], **_window(k)}
    f.update(over)
    return VerifyBatch(**f)


def commit_batch(k: int = 2, accept: int = 1, **over: Any) -> CommitBatch:
    f: dict[str, Any] = {
        "k": k, "verify_id": VerifyId(1), "draft_id": DraftId(1), "rids": [1], "slots": [1], "seq_lens": [4], "accept_pos": [accept],
        **_window(k), "released_kv": list(range(100, 100 + k - accept)),
    }
    f.update(over)
    return CommitBatch(**f)


def draft_commit(k: int = 2, accept: int = 1, **over: Any) -> DraftCommitBatch:
    f: dict[str, Any] = {"k": k, "draft_id": DraftId(1), "rids": [1], "slots": [1], "seq_lens": [4], "accept_pos": [accept], **_window(k)}
    f.update(over)
    return DraftCommitBatch(**f)


def test_k_is_accepted_in_1_to_max_spec_k_and_refused_outside_naming_the_node() -> None:
    assert check_k("Node", 1) == 1 and check_k("Node", MAX_SPEC_K) == MAX_SPEC_K
    assert check_k("Node", np.int64(3)) == 3 and type(check_k("Node", np.int64(3))) is int
    err = refused(lambda: check_k("Node", MAX_SPEC_K + 1), "Node", "k")
    assert err.value == MAX_SPEC_K + 1 and f"at most MAX_SPEC_K ({MAX_SPEC_K})" in str(err)
    err = refused(lambda: check_k("Node", 0), "Node", "k")
    assert err.value == 0 and ">= 1" in str(err)
    refused(lambda: check_k("Node", 2.0), "Node", "k")
    # every speculative node checks its k the same way, under its own name
    assert draft(k=MAX_SPEC_K).k == MAX_SPEC_K
    refused(lambda: draft(k=MAX_SPEC_K + 1, kv_locs=list(range(MAX_SPEC_K + 2))), "DraftBatch", "k")
    refused(lambda: verify_batch(k=MAX_SPEC_K + 1), "VerifyBatch", "k")
    refused(lambda: commit_batch(k=MAX_SPEC_K + 1), "CommitBatch", "k")
    refused(lambda: draft_commit(k=0, accept=0), "DraftCommitBatch", "k")
    refused(lambda: Proposals(k=MAX_SPEC_K + 1, draft_id=DraftId(1), tokens=[]), "Proposals", "k")
    refused(lambda: Verified(k=0, verify_id=VerifyId(1), rids=[], tokens=[]), "Verified", "k")


@pytest.mark.parametrize(
    ("build", "node", "field"),
    [
        (lambda: draft(draft_id=0), "DraftBatch", "draft_id"),
        (lambda: verify_batch(verify_id=0), "VerifyBatch", "verify_id"),
        (lambda: verify_batch(draft_id=0), "VerifyBatch", "draft_id"),
        (lambda: commit_batch(verify_id=0), "CommitBatch", "verify_id"),
        (lambda: commit_batch(draft_id=0), "CommitBatch", "draft_id"),
        (lambda: draft_commit(draft_id=0), "DraftCommitBatch", "draft_id"),
        (lambda: Proposals(k=2, draft_id=DraftId(0), tokens=[1, 2]), "Proposals", "draft_id"),
        (lambda: Verified(k=2, verify_id=VerifyId(0), rids=[1], tokens=[1, 2, 3]), "Verified", "verify_id"),
    ],
)
def test_phase_ids_must_be_positive(build: Callable[[], object], node: str, field: str) -> None:
    err = refused(build, node, field)
    assert err.value == 0 and "must be positive" in str(err)


def test_phase_ids_of_one_are_accepted() -> None:
    assert draft().draft_id == 1 and verify_batch().verify_id == 1 and commit_batch().draft_id == 1 and draft_commit().draft_id == 1
    assert Proposals(k=2, draft_id=DraftId(1), tokens=[1, 2]).tokens.tolist() == [1, 2]
    Verified(k=2, verify_id=VerifyId(1), rids=[1], tokens=[1, 2, 3])


def test_a_commit_position_lies_in_the_window() -> None:
    # accept_pos == k (every draft accepted) is the last position of the window
    assert int(commit_batch(k=2, accept=2).accept_pos[0]) == 2
    assert int(draft_commit(k=2, accept=2).accept_pos[0]) == 2
    err = refused(lambda: commit_batch(k=2, accept=3, released_kv=[]), "CommitBatch", "accept_pos")
    assert err.value == 3 and "must be <= k (2)" in str(err)
    err = refused(lambda: draft_commit(k=2, accept=3), "DraftCommitBatch", "accept_pos")
    assert err.value == 3 and "must be <= k (2)" in str(err)
    # the largest position is the one named, whichever row holds it
    two = {"rids": [1, 2], "slots": [1, 2], "seq_lens": [4, 4], **_window(2, 2)}
    err = refused(lambda: draft_commit(k=2, accept=0, **{**two, "accept_pos": [4, 3]}), "DraftCommitBatch", "accept_pos")
    assert err.value == 4


def test_a_commit_releases_exactly_the_rejected_positions() -> None:
    for accept in (0, 1, 2):
        assert commit_batch(k=2, accept=accept).released_kv.shape[0] == 2 - accept
    err = refused(lambda: commit_batch(k=2, accept=1, released_kv=[100, 101]), "CommitBatch", "released_kv")
    assert err.value == 2 and "rejected positions (1)" in str(err)
    refused(lambda: commit_batch(k=2, accept=1, released_kv=[]), "CommitBatch", "released_kv")
    two = {"rids": [1, 2], "slots": [1, 2], "seq_lens": [4, 4], **_window(3, 2)}
    # 2 rows * k 3 - (1 + 2) accepted = 3 rejected
    assert commit_batch(k=3, **{**two, "accept_pos": [1, 2], "released_kv": [7, 8, 9]}).released_kv.shape[0] == 3
    refused(lambda: commit_batch(k=3, **{**two, "accept_pos": [1, 2], "released_kv": [7, 8]}), "CommitBatch", "released_kv")


def test_proposals_hold_k_tokens_per_row() -> None:
    assert Proposals(k=3, draft_id=DraftId(1), tokens=[1, 2, 3, 4, 5, 6]).tokens.shape[0] == 6
    Proposals(k=3, draft_id=DraftId(1), tokens=[])
    err = refused(lambda: Proposals(k=3, draft_id=DraftId(1), tokens=[1, 2, 3, 4]), "Proposals", "tokens")
    assert err.value == 4 and "k (3) tokens per row" in str(err)
    refused(lambda: Proposals(k=3, draft_id=DraftId(1), tokens=[1, 2]), "Proposals", "tokens")


def test_a_window_row_fits_max_seq_len() -> None:
    from ir.columns import MAX_SEQ_LEN

    k = 2
    assert int(verify_batch(k=k, seq_lens=[MAX_SEQ_LEN - k - 1]).seq_lens[0]) == MAX_SEQ_LEN - k - 1
    err = refused(lambda: verify_batch(k=k, seq_lens=[MAX_SEQ_LEN - k]), "VerifyBatch", "seq_lens")
    assert err.value == MAX_SEQ_LEN - k
    refused(lambda: draft(k=k, seq_lens=[MAX_SEQ_LEN - k]), "DraftBatch", "seq_lens")
    refused(lambda: verify_batch(k=k, seq_lens=[0]), "VerifyBatch", "seq_lens")


def test_a_verify_plan_keeps_hidden_states_only_under_a_positive_id() -> None:
    b = verify_batch()
    assert VerifyPlan(batch=b).keep_hidden is None
    assert VerifyPlan(batch=b, keep_hidden=HiddenId(1)).keep_hidden == 1
    err = refused(lambda: VerifyPlan(batch=b, keep_hidden=HiddenId(0)), "VerifyPlan", "keep_hidden")
    assert err.value == 0 and "positive hidden id" in str(err)
    refused(lambda: VerifyPlan(batch=b, keep_hidden=HiddenId(-3)), "VerifyPlan", "keep_hidden")
    refused(lambda: VerifyPlan(batch=b, keep_hidden=1.0), "VerifyPlan", "keep_hidden")  # type: ignore[arg-type]
    # the plan's rows are its batch's
    assert VerifyPlan(batch=b).rid_list() == [1] and VerifyPlan(batch=b).slot_list() == [1]


def test_a_verify_window_is_k_plus_one_per_row() -> None:
    b = verify_batch(k=2, rids=[1, 2], slots=[1, 2], seq_lens=[4, 5], input_ids=[1, 2, 3, 4, 5, 6], kv_locs=list(range(6)))
    assert b.window(b.input_ids).tolist() == [[1, 2, 3], [4, 5, 6]]
    refused(lambda: verify_batch(k=2, input_ids=[1, 2]), "VerifyBatch", "input_ids")


# -- ir.head -------------------------------------------------------------------------------------


def head_commit(k: int = 2, accept: list[int] | None = None, **over: Any) -> HeadCommitBatch:
    acc = [1] if accept is None else accept
    n = len(acc)
    lens = [a + 1 for a in acc]
    f: dict[str, Any] = {
        "k": k, "hidden_id": HiddenId(1), "rids": list(range(1, n + 1)), "slots": list(range(1, n + 1)), "prefix_lens": [3] * n,
        "accept_pos": acc, "extend_lens": lens, "input_ids": [1] * sum(lens), "kv_locs": list(range(sum(lens))),
    }
    f.update(over)
    return HeadCommitBatch(**f)


def head_extend(**over: Any) -> HeadExtendBatch:
    f: dict[str, Any] = {
        "hidden_id": HiddenId(1), "rids": [1], "slots": [1], "prefix_lens": [0], "extend_lens": [2], "intents": (CLEAR,),
        "input_ids": [5, 6], "kv_locs": [0, 1], "init": MambaInit(serial=TicketSerial(3), clear_slots=(1,)),
    }
    f.update(over)
    return HeadExtendBatch(**f)


def test_a_head_commit_reads_window_positions_up_to_k() -> None:
    assert head_commit(k=2, accept=[2]).accept_pos.tolist() == [2]
    assert head_commit(k=2, accept=[0, 2]).extend_lens.tolist() == [1, 3]
    err = refused(lambda: head_commit(k=2, accept=[3]), "HeadCommitBatch", "accept_pos")
    assert err.value == 3 and "must be <= k (2)" in str(err)
    err = refused(lambda: head_commit(k=2, accept=[1, 4]), "HeadCommitBatch", "accept_pos")
    assert err.value == 4


def test_a_head_commit_feeds_accept_pos_plus_one_tokens_per_row_naming_the_first_bad_row() -> None:
    err = refused(lambda: head_commit(k=2, accept=[1], extend_lens=[1], input_ids=[1], kv_locs=[0]), "HeadCommitBatch", "extend_lens")
    assert err.value == 1 and "row 0 must feed accept_pos + 1 (2) tokens" in str(err)
    err = refused(lambda: head_commit(k=3, accept=[0, 1, 2], extend_lens=[1, 3, 2], input_ids=[1] * 6, kv_locs=list(range(6))),
                  "HeadCommitBatch", "extend_lens")
    assert err.value == 3 and "row 1 must feed accept_pos + 1 (2) tokens" in str(err)


def test_head_nodes_check_k_and_hidden_id() -> None:
    assert head_commit(k=MAX_SPEC_K).k == MAX_SPEC_K
    refused(lambda: head_commit(k=MAX_SPEC_K + 1), "HeadCommitBatch", "k")
    refused(lambda: head_commit(k=0, accept=[0]), "HeadCommitBatch", "k")
    err = refused(lambda: head_commit(hidden_id=0), "HeadCommitBatch", "hidden_id")
    assert err.value == 0 and "must be positive" in str(err)
    assert head_extend().hidden_id == 1
    refused(lambda: head_extend(hidden_id=0), "HeadExtendBatch", "hidden_id")
    refused(lambda: head_extend(hidden_id=-1), "HeadExtendBatch", "hidden_id")
    refused(lambda: head_extend(hidden_id="1"), "HeadExtendBatch", "hidden_id")


def test_a_head_extend_has_one_intent_per_row_and_no_empty_init() -> None:
    assert head_extend().num_tokens == 2
    assert head_extend(init=None).init is None
    err = refused(lambda: head_extend(intents=(CLEAR, CLEAR)), "HeadExtendBatch", "intents")
    assert err.value == 2 and "len(rids) (1)" in str(err)
    refused(lambda: head_extend(intents=()), "HeadExtendBatch", "intents")
    refused(lambda: head_extend(intents=CLEAR), "HeadExtendBatch", "intents")
    refused(lambda: head_extend(intents=("clear",)), "HeadExtendBatch", "intents")
    err = refused(lambda: head_extend(init=MambaInit(serial=TicketSerial(3))), "HeadExtendBatch", "init")
    assert "empty MambaInit must be None" in str(err)


def _head_plan(**over: Any) -> HeadExtendPlan:
    f: dict[str, Any] = {
        "hidden_id": HiddenId(2), "rids": [1], "slots": [1], "prefix_lens": [0], "extend_lens": [1], "input_ids": [5], "kv_locs": [0],
        "tickets": (Ticket(pool=PoolId("head"), op=MambaInit(serial=TicketSerial(3), clear_slots=(1,))),),
    }
    f.update(over)
    return HeadExtendPlan(**f)


def test_a_head_extend_plan_checks_its_tickets_and_hidden_id() -> None:
    plan = _head_plan()
    assert plan.ticket_for(PoolId("head")) is not None and plan.ticket_for(TARGET_POOL) is None
    refused(lambda: _head_plan(hidden_id=0), "HeadExtendPlan", "hidden_id")
    snap = Ticket(pool=PoolId("head"), op=MambaSnapshot(serial=TicketSerial(4), src=(1,), dst=(9,)))
    assert _head_plan(snapshots=(snap,)).snapshot_for(PoolId("head")) == snap
    # a snapshot is not an init ticket, and an init is not a snapshot ticket
    refused(lambda: _head_plan(tickets=(snap,)), "HeadExtendPlan", "tickets")
    refused(lambda: _head_plan(snapshots=plan.tickets), "HeadExtendPlan", "snapshots")


# -- ir.hidden -----------------------------------------------------------------------------------


def hidden(**over: Any) -> HiddenStates:
    f: dict[str, Any] = {"hidden_id": HiddenId(5), "source": HiddenSource.EXTEND, "rids": [3, 4], "starts": [0, 8], "lens": [4, 2]}
    f.update(over)
    return HiddenStates(**f)


def test_hidden_states_invariants() -> None:
    assert hidden().verify_id is None
    assert hidden(source=HiddenSource.VERIFY, verify_id=VerifyId(1)).verify_id == 1
    assert hidden(starts=[0, 0], lens=[1, 1]).lens.tolist() == [1, 1]
    assert hidden(hidden_id=HiddenId(1)).hidden_id == 1  # the first id a minter gives
    err = refused(lambda: hidden(hidden_id=0), "HiddenStates", "hidden_id")
    assert err.value == 0
    refused(lambda: hidden(source="extend"), "HiddenStates", "source")
    # verify_id names the producing verify exactly when the source is a verify
    refused(lambda: hidden(source=HiddenSource.VERIFY), "HiddenStates", "verify_id")
    refused(lambda: hidden(verify_id=VerifyId(1)), "HiddenStates", "verify_id")
    err = refused(lambda: hidden(source=HiddenSource.VERIFY, verify_id=VerifyId(0)), "HiddenStates", "verify_id")
    assert "must be positive" in str(err)
    refused(lambda: hidden(lens=[4, 0]), "HiddenStates", "lens")
    refused(lambda: hidden(starts=[-1, 0]), "HiddenStates", "starts")
    refused(lambda: hidden(starts=[0]), "HiddenStates", "starts")


def test_described_names_the_handle_its_producer_and_at_most_eight_rows() -> None:
    assert hidden().described() == "hidden #5 of an extend (rows [3, 4], positions 0..3, 8..9)"
    h = hidden(source=HiddenSource.VERIFY, verify_id=VerifyId(7), rids=[1], starts=[2], lens=[3])
    assert h.described() == "hidden #5 of verify #7 (rows [1], positions 2..4)"
    many = hidden(rids=list(range(10)), starts=list(range(0, 100, 10)), lens=[1] * 10)
    text = many.described()
    assert "rows [0, 1, 2, 3, 4, 5, 6, 7]," in text
    assert text.endswith("positions " + ", ".join(f"{s}..{s}" for s in range(0, 80, 10)) + ")")


def test_asked_hidden_describes_the_positions_the_forward_keeps() -> None:
    b = verify_batch(k=2, rids=[1, 2], slots=[1, 2], seq_lens=[4, 6], input_ids=[1] * 6, kv_locs=list(range(6)))
    assert asked_hidden(VerifyPlan(batch=b)) is None
    plan = VerifyPlan(batch=b, keep_hidden=HiddenId(9))
    h = asked_hidden(plan)
    assert h is not None and h is asked_hidden(plan)
    assert (h.hidden_id, h.source, h.verify_id) == (9, HiddenSource.VERIFY, 1)
    assert h.rids.tolist() == [1, 2] and h.starts.tolist() == [3, 5] and h.lens.tolist() == [3, 3]
    ext = ExtendPlan(rids=[4], slots=[2], prefix_lens=[6], extend_lens=[2], more_chunks=[False], input_ids=[1, 2], kv_locs=[0, 1],
                     tickets=(), keep_hidden=HiddenId(8))
    he = asked_hidden(ext)
    assert he is not None and (he.hidden_id, he.source, he.verify_id) == (8, HiddenSource.EXTEND, None)
    assert he.starts.tolist() == [6] and he.lens.tolist() == [2]
    dec = DecodePlan(rids=[], slots=[], seq_lens=[], input_ids=[], kv_locs=[])
    hm = asked_hidden(MixedPlan(extend=ext, decode=dec))
    assert hm is not None and hm.hidden_id == 8 and hm.rids.tolist() == [4]
    assert asked_hidden(ExtendPlan(rids=[4], slots=[2], prefix_lens=[6], extend_lens=[1], more_chunks=[False], input_ids=[1], kv_locs=[0],
                                   tickets=())) is None


# -- ir.results ----------------------------------------------------------------------------------


def logprobs(n: int, top: int = 0) -> Logprobs:
    return Logprobs(logprob=[-0.5] * n, top_lens=[top] * n, top_ids=list(range(n * top)), top_logprobs=[-1.0] * (n * top))


def test_results_hold_one_logprobs_entry_per_token() -> None:
    assert Sampled(rids=[1, 2], tokens=[5, 6], logprobs=logprobs(2)).logprobs is not None
    assert Sampled(rids=[1, 2], tokens=[5, 6]).logprobs is None
    err = refused(lambda: Sampled(rids=[1, 2], tokens=[5, 6], logprobs=logprobs(1)), "Sampled", "logprobs")
    assert err.value == 1 and "one entry per token (2)" in str(err)
    refused(lambda: Sampled(rids=[1, 2], tokens=[5, 6], logprobs=logprobs(3)), "Sampled", "logprobs")
    refused(lambda: Sampled(rids=[1], tokens=[5], logprobs={"logprob": [0.0]}), "Sampled", "logprobs")
    # a verify's entries are per window position: k + 1 per row
    assert Verified(k=2, verify_id=VerifyId(1), rids=[1], tokens=[1, 2, 3], logprobs=logprobs(3)).k == 2
    err = refused(lambda: Verified(k=2, verify_id=VerifyId(1), rids=[1], tokens=[1, 2, 3], logprobs=logprobs(1)), "Verified", "logprobs")
    assert "one entry per token (3)" in str(err)
    refused(lambda: Verified(k=2, verify_id=VerifyId(1), rids=[1], tokens=[1, 2, 3], logprobs=[0.0] * 3), "Verified", "logprobs")


def test_result_tokens_are_ids_or_non_finite() -> None:
    assert Sampled(rids=[1], tokens=[NON_FINITE]).tokens.tolist() == [-1]
    refused(lambda: Sampled(rids=[1], tokens=[-2]), "Sampled", "tokens")
    refused(lambda: Sampled(rids=[1, 2], tokens=[1]), "Sampled", "tokens")
    assert Verified(k=1, verify_id=VerifyId(1), rids=[1], tokens=[NON_FINITE, 0]).tokens.tolist() == [-1, 0]
    refused(lambda: Verified(k=1, verify_id=VerifyId(1), rids=[1], tokens=[1, 2, 3]), "Verified", "tokens")
    refused(lambda: Verified(k=1, verify_id=VerifyId(1), rids=[1], tokens=[1, -2]), "Verified", "tokens")
    assert Ran(rids=[1, 2]).rid_list() == [1, 2]


def test_logprobs_bounds_and_entries() -> None:
    lp = Logprobs(logprob=[-0.25, math.nan], top_lens=[2, 1], top_ids=[7, 8, NON_FINITE], top_logprobs=[-0.5, -1.5, math.nan])
    assert lp.entry(0) == {"logprob": -0.25, "top": [{"id": 7, "logprob": -0.5}, {"id": 8, "logprob": -1.5}]}
    assert lp.entry(1) == {"logprob": None, "top": [{"id": -1, "logprob": None}]}
    assert logprobs(1, MAX_LOGPROBS).entry(0)["top"][-1]["id"] == MAX_LOGPROBS - 1
    refused(lambda: logprobs(1, MAX_LOGPROBS + 1), "Logprobs", "top_lens")
    refused(lambda: Logprobs(logprob=[0.0], top_lens=[-1], top_ids=[], top_logprobs=[]), "Logprobs", "top_lens")
    refused(lambda: Logprobs(logprob=[0.0], top_lens=[2], top_ids=[1], top_logprobs=[0.0]), "Logprobs", "top_ids")
    refused(lambda: Logprobs(logprob=[0.0], top_lens=[1], top_ids=[-2], top_logprobs=[0.0]), "Logprobs", "top_ids")
    refused(lambda: Logprobs(logprob=[0.0], top_lens=[1], top_ids=[1], top_logprobs=[]), "Logprobs", "top_logprobs")


# -- ir.sampling ---------------------------------------------------------------------------------


def rows(n: int = 3, **over: Any) -> SamplingRows:
    f: dict[str, Any] = {
        "temperature": [1.0] * n, "top_k": [-1] * n, "top_p": [1.0] * n, "min_p": [0.0] * n, "presence_penalty": [0.0] * n,
        "frequency_penalty": [0.0] * n, "repetition_penalty": [1.0] * n, "seed": [1] * n, "index": [0] * n, "logprobs": [-1] * n,
        "ban_until": [0] * n, "banned_lens": [0] * n, "banned": [],
    }
    f.update(over)
    return SamplingRows(**f)


@pytest.mark.parametrize(
    ("field", "values", "first"),
    [
        ("temperature", [1.0, -1.0, -2.0], -1.0),
        ("temperature", [1.0, math.inf, -2.0], math.inf),
        ("top_p", [1.0, 0.0, 2.0], 0.0),
        ("top_p", [0.5, 1.5, 0.0], 1.5),
        ("min_p", [0.0, -0.5, 2.0], -0.5),
        ("min_p", [1.0, 1.5, -1.0], 1.5),
        ("presence_penalty", [0.0, 2.5, -3.0], 2.5),
        ("presence_penalty", [2.0, -2.5, 3.0], -2.5),
        ("frequency_penalty", [0.0, -2.5, 3.0], -2.5),
        ("frequency_penalty", [-2.0, 2.5, 3.0], 2.5),
        ("repetition_penalty", [1.0, 0.0, -1.0], 0.0),
        ("repetition_penalty", [1.0, math.inf, 0.0], math.inf),
    ],
)
def test_sampling_rows_quote_the_first_bad_value(field: str, values: list[float], first: float) -> None:
    err = refused(lambda: rows(**{field: values}), "SamplingRows", field)
    assert err.value == first


def test_sampling_rows_accept_the_edges_of_each_range() -> None:
    r = rows(2, temperature=[0.0, 1e9], top_p=[1.0, 1e-9], min_p=[0.0, 1.0], presence_penalty=[-2.0, 2.0],
             frequency_penalty=[2.0, -2.0], repetition_penalty=[1e-9, 5.0], top_k=[-1, 0], logprobs=[-1, MAX_LOGPROBS],
             index=[0, 15], ban_until=[0, 1], banned_lens=[0, 2], banned=[0, 3])
    assert r.num_requests == 2 and r.bans_any and not r.all_greedy
    assert rows(1, temperature=[0.0]).all_greedy
    assert not rows(1, temperature=[0.0], logprobs=[0]).all_greedy
    assert not rows(1, temperature=[0.0], ban_until=[3], banned_lens=[1], banned=[2]).all_greedy
    assert rows(1, temperature=[0.0], ban_until=[3]).all_greedy  # a ban with no ids bans nothing
    assert rows(1, temperature=[0.0], banned_lens=[1], banned=[2]).all_greedy  # ids banned before position 0: nothing


def test_sampling_rows_take_keeps_each_rows_banned_ids() -> None:
    r = rows(3, seed=[10, 11, 12], banned_lens=[1, 0, 2], banned=[5, 6, 7], ban_until=[4, 0, 9])
    t = r.take(np.array([2, 0], dtype=np.int64))
    assert t.seed.tolist() == [12, 10] and t.banned_lens.tolist() == [2, 1] and t.banned.tolist() == [6, 7, 5]
    m = r.take(np.array([False, True, True]))
    assert m.seed.tolist() == [11, 12] and m.banned.tolist() == [6, 7]
    j = t.joined(m)
    assert j.seed.tolist() == [12, 10, 11, 12] and j.banned.tolist() == [6, 7, 5, 6, 7]


# -- ir.plan -------------------------------------------------------------------------------------


def ext_plan(**over: Any) -> ExtendPlan:
    f: dict[str, Any] = {"rids": [1], "slots": [1], "prefix_lens": [0], "extend_lens": [1], "more_chunks": [False], "input_ids": [5],
                         "kv_locs": [0], "tickets": ()}
    f.update(over)
    return ExtendPlan(**f)


def dec_plan(**over: Any) -> DecodePlan:
    f: dict[str, Any] = {"rids": [2], "slots": [2], "seq_lens": [3], "input_ids": [0], "kv_locs": [1]}
    f.update(over)
    return DecodePlan(**f)


def test_plan_ids_are_none_or_positive() -> None:
    assert ext_plan(sample_id=SampleId(1), keep_hidden=HiddenId(1)).sample_id == 1
    for field in ("sample_id", "keep_hidden"):
        for bad in (0, -1):
            err = refused(lambda: ext_plan(**{field: bad}), "ExtendPlan", field)  # noqa: B023
            assert err.value == bad
    assert dec_plan(sample_id=SampleId(1), inputs_from=SampleId(2)).inputs_from == 2
    for field in ("sample_id", "inputs_from"):
        refused(lambda: dec_plan(**{field: 0}), "DecodePlan", field)  # noqa: B023


def test_a_pipelined_decode_names_another_sample_and_holds_placeholders() -> None:
    err = refused(lambda: dec_plan(sample_id=SampleId(3), inputs_from=SampleId(3)), "DecodePlan", "inputs_from")
    assert err.value == 3
    err = refused(lambda: dec_plan(inputs_from=SampleId(3), input_ids=[4]), "DecodePlan", "input_ids")
    assert err.value == [4]
    assert dec_plan(input_ids=[4]).input_ids.tolist() == [4]  # without inputs_from, real tokens


def test_a_mixed_plan_keeps_one_sample_and_lists_extend_rows_first() -> None:
    m = MixedPlan(extend=ext_plan(sample_id=SampleId(4)), decode=dec_plan(sample_id=SampleId(4)))
    assert m.rid_list() == [1, 2] and m.slot_list() == [1, 2]
    MixedPlan(extend=ext_plan(sample_id=SampleId(4)), decode=dec_plan())
    MixedPlan(extend=ext_plan(), decode=dec_plan(sample_id=SampleId(5)))
    err = refused(lambda: MixedPlan(extend=ext_plan(sample_id=SampleId(4)), decode=dec_plan(sample_id=SampleId(5))), "MixedPlan", "decode")
    assert err.value == 5 and "#5" in str(err) and "#4" in str(err)
    # an empty part adds no rows
    empty = DecodePlan(rids=[], slots=[], seq_lens=[], input_ids=[], kv_locs=[])
    assert MixedPlan(extend=ext_plan(), decode=empty).rid_list() == [1]


def test_plan_tickets_per_kind_share_one_serial_and_op_and_name_distinct_pools() -> None:
    op = MambaInit(serial=TicketSerial(3), clear_slots=(1,))
    a, b = Ticket(pool=TARGET_POOL, op=op), Ticket(pool=PoolId("draft"), op=op)
    p = ext_plan(tickets=(a, b))
    assert p.ticket_for(PoolId("draft")) == b and p.tickets_for(TARGET_POOL) == (a,) and p.all_tickets() == (a, b)
    err = refused(lambda: ext_plan(tickets=(a, a)), "ExtendPlan", "tickets")
    assert "two tickets for one pool" in str(err)
    other = Ticket(pool=PoolId("draft"), op=MambaInit(serial=TicketSerial(4), clear_slots=(1,)))
    err = refused(lambda: ext_plan(tickets=(a, other)), "ExtendPlan", "tickets")
    assert err.value == [3, 4]
    diff = Ticket(pool=PoolId("draft"), op=MambaInit(serial=TicketSerial(3), clear_slots=(2,)))
    refused(lambda: ext_plan(tickets=(a, diff)), "ExtendPlan", "tickets")
    refused(lambda: ext_plan(tickets=a), "ExtendPlan", "tickets")
    refused(lambda: ext_plan(tickets=(op,)), "ExtendPlan", "tickets")


# -- ir.init -------------------------------------------------------------------------------------


def test_serials_are_minted_once_and_traced_to_this_process() -> None:
    from ir import init

    a, b = init.mint_serial(), init.mint_serial()
    assert b > a and init.serial_epoch(a) == init.serial_epoch(b) == init.this_epoch()
    assert 1 <= init.this_epoch() <= 2**init.EPOCH_BITS and a < 2**62
    assert init.minted_here(a) and init.minted_here(b)
    assert not init.minted_here(b + 1)  # not yet minted
    assert not init.minted_here(init.this_epoch() << init.SERIAL_COUNTER_BITS)  # counter 0 is never minted
    m = init._Minter()
    first = m.mint()
    assert m.minted(first) and not m.minted(first + 1) and first & init._COUNTER_MASK == 1
    assert not m.minted(a)  # another minter's (another process's) serial
    # a counter that runs out starts a new epoch; serials of the old one stay known
    import itertools

    m._count = itertools.count(init._COUNTER_MASK)
    last = m.mint()
    assert last & init._COUNTER_MASK == init._COUNTER_MASK and init.serial_epoch(last) == init.serial_epoch(first)
    fresh = m.mint()
    assert init.serial_epoch(fresh) != init.serial_epoch(first) and fresh & init._COUNTER_MASK == 1
    assert m.minted(last) and m.minted(fresh) and m.minted(first)
    m.after_fork()  # a forked child knows none of its parent's serials
    assert not m.minted(fresh) and not m.minted(first) and m.minted(m.mint())


@pytest.mark.parametrize(
    ("build", "field", "value", "message"),
    [
        (lambda: MambaInit(serial=TicketSerial(0), clear_slots=(1,)), "serial", 0, "must be positive"),
        (lambda: MambaInit(serial=TicketSerial(-1), clear_slots=(1,)), "serial", -1, "must be positive"),
        (lambda: MambaInit(serial=TicketSerial(1), clear_slots=1), "clear_slots", 1, "tuple or list"),
        (lambda: MambaInit(serial=TicketSerial(1), cow_src=(2,), cow_dst=(3, 4)), "cow_dst", (3, 4), "len(cow_src) (1)"),
        (lambda: MambaInit(serial=TicketSerial(1), clear_slots=(1, 0)), "clear_slots", 0, "slot must be >= 1"),
        (lambda: MambaInit(serial=TicketSerial(1), cow_src=(0,), cow_dst=(2,)), "cow_src", 0, "slot must be >= 1"),
        (lambda: MambaInit(serial=TicketSerial(1), cow_src=(2,), cow_dst=(0,)), "cow_dst", 0, "slot must be >= 1"),
        (lambda: MambaInit(serial=TicketSerial(1), clear_slots=(2, 3, 2)), "clear_slots", 2, "slot 2 appears twice"),
        (lambda: MambaInit(serial=TicketSerial(1), cow_src=(5, 6), cow_dst=(2, 2)), "cow_dst", 2, "slot 2 appears twice"),
        (lambda: MambaInit(serial=TicketSerial(1), cow_src=(2,), cow_dst=(2,)), "cow_src", 2, "onto itself"),
        (lambda: MambaInit(serial=TicketSerial(1), clear_slots=(5,), cow_src=(5,), cow_dst=(2,)), "cow_src", 5, "cleared in the same forward"),
        (lambda: MambaInit(serial=TicketSerial(1), clear_slots=(2,), cow_src=(5,), cow_dst=(2,)), "cow_dst", 2, "both cleared and a COW dst"),
        (lambda: MambaInit(serial=TicketSerial(1), cow_src=(5, 3, 7), cow_dst=(3, 4, 5)), "cow_src", 3, "slot 3 is both a COW src and a COW dst"),
        (lambda: MambaSnapshot(serial=TicketSerial(0), src=(1,), dst=(2,)), "serial", 0, "must be positive"),
        (lambda: MambaSnapshot(serial=TicketSerial(1), src=(), dst=()), "dst", (), "at least one slot"),
        (lambda: MambaSnapshot(serial=TicketSerial(1), src=(1, 3), dst=(2,)), "dst", (2,), "len(src) (2)"),
        (lambda: MambaSnapshot(serial=TicketSerial(1), src=(1,), dst=(2,), at=3), "at", 3, "tuple or list"),
        (lambda: MambaSnapshot(serial=TicketSerial(1), src=(1,), dst=(2,), at=(1, 2)), "at", (1, 2), "or len(src) (1)"),
        (lambda: MambaSnapshot(serial=TicketSerial(1), src=(1, 3), dst=(2, 4), at=(1, 0)), "at", 0, "at least one token"),
        (lambda: MambaSnapshot(serial=TicketSerial(1), src=(0,), dst=(2,)), "src", 0, "slot must be >= 1"),
        (lambda: MambaSnapshot(serial=TicketSerial(1), src=(1,), dst=(0,)), "dst", 0, "slot must be >= 1"),
        (lambda: MambaSnapshot(serial=TicketSerial(1), src=(1, 3), dst=(2, 2)), "dst", 2, "slot 2 appears twice"),
        (lambda: MambaSnapshot(serial=TicketSerial(1), src=(1, 4, 2), dst=(4, 2, 6)), "dst", 2, "slot 2 is both a snapshot source and a snapshot target"),
    ],
)
def test_a_malformed_op_is_refused_naming_the_field_and_value(build: Callable[[], object], field: str, value: object, message: str) -> None:
    with pytest.raises(IRValidationError) as info:
        build()
    assert info.value.field == field and info.value.value == value, str(info.value)
    assert message in str(info.value)


def test_well_formed_ops_at_the_edges_are_accepted() -> None:
    from ir.init import op_counts, op_plan_rows, op_reads, op_resets, op_slots, op_text, op_when, op_writes

    init = MambaInit(serial=TicketSerial(1), clear_slots=(1, 2), cow_src=(5, 6), cow_dst=(3, 4))
    assert init.num_ops == 4 and not init.is_empty
    assert MambaInit(serial=TicketSerial(1)).is_empty and MambaInit(serial=TicketSerial(1)).num_ops == 0
    assert not MambaInit(serial=TicketSerial(1), cow_src=(5,), cow_dst=(3,)).is_empty
    assert not MambaInit(serial=TicketSerial(1), clear_slots=range(1, 3)).is_empty
    assert op_reads(init) == (5, 6) and op_writes(init) == (1, 2, 3, 4) and op_slots(init) == (1, 2, 5, 6, 3, 4)
    assert op_plan_rows(init) == (1, 2, 3, 4) and op_resets(init) == (1, 2)
    assert op_counts(init) == {"tickets": 1, "clears": 2, "cows": 2} and op_when(init) is When.BEFORE
    assert op_text(init) == "clear [1, 2], cow [5->3, 6->4]"
    snap = MambaSnapshot(serial=TicketSerial(2), src=(1, 3), dst=(7, 8), at=(1, 5))
    assert op_reads(snap) == (1, 3) and op_writes(snap) == (7, 8) and op_plan_rows(snap) == (1, 3) and op_resets(snap) == ()
    assert op_counts(snap) == {"snapshots": 2} and op_when(snap) is When.AFTER
    assert op_text(MambaSnapshot(serial=TicketSerial(2), src=(1,), dst=(4,))) == "snapshot [1->4]"
    t = Ticket(pool=PoolId("draft"), op=snap)
    assert t.serial == 2 and str(t) == "snapshot ticket #2 for pool 'draft'"
    assert str(Ticket(pool=TARGET_POOL, op=init)) == f"ticket #1 for pool {TARGET_POOL!r}"
    for bad in ("", 3):
        with pytest.raises(IRValidationError) as info:
            Ticket(pool=bad, op=init)  # type: ignore[arg-type]
        assert (info.value.node, info.value.field) == ("Ticket", "pool")


# -- ir.request, ir.mint -------------------------------------------------------------------------


def admitted(**over: Any) -> Any:
    from ir.request import AdmittedRequest, Clear

    f: dict[str, Any] = {"rid": 1, "slot": 2, "intent": Clear(), "input_ids": [5, 6, 7], "kv_locs": [0, 1, 2]}
    f.update(over)
    return AdmittedRequest(**f)


def test_request_bounds_are_accepted_on_the_inside() -> None:
    from ir.columns import MAX_SEQ_LEN
    from ir.request import Continue, CopyFrom

    assert admitted(slot=1).slot == 1 and admitted().prefix_len == 0 and admitted().snapshot_len == 3
    assert admitted(snapshot_to=3, snapshot_at=1).snapshot_len == 1
    assert admitted(snapshot_to=3, snapshot_at=3).snapshot_len == 3
    assert admitted(snapshot_to=1).snapshot_len == 3
    assert admitted(intent=CopyFrom(src=1, prefix_len=1)).prefix_len == 1
    assert admitted(intent=Continue(prefix_len=MAX_SEQ_LEN - 3)).prefix_len == MAX_SEQ_LEN - 3
    assert admitted(more_chunks=np.bool_(True)).more_chunks
    assert CopyFrom(src=1, prefix_len=MAX_SEQ_LEN).prefix_len == MAX_SEQ_LEN


@pytest.mark.parametrize(
    ("over", "node", "field", "value"),
    [
        ({"slot": 0}, "AdmittedRequest", "slot", 0),
        ({"slot": 1.0}, "AdmittedRequest", "slot", 1.0),
        ({"rid": "1"}, "AdmittedRequest", "rid", "1"),
        ({"more_chunks": 1}, "AdmittedRequest", "more_chunks", 1),
        ({"snapshot_to": 2}, "AdmittedRequest", "snapshot_to", 2),
        ({"snapshot_to": 0}, "AdmittedRequest", "snapshot_to", 0),
        ({"snapshot_to": True}, "AdmittedRequest", "snapshot_to", True),
        ({"snapshot_at": 1}, "AdmittedRequest", "snapshot_at", 1),
        ({"snapshot_to": 3, "snapshot_at": 0}, "AdmittedRequest", "snapshot_at", 0),
        ({"snapshot_to": 3, "snapshot_at": 4}, "AdmittedRequest", "snapshot_at", 4),
        ({"snapshot_to": 3, "snapshot_at": 2.0}, "AdmittedRequest", "snapshot_at", 2.0),
        ({"input_ids": [], "kv_locs": []}, "AdmittedRequest", "input_ids", ()),
        ({"kv_locs": [0, 1]}, "AdmittedRequest", "kv_locs", 2),
    ],
)
def test_a_malformed_request_is_refused_naming_the_field(over: dict[str, Any], node: str, field: str, value: object) -> None:
    err = refused(lambda: admitted(**over), node, field)
    assert err.value == value


def test_intent_bounds() -> None:
    from ir.columns import MAX_SEQ_LEN
    from ir.request import Continue, CopyFrom

    err = refused(lambda: admitted(intent=CopyFrom(src=2, prefix_len=4)), "AdmittedRequest", "intent")
    assert err.value == 2 and "own slot" in str(err)
    err = refused(lambda: admitted(intent=Continue(prefix_len=MAX_SEQ_LEN - 2)), "AdmittedRequest", "prefix_len")
    assert err.value == MAX_SEQ_LEN - 2
    refused(lambda: CopyFrom(src=0, prefix_len=4), "CopyFrom", "src")
    refused(lambda: CopyFrom(src=True, prefix_len=4), "CopyFrom", "src")
    err = refused(lambda: CopyFrom(src=3, prefix_len=0), "CopyFrom", "prefix_len")
    assert "a COW starts after a cached prefix (> 0 tokens)" in str(err)
    refused(lambda: CopyFrom(src=3, prefix_len=MAX_SEQ_LEN + 1), "CopyFrom", "prefix_len")
    err = refused(lambda: Continue(prefix_len=0), "Continue", "prefix_len")
    assert "a continuation follows earlier chunks" in str(err)
    refused(lambda: Continue(prefix_len=MAX_SEQ_LEN + 1), "Continue", "prefix_len")
    refused(lambda: Continue(prefix_len=2.0), "Continue", "prefix_len")
    assert Continue(prefix_len=1).kind is InitIntent.CONTINUE and CopyFrom(src=1, prefix_len=1).kind is InitIntent.COW


def test_minted_ids_are_positive_increasing_and_of_this_process() -> None:
    from ir import mint
    from ir.init import minted_here

    ids = [mint.mint_sample_id(), mint.mint_draft_id(), mint.mint_verify_id(), mint.mint_hidden_id()]
    assert ids == sorted(ids) and len(set(ids)) == 4 and ids[0] > 0
    assert all(minted_here(i) for i in ids)


# -- ir.verify -----------------------------------------------------------------------------------


def test_the_verify_level_setting_is_exactly_0_1_or_2(monkeypatch: pytest.MonkeyPatch) -> None:
    from ir.errors import SettingsError
    from ir.verify import VerifyLevel, parse_verify_level, verify_level_from_env

    assert [parse_verify_level(v) for v in (None, "", "0", "1", "2")] == [1, 1, 0, 1, 2]
    assert parse_verify_level("2") is VerifyLevel.EVERY_PASS and parse_verify_level("0") is VerifyLevel.OFF
    for bad in ("3", "-1", " 1", "yes", "01"):
        with pytest.raises(SettingsError, match=r"BATCHC_VERIFY must be 0, 1 or 2, got"):
            parse_verify_level(bad)
    monkeypatch.setenv("BATCHC_VERIFY", "0")
    assert verify_level_from_env() is VerifyLevel.OFF
    monkeypatch.delenv("BATCHC_VERIFY")
    assert verify_level_from_env() is VerifyLevel.LAST


def _ext_batch(**over: Any) -> Any:
    from ir.batch import ExtendBatch

    f: dict[str, Any] = {
        "rids": [1, 2], "slots": [1, 2], "prefix_lens": [0, 0], "extend_lens": [2, 3], "more_chunks": [False, False],
        "input_ids": [5] * 5, "kv_locs": list(range(5)), "intents": (CLEAR, CLEAR), "init": MambaInit(serial=TicketSerial(11), clear_slots=(1, 2)),
    }
    f.update(over)
    return ExtendBatch(**f)


def _snap(src: tuple[int, ...], dst: tuple[int, ...], at: tuple[int, ...] = ()) -> MambaSnapshot:
    return MambaSnapshot(serial=TicketSerial(12), src=src, dst=dst, at=at)


def test_a_snapshot_position_lies_in_its_rows_chunk() -> None:
    from ir.errors import IRVerificationError
    from ir.verify import verify

    verify(_ext_batch(snapshot=_snap((1, 2), (7, 8), (2, 3))))  # each row's whole chunk
    verify(_ext_batch(snapshot=_snap((2, 1), (7, 8), (1, 1))))
    with pytest.raises(IRVerificationError, match=r"^ExtendBatch\.snapshot\.at\[1\]: 3 is not a position in slot 1's chunk \(1 to its extend_len 2\)$"):
        verify(_ext_batch(snapshot=_snap((2, 1), (7, 8), (3, 3))))
    with pytest.raises(IRVerificationError, match=r"^ExtendBatch\.snapshot\.at\[0\]: 4 is not a position in slot 2's chunk"):
        verify(_ext_batch(snapshot=_snap((2,), (7,), (4,))))


def test_a_speculative_node_has_unique_rows_and_releases_only_its_window() -> None:
    from ir.errors import IRVerificationError
    from ir.head import HeadCommitPlan
    from ir.spec import CommitPlan, DraftPlan
    from ir.verify import verify

    two = {"rids": [1, 2], "slots": [1, 2], "seq_lens": [4, 4], **_window(2, 2)}
    good = commit_batch(k=2, **{**two, "accept_pos": [1, 2], "released_kv": [2]})  # row 0's last window position
    verify(good)
    verify(CommitPlan(batch=good))
    with pytest.raises(IRVerificationError, match=r"^CommitBatch\.released_kv: KV location 9 is not in any row's window$"):
        verify(commit_batch(k=2, **{**two, "accept_pos": [1, 2], "released_kv": [9]}))
    with pytest.raises(IRVerificationError, match=r"^CommitPlan\.batch\.released_kv: KV location 9"):
        verify(CommitPlan(batch=commit_batch(k=2, **{**two, "accept_pos": [1, 2], "released_kv": [9]})))
    with pytest.raises(IRVerificationError, match=r"^DraftBatch\.rids\[1\]: request id 1 already used at index 0$"):
        verify(draft(rids=[1, 1], slots=[1, 2], seq_lens=[4, 4], input_ids=[3, 3], kv_locs=list(range(6))))
    with pytest.raises(IRVerificationError, match=r"^DraftPlan\.batch\.slots\[1\]: slot 1"):
        verify(DraftPlan(batch=draft(rids=[1, 2], slots=[1, 1], seq_lens=[4, 4], input_ids=[3, 3], kv_locs=list(range(6)))))
    with pytest.raises(IRVerificationError, match=r"^VerifyBatch\.kv_locs\[2\]: KV location 0 already used at index 0$"):
        verify(verify_batch(kv_locs=[0, 1, 0]))
    hc = head_commit(k=2, accept=[1, 0])
    verify(hc)
    verify(HeadCommitPlan(batch=hc))
    with pytest.raises(IRVerificationError, match=r"^HeadCommitBatch\.slots\[1\]: slot 1"):
        verify(head_commit(k=2, accept=[1, 0], slots=[1, 1]))
    with pytest.raises(IRVerificationError, match=r"^HeadCommitPlan\.batch\.rids\[1\]: request id 1"):
        verify(HeadCommitPlan(batch=head_commit(k=2, accept=[1, 0], rids=[1, 1])))


def test_a_head_extend_verifies_as_the_prefill_it_follows() -> None:
    from ir.errors import IRVerificationError
    from ir.verify import verify

    verify(head_extend())
    with pytest.raises(IRVerificationError, match=r"^HeadExtendBatch\.init: requests need init ops"):
        verify(head_extend(init=None))
    with pytest.raises(IRVerificationError, match=r"^HeadExtendBatch\.kv_locs\[1\]: KV location 0"):
        verify(head_extend(kv_locs=[0, 0]))
    verify(_head_plan())
    stranger = (Ticket(pool=PoolId("head"), op=MambaInit(serial=TicketSerial(3), clear_slots=(4,))),)
    with pytest.raises(IRVerificationError, match=r"^HeadExtendPlan\.tickets\[0\]: ticket #3 for pool 'head' writes slot 4, which no request"):
        verify(_head_plan(tickets=stranger))


def test_verify_rechecks_the_rows_aligned_with_a_node() -> None:
    import attrs as _attrs

    from ir.columns import build_unchecked
    from ir.verify import verify

    good = rows(2)
    bad = build_unchecked(SamplingRows, **{**{a.name: getattr(good, a.name) for a in _attrs.fields(SamplingRows)},
                                         "top_p": np.array([1.0, 0.0])})
    dec = dec_plan(rids=[2, 3], slots=[2, 3], seq_lens=[3, 3], input_ids=[0, 0], kv_locs=[1, 2])
    verify(build_unchecked(DecodePlan, **{**{a.name: getattr(dec, a.name) for a in _attrs.fields(DecodePlan)}, "sampling": good}))
    err = refused(lambda: verify(build_unchecked(DecodePlan, **{**{a.name: getattr(dec, a.name) for a in _attrs.fields(DecodePlan)},
                                                                 "sampling": bad})), "SamplingRows", "top_p")
    assert err.value == 0.0
    err = refused(lambda: verify(build_unchecked(DecodePlan, **{**{a.name: getattr(dec, a.name) for a in _attrs.fields(DecodePlan)},
                                                                 "sampling": rows(3)})), "DecodePlan", "sampling")


# -- ir.printer, ir.parse ------------------------------------------------------------------------


def test_dump_renumbers_names_in_order_of_first_appearance() -> None:
    from ir.batch import DecodeBatch
    from ir.printer import dump, dump_all

    b = DecodeBatch(rids=[40, 7, 9], slots=[9, 3, 5], seq_lens=[2, 5, 1], input_ids=[1, 2, 3], kv_locs=[30, 12, 31])
    assert dump(b) == "DecodeBatch requests=3\n  r0 s1 seq=2 token=1 kv=k0\n  r1 s2 seq=5 token=2 kv=k1\n  r2 s3 seq=1 token=3 kv=k2\n"
    assert dump(b, exact=True) == "DecodeBatch requests=3\n  r40 s9 seq=2 token=1 kv=k30\n  r7 s3 seq=5 token=2 kv=k12\n  r9 s5 seq=1 token=3 kv=k31\n"
    # names are shared across the nodes of one dump_all (slot 3 is s2 in both)
    c = DecodeBatch(rids=[7], slots=[3], seq_lens=[6], input_ids=[4], kv_locs=[13])
    assert dump_all([b, c]).endswith("DecodeBatch requests=1\n  r1 s2 seq=6 token=4 kv=k3\n")
    assert dump(c) == "DecodeBatch requests=1\n  r0 s1 seq=6 token=4 kv=k0\n"


def test_dump_writes_kv_runs_parts_and_optional_words() -> None:
    from ir.parse import parse
    from ir.printer import dump

    e = _ext_batch(extend_lens=[4, 3], input_ids=[5, 6, 7, 8, 9, 10, 11], kv_locs=[3, 4, 5, 9, 20, 21, 23], more_chunks=[True, False],
                   snapshot=_snap((1, 2), (7, 8), (1, 2)))
    text = dump(e, exact=True)
    assert text == (
        "ExtendBatch requests=2 tokens=7\n"
        "  init #11 clear[s1 s2] cow[]\n"
        "  snapshot #12 [s1->s7 s2->s8] at[1 2]\n"
        "  r1 s1 prefix=0 extend=4 init=clear more tokens=[5 6 7 8] kv=k3..k5,k9\n"
        "  r2 s2 prefix=0 extend=3 init=clear tokens=[9 10 11] kv=k20..k21,k23\n"
    )
    assert parse(text) == e
    assert dump(e).splitlines()[3].endswith("kv=k0..k3")  # renumbered: consecutive from k0
    plan = ext_plan(tickets=(Ticket(pool=PoolId("a b"), op=MambaInit(serial=TicketSerial(3), clear_slots=(1,))),),
                    sample_id=SampleId(4), keep_hidden=HiddenId(5))
    text = dump(plan, exact=True)
    assert text == ('ExtendPlan requests=1 tokens=1 sample=#4 hidden=#5\n  ticket op=init #3 clear[s1] cow[] pool="a b"\n'
                    "  r1 s1 prefix=0 extend=1 tokens=[5] kv=k0\n")
    assert parse(text) == plan
    assert dump(ext_plan()) == "ExtendPlan requests=1 tokens=1\n  tickets none\n  r0 s1 prefix=0 extend=1 tokens=[5] kv=k0\n"
    m = MixedPlan(extend=ext_plan(), decode=dec_plan(inputs_from=SampleId(2)))
    assert dump(m, exact=True).splitlines()[0] == "MixedPlan requests=2"
    assert dump(m, exact=True).splitlines()[4] == "  DecodePlan requests=1 inputs=#2"
    assert parse(dump(m, exact=True)) == m
    c = commit_batch()
    assert dump(c, exact=True) == "CommitBatch requests=1 k=2 verify=#1 draft=#1\n  r1 s1 seq=4 accept=1 tokens=[1 1 1] kv=k0..k2\n  released kv=k100\n"
    assert parse(dump(c, exact=True)) == c
    assert dump(admitted(snapshot_to=5, snapshot_at=2, more_chunks=True)) == (
        "AdmittedRequest r0 s1 intent=clear more snapshot_to=s2 snapshot_at=2 tokens=[5 6 7] kv=k0..k2\n")


def test_dump_of_sampling_rows_reads_back() -> None:
    from ir.parse import parse
    from ir.printer import dump

    e = _ext_batch(sampling=rows(2, temperature=[0.5, 0.0], banned_lens=[1, 0], banned=[3], ban_until=[4, 0]))
    text = dump(e, exact=True)
    assert "\n  SamplingRows requests=2 tokens=1\n    temp=0.5 top_k=-1 " in text and "ban_until=4 bans=1 banned=[3]\n" in text
    assert parse(text) == e


@pytest.mark.parametrize(
    ("text", "line", "token", "message"),
    [
        ("  DecodeBatch requests=0\n", 1, "DecodeBatch", "expected a node indented by 0 spaces"),
        (" DecodeBatch requests=0\n", 1, "DecodeBatch", "indent by two spaces per level"),
        ("DecodeBatch requests=1\n   r0 s1 seq=3 token=1 kv=k0\n", 2, "r0", "indent by two spaces per level"),
        ("DecodeBatch requests=1\n\tr0 s1 seq=3 token=1 kv=k0\n", 2, "r0", "indent by two spaces per level"),
        ("DecodeBatch requests=1\n  \tr0 s1 seq=3 token=1 kv=k0\n", 2, "r0", "indent by two spaces per level"),
        ("DecodeBatch requests=x\n", 1, "requests=x", "expected an integer"),
        ("DecodeBatch\n", 1, "<end of line>", "expected requests=..."),
        ("DecodeBatch reqs=0\n", 1, "reqs=0", "expected requests=..."),
        ("DecodeBatch requests=1\n  r0 s1 seq=3 token=1 kv=x0\n", 2, "x0", "expected KV locations"),
        ("DecodeBatch requests=1\n  r0 s1 seq=3 token=1\n", 2, "<end of line>", "expected kv=..."),
        ("DecodeBatch requests=1\n  rx s1 seq=3 token=1 kv=k0\n", 1, "requests=1", "0 rows follow"),
        ("ExtendBatch requests=1 tokens=2\n  init none\n  r0 s1 prefix=4 extend=1 init=continue tokens=[1] kv=k0\n", 1, "tokens=2",
         "tokens=2 but the rows hold 1"),
        ("ExtendBatch requests=1 tokens=1\n  init none\n  r0 s1 prefix=4 extend=1 init=continue tokens=1 kv=k0\n", 3, "tokens=1",
         "expected [token ids]"),
        ("ExtendBatch requests=1 tokens=1\n  init none\n  r0 s1 prefix=4 extend=1 init=continue tokens=[x] kv=k0\n", 3, "x",
         "expected an integer"),
        ("ExtendBatch requests=1 tokens=1\n  init #1 clr[s1] cow[]\n  r0 s1 prefix=0 extend=1 init=clear tokens=[1] kv=k0\n", 2, "clr[s1]",
         "expected clear[...]"),
        ("ExtendBatch requests=1 tokens=1\n  init #1 clear[s1] cow[s2]\n  r0 s1 prefix=0 extend=1 init=clear tokens=[1] kv=k0\n", 2, "s2",
         "expected a copy s<src>->s<dst>"),
        ("ExtendBatch requests=1 tokens=1\n  init #1 clear[s1] cow[]\n  r0 s1 prefix=0 extend=1 init=fresh tokens=[1] kv=k0\n", 3,
         "init=fresh", "expected init=clear, init=cow or init=continue"),
        ('Ticket op=init #1 clear[s1] cow[] pool="x\n', 1, 'pool="x', "expected a pool name"),
        ("Ticket op=init #1 clear[s1] cow[] pool=\"\\q\"\n", 1, 'pool="\\q"', "expected a pool name"),
        ("Ticket op=copy #1 clear[s1] cow[] pool=x\n", 1, "op=copy", "expected op=init or op=snapshot"),
        ("DecodeBatch requests=1\n", 1, "requests=1", "requests=1 but 0 rows follow"),
        ("MixedPlan requests=1\n", 1, "<end of text>", "expected a node"),
        ("MixedPlan requests=1\n  ExtendPlan requests=0 tokens=0\n    tickets none\n", 3, "<end of text>", "expected a node"),
        ("ExtendBatch requests=1 tokens=1\n  r0 s1 prefix=0 extend=1 init=clear tokens=[1] kv=k0\n", 2, "r0", "expected init ... or init none"),
        ("CommitBatch requests=0 k=1 verify=#1 draft=#2\n", 1, "<end of text>", "expected released kv=..."),
    ],
)
def test_more_parse_errors_name_line_and_token(text: str, line: int, token: str, message: str) -> None:
    from ir.parse import ParseError, parse

    with pytest.raises(ParseError) as info:
        parse(text)
    assert (info.value.line, info.value.token) == (line, token), str(info.value)
    assert message in str(info.value), str(info.value)


def test_parse_reads_floats_and_refuses_bad_ones() -> None:
    from ir.parse import ParseError, parse
    from ir.printer import dump

    r = rows(1, temperature=[0.1 + 0.2], top_p=[1e-9])
    text = dump(r)
    assert parse(text) == r
    with pytest.raises(ParseError, match=r"expected a number \(at 'temp=x'\)"):
        parse(text.replace("temp=0.30000000000000004", "temp=x"))
    assert parse("IdleBatch requests=0\n\n") == parse("\nIdleBatch requests=0")


# -- ir.columns ----------------------------------------------------------------------------------


def _decode(n: int, **over: Any) -> Any:
    from ir.batch import DecodeBatch

    f: dict[str, Any] = {"rids": list(range(n)), "slots": list(range(1, n + 1)), "seq_lens": [3] * n, "input_ids": [7] * n,
                         "kv_locs": list(range(n))}
    f.update(over)
    return DecodeBatch(**f)


@pytest.mark.parametrize("n", [3, 200])  # a small column (checked from a list) and a large one (numpy)
def test_column_bounds_hold_at_the_edge_and_name_the_first_value_outside(n: int) -> None:
    from ir.columns import MAX_SEQ_LEN

    def with_(col: list[int], i: int, v: int) -> list[int]:
        return [*col[:i], v, *col[i + 1 :]]

    slots, seqs = list(range(1, n + 1)), [3] * n
    assert _decode(n, slots=with_(slots, n - 1, 1) if n < 2 else slots).num_requests == n
    assert _decode(n, seq_lens=with_(seqs, n - 1, MAX_SEQ_LEN), input_ids=[0] * n, kv_locs=list(range(n))).num_requests == n
    assert _decode(n, seq_lens=with_(seqs, 1, 1)).num_requests == n
    bad = with_(with_(slots, 1, 0), n - 1, -5)
    err = refused(lambda: _decode(n, slots=bad), "DecodeBatch", "slots")
    assert err.value == 0 and "every value must be >= 1" in str(err)
    err = refused(lambda: _decode(n, seq_lens=with_(with_(seqs, 1, MAX_SEQ_LEN + 2), n - 1, MAX_SEQ_LEN + 1)), "DecodeBatch", "seq_lens")
    assert err.value == MAX_SEQ_LEN + 2 and "every value must be <= MAX_SEQ_LEN (2**31 - 1)" in str(err)
    err = refused(lambda: _decode(n, seq_lens=with_(seqs, n - 1, 0)), "DecodeBatch", "seq_lens")
    assert err.value == 0
    err = refused(lambda: _decode(n, kv_locs=with_(list(range(n)), n - 1, -1)), "DecodeBatch", "kv_locs")
    assert err.value == -1 and ">= 0" in str(err)
    err = refused(lambda: _decode(n, input_ids=[7] * (n - 1)), "DecodeBatch", "input_ids")
    assert err.value == n - 1 and f"length must equal len(rids) ({n})" in str(err)
    refused(lambda: _decode(n, kv_locs=list(range(n + 1))), "DecodeBatch", "kv_locs")


@pytest.mark.parametrize("n", [2, 100])
def test_a_bound_that_depends_on_another_column(n: int) -> None:
    from ir.columns import MAX_SEQ_LEN

    lens = [1] * n
    f: dict[str, Any] = {"rids": list(range(n)), "slots": list(range(1, n + 1)), "extend_lens": lens, "more_chunks": [False] * n,
                         "input_ids": [1] * n, "kv_locs": list(range(n)), "intents": (InitIntent.CONTINUE,) * n, "init": None}
    from ir.batch import ExtendBatch

    ok = ExtendBatch(**f, prefix_lens=[MAX_SEQ_LEN - 1] * n)
    assert int(ok.prefix_lens.max()) == MAX_SEQ_LEN - 1
    err = refused(lambda: ExtendBatch(**f, prefix_lens=[0] * (n - 1) + [MAX_SEQ_LEN]), "ExtendBatch", "prefix_lens")
    assert err.value == MAX_SEQ_LEN and "every value must be <= MAX_SEQ_LEN - extend_lens" in str(err)
    err = refused(lambda: ExtendBatch(**f, prefix_lens=[0] * (n - 1) + [-1]), "ExtendBatch", "prefix_lens")
    assert err.value == -1
    # packed token columns hold sum(extend_lens) entries
    err = refused(lambda: ExtendBatch(**{**f, "input_ids": [1] * (n + 1)}, prefix_lens=[0] * n), "ExtendBatch", "input_ids")
    assert err.value == n + 1 and f"({n})" in str(err)


@pytest.mark.parametrize(
    ("value", "bad", "message"),
    [
        ([1, True], True, "got a bool entry"),
        ([1, 2.0], 2.0, "got a float entry"),
        ([1, None], None, "got a NoneType entry"),
        ([1, 2**63], 2**63, "within int64"),
        (np.array([1, 2**63], dtype=np.uint64), 2**63, "within int64"),
        ("12", "12", "not a str"),
        (5, 5, "not int"),
    ],
)
def test_an_int_column_refuses_what_is_not_an_int64_sequence(value: object, bad: object, message: str) -> None:
    err = refused(lambda: Ran(rids=value), "Ran", "rids")
    assert err.value == bad and message in str(err)


def test_column_converters_accept_ints_of_every_kind_and_keep_owned_columns() -> None:
    r = Ran(rids=[np.int32(1), 2, np.uint8(3)])
    assert r.rids.tolist() == [1, 2, 3] and r.rids.dtype == np.int64 and not r.rids.flags.writeable
    assert Ran(rids=np.array([4, 5], dtype=np.int32)).rids.tolist() == [4, 5]
    assert Ran(rids=b"\x01\x02").rids.tolist() == [1, 2]
    assert Ran(rids=[2**63 - 1, -(2**63)]).rids.tolist() == [2**63 - 1, -(2**63)]
    assert Ran(rids=r.rids).rids is r.rids  # an IR-owned column is shared, not copied
    src = np.array([1, 2], dtype=np.int64)
    copied = Ran(rids=src).rids
    src[0] = 9
    assert copied.tolist() == [1, 2]  # a caller's array is copied
    refused(lambda: Ran(rids=np.array([[1, 2]])), "Ran", "rids")
    refused(lambda: Ran(rids=np.array([1.0])), "Ran", "rids")
    # bool and float columns
    e = ext_plan(more_chunks=[np.bool_(True)])
    assert e.more_chunks.tolist() == [True]
    err = refused(lambda: ext_plan(more_chunks=[1]), "ExtendPlan", "more_chunks")
    assert err.value == 1 and "bools" in str(err)
    refused(lambda: ext_plan(more_chunks=np.array([1])), "ExtendPlan", "more_chunks")
    refused(lambda: ext_plan(more_chunks=None), "ExtendPlan", "more_chunks")
    assert Logprobs(logprob=[np.float32(0.5)], top_lens=[0], top_ids=[], top_logprobs=[]).logprob.tolist() == [0.5]
    assert Logprobs(logprob=np.array([1], dtype=np.int64), top_lens=[0], top_ids=[], top_logprobs=[]).logprob.tolist() == [1.0]
    err = refused(lambda: Logprobs(logprob=[True], top_lens=[0], top_ids=[], top_logprobs=[]), "Logprobs", "logprob")
    assert err.value is True
    refused(lambda: Logprobs(logprob="x", top_lens=[0], top_ids=[], top_logprobs=[]), "Logprobs", "logprob")
    refused(lambda: Logprobs(logprob=np.array(["a"]), top_lens=[0], top_ids=[], top_logprobs=[]), "Logprobs", "logprob")


def test_the_structural_int_checks() -> None:
    from ir.columns import check_instance, check_int, check_pool, ints, type_names

    assert check_int("N", "f", np.int16(-3)) == -3 and check_int("N", "f", 2**63 - 1) == 2**63 - 1
    for bad, why in ((2**63, "fit in int64"), (-(2**63) - 1, "fit in int64"), (True, "not bool"), (1.0, "not float"), (None, "not NoneType")):
        err = refused(lambda: check_int("N", "f", bad), "N", "f")  # noqa: B023
        assert err.value is bad and why in str(err)
    assert ints([1, np.int64(2)], "N", "f") == (1, 2) and type(ints([np.int64(2)], "N", "f")[0]) is int
    err = refused(lambda: ints([1, 2, False, 3.0], "N", "f"), "N", "f")
    assert err.value is False and "every entry must be an int" in str(err)
    assert type_names(MambaInit) == "a MambaInit" and type_names(InitIntent, optional=True) == "an InitIntent or None"
    check_instance("N", "f", None, MambaInit, optional=True)
    err = refused(lambda: check_instance("N", "f", None, MambaInit), "N", "f")
    assert "must be a MambaInit, not NoneType" in str(err)
    check_pool("N", "p", "x")
    refused(lambda: check_pool("N", "p", ""), "N", "p")
    refused(lambda: check_pool("N", "p", None), "N", "p")


def test_node_typed_fields_are_type_checked_naming_the_node() -> None:
    from ir.batch import MixedBatch

    err = refused(lambda: MixedBatch(extend=_ext_batch(), decode=None), "MixedBatch", "decode")  # type: ignore[arg-type]
    assert "must be a DecodeBatch, not NoneType" in str(err)
    refused(lambda: _ext_batch(init="clear"), "ExtendBatch", "init")
    refused(lambda: _ext_batch(snapshot=MambaInit(serial=TicketSerial(1), clear_slots=(1,))), "ExtendBatch", "snapshot")
    err = refused(lambda: dec_plan(sampling=rows(2)), "DecodePlan", "sampling")
    assert err.value == 2 and "one row per request: len(rids) = 1" in str(err)
    assert dec_plan(sampling=rows(1)).sampling is not None


def test_sampling_rows_of_params_name_the_unseeded_row_and_carry_bans() -> None:
    from ir.sampling import GREEDY, SamplingParams

    seeded = SamplingParams(temperature=0.5, seed=9)
    r = SamplingRows.of([GREEDY, seeded], [0, 3], [(5, [1, 2]), (0, [])])
    assert r.seed.tolist() == [0, 9] and r.index.tolist() == [0, 3]
    assert r.ban_until.tolist() == [5, 0] and r.banned_lens.tolist() == [2, 0] and r.banned.tolist() == [1, 2]
    assert r.bans_any and not r.all_greedy
    with pytest.raises(IRValidationError, match=r"row 2 is sampled \(temperature 0\.7\) and has no seed") as info:
        SamplingRows.of([GREEDY, seeded, SamplingParams(temperature=0.7)])
    assert (info.value.node, info.value.field) == ("SamplingRows", "seed")
    assert SamplingRows.of([GREEDY]).all_greedy and SamplingRows.of([]).num_requests == 0
    g = SamplingRows.greedy(3)
    assert g.num_requests == 3 and g.all_greedy and g.temperature.tolist() == [0.0] * 3


def test_rows_joined_keeps_rows_in_order_and_fills_either_greedy_side() -> None:
    from ir.sampling import rows_joined, rows_take

    a, b = rows(1, seed=[3], temperature=[0.5]), rows(2, seed=[4, 5], temperature=[0.6, 0.7])
    assert rows_joined(None, 1, None, 2) is None
    assert rows_joined(a, 1, None, 0) is a and rows_joined(None, 0, b, 2) is b
    j = rows_joined(a, 1, None, 2)
    assert j is not None and j.temperature.tolist() == [0.5, 0.0, 0.0]
    j = rows_joined(None, 2, b, 2)
    assert j is not None and j.temperature.tolist() == [0.0, 0.0, 0.6, 0.7]
    j = rows_joined(a, 1, b, 2)
    assert j is not None and j.seed.tolist() == [3, 4, 5]
    assert rows_take(None, np.array([0])) is None
    t = rows_take(b, np.array([1]))
    assert t is not None and t.seed.tolist() == [5]


def test_sampling_params_flags_and_seeding() -> None:
    from ir.sampling import SamplingParams, derive_seed

    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=1e-9).greedy
    assert not SamplingParams().penalised
    assert SamplingParams(presence_penalty=0.1).penalised and SamplingParams(frequency_penalty=-0.1).penalised
    assert SamplingParams(repetition_penalty=0.9).penalised
    p = SamplingParams(temperature=0.5)
    assert p.seeded(7, 3).seed == derive_seed(7, 3) and p.seeded(7, 3).temperature == 0.5
    assert p.seeded(7, 3) != p.seeded(7, 4) and p.seeded(8, 3) != p.seeded(7, 3)
    assert SamplingParams(temperature=0.0).seeded(7, 3).seed is None
    # edges of the integer ranges, both sides
    assert SamplingParams(max_new_tokens=1, min_tokens=1).min_tokens == 1
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(n=1).n == 1
    err = refused(lambda: SamplingParams(max_new_tokens=1, min_tokens=2), "SamplingParams", "min_tokens")
    assert err.value == 2
    from ir.columns import MAX_SEQ_LEN

    assert SamplingParams(max_new_tokens=MAX_SEQ_LEN).max_new_tokens == MAX_SEQ_LEN
    refused(lambda: SamplingParams(max_new_tokens=MAX_SEQ_LEN + 1), "SamplingParams", "max_new_tokens")
    for field in ("top_k", "min_tokens", "max_new_tokens", "n", "seed", "logprobs"):
        err = refused(lambda: SamplingParams(**{field: 1.5}), "SamplingParams", field)  # noqa: B023
        assert err.value == 1.5 and "must be an int, not float" in str(err)
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        err = refused(lambda: SamplingParams(**{field: None}), "SamplingParams", field)  # noqa: B023
        assert "must be a number, not NoneType" in str(err)
    err = refused(lambda: SamplingParams(stop_token_ids=[1, -2, -3]), "SamplingParams", "stop_token_ids")
    assert err.value == -2
    err = refused(lambda: SamplingParams(stop=["ok", 5, ""]), "SamplingParams", "stop")
    assert err.value == 5
    assert SamplingParams(stop="x" * 256).stop == ("x" * 256,)


def test_nodes_compare_by_contents_and_copies_are_rebuilt_through_their_checks() -> None:
    import copy
    import pickle

    from ir.batch import IdleBatch, MixedBatch

    a, b = _decode(3), _decode(3)
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != _decode(3, seq_lens=[3, 3, 4]) and a != _decode(2)
    for clone in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a)):
        assert clone == a and not clone.slots.flags.writeable
        with pytest.raises(ValueError):
            clone.slots.setflags(write=True)
    m = MixedBatch(extend=_ext_batch(), decode=_decode(3, rids=[7, 8, 9], slots=[5, 6, 7], kv_locs=[10, 11, 12]))
    assert m.num_requests == 5 and m.parts() == (m.extend, m.decode) and m.init is m.extend.init
    assert IdleBatch().num_requests == 0 and IdleBatch().parts() == ()
    assert a.rid_at(0) == 0 and a.rid_at(-1) == 2 and a.slot_list() == [1, 2, 3]
    assert _ext_batch().num_tokens == 5 and head_extend().num_tokens == 2


def test_build_unchecked_fills_plain_defaults_and_refuses_a_missing_field() -> None:
    from ir.columns import build_unchecked

    d = _decode(1)
    plan = build_unchecked(DecodePlan, rids=d.rids, slots=d.slots, seq_lens=d.seq_lens, input_ids=d.input_ids, kv_locs=d.kv_locs)
    assert plan.sample_id is None and plan.inputs_from is None and plan.sampling is None
    with pytest.raises(TypeError, match=r"build_unchecked\(DecodePlan\): field 'kv_locs' has no plain default"):
        build_unchecked(DecodePlan, rids=d.rids, slots=d.slots, seq_lens=d.seq_lens, input_ids=d.input_ids)


def test_the_text_form_refuses_declarations_it_cannot_print() -> None:
    import attrs as _attrs

    from ir.columns import REQUEST, ColumnNode, Node, as_i64, column, per
    from ir.printer import layout

    @_attrs.frozen(kw_only=True)
    class Untexted(ColumnNode):
        rids: Any = column(converter=as_i64, metadata=per(REQUEST))

    @_attrs.frozen(kw_only=True)
    class Untagged(Node):
        op: MambaInit | MambaSnapshot

    @_attrs.frozen(kw_only=True)
    class Unlined(Node):
        ops: tuple[MambaInit, ...] = ()

    @_attrs.frozen(kw_only=True)
    class Floaty(Node):
        x: float = 0.0

    for cls, message in ((Untexted, "Untexted.rids: a printed column needs per(..., text=...)"),
                         (Untagged, "Untagged.op: a union of nodes needs shown(..., tags=...)"),
                         (Unlined, "Unlined.ops: a tuple of nodes needs shown(line=...)"),
                         (Floaty, "Floaty.x: no text form for 'float'")):
        with pytest.raises(TypeError) as info:
            layout(cls)
        assert str(info.value) == message


def test_column_declarations_that_cannot_be_checked_are_refused() -> None:
    import attrs as _attrs

    from ir.columns import ANY, REQUEST, WINDOW, ColumnNode, as_i64, column, per

    with pytest.raises(TypeError, match=r"^Windowed\.ids: a window column needs a REQUEST column before it$"):

        @_attrs.frozen(kw_only=True)
        class Windowed(ColumnNode):
            k: int
            ids: Any = column(converter=as_i64, metadata=per(WINDOW))

    with pytest.raises(TypeError, match=r"^column: converter must be as_i64, as_bool or as_f64, not "):
        column(converter=list, metadata=per(REQUEST))
    with pytest.raises(TypeError, match=r"^column: metadata must come from per\(\.\.\.\), got "):
        column(converter=as_i64, metadata={"ir.columns": "request"})

    @_attrs.frozen(kw_only=True)
    class Unaligned(ColumnNode):
        ids: Any = column(converter=as_i64, metadata=per(ANY))
        sampling: SamplingRows | None = None

    with pytest.raises(TypeError, match=r"^Unaligned: a field aligned with the rows needs a per-request column$"):
        Unaligned(ids=[1])


def test_an_accept_result_names_its_verify_and_holds_counts_and_bonus_tokens() -> None:
    from ir.spec import AcceptResult

    r = AcceptResult(verify_id=VerifyId(1), rids=[1, 2], accepted=[0, 3], bonus=[NON_FINITE, 5])
    assert r.accepted.tolist() == [0, 3] and r.bonus.tolist() == [-1, 5]
    err = refused(lambda: AcceptResult(verify_id=VerifyId(0), rids=[1], accepted=[0], bonus=[1]), "AcceptResult", "verify_id")
    assert err.value == 0 and "must be positive (use ir.mint.mint_verify_id())" in str(err)
    refused(lambda: AcceptResult(verify_id=VerifyId(1), rids=[1], accepted=[-1], bonus=[1]), "AcceptResult", "accepted")
    refused(lambda: AcceptResult(verify_id=VerifyId(1), rids=[1], accepted=[0], bonus=[-2]), "AcceptResult", "bonus")
    refused(lambda: AcceptResult(verify_id=VerifyId(1), rids=[1], accepted=[0, 1], bonus=[1]), "AcceptResult", "accepted")


def test_a_draft_extend_is_extend_shaped() -> None:
    from ir.columns import MAX_SEQ_LEN
    from ir.spec import DraftExtendBatch, DraftExtendPlan

    def de(**over: Any) -> DraftExtendBatch:
        f: dict[str, Any] = {"rids": [1], "slots": [1], "prefix_lens": [3], "extend_lens": [2], "input_ids": [4, 5], "kv_locs": [7, 8]}
        f.update(over)
        return DraftExtendBatch(**f)

    assert DraftExtendPlan(batch=de()).rid_list() == [1]
    assert de(prefix_lens=[MAX_SEQ_LEN - 2]).prefix_lens.tolist() == [MAX_SEQ_LEN - 2]
    refused(lambda: de(prefix_lens=[MAX_SEQ_LEN - 1]), "DraftExtendBatch", "prefix_lens")
    refused(lambda: de(extend_lens=[0], input_ids=[], kv_locs=[]), "DraftExtendBatch", "extend_lens")
    refused(lambda: de(input_ids=[4]), "DraftExtendBatch", "input_ids")
    refused(lambda: de(slots=[0]), "DraftExtendBatch", "slots")


# -- ir.wire -------------------------------------------------------------------------------------


def test_the_wire_prefix_edges() -> None:
    import struct

    from ir.wire import WireError, pack, unpack

    plan = dec_plan()
    top = 2**63 - 1
    message = pack(top, plan)
    got = unpack(message, expect_step=top)
    assert got.step == top and got.plan == plan
    assert unpack(bytearray(message)).plan == plan and unpack(memoryview(message)).plan == plan
    prefix = struct.Struct("<4sHHQII")
    over = bytearray(message)
    prefix.pack_into(over, 0, *(list(prefix.unpack_from(message))[:3] + [top + 1] + list(prefix.unpack_from(message))[4:]))
    with pytest.raises(WireError, match=r"^plan message: step 9223372036854775808 is over 2\*\*63 - 1$"):
        unpack(bytes(over))
    with pytest.raises(WireError, match=rf"^plan message: {prefix.size - 1} bytes is shorter than the {prefix.size}-byte prefix$"):
        unpack(message[: prefix.size - 1])
    view = memoryview(bytearray(message))
    view.release()
    with pytest.raises(WireError, match=r"^plan message: unreadable buffer"):
        unpack(view)
    with pytest.raises(WireError, match=r"^plan message: step must fit in int64"):
        pack(top + 1, plan)
    assert unpack(pack(0, plan), expect_step=0).step == 0


def test_plan_ticket_fields_say_which_tickets_they_take() -> None:
    op = MambaInit(serial=TicketSerial(3), clear_slots=(1,))
    init = Ticket(pool=TARGET_POOL, op=op)
    snap = Ticket(pool=TARGET_POOL, op=MambaSnapshot(serial=TicketSerial(4), src=(1,), dst=(2,)))
    err = refused(lambda: ext_plan(tickets=init), "ExtendPlan", "tickets")
    assert "must be a tuple of a Ticket of a MambaInit" in str(err)
    err = refused(lambda: ext_plan(snapshots=[op]), "ExtendPlan", "snapshots")
    assert "every entry must be a Ticket of a MambaSnapshot, not MambaInit" in str(err)
    err = refused(lambda: ext_plan(tickets=(snap,)), "ExtendPlan", "tickets")
    assert "every entry must be a Ticket of a MambaInit, not a Ticket of a MambaSnapshot" in str(err) and err.value == snap
    assert ext_plan(tickets=[init], snapshots=[snap]).all_tickets() == (init, snap)
    assert ext_plan(tickets=[init], snapshots=[snap]).tickets_for(PoolId("draft")) == ()


def test_array_likes_convert_and_owned_columns_stay_read_only() -> None:
    import torch

    from ir.columns import frozen_i64, is_owned, own

    assert Ran(rids=torch.tensor([3, 4])).rids.tolist() == [3, 4]
    assert ext_plan(more_chunks=torch.tensor([True])).more_chunks.tolist() == [True]
    assert Logprobs(logprob=torch.tensor([0.25]), top_lens=[0], top_ids=[], top_logprobs=[]).logprob.tolist() == [0.25]
    refused(lambda: Ran(rids=torch.tensor([1.5])), "Ran", "rids")
    refused(lambda: ext_plan(more_chunks=torch.tensor([1])), "ExtendPlan", "more_chunks")
    refused(lambda: Ran(rids=np.int64(3)), "Ran", "rids")  # a scalar is not a column
    arr = np.array([1, 2], dtype=np.int64)
    assert not is_owned(arr) and is_owned(own(arr)) and is_owned(own(arr)[1:])
    owned = frozen_i64([5, 6])
    assert is_owned(owned) and frozen_i64(owned) is owned and frozen_i64(arr) is not arr
    with pytest.raises(ValueError):
        owned.setflags(write=True)
