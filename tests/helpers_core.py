"""Shared builders for the core tests: a tiny pool layout, a backend "world", and plan builders.

Nothing here asserts; tests do.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from backend.allocator import KVAllocator, SlotAllocator
from backend.executor import Executor
from backend.ledger import Ledger
from backend.model import ModelHook
from backend.pool import MambaLayerSpec, MambaStatePool, PoolLayout
from ir.batch import DecodeBatch, ExtendBatch
from ir.ids import TARGET_POOL, MambaSlot, PoolId, RequestId
from ir.plan import ExtendPlan
from ir.request import AdmittedRequest, Clear, Intent
from passes.lower import LowerContext, lower
from passes.prepare_for_extend import prepare_for_extend

SMALL_LAYOUT = PoolLayout(
    layers=(
        MambaLayerSpec(conv_dim=6, kernel_width=4, nheads=2, head_dim=3, d_state=4),
        MambaLayerSpec(conv_dim=5, kernel_width=3, nheads=1, head_dim=2, d_state=5, ssm_dtype=torch.float16),
    ),
    align=64,
)


def random_fill(pool: MambaStatePool, seed: int = 0) -> None:
    """Fill every row (padding row included) with seeded random bytes, so a stray clear or copy shows."""
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, tuple(pool.buffer.shape), generator=gen, dtype=torch.uint8))


@attrs.define
class World:
    """One backend: a target pool, its ledger, slot/KV allocators and an executor bound to them."""

    pool: MambaStatePool
    ledger: Ledger
    slots: SlotAllocator
    kv: KVAllocator
    executor: Executor

    def state(self) -> tuple[torch.Tensor, tuple[object, ...], int, int, frozenset[int], int, frozenset[int]]:
        """Everything bad input must leave untouched: pool bytes, ledger, both allocators."""
        return (
            self.pool.buffer.clone(),
            self.ledger.outstanding(),
            self.ledger.num_consumed,
            self.slots.num_free,
            self.slots.live(),
            self.kv.num_free,
            self.kv.live(),
        )


def make_world(
    *,
    capacity: int = 4,
    live_slots: int = 3,
    kv_capacity: int = 64,
    pool_id: PoolId = TARGET_POOL,
    model: ModelHook | None = None,
    seed: int = 0,
) -> World:
    pool = MambaStatePool(pool_id, SMALL_LAYOUT, capacity)
    random_fill(pool, seed)
    ledger = Ledger()
    slots = SlotAllocator(capacity)
    slots.alloc_many(live_slots)  # slots 1..live_slots are live
    kv = KVAllocator(kv_capacity)
    return World(pool=pool, ledger=ledger, slots=slots, kv=kv, executor=Executor(pool, ledger, model, slots=slots))


def request(
    rid: int,
    slot: int,
    tokens: Sequence[int],
    kv_start: int,
    *,
    intent: Intent | None = None,
    more_chunks: bool = False,
) -> AdmittedRequest:
    return AdmittedRequest(
        rid=RequestId(rid),
        slot=MambaSlot(slot),
        input_ids=np.asarray(tokens, dtype=np.int64),
        kv_locs=np.arange(kv_start, kv_start + len(tokens), dtype=np.int64),
        intent=Clear() if intent is None else intent,
        more_chunks=more_chunks,
    )


def extend_plan(
    reqs: Sequence[AdmittedRequest],
    *,
    pools: tuple[PoolId, ...] = (TARGET_POOL,),
    ledger: Ledger | None = None,
) -> tuple[ExtendBatch, ExtendPlan]:
    """``prepare_for_extend`` + ``lower``; registers the tickets when a ledger is given."""
    batch = prepare_for_extend(reqs)
    plan = lower(batch, LowerContext(pools=pools))
    if ledger is not None:
        ledger.register(plan.tickets)
    return batch, plan


def decode_batch(rids: Sequence[int], slots: Sequence[int], seq_lens: Sequence[int], kv: Sequence[int]) -> DecodeBatch:
    return DecodeBatch(
        rids=np.asarray(rids, dtype=np.int64),
        slots=np.asarray(slots, dtype=np.int64),
        seq_lens=np.asarray(seq_lens, dtype=np.int64),
        input_ids=np.full(len(rids), 7, dtype=np.int64),
        kv_locs=np.asarray(kv, dtype=np.int64),
    )
