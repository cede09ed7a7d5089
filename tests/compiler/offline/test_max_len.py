"""``batchc run --max-len N``: the context length. By default 512 for the bundled models and batchc
checkpoints, a Hugging Face model's ``max_position_embeddings`` (and no more than that); checked
against the memory estimate like the other sizes. A workload request that does not fit the context
is refused on its own, with its reason (``--outputs``: ``finish_reason`` ``"refused"`` and
``reason``; the summary's ``refused_requests``), the others are served, and the run exits 2 with one
line (1 when the run also failed). The reason names the positions reserved for speculation only when
k > 0, with the right plural."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backend import faults
from backend.hf.config import parse_config, read_json
from compiler.offline import load_workload
from compiler.workload import MAX_CONTEXT
from tests.backend.hf.builders import save_hf_model, save_tokenizer
from tests.helpers import run_cli

SMALL = ["--lossless-sample", "0", "--threads", "1"]


def _one_line(args: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    capsys.readouterr()
    got = run_cli(args)
    out, err = capsys.readouterr()
    assert got == code, (got, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _workload(tmp: Path, lines: list[dict[str, Any]]) -> Path:
    path = tmp / "workload.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_bundled_models_context_is_512_unless_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = tmp_path / "s.json"
    for extra, want in (([], 512), (["--max-len", "600"], 600)):
        args = ["run", "--requests", "2", "--max-new-tokens", "2", "--k", "0", *SMALL, "--json", str(summary), *extra]
        assert run_cli(args) == 0, capsys.readouterr().err
        assert json.loads(summary.read_text())["max_len"] == want
    # a prompt of 560 bytes fits --max-len 600 and not the default 512
    path = _workload(tmp_path, [{"prompt": "y" * 560, "max_new_tokens": 3}])
    assert run_cli(["run", "--workload", str(path), "--k", "0", *SMALL, "--max-len", "600"]) == 0, capsys.readouterr().err
    assert "exceeds the context limit 512" in _one_line(["run", "--workload", str(path), "--k", "0", *SMALL], capsys)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Granite-4.0-H checkpoint made for 640 positions (not 512), with its tokenizer."""
    d = tmp_path_factory.mktemp("granite640")
    save_hf_model("granitemoehybrid", d, seed=7, vocab_size=320, max_position_embeddings=640)
    save_tokenizer(d)
    return d


def test_a_hugging_face_models_context_is_its_max_position_embeddings(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from compiler.offline.tokenizer import HFTokenizer

    text = "ab " * 280
    n = len(HFTokenizer(hf_dir / "tokenizer.json").encode(text))
    assert 512 < n + 4 + 1 <= 640  # fits 640 positions only
    path = _workload(tmp_path, [{"prompt": text, "max_new_tokens": 4}, {"prompt": "x", "max_new_tokens": 4}])
    summary, outputs = tmp_path / "s.json", tmp_path / "o.jsonl"
    capsys.readouterr()
    assert run_cli(["run", "--model", str(hf_dir), "--workload", str(path), *SMALL, "--json", str(summary), "--outputs", str(outputs)]) == 0, \
        capsys.readouterr().err
    s = json.loads(summary.read_text())
    assert s["max_len"] == 640 and s["refused_requests"] == 0
    assert [len(json.loads(line)["output_ids"]) for line in outputs.read_text().splitlines()] == [4, 4]
    # a shorter --max-len refuses that request alone; a longer one than the model was made for is refused
    err = _one_line(["run", "--model", str(hf_dir), "--workload", str(path), *SMALL, "--max-len", "560"], capsys)
    assert err == (f"batchc: error: 1 of 2 requests refused (the others were served), first: {path}:1: prompt of {n} tokens + 4 new "
                   f"tokens exceeds the context limit 560 (prompt and new tokens may fill 559 of its positions; a decode step holds 1 more)\n")
    err = _one_line(["run", "--model", str(hf_dir), "--workload", str(path), *SMALL, "--max-len", "641"], capsys)
    assert err == f"batchc: error: --max-len 641 is over the max_position_embeddings 640 of target {hf_dir} (Granite-4.0-H)\n"


@pytest.mark.parametrize(("family", "default"), [("bamba", 262144), ("granitemoehybrid", 2048), ("nemotron_h", 4096)])
def test_a_config_without_max_position_embeddings_gets_the_familys_default(tmp_path: Path, family: str, default: int) -> None:
    from backend.tools.hf_random import hf_config

    raw = hf_config(family).to_dict()
    assert parse_config(tmp_path / "config.json", raw).max_positions == 512
    del raw["max_position_embeddings"]
    assert parse_config(tmp_path / "config.json", raw).max_positions == default
    for bad in (0, "512", 2.5, True):
        (tmp_path / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": bad}))
        with pytest.raises(Exception, match="max_position_embeddings"):
            parse_config(tmp_path / "config.json", read_json(tmp_path / "config.json", "config.json"))


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--max-len", str(MAX_CONTEXT), "--max-running", "8", "--cache-entries", "16", "--token-budget", "2048"],
         f"; lower --max-running (8), --cache-entries (16), --k (2), --chunk-size (512), --token-budget (2048), --max-len ({MAX_CONTEXT}), "
         "raise --memory-fraction or use a smaller model"),
        (["--max-len", str(MAX_CONTEXT + 1)], f"batchc run: error: argument --max-len: expected at most {MAX_CONTEXT}, got {MAX_CONTEXT + 1}"),
        (["--max-len", "2"], "batchc run: error: argument --max-len: expected an integer >= 3, got 2"),
        (["--max-len", "4", "--k", "2"], "batchc: error: --max-len 4 leaves no room for a prompt token and a new token next to the "
         "k + 1 = 3 positions of a step"),
        (["--max-len", "256"], "batchc: error: the context length 256 (--max-len) has no room for the built-in workload: its longest "
         "prompt (436 bytes) + 1 new token + k + 1 = 3 need 440; give a longer --max-len or a --workload FILE"),
        (["--max-len", "470"], "batchc: error: --max-new-tokens 32 is over 31: the context limit 470 minus the longest built-in prompt "
         "(436 bytes) minus k + 1 = 3"),
    ],
    ids=["over-memory", "over-bound", "under-3", "under-k+3", "no-room-for-builtin", "builtin-max-new-tokens"],
)
def test_a_bad_max_len_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str) -> None:
    summary = tmp_path / "s.json"
    err = _one_line(["run", *args, "--json", str(summary)], capsys)
    assert fragment in err, err
    assert not summary.exists()


