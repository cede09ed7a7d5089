"""The engine's paths for backends that run beside it (``overlap``), run in this process in a second.

``InlineBackend`` is a ``backend.boundary.Backend`` that runs each plan on an in-process executor
when it is submitted but hands the result (or the error) back only at ``wait``, as a backend in
another process does. Swapped in for an engine's backends (``InlineBackends``), the engine takes the
paths it takes with real processes: commits of a speculative iteration deferred to the next step,
and (``k = 0``) pipelined forwards whose inputs are named by the forward before. Real processes are
covered by ``tests/compiler/engine/test_overlap.py``; these check the engine's side of the protocol, fast:

- the outputs equal those of the same engine with in-process executors (whose greedy parity with
  the from-scratch reference the serving tests check): pipelined decodes, chunked and mixed
  prefills, a stop token, the speculative iteration with deferred commits;
- a deferred commit that failed is reported at the next step: its requests are aborted, the step
  says ``FAILED``, and serving goes on for the others.
"""

from __future__ import annotations

from typing import Any

from backend.boundary import Pending
from backend.executor import Executor
from backend.ledger import RankLedgers
from compiler.engine import Engine, StepKind
from ir.ids import PoolId, RequestId
from ir.nodes import Plan
from ir.results import Result
from ir.spec import CommitPlan
from tests.helpers import engine, greedy_reference


class InlineBackend:
    """Runs each plan at ``submit`` on ``inner``; ``wait`` returns or raises what it gave.
    ``fail`` names plan types whose next ``wait`` raises instead (the other process failed it)."""

    def __init__(self, inner: Executor[Any]) -> None:
        self.inner = inner
        self.fail: set[type] = set()
        self.log: list[str] = []
        self.cancelled: list[str] = []
        self.settled = 0

    @property
    def pool_id(self) -> PoolId:
        return self.inner.pool_id

    @property
    def usable(self) -> bool:
        return True

    def submit(self, plan: Plan) -> Pending:
        p = Pending(plan)
        self.log.append(f"submit {type(plan).__name__}")
        try:
            p.result = self.inner.execute(plan)
        except Exception as exc:  # noqa: BLE001 - handed back at wait, as a process does
            p.error = exc
        if type(plan) in self.fail:
            self.fail.discard(type(plan))
            p.error = RuntimeError(f"the other process failed {type(plan).__name__}")
        return p  # (not done: it is read back at wait)

    def wait(self, pending: Pending) -> Result:
        self.log.append(f"wait {type(pending.plan).__name__}")
        pending.done = True
        return pending.outcome()

    def forget_verifies(self) -> None:
        self.inner.forget_verifies()


class InlineBackends:
    """The engine's in-process backends, each behind an ``InlineBackend``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._target = InlineBackend(inner.target)
        self._draft = InlineBackend(inner.draft) if inner.draft is not None else None

    @property
    def target(self) -> InlineBackend:
        return self._target

    @property
    def draft(self) -> InlineBackend | None:
        return self._draft

    @property
    def concurrent(self) -> bool:
        return True

    def _all(self) -> list[InlineBackend]:
        return [self._target] + ([self._draft] if self._draft is not None else [])

    def ready(self) -> None:
        pass

    def settle(self) -> None:
        for b in self._all():
            b.settled += 1  # (every plan here has run already)

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        self.inner.share_prefix(src, dst, length)

    def cancel_outstanding(self, reason: str) -> None:
        for b in self._all():
            b.cancelled.append(reason)  # (one ledger here: the engine cancelled in it already)

    def busy_intervals(self) -> list[tuple[float, float]]:
        return []

    def waited_seconds(self) -> float:
        return 0.0

    def close(self) -> RankLedgers | None:
        return self.inner.close()  # type: ignore[no-any-return]  # the engine's own backends


def _inline(eng: Engine) -> tuple[InlineBackend, InlineBackend | None]:
    backends = InlineBackends(eng.backends)
    eng.backends = eng.forwards.backends = backends
    eng.target = eng.forwards.target = backends.target
    eng.draft = eng.forwards.draft = backends.draft
    return backends.target, backends.draft


PROMPTS = [list(range(3, 12)), [5, 9, 2], list(range(20, 33)), [7, 7, 8, 1]]


def _served(eng: Engine, requests: dict[int, dict[str, Any]]) -> dict[RequestId, list[int]]:
    for i, kw in requests.items():
        eng.admit(RequestId(i), PROMPTS[i], **kw)
    eng.run_until_done(max_steps=200)
    eng.sync()
    return dict(eng.outputs)


def _plain(requests: dict[int, dict[str, Any]]) -> dict[RequestId, list[int]]:
    """What the engine serves with in-process executors, not pipelined."""
    return _served(engine(0), requests)


def test_pipelined_forwards_emit_the_greedy_tokens() -> None:
    """``k = 0`` one step behind: each forward is sent before the one in flight is read back; every
    token is read back (landed) once, in order, including the last forward's."""
    # the short prompt first: its decodes run beside the long one's chunks (mixed forwards)
    requests: dict[int, dict[str, Any]] = {1: {"max_new_tokens": 4}, 0: {"max_new_tokens": 3}}
    expected = _plain(requests)
    requests[1]["stop"] = expected[RequestId(1)][1]  # request 1 ends at its second token
    expected[RequestId(1)] = expected[RequestId(1)][:2]
    eng = engine(0, chunk_size=4, token_budget=4)
    target, _ = _inline(eng)
    eng.forwards.pipelined = True
    assert _served(eng, requests) == expected
    assert "submit DecodePlan" in target.log and "submit MixedPlan" in target.log
    assert target.log.count("wait DecodePlan") + target.log.count("wait MixedPlan") + target.log.count("wait ExtendPlan") == sum(
        1 for e in target.log if e.startswith("submit")
    )  # every forward sent is read back
    eng.ledger.assert_drained()
    assert eng.slots.num_live == 0 and eng.kv.num_live == 0
    eng.close()


