"""``HybridHook``: the reference hybrid model behind the executor's ``SpecModelHook`` protocol.

One hook per model (target or draft) holds that model's KV cache and token table; the executor
hands it the staged plan and the Mamba pool it owns. The hook returns logits: at each row's last
token for forwards, at every window position for the verify; the executor chooses the tokens
(``backend.plan_sampling``: ``NON_FINITE`` at a position whose logits hold a NaN or an infinity)
and keeps the verify's intermediate states until the commit that names them.

The hook reads the model through ``HybridEntryPoints``, the entry points it calls, and never imports
``backend.hybrid.model``: the model builds its own hook (``HybridModel.serving_hook``), so the
dependency runs one way, model to hook, and the two form no import cycle.
"""

from __future__ import annotations

from typing import Protocol, assert_never

import numpy as np
import numpy.typing as npt
import torch

from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.outputs import ForwardOut, VerifyOut, VerifyStates
from backend.model import ForwardPlan
from backend.pool import MambaStatePool
from backend.readback import host_values, staged
from backend.staging import Captures, StagedDecode, StagedExtend, StagedWindow
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from ir.spec import CommitPlan, DraftCommitPlan, DraftExtendPlan, DraftPlan, VerifyPlan

__all__ = ["HybridEntryPoints", "HybridHook"]


class HybridEntryPoints(Protocol):
    """The entry points of ``backend.hybrid.model.HybridModel`` that the hook calls (documented
    there); mypy checks that the model fits where the model builds its hook."""

    def extend(
        self, pool: MambaStatePool, kv: KVCache, table: TokenTable, *, slots: torch.Tensor, cu_seqlens: torch.Tensor,
        prefix_lens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, kv_locs: torch.Tensor,
        captures: Captures | None = None, keep_hidden: bool = False,
    ) -> ForwardOut:
        """``HybridModel.extend``: a prefill chunk of every row, logits at each row's last token."""
        ...

    def decode(
        self, pool: MambaStatePool, kv: KVCache, table: TokenTable, *, slots: torch.Tensor, input_ids: torch.Tensor,
        positions: torch.Tensor, kv_locs: torch.Tensor,
    ) -> ForwardOut:
        """``HybridModel.decode``: one token per row."""
        ...

    def mixed(
        self, pool: MambaStatePool, kv: KVCache, table: TokenTable, *, slots: torch.Tensor, cu_seqlens: torch.Tensor,
        prefix_lens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, kv_locs: torch.Tensor,
        decode_slots: torch.Tensor, decode_ids: torch.Tensor, decode_positions: torch.Tensor, decode_kv_locs: torch.Tensor,
        captures: Captures | None = None, keep_hidden: bool = False,
    ) -> ForwardOut:
        """``HybridModel.mixed``: extend rows and decode rows in one pass over the layers."""
        ...

    def verify(
        self, pool: MambaStatePool, kv: KVCache, table: TokenTable, *, slots: torch.Tensor, input_ids: torch.Tensor,
        positions: torch.Tensor, kv_locs: torch.Tensor,
    ) -> VerifyOut:
        """``HybridModel.verify``: logits and states at every window position, the pool untouched."""
        ...

    def propose_keeping_states(
        self, pool: MambaStatePool, kv: KVCache, table: TokenTable, *, slots: torch.Tensor, input_ids: torch.Tensor,
        positions: torch.Tensor, kv_locs: torch.Tensor, k: int,
    ) -> tuple[torch.Tensor, VerifyStates]:
        """``HybridModel.propose_keeping_states``: ``k`` greedy proposals per row and the per-step states."""
        ...

    def commit(self, pool: MambaStatePool, states: VerifyStates, *, accept_pos: torch.Tensor, slots: torch.Tensor) -> None:
        """``HybridModel.commit``: each row's state at its accepted position, written into the pool."""
        ...


