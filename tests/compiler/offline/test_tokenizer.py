"""Tokenizers of the serving path: bytes and a checkpoint's ``tokenizer.json``; incremental
detokenisation equals decoding all the ids at once and never returns half a UTF-8 character; an
engine request ends at any of several stop ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.offline.tokenizer import REPLACEMENT, ByteTokenizer, HFTokenizer
from ir.errors import PreconditionError
from ir.ids import RequestId
from tests.backend.hf.builders import save_tokenizer
from tests.helpers import tiny_model


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def hf_tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    d = tmp_path_factory.mktemp(str(request.param))
    save_tokenizer(d, metaspace=request.param == "metaspace", vocab_size=400)
    return HFTokenizer(d / "tokenizer.json")


TEXTS = st.text(alphabet=st.sampled_from(list("def f(x): return 1\n") + ["ü", "é", "日", "本", "🙂", "🚀", " ", "—"]), max_size=40)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_incremental_detokenisation_is_the_whole_decode_and_never_splits_a_character(hf_tokenizer: HFTokenizer, data: st.DataObject) -> None:
    ids = data.draw(st.one_of(
        st.lists(st.integers(0, hf_tokenizer.vocab_size - 1), min_size=1, max_size=40),  # any ids at all
        TEXTS.filter(bool).map(hf_tokenizer.encode),  # what a model trained on text would emit
    ))
    detok = hf_tokenizer.detokenizer()
    pieces = [detok.push(t) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == hf_tokenizer.decode(ids)
    whole = hf_tokenizer.decode(ids)
    if REPLACEMENT not in whole:  # then no piece may hold a broken character
        assert all(REPLACEMENT not in p for p in pieces)


@given(text=TEXTS)
def test_text_round_trips_and_specials_are_left_out(hf_tokenizer: HFTokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text)
    assert ids[0] == 1  # the post-processor's BOS
    assert hf_tokenizer.decode([*ids, 2]) == hf_tokenizer.decode(ids)  # EOS: special, left out
    if hf_tokenizer.name.endswith("tokenizer.json") and "byte-level" in hf_tokenizer.name:
        assert hf_tokenizer.decode(ids) == text


@given(data=st.binary(max_size=40))
def test_the_byte_detokenizer_holds_partial_characters_back(data: bytes) -> None:
    tok = ByteTokenizer()
    detok = tok.detokenizer()
    pieces = [detok.push(b) for b in data] + [detok.flush()]
    assert "".join(pieces) == data.decode("utf-8", errors="replace")
    emoji = "🙂".encode()
    detok = tok.detokenizer()
    assert [detok.push(b) for b in emoji] == ["", "", "", "🙂"]


def test_single_id() -> None:
    assert ByteTokenizer().single_id("\n") == 10 and ByteTokenizer().single_id("é") is None


def test_a_request_ends_at_any_of_its_stop_ids() -> None:
    from compiler.engine import Engine

    model = tiny_model()
    probe = Engine(model, None, k=0, capacity=4, kv_capacity=256, max_len=64)
    probe.admit(RequestId(0), list(b"def f(x):"), max_new_tokens=12)
    probe.run_until_done()
    full = probe.outputs[RequestId(0)]
    assert len(set(full)) > 2
    third = full[2]
    first_at = full.index(third)
    eng = Engine(model, None, k=0, capacity=4, kv_capacity=256, max_len=64)
    eng.admit(RequestId(0), list(b"def f(x):"), max_new_tokens=12, stop=[255, third])
    eng.admit(RequestId(1), list(b"def f(x):"), max_new_tokens=12, stop=(254,))
    eng.admit(RequestId(2), list(b"def f(x):"), max_new_tokens=12, stop=[])
    eng.run_until_done()
    assert eng.outputs[RequestId(0)] == full[: first_at + 1]
    assert eng.outputs[RequestId(1)] == full and eng.outputs[RequestId(2)] == full


@pytest.mark.parametrize(
    ("stop", "message"),
    [([1, "x"], "stop"), ([1, 300], "stop must be a token id in"), ([True], "stop"), (list(range(65)), "at most 64 stop ids"),
     (["x" * 10**6], "stop")],
)
def test_bad_stop_ids_are_refused(stop: object, message: str) -> None:
    from typeguard import suppress_type_checks

    from compiler.engine import Engine

    eng = Engine(tiny_model(), None, k=0, capacity=4, kv_capacity=64, max_len=32)
    with suppress_type_checks(), pytest.raises(PreconditionError, match=message) as e:
        eng.admit(RequestId(0), [1, 2], max_new_tokens=2, stop=stop)  # type: ignore[arg-type]  # deliberately wrong
    assert len(eng.requests) == 0
    assert len(str(e.value)) < 400  # a huge value is shown shortened


def test_tokenizers_refuse_what_is_not_text_or_token_ids(hf_tokenizer: HFTokenizer) -> None:
    from typeguard import suppress_type_checks

    for tok in (hf_tokenizer, ByteTokenizer()):
        with suppress_type_checks():
            for bad in (None, 5, b"x"):
                with pytest.raises(ValueError, match="text must be a str"):
                    tok.encode(bad)  # type: ignore[arg-type]  # deliberately wrong
            with pytest.raises(ValueError, match="not valid Unicode"):
                tok.encode("\ud800")
            for ids, message in (([True], "token id"), ([1.5], "token id"), ([-1], "token id -1 is not in"), ("ab", "must be a list")):
                with pytest.raises(ValueError, match=message):
                    tok.decode(ids)  # type: ignore[arg-type]  # deliberately wrong
    with pytest.raises(ValueError, match="token id 300 is not in"):
        ByteTokenizer().decode([300])
    assert hf_tokenizer.decode([72, 5000, 73]) == hf_tokenizer.decode([72, 73])  # an id the tokenizer lacks decodes to nothing
    with pytest.raises(ValueError, match="is not in"):
        hf_tokenizer.decode([1 << 40])


def test_a_bad_id_does_not_break_a_detokenizer(hf_tokenizer: HFTokenizer) -> None:
    for tok in (hf_tokenizer, ByteTokenizer()):
        detok = tok.detokenizer()
        ids = tok.encode("def f(x): 🙂")
        first = detok.push(ids[0])
        with pytest.raises(ValueError):
            detok.push(1 << 40)
        rest = "".join(detok.push(t) for t in ids[1:]) + detok.flush()
        assert first + rest == tok.decode(ids)


def test_a_tokenizer_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    from backend.hybrid.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        HFTokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(CheckpointError, match="is a directory"):
        HFTokenizer(tmp_path)
    from typeguard import suppress_type_checks

    with suppress_type_checks():
        for bad in (5, None, b"x", ""):
            with pytest.raises(CheckpointError, match="a tokenizer path must be a non-empty str or Path"):
                HFTokenizer(bad)  # type: ignore[arg-type]  # deliberately wrong


def test_workload_loading_checks_its_tokenizer_and_arguments(tmp_path: Path, hf_tokenizer: HFTokenizer) -> None:
    from typeguard import suppress_type_checks

    from compiler.offline import builtin_workload, load_workload
    from compiler.offline.load import tokenize_workload
    from compiler.workload import WorkloadError

    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "x"}\n')
    with suppress_type_checks():
        for bad in ("x", 5):
            with pytest.raises(WorkloadError, match="load_workload: tokenizer must be a Tokenizer"):
                load_workload(path, max_len=64, tokenizer=bad)  # type: ignore[arg-type]  # deliberately wrong
        workload = builtin_workload(num_requests=2)
        for kwargs, message in (
            ({"tokenizer": None}, "tokenizer must be a Tokenizer"), ({"vocab": True}, "vocab must be an int"),
            ({"vocab": 1.5}, "vocab must be an int"), ({"vocab": 0}, "vocab must be an int"),
        ):
            args = {"tokenizer": hf_tokenizer, "vocab": 400, **kwargs}
            with pytest.raises(WorkloadError, match=message):
                tokenize_workload(workload, args["tokenizer"], vocab=args["vocab"])  # type: ignore[arg-type]  # deliberately wrong
        with pytest.raises(WorkloadError, match="workload must be a list of Request"):
            tokenize_workload(None, hf_tokenizer, vocab=400)  # type: ignore[arg-type]  # deliberately wrong
    assert [len(r.token_ids) > 0 for r in tokenize_workload(workload, hf_tokenizer, vocab=400)] == [True, True]


def test_a_tokenized_request_that_does_not_fit_is_named_with_its_counts(hf_tokenizer: HFTokenizer) -> None:
    """``tokenized_overflow``: the first built-in request whose prompt tokens, new tokens and k + 1
    do not fit the context, in the words ``batchc run`` and ``bench serve`` print."""
    from compiler.offline import builtin_workload
    from compiler.offline.load import tokenize_workload, tokenized_overflow

    workload = tokenize_workload(builtin_workload(num_requests=3, max_new_tokens=8), hf_tokenizer, vocab=400)
    need = max(len(r.token_ids) + r.max_new_tokens for r in workload) + 3
    assert tokenized_overflow(workload, max_len=need, reserve=3) is None
    first = next(r for r in workload if len(r.token_ids) + r.max_new_tokens + 3 > need - 1)
    assert tokenized_overflow(workload, max_len=need - 1, reserve=3) == (
        f"built-in request {first.rid}: {len(first.token_ids)} prompt tokens + {first.max_new_tokens} new tokens + k + 1 = 3 "
        f"exceed the context limit {need - 1}; lower --max-new-tokens")
