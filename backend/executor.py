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
the pool (its version counter and a content fingerprint) after every plan and checks the stamp
before the next, so a write to the pool by code other than the executor's ops and model hook is
reported with the pool's name; and it records the version counter of every staged tensor around
each model-hook call, so a hook that writes its inputs in place is reported with the tensor's name.
Triton stores do not bump ``_version``: the fingerprint is what catches them on the pool.

Speculative plans: a ``VerifyPlan`` leaves its intermediate states with the executor under the
verify's id, and exactly one ``CommitPlan`` naming that id consumes them (a second commit, or a
commit of a verify that never ran on this pool, is refused before touching the pool).

Per plan, in this order: (1) check that the plan fits this backend (its tickets name this pool,
every slot, the init ops' COW sources included, is in range and, with an allocator attached, live), raising ``PlanExecutionError`` or
``SlotError`` before anything is touched; (2) stage the plan's columns into tensors; (3) for a
prefill plan with init ops, consume this pool's ticket through the ledger while applying its
clears, then its copies; (4) call the model hook; (5) for a prefill plan with prefix-cache
snapshots, consume this pool's snapshot ticket while copying the requests' new states into their
cache slots.

A prefill plan whose tickets do not include this executor's pool is refused: it was lowered for
other pools, and running it here would skip this pool's init ops. A ticket whose ops fail midway
is returned to the ledger as outstanding. There is no path that applies an init op without
consuming its ticket.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import TypeAlias, assert_never

import attrs
import numpy as np
import torch

from backend.allocator import SlotAllocator
from backend.ledger import Ledger
from backend.model import ForwardPlan, ModelHook, NoOpModel, SpecModelHook
from backend.pool import MambaStatePool
from backend.staging import StagedDecode, StagedExtend, StagedWindow, stage_decode, stage_extend, stage_window
from backend import faults
from backend.state_init import apply_init, apply_snapshot, check_init_fits, check_slots_fit, restoring
from ir._fields import I64
from ir.errors import MutationError, PlanExecutionError
from ir.init import InitTicket, SnapshotTicket
from ir.nodes import Plan
from ir.ids import TicketSerial
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.spec import CommitPlan, DraftExtendPlan, DraftPlan, VerifyPlan


Staged: TypeAlias = StagedExtend | StagedDecode | StagedWindow


class Executor:
    def __init__(
        self,
        pool: MambaStatePool,
        ledger: Ledger,
        model: ModelHook | None = None,
        *,
        slots: SlotAllocator | None = None,
        transactional: bool = False,
        watch: bool | None = None,
    ) -> None:
        self.pool = pool
        self.transactional = transactional
        self.watch = watch if watch is not None else os.environ.get("BATCHC_VERIFY") == "2"
        self._seen: tuple[int, int] | None = None
        self.ledger = ledger
        self.model: ModelHook = model if model is not None else NoOpModel()
        self.slots = slots
        self._intermediates: dict[TicketSerial, object] = {}

    def execute(self, plan: Plan) -> torch.Tensor | None:
        if not self.watch:
            return self._execute(plan)
        self._check_pool_untouched()
        try:
            return self._execute(plan)
        finally:
            self._seen = self._pool_stamp()

    def _execute(self, plan: Plan) -> torch.Tensor | None:
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
                return None
            case DraftExtendPlan():
                return self.run_draft_extend(plan)
            case IdlePlan():
                return None
            case _:
                assert_never(plan)

    def run_prefill(self, plan: ExtendPlan | MixedPlan) -> torch.Tensor | None:
        ext = plan if isinstance(plan, ExtendPlan) else plan.extend
        self._check_slots(ext.slots, type(plan).__name__)
        ticket = self._ticket(ext)
        decode: StagedDecode | None = None
        if isinstance(plan, MixedPlan):
            self._check_slots(plan.decode.slots, "MixedPlan.decode")
            decode = stage_decode(plan.decode, self.pool.device)
        extend: StagedExtend = stage_extend(ext, self.pool.device)
        snapshot = self._snapshot_ticket(ext)
        rows = [int(s) for s in ext.slots] + ([int(s) for s in plan.decode.slots] if isinstance(plan, MixedPlan) else [])
        if not self.transactional:
            # the init ticket is consumed once its ops are applied; a failing forward then leaves
            # its requests' state undefined: the driver aborts them
            if ticket is not None:
                with self.ledger.consuming(ticket, self.pool.pool_id):
                    apply_init(self.pool, ticket.init)
            out = self._forward(plan, extend, decode)
            faults.check("model_forward")
            if snapshot is not None:
                with self.ledger.consuming(snapshot, self.pool.pool_id):
                    apply_snapshot(self.pool, snapshot.snapshot)
            return out
        # transactional: the whole forward is one unit; on failure every row it wrote is restored
        # and every ticket is outstanding again, so the same plan can simply be executed again
        with restoring(self.pool, rows), ExitStack() as held:
            if ticket is not None:
                held.enter_context(self.ledger.consuming(ticket, self.pool.pool_id))
                apply_init(self.pool, ticket.init)
            out = self._forward(plan, extend, decode)
            faults.check("model_forward")
            if snapshot is not None:
                held.enter_context(self.ledger.consuming(snapshot, self.pool.pool_id))
                apply_snapshot(self.pool, snapshot.snapshot)
        return out

    def run_decode(self, plan: DecodePlan) -> torch.Tensor | None:
        self._check_slots(plan.slots, "DecodePlan")
        staged = stage_decode(plan, self.pool.device)
        with self._unit(plan.slots):
            out = self._forward(plan, None, staged)
            faults.check("model_forward")
        return out

    def run_draft(self, plan: DraftPlan) -> torch.Tensor:
        self._check_slots(plan.batch.slots, "DraftPlan")
        staged = stage_window(plan.batch, self.pool.device)
        before = self._staged_versions(staged)
        out = self._spec_model(plan).propose(plan, staged, self.pool)
        self._check_staged(staged, before, "the model hook's propose")
        return out

    def run_verify(self, plan: VerifyPlan) -> torch.Tensor:
        vid = plan.batch.verify_id
        if vid in self._intermediates:
            raise PlanExecutionError(f"verify #{vid} already ran on pool {self.pool.pool_id!r}")
        self._check_slots(plan.batch.slots, "VerifyPlan")
        staged = stage_window(plan.batch, self.pool.device)
        before = self._staged_versions(staged)
        out, states = self._spec_model(plan).verify(plan, staged, self.pool)
        self._check_staged(staged, before, "the model hook's verify")
        self._intermediates[vid] = states
        return out

    def run_commit(self, plan: CommitPlan) -> None:
        """Commit the intermediate states of the verify the plan names; each verify commits once."""
        vid = plan.batch.verify_id
        self._check_slots(plan.batch.slots, "CommitPlan")
        if vid not in self._intermediates:
            raise PlanExecutionError(
                f"no intermediate states of verify #{vid} on pool {self.pool.pool_id!r}: never verified here, or already committed"
            )
        with self._unit(plan.batch.slots):
            self._spec_model(plan).commit(plan, self._intermediates[vid], self.pool)
            faults.check("commit")
        del self._intermediates[vid]

    def run_draft_extend(self, plan: DraftExtendPlan) -> torch.Tensor | None:
        self._check_slots(plan.batch.slots, "DraftExtendPlan")
        staged = stage_extend(plan.batch, self.pool.device)
        with self._unit(plan.batch.slots):
            out = self._forward(plan, staged, None)
            faults.check("model_forward")
        return out

    def _forward(self, plan: ForwardPlan, extend: StagedExtend | None, decode: StagedDecode | None) -> torch.Tensor | None:
        before_extend, before_decode = self._staged_versions(extend), self._staged_versions(decode)
        out = self.model.forward(plan, extend, decode, self.pool)
        self._check_staged(extend, before_extend, "the model hook")
        self._check_staged(decode, before_decode, "the model hook")
        return out

    def _unit(self, slots: I64) -> AbstractContextManager[None]:
        """A transactional executor restores the rows a failing forward wrote."""
        return restoring(self.pool, slots.tolist()) if self.transactional else nullcontext()

    # -- the in-place mutation detector (``watch``: on at BATCHC_VERIFY=2) -------------------

    def _pool_stamp(self) -> tuple[int, int]:
        """The pool buffer's version counter and a content fingerprint. Torch in-place ops bump the
        version; Triton stores (our GPU kernels, or anyone's) do not, so the fingerprint catches those."""
        b = self.pool.buffer
        words = b.view(torch.int32) if b.shape[1] % 4 == 0 else b.to(torch.int32)
        weights = torch.arange(1, words.shape[1] + 1, device=b.device, dtype=torch.int64)
        return b._version, int((words.to(torch.int64) * weights).sum())

    def _check_pool_untouched(self) -> None:
        if self._seen is None:
            return
        version, fingerprint = self._pool_stamp()
        if (version, fingerprint) != self._seen:
            how = f"version {self._seen[0]} -> {version}" if version != self._seen[0] else "contents changed, version unchanged (a Triton store?)"
            raise MutationError(f"pool {self.pool.pool_id!r} was written outside the executor since its last plan ({how})")

    def _staged_versions(self, staged: Staged | None) -> dict[str, tuple[int, torch.Tensor]]:
        """Version and a copy of every staged tensor (the fields of one staging share one buffer,
        so one field's write bumps every field's version; the copies tell which field changed)."""
        if not self.watch or staged is None:
            return {}
        return {
            k: (v._version, v.clone())
            for k, v in attrs.asdict(staged, recurse=False).items()
            if isinstance(v, torch.Tensor)
        }

    def _check_staged(self, staged: Staged | None, before: dict[str, tuple[int, torch.Tensor]], who: str) -> None:
        if staged is None or not before:
            return
        now = {k: v for k, v in attrs.asdict(staged, recurse=False).items() if isinstance(v, torch.Tensor)}
        bumped = [k for k, (version, _) in before.items() if now[k]._version != version]
        if not bumped:
            return
        changed = [k for k in bumped if not torch.equal(now[k], before[k][1])] or bumped
        name = changed[0]
        raise MutationError(
            f"{who} wrote the staged tensor {type(staged).__name__}.{name} in place "
            f"(version {before[name][0]} -> {now[name]._version})"
        )

    def adopt_pool_contents(self) -> None:
        """Declare the pool's current contents as known after an intentional write from outside the
        executor (an engine seeding a checkpoint, a test standing in for a model)."""
        if self.watch:
            self._seen = self._pool_stamp()

    def forget_verifies(self) -> None:
        """Drop every kept verify state (the driver aborted the requests they belonged to)."""
        self._intermediates.clear()

    def _spec_model(self, plan: DraftPlan | VerifyPlan | CommitPlan) -> SpecModelHook:
        if not isinstance(self.model, SpecModelHook):
            raise PlanExecutionError(f"{type(plan).__name__} needs a SpecModelHook; {type(self.model).__name__} has no speculative phases")
        return self.model

    def _ticket(self, plan: ExtendPlan) -> InitTicket | None:
        if not plan.tickets:
            return None
        ticket = plan.ticket_for(self.pool.pool_id)
        if ticket is None:
            pools = ", ".join(repr(t.pool) for t in plan.tickets)
            raise PlanExecutionError(
                f"plan with init #{plan.tickets[0].serial} was lowered for pool(s) {pools}, "
                f"not for this executor's pool {self.pool.pool_id!r}"
            )
        check_init_fits(self.pool, ticket.init)
        if self.slots is not None:
            # a COW source is a checkpoint slot: reading a freed one would copy stale bytes
            init = ticket.init
            self.slots.check_live((*init.clear_slots, *init.cow_dst, *init.cow_src), f"init #{init.serial}")
        return ticket

    def _snapshot_ticket(self, plan: ExtendPlan) -> SnapshotTicket | None:
        if not plan.snapshots:
            return None
        ticket = plan.snapshot_for(self.pool.pool_id)
        if ticket is None:
            pools = ", ".join(repr(t.pool) for t in plan.snapshots)
            raise PlanExecutionError(
                f"plan with snapshot #{plan.snapshots[0].serial} was lowered for pool(s) {pools}, "
                f"not for this executor's pool {self.pool.pool_id!r}"
            )
        snap = ticket.snapshot
        check_slots_fit(self.pool, f"snapshot #{snap.serial}", (("src", snap.src), ("dst", snap.dst)))
        if self.slots is not None:
            self.slots.check_live((*snap.src, *snap.dst), f"snapshot #{snap.serial}")
        return ticket

    def _check_slots(self, slots: I64, what: str) -> None:
        if slots.size:
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 1 or hi > self.pool.capacity:
                bad = lo if lo < 1 else hi
                raise PlanExecutionError(f"{what}: slot {bad} out of range [1, {self.pool.capacity}] of pool {self.pool.pool_id!r}")
            if self.slots is not None:
                self.slots.check_live(np.asarray(slots).tolist(), what)
