"""Step sequences (``compiler.testing.strategies.step_sequences``) run through a ``Pipeline``
(``compiler.testing.runner``) on the fake backend (``compiler.testing.fakes``).

- On executors over small pools (one pool, or a target and a draft pool): every plan verifies, every
  ticket is consumed exactly once on each pool by the ledger's books (drained, minted == consumed;
  the fake model keeps no recurrent state to compare: states are compared in
  ``tests/scenarios/`` and ``tests/test_fuzz_stack.py``), the
  running batch holds exactly the requests the steps left running, with the context lengths the
  steps imply, and a speculative iteration accepts what the fake model's rules say it must.
- Without a backend: the draws stand in for the proposals and target tokens, and
  ``consume_tickets`` drains the ledger.
- Every kind of step, and every way a request starts (fresh, COW of a snapshot, continued chunk),
  is drawn.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, find, given, settings
from typeguard import suppress_type_checks

from backend.hybrid.config import MAX_VOCAB as HYBRID_MAX_VOCAB
from backend.ledger import Ledger
from backend.pool import MAX_POOL_SLOTS
from compiler.steps import Pipeline
from compiler.testing import pytest_plugin as plugin
from compiler.testing.fakes import MAX_CAPACITY, MAX_VOCAB, FakeBackend, FakeModel, small_pool
from compiler.testing.runner import consume_tickets, run_steps
from compiler.testing.strategies import Decode, Finish, Mixed, Prefill, Speculate, StepSequence, head_commit_plans, step_sequences
from ir.errors import PlanExecutionError
from ir.ids import MambaSlot, PoolId, RequestId
from ir.nodes import Plan
from ir.plan import ExtendPlan, MixedPlan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.results import Ran, Result
from ir.spec import CommitPlan, VerifyPlan
from ir.verify import verify
from passes.lower import LowerContext

FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POOLS = [("target",), ("target", "draft")]


def _expected_running(sequence: StepSequence, accepted: list[list[int]]) -> list[tuple[int, int, int]]:
    """(rid, slot, context length) of each running row after ``sequence``, computed from the steps
    alone (``accepted``: each speculative iteration's accepted drafts per row, in order)."""
    running: list[tuple[int, int, int]] = []
    spec = iter(accepted)
    for step in sequence:
        match step:
            case Prefill(requests=requests) | Mixed(requests=requests):
                if isinstance(step, Mixed):
                    running = [(r, s, n + 1) for r, s, n in running]
                running += [(int(q.rid), int(q.slot), q.prefix_len + q.input_ids.shape[0]) for q in requests if not q.more_chunks]
            case Decode():
                running = [(r, s, n + 1) for r, s, n in running]
            case Finish(rids=rids):
                running = [row for row in running if row[0] not in {int(r) for r in rids}]
            case Speculate():
                running = [(r, s, n + 1 + a) for (r, s, n), a in zip(running, next(spec), strict=True)]
    return running


def _accepted(plans: list[Plan]) -> list[list[int]]:
    return [p.batch.accept_pos.tolist() for p in plans if isinstance(p, CommitPlan)]


@pytest.mark.parametrize("pools", POOLS, ids="+".join)
def test_a_step_sequence_runs_on_executors_and_drains_the_ledger(pools: tuple[str, ...]) -> None:
    @FAST
    @given(step_sequences())
    def check(sequence: StepSequence) -> None:
        backend = FakeBackend(pools=pools, capacity=sequence.capacity)
        pipeline = Pipeline(backend.ledger, LowerContext(pools=pools))
        trace = run_steps(pipeline, sequence, execute=backend.execute)
        backend.ledger.assert_drained()
        for pool in pools:
            assert backend.ledger.minted(PoolId(pool)) == backend.ledger.counts(PoolId(pool))
        assert len(trace.results) == len(trace.plans)
        for plan in trace.plans:
            verify(plan)
        running = [(int(r), int(s), int(n)) for r, s, n in zip(trace.running.rids, trace.running.slots, trace.running.seq_lens, strict=True)]
        assert running == _expected_running(sequence, _accepted(trace.plans))

    check()


@FAST
@given(step_sequences(min_steps=3, speculative=True))
def test_a_speculative_iteration_accepts_what_the_fake_models_rules_say(sequence: StepSequence) -> None:
    assume(any(isinstance(s, Speculate) for s in sequence))
    backend = FakeBackend(capacity=sequence.capacity)
    model = backend.model
    trace = run_steps(Pipeline(backend.ledger), sequence, execute=backend.execute)
    for plan in trace.plans:
        if isinstance(plan, CommitPlan):
            b = plan.batch
            for row, accepted in zip(b.input_ids.reshape(b.num_requests, b.k + 1).tolist(), b.accept_pos.tolist(), strict=True):
                m = 0
                while m < b.k and row[m + 1] == model.next_token(row[m]):
                    m += 1
                assert accepted == m
                assert all(row[j + 1] == model.draft_token(row[j]) for j in range(b.k))  # the proposals are the fake draft's


@FAST
@given(step_sequences())
def test_without_a_backend_the_draws_stand_in_and_consume_tickets_drains_the_ledger(sequence: StepSequence) -> None:
    ledger = Ledger()
    trace = run_steps(Pipeline(ledger, LowerContext(pools=("target", "draft"))), sequence)
    assert trace.results == []
    tickets = [t for p in trace.plans for part in ([p.extend] if isinstance(p, MixedPlan) else [p]) if isinstance(part, ExtendPlan) for t in part.all_tickets()]
    assert len(ledger.outstanding()) == len(tickets)
    assert consume_tickets(ledger, trace.plans) == len(tickets)
    ledger.assert_drained()
    verifies = iter(p for p in trace.plans if isinstance(p, VerifyPlan))
    for step in sequence:
        if isinstance(step, Speculate):
            b = next(verifies).batch
            window = b.input_ids.reshape(b.num_requests, b.k + 1)
            assert window[:, 0].tolist() == list(step.next_tokens)
            assert window[:, 1:].reshape(-1).tolist() == list(step.proposals)
    assert next(verifies, None) is None


GENERATE = settings(phases=[Phase.generate], max_examples=500, database=None, suppress_health_check=list(HealthCheck))


def _has(step_type: type, test: Any = lambda s: True) -> Any:
    return lambda seq: any(isinstance(s, step_type) and test(s) for s in seq)


def _requests(seq: StepSequence) -> list[Any]:
    return [r for s in seq for r in (s.requests if isinstance(s, (Prefill, Mixed)) else ())]


@pytest.mark.parametrize(
    ("what", "condition"),
    [
        ("a mixed forward", _has(Mixed)),
        ("a decode", _has(Decode)),
        ("finished requests", _has(Finish)),
        ("a speculative iteration with a draft commit", _has(Speculate, lambda s: not s.draft_extend and s.k > 1)),
        ("a speculative iteration with a draft extend", _has(Speculate, lambda s: s.draft_extend)),
        ("a COW of a snapshot", lambda seq: any(isinstance(r.intent, CopyFrom) for r in _requests(seq))),
        ("a continued chunk", lambda seq: any(isinstance(r.intent, Continue) for r in _requests(seq))),
        ("a forward of several requests", lambda seq: any(len(s.requests) >= 3 for s in seq if isinstance(s, Prefill))),
    ],
)
def test_every_kind_of_step_is_drawn(what: str, condition: Any) -> None:
    assert condition(find(step_sequences(), condition, settings=GENERATE)), what


def test_a_sequence_can_leave_out_speculation_chunking_and_the_prefix_cache() -> None:
    @FAST
    @given(step_sequences(speculative=False, chunked=False, prefix_cache=False))
    def check(sequence: StepSequence) -> None:
        assert not any(isinstance(s, Speculate) for s in sequence)
        for r in _requests(sequence):
            assert not r.more_chunks and r.snapshot_to is None and not isinstance(r.intent, (CopyFrom, Continue))

    check()


ONE = AdmittedRequest(rid=RequestId(0), slot=MambaSlot(1), input_ids=[3], kv_locs=[0], intent=Clear())


def test_run_steps_names_a_result_of_the_wrong_kind() -> None:
    sequence = StepSequence(
        steps=(Prefill(requests=(ONE,)), Speculate(k=1, next_tokens=(1,), kv_locs=(100, 101), proposals=(2,), target_tokens=(2, 3), draft_extend=False)),
        capacity=8, vocab=16,
    )

    def ran(plan: Plan) -> Result:
        return Ran(rids=plan.rids)

    with pytest.raises(TypeError, match=r"^run_steps: execute gave a Ran for a DraftPlan, not its Proposals$"):
        run_steps(Pipeline(Ledger()), sequence, execute=ran)


def test_the_runner_refuses_arguments_of_the_wrong_kind_naming_them() -> None:
    ledger = Ledger()
    pipeline = Pipeline(ledger)
    _, plan = Pipeline(ledger).prefill([ONE])
    trace = run_steps(pipeline, [Prefill(requests=(ONE,))])
    with suppress_type_checks():  # (as an untyped caller calls them)
        with pytest.raises(TypeError, match=r"^run_steps: sequence\[1\] must be a step \(Prefill, Mixed, Decode, Finish, Speculate\), got "
                           r"AdmittedRequest\(rid=0, .* \(AdmittedRequest\) \(requests are prefilled by a step: Prefill\(requests=\[\.\.\.\]\)\)$"):
            run_steps(Pipeline(Ledger()), [Prefill(requests=(ONE,)), ONE])  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"^run_steps: pipeline must be a compiler\.steps\.Pipeline, got .* \(Ledger\)$"):
            run_steps(ledger, [])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^run_steps: sequence must be a StepSequence or an iterable of steps, got 3 \(int\)$"):
            run_steps(pipeline, 3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^run_steps: execute must be a function of a plan \(or None\), got 'x' \(str\)$"):
            run_steps(pipeline, [], execute="x")  # type: ignore[arg-type]
        outstanding = len(ledger.outstanding())
        with pytest.raises(TypeError, match=r"^consume_tickets: plans must be the plans, got a Trace \(pass trace\.plans\)$"):
            consume_tickets(ledger, trace)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^consume_tickets: plans\[1\] must be a plan, got None \(NoneType\)$"):
            consume_tickets(ledger, [plan, None])  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"^consume_tickets: ledger must be a backend\.ledger\.Ledger, got .* \(Pipeline\)$"):
            consume_tickets(pipeline, [plan])  # type: ignore[arg-type]
        assert len(ledger.outstanding()) == outstanding  # (refused before any ticket was consumed)
        with pytest.raises(TypeError, match=r"^verify: node must be an IR batch or plan, got 123 \(int\)$"):
            verify(123)  # type: ignore[arg-type]
    assert consume_tickets(ledger, [plan, *trace.plans]) == outstanding
    ledger.assert_drained()


