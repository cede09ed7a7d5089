"""End-to-end runs of the ``batchc`` command line (small sizes)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from compiler.cli import main


def test_console_script_help() -> None:
    exe = shutil.which("batchc")
    cmd = [exe, "--help"] if exe else [sys.executable, "-m", "compiler.cli", "--help"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for command in ("run", "dump", "bench"):
        assert command in result.stdout


def test_dump_prints_every_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump"]) == 0
    out = capsys.readouterr().out
    for name in ("prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch", "mix_with_running", "lower"):
        assert f" {name} ==" in out
    assert "MixedPlan requests=" in out and "IdlePlan requests=0" not in out


def test_bench_pipeline_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "pipeline", "--sizes", "1", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "mutable baseline" in out and "ratio" in out


def test_bench_kernels_on_cpu_says_gpu_figures_need_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kernels", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "need a GPU" in out
    assert "bundled target decode" in out and "bundled target verify" in out  # the torch path against the per-row one


def test_bad_option_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--requests", "-3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "expected a positive integer, got -3" in err
    assert "Traceback" not in err