@pytest.mark.parametrize("dp", [1, 2], ids=["one-engine", "dp2"])
def test_a_prompt_longer_than_the_context_is_refused_alone_and_the_others_are_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dp: int
) -> None:
    lines = [{"prompt": "def f(x):", "max_new_tokens": 4}, {"prompt": "x" * 600, "max_new_tokens": 3}, {"prompt": "import ", "max_new_tokens": 3}]
    path = _workload(tmp_path, lines)
    summary, outputs = tmp_path / "s.json", tmp_path / "o.jsonl"
    args = ["run", "--workload", str(path), "--lossless-sample", "4", "--json", str(summary), "--outputs", str(outputs), "--dp", str(dp)]
    err = _one_line(args, capsys)
    reason = (f"{path}:2: prompt of 600 bytes + 3 new tokens exceeds the context limit 512 (prompt and new tokens may fill 509 of its "
              "positions; a decode step holds 1 more and 2 positions are reserved for speculation)")
    assert err == f"batchc: error: 1 of 3 requests refused (the others were served), first: {reason}\n"
    got = [json.loads(line) for line in outputs.read_text().splitlines()]
    assert [g["rid"] for g in got] == [0, 1, 2]
    assert [g["finish_reason"] for g in got] == ["length", "refused", "length"]
    assert [len(g["output_ids"]) for g in got] == [4, 0, 3]
    assert got[1]["reason"] == reason and got[1]["text"] == "" and "reason" not in got[0]
    # the served requests' outputs are the ones they get without the refused one
    alone = tmp_path / "alone.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines[::2]))
    assert run_cli(["run", "--workload", str(path), "--lossless-sample", "0", "--outputs", str(alone)]) == 0
    assert [json.loads(line)["output_ids"] for line in alone.read_text().splitlines()] == [got[0]["output_ids"], got[2]["output_ids"]]
    s = json.loads(summary.read_text())
    assert s["requests"] == 3 and s["refused_requests"] == 1
    if dp == 1:
        assert s["lossless_check"].startswith("passed: 2 requests") and s["prompt_tokens"] == len("def f(x):") + len("import ")


def test_only_refused_requests_serve_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _workload(tmp_path, [{"prompt": "x" * 600, "max_new_tokens": 3}])
    outputs = tmp_path / "o.jsonl"
    err = _one_line(["run", "--workload", str(path), "--k", "0", "--outputs", str(outputs)], capsys)
    assert err.startswith("batchc: error: 1 of 1 request refused (nothing was served), first: ")
    assert json.loads(outputs.read_text())["finish_reason"] == "refused"


def test_a_failed_run_with_refused_requests_exits_1_saying_both(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _workload(tmp_path, [{"prompt": "def f(x):", "max_new_tokens": 6}] * 3 + [{"prompt": "x" * 600, "max_new_tokens": 3}])
    with faults.armed(faults.FaultPoint.MODEL_FORWARD, after=2):
        err = _one_line(["run", "--workload", str(path), "--lossless-sample", "0", "--k", "0"], capsys, code=1)  # a decode fails
    assert err.startswith("batchc: run failed: ") and "requests aborted by 1 failed forwards" in err
    assert "; 1 of 4 requests refused (the others were served), first: " in err


@pytest.mark.parametrize(
    ("k", "held"),
    [
        (0, "prompt and new tokens may fill 511 of its positions; a decode step holds 1 more)"),
        (1, "prompt and new tokens may fill 510 of its positions; a decode step holds 1 more and 1 position is reserved for speculation)"),
        (2, "prompt and new tokens may fill 509 of its positions; a decode step holds 1 more and 2 positions are reserved for speculation)"),
    ],
)
def test_the_reason_names_speculation_only_when_k_is_positive(tmp_path: Path, k: int, held: str) -> None:
    path = _workload(tmp_path, [{"prompt": "x" * 510, "max_new_tokens": 2}, {"prompt": "x", "max_new_tokens": 2}])
    long, short = load_workload(path, max_len=512, reserve=k + 1)
    assert long.refused == f"{path}:1: prompt of 510 bytes + 2 new tokens exceeds the context limit 512 ({held}"
    assert ("speculation" in long.refused) == (k > 0)
    assert short.refused is None
