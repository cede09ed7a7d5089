"""Launch wrappers of the Mamba2 selective state update over a slot-indexed pool: decode and verify.

- ``selective_state_update``: one token per row; ``state[slot]`` updated in place.
- ``selective_state_verify``: T tokens per row; the pool is only read, each position's state goes
  to a fresh intermediate buffer ``[batch, T, nheads, head_dim, d_state]`` (state dtype).
- ``selective_state_verify_kept``: what the model's verify runs: the above on the Triton path, the
  closed form of ``backend.kernels.window`` (no state per position) on the torch path.

Shapes (decode; verify adds a T axis after batch everywhere except the per-head parameters):
``state [num_slots, nheads, head_dim, d_state]`` (any strides), ``x, z [batch, nheads, head_dim]``,
``dt [batch, nheads]``, ``A, D, dt_bias [nheads]``, ``B, C [batch, ngroups, d_state]`` with
``nheads % ngroups == 0``. Compute is float32; the state is stored in its own dtype; ``y`` has
``x``'s dtype.

Invariants checked before any launch (``ValueError``): the shapes above, one device, float dtypes,
``slot_idx`` 1-D int64/int32 of length batch with entries -1 or in ``[0, num_slots)`` and no slot
twice (unless ``check_slots=False``, see ``backend.kernels.checks``). Padding rows (-1) leave the
pool untouched and their outputs zero.

Launch shape: one program per (head_dim block, row, head) holding a ``[BLOCK_P, d_state]`` state
tile in registers; ``BLOCK_P * d_state`` is kept near 2048 elements (8 KiB of fp32 state per
program) so that a batch-64 decode of a 128-head layer already fills an H100/H200 many times over.
"""

from __future__ import annotations

import torch

from backend.kernels import checks, torch_paths
from backend.kernels.checks import require
from backend.kernels.dispatch import jit_module, use_triton
from backend.kernels.window import SsmWindow, selective_state_verify_window

__all__ = ["selective_state_update", "selective_state_verify", "selective_state_verify_kept"]

TILE_ELEMENTS = 2048


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _validate(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    slot_idx: torch.Tensor,
    *,
    lead: tuple[int, ...],
    check_slots: bool,
) -> None:
    """``lead`` is ``(batch,)`` for decode, ``(batch, T)`` for verify."""
    device = x.device
    F = checks.STATE_DTYPES  # float dtypes accepted for every input
    require(state.dim() == 4, f"state must be [num_slots, nheads, head_dim, d_state], got {tuple(state.shape)}")
    num_slots, nheads, head_dim, d_state = state.shape
    checks.check_tensor("state", state, shape=state.shape, device=device, dtypes=F)
    checks.check_tensor("x", x, shape=(*lead, nheads, head_dim), device=device, dtypes=F)
    checks.check_tensor("dt", dt, shape=(*lead, nheads), device=device, dtypes=F)
    checks.check_tensor("A", A, shape=(nheads,), device=device, dtypes=F)
    require(B.dim() == len(lead) + 2, f"B must be [{', '.join(['batch', 'T'][: len(lead)])}, ngroups, d_state]")
    ngroups = B.shape[-2]
    require(ngroups > 0 and nheads % ngroups == 0, f"nheads {nheads} is not a multiple of ngroups {ngroups}")
    checks.check_tensor("B", B, shape=(*lead, ngroups, d_state), device=device, dtypes=F)
    checks.check_tensor("C", C, shape=(*lead, ngroups, d_state), device=device, dtypes=F)
    checks.check_optional("D", D, shape=(nheads,), device=device, dtypes=F)
    checks.check_optional("z", z, shape=(*lead, nheads, head_dim), device=device, dtypes=F)
    checks.check_optional("dt_bias", dt_bias, shape=(nheads,), device=device, dtypes=F)
    checks.check_index("slot_idx", slot_idx, length=lead[0], device=device)
    if check_slots:
        checks.check_slot_rows("slot_idx", slot_idx, num_slots)


