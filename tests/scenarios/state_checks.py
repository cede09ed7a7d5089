"""What the scenario tests (``tests/scenarios/test_*.py``) check after each replayed upstream bug,
shared so that every scenario ends the same way.

- Mamba state rows: ``state_rows`` (every layer's conv and SSM state of one slot, cloned) and
  ``scratch_states`` (the same rows after a from-scratch prefill of the tokens: a fresh pool,
  slot 1 cleared, one chunk, one request). ``assert_states_match`` compares them, exactly
  (``torch.equal``) or within ``STATE_ATOL``/``STATE_RTOL``, and first checks that the expected
  state is far from zero (a comparison that a cleared row could pass proves nothing);
  ``distance`` measures how far apart two states are.
- ``Recorder``: wraps an executor's ``execute`` to keep every plan it ran with the pool's bytes
  before and after it, and the state rows of each request whose prefill completed (in the order
  the executor ran them).
- ``reference_outputs``: the reference run of one prompt (a fresh ``Engine`` at ``k = 0``, no
  prefix cache, the request alone, greedy, float32), cached per model, prompt and length.
- ``MODELS``: the models a scenario that compares tokens runs on, by name: ``"tiny"`` (the tiny
  target and its default draft, ``tests.helpers.tiny_models``) and ``"state-sensitive"``
  (``sensitive_models``: ``compiler.testing.models.state_sensitive`` of the tiny target, and a draft
  made from it as the tiny draft is). On the tiny target a wrong Mamba state at a cached prefix
  mostly leaves the tokens as they were (attention reads the whole context, the Mamba layers
  forget within a few tokens: ``tests/testing/test_models.py``), so a token comparison there proves
  little about states; on the sensitive one it does, and ``assert_tokens_need_state`` shows it for
  the scenario's own prompt (a state zeroed at the copy point would change its tokens).
- ``assert_accounted``: every ticket consumed or its cancellation recorded, every pool's live +
  free slots equal to its capacity (the state slots and the KV locations).
- ``stale_fill``: what a slot's previous owner left, in every row (finite values).
- ``TinyWorld``: the IR-level rig of a scenario: the tiny target's pool, serving hook, slot
  allocator and executor, one ledger and a ``Pipeline`` verifying after every pass.

Why a tolerance for states: a prefill in several chunks (or batched beside other rows) sums the
same float32 terms in another order than one chunk alone (the SSD scan's chunk boundaries, the
conv window's split, batched matmuls), which moves the last bits; a wrong init (a stale clear, a
copy from the wrong row, a missing clear) moves the state by the size of the state itself (the
checks below require it to be far larger than the tolerance).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import attrs
import torch

from backend.allocator import SlotAllocator
from backend.executor import Executor
from backend.hybrid import HybridModel
from backend.hybrid.head import HeadModel
from backend.hybrid.reference import reference_hidden
from backend.hybrid.weights import perturb
from backend.ledger import Ledger
from backend.model import ServingModelHook
from backend.pool import MambaStatePool
from compiler.engine import Engine
from compiler.manager import PassManager
from compiler.steps import Pipeline
from compiler.testing.models import greedy_continuation, state_sensitive
from compiler.tools.ab import DRAFT_NOISE
from ir.head import HeadExtendPlan
from ir.ids import TARGET_POOL, PoolId, RequestId
from ir.nodes import Plan
from ir.plan import ExtendPlan, MixedPlan
from ir.results import Result
from passes import LowerContext
from tests.helpers import Backend, random_fill, tiny_models

__all__ = [
    "MODELS",
    "STATE_ATOL",
    "STATE_RTOL",
    "Ran",
    "Recorder",
    "TinyWorld",
    "assert_accounted",
    "assert_states_match",
    "assert_tokens_need_state",
    "distance",
    "reference_outputs",
    "scratch_states",
    "sensitive_models",
    "stale_fill",
    "state_rows",
]

STATE_ATOL = 1e-5
STATE_RTOL = 1e-5
"""Float32 reordering noise (module docstring): measured below 1e-6 on the tiny model's states, whose
entries are of order 0.01 to 1; a wrong init moves them by 1e-2 or more."""


def state_rows(pool: MambaStatePool, slot: int) -> list[torch.Tensor]:
    """Every Mamba layer's conv state, then SSM state, of ``slot``, cloned (float32 on the tiny models)."""
    rows: list[torch.Tensor] = []
    for layer in range(len(pool.layout.layers)):
        rows.append(pool.conv_state(layer)[slot].clone())
        rows.append(pool.ssm_state(layer)[slot].clone())
    return rows


@cache
def _scratch(tokens: tuple[int, ...], model: HybridModel) -> tuple[torch.Tensor, ...]:
    b = Backend(model, capacity=1, kv_capacity=len(tokens) + 1, max_len=max(len(tokens), 8))
    b.extend([(1, list(tokens), 0)])
    return tuple(state_rows(b.pool, 1))


