"""The executor's gate (a tensor-parallel rank's agreement points; ``backend.executor``): for every
kind of plan, ``validated`` is reached after the plan's checks and ticket claims and before anything
is written or the model runs, and ``applied`` after it ran. A gate that refuses at ``validated``
(another rank refused the plan) leaves the pool bytes, the ledger and the model untouched, and the
plan's tickets outstanding so the same plan can run once the group agrees.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.executor import Executor
from backend.model import blank_logits
from backend.pool import MambaStatePool
from backend.staging import StagedDecode, StagedExtend, StagedWindow
from ir.ids import MambaSlot
from ir.request import CopyFrom
from ir.spec import CommitPlan, DraftCommitPlan, DraftPlan, VerifyPlan
from passes.accept import accept
from passes.commit import commit
from passes.lower import LowerContext, lower
from passes.prepare_for_draft import SpecContext, prepare_for_draft
from passes.prepare_for_draft_commit import prepare_for_draft_commit
from passes.prepare_for_verify import prepare_for_verify
from tests.helpers import ToySpecModel, World, decode_batch, extend_plan, make_world, proposed, request, verified


class Refused(Exception):
    """What the refusing gate raises (another rank refused the plan)."""


class RecordingGate:
    """A ``Gate`` that records, per call, whether the pool still held the bytes it had when the
    plan was handed over; calls after the first of each kind are no-ops, as the protocol says."""

    def __init__(self, events: list[str], refuse: bool = False) -> None:
        self.events = events
        self.refuse = refuse
        self.pool: MambaStatePool | None = None
        self.before: torch.Tensor | None = None
        self.clean_at_validated: bool | None = None
        self._seen: set[str] = set()

    def begin(self, pool: MambaStatePool) -> None:
        self.pool, self.before, self._seen = pool, pool.buffer.clone(), set()
        self.clean_at_validated = None

    def validated(self, plan: str) -> None:
        if "validated" in self._seen:
            return
        self._seen.add("validated")
        assert self.pool is not None and self.before is not None
        self.clean_at_validated = bool(torch.equal(self.pool.buffer, self.before))
        self.events.append(f"validated {plan}")
        if self.refuse:
            raise Refused(plan)

    def applied(self, plan: str) -> None:
        if "applied" in self._seen:
            return
        self._seen.add("applied")
        self.events.append(f"applied {plan}")


class RecordingModel(ToySpecModel):
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor:
        self.events.append("forward")
        return blank_logits(extend, decode)

    def propose(self, plan: DraftPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, object]:
        self.events.append("propose")
        return super().propose(plan, staged, pool)

    def verify(self, plan: VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, object]:
        self.events.append("verify")
        return super().verify(plan, staged, pool)

    def commit(self, plan: CommitPlan | DraftCommitPlan, states: object, pool: MambaStatePool) -> None:
        self.events.append("commit")
        super().commit(plan, states, pool)


def _world(transactional: bool, refuse: bool = False) -> tuple[World, RecordingGate, list[str]]:
    events: list[str] = []
    w = make_world(capacity=6, live_slots=5)
    gate = RecordingGate(events, refuse=refuse)
    w.executor = Executor(w.pool, w.ledger, RecordingModel(events), slots=w.slots, transactional=transactional, gate=gate)
    return w, gate, events


def _run(w: World, gate: RecordingGate, events: list[str], plan: object, model_call: str) -> None:
    events.clear()
    gate.begin(w.pool)
    w.executor.execute(plan)  # type: ignore[arg-type]  # every plan kind goes through here
    name = type(plan).__name__
    assert events == [f"validated {name}", model_call, f"applied {name}"], events
    assert gate.clean_at_validated, f"{name}: the pool was written before the gate's validated"


@pytest.mark.parametrize("transactional", [False, True])
def test_validated_comes_before_any_write_and_applied_after_the_model(transactional: bool) -> None:
    w, gate, events = _world(transactional)
    # a prefill whose init ops write (a clear of slot 1, a COW of cache slot 4 into slot 2)
    _, fresh = extend_plan([request(1, 1, [5, 6], 0)], ledger=w.ledger)
    _run(w, gate, events, fresh, "forward")
    assert bool((w.pool.buffer[1] == 0).all()) and w.ledger.is_consumed(fresh.tickets[0])
    _, copy = extend_plan([request(2, 2, [7], 8, intent=CopyFrom(src=MambaSlot(4), prefix_len=3))], ledger=w.ledger)
    _run(w, gate, events, copy, "forward")
    assert torch.equal(w.pool.buffer[2], w.pool.buffer[4])
    running = decode_batch([1, 2], [1, 2], [4, 4], [20, 21])
    _run(w, gate, events, lower(running, LowerContext()), "forward")
    draft = prepare_for_draft(running, SpecContext(k=2, next_tokens=[3, 3], kv_locs=list(range(30, 36))))
    _run(w, gate, events, lower(draft, LowerContext()), "propose")
    v = prepare_for_verify(draft, proposed(draft, np.full(4, 7, dtype=np.int64)))
    _run(w, gate, events, lower(v, LowerContext()), "verify")
    c = commit(v, accept(v, verified(v, np.full(6, 7, dtype=np.int64))))
    _run(w, gate, events, lower(c, LowerContext()), "commit")
    _run(w, gate, events, lower(prepare_for_draft_commit(c, draft), LowerContext()), "commit")
    w.ledger.assert_drained()


@pytest.mark.parametrize("transactional", [False, True])
def test_a_gate_that_refuses_leaves_everything_as_it_was(transactional: bool) -> None:
    w, gate, events = _world(transactional, refuse=True)
    _, plan = extend_plan([request(1, 1, [5, 6], 0)], ledger=w.ledger)
    before = w.state()
    gate.begin(w.pool)
    with pytest.raises(Refused):
        w.executor.execute(plan)
    after = w.state()
    assert events == ["validated ExtendPlan"]  # the model never ran
    assert torch.equal(before[0], after[0]), "the pool was written"
    assert before[1:] == after[1:], "the ledger or the allocators changed"
    assert not w.ledger.is_consumed(plan.tickets[0])
    # the group agrees the next time: the same plan runs, its clear applied once
    gate.refuse = False
    _run(w, gate, events, plan, "forward")
    assert bool((w.pool.buffer[1] == 0).all())
    w.ledger.assert_drained()
