"""``batchc run --model DIR`` on Hugging Face checkpoints of each supported family: greedy output
token for token equal to transformers' ``generate(do_sample=False)`` at k = 0 and with a draft at
k = 2, ``--outputs`` lines, tokens (not bytes) counted against the limits, and one-line refusals
(exit 2) of what cannot be served."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.backend.hf.builders import FAMILY_NAMES, save_hf_model, save_tokenizer
from tests.helpers import run_cli

NEW = 32
PROMPTS = [
    "def f(x):\n    return",
    "Grüße 🙂 café",
    "import re",
    "for a in range(10):\n    print(a)\nclass K:",
    "x",
]


_main = run_cli


def _workload(tmp: Path, lines: list[dict[str, Any]]) -> Path:
    path = tmp / "workload.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family_dirs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path, Path]:
    """A family's target (seeded) and draft (the target plus 3% noise), both with the tokenizer."""
    family = str(request.param)
    target_dir, draft_dir = tmp_path_factory.mktemp(f"{family}-target"), tmp_path_factory.mktemp(f"{family}-draft")
    model = save_hf_model(family, target_dir, seed=7, vocab_size=320)
    save_hf_model(family, draft_dir, seed=7, vocab_size=320, noise=0.03)
    for d in (target_dir, draft_dir):
        save_tokenizer(d)
    return family, model, target_dir, draft_dir


