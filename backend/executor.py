"""The executor: consumes plans on the one state pool it owns.

Failures (the fault points of ``backend.faults`` in tests): an init or snapshot launch that fails
restores the rows it wrote and its ticket stays outstanding. A ``transactional`` executor treats
each whole forward (init ops, model, snapshot; or a commit) as one unit: if anything in it fails,
every row the forward could have written is restored and every ticket is outstanding again, so the
same plan can be executed again and gives the output of a run without the fault; this costs one
copy of the plan's rows per forward. A non-transactional executor consumes the init ticket as soon
as its ops are applied; a failing forward then leaves its requests' state undefined and the driver
must abort them.

In-place mutation detector (``watch``, on by default at ``BATCHC_VERIFY=2``): the executor stamps
the pool (its version counter and a hash of its bytes in order, so a row swap or +d/-d in two rows
shows) after every plan and checks the stamp before the next, so a write to the pool by code other
than the executor's ops and model hook is reported with the pool's name; and around each model-hook
call it compares every staged tensor and every plan column with a copy taken before (by content:
Triton stores do not bump ``_version``), so a hook that writes its inputs is reported by name.

Speculative plans: a ``VerifyPlan`` leaves its intermediate states with the executor under the
verify's id, bound to the rows and window it ran on, and exactly one ``CommitPlan`` naming that id
and those same slots (in the same order) with the same ``k`` consumes them (a second commit, a commit
of a verify that never ran on this pool, or one naming other slots, is refused before touching the
pool). Until that commit no other plan runs over those rows on this pool (a decode, a prefill, a
draft or another verify there would start from the state before the verify, and the commit would
later overwrite what it wrote: refused, naming the slot and the verify). A ``DraftPlan`` leaves its
proposal's per-step states the same way under the draft's id, for exactly one ``DraftCommitPlan``;
they live until that commit or the next draft on this pool (an engine that catches its draft up
with a ``DraftExtendPlan`` never commits them, and keeps at most one draft's states). A commit
never takes a draft's states, nor a draft commit a verify's.
A ``DraftPlan`` returns its ``Proposals`` (``ir.spec``), kept with its states: the draft commit is
refused unless the window it commits holds exactly those proposals (a verify of other tokens would
leave the draft's state matching no sequence). A ``VerifyPlan`` names the draft whose proposals it
checks, and each draft's proposals are verified once on a pool (in the order drafts were minted).

Per plan, in this order: (1) check that the plan fits this backend (its tickets name this pool,
every slot an op names, the init ops' COW sources included, is in range and, with an allocator
attached, live; each op's slots relate to the plan's rows as its kind declares, ``ir.init.OpDecl``:
an init writes only rows of the plan and reads none, a snapshot reads rows of the plan and writes
none of them; no decode row feeds a request's first token, which only a prefill starts from its
clear; no row holds a verify's states that wait for their commit), raising ``PlanExecutionError``
or ``SlotError`` before anything is touched; (2) stage the plan's
columns into tensors; (3) claim every ticket of the plan (init and snapshot) through the ledger,
which refuses a replayed, unknown or forged ticket (``ResourceReplayError``, ``UnknownTicketError``,
``TicketMismatchError``) before the model runs; (4) apply the registered ops that run before the
forward (``backend.state_init.apply_op``; an init: clears, then copies); (5) call the model hook;
(6) apply the registered ops that run after it (the snapshots, copying the requests' new states
into their cache slots; a snapshot inside a chunk copies the state the hook captured there, into a
scratch pool the executor keeps: ``backend.staging.Captures``).

A prefill plan whose tickets do not include this executor's pool is refused: it was lowered for
other pools, and running it here would skip this pool's init ops. A ticket whose ops fail midway
is returned to the ledger as outstanding. There is no path that applies an init op without
consuming its ticket, and what is applied is the registered ticket's ops.

A ``gate`` (a tensor-parallel rank's; ``backend.tp``) is told twice per plan: ``validated`` once the
plan's checks and ticket claims passed and before anything is written (between (3) and (4); the
ranks agree there that every rank accepted the plan), and ``applied`` once it ran, before its
tickets count as consumed (the ranks agree there that every rank applied it). With a gate, an init
ticket is consumed with the rest of the plan's tickets at ``applied``, never early.

Token counts (``counts``, a ``backend.counts.TokenCounts``; the target's executor of an engine that
serves penalties): every op applied to the pool is applied to the counts too, on the same claimed
ticket (``backend.state_init.apply_counts_op``); an extend forward marks its input tokens as the
prompt's, a decode forward counts its input (the token generated at ``P - 1``) before sampling at
``P``, a verify reads the counts plus its window's input ``0`` and proposals
(``backend.sampling.window_counts``) and changes nothing, and its commit counts the window inputs it
commits. The rows a forward restores on failure (transactional) include their counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Generic, Never, NoReturn, Protocol, TypeAlias, cast, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt
import torch

from backend import faults
from backend.allocator import SlotAllocator
from backend.boundary import Pending, run_now
from backend.counts import TokenCounts
from backend.hidden_store import HiddenStore
from backend.ledger import Claim, Ledger
from backend.logprobs import logprobs_of
from backend.model import CapturesInnerStates, ForwardPlan, HeadHook, KeepsHidden, ModelHook, NoOpModel, SpecModelHook, VerifyStateT
from backend.plan_sampling import Counts, penalised, sample_logits, verify_tokens
from backend.pool import MambaStatePool
from backend.sampling import sample
from backend.staging import Captures, StagedDecode, StagedExtend, StagedWindow, stage_decode, stage_extend, stage_window
from backend.state_init import apply_counts_op, apply_op, restoring
from backend.state_store import check_fresh_rows, own_tickets
from ir.columns import I64, frozen_i64
from ir.errors import IRValidationError, MutationError, PlanExecutionError
from ir.head import HeadCommitPlan, HeadExtendPlan
from ir.hidden import HiddenStates, asked_hidden
from ir.ids import DraftId, PoolId, SampleId, VerifyId
from ir.init import SERIAL_COUNTER_BITS, Op, Ticket, When, op_when, serial_epoch
from ir.linear import consumes
from ir.nodes import Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.results import Ran, Result, Sampled, Verified
from ir.sampling import SamplingRows, rows_joined
from ir.spec import CommitPlan, DraftCommitPlan, DraftExtendPlan, DraftPlan, Proposals, VerifyPlan
from ir.verify import VerifyLevel, verify_level_from_env

__all__ = ["AnyExecutor", "Executor", "Gate"]

Staged: TypeAlias = StagedExtend | StagedDecode | StagedWindow


_NO_TOKENS = frozen_i64([])
_NOTHING = nullcontext()
"""A context that does nothing (reusable: one object for every unwatched, non-transactional call)."""

@runtime_checkable
class Gate(Protocol):
    """Where an executor's plan meets the other ranks of a tensor-parallel group (see the module).
    Each is called at least once per plan, in this order; calls after the first are no-ops."""

    def validated(self, plan: str) -> None:
        """Every check of ``plan`` passed here and nothing is written yet; raises if another rank
        refused it (then nothing runs anywhere)."""
        ...

    def applied(self, plan: str) -> None:
        """``plan`` ran here; raises if another rank did not get there (its tickets stay
        outstanding)."""
        ...




@attrs.frozen(kw_only=True, eq=False)
class _Kept(Generic[VerifyStateT]):
    """What a verify (or a draft proposal) left on this pool for its commit: the rows and window it
    ran on, and the model's per-position states."""

    phase: str
    """``"verify"`` or ``"draft"``: which commit may take them."""
    slots: bytes
    k: int
    states: VerifyStateT
    proposed: bytes = b""
    """A draft's proposals (int64, row-major): the draft commit's window must hold exactly these."""


