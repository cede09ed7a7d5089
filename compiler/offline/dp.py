"""``batchc run --dp N``: N replicas of the engine, each in its own process with its own models,
pools, prefix cache and ledger, fed by a prefix-aware router.

Routing (``route``): a request's key is its first ``block`` prompt tokens, the prefix cache's first
block; every request of one key goes to the replica that got the key first, and a new key goes to
the replica with the least work assigned so far (prompt plus new tokens), so requests that share a
system prompt share one replica's prefix cache while the load stays even. ``"round-robin"`` (for
comparison) deals the requests out in turn, ignoring prefixes.

Each replica is ``python -m compiler.offline.dp``: it reads its part of the workload and the run's
options as one JSON object on stdin, loads the models itself, serves its part with ``run`` (the
lossless check included, on its own first requests) and writes the summary and its outputs as JSON
on stdout. Requests travel as token ids and bytes, not pickles. The router starts every replica at
once and reads them all; a replica that fails stops the others, and the run fails naming it in the
words of every mode ("replica 0 killed by signal 9", "replica 1 exited with status 1: <its last
stderr line>"). Replicas are ``backend.children.spawn``'s children: they die with the router.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs

from backend import children
from compiler.engine.config import ServeConfig
from compiler.offline.budget import MemoryBudget
from compiler.workload import Request, ServeError
from ir.ids import RequestId
from ir.sampling import SamplingParams

__all__ = ["ROUTINGS", "ReplicaFailed", "ReplicaResult", "merged", "route", "serve_replicas", "timed_serve"]

ROUTINGS: Final = ("prefix", "round-robin")
"""The ``routing`` values ``route`` takes (``batchc run --dp-routing``)."""


def route(workload: Sequence[Request], replicas: int, *, block: int, routing: str = "prefix") -> list[list[Request]]:
    """Each replica's requests, in workload order (see the module)."""
    if type(replicas) is not int or replicas < 1:
        raise ServeError(f"replicas must be an int >= 1, got {replicas!r}")
    if type(block) is not int or block < 1:
        raise ServeError(f"block must be an int >= 1, got {block!r}")
    if routing not in ROUTINGS:
        raise ServeError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    parts: list[list[Request]] = [[] for _ in range(replicas)]
    load = [0] * replicas
    home: dict[tuple[int, ...], int] = {}
    for n, r in enumerate(workload):
        if routing == "round-robin":
            i = n % replicas
        else:
            key = tuple(int(t) for t in r.token_ids[:block])
            i = home.get(key, -1)
            if i < 0:
                i = min(range(replicas), key=lambda j: (load[j], j))
                home[key] = i
        parts[i].append(r)
        load[i] += len(r.token_ids) + r.max_new_tokens
    return parts


@attrs.frozen(kw_only=True)
class ReplicaResult:
    """What one replica process reported: its index, its summary (as JSON) and its requests' outputs,
    aborted and errored ids and logprobs."""

    index: int
    summary: dict[str, Any]
    """The replica's ``ServeSummary.to_json()``."""
    outputs: dict[RequestId, tuple[int, ...]]
    aborted: tuple[RequestId, ...]
    errored: tuple[RequestId, ...] = ()
    """Requests that ended at non-finite logits (``ServeSummary.errored``)."""
    logprobs: dict[RequestId, list[dict[str, Any]]] = attrs.Factory(dict)
    """``ServeSummary.logprobs``."""


class ReplicaFailed(RuntimeError):
    """A replica process failed; the message names it and says why in one line."""


def _request_json(r: Request) -> dict[str, object]:
    # the sampling fields by name (tuples become lists); the replica rebuilds and re-checks them
    return {"rid": int(r.rid), "prompt": r.prompt.decode("latin-1"), "max_new_tokens": r.max_new_tokens, "arrival": r.arrival,
            "sampling": attrs.asdict(r.sampling), "ids": list(r.ids) if r.ids is not None else None}


def _request(d: dict[str, Any]) -> Request:
    return Request(rid=RequestId(d["rid"]), prompt=d["prompt"].encode("latin-1"), max_new_tokens=d["max_new_tokens"],
                   arrival=d["arrival"], sampling=SamplingParams(**d["sampling"]),
                   ids=tuple(d["ids"]) if d["ids"] is not None else None)


