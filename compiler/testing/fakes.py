"""A fake model and small backends, so that a test can execute the plans its passes produce.

- ``FakeModel``: a ``backend.model.SpecModelHook`` that runs no model and touches no state. Its
  logits are deterministic: every position predicts ``next_token(t) = (3 * t + 1) % vocab`` after
  token ``t`` (a one-hot row); its draft proposes ``draft_token(t)``, which is ``next_token(t)``
  except where that is a multiple of 4 (then the token after it), so a speculative iteration
  accepts some drafts and rejects others, the same way on every run.
- ``small_pool``: a one-layer Mamba state pool of a few bytes per slot.
- ``FakeBackend``: one ``backend.executor.Executor`` per pool over a ``small_pool``, all sharing one
  ledger and one ``FakeModel``; ``execute(plan)`` runs a plan where an engine would (a prefill or a
  decode on every pool, a draft phase on the last pool, a verify or commit on the first).

This module imports torch (the executors stage their plans as tensors); the strategies do not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from backend.executor import Executor
from backend.hybrid.config import MAX_VOCAB as HYBRID_MAX_VOCAB
from backend.ledger import Ledger
from backend.model import ForwardPlan
from backend.pool import MAX_POOL_SLOTS, MambaLayerSpec, MambaStatePool, PoolLayout
from backend.staging import StagedDecode, StagedExtend, StagedWindow
from ir.errors import short_repr
from ir.head import HeadCommitPlan, HeadExtendPlan
from ir.ids import PoolId
from ir.linear import consumes
from ir.nodes import Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.results import Result
from ir.spec import CommitPlan, DraftCommitPlan, DraftExtendPlan, DraftPlan, VerifyPlan

__all__ = ["MAX_CAPACITY", "MAX_VOCAB", "SMALL_LAYOUT", "FakeBackend", "FakeModel", "small_pool"]

SMALL_LAYOUT = PoolLayout(layers=(MambaLayerSpec(conv_dim=4, kernel_width=2, nheads=1, head_dim=2, d_state=2),), align=16)
"""One float32 Mamba layer of a few dozen bytes per slot."""


MAX_VOCAB: Final = HYBRID_MAX_VOCAB
"""The largest ``vocab`` a ``FakeModel`` takes (a model's bound, ``backend.hybrid.config.MAX_VOCAB``)."""
MAX_CAPACITY: Final = MAX_POOL_SLOTS
"""The most slots a ``small_pool`` (and a ``FakeBackend``'s pools) takes (``backend.pool.MAX_POOL_SLOTS``)."""


def _int(fn: str, name: str, value: object, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int, got {short_repr(value)} ({type(value).__name__})")
    if not minimum <= value <= maximum:
        raise ValueError(f"{fn}: {name} must be in [{minimum}, {maximum}], got {value}")
    return value


class FakeModel:
    """A speculative model hook with deterministic logits over ``vocab`` tokens and no state (see
    the module docstring). It never writes the pool: an executor's mutation detector stays quiet."""

    def __init__(self, vocab: int = 16) -> None:
        """``vocab``: an int in ``[2, MAX_VOCAB]`` (``TypeError``/``ValueError`` naming it otherwise)."""
        self.vocab = _int("FakeModel", "vocab", vocab, 2, MAX_VOCAB)

    def next_token(self, token: int) -> int:
        """The token every forward predicts after ``token`` (the argmax of its logits)."""
        return (3 * token + 1) % self.vocab

    def draft_token(self, token: int) -> int:
        """The token the draft proposes after ``token``: ``next_token``, unless that is a multiple of 4."""
        t = self.next_token(token)
        return t if t % 4 else (t + 1) % self.vocab

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """One-hot logits ``[*tokens.shape, vocab]`` of ``next_token`` of each token."""
        return torch.nn.functional.one_hot((3 * tokens.to(torch.int64) + 1) % self.vocab, self.vocab).to(torch.float32)

    def forward(self, plan: ForwardPlan, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor:
        """Logits ``[rows, vocab]`` after each extend sequence's last token, then each decode row's token."""
        last = []
        if extend is not None:
            last.append(extend.input_ids[extend.cu_seqlens[1:] - 1])
        if decode is not None:
            last.append(decode.input_ids)
        return self._logits(torch.cat(last) if last else torch.zeros(0, dtype=torch.int64))

    def propose(self, plan: DraftPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, None]:
        """``k`` proposals per row, each ``draft_token`` of the one before (the pending token first)."""
        out = torch.zeros((plan.batch.num_requests, plan.batch.k), dtype=torch.int64)
        for i, pending in enumerate(staged.input_ids.tolist()):
            t = int(pending)
            for j in range(plan.batch.k):
                t = self.draft_token(t)
                out[i, j] = t
        return out, None

    def verify(self, plan: VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, None]:
        """Logits ``[n, k + 1, vocab]``: ``next_token`` after each window token."""
        return self._logits(staged.input_ids.reshape(plan.batch.num_requests, plan.batch.k + 1)), None

    def commit(self, plan: CommitPlan | DraftCommitPlan, states: None, pool: MambaStatePool) -> None:
        """Nothing to commit: the fake keeps no state."""


def small_pool(pool_id: str = "target", capacity: int = 8) -> MambaStatePool:
    """A ``SMALL_LAYOUT`` pool of slots ``1..capacity`` (plus the padding slot) on the CPU, zeroed."""
    return MambaStatePool(PoolId(pool_id), SMALL_LAYOUT, _int("small_pool", "capacity", capacity, 1, MAX_CAPACITY))


class FakeBackend:
    """One executor per pool (``pools``, the first the target's, the last the draft's) over a
    ``small_pool`` of ``capacity`` slots, sharing ``ledger`` (a fresh one by default) and ``model``
    (a ``FakeModel()`` by default). Lower plans for the same pools (``LowerContext(pools=...)``)."""

    def __init__(self, ledger: Ledger | None = None, *, pools: Sequence[str] = ("target",), capacity: int = 8, model: FakeModel | None = None) -> None:
        """``pools``: one or more distinct pool names; ``capacity`` in ``[1, MAX_CAPACITY]`` (one-line errors naming them)."""
        arg: object = pools  # typed; checked because callers need not be typed
        if isinstance(arg, str) or not isinstance(arg, Sequence) or not arg or not all(isinstance(p, str) and p for p in arg):
            raise TypeError(f"FakeBackend: pools must be a sequence of pool names (non-empty str), got {short_repr(arg)}")
        if len(set(pools)) != len(pools):
            raise ValueError(f"FakeBackend: pools must be distinct, got {short_repr(pools)}")
        _int("FakeBackend", "capacity", capacity, 1, MAX_CAPACITY)
        self.ledger = ledger if ledger is not None else Ledger()
        self.model = model if model is not None else FakeModel()
        self.executors: dict[PoolId, Executor[None]] = {
            PoolId(p): Executor(small_pool(p, capacity), self.ledger, self.model) for p in pools
        }

    @property
    def target(self) -> Executor[None]:
        """The first pool's executor: verifies and commits run there."""
        return next(iter(self.executors.values()))

    @property
    def draft(self) -> Executor[None]:
        """The last pool's executor (the target's when there is one pool): draft phases run there."""
        return list(self.executors.values())[-1]

    def _route(self, plan: Plan) -> list[Executor[None]]:
        match plan:
            case ExtendPlan() | MixedPlan() | DecodePlan():
                return list(self.executors.values())
            case DraftPlan() | DraftCommitPlan() | DraftExtendPlan():
                return [self.draft]
            case VerifyPlan() | CommitPlan() | IdlePlan():
                return [self.target]
            case HeadExtendPlan() | HeadCommitPlan():
                raise ValueError(f"FakeBackend.execute: a {type(plan).__name__} needs a draft head's executor, and this backend runs none")
            case _:
                raise TypeError(f"FakeBackend.execute: plan must be a Plan, got {short_repr(plan)} ({type(plan).__name__})")

    @consumes
    def execute(self, plan: Plan) -> Result:
        """Run ``plan`` where an engine would (see the class docstring); the target's result (for a
        draft phase, the draft pool's)."""
        first: Result | None = None
        for ex in self._route(plan):
            out = ex.execute(plan)
            if first is None:
                first = out
        assert first is not None  # (every route names an executor)
        return first
