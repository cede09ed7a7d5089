"""The bundled prompt set of the built-in workloads (``batchc run``, ``batchc ab``): system
prefixes that many requests share (so their prefix state is cached and copied), and Python snippets
that make up the request bodies; and the limits and defaults of ``batchc run``'s and ``batchc bench
serve``'s workloads and options (here, so that the command line can state them in ``--help``
without importing the serving stack), with the options record (``ServeConfig``, whose defaults are
the command line's), the request record, the context rule (``context_overflow``, ``Engine.admit``'s:
a request that breaks it is refused on its own, ``Request.refused``) and the errors of a run."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ir.errors import BatchcError
from ir.ids import RequestId

ARRIVALS = ("bursts", "trickle")
"""Arrival patterns of the built-in workload (``compiler.serve.builtin_workload``)."""

BURST_SIZE = 8
BURST_EVERY = 20
MAX_BODY_SNIPPETS = 6
"""A built-in request body is 1 to this many snippets."""

MAX_WORKLOAD_BYTES = 64 << 20
"""Largest workload file (64 MiB), checked with ``stat`` before reading and by reading at most one
byte more (``compiler.serve.load_workload``)."""
MAX_REQUESTS = 100_000
"""Most requests in one workload, built-in or from a file (about 100 MB of requests in memory)."""
MAX_K = 32
"""Most draft tokens per speculative iteration (k + 1 positions of every request's context are kept
for them; each iteration runs k draft forwards)."""
MAX_SERVE_BYTES = 4 << 30
"""Bound on the estimated memory of a run (4 GiB; ``compiler.serve.memory_estimate``)."""
BENCH_SERVE_REQUESTS = 64
BENCH_SERVE_NEW_TOKENS = 48
"""``batchc bench serve``'s default built-in workload: requests, and most new tokens per request; about
1,900 tokens, a few seconds per engine and case on a 2-core CPU, so that the machine's noise (the
same engine's run swings by a third between repeats on a shared machine) is not as large as the
effects measured."""
BENCH_SERVE_REPEATS = 3
"""``batchc bench serve``'s default interleaved repeats, as many as keep the default bench short on
a 2-core CPU (measured: docs/measurements/index.md)."""
SWEEP_RUNNING = (8, 32, 128, 256)
"""``batchc bench serve --sweep``'s default running batches."""
SWEEP_NEW_TOKENS = 8
"""New tokens per request in ``batchc bench serve --sweep``."""
MAX_THREADS = 1024
"""Most torch intra-op threads a run or benchmark may ask for (``ServeConfig.threads``)."""
MAX_CONTEXT = 1 << 20
"""Longest context (``--max-len``, ``ServeConfig.max_len``): the engine's own bound,
``compiler.engine.admission.MAX_LEN``, stated here so that the command line need not import it."""
DEFAULT_CONTEXT = 512
"""Context length of the bundled models and batchc checkpoints, which record none (a Hugging Face
checkpoint's default is its ``max_position_embeddings``)."""
MAX_SEED = 2**63 - 1
"""Largest seed (``--seed``): torch's generators take 64-bit seeds; seeds are 0 to this."""
MAX_RUNNING = 1 << 16
"""Most live requests (``--max-running``) and prefix-cache entries (``--cache-entries``) the command
line takes: far past what the memory bound admits on any model, and their sum plus 2 (an engine's
slots) stays under the engine's bound of 2**20."""


SYSTEM_PREFIXES: tuple[bytes, ...] = (
    b"You are a careful Python reviewer. Answer briefly.\n",
    b"Translate the following comment into plain English:\n",
)
SNIPPETS: tuple[bytes, ...] = (
    b"def merge(a, b):\n    return sorted(a + b)\n",
    b"for i in range(10):\n    print(i * i)\n",
    b"class Slot:\n    __slots__ = ('index', 'live')\n",
    b"with open(path) as f:\n    data = f.read()\n",
    b"x = [n for n in numbers if n % 2 == 0]\n",
    b"try:\n    run()\nexcept KeyError as exc:\n    log(exc)\n",
    b"async def fetch(url):\n    return await client.get(url)\n",
    b"import itertools\npairs = list(itertools.combinations(items, 2))\n",
)


