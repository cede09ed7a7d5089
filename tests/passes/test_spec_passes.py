"""Speculative-decoding passes: draft, verify, accept, commit, draft extend, and their plans."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.boundary import checked
from backend.executor import Executor
from backend.ledger import Ledger
from backend.model import blank_logits
from backend.pool import MambaStatePool
from backend.staging import StagedDecode, StagedExtend, StagedWindow
from compiler.manager import PassManager
from compiler.steps import Pipeline
from ir.batch import DecodeBatch
from ir.columns import SMALL_COLUMN, frozen_i64
from ir.errors import IRValidationError, PlanExecutionError, PreconditionError
from ir.ids import DRAFT_POOL, TARGET_POOL, DraftId, VerifyId
from ir.init import SERIAL_COUNTER_BITS, serial_epoch
from ir.spec import AcceptResult, CommitPlan, DraftBatch, DraftCommitPlan, DraftExtendPlan, DraftPlan, VerifyBatch, VerifyPlan
from ir.verify import verify
from passes import (
    LowerContext,
    SpecContext,
    accept,
    commit,
    lower,
    merge_batch,
    prepare_for_draft,
    prepare_for_draft_commit,
    prepare_for_draft_extend,
    prepare_for_verify,
)
from tests.helpers import LAYOUT, decode_batch, fresh, proposed, verified

K = 3


def _running() -> object:
    # forward-done state: row 0 has 5 committed tokens, row 1 has 9
    return decode_batch([1, 2], [3, 4], [5, 9], [15, 19], tokens=[50, 90])


def _draft() -> DraftBatch:
    running = decode_batch([1, 2], [3, 4], [5, 9], [15, 19], tokens=[50, 90])
    return prepare_for_draft(running, SpecContext(k=K, next_tokens=[7, 8], kv_locs=list(range(100, 108))))


def _verify() -> VerifyBatch:
    d = _draft()
    return prepare_for_verify(d, proposed(d, [11, 12, 13, 21, 22, 23]))


def test_prepare_for_draft_feeds_pending_token_at_next_position() -> None:
    d = _draft()
    assert d.seq_lens.tolist() == [6, 10]
    assert d.input_ids.tolist() == [7, 8]
    assert d.kv_locs.tolist() == list(range(100, 108))
    verify(d)


def test_spec_context_checks_window_size() -> None:
    with pytest.raises(IRValidationError, match="SpecContext.kv_locs"):
        SpecContext(k=K, next_tokens=[7, 8], kv_locs=list(range(100, 107)))
    with pytest.raises(IRValidationError, match="SpecContext.k"):
        SpecContext(k=0, next_tokens=[7], kv_locs=[1])


def test_prepare_for_verify_windows_pending_then_drafts() -> None:
    v = _verify()
    assert v.window(v.input_ids).tolist() == [[7, 11, 12, 13], [8, 21, 22, 23]]
    assert v.verify_id != _verify().verify_id
    verify(v)


def test_prepare_for_verify_checks_token_count() -> None:
    d = _draft()
    with pytest.raises(PreconditionError, match=rf"the proposals of draft #{d.draft_id} hold 3 tokens with k=3; the draft has 2 rows x k=3"):
        prepare_for_verify(d, proposed(d, [1, 2, 3]))


@pytest.mark.parametrize(
    ("target", "accepted", "bonus"),
    [
        ([[11, 12, 13, 14], [21, 22, 23, 24]], [3, 3], [14, 24]),  # everything accepted
        ([[99, 12, 13, 14], [21, 99, 23, 24]], [0, 1], [99, 99]),  # first mismatch decides
        ([[11, 12, 99, 14], [21, 22, 23, 99]], [2, 3], [99, 99]),
        ([[11, 99, 13, 14], [5, 22, 23, 24]], [1, 0], [99, 5]),  # later matches do not count
    ],
)
def test_accept_longest_matching_prefix_plus_bonus(target: list[list[int]], accepted: list[int], bonus: list[int]) -> None:
    v = _verify()
    r = accept(v, verified(v, frozen_i64(np.array(target).reshape(-1))))
    assert r.accepted.tolist() == accepted
    assert r.bonus.tolist() == bonus


@pytest.mark.parametrize("n", [1, 5, SMALL_COLUMN, SMALL_COLUMN + 1, 3 * SMALL_COLUMN])
def test_accept_agrees_with_the_definition_on_both_sides_of_the_small_path(n: int) -> None:
    """Up to ``SMALL_COLUMN`` rows ``accept`` loops in Python, above it numpy: both give each row's
    longest prefix of drafts equal to the target's predictions and the prediction after it."""
    rng = np.random.default_rng(n)
    k = 3
    running = decode_batch(list(range(1, n + 1)), list(range(1, n + 1)), [5] * n, list(range(1000, 1000 + n)), tokens=[1] * n)
    d = prepare_for_draft(running, SpecContext(k=k, next_tokens=[7] * n, kv_locs=list(range(2000, 2000 + n * (k + 1)))))
    drafts = rng.integers(0, 3, size=(n, k))
    v = prepare_for_verify(d, proposed(d, drafts.reshape(-1).tolist()))
    targets = rng.integers(0, 3, size=(n, k + 1))
    targets[: n // 2, :k] = drafts[: n // 2]  # (half the rows match everywhere)
    r = accept(v, verified(v, frozen_i64(targets.reshape(-1))))
    want = [next((j for j in range(k) if drafts[i, j] != targets[i, j]), k) for i in range(n)]
    assert r.accepted.tolist() == want
    assert r.bonus.tolist() == [int(targets[i, m]) for i, m in enumerate(want)]
    r.check_fields()  # (built unchecked: its local checks hold)


def test_commit_releases_rejected_kv_and_draft_extend_takes_accepted_tokens() -> None:
    v = _verify()
    r = accept(v, verified(v, frozen_i64([11, 99, 13, 14, 21, 22, 23, 24])))  # row 0 accepts 1, row 1 accepts 3
    c = commit(v, r)
    assert c.accept_pos.tolist() == [1, 3]
    assert c.released_kv.tolist() == [102, 103]
    assert c.verify_id == v.verify_id
    verify(c)
    e = prepare_for_draft_extend(c)
    assert e.prefix_lens.tolist() == [5, 9]
    assert e.extend_lens.tolist() == [2, 4]
    assert e.input_ids.tolist() == [7, 11, 8, 21, 22, 23]
    assert e.kv_locs.tolist() == [100, 101, 104, 105, 106, 107]
    verify(e)
    running = merge_batch(decode_batch([], [], [], [], tokens=[]), e)
    assert running.seq_lens.tolist() == [7, 13]  # c + m + 1 committed
    assert running.input_ids.tolist() == [11, 23]


def test_accept_names_the_verify_it_judged_and_its_rows() -> None:
    v = _verify()
    r = accept(v, verified(v, frozen_i64([11, 99, 13, 14, 21, 22, 23, 24])))
    assert r.verify_id == v.verify_id and r.rids.tolist() == v.rid_list() == [1, 2]


def test_commit_refuses_the_accept_result_of_another_verify_with_as_many_rows() -> None:
    """Two verifies of the same draft (the same rows, the same row count): the result of one does
    not commit the other, and the refusal names both verifies; each commits its own."""
    d = _draft()
    mine = prepare_for_verify(d, proposed(d, [11, 12, 13, 21, 22, 23]))
    theirs = prepare_for_verify(d, proposed(d, [11, 12, 13, 21, 22, 23]))
    targets = frozen_i64([11, 99, 13, 14, 21, 22, 23, 24])
    other = accept(theirs, verified(theirs, targets))
    with pytest.raises(
        PreconditionError,
        match=rf"^commit: the accept result of verify #{theirs.verify_id} cannot commit verify #{mine.verify_id}: "
        "a commit applies the result of the verify it judged$",
    ):
        commit(mine, other)
    with pytest.raises(PreconditionError, match=rf"the accept result of verify #{mine.verify_id} cannot commit verify #{theirs.verify_id}"):
        commit(theirs, accept(mine, verified(mine, targets)))
    assert commit(mine, accept(mine, verified(mine, targets))).accept_pos.tolist() == [1, 3]
    assert commit(theirs, other).verify_id == theirs.verify_id


@pytest.mark.parametrize(
    ("rids", "shown"),
    [
        ([2, 1], r"judged rows \[2, 1\], the verify's are \[1, 2\] \(row 0: request 2, the verify's 1\)"),  # permuted
        ([1, 3], r"judged rows \[1, 3\], the verify's are \[1, 2\] \(row 1: request 3, the verify's 2\)"),  # another request
        ([1], r"judged 1 row \[1\], the verify has 2 rows \[1, 2\]"),
    ],
)
def test_commit_refuses_an_accept_result_of_its_verify_for_other_rows(rids: list[int], shown: str) -> None:
    """The result names the right verify but other rows (another order, another request, another
    count): the accepted positions would land in other rows' slots, so it is refused naming both."""
    v = _verify()
    own = accept(v, verified(v, frozen_i64([11, 99, 13, 14, 21, 22, 23, 24])))
    forged = AcceptResult(verify_id=v.verify_id, rids=rids, accepted=own.accepted[: len(rids)], bonus=own.bonus[: len(rids)])
    with pytest.raises(PreconditionError, match=rf"^commit: the accept result of verify #{v.verify_id} {shown}: a commit applies each row's result to that row$"):
        commit(v, forged)
    assert commit(v, own).accept_pos.tolist() == [1, 3]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_commit_takes_exactly_its_own_verifys_result(data: st.DataObject) -> None:
    """For any verify (1 to 6 rows) and target tokens: the verify's own accept result commits its
    accepted positions; the same columns named by any other verify id, and the verify's id with any
    other row list (a permutation, other requests, another count), are refused."""
    n = data.draw(st.integers(1, 6), label="rows")
    rids = data.draw(st.lists(st.integers(1, 50), min_size=n, max_size=n, unique=True), label="rids")
    running = decode_batch(rids, list(range(1, n + 1)), [5] * n, list(range(1000, 1000 + n)))
    d = prepare_for_draft(running, SpecContext(k=2, next_tokens=[7] * n, kv_locs=list(range(2000, 2000 + 3 * n))))
    v = prepare_for_verify(d, proposed(d, data.draw(st.lists(st.integers(0, 3), min_size=2 * n, max_size=2 * n), label="drafts")))
    own = accept(v, verified(v, frozen_i64(data.draw(st.lists(st.integers(0, 3), min_size=3 * n, max_size=3 * n), label="targets"))))
    assert commit(v, own).accept_pos.tolist() == own.accepted.tolist()
    other_id = data.draw(st.integers(1, 2**62).filter(lambda i: i != v.verify_id), label="other verify id")
    with pytest.raises(PreconditionError, match=rf"^commit: the accept result of verify #{other_id} cannot commit verify #{v.verify_id}: "):
        commit(v, attrs.evolve(own, verify_id=VerifyId(other_id)))
    other_rids = data.draw(
        (st.permutations(rids) | st.lists(st.integers(1, 50), min_size=0, max_size=n + 1, unique=True)).filter(lambda r: list(r) != rids),
        label="other rids",
    )
    m = len(other_rids)
    forged = AcceptResult(verify_id=v.verify_id, rids=list(other_rids), accepted=[0] * m, bonus=[0] * m)
    with pytest.raises(PreconditionError, match=rf"^commit: the accept result of verify #{v.verify_id} judged .*: a commit applies each row's result to that row$"):
        commit(v, forged)


def test_draft_commit_commits_the_accepted_position_and_merges_like_the_draft_extend() -> None:
    d = _draft()
    v = prepare_for_verify(d, proposed(d, [11, 12, 13, 21, 22, 23]))
    c = commit(v, accept(v, verified(v, frozen_i64([11, 99, 13, 14, 21, 22, 23, 24]))))
    dc = prepare_for_draft_commit(c, d)
    assert dc.draft_id == d.draft_id != v.verify_id
    assert dc.accept_pos.tolist() == [1, 3] and dc.k == K
    verify(dc)
    assert merge_batch(decode_batch([], [], [], []), dc) == merge_batch(decode_batch([], [], [], []), prepare_for_draft_extend(c))


def test_draft_commit_pairs_a_commit_with_the_draft_of_its_own_iteration() -> None:
    d = _draft()
    v = prepare_for_verify(d, proposed(d, [11, 12, 13, 21, 22, 23]))
    c = commit(v, accept(v, verified(v, frozen_i64([0] * 8))))
    other = prepare_for_draft(
        decode_batch([1, 2], [3, 5], [5, 9], [15, 19], tokens=[50, 90]), SpecContext(k=K, next_tokens=[7, 8], kv_locs=list(range(100, 108)))
    )
    with pytest.raises(
        PreconditionError, match=rf"the commit of verify #{v.verify_id} checked the proposals of draft #{d.draft_id}, not those of draft #{other.draft_id}"
    ):
        prepare_for_draft_commit(c, other)
    # a commit that names the other draft (forged) is still refused on its rows
    forged = attrs.evolve(c, draft_id=other.draft_id)
    with pytest.raises(PreconditionError, match=rf"the commit's slots \[3, 4\] are not those of draft #{other.draft_id} \(\[3, 5\]\)"):
        prepare_for_draft_commit(forged, other)


def test_spec_plans_have_no_tickets() -> None:
    for plan in (lower(_draft(), LowerContext()), lower(_verify(), LowerContext())):
        assert "tickets" not in {f.name for f in type(plan).__attrs_attrs__}


class _Scripted:
    """A spec model hook with scripted tokens: the draft proposes ``10*slot + j``; the target agrees
    on the first ``agree[slot]`` of them."""

    def __init__(self, agree: dict[int, int]) -> None:
        self.agree = agree
        self.commits: list[tuple[str, list[int]]] = []

    def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor:
        return blank_logits(extend, decode)

    def propose(self, plan: DraftPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, object]:
        return torch.tensor([[10 * int(s) + j for j in range(plan.batch.k)] for s in staged.slots]), "draft states"

    def verify(self, plan: VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, object]:
        k = plan.batch.k
        rows = []
        for s, window in zip(staged.slots.tolist(), staged.input_ids.tolist(), strict=True):
            a = self.agree[s]
            rows.append([window[j + 1] if j < a else 200 + s for j in range(k)] + [250])
        return torch.tensor(rows), "states"

    def commit(self, plan: CommitPlan | DraftCommitPlan, states: object, pool: MambaStatePool) -> None:
        assert states == ("states" if isinstance(plan, CommitPlan) else "draft states")
        self.commits.append((type(plan).__name__, plan.batch.accept_pos.tolist()))


def test_one_iteration_through_pipeline_and_executors() -> None:
    """The draft-extend variant: the draft catches up with a forward and never commits its states."""
    ledger = Ledger()
    target, draft = MambaStatePool(TARGET_POOL, LAYOUT, 8), MambaStatePool(DRAFT_POOL, LAYOUT, 8)
    model = _Scripted({1: 0, 2: 2})
    ex_t, ex_d = Executor(target, ledger, model), Executor(draft, ledger, model)
    pipe = Pipeline(ledger, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)), PassManager(verify_level=2))
    extend, plan = pipe.prefill([fresh(1, 1, [1, 2, 3], 1), fresh(2, 2, [4, 5], 4)])
    ex_t.execute(plan)
    ex_d.execute(plan)  # the draft pool's init ops run here, and only here
    running = pipe.merge(decode_batch([], [], [], [], tokens=[]), extend)
    consumed = ledger.num_consumed
    for it in range(3):
        d, dplan = pipe.draft(running, SpecContext(k=K, next_tokens=[60, 61], kv_locs=list(range(10 + 8 * it, 18 + 8 * it))))
        proposals = ex_d.run_draft(dplan)
        v, vplan = pipe.verify(d, proposals)
        verified = checked(vplan, ex_t.execute(vplan))
        result, c, cplan = pipe.commit(v, verified)
        assert result.accepted.tolist() == [0, 2]
        ex_t.execute(cplan)
        with pytest.raises(PlanExecutionError, match="already committed"):
            ex_t.execute(cplan)
        e, eplan = pipe.draft_extend(c)
        assert isinstance(eplan, DraftExtendPlan)
        ex_d.execute(eplan)
        running = pipe.merge(decode_batch([], [], [], [], tokens=[]), e)
    assert running.seq_lens.tolist() == [3 + 3, 2 + 3 * 3]
    assert ledger.num_consumed == consumed == 2  # one ticket per pool, at the prefill only
    assert ledger.counts(TARGET_POOL).clears == ledger.counts(DRAFT_POOL).clears == 2
    ledger.assert_drained()
    assert model.commits == [("CommitPlan", [0, 2])] * 3


