"""``batchc run --model DIR --model-impl transformers``: the workload served with transformers' own
modeling code and cache (``backend.hf.transformers_backend``) under batchc's engine: with chunked
prefill and the prefix cache, each request's output equals transformers' ``generate`` for it alone,
every ticket is consumed and the lossless check passes; what the transformers backend does not serve
is refused in one line (exit 2) before anything runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.backend.hf.builders import FAMILY_NAMES, save_hf_model, save_tokenizer
from tests.helpers import run_cli

NEW = 12
SHARED = "def f(x):\n    return x * 2 + 1\nimport re, os\nclass K:\n"
PROMPTS = [SHARED + "    pass", "Grüße 🙂 café", SHARED + "for a in range(10):", "x", SHARED + "    print(a)"]
"""Three prompts share a long prefix (worth a prefix-cache snapshot once seen twice)."""


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    family = str(request.param)
    d = tmp_path_factory.mktemp(family)
    model = save_hf_model(family, d, seed=7, vocab_size=320)
    save_tokenizer(d)
    return family, model, d


def _generate(model: Any, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy output, cut after the first end-of-sequence id as batchc reports it."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW, do_sample=False)[0, len(prompt_ids) :].tolist()
    eos = model.generation_config.eos_token_id
    return out[: out.index(eos) + 1] if eos in out else out


def _workload(tmp: Path, lines: list[dict[str, Any]]) -> Path:
    path = tmp / "workload.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_outputs_equal_generate_with_chunks_and_the_prefix_cache(
    checkpoint: tuple[str, Any, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    family, model, d = checkpoint
    # one request at a time (arrivals 4 steps apart): the later ones find the shared prefix cached
    workload = _workload(tmp_path, [{"prompt": p, "max_new_tokens": NEW, "arrival": 4 * i} for i, p in enumerate(PROMPTS)])
    outputs, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    args = ["run", "--model", str(d), "--model-impl", "transformers", "--workload", str(workload), "--outputs", str(outputs),
            "--json", str(summary), "--chunk-size", "7", "--lossless-sample", "2"]
    assert run_cli(args) == 0, capsys.readouterr().err
    lines = [json.loads(line) for line in outputs.read_text().splitlines()]
    for line in lines:
        assert line["output_ids"] == _generate(model, line["prompt_ids"]), (family, line["prompt"])
    s = json.loads(summary.read_text())
    assert s["outstanding_tickets"] == 0 and s["aborted_requests"] == 0
    assert s["prefix_cache_hit_tokens"] > 0
    cows = s["target_cows_minted_consumed"].split("/")
    assert cows[0] == cows[1] and int(cows[0]) >= 1
    assert s["lossless_check"].startswith("passed")


def _one_line_refusal(args: list[str], capsys: pytest.CaptureFixture[str], fragment: str) -> None:
    capsys.readouterr()
    code = run_cli(args)
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and "Traceback" not in err and out == ""
    assert fragment in err, err


def test_what_the_transformers_backend_does_not_serve_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "granite"
    save_hf_model("granitemoehybrid", d, seed=7, vocab_size=320)  # (the refusals come before any model code runs: one family shows them)
    save_tokenizer(d)
    impl = ["--model-impl", "transformers"]
    _one_line_refusal(["run", *impl], capsys, "--model-impl transformers needs --model DIR")
    _one_line_refusal(["run", "--model", str(tmp_path / "x.safetensors"), *impl], capsys, "is not a directory")
    _one_line_refusal(["run", "--model", str(d), *impl, "--k", "2"], capsys, "--model-impl transformers with --k")
    _one_line_refusal(["run", "--model", str(d), *impl, "--draft", str(d)], capsys, "--model-impl transformers with --draft")
    _one_line_refusal(["run", "--model", str(d), *impl, "--overlap"], capsys, "--model-impl transformers with --overlap")
    _one_line_refusal(["run", "--model", str(d), *impl, "--dp", "2"], capsys, "--model-impl transformers with --dp")
    penalised = _workload(tmp_path, [{"prompt": "x", "max_new_tokens": 2, "presence_penalty": 0.5}])
    _one_line_refusal(["run", "--model", str(d), *impl, "--workload", str(penalised)], capsys, "sets a penalty")
    _one_line_refusal(["run", "--model", str(d), "--model-impl", "vllm"], capsys, "invalid choice: 'vllm'")


def test_without_transformers_installed_the_refusal_says_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    d = tmp_path / "granite"
    save_hf_model("granitemoehybrid", d, seed=7, vocab_size=320)
    save_tokenizer(d)
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else found(name, *a))
    _one_line_refusal(["run", "--model", str(d), "--model-impl", "transformers"], capsys,
                      "--model-impl transformers needs transformers installed (pip install 'batchc[transformers]')")
