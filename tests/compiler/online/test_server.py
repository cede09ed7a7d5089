"""``batchc serve`` end to end, as its users reach it: the real ``openai`` client and raw httpx
against a server this module starts on a free loopback port (``server_proc``), on the bundled
byte-level models at a small context.

One server (``served``, with an API key, two requests running and one waiting at most) takes the
API tests; the drain on SIGTERM, the engine process's crash and the request deadline each get their
own server, since each ends it or needs other options. The crash server also serves scenario 6
(a prefill of one token per step, ``--token-budget 1``, its plans dumped through ``BATCHC_DUMP_DIR``)
before the crash test ends it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests import forkserver
from tests.compiler.cli.test_lifetimes import alive
from tests.compiler.online.server_proc import ROOT, ServerProc
from tests.lazy import lazy

if TYPE_CHECKING:
    import openai
else:
    openai = lazy("openai")  # (a second to import: only the worker that runs these tests pays it)

KEY = "test-key-0123"
MODEL = "batchc-bundled"
MAX_LEN = 256
PROMPT = "The history of the "
OPTIONS = ["--max-len", str(MAX_LEN), "--k", "2", "--max-running", "2", "--max-waiting", "1", "--api-key", KEY]
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = MAX_LEN - 3 - len(PROMPT)
"""max_tokens of a request that runs for hundreds of engine steps."""


SAMPLED_OPTIONS = ("--seed", "7", "--temperature", "1", "--top-p", "0.9")
"""The sampling defaults of the ``sampled`` server and of the ``batchc run`` it is compared with."""

SERVERS = {
    "api": OPTIONS,
    "drain": ["--max-len", str(MAX_LEN), "--drain-timeout", "0.5"],
    "deadline": ["--max-len", str(MAX_LEN), "--request-timeout", "0.05"],
    "crash": ["--max-len", str(MAX_LEN), "--token-budget", "1"],
    "sampled": ["--max-len", str(MAX_LEN), "--k", "2", *SAMPLED_OPTIONS],
}


@pytest.fixture(scope="module")
def crash_plans(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the crash server's engine process dumps every pass output into (``BATCHC_DUMP_DIR``)."""
    return tmp_path_factory.mktemp("crash-plans")


