"""The one module of shared test builders. Nothing here asserts; tests do.

- IR: requests of each init intent (``fresh``, ``cow``, ``cont``, ``request``), decode batches,
  ``extend_plan`` (prepare + lower, tickets registered on a ledger when given).
- Backend worlds: small pool layouts, ``random_fill``, ``make_world`` (a target pool of random
  bytes with its ledger, allocators and executor), ``ToySpecModel`` (a speculative hook whose
  commit marks the pool bytes).
- Kernels: ``make_pool`` (a random pool on the test device, or another), ``randn``, ``index``, ``ssm_inputs``.
- The hybrid model: ``tiny_model``, ``Backend`` (a model's pool, KV cache and token table with
  list-of-ints entry points), ``assert_close`` at float32 tolerance.
- Serving: the tiny target and its default draft (``tiny_models``), ``engine``, the from-scratch
  greedy reference (``greedy_reference``), the review prompts that share a system prefix.

``DEVICE`` is CUDA when there is a GPU (the Triton kernels compile), otherwise the CPU (the torch
references, or the kernels under Triton's interpreter in the kernel tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import attrs
import numpy as np
import torch

from backend.allocator import KVAllocator, SlotAllocator
from backend.executor import Executor
from backend.hybrid import ForwardOut, HybridModel, KVCache, TokenTable, tiny
from backend.hybrid.reference import greedy_generate_reference
from backend.hybrid.weights import perturb
from backend.ledger import Ledger
from backend.model import ModelHook
from backend.pool import MambaLayerSpec, MambaStatePool, PoolLayout
from backend.staging import StagedDecode, StagedExtend, StagedWindow
from compiler.engine import Engine
from compiler.tools.ab import DRAFT_NOISE
from ir.batch import DecodeBatch, ExtendBatch
from ir.ids import TARGET_POOL, MambaSlot, PoolId, RequestId
from ir.plan import ExtendPlan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom, Intent
from ir.spec import CommitPlan, DraftCommitPlan, DraftPlan, VerifyPlan
from passes.lower import LowerContext, lower
from passes.prepare_for_extend import prepare_for_extend

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GOLDEN = TESTS / "golden"
"""The golden dumps: per registered pass under ``passes/``, the built-in scenario's at the top."""

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# -- IR ------------------------------------------------------------------------------------------


def request(
    rid: int,
    slot: int,
    tokens: Sequence[int],
    kv_start: int,
    *,
    intent: Intent | None = None,
    more_chunks: bool = False,
) -> AdmittedRequest:
    """An admitted request feeding ``tokens`` at KV locations ``kv_start, kv_start + 1, ...``
    (a fresh slot unless ``intent`` says otherwise)."""
    return AdmittedRequest(
        rid=RequestId(rid),
        slot=MambaSlot(slot),
        input_ids=np.asarray(tokens, dtype=np.int64),
        kv_locs=np.arange(kv_start, kv_start + len(tokens), dtype=np.int64),
        intent=Clear() if intent is None else intent,
        more_chunks=more_chunks,
    )


def fresh(rid: int, slot: int, tokens: Sequence[int], kv_start: int, *, more: bool = False) -> AdmittedRequest:
    return request(rid, slot, tokens, kv_start, intent=Clear(), more_chunks=more)


def cow(rid: int, slot: int, src: int, prefix: int, tokens: Sequence[int], kv_start: int) -> AdmittedRequest:
    return request(rid, slot, tokens, kv_start, intent=CopyFrom(src=MambaSlot(src), prefix_len=prefix))


def cont(rid: int, slot: int, prefix: int, tokens: Sequence[int], kv_start: int, *, more: bool = False) -> AdmittedRequest:
    return request(rid, slot, tokens, kv_start, intent=Continue(prefix_len=prefix), more_chunks=more)


def decode_batch(
    rids: Sequence[int],
    slots: Sequence[int],
    seq_lens: Sequence[int],
    kv: Sequence[int],
    *,
    tokens: Sequence[int] | None = None,
) -> DecodeBatch:
    """A running batch; every input token is 7 unless ``tokens`` are given."""
    return DecodeBatch(
        rids=np.asarray(rids, dtype=np.int64),
        slots=np.asarray(slots, dtype=np.int64),
        seq_lens=np.asarray(seq_lens, dtype=np.int64),
        input_ids=np.full(len(rids), 7, dtype=np.int64) if tokens is None else np.asarray(tokens, dtype=np.int64),
        kv_locs=np.asarray(kv, dtype=np.int64),
    )


def empty_decode() -> DecodeBatch:
    return DecodeBatch.empty()


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


# -- backend worlds ------------------------------------------------------------------------------

