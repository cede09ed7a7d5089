"""The model hook: the engine's forward, called by the executor after the init ops of a forward.

An engine implements ``ModelHook``; batchc calls ``forward`` once per plan with the staged inputs
and the state pool the executor owns. ``NoOpModel`` does nothing and is what the foundation's
tests and the pipeline benchmark use.
"""

from __future__ import annotations

from typing import Protocol

import torch

from backend.pool import MambaStatePool
from backend.staging import StagedDecode, StagedExtend
from ir.plan import Plan


class ModelHook(Protocol):
    def forward(
        self,
        plan: Plan,
        extend: StagedExtend | None,
        decode: StagedDecode | None,
        pool: MambaStatePool,
    ) -> torch.Tensor | None:
        """Run one forward. ``extend``/``decode`` are the staged parts of the plan (both for MIXED)."""
        ...


class NoOpModel:
    def forward(
        self,
        plan: Plan,
        extend: StagedExtend | None,
        decode: StagedDecode | None,
        pool: MambaStatePool,
    ) -> torch.Tensor | None:
        return None
