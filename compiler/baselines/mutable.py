"""The mutable baseline: a small, faithful model of the pre-fix ``ScheduleBatch`` lifecycle.

This is what batchc replaces, kept so that benchmarks and the A/B demo run both side by side. It
deliberately reproduces the upstream engine's behaviour, bugs included:

- one long-lived ``ScheduleBatch`` holds torch tensors and is mutated in place by
  ``prepare_for_extend``, ``prepare_for_decode``, ``filter_batch`` and ``merge_batch``;
- ``prepare_for_extend`` stores the deferred init ops in three fields, ``mamba_cow_src_indices``,
  ``mamba_cow_dst_indices`` and ``mamba_clear_indices``;
- ``get_model_worker_batch`` copies them, with the other per-forward fields, into a ``ForwardBatch``;
  ``ModelRunner.forward`` executes them before the model when the forward mode runs the Mamba
  prefill path (EXTEND, MIXED, DRAFT_EXTEND; the DECODE path does not read them) and then nulls
  them on the ``ForwardBatch`` only, never on the ``ScheduleBatch``;
- ``filter_batch`` resets them only when it removes a request; ``merge_batch`` never does (the
  running batch keeps its own fields; when nothing is running, the prefill batch itself becomes the
  running batch, fields included);
- ``prepare_for_decode`` does not reset them, and in speculative mode takes an early return into the
  spec path before touching anything else.

So, in speculative mode, every draft-extend forward built from the batch carries the prefill's
stale indices and the draft runner replays them on live state. ``fixed=True`` applies the three
lines of the upstream fix (reset at the top of ``prepare_for_decode``) for comparison.

A ``ModelRunner`` may be given a ``Ledger``: it then routes each execution through a ticket keyed
by the extend that created the indices, and the ledger refuses the first replay.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence

import attrs
import torch

from backend.kernels.init_rows import init_rows
from backend.ledger import Ledger
from backend.pool import MambaStatePool
from ir.ids import PoolId, TicketSerial
from ir.init import InitTicket, MambaInit, Ticket, mint_serial


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"

    def runs_mamba_prefill_path(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND)


@attrs.define(kw_only=True)
class Req:
    rid: int
    slot: int
    prompt: list[int]
    prefix_len: int = 0
    cow_src: int | None = None  # COW source slot when the prefix state is cached
    output_ids: list[int] = attrs.Factory(list)
    finished: bool = False
    decode_batch_idx: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0


_i64 = torch.int64


def _t(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=_i64)


@attrs.define(kw_only=True, eq=False)
class ForwardBatch:
    """The per-forward copy the model runner reads (SGLang: ``ModelWorkerBatch``/``ForwardBatch``)."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    mamba_cow_src_indices: torch.Tensor | None
    mamba_cow_dst_indices: torch.Tensor | None
    mamba_clear_indices: torch.Tensor | None
    init_origin: int | None  # which extend created the indices (for the ledger adapter)


