"""Serving over a tensor-parallel group: one scheduler (rank 0), one authority over the tickets.

Rank 0 schedules, lowers and mints serials; its engine runs each plan on its own shard through a
``TPExecutor``, which first broadcasts the plan to the workers as an ``ir.wire`` message with the
next step number (the format the executor processes of ``backend.remote`` read: one protocol).
A worker (``serve_worker``) refuses a message whose step number is not the next one (numbers count
the plans the group accepted: a replayed message carries an old one, a reordered one a later one),
rebuilds the plan through the IR constructors, admits its tickets into its own ledger (which trusts serials of
rank 0's epoch only: ``Ledger.trust_peer``) and runs it on its shard with its own ``Executor``.

Every rank's executor meets the others twice per plan (``TPGate``, the executor's ``Gate``):

1. ``validated``: every check passed and nothing is written yet. An all-reduce of an ok flag: if any
   rank refused (a replayed, out-of-order or forged message, a plan its ledger or checks refuse),
   every rank releases its claims and raises ``RankRefused`` naming each refusing rank and why;
   nothing ran anywhere, and the workers serve on. This also keeps the model's collectives in
   lockstep: no rank enters a forward that another has refused.
2. ``applied``: the plan ran. A second all-reduce before the ledger's consuming block ends, so a
   ticket counts as consumed on a rank only once every rank applied its op.

A failure after point 1 (a rank that raises in its forward, dies, or stops answering) cannot be
undone on the others: it is fatal for the group. The failing rank leaves its cause in the group's
store and leaves; the others' collectives fail (at once for a closed connection, after the group's
timeout for a silent rank), and rank 0 raises ``RankFailed`` naming the rank and the cause, then
closes the group, so the workers it started exit too.

A serving session (``TPLeader.open_session`` ... ``close_session``) is one engine's life: the workers
build their pools and caches from rank 0's sizes, and at the end every rank's ledger counts are
gathered (``RankLedgers``), so rank 0 can check that every rank consumed the same tickets and that
every ledger is drained.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from typing import Any

from backend import faults
from backend.allocator import SlotAllocator
from backend.boundary import InProcessGroup, Pending, run_now
from backend.counts import token_counts
from backend.executor import Executor
from backend.hidden_store import HiddenStore
from backend.hybrid.head import HeadModel
from backend.hybrid.model import HybridModel
from backend.ledger import LEDGER_COUNTS_WIDTH, Ledger, LedgerCounts, RankLedgers
from backend.model import HeadHook, ReadsTargetHidden, ServedModel, ServingModelHook
from backend.pool import MambaStatePool
from backend.remote import plan_tickets
from backend.tp.group import Msg, RankFailed, RankFault, RankRefused, TPGroup, Vote, one_line
from backend.tp.shard import head_fingerprint
from ir.columns import int_problem
from ir.errors import BatchcError, IRValidationError, short_repr
from ir.ids import PoolId
from ir.init import this_epoch
from ir.linear import consumes, consumes_on
from ir.nodes import Plan
from ir.results import Result
from ir.wire import WireError, pack, unpack


class _State(enum.Enum):
    NEW = 0  # the plan's checks are running
    AGREEING = 1  # in a collective of the gate
    VALIDATED = 2  # every rank accepted it; it is being applied
    APPLIED = 3  # every rank applied it
    REFUSED = 4  # some rank refused it; nothing ran


class TPGate:
    """A rank's ``Gate`` (``backend.executor``): the two agreements of each plan (see the module)."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.state = _State.APPLIED
        self.step = -1

    def begin(self, step: int) -> None:
        """Start plan message ``step``: the next ``validated`` runs the first agreement."""
        self.state, self.step = _State.NEW, step

    def validated(self, plan: str) -> None:
        """Point 1 (see the module): agree with every rank that the plan passed its checks here and
        nothing is written yet; raises ``RankRefused`` (or ``RankFault``) naming the ranks that did not,
        and then nothing runs anywhere. A no-op after the first call of a plan."""
        if self.state is not _State.NEW:
            return
        self.state = _State.AGREEING
        worst, dissent = self.group.agree()
        if worst is not Vote.OK:
            self.state = _State.REFUSED
            raise _dissent(f"{plan} (plan message {self.step})", worst, dissent)
        self.state = _State.VALIDATED

    def applied(self, plan: str) -> None:
        """Point 2: agree with every rank that the plan ran (after point 1, if it was skipped); a rank that
        did not get here is gone, and this raises ``RankFailed``. A no-op after the first call of a plan."""
        if self.state is _State.NEW:
            self.validated(plan)
        if self.state is not _State.VALIDATED:
            return
        self.state = _State.AGREEING
        self.group.agree()  # a rank that did not get here is gone: this raises RankFailed
        self.state = _State.APPLIED

    def refuse(self, exc: BaseException) -> None:
        """This rank's checks of the plan raised ``exc`` before point 1: tell the others (a
        ``BatchcError`` is a refusal, anything else a fault)."""
        self.state = _State.REFUSED
        vote = Vote.REFUSED if isinstance(exc, BatchcError) else Vote.FAILED
        self.group.agree(vote, f"{one_line(exc)} (plan message {self.step})")


