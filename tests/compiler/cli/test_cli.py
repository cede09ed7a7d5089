"""End-to-end runs of the ``batchc`` command line (small sizes)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compiler.cli
from compiler.cli import main, parser
from compiler.offline import ServeConfig


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


def test_bench_iteration_prints_every_phase_in_decodes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = tmp_path / "iteration.json"
    assert main(["bench", "iteration", "--rows", "2", "--repeats", "1", "--json", str(report)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (rich wraps the closing sentence)
    phases = ("decode", "verify", "commit", "propose", "draft commit", "propose k", "draft extend", "head propose", "head commit")
    for phase in phases:
        assert f" {phase} " in out
    assert "iteration with the separate draft (verify + commit + propose + draft commit):" in out and "target decodes" in out
    assert "with the draft head (verify + commit + head propose + head commit):" in out
    data = json.loads(report.read_text())
    assert [p["phase"] for p in data["phases"]] == list(phases) and [i["draft"] for i in data["iterations"]] == ["model", "mtp"]


def test_bench_iteration_takes_the_context_of_its_rows(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = tmp_path / "iteration.json"
    assert main(["bench", "iteration", "--draft", "mtp", "--rows", "2", "--repeats", "1", "--context", "7", "--json", str(report)]) == 0
    assert "2 rows, k=2, 7 tokens of context" in " ".join(capsys.readouterr().out.split())
    assert json.loads(report.read_text())["context"] == 7
    for bad in ("0", "2049", "x"):
        with pytest.raises(SystemExit) as info:
            main(["bench", "iteration", "--context", bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "--context" in err and len(err.strip().splitlines()) <= 2  # (argparse: the usage line and the error)


def test_bench_iteration_times_the_draft_it_is_given(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``--draft``: that draft's phases only (here the bundled head: ``mtp``); ``--model`` needs one."""
    report = tmp_path / "iteration.json"
    assert main(["bench", "iteration", "--draft", "mtp", "--rows", "2", "--repeats", "1", "--json", str(report)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "with the draft head (verify + commit + head propose + head commit):" in out and "separate draft" not in out
    data = json.loads(report.read_text())
    assert [p["phase"] for p in data["phases"]] == ["decode", "verify", "commit", "head propose", "head commit"]
    assert [i["draft"] for i in data["iterations"]] == ["mtp"]
    assert main(["bench", "iteration", "--model", str(tmp_path / "nowhere")]) == 2
    assert "give --draft (a head file from batchc train-draft" in capsys.readouterr().err


def test_bad_option_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--requests", "-3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "expected a positive integer, got -3" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["run"], ["ab"], ["bench", "serve"], ["bench", "pipeline"], ["bench", "kernels"], ["bench", "iteration"]])
def test_threads_default_is_the_config_record(argv: list[str]) -> None:
    assert parser().parse_args(argv).threads == ServeConfig().threads == 1


@pytest.mark.parametrize(("argv", "command"), [(["run"], "cmd_run"), (["ab"], "cmd_ab"), (["bench", "serve"], "cmd_bench"),
                                               (["bench", "kernels"], "cmd_bench"), (["bench", "iteration"], "cmd_bench")])
def test_threads_are_set_before_the_command_runs(monkeypatch: pytest.MonkeyPatch, argv: list[str], command: str) -> None:
    seen: list[int] = []

    def command_stub(args: object, console: object) -> int:
        seen.append(torch.get_num_threads())
        return 0

    monkeypatch.setattr(compiler.cli, command, command_stub)
    want = 3 if torch.get_num_threads() != 3 else 2
    assert main([*argv, "--threads", str(want)]) == 0
    assert seen == [want] and torch.get_num_threads() == want