@attrs.define(kw_only=True, eq=False)
class ScheduleBatch:
    reqs: list[Req] = attrs.Factory(list)
    forward_mode: ForwardMode = ForwardMode.IDLE
    spec_enabled: bool = False
    fixed: bool = False
    req_pool_indices: torch.Tensor = attrs.Factory(lambda: _t([]))
    seq_lens: torch.Tensor = attrs.Factory(lambda: _t([]))
    seq_lens_cpu: torch.Tensor = attrs.Factory(lambda: _t([]))
    orig_seq_lens: torch.Tensor = attrs.Factory(lambda: _t([]))
    seq_lens_sum: int = 0
    input_ids: torch.Tensor = attrs.Factory(lambda: _t([]))
    out_cache_loc: torch.Tensor = attrs.Factory(lambda: _t([]))
    extend_lens: torch.Tensor = attrs.Factory(lambda: _t([]))
    prefix_lens: torch.Tensor = attrs.Factory(lambda: _t([]))
    output_ids: torch.Tensor | None = None
    mamba_cow_src_indices: torch.Tensor | None = None
    mamba_cow_dst_indices: torch.Tensor | None = None
    mamba_clear_indices: torch.Tensor | None = None
    init_origin: int | None = None

    _extends = itertools.count(1)

    def prepare_for_extend(self, reqs: list[Req], out_cache_loc: torch.Tensor) -> None:
        self.reqs = reqs
        self.forward_mode = ForwardMode.EXTEND
        ext = [r.prompt[r.prefix_len :] for r in reqs]
        self.input_ids = _t([t for e in ext for t in e])
        self.extend_lens = _t([len(e) for e in ext])
        self.prefix_lens = _t([r.prefix_len for r in reqs])
        self.seq_lens = _t([len(r.prompt) for r in reqs])
        self.seq_lens_cpu = self.seq_lens.clone()
        self.orig_seq_lens = self.seq_lens.clone()
        self.seq_lens_sum = int(self.seq_lens.sum())
        for r in reqs:
            r.kv_committed_len = r.kv_allocated_len = len(r.prompt)
        self.req_pool_indices = _t([r.slot for r in reqs])
        self.out_cache_loc = out_cache_loc
        cow = [(r.cow_src, r.slot) for r in reqs if r.cow_src is not None]
        clear = [r.slot for r in reqs if r.cow_src is None and r.prefix_len == 0]
        self.mamba_cow_src_indices = _t([s for s, _ in cow]) if cow else None
        self.mamba_cow_dst_indices = _t([d for _, d in cow]) if cow else None
        self.mamba_clear_indices = _t(clear) if clear else None
        self.init_origin = next(self._extends) if cow or clear else None

    def prepare_for_decode(self, out_cache_loc: torch.Tensor) -> None:
        self.forward_mode = ForwardMode.DECODE
        if self.fixed:
            self.mamba_cow_src_indices = None
            self.mamba_cow_dst_indices = None
            self.mamba_clear_indices = None
        if self.spec_enabled:
            # Spec decoding owns decode preparation; in the pre-fix engine nothing above ran.
            return
        assert self.output_ids is not None, "prepare_for_decode before any forward produced tokens"
        self.input_ids = self.output_ids
        self.output_ids = None
        self.out_cache_loc = out_cache_loc
        for req in self.reqs:
            req.decode_batch_idx += 1
            req.kv_committed_len += 1
            req.kv_allocated_len += 1
        self.seq_lens.add_(1)
        self.seq_lens_cpu.add_(1)
        self.orig_seq_lens.add_(1)
        self.seq_lens_sum += len(self.reqs)

    def filter_batch(self, keep: Sequence[int]) -> None:
        """Keep the requests at positions ``keep`` (the engine computes them from finished flags)."""
        if len(keep) == len(self.reqs):
            return  # nothing removed: the deferred init fields survive untouched
        idx = _t(keep)
        self.reqs = [self.reqs[i] for i in keep]
        self.req_pool_indices = self.req_pool_indices[idx]
        self.seq_lens = self.seq_lens[idx]
        self.seq_lens_cpu = self.seq_lens_cpu[idx]
        self.orig_seq_lens = self.orig_seq_lens[idx]
        self.seq_lens_sum = int(self.seq_lens.sum())
        if self.output_ids is not None:
            self.output_ids = self.output_ids[idx]
        self.mamba_cow_src_indices = None
        self.mamba_cow_dst_indices = None
        self.mamba_clear_indices = None

    def merge_batch(self, other: ScheduleBatch) -> None:
        """Append ``other``'s requests; like the engine, the deferred init fields are not touched."""
        self.reqs.extend(other.reqs)
        self.req_pool_indices = torch.cat((self.req_pool_indices, other.req_pool_indices))
        self.seq_lens = torch.cat((self.seq_lens, other.seq_lens))
        self.seq_lens_cpu = torch.cat((self.seq_lens_cpu, other.seq_lens_cpu))
        self.orig_seq_lens = torch.cat((self.orig_seq_lens, other.orig_seq_lens))
        self.seq_lens_sum += other.seq_lens_sum
        if self.output_ids is not None and other.output_ids is not None:
            self.output_ids = torch.cat((self.output_ids, other.output_ids))

    def get_model_worker_batch(self, mode: ForwardMode | None = None) -> ForwardBatch:
        mode = mode if mode is not None else self.forward_mode
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            starts = torch.repeat_interleave(self.prefix_lens, self.extend_lens)
            offsets = torch.cumsum(self.extend_lens, 0) - self.extend_lens
            positions = torch.arange(self.input_ids.numel()) - torch.repeat_interleave(offsets, self.extend_lens) + starts
        else:
            positions = self.seq_lens - 1
        return ForwardBatch(
            forward_mode=mode,
            input_ids=self.input_ids,
            positions=positions,
            seq_lens=self.seq_lens,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=self.req_pool_indices,
            mamba_cow_src_indices=self.mamba_cow_src_indices,
            mamba_cow_dst_indices=self.mamba_cow_dst_indices,
            mamba_clear_indices=self.mamba_clear_indices,
            init_origin=self.init_origin,
        )


