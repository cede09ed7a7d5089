"""``batchc bench online``: a load generator for ``batchc serve``, our equivalent of vLLM's
``benchmark_serving``.

It starts a server (``batchc serve --port 0`` with the given model options; or uses ``--url``),
then, for each rate, sends the built-in workload's prompts (``compiler.offline.load.builtin_workload``,
with its prefixes and mixed lengths) as streaming completions with Poisson arrivals (exponential
gaps of mean 1 / rate, from a seeded generator) over loopback, greedy
(``temperature 0``) and with ``ignore_eos``, so that every request runs to its ``max_tokens``. Per
rate it reports request throughput, output tokens per second, and time to first token (TTFT), time
per output token (TPOT: after the first token, per further token) and inter-token latency (ITL:
between two chunks of a stream) at p50, p90 and p99, in milliseconds. Every request must succeed; a
failed one fails the bench (exit 1).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs

from compiler.tools.bench_serve import percentile

QUANTILES = (0.5, 0.9, 0.99)


@attrs.frozen(kw_only=True)
class Sent:
    """One request's timings (``time.perf_counter`` seconds from its send)."""

    ttft: float
    chunks: tuple[float, ...]
    """Arrival of each chunk that carried text."""
    e2e: float
    tokens: int


async def _one(client: Any, url: str, model: str, prompt: str, max_tokens: int) -> Sent:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = -1
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"a request was answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"a stream failed: {chunk['error']}")
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter() - t0)
    if tokens < 0 or not arrivals:
        raise RuntimeError("a stream ended without text or usage")
    return Sent(ttft=arrivals[0], chunks=tuple(arrivals), e2e=time.perf_counter() - t0, tokens=tokens)


async def _rate(url: str, model: str, prompts: Sequence[tuple[str, int]], rate: float, seed: int) -> tuple[list[Sent], float]:
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        due = 0.0
        for prompt, n in prompts:
            wait = due - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.ensure_future(_one(client, url, model, prompt, n)))
            due += rng.expovariate(rate)
        sent = await asyncio.gather(*tasks)
        return list(sent), time.perf_counter() - t0


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in QUANTILES:
        v = percentile(values, q)
        out[f"p{round(q * 100)}"] = None if v is None else v * 1e3
    return out


def summarise(rate: float, sent: Sequence[Sent], wall: float) -> dict[str, Any]:
    tokens = sum(s.tokens for s in sent)
    tpot = [(s.e2e - s.ttft) / (s.tokens - 1) for s in sent if s.tokens > 1]
    itl = [b - a for s in sent for a, b in zip(s.chunks, s.chunks[1:], strict=False)]
    return {
        "rate": rate, "requests": len(sent), "wall_s": wall, "request_throughput": len(sent) / wall,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall, "ttft_ms": _ms([s.ttft for s in sent]), "tpot_ms": _ms(tpot),
        "itl_ms": _ms(itl),
    }


def start_server(serve_args: Sequence[str], timeout_s: float = 600.0) -> tuple[subprocess.Popen[bytes], str]:
    """``batchc serve --port 0 ARGS`` as a child of this process (dies with it); its URL."""
    from backend import children

    proc = children.spawn([sys.executable, "-m", "compiler.cli", "serve", "--port", "0", *serve_args], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline().decode(errors="replace")
        if not line:
            children.kill(proc)
            raise RuntimeError(f"batchc serve {children.ended(proc.returncode or 0)} before it listened")
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    children.kill(proc)
    raise RuntimeError(f"batchc serve {children.no_answer(timeout_s)}")


def served_model(url: str) -> str:
    """The id of the model ``url`` serves (``GET /v1/models``)."""
    import httpx

    try:
        r = httpx.get(f"{url}/v1/models", timeout=60)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise RuntimeError(f"{url}/v1/models did not name a model ({exc})") from None


RESERVE = 16
"""Context positions left free after a request's prompt and tokens (the server's k + 1, for any k up to 15)."""


def bench_prompts(*, requests: int, max_new_tokens: int, seed: int) -> list[tuple[str, int]]:
    """The built-in workload's prompts and lengths (byte prompts: one token per byte on the bundled models)."""
    from compiler.offline.load import builtin_workload

    workload = builtin_workload(num_requests=requests, max_new_tokens=max_new_tokens, seed=seed)
    return [(r.prompt.decode("utf-8", "replace"), r.max_new_tokens) for r in workload]


def run_online_bench(*, url: str, model: str, rates: Sequence[float], prompts: Sequence[tuple[str, int]], seed: int) -> list[dict[str, Any]]:
    """One summary per rate (see the module)."""
    rows = []
    for rate in rates:
        sent, wall = asyncio.run(_rate(url, model, prompts, rate, seed))
        rows.append(summarise(rate, sent, wall))
    return rows
