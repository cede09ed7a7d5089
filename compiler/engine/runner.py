"""Running one plan on one backend, with retries: the engine's forward runner.

The runner talks to a ``backend.boundary.Backend`` and cannot tell how it runs plans. With
``retries > 0`` the backends are transactional (a failed forward leaves nothing behind), so a forward
that raises is simply executed again. A ``BatchcError`` is never retried: a plan that does not fit
its backend is a bug, not a fault; nor is a ``BackendBroken`` (a tensor-parallel rank that failed
breaks its group): the engine stops. When every attempt fails, ``StepFailed`` carries the plan's
requests; the engine aborts them through its release path and serving goes on.

``submit`` and ``wait`` split a run in two, so the scheduler can do host work while the forward
runs: a backend in another process returns from ``submit`` at once; one in this process runs the
plan there (``wait`` hands back what it gave). Retries happen at ``wait``. Results come back as
``ir.results`` nodes; the caller narrows them with ``backend.boundary.checked``, which refuses a
result of the wrong kind or for other rows.
"""

from __future__ import annotations

from backend.boundary import Backend, BackendBroken, Pending
from compiler.engine.report import SpecStats
from ir.errors import BatchcError
from ir.ids import RequestId
from ir.linear import consumes_on, keeps_linear
from ir.nodes import Plan
from ir.results import Result

__all__ = ["ForwardRunner", "StepFailed", "Submitted", "cause_words", "rids_of"]


def cause_words(cause: BaseException) -> str:
    """How a failure's cause is named to a user: its kind and its own message (``ExecutorGone:
    executor process for pool 'target' killed by signal 9``), not a repr with quotes and escapes."""
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


class StepFailed(Exception):
    """A forward failed on every attempt; ``rids`` are the requests it carried."""

    def __init__(self, rids: tuple[RequestId, ...], cause: Exception) -> None:
        super().__init__(f"forward of requests {list(rids)} failed: {cause_words(cause)}")
        self.rids = rids
        self.cause = cause


def rids_of(plan: Plan) -> tuple[RequestId, ...]:
    """The requests a plan carries."""
    return tuple(plan.rid_list())


@keeps_linear  # a plan in flight, until ``wait`` reads it back (or retries it)
class Submitted:
    """A plan handed to ``ForwardRunner.submit``: the backend's pending run, or (when submitting
    it failed) the failure to retry or raise."""

    def __init__(self, backend: Backend, plan: Plan) -> None:
        self.backend, self.plan = backend, plan
        self.sent: Pending | Exception = RuntimeError("not submitted")
        """The backend's pending run, or what failed when submitting it."""

    @property
    def failed(self) -> bool:
        """It is known to have failed without waiting (it ran in process, or never left)."""
        return isinstance(self.sent, Exception) or (self.sent.done and self.sent.error is not None)

    @property
    def in_flight(self) -> bool:
        """It runs elsewhere and has not been read back."""
        return not isinstance(self.sent, Exception) and not self.sent.done


class ForwardRunner:
    """Runs the engine's plans on their backends (see the module): retries a failed forward up to
    ``retries`` times (counted in ``stats.retries``), never a refusal (``BatchcError``) nor a broken
    backend, and raises ``StepFailed`` with the plan's requests when every attempt failed."""

    def __init__(self, retries: int, stats: SpecStats) -> None:
        self.retries = retries
        self.stats = stats

    @consumes_on("backend")
    def run(self, backend: Backend, plan: Plan) -> Result:
        """``wait(submit(backend, plan))`` in one frame (no ``Submitted`` in between): the same
        refusals raised, the same failures retried."""
        try:
            sent = backend.submit(plan)
            return backend.wait(sent)
        except (BatchcError, BackendBroken):
            raise
        except Exception as exc:  # noqa: BLE001 - a fault submitting or running it: retried as ``wait`` retries
            return self._attempts(backend, plan, self.retries, exc)

    @consumes_on("backend")
    def submit(self, backend: Backend, plan: Plan) -> Submitted:
        """Start ``plan`` on ``backend``; a refusal on this side (a ``BatchcError``) and a broken
        backend are raised here."""
        s = Submitted(backend, plan)
        try:
            s.sent = backend.submit(plan)
        except (BatchcError, BackendBroken):
            raise
        except Exception as exc:  # noqa: BLE001 - a fault before the plan left (a backend gone): ``wait`` retries it
            s.sent = exc
        return s

    def wait(self, s: Submitted) -> Result:
        """The result of a submitted plan, retried up to ``retries`` times; ``StepFailed`` when
        every attempt failed."""
        try:
            if isinstance(s.sent, Exception):
                raise s.sent
            return s.backend.wait(s.sent)
        except (BatchcError, BackendBroken):
            raise  # a plan that does not fit is a bug, and a broken backend stays broken: neither is retried
        except Exception as exc:
            return self._attempts(s.backend, s.plan, self.retries, exc)

    def _attempts(self, backend: Backend, plan: Plan, attempts: int, failed: Exception) -> Result:
        for _ in range(attempts):
            self.stats.retries += 1
            try:
                return backend.wait(backend.submit(plan))  # type: ignore[linear-reuse]  # a retry: the failed attempt left its tickets outstanding
            except (BatchcError, BackendBroken):
                raise
            except Exception as exc:  # noqa: BLE001 - the next attempt, or StepFailed below
                failed = exc
        raise StepFailed(rids_of(plan), failed) from failed