def _dissent(what: str, worst: Vote, dissent: list[tuple[int, str]]) -> RankRefused | RankFault:
    return RankRefused(what, dissent) if worst is Vote.REFUSED else RankFault(what, dissent)


def _settle(group: TPGroup, gate: TPGate, exc: BaseException, plan: str) -> BaseException:
    """What a rank's exception out of a plan means for the group: the exception to raise. A refusal
    before point 1 is agreed on (every rank learns of it) and the group serves on; anything after
    point 1 breaks the group, with this rank's cause left in the store."""
    if isinstance(exc, RankFailed):
        return exc
    if gate.state is _State.NEW:
        gate.refuse(exc)
        return exc
    if gate.state is _State.REFUSED and isinstance(exc, (RankRefused, RankFault)):
        return exc
    cause = f"failed: {one_line(exc)} in {plan} (plan message {gate.step})"
    group.report_fault(cause)
    failed = RankFailed(group.rank, cause)
    group.broken = failed
    return failed


def _counts(ledger: Ledger, pools: Sequence[PoolId]) -> list[int]:
    return [x for p in pools for x in LedgerCounts.of(ledger, p).to_ints()]


def _rank_ledgers(pools: Sequence[PoolId], gathered: list[list[int]]) -> RankLedgers:
    return RankLedgers(pools=tuple(pools), ranks=tuple(
        {p: LedgerCounts.from_ints(v[i * LEDGER_COUNTS_WIDTH : (i + 1) * LEDGER_COUNTS_WIDTH]) for i, p in enumerate(pools)} for v in gathered
    ))


# -- rank 0 ------------------------------------------------------------------------------------


