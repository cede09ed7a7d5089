"""What ``backend.executor.Executor`` promises about the plans it refuses, beside
``test_backend_core.py`` and ``test_ledger_truth.py``: each refusal is a ``PlanExecutionError``
(``IRValidationError`` for a constructor argument) naming what is wrong, raised before the pool, the
ledger or the allocators change, and the well-formed neighbour of the refused plan runs.

Covered: the constructor's capacity checks; slots in ``[1, capacity]`` (both edges); a decode of a
request's first token; a pipelined decode whose token is missing; what a model hook hands back (the
logits of a forward, a proposal's tokens, a verify's tokens or logits); a plan over rows whose
verify waits for its commit; a commit of the wrong phase's states; a draft commit after a verify of
other tokens, and a draft commit replayed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from typeguard import suppress_type_checks

from backend.allocator import SlotAllocator
from backend.counts import TokenCounts
from backend.executor import Executor
from backend.model import blank_logits
from backend.pool import MambaStatePool
from backend.staging import StagedDecode, StagedExtend, StagedWindow
from ir import spec
from ir.errors import IRValidationError, PlanExecutionError
from ir.ids import SampleId
from ir.plan import DecodePlan
from ir.results import Verified
from passes.accept import accept
from passes.commit import commit
from passes.lower import LowerContext, lower
from passes.prepare_for_draft import SpecContext
from passes.prepare_for_draft import prepare_for_draft as _prepare_for_draft
from passes.prepare_for_draft_commit import prepare_for_draft_commit
from passes.prepare_for_verify import prepare_for_verify
from tests.helpers import ToySpecModel, World, decode_batch, extend_plan, make_world, proposed, request, verified


class Hook(ToySpecModel):
    """The toy speculative hook, whose forward, propose and verify can be told to return something
    else (``bad_*``), counting forwards."""

    def __init__(self) -> None:
        self.forwards = 0
        self.bad_logits: Callable[[torch.Tensor], object] | None = None
        self.bad_proposal: object = None
        self.bad_verify: object = None

    def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> Any:
        self.forwards += 1
        out = blank_logits(extend, decode)
        return out if self.bad_logits is None else self.bad_logits(out)

    def propose(self, plan: spec.DraftPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[Any, object]:
        out, states = super().propose(plan, staged, pool)
        return (out if self.bad_proposal is None else self.bad_proposal), states

    def verify(self, plan: spec.VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[Any, object]:
        out, states = super().verify(plan, staged, pool)
        return (out if self.bad_verify is None else self.bad_verify), states


def _world(capacity: int = 4, live: int = 4) -> tuple[World, Hook]:
    hook = Hook()
    w = make_world(capacity=capacity, live_slots=live, model=hook)
    w.executor = Executor(w.pool, w.ledger, hook, slots=w.slots)
    return w, hook


def _refused(w: World, run: Callable[[], object], match: str) -> None:
    before = w.state()
    with pytest.raises(PlanExecutionError, match=match):
        run()
    after = w.state()
    assert torch.equal(before[0], after[0]), "pool bytes changed"
    assert before[1:] == after[1:], "ledger or allocators changed"


def test_the_constructor_checks_capacities_against_the_pool() -> None:
    w = make_world(capacity=4)
    Executor(w.pool, w.ledger, slots=SlotAllocator(4), counts=TokenCounts(4, 8))
    with pytest.raises(IRValidationError, match=r"the slot allocator's capacity 5 differs from the pool's 4") as info:
        Executor(w.pool, w.ledger, slots=SlotAllocator(5))
    assert (info.value.node, info.value.field) == ("Executor", "slots")
    with pytest.raises(IRValidationError, match=r"the token counts' capacity 3 differs from the pool's 4") as info:
        Executor(w.pool, w.ledger, counts=TokenCounts(3, 8))
    assert info.value.field == "counts"
    assert Executor(w.pool, w.ledger, transactional=True).transactional
    assert not Executor(w.pool, w.ledger).transactional


def test_slots_lie_in_1_to_capacity() -> None:
    w, hook = _world(capacity=4, live=4)
    w.executor.execute(DecodePlan(rids=[1, 4], slots=[1, 4], seq_lens=[3, 3], input_ids=[1, 1], kv_locs=[0, 1]))
    assert hook.forwards == 1
    bare = make_world(capacity=4, live_slots=4)
    ex = Executor(bare.pool, bare.ledger, Hook())  # no allocator: only the range is checked
    _refused(bare, lambda: ex.execute(DecodePlan(rids=[1, 5], slots=[1, 5], seq_lens=[3, 3], input_ids=[1, 1], kv_locs=[0, 1])),
             r"^DecodePlan: slot 5 out of range \[1, 4\] of pool 'target'$")
    ex.execute(DecodePlan(rids=[1], slots=[4], seq_lens=[3], input_ids=[1], kv_locs=[0]))


def test_a_decode_never_feeds_a_requests_first_token() -> None:
    w, hook = _world()
    w.executor.execute(DecodePlan(rids=[1, 2], slots=[1, 2], seq_lens=[2, 9], input_ids=[1, 1], kv_locs=[0, 1]))
    _refused(w, lambda: w.executor.execute(DecodePlan(rids=[1, 2], slots=[1, 2], seq_lens=[9, 1], input_ids=[1, 1], kv_locs=[0, 1])),
             r"^DecodePlan: the row of slot 2 feeds the token at position 0 \(seq_lens 1\)")
    assert hook.forwards == 1


def test_a_pipelined_decode_takes_each_kept_token_once() -> None:
    w, hook = _world()
    first = w.executor.execute(DecodePlan(rids=[1, 2], slots=[1, 2], seq_lens=[3, 3], input_ids=[1, 1], kv_locs=[0, 1], sample_id=SampleId(5)))
    nxt = DecodePlan(rids=[1, 2], slots=[1, 2], seq_lens=[4, 4], input_ids=[0, 0], kv_locs=[2, 3], inputs_from=SampleId(5))
    _refused(w, lambda: w.executor.execute(attrs.evolve(nxt, inputs_from=SampleId(6))),
             r"^DecodePlan takes slot 1's input from sample #6, but pool 'target' holds the token of sample #5 for it")
    w.executor.execute(nxt)
    assert hook.forwards == 2 and first.tokens.shape[0] == 2
    _refused(w, lambda: w.executor.execute(nxt), r"^DecodePlan takes slot 1's input from sample #5, but pool 'target' holds no token for it")


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        (lambda out: out[:1], r"torch\.Size\(\[1, \d+\]\)|\(1, \d+\)"),
        (lambda out: out[0], r"\(\d+,\)|torch\.Size"),
        (lambda out: out.numpy(), "ndarray"),
        (lambda out: None, "NoneType"),
    ],
)
def test_a_forward_must_return_logits_for_every_row(bad: Callable[[torch.Tensor], object], shown: str) -> None:
    w, hook = _world()
    hook.bad_logits = bad
    plan = DecodePlan(rids=[1, 2], slots=[1, 2], seq_lens=[3, 3], input_ids=[1, 1], kv_locs=[0, 1])
    with pytest.raises(PlanExecutionError, match=r"^DecodePlan: the model hook returned .*not logits of shape \[2, vocab\]") as info:
        w.executor.execute(plan)
    assert re.search(shown, str(info.value)), str(info.value)
    hook.bad_logits = None
    w.executor.execute(plan)


def test_a_prefill_whose_forward_returns_no_logits_is_refused_naming_the_rows() -> None:
    w, hook = _world()
    hook.bad_logits = lambda out: out[:1]
    _, plan = extend_plan([request(1, 1, [5, 6], 0), request(2, 2, [7], 2)], ledger=w.ledger)
    with pytest.raises(PlanExecutionError, match=r"^ExtendPlan: the model hook returned .*not logits of shape \[2, vocab\]"):
        w.executor.execute(plan)


def _spec(w: World, k: int = 2) -> tuple[spec.DraftBatch, spec.VerifyBatch]:
    running = decode_batch([1, 2], [1, 2], [4, 4], [20, 21])
    draft = _prepare_for_draft(running, SpecContext(k=k, next_tokens=[3, 3], kv_locs=list(range(30, 30 + 2 * (k + 1)))))
    return draft, prepare_for_verify(draft, proposed(draft, np.full(2 * k, 7, dtype=np.int64)))


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        (torch.full((2, 3), 7, dtype=torch.int64), r"torch\.int64 \(2, 3\)"),
        (torch.full((1, 2), 7, dtype=torch.int64), r"torch\.int64 \(1, 2\)"),
        (torch.full((2, 2), 7, dtype=torch.int32), r"torch\.int32 \(2, 2\)"),
        ([[7, 7], [7, 7]], "list"),
    ],
)
def test_a_proposal_is_n_by_k_int64_tokens(bad: object, shown: str) -> None:
    w, hook = _world()
    draft, _ = _spec(w)
    hook.bad_proposal = bad
    _refused(w, lambda: w.executor.execute(lower(draft, LowerContext())),
             rf"^draft #{draft.draft_id}: the model hook's propose returned {shown}, not 2 x 2 int64 token ids$")
    hook.bad_proposal = None
    out = w.executor.execute(lower(draft, LowerContext()))
    assert isinstance(out, spec.Proposals) and out.tokens.tolist() == [7] * 4 and out.draft_id == draft.draft_id


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        (torch.full((2, 2), 7, dtype=torch.int64), r"torch\.int64 \(2, 2\)"),
        (torch.full((2, 3), 7, dtype=torch.int32), r"torch\.int32 \(2, 3\)"),
        (torch.zeros((2, 2, 5)), r"torch\.float32 \(2, 2, 5\)"),
        ("tokens", "str"),
    ],
)
def test_a_verify_returns_n_by_window_tokens_or_logits(bad: object, shown: str) -> None:
    w, hook = _world()
    _, v = _spec(w)
    hook.bad_verify = bad
    msg = rf"^verify #{v.verify_id}: the model hook's verify returned {shown}, not 2 x 3 x vocab logits or 2 x 3 int64 tokens$"
    with suppress_type_checks(), pytest.raises(PlanExecutionError, match=msg):  # (a user's hook: production runs without typeguard)
        w.executor.execute(lower(v, LowerContext()))
    w2, hook2 = _world()
    logits = torch.zeros((2, 3, 11))
    logits[..., 7] = 1.0
    hook2.bad_verify = logits
    _, v2 = _spec(w2)
    out = w2.executor.execute(lower(v2, LowerContext()))
    assert isinstance(out, Verified) and out.tokens.tolist() == [7] * 6 and out.verify_id == v2.verify_id


def test_rows_whose_verify_waits_for_its_commit_take_no_other_plan() -> None:
    w, hook = _world()
    draft, v = _spec(w)
    w.executor.execute(lower(v, LowerContext()))
    _refused(w, lambda: w.executor.execute(DecodePlan(rids=[5, 2], slots=[3, 2], seq_lens=[3, 3], input_ids=[1, 1], kv_locs=[0, 1])),
             rf"^DecodePlan over slot 2 of pool 'target': the states of verify #{v.verify_id} on that row wait for their commit")
    w.executor.execute(DecodePlan(rids=[5], slots=[3], seq_lens=[3], input_ids=[1], kv_locs=[0]))  # another row runs
    c = commit(v, accept(v, verified(v, np.full(6, 7, dtype=np.int64))))
    # a commit naming a draft's id finds no verify states under it
    _refused(w, lambda: w.executor.execute(spec.CommitPlan(batch=attrs.evolve(c, verify_id=draft.draft_id))),
             rf"^no intermediate states of verify #{draft.draft_id} on pool 'target': never verified here, or already committed$")
    w.executor.execute(lower(c, LowerContext()))
    w.executor.execute(DecodePlan(rids=[1, 2], slots=[1, 2], seq_lens=[7, 7], input_ids=[1, 1], kv_locs=[0, 1]))


def test_a_draft_commit_takes_the_drafts_own_states_once_after_a_verify_of_its_proposals() -> None:
    w, hook = _world()
    draft, v = _spec(w)
    w.executor.execute(lower(draft, LowerContext()))
    c = commit(v, accept(v, verified(v, np.full(6, 7, dtype=np.int64))))
    dc = prepare_for_draft_commit(c, draft)
    # a draft commit naming the verify's id (no draft states under it) is refused naming the phase
    w.executor.execute(lower(v, LowerContext()))
    _refused(w, lambda: w.executor.execute(spec.DraftCommitPlan(batch=attrs.evolve(dc, draft_id=v.verify_id))),
             rf"^no kept states of draft #{v.verify_id} on pool 'target': #{v.verify_id} names a verify's states, which only a CommitPlan commits$")
    w.executor.execute(lower(c, LowerContext()))
    other = attrs.evolve(dc, input_ids=np.where(np.arange(dc.input_ids.shape[0]) % 3 == 0, dc.input_ids, 8))
    _refused(w, lambda: w.executor.execute(spec.DraftCommitPlan(batch=other)),
             rf"^commit of draft #{draft.draft_id} after a verify of tokens \[8, 8, 8, 8\]; draft #{draft.draft_id} proposed \[7, 7, 7, 7\]")
    w.executor.execute(lower(dc, LowerContext()))
    _refused(w, lambda: w.executor.execute(lower(dc, LowerContext())),
             rf"^no kept states of draft #{draft.draft_id} on pool 'target': never drafted here, already committed, or dropped by a newer draft$")


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("run_prefill", "an ExtendPlan or a MixedPlan"),
        ("run_head_extend", "a HeadExtendPlan"),
        ("run_head_commit", "a HeadCommitPlan"),
        ("run_decode", "a DecodePlan"),
        ("run_draft", "a DraftPlan"),
        ("run_verify", "a VerifyPlan"),
        ("run_commit", "a CommitPlan"),
        ("run_draft_commit", "a DraftCommitPlan"),
        ("run_draft_extend", "a DraftExtendPlan"),
    ],
)
def test_each_typed_entry_refuses_another_plan_by_name(entry: str, expected: str) -> None:
    w, hook = _world()
    other = DecodePlan(rids=[1], slots=[1], seq_lens=[3], input_ids=[1], kv_locs=[0]) if entry != "run_decode" else "plan"
    with suppress_type_checks():  # (an untyped caller: production runs without typeguard)
        _refused(w, lambda: getattr(w.executor, entry)(other), rf"^Executor\.{entry}: expected {expected}, got a {type(other).__name__}$")
    assert hook.forwards == 0


class KeepingHook(Hook):
    """The hook, handing back a hidden state of width 4 per token."""

    def forward_keeping_hidden(self, plan: object, extend: StagedExtend, decode: StagedDecode | None, pool: MambaStatePool) -> tuple[Any, Any]:
        out = self.forward(plan, extend, None, pool)
        return out, torch.zeros((int(extend.cu_seqlens[-1]), 4))

    def verify_keeping_hidden(self, plan: spec.VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[Any, object, Any]:
        out, states = self.verify(plan, staged, pool)
        return out, states, torch.zeros((plan.batch.num_requests, plan.batch.k + 1, 4))


def test_hidden_states_need_a_hook_that_keeps_them_and_a_store() -> None:
    from ir.head import HeadCommitBatch, HeadCommitPlan
    from ir.ids import HiddenId

    w, hook = _world()
    _, plan = extend_plan([request(1, 1, [5, 6], 0)], ledger=w.ledger)
    with pytest.raises(PlanExecutionError, match=r"^ExtendPlan asks for hidden states; the model hook Hook hands back none$"):
        w.executor.execute(attrs.evolve(plan, keep_hidden=HiddenId(3)))
    keeping = make_world(capacity=4, live_slots=4)
    ex = Executor(keeping.pool, keeping.ledger, KeepingHook(), slots=keeping.slots)
    _, plan = extend_plan([request(1, 1, [5, 6], 0)], ledger=keeping.ledger)
    with pytest.raises(PlanExecutionError, match=r"^ExtendPlan keeps or reads hidden states, and the executor of pool 'target' shares no hidden store"):
        ex.execute(attrs.evolve(plan, keep_hidden=HiddenId(4)))
    _, plan = extend_plan([request(2, 2, [5], 2)], ledger=keeping.ledger)
    assert ex.execute(plan).hidden is None  # a plan that asks for none gets none

    hc = HeadCommitBatch(k=1, hidden_id=HiddenId(5), rids=[1], slots=[1], prefix_lens=[2], accept_pos=[0], extend_lens=[1], input_ids=[5],
                         kv_locs=[3])
    _refused(w, lambda: w.executor.execute(HeadCommitPlan(batch=hc)),
             r"^HeadCommitPlan is a draft head's phase; this executor's model hook Hook is no HeadHook$")


def _snapshotting(w: World, at: int) -> Any:
    from ir.ids import TARGET_POOL
    from ir.init import MambaInit, MambaSnapshot, Ticket, mint_serial
    from ir.plan import ExtendPlan

    plan = ExtendPlan(
        rids=[1], slots=[1], prefix_lens=[0], extend_lens=[2], more_chunks=[False], input_ids=[5, 6], kv_locs=[0, 1],
        tickets=(Ticket(pool=TARGET_POOL, op=MambaInit(serial=mint_serial(), clear_slots=(1,))),),
        snapshots=(Ticket(pool=TARGET_POOL, op=MambaSnapshot(serial=mint_serial(), src=(1,), dst=(3,), at=(at,))),),
    )
    w.ledger.register(plan.all_tickets())
    return plan


def test_a_snapshot_inside_a_chunk_needs_a_position_in_it_and_a_hook_that_captures() -> None:
    w, hook = _world()
    past = _snapshotting(w, 3)
    _refused(w, lambda: w.executor.execute(past), rf"^ExtendPlan: snapshot #{past.snapshots[0].serial} at 3 past the 2 tokens of slot 1's chunk$")
    inside = _snapshotting(w, 1)
    _refused(w, lambda: w.executor.execute(inside),
             rf"^ExtendPlan: snapshot #{inside.snapshots[0].serial} is taken inside a chunk, and the model hook Hook captures no inner states$")
    assert hook.forwards == 0
    w.ledger.cancel_all(past.all_tickets(), "refused")
    w.ledger.cancel_all(inside.all_tickets(), "refused")
    end = _snapshotting(w, 2)  # at the chunk's end: the state the forward leaves, no capture
    w.executor.execute(end)
    assert hook.forwards == 1 and torch.equal(w.pool.buffer[3], w.pool.buffer[1])
    w.ledger.assert_drained()


def test_a_pipelined_prefill_keeps_the_tokens_of_the_rows_it_completes() -> None:
    w, hook = _world()
    _, plan = extend_plan([request(1, 1, [5, 6], 0), request(2, 2, [7], 2, more_chunks=True)], ledger=w.ledger)
    w.executor.execute(attrs.evolve(plan, sample_id=SampleId(9)))
    nxt = DecodePlan(rids=[1], slots=[1], seq_lens=[3], input_ids=[0], kv_locs=[3], inputs_from=SampleId(9))
    _refused(w, lambda: w.executor.execute(attrs.evolve(nxt, rids=[2], slots=[2])),
             r"^DecodePlan takes slot 2's input from sample #9, but pool 'target' holds no token for it")
    w.executor.execute(nxt)


def test_an_idle_plan_runs_nothing() -> None:
    from ir.plan import IdlePlan
    from ir.results import Ran

    w, hook = _world()
    out = w.executor.execute(IdlePlan())
    assert isinstance(out, Ran) and out.rid_list() == [] and hook.forwards == 0


def test_a_mixed_forward_returns_logits_for_its_extend_and_decode_rows() -> None:
    from passes.mix_with_running import mix_with_running
    from passes.prepare_for_extend import prepare_for_extend

    w, hook = _world()
    ext = prepare_for_extend([request(1, 1, [5, 6], 0)])
    plan = lower(mix_with_running(ext, decode_batch([2, 3], [2, 3], [4, 4], [20, 21])), LowerContext())
    w.ledger.register(plan.tickets)
    hook.bad_logits = lambda out: out[:2]
    with pytest.raises(PlanExecutionError, match=r"^MixedPlan: the model hook returned .*not logits of shape \[3, vocab\]"):
        w.executor.execute(plan)
    w2, hook2 = _world()
    plan2 = lower(mix_with_running(prepare_for_extend([request(1, 1, [5, 6], 0)]), decode_batch([2, 3], [2, 3], [4, 4], [20, 21])), LowerContext())
    w2.ledger.register(plan2.tickets)
    out = w2.executor.execute(plan2)
    assert out.rid_list() == [1, 2, 3] and hook2.forwards == 1


def test_kept_states_live_until_their_commit_or_until_forgotten() -> None:
    w, hook = _world()
    draft, v = _spec(w)
    assert w.executor.kept_states == () and w.executor.usable and w.executor.pool_id == "target"
    w.executor.execute(lower(draft, LowerContext()))
    assert w.executor.kept_states == (draft.draft_id,)
    w.executor.execute(lower(v, LowerContext()))
    assert w.executor.kept_states == (draft.draft_id, v.verify_id)
    c = commit(v, accept(v, verified(v, np.full(6, 7, dtype=np.int64))))
    w.executor.execute(lower(c, LowerContext()))
    assert w.executor.kept_states == (draft.draft_id,)
    w.executor.execute(lower(prepare_for_draft_commit(c, draft), LowerContext()))
    assert w.executor.kept_states == ()
    # a newer draft drops an older one's states (never committed: the engine caught up by a forward)
    d1, _ = _spec(w)
    d2, _ = _spec(w)
    w.executor.execute(lower(d1, LowerContext()))
    w.executor.execute(lower(d2, LowerContext()))
    assert w.executor.kept_states == (d2.draft_id,)
    w.executor.execute(DecodePlan(rids=[3], slots=[3], seq_lens=[3], input_ids=[1], kv_locs=[0], sample_id=SampleId(8)))
    w.executor.forget_verifies()
    assert w.executor.kept_states == ()
    _refused(w, lambda: w.executor.execute(DecodePlan(rids=[3], slots=[3], seq_lens=[4], input_ids=[0], kv_locs=[1], inputs_from=SampleId(8))),
             r"holds no token for it")


def test_a_penalised_verify_counts_its_pending_token_before_position_0_and_changes_no_count() -> None:
    from ir.mint import mint_draft_id, mint_verify_id
    from ir.sampling import SamplingParams, SamplingRows

    w = make_world(capacity=4, live_slots=4)
    hook = Hook()
    counts = TokenCounts(4, 8)
    ex = Executor(w.pool, w.ledger, hook, slots=w.slots, counts=counts)
    logits = torch.zeros((1, 2, 8))
    logits[..., 3] = 1.0  # the pending token, best unless penalised
    logits[..., 4] = 0.5
    hook.bad_verify = logits
    rows = SamplingRows.of([SamplingParams(temperature=0.0, presence_penalty=2.0)])
    before = [t.clone() for t in counts.rows(torch.tensor([1]))]
    did = mint_draft_id()
    v = spec.VerifyBatch(k=1, verify_id=mint_verify_id(), draft_id=did, rids=[1], slots=[1], seq_lens=[4], input_ids=[3, 5], kv_locs=[0, 1],
                         sampling=rows)
    out = ex.execute(spec.VerifyPlan(batch=v))
    assert isinstance(out, Verified) and out.tokens.tolist() == [4, 4]  # token 3 was fed (the pending input): penalised everywhere
    after = counts.rows(torch.tensor([1]))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    plain = Executor(make_world(capacity=4, live_slots=4).pool, w.ledger, hook, counts=TokenCounts(4, 8))
    unpenalised = spec.VerifyBatch(k=1, verify_id=mint_verify_id(), draft_id=mint_draft_id(), rids=[1], slots=[1], seq_lens=[4],
                                   input_ids=[6, 5], kv_locs=[0, 1], sampling=rows)
    assert plain.execute(spec.VerifyPlan(batch=unpenalised)).tokens.tolist() == [3, 3]  # 3 never fed: not penalised
