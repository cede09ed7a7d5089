"""The closed unions of every batch and plan type, for dispatch with ``match`` + ``assert_never``.

Adding a phase means adding it here (a speculative one: to ``SpecBatch``/``SpecPlan`` in
``ir.spec``, a draft head's to ``HeadBatch``/``HeadPlan`` in ``ir.head``, which these unions
include); every ``match`` over these unions then fails mypy's
exhaustiveness check until it handles the new phase. ``NODE_TYPES`` is derived from the unions.
"""

from __future__ import annotations

from typing import Final, TypeAlias, get_args

from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.head import HeadBatch, HeadPlan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.spec import SpecBatch, SpecPlan

__all__ = [
    "Batch",
    "Plan",
    "NODE_TYPES",
]

Batch: TypeAlias = ExtendBatch | DecodeBatch | MixedBatch | IdleBatch | SpecBatch | HeadBatch
Plan: TypeAlias = ExtendPlan | DecodePlan | MixedPlan | IdlePlan | SpecPlan | HeadPlan

NODE_TYPES: Final[tuple[type[Batch | Plan], ...]] = (*get_args(Batch), *get_args(Plan))
"""Every node class, for ``isinstance`` checks on values of unknown type (dumps, error excerpts)."""
