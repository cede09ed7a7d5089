"""The online server's parts without a server: request checks (``protocol``), stop strings on
detokenised text (``text``), chat templates in the sandbox (``chat``), and the engine loop's
messages (``engine_process.Loop`` on a real engine, through a pipe)."""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path

import pytest

from compiler.offline.tokenizer import ByteTokenizer
from compiler.online.chat import ChatTemplate
from compiler.online.protocol import ApiError, ChatMessage, check_context, load_json, parse_request
from compiler.online.text import TextStream


def _parse(body: dict[str, object], kind: str = "completion") -> object:
    return parse_request(body, kind, model="m")  # type: ignore[arg-type]  # (kind: a Literal)


def _refused(body: dict[str, object], kind: str = "completion") -> ApiError:
    with pytest.raises(ApiError) as caught:
        _parse(body, kind)
    return caught.value


def test_openai_names_become_sampling_params() -> None:
    req = parse_request({"model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.1,
                         "seed": 11, "presence_penalty": 1, "frequency_penalty": -1, "repetition_penalty": 1.2, "stop": "x",
                         "stop_token_ids": [3], "ignore_eos": True, "min_tokens": 2, "n": 1, "stream": True,
                         "stream_options": {"include_usage": True}, "user": "u", "logprobs": None}, "completion", model="m")
    s = req.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (7, 0.5, 0.9, 3, 0.1, 11)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.stop, s.stop_token_ids) == (1.0, -1.0, 1.2, ("x",), (3,))
    assert (s.ignore_eos, s.min_tokens, req.stream, req.include_usage, req.prompt) == (True, 2, True, True, "hi")


