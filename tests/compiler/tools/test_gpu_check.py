"""scripts/gpu-check at CI sizes on the CPU: the JSON it writes, its provenance and its sections."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from compiler.tools import gpu_check

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _served_verify_level(monkeypatch: pytest.MonkeyPatch) -> None:
    # (the suite's BATCHC_VERIFY=2 hashes the pool every forward, a readback by design; the check measures a served engine)
    monkeypatch.setenv("BATCHC_VERIFY", "0")


def test_a_cpu_run_writes_one_json_with_provenance_and_each_section(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    code = gpu_check.main(["--device", "cpu", "--out", str(out), "--only", "kernels", "host_time"])
    doc = json.loads(out.read_text())
    assert code == 0, doc["sections"]
    assert doc["schema"] == gpu_check.SCHEMA
    p = doc["provenance"]
    assert p["device"] == "cpu" and p["size"] == "ci" and p["label"].startswith("CPU run")
    assert p["torch"] and p["date"] and p["command"].startswith("scripts/gpu-check --device cpu")
    assert p["commit"] is None or len(p["commit"]) == 40
    assert list(doc["sections"]) == ["kernels", "host_time"]
    kernels = doc["sections"]["kernels"]["data"]
    assert kernels["copy"]["gb_s"] > 0
    names = {r["kernel"] for r in kernels["rows"]}
    assert names == {"init clear", "init cow", "init snapshot", "selective_state_update", "conv step"}
    assert all(r["share_of_copy"] > 0 and r["torch_share_of_copy"] > 0 for r in kernels["rows"])
    host = doc["sections"]["host_time"]["data"]
    assert all(h["readbacks_per_step"] == 1 and h["wall_ms_per_step"] >= h["busy_ms_per_step"] > 0 for h in host.values())


def test_a_failing_section_is_recorded_and_the_next_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device: str, ci: bool) -> dict[str, object]:
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(gpu_check, "section_kernels", broken)
    out = tmp_path / "check.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--only", "kernels", "host_time"]) == 1
    sections = json.loads(out.read_text())["sections"]
    assert sections["kernels"]["status"] == "failed" and sections["kernels"]["error"].startswith("RuntimeError: the device fell over")
    assert sections["host_time"]["status"] == "ok"


def test_a_missing_device_is_refused_in_one_line() -> None:
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--device", "tpu"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("gpu-check: --device tpu: ")
