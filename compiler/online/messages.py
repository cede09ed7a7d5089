"""The typed messages between ``batchc serve``'s HTTP process and its engine process.

The HTTP side sends ``Launch`` once, then ``Submit``, ``Abort``, ``Finish`` and finally ``Shutdown``; the
engine side answers ``Ready`` (or ``StartFailed``) once, then one ``StepOut`` per engine step that
had something to say (new tokens, ended requests) or per idle tick (its ``Stats`` only), and
``Closed`` as its last word. Each message is an attrs frozen value; they travel pickled over one
``multiprocessing.connection.Connection`` between these two processes of one server, never across
a network.

A request of ``n`` completions (``SamplingParams.n``) is submitted once under its id ``rid``
(completion 0) with ``n - 1`` fork ids (completions 1 to n - 1, ``Engine.admit``'s ``forks``);
from then on each completion is a request of its own in these messages: its ``Delta`` and
``Ended`` carry its own id, and ``Finish`` names it. ``Abort`` names the request (``rid``) and
ends all of its completions.

Invariants: every id (a request's and its forks') is submitted once and is distinct from every other;
the engine sends exactly one ``Ended`` per completion id (finished, aborted, refused or failed),
after every ``Delta`` of it; the ids of a ``Delta`` and of an ``Ended`` are the completion's new
output tokens, in order, never repeated, and their ``logprobs`` (for a request that asked for them:
``SamplingParams.logprobs``; else ``None``) hold one entry per one of those ids, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

import attrs

from compiler.offline.budget import DEFAULT_MEMORY_FRACTION
from ir.sampling import SamplingParams

__all__ = [
    "END_REASONS", "Abort", "Closed", "Crashed", "Delta", "EndReason", "Ended", "Finish", "FromEngine", "Launch", "Ready", "Shutdown", "StartFailed",
    "Stats", "StepOut", "Submit", "ToEngine", "TokenLogprob",
]

EndReason = Literal["stop", "length", "abort", "refused", "error", "failed"]
"""How a request ended in the engine: ``stop`` (an end-of-sequence or stop token id, or the HTTP
side's ``Finish`` at a stop string), ``length``
(``max_new_tokens``), ``abort`` (the HTTP side's ``Abort``), ``refused`` (``Engine.admit`` refused
it), ``error`` (non-finite logits), ``failed`` (a forward carrying it failed)."""

END_REASONS: Final = ("stop", "length", "abort", "refused", "error", "failed")
"""Every ``EndReason``, in that order."""


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)  # (a list when the launch came as JSON)


@attrs.frozen(kw_only=True)
class Launch:
    """The engine process's options (``batchc serve``'s model options)."""

    model: str | None
    draft: str | None
    k: int | None
    dtype: str
    max_running: int
    max_len: int | None
    overlap: bool
    threads: int
    chunk_size: int
    token_budget: int
    cache_entries: int
    seed: int = 0
    """The engine's seed (``Engine(seed=)``): a sampled request without a seed gets
    ``ir.sampling.derive_seed(seed, its rid)``."""
    tp: int = 1
    """Tensor-parallel ranks: the engine process is rank 0 and starts the others (``--tp``)."""
    tp_timeout: int = 60
    """Seconds a rank waits on the others in any step (``--tp-timeout``; its default is ``batchc
    run``'s, ``compiler.offline.distributed.TP_TIMEOUT_S``)."""
    sized: tuple[str, ...] = attrs.field(default=(), converter=_names)
    """The options of ``SIZED_OPTIONS`` (``compiler.offline.budget``) the user did not give: their
    values here are the defaults, lowered to fit the memory budget if need be (``fit_serving``)."""
    device: str = "cpu"
    """Where the engine serves and whose memory sizes it (``--device``: ``cpu``, ``cuda`` or ``cuda:N``)."""
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    """The share of the memory available that the engine may use (``--memory-fraction``)."""
    memory_available: int | None = None
    """The bytes available, read once by the HTTP process before it started any engine process
    (``compiler.offline.budget.available_memory``); ``None``: the engine process reads it itself."""
    replicas: int = 1
    """Engine processes sharing that memory equally (``--dp``), each with its own models."""


@attrs.frozen(kw_only=True)
class Ready:
    """The engine is built: what the HTTP side needs to tokenise and check requests."""

    name: str
    vocab: int
    eos: tuple[int, ...]
    max_len: int
    k: int
    reserve: int
    """Context positions a request keeps free after its prompt and new tokens (k + 1)."""
    hf_dir: str | None
    """The Hugging Face checkpoint directory (its tokenizer and chat template), or ``None`` (bytes)."""
    pid: int
    sizes: str = ""
    """The engine's sizes and memory in words (running requests, prefill tokens, cache entries, the
    estimate against the budget), for the server's start line."""


@attrs.frozen
class StartFailed:
    """The engine could not be built (bad options, models, memory bound): one line."""

    message: str


@attrs.frozen(kw_only=True)
class Submit:
    """A request for the engine: its prompt ids, ``max_new_tokens``, stop ids and sampling, under ``rid``
    (completion 0) and, for ``sampling.n > 1``, the ids of its other completions (``forks``)."""

    rid: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop: tuple[int, ...]
    """Token ids that end it (the model's end-of-sequence ids unless ``ignore_eos``)."""
    sampling: SamplingParams
    forks: tuple[int, ...] = ()
    """The ids of completions 1 to ``sampling.n - 1`` (``Engine.admit``'s ``forks``)."""

    @property
    def completions(self) -> tuple[int, ...]:
        """Its completions' ids, in index order."""
        return (self.rid, *self.forks)


@attrs.frozen
class Abort:
    """End request ``rid`` (every completion of it that has not ended) now."""

    rid: int


@attrs.frozen
class Finish:
    """End completion ``rid`` as finished, its output cut to its first ``keep`` ids (``Engine.finish``): the
    HTTP side found a stop string in its text (``compiler.online.text``). A request that has ended
    already (or ends in the same step) is left as it ended; the HTTP side keeps ``keep`` ids of it."""

    rid: int
    keep: int


@attrs.frozen
class Shutdown:
    """Abort whatever is live, close the engine, answer ``Closed`` and exit."""


@attrs.frozen
class TokenLogprob:
    """An output token's log-probability under the target's distribution before any sampling
    transform, and its ``top`` alternatives as ``(id, logprob)``, most likely first (an entry of
    ``Engine.logprobs``; a logprob the engine could not give is ``None``)."""

    id: int
    logprob: float | None
    top: tuple[tuple[int, float | None], ...]


@attrs.frozen
class Delta:
    """New output tokens of one completion, and their logprobs when the request asked for them."""

    rid: int
    """The completion's id."""
    ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


@attrs.frozen(kw_only=True)
class Ended:
    """One completion ended (see ``EndReason``): its last new tokens, their logprobs, and why."""

    rid: int
    """The completion's id."""
    ids: tuple[int, ...]
    """Its last new tokens (those no ``Delta`` carried)."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    reason: EndReason
    message: str | None = None
    """Why, for ``refused``, ``error`` and ``failed``."""


@attrs.frozen(kw_only=True)
class Stats:
    """The engine's gauges and counters, sent with every ``StepOut``."""

    running: int
    """Requests decoding (RUNNING), a request of ``n`` completions counting ``n``."""
    waiting: int
    """Requests submitted and not yet decoding (queued in the engine process or prefilling), a
    request of ``n`` completions counting ``n``."""
    slots_live: int
    slots_capacity: int
    request_slots: int
    """Slots held by live requests (the rest of ``slots_live`` is the prefix cache's)."""
    kv_live: int
    kv_capacity: int
    cache_entries: int
    outstanding_tickets: int
    """The ledger's registered one-shot tickets not yet consumed."""
    proposed: int
    accepted: int
    steps: int


@attrs.frozen(kw_only=True)
class StepOut:
    """What one engine step (or an idle tick) has to say: the completions' new tokens, those that
    ended, and the engine's ``Stats``."""

    deltas: tuple[Delta, ...]
    ended: tuple[Ended, ...]
    stats: Stats


@attrs.frozen(kw_only=True)
class Closed:
    """The engine process's last message: the ledger and allocators after every request left and
    the prefix cache was dropped."""

    outstanding_tickets: int
    """Tickets registered and not consumed, on every rank of a tensor-parallel group (rank 0's ledger
    otherwise)."""
    slots_live: int
    kv_live: int
    ranks_equal: bool = True
    """Every tensor-parallel rank consumed the same tickets (always true on one process)."""


@attrs.frozen
class Crashed:
    """The engine loop raised: one line; the process exits non-zero after sending it."""

    message: str


ToEngine = Launch | Submit | Abort | Finish | Shutdown
"""A message from the HTTP process to the engine process."""
FromEngine = Ready | StartFailed | StepOut | Closed | Crashed
"""A message from the engine process to the HTTP process."""
