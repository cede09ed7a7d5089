"""The serving driver: continuous batching over a target model and (for speculative decoding) a
draft model, each with its own Mamba pool, KV cache and token table, addressed by the same slot ids
and KV locations.

Per ``step()`` (one scheduler iteration), one kind of forward:

- **extend** when requests wait for (more of) their prefill, alternating with the running batch
  so neither starves: each gets its next chunk (at most ``chunk_size`` tokens, at most
  ``token_budget`` in total). A first chunk starts with a clear (fresh slot) or a COW (a cached
  prefix, from a manual ``Checkpoint`` or the ``PrefixCache``), later chunks continue. One
  ``Pipeline.prefill`` lowers the forward with one ticket per pool and both executors run the same
  ``ExtendPlan``: the draft pool's init ops run there, and only there. A chunk that ends at a prefix
  worth caching carries a snapshot into a cache slot (a one-shot op after the forward, through the
  same tickets and ledger). The target's argmax at a prompt's end is the request's first token.
- **mixed** (``k == 0`` only, on by default, ``mixed=False`` turns it off): while requests both
  run and wait, the running batch's decode and the next prefill chunks share one MIXED forward
  (``Pipeline.mixed``), so prefills do not pause the decodes. With a draft the steps alternate
  instead: a speculative iteration is four forwards over two models (the same choice as engines
  that turn mixed chunked prefill off under speculative decoding).
- otherwise **decode** (``k == 0``: plain greedy) or **spec** (``k > 0``): draft proposal (draft
  executor), verify (target), accept + commit (target), draft extend (draft). Rejected KV
  locations go back to the allocator right after the commit.

With ``retries > 0`` the executors are transactional and a forward that fails (a kernel or model
error; ``backend.faults`` injects them in tests) is executed again, giving the output of a run
without the fault; once retries are exhausted the forward's requests are aborted and its tickets
that never ran are cancelled in the ledger.

A request finishes at ``max_new_tokens`` or after emitting its ``stop`` token; ``abort`` ends it at
any time. When the next decode or spec step cannot get its KV locations, the newest running
requests are retracted: their slot and KV go back, and they re-prefill their prompt plus the
tokens generated so far later (greedy, so their output continues unchanged).

KV locations are reference-counted: a request holds one reference on every location of its
context; a checkpoint holds one on its prefix's locations, which requests starting from it share.
Greedy speculative decoding is lossless: the tokens emitted at any ``k`` equal those at ``k = 0``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import assert_never, cast

import attrs
import torch

from backend.allocator import KVAllocator, SlotAllocator
from backend.executor import Executor
from backend.hybrid.hook import HybridHook
from backend.hybrid.model import HybridModel
from backend.pool import MAX_POOL_BYTES as MAMBA_POOL_MAX_BYTES
from backend.ledger import Ledger
from compiler.driver import checked_prompt
from compiler.manager import PassManager
from compiler.prefix_cache import CacheEntry, PrefixCache
from compiler.steps import Pipeline
from ir._fields import I64, frozen_i64, int_problem
from ir.batch import DecodeBatch, ExtendBatch
from ir.errors import BatchcError, EngineStoppedError, PreconditionError, SlotError, short_repr
from ir.nodes import Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.spec import CommitPlan, DraftExtendPlan, DraftPlan, VerifyPlan
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, PoolId, RequestId
from ir.init import InitIntent
from ir.request import AdmittedRequest
from passes.lower import LowerContext
from passes.prepare_for_decode import DecodeContext
from passes.prepare_for_draft import SpecContext


class StepFailed(Exception):
    """A forward failed on every attempt; ``rids`` are the requests it carried."""

    def __init__(self, rids: tuple[RequestId, ...], cause: Exception) -> None:
        super().__init__(f"forward of requests {list(rids)} failed: {cause!r}")
        self.rids = rids
        self.cause = cause


def _plan_rids(plan: Plan) -> list[int]:
    match plan:
        case ExtendPlan() | DecodePlan():
            return [int(r) for r in plan.rids]
        case MixedPlan():
            return [int(r) for r in plan.extend.rids] + [int(r) for r in plan.decode.rids]
        case DraftPlan() | VerifyPlan() | CommitPlan() | DraftExtendPlan():
            return [int(r) for r in plan.batch.rids]
        case IdlePlan():
            return []
        case _:
            assert_never(plan)


@attrs.frozen(kw_only=True)
class Checkpoint:
    """The recurrent state after ``tokens`` in ``slot`` of both pools, and their KV locations."""

    slot: MambaSlot
    tokens: tuple[int, ...]
    kv_locs: tuple[int, ...]


@attrs.define(kw_only=True)
class _Request:
    rid: RequestId
    prompt: I64  # the tokens to prefill: the prompt, plus the output so far after a retraction
    original: I64  # the prompt as admitted
    max_new_tokens: int
    stop: int | None
    source: Checkpoint | CacheEntry | None = None  # where the slot's first state comes from
    slot: MambaSlot | None = None
    done: int = 0  # prompt tokens in the state
    snapshot_at: int | None = None  # prefix boundary to snapshot into the cache
    snapshot_slot: MambaSlot | None = None
    context: list[int] = attrs.Factory(list)  # KV location of every context position (one ref each)
    output: list[int] = attrs.Factory(list)
    retractions: int = 0


@attrs.define
class SpecStats:
    iterations: int = 0
    row_iterations: int = 0
    proposed: int = 0
    accepted: int = 0
    prefills: int = 0
    decodes: int = 0
    mixed: int = 0  # MIXED forwards (counted in prefills and decodes too)
    retractions: int = 0
    aborts: int = 0
    retries: int = 0
    failed_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per row per speculative iteration (accepted drafts + the bonus)."""
        return (self.accepted + self.row_iterations) / self.row_iterations if self.row_iterations else 0.0


