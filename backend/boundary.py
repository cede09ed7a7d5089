"""The one boundary between an engine and whatever runs its plans.

An engine holds ``Backends``: one ``Backend`` per state pool (the target's, and with a draft model
the draft's) and what spans them. It cannot tell how they run: in this process
(``backend.local.InProcess``), each pool's executor in its own process (``backend.remote.Processes``)
or on every rank of a tensor-parallel group (``backend.tp.serve.TensorParallel``). Whoever builds the
engine (the command line, the serving layer, a test) picks a ``Transport``; the engine calls its
``open`` once and talks to what it returns through these protocols only.

Per plan: ``submit`` starts it and ``wait`` gives back its ``ir.results`` result, or raises what
failed. A plan refused on this side (a ``BatchcError``: replayed, forged, unfit) is raised by
``submit``, with nothing run; anything else is raised by ``wait``. An in-process backend runs the
plan within ``submit``; another may return at once and run it while the caller goes on. Plans on one
``Backend`` run in the order they were submitted. ``checked`` (the engine's runner calls it on every
result) refuses a result of the wrong kind or for other rows, so a backend that answers a verify
with a prefill's tokens is a ``PlanExecutionError``, never a wrong token.

Failures that are the transport's own reach the engine as this module's errors, whatever the
transport: ``BackendGone`` (the backend can run no more plans: its process died or was closed; a
fault, like a forward that raised), ``BackendBroken`` (a failure that breaks every backend of the
engine for good, such as a tensor-parallel rank that failed: never retried, the engine stops) and
``ForwardFailed`` (a forward failed where it ran, and its error came back by kind).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, assert_never, overload, runtime_checkable

from backend.allocator import SlotAllocator
from backend.ledger import Ledger, RankLedgers
from backend.model import ServedModel
from ir.errors import BatchcError, PlanExecutionError
from ir.head import HeadCommitPlan, HeadExtendPlan
from ir.hidden import asked_hidden
from ir.ids import PoolId
from ir.linear import consumes, keeps_linear
from ir.nodes import Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.results import Ran, Result, Sampled, Verified
from ir.spec import CommitPlan, DraftCommitPlan, DraftExtendPlan, DraftPlan, Proposals, VerifyPlan

__all__ = [
    "Backend", "BackendBroken", "BackendError", "BackendGone", "Backends", "ForwardFailed", "InProcessGroup", "Pending", "QuietPlan", "SampledPlan",
    "Transport", "checked", "checked_sampled", "result_type", "run_now",
]


class BackendError(RuntimeError):
    """A transport's own failure (a refused plan is a ``BatchcError`` instead)."""


class BackendGone(BackendError):
    """The backend can run no more plans (its process died or was closed); says how it ended."""


class BackendBroken(BackendError):
    """A failure that breaks every backend of the engine for good (a tensor-parallel rank failed):
    never retried; the engine stops."""


class ForwardFailed(BackendError):
    """A forward failed where it ran (another process); ``kind`` is the exception's class name there."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@keeps_linear  # a plan in flight, until ``wait`` reads it back
class Pending:
    """A submitted plan: its result or error once ``done``."""

    def __init__(self, plan: Plan | None) -> None:
        self.plan = plan
        self.done = False
        self.result: Result | None = None
        self.error: BaseException | None = None

    def outcome(self) -> Result:
        """The result of a plan that is ``done``, or its error raised."""
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise PlanExecutionError(f"{type(self.plan).__name__} read back before it ran")
        return self.result


class Backend(Protocol):
    """How one state pool's plans run."""

    @property
    def pool_id(self) -> PoolId:
        """The pool this backend's plans run on."""
        ...

    @consumes
    def submit(self, plan: Plan) -> Pending:
        """Start ``plan`` (see the module: a ``BatchcError`` here means nothing ran). Consumes the
        plan's tickets on this backend: submitting it twice is a ``linear-reuse`` error."""
        ...

    def wait(self, pending: Pending) -> Result:
        """The result of a plan this backend was given, or what failed raised."""
        ...

    def forget_verifies(self) -> None:
        """Drop the states verifies and drafts left for commits that will never come (their
        requests were aborted)."""
        ...

    @property
    def usable(self) -> bool:
        """False once the backend can run nothing more (closed, or its process gone)."""
        ...


