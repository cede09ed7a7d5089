"""What the engine reports: per step (``StepReport``), over a run (``SpecStats``), and the prefix
states it hands out (``PrefixState``)."""

from __future__ import annotations

import enum

import attrs

from ir.ids import MambaSlot, RequestId

__all__ = ["PrefixState", "SpecStats", "StepKind", "StepReport"]


class StepKind(enum.Enum):
    """The forward a step ran."""

    EXTEND = "extend"  # prefill chunks only
    MIXED = "mixed"  # prefill chunks and the running decodes in one forward (k = 0)
    DECODE = "decode"  # one token per running request (k = 0)
    SPEC = "spec"  # draft, verify, commit, draft commit (k > 0)
    RETRACT = "retract"  # no forward: running requests were retracted for KV room
    IDLE = "idle"  # nothing to do
    FAILED = "failed"  # the forward failed after every retry; its requests were aborted


@attrs.frozen(kw_only=True)
class StepReport:
    """One ``Engine.step()``."""

    kind: StepKind
    requests: int
    """Rows the step's forwards advanced (prefill chunks and decoding requests)."""
    prefill_tokens: int
    """Prompt tokens prefilled."""
    tokens: int
    """Tokens emitted (before cutting at max_new_tokens or a stop token)."""
    finished: tuple[RequestId, ...]
    """Requests that finished in this step."""
    aborted: tuple[RequestId, ...]
    """Requests aborted in this step because a forward failed."""
    errored: tuple[RequestId, ...] = ()
    """Requests ended in this step because the logits for their next token were not finite."""
    emitted: tuple[RequestId, ...] = ()
    """Requests that were given at least one token in this step, in the order they got them (the
    first step that names a request is its first token's)."""
    seconds: float
    """Wall time of the step."""


@attrs.frozen(kw_only=True)
class PrefixState:
    """The recurrent state after ``tokens`` in ``slot`` of both pools, and their KV locations."""

    slot: MambaSlot
    tokens: tuple[int, ...]
    kv_locs: tuple[int, ...]


@attrs.define
class SpecStats:
    """Counters over an engine's life (``Engine.stats``): speculative ``iterations`` and
    ``row_iterations`` (one per row per iteration), draft tokens ``proposed`` and ``accepted``,
    forwards that prefilled (``prefills``), decoded (``decodes``) or did both (``mixed``, counted in
    the other two as well), and ``retractions``, ``aborts``, forward ``retries`` and ``failed_steps``."""

    iterations: int = 0
    row_iterations: int = 0
    proposed: int = 0
    accepted: int = 0
    prefills: int = 0
    decodes: int = 0
    mixed: int = 0  # MIXED forwards (counted in prefills and decodes too)
    retractions: int = 0
    aborts: int = 0
    retries: int = 0
    failed_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        """The share of proposed draft tokens the target accepted (0.0 before any was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per row per speculative iteration (accepted drafts + the bonus)."""
        return (self.accepted + self.row_iterations) / self.row_iterations if self.row_iterations else 0.0