MAX_K = 32
"""Most draft tokens per speculative iteration (the same bound as ``compiler.workload.MAX_K``, the
command line's; the engine does not import the command line's modules)."""
MAX_CAPACITY = 2**20
"""Most Mamba slots (per pool) a driver takes: running requests, checkpoints and cache entries."""
MAX_KV_CAPACITY = 2**31
"""Most attention KV locations a driver takes."""
MAX_LEN = 2**20
"""Longest context (prompt, new tokens and the k + 1 speculative positions) a driver takes."""
MAX_TABLE_ENTRIES = 2**31
"""Bound on ``(capacity + 1) * max_len``, the entries of each model's token table (int64: 16 GiB)."""
MAX_POOL_BYTES = MAMBA_POOL_MAX_BYTES
"""Bound on each Mamba state pool's bytes (``backend.pool.MAX_POOL_BYTES``), checked up front."""
MAX_RETRIES = 100
"""Most re-executions of a failing forward."""


def _driver_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """``value`` as an ``int`` in ``[lo, hi]``, or ``PreconditionError`` naming ``SpecDriver``'s
    argument ``name`` and the value (``bool``, ``float``, ``str``, ``None`` are not ints)."""
    problem = int_problem(value)
    if problem is not None:
        raise PreconditionError("SpecDriver", f"{name} {problem} (got {short_repr(value)})")
    n = int(cast(int, value))
    if n < lo or (hi is not None and n > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise PreconditionError("SpecDriver", f"{name} must be {bound}, got {n}")
    return n


def _check_driver_args(
    target: object,
    draft: object,
    *,
    k: object,
    capacity: object,
    kv_capacity: object,
    max_len: object,
    chunk_size: object,
    token_budget: object,
    prefix_cache: object,
    retries: object,
    mixed: object,
    pm: object,
) -> None:
    """``SpecDriver``'s argument checks, all before anything is allocated (``PreconditionError``
    naming the argument and the value)."""
    kk = _driver_int("k", k, 0, MAX_K)
    slots = _driver_int("capacity", capacity, 1, MAX_CAPACITY)
    _driver_int("kv_capacity", kv_capacity, 1, MAX_KV_CAPACITY)
    length = _driver_int("max_len", max_len, 1, MAX_LEN)
    if length < kk + 3:
        raise PreconditionError(
            "SpecDriver", f"max_len {length} leaves no room for a prompt token and a new token next to the k + 1 = {kk + 1} speculative positions"
        )
    if (slots + 1) * length > MAX_TABLE_ENTRIES:
        raise PreconditionError(
            "SpecDriver", f"(capacity + 1) * max_len = {(slots + 1) * length} token-table entries, over the bound {MAX_TABLE_ENTRIES}"
        )
    for name, value in (("chunk_size", chunk_size), ("token_budget", token_budget)):
        if value is not None:
            _driver_int(name, value, 1)
    _driver_int("retries", retries, 0, MAX_RETRIES)
    if type(mixed) is not bool:  # noqa: E721 - 0, 1, 'no' and None are not switches
        raise PreconditionError("SpecDriver", f"mixed must be a bool, not {type(mixed).__name__} (got {short_repr(mixed)})")
    if not isinstance(target, HybridModel):
        raise PreconditionError("SpecDriver", f"target must be a HybridModel, not {type(target).__name__} (got {short_repr(target)})")
    if draft is not None and not isinstance(draft, HybridModel):
        raise PreconditionError("SpecDriver", f"draft must be a HybridModel or None, not {type(draft).__name__} (got {short_repr(draft)})")
    if kk > 0 and draft is None:
        raise PreconditionError("SpecDriver", f"speculative decoding (k = {kk}) needs a draft model, got draft=None")
    if kk > 0 and draft is not None and draft.config.vocab != target.config.vocab:
        raise PreconditionError(
            "SpecDriver", f"draft vocabulary {draft.config.vocab} differs from the target's {target.config.vocab}"
        )
    for name, model in (("target", target), ("draft", draft if kk > 0 else None)):
        if model is not None:
            row_bytes = model.config.pool_layout().row_bytes
            if (slots + 1) * row_bytes > MAX_POOL_BYTES:
                raise PreconditionError(
                    "SpecDriver",
                    f"capacity {slots}: the {name}'s state pool would take {(slots + 1) * row_bytes} bytes, over the bound {MAX_POOL_BYTES}",
                )
    if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
        raise PreconditionError(
            "SpecDriver", f"prefix_cache must be a PrefixCache or None, not {type(prefix_cache).__name__} (got {short_repr(prefix_cache)})"
        )
    if pm is not None and not isinstance(pm, PassManager):
        raise PreconditionError("SpecDriver", f"pm must be a PassManager or None, not {type(pm).__name__} (got {short_repr(pm)})")


class SpecDriver:
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
        argument and the value): counts are ints (numpy integers too; never ``bool``, ``float``,
        ``str`` or ``None``) with ``k`` in ``[0, MAX_K]``, ``capacity`` in ``[1, MAX_CAPACITY]``,
        ``kv_capacity`` in ``[1, MAX_KV_CAPACITY]``, ``max_len`` in ``[k + 3, MAX_LEN]`` (room for a
        prompt token, a new token and the k + 1 speculative positions) with ``(capacity + 1) *
        max_len <= MAX_TABLE_ENTRIES`` and each state pool within ``MAX_POOL_BYTES``,
        ``chunk_size`` and ``token_budget`` ``None`` or ``>= 1``, ``retries`` in ``[0,
        MAX_RETRIES]``; ``target`` a ``HybridModel``; ``draft`` a ``HybridModel`` of the target's
        vocabulary when ``k > 0`` (``None`` or unused when ``k == 0``); ``mixed`` a ``bool``;
        ``prefix_cache`` a ``PrefixCache`` or ``None``; ``pm`` a ``PassManager`` or ``None``."""
        _check_driver_args(
            target, draft, k=k, capacity=capacity, kv_capacity=kv_capacity, max_len=max_len, chunk_size=chunk_size,
            token_budget=token_budget, prefix_cache=prefix_cache, retries=retries, mixed=mixed, pm=pm,
        )
        k, capacity, kv_capacity, max_len, retries = int(k), int(capacity), int(kv_capacity), int(max_len), int(retries)
        chunk_size = int(chunk_size) if chunk_size is not None else None
        token_budget = int(token_budget) if token_budget is not None else None
        self.k = k
        self.vocab = target.config.vocab
        self.retries = retries
        self.mixed = mixed
        self.max_len = max_len
        self.chunk_size = chunk_size if chunk_size is not None else max_len
        self.token_budget = token_budget if token_budget is not None else max_len * capacity
        self.cache = prefix_cache
        self.ledger = Ledger()
        self.slots = SlotAllocator(capacity)
        self.kv = KVAllocator(kv_capacity)
        pools = (TARGET_POOL, DRAFT_POOL) if k > 0 else (TARGET_POOL,)
        self.pipeline = Pipeline(self.ledger, LowerContext(pools=pools), pm)
        self.target = self._executor(target, TARGET_POOL, capacity, kv_capacity)
        self.draft = self._executor(draft, DRAFT_POOL, capacity, kv_capacity) if k > 0 and draft is not None else None
        self.running = DecodeBatch.empty()
        self.stats = SpecStats()
        self._reqs: dict[RequestId, _Request] = {}
        self._waiting: list[RequestId] = []
        self._pending: dict[RequestId, int] = {}
        self._refs: Counter[int] = Counter()
        self._checkpoints: dict[MambaSlot, Checkpoint] = {}
        """The checkpoints ``make_checkpoint`` made and ``release_checkpoint`` has not released."""
        self._last_was_prefill = False
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
        # with retries, each forward is one transactional unit that can simply run again
        return Executor(pool, self.ledger, hook, slots=self.slots, transactional=self.retries > 0)

    def _executors(self) -> list[Executor]:
        return [self.target] + ([self.draft] if self.draft is not None else [])

    def _copy_table_prefix(self, src: int, dst: int, length: int) -> None:
        for ex in self._executors():
            assert isinstance(ex.model, HybridHook)
            ex.model.table.copy_prefix(src, dst, length)

    # -- KV references ------------------------------------------------------------------------

    def _ref(self, locs: Iterable[int]) -> None:
        for loc in locs:
            self._refs[loc] += 1

    def _unref(self, locs: Iterable[int]) -> None:
        freed = []
        for loc in locs:
            self._refs[loc] -= 1
            if self._refs[loc] == 0:
                del self._refs[loc]
                freed.append(loc)
        self.kv.free_many(freed)

    def _alloc_kv(self, n: int) -> I64:
        locs = self.kv.alloc_many(n)
        self._ref(int(x) for x in locs)
        return locs

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
        ``IRValidationError`` for the prompt's tokens), so a refused admission leaves the driver, its
        allocators, pools and prefix cache as they were. Ids and counts are ints (numpy integers
        too), never ``bool``, ``float``, ``str`` or ``None``, within int64. A stopped engine
        (``step``) refuses with ``EngineStoppedError``."""
        self.check_serving()
        problem = int_problem(rid)
        if problem is not None:
            raise PreconditionError("admit", f"rid {problem} (got {rid!r})")
        rid = RequestId(int(rid))
        if rid in self._reqs or rid in self.outputs:
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
        if self.cache is not None and checkpoint is None:
            self.cache.observe(arr.tolist())
        self._reqs[rid] = _Request(rid=rid, prompt=arr, original=arr, max_new_tokens=max_new_tokens, stop=stop, source=checkpoint)
        self._waiting.append(rid)

    def _check_checkpoint(self, rid: RequestId, checkpoint: object, arr: I64) -> None:
        """``admit``'s checks of a checkpoint argument: one of this driver's live prefix checkpoints
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
        for other in self._reqs.values():
            if slot in (other.slot, other.snapshot_slot):
                raise PreconditionError("admit", f"request {rid}: checkpoint slot {slot} is a slot of live request {other.rid}")
        unheld = [loc for loc in checkpoint.kv_locs if loc not in self._refs]
        if unheld:
            raise PreconditionError("admit", f"request {rid}: checkpoint KV location {unheld[0]} is not held (not a live checkpoint)")
        if self._checkpoints.get(MambaSlot(slot)) != checkpoint:
            raise PreconditionError(
                "admit", f"request {rid}: checkpoint {short_repr(checkpoint)} is not a checkpoint this driver holds (forged, or released)"
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
            kv = self._alloc_kv(n)
            req = AdmittedRequest(rid=RequestId(-1 - int(slot)), slot=slot, input_ids=arr, kv_locs=kv, intent=InitIntent.CLEAR)
            _, plan = self.pipeline.prefill([req])
            for ex in self._executors():
                ex.execute(plan)
        except BaseException as exc:
            self.stopped_by = exc  # a slot, KV locations or tickets may be taken and not recorded
            raise
        cp = Checkpoint(slot=slot, tokens=tuple(arr.tolist()), kv_locs=tuple(int(k) for k in kv))
        self._checkpoints[slot] = cp
        return cp

    def release_checkpoint(self, cp: Checkpoint) -> None:
        """Return a checkpoint's slot and its KV references.

        Only a checkpoint this driver made and has not released yet is accepted (the whole record
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
            raise SlotError(f"release_checkpoint: double free of slot {slot}: no checkpoint of this driver holds it (released already?)")
        if held is None or held != cp:
            raise PreconditionError(
                "release_checkpoint", f"cp {short_repr(cp)} is not a checkpoint this driver holds (forged, or released already)"
            )
        waiting = sorted(int(r.rid) for r in self._reqs.values() if r.done == 0 and r.source == held)
        if waiting:
            raise PreconditionError(
                "release_checkpoint", f"checkpoint in slot {slot} is still to be copied by request(s) {waiting} (their first chunk has not run)"
            )
        del self._checkpoints[slot]
        self.slots.free(slot)
        self._unref(held.kv_locs)

    def abort(self, rid: RequestId) -> None:
        """End a live request now (its output so far goes to ``outputs``). ``rid`` is an int (numpy
        integers too; never ``bool``, ``float``, ``str`` or ``None``), else ``PreconditionError``.
        A stopped engine refuses with ``EngineStoppedError``."""
        self.check_serving()
        problem = int_problem(rid)
        if problem is not None:
            raise PreconditionError("abort", f"rid {problem} (got {short_repr(rid)})")
        rid = RequestId(int(rid))
        if rid not in self._reqs:
            raise PreconditionError("abort", f"request {rid} is not live")
        self.stats.aborts += 1
        self._release([rid])

    @property
    def live(self) -> int:
        return len(self._reqs)

    def live_slots(self) -> dict[RequestId, MambaSlot]:
        """The slot of every live request that has started its prefill."""
        return {rid: r.slot for rid, r in self._reqs.items() if r.slot is not None}

    # -- one iteration --------------------------------------------------------------------------

    def step(self) -> str:
        """One iteration. A forward that still fails after ``retries`` attempts aborts the requests of
        that forward (their tickets that did not run are cancelled in the ledger, with the reason);
        the step then returns ``"failed"`` and serving goes on.

        Any other exception escaping a step (a pass refusing its input, a dump that cannot be
        written, a bug) may leave the step's bookkeeping half done: slots, KV locations or a
        prefix-cache reservation taken but not yet recorded. Rather than serve on with resources it
        cannot account for, the engine stops: the exception propagates, and every later ``step`` or
        ``admit`` raises ``EngineStoppedError`` naming it. Outputs already finished stay in
        ``outputs``."""
        self.check_serving()
        self._stepping = True
        try:
            return self._step()
        except StepFailed as failure:
            self._abort_failed(failure)
            return "failed"
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
            raise PreconditionError("engine", "called from inside a step (a model hook?): admit, abort and checkpoints wait for step() to return")
        if self.stopped_by is not None:
            raise EngineStoppedError(
                f"engine stopped: an earlier step raised {self.stopped_by!r}; its bookkeeping may be partial, "
                "so this engine serves no more steps (outputs finished before it are in .outputs)"
            )

    def _step(self) -> str:
        if self.mixed and self.draft is None and self._waiting and self.running.num_requests:
            if self._reserve_kv(1):  # False only when retraction emptied the running batch
                self._last_was_prefill = False
                return self._mixed()
        prefill_ready = bool(self._waiting) and (not self.running.num_requests or not self._last_was_prefill)
        if prefill_ready and self._prefill():
            self._last_was_prefill = True
            return "extend"
        self._last_was_prefill = False
        if not self.running.num_requests:
            return "idle"
        if not self._reserve_kv(self.k + 1):
            return "retract"
        if self.draft is None:
            self._decode()
            return "decode"
        self._speculate()
        return "spec"

    def _kv_owed(self) -> int:
        """KV locations that started, unfinished prefills still need for the rest of their prompts."""
        return sum(int(r.prompt.shape[0]) - (r.done or 0) for r in self._reqs.values() if r.slot is not None and r.rid in self._waiting)

    def _start(self, r: _Request) -> bool:
        """Give a request its slot and prefix source before its first chunk; False if none is free,
        or if the KV for its whole prompt does not fit next to what started prefills still need
        (a started prefill can then always finish: no deadlock of half-prefilled requests)."""
        while self.kv.num_free < self._kv_owed() + int(r.prompt.shape[0]):
            if not self._evict():
                return False
        if self.slots.num_free == 0 and not self._evict():
            return False
        r.slot = self.slots.alloc()
        if r.source is None and self.cache is not None:
            entry = self.cache.lookup(r.prompt.tolist())
            if entry is not None:
                self.cache.pin(entry)  # not evictable until the COW has run
                r.source = entry
        start = len(r.source.tokens) if r.source is not None else 0
        if r.source is not None:
            self._ref(r.source.kv_locs)
            r.context.extend(r.source.kv_locs)
            self._copy_table_prefix(int(r.source.slot), int(r.slot), start)
        if self.cache is not None:
            r.snapshot_at = self.cache.plan_snapshot(r.prompt.tolist(), start)
        return True

    def _evict(self) -> bool:
        if self.cache is None:
            return False
        entry = self.cache.evict_lru()
        if entry is None:
            return False
        self.slots.free(entry.slot)
        self._unref(entry.kv_locs)
        return True

    def _chunks(self) -> list[AdmittedRequest]:
        """The next prefill chunk of each waiting request, in order, within the token budget, the
        free slots and the free KV locations (allocated here)."""
        admitted: list[AdmittedRequest] = []
        budget = self.token_budget
        for rid in list(self._waiting):
            r = self._reqs[rid]
            if budget <= 0:
                break
            if r.slot is None and not self._start(r):
                break
            pos = r.done if r.done else (len(r.source.tokens) if r.source is not None else 0)
            n = min(self.chunk_size, budget, int(r.prompt.shape[0]) - pos)
            if r.snapshot_at is not None and pos < r.snapshot_at:
                n = min(n, r.snapshot_at - pos)
            if n > self.kv.num_free:
                break
            snap_to = None
            if r.snapshot_at is not None and pos + n == r.snapshot_at and self.cache is not None:
                room = self.cache.reserve_room() or (self._evict() and self.cache.reserve_room())
                if room and (self.slots.num_free or self._evict()):
                    snap_to = r.snapshot_slot = self.slots.alloc()
                else:
                    if room:
                        self.cache.release_room()
                    self.cache.cancel_plan(r.prompt[: r.snapshot_at].tolist())
                    r.snapshot_at = None  # no room: skip this snapshot
            kv = self._alloc_kv(n)
            r.context.extend(int(x) for x in kv)
            first = r.done == 0
            assert r.slot is not None
            admitted.append(
                AdmittedRequest(
                    rid=rid, slot=r.slot, input_ids=r.prompt[pos : pos + n], kv_locs=kv, prefix_len=pos,
                    intent=(InitIntent.COW if r.source is not None else InitIntent.CLEAR) if first else InitIntent.CONTINUE,
                    checkpoint=r.source.slot if first and r.source is not None else None,
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
        logits = self._run(self.target, plan)
        if self.draft is not None:
            self._run(self.draft, plan)  # the draft pool's init ops (and snapshots): consumed here, once
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
            r = self._reqs[a.rid]
            if r.done == 0 and isinstance(r.source, CacheEntry) and self.cache is not None:
                self.cache.unpin(r.source)
            pos = a.prefix_len + int(a.input_ids.shape[0])
            r.done = pos
            if a.snapshot_to is not None and self.cache is not None:
                self._copy_table_prefix(int(r.slot or 0), int(a.snapshot_to), pos)
                locs = tuple(r.context[:pos])
                self._ref(locs)
                self.cache.insert(CacheEntry(slot=a.snapshot_to, tokens=tuple(int(t) for t in r.prompt[:pos]), kv_locs=locs))
                r.snapshot_at = r.snapshot_slot = None
            if not a.more_chunks:
                finished.append(a.rid)
                self._waiting.remove(a.rid)
        rows = {RequestId(int(rid)): i for i, rid in enumerate(extend.rids)}
        tokens = logits.argmax(dim=-1).tolist()
        self._emit(finished, [[int(tokens[rows[rid]])] for rid in finished])

    def _mixed(self) -> str:
        """``k == 0`` with requests both running and waiting: the running batch's decode and the
        next prefill chunks in one MIXED forward (a plain decode if no chunk fits)."""
        rids = self.running.rids
        ctx = DecodeContext(next_tokens=self._pending_of(rids), kv_locs=self._alloc_for(rids, 1))
        admitted = self._chunks()
        if not admitted:
            self._decode(ctx)
            return "decode"
        mixed, plan = self.pipeline.mixed(admitted, self.running, ctx)
        logits = self._run(self.target, plan)
        assert logits is not None
        self.stats.prefills += 1
        self.stats.decodes += 1
        self.stats.mixed += 1
        n = mixed.extend.num_requests
        self._after_chunks(admitted, mixed.extend, logits[:n])
        self._emit([RequestId(int(r)) for r in rids], [[int(t)] for t in logits[n:].argmax(dim=-1).tolist()])
        self.running = self.pipeline.merge(mixed.decode, mixed.extend)
        self._finish()
        return "mixed"

    def _reserve_kv(self, per_row: int) -> bool:
        """Retract the newest running requests until the next step's KV locations fit."""
        retracted = False
        while self.running.num_requests and self.kv.num_free < per_row * self.running.num_requests:
            if self._evict():
                continue
            rid = RequestId(int(self.running.rids[-1]))
            self._retract(rid)
            retracted = True
        return not retracted or bool(self.running.num_requests)

    def _retract(self, rid: RequestId) -> None:
        r = self._reqs[rid]
        self.stats.retractions += 1
        self.running = self.pipeline.filter_decode(self.running, [rid])
        assert r.slot is not None
        self.slots.free(r.slot)
        self._unref(r.context)
        self._pending.pop(rid, None)
        if r.snapshot_at is not None and self.cache is not None:
            self.cache.cancel_plan(r.prompt[: r.snapshot_at].tolist())
        if r.snapshot_slot is not None:
            self.slots.free(r.snapshot_slot)
            if self.cache is not None:
                self.cache.release_room()
        prompt = frozen_i64([*r.original.tolist(), *r.output]) if r.output else r.original
        self._reqs[rid] = _Request(
            rid=rid, prompt=prompt, original=r.original, max_new_tokens=r.max_new_tokens, stop=r.stop, output=r.output,
            retractions=r.retractions + 1,
        )
        self._waiting.insert(0, rid)

    def _decode(self, ctx: DecodeContext | None = None) -> None:
        rids = self.running.rids
        if ctx is None:
            ctx = DecodeContext(next_tokens=self._pending_of(rids), kv_locs=self._alloc_for(rids, 1))
        self.running, plan = self.pipeline.decode(self.running, ctx)
        logits = self._run(self.target, plan)
        assert logits is not None
        self.stats.decodes += 1
        self._emit([RequestId(int(r)) for r in rids], [[int(t)] for t in logits.argmax(dim=-1).tolist()])
        self._finish()

    def _speculate(self) -> None:
        assert self.draft is not None
        k, rids = self.k, self.running.rids
        window = self._alloc_for(rids, k + 1)
        draft_batch, dplan = self.pipeline.draft(self.running, SpecContext(k=k, next_tokens=self._pending_of(rids), kv_locs=window))
        proposals = self._run(self.draft, dplan)
        assert proposals is not None
        verify_batch, vplan = self.pipeline.verify(draft_batch, frozen_i64(proposals.reshape(-1).cpu().numpy()))
        target_tokens = self._run(self.target, vplan)
        assert target_tokens is not None
        result, committed, cplan = self.pipeline.commit(verify_batch, frozen_i64(target_tokens.reshape(-1).cpu().numpy()))
        self._run(self.target, cplan)
        released = set(int(x) for x in committed.released_kv)
        for rid in rids:
            r = self._reqs[RequestId(int(rid))]
            r.context = [x for x in r.context if x not in released]
        self._unref(released)
        extended, eplan = self.pipeline.draft_extend(committed)
        self._run(self.draft, eplan)
        self.running = self.pipeline.merge(DecodeBatch.empty(), extended)
        drafts = proposals.reshape(len(rids), k).tolist()
        emitted = [drafts[i][: int(m)] + [int(b)] for i, (m, b) in enumerate(zip(result.accepted, result.bonus, strict=True))]
        self.stats.iterations += 1
        self.stats.row_iterations += len(rids)
        self.stats.proposed += k * len(rids)
        self.stats.accepted += int(result.accepted.sum())
        self._emit([RequestId(int(r)) for r in rids], emitted)
        self._finish()

    # -- failures -------------------------------------------------------------------------------

    def _run(self, ex: Executor, plan: Plan) -> torch.Tensor | None:
        for attempt in range(self.retries + 1):
            try:
                return ex.execute(plan)
            except BatchcError:
                raise  # a plan that does not fit is a bug, not a fault to retry
            except Exception as exc:
                if attempt < self.retries:
                    self.stats.retries += 1
                    continue
                rids = tuple(RequestId(int(r)) for r in _plan_rids(plan))
                raise StepFailed(rids, exc) from exc
        raise AssertionError("unreachable")

    def _abort_failed(self, failure: StepFailed) -> None:
        # every ticket is consumed within the step that registers it, so what is outstanding now
        # belongs to the failed forward
        for t in self.ledger.outstanding():
            self.ledger.cancel(t, f"aborted: its forward failed ({failure.cause!r})")
        self.stats.failed_steps += 1
        live = [rid for rid in failure.rids if rid in self._reqs]
        self.stats.aborts += len(live)
        self.aborted_by_failure.update(live)
        if self.first_failure is None:
            self.first_failure = " ".join(str(failure).split())
        for ex in self._executors():
            ex.forget_verifies()
        self._release(live)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _alloc_for(self, rids: I64, per_row: int) -> I64:
        kv = self._alloc_kv(len(rids) * per_row)
        for i, rid in enumerate(rids):
            self._reqs[RequestId(int(rid))].context.extend(int(x) for x in kv[i * per_row : (i + 1) * per_row])
        return kv

    def _pending_of(self, rids: I64) -> I64:
        return frozen_i64([self._pending[RequestId(int(r))] for r in rids])

    def _emit(self, rids: Sequence[RequestId], tokens: list[list[int]]) -> None:
        for rid, toks in zip(rids, tokens, strict=True):
            r = self._reqs[rid]
            r.output.extend(toks)
            self._pending[rid] = toks[-1]

    def _done(self, r: _Request) -> bool:
        return len(r.output) >= r.max_new_tokens or (r.stop is not None and r.stop in r.output)

    def _finish(self) -> None:
        done = [rid for rid, r in self._reqs.items() if rid not in self._waiting and self._done(r)]
        if done:
            self._release(done)

    def _release(self, rids: Sequence[RequestId]) -> None:
        self.running = self.pipeline.filter_decode(self.running, rids)
        for rid in rids:
            r = self._reqs.pop(rid)
            if rid in self._waiting:
                self._waiting.remove(rid)
            if r.done == 0 and isinstance(r.source, CacheEntry) and r.slot is not None and self.cache is not None:
                self.cache.unpin(r.source)  # its COW never ran
            if r.slot is not None:
                self.slots.free(r.slot)
            if r.snapshot_slot is not None:
                self.slots.free(r.snapshot_slot)
                if self.cache is not None:
                    self.cache.release_room()
            if r.snapshot_at is not None and self.cache is not None:
                self.cache.cancel_plan(r.prompt[: r.snapshot_at].tolist())
            self._unref(r.context)
            self._pending.pop(rid, None)
            out = r.output[: r.max_new_tokens]
            if r.stop is not None and r.stop in out:
                out = out[: out.index(r.stop) + 1]
            self.outputs[rid] = out

    def drop_cache(self) -> None:
        """Evict every prefix-cache entry (all must be unpinned), returning their slots and KV."""
        while self._evict():
            pass

    def run_until_done(self, max_steps: int = 100_000) -> None:
        """Step until no request is live; ``RuntimeError`` if some still are after ``max_steps`` (an
        int >= 0, else ``PreconditionError``)."""
        problem = int_problem(max_steps)
        if problem is not None or max_steps < 0:
            raise PreconditionError("run_until_done", f"max_steps must be an int >= 0 (got {short_repr(max_steps)})")
        for _ in range(max_steps):
            if not self._reqs:
                return
            self.step()
        if not self._reqs:
            return
        raise RuntimeError(f"{self.live} requests still live after {max_steps} steps")
