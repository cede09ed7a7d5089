"""An executor in its own process: the backend half of overlap on a CPU.

On a CPU a forward cannot run beside the scheduler in a thread of the same process (every torch op
takes the interpreter lock back, and a busy scheduler thread starves it), so ``ExecutorProcess``
runs an ``Executor`` (its pool, the model's KV cache and token table, its own ``Ledger``) in a child
process and feeds it plans as ``ir.wire`` messages: the protocol tensor-parallel ranks use too.

Per plan, ``submit`` (on the scheduler's side):

1. checks that the plan's rows and the slots its one-shot ops name are live in the scheduler's slot
   allocator (the allocator stays with the scheduler);
2. claims the plan's tickets for this pool in the scheduler's ledger (``Ledger.claim``: a replayed,
   forged or stripped plan is refused here, before a byte leaves the process);
3. packs the plan with the next message number and sends it; the call returns at once.

In the child, the message is unpacked (every node rebuilt through its constructor, the message
number checked: a replayed, skipped or reordered message is refused), the plan's tickets for its
pool are admitted into the child's ledger with the scheduler's provenance (``Ledger.trust_peer``
with the scheduler's serial epoch: a serial minted anywhere else is refused), and its executor runs
the plan with every check it makes in process. The reply names the tickets the child consumed;
``wait`` settles the scheduler's claim with exactly those (``Claim.settle``), so both ledgers agree
before an op counts as consumed, and a forward that failed leaves its tickets outstanding on both
sides (a transactional executor restored its rows: the same plan can be submitted again).

Errors come back by kind: a ``BatchcError`` raised in the child (a refused plan) is raised as
``ExecutorRefused`` (never retried), anything else as ``ForwardFailed`` (a fault; retried by the
engine's runner when it has retries). A child that died raises ``ExecutorGone`` for every later plan
(``submit``, ``wait``, ``execute``), saying how it ended (``backend.children.ended``: "killed by
signal 9"); the requests that are not plans (``share_prefix``, ``forget_verifies``,
``cancel_outstanding``) and ``drain`` never raise it, so the engine learns of the death on the path
that aborts the plans' requests, whichever call notices it first. The child is started by
``backend.children.spawn``: it dies with this process.

Replies arrive in order. Each carries the child's busy interval (``time.perf_counter``, the same
monotonic clock in both processes on Linux), so a caller can tell how much of its wall time had a
forward running (``busy``).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import pickle
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Final, get_args

import numpy as np
import torch

from backend import boundary, children, faults
from backend.allocator import SlotAllocator
from backend.boundary import BackendGone, ForwardFailed
from backend.counts import token_counts
from backend.executor import Executor
from backend.hidden_store import HiddenStore
from backend.ledger import Claim, Ledger
from backend.model import ServedModel
from ir.columns import check_instance
from ir.errors import BatchcError, IRValidationError
from ir.head import HeadCommitPlan, HeadExtendPlan
from ir.hidden import HiddenStates
from ir.ids import HiddenId, PoolId, TicketSerial
from ir.init import Op, Ticket, op_slots, this_epoch
from ir.linear import consumes, keeps_linear
from ir.nodes import Plan
from ir.plan import ExtendPlan, MixedPlan
from ir.results import Result, Sampled, Verified
from ir.wire import pack, unpack

_log = logging.getLogger("batchc.remote")

_START_TIMEOUT_S: Final = 120.0
"""How long ``ExecutorProcess`` waits for its child to build the pool and report ready."""


def _forward_failed(kind: str, message: str) -> ForwardFailed:
    """A plan raised in the executor process with something other than a ``BatchcError`` (a fault)."""
    return ForwardFailed(kind, f"{message} (in the executor process)")


class ExecutorRefused(BatchcError):
    """The executor process refused a plan or a request with a ``BatchcError`` (its checks, its
    ledger, the message's number): ``kind`` is that error's class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind} in the executor process: {message}")
        self.kind = kind


class ExecutorGone(BackendGone):
    """The executor process is closed or died; nothing more runs on its pool."""


def plan_tickets(plan: Plan, pool: PoolId) -> list[Ticket[Op]]:
    """The one-shot tickets a plan carries for ``pool``, in the order their ops run."""
    ext = plan if isinstance(plan, (ExtendPlan, HeadExtendPlan)) else plan.extend if isinstance(plan, MixedPlan) else None
    return [] if ext is None else list(ext.tickets_for(pool))