class Executor(Generic[VerifyStateT]):
    """Runs plans on the one state pool it owns; ``VerifyStateT`` is what its model's verify keeps
    for the commit.

    The in-process ``backend.boundary.Backend``: ``submit`` runs a plan at once, ``execute`` runs
    one and returns its result, and the ``run_*`` methods are the typed entry points per plan kind
    (each refuses any other kind with ``PlanExecutionError``). Every plan is checked against this
    pool, its tickets claimed through the ``ledger`` and its init ops applied exactly once, then the
    model hook runs (the module docstring gives the order and the failure rules). ``transactional``
    restores every row a failed forward could have written; ``watch`` reports writes to the pool
    from outside the executor and hooks that write their inputs (``MutationError``)."""

    def __init__(
        self,
        pool: MambaStatePool,
        ledger: Ledger,
        model: ModelHook | SpecModelHook[VerifyStateT] | HeadHook | None = None,
        *,
        slots: SlotAllocator | None = None,
        transactional: bool = False,
        watch: bool | None = None,
        gate: Gate | None = None,
        counts: TokenCounts | None = None,
        hidden: HiddenStore | None = None,
    ) -> None:
        """Arguments are checked before anything is kept (``IRValidationError`` naming
        ``Executor.<argument>`` and the value): ``pool`` a ``MambaStatePool``, ``ledger`` a
        ``Ledger``, ``model`` ``None`` or a ``ModelHook`` (an object with a ``forward``), ``slots``
        ``None`` or a ``SlotAllocator``, ``transactional`` a ``bool``, ``watch`` a ``bool`` or
        ``None`` (0, 1 and ``'no'`` are not switches), ``gate`` ``None`` or a ``Gate``, ``counts``
        ``None`` or a ``TokenCounts`` of the pool's capacity (the penalties' state, module), ``hidden``
        ``None`` or the ``HiddenStore`` the target's executor and a draft head's share (module)."""
        from ir.columns import check_instance  # (imported here: this method's checks only)

        check_instance("Executor", "pool", pool, MambaStatePool)
        check_instance("Executor", "ledger", ledger, Ledger)
        if not isinstance(model, HeadHook):
            check_instance("Executor", "model", model, ModelHook, optional=True)  # the protocol check, once
        check_instance("Executor", "slots", slots, SlotAllocator, optional=True)
        check_instance("Executor", "transactional", transactional, bool)
        check_instance("Executor", "watch", watch, bool, optional=True)
        check_instance("Executor", "gate", gate, Gate, optional=True)
        check_instance("Executor", "counts", counts, TokenCounts, optional=True)
        check_instance("Executor", "hidden", hidden, HiddenStore, optional=True)
        if counts is not None and counts.capacity != pool.capacity:
            raise IRValidationError(
                "Executor", "counts", counts, f"the token counts' capacity {counts.capacity} differs from the pool's {pool.capacity}"
            )
        if slots is not None and slots.capacity != pool.capacity:
            raise IRValidationError(
                "Executor", "slots", slots, f"the slot allocator's capacity {slots.capacity} differs from the pool's {pool.capacity}"
            )
        self.pool = pool
        self.counts = counts
        self.hidden = hidden
        self.transactional = transactional
        self.watch = watch if watch is not None else verify_level_from_env() is VerifyLevel.EVERY_PASS
        self._seen: tuple[int, bytes] | None = None
        self.ledger = ledger
        self.gate = gate
        self.model = model if model is not None else NoOpModel()
        self.slots = slots
        self._slots_ok: tuple[bytes, int] | None = None
        """The last slots column found in range and live, with the allocator's generation then."""
        self._intermediates: dict[DraftId | VerifyId, _Kept[VerifyStateT]] = {}
        """Kept states by the id of the draft or verify that computed them (one minter: never equal)."""
        self._verified_upto: dict[int, int] = {}
        self._checked_drafts_upto: dict[int, int] = {}
        """Per minting epoch, the newest draft whose proposals a verify on this pool checked: each
        draft's proposals are verified once, in the order the drafts were minted."""
        self._kept_draft: DraftId | None = None
        """The draft whose states are kept (at most one: a newer draft drops them)."""
        self._capture_pool: MambaStatePool | None = None
        """Scratch rows for the states a forward captures inside its chunks (``_captures``)."""
        self._samples: dict[int, tuple[SampleId, int]] = {}
        """Per slot, the greedy token the last decode with a ``sample_id`` left there (and that id),
        until a pipelined decode uses it."""

    @property
    def model(self) -> ModelHook | HeadHook:
        """The model hook (``NoOpModel`` when none was given); replacing it re-checks its kind."""
        return self._model

    @model.setter
    def model(self, hook: ModelHook | HeadHook) -> None:
        self._model = hook
        self._head: HeadHook | None = hook if isinstance(hook, HeadHook) else None
        # the runtime-protocol check, once per hook rather than once per speculative plan
        self._spec_hook: SpecModelHook[VerifyStateT] | None = (
            cast("SpecModelHook[VerifyStateT]", hook) if isinstance(hook, SpecModelHook) else None
        )
        self._keeps_hidden: KeepsHidden | None = hook if isinstance(hook, KeepsHidden) else None
        self._forward_hook: ModelHook | None = hook if isinstance(hook, ModelHook) else None
        """``None`` for a draft head's hook, which runs its own phases and never the target's plans."""

    @property
    def pool_id(self) -> PoolId:
        """The id of the pool this executor owns; a plan's tickets must name it."""
        return self.pool.pool_id

    @property
    def usable(self) -> bool:
        """An in-process executor can always run plans."""
        return True

    @property
    def kept_states(self) -> tuple[DraftId | VerifyId, ...]:
        """The drafts and verifies whose states this executor keeps for a commit not run yet, in
        the order they ran (at most one draft's: a newer draft drops them; ``forget_verifies``
        drops all). Empty between speculative iterations."""
        return tuple(self._intermediates)

    @consumes
    def submit(self, plan: Plan) -> Pending:
        """``backend.boundary.Backend.submit``: runs ``plan`` now; a refusal (``BatchcError``) is
        raised here, any other failure by ``wait``."""
        return run_now(self.execute, plan)

    def wait(self, pending: Pending) -> Result:
        """``backend.boundary.Backend.wait``: the result of a plan ``submit`` ran, or the failure it raised."""
        return pending.outcome()

    @consumes
    def execute(self, plan: Plan) -> Result:
        """Run ``plan`` and give back its result (``ir.results``; the tokens chosen by
        ``backend.sampling``)."""
        if not self.watch:
            out = self._execute(plan)
        else:
            self._check_pool_untouched()
            try:
                out = self._execute(plan)
            finally:
                self._seen = self._pool_stamp()
        if self.gate is not None:  # plans that reached neither point on their way (an idle plan)
            self.gate.validated(type(plan).__name__)
            self.gate.applied(type(plan).__name__)
        return out

    def _validated(self, plan: Plan) -> None:
        if self.gate is not None:
            self.gate.validated(type(plan).__name__)

    def _execute(self, plan: Plan) -> Result:
        match plan:
            case ExtendPlan() | MixedPlan():
                return self.run_prefill(plan)
            case DecodePlan():
                return self.run_decode(plan)
            case DraftPlan():
                return self.run_draft(plan)
            case VerifyPlan():
                return self.run_verify(plan)
            case CommitPlan():
                self.run_commit(plan)
                return Ran(rids=plan.batch.rids)
            case DraftCommitPlan():
                self.run_draft_commit(plan)
                return Ran(rids=plan.batch.rids)
            case DraftExtendPlan():
                return self.run_draft_extend(plan)
            case IdlePlan():
                return Ran(rids=plan.rids)
            case HeadExtendPlan():
                self.run_head_extend(plan)
                return Ran(rids=plan.rids)
            case HeadCommitPlan():
                self.run_head_commit(plan)
                return Ran(rids=plan.batch.rids)
            case _:
                _not_a_plan(plan)

    @consumes
    def run_prefill(self, plan: ExtendPlan | MixedPlan) -> Sampled:
        """Run an ``ExtendPlan`` or a ``MixedPlan``: claim its tickets for this pool, apply its init ops,
        run the model hook over the chunk (and, mixed, the decode rows), apply its snapshots, and sample
        one token per row (extend rows first, then decode rows). Refuses a plan lowered for other pools,
        a row that starts at token 0 without a clear in the plan's init, and any other plan kind."""
        if not isinstance(plan, (ExtendPlan, MixedPlan)):
            _wrong_plan("run_prefill", plan, "an ExtendPlan or a MixedPlan")
        ext = plan if isinstance(plan, ExtendPlan) else plan.extend
        self._check_slots(ext.slots, type(plan).__name__)
        rows = ext.slots.tolist()
        decode: StagedDecode | None = None
        if isinstance(plan, MixedPlan):
            self._check_slots(plan.decode.slots, "MixedPlan.decode")
            _check_not_first(plan.decode, "MixedPlan.decode")
            rows += plan.decode.slots.tolist()
        self._check_committed(rows, type(plan).__name__)
        tickets = self._own_tickets(ext, frozenset(rows))
        if isinstance(plan, MixedPlan):
            decode = stage_decode(plan.decode, self.pool.device, self._inputs(plan.decode, "MixedPlan.decode"))
        extend: StagedExtend = stage_extend(ext, self.pool.device)
        captures = self._captures(plan, ext)
        if captures is not None:
            extend = attrs.evolve(extend, captures=captures)
        keeps = asked_hidden(plan)
        hidden: list[torch.Tensor] = []

        def forward() -> torch.Tensor:
            self._count_inputs(extend, decode)
            if keeps is None:
                return self._forward(plan, extend, decode)
            logits, states = self._keeping_hidden(plan).forward_keeping_hidden(plan, extend, decode, self.pool)
            hidden.append(states)
            return self._checked_logits(plan, logits, extend, decode)

        out = self._extend_unit(plan, ext, rows, tickets, captures, forward)
        if keeps is not None:
            self._store(plan).keep(keeps, hidden[-1])  # (after the whole unit: a failed forward keeps nothing)
        return self._prefill_sampled(plan, out, keeps)

    def _extend_unit(
        self, plan: ExtendPlan | MixedPlan | HeadExtendPlan, ext: ExtendPlan | HeadExtendPlan, rows: list[int], tickets: list[Ticket[Op]],
        captures: Captures | None, forward: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """Claim the plan's tickets, apply its init ops, run ``forward``, apply its snapshots: one
        unit (module, steps 3 to 6)."""
        # Every ticket of the plan is claimed before the model runs, so a replayed plan (whatever
        # tickets it carries: init, snapshot or both) is refused with the pool untouched; what runs
        # are the registered tickets' ops (the claim checked that the plan's copies equal them).
        if not self.transactional:
            # the init ticket is consumed once its ops are applied; a failing forward then leaves
            # its requests' state undefined (the driver aborts them) and its snapshot outstanding
            with self.ledger.claiming(tickets, self.pool.pool_id, rows, type(plan).__name__) as claim:
                check_fresh_rows(plan, ext, claim.tickets, claim.starts)
                self._validated(plan)
                for t in claim.tickets:
                    if op_when(t.op) is When.BEFORE:
                        self._apply(t.op)
                        if self.gate is None:
                            claim.done(t)
                out = forward()
                faults.check(faults.FaultPoint.MODEL_FORWARD)
                self._after(claim, captures)
                if self.gate is not None:
                    self.gate.applied(type(plan).__name__)
            return out
        # transactional: the whole forward is one unit; on failure every row it wrote is restored
        # and every ticket is outstanding again, so the same plan can simply be executed again
        with self._restoring(rows), self.ledger.claiming(tickets, self.pool.pool_id, rows, type(plan).__name__) as claim:
            check_fresh_rows(plan, ext, claim.tickets, claim.starts)
            self._validated(plan)
            for t in claim.tickets:
                if op_when(t.op) is When.BEFORE:
                    self._apply(t.op)
            out = forward()
            faults.check(faults.FaultPoint.MODEL_FORWARD)
            self._after(claim, captures)
            if self.gate is not None:
                self.gate.applied(type(plan).__name__)
        return out

    # -- a draft head's phases (``ir.head``): they read the target's hidden states ----------------

    def _head_hook(self, plan: Plan) -> HeadHook:
        if self._head is None:
            raise PlanExecutionError(f"{type(plan).__name__} is a draft head's phase; this executor's model hook {type(self.model).__name__} is no HeadHook")
        return self._head

    def _store(self, plan: Plan) -> HiddenStore:
        if self.hidden is None:
            raise PlanExecutionError(
                f"{type(plan).__name__} keeps or reads hidden states, and the executor of pool {self.pool.pool_id!r} shares no hidden store "
                "(no draft head is served beside it in this process)"
            )
        return self.hidden

    def _keeping_hidden(self, plan: Plan) -> KeepsHidden:
        if self._keeps_hidden is None:
            raise PlanExecutionError(f"{type(plan).__name__} asks for hidden states; the model hook {type(self.model).__name__} hands back none")
        return self._keeps_hidden

    @consumes
    def run_head_extend(self, plan: HeadExtendPlan) -> None:
        """The head's extend over a target prefill chunk: its init ops and snapshots for this pool, as
        a prefill's (claimed through the ledger, applied once), and the head over the chunk's tokens
        with the target's hidden states there, taken from the store (once)."""
        if not isinstance(plan, HeadExtendPlan):
            _wrong_plan("run_head_extend", plan, "a HeadExtendPlan")
        head = self._head_hook(plan)
        store = self._store(plan)
        self._check_slots(plan.slots, "HeadExtendPlan")
        rows = plan.slots.tolist()
        tickets = self._own_tickets(plan, frozenset(rows))
        extend: StagedExtend = stage_extend(plan, self.pool.device)
        captures = self._captures(plan, plan)
        if captures is not None:
            extend = attrs.evolve(extend, captures=captures)
        hidden = store.read_extend(plan)  # (refused before any ticket is claimed: nothing written)

        def forward() -> torch.Tensor:
            with self._watched("the head hook's extend", plan, extend):
                return self._checked_logits(plan, head.extend(extend, hidden, self.pool), extend, None)

        self._extend_unit(plan, plan, rows, tickets, captures, forward)
        store.taken(plan.hidden_id)

    @consumes
    def run_head_commit(self, plan: HeadCommitPlan) -> None:
        """The head's catch-up over a speculative iteration's committed tokens, with the verify's
        hidden states at those window positions (taken from the store, once); no init ops."""
        if not isinstance(plan, HeadCommitPlan):
            _wrong_plan("run_head_commit", plan, "a HeadCommitPlan")
        head = self._head_hook(plan)
        store = self._store(plan)
        self._check_rows(plan.batch.slots, "HeadCommitPlan")
        staged = stage_extend(plan.batch, self.pool.device)
        hidden = store.read_commit(plan)
        self._validated(plan)
        with self._unit(plan.batch.slots):
            with self._watched("the head hook's extend", plan, staged):
                self._checked_logits(plan, head.extend(staged, hidden, self.pool), staged, None)
            faults.check(faults.FaultPoint.MODEL_FORWARD)
        store.taken(plan.batch.hidden_id)
        if self.gate is not None:
            self.gate.applied(type(plan).__name__)

    def _prefill_sampled(self, plan: ExtendPlan | MixedPlan, logits: torch.Tensor, hidden: HiddenStates | None) -> Sampled:
        """``_sampled`` for a prefill: the tokens are the extend rows', then (mixed) the decode rows'.
        With a ``sample_id`` the extend part keeps the first token of every row it completes."""
        ext = plan if isinstance(plan, ExtendPlan) else plan.extend
        n = ext.num_requests
        positions = ext.prefix_lens + ext.extend_lens  # (each row's first new token's position)
        rows = ext.sampling
        if isinstance(plan, MixedPlan):
            rows = rows_joined(rows, n, plan.decode.sampling, plan.decode.num_requests)
            positions = np.concatenate((positions, plan.decode.seq_lens))
        slots = ext.slots if not isinstance(plan, MixedPlan) else np.concatenate((ext.slots, plan.decode.slots))
        tokens = sample_logits(logits, rows, frozen_i64(positions), counts=self._count_rows(rows, slots))
        logprobs = logprobs_of(logits, tokens, rows)
        if isinstance(plan, MixedPlan):
            self._sampled(plan.decode, tokens[n:])
        if ext.sample_id is not None:
            for slot, token, more in zip(ext.slots.tolist(), _inputs_of(tokens[:n]), ext.more_chunks.tolist(), strict=True):
                if not more:
                    self._samples[slot] = (ext.sample_id, token)
        return Sampled(rids=plan.rids, tokens=tokens, logprobs=logprobs, hidden=hidden)

    def _after(self, claim: Claim, captures: Captures | None = None) -> None:
        """The ops that run after the forward (the prefix cache's snapshots)."""
        for t in claim.tickets:
            if op_when(t.op) is When.AFTER:
                self._apply(t.op, captures)

    def _captures(self, plan: ExtendPlan | MixedPlan | HeadExtendPlan, ext: ExtendPlan | HeadExtendPlan) -> Captures | None:
        """The states this pool's snapshot takes inside a chunk (``MambaSnapshot.at`` below its
        request's ``extend_len``), for the hook to capture into a scratch pool; ``None`` if none."""
        t = ext.snapshot_for(self.pool.pool_id)
        if t is None or not t.op.at:
            return None
        op = t.op
        rows = {slot: i for i, slot in enumerate(ext.slots.tolist())}
        lens = ext.extend_lens.tolist()
        inner: list[int] = []
        for j, (src, at) in enumerate(zip(op.src, op.at, strict=True)):
            row = rows.get(src)
            if row is not None and at > lens[row]:
                raise PlanExecutionError(f"{type(plan).__name__}: snapshot #{op.serial} at {at} past the {lens[row]} tokens of slot {src}'s chunk")
            if row is not None and at < lens[row]:
                inner.append(j)  # (a source that is no row of the plan: the ledger's claim refuses it)
        if not inner:
            return None
        model = self.model
        if not (isinstance(model, CapturesInnerStates) and model.captures_inner_states()):
            raise PlanExecutionError(
                f"{type(plan).__name__}: snapshot #{op.serial} is taken inside a chunk, and the model hook {type(model).__name__} captures no inner states"
            )
        if self._capture_pool is None or self._capture_pool.capacity < len(inner):
            self._capture_pool = MambaStatePool(self.pool.pool_id, self.pool.layout, max(len(inner), 8), device=self.pool.device)
        return Captures(
            seq=tuple(rows[op.src[j]] for j in inner), at=tuple(op.at[j] for j in inner), entries=tuple(inner), into=self._capture_pool,
        )

    def _apply(self, op: Op, captures: Captures | None = None) -> None:
        """``op`` on the counts (idempotent: see ``backend.state_init``), then on the pool."""
        if self.counts is not None:
            apply_counts_op(self.counts, op)
        apply_op(self.pool, op, captures)

    def _count_inputs(self, extend: StagedExtend | None, decode: StagedDecode | None) -> None:
        """An extend's inputs are prompt tokens; a decode's input is the token generated before the
        one it samples (module docstring)."""
        if self.counts is None:
            return
        if extend is not None:
            self.counts.prompt(extend.slots, extend.cu_seqlens.diff(), extend.input_ids)
        if decode is not None:
            self.counts.feed(decode.slots, decode.input_ids)

    def _count_rows(self, rows: SamplingRows | None, slots: npt.NDArray[np.int64]) -> Counts | None:
        """The counts of ``slots`` when some row has a penalty (else the sampler needs none)."""
        if self.counts is None or not penalised(rows):
            return None
        return self.counts.rows(torch.from_numpy(np.array(slots, dtype=np.int64)))  # (a copy: IR columns are read-only)

    @consumes
    def run_decode(self, plan: DecodePlan) -> Sampled:
        """Run a ``DecodePlan``: one forward over one token per row, then sampling at each row's
        ``seq_lens`` position. It carries no tickets; a row with a registered ticket not yet run is
        refused (``Ledger.rows_free``). A pipelined decode (``inputs_from``) takes its inputs from the
        tokens an earlier forward on this pool sampled, each once. A row at position 0 (``seq_lens``
        1: a request's first token) is refused (``_check_not_first``)."""
        if not isinstance(plan, DecodePlan):
            _wrong_plan("run_decode", plan, "a DecodePlan")
        self._check_rows(plan.slots, "DecodePlan")
        _check_not_first(plan, "DecodePlan")
        staged = stage_decode(plan, self.pool.device, self._inputs(plan, "DecodePlan"))
        with self._unit(plan.slots):
            self._count_inputs(None, staged)
            out = self._forward(plan, None, staged)
            faults.check(faults.FaultPoint.MODEL_FORWARD)
        tokens = sample_logits(out, plan.sampling, plan.seq_lens, counts=self._count_rows(plan.sampling, plan.slots))
        self._sampled(plan, tokens)
        return Sampled(rids=plan.rids, tokens=tokens, logprobs=logprobs_of(out, tokens, plan.sampling))

    def _inputs(self, plan: DecodePlan, what: str) -> npt.NDArray[np.int64] | None:
        """The input tokens a pipelined decode names (``DecodePlan.inputs_from``): each row's slot must
        hold a token that sample left here and no plan used yet; else ``PlanExecutionError``."""
        if plan.inputs_from is None:
            return None
        tokens = []
        for slot in plan.slots.tolist():
            kept = self._samples.get(slot)
            if kept is None or kept[0] != plan.inputs_from:
                found = f"the token of sample #{kept[0]}" if kept is not None else "no token"
                raise PlanExecutionError(
                    f"{what} takes slot {slot}'s input from sample #{plan.inputs_from}, but pool {self.pool.pool_id!r} holds "
                    f"{found} for it (a plan built against a forward that never ran here, or one whose token was used already)"
                )
            tokens.append(kept[1])
        return np.asarray(tokens, dtype=np.int64)

    def _sampled(self, plan: DecodePlan, tokens: I64) -> None:
        """After a forward succeeded: the tokens it named are used (a replay finds none), and with a
        ``sample_id`` its sampled tokens are kept per slot for the plan that names them."""
        if plan.inputs_from is not None:
            for slot in plan.slots.tolist():
                del self._samples[slot]
        if plan.sample_id is not None:
            for slot, token in zip(plan.slots.tolist(), _inputs_of(tokens), strict=True):
                self._samples[slot] = (plan.sample_id, token)

    @consumes
    def run_draft(self, plan: DraftPlan) -> Proposals:
        """Run the proposal; keep its per-step states (and the proposed tokens) for the draft
        commit, dropping an older draft's, never committed. Returns the ``Proposals``, which only
        the verify of this draft may consume."""
        if not isinstance(plan, DraftPlan):
            _wrong_plan("run_draft", plan, "a DraftPlan")
        did = plan.batch.draft_id
        self._check_fresh("draft", did)
        self._check_rows(plan.batch.slots, "DraftPlan")
        staged = stage_window(plan.batch, self.pool.device)
        self._validated(plan)
        n, k = plan.batch.num_requests, plan.batch.k
        if self._head is not None:
            # a head proposes from its carried state and keeps nothing: its commit is a forward
            # over the verified tokens with the verify's hidden states (``run_head_commit``)
            with self._watched("the head hook's propose", plan, staged):
                out = self._head.propose(staged, k, self.pool)
            self._check_proposed(did, out, n, k)
            self._verified_upto[serial_epoch(did)] = did & ((1 << SERIAL_COUNTER_BITS) - 1)
            return Proposals(k=k, draft_id=did, tokens=out.reshape(-1).cpu().numpy())
        with self._watched("the model hook's propose", plan, staged):
            out, states = self._spec_model(plan).propose(plan, staged, self.pool)
        self._check_proposed(did, out, n, k)
        proposals = Proposals(k=k, draft_id=did, tokens=out.reshape(-1).cpu().numpy())
        if self._kept_draft is not None:
            self._intermediates.pop(self._kept_draft, None)
        self._keep("draft", did, plan.batch.slots, k, states, proposed=proposals.tokens.tobytes())
        self._kept_draft = did
        return proposals

    def _check_proposed(self, did: DraftId, out: object, n: int, k: int) -> None:
        """A proposal hook's tokens are ``[n, k]`` int64 (a user's hook: its annotation is a promise)."""
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, k) or out.dtype != torch.int64:
            got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise PlanExecutionError(f"draft #{did}: the model hook's propose returned {got}, not {n} x {k} int64 token ids")

    @consumes
    def run_verify(self, plan: VerifyPlan) -> Verified:
        """Run a ``VerifyPlan``: the model's verify over each row's window, keeping its intermediate
        states under the verify's id for exactly one ``CommitPlan``, and return the target's tokens
        (``Verified``). Each verify runs once, and each draft's proposals are checked by one verify on
        this pool, in the order the drafts were minted."""
        if not isinstance(plan, VerifyPlan):
            _wrong_plan("run_verify", plan, "a VerifyPlan")
        vid, did = plan.batch.verify_id, plan.batch.draft_id
        self._check_fresh("verify", vid)
        epoch, n = serial_epoch(did), did & ((1 << SERIAL_COUNTER_BITS) - 1)
        if n <= self._checked_drafts_upto.get(epoch, 0):
            raise PlanExecutionError(
                f"verify #{vid} checks the proposals of draft #{did}, which a verify on pool {self.pool.pool_id!r} already checked "
                "(each draft's proposals are verified once, in the order the drafts were minted)"
            )
        self._check_rows(plan.batch.slots, "VerifyPlan")
        staged = stage_window(plan.batch, self.pool.device)
        self._validated(plan)
        keeps = asked_hidden(plan)
        hidden: torch.Tensor | None = None
        with self._watched("the model hook's verify", plan, staged):
            if keeps is None:
                out, states = self._spec_model(plan).verify(plan, staged, self.pool)
            else:
                out, kept, hidden = self._keeping_hidden(plan).verify_keeping_hidden(plan, staged, self.pool)
                states = cast("VerifyStateT", kept)  # (the same hook's verify states, as ``verify`` returns them)
        tokens = self._verify_tokens(plan, out)
        logprobs = None
        if plan.batch.sampling is not None and (plan.batch.sampling.logprobs >= 0).any():
            if out.dim() != 3:
                raise PlanExecutionError(f"verify #{vid}: rows ask for logprobs, and the model hook's verify returned tokens, not logits")
            w = plan.batch.k + 1
            logprobs = logprobs_of(out.reshape(-1, out.shape[-1]), tokens, plan.batch.sampling, per_row=w)
        if keeps is not None:
            assert hidden is not None
            self._store(plan).keep(keeps, hidden)
        self._keep("verify", vid, plan.batch.slots, plan.batch.k, states)
        self._checked_drafts_upto[epoch] = n
        return Verified(k=plan.batch.k, verify_id=plan.batch.verify_id, rids=plan.batch.rids, tokens=tokens, logprobs=logprobs, hidden=keeps)

    def _verify_tokens(self, plan: VerifyPlan, out: torch.Tensor) -> I64:
        """The target's tokens from what the hook's verify returned: logits ``[n, k + 1, V]`` (sampled
        through ``backend.plan_sampling.verify_tokens``) or, for a batch of greedy rows only, its
        ``[n, k + 1]`` argmax tokens."""
        b = plan.batch
        n, w = b.num_requests, b.k + 1
        hook_out: object = out  # a user's hook: its annotation is a promise, checked here
        if isinstance(hook_out, torch.Tensor) and out.dim() == 3 and tuple(out.shape[:2]) == (n, w) and out.is_floating_point():
            if b.sampling is None:  # every row greedy, no penalty: the proposals play no part (``verify_tokens``)
                return verify_tokens(out, _NO_TOKENS, None, b.seq_lens)
            drafts = b.window(b.input_ids)[:, 1:].reshape(-1)
            counts = self._count_rows(b.sampling, b.slots)
            if counts is not None:
                # the window's input 0 (the last generated token) is fed here, before position 0
                pending = torch.from_numpy(b.window(b.input_ids)[:, 0].copy()).to(counts[0].device)
                fed = counts[0].clone()
                fed[torch.arange(n, device=fed.device), pending] += 1
                counts = (fed, counts[1])
            return verify_tokens(out, frozen_i64(drafts), b.sampling, b.seq_lens, counts=counts)
        if isinstance(hook_out, torch.Tensor) and tuple(out.shape) == (n, w) and out.dtype == torch.int64:
            if b.sampling is not None and (b.sampling.temperature.any() or b.sampling.bans_any) or self.counts is not None and penalised(b.sampling):
                raise PlanExecutionError(
                    f"verify #{b.verify_id}: the model hook's verify returned tokens, but sampled or penalised rows and rows with "
                    f"min_tokens need its logits ({n} x {w} x vocab)"
                )
            return frozen_i64(out.reshape(-1).cpu().numpy())
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(hook_out, torch.Tensor) else type(hook_out).__name__
        raise PlanExecutionError(f"verify #{b.verify_id}: the model hook's verify returned {got}, not {n} x {w} x vocab logits or {n} x {w} int64 tokens")

    @consumes
    def run_commit(self, plan: CommitPlan) -> None:
        """Commit the intermediate states of the verify the plan names; each verify commits once."""
        if not isinstance(plan, CommitPlan):
            _wrong_plan("run_commit", plan, "a CommitPlan")
        self._commit(plan, "verify", plan.batch.verify_id)

    @consumes
    def run_draft_commit(self, plan: DraftCommitPlan) -> None:
        """Commit the states the draft the plan names kept; each draft commits once."""
        if not isinstance(plan, DraftCommitPlan):
            _wrong_plan("run_draft_commit", plan, "a DraftCommitPlan")
        self._commit(plan, "draft", plan.batch.draft_id)
        self._kept_draft = None

    def _check_fresh(self, phase: str, serial: DraftId | VerifyId) -> None:
        """Ids are minted in order and each draft or verify runs once: remembering the newest one per
        minting epoch refuses a replay (even after its commit) in constant memory."""
        epoch, n = serial_epoch(serial), serial & ((1 << SERIAL_COUNTER_BITS) - 1)
        if serial in self._intermediates or n <= self._verified_upto.get(epoch, 0):
            raise PlanExecutionError(
                f"{phase} #{serial} already ran on pool {self.pool.pool_id!r} (each {phase} runs once, in the order its id was minted)"
            )

    def _keep(self, phase: str, serial: DraftId | VerifyId, slots: I64, k: int, states: VerifyStateT, proposed: bytes = b"") -> None:
        self._intermediates[serial] = _Kept(phase=phase, slots=slots.tobytes(), k=k, states=states, proposed=proposed)
        self._verified_upto[serial_epoch(serial)] = serial & ((1 << SERIAL_COUNTER_BITS) - 1)

    def _commit(self, plan: CommitPlan | DraftCommitPlan, phase: str, serial: DraftId | VerifyId) -> None:
        self._check_rows(plan.batch.slots, type(plan).__name__, committed=False)  # (after the checks of what it commits, below)
        kept = self._intermediates.get(serial)
        if kept is None or kept.phase != phase:
            what = "intermediate states of verify" if phase == "verify" else "kept states of draft"
            why = "never verified here, or already committed" if phase == "verify" else "never drafted here, already committed, or dropped by a newer draft"
            if kept is not None:
                why = f"#{serial} names a {kept.phase}'s states, which only a {'CommitPlan' if kept.phase == 'verify' else 'DraftCommitPlan'} commits"
            raise PlanExecutionError(f"no {what} #{serial} on pool {self.pool.pool_id!r}: {why}")
        # the states are bound to the rows they were computed on: committing them into other slots
        # (or another window) would write one request's state into another's row
        if plan.batch.slots.tobytes() != kept.slots or plan.batch.k != kept.k:
            ran = np.frombuffer(kept.slots, dtype=np.int64).tolist()
            raise PlanExecutionError(
                f"commit of {phase} #{serial} names slots {plan.batch.slots.tolist()} with k={plan.batch.k}; "
                f"the {phase} ran on slots {ran} with k={kept.k} on pool {self.pool.pool_id!r}"
            )
        if phase == "draft":
            # the states were computed by feeding the proposals: committing them after a verify of
            # other tokens would leave the draft's state matching no sequence
            checked = np.ascontiguousarray(plan.batch.input_ids.reshape(-1, kept.k + 1)[:, 1:])
            if checked.tobytes() != kept.proposed:
                proposed = np.frombuffer(kept.proposed, dtype=np.int64).tolist()
                raise PlanExecutionError(
                    f"commit of draft #{serial} after a verify of tokens {checked.reshape(-1).tolist()[:16]}; "
                    f"draft #{serial} proposed {proposed[:16]} on pool {self.pool.pool_id!r}"
                )
        self._check_committed(plan.batch.slots.tolist(), type(plan).__name__, cast("VerifyId", serial) if phase == "verify" else None)
        self._validated(plan)
        with self._unit(plan.batch.slots):
            with self._watched("the model hook's commit", plan):
                self._spec_model(plan).commit(plan, kept.states, self.pool)
            if phase == "verify" and self.counts is not None:
                # the window inputs it commits (0 to accept_pos) were generated and are now fed
                b = plan.batch
                window = b.input_ids.reshape(-1, b.k + 1)
                fed = window[np.arange(b.k + 1)[None, :] <= b.accept_pos[:, None]]  # (row-major: each row's in order)
                self.counts.feed(torch.from_numpy(b.slots.copy()), torch.from_numpy(fed), torch.from_numpy(b.accept_pos + 1))
            faults.check(faults.FaultPoint.COMMIT)
        del self._intermediates[serial]

    @consumes
    def run_draft_extend(self, plan: DraftExtendPlan) -> Sampled:
        """Run a ``DraftExtendPlan``: the draft model's catch-up forward over each row's accepted
        tokens, from its committed state, and the greedy token of each row. No tickets: a row with a
        registered ticket not yet run is refused."""
        if not isinstance(plan, DraftExtendPlan):
            _wrong_plan("run_draft_extend", plan, "a DraftExtendPlan")
        self._check_rows(plan.batch.slots, "DraftExtendPlan")
        staged = stage_extend(plan.batch, self.pool.device)
        with self._unit(plan.batch.slots):
            out = self._forward(plan, staged, None)
            faults.check(faults.FaultPoint.MODEL_FORWARD)
        return Sampled(rids=plan.batch.rids, tokens=sample(out))

    def _forward(self, plan: ForwardPlan, extend: StagedExtend | None, decode: StagedDecode | None) -> torch.Tensor:
        self._validated(plan)
        model = self._forward_hook
        if model is None:
            if self._head is not None:
                raise PlanExecutionError(
                    f"{type(plan).__name__} on pool {self.pool.pool_id!r}: a draft head runs its own phases (HeadExtendPlan, HeadCommitPlan), not the target's plans"
                )
            raise PlanExecutionError(f"{type(plan).__name__} on pool {self.pool.pool_id!r}: the model hook {type(self.model).__name__} has no forward")
        with self._watched("the model hook", plan, extend, decode):
            out: object = model.forward(plan, extend, decode, self.pool)  # a user's hook: its annotation is a promise
        return self._checked_logits(plan, out, extend, decode)

    def _checked_logits(self, plan: Plan, out: object, extend: StagedExtend | None, decode: StagedDecode | None) -> torch.Tensor:
        """``out`` if it is logits ``[rows, vocab]`` for the staged rows, else ``PlanExecutionError``."""
        rows = (int(extend.cu_seqlens.shape[0]) - 1 if extend is not None else 0) + (int(decode.packed.shape[1]) if decode is not None else 0)
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != rows:
            got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise PlanExecutionError(f"{type(plan).__name__}: the model hook returned {got}, not logits of shape [{rows}, vocab]")
        return out

    def _unit(self, slots: I64) -> AbstractContextManager[None]:
        """A transactional executor restores the rows a failing forward wrote."""
        return self._restoring(slots.tolist()) if self.transactional else _NOTHING

    @contextmanager
    def _restoring(self, rows: list[int]) -> Iterator[None]:
        """The pool's rows and (with counts) their counts, restored if the block raises."""
        with restoring(self.pool, rows), self.counts.restoring(rows) if self.counts is not None else nullcontext():
            yield

    # -- the in-place mutation detector (``watch``: on at BATCHC_VERIFY=2) -------------------

    def _pool_stamp(self) -> tuple[int, bytes]:
        """The pool buffer's version counter and a hash of its bytes. Torch in-place ops bump the
        version; Triton stores (our GPU kernels, or anyone's) do not, so the hash catches those. A
        hash of the bytes in order (not a sum) sees a row swap or +d/-d in two rows; it copies the
        pool to the host, which is the price of ``BATCHC_VERIFY=2``."""
        b = self.pool.buffer.detach().contiguous()
        digest = hashlib.blake2b(b.view(torch.uint8).cpu().numpy().data, digest_size=16).digest()
        return b._version, digest

    def _check_pool_untouched(self) -> None:
        if self._seen is None:
            return
        version, fingerprint = self._pool_stamp()
        if (version, fingerprint) != self._seen:
            how = f"version {self._seen[0]} -> {version}" if version != self._seen[0] else "contents changed, version unchanged (a Triton store?)"
            raise MutationError(f"pool {self.pool.pool_id!r} was written outside the executor since its last plan ({how})")

    def _watched(self, who: str, plan: Plan, *staged: Staged | None) -> AbstractContextManager[None]:
        """Run a model-hook call; when watching, check afterwards that it changed neither a staged
        input (compared by content: a Triton store bumps no version) nor a column of the plan."""
        return self._watching(who, plan, *staged) if self.watch else _NOTHING

    @contextmanager
    def _watching(self, who: str, plan: Plan, *staged: Staged | None) -> Iterator[None]:
        inputs = [(s, {k: v.clone() for k, v in _tensors(s).items()}) for s in staged if s is not None]
        columns = {name: col.tobytes() for name, col in _columns(plan, type(plan).__name__)}
        yield
        for s, before in inputs:
            for k, now in _tensors(s).items():
                if not torch.equal(now, before[k]):
                    raise MutationError(f"{who} wrote the staged tensor {type(s).__name__}.{k} in place")
        for name, col in _columns(plan, type(plan).__name__):
            if col.tobytes() != columns[name]:
                raise MutationError(f"{who} changed the plan column {name}")

    def adopt_pool_contents(self) -> None:
        """Declare the pool's current contents as known after an intentional write from outside the
        executor (an engine seeding a checkpoint, a test standing in for a model)."""
        if self.watch:
            self._seen = self._pool_stamp()

    def forget_verifies(self) -> None:
        """Drop every kept verify and draft state and every kept sample (the engine aborted the
        requests they belonged to, and the plans built on them: a replay of one finds nothing)."""
        self._intermediates.clear()
        self._kept_draft = None
        self._samples.clear()
        if self.hidden is not None:
            self.hidden.forget()

    def _spec_model(self, plan: DraftPlan | VerifyPlan | CommitPlan | DraftCommitPlan) -> SpecModelHook[VerifyStateT]:
        if self._spec_hook is None:
            raise PlanExecutionError(f"{type(plan).__name__} needs a SpecModelHook; {type(self.model).__name__} has no speculative phases")
        # the model this executor was built with: its verify states are this executor's VerifyStateT
        return self._spec_hook

    def _own_tickets(self, plan: ExtendPlan | HeadExtendPlan, own: frozenset[int]) -> list[Ticket[Op]]:
        """The plan's tickets for this pool, checked (``backend.state_store.own_tickets``: slots in
        range, of the plan or not as each op kind declares, live with an allocator; a kind lowered
        for other pools only is refused)."""
        live = None if self.slots is None else self.slots.check_live
        return own_tickets(plan, self.pool.pool_id, self.pool.capacity, own, live, whose="this executor's pool")

    def _check_rows(self, slots: I64, what: str, *, committed: bool = True) -> None:
        """``_check_slots``, no registered ticket still has to run on one of the rows (a plan
        without tickets cannot run over a slot whose clear, COW or snapshot is pending), and
        (``committed``) no verify's states wait for their commit there (``_check_committed``)."""
        self._check_slots(slots, what)
        rows = slots.tolist()
        self.ledger.rows_free(rows, self.pool.pool_id, what)
        if committed:
            self._check_committed(rows, what)

    def _check_committed(self, rows: list[int], what: str, commits: VerifyId | None = None) -> None:
        """No row of ``rows`` holds the states of a verify that ran here and whose commit has not
        (except ``commits``, the verify the plan commits): a plan over such a row would run on the
        state before that verify, as if the tokens it accepted had never been fed, and the commit
        coming later would overwrite what the plan wrote (SGLang PR #26351: the commit after a
        verify skipped). ``PlanExecutionError`` naming the slot and the verify, before anything runs."""
        if not self._intermediates:
            return
        for serial, kept in self._intermediates.items():
            if kept.phase != "verify" or serial == commits:
                continue
            waiting = set(rows).intersection(np.frombuffer(kept.slots, dtype=np.int64).tolist())
            if waiting:
                raise PlanExecutionError(
                    f"{what} over slot {min(waiting)} of pool {self.pool.pool_id!r}: the states of verify #{serial} on that row "
                    f"wait for their commit (a CommitPlan naming verify #{serial}), which has not run"
                )

    def _check_slots(self, slots: I64, what: str) -> None:
        """Every slot in range and (with an allocator) live. The phases of a speculative iteration
        run on one slots column: it is checked once until the allocator next changes."""
        if not slots.size:
            return
        key = (slots.tobytes(), self.slots.generation if self.slots is not None else 0)
        if key == self._slots_ok:
            return
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 1 or hi > self.pool.capacity:
            bad = lo if lo < 1 else hi
            raise PlanExecutionError(f"{what}: slot {bad} out of range [1, {self.pool.capacity}] of pool {self.pool.pool_id!r}")
        if self.slots is not None:
            self.slots.check_live(np.asarray(slots).tolist(), what)
        self._slots_ok = key


