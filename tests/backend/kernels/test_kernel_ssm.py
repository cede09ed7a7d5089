"""selective_state_update / selective_state_verify (Mamba2): Triton kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch

from backend import reference
from backend.kernels.ssm import selective_state_update, selective_state_verify
from tests.helpers import DEVICE, SSM_D_STATE, SSM_HEAD_DIM, SSM_NHEADS, index, make_pool, randn, ssm_inputs


def _pool(state_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return make_pool(nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE, ssm_dtype=state_dtype).ssm_state(1)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16 state: Triton's interpreter truncates float32 -> bfloat16 where torch rounds to nearest.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("ngroups", "full"), [(2, True), (1, False), (4, True)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_update_matches_reference(state_dtype: torch.dtype, ngroups: int, full: bool, index_dtype: torch.dtype) -> None:
    state = _pool(state_dtype)
    assert not state.is_contiguous()
    inp = ssm_inputs((4,), ngroups=ngroups, full=full)
    slots = index([5, -1, 2, 0], index_dtype)
    expected_state = state.clone()
    expected = reference.selective_state_update_reference(
        expected_state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=full, slot_idx=slots
    )
    y = selective_state_update(state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=full, slot_idx=slots)
    torch.testing.assert_close(y, expected, **_tol(state_dtype))
    torch.testing.assert_close(state, expected_state, **_tol(state_dtype))
    assert torch.all(y[1] == 0)
    for untouched in (1, 3, 4, 6):
        assert torch.equal(state[untouched], expected_state[untouched])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_matches_reference_and_leaves_pool(state_dtype: torch.dtype) -> None:
    state = _pool(state_dtype)
    T = 3
    inp = ssm_inputs((3, T))
    slots = index([1, -1, 4])
    before = state.clone()
    y, states = selective_state_verify(state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, slot_idx=slots)
    exp_y, exp_states = reference.selective_state_verify_reference(
        state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=True, slot_idx=slots
    )
    assert torch.equal(state, before)
    assert states.shape == (3, T, SSM_NHEADS, SSM_HEAD_DIM, SSM_D_STATE) and states.dtype == state_dtype
    torch.testing.assert_close(y, exp_y, **_tol(state_dtype))
    torch.testing.assert_close(states, exp_states, **_tol(state_dtype))
    assert torch.all(y[1] == 0) and torch.all(states[1] == 0)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_with_a_precomputed_dt_matches_reference(state_dtype: torch.dtype) -> None:
    """The model computes a clamped ``softplus(dt + dt_bias)`` itself and passes it with no bias and
    no softplus (``HybridConfig.dt_min``)."""
    state = _pool(state_dtype)
    inp = ssm_inputs((3, 3))
    dt = torch.nn.functional.softplus(inp.dt + inp.dt_bias).clamp(min=0.5)
    slots = index([1, -1, 4])
    y, states = selective_state_verify(state, inp.x, dt, *inp[2:6], z=inp.z, dt_bias=None, dt_softplus=False, slot_idx=slots)
    exp_y, exp_states = reference.selective_state_verify_reference(
        state, inp.x, inp.dt, *inp[2:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=True, slot_idx=slots
    )
    assert not torch.allclose(y, exp_y, **_tol(state_dtype)), "the clamp binds somewhere"
    exp_y, exp_states = reference.selective_state_verify_reference(
        state, inp.x, dt, *inp[2:6], z=inp.z, dt_bias=None, dt_softplus=False, slot_idx=slots
    )
    torch.testing.assert_close(y, exp_y, **_tol(state_dtype))
    torch.testing.assert_close(states, exp_states, **_tol(state_dtype))


def test_large_dt_softplus_is_finite() -> None:
    state = _pool()
    inp = ssm_inputs((1,))._replace(dt=torch.full((1, SSM_NHEADS), 60.0, device=DEVICE))
    y = selective_state_update(state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, slot_idx=index([1]))
    assert torch.isfinite(y).all() and torch.isfinite(state[1]).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("slot_out_of_range", "out of range"),
        ("slot_negative", "out of range"),
        ("slot_repeated", "repeats slots"),
        ("x_shape", "x has shape"),
        ("groups", "not a multiple"),
        ("B_dtype", "B has dtype"),
        ("D_shape", "D has shape"),
        ("z_shape", "z has shape"),
        ("slot_length", "entries"),
    ],
)
def test_bad_input_raises_before_launch(change: str, message: str) -> None:
    state = _pool()
    inp = ssm_inputs((2,))
    slots = index([1, 2])
    if change == "slot_out_of_range":
        slots = index([1, state.shape[0]])
    elif change == "slot_negative":
        slots = index([-2, 1])
    elif change == "slot_repeated":
        slots = index([3, 3])
    elif change == "x_shape":
        inp = inp._replace(x=inp.x[:, :, :-1])
    elif change == "groups":
        inp = inp._replace(B=randn(2, 3, SSM_D_STATE, seed=9), C=randn(2, 3, SSM_D_STATE, seed=9))
    elif change == "B_dtype":
        inp = inp._replace(B=inp.B.to(torch.int32))
    elif change == "D_shape":
        inp = inp._replace(D=randn(SSM_NHEADS + 1, seed=9))
    elif change == "z_shape":
        inp = inp._replace(z=inp.x[:1])
    elif change == "slot_length":
        slots = index([1, 2, 3])
    before = state.clone()
    with pytest.raises(ValueError, match=message):
        selective_state_update(state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, slot_idx=slots)
    assert torch.equal(state, before)