class TPLeader:
    """Rank 0's side of the group: it sends every plan and request to the workers, in order."""

    def __init__(self, group: TPGroup) -> None:
        given: object = group
        if not isinstance(given, TPGroup) or group.rank != 0:
            raise IRValidationError("TPLeader", "group", given, "must be rank 0's TPGroup")
        self.group = group
        self.gate = TPGate(group)
        self.step = 0
        """The step number of the next plan message."""
        self.pools: tuple[PoolId, ...] | None = None
        """The open session's pools (None between sessions)."""
        self.plans = 0
        """Plans the group ran."""
        self.plan_bytes = 0
        """Bytes of the plan messages sent."""
        self._sizes = (0, 0)
        """The open session's capacity and max_len (``share_prefix``'s bounds)."""

    @property
    def world(self) -> int:
        """Ranks in the group, rank 0 included."""
        return self.group.world

    def _check(self) -> None:
        if self.group.broken is not None:
            raise self.group.broken
        if self.group.closed:
            raise RuntimeError("the tensor-parallel group is shut down (TPLeader.shutdown)")

    def _fatal(self, failed: BaseException) -> BaseException:
        if isinstance(failed, RankFailed):
            self.group.broken = failed
            self.group.close(wait_s=10.0)  # the workers' collectives fail at once; those started here exit
        return failed

    def open_session(
        self, models: Mapping[PoolId, object], *, capacity: int, kv_capacity: int, max_len: int, transactional: bool,
        penalties: bool = False,
    ) -> None:
        """The workers build a pool and caches per pool of ``models`` (rank 0's shards, by pool),
        after checking that their shards were cut from the same models (``ShardOrigin``'s
        fingerprint) for their rank; ``RankRefused`` naming the rank if one cannot or does not."""
        self._check()
        if self.pools is not None:
            raise RuntimeError("a tensor-parallel session is already open (one engine at a time)")
        origins = {}
        for pool, model in models.items():
            try:
                origins[pool] = check_shard(model, pool, 0, self.world)
            except ValueError as exc:
                raise IRValidationError("TPLeader.open_session", "models", pool, str(exc)) from None
        pools = tuple(models)
        self._sizes = (capacity, max_len)
        cfg = {"pools": list(pools), "capacity": capacity, "kv_capacity": kv_capacity, "max_len": max_len,
               "transactional": transactional, "epoch": this_epoch(), "origins": origins, "penalties": penalties}
        try:
            self.group.send(Msg.START, json.dumps(cfg).encode())
            worst, dissent = self.group.agree()
        except RankFailed as exc:
            raise self._fatal(exc) from None
        if worst is not Vote.OK:
            raise RankRefused("the session start", dissent)
        self.pools = tuple(pools)

    @consumes_on("ex")
    def execute(self, pool: PoolId, ex: Executor[Any], plan: Plan) -> Result:
        """Send ``plan`` for ``pool`` and run it on rank 0's shard with ``ex``."""
        self._check()
        index = self._index(pool)
        given: object = ex
        if not isinstance(given, Executor) or ex.gate is not self.gate or ex.pool.pool_id != pool:
            raise IRValidationError("TPLeader.execute", "ex", given, f"must be an Executor of pool {pool!r} built with gate=leader.gate")
        data = pack(self.step, plan)  # (a plan that cannot be packed is refused before anything is sent)
        try:
            self.group.send(Msg.PLAN, data, arg=index)
        except RankFailed as exc:
            raise self._fatal(exc) from None
        self.plan_bytes += len(data)
        self.gate.begin(self.step)
        try:
            out = ex.execute(plan)
            self.step += 1  # (numbers count accepted plans: a refused one's number is the next plan's)
            self.plans += 1
            return out
        except BaseException as exc:
            try:
                raised = _settle(self.group, self.gate, exc, type(plan).__name__)
            except RankFailed as failed:
                raise self._fatal(failed) from None
            self._fatal(raised)
            if raised is exc:
                raise
            raise raised from exc

    def send_raw(self, pool: PoolId, data: bytes) -> list[tuple[int, str]]:
        """Tests: send ``data`` as a plan message for ``pool`` without running anything here or
        advancing the step number, and return the workers' refusals. A message every worker
        accepts would run on their shards only, out of step with this rank: the group is then
        broken (``RankFailed``)."""
        self._check()
        try:
            self.group.send(Msg.PLAN, bytes(data), arg=self._index(pool))
            worst, refusals = self.group.agree()
        except RankFailed as exc:
            raise self._fatal(exc) from None
        if worst is Vote.OK:
            raise self._fatal(RankFailed(None, "the tensor-parallel group is out of step: the workers accepted a raw plan message "
                                                   "that rank 0 did not run"))
        return refusals

    def _index(self, pool: PoolId) -> int:
        if self.pools is None:
            raise RuntimeError("no tensor-parallel session is open (TPLeader.open_session)")
        if pool not in self.pools:
            raise IRValidationError("TPLeader", "pool", pool, f"is not a pool of the session ({list(self.pools)})")
        return self.pools.index(pool)

    def _request(self, kind: Msg, payload: bytes = b"", arg: int = 0) -> None:
        self._check()
        try:
            self.group.send(kind, payload, arg)
        except RankFailed as exc:
            raise self._fatal(exc) from None

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """The workers' token tables: slot ``dst``'s first ``length`` KV locations become ``src``'s
        (checked here against the session's sizes: a bad one would fail on the workers only)."""
        self._check()
        if self.pools is None:
            raise RuntimeError("no tensor-parallel session is open (TPLeader.open_session)")
        capacity, max_len = self._sizes
        for name, value, hi in (("src", src, capacity), ("dst", dst, capacity), ("length", length, max_len)):
            if int_problem(value) is not None or not 0 <= int(value) <= hi:
                raise IRValidationError("TPLeader.share_prefix", name, value, f"must be an int in [0, {hi}]")
        self._request(Msg.SHARE, json.dumps([int(src), int(dst), int(length)]).encode())

    def forget_verifies(self, pool: PoolId) -> None:
        """The workers' ``Executor.forget_verifies`` of ``pool`` (rank 0's own is the caller's)."""
        self._request(Msg.FORGET, arg=self._index(pool))

    def cancel_outstanding(self, reason: str) -> None:
        """Cancel, in every worker's ledger, every ticket admitted there that did not run, for ``reason``."""
        self._request(Msg.CANCEL, json.dumps(str(reason)).encode())

    def ping(self, payload: bytes = b"") -> None:
        """Tell the workers rank 0 is alive (they wait ``timeout_s`` for each message); they drop
        ``payload`` (a benchmark of the broadcast alone sends one)."""
        self._request(Msg.PING, bytes(payload))

    def arm_fault(self, rank: int, point: faults.FaultPoint, *, after: int = 0) -> None:
        """Tests: arm ``point`` on ``rank`` (``backend.faults``)."""
        if rank == 0:
            faults.arm(faults.FaultPoint(point), after=after)
        else:
            self._request(Msg.ARM, json.dumps([int(rank), faults.FaultPoint(point).value, int(after)]).encode())

    def close_session(self, ledger: Ledger) -> RankLedgers:
        """End the session: every rank's ledger counts (rank 0's from ``ledger``), gathered."""
        self._check()
        if self.pools is None:
            raise RuntimeError("no tensor-parallel session is open")
        pools, self.pools = self.pools, None
        try:
            self.group.send(Msg.CLOSE)
            gathered = self.group.gather_ints(_counts(ledger, pools))
        except RankFailed as exc:
            raise self._fatal(exc) from None
        return _rank_ledgers(pools, gathered)

    def shutdown(self) -> None:
        """Stop the workers (they return from ``serve_worker``) and leave the group; idempotent.
        Every later call raises."""
        if self.group.closed:
            return
        if self.group.broken is None:
            try:
                self.group.send(Msg.SHUTDOWN)
            except RankFailed:
                pass
        self.group.close()