def scratch_states(tokens: Sequence[int], *, draft: bool = False, model: HybridModel | None = None) -> list[torch.Tensor]:
    """The state rows after a from-scratch prefill of ``tokens`` on the tiny target (the default
    draft with ``draft``; ``model`` when given): a fresh pool whose slot 1 starts at zero, the
    tokens in one chunk, the request alone."""
    chosen = model if model is not None else tiny_models()[1 if draft else 0]
    return [t.clone() for t in _scratch(tuple(int(t) for t in tokens), chosen)]


def scratch_head_states(tokens: Sequence[int], head: HeadModel) -> list[torch.Tensor]:
    """The draft head's state rows after a from-scratch extend over ``tokens``: a fresh head pool
    whose slot 1 starts at zero, the tokens in one chunk, the request alone, paired with the
    target's hidden states of the same tokens from the cache-free reference
    (``backend.hybrid.reference.reference_hidden``)."""
    ids = [int(t) for t in tokens]
    n = len(ids)
    hidden = reference_hidden(head.target, ids).to(head.dtype)
    pool = head.new_pool(1)
    hook = head.serving_hook(capacity=1, kv_capacity=n + 1, max_len=max(n, 8))

    def t(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int64, device=head.device)

    head.extend(pool, hook.kv, hook.table, slots=t([1]), cu_seqlens=t([0, n]), prefix_lens=t([0]), input_ids=t(ids),
                positions=t(list(range(n))), kv_locs=t(list(range(1, n + 1))), hidden=hidden)
    return state_rows(pool, 1)


def _flat(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([r.reshape(-1).to(torch.float64) for r in rows])


def assert_states_match(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], what: str, *, exact: bool = False) -> None:
    """``actual`` equals ``expected`` (``exact``: bit for bit; else within ``STATE_ATOL``/``STATE_RTOL``),
    and ``expected`` is a state worth comparing: far from zero (a cleared row would not pass)."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} state tensors, expected {len(expected)}"
    scale = float(_flat(expected).abs().max())
    assert scale > 1000 * STATE_ATOL, f"{what}: the expected state is (nearly) zero, max |x| = {scale}: the comparison would prove nothing"
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        kind = ("conv", "ssm")[i % 2]
        same = torch.equal(a, e) if exact else torch.allclose(a, e, atol=STATE_ATOL, rtol=STATE_RTOL)
        if not same:
            how = "bit for bit" if exact else f"within atol={STATE_ATOL}, rtol={STATE_RTOL}"
            raise AssertionError(f"{what}: layer {i // 2} {kind} state differs ({how}): max |diff| = {float((a - e).abs().max())}")


def distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The largest absolute difference between two states (for asserting that two states differ
    by far more than the tolerance)."""
    return float((_flat(a) - _flat(b)).abs().max())


@attrs.define
class Ran:
    """One plan an executor ran: the plan, the pool's bytes before and after it."""

    plan: Plan
    before: torch.Tensor
    after: torch.Tensor

    def changed_rows(self) -> set[int]:
        """The pool rows whose bytes the plan changed (padding row 0 included)."""
        diff = (self.before != self.after).reshape(self.before.shape[0], -1).any(dim=1)
        return {int(i) for i in torch.nonzero(diff).reshape(-1).tolist()}


class Recorder:
    """Keeps what an executor runs: ``ran`` (each plan with the pool's bytes before and after it,
    refused plans not included) and ``prefilled`` (per request, the state rows of its slot right
    after the forward that completed its prompt). ``on_ran`` (optional) is called after each plan."""

    def __init__(self, executor: Executor[Any], on_ran: Callable[[Ran], None] | None = None) -> None:
        self.executor = executor
        self.ran: list[Ran] = []
        self.prefilled: dict[RequestId, list[torch.Tensor]] = {}
        self.on_ran = on_ran
        inner = executor.execute

        def execute(plan: Plan) -> Result:
            before = executor.pool.buffer.clone()
            out = inner(plan)
            ran = Ran(plan=plan, before=before, after=executor.pool.buffer.clone())
            self.ran.append(ran)
            self._keep_prefilled(plan)
            if self.on_ran is not None:
                self.on_ran(ran)
            return out

        executor.execute = execute  # type: ignore[method-assign]  # (the engine's submit calls self.execute)

    def _keep_prefilled(self, plan: Plan) -> None:
        if isinstance(plan, HeadExtendPlan):  # (no more_chunks: the last head extend of a request is after its last chunk)
            for rid, slot in zip(plan.rids.tolist(), plan.slots.tolist(), strict=True):
                self.prefilled[RequestId(rid)] = state_rows(self.executor.pool, slot)
            return
        ext = plan if isinstance(plan, ExtendPlan) else plan.extend if isinstance(plan, MixedPlan) else None
        if ext is None:
            return
        for rid, slot, more in zip(ext.rids.tolist(), ext.slots.tolist(), ext.more_chunks.tolist(), strict=True):
            if not more:
                self.prefilled[RequestId(rid)] = state_rows(self.executor.pool, slot)

    def extend_plans(self) -> list[ExtendPlan]:
        """The extend plans (a mixed plan's extend part) it ran, in order."""
        out: list[ExtendPlan] = []
        for r in self.ran:
            if isinstance(r.plan, ExtendPlan):
                out.append(r.plan)
            elif isinstance(r.plan, MixedPlan):
                out.append(r.plan.extend)
        return out