@pytest.fixture(scope="module")
def servers(crash_plans: Path) -> Iterator[dict[str, ServerProc]]:
    """Every server of the module, started at once (their start-ups overlap); the drain, deadline and
    crash tests each end theirs."""
    # (the drain and crash servers start their processes as batchc does: their tests check that every process they started is gone)
    started = {name: ServerProc(args, env={"BATCHC_DUMP_DIR": str(crash_plans)} if name == "crash" else None, real_children=name in ("drain", "crash"))
               for name, args in SERVERS.items()}
    try:
        yield {name: s.ready() for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture
def served(servers: dict[str, ServerProc]) -> ServerProc:
    return servers["api"]


def _client(server: ServerProc, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, **kw)  # type: ignore[arg-type]  # (timeout)


def _post(server: ServerProc, path: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=data, headers=AUTH if headers is None else headers, timeout=60)


def metrics(server: ServerProc) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=30).text
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(batchc_[a-z_]+(?:\{[^}]*\})?) (\S+)", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _settled(server: ServerProc, limit_s: float = 30.0) -> dict[str, float]:
    """The metrics once nothing is in flight or live in the engine."""
    deadline = time.monotonic() + limit_s
    while True:
        m = metrics(server)
        if m["batchc_requests_in_flight"] == m["batchc_requests_running"] == m["batchc_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"requests still in flight after {limit_s} s: {m}"
        time.sleep(0.05)


def _offline(tmp_path: Path, prompt: str, max_new_tokens: int, *, lines: list[dict[str, object]] | None = None,
             options: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """``batchc run`` of the same request (or of the workload ``lines``) with the server's model
    options and ``options`` (started now, read later: it runs while the server answers)."""
    lines = lines if lines is not None else [{"prompt": prompt, "max_new_tokens": max_new_tokens}]
    (tmp_path / "w.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return forkserver.Popen(
        [sys.executable, "-m", "compiler.cli", "run", "--workload", str(tmp_path / "w.jsonl"), "--outputs", str(tmp_path / "out.jsonl"),
         "--max-len", str(MAX_LEN), "--k", "2", "--max-running", "2", "--lossless-sample", "0", *options],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def _offline_lines(tmp_path: Path, proc: subprocess.Popen[str]) -> list[dict[str, object]]:
    """The ``--outputs`` lines of the run, by request id."""
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    outs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    return sorted(outs, key=lambda o: int(o["rid"]))


@pytest.fixture(scope="module")
def offline_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], list[dict[str, object]]]]:
    """One ``batchc run`` of every fixed workload line the API tests compare the server with (each a
    request of its own, with its own seed where it samples), started when the first of them asks:
    ``offline_runs(name)`` is that line's ``--outputs`` lines (one per completion)."""
    lines = {"greedy": {"prompt": PROMPT, "max_new_tokens": 24}, "sampled": {"prompt": PROMPT, "max_new_tokens": 24, **SAMPLED},
             "penalised": {"prompt": PROMPT, "max_new_tokens": 24, "temperature": 0, **PENALTIES}, "n": N_LINE,
             "logprobs": LOGPROBS_LINE}
    tmp = tmp_path_factory.mktemp("offline")
    proc = _offline(tmp, PROMPT, 24, lines=list(lines.values()))
    outs: list[dict[str, object]] = []

    def read(name: str) -> list[dict[str, object]]:
        if not outs:
            outs.extend(_offline_lines(tmp, proc))
        rid = list(lines).index(name)
        return [o for o in outs if int(o["rid"]) == rid]  # type: ignore[call-overload]  # (a JSON number)

    try:
        yield read
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _streamed(client: openai.OpenAI, **body: object) -> tuple[str, str | None, int]:
    """A streamed completion's text, last finish_reason and usage's completion tokens."""
    pieces, reasons, tokens = [], [], -1
    for chunk in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **body):  # type: ignore[call-overload]  # (body: the test's fields)
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert set(reasons[:-1]) <= {None}
    return "".join(pieces), reasons[-1], tokens


def _sse(lines: Iterator[str]) -> list[object]:
    """The data events of a stream, ``"[DONE]"`` as itself."""
    out: list[object] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_completion_is_batchc_runs_greedy_output_streaming_or_not(served: ServerProc, offline_runs: Callable[[str], list[dict[str, object]]]) -> None:
    client = _client(served)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (len(PROMPT), 24, len(PROMPT) + 24)
    (out,) = offline_runs("greedy")
    assert out["finish_reason"] == "length" and whole.choices[0].text == out["text"]
    pieces, usage, reasons = [], None, []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].text
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 24)


def test_a_stream_is_server_sent_events_ending_with_done(served: ServerProc) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert all(isinstance(c, dict) and c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks if isinstance(c, dict)}) == 1


def test_stop_strings_end_the_text_before_them(served: ServerProc) -> None:
    client = _client(served)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = text[12:15]
    cut = text.find(stop)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "\x00never"])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (text[:cut], "stop")
    assert whole.usage is not None and whole.usage.completion_tokens == len((text[:cut] + stop).encode())
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=stop, stream=True)
    chunks = [c.choices[0] for c in streamed]
    assert "".join(c.text for c in chunks) == text[:cut] and chunks[-1].finish_reason == "stop"


