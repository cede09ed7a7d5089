"""Requests' sampling parameters from the outside in: every
``SamplingParams`` field of a workload line and its refusals (the line, the field and the value in
one line, exit 2), ``batchc run``'s ``--temperature``/``--top-p``/``--top-k``/``--min-p`` defaults
and their precedence, ``--seed`` reaching ``derive_seed``, stop strings cut on the detokenized text
(split across tokens, inside one speculative step), ``Engine.finish``, ``min_tokens`` and
``ignore_eos`` when a request ends, and the ``--outputs`` lines' ``index`` and ``finish_reason``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from typeguard import suppress_type_checks

from backend.hybrid.checkpoint import default_draft, default_target
from backend.hybrid.model import HybridModel
from compiler.engine import Engine
from compiler.engine.requests import Request as EngineRequest
from compiler.offline import Request, ServeConfig, WorkloadError, builtin_workload, load_workload, make_engine, serve
from compiler.offline.dp import _request, _request_json
from compiler.offline.models import finish_reason, output_lines
from compiler.offline.run import stop_ids
from compiler.offline.stops import StopScanner, scan
from compiler.offline.tokenizer import ByteTokenizer, HFTokenizer
from ir.columns import frozen_i64
from ir.errors import PreconditionError
from ir.ids import RequestId
from ir.sampling import GREEDY, SamplingParams, derive_seed
from tests.backend.hf.builders import save_tokenizer
from tests.helpers import run_cli


def _workload(tmp: Path, *lines: str) -> Path:
    path = tmp / "w.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _load(tmp: Path, *lines: str, **kw: Any) -> list[Request]:
    return load_workload(_workload(tmp, *lines), max_len=512, **kw)


# ---- workload lines ----------------------------------------------------------------------------


def test_every_sampling_field_of_a_line_is_read(tmp_path: Path) -> None:
    fields: dict[str, object] = {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 123, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "stop": ["\n\n", "END"], "stop_token_ids": [7, 9],
        "ignore_eos": True, "min_tokens": 2, "max_new_tokens": 12, "logprobs": 3, "n": 2,
    }
    assert set(fields) == {a.name for a in attrs.fields(SamplingParams)}  # every field, no more
    (r,) = _load(tmp_path, json.dumps({"prompt": "x", "arrival": 4, **fields}))
    assert r.sampling == SamplingParams(**fields)  # type: ignore[arg-type]  # the dict's values are the fields' types
    assert r.max_new_tokens == 12 and r.arrival == 4 and r.completions() == [r.rid, r.rid + (1 << 40)]  # n = 2: two completions
    # one string is a list of one; a line that sets nothing is GREEDY with the file's default length
    one, bare = _load(tmp_path, '{"prompt": "x", "stop": "ab"}', '{"prompt": "y"}', default_max_new_tokens=5)
    assert one.sampling.stop == ("ab",) and one.sampling.greedy
    assert bare.sampling == attrs.evolve(GREEDY, max_new_tokens=5) and bare.max_new_tokens == 5


def test_a_null_field_of_a_line_is_not_given(tmp_path: Path) -> None:
    """``null`` means "not given", as in ``batchc serve``'s bodies and the OpenAI API: every optional
    field of a line takes its default (the run's option, else greedy's; the file's length; arrival 0),
    and a null prompt is still no prompt."""
    nulls = {name: None for name in [a.name for a in attrs.fields(SamplingParams)] + ["arrival"]}
    (given,), (bare,) = (_load(tmp_path, json.dumps({"prompt": "x", **nulls}), default_max_new_tokens=5, defaults={"temperature": 0.5}),
                         _load(tmp_path, '{"prompt": "x"}', default_max_new_tokens=5, defaults={"temperature": 0.5}))
    assert given.sampling == bare.sampling and given.sampling.temperature == 0.5 and given.sampling.stop == ()
    assert (given.max_new_tokens, given.arrival) == (bare.max_new_tokens, bare.arrival) == (5, 0)
    with pytest.raises(WorkloadError, match=r"w.jsonl:1: 'prompt' must be a non-empty string"):
        _load(tmp_path, '{"prompt": null, "stop": null}')


BAD_FIELDS = [
    ('"temperature": -1', "'temperature': must be >= 0 and finite (0 is greedy) (got -1.0)"),
    ('"temperature": NaN', "'temperature': must be >= 0 and finite (0 is greedy) (got nan)"),
    ('"temperature": Infinity', "'temperature': must be >= 0 and finite (0 is greedy) (got inf)"),
    ('"temperature": true', "'temperature': must be a number, not bool (got True)"),
    ('"temperature": "0.5"', "'temperature': must be a number, not str (got '0.5')"),
    ('"top_p": 0', "'top_p': must be in (0, 1] (got 0.0)"),
    ('"top_p": 1.5', "'top_p': must be in (0, 1] (got 1.5)"),
    ('"min_p": 1.5', "'min_p': must be in [0, 1] (got 1.5)"),
    ('"top_k": -2', "'top_k': must be >= -1 (-1 or 0: off) (got -2)"),
    ('"top_k": 2.0', "'top_k': must be an int, not float (got 2.0)"),
    ('"seed": -1', "'seed': must be in [0, 2**63 - 1] (got -1)"),
    ('"seed": 9223372036854775808', "'seed': must be in [0, 2**63 - 1] (got 9223372036854775808)"),
    ('"presence_penalty": 3', "'presence_penalty': must be in [-2, 2] (got 3.0)"),
    ('"repetition_penalty": 0', "'repetition_penalty': must be > 0 and finite (1 is off) (got 0.0)"),
    ('"stop": ""', "'stop': a stop string must not be empty (got '')"),
    ('"stop": [1]', "'stop': each stop must be a str, not int (got 1)"),
    ('"stop": ' + json.dumps(["s"] * 17), "'stop': holds 17 strings, at most 16 allowed"),
    ('"stop": "' + "a" * 257 + '"', "'stop': a stop string has at most 256 characters, got 257"),
    ('"stop_token_ids": 5', "'stop_token_ids': must be a list of int, not int (got 5)"),
    ('"stop_token_ids": [-1]', "'stop_token_ids': a token id must be >= 0 (got -1)"),
    ('"stop_token_ids": [256]', "'stop_token_ids' holds id 256, not below the model's vocabulary size 256"),
    ('"ignore_eos": 1', "'ignore_eos': must be a bool, not int (got 1)"),
    ('"min_tokens": 5, "max_new_tokens": 4', "'min_tokens': must be in [0, max_new_tokens = 4] (got 5)"),
    ('"logprobs": 21', "'logprobs': must be in [0, 20] (got 21)"),
    ('"logprobs": -1', "'logprobs': must be in [0, 20] (got -1)"),
    ('"n": 0', "'n': must be in [1, 16] (got 0)"),
    ('"n": 17', "'n': must be in [1, 16] (got 17)"),
    ('"n": false', "'n': must be an int, not bool (got False)"),
    ('"temprature": 0.5', "unknown field(s) ['temprature']"),
]


@pytest.mark.parametrize(("field", "message"), BAD_FIELDS, ids=[f for f, _ in BAD_FIELDS])
def test_a_bad_field_is_refused_naming_the_line_the_field_and_the_value(tmp_path: Path, field: str, message: str) -> None:
    path = _workload(tmp_path, '{"prompt": "ok"}', "", '{"prompt": "x", ' + field + "}")
    with pytest.raises(WorkloadError) as caught:
        load_workload(path, max_len=512)
    assert str(caught.value) == f"{path}:3: {message}" or str(caught.value).startswith(f"{path}:3: {message}")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("field", "message"), [BAD_FIELDS[0], BAD_FIELDS[14], BAD_FIELDS[26]])
def test_batchc_run_refuses_a_bad_field_in_one_line_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str,
                                                                 message: str) -> None:
    path = _workload(tmp_path, '{"prompt": "x", ' + field + "}")
    out = tmp_path / "o.jsonl"
    assert run_cli(["run", "--workload", str(path), "--outputs", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"w.jsonl:1: {message}" in err, err
    assert not out.exists()  # nothing ran


# ---- run defaults ------------------------------------------------------------------------------


def test_each_option_is_the_default_of_its_own_field(tmp_path: Path) -> None:
    defaults = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "min_p": 0.1}
    rs = _load(tmp_path, '{"prompt": "a"}', '{"prompt": "b", "temperature": 0.2}', '{"prompt": "c", "top_p": 0.5, "top_k": -1}',
               '{"prompt": "d", "temperature": 0, "min_p": 0}', defaults=defaults)
    got = [(r.sampling.temperature, r.sampling.top_p, r.sampling.top_k, r.sampling.min_p) for r in rs]
    assert got == [(0.8, 0.9, 50, 0.1), (0.2, 0.9, 50, 0.1), (0.8, 0.5, -1, 0.1), (0.0, 0.9, 50, 0.0)]
    # without options, a line that sets only top_p stays greedy (temperature is GREEDY's)
    (r,) = _load(tmp_path, '{"prompt": "a", "top_p": 0.5}')
    assert r.sampling.greedy and r.sampling.top_p == 0.5
    # the built-in workload takes them too, each request with its own max_new_tokens
    for r in builtin_workload(num_requests=5, defaults={"temperature": 1.5, "top_k": 3}):
        assert (r.sampling.temperature, r.sampling.top_k, r.sampling.max_new_tokens) == (1.5, 3, r.max_new_tokens)
    assert all(r.sampling == attrs.evolve(GREEDY, max_new_tokens=r.max_new_tokens) for r in builtin_workload(num_requests=5))
    # and the built-in workload's prompts and lengths do not depend on them
    assert [(r.prompt, r.max_new_tokens) for r in builtin_workload(num_requests=9, defaults={"temperature": 1.0})] == [
        (r.prompt, r.max_new_tokens) for r in builtin_workload(num_requests=9)
    ]


@pytest.mark.parametrize(("args", "fragment"), [
    (["--top-p", "0"], "argument --top-p: expected a finite number in (0, 1], got 0"),
    (["--top-p", "1.01"], "argument --top-p: expected a finite number in (0, 1], got 1.01"),
    (["--min-p", "-0.1"], "argument --min-p: expected a finite number in [0, 1], got -0.1"),
    (["--temperature", "-1"], "argument --temperature: expected a finite number in [0, inf), got -1"),
    (["--temperature", "nan"], "argument --temperature: expected a finite number in [0, inf), got nan"),
    (["--top-k", "-2"], "argument --top-k: expected an integer >= -1, got -2"),
    (["--top-k", "2.5"], "argument --top-k: expected an integer >= -1, got '2.5'"),
])
def test_bad_sampling_options_are_refused_in_one_line(capsys: pytest.CaptureFixture[str], args: list[str], fragment: str) -> None:
    assert run_cli(["run", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err


@pytest.fixture
def admitted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[RequestId, tuple[SamplingParams, int, list[int]]]]:
    """Every ``Engine.admit`` of the test: the request's stored parameters (seeded), the engine's
    seed and the stop ids it was given, by request id."""
    seen: dict[RequestId, tuple[SamplingParams, int, list[int]]] = {}
    real = Engine.admit

    def spy(self: Engine, rid: RequestId, prompt: Any, **kw: Any) -> None:
        real(self, rid, prompt, **kw)
        stop = kw.get("stop")
        seen.setdefault(rid, (self.requests[rid].sampling, self.seed, list(stop) if stop is not None else []))

    monkeypatch.setattr(Engine, "admit", spy)
    yield seen


def test_options_and_seed_reach_the_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           admitted: dict[RequestId, tuple[SamplingParams, int, list[int]]]) -> None:
    path = _workload(tmp_path, '{"prompt": "a", "max_new_tokens": 2}', '{"prompt": "b", "max_new_tokens": 2, "seed": 5, "top_p": 0.5}',
                     '{"prompt": "c", "max_new_tokens": 2, "temperature": 0}')
    args = ["run", "--workload", str(path), "--k", "0", "--lossless-sample", "0", "--seed", "7", "--temperature", "0.9", "--top-p", "0.8"]
    assert run_cli(args) == 0, capsys.readouterr().err
    a, b, c = (admitted[RequestId(i)] for i in range(3))
    assert a[1] == 7  # Engine(seed=) is the run's --seed
    # a sampled request without a seed: derive_seed(--seed, its id); its own seed stays; greedy reads no stream
    assert a[0] == SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=2, seed=derive_seed(7, 0))
    assert b[0] == SamplingParams(temperature=0.9, top_p=0.5, max_new_tokens=2, seed=5)
    assert c[0] == SamplingParams(temperature=0.0, top_p=0.8, max_new_tokens=2)


def test_the_built_in_workload_is_sampled_with_the_options(capsys: pytest.CaptureFixture[str],
                                                           admitted: dict[RequestId, tuple[SamplingParams, int, list[int]]]) -> None:
    args = ["run", "--requests", "2", "--max-new-tokens", "2", "--k", "0", "--lossless-sample", "0", "--seed", "3", "--top-k", "4",
            "--temperature", "1"]
    assert run_cli(args) == 0, capsys.readouterr().err
    for rid in (RequestId(0), RequestId(1)):
        params, seed, _ = admitted[rid]
        assert (params.temperature, params.top_k, params.seed, seed) == (1.0, 4, derive_seed(3, rid), 3)


def test_the_config_seed_makes_the_engine_seed() -> None:
    target, draft = _bundled()
    for seed in (0, 11, 2**63 - 1):
        with make_engine(target, draft, ServeConfig(seed=seed), None, cache=False, k=0) as eng:
            assert eng.seed == seed
    with pytest.raises(ValueError, match=r"seed must be in \[0, 9223372036854775807\], got 9223372036854775808"):
        ServeConfig(seed=2**63)
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        ServeConfig(seed=-1)


def test_a_replica_gets_each_request_s_sampling() -> None:
    p = SamplingParams(temperature=0.5, stop=["a", "bc"], stop_token_ids=[3], seed=9, max_new_tokens=6, logprobs=2, n=3, ignore_eos=True)
    r = Request(rid=RequestId(4), prompt=b"xy", max_new_tokens=6, arrival=2, sampling=p, ids=(5, 6))
    assert _request(json.loads(json.dumps(_request_json(r)))) == r


def test_a_request_s_length_and_its_sampling_length_agree() -> None:
    with pytest.raises(ValueError, match="max_new_tokens 4 differs from its sampling.max_new_tokens 32"):
        Request(rid=RequestId(0), prompt=b"x", max_new_tokens=4, sampling=GREEDY)


# ---- stop strings ------------------------------------------------------------------------------


def test_a_stop_string_split_over_tokens_is_found_at_the_token_completing_it() -> None:
    tok = ByteTokenizer()
    out = list(b"abc\n\ndef")
    cut = scan(tok, ["\n\n"], out)
    assert cut is not None and (cut.keep, cut.text, cut.stop) == (5, "abc", "\n\n")
    # fed in any pieces, the same cut (the serving loop feeds a step's tokens; the writer all of them)
    for pieces in ([out[:4], out], [out[:1], out[:3], out[:7], out], [out]):
        sc = StopScanner(tok, ["\n\n"])
        got = [sc.feed(p) for p in pieces]
        assert got[-1] == cut and all(g is None or g == cut for g in got)
    # the first stop to appear wins, whichever comes first in the list; several tokens in one feed
    cut = scan(tok, ["def", "c\n", "ab"], out)
    assert cut is not None and (cut.keep, cut.text, cut.stop) == (2, "", "ab")
    cut = scan(tok, ["def", "c\n"], out)
    assert cut is not None and (cut.keep, cut.text, cut.stop) == (4, "ab", "c\n")
    assert scan(tok, ["xyz"], out) is None and scan(tok, [], out) is None


def test_a_stop_string_of_a_multibyte_character_is_found_once_the_character_is_whole() -> None:
    out = list("naïve café".encode())
    cut = scan(ByteTokenizer(), ["é"], out)
    assert cut is not None and cut.keep == len(out) and cut.text == "naïve caf"
    cut = scan(ByteTokenizer(), ["ï"], out)
    assert cut is not None and cut.keep == 4 and cut.text == "na"


def test_min_tokens_passes_over_an_early_stop_string() -> None:
    out = list(b"a.b.c.")
    assert scan(ByteTokenizer(), ["."], out) == scan(ByteTokenizer(), ["."], out, min_tokens=2)
    cut = scan(ByteTokenizer(), ["."], out, min_tokens=3)
    assert cut is not None and (cut.keep, cut.text) == (4, "a.b")
    cut = scan(ByteTokenizer(), ["a."], out, min_tokens=3)
    assert cut is None  # its only occurrence ends at the second token


def test_stop_strings_on_a_checkpoint_tokenizer(tmp_path: Path) -> None:
    raw = save_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    text = "def f(x):\n    return x * 2\n"
    ids = raw.encode(text, add_special_tokens=False).ids
    assert len(ids) < len(text)  # tokens of several characters
    for stop in ("return", "n x", "x * 2\n", ":\n  "):
        cut = scan(tok, [stop], ids)
        assert cut is not None and cut.text == text[: text.index(stop)], stop
        # the ids kept are the shortest prefix whose text holds the stop string
        assert stop in tok.decode(ids[: cut.keep]) and stop not in tok.decode(ids[: cut.keep - 1])


@cache
def _bundled() -> tuple[HybridModel, HybridModel]:
    return default_target(), default_draft()


PROMPT = b"import os\n"  # the bundled models continue it "\n    def __init__(self, " (greedy)


def _serve_stops(k: int, stop: list[str], *, new: int = 24) -> tuple[list[int], list[tuple[int, int]], Engine]:
    """The output of PROMPT served at ``k`` with ``stop``; and, for each ``Engine.finish``, the
    request's output length when it was called and the length kept."""
    target, draft = _bundled()
    eng = make_engine(target, draft, ServeConfig(k=k, lossless_sample=0), None, cache=False, k=k)
    finishes: list[tuple[int, int]] = []
    real = eng.finish

    def spy(rid: RequestId, *, length: int | None = None) -> None:
        finishes.append((len(eng.requests[rid].output), -1 if length is None else length))
        real(rid, length=length)

    eng.finish = spy  # type: ignore[method-assign]  # recording the calls the serving loop makes
    sampling = attrs.evolve(GREEDY, max_new_tokens=new, stop=stop)
    serve(eng, [Request(rid=RequestId(0), prompt=PROMPT, max_new_tokens=new, sampling=sampling)], max_running=8)
    return eng.outputs[RequestId(0)], finishes, eng


@cache
def _free() -> list[int]:
    """PROMPT's greedy output of 24 tokens, served without a stop string (once for the module: the
    stop-string tests compare against its prefixes)."""
    free, _, eng = _serve_stops(0, [])
    eng.close()
    return free


def test_a_stop_string_ends_a_served_request_inside_a_speculative_step() -> None:
    free = _free()
    text = bytes(free).decode()
    assert text.startswith("\n    def __init__(self")
    dropped = []
    for stop in ("def", "_in", "f _", "__init__(", "ni"):
        at = text.index(stop)
        want = free[: at + len(stop)]  # the ids up to the one completing it
        for k in (0, 2):
            out, finishes, eng = _serve_stops(k, [stop, "zzz"])
            assert out == want, (stop, k)
            assert len(finishes) == 1 and finishes[0][1] == len(want)
            if k == 2:
                dropped.append(finishes[0][0] - finishes[0][1])
            # finished, not aborted: every slot and KV location back, the ledger drained
            assert eng.stats.aborts == 0 and not eng.aborted_by_failure and eng.live == 0
            assert eng.slots.num_live == 0 and eng.kv.num_live == 0
            eng.ledger.assert_drained()
            eng.close()
            lines = output_lines([Request(rid=RequestId(0), prompt=PROMPT, max_new_tokens=24,
                                          sampling=attrs.evolve(GREEDY, max_new_tokens=24, stop=[stop, "zzz"]))],
                                 {RequestId(0): out}, (), ByteTokenizer(), ())
            assert (lines[0]["text"], lines[0]["finish_reason"]) == (text[:at], "stop")
    # at k = 2 a step emits several tokens: a stop completed inside a window drops the window's rest
    # (read off the k = 2 runs above: "zzz" never appears, so each ends where its one stop ends it)
    assert max(dropped) > 0 and min(dropped) >= 0, dropped


def test_a_stop_string_in_the_last_tokens_of_a_request_at_its_length_is_cut_too() -> None:
    free = _free()[:9]  # (greedy: a request of 9 new tokens gets the first 9 of 24)
    text = bytes(free).decode()  # "\n    def " : "ef" completes at the 8th token, the 9th ends it by length
    stop = text[6:8]
    for k in (0, 2):
        out, _, eng = _serve_stops(k, [stop], new=9)
        eng.close()
        assert out == free[:8], k


# ---- ending: min_tokens, ignore_eos, Engine.finish --------------------------------------------


def _record(output: list[int], *, stop: frozenset[int], min_tokens: int = 0, new: int = 6) -> EngineRequest:
    p = frozen_i64([1, 2])
    return EngineRequest(rid=RequestId(1), prompt=p, original=p, max_new_tokens=new, stop=stop, output=output,
                         sampling=attrs.evolve(GREEDY, max_new_tokens=new, min_tokens=min_tokens))


def test_no_stop_id_ends_a_request_before_min_tokens() -> None:
    r = _record([9, 4, 9, 5], stop=frozenset({9}), min_tokens=2)
    assert r.is_done() and r.final_output() == [9, 4, 9]
    r = _record([9, 4, 9, 5], stop=frozenset({9}), min_tokens=3)
    assert not r.is_done() and r.final_output() == [9, 4, 9, 5]
    r = _record([9, 4, 9, 5], stop=frozenset({9}))
    assert r.is_done() and r.final_output() == [9]


def test_ignore_eos_leaves_the_end_of_sequence_ids_out() -> None:
    r = Request(rid=RequestId(0), prompt=b"x", max_new_tokens=3)
    assert stop_ids(r, (2, 7)) == [2, 7]
    ignoring = attrs.evolve(r, sampling=attrs.evolve(r.sampling, ignore_eos=True, stop_token_ids=[5]))
    assert stop_ids(ignoring, (2, 7)) == []  # (its stop_token_ids the engine adds itself)


def test_engine_finish_ends_a_live_request_as_finished() -> None:
    target, _ = _bundled()
    eng = Engine(target, None, k=0)
    eng.admit(RequestId(0), list(PROMPT), max_new_tokens=10)
    eng.admit(RequestId(1), list(PROMPT), max_new_tokens=10)
    eng.step()
    eng.step()
    eng.step()
    out = list(eng.requests[RequestId(0)].output)
    assert len(out) == 3
    eng.finish(RequestId(0), length=2)
    assert eng.outputs[RequestId(0)] == out[:2] and eng.stats.aborts == 0 and RequestId(0) not in eng.requests
    with suppress_type_checks():  # the suite's typeguard would refuse these at the signature; production checks them itself
        eng.finish(np.int64(1))  # type: ignore[arg-type]  # a numpy integer is an id too
        assert eng.outputs[RequestId(1)] == out
        for rid, message in ((RequestId(0), "request 0 is not live"), (True, "rid must be an int, not bool"),
                             (RequestId(5), "request 5 is not live")):
            with pytest.raises(PreconditionError, match=re.escape(f"finish: {message}")):
                eng.finish(rid)  # type: ignore[arg-type]  # True: deliberately wrong
        eng.admit(RequestId(2), list(PROMPT), max_new_tokens=10)
        for bad in (-1, 2.0, "1", True):
            with pytest.raises(PreconditionError, match="finish: length must be an int >= 0"):
                eng.finish(RequestId(2), length=bad)  # type: ignore[arg-type]  # deliberately wrong
    eng.finish(RequestId(2))  # never started: nothing emitted, nothing held
    assert eng.outputs[RequestId(2)] == [] and eng.slots.num_live == 0 and eng.kv.num_live == 0
    eng.ledger.assert_drained()


# ---- --outputs: index and finish_reason --------------------------------------------------------


def _req(**sampling: Any) -> Request:
    return Request(rid=RequestId(0), prompt=b"p", max_new_tokens=4, sampling=attrs.evolve(GREEDY, max_new_tokens=4, **sampling))


@pytest.mark.parametrize(("sampling", "output", "reason"), [
    ({}, [5, 6, 7, 8], "length"),
    ({}, [5, 2], "stop"),  # an end-of-sequence id
    ({"ignore_eos": True}, [5, 2, 6, 2], "length"),  # not with ignore_eos
    ({"stop_token_ids": [6]}, [5, 6], "stop"),
    ({"stop_token_ids": [6], "ignore_eos": True}, [5, 6], "stop"),
    ({"stop_token_ids": [6], "min_tokens": 2}, [6, 6], "length"),  # (never served so: a stop id before min_tokens ends nothing)
    ({"stop_token_ids": [6], "min_tokens": 1}, [6, 6], "stop"),
    ({"stop": ["fg"]}, list(b"efg"), "stop"),
    ({"stop": ["fg"]}, list(b"efgh"), "stop"),
    ({"stop": ["zz"]}, list(b"efgh"), "length"),
])
def test_finish_reasons(sampling: dict[str, Any], output: list[int], reason: str) -> None:
    r = _req(**sampling)
    (line,) = output_lines([r], {r.rid: output}, (), ByteTokenizer(), (2,))
    assert line["finish_reason"] == reason
    assert finish_reason(r, output, (2,), aborted=True) == "abort"


def test_outputs_lines_carry_index_and_cut_text() -> None:
    a = _req(stop=["\n"])
    b = attrs.evolve(_req(), rid=RequestId(1), sampling=attrs.evolve(_req().sampling, n=2, temperature=1.0))
    fork = b.completions()[1]
    assert fork != b.rid and b.completions()[0] == b.rid
    lines = output_lines([a, b], {a.rid: list(b"ab\n"), b.rid: list(b"cd"), fork: list(b"ef")}, (), ByteTokenizer(), ())
    assert [list(x) for x in lines] == [["rid", "index", "prompt", "prompt_ids", "output_ids", "text", "finish_reason"]] * 3
    assert [(x["rid"], x["index"], x["output_ids"], x["text"], x["finish_reason"]) for x in lines] == [
        (0, 0, list(b"ab\n"), "ab", "stop"), (1, 0, list(b"cd"), "cd", "length"), (1, 1, list(b"ef"), "ef", "length"),
    ]


def test_batchc_run_writes_stop_cut_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _workload(tmp_path, json.dumps({"prompt": PROMPT.decode(), "max_new_tokens": 20, "stop": ["__init"]}),
                     json.dumps({"prompt": PROMPT.decode(), "max_new_tokens": 5}))
    out = tmp_path / "o.jsonl"
    assert run_cli(["run", "--workload", str(path), "--outputs", str(out), "--lossless-sample", "2"]) == 0, capsys.readouterr().err
    first, second = (json.loads(x) for x in out.read_text().splitlines())
    assert (first["text"], first["finish_reason"], first["index"]) == ("\n    def ", "stop", 0)
    assert bytes(first["output_ids"]).decode() == "\n    def __init"
    assert (second["text"], second["finish_reason"], second["index"]) == ("\n    ", "length", 0)
    assert "r0: ...'import os\\n' -> '\\n    def '" in capsys.readouterr().out  # the samples show the text as cut


def test_a_stop_string_ends_a_pipelined_request_as_it_does_in_process() -> None:
    # --overlap: executors in their own processes, k = 0 pipelined one forward ahead (a finished
    # request may be in the forward in flight), k = 2 with commits running beside the host
    target, draft = _bundled()
    sampling = attrs.evolve(GREEDY, max_new_tokens=20, stop=["def"])
    for k in (0, 2):
        with make_engine(target, draft, ServeConfig(k=k, lossless_sample=0), None, cache=False, k=k, overlap=True) as eng:
            assert eng.backends.concurrent
            serve(eng, [Request(rid=RequestId(i), prompt=PROMPT, max_new_tokens=20, sampling=sampling) for i in range(3)], max_running=8)
            assert [bytes(eng.outputs[RequestId(i)]) for i in range(3)] == [b"\n    def"] * 3, k
            assert eng.stats.aborts == 0 and eng.slots.num_live == 0 and eng.kv.num_live == 0


def test_compare_mutable_refuses_what_the_baseline_cannot_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for line, said in (('"temperature": 0.5', "request 1 sets temperature 0.5"), ('"stop": "x"', "request 1 sets stop ('x',)")):
        path = _workload(tmp_path, '{"prompt": "a", "max_new_tokens": 2}', '{"prompt": "b", ' + line + "}")
        assert run_cli(["run", "--workload", str(path), "--compare-mutable"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--compare-mutable: {said}; the mutable baseline serves greedy requests" in err, err
