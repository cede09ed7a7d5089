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

import os
import re
import signal
import time
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import numpy as np
import torch

from backend.allocator import KVAllocator, SlotAllocator
from backend.executor import Executor
from backend.hybrid import ForwardOut, HybridConfig, HybridModel, KVCache, TokenTable, tiny
from backend.hybrid.reference import greedy_generate_reference
from backend.hybrid.weights import perturb
from backend.ledger import Ledger
from backend.model import ModelHook, blank_logits
from backend.pool import MambaLayerSpec, MambaStatePool, PoolLayout
from backend.staging import StagedDecode, StagedExtend, StagedWindow
from compiler.engine import Engine
from compiler.tools.ab import DRAFT_NOISE
from ir import spec
from ir.batch import DecodeBatch, ExtendBatch
from ir.columns import I64, type_names
from ir.ids import TARGET_POOL, MambaSlot, PoolId, RequestId
from ir.init import OP_TYPES, When
from ir.plan import ExtendPlan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom, Intent
from ir.results import Verified
from passes.lower import LowerContext, lower
from passes.prepare_for_extend import prepare_for_extend

if TYPE_CHECKING:  # annotations only: most tests never start an executor process
    from backend.remote import ExecutorProcess

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


def proposed(draft: spec.DraftBatch, tokens: Sequence[int] | I64) -> spec.Proposals:
    """``tokens`` as the ``Proposals`` of ``draft`` (what its draft executor would return): for pass
    tests that choose the proposals instead of running a draft model."""
    return spec.Proposals(k=draft.k, draft_id=draft.draft_id, tokens=tokens)


def verified(verify: spec.VerifyBatch, tokens: Sequence[int] | I64) -> Verified:
    """``tokens`` as the ``Verified`` result of ``verify`` (what its target executor would return:
    ``k + 1`` per row, row-major, named by its verify id and rows): for pass tests that choose the
    target's tokens instead of running a target model."""
    return Verified(k=verify.k, verify_id=verify.verify_id, rids=verify.rids, tokens=tokens)


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

    def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor:
        return blank_logits(extend, decode)

    def propose(self, plan: spec.DraftPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, object]:
        return torch.full((plan.batch.num_requests, plan.batch.k), 7, dtype=torch.int64), ("states of draft", plan.batch.draft_id)

    def verify(self, plan: spec.VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, object]:
        return torch.full((plan.batch.num_requests, plan.batch.k + 1), 7, dtype=torch.int64), ("states of", plan.batch.verify_id)

    def commit(self, plan: spec.CommitPlan | spec.DraftCommitPlan, states: object, pool: MambaStatePool) -> None:
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
    layer_spec = MambaLayerSpec(
        conv_dim=conv_dim,
        kernel_width=kernel_width,
        nheads=nheads,
        head_dim=head_dim,
        d_state=d_state,
        conv_dtype=conv_dtype,
        ssm_dtype=ssm_dtype,
    )
    pool = MambaStatePool(TARGET_POOL, PoolLayout(layers=(layer_spec,) * layers), capacity, device=device)
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


def run_cli(args: list[str]) -> int:
    """``batchc``'s exit status for ``args`` (argparse's refusals exit through ``SystemExit``)."""
    from compiler.cli import main

    try:
        return main(args)
    except SystemExit as exc:
        assert isinstance(exc.code, int)
        return exc.code


def tiny_model(seed: int = 0, arch: str = "bundled") -> HybridModel:
    """The tiny hybrid model on the test device, of one of ``ARCHITECTURES``."""
    return HybridModel.from_seed(ARCHITECTURES[arch](), seed, device=DEVICE)


def _bamba_like() -> HybridConfig:
    """Grouped-query attention with partial rotary; the gated norm over the whole mixer width."""
    return attrs.evolve(tiny(), attn_kv_heads=1, rotary_dim=8, norm_groups=1)


def _granite_like() -> HybridConfig:
    """No position embedding, a softmax scale, tied embeddings, embedding/residual/logit scales."""
    return attrs.evolve(
        tiny(), attn_kv_heads=1, rotary_dim=0, attn_scale=0.2, tie_embeddings=True, embed_scale=0.5,
        residual_scale=4.0, logit_scale=0.25,
    )


def _nemotron_like() -> HybridConfig:
    """One operation per layer, squared-ReLU MLPs, and a dt clamp that binds (random dt_bias puts
    dt in [1e-3, 0.1])."""
    return attrs.evolve(
        tiny(), block="single", layers=("mamba", "mlp", "attn", "mlp", "mamba", "mlp"), mlp_kind="relu2",
        attn_kv_heads=1, rotary_dim=0, norm_groups=4, dt_min=0.01, dt_max=0.05,
    )


ARCHITECTURES: dict[str, Callable[[], HybridConfig]] = {
    "bundled": tiny,
    "bamba-like": _bamba_like,
    "granite-like": _granite_like,
    "nemotron-like": _nemotron_like,
}
"""Tiny configs of the bundled architecture and of each Hugging Face family's switches."""


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


def served_greedy(model: HybridModel, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict[int, list[int]]:
    """Each prompt's greedy tokens as the engine serves them at k = 0 on ``model`` (request ``i + 1``
    is prompt ``i``), all admitted at once, four running."""
    with Engine(model, None, k=0, capacity=4) as eng:
        for i, p in enumerate(prompts):
            eng.admit(RequestId(i + 1), list(p), max_new_tokens=max_new_tokens)
        while eng.live:
            eng.step()
        return {int(r): list(v) for r, v in eng.outputs.items()}


# -- refusal messages ---------------------------------------------------------------------------
# What a refusal names as the accepted op kinds, from the declarations (a new kind changes these
# lists, not the tests that pin the messages around them).
OPS_NAMED = re.escape(type_names(OP_TYPES))
"""``a MambaInit or a MambaSnapshot``, as a pattern."""
BEFORE_NAMED = re.escape(type_names(tuple(c for c in OP_TYPES if c.DECL.when is When.BEFORE)))
AFTER_NAMED = re.escape(type_names(tuple(c for c in OP_TYPES if c.DECL.when is When.AFTER)))


def kill_child(ex: ExecutorProcess, timeout_s: float = 10.0) -> None:
    """SIGKILL an executor process's child and wait until it has ended (``exit_code`` reaps it), so
    the next use of ``ex`` meets a dead process, not a dying one."""
    os.kill(ex.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while ex.exit_code is None:
        assert time.monotonic() < deadline, f"executor process {ex.pid} still running {timeout_s} s after SIGKILL"
        time.sleep(0.01)
