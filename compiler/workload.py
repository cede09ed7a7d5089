"""The bundled prompt set of the built-in workloads (``batchc run``, ``batchc ab``): system
prefixes that many requests share (so their prefix state is cached and copied), and Python snippets
that make up the request bodies; and the limits and defaults of ``batchc run``'s and ``batchc bench
serve``'s workloads and options (here, so that the command line can state them in ``--help``
without importing the serving stack), with the request record, the context rule
(``context_overflow``, ``Engine.admit``'s: a request that breaks it is refused on its own,
``Request.refused``) and the errors of a run. The options record (``ServeConfig``) lives with the
engine, in ``compiler.engine.config``."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs

from ir.errors import BatchcError
from ir.ids import RequestId
from ir.sampling import GREEDY, SamplingParams

__all__ = [
    "ARRIVALS", "BENCH_SERVE_NEW_TOKENS", "BENCH_SERVE_REPEATS", "BENCH_SERVE_REQUESTS", "BURST_EVERY", "BURST_SIZE", "BYTE_VOCAB", "DEFAULT_CONTEXT",
    "LONGEST_BUILTIN_PROMPT", "MAX_ARRIVAL", "MAX_BODY_SNIPPETS", "MAX_CONTEXT", "MAX_K", "MAX_REQUESTS", "MAX_RUNNING", "MAX_SEED",
    "MAX_THREADS", "MAX_WORKLOAD_BYTES", "SNIPPETS", "SWEEP_NEW_TOKENS", "SWEEP_RUNNING", "SYSTEM_PREFIXES", "Request",
    "ServeError", "WorkloadError", "completion_rid", "context_overflow",
]

ARRIVALS = ("bursts", "trickle")
"""Arrival patterns of the built-in workload (``compiler.offline.builtin_workload``)."""

BURST_SIZE = 8
"""Requests per burst of the built-in workload's ``bursts`` arrivals."""
BURST_EVERY = 20
"""Scheduler steps between two bursts of the built-in workload's ``bursts`` arrivals."""
MAX_BODY_SNIPPETS = 6
"""A built-in request body is 1 to this many snippets."""

MAX_WORKLOAD_BYTES = 64 << 20
"""Largest workload file (64 MiB), checked with ``stat`` before reading and by reading at most one
byte more (``compiler.offline.load_workload``)."""
MAX_REQUESTS = 100_000
"""Most requests in one workload, built-in or from a file (about 100 MB of requests in memory)."""
MAX_K = 32
"""Most draft tokens per speculative iteration (k + 1 positions of every request's context are kept
for them; each iteration runs k draft forwards)."""
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
line takes: far past what the memory budget admits on any model, and their sum plus 2 (an engine's
slots) stays under the engine's bound of 2**20."""


SYSTEM_PREFIXES: tuple[bytes, ...] = (
    b"You are a careful Python reviewer. Answer briefly.\n",
    b"Translate the following comment into plain English:\n",
)
"""The system prefixes about two thirds of the built-in requests start with (shared, so cached)."""
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
"""The Python snippets built-in request bodies are made of."""


MAX_ARRIVAL = 1_000_000
"""Latest arrival step a workload may ask for (a larger one would idle the scheduler for ever)."""
BYTE_VOCAB = 256
"""Vocabulary of the byte-level serving path: prompts, completions and stop tokens are bytes."""


class WorkloadError(BatchcError, ValueError):
    """A workload file that cannot be served; the message names the file and line."""


class ServeError(BatchcError, ValueError):
    """Options or models that cannot be served; the message names the option or model field."""


def _greedy_of(r: Request) -> SamplingParams:
    return _greedy_with(r.max_new_tokens)


@functools.lru_cache(maxsize=1024)
def _greedy_with(max_new_tokens: int) -> SamplingParams:
    """``GREEDY`` with this ``max_new_tokens`` (a frozen value: one per length serves every request;
    building and validating one per request made a 100,000-request sweep take seconds)."""
    return attrs.evolve(GREEDY, max_new_tokens=max_new_tokens)


FORK_SHIFT = 40
"""Completion ``i > 0`` of request ``rid`` is served under engine id ``rid + (i << FORK_SHIFT)``
(``completion_rid``): above every workload line's id (at most ``MAX_REQUESTS``)."""


def completion_rid(rid: RequestId, index: int) -> RequestId:
    """The engine's id of completion ``index`` of request ``rid`` (``rid`` itself for completion 0)."""
    return rid if index == 0 else RequestId(int(rid) + (index << FORK_SHIFT))


@attrs.frozen(kw_only=True)
class Request:
    """One request of a workload. ``prompt`` is its text, UTF-8; on the byte-level path the bytes
    are the token ids, otherwise ``ids`` holds the tokenizer's ids of it.

    Invariant: ``sampling.max_new_tokens == max_new_tokens`` (checked on construction,
    ``ValueError``); ``sampling`` defaults to ``GREEDY`` with this ``max_new_tokens``."""

    rid: RequestId
    prompt: bytes
    max_new_tokens: int
    arrival: int = 0
    sampling: SamplingParams = attrs.field(default=attrs.Factory(_greedy_of, takes_self=True))
    """How its tokens are chosen and when it ends (stop strings, stop token ids, ``ignore_eos``,
    ``min_tokens``): the workload line's sampling fields over the run's defaults."""

    def completions(self) -> list[RequestId]:
        """The engine ids of its ``sampling.n`` completions, in index order (``completion_rid``)."""
        return [completion_rid(self.rid, i) for i in range(self.sampling.n)]
    ids: tuple[int, ...] | None = None
    refused: str | None = None
    """Why the request is not served (its prompt and new tokens do not fit the context), naming its
    file and line; ``None`` for a request to serve. Refused requests are never admitted: a run
    serves the others and reports these with their reason."""

    def __attrs_post_init__(self) -> None:
        if self.sampling.max_new_tokens != self.max_new_tokens:
            raise ValueError(f"request {self.rid}: max_new_tokens {self.max_new_tokens} differs from its "
                             f"sampling.max_new_tokens {self.sampling.max_new_tokens}")

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


LONGEST_BUILTIN_PROMPT = max(len(p) for p in SYSTEM_PREFIXES) + MAX_BODY_SNIPPETS * max(len(s) for s in SNIPPETS)
"""Longest prompt ``builtin_workload`` can build (bytes)."""
