"""float32 weights through ``backend.kernels.lowp.f32_linear``'s C kernel (2 to 16 rows): the
product of the float32 values to float32 tolerance, one row's output bit for bit the same whatever
rows it is batched with, and a model through it agreeing with the same model through MKL."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backend.hybrid import HybridModel
from backend.hybrid.reference import greedy_generate_reference
from backend.hybrid.weights import matmul_layout, projections
from backend.kernels import lowp
from compiler.tools.bench_decode import weight_agreement
from tests.helpers import served_greedy, tiny_models

needs_kernel = pytest.mark.skipif(lowp.kernel_status() != "c-avx2-f16c", reason="the C kernel does not run here")


class _Counting:
    """A stand-in for the kernel library that counts the float32 products it forwards."""

    def __init__(self, lib: Any) -> None:
        self.lib, self.calls = lib, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)

    def batchc_f32_linear(self, *args: Any) -> None:
        self.calls += 1
        self.lib.batchc_f32_linear(*args)


def _stored(k: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """A float32 ``[n, k]`` matrix stored as ``matmul_layout`` stores it (its ``.T`` contiguous)."""
    return torch.randn(k, n, generator=gen).T


@needs_kernel
def test_f32_linear_is_the_product_of_the_float32_values() -> None:
    gen = torch.Generator().manual_seed(3)
    before = torch.get_num_threads()
    try:
        # in-widths off the 8-k steps, out-widths off the 24- and 16-column tiles and the 8-lane vectors
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for k, n in ((13, 7), (77, 53), (200, 101), (96, 389)):
                w = _stored(k, n, gen)
                for rows in (2, 3, 5, 8, 9, 13, 16):
                    x = torch.randn(rows, 2 * k, generator=gen)[:, ::2]  # rows with a stride, columns not unit
                    out = lowp.f32_linear(x, w)
                    ref = x.double() @ w.double().T
                    scale = (x.double().abs() @ w.double().abs().T).max().item()
                    assert out.dtype == torch.float32 and out.shape == (rows, n)
                    assert (out.double() - ref).abs().max().item() <= 4 * k * 2**-24 * scale, (k, n, rows)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_a_rows_output_is_the_same_bits_whatever_it_is_batched_with() -> None:
    gen = torch.Generator().manual_seed(4)
    w = _stored(203, 389, gen)
    x = torch.randn(16, 203, generator=gen)
    whole = lowp.f32_linear(x, w)
    for rows in range(2, 17):
        for start in (0, 16 - rows):
            assert torch.equal(lowp.f32_linear(x[start:start + rows], w), whole[start:start + rows]), (rows, start)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(lowp.f32_linear(x, w), whole)
    finally:
        torch.set_num_threads(before)


def test_f32_linear_leaves_to_mkl_what_the_rule_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(5)
    w = _stored(40, 30, gen)
    if lowp.kernel_status() == "c-avx2-f16c":
        spy = _Counting(lowp._lib)
        monkeypatch.setattr(lowp, "_lib", spy)
    for x, ww in ((torch.randn(1, 40, generator=gen), w), (torch.randn(17, 40, generator=gen), w),
                  (torch.randn(4, 40, generator=gen), w.contiguous()), (torch.randn(4, 40, dtype=torch.float64, generator=gen), w.double())):
        assert torch.equal(lowp.f32_linear(x, ww), x @ ww.T)
    monkeypatch.setenv("BATCHC_F32_KERNEL", "0")
    x4 = torch.randn(4, 40, generator=gen)
    assert torch.equal(lowp.f32_linear(x4, w), x4 @ w.T)
    if lowp.kernel_status() == "c-avx2-f16c":
        assert spy.calls == 0
        monkeypatch.setenv("BATCHC_F32_KERNEL", "1")
        lowp.f32_linear(x4, w)
        assert spy.calls == 1


@needs_kernel
def test_a_model_through_the_kernel_agrees_with_it_through_mkl(monkeypatch: pytest.MonkeyPatch) -> None:
    seeded, _ = tiny_models()
    target = HybridModel(seeded.config, matmul_layout(seeded.config, seeded.weights))  # as the loaders store it
    assert all(target.weights[n].T.is_contiguous() for n in projections(target.config))
    spy = _Counting(lowp._lib)
    monkeypatch.setattr(lowp, "_lib", spy)
    prompts = [[5, 17, 33, 8, 60, 3], [44, 90, 12], [7, 7, 7, 7, 1], [100, 2]]
    runs: dict[str, dict[int, list[int]]] = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("BATCHC_F32_KERNEL", switch)
        calls = spy.calls
        runs[switch] = served_greedy(target, prompts, 6)
        assert (spy.calls > calls) == (switch == "1")
    assert runs["1"] == runs["0"] == {i + 1: greedy_generate_reference(target, p, 6) for i, p in enumerate(prompts)}
    # the logits: the same values stored [out, in] (MKL, the kernel's layout check fails) against the kernel's
    calls = spy.calls
    report = weight_agreement(seeded, target, [[5, 17, 33, 8, 60, 3, 44, 90, 12]], 4)
    assert spy.calls > calls
    assert report.greedy_match == 1.0 and report.forced_top1 == 1.0 and report.first_divergence == (None,)
    assert 0.0 < report.logit_max_abs_diff < 1e-4 * max(1.0, report.logit_std), report  # another order of the sums, no more