def test_pipelined_forwards_overlap_and_none_runs_past_the_last_token() -> None:
    """Pipelining sends each forward before the one in flight is read back (two in flight at once),
    and leaves out a row whose last token (by length) is in flight: n tokens cost one prefill and
    n - 1 decodes, as without pipelining, and every forward sent is read back."""
    for n in (1, 2, 5):
        eng = engine(0)
        target, _ = _inline(eng)
        eng.forwards.pipelined = True
        assert _served(eng, {1: {"max_new_tokens": n}}) == _plain({1: {"max_new_tokens": n}})
        overlapped = ["submit DecodePlan", "wait ExtendPlan"] + ["submit DecodePlan", "wait DecodePlan"] * (n - 2) + ["wait DecodePlan"]
        assert target.log == ["submit ExtendPlan"] + (overlapped if n > 1 else ["wait ExtendPlan"])
        assert eng.stats.decodes == n - 1
        eng.close()


def test_speculation_with_deferred_commits_emits_the_greedy_tokens() -> None:
    requests: dict[int, dict[str, Any]] = {0: {"max_new_tokens": 4}, 1: {"max_new_tokens": 3}}
    eng = engine(2)
    target, draft = _inline(eng)
    assert draft is not None
    assert _served(eng, requests) == _plain(requests)
    for ex, commit in ((target, "CommitPlan"), (draft, "DraftCommitPlan")):
        assert ex.log.count(f"submit {commit}") == ex.log.count(f"wait {commit}") > 0  # each deferred commit is waited for
    eng.ledger.assert_drained()
    eng.close()


def test_a_deferred_commit_that_failed_aborts_its_requests_at_the_next_step() -> None:
    eng = engine(2)
    target, draft = _inline(eng)
    assert draft is not None
    eng.admit(RequestId(0), PROMPTS[0], max_new_tokens=8)
    assert eng.step().kind is StepKind.EXTEND
    target.fail.add(CommitPlan)
    assert eng.step().kind is StepKind.SPEC  # the commit is sent; its reply is read at the next step
    eng.admit(RequestId(1), PROMPTS[1], max_new_tokens=2)
    report = eng.step()
    assert report.kind is StepKind.FAILED and report.aborted == (RequestId(0),)
    assert eng.aborted_by_failure == {RequestId(0)} and eng.stats.failed_steps == 1
    assert eng.first_failure is not None and "the other process failed CommitPlan" in eng.first_failure
    # each process is drained (a plan sent beside the failed one settles its claim), then told to
    # cancel, in its own ledger, the tickets of the forward that failed
    assert target.settled >= 1 and draft.settled >= 1
    assert target.cancelled == draft.cancelled == ["aborted: its forward failed (RuntimeError: the other process failed CommitPlan)"]
    eng.run_until_done(max_steps=50)  # serving goes on
    eng.sync()
    assert eng.outputs[RequestId(1)] == _plain({1: {"max_new_tokens": 2}})[RequestId(1)]
    eng.close()


def test_a_pipelined_mixed_forward_gives_each_decoding_row_its_own_token() -> None:
    """A pipelined mixed forward beside two running requests: the prefill chunk's rows come first in
    its logits, then one row per decoding request, in order. Each request's tokens are the greedy
    reference's, so none read another's row."""
    eng = engine(0, chunk_size=4, token_budget=8)
    target, _ = _inline(eng)
    eng.forwards.pipelined = True
    short = {1: 6, 3: 6}
    for i, n in short.items():
        eng.admit(RequestId(i), PROMPTS[i], max_new_tokens=n)
    kinds = [eng.step().kind for _ in range(2)]
    eng.admit(RequestId(2), PROMPTS[2], max_new_tokens=2)  # 13 tokens: chunks beside the two decodes
    kinds += [eng.step().kind for _ in range(2)]
    assert StepKind.MIXED in kinds[2:]
    eng.run_until_done(max_steps=100)
    eng.sync()
    for i, n in {**short, 2: 2}.items():
        assert eng.outputs[RequestId(i)] == greedy_reference(PROMPTS[i], n), i
    eng.ledger.assert_drained()
    eng.close()
