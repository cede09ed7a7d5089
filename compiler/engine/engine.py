"""The serving engine: continuous batching over a target model and (for speculative decoding) a
draft model, each with its own Mamba pool, KV cache and token table, addressed by the same slot ids
and KV locations.

Per ``step()`` (one scheduler iteration), one kind of forward (``StepKind``), chosen and run by
``compiler.engine.forwards``.

The engine is small parts with one job each: the request table (``requests``: states and the
prefill queue), KV reference counts (``kv_refs``), the prefix-cache session (``cache_session``; a
null object when caching is off), prefill chunking (``chunks``), the step's forwards (``forwards``),
the forward runner (``runner``: retries and ``StepFailed``), prefix states (``prefixes``) and
the argument checks (``admission``). This module wires them and owns the step loop. Every request
that leaves (finished, aborted, failed, errored, retracted) goes through one release path, ``_release``.

The engine's plans run on ``backend.boundary.Backends`` that its ``transport`` opens (by default in
this process, ``backend.transports.in_process()``); it talks to them through that protocol only and cannot
tell how they run. With a transport whose backends run beside the host (``concurrent``: each
model's executor in its own process, ``backend.remote.Processes``), at ``k == 0`` (without retries,
with ``mixed``) every step is pipelined: built and sent while the previous forward runs, its input
tokens named by that forward's sample (``Forwards.run_pipelined``). ``step()``'s report then has the
kind of the forward it sent and the tokens, finished requests and failures of the one it read back;
``sync`` reads back the last one. At ``k > 0`` the target's and the draft's prefill of an extend
step run at the same time, and the commits of a speculative iteration run while the host goes on.
``close`` (or ``with Engine(...)``) closes the backends (stopping processes; ending a
tensor-parallel session, whose every rank's ledger counts it keeps in ``closing_ledgers``).

A request finishes at ``max_new_tokens`` or after emitting its ``stop`` token; ``abort`` ends it at
any time; a request whose next token's logits are not finite ends there, in ``errored``, its output
cut before that token (``compiler.engine.nonfinite``; the step goes on with the others). Greedy speculative decoding is lossless: the tokens emitted at any ``k`` equal those at
``k = 0``, retracted requests included (they re-prefill their prompt and output so far).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

from backend.allocator import KVAllocator, SlotAllocator
from backend.boundary import Backend, Backends, Transport
from backend.ledger import Ledger, RankLedgers
from backend.model import CapturesInnerStates, ReadsTargetHidden, ServedModel
from backend.transports import in_process
from compiler.engine.admission import check_engine_args, check_request, check_sampling
from compiler.engine.cache_session import CacheSession, NoCache, PrefixCacheSession
from compiler.engine.chunks import ChunkPlanner
from compiler.engine.forwards import Forwards, InFlight, Progress
from compiler.engine.kv_refs import KVRefs
from compiler.engine.policy import DEFAULT_POLICY, SchedulePolicy
from compiler.engine.prefixes import PrefixStates
from compiler.engine.report import PrefixState, SpecStats, StepKind, StepReport
from compiler.engine.requests import Ending, Request, RequestTable
from compiler.engine.runner import ForwardRunner, StepFailed
from compiler.manager import PassManager
from compiler.prefix_cache import PrefixCache
from compiler.steps import Pipeline
from ir.batch import DecodeBatch
from ir.columns import I64, frozen_i64, int_problem
from ir.errors import EngineStoppedError, PreconditionError, short_repr
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, PoolId, RequestId
from ir.sampling import SamplingParams
from passes.lower import LowerContext

__all__ = ["Engine"]


class Engine:
    """The serving engine: what an integrator drives to serve requests on a target model (and, for
    speculative decoding with ``k > 0``, a draft model or draft head).

    Use: build it with the served models (``backend.model.ServedModel``, e.g. a
    ``backend.hybrid.HybridModel``), ``admit`` requests, call ``step`` until ``live`` is 0 (or
    ``run_until_done``), read each ended request's tokens in ``outputs``, and ``close`` it (or use
    ``with``). Each step compiles one forward through the typed passes (``compiler.steps.Pipeline``)
    and runs it on the backends its ``transport`` opened; the engine owns the slot and KV allocators,
    the ledger of one-shot tickets, the request table and the optional prefix cache.

    What it guarantees: every one-shot init op (clear, copy-on-write, snapshot) runs exactly once, and
    the ledger reports one that never ran; a refused argument (``admit``, ``abort``, ``finish``, the
    constructor) changes nothing; a forward that still fails after ``retries`` aborts its requests (and
    those of a pipelined forward built on it) and serving goes on; greedy speculative decoding emits exactly the tokens of ``k = 0``. What it
    refuses: bad arguments (``PreconditionError`` naming the argument and the value), penalised
    requests without ``penalties=True``, calls from inside a step (a model hook calling back), and any
    call after an exception escaped a step (``EngineStoppedError``). One thread drives an engine."""

    def __init__(
        self,
        target: ServedModel[Any],
        draft: ServedModel[Any] | None,
        *,
        k: int,
        capacity: int = 16,
        kv_capacity: int = 4096,
        max_len: int = 512,
        chunk_size: int | None = None,
        token_budget: int | None = None,
        prefix_cache: PrefixCache | None = None,
        retries: int = 0,
        mixed: bool = True,
        pm: PassManager | None = None,
        transport: Transport | None = None,
        policy: SchedulePolicy = DEFAULT_POLICY,
        seed: int = 0,
        penalties: bool = False,
    ) -> None:
        """Every argument is checked before anything is allocated (``check_engine_args``: types and
        bounds, ``PreconditionError`` naming the argument and the value). ``transport``: how the
        plans run (``backend.boundary.Transport``; see the module; default ``in_process()`` of
        ``backend.transports``): ``processes()`` runs each model's executor in its own process,
        ``tensor_parallel(leader)`` on every rank of a tensor-parallel group (``target`` and
        ``draft`` are then rank 0's shards).
        ``policy``: when requests both wait for their prefill and run (with a draft, or
        ``mixed=False``), whether a step prefills or runs the running batch (``compiler.engine.policy``).
        ``seed``: the run's seed, from which a sampled request that sets no seed of its own gets one
        (``ir.sampling.derive_seed`` of this seed and its request id), in [0, 2**63 - 1].
        ``penalties``: serve presence, frequency and repetition penalties; the target's executor then
        keeps per-slot token counts (``backend.counts``: ``(capacity + 1) * vocab * 5`` bytes) where it
        runs. Without it ``admit`` refuses a penalised request."""
        if transport is None:
            transport = in_process()
        check_engine_args(
            target, draft, k=k, capacity=capacity, kv_capacity=kv_capacity, max_len=max_len, chunk_size=chunk_size,
            token_budget=token_budget, prefix_cache=prefix_cache, retries=retries, mixed=mixed, pm=pm, transport=transport,
            policy=policy, seed=seed, penalties=penalties,
        )
        self.penalties = penalties
        self.seed = int(seed)
        self.policy = policy
        self.transport = transport
        self.closing_ledgers: RankLedgers | None = None
        """Every rank's ledger counts, gathered by ``close`` when the transport is a group's."""
        k, capacity, kv_capacity, max_len, retries = int(k), int(capacity), int(kv_capacity), int(max_len), int(retries)
        self.k, self.vocab, self.retries, self.mixed, self.max_len = k, target.vocab, retries, mixed, max_len
        self.cache = prefix_cache
        self.ledger = Ledger()
        self.slots = SlotAllocator(capacity)
        self.kv = KVAllocator(kv_capacity)
        self.kv_refs = KVRefs(self.kv)
        self.session: CacheSession = (
            PrefixCacheSession(prefix_cache, self.slots, self.kv_refs) if prefix_cache is not None else NoCache()
        )
        # a draft head (MTP/EAGLE) reads the target's hidden states and runs its own phases, so its
        # pool gets the prefill's init ops through the head extend's tickets (``ir.head``)
        drafting: object = draft  # (a ServedModel, which a head also is)
        self.head = k > 0 and isinstance(drafting, ReadsTargetHidden) and drafting.reads_target_hidden()
        if self.head:
            ctx = LowerContext(pools=(TARGET_POOL,), head_pools=(DRAFT_POOL,))
        else:
            ctx = LowerContext(pools=(TARGET_POOL, DRAFT_POOL) if k > 0 else (TARGET_POOL,))
        self.pipeline = Pipeline(self.ledger, ctx, pm)
        models: dict[PoolId, ServedModel[Any]] = {TARGET_POOL: target} | ({DRAFT_POOL: draft} if k > 0 and draft is not None else {})
        self.backends: Backends = transport.open(
            models, ledger=self.ledger, slots=self.slots, capacity=capacity, kv_capacity=kv_capacity, max_len=max_len, retries=retries,
            penalties=penalties,
        )
        self.target: Backend = self.backends.target
        self.draft: Backend | None = self.backends.draft
        self._closed = False
        self.stats = SpecStats()
        self.runner = ForwardRunner(retries, self.stats)
        self.requests = RequestTable()
        self.planner = ChunkPlanner(
            requests=self.requests, slots=self.slots, kv=self.kv, kv_refs=self.kv_refs, session=self.session,
            share_prefix=self._share_prefix, chunk_size=int(chunk_size) if chunk_size is not None else max_len,
            token_budget=int(token_budget) if token_budget is not None else max_len * capacity,
            # (with penalties, a snapshot takes the slot's token counts as of the forward's end, so it must
            # sit there: backend.state_init.apply_counts_op)
            inner_snapshots=not penalties and all(isinstance(m, CapturesInnerStates) and m.captures_inner_states() for m in models.values()),
        )
        self.forwards = Forwards(
            k=k, pipeline=self.pipeline, runner=self.runner, backends=self.backends, ledger=self.ledger, requests=self.requests,
            kv_refs=self.kv_refs, session=self.session, planner=self.planner, stats=self.stats, release=self._release, mixed=mixed,
            policy=policy, head=self.head,
        )
        # with backends that run beside the host, each step is built while the previous one runs: at
        # k = 0, without retries (a retried forward would have to replay the one sent after it) and
        # with mixed forwards (every step then decodes every running row, so every row's input is the
        # token the forward before sampled)
        self.forwards.pipelined = self.backends.concurrent and self.draft is None and retries == 0 and mixed
        self.prefixes = PrefixStates(
            slots=self.slots, kv=self.kv, kv_refs=self.kv_refs, pipeline=self.pipeline, executors=self._executors,
            k=k, max_len=max_len, vocab=self.vocab, head=self.head,
        )
        self.outputs: dict[RequestId, list[int]] = {}
        self._fork_prefixes: list[PrefixState] = []
        """The shared prompt states of ``n > 1`` requests not yet copied by all their completions."""
        self.logprobs: dict[RequestId, list[dict[str, Any]]] = {}
        """Of each ended request that asked for logprobs (``SamplingParams.logprobs``): one entry per
        token of its ``outputs``: ``{"id", "logprob", "top": [{"id", "logprob"}, ...]}``, from the
        target's distribution before any sampling transform (``backend.logprobs``)."""
        self.stopped_by: BaseException | None = None
        self._stepping = False
        """True while ``step`` runs: a model hook calling back into the engine is refused."""
        self.aborted_by_failure: set[RequestId] = set()
        """Requests aborted because a forward carrying them failed (not by ``abort``)."""
        self.first_failure: str | None = None
        """The first failed forward, in one line."""
        self.errored: set[RequestId] = set()
        """Requests ended because the logits for their next token were not finite (NaN or
        infinity): their outputs stop before it (``compiler.engine.nonfinite``)."""

    @property
    def running(self) -> DecodeBatch:
        """The running batch: every RUNNING request, in decode order."""
        return self.forwards.running

    @property
    def in_flight(self) -> InFlight | None:
        """The pipelined forward sent and not read back yet: its requests and sample id
        (``None`` when none is in flight, always so unless the engine pipelines decodes)."""
        return self.forwards.in_flight

    @property
    def chunk_size(self) -> int:
        """The most prompt tokens one request prefills in one forward (a longer prompt is chunked)."""
        return self.planner.chunk_size

    @property
    def token_budget(self) -> int:
        """The most prompt tokens one forward prefills, over all its requests."""
        return self.planner.token_budget

    def _executors(self) -> list[Backend]:
        return [self.target] + ([self.draft] if self.draft is not None else [])

    def _share_prefix(self, src: int, dst: int, length: int) -> None:
        self.backends.share_prefix(src, dst, length)

    def close(self) -> None:
        """Close the backends (stop executor processes; end a tensor-parallel session, gathering
        every rank's ledger counts into ``closing_ledgers`` unless the group is broken). Later steps
        fail. Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        self.closing_ledgers = self.backends.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def busy_intervals(self) -> list[tuple[float, float]]:
        """Every interval (``time.perf_counter`` seconds) during which a backend in another process
        ran a plan, both pools; empty in process."""
        return self.backends.busy_intervals()

    def waited_seconds(self) -> float:
        """The seconds this process spent blocked on other processes' replies (its host work is the
        rest of the wall time)."""
        return self.backends.waited_seconds()

    def busy_seconds(self, start: float, end: float) -> float:
        """With concurrent backends: the seconds of ``[start, end]`` (``time.perf_counter``) during which at
        least one executor process ran a plan (the union of ``busy_intervals``)."""
        total, reach = 0.0, start
        for a, b in sorted(self.busy_intervals()):
            a, b = max(a, reach), min(b, end)
            if b > a:
                total += b - a
                reach = b
        return total

    def admit(
        self,
        rid: RequestId,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        prefix: PrefixState | None = None,
        stop: int | Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        forks: Sequence[RequestId] = (),
    ) -> None:
        """Queue a request; it ends after ``max_new_tokens`` or once it emits a ``stop`` id (one id, or
        a list or tuple of them, such as a tokenizer's end-of-sequence ids) or one of
        ``sampling.stop_token_ids``. ``sampling`` (default: ``GREEDY``) chooses its tokens; a sampled
        request without a seed gets one derived from the engine's ``seed`` and ``rid``. When both
        are given, ``max_new_tokens`` is the request's bound (the serving layer passes the same). With ``prefix`` its slot starts as a copy of that prefix state; else,
        with a prefix cache, the longest cached prefix is used when the request is scheduled.

        ``sampling.n > 1``: ``n`` completions of the prompt, under ``rid`` (completion 0) and the
        ``n - 1`` ids in ``forks`` (completions 1 to n - 1, in order), each with its own output.
        The prompt but its last token is prefilled once, now, into a prefix state
        (``make_prefix``); every completion starts as a copy-on-write copy of that state and shares
        its KV locations (the prefix state's one-shot ops and tickets: a clear, then one COW per
        completion), prefills the last prompt token in its own slot and samples from there with its
        completion index in its random stream's key (one seed for all). The prefix state is
        released once every completion has copied it. ``n > 1`` with ``prefix`` is refused, and so
        is a prompt of more than one token in an engine of one slot (the shared state would hold it).

        Every argument is checked before anything changes (``PreconditionError``, or
        ``IRValidationError`` for the prompt's tokens), so a refused admission leaves the engine, its
        allocators, pools and prefix cache as they were. Ids and counts are ints (numpy integers
        too), never ``bool``, ``float``, ``str`` or ``None``, within int64. A stopped engine
        (``step``) refuses with ``EngineStoppedError``."""
        self.check_serving()
        rid, arr, max_new_tokens, stops = check_request(
            rid, prompt, max_new_tokens, stop, in_use=lambda r: r in self.requests or r in self.outputs,
            vocab=self.vocab, max_len=self.max_len, k=self.k, kv_capacity=self.kv.capacity,
        )
        params = check_sampling(rid, sampling)
        if params.penalised and not self.penalties:
            raise PreconditionError(
                "admit", f"request {rid}: presence_penalty={params.presence_penalty}, frequency_penalty={params.frequency_penalty}, "
                f"repetition_penalty={params.repetition_penalty} need an engine built with penalties=True (it keeps the token counts)"
            )
        group = self._check_forks(rid, forks, params, prefix, arr)
        if prefix is not None:
            self.prefixes.check(rid, prefix, arr, self.requests)
        elif not forks:
            self.session.observe(arr)
        stops = stops | frozenset(params.stop_token_ids)
        seeded = params.seeded(self.seed, rid)  # (completions share the seed; their index keeps their streams apart)
        if len(group) > 1 and arr.shape[0] > 1:
            prefix = self.make_prefix(arr[:-1].tolist())
            self._fork_prefixes.append(prefix)
        for index, member in enumerate(group):
            self.requests.add(
                Request(
                    rid=member, prompt=arr, original=arr, max_new_tokens=max_new_tokens, stop=stops, source=prefix,
                    sampling=seeded, index=index, logprobs=[] if params.logprobs is not None else None,
                )
            )

    def _check_forks(
        self, rid: RequestId, forks: object, params: SamplingParams, prefix: PrefixState | None, arr: I64
    ) -> list[RequestId]:
        """``admit``'s checks of ``forks`` against ``sampling.n``; the completions' ids, ``rid`` first."""
        if not isinstance(forks, (list, tuple)):
            raise PreconditionError("admit", f"request {rid}: forks must be a list or tuple of request ids (got {short_repr(forks)})")
        if len(forks) != params.n - 1:
            raise PreconditionError("admit", f"request {rid}: sampling.n = {params.n} needs {params.n - 1} fork ids, got {len(forks)}")
        group = [rid]
        for f in forks:
            problem = int_problem(f)
            if problem is not None:
                raise PreconditionError("admit", f"request {rid}: fork id {problem} (got {short_repr(f)})")
            fid = RequestId(int(f))
            if fid in group or fid in self.requests or fid in self.outputs:
                raise PreconditionError("admit", f"request {rid}: fork id {fid} is already in use")
            group.append(fid)
        if len(group) > 1:
            if prefix is not None:
                raise PreconditionError("admit", f"request {rid}: sampling.n = {params.n} with a prefix (the completions share a prefix of their own)")
            need = int(arr.shape[0]) - 1
            if need and self.slots.capacity < 2:  # (the shared state would hold the one slot its completions wait for)
                raise PreconditionError(
                    "admit", f"request {rid}: sampling.n = {params.n} needs a slot for its completions beside their shared prompt state; "
                    f"capacity {self.slots.capacity} has one"
                )
            if need and (self.slots.num_free < 1 or self.kv.num_free < need):
                raise PreconditionError(
                    "admit", f"request {rid}: no room for its completions' shared prompt state now ({self.slots.num_free} free slots, "
                    f"{self.kv.num_free} free KV locations; it needs 1 and {need})"
                )
        return group

    def _release_fork_prefixes(self) -> None:
        """Release the shared prompt states of ``n > 1`` requests that every completion has copied."""
        for cp in list(self._fork_prefixes):
            if not any(r.done == 0 and r.source == cp for r in self.requests):
                self._fork_prefixes.remove(cp)
                self.prefixes.release(cp, self.requests)

    def make_prefix(self, tokens: Sequence[int]) -> PrefixState:
        """Prefill ``tokens`` into a fresh slot of both models and keep it as a prefix state (checks:
        ``PrefixStates.checked_tokens``). An exception escaping the prefill stops the engine, as one
        escaping ``step`` does."""
        self.check_serving()
        arr = self.prefixes.checked_tokens(tokens)
        try:
            return self.prefixes.make(arr)
        except BaseException as exc:
            self.stopped_by = exc  # a slot, KV locations or tickets may be taken and not recorded
            raise

    def release_prefix(self, cp: PrefixState) -> None:
        """Return a prefix state's slot and its KV references (checks: ``PrefixStates.release``)."""
        self.check_serving()
        self.prefixes.release(cp, self.requests)

    def _live_rid(self, call: str, rid: object) -> RequestId:
        """``rid`` as the id of a live request, else ``PreconditionError`` naming ``call``."""
        problem = int_problem(rid)
        if problem is not None:
            raise PreconditionError(call, f"rid {problem} (got {short_repr(rid)})")
        live = RequestId(int(cast(int, rid)))
        if live not in self.requests:
            raise PreconditionError(call, f"request {live} is not live")
        return live

    def abort(self, rid: RequestId) -> None:
        """End a live request now (its output so far goes to ``outputs``). ``rid`` is an int (numpy
        integers too; never ``bool``, ``float``, ``str`` or ``None``), else ``PreconditionError``.
        A stopped engine refuses with ``EngineStoppedError``."""
        self.check_serving()
        rid = self._live_rid("abort", rid)
        self.stats.aborts += 1
        self._release([rid], Ending.ABORTED)

    def finish(self, rid: RequestId, *, length: int | None = None) -> None:
        """End a live request now as finished (``Ending.FINISHED``, through the release path of a
        request at its ``max_new_tokens`` or stop id), its output first cut to its first ``length``
        tokens (``None``: all of them): the serving layer's stop strings end a request this way
        (``compiler.offline.stops``). ``rid`` and ``length`` are ints (numpy integers too; never
        ``bool``, ``float``, ``str``), ``length`` >= 0, else ``PreconditionError``; a stopped engine
        refuses with ``EngineStoppedError``."""
        self.check_serving()
        rid = self._live_rid("finish", rid)
        if length is not None:
            problem = int_problem(length)
            if problem is not None or int(length) < 0:
                raise PreconditionError("finish", f"length must be an int >= 0 (got {short_repr(length)})")
            r = self.requests[rid]
            del r.output[int(length):]
        self._release([rid], Ending.FINISHED)

    @property
    def live(self) -> int:
        """How many requests are live (queued or running; ended requests are in ``outputs``)."""
        return len(self.requests)

    def live_slots(self) -> dict[RequestId, MambaSlot]:
        """The slot of every live request that has started its prefill."""
        return {r.rid: r.slot for r in self.requests if r.slot is not None}

    # -- one iteration --------------------------------------------------------------------------

    def step(self) -> StepReport:
        """One iteration, reported. A forward that still fails after ``retries`` attempts aborts the
        requests of that forward (their tickets that did not run are cancelled in the ledger, with
        the reason); the report's kind is then ``StepKind.FAILED`` and serving goes on.

        Any other exception escaping a step (a pass refusing its input, a dump that cannot be
        written, a bug) may leave the step's bookkeeping half done: slots, KV locations or a
        prefix-cache reservation taken but not yet recorded. Rather than serve on with resources it
        cannot account for, the engine stops: the exception propagates, and every later ``step`` or
        ``admit`` raises ``EngineStoppedError`` naming it. Outputs already finished stay in
        ``outputs``."""
        self.check_serving()
        t0 = time.perf_counter()
        self.forwards.progress = Progress()
        self._stepping = True
        try:
            try:
                kind = self.forwards.run()
            except StepFailed as failure:
                self._abort_failed(failure)  # (what this raises is caught below: the engine stops)
                kind = StepKind.FAILED
        except BaseException as exc:
            self.stopped_by = exc
            raise
        finally:
            self._stepping = False
        if self._fork_prefixes:
            self._release_fork_prefixes()
        p = self.forwards.progress
        return StepReport(
            kind=kind, requests=p.requests, prefill_tokens=p.prefill_tokens, tokens=p.tokens, finished=tuple(p.finished),
            aborted=tuple(p.aborted), errored=tuple(p.errored), emitted=tuple(p.emitted), seconds=time.perf_counter() - t0,
        )

    def sync(self) -> None:
        """Read back what is still running in executor processes (``overlap``: the last pipelined
        forward at ``k == 0``, the last speculative iteration's commits); a failed one aborts its
        requests, as in ``step``. A no-op without ``overlap``."""
        self.check_serving()
        self._stepping = True
        try:
            try:
                self.forwards.settle()
            except StepFailed as failure:
                self._abort_failed(failure)
        except BaseException as exc:
            self.stopped_by = exc
            raise
        finally:
            self._stepping = False

    def check_serving(self) -> None:
        """Raise ``EngineStoppedError`` if an earlier step raised (see ``step``), and
        ``PreconditionError`` when called from inside a step (a model hook calling back into the
        engine: the step's bookkeeping is half done)."""
        if self._stepping:
            raise PreconditionError("engine", "called from inside a step (a model hook?): admit, abort and prefix states wait for step() to return")
        if self.stopped_by is not None:
            raise EngineStoppedError(
                f"engine stopped: an earlier step raised {self.stopped_by!r}; its bookkeeping may be partial, "
                "so this engine serves no more steps (outputs finished before it are in .outputs)"
            )

    def _abort_failed(self, failure: StepFailed) -> None:
        live = self.forwards.abort_failed(failure)
        self.aborted_by_failure.update(live)
        if self.first_failure is None:
            self.first_failure = " ".join(str(failure).split())

    def _release(self, rids: Sequence[RequestId], ending: Ending) -> None:
        """The one release path: the requests leave the running batch and give back their slot,
        their prefix-cache pin, room and plan, and their KV references. A retracted request goes
        back to the head of the queue, to re-prefill its prompt and output so far; any other
        ending records its output."""
        self.forwards.running = self.pipeline.filter_decode(self.forwards.running, rids)
        for rid in rids:
            r = self.requests[rid]
            if r.slot is not None:
                self.slots.free(r.slot)
            self.session.abandon(r)
            self.kv_refs.unref(r.context)
            if ending is Ending.RETRACTED:
                prompt = frozen_i64([*r.original.tolist(), *r.output]) if r.output else r.original
                self.requests.requeue(
                    Request(rid=rid, prompt=prompt, original=r.original, max_new_tokens=r.max_new_tokens, stop=r.stop, logprobs=r.logprobs,
                            output=r.output, retractions=r.retractions + 1, sampling=r.sampling, index=r.index)
                )
            else:
                self.requests.remove(rid)
                self.outputs[rid] = r.final_output()
                if r.logprobs is not None:
                    self.logprobs[rid] = r.logprobs[: len(self.outputs[rid])]
                if ending is Ending.ERROR:
                    self.errored.add(rid)

    def drop_cache(self) -> None:
        """Evict every prefix-cache entry (all must be unpinned), returning their slots and KV."""
        while self.session.evict():
            pass

    def run_until_done(self, max_steps: int = 100_000) -> None:
        """Step until no request is live; ``RuntimeError`` if some still are after ``max_steps`` (an
        int >= 0, else ``PreconditionError``)."""
        problem = int_problem(max_steps)
        if problem is not None or max_steps < 0:
            raise PreconditionError("run_until_done", f"max_steps must be an int >= 0 (got {short_repr(max_steps)})")
        for _ in range(max_steps):
            if not self.requests:
                self.sync()
                return
            self.step()
        if not self.requests:
            self.sync()
            return
        raise RuntimeError(f"{self.live} requests still live after {max_steps} steps")