class TPExecutor:
    """Rank 0's executor of one pool in a tensor-parallel group: each plan goes to the workers, then
    runs on ``executor`` (rank 0's shard; its ``gate`` is the leader's)."""

    def __init__(self, leader: TPLeader, executor: Executor[Any]) -> None:
        if executor.gate is not leader.gate:
            raise IRValidationError("TPExecutor", "executor", executor, "must be built with gate=leader.gate")
        self.leader = leader
        self.executor = executor
        self.pool_id = executor.pool.pool_id

    @property
    def ledger(self) -> Ledger:
        """Rank 0's ledger: its executor's (the engine's)."""
        return self.executor.ledger

    @property
    def pool(self) -> MambaStatePool:
        """Rank 0's shard of the pool."""
        return self.executor.pool

    @consumes
    def execute(self, plan: Plan) -> Result:
        """Run ``plan`` on every rank: sent to the workers, then run on rank 0's shard (``TPLeader.execute``)."""
        return self.leader.execute(self.pool_id, self.executor, plan)

    @consumes
    def submit(self, plan: Plan) -> Pending:
        """``backend.boundary.Backend.submit``: runs ``plan`` on every rank now; a refusal
        (``BatchcError``) and a failed rank (``RankFailed``) are raised here, a fault by ``wait``."""
        return run_now(self.execute, plan, raised=(RankFailed,))

    def wait(self, pending: Pending) -> Result:
        """``backend.boundary.Backend.wait``: the result of a plan ``submit`` ran, or the fault it raised."""
        return pending.outcome()

    @property
    def usable(self) -> bool:
        """False once the group is broken or shut down."""
        return self.leader.group.broken is None and not self.leader.group.closed

    def forget_verifies(self) -> None:
        """Drop the kept verify and draft states of this pool on rank 0 and on every worker."""
        self.executor.forget_verifies()
        self.leader.forget_verifies(self.pool_id)