def run_now(execute: Callable[[Plan], Result], plan: Plan, *, raised: tuple[type[BaseException], ...] = ()) -> Pending:
    """``Backend.submit`` for a backend that runs a plan on the caller's thread: ``execute(plan)``
    now; a refusal (``BatchcError``, or one of ``raised``) is raised here, any other failure kept
    for ``wait``."""
    never: tuple[type[BaseException], ...] = (BatchcError, *raised)
    pending = Pending(plan)
    try:
        pending.result = execute(plan)
    except never:
        raise
    except Exception as exc:  # noqa: BLE001 - a fault: the caller reads it at ``wait``
        pending.error = exc
    pending.done = True
    return pending


class Backends(Protocol):
    """What a ``Transport`` opens for one engine: a ``Backend`` per pool and what spans them."""

    @property
    def target(self) -> Backend:
        """The target model's backend (its pool's plans: prefills, decodes, verifies, commits)."""
        ...

    @property
    def draft(self) -> Backend | None:
        """The draft model's backend, or ``None`` when the engine serves no draft."""
        ...

    @property
    def concurrent(self) -> bool:
        """Plans run beside the caller (in other processes): a caller may build the next plan while
        one runs."""
        ...

    def ready(self) -> None:
        """Wait until every backend can take plans (a process has built its pool)."""
        ...

    def settle(self) -> None:
        """Read back every plan in flight (their errors stay on their ``Pending``)."""
        ...

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Every model's token table: slot ``dst``'s first ``length`` KV locations become ``src``'s."""
        ...

    def cancel_outstanding(self, reason: str) -> None:
        """Cancel the tickets still outstanding in the backends' own ledgers (other processes' or
        ranks'); the engine cancels those of its own ledger."""
        ...

    def busy_intervals(self) -> list[tuple[float, float]]:
        """Every interval (``time.perf_counter`` seconds) during which a backend in another process
        ran a plan; empty in process."""
        ...

    def waited_seconds(self) -> float:
        """Seconds the caller spent blocked on other processes' replies."""
        ...

    def close(self) -> RankLedgers | None:
        """Stop what the transport started; a group's every rank's ledger counts (else None)."""
        ...


class InProcessGroup:
    """What ``Backends`` in this process share: each plan runs within ``submit``, so there is
    nothing to wait for, settle or time; ``backends[0]`` is the target's, ``backends[1]`` (if any)
    the draft's."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self._backends = list(backends)

    @property
    def target(self) -> Backend:
        """The first backend given: the target's."""
        return self._backends[0]

    @property
    def draft(self) -> Backend | None:
        """The second backend given, the draft's, or ``None`` when only one was given."""
        return self._backends[1] if len(self._backends) > 1 else None

    @property
    def concurrent(self) -> bool:
        """Always False: each plan runs within ``submit``, on the caller's thread."""
        return False

    def ready(self) -> None:
        """Nothing to wait for: the pools are built when the backends are."""
        pass

    def settle(self) -> None:
        """Nothing to settle: no plan is ever in flight after ``submit`` returns."""
        pass

    def busy_intervals(self) -> list[tuple[float, float]]:
        """Always empty: no backend runs in another process."""
        return []

    def waited_seconds(self) -> float:
        """Always 0.0: the caller never waits on another process."""
        return 0.0


@runtime_checkable
class Transport(Protocol):
    """A way of running an engine's plans; ``open`` builds one ``Backends`` per engine."""

    def refusal(self, models: Mapping[PoolId, ServedModel[Any]], *, retries: int) -> str | None:
        """Why this transport cannot serve ``models`` with ``retries`` (one line), or None; asked
        before anything is allocated."""
        ...

    def open(
        self, models: Mapping[PoolId, ServedModel[Any]], *, ledger: Ledger, slots: SlotAllocator, capacity: int, kv_capacity: int,
        max_len: int, retries: int, penalties: bool = False,
    ) -> Backends:
        """One backend per pool of ``models`` (the engine's ``ledger`` and slot allocator; with
        ``retries`` each forward is one transactional unit that can run again; with ``penalties``
        the target's executor keeps token counts, ``backend.counts``, where it runs)."""
        ...