MAX_ARRIVAL = 1_000_000
"""Latest arrival step a workload may ask for (a larger one would idle the scheduler for ever)."""
BYTE_VOCAB = 256
"""Vocabulary of the byte-level serving path: prompts, completions and stop tokens are bytes."""


class WorkloadError(BatchcError, ValueError):
    """A workload file that cannot be served; the message names the file and line."""


class ServeError(BatchcError, ValueError):
    """Options or models that cannot be served; the message names the option or model field."""


@attrs.frozen(kw_only=True)
class Request:
    """One request of a workload. ``prompt`` is its text, UTF-8; on the byte-level path the bytes
    are the token ids, otherwise ``ids`` holds the tokenizer's ids of it."""

    rid: RequestId
    prompt: bytes
    max_new_tokens: int
    arrival: int = 0
    stop: int | None = None
    """A token id that ends the request (besides the model's end-of-sequence ids)."""
    ids: tuple[int, ...] | None = None
    refused: str | None = None
    """Why the request is not served (its prompt and new tokens do not fit the context), naming its
    file and line; ``None`` for a request to serve. Refused requests are never admitted: a run
    serves the others and reports these with their reason."""

    @property
    def token_ids(self) -> Sequence[int]:
        """The prompt as the model sees it."""
        return self.prompt if self.ids is None else self.ids


def context_overflow(n: int, unit: str, new: int, *, max_len: int, k: int) -> str | None:
    """Why a prompt of ``n`` ``unit`` (``"bytes"`` or ``"tokens"``) and ``new`` new tokens does not
    fit a context of ``max_len`` positions at ``k`` draft tokens per step, or ``None`` when it fits.
    The rule is ``Engine.admit``'s: prompt + new tokens + k + 1 <= ``max_len`` (a decode or verify
    step writes k + 1 positions). Positions reserved for speculation are named only when k > 0."""
    if n + new + k + 1 <= max_len:
        return None
    held = "a decode step holds 1 more"
    if k:
        held += f" and {k} {'position is' if k == 1 else 'positions are'} reserved for speculation"
    return (f"prompt of {n} {unit} + {new} new tokens exceeds the context limit {max_len} (prompt and new tokens may fill "
            f"{max_len - k - 1} of its positions; {held})")


DEFAULT_PREFILL_STREAK = 2
"""``ServeConfig.prefill_streak``'s default: measured (docs: measurements, "Scheduling")."""
MAX_PREFILL_STREAK = 1 << 20
"""The same bound as ``compiler.engine.policy.MAX_STREAK`` (this module imports no engine)."""

LONGEST_BUILTIN_PROMPT = max(len(p) for p in SYSTEM_PREFIXES) + MAX_BODY_SNIPPETS * max(len(s) for s in SNIPPETS)
"""Longest prompt ``builtin_workload`` can build (bytes)."""


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
    them, each snapshot cutting a prefill chunk (an extra forward); at 16 it evicts 12."""
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

    overlap: bool = False
    """Run each model's executor in its own process (``Engine(overlap=True)``). Off by default:
    measured on a 2-core CPU it is no faster yet (docs/guides/overlap.md)."""

    def __attrs_post_init__(self) -> None:
        if type(self.overlap) is not bool:  # noqa: E721 - 0, 1 and 'no' are not switches
            raise ServeError(f"overlap must be a bool, got {self.overlap!r}")
        for name, value in attrs.asdict(self).items():
            if name == "overlap":
                continue
            if type(value) is not int:  # noqa: E721 - bool, float and str are not option values
                raise ServeError(f"{name} must be an int, got {value!r}")
            lo = 0 if name in ("k", "lossless_sample", "prefill_streak") else 1
            if value < lo:
                raise ServeError(f"{name} must be >= {lo}, got {value}")
        if self.k > MAX_K:
            raise ServeError(f"k must be in [0, {MAX_K}], got {self.k}")
        if self.prefill_streak > MAX_PREFILL_STREAK:
            raise ServeError(f"prefill_streak must be in [0, {MAX_PREFILL_STREAK}], got {self.prefill_streak}")
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


