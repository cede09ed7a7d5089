"""The serving engine: continuous batching over a target model and (for speculative decoding) a
draft model, each with its own Mamba pool, KV cache and token table, addressed by the same slot ids
and KV locations.

Per ``step()`` (one scheduler iteration), one kind of forward (``StepKind``):

- **extend** when requests wait for (more of) their prefill, alternating with the running batch
  so neither starves: each gets its next chunk (at most ``chunk_size`` tokens, at most
  ``token_budget`` in total). A first chunk starts with a clear (fresh slot) or a COW (a cached
  prefix, from a ``Checkpoint`` or the prefix cache), later chunks continue. One
  ``Pipeline.prefill`` lowers the forward with one ticket per pool and both executors run the same
  ``ExtendPlan``: the draft pool's init ops run there, and only there. A chunk that ends at a prefix
  worth caching carries a snapshot into a cache slot (a one-shot op after the forward, through the
  same tickets and ledger). The target's argmax at a prompt's end is the request's first token.
- **mixed** (``k == 0`` only, on by default, ``mixed=False`` turns it off): while requests both
  run and wait, the running batch's decode and the next prefill chunks share one MIXED forward.
  With a draft the steps alternate instead: a speculative iteration is four forwards over two
  models (the same choice as engines that turn mixed chunked prefill off under speculation).
- otherwise **decode** (``k == 0``: plain greedy) or **spec** (``k > 0``): draft proposal (draft
  executor), verify (target), accept + commit (target), draft extend (draft). Rejected KV
  locations go back to the allocator right after the commit.

The engine is small parts with one job each: the request table (``requests``: states and the
prefill queue), KV reference counts (``kv_refs``), the prefix-cache session (``cache_session``; a
null object when caching is off), the forward runner (``runner``: retries and ``StepFailed``) and
the argument checks (``admission``). Every request that leaves (finished, aborted, failed,
retracted) goes through one release path, ``_release``.

A request finishes at ``max_new_tokens`` or after emitting its ``stop`` token; ``abort`` ends it at
any time. When the next decode or spec step cannot get its KV locations, the newest running
requests are retracted and re-prefill their prompt plus the tokens generated so far later (greedy,
so their output continues unchanged). Greedy speculative decoding is lossless: the tokens emitted
at any ``k`` equal those at ``k = 0``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from backend.allocator import KVAllocator, SlotAllocator
from backend.executor import Executor
from backend.hybrid.hook import HybridHook
from backend.hybrid.model import HybridModel
from backend.ledger import Ledger
from backend.model import ServingModelHook
from compiler.driver import checked_prompt
from compiler.engine.admission import MAX_LEN, check_engine_args
from compiler.engine.cache_session import CacheSession, NoCache, PrefixCacheSession
from compiler.engine.kv_refs import KVRefs
from compiler.engine.report import Checkpoint, SpecStats, StepKind, StepReport
from compiler.engine.requests import Ending, Request, RequestState, RequestTable
from compiler.engine.runner import ForwardRunner, StepFailed
from compiler.manager import PassManager
from compiler.prefix_cache import PrefixCache
from compiler.steps import Pipeline
from ir.batch import DecodeBatch, ExtendBatch
from ir.columns import I64, frozen_i64, int_problem
from ir.errors import EngineStoppedError, PreconditionError, SlotError, short_repr
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, PoolId, RequestId
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom, Intent
from passes.lower import LowerContext
from passes.prepare_for_decode import DecodeContext
from passes.prepare_for_draft import SpecContext


class _Progress:
    """What one step did, filled in as it goes (``StepReport`` at the end)."""

    def __init__(self) -> None:
        self.requests = self.prefill_tokens = self.tokens = 0
        self.finished: list[RequestId] = []
        self.aborted: list[RequestId] = []


class Engine:
    def __init__(
        self,
        target: HybridModel,
        draft: HybridModel | None,
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
    ) -> None:
        """Every argument is checked before anything is allocated (``PreconditionError`` naming the
        argument and the value; bounds in ``compiler.engine.admission``): counts are ints (numpy
        integers too; never ``bool``, ``float``, ``str`` or ``None``) with ``k`` in ``[0, MAX_K]``,
        ``capacity`` in ``[1, MAX_CAPACITY]``, ``kv_capacity`` in ``[1, MAX_KV_CAPACITY]``,
        ``max_len`` in ``[k + 3, MAX_LEN]`` (room for a prompt token, a new token and the k + 1
        speculative positions) with ``(capacity + 1) * max_len <= MAX_TABLE_ENTRIES`` and each state
        pool within ``MAX_POOL_BYTES``, ``chunk_size`` and ``token_budget`` ``None`` or ``>= 1``,
        ``retries`` in ``[0, MAX_RETRIES]``; ``target`` a ``HybridModel``; ``draft`` a
        ``HybridModel`` of the target's vocabulary when ``k > 0`` (``None`` or unused when ``k ==
        0``); ``mixed`` a ``bool``; ``prefix_cache`` a ``PrefixCache`` or ``None``; ``pm`` a
        ``PassManager`` or ``None``."""
        check_engine_args(
            target, draft, k=k, capacity=capacity, kv_capacity=kv_capacity, max_len=max_len, chunk_size=chunk_size,
            token_budget=token_budget, prefix_cache=prefix_cache, retries=retries, mixed=mixed, pm=pm,
        )
        k, capacity, kv_capacity, max_len, retries = int(k), int(capacity), int(kv_capacity), int(max_len), int(retries)
        self.k = k
        self.vocab = target.config.vocab
        self.retries = retries
        self.mixed = mixed
        self.max_len = max_len
        self.chunk_size = int(chunk_size) if chunk_size is not None else max_len
        self.token_budget = int(token_budget) if token_budget is not None else max_len * capacity
        self.cache = prefix_cache
        self.ledger = Ledger()
        self.slots = SlotAllocator(capacity)
        self.kv = KVAllocator(kv_capacity)
        self.kv_refs = KVRefs(self.kv)
        self.session: CacheSession = (
            PrefixCacheSession(prefix_cache, self.slots, self.kv_refs) if prefix_cache is not None else NoCache()
        )
        pools = (TARGET_POOL, DRAFT_POOL) if k > 0 else (TARGET_POOL,)
        self.pipeline = Pipeline(self.ledger, LowerContext(pools=pools), pm)
        self._hooks: list[ServingModelHook] = []
        self.target = self._executor(target, TARGET_POOL, capacity, kv_capacity)
        self.draft = self._executor(draft, DRAFT_POOL, capacity, kv_capacity) if k > 0 and draft is not None else None
        self.running = DecodeBatch.empty()
        self.stats = SpecStats()
        self.runner = ForwardRunner(retries, self.stats)
        self.requests = RequestTable()
        self._checkpoints: dict[MambaSlot, Checkpoint] = {}
        """The checkpoints ``make_checkpoint`` made and ``release_checkpoint`` has not released."""
        self._last_was_prefill = False
        self._progress = _Progress()
        self.outputs: dict[RequestId, list[int]] = {}
        self.stopped_by: BaseException | None = None
        self._stepping = False
        """True while ``step`` runs: a model hook calling back into the engine is refused."""
        self.aborted_by_failure: set[RequestId] = set()
        """Requests aborted because a forward carrying them failed (not by ``abort``)."""
        self.first_failure: str | None = None
        """The first failed forward, in one line."""

    def _executor(self, model: HybridModel, pool_id: PoolId, capacity: int, kv_capacity: int) -> Executor:
        pool = model.new_pool(capacity, pool_id=pool_id)
        hook = HybridHook(model, model.new_kv_cache(kv_capacity), model.new_token_table(capacity, self.max_len))
        self._hooks.append(hook)
        # with retries, each forward is one transactional unit that can simply run again
        return Executor(pool, self.ledger, hook, slots=self.slots, transactional=self.retries > 0)

    def _executors(self) -> list[Executor]:
        return [self.target] + ([self.draft] if self.draft is not None else [])

    def _share_prefix(self, src: int, dst: int, length: int) -> None:
        for hook in self._hooks:
            hook.share_prefix(src, dst, length)

    # -- requests -----------------------------------------------------------------------------

    def admit(
        self,
        rid: RequestId,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        checkpoint: Checkpoint | None = None,
        stop: int | None = None,
    ) -> None:
        """Queue a request. With ``checkpoint`` its slot starts as a copy of that prefix state; else,
        with a prefix cache, the longest cached prefix is used when the request is scheduled.

        Every argument is checked before anything changes (``PreconditionError``, or
        ``IRValidationError`` for the prompt's tokens), so a refused admission leaves the engine, its
        allocators, pools and prefix cache as they were. Ids and counts are ints (numpy integers
        too), never ``bool``, ``float``, ``str`` or ``None``, within int64. A stopped engine
        (``step``) refuses with ``EngineStoppedError``."""
        self.check_serving()
        problem = int_problem(rid)
        if problem is not None:
            raise PreconditionError("admit", f"rid {problem} (got {rid!r})")
        rid = RequestId(int(rid))
        if rid in self.requests or rid in self.outputs:
            raise PreconditionError("admit", f"request id {rid} is already in use")
        arr = checked_prompt(f"request {rid}", prompt, self.vocab, MAX_LEN)  # huge inputs refused unread
        problem = int_problem(max_new_tokens)
        if problem is not None:
            raise PreconditionError("admit", f"request {rid}: max_new_tokens {problem} (got {max_new_tokens!r})")
        max_new_tokens = int(max_new_tokens)
        if max_new_tokens < 1:
            raise PreconditionError("admit", f"request {rid}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if arr.shape[0] + max_new_tokens + self.k + 1 > self.max_len:
            raise PreconditionError(
                "admit", f"request {rid}: prompt {arr.shape[0]} + {max_new_tokens} new tokens exceed max_len {self.max_len}"
            )
        if stop is not None:
            problem = int_problem(stop)
            if problem is not None:
                raise PreconditionError("admit", f"request {rid}: stop {problem} (got {stop!r})")
            stop = int(stop)
            if not 0 <= stop < self.vocab:
                raise PreconditionError("admit", f"request {rid}: stop must be a token id in [0, {self.vocab}), got {stop}")
        if checkpoint is not None:
            self._check_checkpoint(rid, checkpoint, arr)
        else:
            self.session.observe(arr)
        self.requests.add(Request(rid=rid, prompt=arr, original=arr, max_new_tokens=max_new_tokens, stop=stop, source=checkpoint))

    def _check_checkpoint(self, rid: RequestId, checkpoint: object, arr: I64) -> None:
        """``admit``'s checks of a checkpoint argument: one of this engine's live prefix checkpoints
        that the prompt extends (``PreconditionError`` otherwise)."""
        if not isinstance(checkpoint, Checkpoint):
            raise PreconditionError("admit", f"request {rid}: checkpoint must be a Checkpoint (from make_checkpoint), got {checkpoint!r}")
        problem = int_problem(checkpoint.slot)
        if problem is not None:
            raise PreconditionError("admit", f"request {rid}: checkpoint slot {problem} (got {checkpoint.slot!r})")
        for name, values in (("tokens", checkpoint.tokens), ("kv_locs", checkpoint.kv_locs)):
            if not isinstance(values, tuple):
                raise PreconditionError("admit", f"request {rid}: checkpoint {name} must be a tuple of ints, got {values!r}")
            for v in values:
                problem = int_problem(v)
                if problem is not None:
                    raise PreconditionError("admit", f"request {rid}: every checkpoint {name} entry {problem} (got {v!r})")
        n = len(checkpoint.tokens)
        if len(checkpoint.kv_locs) != n:
            raise PreconditionError("admit", f"request {rid}: checkpoint has {len(checkpoint.kv_locs)} KV locations for {n} tokens")
        if not (n < arr.shape[0] and tuple(int(t) for t in arr[:n]) == checkpoint.tokens):
            raise PreconditionError("admit", f"request {rid}: prompt does not extend the checkpoint's {n} tokens")
        slot = int(checkpoint.slot)
        if not self.slots.is_live(MambaSlot(slot)):
            raise PreconditionError("admit", f"request {rid}: checkpoint slot {checkpoint.slot} was released")
        for other in self.requests:
            if slot in (other.slot, other.snapshot_slot):
                raise PreconditionError("admit", f"request {rid}: checkpoint slot {slot} is a slot of live request {other.rid}")
        unheld = [loc for loc in checkpoint.kv_locs if self.kv_refs.count(loc) == 0]
        if unheld:
            raise PreconditionError("admit", f"request {rid}: checkpoint KV location {unheld[0]} is not held (not a live checkpoint)")
        if self._checkpoints.get(MambaSlot(slot)) != checkpoint:
            raise PreconditionError(
                "admit", f"request {rid}: checkpoint {short_repr(checkpoint)} is not a checkpoint this engine holds (forged, or released)"
            )

    def make_checkpoint(self, tokens: Sequence[int]) -> Checkpoint:
        """Prefill ``tokens`` into a fresh slot of both models and keep it as a prefix checkpoint.

        Everything is checked before a slot, a KV location or a ticket is taken: the tokens
        (``IRValidationError``), their length (a request extending the checkpoint must fit
        ``max_len``: at least one more prompt token, one new token and the k + 1 speculative
        positions) and the free slots and KV locations (``PreconditionError``). A stopped engine
        refuses with ``EngineStoppedError``; an exception escaping the prefill itself stops the
        engine, as one escaping ``step`` does."""
        self.check_serving()
        arr = checked_prompt("checkpoint", tokens, self.vocab, MAX_LEN)  # validated before anything is allocated
        n = int(arr.shape[0])
        if n + self.k + 3 > self.max_len:
            raise PreconditionError(
                "make_checkpoint",
                f"tokens: a checkpoint of {n} tokens leaves no room under max_len {self.max_len} for a request extending it "
                f"(at least {n} + 1 prompt tokens, 1 new token and k + 1 = {self.k + 1} speculative positions)",
            )
        if n > self.kv.num_free or self.slots.num_free == 0:
            raise PreconditionError(
                "make_checkpoint",
                f"no room for a {n}-token checkpoint ({self.slots.num_free} free slots, {self.kv.num_free} free KV locations)",
            )
        try:
            slot = self.slots.alloc()
            kv = self.kv_refs.alloc(n)
            req = AdmittedRequest(rid=RequestId(-1 - int(slot)), slot=slot, input_ids=arr, kv_locs=kv, intent=Clear())
            _, plan = self.pipeline.prefill([req])
            for ex in self._executors():
                ex.execute(plan)
        except BaseException as exc:
            self.stopped_by = exc  # a slot, KV locations or tickets may be taken and not recorded
            raise
        cp = Checkpoint(slot=slot, tokens=tuple(arr.tolist()), kv_locs=tuple(kv.tolist()))
        self._checkpoints[slot] = cp
        return cp

    def release_checkpoint(self, cp: Checkpoint) -> None:
        """Return a checkpoint's slot and its KV references.

        Only a checkpoint this engine made and has not released yet is accepted (the whole record
        must equal the one ``make_checkpoint`` returned), and only while no live request still
        waits to copy it (admitted from it and not yet past its first prefill chunk); otherwise
        ``PreconditionError`` (``SlotError`` for a second release: a double free of its slot), and
        nothing changes. A stopped engine refuses with ``EngineStoppedError``."""
        self.check_serving()
        if not isinstance(cp, Checkpoint):
            raise PreconditionError(
                "release_checkpoint", f"cp must be a Checkpoint (from make_checkpoint), not {type(cp).__name__} (got {short_repr(cp)})"
            )
        problem = int_problem(cp.slot)
        if problem is not None:
            raise PreconditionError("release_checkpoint", f"cp.slot {problem} (got {short_repr(cp.slot)})")
        slot = MambaSlot(int(cp.slot))
        held = self._checkpoints.get(slot)
        if held is None and not self.slots.is_live(slot):
            raise SlotError(f"release_checkpoint: double free of slot {slot}: no checkpoint of this engine holds it (released already?)")
        if held is None or held != cp:
            raise PreconditionError(
                "release_checkpoint", f"cp {short_repr(cp)} is not a checkpoint this engine holds (forged, or released already)"
            )
        waiting = sorted(int(r.rid) for r in self.requests if r.done == 0 and r.source == held)
        if waiting:
            raise PreconditionError(
                "release_checkpoint", f"checkpoint in slot {slot} is still to be copied by request(s) {waiting} (their first chunk has not run)"
            )
        del self._checkpoints[slot]
        self.slots.free(slot)
        self.kv_refs.unref(held.kv_locs)

    def abort(self, rid: RequestId) -> None:
        """End a live request now (its output so far goes to ``outputs``). ``rid`` is an int (numpy
        integers too; never ``bool``, ``float``, ``str`` or ``None``), else ``PreconditionError``.
        A stopped engine refuses with ``EngineStoppedError``."""
        self.check_serving()
        problem = int_problem(rid)
        if problem is not None:
            raise PreconditionError("abort", f"rid {problem} (got {short_repr(rid)})")
        rid = RequestId(int(rid))
        if rid not in self.requests:
            raise PreconditionError("abort", f"request {rid} is not live")
        self.stats.aborts += 1
        self._release([rid], Ending.ABORTED)

    @property
    def live(self) -> int:
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
        self._progress = _Progress()
        self._stepping = True
        try:
            kind = self._step()
        except StepFailed as failure:
            self._abort_failed(failure)
            kind = StepKind.FAILED
        except BaseException as exc:
            self.stopped_by = exc
            raise
        finally:
            self._stepping = False
        p = self._progress
        return StepReport(
            kind=kind, requests=p.requests, prefill_tokens=p.prefill_tokens, tokens=p.tokens, finished=tuple(p.finished),
            aborted=tuple(p.aborted), seconds=time.perf_counter() - t0,
        )

    def check_serving(self) -> None:
        """Raise ``EngineStoppedError`` if an earlier step raised (see ``step``), and
        ``PreconditionError`` when called from inside a step (a model hook calling back into the
        engine: the step's bookkeeping is half done)."""
        if self._stepping:
            raise PreconditionError("engine", "called from inside a step (a model hook?): admit, abort and checkpoints wait for step() to return")
        if self.stopped_by is not None:
            raise EngineStoppedError(
                f"engine stopped: an earlier step raised {self.stopped_by!r}; its bookkeeping may be partial, "
                "so this engine serves no more steps (outputs finished before it are in .outputs)"
            )

    def _step(self) -> StepKind:
        if self.mixed and self.draft is None and self.requests.has_queued and self.running.num_requests:
            if self._reserve_kv(1):  # False only when retraction emptied the running batch
                self._last_was_prefill = False
                return self._mixed()
        prefill_ready = self.requests.has_queued and (not self.running.num_requests or not self._last_was_prefill)
        if prefill_ready and self._prefill():
            self._last_was_prefill = True
            return StepKind.EXTEND
        self._last_was_prefill = False
        if not self.running.num_requests:
            return StepKind.IDLE
        if not self._reserve_kv(self.k + 1):
            return StepKind.RETRACT
        if self.draft is None:
            self._decode()
            return StepKind.DECODE
        self._speculate()
        return StepKind.SPEC

    def _start(self, r: Request) -> bool:
        """Give a request its slot and prefix source before its first chunk; False if none is free,
        or if the KV for its whole prompt does not fit next to what started prefills still need
        (a started prefill can then always finish: no deadlock of half-prefilled requests)."""
        while self.kv.num_free < self.requests.kv_owed() + int(r.prompt.shape[0]):
            if not self.session.evict():
                return False
        if self.slots.num_free == 0 and not self.session.evict():
            return False
        self.requests.started(r, self.slots.alloc())
        assert r.slot is not None
        if r.source is None:
            r.source = self.session.source_for(r.prompt)
        if r.source is not None:
            self.kv_refs.ref(r.source.kv_locs)
            r.context.extend(r.source.kv_locs)
            self._share_prefix(int(r.source.slot), int(r.slot), r.start)
        r.snapshot_at = self.session.plan_snapshot(r.prompt, r.start)
        return True

    def _chunks(self) -> list[AdmittedRequest]:
        """The next prefill chunk of each waiting request, in order, within the token budget, the
        free slots and the free KV locations (allocated here)."""
        admitted: list[AdmittedRequest] = []
        budget = self.token_budget
        for rid in self.requests.queued:
            r = self.requests[rid]
            if budget <= 0:
                break
            if r.state is RequestState.WAITING and not self._start(r):
                break
            assert r.slot is not None
            pos = r.next_pos
            n = min(self.chunk_size, budget, int(r.prompt.shape[0]) - pos)
            if r.snapshot_at is not None and pos < r.snapshot_at:
                n = min(n, r.snapshot_at - pos)
            if n > self.kv.num_free:
                break
            snap_to = None
            if r.snapshot_at is not None and pos + n == r.snapshot_at:
                snap_to = r.snapshot_slot = self.session.snapshot_slot(r.prompt, r.snapshot_at)
                if snap_to is None:
                    r.snapshot_at = None  # no room: skip this snapshot
            kv = self.kv_refs.alloc(n)
            r.context.extend(kv.tolist())
            first = r.done == 0
            intent: Intent
            if not first:
                intent = Continue(prefix_len=pos)
            elif r.source is not None:
                intent = CopyFrom(src=r.source.slot, prefix_len=pos)
            else:
                intent = Clear()
            admitted.append(
                AdmittedRequest(
                    rid=rid, slot=r.slot, input_ids=r.prompt[pos : pos + n], kv_locs=kv, intent=intent,
                    more_chunks=pos + n < r.prompt.shape[0], snapshot_to=snap_to,
                )
            )
            budget -= n
        return admitted

    def _prefill(self) -> bool:
        admitted = self._chunks()
        if not admitted:
            return False
        extend, plan = self.pipeline.prefill(admitted)
        logits = self.runner.run(self.target, plan)
        if self.draft is not None:
            self.runner.run(self.draft, plan)  # the draft pool's init ops (and snapshots): consumed here, once
        assert logits is not None
        self.stats.prefills += 1
        self._after_chunks(admitted, extend, logits)
        self.running = self.pipeline.merge(self.running, extend)
        self._finish()
        return True

    def _after_chunks(self, admitted: Sequence[AdmittedRequest], extend: ExtendBatch, logits: torch.Tensor) -> None:
        """Advance the prefilled requests, cache their snapshots, and emit the first token of each
        whose prompt is complete (``logits``: one row per extend row, in ``extend.rids`` order)."""
        finished: list[RequestId] = []
        for a in admitted:
            r = self.requests[a.rid]
            if r.done == 0:
                self.session.copied(r.source)
            pos = a.prefix_len + int(a.input_ids.shape[0])
            r.done = pos
            self._progress.requests += 1
            self._progress.prefill_tokens += int(a.input_ids.shape[0])
            if a.snapshot_to is not None:
                assert r.slot is not None
                self._share_prefix(int(r.slot), int(a.snapshot_to), pos)
                self.session.insert(a.snapshot_to, tuple(r.prompt[:pos].tolist()), tuple(r.context[:pos]))
                r.snapshot_at = r.snapshot_slot = None
            if not a.more_chunks:
                finished.append(a.rid)
                self.requests.prefilled(r)
        rows = {rid: i for i, rid in enumerate(extend.rid_list())}
        tokens = logits.argmax(dim=-1).tolist()
        self._emit(finished, [[int(tokens[rows[rid]])] for rid in finished])

    def _mixed(self) -> StepKind:
        """``k == 0`` with requests both running and waiting: the running batch's decode and the
        next prefill chunks in one MIXED forward (a plain decode if no chunk fits)."""
        rids = self.running.rid_list()
        ctx = DecodeContext(next_tokens=self._pending_of(rids), kv_locs=self._alloc_for(rids, 1))
        admitted = self._chunks()
        if not admitted:
            self._decode(ctx)
            return StepKind.DECODE
        mixed, plan = self.pipeline.mixed(admitted, self.running, ctx)
        logits = self.runner.run(self.target, plan)
        assert logits is not None
        self.stats.prefills += 1
        self.stats.decodes += 1
        self.stats.mixed += 1
        n = mixed.extend.num_requests
        self._after_chunks(admitted, mixed.extend, logits[:n])
        self._progress.requests += len(rids)
        self._emit(rids, [[t] for t in logits[n:].argmax(dim=-1).tolist()])
        self.running = self.pipeline.merge(mixed.decode, mixed.extend)
        self._finish()
        return StepKind.MIXED

    def _reserve_kv(self, per_row: int) -> bool:
        """Retract the newest running requests until the next step's KV locations fit."""
        retracted = False
        while self.running.num_requests and self.kv.num_free < per_row * self.running.num_requests:
            if self.session.evict():
                continue
            self._retract(self.running.rid_at(-1))
            retracted = True
        return not retracted or bool(self.running.num_requests)

    def _retract(self, rid: RequestId) -> None:
        self.stats.retractions += 1
        self._release([rid], Ending.RETRACTED)

    def _decode(self, ctx: DecodeContext | None = None) -> None:
        rids = self.running.rid_list()
        if ctx is None:
            ctx = DecodeContext(next_tokens=self._pending_of(rids), kv_locs=self._alloc_for(rids, 1))
        self.running, plan = self.pipeline.decode(self.running, ctx)
        logits = self.runner.run(self.target, plan)
        assert logits is not None
        self.stats.decodes += 1
        self._progress.requests += len(rids)
        self._emit(rids, [[t] for t in logits.argmax(dim=-1).tolist()])
        self._finish()

    def _speculate(self) -> None:
        assert self.draft is not None
        k, rids = self.k, self.running.rid_list()
        window = self._alloc_for(rids, k + 1)
        draft_batch, dplan = self.pipeline.draft(self.running, SpecContext(k=k, next_tokens=self._pending_of(rids), kv_locs=window))
        proposals = self.runner.run(self.draft, dplan)
        assert proposals is not None
        verify_batch, vplan = self.pipeline.verify(draft_batch, frozen_i64(proposals.reshape(-1).cpu().numpy()))
        target_tokens = self.runner.run(self.target, vplan)
        assert target_tokens is not None
        result, committed, cplan = self.pipeline.commit(verify_batch, frozen_i64(target_tokens.reshape(-1).cpu().numpy()))
        self.runner.run(self.target, cplan)
        released = set(committed.released_kv.tolist())
        for rid in rids:
            r = self.requests[rid]
            r.context = [x for x in r.context if x not in released]
        self.kv_refs.unref(committed.released_kv)
        extended, eplan = self.pipeline.draft_extend(committed)
        self.runner.run(self.draft, eplan)
        self.running = self.pipeline.merge(DecodeBatch.empty(), extended)
        drafts = proposals.reshape(len(rids), k).tolist()
        emitted = [drafts[i][:m] + [b] for i, (m, b) in enumerate(zip(result.accepted.tolist(), result.bonus.tolist(), strict=True))]
        self.stats.iterations += 1
        self.stats.row_iterations += len(rids)
        self.stats.proposed += k * len(rids)
        self.stats.accepted += int(result.accepted.sum())
        self._progress.requests += len(rids)
        self._emit(rids, emitted)
        self._finish()

    def _abort_failed(self, failure: StepFailed) -> None:
        # every ticket is consumed within the step that registers it, so what is outstanding now
        # belongs to the failed forward
        for t in self.ledger.outstanding():
            self.ledger.cancel(t, f"aborted: its forward failed ({failure.cause!r})")
        self.stats.failed_steps += 1
        live = [rid for rid in failure.rids if rid in self.requests]
        self.stats.aborts += len(live)
        self.aborted_by_failure.update(live)
        self._progress.aborted.extend(live)
        if self.first_failure is None:
            self.first_failure = " ".join(str(failure).split())
        for ex in self._executors():
            ex.forget_verifies()
        self._release(live, Ending.FAILED)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _alloc_for(self, rids: Sequence[RequestId], per_row: int) -> I64:
        kv = self.kv_refs.alloc(len(rids) * per_row)
        locs = kv.tolist()
        for i, rid in enumerate(rids):
            self.requests[rid].context.extend(locs[i * per_row : (i + 1) * per_row])
        return kv

    def _pending_of(self, rids: Sequence[RequestId]) -> I64:
        pending: list[int] = []
        for rid in rids:
            token = self.requests[rid].pending
            assert token is not None, "every running request has emitted a token"
            pending.append(token)
        return frozen_i64(pending)

    def _emit(self, rids: Sequence[RequestId], tokens: list[list[int]]) -> None:
        for rid, toks in zip(rids, tokens, strict=True):
            r = self.requests[rid]
            r.output.extend(toks)
            r.pending = toks[-1]
            self._progress.tokens += len(toks)

    def _finish(self) -> None:
        done = [r.rid for r in self.requests if r.state is RequestState.RUNNING and r.is_done()]
        if done:
            self._progress.finished.extend(done)
            self._release(done, Ending.FINISHED)

    def _release(self, rids: Sequence[RequestId], ending: Ending) -> None:
        """The one release path: the requests leave the running batch and give back their slot,
        their prefix-cache pin, room and plan, and their KV references. A retracted request goes
        back to the head of the queue, to re-prefill its prompt and output so far; any other
        ending records its output."""
        self.running = self.pipeline.filter_decode(self.running, rids)
        for rid in rids:
            r = self.requests[rid]
            if r.slot is not None:
                self.slots.free(r.slot)
            self.session.abandon(r)
            self.kv_refs.unref(r.context)
            if ending is Ending.RETRACTED:
                prompt = frozen_i64([*r.original.tolist(), *r.output]) if r.output else r.original
                self.requests.requeue(
                    Request(rid=rid, prompt=prompt, original=r.original, max_new_tokens=r.max_new_tokens, stop=r.stop,
                            output=r.output, retractions=r.retractions + 1)
                )
            else:
                self.requests.remove(rid)
                self.outputs[rid] = r.final_output()

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
                return
            self.step()
        if not self.requests:
            return
        raise RuntimeError(f"{self.live} requests still live after {max_steps} steps")