@keeps_linear  # a plan in flight in the executor process, until its reply is read
class Pending(boundary.Pending):
    """A plan (or a request, ``plan`` None) sent to an ``ExecutorProcess`` whose reply has not been
    read yet: its message number and the scheduler's claim on its tickets."""

    def __init__(self, number: int, plan: Plan | None, claim: Claim | None) -> None:
        super().__init__(plan)
        self.number = number
        self.claim = claim


_Key = tuple[TicketSerial, PoolId]


class ExecutorProcess:
    """An ``Executor`` over ``model``'s pool ``pool_id`` in a child process (see the module)."""

    def __init__(
        self,
        model: ServedModel[Any],
        *,
        pool_id: PoolId,
        capacity: int,
        kv_capacity: int,
        max_len: int,
        ledger: Ledger,
        slots: SlotAllocator | None = None,
        transactional: bool = False,
        threads: int = 1,
        penalties: bool = False,
        hidden: HiddenStore | None = None,
    ) -> None:
        """Arguments are checked here (``IRValidationError`` naming ``ExecutorProcess.<argument>``);
        the model is pickled to the child, which builds the pool, the serving hook and (with
        ``penalties``, for the target) the token counts (``backend.counts``) and reports ready
        (an error there is raised here, as ``ExecutorRefused`` or ``ForwardFailed``). ``hidden``:
        where the target's hidden states wait between its process and its draft head's (a store
        both ``ExecutorProcess``es share; default: one of its own)."""
        check_instance("ExecutorProcess", "model", model, ServedModel)
        check_instance("ExecutorProcess", "ledger", ledger, Ledger)
        check_instance("ExecutorProcess", "slots", slots, SlotAllocator, optional=True)
        check_instance("ExecutorProcess", "transactional", transactional, bool)
        check_instance("ExecutorProcess", "penalties", penalties, bool)
        check_instance("ExecutorProcess", "hidden", hidden, HiddenStore, optional=True)
        for name, value in (("capacity", capacity), ("kv_capacity", kv_capacity), ("max_len", max_len), ("threads", threads)):
            if type(value) is not int or value < 1:
                raise IRValidationError("ExecutorProcess", name, value, "must be an int >= 1")
        if not isinstance(pool_id, str):
            raise IRValidationError("ExecutorProcess", "pool_id", pool_id, "must be a pool name (str)")
        self.pool_id = pool_id
        self.ledger = ledger
        self.slots = slots
        self.hidden = hidden if hidden is not None else HiddenStore()
        """Hidden states handed back by this child (a target's ``keep_hidden`` plans), waiting for
        the head plan that names them; the head's ``submit`` hands them on to its child, once."""
        self._live_ok: tuple[bytes, int] | None = None
        self._proc, self._conn = children.spawn_module("backend.remote")
        self._next = 0
        self._pending: deque[Pending] = deque()
        self._gone: str | None = None
        self._ready = False
        self._control_error: BaseException | None = None
        self.busy: list[tuple[float, float]] = []
        """The child's busy intervals, one per reply read, in ``time.perf_counter`` seconds."""
        self.waited = 0.0
        """Seconds the caller spent blocked on this process's replies."""
        self._finalizer = weakref.finalize(self, _shutdown, self._conn, self._proc)
        try:
            start = _dumps(("start", model, pool_id, capacity, kv_capacity, max_len, transactional, threads, this_epoch(), penalties))
        except Exception as exc:  # noqa: BLE001 - any pickling failure: the model cannot travel
            self.close()
            raise IRValidationError("ExecutorProcess", "model", type(model).__name__, f"must pickle to reach its process ({exc!r})") from exc
        try:
            self._conn.send_bytes(start)
        except (OSError, EOFError, ValueError) as exc:  # the child died already: the first use raises ExecutorGone
            self._mark_gone(exc)

    def wait_ready(self) -> None:
        """Wait until the child has built its pool (``ExecutorGone`` after ``_START_TIMEOUT_S``
        without it); the first use waits anyway, so this only moves the start-up cost to a chosen
        moment."""
        self._check_open()

    def _wait_ready(self) -> None:
        """The child builds its pool while the caller goes on; the first use waits for it."""
        if self._ready:
            return
        try:
            answered = self._conn.poll(_START_TIMEOUT_S)
        except (OSError, EOFError) as exc:
            raise self._mark_gone(exc) from None
        if not answered:
            self.close()
            raise ExecutorGone(f"executor process for pool {self.pool_id!r} {children.no_answer(_START_TIMEOUT_S)} (it did not start)")
        reply = self._recv()
        self.waited = 0.0  # start-up is not waiting on plans
        if reply[0] != "ready":
            self.close()
            raise _error(reply)
        self._ready = True

    # -- plans ---------------------------------------------------------------------------------

    @consumes
    def submit(self, plan: Plan) -> Pending:
        """Check and claim ``plan`` here and send it; returns at once (``wait`` reads the reply)."""
        if not isinstance(plan, get_args(Plan)):
            raise IRValidationError("ExecutorProcess.submit", "plan", plan, "must be a plan")
        self._check_open()
        rows = plan.slots.tolist()
        tickets = plan_tickets(plan, self.pool_id)
        if self.slots is not None:
            key = (np.asarray(rows, dtype=np.int64).tobytes(), self.slots.generation)
            if key != self._live_ok:
                self.slots.check_live(rows, type(plan).__name__)
                self._live_ok = key
            for t in tickets:
                self.slots.check_live(op_slots(t.op), str(t))
        # plans run in the order they are sent: a ticket an earlier plan holds runs before this one
        claim = self.ledger.claim(tickets, self.pool_id, rows, type(plan).__name__, ordered=True)
        try:
            data = pack(self._next, plan)
            self._send(("plan", data, self._hand_on(plan)))
        except BaseException:
            claim.settle(())
            raise
        p = Pending(self._next, plan, claim)
        self._next += 1
        self._pending.append(p)
        return p

    def _hand_on(self, plan: Plan) -> tuple[HiddenStates, torch.Tensor] | None:
        """The hidden states a head plan reads, out of the shared store, to travel with it (once: a
        plan sent again after a failed forward finds them still held in the child, a replayed one
        finds them nowhere and the child refuses it naming the id)."""
        hid = read_hidden_id(plan)
        return self.hidden.hand_over(hid) if hid is not None and hid in self.hidden else None

    def wait(self, pending: boundary.Pending) -> Result:
        """The result of ``pending`` (reading every earlier reply first), or its error raised (or
        that of a failed request sent before it)."""
        if not isinstance(pending, Pending) or pending not in self._pending and not pending.done:
            raise IRValidationError(
                "ExecutorProcess.wait", "pending", pending, f"was not submitted to the executor process of pool {self.pool_id!r}"
            )
        while not pending.done:
            self._read_one()
        self._raise_control_error()
        return pending.outcome()

    @property
    def usable(self) -> bool:
        """True until this side closed the process or found it gone."""
        return not self.closed

    @consumes
    def execute(self, plan: Plan) -> Result:
        """``submit`` then ``wait``: the in-process ``Executor.execute`` of this pool."""
        return self.wait(self.submit(plan))

    def drain(self) -> None:
        """Read every outstanding reply (the errors of plans stay on their ``Pending``; that of a
        failed request is raised; a dead child leaves ``ExecutorGone`` on every plan in flight)."""
        while self._pending:
            try:
                self._read_one()
            except ExecutorGone:
                return  # (the plans in flight hold it)
        self._raise_control_error()

    # -- requests that are not plans (in order with the plans) ---------------------------------

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """The serving hook's ``share_prefix`` in the child (its token table's rows)."""
        self._control("share", int(src), int(dst), int(length))

    def forget_verifies(self) -> None:
        """``Executor.forget_verifies`` in the child: kept verify and draft states and samples go
        (and the hidden states this side holds for a head plan)."""
        self.hidden.forget()
        self._control("forget")

    def cancel_outstanding(self, reason: str) -> None:
        """Cancel, in the child's ledger, every ticket admitted there that did not run (the
        scheduler cancelled them in its own ledger: their requests were aborted)."""
        self._control("cancel", str(reason))

    def arm_fault(self, point: faults.FaultPoint, *, after: int = 0) -> None:
        """Tests: arm ``point`` in the child (``backend.faults``), to fire once at its ``after + 1``-th
        pass; ``disarm_faults`` ends it."""
        self._control("arm", faults.FaultPoint(point).value, int(after))

    def disarm_faults(self) -> None:
        """Tests: disarm every fault point in the child (``backend.faults.disarm``)."""
        self._control("disarm")

    def _control(self, *msg: object) -> None:
        """Send a request that is not a plan; it returns at once. Its error (a bug: a bad slot, say)
        is raised by the next ``wait``, ``drain`` or request. A dead child has no state left to
        change: the request is dropped, and the child's death is raised by the plans (their
        ``submit`` or ``wait``: the one path on which the engine aborts their requests), whichever
        call happens to notice it first."""
        if self._gone is not None and self._gone != "closed":
            return
        self._check_open()
        self._raise_control_error()
        try:
            self._send(msg)
        except ExecutorGone:
            return
        self._pending.append(Pending(-1, None, None))

    def _raise_control_error(self) -> None:
        if self._control_error is not None:
            err, self._control_error = self._control_error, None
            raise err

    # -- plumbing ------------------------------------------------------------------------------

    def _gone_error(self) -> ExecutorGone:
        if self._gone == "closed":
            return ExecutorGone(f"executor process for pool {self.pool_id!r} is closed")
        return ExecutorGone(f"executor process for pool {self.pool_id!r} {self._gone}")

    def _check_open(self) -> None:
        if self._gone is not None:
            raise self._gone_error()
        self._wait_ready()

    def _send(self, msg: tuple[object, ...]) -> None:
        try:
            self._conn.send_bytes(_dumps(msg))
        except (OSError, EOFError, ValueError) as exc:
            raise self._mark_gone(exc) from None

    def _recv(self) -> tuple[Any, ...]:
        t0 = time.perf_counter()
        try:
            reply = pickle.loads(self._conn.recv_bytes())
        except (OSError, EOFError) as exc:
            raise self._mark_gone(exc) from None
        self.waited += time.perf_counter() - t0
        assert isinstance(reply, tuple)
        return reply

    def _mark_gone(self, exc: BaseException) -> ExecutorGone:
        """The child's socket failed with ``exc``: the child is gone (or going). Say how it ended in
        the common words (``backend.children.ended``; the socket's own error goes to the debug
        log), fail every plan in flight, and return the error to raise."""
        _log.debug("executor process for pool %r: socket failed: %r", self.pool_id, exc)
        try:  # a closed socket means the child is exiting: its status follows at once
            code: int | None = self._proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        self._gone = children.ended(code) if code is not None else "lost its connection"
        err = self._gone_error()
        for p in self._pending:  # claims of plans that never ran return to outstanding
            if p.claim is not None and p.claim.open:
                p.claim.settle(())
            p.done, p.error = True, err
        self._pending.clear()
        return err

    def _read_one(self) -> None:
        if not self._pending:
            return
        reply = self._recv()
        p = self._pending.popleft()
        kind = reply[0]
        started, ended, consumed = reply[-3], reply[-2], reply[-1]
        self.busy.append((started, ended))
        if p.claim is not None:
            p.claim.settle(consumed)
        if kind == "done":
            p.result = reply[1]  # (IR nodes unpickle through their constructors: checked)
            if reply[2] is not None:  # a target's hidden states, for the head plan that names them
                try:
                    self.hidden.keep(*reply[2])
                except BatchcError as exc:  # (an id kept twice or states of the wrong shape: the plan's error, not the reader's)
                    p.result, p.error = None, exc
        else:
            p.error = _error(reply)
            if p.plan is None and self._control_error is None:
                self._control_error = p.error
        p.done = True

    def close(self) -> None:
        """Stop the child after the plans already sent (their replies are read and dropped, so the
        child never blocks on a full socket); later calls raise ``ExecutorGone``."""
        if self._gone is None:
            try:
                self.drain()
            except Exception:  # noqa: BLE001 - closing: a failed plan or a dead child changes nothing now
                pass
            if self._gone is None:
                self._gone = "closed"
        self._finalizer()

    @property
    def closed(self) -> bool:
        """True once this side closed the process or found it gone: every later plan raises
        ``ExecutorGone``."""
        return self._gone is not None

    @property
    def pid(self) -> int:
        """The child process's id (for a supervisor's signals and liveness checks)."""
        return self._proc.pid

    @property
    def exit_code(self) -> int | None:
        """The child's exit status once it has ended (negative: the signal that ended it), else
        ``None``; never blocks (``closed`` says whether this side still uses it)."""
        return self._proc.poll()

    def __enter__(self) -> ExecutorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _error(reply: tuple[Any, ...]) -> BaseException:
    _, kind, message, refused = reply[:4]
    return ExecutorRefused(kind, message) if refused else _forward_failed(kind, message)