class ModelRunner:
    """Executes the deferred init ops of a ``ForwardBatch`` on one pool, then (here) no model.

    ``executed`` counts init-op executions (one per forward that ran any); ``replays`` counts those
    that repeated an earlier forward's indices. With a ``ledger``, each execution goes through a
    ticket keyed by the extend that created the indices, so the first replay raises
    ``ResourceReplayError`` instead of running.
    """

    def __init__(self, pool: MambaStatePool, ledger: Ledger | None = None) -> None:
        self.pool = pool
        self.ledger = ledger
        self.executed = 0
        self.replays = 0
        self.clears_executed = 0
        self.cows_executed = 0
        self.stale_ops = 0  # clears and COWs run again by replays, each on a live request's state
        self._seen: set[int] = set()
        self._serials: dict[int, TicketSerial] = {}

    def forward(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.runs_mamba_prefill_path() and (
            fb.mamba_clear_indices is not None or fb.mamba_cow_dst_indices is not None
        ):
            self._run_init(fb)
        fb.mamba_cow_src_indices = None
        fb.mamba_cow_dst_indices = None
        fb.mamba_clear_indices = None

    def _run_init(self, fb: ForwardBatch) -> None:
        empty = _t([])
        clear = fb.mamba_clear_indices if fb.mamba_clear_indices is not None else empty
        src = fb.mamba_cow_src_indices if fb.mamba_cow_src_indices is not None else empty
        dst = fb.mamba_cow_dst_indices if fb.mamba_cow_dst_indices is not None else empty
        origin = fb.init_origin if fb.init_origin is not None else -1
        is_replay = origin in self._seen
        if self.ledger is not None:
            ticket = self._ticket(origin, clear, src, dst)
            if not is_replay:
                self.ledger.register((ticket,))
            with self.ledger.consuming(ticket, self.pool.pool_id):
                init_rows(self.pool.buffer, clear.to(self.pool.device), src.to(self.pool.device), dst.to(self.pool.device))
        else:
            init_rows(self.pool.buffer, clear.to(self.pool.device), src.to(self.pool.device), dst.to(self.pool.device))
        self.executed += 1
        self.replays += int(is_replay)
        self.stale_ops += int(clear.numel() + dst.numel()) if is_replay else 0
        self.clears_executed += int(clear.numel())
        self.cows_executed += int(dst.numel())
        self._seen.add(origin)

    def _ticket(self, origin: int, clear: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> InitTicket:
        if origin not in self._serials:
            self._serials[origin] = mint_serial()
        init = MambaInit(
            serial=self._serials[origin],
            clear_slots=clear.tolist(),
            cow_src=src.tolist(),
            cow_dst=dst.tolist(),
        )
        return Ticket(pool=PoolId(self.pool.pool_id), op=init)