@cache
def sensitive_models() -> tuple[HybridModel, HybridModel]:
    """``state_sensitive`` of the tiny target (seed 0), and a draft made from it as ``tiny_models``
    makes the tiny draft (``DRAFT_NOISE`` relative noise, seed 1)."""
    target = state_sensitive(tiny_models()[0])
    return target, HybridModel(target.config, perturb(target.weights, DRAFT_NOISE, seed=1))


MODELS: dict[str, Callable[[], tuple[HybridModel, HybridModel]]] = {"tiny": tiny_models, "state-sensitive": sensitive_models}
"""The (target, draft) pairs a token-comparing scenario runs on, by name (the module docstring)."""


@cache
def _reference(prompt: tuple[int, ...], n: int, model: HybridModel) -> tuple[int, ...]:
    with Engine(model, None, k=0) as e:
        e.admit(RequestId(0), list(prompt), max_new_tokens=n)
        e.run_until_done()
        e.ledger.assert_drained()
        return tuple(e.outputs[RequestId(0)])


def reference_outputs(prompt: Sequence[int], n: int, model: HybridModel | None = None) -> list[int]:
    """The ``n`` tokens the reference run gives after ``prompt``: a fresh engine at ``k = 0`` without
    a prefix cache, the request alone, greedy, float32, on ``model`` (default the tiny target;
    cached per model, prompt and ``n``)."""
    return list(_reference(tuple(int(t) for t in prompt), n, model if model is not None else tiny_models()[0]))


def assert_tokens_need_state(prompt: Sequence[int], at: int, n: int, model: HybridModel) -> None:
    """The ``n`` reference tokens after ``prompt`` on ``model`` change when the request's Mamba state
    is zeroed after its first ``at`` tokens (``greedy_continuation``): a run that lost or replaced
    the state there would fail the scenario's token comparison."""
    zeroed = greedy_continuation(model, list(prompt), n, zero_state_at=at)
    assert zeroed != reference_outputs(prompt, n, model), (
        f"a state zeroed at token {at} of {bytes(prompt)!r} gives the same {n} tokens: the token comparison proves nothing about states")


def assert_accounted(e: Engine) -> None:
    """The engine's books after a scenario: every ticket consumed (or cancelled, recorded with its
    reason), every slot and KV location either live or free, and every request ended."""
    e.ledger.assert_drained()
    assert e.slots.num_live + e.slots.num_free == e.slots.capacity
    assert e.kv.num_live + e.kv.num_free == e.kv.capacity
    assert e.live == 0


def stale_fill(pool: MambaStatePool, seed: int = 0) -> None:
    """Every row, padding row included, holds what a previous owner could have left: random bytes,
    then every state value random in [-1, 1) (finite: a forward that wrongly read them gives wrong
    states, not NaNs). An executor watching the pool must adopt its contents after this."""
    random_fill(pool, seed)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(len(pool.layout.layers)):
        for view in (pool.conv_state(layer), pool.ssm_state(layer)):
            view.copy_((torch.rand(view.shape, generator=gen) * 2 - 1).to(view.dtype))


class TinyWorld:
    """One pool of the tiny target (``model`` in its place when given; ``capacity`` slots) with its
    serving hook, a slot allocator holding every slot live (a plan may name any), an executor bound
    to both, one ledger and a pipeline that verifies after every pass. ``stale`` fills every row
    with random bytes first (a slot's previous owner), so a missing clear shows. KV locations come
    from ``kv(n)`` (a bump allocator, location 0 never handed out)."""

    def __init__(self, capacity: int = 6, *, pool_id: str = TARGET_POOL, stale: bool = True, which: int = 0,
                 model: HybridModel | None = None) -> None:
        self.model = tiny_models()[which] if model is None else model
        self.ledger = Ledger()
        self.pool = self.model.new_pool(capacity, pool_id=PoolId(pool_id))
        if stale:
            stale_fill(self.pool, seed=capacity)
        hook = self.model.serving_hook(capacity=capacity, kv_capacity=512, max_len=128)
        assert isinstance(hook, ServingModelHook)
        self.hook = hook
        self.slots = SlotAllocator(capacity)
        self.slots.alloc_many(capacity)
        self.executor: Executor[Any] = Executor(self.pool, self.ledger, hook, slots=self.slots)
        self.pipeline = Pipeline(self.ledger, LowerContext(pools=(PoolId(pool_id),)), PassManager(verify_level=2))
        self._kv = 1

    def kv(self, n: int) -> int:
        """The first of ``n`` fresh KV locations (consecutive)."""
        start = self._kv
        self._kv += n
        assert self._kv <= 512, "the world's KV cache is too small"
        return start

    def release_all(self) -> None:
        """Free every slot (the end of the scenario) and check the allocator's books."""
        self.slots.free_many(sorted(self.slots.live()))
        assert self.slots.num_live == 0 and self.slots.num_free == self.slots.capacity