def _launch(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    slot_idx: torch.Tensor,
    y: torch.Tensor,
    out_state: torch.Tensor,
    *,
    in_place: bool,
) -> None:
    """Every per-token tensor here carries a T axis: ``x [batch, T, H, P]`` etc."""
    batch, T, nheads, head_dim = x.shape
    ngroups, d_state = B.shape[-2:]
    block_n = _next_pow2(d_state)
    block_p = min(_next_pow2(head_dim), max(1, TILE_ELEMENTS // block_n))
    o_strides: tuple[int, ...]
    if in_place:
        s = state.stride()
        o_strides = (s[0], 0, s[1], s[2], s[3])  # one position, written back into the slot
    else:
        o_strides = out_state.stride()
    z_strides = z.stride() if z is not None else (0, 0, 0, 0)
    grid = ((head_dim + block_p - 1) // block_p, batch, nheads)
    jit_module("ssm").ssm_update_kernel[grid](
        state,
        x,
        dt,
        dt_bias if dt_bias is not None else A,  # unused placeholders keep the signature fixed
        A,
        B,
        C,
        D if D is not None else A,
        z if z is not None else x,
        y,
        slot_idx,
        out_state,
        T,
        nheads // ngroups,
        head_dim,
        d_state,
        *state.stride(),
        *o_strides,
        *x.stride(),
        *dt.stride(),
        *B.stride(),
        *C.stride(),
        *z_strides,
        *y.stride(),
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus,
        HAS_D=D is not None,
        HAS_Z=z is not None,
        IN_PLACE=in_place,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
    )


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    slot_idx: torch.Tensor,
    check_slots: bool = True,
) -> torch.Tensor:
    """Decode: returns ``y [batch, nheads, head_dim]``; ``state[slot_idx]`` updated in place."""
    require(x.dim() == 3, f"x must be [batch, nheads, head_dim], got shape {tuple(x.shape)}")
    _validate(state, x, dt, A, B, C, D, z, dt_bias, slot_idx, lead=(x.shape[0],), check_slots=check_slots)
    if not use_triton(x):
        return torch_paths.selective_state_update(
            state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, slot_idx=slot_idx
        )
    y = torch.zeros_like(x)
    if x.numel():
        _launch(
            state,
            x[:, None],
            dt[:, None],
            A,
            B[:, None],
            C[:, None],
            D,
            None if z is None else z[:, None],
            dt_bias,
            dt_softplus,
            slot_idx,
            y[:, None],
            state,
            in_place=True,
        )
    return y


def selective_state_verify_kept(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    slot_idx: torch.Tensor,
    check_slots: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | SsmWindow]:
    """A verify whose states are kept for a commit in the cheapest form the device has: on the
    Triton path every position's state (``selective_state_verify``), on the torch path an
    ``SsmWindow`` (``backend.kernels.window``: the committed state and the per-token factors, the
    accepted position's state computed at the commit; equal to the steps to float32 rounding).
    ``backend.kernels.window.commit_states`` commits either."""
    if use_triton(x):
        return selective_state_verify(
            state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, slot_idx=slot_idx, check_slots=check_slots
        )
    require(x.dim() == 4, f"x must be [batch, T, nheads, head_dim], got shape {tuple(x.shape)}")
    batch, T = x.shape[0], x.shape[1]
    _validate(state, x, dt, A, B, C, D, z, dt_bias, slot_idx, lead=(batch, T), check_slots=check_slots)
    if T == 0 or batch == 0:
        return torch.zeros_like(x), torch.zeros((batch, T, *state.shape[1:]), dtype=state.dtype, device=x.device)
    return selective_state_verify_window(state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, slot_idx=slot_idx)


def selective_state_verify(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    slot_idx: torch.Tensor,
    check_slots: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify over ``x [batch, T, nheads, head_dim]``: returns ``(y [batch, T, nheads, head_dim],
    states [batch, T, nheads, head_dim, d_state])``; ``states[:, t]`` is the state after token ``t``.
    The pool is not written."""
    require(x.dim() == 4, f"x must be [batch, T, nheads, head_dim], got shape {tuple(x.shape)}")
    batch, T = x.shape[0], x.shape[1]
    _validate(state, x, dt, A, B, C, D, z, dt_bias, slot_idx, lead=(batch, T), check_slots=check_slots)
    if not use_triton(x):
        return torch_paths.selective_state_verify(
            state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, slot_idx=slot_idx
        )
    y = torch.zeros_like(x)
    states = torch.zeros((batch, T, *state.shape[1:]), dtype=state.dtype, device=x.device)
    if x.numel():
        _launch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, y, states, in_place=False)
    return y, states
