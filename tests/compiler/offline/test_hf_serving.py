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


def test_limits_count_tokens_and_a_stop_is_any_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
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
    # a stop string is text, whatever number of tokens it is; an empty one is refused, naming the line
    assert tok.encode("Grüße 🙂", add_special_tokens=False).ids[1:]  # several tokens
    many = _workload(tmp_path, [{"prompt": "x", "max_new_tokens": 4, "stop": ["Grüße 🙂", "\n"]}])
    assert _main(["run", "--model", str(d), "--workload", str(many)]) == 0
    capsys.readouterr()
    empty = _workload(tmp_path, [{"prompt": "x", "stop": ["\n", ""]}])
    assert _main(["run", "--model", str(d), "--workload", str(empty)]) == 2
    assert "workload.jsonl:1: 'stop': a stop string must not be empty (got '')" in capsys.readouterr().err


def test_the_bundled_run_writes_outputs_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = _workload(tmp_path, [{"prompt": "def f(x):", "max_new_tokens": 6}, {"prompt": "import ", "max_new_tokens": 40, "stop": "\n"}])
    out = tmp_path / "o.jsonl"
    assert _main(["run", "--workload", str(workload), "--k", "0", "--outputs", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt_ids"] for x in lines] == [list(b"def f(x):"), list(b"import ")]
    assert len(lines[0]["output_ids"]) == 6 and lines[0]["finish_reason"] == "length"
    assert lines[0]["text"] == bytes(lines[0]["output_ids"]).decode("utf-8", "replace")
    # the stop string "\n": the ids end with the newline that completed it, the text before it
    second = lines[1]
    assert second["finish_reason"] == ("stop" if 10 in second["output_ids"] else "length")
    assert 10 not in second["output_ids"][:-1] and "\n" not in second["text"]
    assert second["text"] == bytes(second["output_ids"]).decode("utf-8", "replace").removesuffix("\n")
    assert [x["index"] for x in lines] == [0, 0]


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


def test_a_checkpoint_holding_nan_or_inf_is_refused_before_serving(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Target or draft, NaN or Inf, one process or rank 0 of --tp 2: one line naming the checkpoint's
    tensor, exit 2, before anything is served (it used to serve all-zero outputs and exit 0)."""
    import safetensors.torch

    target, draft = tmp_path / "t", tmp_path / "d"
    save_hf_model("bamba", target, seed=7, vocab_size=320)
    save_hf_model("bamba", draft, seed=7, vocab_size=320, noise=0.03)
    for d in (target, draft):
        save_tokenizer(d)

    def poison(d: Path, name: str, value: float) -> None:
        tensors = dict(safetensors.torch.load_file(str(d / "model.safetensors")))
        tensors[name].view(-1)[5] = value
        safetensors.torch.save_file(tensors, str(d / "model.safetensors"))

    poison(draft, "model.layers.2.mamba.in_proj.weight", float("inf"))
    _one_line_refusal(["run", "--model", str(target), "--draft", str(draft), "--k", "2"], capsys,
                      "tensor 'model.layers.2.mamba.in_proj.weight' has 1 non-finite values")
    poison(target, "model.layers.1.self_attn.v_proj.weight", float("nan"))
    for extra in ([], ["--tp", "2"]):
        _one_line_refusal(["run", "--model", str(target), *extra], capsys, "tensor 'model.layers.1.self_attn.v_proj.weight' has 1 non-finite values")


def test_logits_that_are_not_finite_end_their_requests_with_error_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Finite weights whose logits are not finite for some requests: a tied Granite embedding row
    that the embedding multiplier (10) takes past float32 (1e38 * 10 = inf) at lookup, so every
    position from the one fed that token on has NaN logits; the final norm's weight 0 on that one
    coordinate keeps every other token's logits finite and unchanged. The request that generates
    the token emits it and then ends with finish_reason "error" (at k = 2 possibly earlier: see
    compiler.engine.nonfinite); the others are served exactly as without the poison; exit 1 with
    one line; the lossless check compares only the requests that ended normally, at k = 0,
    pipelined (--overlap) and through the verify at k = 2."""
    import safetensors.torch

    d = tmp_path / "m"
    save_hf_model("granitemoehybrid", d, seed=7, vocab_size=320, embedding_multiplier=10.0)
    tok = save_tokenizer(d)
    tensors = dict(safetensors.torch.load_file(str(d / "model.safetensors")))
    tensors["model.norm.weight"][0] = 0.0
    safetensors.torch.save_file(tensors, str(d / "model.safetensors"))
    workload = _workload(tmp_path, [{"prompt": p, "max_new_tokens": 10} for p in PROMPTS])
    prompts = [tok.encode(p).ids for p in PROMPTS]

    def served(*extra: str) -> tuple[int, str, list[dict[str, Any]], dict[str, Any]]:
        out, summary = tmp_path / "o.jsonl", tmp_path / "s.json"
        capsys.readouterr()
        code = _main(["run", "--model", str(d), "--workload", str(workload), "--outputs", str(out), "--json", str(summary),
                      "--lossless-sample", str(len(PROMPTS)), *extra])
        stdout, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return code, stdout + err, [json.loads(x) for x in out.read_text().splitlines()], json.loads(summary.read_text())

    code, _, clean, report = served()
    assert code == 0 and report["errored_requests"] == 0
    # a token some request generates (not first) and that appears nowhere else, prompts included
    seen = [set(p) | set(line["output_ids"]) for p, line in zip(prompts, clean, strict=True)]
    victim, at, poison = next(
        (r, j, t) for r, line in enumerate(clean) for j, t in enumerate(line["output_ids"])
        if j >= 1 and t not in line["output_ids"][:j] and t not in prompts[r] and t != 2
        and not any(t in s for i, s in enumerate(seen) if i != r)
    )
    tensors["model.embed_tokens.weight"][poison, 0] = 1e38  # finite: the load accepts it
    safetensors.torch.save_file(tensors, str(d / "model.safetensors"))
    for extra in ([], ["--overlap"], ["--draft", str(d), "--k", "2"]):
        code, text, lines, report = served(*extra)
        assert code == 1, (extra, text)
        assert text.count("batchc: run failed:") == 1
        assert f"1 request ended in error (first: request {victim}): the model's logits for its next token were not finite" in text
        for r, (line, want) in enumerate(zip(lines, clean, strict=True)):
            if r == victim:
                assert line["finish_reason"] == "error" and "not finite" in line["reason"], (extra, line)
                if "--k" not in extra:  # up to the poisoned token, whose own logits were finite
                    assert line["output_ids"] == want["output_ids"][: at + 1], extra
                else:  # a verify window's later NaN may flag its earlier positions too (masked products): a prefix
                    assert line["output_ids"] == want["output_ids"][: len(line["output_ids"])] and len(line["output_ids"]) <= at + 1
            else:
                assert line == want, (extra, r)
        assert report["errored_requests"] == 1 and report["slots_live_after"] == 0 and report["outstanding_tickets"] == 0
        assert report["lossless_check"] == (
            f"passed: {len(PROMPTS) - 1} requests equal plain greedy of the target (1 request that ended in error not compared)"
        )
    # every request poisoned (the beginning-of-sequence token starts every prompt): no verdict at all
    tensors["model.embed_tokens.weight"][1, 0] = 1e38
    safetensors.torch.save_file(tensors, str(d / "model.safetensors"))
    code, text, lines, report = served()
    assert code == 1 and "passed" not in text
    assert [line["finish_reason"] for line in lines] == ["error"] * len(PROMPTS) and all(not line["output_ids"] for line in lines)
    assert report["lossless_check"].startswith("not run: none of the 5 sampled requests ended normally") and "lossless_ok" not in report