def test_a_stop_string_cuts_as_batchc_run_cuts_and_counts_as_finished(served: ServerProc, tmp_path: Path) -> None:
    """Online and offline cut at the same token with the same text (one ``StopScanner``); the engine
    finishes the request there (not aborted), and /metrics counts it finished."""
    client = _client(served)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = text[10:13]
    offline = _offline(tmp_path, PROMPT, 30, lines=[{"prompt": PROMPT, "max_new_tokens": 30, "stop": [stop, "\x00never"]}])
    before = _settled(served)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "\x00never"])
    streamed = _streamed(client, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "\x00never"])
    after = _settled(served)
    (out,) = _offline_lines(tmp_path, offline)
    assert out["finish_reason"] == "stop" and isinstance(out["output_ids"], list) and len(out["output_ids"]) < 30
    assert whole.usage is not None
    assert (whole.choices[0].text, whole.choices[0].finish_reason, whole.usage.completion_tokens) == (
        out["text"], "stop", len(out["output_ids"]))
    assert streamed == (out["text"], "stop", len(out["output_ids"]))
    outcomes = {o: after[f'batchc_requests_total{{outcome="{o}"}}'] - before[f'batchc_requests_total{{outcome="{o}"}}']
                for o in ("finished", "cancelled", "aborted")}
    assert outcomes == {"finished": 2, "cancelled": 0, "aborted": 0}
    assert after["batchc_ledger_outstanding_tickets"] == 0 and after["batchc_request_slots_live"] == 0


SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}
"""The seeded sampled request the server and ``batchc run`` must agree on (``whole`` below spells it out, for the client's types)."""


def test_a_seeded_sampled_request_is_batchc_runs_output_streaming_or_not(served: ServerProc,
                                                                         offline_runs: Callable[[str], list[dict[str, object]]]) -> None:
    """The same tokens as ``batchc run --workload`` with the same line and model options."""
    client = _client(served)
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=1234)
    streamed = _streamed(client, prompt=PROMPT, max_tokens=24, **SAMPLED)
    (out,) = offline_runs("sampled")
    assert whole.usage is not None
    assert (whole.choices[0].text, whole.choices[0].finish_reason, whole.usage.completion_tokens) == (
        out["text"], out["finish_reason"], len(out["output_ids"]))  # type: ignore[arg-type]  # (a JSON list)
    assert streamed == (whole.choices[0].text, whole.choices[0].finish_reason, whole.usage.completion_tokens)
    assert whole.choices[0].text != greedy  # (it sampled: this seed's tokens are not the greedy ones)


PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0}


def test_a_penalised_request_is_batchc_runs_output(served: ServerProc, offline_runs: Callable[[str], list[dict[str, object]]]) -> None:
    """The server keeps token counts: presence and frequency penalties change the tokens as they do
    in ``batchc run``."""
    penalties = PENALTIES
    client = _client(served)
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, **penalties)  # type: ignore[call-overload]  # (the test's fields)
    (out,) = offline_runs("penalised")
    assert whole.choices[0].text == out["text"] and whole.choices[0].text != greedy


N_LINE: dict[str, object] = {"prompt": PROMPT, "max_new_tokens": 24, "n": 3, "stop": ["\n"], **SAMPLED}
"""A seeded line of three completions whose stop string ends some of them and not the others."""


def _n_streamed(server: ServerProc, body: dict[str, object]) -> tuple[list[str], list[str | None], int, list[int]]:
    """A streamed request of ``n`` completions through the openai client: each choice's text and
    finish_reason, by index; usage's completion tokens; the choice index of every chunk, in order."""
    n = int(body["n"])  # type: ignore[call-overload]  # (an int, from the test)
    texts: list[str] = [""] * n
    reasons: list[str | None] = [None] * n
    order: list[int] = []
    tokens = -1
    for chunk in _client(server).completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **body):  # type: ignore[call-overload]  # (body: the test's fields)
        for choice in chunk.choices:
            assert reasons[choice.index] is None, "a chunk after its choice's finish_reason"
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason
            order.append(choice.index)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return texts, reasons, tokens, order


