"""The serving options record (``ServeConfig``): what ``batchc run``, ``batchc bench serve`` and the
serving layer build an engine with. Its defaults are the command line's (``compiler.cli.args``), and
it is checked on construction: a bad value raises ``ServeError`` naming the option (the memory
bound of a whole run is ``compiler.offline.check_serving``'s).

The limits it shares with the workloads and the command line (``MAX_K``, ``MAX_CONTEXT``, ...) stay
in ``compiler.workload``; the prefill streak's default and bound are the scheduling policy's
(``compiler.engine.policy``) and live here, beside the option that sets them.
"""

from __future__ import annotations

import attrs

from compiler.workload import DEFAULT_CONTEXT, LONGEST_BUILTIN_PROMPT, MAX_CONTEXT, MAX_K, MAX_SEED, MAX_THREADS, ServeError

__all__ = ["DEFAULT_PREFILL_STREAK", "MAX_PREFILL_STREAK", "ServeConfig"]

DEFAULT_PREFILL_STREAK = 2
"""``ServeConfig.prefill_streak``'s default: measured (docs: measurements, "Scheduling")."""
MAX_PREFILL_STREAK = 1 << 20
"""Largest ``ServeConfig.prefill_streak`` (``compiler.engine.policy.MAX_STREAK``)."""


@attrs.frozen(kw_only=True)
class ServeConfig:
    """Serving options (checked on construction, ``ServeError``; memory bounds: ``check_serving``)."""

    k: int = 2
    max_running: int = 8
    chunk_size: int = 512
    """Most prompt tokens of one request a prefill step takes (measured with ``token_budget`` and
    ``prefill_streak``: docs/measurements/index.md, "Scheduling"; every forward costs a few ms of fixed
    work on a CPU, so fewer, larger prefill forwards win)."""
    token_budget: int = 2048
    """Most prompt tokens of all requests a prefill step takes (a burst of prompts in one forward)."""
    cache_entries: int = 16
    """Prefix-cache entries: at 8 the built-in workload evicted 32 entries a run and re-snapshotted
    them (each snapshot then cut a prefill chunk, an extra forward; now it is taken inside the
    chunk); at 16 it evicts 12."""
    cache_block: int = 16
    max_len: int = DEFAULT_CONTEXT
    """Context length: prompt, new tokens and the k + 1 positions of a decode or verify step."""
    lossless_sample: int = 4
    prefill_streak: int = DEFAULT_PREFILL_STREAK
    """With a draft: prefill steps in a row while requests run before one speculative step
    (``compiler.engine.policy.PrefillFirst``'s ``max_streak``; 0: no bound, 1: alternate)."""
    threads: int = 1
    """Torch intra-op threads (``torch.set_num_threads``) that ``batchc run`` and ``batchc bench``
    set before any work; process-wide, so the library's ``run`` leaves it alone. The default is
    measured (docs/measurements/index.md, "Threads"): on a CPU shared with other processes, two threads made runs many
    times slower whenever another process held a core (idle OpenMP workers spin-wait for it), and
    gained little when the CPU was quiet."""

    seed: int = 0
    """The run's seed (``batchc run --seed``): the engine's (``Engine(seed=)``), from which a sampled
    request that sets no seed of its own gets ``ir.sampling.derive_seed(seed, its request id)``;
    0 to ``MAX_SEED``."""

    overlap: bool = False
    """Run each model's executor in its own process (``Engine(transport=processes())``,
    ``backend.transports``). Off by default:
    measured on a 2-core CPU it is no faster yet (docs/guides/overlap.md)."""

    penalties: bool = False
    """Serve presence, frequency and repetition penalties (``Engine(penalties=True)``: the target keeps
    per-slot token counts, counted by ``check_serving``). ``batchc run`` turns it on when a workload
    line asks for a penalty."""

    def __attrs_post_init__(self) -> None:
        given = attrs.asdict(self, recurse=False)
        for switch in ("overlap", "penalties"):
            if type(given[switch]) is not bool:  # noqa: E721 - 0, 1 and 'no' are not switches
                raise ServeError(f"{switch} must be a bool, got {given[switch]!r}")
        for name, value in attrs.asdict(self).items():
            if name in ("overlap", "penalties"):
                continue
            if type(value) is not int:  # noqa: E721 - bool, float and str are not option values
                raise ServeError(f"{name} must be an int, got {value!r}")
            lo = 0 if name in ("k", "lossless_sample", "prefill_streak", "seed") else 1
            if value < lo:
                raise ServeError(f"{name} must be >= {lo}, got {value}")
        if self.k > MAX_K:
            raise ServeError(f"k must be in [0, {MAX_K}], got {self.k}")
        if self.prefill_streak > MAX_PREFILL_STREAK:
            raise ServeError(f"prefill_streak must be in [0, {MAX_PREFILL_STREAK}], got {self.prefill_streak}")
        if self.seed > MAX_SEED:
            raise ServeError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")
        if self.threads > MAX_THREADS:
            raise ServeError(f"threads must be in [1, {MAX_THREADS}], got {self.threads}")
        if self.max_len > MAX_CONTEXT:
            raise ServeError(f"max_len must be at most {MAX_CONTEXT}, got {self.max_len}")
        if self.max_len < self.k + 3:
            raise ServeError(f"max_len {self.max_len} leaves no room for a prompt and a new token next to k + 1 = {self.k + 1}")

    @property
    def reserve(self) -> int:
        """Context positions a request keeps free after its prompt and new tokens (``Engine.admit``)."""
        return self.k + 1

    @property
    def builtin_max_new_tokens(self) -> int:
        """Largest ``max_new_tokens`` the built-in workload can ask for: its longest possible prompt
        plus that many tokens plus ``reserve`` must fit ``max_len``."""
        return self.max_len - LONGEST_BUILTIN_PROMPT - self.reserve
