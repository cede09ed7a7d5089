"""``--weight-dtype`` on ``batchc run`` and ``batchc bench decode``: 16-bit matrices beside float32
compute serve the same workload, the bench reports their agreement with float32, and what they do
not serve with is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compiler.tools import docs_tables
from tests.helpers import run_cli


def test_run_serves_with_16_bit_weights_and_records_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outs = {}
    for dtype in ("float32", "float16"):
        out = tmp_path / f"{dtype}.jsonl"
        assert run_cli(["run", "--k", "0", "--requests", "1", "--max-new-tokens", "4", "--weight-dtype", dtype, "--outputs", str(out)]) == 0
        outs[dtype] = [json.loads(line)["output_ids"] for line in out.read_text().splitlines()]
    capsys.readouterr()
    assert len(outs["float16"]) == 1 and all(outs["float16"])
    # the bundled byte-level model's greedy tokens survive float16 matrices on these prompts (logits differ by ~1e-3)
    assert outs["float16"] == outs["float32"]


def test_bench_decode_reports_the_agreement_that_the_docs_render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--weight-dtype", "float32", "bfloat16", "--batch", "1", "--threads", "1", "--prompt-len", "5",
            "--new-tokens", "3", "--repeats", "1", "--min-seconds", "0", "--copy-mib", "8", "--no-split", "--json", str(out)]
    assert run_cli(argv) == 0
    assert "16-bit weights against float32" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [r["dtype"] for r in data["rows"]] == ["float32", "bfloat16 weights"]
    assert data["weight_bytes"]["bfloat16 weights"] < data["weight_bytes"]["float32"]
    [(label, agreement)] = data["agreement"].items()
    assert label == "bfloat16 weights" and agreement["prompts"] == 4 and agreement["new_tokens"] == 3
    assert 0 <= agreement["greedy_match"] <= 1 and agreement["logit_max_abs_diff"] > 0
    record = {"provenance": {key: 1 for key in docs_tables.PROVENANCE_KEYS} | {"commit": "c" * 40, "command": " ".join(["batchc", *argv])},
              "data": data}
    table = docs_tables.render_record(record)
    assert "| bfloat16 weights | 1 | 1 |" in table and "greedy match" in table


def test_what_16_bit_weights_do_not_serve_with_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in ((["run", "--weight-dtype", "float16", "--k", "2"], "--weight-dtype float16 with --k 2:"),
                       (["run", "--weight-dtype", "bfloat16", "--k", "0", "--dtype", "bfloat16"], "--weight-dtype bfloat16 with --dtype bfloat16:"),
                       (["run", "--weight-dtype", "int8"], "argument --weight-dtype: invalid choice: 'int8'"),
                       (["bench", "decode", "--weight-dtype", "float64"], "argument --weight-dtype: invalid choice: 'float64'")):
        assert run_cli(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "Traceback" not in err, err