def test_n_seeded_completions_are_batchc_runs_lines_streaming_or_not(served: ServerProc,
                                                                     offline_runs: Callable[[str], list[dict[str, object]]]) -> None:
    """``n = 3``: the choices (index 0 to 2) are ``batchc run``'s three ``--outputs`` lines of the same
    workload line, each cut at its own stop string; usage counts every choice's tokens and the prompt
    once; a stream interleaves the choices' chunks as their tokens come and ends with one [DONE]."""
    body = {k: v for k, v in N_LINE.items() if k != "max_new_tokens"} | {"max_tokens": 24}
    _settled(served)  # (the api server keeps three completions in flight at most)
    whole = _post(served, "/v1/completions", {"model": MODEL, **body})
    assert whole.status_code == 200, whole.text
    streamed = _n_streamed(served, body)
    outs = offline_runs("n")
    assert [o["index"] for o in outs] == [0, 1, 2]
    want = [(o["text"], o["finish_reason"]) for o in outs]
    assert {r for _, r in want} == {"length", "stop"}  # (the stop string ends some choices, not all)
    answer = whole.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [(c["text"], c["finish_reason"]) for c in answer["choices"]] == want
    tokens = sum(len(o["output_ids"]) for o in outs)  # type: ignore[arg-type,misc]  # (JSON lists)
    assert answer["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": tokens, "total_tokens": len(PROMPT) + tokens}
    texts, reasons, streamed_tokens, order = streamed
    assert list(zip(texts, reasons, strict=True)) == want and streamed_tokens == tokens
    first = {i: order.index(i) for i in range(3)}
    last = {i: len(order) - 1 - order[::-1].index(i) for i in range(3)}
    assert max(first.values()) < min(last.values()), order  # (interleaved: every choice began before any ended)
    with httpx.stream("POST", f"{served.url}/v1/completions", json={"model": MODEL, **body, "stream": True}, headers=AUTH, timeout=60) as r:
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert sorted(c["choices"][0]["index"] for c in events[:-1] if isinstance(c, dict) and c["choices"][0]["finish_reason"]) == [0, 1, 2]


def test_n_completions_count_against_the_queue_and_are_all_released_on_a_disconnect(served: ServerProc) -> None:
    before = _settled(served)
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 1.0, "seed": 5, "n": 3, "stream": True}
    r = _post(served, "/v1/completions", dict(long, n=4))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # (over --max-running 2 + --max-waiting 1: never servable)
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{served.url}/v1/completions", json=dict(long, n=2), headers=AUTH) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")
        r = _post(served, "/v1/completions", long)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"  # (2 in flight + 3 > 3)
        assert metrics(served)["batchc_requests_running"] == 2
    after = _settled(served)
    assert after['batchc_requests_total{outcome="cancelled"}'] == before['batchc_requests_total{outcome="cancelled"}'] + 1
    assert after["batchc_ledger_outstanding_tickets"] == 0 and after["batchc_request_slots_live"] == 0


LOGPROBS_LINE: dict[str, object] = {"prompt": PROMPT, "max_new_tokens": 24, "logprobs": 3, "stop": ["."], **SAMPLED}
"""A seeded line with logprobs (three alternatives) whose stop string cuts it."""


def _byte_text(token: int) -> str:
    return bytes((token,)).decode("utf-8", errors="replace")


def _legacy(entries: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``batchc run``'s logprob entries in /v1/completions' format (``top_logprobs``: a text's likelier id)."""
    tokens = [_byte_text(int(e["id"])) for e in entries]
    tops = []
    for e in entries:
        top: dict[str, object] = {}
        for alt in e["top"]:
            top.setdefault(_byte_text(alt["id"]), alt["logprob"])
        tops.append(top)
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries], "top_logprobs": tops, "text_offset": offsets}


def _close(got: object, want: object) -> bool:
    """Equal, floats to 1e-4 (a logprob's last bits depend on the batch it was computed in)."""
    if isinstance(want, float) and isinstance(got, float):
        return abs(got - want) <= 1e-4
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict) and isinstance(got, dict):
        return list(got) == list(want) and all(_close(got[k], w) for k, w in want.items())
    return got == want


