"""``batchc run`` end to end on a short workload, and its refusals of bad input: one line on stderr
naming the file and line (or tensor), exit status 2, no traceback."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
import safetensors.torch

from backend.hybrid.checkpoint import FORMAT, bundled_path, config_to_json, save_checkpoint
from backend.hybrid.config import tiny
from backend.hybrid.weights import init_weights
from compiler.cli import main


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["run", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_short_run_json_summary_invariants(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "summary.json"
    code, out, _ = _run(["--requests", "6", "--max-new-tokens", "6", "--lossless-sample", "3", "--json", str(path)], capsys)
    assert code == 0
    s = json.loads(path.read_text())
    assert s["requests"] == 6
    assert s["outstanding_tickets"] == 0 and s["replays_blocked"] == 0
    assert s["slots_live_after"] == 0 and s["kv_live_after"] == 0
    for pool in ("target", "draft"):
        for op in ("clears", "cows", "snapshots"):
            minted, consumed = s[f"{pool}_{op}_minted_consumed"].split("/")
            assert minted == consumed
    assert s["target_clears_minted_consumed"] == s["draft_clears_minted_consumed"]
    assert s["lossless_ok"] is True and s["lossless_check"].startswith("passed")
    assert s["aborted_requests"] == 0 and s["failed_forwards"] == 0 and s["first_failure"] is None
    assert "aborted_requests" in out and "first_failure" not in out
    assert 0.0 <= s["acceptance_rate"] <= 1.0
    assert 6 <= s["generated_tokens"] <= 36
    assert "lossless_check" in out and "host time per pass" in out


def test_compare_mutable_shows_the_replays_and_the_acceptance_they_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # two bursts of 8 on the bundled models: the pre-fix baseline replays the first prefill's clears
    # and COWs on the live draft state; the fixed baseline and the compiled pipeline run none
    path = tmp_path / "summary.json"
    code, out, _ = _run(["--requests", "16", "--max-new-tokens", "16", "--lossless-sample", "0", "--compare-mutable",
                         "--json", str(path)], capsys)
    assert code == 0
    s = json.loads(path.read_text())
    pre, fixed = s["mutable_baseline"], s["mutable_baseline_fixed"]
    assert pre["replays"] > 0 and pre["stale_ops_run"] > 0
    assert fixed["replays"] == 0 and fixed["stale_ops_run"] == 0 and s["replays_blocked"] == 0
    assert pre["init_ops_draft"] == fixed["init_ops_draft"] + pre["stale_ops_run"]
    assert pre["acceptance_rate"] < fixed["acceptance_rate"]
    assert "mutable, pre-fix" in out and "mutable + upstream fix" in out
    # the ratio and the exposed host time per step of every run, model time measured alike
    assert s["tokens_per_s_vs_mutable_fixed"] == pytest.approx(s["tokens_per_s"] / fixed["tokens_per_s"])
    for run in (s, pre, fixed):
        assert 0.0 < run["model_s"] < run["wall_s"] and run["steps"] > 0
        assert run["host_ms_per_step"] == pytest.approx((run["wall_s"] - run["model_s"]) / run["steps"] * 1e3)
    assert "compiled / mutable + upstream fix" in out and "host ms/step" in out


def test_builtin_workload_arrival_patterns() -> None:
    from compiler.offline import builtin_workload
    from compiler.workload import BURST_EVERY, BURST_SIZE

    bursts, trickle = builtin_workload(num_requests=20), builtin_workload(num_requests=20, arrivals="trickle")
    assert [r.arrival for r in bursts] == [(i // BURST_SIZE) * BURST_EVERY for i in range(20)]
    steps = [b.arrival - a.arrival for a, b in pairwise(trickle)]
    assert set(steps) <= {0, 1, 2} and len(set(steps)) > 1
    assert [(r.prompt, r.max_new_tokens) for r in bursts] == [(r.prompt, r.max_new_tokens) for r in trickle]
    with pytest.raises(ValueError, match="arrivals must be one of"):
        builtin_workload(arrivals="poisson")


def test_loading_a_checkpoint_the_test_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny()
    path = tmp_path / "tiny.safetensors"
    save_checkpoint(path, cfg, init_weights(cfg, seed=3))
    code, _, err = _run(["--model", str(path), "--k", "0", "--requests", "3", "--max-new-tokens", "4", "--lossless-sample", "0"], capsys)
    assert code == 0, err


BAD_WORKLOADS = [
    ("bad-json", '{"prompt": "x", "max_new_tokens": 3}\n{"prompt": "y",\n', r"workload.jsonl:2: bad JSON"),
    ("empty-prompt", '{"prompt": "", "max_new_tokens": 3}\n', r"workload.jsonl:1: 'prompt' must be a non-empty string"),
    ("negative-max-tokens", '{"prompt": "x", "max_new_tokens": -1}\n', r"workload.jsonl:1: 'max_new_tokens' must be a positive integer, got -1"),
    ("not-an-object", "[1, 2]\n", r"workload.jsonl:1: expected a JSON object, got list"),
    ("unknown-field", '{"prompt": "x", "temprature": 0.7}\n', r"workload.jsonl:1: unknown field\(s\) \['temprature'\]"),
    ("long-stop", '{"prompt": "x", "stop": "%s"}\n' % ("a" * 257), r"workload.jsonl:1: 'stop': a stop string has at most 256 characters, got 257"),
    ("empty-file", "\n\n", r"workload.jsonl: no requests"),
]


@pytest.mark.parametrize(("content", "message"), [(c, m) for _, c, m in BAD_WORKLOADS], ids=[i for i, _, _ in BAD_WORKLOADS])
def test_malformed_workload_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str) -> None:
    path = tmp_path / "workload.jsonl"
    path.write_text(content)
    code, _, err = _run(["--workload", str(path)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    import re

    assert re.search(message, err), err


def test_missing_workload_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["--workload", str(tmp_path / "nope.jsonl")], capsys)
    assert code == 2 and "nope.jsonl: cannot read workload file" in err and err.count("\n") == 1


def test_corrupt_checkpoint_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(bundled_path("target.safetensors").read_bytes()[:1000])
    code, _, err = _run(["--model", str(path)], capsys)
    assert code == 2 and "bad.safetensors" in err and err.count("\n") == 1 and "Traceback" not in err


def test_mismatched_checkpoint_names_the_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny()
    weights = init_weights(cfg, seed=0)
    weights["lm_head"] = weights["lm_head"][:-1].contiguous()
    path = tmp_path / "mismatch.safetensors"
    # written by hand: save_checkpoint itself refuses weights that do not match their config
    safetensors.torch.save_file(weights, str(path), metadata={"format": FORMAT, "config": config_to_json(cfg)})
    code, _, err = _run(["--model", str(path)], capsys)
    assert code == 2 and "lm_head" in err and err.count("\n") == 1

