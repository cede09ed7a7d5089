"""The bundled prompt set of the built-in workloads (``batchc run``, ``batchc ab``): system
prefixes that many requests share (so their prefix state is cached and copied), and Python snippets
that make up the request bodies."""

from __future__ import annotations

ARRIVALS = ("bursts", "trickle")
"""Arrival patterns of the built-in workload (``compiler.serve.builtin_workload``)."""

BURST_SIZE = 8
BURST_EVERY = 20


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