class TPBackends(InProcessGroup):
    """``backend.boundary.Backends`` of rank 0 of a tensor-parallel group, for one session (rank 0's
    executors run in this process, each plan on every rank within ``submit``)."""

    def __init__(self, leader: TPLeader, ledger: Ledger, executors: list[TPExecutor], hooks: list[ServingModelHook[Any] | HeadHook]) -> None:
        super().__init__(executors)
        self.leader, self._ledger, self._hooks = leader, ledger, hooks

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Every rank's token tables (rank 0's hooks here, the workers' by message): slot ``dst``'s first
        ``length`` KV locations become ``src``'s."""
        for hook in self._hooks:
            hook.share_prefix(src, dst, length)
        self.leader.share_prefix(src, dst, length)

    def cancel_outstanding(self, reason: str) -> None:
        """Cancel the tickets still outstanding in the workers' ledgers (one request for every pool)."""
        self.leader.cancel_outstanding(reason)  # one request cancels them on every worker, every pool

    def close(self) -> RankLedgers | None:
        """End the session, gathering every rank's ledger counts (None if the group is broken or
        the session was ended already)."""
        leader = self.leader
        if leader.pools is None or leader.group.broken is not None or leader.group.closed:
            return None
        return leader.close_session(self._ledger)


class TensorParallel:
    """The ``backend.boundary.Transport`` of rank 0 of a tensor-parallel group: every plan runs on
    every rank (``TPLeader``); the models an engine is given are rank 0's shards."""

    def __init__(self, leader: TPLeader) -> None:
        if not isinstance(leader, TPLeader):
            raise IRValidationError("TensorParallel", "leader", leader, "must be a backend.tp.TPLeader")
        self.leader = leader

    def __repr__(self) -> str:
        return f"TensorParallel(world={self.leader.world})"

    def refusal(self, models: Mapping[PoolId, ServedModel[Any]], *, retries: int) -> str | None:
        """Why the group cannot serve ``models`` (one line), or None: retries are refused (a failed rank is
        fatal to the group), as is a leader whose session another engine holds, and any model that is not
        rank 0's shard (or a draft head)."""
        if retries:
            return f"tp with retries {retries}: a forward that fails on a rank is fatal to the group, never retried"
        if self.leader.pools is not None:
            return "tp: the leader's session is in use by another engine (close that engine first)"
        for pool, model in models.items():
            try:
                check_shard(model, pool, 0, self.leader.world)
            except ValueError as exc:
                return f"tp: {exc}"
        return None

    def open(
        self, models: Mapping[PoolId, ServedModel[Any]], *, ledger: Ledger, slots: SlotAllocator, capacity: int, kv_capacity: int,
        max_len: int, retries: int, penalties: bool = False,
    ) -> TPBackends:
        """Open the group's session (the workers build their pools), then rank 0's executors; if
        those cannot be built, the session ends."""
        leader = self.leader
        leader.open_session(models, capacity=capacity, kv_capacity=kv_capacity, max_len=max_len, transactional=False, penalties=penalties)
        try:
            executors: list[TPExecutor] = []
            hooks: list[ServingModelHook[Any] | HeadHook] = []
            hidden = _hidden_store(models)
            for pool, model in models.items():
                hook = model.serving_hook(capacity=capacity, kv_capacity=kv_capacity, max_len=max_len)
                hooks.append(hook)
                # (every rank keeps the target's token counts and updates them alike: the logits it
                # samples from are the whole vocabulary's on every rank)
                state = model.new_pool(capacity, pool_id=pool)
                counts = token_counts(state, model.vocab) if penalties else None
                executors.append(TPExecutor(leader, Executor(state, ledger, hook, slots=slots, gate=leader.gate, counts=counts, hidden=hidden)))
        except BaseException:
            if leader.pools is not None and leader.group.broken is None and not leader.group.closed:
                leader.close_session(ledger)
            raise
        return TPBackends(leader, ledger, executors, hooks)


