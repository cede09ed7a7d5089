"""selective_state_update / selective_state_verify (Mamba2): Triton kernel against the torch reference."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from backend import reference
from backend.kernels.ssm import selective_state_update, selective_state_verify

from .helpers import DEVICE, index, make_pool, randn

NHEADS, HEAD_DIM, D_STATE = 4, 12, 16  # head_dim 12: not a power of two, exercises the row mask


class Inputs(NamedTuple):
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None


def make_inputs(lead: tuple[int, ...], *, ngroups: int = 2, full: bool = True, seed: int = 0) -> Inputs:
    """Per-token inputs with leading dims ``lead`` (``(batch,)`` or ``(batch, T)``)."""
    return Inputs(
        x=randn(*lead, NHEADS, HEAD_DIM, seed=seed),
        dt=randn(*lead, NHEADS, seed=seed + 1) * 0.5,
        A=-torch.rand(NHEADS, generator=torch.Generator().manual_seed(seed + 2)).to(DEVICE) - 0.1,
        B=randn(*lead, ngroups, D_STATE, seed=seed + 3),
        C=randn(*lead, ngroups, D_STATE, seed=seed + 4),
        D=randn(NHEADS, seed=seed + 5) if full else None,
        z=randn(*lead, NHEADS, HEAD_DIM, seed=seed + 6) if full else None,
        dt_bias=randn(NHEADS, seed=seed + 7) if full else None,
    )


def _pool(state_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return make_pool(nheads=NHEADS, head_dim=HEAD_DIM, d_state=D_STATE, ssm_dtype=state_dtype).ssm_state(1)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16 state: Triton's interpreter truncates float32 -> bfloat16 where torch rounds to nearest.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("ngroups", "full"), [(2, True), (1, False), (4, True)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_update_matches_reference(state_dtype: torch.dtype, ngroups: int, full: bool, index_dtype: torch.dtype) -> None:
    state = _pool(state_dtype)
    assert not state.is_contiguous()
    inp = make_inputs((4,), ngroups=ngroups, full=full)
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
    inp = make_inputs((3, T))
    slots = index([1, -1, 4])
    before = state.clone()
    y, states = selective_state_verify(state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, slot_idx=slots)
    exp_y, exp_states = reference.selective_state_verify_reference(
        state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=True, slot_idx=slots
    )
    assert torch.equal(state, before)
    assert states.shape == (3, T, NHEADS, HEAD_DIM, D_STATE) and states.dtype == state_dtype
    torch.testing.assert_close(y, exp_y, **_tol(state_dtype))
    torch.testing.assert_close(states, exp_states, **_tol(state_dtype))
    assert torch.all(y[1] == 0) and torch.all(states[1] == 0)


def test_large_dt_softplus_is_finite() -> None:
    state = _pool()
    inp = make_inputs((1,))._replace(dt=torch.full((1, NHEADS), 60.0, device=DEVICE))
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
    inp = make_inputs((2,))
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
        inp = inp._replace(B=randn(2, 3, D_STATE, seed=9), C=randn(2, 3, D_STATE, seed=9))
    elif change == "B_dtype":
        inp = inp._replace(B=inp.B.to(torch.int32))
    elif change == "D_shape":
        inp = inp._replace(D=randn(NHEADS + 1, seed=9))
    elif change == "z_shape":
        inp = inp._replace(z=inp.x[:1])
    elif change == "slot_length":
        slots = index([1, 2, 3])
    before = state.clone()
    with pytest.raises(ValueError, match=message):
        selective_state_update(state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, slot_idx=slots)
    assert torch.equal(state, before)