def test_logprobs_are_batchc_runs_cut_at_the_stop_string_streaming_or_not(served: ServerProc,
                                                                          offline_runs: Callable[[str], list[dict[str, object]]]) -> None:
    """/v1/completions' ``logprobs: 3``: the tokens' texts, logprobs and top three alternatives of
    ``batchc run --outputs``, up to the token that completed the stop string, whole and streamed
    (the chunks' pieces joined, ``text_offset`` running on)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "logprobs": 3, "stop": ["."], **SAMPLED}
    whole = _post(served, "/v1/completions", body)
    assert whole.status_code == 200, whole.text
    merged: dict[str, list[object]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pieces = []
    with httpx.stream("POST", f"{served.url}/v1/completions", json=dict(body, stream=True), headers=AUTH, timeout=60) as r:
        for event in _sse(r.iter_lines()):
            if isinstance(event, dict) and event["choices"]:
                choice = event["choices"][0]
                pieces.append(choice["text"])
                for key, values in (choice["logprobs"] or {}).items():
                    merged[key] += values
    (out,) = offline_runs("logprobs")
    entries = out["logprobs"]
    assert isinstance(entries, list) and out["finish_reason"] == "stop" and len(entries) == len(out["output_ids"]) < 24  # type: ignore[arg-type]  # (JSON)
    assert [e["id"] for e in entries] == out["output_ids"]
    want = _legacy(entries)
    choice = whole.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (out["text"], "stop")
    assert choice["logprobs"]["tokens"] == want["tokens"] and _close(choice["logprobs"], want), (choice["logprobs"], want)
    assert "".join(pieces) == out["text"]
    assert merged["tokens"] == want["tokens"] and _close(merged, want), (merged, want)
    # through the openai client's types
    typed = _client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, logprobs=3, stop=["."], temperature=1.0,
                                               top_p=0.9, seed=1234).choices[0].logprobs
    assert typed is not None and typed.tokens == want["tokens"] and typed.text_offset == want["text_offset"]
    assert _close(typed.token_logprobs, want["token_logprobs"]) and _close(typed.top_logprobs, want["top_logprobs"])


def test_logprobs_and_n_out_of_range_are_400_naming_the_field(served: ServerProc) -> None:
    completion = {"model": MODEL, "prompt": "a", "max_tokens": 2}
    for extra, param in (({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 2.0}, "n"), ({"n": True}, "n"), ({"logprobs": 21}, "logprobs"),
                         ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"logprobs": 1.5}, "logprobs"),
                         ({"best_of": 2}, "best_of")):
        r = _post(served, "/v1/completions", completion | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
                         ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 2}, "logprobs"), ({"n": 17}, "n")):
        r = _post(served, "/v1/chat/completions", chat | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    # in range, a chat body is taken (and refused only for the bundled model's missing chat template)
    r = _post(served, "/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 20, "n": 3})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"


def test_unseeded_requests_derive_their_seeds_from_the_servers_seed_in_arrival_order(servers: dict[str, ServerProc],
                                                                                  tmp_path: Path) -> None:
    """``--seed`` and the sampling defaults as ``batchc run``'s: the server's n-th accepted request
    (0 first) samples as the workload's n-th line, without a seed or a temperature of its own."""
    server = servers["sampled"]
    lines: list[dict[str, object]] = [{"prompt": PROMPT, "max_new_tokens": 16}, {"prompt": PROMPT, "max_new_tokens": 16}]
    offline = _offline(tmp_path, PROMPT, 16, lines=lines, options=SAMPLED_OPTIONS)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    online = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16).choices[0].text for _ in lines]
    outs = _offline_lines(tmp_path, offline)
    assert online == [o["text"] for o in outs]
    assert online[0] != online[1]  # (two seeds: request ids 0 and 1)


def test_chat_without_a_template_is_refused_naming_it(served: ServerProc) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _client(served).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "messages" and error["code"] == "no_chat_template"
    assert "chat template" in error["message"]