def _prefilled(agree: dict[int, int]) -> tuple[Ledger, MambaStatePool, _Scripted, Executor[object], Executor[object], Pipeline, DecodeBatch]:
    """Two requests prefilled on a target and a draft pool sharing one ledger: the ledger, the draft
    pool, the scripted model, both executors, the pipeline and the running batch."""
    ledger = Ledger()
    target, draft = MambaStatePool(TARGET_POOL, LAYOUT, 8), MambaStatePool(DRAFT_POOL, LAYOUT, 8)
    model = _Scripted(agree)
    ex_t, ex_d = Executor[object](target, ledger, model), Executor[object](draft, ledger, model)
    pipe = Pipeline(ledger, LowerContext(pools=(TARGET_POOL, DRAFT_POOL)), PassManager(verify_level=2))
    extend, plan = pipe.prefill([fresh(1, 1, [1, 2, 3], 1), fresh(2, 2, [4, 5], 4)])
    ex_t.execute(plan)
    ex_d.execute(plan)
    return ledger, draft, model, ex_t, ex_d, pipe, pipe.merge(decode_batch([], [], [], []), extend)


def test_one_iteration_with_a_draft_commit() -> None:
    """The engine's variant: the draft commits the states its proposal kept, once, at the target's
    accepted positions; a replayed draft commit, or one of a draft a newer draft replaced, is refused."""
    ledger, draft, model, ex_t, ex_d, pipe, running = _prefilled({1: 0, 2: 2})
    for it in range(3):
        d, dplan = pipe.draft(running, SpecContext(k=K, next_tokens=[60, 61], kv_locs=list(range(10 + 8 * it, 18 + 8 * it))))
        proposals = ex_d.run_draft(dplan)
        v, vplan = pipe.verify(d, proposals)
        target = checked(vplan, ex_t.execute(vplan))
        _, c, cplan = pipe.commit(v, target)
        ex_t.execute(cplan)
        dc, dcplan = pipe.draft_commit(c, d)
        assert isinstance(dcplan, DraftCommitPlan) and dc.draft_id == d.draft_id
        assert dc.accept_pos.tolist() == c.accept_pos.tolist() == [0, 2]
        ex_d.execute(dcplan)
        with pytest.raises(PlanExecutionError, match=rf"draft #{d.draft_id}.*already committed"):
            ex_d.execute(dcplan)
        running = pipe.merge(decode_batch([], [], [], []), dc)
    assert running.seq_lens.tolist() == [3 + 3, 2 + 3 * 3]
    assert model.commits == [("CommitPlan", [0, 2]), ("DraftCommitPlan", [0, 2])] * 3
    # a newer draft drops an older draft's kept states: committing the older one is refused
    d1, dplan1 = pipe.draft(running, SpecContext(k=K, next_tokens=[60, 61], kv_locs=list(range(40, 48))))
    ex_d.execute(dplan1)
    d2, dplan2 = pipe.draft(running, SpecContext(k=K, next_tokens=[60, 61], kv_locs=list(range(40, 48))))
    ex_d.execute(dplan2)
    v1 = _verify_of(d1)
    stale = lower(prepare_for_draft_commit(commit(v1, accept(v1, verified(v1, frozen_i64([0] * 8)))), d1), LowerContext())
    before = draft.copy_buffer()
    with pytest.raises(PlanExecutionError, match=rf"draft #{d1.draft_id}.*dropped by a newer draft"):
        ex_d.execute(stale)
    assert torch.equal(draft.buffer, before)
    ledger.assert_drained()


