"""Speculative decoding: one verify over T positions plus a commit equals the accepted decode steps.

Rows carry every accept position at once (``-1 .. T-1``) plus a padding row; the decode side runs
T steps in which a row takes part while ``t <= accept_pos[row]`` (a padding slot afterwards).
"""

from __future__ import annotations

import pytest
import torch

from backend.kernels.commit import commit_accepted
from backend.kernels.conv import causal_conv1d_update, causal_conv1d_verify
from backend.kernels.ssm import selective_state_update, selective_state_verify
from backend.pool import MambaStatePool
from tests.helpers import SSM_D_STATE, SSM_HEAD_DIM, SSM_NHEADS, index, make_pool, randn, ssm_inputs

T = 3
DIM, WIDTH = 20, 4
ACCEPT = [-1, 0, 1, 2, 1, -1]  # per row; the last row is a padding row (slot -1)
SLOTS = [3, 1, 6, 2, 5, -1]


def _pool(state_dtype: torch.dtype) -> MambaStatePool:
    return make_pool(
        conv_dim=DIM,
        kernel_width=WIDTH,
        nheads=SSM_NHEADS,
        head_dim=SSM_HEAD_DIM,
        d_state=SSM_D_STATE,
        conv_dtype=state_dtype,
        ssm_dtype=state_dtype,
        seed=11,
    )


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_then_commit_equals_accepted_decode_steps(state_dtype: torch.dtype) -> None:
    batch = len(SLOTS)
    x_conv, weight, bias = randn(batch, T, DIM, seed=1), randn(DIM, WIDTH, seed=2), randn(DIM, seed=3)
    ssm_in = ssm_inputs((batch, T), seed=20)

    decoded = _pool(state_dtype)
    conv_outs, ssm_outs = [], []
    for t in range(T):
        step_slots = index([s if t <= a else -1 for s, a in zip(SLOTS, ACCEPT, strict=True)])
        conv_outs.append(
            causal_conv1d_update(x_conv[:, t], decoded.conv_state(0), weight, bias, silu=True, slot_idx=step_slots)
        )
        ssm_outs.append(
            selective_state_update(
                decoded.ssm_state(0), ssm_in.x[:, t], ssm_in.dt[:, t], ssm_in.A, ssm_in.B[:, t], ssm_in.C[:, t],
                ssm_in.D, z=ssm_in.z[:, t], dt_bias=ssm_in.dt_bias, slot_idx=step_slots,
            )
        )

    verified = _pool(state_dtype)
    slots = index(SLOTS)
    conv_out, conv_states = causal_conv1d_verify(x_conv, verified.conv_state(0), weight, bias, silu=True, slot_idx=slots)
    ssm_out, ssm_states = selective_state_verify(
        verified.ssm_state(0), *ssm_in[:6], z=ssm_in.z, dt_bias=ssm_in.dt_bias, slot_idx=slots
    )
    accept = index(ACCEPT)
    commit_accepted(verified.conv_state(0), conv_states, accept, slots)
    commit_accepted(verified.ssm_state(0), ssm_states, accept, slots)

    # Same kernel arithmetic on both sides: the whole pools agree bit for bit.
    assert torch.equal(verified.buffer, decoded.buffer)
    for row, accepted in enumerate(ACCEPT):
        for t in range(accepted + 1):
            torch.testing.assert_close(conv_out[row, t], conv_outs[t][row], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(ssm_out[row, t], ssm_outs[t][row], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("accept", "slots", "message"),
    [
        ([0, 3], [1, 2], "accept_pos out of range"),
        ([-2, 0], [1, 2], "accept_pos out of range"),
        ([0, 1], [2, 2], "more than once"),
        ([0, 1], [1, 99], "out of range"),
    ],
)
def test_commit_rejects_bad_rows(accept: list[int], slots: list[int], message: str) -> None:
    pool = _pool(torch.float32)
    inter = randn(2, T, SSM_NHEADS, SSM_HEAD_DIM, SSM_D_STATE, seed=5)
    before = pool.copy_buffer()
    with pytest.raises(ValueError, match=message):
        commit_accepted(pool.ssm_state(0), inter, index(accept), index(slots))
    assert torch.equal(pool.buffer, before)


def test_commit_rejects_mismatched_buffers() -> None:
    pool = _pool(torch.float32)
    before = pool.copy_buffer()
    accept, slots = index([0]), index([1])
    with pytest.raises(ValueError, match="dtype mismatch"):
        bf16 = randn(1, T, SSM_NHEADS, SSM_HEAD_DIM, SSM_D_STATE, seed=5, dtype=torch.bfloat16)
        commit_accepted(pool.ssm_state(0), bf16, accept, slots)
    with pytest.raises(ValueError, match="do not match"):
        commit_accepted(pool.ssm_state(0), randn(1, T, DIM, WIDTH - 1, seed=5), accept, slots)
    with pytest.raises(ValueError, match="contiguous"):
        inter = randn(1, T, SSM_NHEADS, SSM_D_STATE, SSM_HEAD_DIM, seed=5).transpose(-1, -2)
        commit_accepted(pool.ssm_state(0), inter, accept, slots)
    assert torch.equal(pool.buffer, before)


def test_commit_repeated_slot_allowed_when_only_one_row_commits() -> None:
    pool = _pool(torch.float32)
    inter = randn(2, T, DIM, WIDTH - 1, seed=6)
    commit_accepted(pool.conv_state(0), inter, index([-1, 2]), index([4, 4]))
    assert torch.equal(pool.conv_state(0)[4], inter[1, 2])