def _shutdown(conn: multiprocessing.connection.Connection, proc: subprocess.Popen[bytes]) -> None:
    try:
        conn.send_bytes(_dumps(("close",)))
    except (OSError, EOFError, ValueError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        children.kill(proc)
    conn.close()


# -- the child -------------------------------------------------------------------------------


def _main(fd: int) -> None:
    conn = multiprocessing.connection.Connection(fd)
    try:
        start = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    if start[0] == "start":  # (a scheduler that could not send its model closes at once)
        _serve(conn, *start[1:])


def _serve(
    conn: multiprocessing.connection.Connection, model: ServedModel[Any], pool_id: PoolId, capacity: int, kv_capacity: int,
    max_len: int, transactional: bool, threads: int, parent_epoch: int, penalties: bool,
) -> None:
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        pool = model.new_pool(capacity, pool_id=pool_id)
        hook = model.serving_hook(capacity=capacity, kv_capacity=kv_capacity, max_len=max_len)
        ledger = Ledger()
        ledger.trust_peer(parent_epoch, "scheduler")
        counts = token_counts(pool, model.vocab) if penalties else None
        hidden = HiddenStore()  # a target's kept hidden states go back with its result; a head's come with its plan
        ex: Executor[Any] = Executor(pool, ledger, hook, transactional=transactional, counts=counts, hidden=hidden)
    except BaseException as exc:  # noqa: BLE001 (reported to the scheduler, which raises it)
        conn.send_bytes(_dumps(_failed(exc, t0, [])))
        return
    conn.send_bytes(_dumps(("ready",)))
    number = 0
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "close":
            return
        t0 = time.perf_counter()
        tickets: list[Ticket[Op]] = []
        handed: tuple[HiddenStates, torch.Tensor] | None = None
        try:
            out: Result | None = None
            if kind == "plan":
                plan = unpack(msg[1], expect_step=number).plan
                number += 1
                handed_on = msg[2] if len(msg) > 2 else None  # the hidden states a head plan reads (``_hand_on``)
                if handed_on is not None:
                    hidden.keep(*handed_on)
                tickets = plan_tickets(plan, pool_id)
                ledger.register(tickets)
                out = ex.execute(plan)  # (results pickle as IR nodes: tokens, not logits)
                kept = kept_hidden_id(out)
                handed = hidden.hand_over(kept) if kept is not None else None
            elif kind == "share":
                hook.share_prefix(msg[1], msg[2], msg[3])
            elif kind == "forget":
                ex.forget_verifies()
            elif kind == "cancel":
                for t in ledger.outstanding():
                    ledger.cancel(t, msg[1])
            elif kind == "arm":
                faults.arm(faults.FaultPoint(msg[1]), after=msg[2])
            elif kind == "disarm":
                faults.disarm()
            else:
                raise ExecutorRefused("ValueError", f"unknown request {kind!r}")
        except BaseException as exc:  # noqa: BLE001 (reported to the scheduler, which raises it)
            conn.send_bytes(_dumps(_failed(exc, t0, _consumed(ledger, tickets))))
            continue
        conn.send_bytes(_dumps(("done", out, handed, t0, time.perf_counter(), _consumed(ledger, tickets))))


def read_hidden_id(plan: Plan) -> HiddenId | None:
    """The hidden states a head plan reads, by id (``None`` for every other plan)."""
    if isinstance(plan, HeadExtendPlan):
        return plan.hidden_id
    if isinstance(plan, HeadCommitPlan):
        return plan.batch.hidden_id
    return None


def kept_hidden_id(out: Result | None) -> HiddenId | None:
    """The hidden states a target's result hands back a handle on, by id (``None`` for none)."""
    if isinstance(out, (Sampled, Verified)) and out.hidden is not None:
        return out.hidden.hidden_id
    return None


def _dumps(msg: tuple[object, ...]) -> bytes:
    """Plain pickle (not multiprocessing's, which hands torch tensors over as shared-memory file
    descriptors that only a multiprocessing child can open)."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _consumed(ledger: Ledger, tickets: Sequence[Ticket[Op]]) -> list[_Key]:
    return [(t.serial, t.pool) for t in tickets if ledger.is_consumed(t)]


def _failed(exc: BaseException, t0: float, consumed: list[_Key]) -> tuple[object, ...]:
    kind = exc.kind if isinstance(exc, (ExecutorRefused, ForwardFailed)) else type(exc).__name__
    return ("failed", kind, str(exc), isinstance(exc, BatchcError), t0, time.perf_counter(), consumed)


class ProcessBackends:
    """``backend.boundary.Backends`` with each pool's executor in its own process."""

    def __init__(self, target: ExecutorProcess, draft: ExecutorProcess | None) -> None:
        self._target, self._draft = target, draft

    @property
    def target(self) -> ExecutorProcess:
        """The target pool's executor process."""
        return self._target

    @property
    def draft(self) -> ExecutorProcess | None:
        """The draft pool's executor process, or ``None`` when the engine serves no draft."""
        return self._draft

    @property
    def concurrent(self) -> bool:
        """Always True: plans run in the children while the caller builds the next one."""
        return True

    def _all(self) -> list[ExecutorProcess]:
        return [self._target] + ([self._draft] if self._draft is not None else [])

    def ready(self) -> None:
        """Wait until every child has built its pool (``ExecutorGone`` for one that did not in time)."""
        for ex in self._all():
            ex.wait_ready()

    def settle(self) -> None:
        """Read every reply still outstanding from each open child (the plans' errors stay on their
        ``Pending``)."""
        for ex in self._all():
            if not ex.closed:
                ex.drain()

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Every child's token table: slot ``dst``'s first ``length`` KV locations become ``src``'s."""
        for ex in self._all():
            ex.share_prefix(src, dst, length)

    def cancel_outstanding(self, reason: str) -> None:
        """Cancel, in each open child's ledger, the tickets admitted there that did not run."""
        for ex in self._all():
            if not ex.closed:
                ex.cancel_outstanding(reason)

    def busy_intervals(self) -> list[tuple[float, float]]:
        """Every child's busy intervals (``time.perf_counter`` seconds), one per reply read."""
        return [iv for ex in self._all() for iv in ex.busy]

    def waited_seconds(self) -> float:
        """Seconds the caller spent blocked on the children's replies, over every child."""
        return sum(ex.waited for ex in self._all())

    def close(self) -> None:
        """Stop every child after the plans already sent; returns None (no group of ranks to report on)."""
        for ex in self._all():
            ex.close()


class Processes:
    """The ``backend.boundary.Transport`` that runs each pool's executor in its own process (the
    engine's overlap on a CPU); ``threads``: torch threads per process (default: this process's)."""

    def __init__(self, threads: int | None = None) -> None:
        if threads is not None and (type(threads) is not int or threads < 1):
            raise IRValidationError("Processes", "threads", threads, "must be an int >= 1 or None")
        self.threads = threads

    def __repr__(self) -> str:
        return "Processes()" if self.threads is None else f"Processes(threads={self.threads})"

    def refusal(self, models: Mapping[PoolId, ServedModel[Any]], *, retries: int) -> str | None:
        """Never refuses: any served model can run in an executor process."""
        return None

    def open(
        self, models: Mapping[PoolId, ServedModel[Any]], *, ledger: Ledger, slots: SlotAllocator, capacity: int, kv_capacity: int,
        max_len: int, retries: int, penalties: bool = False,
    ) -> ProcessBackends:
        """The processes start side by side (the target's first); if one cannot start, those
        started are stopped and the error is raised."""
        threads = self.threads if self.threads is not None else torch.get_num_threads()
        started: list[ExecutorProcess] = []
        # a draft head reads the target's hidden states: they come back with the target's result
        # and go on with the head's plan, through one store on this side
        hidden = HiddenStore()
        try:
            for pool, model in models.items():
                started.append(ExecutorProcess(
                    model, pool_id=pool, capacity=capacity, kv_capacity=kv_capacity, max_len=max_len, ledger=ledger, slots=slots,
                    transactional=retries > 0, threads=threads, penalties=penalties, hidden=hidden,
                ))
            backends = ProcessBackends(started[0], started[1] if len(started) > 1 else None)
            backends.ready()
        except BaseException:
            for ex in started:
                ex.close()
            raise
        return backends


__all__ = [
    "ExecutorGone", "ExecutorProcess", "ExecutorRefused", "ForwardFailed", "Pending", "ProcessBackends", "Processes",
    "plan_tickets",
]


if __name__ == "__main__":
    _main(int(sys.argv[1]))