def test_the_fake_model_is_deterministic_and_checks_its_vocabulary() -> None:
    model = FakeModel(vocab=16)
    assert [model.next_token(t) for t in range(6)] == [1, 4, 7, 10, 13, 0]
    assert [model.draft_token(t) for t in range(6)] == [1, 5, 7, 10, 13, 1]  # 4 and 0 are multiples of 4: the draft errs there
    logits = model._logits(torch.tensor([[0, 1], [2, 3]]))
    assert logits.shape == (2, 2, 16) and logits.argmax(-1).tolist() == [[1, 4], [7, 10]]
    with suppress_type_checks():
        for bad, error in ((1, ValueError), (MAX_VOCAB + 1, ValueError), (True, TypeError), ("16", TypeError)):
            with pytest.raises(error, match=r"^FakeModel: vocab must be"):
                FakeModel(vocab=bad)  # type: ignore[arg-type]
    assert FakeModel(vocab=MAX_VOCAB).vocab == MAX_VOCAB == HYBRID_MAX_VOCAB  # (a model's own bound)
    with pytest.raises(ValueError, match=rf"^FakeModel: vocab must be in \[2, {MAX_VOCAB}\], got {2**40}$"):
        FakeModel(vocab=2**40)  # (refused before any logits are allocated)


def test_the_fake_backend_routes_plans_and_refuses_what_it_cannot_run() -> None:
    backend = FakeBackend(pools=("target", "draft"), capacity=4)
    assert list(backend.executors) == ["target", "draft"] and backend.target is not backend.draft
    assert backend.target.pool.capacity == 4 and small_pool("x", 2).capacity == 2
    head = find(head_commit_plans(), lambda p: True, settings=GENERATE)
    with pytest.raises(ValueError, match=r"^FakeBackend\.execute: a HeadCommitPlan needs a draft head's executor"):
        backend.execute(head)
    with suppress_type_checks():
        with pytest.raises(TypeError, match=r"^FakeBackend: pools must be a sequence of pool names"):
            FakeBackend(pools="target")
        with pytest.raises(ValueError, match=r"^FakeBackend: pools must be distinct"):
            FakeBackend(pools=("a", "a"))
    for bad in (0, MAX_CAPACITY + 1):
        with pytest.raises(ValueError, match=rf"^FakeBackend: capacity must be in \[1, {MAX_CAPACITY}\], got {bad}$"):
            FakeBackend(capacity=bad)
        with pytest.raises(ValueError, match=rf"^small_pool: capacity must be in \[1, {MAX_CAPACITY}\], got {bad}$"):
            small_pool("x", bad)
    assert MAX_CAPACITY == MAX_POOL_SLOTS and (MAX_CAPACITY, MAX_VOCAB) == (plugin.MAX_CAPACITY, plugin.MAX_VOCAB)
    # a prefill lowered for other pools is refused by the executors before anything is written
    before = backend.target.pool.buffer.clone()
    _, plan = Pipeline(Ledger(), LowerContext(pools=("elsewhere",))).prefill([ONE])
    with pytest.raises(PlanExecutionError, match="elsewhere"):
        backend.execute(plan)
    assert torch.equal(backend.target.pool.buffer, before)
