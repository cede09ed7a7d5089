"""The engine's own pipeline: batchc's typed steps plus one of its own, composed from its own pass
and batchc's (every pass through the same pass manager, every lowered ticket registered by batchc's
step that lowers it)."""

from __future__ import annotations

from compiler.steps import Pipeline
from ir.batch import DecodeBatch
from ir.ids import RequestId
from ir.plan import DecodePlan
from myengine.passes import cap_running
from passes import DecodeContext

__all__ = ["CappedPipeline"]


class CappedPipeline(Pipeline):
    """``Pipeline`` with a capped decode step: at most ``limit`` requests decode."""

    def capped_decode(self, running: DecodeBatch, ctx: DecodeContext, limit: int) -> tuple[DecodeBatch, DecodePlan, list[RequestId]]:
        """Retract the rows past ``limit`` (``cap_running``), then batchc's decode step on the rest
        (``ctx`` for the rows kept); returns the decode batch, its plan and the retracted ids."""
        kept, retracted = self.pm.run(cap_running, running, limit)
        batch, plan = self.decode(kept, ctx)
        return batch, plan, retracted
