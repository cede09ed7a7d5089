"""``HybridHook``: the reference hybrid model behind the executor's ``SpecModelHook`` protocol.

One hook per model (target or draft) holds that model's KV cache and token table; the executor
hands it the staged plan and the Mamba pool it owns. Outputs are greedy: the hook returns logits for
forwards (the engine samples) and argmax tokens for the verify (``NON_FINITE`` at a position whose
logits hold a NaN or an infinity: ``backend.sampling``), whose intermediate states the executor
keeps until the commit that names them.
"""

from __future__ import annotations

from typing import assert_never

import torch

from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.model import HybridModel, VerifyStates
from backend.model import ForwardPlan
from backend.pool import MambaStatePool
from backend.sampling import greedy_or_flag
from backend.staging import StagedDecode, StagedExtend, StagedWindow
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from ir.spec import CommitPlan, DraftCommitPlan, DraftExtendPlan, DraftPlan, VerifyPlan


class HybridHook:
    def __init__(self, model: HybridModel, kv: KVCache, table: TokenTable) -> None:
        self.model = model
        self.kv = kv
        self.table = table

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst``'s first ``length`` KV locations become slot ``src``'s (the token table's rows)."""
        self.table.copy_prefix(src, dst, length)

    def _extend(self, s: StagedExtend, pool: MambaStatePool) -> torch.Tensor:
        return self.model.extend(
            pool, self.kv, self.table, slots=s.slots, cu_seqlens=s.cu_seqlens, prefix_lens=s.prefix_lens,
            input_ids=s.input_ids, positions=s.positions, kv_locs=s.kv_locs,
        ).logits

    def _decode(self, s: StagedDecode, pool: MambaStatePool) -> torch.Tensor:
        return self.model.decode(
            pool, self.kv, self.table, slots=s.slots, input_ids=s.input_ids, positions=s.positions, kv_locs=s.kv_locs
        ).logits

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
                return torch.cat((self._extend(extend, pool), self._decode(decode, pool)))
            case _:
                assert_never(plan)

    def propose(self, plan: DraftPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, VerifyStates]:
        return self.model.propose_keeping_states(
            pool, self.kv, self.table, slots=staged.slots, input_ids=staged.input_ids,
            positions=staged.positions[:, 0].contiguous(), kv_locs=staged.kv_locs, k=plan.batch.k,
        )

    def verify(self, plan: VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, VerifyStates]:
        out = self.model.verify(
            pool, self.kv, self.table, slots=staged.slots, input_ids=staged.input_ids,
            positions=staged.positions, kv_locs=staged.kv_locs,
        )
        # a window position whose logits are not finite reads NON_FINITE: the engine ends that row
        # there (or, past its bonus position, never reads it)
        return greedy_or_flag(out.logits), out.states

    def commit(self, plan: CommitPlan | DraftCommitPlan, states: VerifyStates, pool: MambaStatePool) -> None:
        dev = pool.device
        self.model.commit(
            pool, states,
            accept_pos=torch.from_numpy(plan.batch.accept_pos.copy()).to(dev),
            slots=torch.from_numpy(plan.batch.slots.copy()).to(dev),
        )
