"""The forwards of one engine step, and which one a step runs (``Forwards.run``). Each lowers its
batch through the engine's ``Pipeline``, runs the plans through the ``ForwardRunner`` and records
what the step did in ``Progress``.

Per engine step, one kind of forward (``StepKind``):

- **extend** when requests wait for (more of) their prefill and nothing runs, or the engine's
  scheduling policy (``compiler.engine.policy``) says so while rows run: each gets its next chunk
  (at most ``chunk_size`` tokens, at most ``token_budget`` in total). A first chunk starts with a clear (fresh slot) or a COW (a cached
  prefix, from a ``PrefixState`` or the prefix cache), later chunks continue. One
  ``Pipeline.prefill`` lowers the forward with one ticket per pool and both executors run the same
  ``ExtendPlan``: the draft pool's init ops run there, and only there. A chunk that ends at a prefix
  worth caching carries a snapshot into a cache slot (a one-shot op after the forward, through the
  same tickets and ledger). The token the target's sampler chose at a prompt's end is the request's first token.
- **mixed** (``k == 0`` only, on by default, ``mixed=False`` turns it off): while requests both
  run and wait, the running batch's decode and the next prefill chunks share one MIXED forward.
  With a draft the policy chooses between a prefill step and a speculative step instead: a
  speculative iteration is four forwards over two models (the same choice as engines that turn
  mixed chunked prefill off under speculation).
- otherwise **decode** (``k == 0``: plain greedy) or **spec** (``k > 0``): draft proposal (draft
  executor), verify (target), accept + commit (target), draft extend (draft). Rejected KV
  locations go back to the allocator right after the commit.

When the next decode or spec step cannot get its KV locations, the newest running requests are
retracted (``retract``) and re-prefill their prompt plus their output so far later.

Pipelined (``pipelined``, ``k == 0``: the engine's ``overlap``): each step's forward is built and sent
before the previous one is read back (``run_pipelined``); the step kinds are chosen as above.

``Forwards`` holds the running batch (a frozen ``DecodeBatch`` replaced each step) and emits tokens
into the request table; requests that finish go through the engine's one release path (``release``),
and so do requests whose next token's logits are not finite (``Ending.ERROR``: the backend's sampler
gives such a row or verify position ``NON_FINITE``; ``compiler.engine.nonfinite``). Tokens come
back chosen, as ``ir.results`` nodes (``backend.boundary.checked``); nothing here reads logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np

from backend.boundary import Backend, Backends, checked, checked_sampled
from backend.ledger import Ledger
from compiler.engine.cache_session import CacheSession
from compiler.engine.chunks import ChunkPlanner
from compiler.engine.kv_refs import KVRefs
from compiler.engine.nonfinite import bonus_tokens
from compiler.engine.policy import QueueState, SchedulePolicy
from compiler.engine.report import SpecStats, StepKind
from compiler.engine.requests import Ending, Request, RequestState, RequestTable
from compiler.engine.runner import ForwardRunner, StepFailed, Submitted, cause_words, rids_of
from compiler.steps import Pipeline
from ir.batch import DecodeBatch, ExtendBatch
from ir.columns import I64, frozen_i64
from ir.ids import MambaSlot, RequestId, SampleId
from ir.mint import mint_sample_id
from ir.request import AdmittedRequest
from ir.results import NON_FINITE, Logprobs, Verified
from ir.sampling import SamplingRows
from ir.spec import AcceptResult, CommitBatch
from passes.prepare_for_decode import DecodeContext
from passes.prepare_for_draft import SpecContext

__all__ = ["Forwards", "InFlight", "Progress"]


class Progress:
    """What one step did, filled in as it goes (the engine's ``StepReport`` at the end)."""

    def __init__(self) -> None:
        self.requests = self.prefill_tokens = self.tokens = 0
        self.finished: list[RequestId] = []
        self.aborted: list[RequestId] = []
        self.errored: list[RequestId] = []
        """Requests whose next token's logits were not finite (``_emit``); released by ``_finish``."""
        self.emitted: list[RequestId] = []
        """Requests given at least one token."""


@attrs.frozen(kw_only=True)
class InFlight:
    """What a pipelined forward sent and not read back yet is for: the requests whose next token it
    samples, in the order of its rows, and the id its tokens are kept under (``DecodePlan.sample_id``;
    the next pipelined decode names it as ``inputs_from``). A read-only view (``Forwards.in_flight``)."""

    rids: tuple[RequestId, ...]
    sample_id: SampleId


@attrs.frozen
class _Inflight:
    """A pipelined forward sent and not read back yet, and what reading it back does: the rows
    whose token it samples (the extend rows it completes, then the decode rows, in the order of its
    logits' rows), each with the request record it was built for, the snapshots to enter into the
    prefix cache, and the id its tokens are kept under."""

    submitted: Submitted
    sample_id: SampleId
    rows: list[tuple[int, Request]]
    """(row of the logits, request) of every token the forward samples for a request."""
    first_decode_row: int
    """Rows of the logits from here on are decode rows (before: extend rows)."""
    snapshots: list[tuple[Request, MambaSlot, int]]
    """(request, cache slot, position) of every snapshot the forward takes."""

    @property
    def rids(self) -> list[RequestId]:
        return [r.rid for _, r in self.rows]


class Forwards:
    """The engine's forwards (see the module): it holds the running batch, chooses each step's kind of
    forward (``run``), lowers it through the ``Pipeline``, runs its plans through the
    ``ForwardRunner``, emits the tokens that come back into the request table and releases requests
    that end through the engine's ``release``. Built and owned by ``compiler.engine.Engine``."""

    def __init__(
        self,
        *,
        k: int,
        pipeline: Pipeline,
        runner: ForwardRunner,
        backends: Backends,
        ledger: Ledger,
        requests: RequestTable,
        kv_refs: KVRefs,
        session: CacheSession,
        planner: ChunkPlanner,
        stats: SpecStats,
        release: Callable[[Sequence[RequestId], Ending], None],
        mixed: bool,
        policy: SchedulePolicy,
        head: bool = False,
    ) -> None:
        self.k, self.pipeline, self.runner, self.backends = k, pipeline, runner, backends
        self.head = head
        """The draft is a head (MTP/EAGLE) that reads the target's hidden states: it runs its own
        phases (``ir.head``) after each target prefill and each speculative commit."""
        self.ledger = ledger
        self.target: Backend = backends.target
        self.draft: Backend | None = backends.draft
        self.requests, self.kv_refs, self.session, self.planner, self.stats = requests, kv_refs, session, planner, stats
        self.release, self.mixed = release, mixed
        self.running = DecodeBatch.empty()
        self.progress = Progress()
        self.policy = policy
        self._streak = 0
        """Prefill steps in a row just before this one while rows were running (``QueueState``)."""
        self.pipelined = False
        """``k == 0``: build each step's forward while the previous one runs (``run_pipelined``)."""
        self._inflight: _Inflight | None = None
        self._deferred: list[Submitted] = []
        """Commits sent to executor processes and not waited for yet: nothing in this step needs
        their result, and the next plan on each pool runs after them in that process."""

    @property
    def in_flight(self) -> InFlight | None:
        """The pipelined forward sent and not read back yet (``None`` when there is none)."""
        f = self._inflight
        return None if f is None else InFlight(rids=tuple(f.rids), sample_id=f.sample_id)

    def settle(self) -> None:
        """Wait for the plans still in flight in executor processes (the commits of the last
        speculative iteration, the last pipelined decode): ``StepFailed`` if one failed."""
        self.land()
        self._settle_commits()

    def _settle_commits(self) -> None:
        deferred, self._deferred = self._deferred, []
        for i, s in enumerate(deferred):
            try:
                self.runner.wait(s)
            except BaseException:
                self._deferred = deferred[i + 1 :]
                raise

    def run(self) -> StepKind:
        """Choose this step's forward and run it, after settling the commits still in flight
        (``pipelined``: ``run_pipelined`` takes every step)."""
        self._settle_commits()
        if self.pipelined and self.draft is None:
            return self.run_pipelined()
        self.land()
        if self.mixed and self.draft is None and self.requests.has_queued and self.running.num_requests:
            if self._reserve_kv(1):  # False only when retraction emptied the running batch
                self._streak = 0
                return self.run_mixed()
        running = self.running.num_requests
        if self.requests.has_queued and (
            not running or self.policy.prefill_now(QueueState(queued=self.requests.num_queued, running=running, prefill_streak=self._streak))
        ) and self.prefill():
            self._streak = self._streak + 1 if running else 0
            return StepKind.EXTEND
        self._streak = 0
        if not self.running.num_requests:
            return StepKind.IDLE
        if not self._reserve_kv(self.k + 1):
            return StepKind.RETRACT
        if self.draft is None:
            self.decode()
            return StepKind.DECODE
        self.speculate()
        return StepKind.SPEC

    def _reserve_kv(self, per_row: int) -> bool:
        """Retract the newest running requests until the next step's KV locations fit."""
        retracted = False
        while self.running.num_requests and self.kv_refs.kv.num_free < per_row * self.running.num_requests:
            if self.session.evict():
                continue
            self.retract(self.running.rid_at(-1))
            retracted = True
        return not retracted or bool(self.running.num_requests)

    def abort_failed(self, failure: StepFailed) -> list[RequestId]:
        """Abort the live requests of a forward that failed after every retry; returns them."""
        self.backends.settle()  # a plan submitted beside the failed one has settled its claim
        self._deferred.clear()  # the other commit of the failed one's iteration: its rows are aborted
        # a forward sent after the failed one names tokens that were never sampled and is never read
        # back: its requests (rows it admitted too, whose chunks count as run) go with the failed one's
        dropped, self._inflight = self._inflight, None
        # every ticket is consumed within the step that registers it, so what is outstanding now
        # belongs to the failed forward
        reason = f"aborted: its forward failed ({cause_words(failure.cause)})"
        for t in self.ledger.outstanding():
            self.ledger.cancel(t, reason)
        self.backends.cancel_outstanding(reason)
        self.stats.failed_steps += 1
        rids = failure.rids + (rids_of(dropped.submitted.plan) if dropped is not None else ())
        live = [rid for rid in dict.fromkeys(rids) if rid in self.requests]
        self.stats.aborts += len(live)
        self.progress.aborted.extend(live)
        for ex in (self.target, self.draft):
            if ex is not None and ex.usable:
                ex.forget_verifies()
        self.release(live, Ending.FAILED)
        return live

    def retract(self, rid: RequestId) -> None:
        """Send a running request back to the queue (out of KV room)."""
        self.stats.retractions += 1
        self.release([rid], Ending.RETRACTED)

    def _sampling(self, admitted: Sequence[AdmittedRequest]) -> SamplingRows | None:
        """The sampling rows of the requests a prefill admits (``None`` when every one is greedy,
        asks for no logprobs and no penalty and bans nothing: the batch then carries none). A request
        with ``min_tokens`` and stop ids (its end-of-sequence ids included) bans them below the
        absolute position ``len(original prompt) + min_tokens``, where its output token at index
        ``min_tokens`` goes, whatever its prompt has grown to by retraction (capped at its
        ``max_new_tokens``: it ends there anyway)."""
        records = [self.requests[a.rid] for a in admitted]
        bans = [
            (len(r.original) + min(r.sampling.min_tokens, r.max_new_tokens), sorted(r.stop)) if r.sampling.min_tokens and r.stop else (0, [])
            for r in records
        ]
        if all(r.sampling.greedy and r.sampling.logprobs is None and not r.sampling.penalised for r in records) and not any(
            until for until, _ in bans
        ):
            return None
        return SamplingRows.of([r.sampling for r in records], [r.index for r in records], bans)

    def prefill(self) -> bool:
        """The next prefill chunks in one EXTEND forward; False if none fits."""
        admitted = self.planner.next_chunks()
        if not admitted:
            return False
        if self.head:
            self._prefill_with_head(admitted)
            return True
        extend, plan = self.pipeline.prefill(admitted, sampling=self._sampling(admitted))
        on_target = self.runner.submit(self.target, plan)
        # the draft pool's init ops (and snapshots) are consumed there, once; in executor processes
        # the two prefills run at the same time
        on_draft = self.runner.submit(self.draft, plan) if self.draft is not None else None
        sampled = checked(plan, self.runner.wait(on_target))
        self.stats.prefills += 1
        self._wait(on_draft)
        self._after_chunks(admitted, extend, sampled.tokens.tolist(), sampled.logprobs)
        self.running = self.pipeline.merge(self.running, extend)
        self._finish()
        return True

    def _prefill_with_head(self, admitted: Sequence[AdmittedRequest]) -> None:
        """The target's prefill, keeping its hidden states, then the head's extend over the same
        chunks with them: the head pool's init ops and snapshots run there, once."""
        assert self.draft is not None
        extend, plan = self.pipeline.prefill(admitted, sampling=self._sampling(admitted), keep_hidden=True)
        sampled = checked(plan, self.runner.run(self.target, plan))
        self.stats.prefills += 1
        hidden = sampled.hidden
        assert hidden is not None  # (``checked``: the plan asked for them)
        _, hplan = self.pipeline.head_extend(extend, hidden)
        self.runner.run(self.draft, hplan)
        self._after_chunks(admitted, extend, sampled.tokens.tolist(), sampled.logprobs)
        self.running = self.pipeline.merge(self.running, extend)
        self._finish()

    def _wait(self, *submitted: Submitted | None) -> None:
        for s in submitted:
            if s is not None:
                self.runner.wait(s)

    def _after_chunks(self, admitted: Sequence[AdmittedRequest], extend: ExtendBatch, tokens: list[int], lp: Logprobs | None) -> None:
        """Advance the prefilled requests, cache their snapshots, and emit the first token of each
        whose prompt is complete (``tokens``: one per extend row, in ``extend.rids`` order; ``lp``
        their logprobs, entries in the same order, or ``None``)."""
        completed, snapshots = self._chunks_ran(admitted)
        for r, slot, pos in snapshots:
            self._snapshot_taken(r, slot, pos)
        rows = {rid: i for i, rid in enumerate(extend.rid_list())}
        at = [[rows[r.rid]] for r in completed]
        self._emit([r.rid for r in completed], [[int(tokens[i[0]])] for i in at], lp, at)

    def _chunks_ran(self, admitted: Sequence[AdmittedRequest]) -> tuple[list[Request], list[tuple[Request, MambaSlot, int]]]:
        """The planner's bookkeeping of prefill chunks that are sent: positions advance, a first
        chunk's COW source is released, a request whose prompt is complete runs. Returns those
        requests and the snapshots the chunks take (request, cache slot, position)."""
        completed: list[Request] = []
        snapshots: list[tuple[Request, MambaSlot, int]] = []
        for a in admitted:
            r = self.requests[a.rid]
            if r.done == 0:
                self.session.copied(r.source)
            pos = a.prefix_len + int(a.input_ids.shape[0])
            r.done = pos
            self.progress.requests += 1
            self.progress.prefill_tokens += int(a.input_ids.shape[0])
            if a.snapshot_to is not None:
                snapshots.append((r, a.snapshot_to, a.prefix_len + a.snapshot_len))
            if not a.more_chunks:
                completed.append(r)
                self.requests.prefilled(r)
        return completed, snapshots

    def _snapshot_taken(self, r: Request, slot: MambaSlot, pos: int) -> None:
        """The snapshot of ``r``'s first ``pos`` tokens into cache slot ``slot`` ran: a cache entry."""
        assert r.slot is not None
        self.planner.share_prefix(int(r.slot), int(slot), pos)
        self.session.insert(slot, tuple(r.prompt[:pos].tolist()), tuple(r.context[:pos]))
        r.snapshot_at = r.snapshot_slot = None

    def run_mixed(self) -> StepKind:
        """``k == 0`` with requests both running and waiting: the running batch's decode and the
        next prefill chunks in one MIXED forward (a plain decode if no chunk fits)."""
        rids = self.running.rid_list()
        ctx = DecodeContext(next_tokens=self._pending_of(rids), kv_locs=self._alloc_for(rids, 1), rids=rids)
        admitted = self.planner.next_chunks()
        if not admitted:
            self.decode(ctx)
            return StepKind.DECODE
        mixed, plan = self.pipeline.mixed(admitted, self.running, ctx, sampling=self._sampling(admitted))
        result = checked(plan, self.runner.run(self.target, plan))
        tokens = result.tokens.tolist()
        self.stats.prefills += 1
        self.stats.decodes += 1
        self.stats.mixed += 1
        n = mixed.extend.num_requests
        self._after_chunks(admitted, mixed.extend, tokens[:n], result.logprobs)
        self.progress.requests += len(rids)
        self._emit(rids, [[t] for t in tokens[n:]], result.logprobs, [[n + i] for i in range(len(rids))])
        self.running = self.pipeline.merge(mixed.decode, mixed.extend)
        self._finish()
        return StepKind.MIXED

    def decode(self, ctx: DecodeContext | None = None) -> None:
        """One greedy token per running request (``ctx``: its inputs, when already allocated)."""
        rids = self.running.rid_list()
        if ctx is None:
            ctx = DecodeContext(next_tokens=self._pending_of(rids), kv_locs=self._alloc_for(rids, 1), rids=rids)
        self.running, plan = self.pipeline.decode(self.running, ctx)
        result = checked(plan, self.runner.run(self.target, plan))
        self.stats.decodes += 1
        self.progress.requests += len(rids)
        self._emit(rids, [[t] for t in result.tokens.tolist()], result.logprobs, [[i] for i in range(len(rids))])
        self._finish()

    def run_pipelined(self) -> StepKind:
        """``k == 0`` one step behind: this step's forward (extend, mixed or decode, chosen as
        ``run`` chooses) is built and sent before the one in flight is read back. Its plan names the
        input tokens it cannot know yet symbolically (``DecodePlan.inputs_from``: what the forward in
        flight samples, per slot; ``sample_id`` on the plan that samples them), and the backend
        resolves them when it stages it. The chunk planner's bookkeeping (positions, finished
        prompts, COW sources) is done when a plan is built; tokens, prefix-cache entries and finished
        requests when it is read back. Rows that the forward in flight finishes by length are left
        out; a row that emits its stop token there runs once more, and that token is dropped."""
        prev = self._inflight
        if prev is not None and prev.submitted.failed:  # (in process: it ran already) nothing to build on
            self.land()
        # (the engine pipelines only with mixed forwards: every step decodes every running row, and
        # prefills whatever is queued beside them)
        prefill = self.requests.has_queued
        if self.running.num_requests and not self._reserve_kv(1):
            self.land()
            return StepKind.RETRACT
        prev = self._inflight
        running = self.running
        if prev is not None:
            ending = [rid for rid in running.rid_list() if self._ends_at_next_token(rid)]
            if ending:
                running = self.pipeline.filter_decode(running, ending)
        rids = running.rid_list()
        sample = mint_sample_id()
        kv = self._alloc_for(rids, 1) if rids else None
        admitted = self.planner.next_chunks() if prefill else []
        if prev is not None and rids:
            inputs: I64 = np.zeros(len(rids), dtype=np.int64)
        elif rids:
            inputs = self._pending_of(rids)
        after = prev.sample_id if prev is not None else None
        built: _Inflight | None = None
        kind = StepKind.IDLE
        if admitted and rids:
            assert kv is not None
            mixed, mplan = self.pipeline.mixed(
                admitted, running, DecodeContext(next_tokens=inputs, kv_locs=kv, rids=rids), sample_id=sample, inputs_from=after,
                sampling=self._sampling(admitted),
            )
            built = self._built(self.runner.submit(self.target, mplan), sample, admitted, mixed.extend, rids)
            self.running = self.pipeline.merge(mixed.decode, mixed.extend)
            self.stats.prefills += 1
            self.stats.decodes += 1
            self.stats.mixed += 1
            kind = StepKind.MIXED
        elif admitted:
            extend, eplan = self.pipeline.prefill(admitted, sample_id=sample, sampling=self._sampling(admitted))
            built = self._built(self.runner.submit(self.target, eplan), sample, admitted, extend, [])
            self.running = self.pipeline.merge(running, extend)
            self.stats.prefills += 1
            kind = StepKind.EXTEND
        elif rids:
            assert kv is not None
            self.running, dplan = self.pipeline.decode(running, DecodeContext(next_tokens=inputs, kv_locs=kv, rids=rids), sample_id=sample, inputs_from=after)
            built = _Inflight(self.runner.submit(self.target, dplan), sample, [(i, self.requests[rid]) for i, rid in enumerate(rids)], 0, [])
            self.stats.decodes += 1
            kind = StepKind.DECODE
        else:
            self.running = running
        self._inflight = built
        if prev is not None:
            self._land(prev)
        if built is not None and built.submitted.failed:
            self.land()  # it failed already (in process, or the executor process is gone): say so now
        return kind

    def _built(
        self, submitted: Submitted, sample: SampleId, admitted: Sequence[AdmittedRequest], extend: ExtendBatch,
        decode_rids: Sequence[RequestId],
    ) -> _Inflight:
        """The planner's side of a prefill just sent (``_chunks_ran``), and what reading it back does."""
        completed, snapshots = self._chunks_ran(admitted)
        rows = {rid: i for i, rid in enumerate(extend.rid_list())}
        n = extend.num_requests
        sampled = [(rows[r.rid], r) for r in completed] + [(n + i, self.requests[rid]) for i, rid in enumerate(decode_rids)]
        return _Inflight(submitted, sample, sampled, n, snapshots)

    def _ends_at_next_token(self, rid: RequestId) -> bool:
        r = self.requests[rid]
        return r.state is RequestState.RUNNING and len(r.output) + 1 >= r.max_new_tokens

    def land(self) -> None:
        """Read back the pipelined forward in flight, if any (``_land``)."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._land(prev)

    def _land(self, prev: _Inflight) -> None:
        """Enter its snapshots into the prefix cache, emit its tokens and finish requests. A request
        retracted, aborted or finished since the plan was built (or retracted and back with a new
        record) gets nothing: its token is dropped, and its snapshot slot went back when it left."""
        result = checked_sampled(prev.submitted.plan, self.runner.wait(prev.submitted))
        tokens = result.tokens.tolist()
        for r, slot, pos in prev.snapshots:
            if self.requests.get(r.rid) is r:
                self._snapshot_taken(r, slot, pos)
        live = [(i, r) for i, r in prev.rows if self.requests.get(r.rid) is r and r.state is RequestState.RUNNING]
        self.progress.requests += sum(1 for i, _ in live if i >= prev.first_decode_row)  # (extend rows counted when sent)
        self._emit([r.rid for _, r in live], [[int(tokens[i])] for i, _ in live], result.logprobs, [[i] for i, _ in live])
        self._finish()

    def speculate(self) -> None:
        """One speculative iteration: the draft proposes k tokens per row (keeping its state after
        each), the target verifies them, the accepted prefix and a bonus token are committed on the
        target, and the draft commits its own state at the accepted position (no draft forward)."""
        assert self.draft is not None
        if self.head:
            self._speculate_with_head()
            return
        k, rids = self.k, self.running.rid_list()
        window = self._alloc_for(rids, k + 1)
        draft_batch, dplan = self.pipeline.draft(self.running, SpecContext(k=k, next_tokens=self._pending_of(rids), kv_locs=window, rids=rids))
        proposals = checked(dplan, self.runner.run(self.draft, dplan))
        drafts = proposals.tokens.reshape(len(rids), k).tolist()
        verify_batch, vplan = self.pipeline.verify(draft_batch, proposals)
        verified_result = checked(vplan, self.runner.run(self.target, vplan))
        result, committed, cplan = self.pipeline.commit(verify_batch, verified_result)
        on_target = self.runner.submit(self.target, cplan)
        draft_committed, dcplan = self.pipeline.draft_commit(committed, draft_batch)
        on_draft = self.runner.submit(self.draft, dcplan)
        # in executor processes both commits run while the host does the rest of the iteration
        # and the next step's passes; a commit that failed fails the next step (``settle``)
        self._drop_rejected(rids, committed)
        self.running = self.pipeline.merge(DecodeBatch.empty(), draft_committed)
        for s in (on_target, on_draft):
            if s.in_flight:
                self._deferred.append(s)
            else:
                self.runner.wait(s)
        self._emit_iteration(rids, drafts, verified_result, result)

    def _speculate_with_head(self) -> None:
        """One speculative iteration with a draft head: the head proposes k tokens per row from its
        carried state, the target verifies them keeping its hidden states, the accepted prefix and
        a bonus token are committed on the target, and the head catches up over the committed
        tokens with the verify's hidden states there (a forward: its proposal kept nothing)."""
        assert self.draft is not None
        k, rids = self.k, self.running.rid_list()
        window = self._alloc_for(rids, k + 1)
        draft_batch, dplan = self.pipeline.draft(self.running, SpecContext(k=k, next_tokens=self._pending_of(rids), kv_locs=window, rids=rids))
        proposals = checked(dplan, self.runner.run(self.draft, dplan))
        drafts = proposals.tokens.reshape(len(rids), k).tolist()
        verify_batch, vplan = self.pipeline.verify(draft_batch, proposals, keep_hidden=True)
        verified_result = checked(vplan, self.runner.run(self.target, vplan))
        result, committed, cplan = self.pipeline.commit(verify_batch, verified_result)
        self.runner.run(self.target, cplan)
        hidden = verified_result.hidden
        assert hidden is not None  # (``checked``: the verify asked for them)
        _, hplan = self.pipeline.head_commit(committed, hidden)
        self.runner.run(self.draft, hplan)
        self._drop_rejected(rids, committed)
        self.running = self.pipeline.merge(DecodeBatch.empty(), committed)
        self._emit_iteration(rids, drafts, verified_result, result)

    def _drop_rejected(self, rids: Sequence[RequestId], committed: CommitBatch) -> None:
        """Each row's rejected positions are the tail of its window, the last entries of its
        context: dropped there, and their KV locations released."""
        k = committed.k
        for r, m in zip(self.requests.records(rids), committed.accept_pos.tolist(), strict=True):
            if m < k:
                del r.context[m - k :]
        self.kv_refs.unref(committed.released_kv)

    def _emit_iteration(self, rids: Sequence[RequestId], drafts: list[list[int]], verified: Verified, result: AcceptResult) -> None:
        """Emit each row's accepted proposals and its bonus token (``NON_FINITE``: ``_emit`` ends
        that row), count the iteration, and finish the requests that ended."""
        k, accepted = verified.k, result.accepted
        bonus = bonus_tokens(verified.tokens, accepted.tolist(), k)
        emitted = [drafts[i][:m] + [b] for i, (m, b) in enumerate(zip(accepted.tolist(), bonus, strict=True))]
        self.stats.iterations += 1
        self.stats.row_iterations += len(rids)
        self.stats.proposed += k * len(rids)
        self.stats.accepted += int(accepted.sum())
        self.progress.requests += len(rids)
        at = [[i * (k + 1) + j for j in range(len(toks))] for i, toks in enumerate(emitted)]  # (window position j's entry)
        self._emit(rids, emitted, verified.logprobs, at)
        self._finish()

    def _alloc_for(self, rids: Sequence[RequestId], per_row: int) -> I64:
        kv = self.kv_refs.alloc(len(rids) * per_row)
        locs = kv.tolist()
        for i, r in enumerate(self.requests.records(rids)):
            r.context.extend(locs[i * per_row : (i + 1) * per_row])
        return kv

    def _pending_of(self, rids: Sequence[RequestId]) -> I64:
        pending: list[int] = []
        for r in self.requests.records(rids):
            token = r.pending
            assert token is not None, "every running request has emitted a token"
            pending.append(token)
        return frozen_i64(pending)

    def _emit(self, rids: Sequence[RequestId], tokens: list[list[int]], lp: Logprobs | None = None, at: list[list[int]] | None = None) -> None:
        """Each request's tokens up to the first ``NON_FINITE``; a request a flag cuts short before
        it is done is marked errored (``_finish`` ends it). With ``lp``, a request that asked for
        logprobs records the entry ``at[i][j]`` of ``lp`` for its ``j``-th token."""
        for i, (rid, r, toks) in enumerate(zip(rids, self.requests.records(rids), tokens, strict=True)):
            flagged = NON_FINITE in toks
            if flagged:
                toks = toks[: toks.index(NON_FINITE)]
            if r.logprobs is not None:
                if lp is None or at is None:
                    raise AssertionError(f"request {rid} asked for logprobs and its forward gave none")  # (a sampling row asks: the backend answers)
                r.logprobs.extend({"id": t, **lp.entry(e)} for t, e in zip(toks, at[i], strict=False))
            r.output.extend(toks)
            self.progress.tokens += len(toks)
            if toks:
                r.pending = toks[-1]
                self.progress.emitted.append(rid)
            if flagged and not r.is_done():
                self.progress.errored.append(rid)

    def _finish(self) -> None:
        """Release the errored requests, then the finished ones (after the running batch is the
        step's new one: a release filters it)."""
        if self.progress.errored:
            errored = [rid for rid in dict.fromkeys(self.progress.errored) if rid in self.requests]
            self.release(errored, Ending.ERROR)
        done = [r.rid for r in self.requests if r.state is RequestState.RUNNING and r.is_done()]
        if done:
            self.progress.finished.extend(done)
            self.release(done, Ending.FINISHED)