SampledPlan: TypeAlias = ExtendPlan | DecodePlan | MixedPlan | DraftExtendPlan
"""The plans whose result is ``Sampled``."""
QuietPlan: TypeAlias = CommitPlan | DraftCommitPlan | IdlePlan | HeadExtendPlan | HeadCommitPlan
"""The plans whose result is ``Ran``."""


def result_type(plan: Plan) -> type[Result]:
    """The kind of result ``plan`` gives back."""
    match plan:
        case ExtendPlan() | DecodePlan() | MixedPlan() | DraftExtendPlan():
            return Sampled
        case DraftPlan():
            return Proposals
        case VerifyPlan():
            return Verified
        case CommitPlan() | DraftCommitPlan() | IdlePlan() | HeadExtendPlan() | HeadCommitPlan():
            return Ran
        case _:
            assert_never(plan)


@overload
def checked(plan: SampledPlan, result: Result) -> Sampled: ...
@overload
def checked(plan: DraftPlan, result: Result) -> Proposals: ...
@overload
def checked(plan: VerifyPlan, result: Result) -> Verified: ...
@overload
def checked(plan: QuietPlan, result: Result) -> Ran: ...
@overload
def checked(plan: Plan, result: Result) -> Result: ...
def checked(plan: Plan, result: Result) -> Result:
    """``result`` if it is what ``plan`` gives back (its kind, its rows in the plan's order; a
    draft's proposals and a verify's target tokens are its own; the hidden-state handle the plan asked for, ``keep_hidden``, and
    none otherwise: ``ir.hidden.asked_hidden``), else ``PlanExecutionError`` saying what came back."""
    expected = result_type(plan)
    name = type(plan).__name__
    if type(result) is not expected:
        raise PlanExecutionError(f"{name} came back as {type(result).__name__}, not {expected.__name__}")
    if isinstance(result, Proposals) and isinstance(plan, DraftPlan):
        if result.draft_id != plan.batch.draft_id or result.k != plan.batch.k or result.tokens.shape[0] != plan.batch.num_requests * plan.batch.k:
            raise PlanExecutionError(
                f"draft #{plan.batch.draft_id} ({plan.batch.num_requests} rows, k={plan.batch.k}) came back as the proposals of "
                f"draft #{result.draft_id} ({result.tokens.shape[0]} tokens, k={result.k})"
            )
        return result
    rids = plan.rids
    if not isinstance(result, Proposals) and result.rids.tobytes() != rids.tobytes():
        raise PlanExecutionError(f"{name} of requests {rids.tolist()[:16]} came back for requests {result.rids.tolist()[:16]}")
    if isinstance(result, Verified) and isinstance(plan, VerifyPlan) and (result.k != plan.batch.k or result.verify_id != plan.batch.verify_id):
        raise PlanExecutionError(
            f"verify #{plan.batch.verify_id} (k={plan.batch.k}) came back as the target tokens of verify #{result.verify_id} (k={result.k})"
        )
    if isinstance(result, (Sampled, Verified)):
        asked = asked_hidden(plan) if isinstance(plan, (ExtendPlan, MixedPlan, VerifyPlan)) else None
        got = result.hidden
        if got is not asked and got != asked:
            raise PlanExecutionError(
                f"{name} asked for {asked.described() if asked is not None else 'no hidden states'}, and came back with "
                f"{got.described() if got is not None else 'none'}"
            )
    return result


def checked_sampled(plan: Plan, result: Result) -> Sampled:
    """``checked`` for a plan known only as a ``Plan`` that must have sampled (a prefill, decode or
    mixed forward read back later)."""
    result = checked(plan, result)
    if not isinstance(result, Sampled):
        raise PlanExecutionError(f"{type(plan).__name__} samples no tokens (it came back as {type(result).__name__})")
    return result
