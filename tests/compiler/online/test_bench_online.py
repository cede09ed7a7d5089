"""``batchc bench online`` end to end: it starts ``batchc serve``, sends Poisson arrivals at each
rate, and writes one row per rate with the throughput and the latency percentiles."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests import forkserver
from tests.compiler.online.server_proc import ROOT


def test_bench_online_reports_a_row_per_rate(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = forkserver.run([sys.executable, "-m", "compiler.cli", "bench", "online", "--rates", "4", "50", "--requests", "6",
                           "--max-new-tokens", "4", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["rate"] for r in report["rows"]] == [4.0, 50.0]
    for row in report["rows"]:
        assert row["requests"] == 6 and row["output_tokens"] >= 6 and row["request_throughput"] > 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            values = [row[metric][q] for q in ("p50", "p90", "p99")]
            assert all(v is None or v >= 0 for v in values)
        assert row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
    assert "batchc bench online" in proc.stdout
