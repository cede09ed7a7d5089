"""The model hook: the engine's forward, called by the executor after the init ops of a forward.

An engine implements ``ModelHook`` (and ``SpecModelHook`` for speculative decoding); batchc calls
it once per plan with the staged inputs and the state pool the executor owns. ``NoOpModel`` does nothing and is what the foundation's
tests and the pipeline benchmark use.
"""

from __future__ import annotations

from typing import Protocol, TypeAlias, runtime_checkable

import torch
from typing_extensions import TypeVar

from backend.pool import MambaStatePool, PoolLayout
from backend.staging import StagedDecode, StagedExtend, StagedWindow
from ir.ids import PoolId
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from ir.spec import CommitPlan, DraftCommitPlan, DraftExtendPlan, DraftPlan, VerifyPlan

__all__ = [
    "CapturesInnerStates", "ForwardPlan", "HeadHook", "KeepsHidden", "ModelHook", "NoOpModel", "ReadsTargetHidden", "ServedModel", "ServingModelHook",
    "SpecModelHook", "VerifyStateT", "blank_logits",
]

ForwardPlan: TypeAlias = ExtendPlan | DecodePlan | MixedPlan | DraftExtendPlan
"""Plans whose forward updates the committed state in place (a draft extend is extend-shaped)."""

VerifyStateT = TypeVar("VerifyStateT", default=object)
"""What a model's proposal or verify keeps for its commit (the per-position states); opaque to
batchc, which hands the commit exactly what the same hook's proposal or verify returned. ``object``
when not given."""


@runtime_checkable
class ModelHook(Protocol):
    """The engine's forward: what an integrator implements so that batchc's executor can run its model.

    The executor owns the state pool and calls ``forward`` once per forward plan (``ExtendPlan``,
    ``DecodePlan``, ``MixedPlan``, ``DraftExtendPlan``), after it has checked the plan, claimed its
    tickets and applied its init ops (each clear or copy-on-write exactly once), and before it applies
    the plan's snapshots. The hook advances each row's recurrent state in ``pool`` in place (row =
    slot) and returns logits; it never applies init ops itself, and it must not write its staged
    inputs nor the plan (an executor that watches reports that, ``MutationError``). The executor
    checks what comes back: anything but a ``[rows, vocab]`` tensor is a ``PlanExecutionError``.
    Sampling is batchc's (``backend.plan_sampling``), from the logits.

    A structural protocol: any object with a matching ``forward`` is a ``ModelHook`` (it is
    ``runtime_checkable``, and the executor checks it once when built). ``SpecModelHook`` adds the
    speculative phases, ``KeepsHidden`` and ``CapturesInnerStates`` optional abilities."""

    def forward(
        self,
        plan: ForwardPlan,
        extend: StagedExtend | None,
        decode: StagedDecode | None,
        pool: MambaStatePool,
    ) -> torch.Tensor:
        """Run one forward and return its logits, ``[rows, vocab]``: one row per sequence of
        ``extend`` (its last position), then one per row of ``decode``. ``extend``/``decode`` are
        the staged parts of the plan (both for MIXED)."""
        ...


@runtime_checkable
class CapturesInnerStates(Protocol):
    """A model hook whose extend forwards honour ``StagedExtend.captures`` (the Mamba state of each
    named row after its first ``at`` tokens goes to the capture pool), or a served model whose
    hooks do: a prefix-cache snapshot can then be taken inside a chunk. The executor refuses such a
    snapshot for a hook that is not one (it would copy a capture row nobody wrote), and the engine
    asks for one only when every model it serves is one."""

    def captures_inner_states(self) -> bool:
        """True when extend forwards fill ``extend.captures`` (a wrapper answers for what it wraps)."""
        ...


@runtime_checkable
class SpecModelHook(ModelHook, Protocol[VerifyStateT]):
    """A model hook that also runs the speculative phases (draft proposal, verify, commit)."""

    def propose(self, plan: DraftPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, VerifyStateT]:
        """Draft proposal: ``k + 1`` greedy steps from the committed state, which stays as it was,
        feeding the pending token and then each proposal. Returns ``([n, k]`` proposed tokens, the
        state after each of the ``k + 1`` steps); the executor keeps the states for the draft commit."""
        ...

    def verify(self, plan: VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, VerifyStateT]:
        """Verify over ``k + 1`` positions: ``([n, k + 1]`` target tokens or logits, intermediate states).
        The committed state stays as it was; the executor keeps the states for the commit."""
        ...

    def commit(self, plan: CommitPlan | DraftCommitPlan, states: VerifyStateT, pool: MambaStatePool) -> None:
        """Scatter each row's state at ``accept_pos`` (of the verify's or the proposal's states)
        into its slot."""
        ...