def serve_replicas(
    parts: Sequence[Sequence[Request]], *, model: str | None, draft: str | None, dtype: str, cfg: ServeConfig, threads: int,
    on_done: Callable[[int], None] | None = None, budget: MemoryBudget | None = None,
) -> list[ReplicaResult]:
    """Serve each part on its own replica process, all at once; ``on_done(n)`` as replicas finish.
    ``budget``: each replica's memory (``MemoryBudget.share``; default: what its machine has available
    when it checks, with its models). ``ReplicaFailed`` (every other replica stopped) when one fails."""
    procs: list[subprocess.Popen[bytes]] = []
    results: list[tuple[bytes, bytes] | None] = [None] * len(parts)
    done = threading.Condition()
    try:
        for part in parts:
            spec = {"model": model, "draft": draft, "dtype": dtype, "cfg": attrs.asdict(cfg), "threads": threads,
                    "budget": attrs.asdict(budget) if budget is not None else None, "requests": [_request_json(r) for r in part]}
            # (spawned here, on this thread: the replica dies with it, whatever ends this process)
            proc = children.spawn([sys.executable, "-m", "compiler.offline.dp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
            procs.append(proc)

            def talk(i: int, p: subprocess.Popen[bytes], data: bytes) -> None:
                out, err = p.communicate(data)
                with done:
                    results[i] = (out, err)
                    done.notify_all()

            threading.Thread(target=talk, args=(len(procs) - 1, proc, json.dumps(spec).encode()), daemon=True).start()
        finished = 0
        while finished < len(parts):
            with done:
                done.wait(timeout=0.5)
                ready = [i for i, r in enumerate(results) if r is not None]
            for i in ready:
                code = procs[i].returncode
                if code not in (None, 0):
                    assert code is not None
                    err = (results[i] or (b"", b""))[1].decode(errors="replace").strip().splitlines()
                    said = f": {err[-1].strip()}" if err and code > 0 else ""
                    raise ReplicaFailed(f"replica {i} {children.ended(code)}{said}")
            if len(ready) != finished:
                finished = len(ready)
                if on_done is not None:
                    on_done(finished)
        out: list[ReplicaResult] = []
        for i, r in enumerate(results):
            assert r is not None
            try:
                d = json.loads(r[0])
            except ValueError:
                raise ReplicaFailed(f"replica {i} exited with status 0 without writing its result") from None
            out.append(ReplicaResult(index=i, summary=d["summary"], outputs={RequestId(int(k)): tuple(v) for k, v in d["outputs"].items()},
                                     aborted=tuple(map(RequestId, d["aborted"])), errored=tuple(map(RequestId, d["errored"])),
                                     logprobs={RequestId(int(k)): v for k, v in d["logprobs"].items()}))
        return out
    finally:
        for p in procs:
            children.kill(p)


def _replica_main() -> int:
    """A replica: one JSON spec on stdin, the summary and outputs as JSON on stdout."""
    import torch

    from compiler.offline.models import Served, load_draft, load_served
    from compiler.offline.run import run

    spec = json.loads(sys.stdin.buffer.read())
    torch.set_num_threads(spec["threads"])
    cfg = ServeConfig(**spec["cfg"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec["dtype"]]
    target = load_served(spec["model"], role="target", dtype=dtype, bundled="target")
    drafted = load_draft(spec["draft"], target=target, dtype=dtype) if cfg.k > 0 else None
    workload = [_request(r) for r in spec["requests"]]
    budget = MemoryBudget(**spec["budget"]) if spec["budget"] is not None else None
    summary = run(workload, target.model, (drafted.model if isinstance(drafted, Served) else drafted.head) if drafted is not None else None, cfg,
                  tokenizer=target.tokenizer if target.hf else None, eos=target.eos, budget=budget)
    sys.stdout.write(json.dumps({"summary": summary.to_json(), "outputs": {str(k): list(v) for k, v in summary.outputs.items()},
                                 "aborted": list(summary.aborted), "errored": list(summary.errored),
                                 "logprobs": {str(k): v for k, v in summary.logprobs.items()}}, default=_plain))
    return 0


def _plain(value: object) -> object:
    if attrs.has(type(value)):
        return attrs.asdict(value)  # type: ignore[arg-type]  # attrs.has narrows to the class, not the instance
    raise TypeError(f"{type(value).__name__} is not JSON")


def merged(results: Sequence[ReplicaResult], wall_s: float) -> dict[str, object]:
    """The run's figures over every replica: tokens, tokens/s over the router's wall time (from the
    first replica's start to the last one's end, loading included) and over the slowest replica's
    serving time, every ledger drained, every lossless check passed."""
    tokens = sum(int(r.summary["generated_tokens"]) for r in results)
    serving = max(float(r.summary["wall_s"]) for r in results)
    # a replica whose check compared nothing (all its sampled requests ended in error, or none were
    # sampled) has no lossless_ok: "true" only where some replica compared and none failed, like one engine's
    verdicts = [r.summary["lossless_ok"] for r in results if r.summary.get("lossless_ok") is not None]
    lossless: dict[str, object] = {"lossless_ok": all(verdicts)} if verdicts else {}
    return {
        "dp": len(results), "requests": sum(int(r.summary["requests"]) for r in results), "generated_tokens": tokens,
        "tokens_per_s": tokens / serving if serving else 0.0, "slowest_replica_wall_s": serving, "router_wall_s": wall_s,
        "outstanding_tickets": sum(int(r.summary["outstanding_tickets"]) for r in results),
        "aborted_requests": sum(int(r.summary["aborted_requests"]) for r in results),
        "errored_requests": sum(int(r.summary["errored_requests"]) for r in results),
        **lossless,
        "prefix_cache_hit_tokens": sum(int(r.summary["prefix_cache_hit_tokens"]) for r in results),
        "replicas": [r.summary for r in results],
    }


def timed_serve(parts: Sequence[Sequence[Request]], **kw: Any) -> tuple[list[ReplicaResult], float]:
    """``serve_replicas`` of ``parts`` (keywords passed on), and the wall seconds it took, loading
    included."""
    t0 = time.perf_counter()
    results = serve_replicas(parts, **kw)
    return results, time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(_replica_main())
