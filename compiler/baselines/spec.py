"""The mutable baseline driven through the speculative flow, on the same models as ``Engine``.

One long-lived ``ScheduleBatch`` per the pre-fix engine (``compiler.baselines.mutable``): every
forward object of an iteration (draft decode, target verify, draft extend) is built from it by
``get_model_worker_batch``; ``prepare_for_decode`` takes the spec early return; the first prefill
batch becomes the running batch, so its deferred init indices ride along until a request finishes.
The target and draft ``ModelRunner``s execute whatever init indices reach a prefill-path forward
(EXTEND, DRAFT_EXTEND) on their own pool before the model runs, so the draft side replays the stale
clears and COWs on live state every iteration, for real, and only the speed suffers: verification
keeps the output equal to greedy.

With ``ledger=`` both runners consume the init ops through tickets and the first replay raises
``ResourceReplayError``.

With a draft head (``backend.hybrid.head.HeadModel``, the upstream setting itself) the draft side is
the head: after each target prefill it extends over the prompt with the target's hidden states;
its proposal runs from its own state; its DRAFT_EXTEND after the verify is the head's catch-up over
the accepted tokens with the verify's hidden states, built from the same long-lived batch, so the
pre-fix baseline replays the stale clears and COWs on the head's live pool there, as the engine
the bug was found in did.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch

from backend.allocator import KVAllocator, SlotAllocator
from backend.hybrid.head import HeadModel, pack_accepted
from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.model import HybridModel, greedy
from backend.ledger import Ledger
from backend.pool import MambaStatePool
from compiler.baselines.mutable import ForwardMode, ModelRunner, Req, ScheduleBatch
from compiler.engine import PrefixState, SpecStats, StepKind, StepReport
from ir.ids import DRAFT_POOL, TARGET_POOL, PoolId, RequestId


class _Side:
    """One model with its pool, KV cache, token table and init-op runner."""

    def __init__(
        self, model: HybridModel | HeadModel, pool_id: PoolId, capacity: int, kv_capacity: int, max_len: int, ledger: Ledger | None,
    ) -> None:
        self.model = model
        self.pool: MambaStatePool = model.new_pool(capacity, pool_id=pool_id)
        self.kv: KVCache = model.new_kv_cache(kv_capacity)
        self.table: TokenTable = model.new_token_table(capacity, max_len)
        self.runner = ModelRunner(self.pool, ledger)


def _i64(values: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device`` (default: the host, where the batch's own columns live)."""
    return torch.tensor(list(values), dtype=torch.int64, device=device)


