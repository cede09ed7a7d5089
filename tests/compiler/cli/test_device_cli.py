"""``--device`` on ``batchc ab``, ``bench serve`` and ``bench iteration``: the
values and refusals of ``batchc run``'s (``tests/compiler/cli/test_memory_cli.py``), ``--device cpu``
the default run, and the options that need other processes refused on a CUDA device, each in one
line with exit status 2 before anything starts. A CUDA machine is faked as that file fakes one; the
torch here has no CUDA, so a run that gets past the checks fails to place its models, in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import run_cli

_SMALL = {
    "ab": ["ab", "--requests", "2", "--max-new-tokens", "2", "--max-running", "2"],
    "bench serve": ["bench", "serve", "--sweep", "1", "--max-new-tokens", "2", "--k", "0", "--repeats", "1"],
    "bench iteration": ["bench", "iteration", "--rows", "1", "--k", "1", "--repeats", "1", "--context", "2"],
}
"""Each command at a size that runs in about a second."""


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], *fragments: str) -> None:
    capsys.readouterr()
    code = run_cli(args)
    out, err = capsys.readouterr()
    assert code == 2, (code, err[-2000:])
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert out == "", "something started: " + out[:300]
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def _cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as one with two CUDA devices of 8 GiB free each."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (8 << 30, 80 << 30))


def test_ab_on_the_cpu_device_is_the_default_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs: list[dict[str, Any]] = []
    for extra in ([], ["--device", "cpu"]):
        path = tmp_path / f"ab{len(runs)}.json"
        assert run_cli([*_SMALL["ab"], *extra, "--json", str(path)]) == 0, capsys.readouterr().err
        report = json.loads(path.read_text())
        for run in report["runs"].values():
            assert run.pop("wall_s") > 0
        report["ledger_on_baseline"] = re.sub(r"ticket #\d+", "ticket", report["ledger_on_baseline"])  # (a process-wide counter)
        runs.append(report)
    assert runs[0] == runs[1]
    assert runs[0]["runs"]["compiled"]["equals_greedy"] is True


@pytest.mark.parametrize("command", ["bench serve", "bench iteration"])
def test_the_benches_run_on_the_cpu_device(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    path = tmp_path / "out.json"
    assert run_cli([*_SMALL[command], "--device", "cpu", "--json", str(path)]) == 0, capsys.readouterr().err
    report = json.loads(path.read_text())
    if command == "bench serve":  # every engine served the sweep's tokens
        assert {r["engine"] for r in report} == {"compiled", "mutable", "mutable-fixed"} and all(r["tokens"] == 2 for r in report)
    else:
        assert {p["phase"] for p in report["phases"]} >= {"decode", "verify", "commit", "head propose"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("command", list(_SMALL))
def test_cuda_where_there_is_none_is_refused(capsys: pytest.CaptureFixture[str], command: str) -> None:
    _refused([*_SMALL[command], "--device", "cuda"], capsys,
             f"batchc {command}: error: argument --device: device 'cuda': no CUDA device on this machine")


@pytest.mark.parametrize("command", list(_SMALL))
def test_a_cuda_device_is_checked_then_the_models_placed_on_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                               command: str) -> None:
    _cuda(monkeypatch)
    _refused([*_SMALL[command], "--device", "cuda:2"], capsys,
             f"batchc {command}: error: argument --device: device 'cuda:2': this machine has 2 CUDA devices")
    if command == "bench serve":  # the options that serve through other processes
        for option in (["--overlap"], ["--tp", "2"]):
            _refused([*_SMALL[command], "--device", "cuda:1", *option], capsys,
                     f"batchc: error: --device cuda:1 with {option[0]}: on a CUDA device the bench serves in this process only so far")
    # past the checks, the models go to the device: this torch has none (the device above is faked), which the command says
    # in one line instead of running on the CPU
    _refused([*_SMALL[command], "--device", "cuda:1"], capsys, "batchc: error: --device cuda:1: the models cannot be placed there (")
