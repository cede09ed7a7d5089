"""causal_conv1d_update / causal_conv1d_verify: Triton kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch

from backend import reference
from backend.kernels.conv import causal_conv1d_update, causal_conv1d_verify
from tests.helpers import index, make_pool, randn

DIM = 24  # not a multiple of the channel block: exercises the channel mask


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16 state: Triton's interpreter truncates float32 -> bfloat16 where torch and GPUs round to
    # nearest, so a state (and any output computed from a stored token) may differ by one bf16 ulp.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("silu", "with_bias"), [(True, True), (False, False)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_update_matches_reference(
    width: int, state_dtype: torch.dtype, silu: bool, with_bias: bool, index_dtype: torch.dtype
) -> None:
    pool = make_pool(conv_dim=DIM, kernel_width=width, conv_dtype=state_dtype)
    state = pool.conv_state(1)  # strided view: slot stride is the whole row
    assert not state.is_contiguous()
    x, weight = randn(4, DIM, seed=1), randn(DIM, width, seed=2)
    bias = randn(DIM, seed=3) if with_bias else None
    slots = index([3, -1, 1, 0], index_dtype)  # a padding row, and slot 0 used by a padded row
    expected_state = state.clone()
    expected = reference.causal_conv1d_update_reference(x, expected_state, weight, bias, silu=silu, slot_idx=slots)
    before = pool.copy_buffer()
    before_ssm = pool.ssm_state(1).clone()
    out = causal_conv1d_update(x, state, weight, bias, silu=silu, slot_idx=slots)
    torch.testing.assert_close(out, expected, **_tol(torch.float32))
    torch.testing.assert_close(state, expected_state, **_tol(state_dtype))
    assert torch.all(out[1] == 0)
    # Only the conv state of layer 1 in slots 3, 1, 0 changed.
    for slot in (2, 4, 5, 6):
        assert torch.equal(pool.buffer[slot], before[slot])
    assert torch.equal(pool.ssm_state(1), before_ssm)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_matches_reference_and_leaves_pool(width: int, state_dtype: torch.dtype) -> None:
    pool = make_pool(conv_dim=DIM, kernel_width=width, conv_dtype=state_dtype)
    state = pool.conv_state(0)
    T = 3
    x, weight, bias = randn(3, T, DIM, seed=4), randn(DIM, width, seed=5), randn(DIM, seed=6)
    slots = index([2, 5, -1])
    before = pool.copy_buffer()
    out, states = causal_conv1d_verify(x, state, weight, bias, silu=True, slot_idx=slots)
    exp_out, exp_states = reference.causal_conv1d_verify_reference(x, state, weight, bias, silu=True, slot_idx=slots)
    assert torch.equal(pool.buffer, before)
    assert states.shape == (3, T, DIM, width - 1) and states.dtype == state_dtype
    torch.testing.assert_close(out, exp_out, **_tol(state_dtype))
    torch.testing.assert_close(states, exp_states, **_tol(state_dtype))
    assert torch.all(out[2] == 0) and torch.all(states[2] == 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("slot_out_of_range", "out of range"),
        ("slot_repeated", "repeats slots"),
        ("weight_shape", "weight has shape"),
        ("width_5", "width must be in"),
        ("bias_dtype", "bias has dtype"),
        ("slot_float", "int64 or int32"),
        ("slot_length", "entries"),
        ("state_shape", "conv_state has shape"),
    ],
)
def test_bad_input_raises_before_launch(change: str, message: str) -> None:
    pool = make_pool(conv_dim=DIM, kernel_width=4)
    state = pool.conv_state(0)
    x, weight, bias = randn(2, DIM, seed=7), randn(DIM, 4, seed=8), randn(DIM, seed=9)
    slots = index([1, 2])
    if change == "slot_out_of_range":
        slots = index([1, pool.num_slots])
    elif change == "slot_repeated":
        slots = index([2, 2])
    elif change == "weight_shape":
        weight = randn(DIM + 1, 4, seed=8)
    elif change == "width_5":
        weight = randn(DIM, 5, seed=8)
    elif change == "bias_dtype":
        bias = bias.to(torch.int32)
    elif change == "slot_float":
        slots = slots.float()
    elif change == "slot_length":
        slots = index([1])
    elif change == "state_shape":
        state = state[:, :, :2]
    before = pool.copy_buffer()
    with pytest.raises(ValueError, match=message):
        causal_conv1d_update(x, state, weight, bias, silu=True, slot_idx=slots)
    with pytest.raises(ValueError, match=message):
        causal_conv1d_verify(x[:, None], state, weight, bias, silu=True, slot_idx=slots)
    assert torch.equal(pool.buffer, before)