def _verify_of(d: DraftBatch) -> VerifyBatch:
    return prepare_for_verify(d, proposed(d, [0] * (d.num_requests * d.k)))


def test_a_commit_never_takes_a_drafts_states_nor_a_draft_commit_a_verifys() -> None:
    ledger = Ledger()
    pool = MambaStatePool(TARGET_POOL, LAYOUT, 8)
    ex = Executor(pool, ledger, _Scripted({3: 1, 4: 1}))
    d = _draft()
    ex.execute(lower(d, LowerContext()))
    v = _verify_of(d)
    ex.execute(lower(v, LowerContext()))
    c = commit(v, accept(v, verified(v, frozen_i64([0] * 8))))
    forged = attrs.evolve(c, verify_id=VerifyId(d.draft_id))  # a commit naming the draft's id (forged: mypy refuses it unwrapped)
    before = pool.copy_buffer()
    with pytest.raises(PlanExecutionError, match=rf"#{d.draft_id} names a draft's states, which only a DraftCommitPlan commits"):
        ex.execute(lower(forged, LowerContext()))
    wrong = attrs.evolve(prepare_for_draft_commit(c, d), draft_id=v.verify_id)  # a draft commit naming the verify's id
    with pytest.raises(PlanExecutionError, match=rf"#{v.verify_id} names a verify's states, which only a CommitPlan commits"):
        ex.execute(lower(wrong, LowerContext()))
    assert torch.equal(pool.buffer, before)