LAYOUT = PoolLayout(layers=(MambaLayerSpec(conv_dim=8, kernel_width=4, nheads=2, head_dim=4, d_state=4),))
"""One float32 layer."""

SMALL_LAYOUT = PoolLayout(
    layers=(
        MambaLayerSpec(conv_dim=6, kernel_width=4, nheads=2, head_dim=3, d_state=4),
        MambaLayerSpec(conv_dim=5, kernel_width=3, nheads=1, head_dim=2, d_state=5, ssm_dtype=torch.float16),
    ),
    align=64,
)
"""Two layers of different shapes and dtypes, aligned rows."""


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
    """``SMALL_LAYOUT`` pool of random bytes; slots ``1..live_slots`` are live."""
    pool = MambaStatePool(pool_id, SMALL_LAYOUT, capacity)
    random_fill(pool, seed)
    ledger = Ledger()
    slots = SlotAllocator(capacity)
    slots.alloc_many(live_slots)
    kv = KVAllocator(kv_capacity)
    return World(pool=pool, ledger=ledger, slots=slots, kv=kv, executor=Executor(pool, ledger, model, slots=slots))


class ToySpecModel:
    """A speculative model hook that proposes token 7, predicts token 7 everywhere, and commits (a
    verify's or a proposal's states) by writing a marker into the committed rows (so a second commit
    would show in the pool bytes)."""

    def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> None:
        return None

    def propose(self, plan: DraftPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, object]:
        return torch.full((plan.batch.num_requests, plan.batch.k), 7, dtype=torch.int64), ("states of draft", plan.batch.draft_id)

    def verify(self, plan: VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, object]:
        return torch.full((plan.batch.num_requests, plan.batch.k + 1), 7, dtype=torch.int64), ("states of", plan.batch.verify_id)

    def commit(self, plan: CommitPlan | DraftCommitPlan, states: object, pool: MambaStatePool) -> None:
        for s in plan.batch.slots.tolist():
            pool.buffer[s].fill_(0x11)


# -- kernels -------------------------------------------------------------------------------------


