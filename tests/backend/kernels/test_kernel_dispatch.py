"""The dispatch rule and the re-decoration of jit modules when TRITON_INTERPRET flips."""

from __future__ import annotations

import pytest
import torch

from backend.kernels import dispatch
from backend.kernels.init_rows import init_rows
from tests.helpers import HAS_CUDA


def test_rule_follows_device_and_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.empty(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton(cpu)  # the module fixture asks for Triton on the CPU
    monkeypatch.delenv(dispatch.CPU_KERNELS_ENV)
    assert not dispatch.use_triton(cpu)
    monkeypatch.setenv(dispatch.CPU_KERNELS_ENV, "1")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not dispatch.use_triton(cpu)
    if HAS_CUDA:
        assert dispatch.use_triton(torch.empty(1, device="cuda"))


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU fallback and interpreter switching")
def test_flipping_the_interpreter_after_import_still_runs_the_right_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compiled_mode = dispatch.jit_module("init_rows")  # decorated for the compiler: unusable on CPU
    buffer = torch.arange(4 * 64, dtype=torch.int64).to(torch.uint8).view(4, 64)
    init_rows(buffer, torch.tensor([1]), torch.tensor([2]), torch.tensor([3]))  # torch reference
    assert torch.all(buffer[1] == 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = dispatch.jit_module("init_rows")
    assert type(interpreted.init_rows_kernel).__name__ == "InterpretedFunction"
    assert type(compiled_mode.init_rows_kernel).__name__ != "InterpretedFunction" or compiled_mode is interpreted
    init_rows(buffer, torch.tensor([2]), torch.tensor([]).long(), torch.tensor([]).long())
    assert torch.all(buffer[2] == 0)