def _check_not_first(plan: DecodePlan, what: str) -> None:
    """No decode row feeds a request's first token (``seq_lens`` 1, position 0): a decode advances the
    state its slot holds, and a request's first token starts from a cleared state, which only a
    prefill's init gives it (vLLM PR #32118: a new request given one token by the token budget was
    run as a decode, on the slot's stale state). ``PlanExecutionError`` naming the slot, before
    anything runs."""
    if plan.seq_lens.shape[0] and int(plan.seq_lens.min()) < 2:
        slot = int(plan.slots[int(np.argmin(plan.seq_lens))])
        raise PlanExecutionError(
            f"{what}: the row of slot {slot} feeds the token at position 0 (seq_lens 1): a request's first token is a prefill "
            "(an ExtendPlan whose init clears the slot), never a decode of the state the slot holds"
        )


def _inputs_of(tokens: I64) -> list[int]:
    """Sampled tokens as the inputs of the pipelined forward already built on them. A flagged row's
    (``NON_FINITE``) is never read back (the engine ends its request when this forward lands), so
    its input becomes 0, which keeps that forward well-formed."""
    return [max(t, 0) for t in tokens.tolist()]


def _wrong_plan(entry: str, value: object, expected: str) -> NoReturn:
    """A typed entry point handed something else: mypy rejects it for typed callers; anyone else
    gets a typed error naming the entry and what they passed."""
    raise PlanExecutionError(f"Executor.{entry}: expected {expected}, got a {type(value).__name__}")


def _not_a_plan(value: Never) -> NoReturn:
    """The exhaustive match's last case: mypy proves it unreachable for typed callers; anyone else
    gets a typed error naming what they passed."""
    raise PlanExecutionError(f"Executor.execute: a {type(value).__name__} is not a plan")


def _tensors(staged: Staged) -> dict[str, torch.Tensor]:
    return {k: v for k, v in attrs.asdict(staged, recurse=False).items() if isinstance(v, torch.Tensor)}


def _columns(node: attrs.AttrsInstance, path: str) -> Iterator[tuple[str, npt.NDArray[Any]]]:
    """Every numpy column of a plan, nested batches and parts included, with its path."""
    for name, value in attrs.asdict(node, recurse=False).items():
        if isinstance(value, np.ndarray):
            yield f"{path}.{name}", value
        elif attrs.has(type(value)):
            yield from _columns(cast(attrs.AttrsInstance, value), f"{path}.{name}")


AnyExecutor: TypeAlias = Executor[Any]
"""An executor whatever its model keeps between verify and commit (for code that only runs plans)."""
