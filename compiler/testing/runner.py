"""Run a ``compiler.testing.strategies.StepSequence`` through a ``compiler.steps.Pipeline``.

``run_steps(pipeline, sequence, execute=...)`` replays the steps the way an engine drives its
pipeline: a prefill (``Pipeline.prefill``) or a mixed forward (``Pipeline.mixed``) and then the
finished prefills joining the running batch (``Pipeline.merge``), decodes (``Pipeline.decode``),
finished requests leaving it (``Pipeline.filter_decode``), and speculative iterations (``draft``,
``verify``, ``commit``, then ``draft_commit`` or ``draft_extend``, and ``merge``). Every pass runs
through the pipeline's pass manager, so its verification level applies.

``execute`` runs each plan as soon as it is lowered (``compiler.testing.fakes.FakeBackend.execute``
over small pools, or your own executors); the proposals a draft returns go to its verify and the
tokens a verify returns to its commit. Without it nothing runs: the draws of the sequence stand in
for the proposals and target tokens, and the lowered plans' tickets stay outstanding in the
pipeline's ledger until ``consume_tickets`` consumes them as a backend would.

This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeAlias, assert_never, get_args

import attrs
import numpy as np

from backend.ledger import Ledger
from compiler.steps import Pipeline
from compiler.testing.strategies import Decode, Finish, Mixed, Prefill, Speculate, Step, StepSequence
from ir.batch import DecodeBatch
from ir.columns import frozen_i64
from ir.errors import short_repr
from ir.head import HeadExtendPlan
from ir.linear import keeps_linear
from ir.nodes import Plan
from ir.plan import ExtendPlan, MixedPlan
from ir.request import AdmittedRequest
from ir.results import Result, Verified
from ir.spec import Proposals
from passes.prepare_for_decode import DecodeContext
from passes.prepare_for_draft import SpecContext

__all__ = ["Execute", "Trace", "consume_tickets", "run_steps"]

Execute: TypeAlias = Callable[[Plan], Result]
"""Runs one plan on a backend and gives back its result (``Executor.execute`` is one)."""


@keeps_linear
@attrs.define
class Trace:
    """What ``run_steps`` did: every plan it lowered, in order (with ``execute``: the results, one
    per plan), and the running batch after the last step."""

    plans: list[Plan]
    results: list[Result]
    running: DecodeBatch


_STEPS: tuple[type, ...] = get_args(Step)
_PLANS: tuple[type, ...] = get_args(Plan)  # (the nested unions are flattened: every plan class)


def _check_arg(fn: str, name: str, value: object, cls: type, what: str) -> None:
    if not isinstance(value, cls):
        raise TypeError(f"{fn}: {name} must be {what}, got {short_repr(value)} ({type(value).__name__})")


def _iterable(fn: str, name: str, value: object, what: str) -> Iterable[object]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{fn}: {name} must be {what}, got {short_repr(value)} ({type(value).__name__})")
    return value


def _ctx(tokens: Iterable[int], kv: Iterable[int]) -> DecodeContext:
    return DecodeContext(next_tokens=list(tokens), kv_locs=list(kv))


def run_steps(pipeline: Pipeline, sequence: StepSequence | Iterable[Step], *, execute: Execute | None = None) -> Trace:
    """Run ``sequence``'s steps through ``pipeline`` from an empty running batch, each plan through
    ``execute`` when given (see the module docstring); returns the ``Trace``. A ``TypeError`` names
    an argument of the wrong kind (a step that is not one, by its index) and a result of the wrong
    kind (a draft's must be ``Proposals``, a verify's ``Verified``)."""
    _check_arg("run_steps", "pipeline", pipeline, Pipeline, "a compiler.steps.Pipeline")
    if execute is not None and not callable(execute):
        raise TypeError(f"run_steps: execute must be a function of a plan (or None), got {short_repr(execute)} ({type(execute).__name__})")
    steps = _iterable("run_steps", "sequence", sequence, "a StepSequence or an iterable of steps")
    running = DecodeBatch.empty()
    plans: list[Plan] = []
    results: list[Result] = []

    def run(plan: Plan) -> Result | None:
        plans.append(plan)
        if execute is None:
            return None
        out = execute(plan)
        results.append(out)
        return out

    for i, step in enumerate(steps):
        if not isinstance(step, (Prefill, Mixed, Decode, Finish, Speculate)):  # (the members of Step)
            hint = " (requests are prefilled by a step: Prefill(requests=[...]))" if isinstance(step, AdmittedRequest) else ""
            raise TypeError(f"run_steps: sequence[{i}] must be a step ({', '.join(t.__name__ for t in _STEPS)}), "
                            f"got {short_repr(step)} ({type(step).__name__}){hint}")
        match step:
            case Prefill(requests=requests):
                extend, plan = pipeline.prefill(requests)
                run(plan)
                running = pipeline.merge(running, extend)
            case Mixed(requests=requests, next_tokens=tokens, kv_locs=kv):
                mixed, mplan = pipeline.mixed(requests, running, _ctx(tokens, kv))
                run(mplan)
                running = pipeline.merge(mixed.decode, mixed.extend)
            case Decode(next_tokens=tokens, kv_locs=kv):
                running, dplan = pipeline.decode(running, _ctx(tokens, kv))
                run(dplan)
            case Finish(rids=rids):
                running = pipeline.filter_decode(running, rids)
            case Speculate():
                running = _speculate(pipeline, running, step, run)
            case _:
                assert_never(step)
    return Trace(plans=plans, results=results, running=running)


def _speculate(pipeline: Pipeline, running: DecodeBatch, step: Speculate, run: Callable[[Plan], Result | None]) -> DecodeBatch:
    """One speculative iteration; returns the new running batch."""
    draft, dplan = pipeline.draft(running, SpecContext(k=step.k, next_tokens=list(step.next_tokens), kv_locs=list(step.kv_locs)))
    out = run(dplan)
    if out is None:
        proposals = Proposals(k=step.k, draft_id=draft.draft_id, tokens=list(step.proposals))
    elif isinstance(out, Proposals):
        proposals = out
    else:
        raise TypeError(f"run_steps: execute gave a {type(out).__name__} for a DraftPlan, not its Proposals")
    verify, vplan = pipeline.verify(draft, proposals)
    verified = run(vplan)
    if verified is None:
        verified = Verified(k=step.k, verify_id=verify.verify_id, rids=verify.rids, tokens=frozen_i64(np.asarray(step.target_tokens, dtype=np.int64)))
    elif not isinstance(verified, Verified):
        raise TypeError(f"run_steps: execute gave a {type(verified).__name__} for a VerifyPlan, not a Verified")
    _, committed, cplan = pipeline.commit(verify, verified)
    run(cplan)
    if step.draft_extend:
        caught_up, deplan = pipeline.draft_extend(committed)
        run(deplan)
        return pipeline.merge(DecodeBatch.empty(), caught_up)
    draft_committed, dcplan = pipeline.draft_commit(committed, draft)
    run(dcplan)
    return pipeline.merge(DecodeBatch.empty(), draft_committed)


def consume_tickets(ledger: Ledger, plans: Iterable[Plan]) -> int:
    """Consume every ticket of ``plans`` (the init and snapshot ops of their prefills and head
    extends, on each pool they name) through ``ledger``, as a backend that applies nothing would; returns how many. For a test
    without a backend that wants the ledger drained. ``TypeError`` naming an argument of the wrong
    kind (a ``Trace``: its ``plans``), before any ticket is consumed."""
    _check_arg("consume_tickets", "ledger", ledger, Ledger, "a backend.ledger.Ledger")
    if isinstance(plans, Trace):
        raise TypeError("consume_tickets: plans must be the plans, got a Trace (pass trace.plans)")
    listed = list(_iterable("consume_tickets", "plans", plans, "an iterable of plans"))
    for i, plan in enumerate(listed):
        if not isinstance(plan, _PLANS):
            raise TypeError(f"consume_tickets: plans[{i}] must be a plan, got {short_repr(plan)} ({type(plan).__name__})")
    n = 0
    for plan in listed:
        part = plan.extend if isinstance(plan, MixedPlan) else plan
        if not isinstance(part, (ExtendPlan, HeadExtendPlan)):
            continue
        for ticket in part.all_tickets():
            with ledger.consuming(ticket, ticket.pool):
                n += 1
    return n
