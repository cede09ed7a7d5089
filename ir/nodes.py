"""The closed unions of every batch and plan type, for dispatch with ``match`` + ``assert_never``.

Adding a phase means adding it here; every ``match`` over these unions then fails mypy's
exhaustiveness check until it handles the new phase.
"""

from __future__ import annotations

from typing import TypeAlias

from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.spec import (
    CommitBatch,
    CommitPlan,
    DraftBatch,
    DraftCommitBatch,
    DraftCommitPlan,
    DraftExtendBatch,
    DraftExtendPlan,
    DraftPlan,
    VerifyBatch,
    VerifyPlan,
)

Batch: TypeAlias = (
    ExtendBatch | DecodeBatch | MixedBatch | IdleBatch | DraftBatch | VerifyBatch | CommitBatch | DraftCommitBatch | DraftExtendBatch
)
Plan: TypeAlias = (
    ExtendPlan | DecodePlan | MixedPlan | IdlePlan | DraftPlan | VerifyPlan | CommitPlan | DraftCommitPlan | DraftExtendPlan
)

NODE_TYPES: tuple[type[Batch | Plan], ...] = (
    ExtendBatch, DecodeBatch, MixedBatch, IdleBatch, DraftBatch, VerifyBatch, CommitBatch, DraftCommitBatch,
    DraftExtendBatch, ExtendPlan, DecodePlan, MixedPlan, IdlePlan, DraftPlan, VerifyPlan, CommitPlan, DraftCommitPlan,
    DraftExtendPlan,
)
"""Every node class, for ``isinstance`` checks on values of unknown type (dumps, error excerpts)."""