# -- the workers -------------------------------------------------------------------------------


def check_shard(model: object, pool: PoolId, rank: int, world: int) -> str:
    """``ValueError`` unless ``model`` is rank ``rank``'s shard of ``world`` (``shard_model``) or a
    draft head, which every rank holds whole (its layers are small and it reads the target's hidden
    states, which every rank has whole after the target's last all-reduce: its phases issue no
    collective); returns the fingerprint every rank's must equal."""
    if isinstance(model, HeadModel):
        return head_fingerprint(model)
    if not isinstance(model, HybridModel) or model.origin is None:
        raise ValueError(f"the {pool} model must be a shard cut by backend.tp.shard_model, got {short_repr(model)}")
    if (model.origin.rank, model.origin.world) != (rank, world):
        raise ValueError(f"the {pool} model is the shard of rank {model.origin.rank} of {model.origin.world}, "
                         f"not of rank {rank} of {world}")
    return model.origin.fingerprint


def _hidden_store(models: Mapping[PoolId, object]) -> HiddenStore | None:
    """One store the target's and the head's executors share on a rank, with a head among ``models``."""
    heads = any(isinstance(m, ReadsTargetHidden) and m.reads_target_hidden() for m in models.values())
    return HiddenStore() if heads else None


class _Session:
    def __init__(self, group: TPGroup, gate: TPGate, models: Mapping[PoolId, HybridModel | HeadModel], cfg: dict[str, Any]) -> None:
        self.pools: tuple[PoolId, ...] = tuple(cfg["pools"])
        self.ledger = Ledger()
        self.ledger.trust_peer(int(cfg["epoch"]), "tensor-parallel rank 0")
        self.hooks: list[ServingModelHook[Any] | HeadHook] = []
        self.executors: list[Executor[Any]] = []
        hidden = _hidden_store(models)
        for pool in self.pools:
            if pool not in models:
                raise ValueError(f"rank {group.rank} has no model for pool {pool!r} (it has {sorted(models)})")
            model = models[pool]
            mine = check_shard(model, pool, group.rank, group.world)
            if mine != cfg["origins"][pool]:
                raise ValueError(f"rank {group.rank}'s {pool} model is not rank 0's (fingerprint {mine}, "
                                 f"rank 0's {cfg['origins'][pool]}): another checkpoint, seed or dtype")
            hook = model.serving_hook(capacity=cfg["capacity"], kv_capacity=cfg["kv_capacity"], max_len=cfg["max_len"])
            self.hooks.append(hook)
            state = model.new_pool(cfg["capacity"], pool_id=pool)
            counts = token_counts(state, model.vocab) if cfg.get("penalties") else None
            self.executors.append(Executor(state, self.ledger, hook, transactional=bool(cfg["transactional"]), gate=gate, counts=counts,
                                           hidden=hidden))


