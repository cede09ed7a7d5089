"""``batchc run``: the main job. A workload of requests served by ``Engine`` on a target and a
draft model, with the prefix cache, chunked prefill, continuous batching and speculative decoding,
and a summary an engine author can judge the library by.

Workloads: the built-in one (``builtin_workload``: requests built from a bundled prompt set, with
shared system prefixes, arrivals in bursts or a trickle, and mixed lengths) or a JSONL file (``load_workload``), one
request per line: ``{"prompt": str, "arrival": int (optional, scheduler step)}`` and any
``ir.sampling.SamplingParams`` field under its name (``max_new_tokens``, ``temperature``, ``top_p``,
..., ``stop``: a string or list of strings, the text ending before it, ``compiler.offline.stops``). A
malformed file or a bad field raises ``WorkloadError`` naming the line (and the field and value).
``load_workload`` checks the same bounds as ``Engine.admit`` (context length with the k + 1
speculative positions, token ids below the vocabulary), so a loaded workload is never refused
mid-run; its file limits are in its docstring.

Before anything is allocated, ``check_serving`` refuses models that the byte-level serving path
cannot serve (target/draft vocabulary mismatch, vocabulary other than 256) and runs whose estimated
memory (``memory_estimate``: the models' weights, state pools, KV caches, token tables, allocators,
verify states, attention scores and activations, for every engine the run builds) is over the
memory budget, a fraction of what the machine has available (``memory_budget``, a
``MemoryBudget``); ``fit_serving`` lowers the sizes the user left to the run until it fits.

A forward that fails aborts its requests (``Engine``, no retries here); the summary counts
them (``aborted_requests``, ``failed_forwards``, ``first_failure``), and the lossless check skips
them.

The lossless check re-runs a sample of the requests with plain greedy decoding of the target alone
(no draft, no cache, no chunking) and compares the outputs token for token.

The names below load on first use (PEP 562): ``batchc serve``'s HTTP process imports torch-free
submodules (``compiler.offline.tokenizer``, ``compiler.offline.stops``) without loading the models and
torch through ``compiler.offline.load`` and ``compiler.offline.run``. The whole ``batchc run`` job is
``compiler.offline.run.run`` (not a name here: loaded lazily, it would be shadowed by its submodule).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compiler.engine.config import ServeConfig
    from compiler.offline.budget import MemoryBudget, memory_budget
    from compiler.offline.load import builtin_workload, load_workload
    from compiler.offline.memory import check_serving, fit_serving, memory_estimate
    from compiler.offline.run import make_engine, serve
    from compiler.offline.summary import MutableRun, Sample, ServeSummary
    from compiler.workload import (
        BYTE_VOCAB,
        LONGEST_BUILTIN_PROMPT,
        MAX_ARRIVAL,
        Request,
        ServeError,
        WorkloadError,
    )

_WHERE = {
    "ServeConfig": "compiler.engine.config", "builtin_workload": "compiler.offline.load", "load_workload": "compiler.offline.load",
    "check_serving": "compiler.offline.memory", "memory_estimate": "compiler.offline.memory", "fit_serving": "compiler.offline.memory",
    "MemoryBudget": "compiler.offline.budget", "memory_budget": "compiler.offline.budget", "make_engine": "compiler.offline.run",
    "serve": "compiler.offline.run", "MutableRun": "compiler.offline.summary", "Sample": "compiler.offline.summary",
    "ServeSummary": "compiler.offline.summary", "BYTE_VOCAB": "compiler.workload", "LONGEST_BUILTIN_PROMPT": "compiler.workload",
    "MAX_ARRIVAL": "compiler.workload", "Request": "compiler.workload", "ServeError": "compiler.workload", "WorkloadError": "compiler.workload",
}

__all__ = [
    "BYTE_VOCAB", "LONGEST_BUILTIN_PROMPT", "MAX_ARRIVAL", "MemoryBudget", "MutableRun", "Request", "Sample", "ServeConfig", "ServeError",
    "ServeSummary", "WorkloadError", "builtin_workload", "check_serving", "fit_serving", "load_workload", "make_engine", "memory_budget",
    "memory_estimate", "serve",
]


def __getattr__(name: str) -> object:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'compiler.offline' has no attribute {name!r}")
    value = vars(importlib.import_module(where))[name]
    globals()[name] = value  # (looked up once)
    return value
