"""``batchc bench sampler`` reports every case at every row count and vocabulary next to a decode
step of the same rows (the structure of its table and JSON; the timings are never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compiler.cli import main
from compiler.tools.bench_sampler import CASES, run_sampler_bench
from tests.helpers import tiny_models


def test_every_case_rows_and_vocabulary_is_timed_against_the_decode() -> None:
    target, _ = tiny_models()
    report = run_sampler_bench(target, rows=(2, 3), vocabs=(300, target.config.vocab), repeats=2)
    vocab = target.config.vocab
    assert report.model_vocab == vocab and report.repeats == 2
    assert list(report.decode) == [2, 3]
    assert [(r.rows, r.vocab, r.case) for r in report.rows] == [(n, v, c) for n in (2, 3) for v in (vocab, 300) for c in CASES]
    for r in report.rows:
        assert 0 < r.time.min_s <= r.time.median_s <= r.time.max_s
        assert r.share == r.time.median_s / report.decode[r.rows].median_s
    data = report.to_json()
    assert [d["rows"] for d in data["decode"]] == [2, 3]
    assert len(data["sampler"]) == len(report.rows)
    assert set(data["sampler"][0]) == {"rows", "vocab", "case", "median_s", "min_s", "max_s", "share"}


def test_cli_prints_the_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sampler.json"
    assert main(["bench", "sampler", "--rows", "2", "--vocab", "--repeats", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "decode step" in text and "share of decode" in text
    for case in CASES:
        assert case in text
    data = json.loads(out.read_text())
    assert [d["case"] for d in data["sampler"]] == list(CASES)
    assert {d["vocab"] for d in data["sampler"]} == {data["model_vocab"]}