@runtime_checkable
class ServingModelHook(SpecModelHook[VerifyStateT], Protocol[VerifyStateT]):
    """What a serving engine needs from a model beyond the forwards: prefix sharing. A request that
    starts from a cached prefix state (a COW into its slot) also takes over that prefix's KV
    locations, so the model's per-slot context (which location holds each position) is copied."""

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst``'s first ``length`` context positions become those of slot ``src``."""
        ...


@runtime_checkable
class ServedModel(Protocol[VerifyStateT]):
    """What a serving engine needs from a model: its vocabulary, the layout of its recurrent state,
    a state pool, and a ``ServingModelHook`` bound to fresh per-slot caches (whatever the model keeps
    besides the pool: a KV cache, a token table). ``HybridModel`` is one; a test can serve any other.
    """

    @property
    def vocab(self) -> int:
        """Token ids are ``[0, vocab)``."""
        ...

    def pool_layout(self) -> PoolLayout:
        """The per-slot layout of the recurrent state (what ``new_pool`` allocates)."""
        ...

    def new_pool(self, capacity: int, *, pool_id: PoolId) -> MambaStatePool:
        """A state pool of ``capacity`` slots (plus the padding row)."""
        ...

    def serving_hook(self, *, capacity: int, kv_capacity: int, max_len: int) -> ServingModelHook[VerifyStateT] | HeadHook:
        """A hook with fresh caches for ``capacity`` slots of up to ``max_len`` positions and
        ``kv_capacity`` KV locations (a draft head's is a ``HeadHook``: ``ReadsTargetHidden``)."""
        ...


@runtime_checkable
class HeadHook(CapturesInnerStates, Protocol):
    """A draft head's serving hook (``backend.hybrid.head.DraftHeadHook``): the head reads the
    target's hidden states, so its phases take them beside the staged plan. Its pool (the head
    pool) carries each slot's last target hidden state in the row, so the executor runs the same
    init ops on it as on the target's pool (clear, COW, snapshot) and nothing else.

    - after a target prefill chunk: ``extend(the chunk's StagedExtend, the target's hidden at every
      token of the chunk [total, d_model], head pool)``, with the chunk's captures;
    - proposal: ``propose(the draft window, k, head pool) -> [n, k]`` tokens; the pool is untouched;
    - after a verify: ``extend(the StagedExtend of the window tokens p, d1..dm of each row, the
      verify's hidden at window positions 0..m packed (backend.hybrid.head.pack_accepted), head
      pool)``: the head commit, no init ops.
    """

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst``'s first ``length`` context positions become those of slot ``src``."""
        ...

    def extend(self, staged: StagedExtend, hidden: torch.Tensor, pool: MambaStatePool) -> torch.Tensor:
        """The head over the staged tokens given the target's hidden there; logits ``[n, vocab]`` at
        each sequence's last token."""
        ...

    def propose(self, staged: StagedWindow, k: int, pool: MambaStatePool) -> torch.Tensor:
        """``k`` greedy proposals per row, ``[n, k]``, from the committed head state."""
        ...


@runtime_checkable
class KeepsHidden(Protocol):
    """A target model hook that can also hand back its hidden states (the residual stream after the
    last layer, before the final norm), for a draft head beside it (``backend.hidden_store``)."""

    def forward_keeping_hidden(
        self, plan: ExtendPlan | MixedPlan, extend: StagedExtend, decode: StagedDecode | None, pool: MambaStatePool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits, and the hidden state of every token of ``extend``, packed
        ``[total, d_model]`` like its tokens."""
        ...

    def verify_keeping_hidden(
        self, plan: VerifyPlan, staged: StagedWindow, pool: MambaStatePool
    ) -> tuple[torch.Tensor, object, torch.Tensor]:
        """``verify``'s logits and states, and the hidden state at every window position ``[n, k + 1, d_model]``."""
        ...


@runtime_checkable
class ReadsTargetHidden(Protocol):
    """A served model that is a draft head (``backend.hybrid.head.HeadModel``): its serving hook is a
    ``HeadHook``, and its phases read the target's hidden states, so an engine serving it lowers the
    head's own phases (``ir.head``) instead of running the target's plans on its pool."""

    def reads_target_hidden(self) -> bool:
        """True for a draft head."""
        ...


def blank_logits(extend: StagedExtend | None, decode: StagedDecode | None) -> torch.Tensor:
    """Logits of a model that scores one token, 0, for every row: ``[rows, 1]`` zeros."""
    rows = (int(extend.cu_seqlens.shape[0]) - 1 if extend is not None else 0) + (int(decode.packed.shape[1]) if decode is not None else 0)
    return torch.zeros((rows, 1))


class NoOpModel:
    """Runs no model: every forward's logits are ``blank_logits`` (each row's token is 0). It has no
    speculative phases."""

    def forward(
        self,
        plan: ForwardPlan,
        extend: StagedExtend | None,
        decode: StagedDecode | None,
        pool: MambaStatePool,
    ) -> torch.Tensor:
        """``blank_logits``: one row of a single zero logit per staged row; the pool is not touched."""
        return blank_logits(extend, decode)