def test_commit_of_a_verify_that_never_ran_is_refused() -> None:
    ledger = Ledger()
    pool = MambaStatePool(TARGET_POOL, LAYOUT, 8)
    ex = Executor(pool, ledger, _Scripted({3: 1, 4: 1}))
    v = _verify()
    c = commit(v, accept(v, verified(v, frozen_i64([11, 0, 0, 0, 21, 0, 0, 0]))))
    before = pool.copy_buffer()
    with pytest.raises(PlanExecutionError, match=rf"verify #{v.verify_id}.*never verified here"):
        ex.execute(lower(c, LowerContext()))
    assert torch.equal(pool.buffer, before)


def test_spec_plan_on_a_model_without_spec_phases_is_refused() -> None:
    ex = Executor(MambaStatePool(TARGET_POOL, LAYOUT, 8), Ledger())
    with pytest.raises(PlanExecutionError, match="needs a SpecModelHook"):
        ex.execute(lower(_draft(), LowerContext()))


def test_the_first_id_minted_in_an_epoch_runs_once() -> None:
    """Draft and verify ids count from 1 in each minting epoch (each process, and a child after a
    fork, mints in its own): an executor runs the draft whose id is the first of its epoch, and
    refuses it the second time."""
    _, _, _, _, ex_d, pipe, running = _prefilled({1: 0, 2: 2})
    d, _ = pipe.draft(running, SpecContext(k=K, next_tokens=[60, 61], kv_locs=list(range(10, 18))))
    first = attrs.evolve(d, draft_id=DraftId(serial_epoch(d.draft_id) + 1 << SERIAL_COUNTER_BITS | 1))  # another epoch's first id
    proposals = ex_d.run_draft(lower(first, LowerContext()))
    assert proposals.draft_id == first.draft_id and proposals.tokens.tolist() == [10, 11, 12, 20, 21, 22]
    with pytest.raises(PlanExecutionError, match=rf"^draft #{first.draft_id} already ran on pool 'draft' \(each draft runs once"):
        ex_d.run_draft(lower(first, LowerContext()))


