"""Typed step functions: one scheduler step = a fixed sequence of passes, then registration.

``Pipeline`` binds a pass manager, the lowering context (which pools see init ops) and the ledger.
Each method calls the passes through the manager with their own types, so mypy checks every edge of
the lifecycle, and registers the tickets of each lowered prefill plan with the ledger: a ticket the
backend never consumes is then reported by the ledger (``backend.ledger.Ledger.assert_drained``).

With a draft head (MTP/EAGLE, ``ir.head``; its pools in ``LowerContext.head_pools``), one step's
phases are::

    batch, plan = pipe.prefill(requests, keep_hidden=True)       # plan.keep_hidden: a fresh HiddenId
    sampled = checked(plan, <run plan on the target>)            # sampled.hidden: the handle
    head_batch, head_plan = pipe.head_extend(batch, sampled.hidden)  # the head pool's tickets registered
    <run head_plan on the head's backend>
    ...
    verify, vplan = pipe.verify(draft, proposals, keep_hidden=True)
    verified = checked(vplan, <run vplan on the target>)
    result, committed, cplan = pipe.commit(verify, verified)
    head_commit, hcplan = pipe.head_commit(committed, verified.hidden)

``head_extend`` and ``head_commit`` are ``@consumes``: giving one handle to two of them is a
``linear-reuse`` error, and the handle may not be kept past the step (``linear-escape``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from compiler.manager import PassManager
from ir import spec
from ir.batch import DecodeBatch, ExtendBatch, MixedBatch
from ir.errors import PreconditionError
from ir.head import HeadCommitBatch, HeadCommitPlan, HeadExtendBatch, HeadExtendPlan
from ir.hidden import HiddenStates
from ir.ids import HiddenId, RequestId, SampleId
from ir.init import Op, Ticket
from ir.linear import consumes, retires
from ir.mint import mint_hidden_id
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from ir.request import AdmittedRequest
from ir.results import Verified
from ir.sampling import SamplingRows
from passes.accept import accept
from passes.commit import commit
from passes.filter_batch import filter_batch
from passes.lower import LowerContext, lower
from passes.merge_batch import merge_batch
from passes.mix_with_running import mix_with_running
from passes.prepare_for_decode import DecodeContext, prepare_for_decode
from passes.prepare_for_draft import SpecContext, prepare_for_draft
from passes.prepare_for_draft_commit import prepare_for_draft_commit
from passes.prepare_for_draft_extend import prepare_for_draft_extend
from passes.prepare_for_extend import prepare_for_extend
from passes.prepare_for_head_commit import prepare_for_head_commit
from passes.prepare_for_head_extend import prepare_for_head_extend
from passes.prepare_for_verify import prepare_for_verify
from passes.withdraw import withdraw

__all__ = ["Pipeline", "TicketBooks", "TicketRegistry"]


class TicketRegistry(Protocol):
    """Where a lowered plan's one-shot tickets are registered before any backend sees them
    (``backend.ledger.Ledger`` is one): compiling a step needs no runtime object."""

    def register(self, tickets: Iterable[Ticket[Op]], starts: Mapping[int, int] | None = None) -> None:
        """Expect each of ``tickets`` to be consumed exactly once (``backend.ledger.Ledger.register``);
        ``starts``: the lowered plan's rows, each slot mapped to the token its row starts at, which
        bind the tickets to that plan."""
        ...


@runtime_checkable
class TicketBooks(TicketRegistry, Protocol):
    """A ``TicketRegistry`` that can also cancel a plan's tickets, all or none, with a reason
    (``backend.ledger.Ledger.cancel_all``): what ``Pipeline.withdraw`` needs of its ledger."""

    def cancel_all(self, tickets: Iterable[Ticket[Op]], reason: str) -> None:
        """Record that every one of ``tickets`` will never run (``backend.ledger.Ledger.cancel_all``)."""
        ...


class Pipeline:
    """The typed steps of one engine: each method runs a fixed sequence of passes through the pass
    manager and returns the batch (the scheduler's state) and, where a forward runs, its plan.

    What it guarantees: every edge of the lifecycle is type-checked (a method takes exactly the IR
    types its passes take, so a prefill's init ops cannot reach a decode, a draft extend or a commit);
    every pass runs through ``pm`` (verification, dumps and timings as its settings say); and every
    one-shot ticket of a lowered plan is registered with ``ledger`` before the plan is returned, so
    the backend can claim it once and a ticket never consumed is reported. It runs no forward and
    holds no runtime object: the caller hands the plans to a backend and feeds their results back
    (``verify`` takes the draft's ``Proposals``, ``commit`` the target's tokens, ``head_extend`` and
    ``head_commit`` the hidden-state handles). A pass that refuses its input raises through the
    manager as ``PassError`` (the pass's own error chained), before anything is registered.

    ``lower_ctx`` (default: the target's pool only) says which pools a prefill's init ops are lowered
    for; ``pm`` defaults to ``PassManager.from_env()``."""

    def __init__(self, ledger: TicketRegistry, lower_ctx: LowerContext | None = None, pm: PassManager | None = None) -> None:
        self.ledger = ledger
        self.lower_ctx = lower_ctx if lower_ctx is not None else LowerContext()
        self.pm = pm if pm is not None else PassManager.from_env()

    def prefill(
        self, requests: Sequence[AdmittedRequest], *, sample_id: SampleId | None = None, sampling: SamplingRows | None = None,
        keep_hidden: bool = False,
    ) -> tuple[ExtendBatch, ExtendPlan]:
        """``sample_id``: a pipelined step's (``ExtendPlan.sample_id``); ``sampling``: the requests'
        sampling rows (``None``: all greedy); ``keep_hidden``: the forward keeps the target's hidden
        states for the draft head's extend (``ExtendPlan.keep_hidden``, a fresh ``HiddenId``)."""
        batch = self.pm.run(prepare_for_extend, requests, sampling)
        plan: ExtendPlan = self.pm.run(lower, batch, self.lower_ctx, sample_id=sample_id, keep_hidden=_hidden_id(keep_hidden))
        self.ledger.register((*plan.tickets, *plan.snapshots), _starts(plan))
        return batch, plan

    def mixed(
        self, requests: Sequence[AdmittedRequest], running: DecodeBatch, ctx: DecodeContext, *,
        sample_id: SampleId | None = None, inputs_from: SampleId | None = None, sampling: SamplingRows | None = None,
        keep_hidden: bool = False,
    ) -> tuple[MixedBatch, MixedPlan]:
        """New prefills and the running decodes (advanced by ``ctx``) in one forward; ``sample_id``
        and ``inputs_from`` as in ``decode`` (both parts keep their tokens under ``sample_id``);
        ``sampling`` the new requests' sampling rows and ``keep_hidden`` (for the extend part's
        rows), as in ``prefill``."""
        extend = self.pm.run(prepare_for_extend, requests, sampling)
        decode = self.pm.run(prepare_for_decode, running, ctx)
        batch = self.pm.run(mix_with_running, extend, decode)
        plan: MixedPlan = self.pm.run(
            lower, batch, self.lower_ctx, sample_id=sample_id, inputs_from=inputs_from, keep_hidden=_hidden_id(keep_hidden)
        )
        self.ledger.register((*plan.extend.tickets, *plan.extend.snapshots), _starts(plan.extend))
        return batch, plan

    def decode(
        self, batch: ExtendBatch | MixedBatch | DecodeBatch, ctx: DecodeContext, *,
        sample_id: SampleId | None = None, inputs_from: SampleId | None = None,
    ) -> tuple[DecodeBatch, DecodePlan]:
        """``sample_id`` and ``inputs_from``: a pipelined decode's (``DecodePlan``); with
        ``inputs_from``, ``ctx.next_tokens`` are the placeholders (zeros)."""
        out = self.pm.run(prepare_for_decode, batch, ctx)
        plan: DecodePlan = self.pm.run(lower, out, self.lower_ctx, sample_id=sample_id, inputs_from=inputs_from)
        return out, plan

    def filter_decode(self, batch: DecodeBatch, drop: Iterable[RequestId]) -> DecodeBatch:
        """``batch`` without the requests in ``drop`` (finished or aborted; ids not in it are ignored);
        ``batch`` itself when nothing is dropped."""
        return self.pm.run(filter_batch, batch, drop)

    def filter_extend(self, batch: ExtendBatch, drop: Iterable[RequestId]) -> ExtendBatch:
        """``batch`` without the requests in ``drop``, their init ops with them (the ``MambaInit`` keeps its
        serial, or becomes ``None`` when no op is left); ``batch`` itself when nothing is dropped."""
        return self.pm.run(filter_batch, batch, drop)

    @retires  # the plan: withdrawn, it never runs (running it after, on any executor, is ``linear-reuse``)
    def withdraw(self, batch: ExtendBatch, plan: ExtendPlan, drop: Iterable[RequestId], *, reason: str) -> tuple[ExtendBatch, ExtendPlan]:
        """Take the requests in ``drop`` out of a prefill that was lowered (``prefill``) but has not
        run: an admission rolled back, a request aborted before the forward. ``plan``'s tickets are
        cancelled in the ledger, all of them, with ``reason`` (``Ledger.cancelled``: recorded, never
        a silent drop; running ``plan`` after is refused before the pool is touched, and mypy's
        linear-use plugin reports it as ``linear-reuse``), and the remaining requests are
        lowered anew under fresh serials (``passes.withdraw``) and registered. The dropped requests'
        slots are then named by no outstanding ticket: the caller may free them and give them to
        another request at once. With every request dropped the batch and plan are empty (no ticket;
        nothing to run).

        Refused before anything is cancelled: ``plan`` not lowered from ``batch``
        (``PreconditionError``), a ``drop`` that names a request twice or one not in ``batch``
        (``PassError`` from ``withdraw``), a plan whose forward has run or is running
        (``ResourceReplayError``: drop those requests from the decode batch instead), a ledger that
        cannot cancel (``PreconditionError``). The ledger knows a plan has run by its tickets: a plan
        of continuation chunks only carries none, so withdrawing one that ran is not refused at run
        time (only by the plugin, where the run is in the same function); withdraw a plan before any
        backend has it."""
        args: tuple[object, object] = (batch, plan)  # typed; checked because callers need not be typed
        if not isinstance(args[0], ExtendBatch) or not isinstance(args[1], ExtendPlan):
            raise PreconditionError(
                "Pipeline.withdraw", f"takes a prefill's ExtendBatch and its ExtendPlan, got a {type(batch).__name__} and a {type(plan).__name__}"
            )
        _check_lowered_from(batch, plan)
        books = self.ledger
        if not isinstance(books, TicketBooks):
            raise PreconditionError("Pipeline.withdraw", f"the pipeline's ledger ({type(books).__name__}) has no cancel_all: it cannot cancel a plan's tickets")
        out = self.pm.run(withdraw, batch, drop)  # refuses a bad drop before anything is cancelled
        books.cancel_all((*plan.tickets, *plan.snapshots), reason)
        new_plan: ExtendPlan = self.pm.run(lower, out, self.lower_ctx, sample_id=plan.sample_id, keep_hidden=_hidden_id(plan.keep_hidden is not None))
        self.ledger.register((*new_plan.tickets, *new_plan.snapshots), _starts(new_plan))
        return out, new_plan

    def merge(
        self, running: DecodeBatch, prefilled: ExtendBatch | spec.DraftCommitBatch | spec.CommitBatch | spec.DraftExtendBatch | DecodeBatch
    ) -> DecodeBatch:
        """The running decode batch with ``prefilled`` joined, once its forward has run: the prefilled
        requests whose prompt is complete (chunked ones stay out), or the rows of a speculative
        iteration's last phase with the tokens they committed. A prefill's init ops have nowhere to go
        in a ``DecodeBatch``."""
        return self.pm.run(merge_batch, running, prefilled)

    # -- speculative decoding: one iteration = draft, verify, accept + commit, draft commit --------

    def draft(self, running: DecodeBatch, ctx: SpecContext) -> tuple[spec.DraftBatch, spec.DraftPlan]:
        """Speculative step 1: the draft batch and plan that feed each running request's pending token
        (``ctx`` has the pending tokens and ``k + 1`` fresh KV locations per row); the draft's id names
        the states its proposal keeps."""
        batch = self.pm.run(prepare_for_draft, running, ctx)
        plan: spec.DraftPlan = self.pm.run(lower, batch, self.lower_ctx)
        return batch, plan

    @consumes  # the proposals: one verify each (a second one is ``linear-reuse``)
    def verify(
        self, draft: spec.DraftBatch, proposals: spec.Proposals, *, keep_hidden: bool = False
    ) -> tuple[spec.VerifyBatch, spec.VerifyPlan]:
        """The verify of ``draft``'s ``proposals`` (what the draft executor returned for its plan);
        ``keep_hidden``: the forward keeps the target's hidden states at the window positions for
        the draft head's commit (``VerifyPlan.keep_hidden``, a fresh ``HiddenId``)."""
        batch = self.pm.run(prepare_for_verify, draft, proposals)
        plan: spec.VerifyPlan = self.pm.run(lower, batch, self.lower_ctx, keep_hidden=_hidden_id(keep_hidden))
        return batch, plan

    def commit(self, verify: spec.VerifyBatch, verified: Verified) -> tuple[spec.AcceptResult, spec.CommitBatch, spec.CommitPlan]:
        """Speculative steps 3 and 4: accept the proposals the target's tokens agree with (greedy:
        ``passes.accept``; ``verified`` is what the target gave back for ``verify``'s plan, and the
        target tokens of another verify are refused), and the commit batch and plan that make each
        row's state at its accepted position the committed one; the rejected positions' KV locations
        are in the batch's ``released_kv``."""
        result = self.pm.run(accept, verify, verified)
        batch = self.pm.run(commit, verify, result)
        plan: spec.CommitPlan = self.pm.run(lower, batch, self.lower_ctx)
        return result, batch, plan

    def draft_commit(self, committed: spec.CommitBatch, draft: spec.DraftBatch) -> tuple[spec.DraftCommitBatch, spec.DraftCommitPlan]:
        """Speculative step 5, with a draft model whose proposal kept its states: commit the draft's state
        at each row's accepted position (no draft forward runs). ``draft`` must be the iteration's draft,
        row for row."""
        batch = self.pm.run(prepare_for_draft_commit, committed, draft)
        plan: spec.DraftCommitPlan = self.pm.run(lower, batch, self.lower_ctx)
        return batch, plan

    def draft_extend(self, committed: spec.CommitBatch) -> tuple[spec.DraftExtendBatch, spec.DraftExtendPlan]:
        """Speculative step 5, the alternative to ``draft_commit``: a catch-up forward of the draft model
        over the tokens the target committed in this iteration."""
        batch = self.pm.run(prepare_for_draft_extend, committed)
        plan: spec.DraftExtendPlan = self.pm.run(lower, batch, self.lower_ctx)
        return batch, plan

    # -- a draft head (MTP/EAGLE): its extend after each prefill chunk, its commit after each verify --

    @consumes  # the hidden states: one head phase each (a second one is ``linear-reuse``)
    def head_extend(self, prefill: ExtendBatch, hidden: HiddenStates) -> tuple[HeadExtendBatch, HeadExtendPlan]:
        """The head's extend over ``prefill`` (the ``ExtendBatch`` of a prefill lowered with
        ``keep_hidden``; a mixed step's extend part) with the ``hidden`` states its result handed
        back. The plan carries the prefill's init ops as tickets for ``LowerContext.head_pools``,
        registered here with the ledger."""
        batch = self.pm.run(prepare_for_head_extend, prefill, hidden)
        plan: HeadExtendPlan = self.pm.run(lower, batch, self.lower_ctx)
        self.ledger.register((*plan.tickets, *plan.snapshots), _starts(plan))
        return batch, plan

    @consumes  # the hidden states: one head phase each (a second one is ``linear-reuse``)
    def head_commit(self, committed: spec.CommitBatch, hidden: HiddenStates) -> tuple[HeadCommitBatch, HeadCommitPlan]:
        """The head's commit over the tokens ``committed`` accepted, with the ``hidden`` states of
        the verify it was computed from (that verify's result, lowered with ``keep_hidden``)."""
        batch = self.pm.run(prepare_for_head_commit, committed, hidden)
        plan: HeadCommitPlan = self.pm.run(lower, batch, self.lower_ctx)
        return batch, plan


def _check_lowered_from(batch: ExtendBatch, plan: ExtendPlan) -> None:
    """``plan`` is ``batch`` lowered: the same requests in order, its tickets of ``batch``'s serials."""
    if not np.array_equal(batch.rids, plan.rids):
        raise PreconditionError("Pipeline.withdraw", f"the plan's requests {plan.rids.tolist()[:16]} are not the batch's {batch.rids.tolist()[:16]}")
    for column, mine, theirs in (("slots", batch.slots, plan.slots), ("prefix_lens", batch.prefix_lens, plan.prefix_lens),
                                 ("extend_lens", batch.extend_lens, plan.extend_lens), ("input_ids", batch.input_ids, plan.input_ids)):
        if not np.array_equal(mine, theirs):
            raise PreconditionError("Pipeline.withdraw", f"the plan's {column} are not the batch's: the plan was not lowered from it")
    init = None if batch.init is None else batch.init.serial
    snap = None if batch.snapshot is None else batch.snapshot.serial
    if (init is None) != (not plan.tickets) or (snap is None) != (not plan.snapshots):
        raise PreconditionError(
            "Pipeline.withdraw", f"the batch's ops (init {init}, snapshot {snap}) are not the plan's tickets "
            f"({len(plan.tickets)} init, {len(plan.snapshots)} snapshot): the plan was not lowered from it"
        )
    for t in plan.tickets:
        if t.serial != init:
            raise PreconditionError("Pipeline.withdraw", f"{t} is not of this batch's init (serial {init}): the plan was not lowered from it")
    for s in plan.snapshots:
        if s.serial != snap:
            raise PreconditionError("Pipeline.withdraw", f"{s} is not of this batch's snapshot (serial {snap}): the plan was not lowered from it")


def _starts(plan: ExtendPlan | HeadExtendPlan) -> dict[int, int]:
    """The rows of a lowered prefill plan: each slot and the token its row starts at."""
    return dict(zip(plan.slots.tolist(), plan.prefix_lens.tolist(), strict=True))


def _hidden_id(keep: bool) -> HiddenId | None:
    """A fresh ``HiddenId`` when the forward keeps hidden states for a head, else ``None``."""
    return mint_hidden_id() if keep else None
