"""The draft head's IR: hidden-state handles, the head extend and head commit passes,
their lowering, and the boundary's check of a result's handle.

- ``prepare_for_head_extend`` takes the prefill's own columns and one-shot ops, with the handle of
  that prefill's hidden states; states of other rows, of another chunk, of other lengths or of a
  verify are refused naming both values.
- ``prepare_for_head_commit``: the committed window ``[p, d1..dm]`` per row for a known accept
  pattern; states of another verify, of an extend or of other rows are refused naming both.
- Lowering: the target's ``ExtendPlan`` gets the target pools' tickets and the ``HeadExtendPlan``
  the head pools', one op under one serial (the ledger holds them as two tickets); a head extend
  lowered with no head pool, and a context naming a pool both ways, are refused.
- ``backend.boundary.checked`` refuses a result whose handle is not the one the plan asked for.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from backend.boundary import checked, result_type
from backend.ledger import Ledger
from compiler.manager import PassManager
from compiler.steps import Pipeline
from ir.batch import ExtendBatch
from ir.errors import IRValidationError, IRVerificationError, PlanExecutionError, PreconditionError
from ir.head import HeadCommitBatch, HeadCommitPlan, HeadExtendBatch, HeadExtendPlan
from ir.hidden import HiddenSource, HiddenStates, asked_hidden
from ir.ids import TARGET_POOL, HiddenId, MambaSlot, PoolId, VerifyId
from ir.init import InitIntent
from ir.mint import mint_hidden_id
from ir.plan import ExtendPlan
from ir.request import Continue, CopyFrom
from ir.results import Ran, Sampled, Verified
from ir.spec import CommitBatch, VerifyPlan
from ir.verify import verify
from passes import (
    LowerContext,
    SpecContext,
    accept,
    commit,
    lower,
    prepare_for_draft,
    prepare_for_extend,
    prepare_for_head_commit,
    prepare_for_head_extend,
    prepare_for_verify,
)
from tests.helpers import decode_batch, proposed, request, verified

HEAD = PoolId("head")
CTX = LowerContext(pools=(TARGET_POOL,), head_pools=(HEAD,))


def _extend() -> tuple[ExtendBatch, ExtendPlan, HiddenStates]:
    """A prefill (a clear, a COW with a snapshot, a continued chunk) kept for the head, its plan and handle."""
    batch = prepare_for_extend([
        request(10, 1, [5, 6, 7], 100),
        attrs.evolve(request(11, 2, [8, 9], 200, intent=CopyFrom(src=MambaSlot(7), prefix_len=4)), snapshot_to=MambaSlot(9)),
        request(12, 3, [1, 2, 3, 4], 300, intent=Continue(prefix_len=8), more_chunks=True),
    ])
    plan = lower(batch, CTX, keep_hidden=mint_hidden_id())
    hidden = asked_hidden(plan)
    assert hidden is not None
    return batch, plan, hidden


def _iteration(k: int = 3) -> tuple[CommitBatch, VerifyPlan, HiddenStates]:
    """A speculative iteration's commit, its verify's plan kept for the head, and the handle."""
    running = decode_batch([1, 2, 3], [4, 5, 6], [10, 20, 30], [60, 61, 62])
    ctx = SpecContext(k=k, next_tokens=[50, 51, 52], kv_locs=list(range(700, 700 + 3 * (k + 1))))
    draft = prepare_for_draft(running, ctx)
    verify_batch = prepare_for_verify(draft, proposed(draft, [81, 82, 83, 84, 85, 86, 87, 88, 89]))
    plan = lower(verify_batch, CTX, keep_hidden=mint_hidden_id())
    # row 0 rejects d1, row 1 accepts all three, row 2 accepts d1 only
    target = np.array([90, 0, 0, 0, 84, 85, 86, 7, 87, 91, 0, 0], dtype=np.int64)
    committed = commit(verify_batch, accept(verify_batch, verified(verify_batch, target)))
    hidden = asked_hidden(plan)
    assert hidden is not None
    return committed, plan, hidden


# -- the head extend ---------------------------------------------------------------------------------


def test_head_extend_is_the_prefill_with_its_own_ops_and_the_hidden_id() -> None:
    batch, plan, hidden = _extend()
    head = prepare_for_head_extend(batch, hidden)
    assert isinstance(head, HeadExtendBatch) and head.hidden_id == plan.keep_hidden == hidden.hidden_id
    for name in ("rids", "slots", "prefix_lens", "extend_lens", "input_ids", "kv_locs"):
        assert getattr(head, name) is getattr(batch, name)  # shared, not copied
    assert head.init is batch.init and head.snapshot is batch.snapshot and head.intents == batch.intents
    assert head.intents == (InitIntent.CLEAR, InitIntent.COW, InitIntent.CONTINUE)
    assert hidden.source is HiddenSource.EXTEND and hidden.starts.tolist() == [0, 4, 8] and hidden.lens.tolist() == [3, 2, 4]
    verify(head)


def test_head_extend_refuses_states_of_other_rows_naming_both() -> None:
    batch, _, hidden = _extend()
    other = attrs.evolve(hidden, rids=[10, 12, 11])
    with pytest.raises(PreconditionError, match=r"prepare_for_head_extend: hidden #\d+ of an extend .* kept rows \[10, 12, 11\], the extend reads rows \[10, 11, 12\]"):
        prepare_for_head_extend(batch, other)


def test_head_extend_refuses_states_of_another_chunk_naming_both() -> None:
    batch, _, hidden = _extend()
    earlier = attrs.evolve(hidden, starts=[0, 0, 4])  # the same rows' earlier chunk
    with pytest.raises(PreconditionError, match=r"kept first positions \[0, 0, 4\], the extend reads first positions \[0, 4, 8\]"):
        prepare_for_head_extend(batch, earlier)
    shorter = attrs.evolve(hidden, lens=[3, 2, 3])
    with pytest.raises(PreconditionError, match=r"kept lengths \[3, 2, 3\], the extend reads lengths \[3, 2, 4\]"):
        prepare_for_head_extend(batch, shorter)


def test_head_extend_refuses_a_verifys_states() -> None:
    batch, _, _ = _extend()
    _, vplan, vhidden = _iteration()
    with pytest.raises(PreconditionError, match=rf"hidden #{vhidden.hidden_id} of verify #{vplan.batch.verify_id} .* cannot feed a head extend"):
        prepare_for_head_extend(batch, vhidden)


# -- the head commit -----------------------------------------------------------------------------------


def test_head_commit_columns_for_a_known_accept_pattern() -> None:
    committed, vplan, hidden = _iteration(k=3)
    assert committed.accept_pos.tolist() == [0, 3, 1]
    head = prepare_for_head_commit(committed, hidden)
    assert isinstance(head, HeadCommitBatch) and head.hidden_id == vplan.keep_hidden and head.k == 3
    assert head.rids.tolist() == [1, 2, 3] and head.slots.tolist() == [4, 5, 6]
    assert head.prefix_lens.tolist() == [10, 20, 30]  # seq_len - 1: the head's committed length before the window
    assert head.extend_lens.tolist() == [1, 4, 2] and head.accept_pos.tolist() == [0, 3, 1]
    assert head.input_ids.tolist() == [50, 51, 84, 85, 86, 52, 87]  # [p], [p d1 d2 d3], [p d1]
    assert head.kv_locs.tolist() == [700, 704, 705, 706, 707, 708, 709]
    assert hidden.starts.tolist() == [10, 20, 30] and hidden.lens.tolist() == [4, 4, 4]
    verify(head)
    verify(lower(head, CTX))


def test_head_commit_refuses_another_verifys_or_an_extends_states() -> None:
    committed, _, _ = _iteration()
    _, other_plan, other = _iteration()
    with pytest.raises(
        PreconditionError,
        match=rf"hidden #{other.hidden_id} of verify #{other_plan.batch.verify_id} .* cannot feed the head commit of verify #{committed.verify_id}",
    ):
        prepare_for_head_commit(committed, other)
    _, _, prefill = _extend()
    with pytest.raises(PreconditionError, match=rf"hidden #{prefill.hidden_id} of an extend .* cannot feed the head commit"):
        prepare_for_head_commit(committed, prefill)


def test_head_commit_refuses_states_of_other_rows_or_windows_naming_both() -> None:
    committed, _, hidden = _iteration()
    with pytest.raises(PreconditionError, match=r"kept rows \[1, 2\], the commit of verify #\d+ reads rows \[1, 2, 3\]"):
        prepare_for_head_commit(committed, attrs.evolve(hidden, rids=[1, 2], starts=[10, 20], lens=[4, 4]))
    with pytest.raises(PreconditionError, match=r"kept lengths \[3, 3, 3\], the commit of verify #\d+ reads lengths \[4, 4, 4\]"):
        prepare_for_head_commit(committed, attrs.evolve(hidden, lens=[3, 3, 3]))


def test_a_head_commit_feeds_accept_pos_plus_one_tokens() -> None:
    committed, _, hidden = _iteration()
    head = prepare_for_head_commit(committed, hidden)
    with pytest.raises(IRValidationError, match=r"HeadCommitBatch\.extend_lens.*row 0 must feed accept_pos \+ 1 \(1\) tokens"):
        attrs.evolve(head, extend_lens=[2, 4, 1])
    with pytest.raises(IRValidationError, match=r"HeadCommitBatch\.accept_pos.*must be <= k \(3\)"):
        attrs.evolve(head, accept_pos=[0, 4, 1], extend_lens=[1, 5, 2], input_ids=[1] * 8, kv_locs=list(range(8)))


# -- lowering and the ledger ------------------------------------------------------------------------------


def test_the_head_pool_gets_its_own_tickets_of_the_prefills_ops() -> None:
    batch, plan, hidden = _extend()
    head = lower(prepare_for_head_extend(batch, hidden), CTX)
    assert isinstance(head, HeadExtendPlan) and head.hidden_id == hidden.hidden_id
    assert [t.pool for t in plan.all_tickets()] == [TARGET_POOL, TARGET_POOL]
    assert [t.pool for t in head.all_tickets()] == [HEAD, HEAD]
    assert [t.op for t in head.all_tickets()] == [t.op for t in plan.all_tickets()]  # the same ops, same serials
    assert head.ticket_for(HEAD) is not None and head.ticket_for(TARGET_POOL) is None
    verify(head)


def test_pipeline_registers_the_targets_and_the_heads_tickets() -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, CTX, PassManager(verify_level=2))
    batch, plan = pipe.prefill([request(10, 1, [5, 6, 7], 100)], keep_hidden=True)
    assert plan.keep_hidden is not None
    hidden = asked_hidden(plan)
    assert hidden is not None
    head_batch, head_plan = pipe.head_extend(batch, hidden)
    assert head_batch.hidden_id == plan.keep_hidden
    keys = sorted((int(t.serial), str(t.pool)) for t in ledger.outstanding())
    serial = int(plan.tickets[0].serial)
    assert keys == [(serial, "head"), (serial, "target")]
    _, unkept = pipe.prefill([request(11, 2, [5], 200)])
    assert unkept.keep_hidden is None and asked_hidden(unkept) is None


def test_a_head_extend_needs_a_head_pool_and_a_pool_is_seen_one_way() -> None:
    batch, _, hidden = _extend()
    head = prepare_for_head_extend(batch, hidden)
    with pytest.raises(PreconditionError, match=r"lower: a HeadExtendBatch needs the head's pools in LowerContext\.head_pools \(none given; pools \['target'\]\)"):
        lower(head, LowerContext())
    with pytest.raises(IRValidationError, match=r"LowerContext\.head_pools: a head pool must not be in pools \['target'\] .* \(got \['target'\]\)"):
        LowerContext(pools=(TARGET_POOL,), head_pools=(HEAD, TARGET_POOL))


def test_the_verifier_checks_a_head_extend_as_the_prefill() -> None:
    batch, _, hidden = _extend()
    head = prepare_for_head_extend(batch, hidden)
    with pytest.raises(IRVerificationError, match=r"HeadExtendBatch\.init\.clear_slots"):
        verify(attrs.evolve(head, intents=(InitIntent.CONTINUE, InitIntent.COW, InitIntent.CONTINUE)))
    plan = lower(head, CTX)
    with pytest.raises(IRVerificationError, match=r"HeadExtendPlan\.tickets\[0\].*writes slot 1, which no request of the plan owns"):
        verify(attrs.evolve(plan, slots=[9, 2, 3]))


# -- the handle -------------------------------------------------------------------------------------------


def test_a_handle_names_its_verify_exactly_when_a_verify_made_it() -> None:
    with pytest.raises(IRValidationError, match=r"HiddenStates\.verify_id.*exactly when source is verify \(source=extend\)"):
        HiddenStates(hidden_id=HiddenId(3), source=HiddenSource.EXTEND, verify_id=VerifyId(2), rids=[1], starts=[0], lens=[1])
    with pytest.raises(IRValidationError, match=r"HiddenStates\.verify_id.*\(source=verify\)"):
        HiddenStates(hidden_id=HiddenId(3), source=HiddenSource.VERIFY, rids=[1], starts=[0], lens=[1])
    with pytest.raises(IRValidationError, match=r"HiddenStates\.hidden_id.*must be positive"):
        HiddenStates(hidden_id=HiddenId(0), source=HiddenSource.EXTEND, rids=[1], starts=[0], lens=[1])
    with pytest.raises(IRValidationError, match=r"HiddenStates\.lens.*>= 1"):
        HiddenStates(hidden_id=HiddenId(3), source=HiddenSource.EXTEND, rids=[1], starts=[0], lens=[0])


def test_a_handle_describes_itself_by_producer_rows_and_spans_the_first_eight_of_each() -> None:
    # the phrase every refusal about a handle uses: its id, its producer, its rows and each row's positions
    one = HiddenStates(hidden_id=HiddenId(5), source=HiddenSource.EXTEND, rids=[3, 4], starts=[0, 8], lens=[4, 2])
    assert one.described() == "hidden #5 of an extend (rows [3, 4], positions 0..3, 8..9)"
    many = HiddenStates(hidden_id=HiddenId(6), source=HiddenSource.VERIFY, verify_id=VerifyId(2), rids=list(range(1, 11)),
                        starts=[10 * i for i in range(10)], lens=[3] * 10)
    assert many.described() == ("hidden #6 of verify #2 (rows [1, 2, 3, 4, 5, 6, 7, 8], positions "
                                + ", ".join(f"{10 * i}..{10 * i + 2}" for i in range(8)) + ")")


def test_the_boundary_checks_the_handle_a_result_hands_back() -> None:
    batch, plan, hidden = _extend()
    tokens = [1, 2, 3]
    assert checked(plan, Sampled(rids=plan.rids, tokens=tokens, hidden=hidden)).hidden == hidden
    with pytest.raises(PlanExecutionError, match=rf"ExtendPlan asked for hidden #{hidden.hidden_id} of an extend .*, and came back with none"):
        checked(plan, Sampled(rids=plan.rids, tokens=tokens))
    stale = attrs.evolve(hidden, hidden_id=HiddenId(int(hidden.hidden_id) + 1))
    with pytest.raises(PlanExecutionError, match=rf"came back with hidden #{stale.hidden_id} of an extend"):
        checked(plan, Sampled(rids=plan.rids, tokens=tokens, hidden=stale))
    with pytest.raises(PlanExecutionError, match=r"positions 0\.\.2, 4\.\.5, 8\.\.11\), and came back with .* positions 0\.\.2, 4\.\.5, 8\.\.10\)$"):
        checked(plan, Sampled(rids=plan.rids, tokens=tokens, hidden=attrs.evolve(hidden, lens=[3, 2, 3])))
    unkept = lower(batch, CTX)
    with pytest.raises(PlanExecutionError, match=r"ExtendPlan asked for no hidden states, and came back with hidden #"):
        checked(unkept, Sampled(rids=unkept.rids, tokens=tokens, hidden=hidden))
    committed, vplan, vhidden = _iteration()
    window = [0] * 12
    assert checked(vplan, Verified(k=3, verify_id=vplan.batch.verify_id, rids=vplan.rids, tokens=window, hidden=vhidden)).hidden == vhidden
    with pytest.raises(PlanExecutionError, match=r"VerifyPlan asked for hidden #\d+ of verify #\d+ .*, and came back with none"):
        checked(vplan, Verified(k=3, verify_id=vplan.batch.verify_id, rids=vplan.rids, tokens=window))
    head_commit = lower(prepare_for_head_commit(committed, vhidden), CTX)
    assert isinstance(head_commit, HeadCommitPlan) and result_type(head_commit) is Ran
    assert checked(head_commit, Ran(rids=head_commit.rids)).rids.tolist() == [1, 2, 3]
