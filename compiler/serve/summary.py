"""What ``batchc run`` reports: ``ServeSummary`` (``to_json`` is the ``--json`` file)."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class Sample:
    """The end of a prompt and its completion (bytes decoded with replacement)."""

    rid: int
    prompt: str
    completion: str


@attrs.frozen(kw_only=True)
class MutableRun:
    """The same workload through the mutable baseline (``compiler.tools.compare_mutable``)."""

    acceptance_rate: float
    mean_accepted_length: float
    init_ops_target: int
    init_ops_draft: int
    replays: int
    stale_ops_run: int
    wall_s: float
    tokens_per_s: float


_OPTIONAL = frozenset({
    "draft_clears_minted_consumed", "draft_cows_minted_consumed", "draft_snapshots_minted_consumed", "lossless_check",
    "lossless_ok", "mutable_baseline", "mutable_baseline_fixed",
})


@attrs.frozen(kw_only=True)
class ServeSummary:
    """What ``batchc run`` reports; ``to_json`` is what ``--json`` writes (the same field names,
    optional parts left out when they did not run)."""

    requests: int
    prompt_tokens: int
    generated_tokens: int
    k: int
    steps: int
    steps_by_kind: str
    wall_s: float
    tokens_per_s: float
    acceptance_rate: float
    mean_accepted_length: float
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prefix_cache_evictions: int
    retractions: int
    aborted_requests: int
    """Requests aborted because a forward carrying them failed."""
    failed_forwards: int
    first_failure: str | None
    target_clears_minted_consumed: str
    target_cows_minted_consumed: str
    target_snapshots_minted_consumed: str
    draft_clears_minted_consumed: str | None
    draft_cows_minted_consumed: str | None
    draft_snapshots_minted_consumed: str | None
    replays_blocked: int
    outstanding_tickets: int
    slots_live_after: int
    kv_live_after: int
    pass_us_per_step: dict[str, tuple[int, float]]
    """Pass name -> (calls, microseconds per call)."""
    samples: tuple[Sample, ...]
    lossless_check: str | None = None
    lossless_ok: bool | None = None
    mutable_baseline: MutableRun | None = None
    mutable_baseline_fixed: MutableRun | None = None

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in attrs.asdict(self).items() if not (k in _OPTIONAL and v is None)}


