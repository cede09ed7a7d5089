"""``backend.kernels.window``: a verify's SSM states kept as factors (the committed state and per-token
terms) instead of one state per position.

- Every position's output and state equal the step-by-step verify's (``selective_state_verify``,
  itself equal to T decode steps bit for bit) to float32 rounding, with and without ``D``, ``z`` and
  ``dt_bias``, one or two groups, padding rows, for the T of k = 1 to 8.
- ``commit_window`` writes each committing row's state at its accepted position and nothing else
  (accept -1, slot -1), refuses what ``commit_accepted`` refuses with the same words, and leaves the
  pool untouched when it does.
- ``selective_state_verify_kept`` keeps a window on the torch path, and ``commit_states`` commits
  either form to the same pool.
"""

from __future__ import annotations

import pytest
import torch

from backend.kernels.dispatch import use_triton
from backend.kernels.ssm import selective_state_verify, selective_state_verify_kept
from backend.kernels.window import SsmWindow, commit_states, commit_window, selective_state_verify_window
from backend.pool import MambaStatePool
from tests.helpers import SSM_D_STATE, SSM_HEAD_DIM, SSM_NHEADS, index, make_pool, ssm_inputs

SLOTS = [3, 1, 6, 2, 5, -1]


def _pool(state_dtype: torch.dtype = torch.float32) -> MambaStatePool:
    return make_pool(conv_dim=20, kernel_width=4, nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE,
                     conv_dtype=state_dtype, ssm_dtype=state_dtype, seed=11)


@pytest.mark.parametrize(("T", "ngroups", "full"), [(2, 2, True), (3, 1, True), (5, 2, False), (9, 1, True)])
def test_the_window_gives_the_steps_outputs_and_every_positions_state(T: int, ngroups: int, full: bool) -> None:
    pool, slots = _pool(), index(SLOTS)
    ssm_in = ssm_inputs((len(SLOTS), T), ngroups=ngroups, full=full, seed=30 + T)
    args = (pool.ssm_state(0), *ssm_in[:6])
    stepped, states = selective_state_verify(*args, z=ssm_in.z, dt_bias=ssm_in.dt_bias, slot_idx=slots)
    y, window = selective_state_verify_window(*args, z=ssm_in.z, dt_bias=ssm_in.dt_bias, dt_softplus=True, slot_idx=slots)
    torch.testing.assert_close(y, stepped, atol=2e-5, rtol=1e-5)
    assert torch.equal(y[-1], torch.zeros_like(y[-1]))  # the padding row
    live = index([i for i, s in enumerate(SLOTS) if s >= 0])
    for t in range(T):
        at = window.state_at(live, index([t] * live.shape[0]))
        torch.testing.assert_close(at, states[live, t], atol=2e-5, rtol=1e-5)


def test_commit_window_writes_each_committing_rows_accepted_state_only() -> None:
    T, accept = 3, [-1, 0, 1, 2, 1, 2]
    pool, slots = _pool(), index(SLOTS)
    ssm_in = ssm_inputs((len(SLOTS), T), seed=5)
    _, states = selective_state_verify(pool.ssm_state(0), *ssm_in[:6], z=ssm_in.z, dt_bias=ssm_in.dt_bias, slot_idx=slots)
    _, window = selective_state_verify_window(pool.ssm_state(0), *ssm_in[:6], z=ssm_in.z, dt_bias=ssm_in.dt_bias, dt_softplus=True,
                                              slot_idx=slots)
    before = pool.ssm_state(0).clone()
    commit_window(pool.ssm_state(0), window, index(accept), slots)
    after = pool.ssm_state(0)
    for row, (slot, a) in enumerate(zip(SLOTS, accept, strict=True)):
        if slot >= 0 and a >= 0:
            torch.testing.assert_close(after[slot], states[row, a], atol=2e-5, rtol=1e-5)
    untouched = [s for s in range(after.shape[0]) if s not in {s for s, a in zip(SLOTS, accept, strict=True) if s >= 0 and a >= 0}]
    assert torch.equal(after[untouched], before[untouched])  # accept -1 (slot 3), the padding row, every other slot


@pytest.mark.parametrize(
    ("accept", "slots", "message"),
    [([0, 3], [1, 2], "accept_pos out of range"), ([-2, 0], [1, 2], "accept_pos out of range"), ([0, 1], [2, 2], "more than once"),
     ([0, 1], [1, 99], "out of range")],
)
def test_commit_window_refuses_bad_rows_and_writes_nothing(accept: list[int], slots: list[int], message: str) -> None:
    pool = _pool()
    ssm_in = ssm_inputs((2, 3), seed=7)
    _, window = selective_state_verify_window(pool.ssm_state(0), *ssm_in[:6], z=ssm_in.z, dt_bias=ssm_in.dt_bias, dt_softplus=True,
                                              slot_idx=index([1, 2]))
    before = pool.copy_buffer()
    with pytest.raises(ValueError, match=message):
        commit_window(pool.ssm_state(0), window, index(accept), index(slots))
    with pytest.raises(ValueError, match="dtype mismatch"):
        commit_window(_pool(torch.bfloat16).ssm_state(0), window, index([0, 0]), index([1, 2]))
    assert torch.equal(pool.buffer, before)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_the_kept_form_commits_what_the_per_position_states_commit(state_dtype: torch.dtype) -> None:
    T, accept, slots = 4, index([3, 0, 2, 1, 3, 0]), index(SLOTS)
    ssm_in = ssm_inputs((len(SLOTS), T), seed=9)
    kept_pool, stepped_pool = _pool(state_dtype), _pool(state_dtype)
    y, kept = selective_state_verify_kept(kept_pool.ssm_state(0), *ssm_in[:6], z=ssm_in.z, dt_bias=ssm_in.dt_bias, slot_idx=slots)
    stepped, states = selective_state_verify(stepped_pool.ssm_state(0), *ssm_in[:6], z=ssm_in.z, dt_bias=ssm_in.dt_bias, slot_idx=slots)
    assert isinstance(kept, SsmWindow) != use_triton(y)  # a window on the torch path, per-position states on Triton's
    commit_states(kept_pool.ssm_state(0), kept, accept, slots)
    commit_states(stepped_pool.ssm_state(0), states, accept, slots)
    tol = {"atol": 2e-5, "rtol": 1e-5} if state_dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # (bf16: rounded once or T times)
    torch.testing.assert_close(y, stepped, **tol)
    torch.testing.assert_close(kept_pool.ssm_state(0).float(), stepped_pool.ssm_state(0).float(), **tol)
