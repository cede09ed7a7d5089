"""What ``batchc run`` reports: ``ServeSummary`` (``to_json`` is the ``--json`` file)."""

from __future__ import annotations

from typing import Any

import attrs

from ir.ids import RequestId

__all__ = ["MutableRun", "Sample", "ServeSummary", "host_ms_per_step"]


@attrs.frozen(kw_only=True)
class Sample:
    """The end of a prompt and its completion (bytes decoded with replacement)."""

    rid: RequestId
    prompt: str
    completion: str


def host_ms_per_step(wall_s: float, model_s: float, steps: int) -> float:
    """Exposed host time per step in milliseconds: wall time minus the time inside the models'
    forwards, divided by the steps (0 for a run of no steps)."""
    return (wall_s - model_s) / steps * 1e3 if steps else 0.0


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
    steps: int
    model_s: float
    """Seconds inside the models' forwards."""
    host_ms_per_step: float
    """(``wall_s`` - ``model_s``) / ``steps``, in milliseconds."""


_OPTIONAL = frozenset({
    "draft_clears_minted_consumed", "draft_cows_minted_consumed", "draft_snapshots_minted_consumed", "lossless_check",
    "lossless_ok", "mutable_baseline", "mutable_baseline_fixed", "model_s", "host_ms_per_step", "host_busy_ms_per_step",
    "host_hidden_fraction", "tp_ledgers", "tp_lossless_ledgers_ok", "tp_message_ms_per_step", "tp_agree_ms_per_step",
})


@attrs.frozen(kw_only=True)
class ServeSummary:
    """What ``batchc run`` reports; ``to_json`` is what ``--json`` writes (the same field names,
    optional parts left out when they did not run)."""

    requests: int
    refused_requests: int = 0
    """Requests refused on their own and not served (``Request.refused``: they do not fit the context)."""
    prompt_tokens: int
    """Prompt tokens of the served requests."""
    generated_tokens: int
    k: int
    max_len: int
    """Context length (``ServeConfig.max_len``, ``--max-len``)."""
    steps: int
    steps_by_kind: str
    wall_s: float
    tokens_per_s: float
    model_s: float | None = None
    """Seconds inside the models' forwards during the served run (when ``run`` was given a model clock)."""
    host_ms_per_step: float | None = None
    """(``wall_s`` - ``model_s``) / ``steps``, in milliseconds (with ``model_s``): the host time the
    forwards did not hide."""
    overlap: bool = False
    """Whether the executors ran in their own processes (``ServeConfig.overlap``)."""
    host_busy_ms_per_step: float | None = None
    """With ``overlap``: the scheduler's own time per step (wall minus the time it waited on the
    executor processes), in milliseconds."""
    host_hidden_fraction: float | None = None
    """With ``overlap``: the part of the scheduler's own time during which a forward ran, 1 -
    ``host_ms_per_step`` / ``host_busy_ms_per_step`` (at least 0)."""
    acceptance_rate: float
    mean_accepted_length: float
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prefix_cache_evictions: int
    retractions: int
    aborted_requests: int
    """Requests aborted because a forward carrying them failed."""
    errored_requests: int = 0
    """Requests ended because the logits for their next token were not finite (NaN or infinity)."""
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
    tp: int = 1
    """Tensor-parallel ranks."""
    tp_ledgers: dict[str, object] | None = None
    """With ``tp > 1``: every rank's ledger counts per pool at the end of the served run, and whether
    they are equal across ranks and drained (``backend.tp.RankLedgers.to_json``)."""
    tp_lossless_ledgers_ok: bool | None = None
    """With ``tp > 1`` and a lossless check: whether the check's own session ended with every rank's
    ledger drained and the same ops consumed."""
    tp_message_ms_per_step: float | None = None
    """With ``tp > 1``: rank 0's time broadcasting plan messages (and requests), per step."""
    tp_agree_ms_per_step: float | None = None
    """With ``tp > 1``: rank 0's time in the ranks' two agreements per plan, per step."""
    outputs: dict[RequestId, tuple[int, ...]] = attrs.Factory(dict)
    """Every request's generated ids (``--outputs``; not in ``to_json``)."""
    logprobs: dict[RequestId, list[dict[str, Any]]] = attrs.Factory(dict)
    """The logprobs of each request that asked for them, an entry per output id (``Engine.logprobs``;
    ``--outputs``; not in ``to_json``)."""
    aborted: tuple[RequestId, ...] = ()
    """Requests aborted by failed forwards (their outputs are cut short; not in ``to_json``)."""
    errored: tuple[RequestId, ...] = ()
    """Requests ended by non-finite logits (their outputs stop before that token; not in ``to_json``)."""

    @property
    def tokens_per_s_vs_mutable_fixed(self) -> float | None:
        """Compiled tokens/s over the fixed mutable baseline's on the same workload (when it ran)."""
        fixed = self.mutable_baseline_fixed
        if fixed is None:
            return None
        return self.tokens_per_s / fixed.tokens_per_s if fixed.tokens_per_s else 0.0

    def to_json(self) -> dict[str, object]:
        """The summary as ``--json`` writes it: every field but the per-request ones (``outputs``,
        ``logprobs``, ``aborted``, ``errored``), optional parts left out when they did not run, and
        ``tokens_per_s_vs_mutable_fixed`` when the fixed baseline ran."""
        out = {k: v for k, v in attrs.asdict(self).items() if not (k in _OPTIONAL and v is None) and k not in ("outputs", "logprobs", "aborted", "errored")}
        ratio = self.tokens_per_s_vs_mutable_fixed
        if ratio is not None:
            out["tokens_per_s_vs_mutable_fixed"] = ratio
        return out