def test_models_and_health(served: ServerProc) -> None:
    models = _client(served).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{served.url}/health", timeout=30).status_code == 200  # (no key needed)


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"model": "batchc-bundled", "prompt": "a", "temperature": NaN}', 400, None),
    ({"model": "batchc-bundled", "prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "batchc-bundled", "prompt": "a", "max_tokens": 2.0}, 400, "max_tokens"),
    ({"model": "batchc-bundled", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "batchc-bundled", "prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"model": "batchc-bundled", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"model": "batchc-bundled", "prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"model": "batchc-bundled", "prompt": "a", "stop": [""]}, 400, "stop"),
    ({"model": "batchc-bundled", "prompt": "a", "n": 17}, 400, "n"),
    ({"model": "batchc-bundled", "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"model": "batchc-bundled", "prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": "batchc-bundled", "prompt": 5}, 400, "prompt"),
    ({"model": "batchc-bundled", "prompt": [1, 300]}, 400, "prompt"),
    ({"model": "batchc-bundled", "prompt": "x" * MAX_LEN}, 400, "prompt"),
    ({"model": "batchc-bundled", "prompt": "a", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ({"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ({"prompt": "a"}, 400, "model"),
]


def test_bad_requests_get_the_openai_error_naming_the_field(served: ServerProc) -> None:
    for body, status, param in BAD:
        r = _post(served, "/v1/completions", body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
        assert "Traceback" not in r.text
    assert _post(served, "/v1/completions", {"model": MODEL, "prompt": "x" * MAX_LEN}).json()["error"]["code"] == "context_length_exceeded"
    r = httpx.get(f"{served.url}/v1/completions", headers=AUTH, timeout=30)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(f"{served.url}/v2/nothing", headers=AUTH, timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        _client(served).completions.create(model="other", prompt="a")


def test_an_api_key_guards_every_route_but_health(served: ServerProc) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        r = _post(served, "/v1/completions", body, headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        assert httpx.get(f"{served.url}/metrics", headers=headers, timeout=30).status_code == 401
        assert httpx.get(f"{served.url}/v1/models", headers=headers, timeout=30).status_code == 401
    assert httpx.get(f"{served.url}/health", timeout=30).status_code == 200
    assert _post(served, "/v1/completions", body).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="nope", max_retries=0).models.list()


def test_a_full_queue_is_503_at_once_and_disconnected_requests_are_released(served: ServerProc) -> None:
    before = _settled(served)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
    with contextlib.ExitStack() as stack:
        streams = []
        for _ in range(3):  # --max-running 2 + --max-waiting 1
            c = stack.enter_context(httpx.Client(timeout=60))
            streams.append(stack.enter_context(c.stream("POST", f"{served.url}/v1/completions", json=body, headers=AUTH)))
        assert [s.status_code for s in streams] == [200] * 3
        lines = streams[0].iter_lines()  # (kept: an abandoned iterator closes the response)
        assert next(lines).startswith("data: ")  # (decoding: the requests are in the engine)
        t0 = time.monotonic()
        r = _post(served, "/v1/completions", body)
        assert r.status_code == 503 and time.monotonic() - t0 < 5.0
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "service_unavailable"
        m = metrics(served)
        assert m["batchc_requests_in_flight"] == 3, m
    # the three clients went away mid-stream (one still waiting for a place): each is aborted and released
    after = _settled(served)
    assert after['batchc_requests_total{outcome="cancelled"}'] == before['batchc_requests_total{outcome="cancelled"}'] + 3
    assert after["batchc_ledger_outstanding_tickets"] == 0
    assert after["batchc_request_slots_live"] == 0
    assert after['batchc_rejected_requests_total{status="503"}'] >= 1
    # a client that stops waiting for a whole (non-streamed) answer is released too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json=dict(body, stream=False), headers=AUTH, timeout=httpx.Timeout(60, read=0.5))
    final = _settled(served)
    assert final['batchc_requests_total{outcome="cancelled"}'] == after['batchc_requests_total{outcome="cancelled"}'] + 1
    assert final["batchc_ledger_outstanding_tickets"] == 0 and final["batchc_request_slots_live"] == 0
    assert final["batchc_time_to_first_token_seconds_count"] >= 1 and final["batchc_generation_tokens_total"] > 0


def test_sigterm_drains_and_exits_zero_with_one_line(servers: dict[str, ServerProc]) -> None:
    server = servers["drain"]
    assert server.children  # (its engine process)
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
        done = httpx.post(f"{server.url}/v1/completions", json=dict(body, stream=False, max_tokens=4), timeout=60)
        assert done.status_code == 200
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            server.proc.send_signal(signal.SIGTERM)
            health = httpx.get(f"{server.url}/health", timeout=30)
            refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            events = _sse(iter([first, *lines]))
        assert health.status_code == 503 and refused.status_code == 503
        assert refused.json()["error"]["message"] == "the server is shutting down"
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert isinstance(last, dict) and last["choices"][0]["finish_reason"] in ("abort", "length")
        assert server.wait() == 0
        aborted = 1 if last["choices"][0]["finish_reason"] == "abort" else 0
        assert server.lines[-1] == (f"batchc serve: stopped by SIGTERM: {2 - aborted} requests finished, {aborted} aborted; "
                                    "0 outstanding tickets"), server.lines[-3:]
        assert not any(alive(p) for p in server.children)
    finally:
        server.stop()


def test_a_request_past_its_deadline_is_aborted(servers: dict[str, ServerProc]) -> None:
    server = servers["deadline"]
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with httpx.stream("POST", f"{server.url}/v1/completions", json=dict(body, stream=True), timeout=60) as s:
            events = _sse(s.iter_lines())
        assert events[-1] == "[DONE]"
        assert isinstance(events[-2], dict) and events[-2]["error"]["code"] == "request_timeout"
        m = _settled(server)
        assert m['batchc_requests_total{outcome="timeout"}'] == 2 and m["batchc_ledger_outstanding_tickets"] == 0
    finally:
        server.stop()


ONE_TOKEN = "Quiet cat"
"""9 bytes: no prefix-cache hit can reach it (prefixes are cached at multiples of 16 tokens, strictly
shorter than the prompt), so every time it is served its slot starts from its prefill's clear."""


def _first_chunks(plans: Path, first: int) -> list[tuple[int, int, bool]]:
    """``(slot, extend tokens, cleared by the plan's target ticket)`` of every dumped lowered plan's row
    that starts a prompt whose first token is ``first`` (prefix 0), in the order the plans ran."""
    rows = []
    for path in sorted(plans.glob("*-lower.txt")):
        text = path.read_text()
        for m in re.finditer(rf"^  r\d+ s(\d+) prefix=0 extend=(\d+)\b.* tokens=\[{first}\b", text, re.M):
            slot = int(m.group(1))
            rows.append((slot, int(m.group(2)), re.search(rf"ticket op=init #\d+ clear\[[^]]*\bs{slot}\b[^]]*\] cow\[\] pool=target", text) is not None))
    return rows


def test_a_one_token_first_chunk_in_a_freed_slot_is_a_prefill_and_serves_as_on_a_fresh_engine(servers: dict[str, ServerProc],
                                                                                             crash_plans: Path) -> None:
    """Scenario 6 through ``batchc serve`` (vLLM PR #32118, a new request given one token by the token
    budget was run as a decode on its slot's leftovers; ``tests/scenarios/test_one_token_first_chunk_is_a_prefill.py``
    at the IR and engine levels): on a server whose token budget is one prefill token per step, the
    prompt served first (its slot never held a state: what a fresh engine serves), then another prompt
    in the slot it freed, then the first prompt again in the slot the other just freed (freed slots are
    handed out last freed first). The dumped plans show each first chunk as one token at prefix 0 with
    its slot's clear, and the second serving's text equals the first's."""
    server = servers["crash"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    texts = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in (ONE_TOKEN, "Seven", ONE_TOKEN)]
    assert texts[2] == texts[0] and texts[0]
    first, again = _first_chunks(crash_plans, ord(ONE_TOKEN[0]))
    (between,) = _first_chunks(crash_plans, ord("S"))
    assert first == (first[0], 1, True) and again == (between[0], 1, True) and between == (first[0], 1, True), (first, between, again)


def test_an_engine_crash_is_503_and_a_non_zero_exit(servers: dict[str, ServerProc]) -> None:
    server = servers["crash"]
    assert server.engine_pid in server.children
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            os.kill(server.engine_pid, signal.SIGKILL)
            events = _sse(iter([first, *lines]))
        assert events[-1] == "[DONE]"
        assert isinstance(events[-2], dict) and events[-2]["error"]["code"] == "service_unavailable"
        assert server.wait() == 1
        assert "the engine process killed by signal 9" in server.lines[-1], server.lines[-3:]
        assert not any(alive(p) for p in server.children)
    finally:
        server.stop()

