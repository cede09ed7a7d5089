"""Chunked prefill (torch): the chunked SSD scan and the conv1d prefill against token-by-token references."""

from __future__ import annotations

import pytest
import torch

from backend import reference
from backend.kernels.chunked import causal_conv1d_prefill, ssd_prefill
from backend.kernels.conv import causal_conv1d_update
from backend.kernels.ssm import selective_state_update
from tests.helpers import SSM_D_STATE, SSM_HEAD_DIM, SSM_NHEADS, index, make_pool, randn, ssm_inputs

DIM, WIDTH = 20, 4
SEQLENS = [5, 0, 37, 1, 12]  # a zero-length sequence, and one spanning several chunks
SLOTS = [2, 6, 4, -1, 1]


def _cu(seqlens: list[int]) -> torch.Tensor:
    bounds = [0]
    for n in seqlens:
        bounds.append(bounds[-1] + n)
    return index(bounds)


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_ssd_chunked_matches_sequential_scan(chunk_size: int) -> None:
    total = sum(SEQLENS)
    inp = ssm_inputs((total,), seed=3)
    pool = make_pool(nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE)
    state = pool.ssm_state(0)
    expected_state = state.clone()
    cu, slots = _cu(SEQLENS), index(SLOTS)
    expected = reference.ssd_prefill_reference(
        expected_state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=True, cu_seqlens=cu, slot_idx=slots
    )
    y = ssd_prefill(state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, cu_seqlens=cu, slot_idx=slots, chunk_size=chunk_size)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)
    padded = slice(sum(SEQLENS[:3]), sum(SEQLENS[:4]))
    assert torch.all(y[padded] == 0)


def test_conv_prefill_matches_reference() -> None:
    total = sum(SEQLENS)
    pool = make_pool(conv_dim=DIM, kernel_width=WIDTH)
    state = pool.conv_state(1)
    expected_state = state.clone()
    x, weight, bias = randn(total, DIM, seed=1), randn(DIM, WIDTH, seed=2), randn(DIM, seed=3)
    cu, slots = _cu(SEQLENS), index(SLOTS)
    expected = reference.causal_conv1d_prefill_reference(
        x, expected_state, weight, bias, silu=True, cu_seqlens=cu, slot_idx=slots
    )
    out = causal_conv1d_prefill(x, state, weight, bias, silu=True, cu_seqlens=cu, slot_idx=slots)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-6, rtol=1e-6)


def test_prefill_equals_decode_steps() -> None:
    """A prompt prefilled in one go leaves the state a token-by-token decode would (float32)."""
    L = 9
    inp = ssm_inputs((L,), seed=7)
    x_conv, weight, bias = randn(L, DIM, seed=8), randn(DIM, WIDTH, seed=9), randn(DIM, seed=10)
    kwargs = {"conv_dim": DIM, "kernel_width": WIDTH, "nheads": SSM_NHEADS, "head_dim": SSM_HEAD_DIM, "d_state": SSM_D_STATE}
    prefilled, decoded = make_pool(**kwargs), make_pool(**kwargs)  # type: ignore[arg-type]
    conv_out = causal_conv1d_prefill(
        x_conv, prefilled.conv_state(0), weight, bias, silu=True, cu_seqlens=index([0, L]), slot_idx=index([3])
    )
    y = ssd_prefill(
        prefilled.ssm_state(0), *inp[:6], z=inp.z, dt_bias=inp.dt_bias, cu_seqlens=index([0, L]), slot_idx=index([3]),
        chunk_size=4,
    )
    for t in range(L):
        step_conv = causal_conv1d_update(
            x_conv[t : t + 1], decoded.conv_state(0), weight, bias, silu=True, slot_idx=index([3])
        )
        step_y = selective_state_update(
            decoded.ssm_state(0), inp.x[t : t + 1], inp.dt[t : t + 1], inp.A, inp.B[t : t + 1], inp.C[t : t + 1],
            inp.D, z=inp.z[t : t + 1], dt_bias=inp.dt_bias, slot_idx=index([3]),
        )
        torch.testing.assert_close(conv_out[t], step_conv[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y[t], step_y[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prefilled.buffer.view(torch.float32), decoded.buffer.view(torch.float32), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("cu", "slots", "message"),
    [
        ([0, 6, 5], [1, 2], "non-decreasing"),
        ([0, 3], [1, 2], "entries"),
        ([1, 5], [1], "run from 0"),
        ([0, 2, 5], [1, 1], "repeats slots"),
        ([0, 5], [7], "out of range"),
    ],
)
def test_prefill_rejects_bad_varlen(cu: list[int], slots: list[int], message: str) -> None:
    pool = make_pool(nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE)
    inp = ssm_inputs((5,))
    before = pool.copy_buffer()
    with pytest.raises(ValueError, match=message):
        ssd_prefill(pool.ssm_state(0), *inp[:6], cu_seqlens=index(cu), slot_idx=index(slots))
    assert torch.equal(pool.buffer, before)