class _Worker:
    def __init__(self, group: TPGroup, models: Mapping[PoolId, HybridModel | HeadModel]) -> None:
        self.group = group
        self.models = models
        self.gate = TPGate(group)
        self.expected = 0
        self.session: _Session | None = None
        self.sessions: list[RankLedgers] = []

    def _open(self) -> _Session:
        if self.session is None:
            raise RankFailed(0, "sent a request outside a session")
        return self.session

    def serve(self) -> None:
        while True:
            try:
                kind, arg, data = self.group.receive()
            except RankFailed as exc:  # rank 0 went silent or away: say so where rank 0 looks, if it still can
                self.group.report_fault(f"gave up waiting for rank 0's next message: {exc}")
                raise
            if kind is Msg.SHUTDOWN:
                return
            try:
                self._handle(kind, arg, data)
            except RankFailed:
                raise
            except BaseException as exc:  # a request that is not a plan failed here: a bug, fatal
                cause = f"failed: {one_line(exc)} handling {kind.name}"
                self.group.report_fault(cause)
                raise RankFailed(self.group.rank, cause) from exc

    def _handle(self, kind: Msg, arg: int, data: bytes) -> None:
        match kind:
            case Msg.START:
                try:
                    session = _Session(self.group, self.gate, self.models, json.loads(data))
                except Exception as exc:  # noqa: BLE001 - refused, with the reason, at the start's agreement
                    self.group.agree(Vote.REFUSED, one_line(exc))
                    return
                if self.group.agree()[0] is Vote.OK:
                    self.session = session
            case Msg.PLAN:
                self._plan(arg, data)
            case Msg.SHARE:
                src, dst, length = json.loads(data)
                for hook in self._open().hooks:
                    hook.share_prefix(src, dst, length)
            case Msg.FORGET:
                self._open().executors[arg].forget_verifies()
            case Msg.CANCEL:
                ledger = self._open().ledger
                for t in ledger.outstanding():
                    ledger.cancel(t, json.loads(data))
            case Msg.CLOSE:
                session = self._open()
                self.session = None
                self.sessions.append(_rank_ledgers(session.pools, self.group.gather_ints(_counts(session.ledger, session.pools))))
            case Msg.ARM:
                rank, point, after = json.loads(data)
                if rank == self.group.rank:
                    faults.arm(faults.FaultPoint(point), after=after)
            case Msg.PING | Msg.SHUTDOWN:
                pass

    def _plan(self, index: int, data: bytes) -> None:
        self.gate.begin(self.expected)
        name = "plan"
        try:
            session = self._open()
            message = unpack(data, expect_step=self.expected)
            name = type(message.plan).__name__
            if not 0 <= index < len(session.executors):
                raise WireError(f"pool index {index} outside the session's {len(session.executors)} pools")
            ex = session.executors[index]
            session.ledger.register(plan_tickets(message.plan, ex.pool.pool_id))
            ex.execute(message.plan)
            self.expected += 1
        except BaseException as exc:
            out = _settle(self.group, self.gate, exc, name)
            if isinstance(out, RankFailed):
                raise out from exc
            # otherwise refused by some rank before anything ran: serve on


def serve_worker(group: TPGroup, models: Mapping[PoolId, HybridModel | HeadModel]) -> list[RankLedgers]:
    """A worker rank: serve rank 0's sessions on ``models`` (this rank's shard of each pool's model,
    a draft head whole)
    until rank 0 shuts the group down; returns each session's gathered ledger counts. Raises
    ``RankFailed`` when this rank fails (its cause is left for rank 0 first) or the group does."""
    given: object = group
    if not isinstance(given, TPGroup) or group.rank == 0:
        raise IRValidationError("serve_worker", "group", given, "must be a worker's TPGroup (rank >= 1)")
    worker = _Worker(group, models)
    worker.serve()
    return worker.sessions


__all__ = ["LedgerCounts", "RankLedgers", "TPBackends", "TPExecutor", "TPGate", "TPLeader", "TensorParallel", "check_shard", "serve_worker"]
