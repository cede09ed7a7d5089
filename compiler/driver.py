"""A small serving driver for the non-speculative path: admission, chunked prefill, mixed and decode
steps, finish and abort, over the typed pipeline and one executor.

Per ``step()`` it builds exactly one forward:

- requests waiting for (more of) their prefill get their next chunk (at most ``chunk_size`` tokens):
  a first chunk starts with a clear (fresh) or a COW (cached prefix, ``checkpoint`` given at
  admission), later chunks continue; with running decodes as well, the step is a MIXED forward;
- otherwise the running requests decode one token; with nothing to do the step is IDLE.

After the forward the sampler gives one token per request that completed its prompt or decoded;
requests that reach ``max_new_tokens`` finish, and their slot and KV locations are freed.

Invariants kept (checked by the tests): every ticket the pipeline registers is consumed by the
executor in the same step; a slot or KV location is owned by at most one live request; slots and
KV of finished and aborted requests return to their allocators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized

import attrs
import numpy as np
import torch

from backend.allocator import KVAllocator, SlotAllocator
from backend.executor import Executor
from backend.ledger import Ledger
from backend.model import ModelHook
from backend.pool import MambaStatePool, PoolLayout
from compiler.manager import PassManager
from compiler.steps import Pipeline
from ir.batch import DecodeBatch, ExtendBatch, IdleBatch
from ir.columns import I64, as_i64, frozen_i64
from ir.errors import IRValidationError, PreconditionError, SlotError
from ir.ids import TARGET_POOL, MambaSlot, RequestId
from ir.nodes import Plan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom, Intent
from passes.lower import lower
from passes.prepare_for_decode import DecodeContext

Sampler = Callable[[Plan, "torch.Tensor | None", Sequence[tuple[RequestId, int]]], Sequence[int]]
"""``(plan, model_output, [(rid, position)]) -> one token per listed request``."""


def checked_prompt(where: str, prompt: Sequence[int], vocab: int | None = None, max_len: int | None = None) -> I64:
    """The prompt as a read-only int64 column, or ``IRValidationError`` naming ``where`` (``"request
    3"``, ``"checkpoint"``) and the bad token (negative, or ``>= vocab`` when the model's vocabulary
    size is given). With ``max_len``, a longer prompt is refused by its length before any of it is
    read (``range(10**10)`` is not materialised); a prompt without a length (a generator) is refused."""
    if not isinstance(prompt, Sized):
        raise IRValidationError(where, "prompt", prompt, f"must be a sequence of int token ids, not {type(prompt).__name__}")
    if max_len is not None and len(prompt) > max_len:
        raise IRValidationError(where, "prompt", f"<{len(prompt)} tokens>", f"is longer than {max_len} tokens")
    arr = as_i64(prompt)
    if arr.dtype != np.int64 or arr.ndim != 1:
        shown: object = arr[0] if arr.dtype == object and arr.shape == (1,) else prompt
        raise IRValidationError(where, "prompt", shown, "must be a 1-D sequence of int token ids")
    if arr.shape[0] == 0:
        raise IRValidationError(where, "prompt", [], "must hold at least one token")
    if int(arr.min()) < 0:
        raise IRValidationError(where, "prompt", int(arr.min()), "token ids must be >= 0")
    if vocab is not None and int(arr.max()) >= vocab:
        raise IRValidationError(where, "prompt", int(arr.max()), f"token ids must be < the vocabulary size {vocab}")
    return arr


def hash_sampler(plan: Plan, output: torch.Tensor | None, rows: Sequence[tuple[RequestId, int]]) -> list[int]:
    """A deterministic stand-in for sampling when the model hook produces no logits."""
    return [(int(rid) * 1_000_003 + pos * 7919) % 251 + 1 for rid, pos in rows]


@attrs.define(kw_only=True)
class _Request:
    rid: RequestId
    prompt: I64
    max_new_tokens: int
    cow_src: MambaSlot | None
    """The cached-state slot the first chunk copies its prefix state from (``admit``'s ``checkpoint``)."""
    prefix_len: int
    slot: MambaSlot | None = None
    done: int = 0  # prompt tokens already in the state
    kv: list[int] = attrs.Factory(list)
    output: list[int] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class StepResult:
    kind: str
    plan: Plan
    finished: tuple[RequestId, ...]


class Driver:
    def __init__(
        self,
        *,
        layout: PoolLayout,
        capacity: int,
        kv_capacity: int,
        model: ModelHook | None = None,
        sampler: Sampler = hash_sampler,
        chunk_size: int = 64,
        pm: PassManager | None = None,
        device: str = "cpu",
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size!r}")
        self.ledger = Ledger()
        self.pool = MambaStatePool(TARGET_POOL, layout, capacity, device=device)
        self.slots = SlotAllocator(capacity)
        self.kv = KVAllocator(kv_capacity)
        self.pipeline = Pipeline(self.ledger, pm=pm)
        self.executor = Executor(self.pool, self.ledger, model, slots=self.slots)
        self.sampler = sampler
        self.chunk_size = chunk_size
        self.running = DecodeBatch.empty()
        self._reqs: dict[RequestId, _Request] = {}
        self._prefilling: list[RequestId] = []
        self._next: dict[RequestId, int] = {}
        self.outputs: dict[RequestId, list[int]] = {}

    # -- admission and release ------------------------------------------------------------------

    def admit(
        self,
        rid: RequestId,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        checkpoint: MambaSlot | None = None,
        prefix_len: int = 0,
    ) -> None:
        """Queue a request. With ``checkpoint``, the state after ``prefix_len`` prompt tokens is
        copied from that slot (whose owner must keep it alive until the request's first forward)."""
        if rid in self._reqs or rid in self.outputs:
            raise PreconditionError("admit", f"request id {rid} is already in use")
        if max_new_tokens < 1:
            raise PreconditionError("admit", f"request {rid}: max_new_tokens must be >= 1, got {max_new_tokens}")
        arr = checked_prompt(f"request {rid}", prompt)
        if not 0 <= prefix_len < arr.shape[0]:
            raise PreconditionError("admit", f"request {rid}: prefix_len {prefix_len} outside [0, {arr.shape[0]})")
        if (checkpoint is None) != (prefix_len == 0):
            raise PreconditionError("admit", f"request {rid}: a checkpoint goes with a prefix_len > 0 and only then")
        if checkpoint is not None and not self.slots.is_live(checkpoint):
            raise PreconditionError("admit", f"request {rid}: checkpoint slot {checkpoint} is not a live slot")
        self._reqs[rid] = _Request(rid=rid, prompt=arr, max_new_tokens=max_new_tokens, cow_src=checkpoint, prefix_len=prefix_len)
        self._prefilling.append(rid)

    def abort(self, rid: RequestId) -> None:
        if rid not in self._reqs:
            raise PreconditionError("abort", f"request {rid} is not live")
        self._release((rid,))
        self.outputs.setdefault(rid, [])

    def _release(self, rids: Sequence[RequestId]) -> None:
        self.running = self.pipeline.filter_decode(self.running, rids)
        for rid in rids:
            r = self._reqs.pop(rid)
            if r.slot is not None:
                self.slots.free(r.slot)
            self.kv.free_many(r.kv)
            self._next.pop(rid, None)
            if rid in self._prefilling:
                self._prefilling.remove(rid)
            self.outputs[rid] = r.output

    @property
    def live(self) -> int:
        return len(self._reqs)

    # -- one forward ----------------------------------------------------------------------------

    def step(self) -> StepResult:
        if self._prefilling:
            self._reserve()
            admitted = [self._next_chunk(self._reqs[rid]) for rid in self._prefilling]
            if self.running.num_requests:
                mixed, plan_m = self.pipeline.mixed(admitted, self.running, self._decode_ctx())
                out = self.executor.execute(plan_m)
                return self._after_prefill(mixed.extend, mixed.decode, plan_m, out, "mixed")
            extend, plan_e = self.pipeline.prefill(admitted)
            out = self.executor.execute(plan_e)
            return self._after_prefill(extend, self.running, plan_e, out, "extend")
        if self.running.num_requests:
            decode, plan_d = self.pipeline.decode(self.running, self._decode_ctx())
            out = self.executor.execute(plan_d)
            self.running = decode
            rows = list(zip(decode.rid_list(), decode.seq_lens.tolist(), strict=True))
            return self._after_sampling(plan_d, out, rows, "decode")
        plan_i = lower(IdleBatch(), self.pipeline.lower_ctx)
        return StepResult(kind="idle", plan=plan_i, finished=())

    def _reserve(self) -> None:
        """Refuse the step up front (nothing allocated) when its slots or KV locations do not fit."""
        slots = sum(1 for rid in self._prefilling if self._reqs[rid].slot is None)
        kv = sum(self._chunk_len(self._reqs[rid]) for rid in self._prefilling) + self.running.num_requests
        if slots > self.slots.num_free:
            raise SlotError(f"out of slots: this step needs {slots}, {self.slots.num_free} free of {self.slots.capacity}")
        if kv > self.kv.num_free:
            raise SlotError(f"out of KV locations: this step needs {kv}, {self.kv.num_free} free of {self.kv.capacity}")

    def _chunk_len(self, r: _Request) -> int:
        return min(self.chunk_size, int(r.prompt.shape[0]) - r.prefix_len - r.done)

    def _next_chunk(self, r: _Request) -> AdmittedRequest:
        start = r.prefix_len + r.done
        n = self._chunk_len(r)
        first = r.slot is None
        if first:
            r.slot = self.slots.alloc()
        kv = self.kv.alloc_many(n)
        r.kv.extend(int(k) for k in kv)
        intent: Intent
        if not first:
            intent = Continue(prefix_len=start)
        elif r.cow_src is not None:
            intent = CopyFrom(src=r.cow_src, prefix_len=start)
        else:
            intent = Clear()
        assert r.slot is not None
        return AdmittedRequest(
            rid=r.rid,
            slot=r.slot,
            input_ids=r.prompt[start : start + n],
            kv_locs=kv,
            intent=intent,
            more_chunks=start + n < r.prompt.shape[0],
        )

    def _decode_ctx(self) -> DecodeContext:
        rids = self.running.rid_list()
        toks = [self._next[rid] for rid in rids]
        kv = self.kv.alloc_many(len(toks))
        for rid, k in zip(rids, kv.tolist(), strict=True):
            self._reqs[rid].kv.append(k)
        return DecodeContext(next_tokens=frozen_i64(toks), kv_locs=kv)

    def _after_prefill(
        self, extend: ExtendBatch, decode: DecodeBatch, plan: Plan, out: torch.Tensor | None, kind: str
    ) -> StepResult:
        rows: list[tuple[RequestId, int]] = []
        columns = (extend.rid_list(), extend.more_chunks.tolist(), extend.prefix_lens.tolist(), extend.extend_lens.tolist())
        for rid, more, pre, ext in zip(*columns, strict=True):
            self._reqs[rid].done += ext
            if not more:
                self._prefilling.remove(rid)
                rows.append((rid, pre + ext))
        rows += zip(decode.rid_list(), decode.seq_lens.tolist(), strict=True)
        self.running = self.pipeline.merge(decode, extend)
        return self._after_sampling(plan, out, rows, kind)

    def _after_sampling(
        self, plan: Plan, out: torch.Tensor | None, rows: list[tuple[RequestId, int]], kind: str
    ) -> StepResult:
        tokens = self.sampler(plan, out, rows)
        finished: list[RequestId] = []
        for (rid, _), tok in zip(rows, tokens, strict=True):
            r = self._reqs[rid]
            r.output.append(int(tok))
            self._next[rid] = int(tok)
            if len(r.output) >= r.max_new_tokens:
                finished.append(rid)
        if finished:
            self._release(finished)
        return StepResult(kind=kind, plan=plan, finished=tuple(finished))

    def run_until_done(self, max_steps: int = 100_000) -> int:
        steps = 0
        while self._reqs:
            if steps >= max_steps:
                raise RuntimeError(f"{self.live} requests still live after {max_steps} steps")
            self.step()
            steps += 1
        return steps

    def live_slots(self) -> dict[RequestId, MambaSlot]:
        return {rid: r.slot for rid, r in self._reqs.items() if r.slot is not None}

    def kv_of(self, rid: RequestId) -> I64:
        return frozen_i64(self._reqs[rid].kv)