class MutableSpecEngine:
    def __init__(
        self,
        target: HybridModel,
        draft: HybridModel | HeadModel,
        *,
        k: int,
        capacity: int = 16,
        kv_capacity: int = 4096,
        max_len: int = 512,
        fixed: bool = False,
        ledger: Ledger | None = None,
    ) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k
        self.fixed = fixed
        self.slots = SlotAllocator(capacity)
        self.kvs = KVAllocator(kv_capacity)
        self.target = target
        self.device = target.device  # (the models' device: their inputs go there, the batch's columns stay on the host)
        self.t = _Side(target, TARGET_POOL, capacity, kv_capacity, max_len, ledger)
        self.d = _Side(draft, DRAFT_POOL, capacity, kv_capacity, max_len, ledger)
        self.running: ScheduleBatch | None = None
        self.waiting: list[tuple[Req, int, PrefixState | None]] = []
        self.committed: dict[int, int] = {}  # rid -> committed tokens
        self.kv_of: dict[int, list[int]] = {}
        self.outputs: dict[RequestId, list[int]] = {}
        self.max_new: dict[int, int] = {}
        self.stop: dict[int, frozenset[int]] = {}
        self.stats = SpecStats()
        self._advanced = self._prefilled = self._emitted = 0
        self._finished: list[RequestId] = []
        self._emitted_to: list[RequestId] = []

    def admit(
        self, rid: RequestId, prompt: Sequence[int], *, max_new_tokens: int, prefix: PrefixState | None = None,
        stop: int | Sequence[int] | None = None,
    ) -> None:
        req = Req(rid=rid, slot=0, prompt=list(prompt), prefix_len=len(prefix.tokens) if prefix else 0,
                  cow_src=int(prefix.slot) if prefix else None)
        self.waiting.append((req, max_new_tokens, prefix))
        self.max_new[rid] = max_new_tokens
        self.stop[rid] = frozenset() if stop is None else frozenset([stop] if isinstance(stop, int) else stop)

    def make_prefix(self, tokens: Sequence[int]) -> PrefixState:
        """The same prefix state as ``Engine.make_prefix``, built with plain torch calls."""
        slot = self.slots.alloc()
        kv = self.kvs.alloc_many(len(tokens))
        batch = ScheduleBatch(spec_enabled=True, fixed=self.fixed)
        batch.prepare_for_extend([Req(rid=-1 - int(slot), slot=int(slot), prompt=list(tokens))], torch.from_numpy(kv.copy()))
        hidden = None
        for side in self._sides():
            side.runner.forward(batch.get_model_worker_batch(ForwardMode.EXTEND))  # the clear of the fresh slot
            _, kept = self._extend(side, [int(slot)], [0], [list(tokens)], [kv.tolist()], hidden)
            hidden = kept if side is self.t else hidden
        return PrefixState(slot=slot, tokens=tuple(tokens), kv_locs=tuple(int(x) for x in kv))

    def _sides(self) -> tuple[_Side, ...]:
        """The models a prefill runs on: at ``k == 0`` the target alone (nothing reads the draft)."""
        return (self.t, self.d) if self.k > 0 else (self.t,)

    # -- model calls --------------------------------------------------------------------------

    def _extend(
        self, side: _Side, slots: list[int], prefix: list[int], tokens: list[list[int]], kv: list[list[int]], hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The side's model over the tokens: its logits, and (the target's, with a head beside it)
        every token's hidden state; a head reads ``hidden``, the target's at the same tokens."""
        lens = [len(t) for t in tokens]
        dev = self.device
        cu = _i64([0, *itertools.accumulate(lens)], dev)
        positions = _i64([p + j for p, n in zip(prefix, lens, strict=True) for j in range(n)], dev)
        ids, locs, model = _i64([t for row in tokens for t in row], dev), _i64([x for row in kv for x in row], dev), side.model
        if isinstance(model, HeadModel):
            assert hidden is not None
            return model.extend(side.pool, side.kv, side.table, slots=_i64(slots, dev), cu_seqlens=cu, prefix_lens=_i64(prefix, dev),
                                input_ids=ids, positions=positions, kv_locs=locs, hidden=hidden).logits, None
        out = model.extend(side.pool, side.kv, side.table, slots=_i64(slots, dev), cu_seqlens=cu, prefix_lens=_i64(prefix, dev), input_ids=ids,
                           positions=positions, kv_locs=locs, keep_hidden=self.head)
        return out.logits, out.all_hidden

    @property
    def head(self) -> bool:
        """The draft is a head that reads the target's hidden states."""
        return isinstance(self.d.model, HeadModel)

    # -- the engine loop ----------------------------------------------------------------------

    def step(self) -> StepReport:
        t0 = time.perf_counter()
        self._advanced = self._prefilled = self._emitted = 0
        self._finished = []
        self._emitted_to = []
        if self.waiting:
            self._prefill()
            kind = StepKind.EXTEND
        elif self.running is None or not self.running.reqs:
            kind = StepKind.IDLE
        else:
            self._speculate()
            kind = StepKind.SPEC if self.k else StepKind.DECODE
        return StepReport(
            kind=kind, requests=self._advanced, prefill_tokens=self._prefilled, tokens=self._emitted,
            finished=tuple(self._finished), aborted=(), emitted=tuple(self._emitted_to),
            seconds=time.perf_counter() - t0,
        )

    def _prefill(self) -> None:
        reqs = []
        for req, _, cp in self.waiting:
            req.slot = int(self.slots.alloc())
            kv = self.kvs.alloc_many(len(req.prompt) - req.prefix_len).tolist()
            self.kv_of[req.rid] = kv
            if cp is not None:
                for side in self._sides():
                    side.table.copy_prefix(int(cp.slot), req.slot, req.prefix_len)
            reqs.append(req)
        self.waiting.clear()
        batch = ScheduleBatch(spec_enabled=self.k > 0, fixed=self.fixed)
        batch.prepare_for_extend(reqs, _i64([x for r in reqs for x in self.kv_of[r.rid]]))
        logits = hidden = None
        for side in self._sides():
            fb = batch.get_model_worker_batch(ForwardMode.EXTEND)
            side.runner.forward(fb)  # executes the deferred clears/COWs, then nulls fb's copies only
            out, kept = self._extend(
                side, [r.slot for r in reqs], [r.prefix_len for r in reqs], [r.prompt[r.prefix_len :] for r in reqs],
                [self.kv_of[r.rid] for r in reqs], hidden,
            )
            logits, hidden = (out, kept) if side is self.t else (logits, hidden)
        assert logits is not None
        first = greedy(logits).tolist()
        for r, tok in zip(reqs, first, strict=True):
            self.outputs[RequestId(r.rid)] = [int(tok)]
            self.committed[r.rid] = len(r.prompt)
        self._emitted_to.extend(RequestId(r.rid) for r in reqs)
        self._advanced += len(reqs)
        self._prefilled += sum(len(r.prompt) - r.prefix_len for r in reqs)
        self._emitted += len(reqs)
        batch.output_ids = _i64(first)
        self.stats.prefills += 1
        if self.running is None or not self.running.reqs:
            self.running = batch  # the prefill batch becomes the running batch, fields and all
        else:
            self.running.merge_batch(batch)
        self._finish()

    def _decode(self) -> None:
        """``k == 0``: the plain decode path of the same long-lived batch."""
        rb = self.running
        assert rb is not None
        reqs = list(rb.reqs)
        kv = self.kvs.alloc_many(len(reqs))
        rb.prepare_for_decode(torch.from_numpy(kv.copy()))
        fb = rb.get_model_worker_batch()
        self.t.runner.forward(fb)
        assert isinstance(self.t.model, HybridModel)
        dev = self.device
        out = self.t.model.decode(
            self.t.pool, self.t.kv, self.t.table, slots=fb.req_pool_indices.to(dev), input_ids=fb.input_ids.to(dev),
            positions=fb.positions.to(dev), kv_locs=fb.out_cache_loc.to(dev),
        )
        toks = greedy(out.logits).tolist()  # (the step's one readback)
        tokens = _i64(toks)
        for i, r in enumerate(reqs):
            self.kv_of[r.rid].append(int(kv[i]))
            self.committed[r.rid] += 1
            self.outputs[RequestId(r.rid)].append(toks[i])
        self._emitted_to.extend(RequestId(r.rid) for r in reqs)
        self._advanced += len(reqs)
        self._emitted += len(reqs)
        rb.output_ids = tokens
        self.stats.decodes += 1
        self._finish()

    def _speculate(self) -> None:
        if self.k == 0:
            self._decode()
            return
        rb = self.running
        assert rb is not None
        k, reqs = self.k, list(rb.reqs)
        rb.prepare_for_decode(_i64([]))  # spec mode: early return, the deferred init fields stay
        pending = [self.outputs[RequestId(r.rid)][-1] for r in reqs]
        slots = [r.slot for r in reqs]
        c = [self.committed[r.rid] for r in reqs]
        window = self.kvs.alloc_many(len(reqs) * (k + 1)).reshape(len(reqs), k + 1)
        dev = self.device
        positions = _i64(c, dev)[:, None] + torch.arange(k + 1, device=dev)[None, :]
        wt = torch.from_numpy(window.copy()).to(dev)
        # draft decode (proposal): a DECODE-path forward of the draft runner
        self.d.runner.forward(rb.get_model_worker_batch(ForwardMode.DECODE))
        proposals = self.d.model.propose(
            self.d.pool, self.d.kv, self.d.table, slots=_i64(slots, dev), input_ids=_i64(pending, dev),
            positions=positions[:, 0].contiguous(), kv_locs=wt[:, :k].contiguous(), k=k,
        )
        # target verify (the upstream fix of the earlier variant keeps init ops out of it)
        self.t.runner.forward(rb.get_model_worker_batch(ForwardMode.TARGET_VERIFY))
        ids = torch.cat((_i64(pending, dev)[:, None], proposals), dim=1)
        assert isinstance(self.t.model, HybridModel)
        out = self.t.model.verify(self.t.pool, self.t.kv, self.t.table, slots=_i64(slots, dev), input_ids=ids, positions=positions, kv_locs=wt)
        predicted = greedy(out.logits)
        matches = (proposals == predicted[:, :k]).to(torch.int64)
        accepted = matches.cumprod(dim=1).sum(dim=1)
        bonus = predicted[torch.arange(len(reqs), device=dev), accepted]
        self.t.model.commit(self.t.pool, out.states, accept_pos=accepted, slots=_i64(slots, dev))
        # draft extend over the accepted tokens: built from the same long-lived batch (a head's reads
        # the verify's hidden states at those positions)
        self.d.runner.forward(rb.get_model_worker_batch(ForwardMode.DRAFT_EXTEND))
        acc = accepted.tolist()
        ids_host, proposed_host, bonus_host = ids.tolist(), proposals.tolist(), bonus.tolist()  # (read back once each, not per row)
        self._extend(
            self.d, slots, c, [ids_host[i][: acc[i] + 1] for i in range(len(reqs))],
            [window[i, : acc[i] + 1].tolist() for i in range(len(reqs))], pack_accepted(out.hidden, accepted + 1) if self.head else None,
        )
        for i, r in enumerate(reqs):
            m = acc[i]
            self.kvs.free_many(window[i, m + 1 :].tolist())
            self.kv_of[r.rid].extend(window[i, : m + 1].tolist())
            self.committed[r.rid] += m + 1
            self.outputs[RequestId(r.rid)].extend(proposed_host[i][:m] + [bonus_host[i]])
            self._emitted += m + 1
        self._emitted_to.extend(RequestId(r.rid) for r in reqs)
        self._advanced += len(reqs)
        self.stats.iterations += 1
        self.stats.row_iterations += len(reqs)
        self.stats.proposed += k * len(reqs)
        self.stats.accepted += sum(acc)
        rb.output_ids = _i64(bonus_host)
        self._finish()

    def _finish(self) -> None:
        rb = self.running
        if rb is None:
            return
        keep = [i for i, r in enumerate(rb.reqs) if not self._done(r.rid)]
        done = [r for i, r in enumerate(rb.reqs) if i not in keep]
        for r in done:
            rid = RequestId(r.rid)
            self.slots.free(r.slot)
            self.kvs.free_many(self.kv_of.pop(r.rid))
            out = self.outputs[rid][: self.max_new[r.rid]]
            stop = self.stop[r.rid]
            if not stop.isdisjoint(out):
                out = out[: next(i for i, t in enumerate(out) if t in stop) + 1]
            self.outputs[rid] = out
            self._finished.append(rid)
        rb.filter_batch(keep)

    def _done(self, rid: int) -> bool:
        out, stop = self.outputs[RequestId(rid)], self.stop[rid]
        return len(out) >= self.max_new[rid] or not stop.isdisjoint(out)

    def run_until_done(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.waiting and (self.running is None or not self.running.reqs):
                return
            self.step()
        raise RuntimeError(f"baseline still running after {max_steps} steps")

    @property
    def live(self) -> int:
        return len(self.waiting) + (len(self.running.reqs) if self.running is not None else 0)

    @property
    def replays(self) -> int:
        return self.t.runner.replays + self.d.runner.replays

    def release_prefix(self, cp: PrefixState) -> None:
        self.slots.free(cp.slot)
        self.kvs.free_many(cp.kv_locs)