def test_a_verify_of_tokens_that_are_not_the_drafts_proposals_cannot_reach_the_draft_pool() -> None:
    """The verify window must be the draft's proposals: tokens from anywhere (here: Proposals forged
    under the right draft id) verified on the target, then the draft commit, would commit the draft
    pool to states computed from other tokens, matching no sequence. The draft executor refuses that
    commit naming the draft, with its pool untouched; and the draft's proposals, once verified, are
    not verified again, even the genuine ones."""
    ledger, draft, model, ex_t, ex_d, pipe, running = _prefilled({1: 1, 2: 2})
    d, dplan = pipe.draft(running, SpecContext(k=K, next_tokens=[60, 61], kv_locs=list(range(10, 18))))
    real = ex_d.run_draft(dplan)
    assert real.draft_id == d.draft_id and real.tokens.tolist() == [10, 11, 12, 20, 21, 22]
    forged = proposed(d, [10, 99, 12, 20, 21, 22])  # not what the draft proposed
    v, vplan = pipe.verify(d, forged)
    verified = checked(vplan, ex_t.execute(vplan))
    _, c, cplan = pipe.commit(v, verified)
    ex_t.execute(cplan)
    _, dcplan = pipe.draft_commit(c, d)
    before = draft.copy_buffer()
    with pytest.raises(
        PlanExecutionError, match=rf"commit of draft #{d.draft_id} after a verify of tokens \[10, 99, 12, 20, 21, 22\]; draft #{d.draft_id} proposed \[10, 11, 12, 20, 21, 22\]"
    ):
        ex_d.execute(dcplan)
    assert torch.equal(draft.buffer, before)
    assert model.commits == [("CommitPlan", [1, 2])]  # the target's only: nothing reached the draft pool
    # the draft's proposals were verified once already: verifying the genuine ones now is refused too
    v2, vplan2 = pipe.verify(d, real)
    with pytest.raises(PlanExecutionError, match=rf"verify #{v2.verify_id} checks the proposals of draft #{d.draft_id}, which a verify on pool 'target' already checked"):
        ex_t.execute(vplan2)
    ledger.assert_drained()
