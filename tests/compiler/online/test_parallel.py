"""``batchc serve --tp 2`` and ``--dp 2`` end to end: greedy completions (whole and streamed, through
the real ``openai`` client) equal ``batchc run``'s on the same model and options; the requests of
the ``--dp`` server are dealt to both replicas; SIGTERM drains and exits 0 with the summary line,
every child process (the tensor-parallel worker, the replicas) gone. One server per configuration,
started at once with the offline run they are compared with (module fixture); the router's choice
and the refused combinations are checked in process."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs
import httpx
import pytest

from compiler.online.messages import Launch
from compiler.online.router import choose
from tests import forkserver
from tests.compiler.cli.test_lifetimes import alive
from tests.compiler.online.server_proc import ROOT, ServerProc
from tests.helpers import run_cli
from tests.lazy import lazy

if TYPE_CHECKING:
    import openai
else:
    openai = lazy("openai")  # (a second to import: only the worker that runs these tests pays it)

MODEL = "batchc-bundled"
MAX_LEN = 256
PROMPTS = ("The history of the ", "A river runs through ")
NEW = 24
OPTIONS = ["--max-len", str(MAX_LEN), "--k", "2", "--max-running", "2"]
SERVERS = {"tp": [*OPTIONS, "--tp", "2", "--drain-timeout", "0.5"], "dp": [*OPTIONS, "--dp", "2", "--drain-timeout", "0.5"]}


@attrs.frozen
class Started:
    servers: dict[str, ServerProc]
    offline: list[str]
    """``batchc run``'s text of each of ``PROMPTS``, greedy, ``NEW`` tokens, with the servers' model options."""


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    tmp = tmp_path_factory.mktemp("parallel")
    (tmp / "w.jsonl").write_text("".join(json.dumps({"prompt": p, "max_new_tokens": NEW}) + "\n" for p in PROMPTS))
    offline = forkserver.Popen(
        [sys.executable, "-m", "compiler.cli", "run", "--workload", str(tmp / "w.jsonl"), "--outputs", str(tmp / "out.jsonl"),
         "--lossless-sample", "0", *OPTIONS],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    servers = {name: ServerProc(args, real_children=True) for name, args in SERVERS.items()}  # (a test reads their process trees)
    try:
        _, err = offline.communicate(timeout=180)
        assert offline.returncode == 0, err[-2000:]
        lines = sorted((json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()), key=lambda o: int(o["rid"]))
        assert [o["finish_reason"] for o in lines] == ["length"] * len(PROMPTS)
        yield Started({name: s.ready() for name, s in servers.items()}, [str(o["text"]) for o in lines])
    finally:
        offline.kill()
        for s in servers.values():
            s.stop()


def _client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _streamed(client: openai.OpenAI, prompt: str) -> tuple[str, int]:
    pieces, tokens = [], -1
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(pieces), tokens


def _metric(server: ServerProc, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m is not None, name
    return float(m.group(1))


@pytest.mark.parametrize("name", ["tp", "dp"])
def test_greedy_completions_are_batchc_runs_streaming_or_not(started: Started, name: str) -> None:
    server = started.servers[name]
    client = _client(server)
    for prompt, offline in zip(PROMPTS, started.offline, strict=True):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0)
        assert whole.usage is not None and whole.usage.completion_tokens == NEW
        assert (whole.choices[0].text, whole.choices[0].finish_reason) == (offline, "length")
        assert _streamed(client, prompt) == (offline, NEW)
    if name == "dp":  # one request at a time: each found both replicas idle, and they were dealt out in turn
        assert [_metric(server, f'batchc_replica_requests_total{{replica="{i}"}}') for i in (0, 1)] == [2.0, 2.0]
    assert _metric(server, "batchc_ledger_outstanding_tickets") == 0


@pytest.mark.parametrize("name", ["tp", "dp"])
def test_sigterm_drains_and_exits_zero_with_every_child_gone(started: Started, name: str) -> None:
    server = started.servers[name]
    assert len(server.children) >= 2  # (tp: the engine process and its worker rank; dp: two engine processes)
    before = int(_metric(server, 'batchc_requests_total{outcome="finished"}'))
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_LEN - 3 - len(PROMPTS[0]), "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(lines)
        server.proc.send_signal(signal.SIGTERM)
        rest = [first, *lines]
    events = [line[len("data: "):] for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    reason = json.loads(events[-2])["choices"][0]["finish_reason"]
    assert reason in ("abort", "length")
    assert server.wait() == 0
    aborted = 1 if reason == "abort" else 0
    assert server.lines[-1] == (f"batchc serve: stopped by SIGTERM: {before + 1 - aborted} requests finished, {aborted} aborted; "
                                "0 outstanding tickets"), server.lines[-3:]
    assert not any(alive(p) for p in server.children)


def test_the_router_deals_to_the_least_loaded_replica_ties_in_turn() -> None:
    turn, dealt = 0, []
    for _ in range(4):  # all idle: in turn
        dealt.append(choose([0, 0, 0], turn))
        turn = (dealt[-1] + 1) % 3
    assert dealt == [0, 1, 2, 0]
    assert choose([2, 1, 3], 0) == 1 and choose([1, 1, 0], 0) == 2
    assert [choose([1, 1, 1], t) for t in range(3)] == [0, 1, 2] and choose([1, 0, 0], 0) == 1 and choose([0, 1, 0], 2) == 2
    with pytest.raises(ValueError, match="turn 3 is not an index of 3 replicas"):
        choose([0, 0, 0], 3)


def test_the_tp_timeout_default_is_batchc_runs() -> None:
    from compiler.offline.distributed import TP_TIMEOUT_S

    assert attrs.fields(Launch).tp_timeout.default == TP_TIMEOUT_S


@pytest.mark.parametrize(("args", "message"), [
    (["--tp", "2", "--dp", "2"], "--dp 2 with --tp: each replica is one plain engine process"),
    (["--dp", "2", "--overlap"], "--dp 2 with --overlap: each replica is one plain engine process"),
    (["--tp", "2", "--overlap"], "--tp 2 with --overlap: a tensor-parallel engine serves on the group only"),
    (["--tp-timeout", "5"], "--tp-timeout 5 without --tp: an engine on one process has no group to time out"),
])
def test_bad_parallel_options_are_refused_in_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["serve", "--port", "0", *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"batchc: error: {message}"]
