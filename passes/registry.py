"""The passes, declared once: each pass function with its name and whether it ends a step (its
output is a plan for the backend, verified at the default level). The node types a pass takes and
returns are its signature's, which mypy checks at every call through the pass manager; the
declaration does not repeat them.

``compiler.manager.PassManager.run`` takes the pass function itself and reads its declaration
here, so a pass is never named twice at a call site; a function that is not declared is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

import attrs

from ir.errors import PreconditionError
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
from passes.prepare_for_head_commit import prepare_for_head_commit
from passes.prepare_for_head_extend import prepare_for_head_extend
from passes.prepare_for_verify import prepare_for_verify

__all__ = [
    "PassSpec",
    "PASSES",
    "REGISTRY",
    "spec_of",
]


@attrs.frozen(kw_only=True)
class PassSpec:
    """One pass: ``fn`` under ``name`` in dumps, errors and timings; ``ends_step``: its output is a
    plan for the backend (``compiler.manager.PassManager`` reads both)."""

    fn: Callable[..., object]
    name: str
    ends_step: bool = False


PASSES: Final[tuple[PassSpec, ...]] = (
    PassSpec(fn=prepare_for_extend, name="prepare_for_extend"),
    PassSpec(fn=prepare_for_decode, name="prepare_for_decode"),
    PassSpec(fn=mix_with_running, name="mix_with_running"),
    PassSpec(fn=filter_batch, name="filter_batch"),
    PassSpec(fn=merge_batch, name="merge_batch"),
    PassSpec(fn=prepare_for_draft, name="prepare_for_draft"),
    PassSpec(fn=prepare_for_verify, name="prepare_for_verify"),
    PassSpec(fn=accept, name="accept"),
    PassSpec(fn=commit, name="commit"),
    PassSpec(fn=prepare_for_draft_commit, name="prepare_for_draft_commit"),
    PassSpec(fn=prepare_for_draft_extend, name="prepare_for_draft_extend"),
    PassSpec(fn=prepare_for_head_extend, name="prepare_for_head_extend"),
    PassSpec(fn=prepare_for_head_commit, name="prepare_for_head_commit"),
    PassSpec(fn=lower, name="lower", ends_step=True),
)
"""Every pass, in lifecycle order."""

REGISTRY: Final[Mapping[Callable[..., object], PassSpec]] = MappingProxyType({p.fn: p for p in PASSES})


def spec_of(fn: object) -> PassSpec:
    """The declaration of pass ``fn``; ``PreconditionError`` for a function that is not a pass."""
    spec = REGISTRY.get(fn) if callable(fn) else None
    if spec is None:
        raise PreconditionError("PassManager.run", f"{fn!r} is not a registered pass (passes.registry.PASSES)")
    return spec