def _generate(model: Any, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy output, cut after the first end-of-sequence id as batchc reports it."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW, do_sample=False)[0, len(prompt_ids) :].tolist()
    eos = model.generation_config.eos_token_id
    return out[: out.index(eos) + 1] if eos in out else out


@pytest.mark.parametrize("speculative", [False, True], ids=["k0", "k2-draft"])
def test_greedy_output_equals_transformers_generate(
    family_dirs: tuple[str, Any, Path, Path], speculative: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    family, model, target_dir, draft_dir = family_dirs
    workload = _workload(tmp_path, [{"prompt": p, "max_new_tokens": NEW} for p in PROMPTS])
    outputs, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    args = ["run", "--model", str(target_dir), "--workload", str(workload), "--outputs", str(outputs), "--json", str(summary)]
    if speculative:
        args += ["--draft", str(draft_dir), "--k", "2"]
    assert _main(args) == 0, capsys.readouterr().err
    lines = [json.loads(line) for line in outputs.read_text().splitlines()]
    assert [line["rid"] for line in lines] == list(range(len(PROMPTS)))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    distinct = set()
    for line, prompt in zip(lines, PROMPTS, strict=True):
        assert line["prompt"] == prompt
        assert line["prompt_ids"] == tok.encode(prompt).ids and line["prompt_ids"][0] == 1  # the post-processor's BOS
        want = _generate(model, line["prompt_ids"])
        assert line["output_ids"] == want, (family, prompt)
        assert line["text"] == tok.decode(want, skip_special_tokens=True)
        assert line["finish_reason"] == ("stop" if want[-1] == 2 else "length")
        assert line["finish_reason"] == "stop" or len(want) == NEW
        distinct |= set(want)
    assert len(distinct) > 10, "degenerate outputs would make the comparison weak"
    report = json.loads(summary.read_text())
    assert report["k"] == (2 if speculative else 0)
    assert report["lossless_check"].startswith("passed") and report["outstanding_tickets"] == 0
    if speculative:
        assert report["acceptance_rate"] > 0.5, report["acceptance_rate"]


def test_the_built_in_workload_runs_with_prefix_cache_chunks_and_speculation(
    family_dirs: tuple[str, Any, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Shared system prefixes (prefix-cache snapshots and COWs), prompts longer than a chunk, k = 2:
    every init op consumed once per pool, output equal to plain greedy of the target."""
    _, _, target_dir, draft_dir = family_dirs
    summary = tmp_path / "summary.json"
    args = ["run", "--model", str(target_dir), "--draft", str(draft_dir), "--requests", "12", "--max-new-tokens", "8",
            "--json", str(summary)]
    assert _main(args) == 0, capsys.readouterr().err
    report = json.loads(summary.read_text())
    assert report["prefix_cache_hit_tokens"] > 0 and "extend=" in report["steps_by_kind"] and "spec=" in report["steps_by_kind"]
    assert report["prompt_tokens"] < 12 * 200  # tokens, not bytes
    for pool in ("target", "draft"):
        for op in ("clears", "cows", "snapshots"):
            minted, consumed = report[f"{pool}_{op}_minted_consumed"].split("/")
            assert minted == consumed
    assert int(report["target_cows_minted_consumed"].split("/")[0]) > 0
    assert report["lossless_check"].startswith("passed") and report["outstanding_tickets"] == 0


def test_bfloat16_compute_serves_and_matches_greedy(
    family_dirs: tuple[str, Any, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    _, _, target_dir, _ = family_dirs
    workload = _workload(tmp_path, [{"prompt": p, "max_new_tokens": 8} for p in PROMPTS[:2]])
    out, summary = tmp_path / "o.jsonl", tmp_path / "s.json"
    args = ["run", "--model", str(target_dir), "--workload", str(workload), "--dtype", "bfloat16", "--outputs", str(out),
            "--json", str(summary)]
    assert _main(args) == 0, capsys.readouterr().err
    assert [len(json.loads(x)["output_ids"]) > 0 for x in out.read_text().splitlines()] == [True, True]
    assert json.loads(summary.read_text())["lossless_check"].startswith("passed")


def test_the_end_of_sequence_id_ends_a_request_and_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A generation_config.json naming the first generated id as EOS: every request stops at once."""
    d = tmp_path / "m"
    model = save_hf_model("bamba", d, seed=7, vocab_size=320)
    save_tokenizer(d)
    with torch.no_grad():
        first = int(model(torch.tensor([[1, 90]])).logits[0, -1].argmax())
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [first, 2]}))
    workload = _workload(tmp_path, [{"prompt": "x", "max_new_tokens": 8}])
    assert _main(["run", "--model", str(d), "--workload", str(workload), "--outputs", str(tmp_path / "o.jsonl")]) == 0
    (line,) = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert line["prompt_ids"] == [1, 90] and line["output_ids"] == [first] and line["finish_reason"] == "stop"


def test_limits_count_tokens_and_a_stop_is_one_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "m"
    save_hf_model("nemotron_h", d, seed=7, vocab_size=320)
    tok = save_tokenizer(d)
    text = "def f(x):\n    return x * 2 + 1\n" * 12  # 384 bytes, far fewer tokens
    n = len(tok.encode(text).ids)
    assert n < 200
    ok = _workload(tmp_path, [{"prompt": text, "max_new_tokens": 512 - n - 1, "stop": "\n"}])
    assert _main(["run", "--model", str(d), "--workload", str(ok), "--outputs", str(tmp_path / "o.jsonl")]) == 0
    capsys.readouterr()
    over = _workload(tmp_path, [{"prompt": text, "max_new_tokens": 512 - n}])
    capsys.readouterr()
    assert _main(["run", "--model", str(d), "--workload", str(over)]) == 2
    assert f"prompt of {n} tokens + {512 - n} new tokens exceeds the context limit 512" in capsys.readouterr().err
    two = _workload(tmp_path, [{"prompt": "x", "stop": "Grüße 🙂"}])
    assert _main(["run", "--model", str(d), "--workload", str(two)]) == 2
    assert "'stop' must be text that is one token of the tokenizer" in capsys.readouterr().err


def test_the_bundled_run_writes_outputs_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = _workload(tmp_path, [{"prompt": "def f(x):", "max_new_tokens": 6}, {"prompt": "import ", "max_new_tokens": 40, "stop": "\n"}])
    out = tmp_path / "o.jsonl"
    assert _main(["run", "--workload", str(workload), "--k", "0", "--outputs", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt_ids"] for x in lines] == [list(b"def f(x):"), list(b"import ")]
    assert len(lines[0]["output_ids"]) == 6 and lines[0]["finish_reason"] == "length"
    assert lines[0]["text"] == bytes(lines[0]["output_ids"]).decode("utf-8", "replace")
    second = lines[1]
    assert second["finish_reason"] == ("stop" if second["output_ids"][-1] == 10 else "length")
    assert 10 not in second["output_ids"][:-1]


def _one_line_refusal(args: list[str], capsys: pytest.CaptureFixture[str], fragment: str) -> None:
    capsys.readouterr()  # what building the checkpoints printed
    code = _main(args)
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and "Traceback" not in err and out == ""
    assert fragment in err, err


def test_what_cannot_be_served_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, other, moe = tmp_path / "t", tmp_path / "o", tmp_path / "moe"
    save_hf_model("bamba", target, seed=7, vocab_size=320)
    save_tokenizer(target)
    save_hf_model("bamba", other, seed=8, vocab_size=320)
    save_tokenizer(other, vocab_size=300)
    _one_line_refusal(["run", "--model", str(target), "--k", "2"], capsys, "--k 2 with a Hugging Face --model needs --draft DIR")
    _one_line_refusal(["run", "--model", str(target), "--draft", str(other)], capsys, "its tokenizer's vocabulary differs")
    _one_line_refusal(["run", "--model", str(target), "--compare-mutable"], capsys, "--compare-mutable serves the bundled")
    _one_line_refusal(["run", "--model", str(target), "--draft", "/nonexistent.safetensors"], capsys, "no such checkpoint file")
    (other / "tokenizer.json").write_text("{not json")
    _one_line_refusal(["run", "--model", str(other)], capsys, "the tokenizer does not parse")
    (other / "tokenizer.json").unlink()
    _one_line_refusal(["run", "--model", str(other)], capsys, "no tokenizer.json")
    save_hf_model("granitemoehybrid", moe, vocab_size=320)
    cfg = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 4}))
    _one_line_refusal(["run", "--model", str(moe)], capsys, "MoE variants are not supported")
    import safetensors.torch

    tensors = dict(safetensors.torch.load_file(str(moe / "model.safetensors")))
    tensors["model.layers.0.mamba.out_proj.weight"] = tensors["model.layers.0.mamba.out_proj.weight"][:, :-1].contiguous()
    safetensors.torch.save_file(tensors, str(moe / "model.safetensors"))
    (moe / "config.json").write_text(json.dumps(cfg))  # dense again: now the shape is what is wrong
    _one_line_refusal(["run", "--model", str(moe)], capsys, "tensor 'model.layers.0.mamba.out_proj.weight' has shape (64, 127), expected (64, 128)")
    out_dir = tmp_path / "od"
    out_dir.mkdir()
    _one_line_refusal(["run", "--model", str(target), "--outputs", str(out_dir / "a.json"), "--json", str(out_dir / "." / "a.json")],
                      capsys, "name the same file")
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "gone.safetensors"}}))
    _one_line_refusal(["run", "--model", str(target)], capsys, "no shard named by model.safetensors.index.json")
