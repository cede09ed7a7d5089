"""The speculative-decoding driver: continuous batching over a target model and a draft model, each
with its own Mamba pool, KV cache and token table, addressed by the same slot ids and KV locations.

Per ``step()`` (one scheduler iteration):

- if requests are waiting, one prefill forward for all of them: ``Pipeline.prefill`` lowers it with
  one ticket per pool, and both executors run the same ``ExtendPlan`` (the draft pool's clears and
  COWs happen here, and only here); the target's argmax at each prompt end is the first token;
- otherwise, with ``k == 0``, one plain greedy decode of the target; with ``k > 0`` one speculative
  iteration: draft proposal (draft executor), verify (target), accept + commit (target), draft
  extend (draft). Rejected KV locations go back to the allocator right after the commit.

A request emits tokens until ``max_new_tokens``; then its slot and KV locations are freed. A request
may start from a ``Checkpoint`` (``make_checkpoint``): the prefix state is copied (COW) into its
slot in both pools and the prefix's KV locations are shared through both token tables; the
checkpoint must outlive the requests that use it.

Greedy speculative decoding is lossless: the tokens emitted at any ``k`` equal those at ``k = 0``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from backend.allocator import KVAllocator, SlotAllocator
from backend.executor import Executor
from backend.hybrid.hook import HybridHook
from backend.hybrid.model import HybridModel
from backend.ledger import Ledger
from compiler.manager import PassManager
from compiler.steps import Pipeline
from ir._fields import I64, frozen_i64
from ir.batch import DecodeBatch
from ir.errors import PreconditionError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, PoolId, RequestId
from ir.init import InitIntent
from ir.request import AdmittedRequest
from passes.lower import LowerContext
from passes.prepare_for_decode import DecodeContext
from passes.prepare_for_draft import SpecContext


@attrs.frozen(kw_only=True)
class Checkpoint:
    """The recurrent state after ``tokens`` in ``slot`` of both pools, and their KV locations."""

    slot: MambaSlot
    tokens: tuple[int, ...]
    kv_locs: tuple[int, ...]


@attrs.define(kw_only=True)
class _Request:
    rid: RequestId
    prompt: I64
    max_new_tokens: int
    checkpoint: Checkpoint | None
    slot: MambaSlot | None = None
    kv: list[int] = attrs.Factory(list)  # locations this request owns (not a checkpoint's)
    output: list[int] = attrs.Factory(list)


@attrs.define
class SpecStats:
    iterations: int = 0
    row_iterations: int = 0
    proposed: int = 0
    accepted: int = 0
    prefills: int = 0
    decodes: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per row per speculative iteration (accepted drafts + the bonus)."""
        return (self.accepted + self.row_iterations) / self.row_iterations if self.row_iterations else 0.0


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
        pm: PassManager | None = None,
    ) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k > 0 and draft is None:
            raise ValueError("speculative decoding (k > 0) needs a draft model")
        self.k = k
        self.max_len = max_len
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
        self.outputs: dict[RequestId, list[int]] = {}

    def _executor(self, model: HybridModel, pool_id: PoolId, capacity: int, kv_capacity: int) -> Executor:
        pool = model.new_pool(capacity, pool_id=pool_id)
        hook = HybridHook(model, model.new_kv_cache(kv_capacity), model.new_token_table(capacity, self.max_len))
        return Executor(pool, self.ledger, hook, slots=self.slots)

    def _executors(self) -> list[Executor]:
        return [self.target] + ([self.draft] if self.draft is not None else [])

    @staticmethod
    def _hook(ex: Executor) -> HybridHook:
        assert isinstance(ex.model, HybridHook)
        return ex.model

    # -- requests -----------------------------------------------------------------------------

    def admit(
        self, rid: RequestId, prompt: Sequence[int], *, max_new_tokens: int, checkpoint: Checkpoint | None = None
    ) -> None:
        arr = frozen_i64(prompt)
        if rid in self._reqs or rid in self.outputs:
            raise PreconditionError("admit", f"request id {rid} is already in use")
        if max_new_tokens < 1:
            raise PreconditionError("admit", f"request {rid}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if arr.shape[0] + max_new_tokens + self.k + 1 > self.max_len:
            raise PreconditionError("admit", f"request {rid}: prompt {arr.shape[0]} + {max_new_tokens} new tokens exceed max_len {self.max_len}")
        if checkpoint is not None:
            n = len(checkpoint.tokens)
            if not (n < arr.shape[0] and tuple(int(t) for t in arr[:n]) == checkpoint.tokens):
                raise PreconditionError("admit", f"request {rid}: prompt does not extend the checkpoint's {n} tokens")
        self._reqs[rid] = _Request(rid=rid, prompt=arr, max_new_tokens=max_new_tokens, checkpoint=checkpoint)
        self._waiting.append(rid)

    def make_checkpoint(self, tokens: Sequence[int]) -> Checkpoint:
        """Prefill ``tokens`` into a fresh slot of both models and keep it as a prefix checkpoint."""
        slot = self.slots.alloc()
        kv = self.kv.alloc_many(len(tokens))
        req = AdmittedRequest(rid=RequestId(-1 - int(slot)), slot=slot, input_ids=list(tokens), kv_locs=kv, intent=InitIntent.CLEAR)
        _, plan = self.pipeline.prefill([req])
        for ex in self._executors():
            ex.execute(plan)
        return Checkpoint(slot=slot, tokens=tuple(int(t) for t in tokens), kv_locs=tuple(int(k) for k in kv))

    def release_checkpoint(self, cp: Checkpoint) -> None:
        self.slots.free(cp.slot)
        self.kv.free_many(cp.kv_locs)

    @property
    def live(self) -> int:
        return len(self._reqs)

    # -- one iteration --------------------------------------------------------------------------

    def step(self) -> str:
        if self._waiting:
            self._prefill()
            return "extend"
        if not self.running.num_requests:
            return "idle"
        if self.draft is None:
            self._decode()
            return "decode"
        self._speculate()
        return "spec"

    def _prefill(self) -> None:
        admitted = []
        for rid in self._waiting:
            r = self._reqs[rid]
            r.slot = self.slots.alloc()
            start = len(r.checkpoint.tokens) if r.checkpoint is not None else 0
            kv = self.kv.alloc_many(r.prompt.shape[0] - start)
            r.kv.extend(int(x) for x in kv)
            if r.checkpoint is not None:
                for ex in self._executors():
                    self._hook(ex).table.copy_prefix(int(r.checkpoint.slot), int(r.slot), start)
            admitted.append(
                AdmittedRequest(
                    rid=rid, slot=r.slot, input_ids=r.prompt[start:], kv_locs=kv, prefix_len=start,
                    intent=InitIntent.COW if r.checkpoint is not None else InitIntent.CLEAR,
                    checkpoint=r.checkpoint.slot if r.checkpoint is not None else None,
                )
            )
        self._waiting.clear()
        extend, plan = self.pipeline.prefill(admitted)
        logits = self.target.execute(plan)
        if self.draft is not None:
            self.draft.execute(plan)  # the draft pool's init ops: consumed here, once
        assert logits is not None
        self.stats.prefills += 1
        self._emit(extend.rids, [[int(t)] for t in logits.argmax(dim=-1).tolist()])
        self.running = self.pipeline.merge(self.running, extend)
        self._finish()

    def _decode(self) -> None:
        rids = self.running.rids
        kv = self._alloc_for(rids, 1)
        ctx = DecodeContext(next_tokens=self._pending_of(rids), kv_locs=kv)
        self.running, plan = self.pipeline.decode(self.running, ctx)
        logits = self.target.execute(plan)
        assert logits is not None
        self.stats.decodes += 1
        self._emit(rids, [[int(t)] for t in logits.argmax(dim=-1).tolist()])
        self._finish()

    def _speculate(self) -> None:
        assert self.draft is not None
        k, rids = self.k, self.running.rids
        window = self._alloc_for(rids, k + 1)
        draft_batch, dplan = self.pipeline.draft(self.running, SpecContext(k=k, next_tokens=self._pending_of(rids), kv_locs=window))
        proposals = self.draft.execute(dplan)
        assert proposals is not None
        verify_batch, vplan = self.pipeline.verify(draft_batch, frozen_i64(proposals.reshape(-1).cpu().numpy()))
        target_tokens = self.target.execute(vplan)
        assert target_tokens is not None
        result, committed, cplan = self.pipeline.commit(verify_batch, frozen_i64(target_tokens.reshape(-1).cpu().numpy()))
        self.target.execute(cplan)
        self._release_kv(rids, committed.released_kv)
        extended, eplan = self.pipeline.draft_extend(committed)
        self.draft.execute(eplan)
        self.running = self.pipeline.merge(DecodeBatch.empty(), extended)
        drafts = proposals.reshape(len(rids), k).tolist()
        emitted = [drafts[i][: int(m)] + [int(b)] for i, (m, b) in enumerate(zip(result.accepted, result.bonus, strict=True))]
        self.stats.iterations += 1
        self.stats.row_iterations += len(rids)
        self.stats.proposed += k * len(rids)
        self.stats.accepted += int(result.accepted.sum())
        self._emit(rids, emitted)
        self._finish()

    # -- bookkeeping ----------------------------------------------------------------------------

    def _alloc_for(self, rids: I64, per_row: int) -> I64:
        kv = self.kv.alloc_many(len(rids) * per_row)
        for i, rid in enumerate(rids):
            self._reqs[RequestId(int(rid))].kv.extend(int(x) for x in kv[i * per_row : (i + 1) * per_row])
        return kv

    def _release_kv(self, rids: I64, released: I64) -> None:
        gone = set(int(x) for x in released)
        if not gone:
            return
        for rid in rids:
            r = self._reqs[RequestId(int(rid))]
            r.kv = [x for x in r.kv if x not in gone]
        self.kv.free_many(released)

    def _pending_of(self, rids: I64) -> I64:
        return frozen_i64([self._pending[RequestId(int(r))] for r in rids])

    def _emit(self, rids: I64 | Sequence[int], tokens: list[list[int]]) -> None:
        for rid_, toks in zip(rids, tokens, strict=True):
            rid = RequestId(int(rid_))
            r = self._reqs[rid]
            r.output.extend(toks)
            self._pending[rid] = toks[-1]

    def _finish(self) -> None:
        done = [rid for rid, r in self._reqs.items() if len(r.output) >= r.max_new_tokens and rid not in self._waiting]
        if not done:
            return
        self.running = self.pipeline.filter_decode(self.running, done)
        for rid in done:
            r = self._reqs.pop(rid)
            assert r.slot is not None
            self.slots.free(r.slot)
            self.kv.free_many(r.kv)
            self._pending.pop(rid, None)
            self.outputs[rid] = r.output[: r.max_new_tokens]

    def run_until_done(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self._reqs:
                return
            self.step()
        raise RuntimeError(f"{self.live} requests still live after {max_steps} steps")

