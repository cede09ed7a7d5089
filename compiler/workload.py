"""The bundled prompt set of the built-in workloads (``batchc run``, ``batchc ab``): system
prefixes that many requests share (so their prefix state is cached and copied), and Python snippets
that make up the request bodies; and the limits of ``batchc run``'s workloads and options (here,
so that the command line can state them in ``--help`` without importing the serving stack)."""

from __future__ import annotations

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