def make_pool(
    *,
    capacity: int = 6,
    conv_dim: int = 24,
    kernel_width: int = 4,
    nheads: int = 4,
    head_dim: int = 8,
    d_state: int = 16,
    conv_dtype: torch.dtype = torch.float32,
    ssm_dtype: torch.dtype = torch.float32,
    layers: int = 2,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> MambaStatePool:
    """A small pool on ``device`` (the test device) whose every state holds random (finite) values."""
    spec = MambaLayerSpec(
        conv_dim=conv_dim,
        kernel_width=kernel_width,
        nheads=nheads,
        head_dim=head_dim,
        d_state=d_state,
        conv_dtype=conv_dtype,
        ssm_dtype=ssm_dtype,
    )
    pool = MambaStatePool(TARGET_POOL, PoolLayout(layers=(spec,) * layers), capacity, device=device)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        for view in (pool.conv_state(layer), pool.ssm_state(layer)):
            view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
    return pool


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device: torch.device = DEVICE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def index(values: list[int], dtype: torch.dtype = torch.int64, device: torch.device = DEVICE) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


SSM_NHEADS, SSM_HEAD_DIM, SSM_D_STATE = 4, 12, 16
"""The SSM kernel tests' head shape (head_dim 12: not a power of two, exercises the row mask)."""


class SsmInputs(NamedTuple):
    """Per-token inputs of the selective-state kernels."""

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None


def ssm_inputs(
    lead: tuple[int, ...],
    *,
    ngroups: int = 2,
    full: bool = True,
    seed: int = 0,
    nheads: int = SSM_NHEADS,
    head_dim: int = SSM_HEAD_DIM,
    d_state: int = SSM_D_STATE,
    device: torch.device = DEVICE,
) -> SsmInputs:
    """Per-token inputs with leading dims ``lead`` (``(batch,)`` or ``(batch, T)``); ``full`` gives
    ``D``, ``z`` and ``dt_bias``, else they are ``None``."""
    return SsmInputs(
        x=randn(*lead, nheads, head_dim, seed=seed, device=device),
        dt=randn(*lead, nheads, seed=seed + 1, device=device) * 0.5,
        A=-torch.rand(nheads, generator=torch.Generator().manual_seed(seed + 2)).to(device) - 0.1,
        B=randn(*lead, ngroups, d_state, seed=seed + 3, device=device),
        C=randn(*lead, ngroups, d_state, seed=seed + 4, device=device),
        D=randn(nheads, seed=seed + 5, device=device) if full else None,
        z=randn(*lead, nheads, head_dim, seed=seed + 6, device=device) if full else None,
        dt_bias=randn(nheads, seed=seed + 7, device=device) if full else None,
    )


# -- the hybrid model ----------------------------------------------------------------------------

BYTE_PROMPTS = [list(b"The quick brown fox"), list(b"def f(x):\n    return"), list(b"0123456789abcdef0123456")]
"""Three byte-level prompts of different lengths."""

ATOL = RTOL = 2e-5  # float32 end to end: cached/kernel forward vs the cache-free reference


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def tiny_model(seed: int = 0) -> HybridModel:
    """The tiny hybrid model on the test device."""
    return HybridModel.from_seed(tiny(), seed, device=DEVICE)


def ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def grid(rows: list[list[int]]) -> torch.Tensor:
    """An int64 ``[n, T]`` tensor on the test device."""
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


class Backend:
    """One model's backend state: ``capacity`` slots, ``kv_capacity`` KV locations, and a bump
    allocator of KV locations (location 0 is padding)."""

    def __init__(self, model: HybridModel, *, capacity: int = 8, kv_capacity: int = 1024, max_len: int = 96) -> None:
        self.model = model
        self.pool: MambaStatePool = model.new_pool(capacity)
        self.kv: KVCache = model.new_kv_cache(kv_capacity)
        self.table: TokenTable = model.new_token_table(capacity, max_len)
        self._next = 1

    def alloc(self, n: int) -> list[int]:
        locs = list(range(self._next, self._next + n))
        self._next += n
        assert self._next <= self.kv.capacity + 1, "test KV cache too small"
        return locs

    def extend(self, rows: list[tuple[int, list[int], int]]) -> ForwardOut:
        """``rows``: ``(slot, tokens, prefix_len)``; fresh KV locations for every token."""
        cu = [0]
        for _, tokens, _ in rows:
            cu.append(cu[-1] + len(tokens))
        flat = [t for _, tokens, _ in rows for t in tokens]
        positions = [p + j for _, tokens, p in rows for j in range(len(tokens))]
        return self.model.extend(
            self.pool,
            self.kv,
            self.table,
            slots=ids([s for s, _, _ in rows]),
            cu_seqlens=ids(cu),
            prefix_lens=ids([p for _, _, p in rows]),
            input_ids=ids(flat),
            positions=ids(positions),
            kv_locs=ids(self.alloc(len(flat))),
        )

    def decode(self, rows: list[tuple[int, int, int]]) -> ForwardOut:
        """``rows``: ``(slot, token, position)``."""
        return self.model.decode(
            self.pool,
            self.kv,
            self.table,
            slots=ids([s for s, _, _ in rows]),
            input_ids=ids([t for _, t, _ in rows]),
            positions=ids([p for _, _, p in rows]),
            kv_locs=ids(self.alloc(len(rows))),
        )


# -- serving -------------------------------------------------------------------------------------

SYSTEM = list(b"You are a careful reviewer of Python code.\n")  # 43 bytes: block boundaries 16, 32 inside
BODIES = [b"def f(x):", b"import re", b"x = [1, 2]", b"class K:", b"for a in b:"]
REVIEW_PROMPTS = [SYSTEM + list(b) for b in BODIES] + [list(b"print('hello world')")]
"""Five prompts sharing ``SYSTEM`` (a prefix-cache workload) and one that shares nothing."""
REVIEW_NEW = 8
"""New tokens per review prompt."""


@cache
def tiny_models(noise: float = DRAFT_NOISE, seed: int = 1) -> tuple[HybridModel, HybridModel]:
    """The seeded tiny target (CPU, float32) and a draft: the target's weights plus ``noise``
    relative noise (``seed``). The defaults are ``batchc run``'s default draft."""
    target = HybridModel.from_seed(tiny(), seed=0)
    return target, HybridModel(target.config, perturb(target.weights, noise, seed=seed))


def engine(k: int, **options: Any) -> Engine:
    """An ``Engine`` over ``tiny_models()`` (the draft only when ``k > 0``); ``options`` go to the
    constructor unchanged."""
    target, draft = tiny_models()
    return Engine(target, draft if k else None, k=k, **options)


@cache
def _reference(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(greedy_generate_reference(tiny_models()[0], list(prompt), n))


def greedy_reference(prompt: Sequence[int], n: int) -> list[int]:
    """``n`` greedy tokens of the tiny target after ``prompt``, from the from-scratch reference model
    (no pool, KV cache, kernel or scheduler); cached per prompt."""
    return list(_reference(tuple(prompt), n))


def review_greedy() -> dict[RequestId, list[int]]:
    """The reference's output for each of ``REVIEW_PROMPTS`` (request ``i`` is prompt ``i``)."""
    return {RequestId(i): greedy_reference(p, REVIEW_NEW) for i, p in enumerate(REVIEW_PROMPTS)}
