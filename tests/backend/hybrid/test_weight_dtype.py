"""16-bit weights beside float32 compute: ``backend.kernels.lowp.lowp_linear`` against a float64
product of the same 16-bit values, and ``HybridModel.with_weight_dtype`` against a float32 model
holding those same values (so every difference is the order of the sums, not the rounding)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from backend.hybrid import HybridModel
from backend.hybrid.weights import check_weights, projections, with_weight_dtype
from backend.kernels import lowp
from compiler.tools.bench_decode import weight_agreement
from tests.helpers import tiny_models

HALF = (torch.float16, torch.bfloat16)


def _kernel_expected() -> bool:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "").split()
    return {"avx2", "fma", "f16c"} <= set(flags) and (shutil.which("cc") or shutil.which("gcc")) is not None


def test_the_kernel_builds_here_or_says_why_not() -> None:
    status = lowp.kernel_status()
    assert status == "c-avx2-f16c" if _kernel_expected() else status.startswith("torch (widen to float32): "), status


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_lowp_linear_is_the_product_of_the_16_bit_values(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    try:
        # rows across every batch tile (8, 4, 2, 1) and past KERNEL_MAX_ROWS (the widened torch product);
        # columns across the 8-row and 64-column blocks; in-widths with a tail past the last 8
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 5, 8, 11, lowp.KERNEL_MAX_ROWS, lowp.KERNEL_MAX_ROWS + 1):
                for out, k in ((1, 3), (67, 68), (130, 96), (9, 16), (17, 1030)):  # (1030: one row's longer-row tiles)
                    x = torch.randn(rows, k, generator=gen)
                    w = torch.randn(out, k, generator=gen).to(dtype)
                    got = lowp.lowp_linear(x, w)
                    want = x.double() @ w.double().T
                    assert got.dtype == torch.float32 and got.shape == (rows, out)
                    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * k), (threads, rows, out, k)
    finally:
        torch.set_num_threads(before)
    # leading dims are kept, a strided x is read right
    x = torch.randn(2, 3, 24, generator=gen)
    w = torch.randn(10, 24, generator=gen).to(dtype)
    assert torch.allclose(lowp.lowp_linear(x, w), (x.double() @ w.double().T).float(), atol=1e-4)
    wide = torch.randn(4, 48, generator=gen)[:, ::2]
    assert torch.allclose(lowp.lowp_linear(wide, w), (wide.double() @ w.double().T).float(), atol=1e-4)


def test_lowp_linear_refuses_what_it_does_not_multiply() -> None:
    with pytest.raises(TypeError, match="float32 x and float16/bfloat16 w, got torch.float32 and torch.float32"):
        lowp.lowp_linear(torch.zeros(1, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"x \(1, 5\) does not multiply w.T of w \(2, 4\)"):
        lowp.lowp_linear(torch.zeros(1, 5), torch.zeros(2, 4, dtype=torch.float16))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_model_with_16_bit_matrices_computes_in_float32_what_their_values_give(dtype: torch.dtype) -> None:
    target, _ = tiny_models()
    half = target.with_weight_dtype(dtype)
    names = set(projections(target.config))
    for name, t in half.weights.items():
        if name in names:
            assert t.dtype == dtype and t.is_contiguous()
        else:
            assert t is target.weights[name]  # norms, conv, A, D, dt's bias: the float32 originals
    assert (half.dtype, half.weight_dtype) == (torch.float32, dtype)
    assert target.with_weight_dtype(torch.float32) is target and half.with_weight_dtype(dtype) is half
    # the same values in float32: the 16-bit model differs from it only in the order of its sums
    rounded = HybridModel(target.config, {n: t.float() if n in names else t for n, t in half.weights.items()})
    report = weight_agreement(rounded, half, [[5, 17, 33, 8, 60, 3, 44, 90, 12]], 4)
    assert report.greedy_match == 1.0 and report.forced_top1 == 1.0 and report.first_divergence == (None,)
    assert report.logit_max_abs_diff < 1e-4 * max(1.0, report.logit_std), report


def test_the_agreement_sees_a_different_model() -> None:
    target, draft = tiny_models(noise=0.5)
    same = weight_agreement(target, target, [[1, 2, 3, 4]], 2)
    assert (same.greedy_match, same.forced_top1, same.logit_max_abs_diff) == (1.0, 1.0, 0.0)
    other = weight_agreement(target, draft, [[9, 8, 7]], 6)
    assert other.greedy_match < 1.0 and other.logit_max_abs_diff > 0.1, other


def test_only_float32_weights_store_16_bit_matrices() -> None:
    target, _ = tiny_models()
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16, got torch.float64"):
        with_weight_dtype(target.config, target.weights, torch.float64)
    bf = {n: t.bfloat16() for n, t in target.weights.items()}
    with pytest.raises(ValueError, match="the weights must be float32"):
        with_weight_dtype(target.config, bf, torch.float16)
    names = projections(target.config)
    mixed = dict(target.weights) | {names[0]: target.weights[names[0]].half(), names[1]: target.weights[names[1]].bfloat16()}
    with pytest.raises(ValueError, match="only float32 weights may store their matrices in float16 or bfloat16"):
        check_weights(target.config, mixed)
    on_bf = dict(bf) | {names[0]: target.weights[names[0]].half()}
    with pytest.raises(ValueError, match="only float32 weights may store their matrices"):
        check_weights(target.config, on_bf)
    norm = next(n for n in target.weights if n.endswith(".norm"))
    with pytest.raises(ValueError, match="one device and dtype"):
        check_weights(target.config, dict(target.weights) | {norm: target.weights[norm].half()})