@pytest.mark.parametrize(("body", "param", "status"), [
    ({"model": "m", "prompt": "a", "temperature": True}, "temperature", 400),
    ({"model": "m", "prompt": "a", "top_k": 2.0}, "top_k", 400),
    ({"model": "m", "prompt": "a", "seed": -1}, "seed", 400),
    ({"model": "m", "prompt": "a", "presence_penalty": 3}, "presence_penalty", 400),
    ({"model": "m", "prompt": "a", "min_tokens": 99}, "min_tokens", 400),
    ({"model": "m", "prompt": "a", "stop": ["a"] * 17}, "stop", 400),
    ({"model": "m", "prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", 400),
    ({"model": "m", "prompt": "a", "echo": True}, "echo", 400),
    ({"model": "m", "prompt": "a", "logit_bias": {"1": 2}}, "logit_bias", 400),
    ({"model": "m", "prompt": "a", "n": 0}, "n", 400),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt", 400),
    ({"model": "m", "prompt": [True]}, "prompt", 400),
    ({"model": "m", "prompt": []}, "prompt", 400),
    ({"model": "n", "prompt": "a"}, "model", 404),
])
def test_bad_fields_are_named(body: dict[str, object], param: str, status: int) -> None:
    error = _refused(body)
    assert (error.status, error.param) == (status, param)
    assert error.body()["error"]["param"] == param  # type: ignore[index]  # (a dict of dicts)


def test_chat_bodies() -> None:
    req = parse_request({"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                        {"type": "text", "text": "b"}]}], "max_completion_tokens": 5}, "chat", model="m")
    assert req.messages == (ChatMessage(role="system", content="s"), ChatMessage(role="user", content="ab"))
    assert req.sampling.max_new_tokens == 5 and req.max_tokens_given
    assert _refused({"model": "m", "messages": []}, "chat").param == "messages"
    assert _refused({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "chat").param == "messages[0].role"
    assert _refused({"model": "m", "messages": [{"role": "user", "content": 3}]}, "chat").param == "messages[0].content"
    assert _refused({"model": "m", "prompt": "a", "messages": []}, "completion").param == "messages"  # (an unknown field there)


def test_the_context_bounds_the_new_tokens() -> None:
    req = parse_request({"model": "m", "prompt": "a"}, "completion", model="m")
    assert check_context(req, 10, max_len=20, reserve=3).max_new_tokens == 7  # (the default 16, cut to the room)
    chat = parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "chat", model="m")
    assert check_context(chat, 10, max_len=64, reserve=3).max_new_tokens == 51  # (no limit given: the room)
    given = parse_request({"model": "m", "prompt": "a", "max_tokens": 8}, "completion", model="m")
    with pytest.raises(ApiError) as caught:
        check_context(given, 10, max_len=20, reserve=3)
    assert (caught.value.param, caught.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(ApiError) as caught:
        check_context(given, 17, max_len=20, reserve=3)
    assert caught.value.param == "prompt"


@pytest.mark.parametrize("body", [b"\xff", b"{", b"NaN", b'{"a": Infinity}', b"[]", b'"x"', b"[" * 100_000])
def test_json_that_is_not_an_object_is_400(body: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        load_json(body)
    assert caught.value.status == 400


def _stream(text: str, stops: list[str], split: int, min_tokens: int = 0) -> tuple[list[str], TextStream]:
    """``text``'s bytes pushed ``split`` at a time."""
    ts = TextStream(ByteTokenizer(), stops, min_tokens=min_tokens)
    ids = list(text.encode())
    pieces = [ts.push(ids[i : i + split]) for i in range(0, len(ids), split)]
    return pieces + [ts.finish()], ts


@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_a_stop_string_split_across_tokens_ends_the_text_before_it(split: int) -> None:
    pieces, ts = _stream("hello wor|ld and more", ["|ld", "zzz"], split)
    assert "".join(pieces) == "hello wor" and ts.stopped
    assert ts.tokens <= len("hello wor|ld") + split - 1 and ts.tokens >= len("hello wor|ld")
    assert not any("|" in p for p in pieces)
    pieces, ts = _stream("héllo wörld", ["zz"], split)  # no stop: everything, multi-byte characters whole
    assert "".join(pieces) == "héllo wörld" and not ts.stopped and ts.tokens == len("héllo wörld".encode())
    pieces, ts = _stream("abcabc", ["ca", "b"], split)  # the first stop in the text wins
    assert "".join(pieces) == "a"
    pieces, ts = _stream("ab|cd|ef", ["|"], split, min_tokens=4)  # as vLLM: a stop string counts from min_tokens tokens on
    assert "".join(pieces) == "ab|cd" and ts.tokens == len("ab|cd|")


@pytest.mark.parametrize("split", [1, 2, 5])
@pytest.mark.parametrize(("text", "stops", "min_tokens"), [
    ("hello wor|ld and more", ["|ld", "zzz"], 0), ("hé|llo wö|rld", ["ö|", "|"], 3), ("no stop here", ["x"], 0), ("aaaa", ["aa"], 3),
])
def test_the_stream_cuts_where_the_offline_runner_cuts(text: str, stops: list[str], min_tokens: int, split: int) -> None:
    """Online and ``batchc run`` (``compiler.offline.stops.scan``, its ``--outputs`` text) keep the
    same ids and show the same text, however the ids arrive."""
    from compiler.offline.stops import scan

    ids = list(text.encode())
    cut = scan(ByteTokenizer(), stops, ids, min_tokens=min_tokens)
    pieces, ts = _stream(text, stops, split, min_tokens)
    assert "".join(pieces) == (cut.text if cut is not None else text)
    assert (ts.stopped, ts.tokens) == ((True, cut.keep) if cut is not None else (False, len(ids)))


def _template(tmp_path: Path, template: object, **extra: object) -> ChatTemplate | None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **extra}))
    return ChatTemplate.load(str(tmp_path))


def test_chat_templates_render_in_the_sandbox(tmp_path: Path) -> None:
    t = _template(tmp_path, "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}", bos_token={"content": "<s>"}, eos_token="</s>")
    assert t is not None
    msgs = [ChatMessage(role="user", content="hi")]
    assert t.render(msgs, add_generation_prompt=True) == "<s><user>hi\n<assistant>"
    assert t.render(msgs, add_generation_prompt=False) == "<s><user>hi\n"
    refusing = _template(tmp_path, "{{ raise_exception('only user turns') }}")
    assert refusing is not None
    with pytest.raises(ApiError) as caught:
        refusing.render(msgs, add_generation_prompt=True)
    assert "only user turns" in caught.value.message
    escaping = _template(tmp_path, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    assert escaping is not None
    with pytest.raises(ApiError):
        escaping.render(msgs, add_generation_prompt=True)
    mutating = _template(tmp_path, "{{ messages.append(1) }}")
    assert mutating is not None
    with pytest.raises(ApiError):
        mutating.render(msgs, add_generation_prompt=True)
    named = _template(tmp_path, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert named is not None and named.render(msgs, add_generation_prompt=True) == "D"
    assert _template(tmp_path, None) is None
    assert ChatTemplate.load(None) is None and ChatTemplate.load(str(tmp_path / "nowhere")) is None


def test_the_engine_loop_streams_tokens_aborts_and_closes_drained() -> None:
    from compiler.engine.config import ServeConfig
    from compiler.online import engine_process
    from compiler.online.messages import Abort, Closed, Ended, Finish, Launch, Shutdown, StepOut, Submit
    from ir.sampling import SamplingParams

    launch = Launch(model=None, draft=None, k=0, dtype="float32", max_running=2, max_len=64, overlap=False, threads=1,
                    chunk_size=ServeConfig().chunk_size, token_budget=ServeConfig().token_budget, cache_entries=2)
    engine, ready, cfg, _ = engine_process.build(launch)
    assert (ready.vocab, ready.k, ready.reserve, ready.max_len, ready.hf_dir) == (256, 0, 1, 64, None)
    ours, theirs = multiprocessing.Pipe()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    for rid in (0, 1, 2):
        ours.send(Submit(rid=rid, prompt=tuple(b"abc"), max_new_tokens=6, stop=(), sampling=greedy))
    ours.send(Abort(2))  # read in the same batch as its Submit: still queued behind the two running
    ours.send(Submit(rid=3, prompt=tuple(b"abc"), max_new_tokens=40, stop=(), sampling=greedy))
    loop = engine_process.Loop(engine, theirs, cfg.max_running)
    runner = threading.Thread(target=loop.run)
    runner.start()
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: [], 3: []}
    ended: dict[int, Ended] = {}
    while len(ended) < 4:
        assert ours.poll(60), "the engine loop went quiet"
        out = ours.recv()
        assert isinstance(out, StepOut)
        for d in out.deltas:
            assert d.rid not in ended
            if d.rid == 3 and not tokens[3]:
                ours.send(Finish(3, 1))  # a stop string in its first token's text: finished there, not aborted
            tokens[d.rid] += d.ids
        for e in out.ended:
            tokens[e.rid] += e.ids
            ended[e.rid] = e
    ours.send(Shutdown())
    runner.join(60)
    while True:
        last = ours.recv()
        if not isinstance(last, StepOut):
            break
    assert isinstance(last, Closed) and (last.outstanding_tickets, last.slots_live, last.kv_live) == (0, 0, 0)
    assert (ended[2].reason, tokens[2]) == ("abort", [])
    assert ended[0].reason == ended[1].reason == "length"
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]
    assert ended[3].reason == "stop" and 1 <= len(tokens[3]) < 40 and tokens[3] == tokens[0][: len(tokens[3])]
    assert engine.stats.aborts == 0  # rid 2 was taken from the loop's queue, never admitted; rid 3 was finished


def test_a_taken_port_is_refused_in_one_line_before_anything_starts() -> None:
    import socket

    from compiler.online.server import listen
    from compiler.workload import ServeError

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(ServeError, match=r"^cannot listen on 127\.0\.0\.1:\d+: Address already in use$"):
            listen("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()
    with pytest.raises(ServeError, match="cannot listen on no.such.host.invalid:0"):
        listen("no.such.host.invalid", 0)
    free = listen("127.0.0.1", 0)
    assert free.getsockname()[0] == "127.0.0.1"
    free.close()


def test_the_http_side_imports_no_torch() -> None:
    """``batchc serve``'s HTTP process (the command line, the server module, its tokenizer and stop
    strings) loads without torch: only the engine process pays for it."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    code = ("import sys, compiler.cli, compiler.cli.serve, compiler.online.server, compiler.online.engine_client, compiler.online.router; "
            "import compiler.offline.stops, compiler.offline.tokenizer, compiler.engine.config; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('backend.', 'compiler.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # and the names the packages export still load on first use
    code = "import compiler.engine as e, compiler.offline as s; print(e.Engine.__name__, s.ServeConfig is e.ServeConfig, s.serve.__module__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.split()) == (0, ["Engine", "True", "compiler.offline.run"]), done.stderr[-2000:]


def _answer(kind: str) -> object:
    from compiler.online.server import _Answer
    from compiler.online.text import token_text

    tok = ByteTokenizer()
    return _Answer(kind=kind, model="m", prompt_tokens=4, include_usage=False, logprobs=True,  # type: ignore[arg-type]  # (kind: a Literal)
                   token_text=lambda t: token_text(tok, t))


def test_logprobs_in_both_endpoints_formats() -> None:
    """The engine's entries (``TokenLogprob``) as /v1/completions (legacy: texts, ``{text: logprob}``
    keeping a text's likelier id, ``text_offset`` running on across chunks) and as
    /v1/chat/completions (``content``: ``token``, ``logprob``, ``bytes``, ``top_logprobs``) write
    them; a byte that is not a whole character is U+FFFD with its byte; -inf is -9999.0."""
    from compiler.online.messages import TokenLogprob
    from compiler.online.server import _Choice, _Piece

    entries = (TokenLogprob(104, -0.5, ((104, -0.5), (0xE2, -1.0), (0xE3, -2.0))), TokenLogprob(0xE2, float("-inf"), ()),
               TokenLogprob(105, -0.25, ((105, -0.25),)))
    chat = _answer("chat")
    choice = _Choice(index=1, text=TextStream(ByteTokenizer(), ()))
    choice.text.push([104, 0xE2, 105])
    choice.logprobs.extend(entries)
    choice.reason = "length"
    whole = chat.whole([choice])  # type: ignore[attr-defined]  # (_Answer)
    assert whole["choices"][0]["logprobs"] == {"content": [
        {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": [
            {"token": "h", "logprob": -0.5, "bytes": [104]}, {"token": "\ufffd", "logprob": -1.0, "bytes": [0xE2]},
            {"token": "\ufffd", "logprob": -2.0, "bytes": [0xE3]}]},
        {"token": "\ufffd", "logprob": -9999.0, "bytes": [0xE2], "top_logprobs": []},
        {"token": "i", "logprob": -0.25, "bytes": [105], "top_logprobs": [{"token": "i", "logprob": -0.25, "bytes": [105]}]},
    ]}
    assert whole["choices"][0]["index"] == 1 and whole["usage"]["completion_tokens"] == 3
    completion = _answer("completion")
    streamed = _Choice(index=0, text=TextStream(ByteTokenizer(), ()))
    first = completion.piece(streamed, _Piece(0, "h", entries[:2]))  # type: ignore[attr-defined]  # (_Answer)
    second = completion.piece(streamed, _Piece(0, "\ufffdi", entries[2:]))  # type: ignore[attr-defined]  # (_Answer)
    assert first["choices"][0]["logprobs"] == {"tokens": ["h", "\ufffd"], "token_logprobs": [-0.5, -9999.0],
                                               "top_logprobs": [{"h": -0.5, "\ufffd": -1.0}, {}], "text_offset": [0, 1]}
    assert second["choices"][0]["logprobs"] == {"tokens": ["i"], "token_logprobs": [-0.25], "top_logprobs": [{"i": -0.25}],
                                                "text_offset": [2]}


def test_the_engine_loop_serves_n_completions_with_logprobs() -> None:
    """A request of ``n = 2`` sampled completions with logprobs: each completion's ``Delta`` and
    ``Ended`` under its own id, one logprob entry per id (of that id); ``Finish`` ends one
    completion alone; ``Abort`` of a request ends both of its completions; nothing is left."""
    from compiler.engine.config import ServeConfig
    from compiler.online import engine_process
    from compiler.online.engine_client import completion_ids
    from compiler.online.messages import Abort, Closed, Delta, Ended, Finish, Launch, Shutdown, StepOut, Submit
    from ir.sampling import SamplingParams

    launch = Launch(model=None, draft=None, k=2, dtype="float32", max_running=4, max_len=64, overlap=False, threads=1,
                    chunk_size=ServeConfig().chunk_size, token_budget=ServeConfig().token_budget, cache_entries=2)
    engine, _, cfg, _ = engine_process.build(launch)
    ours, theirs = multiprocessing.Pipe()
    sampled = SamplingParams(temperature=1.0, seed=3, max_new_tokens=12, n=2, logprobs=2)
    first, second = completion_ids(0, 2), completion_ids(1, 2)
    assert first[0] == 0 and len(set(first) | set(second)) == 4
    ours.send(Submit(rid=0, prompt=tuple(b"abcd"), max_new_tokens=12, stop=(), sampling=sampled, forks=first[1:]))
    ours.send(Submit(rid=1, prompt=tuple(b"abcd"), max_new_tokens=40, stop=(), sampling=sampled, forks=second[1:]))
    loop = engine_process.Loop(engine, theirs, cfg.max_running)
    runner = threading.Thread(target=loop.run)
    runner.start()
    tokens: dict[int, list[int]] = {rid: [] for rid in first + second}
    logprobs: dict[int, list[int]] = {rid: [] for rid in first + second}
    ended: dict[int, Ended] = {}
    finished = aborted = False
    while len(ended) < 4:
        assert ours.poll(60), "the engine loop went quiet"
        out = ours.recv()
        assert isinstance(out, StepOut)
        messages: list[Delta | Ended] = [*out.deltas, *out.ended]
        for msg in messages:
            assert msg.logprobs is not None and len(msg.logprobs) == len(msg.ids)
            tokens[msg.rid] += msg.ids
            logprobs[msg.rid] += [e.id for e in msg.logprobs]
            assert all(len(e.top) == 2 for e in msg.logprobs)
        ended |= {e.rid: e for e in out.ended}
        if not finished and len(tokens[first[1]]) >= 2:
            ours.send(Finish(first[1], 2))
            finished = True
        if not aborted and tokens[second[0]] and tokens[second[1]]:
            ours.send(Abort(1))
            aborted = True
    ours.send(Shutdown())
    runner.join(60)
    while True:
        last = ours.recv()
        if not isinstance(last, StepOut):
            break
    assert isinstance(last, Closed) and (last.outstanding_tickets, last.slots_live, last.kv_live) == (0, 0, 0)
    assert tokens == logprobs
    assert (ended[first[0]].reason, len(tokens[first[0]])) == ("length", 12)
    assert ended[first[1]].reason == "stop" and len(tokens[first[1]]) >= 2
    assert ended[second[0]].reason == ended[second[1]].reason == "abort"


def test_the_engine_process_builds_a_draft_head_engine_and_refuses_it_with_tp_or_overlap() -> None:
    import attrs

    from compiler.engine.config import ServeConfig
    from compiler.online import engine_process
    from compiler.online.messages import Launch

    launch = Launch(model=None, draft="mtp", k=2, dtype="float32", max_running=2, max_len=64, overlap=False, threads=1,
                    chunk_size=ServeConfig().chunk_size, token_budget=ServeConfig().token_budget, cache_entries=2)
    engine, ready, _, _ = engine_process.build(launch)
    try:
        assert engine.head and ready.k == 2
    finally:
        engine.close()
    for option in ({"overlap": True}, {"tp": 2}):  # executor processes and tensor-parallel ranks serve a head
        _, drafted, k = engine_process.load(attrs.evolve(launch, **option))
        assert drafted is not None and k == 2


class _Built:
    """An ``EngineClient`` stand-in whose engine is already built: ``wait_ready`` returns its ``Ready``."""

    def __init__(self, ready: object) -> None:
        self.ready = ready

    def wait_ready(self, timeout_s: float) -> object:
        return self.ready


def test_replicas_measuring_their_memory_differently_still_serve_and_each_says_its_own() -> None:
    """``--dp``'s replicas load the same models, each measuring its own resident memory (it differed by
    1 MiB between two replicas in CI): they must start, the start line naming each one's sizes; a replica
    that built another engine (here another k) is refused, naming both."""
    import attrs

    from compiler.online.engine_client import EngineGone
    from compiler.online.messages import Ready
    from compiler.online.router import EngineRouter

    def ready(pid: int, sizes: str, k: int = 2) -> Ready:
        return Ready(name="t", vocab=256, eos=(), max_len=64, k=k, reserve=k + 1, hf_dir=None, pid=pid, sizes=sizes)

    def router(*readies: Ready) -> EngineRouter:
        r = EngineRouter.__new__(EngineRouter)
        r.clients = [_Built(x) for x in readies]  # type: ignore[misc]  # (stand-ins: only wait_ready is called)
        return r

    same = router(ready(1, "about 167 MiB"), ready(2, "about 167 MiB"))
    assert same.wait_ready(1.0) == ready(1, "about 167 MiB") and same.pids == (1, 2)
    differ = router(ready(1, "about 167 MiB"), ready(2, "about 168 MiB"))
    got = differ.wait_ready(1.0)
    assert attrs.evolve(got, sizes="") == ready(1, "") and differ.pids == (1, 2)
    assert got.sizes == "replica 0: about 167 MiB; replica 1: about 168 MiB"
    with pytest.raises(EngineGone, match=r"replica 1 built another engine than replica 0: .*k=3.* != .*k=2"):
        router(ready(1, "a"), ready(2, "a", k=3)).wait_ready(1.0)
