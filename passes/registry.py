"""The passes, declared once: each pass function with its name, the node types it takes and
returns, and whether it ends a step (its output is a plan for the backend, verified at the default
level).

``compiler.manager.PassManager.run`` takes the pass function itself and reads its declaration
here, so a pass is never named twice at a call site; a function that is not declared is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, get_args

import attrs

from ir.batch import DecodeBatch, ExtendBatch, MixedBatch
from ir.errors import PreconditionError
from ir.nodes import Batch, Plan
from ir.request import AdmittedRequest
from ir.spec import AcceptResult, CommitBatch, DraftBatch, DraftCommitBatch, DraftExtendBatch, VerifyBatch
from passes.accept import accept
from passes.commit import commit
from passes.filter_batch import filter_batch
from passes.lower import lower
from passes.merge_batch import merge_batch
from passes.mix_with_running import mix_with_running
from passes.prepare_for_decode import prepare_for_decode
from passes.prepare_for_draft import prepare_for_draft
from passes.prepare_for_draft_commit import prepare_for_draft_commit
from passes.prepare_for_draft_extend import prepare_for_draft_extend
from passes.prepare_for_extend import prepare_for_extend
from passes.prepare_for_verify import prepare_for_verify


@attrs.frozen(kw_only=True)
class PassSpec:
    """One pass: ``fn`` maps a node of one of ``takes`` (its first argument) to one of ``returns``."""

    fn: Callable[..., object]
    name: str
    takes: tuple[type, ...]
    returns: tuple[type, ...]
    ends_step: bool = False


_BATCHES: tuple[type, ...] = get_args(Batch)
_PLANS: tuple[type, ...] = get_args(Plan)

PASSES: Final[tuple[PassSpec, ...]] = (
    PassSpec(fn=prepare_for_extend, name="prepare_for_extend", takes=(AdmittedRequest,), returns=(ExtendBatch,)),
    PassSpec(fn=prepare_for_decode, name="prepare_for_decode", takes=(ExtendBatch, MixedBatch, DecodeBatch), returns=(DecodeBatch,)),
    PassSpec(fn=mix_with_running, name="mix_with_running", takes=(ExtendBatch,), returns=(MixedBatch,)),
    PassSpec(fn=filter_batch, name="filter_batch", takes=(ExtendBatch, DecodeBatch), returns=(ExtendBatch, DecodeBatch)),
    PassSpec(fn=merge_batch, name="merge_batch", takes=(DecodeBatch,), returns=(DecodeBatch,)),
    PassSpec(fn=prepare_for_draft, name="prepare_for_draft", takes=(DecodeBatch,), returns=(DraftBatch,)),
    PassSpec(fn=prepare_for_verify, name="prepare_for_verify", takes=(DraftBatch,), returns=(VerifyBatch,)),
    PassSpec(fn=accept, name="accept", takes=(VerifyBatch,), returns=(AcceptResult,)),
    PassSpec(fn=commit, name="commit", takes=(VerifyBatch,), returns=(CommitBatch,)),
    PassSpec(fn=prepare_for_draft_commit, name="prepare_for_draft_commit", takes=(CommitBatch,), returns=(DraftCommitBatch,)),
    PassSpec(fn=prepare_for_draft_extend, name="prepare_for_draft_extend", takes=(CommitBatch,), returns=(DraftExtendBatch,)),
    PassSpec(fn=lower, name="lower", takes=_BATCHES, returns=_PLANS, ends_step=True),
)
"""Every pass, in lifecycle order."""

REGISTRY: Final[Mapping[Callable[..., object], PassSpec]] = MappingProxyType({p.fn: p for p in PASSES})


def spec_of(fn: object) -> PassSpec:
    """The declaration of pass ``fn``; ``PreconditionError`` for a function that is not a pass."""
    spec = REGISTRY.get(fn) if callable(fn) else None
    if spec is None:
        raise PreconditionError("PassManager.run", f"{fn!r} is not a registered pass (passes.registry.PASSES)")
    return spec
