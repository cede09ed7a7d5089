"""The bounded load test of ``batchc serve``: 96 concurrent streams (greedy and seeded sampled), a quarter of them
dropped by their clients at random points, mixed with malformed requests: no 5xx, every stream that
ran to its end equal to the same prompt's answer alone, and every slot and ticket back at the end
(its own server, in its own module). 96 streams are 12 times the server's 8 running requests, so most
wait in its queue, as 200 do; the larger profile, ``BATCHC_LOAD_STREAMS=200`` (any count from 8 up;
about 20 s on two cores, against about 10 s), is the soak run."""

from __future__ import annotations

import asyncio
import json
import os
import random

import httpx

from tests.compiler.online.server_proc import ServerProc
from tests.compiler.online.test_server import MAX_LEN, MODEL, _client, _settled

LOAD_PROMPTS = ("The history of the ", "Once upon a time, ", "In the beginning ", "A quick brown fox ")
LOAD_STREAMS = int(os.environ.get("BATCHC_LOAD_STREAMS", "96"))
LOAD_BAD = 24
if LOAD_STREAMS < 8:
    raise ValueError(f"BATCHC_LOAD_STREAMS must be at least 8 (the server's running requests), got {LOAD_STREAMS}")


def _sampled(i: int) -> bool:
    return (i // len(LOAD_PROMPTS)) % 2 == 1


def _sampling(i: int) -> dict[str, object]:
    """Request ``i``'s fields: every prompt comes greedy and seeded sampled (a seed of its prompt's)
    in turn."""
    if not _sampled(i):
        return {"temperature": 0}
    return {"temperature": 1.0, "top_p": 0.9, "seed": 1000 + i % len(LOAD_PROMPTS)}


async def _load(url: str, expected: dict[tuple[str, bool], str]) -> tuple[int, int, list[str]]:
    """``LOAD_STREAMS`` streams at once (greedy and seeded sampled ones, ``_sampling``), every fourth
    one dropped after a random number of chunks, mixed with malformed requests. Returns (streams
    that ran to [DONE], streams dropped, problems)."""
    rng = random.Random(30)
    problems: list[str] = []
    completed = dropped = 0

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        nonlocal completed, dropped
        prompt = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
        drop_after = rng.randrange(0, 4) if i % 4 == 3 else None
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True, **_sampling(i)}
        want = expected[prompt, _sampled(i)]
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                problems.append(f"stream {i}: {r.status_code} {(await r.aread())[:200]!r}")
                return
            text, chunks = "", 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    completed += 1
                    if text != want:
                        problems.append(f"stream {i}: {text!r} != {want!r}")
                    return
                text += json.loads(line[6:])["choices"][0]["text"]
                chunks += 1
                if drop_after is not None and chunks > drop_after:
                    dropped += 1
                    return  # (leaving the block closes the connection mid-stream)
            problems.append(f"stream {i}: ended without [DONE]")

    async def malformed(client: httpx.AsyncClient, i: int) -> None:
        body = [b"{", b'{"model": "batchc-bundled", "prompt": 1}', b'{"model": "batchc-bundled", "prompt": "a", "top_p": 2}'][i % 3]
        r = await client.post(f"{url}/v1/completions", content=body)
        if r.status_code != 400 or "error" not in r.json():
            problems.append(f"malformed {i}: {r.status_code} {r.text[:200]}")

    limits = httpx.Limits(max_connections=LOAD_STREAMS + LOAD_BAD, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(stream(client, i) for i in range(LOAD_STREAMS)), *(malformed(client, i) for i in range(LOAD_BAD)))
    return completed, dropped, problems


def test_load_streams_a_quarter_dropped_with_malformed_requests() -> None:
    server = ServerProc(["--max-len", str(MAX_LEN), "--max-running", "8", "--max-waiting", "400"]).ready()
    try:
        _check_load(server)
    finally:
        server.stop()


def _check_load(server: ServerProc) -> None:
    client = _client(server)
    # each request's answer alone (the server's own, equal to batchc run's: test_server); under load, batched with
    # up to 7 others and with streams dropped around it, every surviving stream must give the same tokens
    expected = {}
    for i in range(2 * len(LOAD_PROMPTS)):
        p = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
        expected[p, _sampled(i)] = client.completions.create(model=MODEL, prompt=p, max_tokens=8, **_sampling(i)).choices[0].text  # type: ignore[call-overload]  # (the test's fields)
    assert expected[LOAD_PROMPTS[1], True] != expected[LOAD_PROMPTS[1], False]  # (the sampled ones sample)
    before = _settled(server)
    completed, dropped, problems = asyncio.run(_load(server.url, expected))
    assert problems == []
    assert completed + dropped == LOAD_STREAMS and dropped <= LOAD_STREAMS // 4
    after = _settled(server)
    ended = {o: after[f'batchc_requests_total{{outcome="{o}"}}'] - before[f'batchc_requests_total{{outcome="{o}"}}']
             for o in ("finished", "cancelled", "timeout", "aborted", "refused", "error")}
    # a dropped stream whose request had ended already counts as finished
    assert ended["finished"] + ended["cancelled"] == LOAD_STREAMS and ended["cancelled"] <= dropped, ended
    assert ended["timeout"] == ended["aborted"] == ended["refused"] == ended["error"] == 0
    assert after["batchc_ledger_outstanding_tickets"] == 0 and after["batchc_request_slots_live"] == 0
    assert after['batchc_rejected_requests_total{status="400"}'] - before.get('batchc_rejected_requests_total{status="400"}', 0) == LOAD_BAD