class HybridHook:
    """The hybrid model's serving hook: the model's entry points, its KV cache and its token table,
    behind ``backend.model.ServingModelHook`` (and ``KeepsHidden``, ``CapturesInnerStates``). Built by
    ``HybridModel.serving_hook``; the executor calls it with staged plans and the pool it owns. It
    writes the pool, the KV cache and the token table, never its staged inputs."""

    def __init__(self, model: HybridEntryPoints, kv: KVCache, table: TokenTable) -> None:
        self.model = model
        self.kv = kv
        self.table = table

    def captures_inner_states(self) -> bool:
        """Extend forwards store the states ``StagedExtend.captures`` asks for."""
        return True

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst``'s first ``length`` KV locations become slot ``src``'s (the token table's rows)."""
        self.table.copy_prefix(src, dst, length)

    def _extend(self, s: StagedExtend, pool: MambaStatePool) -> torch.Tensor:
        return self.model.extend(
            pool, self.kv, self.table, slots=s.slots, cu_seqlens=s.cu_seqlens, prefix_lens=s.prefix_lens,
            input_ids=s.input_ids, positions=s.positions, kv_locs=s.kv_locs, captures=s.captures,
        ).logits

    def forward_keeping_hidden(
        self, plan: ExtendPlan | MixedPlan, extend: StagedExtend, decode: StagedDecode | None, pool: MambaStatePool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``, and the hidden state of every extend token (``backend.model.KeepsHidden``)."""
        if decode is None:
            out = self.model.extend(
                pool, self.kv, self.table, slots=extend.slots, cu_seqlens=extend.cu_seqlens, prefix_lens=extend.prefix_lens,
                input_ids=extend.input_ids, positions=extend.positions, kv_locs=extend.kv_locs, captures=extend.captures, keep_hidden=True,
            )
        else:
            out = self._mixed(extend, decode, pool, keep_hidden=True)
        assert out.all_hidden is not None  # (keep_hidden=True)
        return out.logits, out.all_hidden

    def verify_keeping_hidden(self, plan: VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, VerifyStates, torch.Tensor]:
        """``verify``, and the hidden state at every window position ``[n, k + 1, d_model]``."""
        out = self.model.verify(
            pool, self.kv, self.table, slots=staged.slots, input_ids=staged.input_ids, positions=staged.positions, kv_locs=staged.kv_locs,
        )
        return out.logits, out.states, out.hidden

    def _decode(self, s: StagedDecode, pool: MambaStatePool) -> torch.Tensor:
        slots, input_ids, positions, kv_locs, _ = s.fields()  # (StagedDecode's rows, one call)
        return self.model.decode(pool, self.kv, self.table, slots=slots, input_ids=input_ids, positions=positions, kv_locs=kv_locs).logits

    def _mixed(self, e: StagedExtend, d: StagedDecode, pool: MambaStatePool, *, keep_hidden: bool = False) -> ForwardOut:
        """A MIXED forward in one pass over the layers (``HybridModel.mixed``): extend rows first
        (a part without rows: the other part's own entry point)."""
        slots, input_ids, positions, kv_locs, _ = d.fields()
        if e.slots.shape[0] == 0 or slots.shape[0] == 0:
            out = self.model.extend(
                pool, self.kv, self.table, slots=e.slots, cu_seqlens=e.cu_seqlens, prefix_lens=e.prefix_lens, input_ids=e.input_ids,
                positions=e.positions, kv_locs=e.kv_locs, captures=e.captures, keep_hidden=keep_hidden,
            )
            if slots.shape[0] == 0:
                return out
            dec = self.model.decode(pool, self.kv, self.table, slots=slots, input_ids=input_ids, positions=positions, kv_locs=kv_locs)
            return ForwardOut(dec.logits, dec.hidden, out.all_hidden)
        return self.model.mixed(
            pool, self.kv, self.table, slots=e.slots, cu_seqlens=e.cu_seqlens, prefix_lens=e.prefix_lens, input_ids=e.input_ids,
            positions=e.positions, kv_locs=e.kv_locs, decode_slots=slots, decode_ids=input_ids, decode_positions=positions,
            decode_kv_locs=kv_locs, captures=e.captures, keep_hidden=keep_hidden,
        )

    def forward(
        self, plan: ForwardPlan, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool
    ) -> torch.Tensor:
        """Logits ``[n, vocab]`` at each row's last token (extend rows first for a MIXED forward)."""
        match plan:
            case ExtendPlan() | DraftExtendPlan():
                assert extend is not None
                return self._extend(extend, pool)
            case DecodePlan():
                assert decode is not None
                return self._decode(decode, pool)
            case MixedPlan():
                assert extend is not None and decode is not None
                return self._mixed(extend, decode, pool).logits
            case _:
                assert_never(plan)

    def propose(self, plan: DraftPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, VerifyStates]:
        """``k`` greedy proposals per row ``[n, k]`` from the draft window's pending token, and the states
        after each proposal step, kept by the executor for the draft's commit."""
        return self.model.propose_keeping_states(
            pool, self.kv, self.table, slots=staged.slots, input_ids=staged.input_ids,
            positions=_first(staged.positions), kv_locs=staged.kv_locs, k=plan.batch.k,
        )

    def verify(self, plan: VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, VerifyStates]:
        """Logits ``[n, k + 1, vocab]`` at every window position and the states there; the pool is not
        written (the commit writes the accepted position's state)."""
        out = self.model.verify(
            pool, self.kv, self.table, slots=staged.slots, input_ids=staged.input_ids,
            positions=staged.positions, kv_locs=staged.kv_locs,
        )
        # the executor chooses the tokens (``backend.plan_sampling.verify_tokens``): a window position
        # whose logits are not finite reads NON_FINITE there, and the engine ends that row
        return out.logits, out.states

    def commit(self, plan: CommitPlan | DraftCommitPlan, states: VerifyStates, pool: MambaStatePool) -> None:
        """Write each row's state at its ``accept_pos`` (from the states its verify or draft kept) into the
        pool."""
        accept_pos, slots = _column(plan.batch.accept_pos, pool.device), _column(plan.batch.slots, pool.device)
        self.model.commit(pool, states, accept_pos=accept_pos, slots=slots)


def _first(positions: torch.Tensor) -> torch.Tensor:
    """A staged window's first column, ``[n]``, marked with its host values as the window is."""
    return staged(positions[:, 0].contiguous(), host_values(positions)[:, 0].copy())


def _column(values: npt.NDArray[np.int64], device: torch.device) -> torch.Tensor:
    """An IR column as an int64 tensor on ``device``, marked with its host values (``staged``: the
    kernels' checks read them there); on a CUDA device copied from pinned memory without waiting."""
    host = np.array(values, dtype=np.int64)  # (a copy: the IR's columns are read-only)
    t = torch.from_numpy(host)
    if device.type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        t = t.to(device)
    return staged(t, host)
