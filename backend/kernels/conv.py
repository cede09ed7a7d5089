"""Launch wrappers of the Mamba2 causal conv1d over a slot-indexed pool: decode and verify.

- ``causal_conv1d_update``: one token per row; ``conv_state[slot]`` is shifted in place.
- ``causal_conv1d_verify``: T tokens per row (speculative verify); the pool is only read, each
  position's state goes to a fresh intermediate buffer ``[batch, T, dim, width - 1]`` that
  ``backend.kernels.commit.commit_accepted`` later scatters from.

Invariants checked before any launch (``ValueError``): widths 2..4; ``conv_state`` is
``[num_slots, dim, width - 1]`` (any strides, e.g. a ``MambaStatePool`` view) in a state dtype;
``x``, ``weight``, ``bias`` shapes; one device; ``slot_idx`` 1-D int64/int32 of length batch with
entries -1 or in ``[0, num_slots)`` and no slot twice (unless ``check_slots=False``: the caller
validated the host copy of the same indices once per forward and wants no device sync per layer).
Padding rows (-1) leave the pool untouched and their outputs zero.
"""

from __future__ import annotations

import torch

from backend.kernels import checks, torch_paths
from backend.kernels.checks import require
from backend.kernels.dispatch import jit_module, use_triton

__all__ = ["causal_conv1d_update", "causal_conv1d_verify"]

BLOCK_D = 128
BLOCK_W = 4  # next power of two >= the largest width


def _validate(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slot_idx: torch.Tensor,
    *,
    tokens_dims: int,
    check_slots: bool,
) -> None:
    require(x.dim() == tokens_dims + 1, f"x must have {tokens_dims + 1} dims, got shape {tuple(x.shape)}")
    require(x.dtype in checks.STATE_DTYPES, f"x has dtype {x.dtype}")
    device = x.device
    batch, dim = x.shape[0], x.shape[-1]
    require(weight.dim() == 2, f"weight must be [dim, width], got shape {tuple(weight.shape)}")
    width = weight.shape[1]
    require(2 <= width <= 4, f"conv width must be in [2, 4], got {width}")
    checks.check_tensor("weight", weight, shape=(dim, width), device=device, dtypes=checks.STATE_DTYPES)
    checks.check_optional("bias", bias, shape=(dim,), device=device, dtypes=checks.STATE_DTYPES)
    require(conv_state.dim() == 3, f"conv_state must be [num_slots, dim, width - 1], got {tuple(conv_state.shape)}")
    checks.check_tensor(
        "conv_state",
        conv_state,
        shape=(conv_state.shape[0], dim, width - 1),
        device=device,
        dtypes=checks.STATE_DTYPES,
    )
    checks.check_index("slot_idx", slot_idx, length=batch, device=device)
    if check_slots:
        checks.check_slot_rows("slot_idx", slot_idx, conv_state.shape[0])


def _launch(
    x3: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out3: torch.Tensor,
    slot_idx: torch.Tensor,
    out_state: torch.Tensor,
    *,
    silu: bool,
    in_place: bool,
) -> None:
    """``x3``/``out3`` are ``[batch, T, dim]``; ``out_state`` is the pool (in place) or ``[batch, T, dim, w-1]``."""
    batch, T, dim = x3.shape
    if in_place:
        o_row, o_t, o_d, o_w = conv_state.stride(0), 0, conv_state.stride(1), conv_state.stride(2)
    else:
        o_row, o_t, o_d, o_w = out_state.stride()
    grid = ((dim + BLOCK_D - 1) // BLOCK_D, batch)
    jit_module("conv").conv_update_kernel[grid](
        x3,
        conv_state,
        weight,
        bias if bias is not None else weight,  # never read when HAS_BIAS is False
        out3,
        slot_idx,
        out_state,
        T,
        dim,
        *x3.stride(),
        *conv_state.stride(),
        o_row,
        o_t,
        o_d,
        o_w,
        *weight.stride(),
        *out3.stride(),
        WIDTH=weight.shape[1],
        HAS_BIAS=bias is not None,
        SILU=silu,
        IN_PLACE=in_place,
        BLOCK_D=BLOCK_D,
        BLOCK_W=BLOCK_W,
    )


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool,
    slot_idx: torch.Tensor,
    check_slots: bool = True,
) -> torch.Tensor:
    """Decode: ``x [batch, dim]`` -> ``out [batch, dim]``; shifts ``x`` into ``conv_state[slot_idx]``."""
    _validate(x, conv_state, weight, bias, slot_idx, tokens_dims=1, check_slots=check_slots)
    if not use_triton(x):
        return torch_paths.causal_conv1d_update(x, conv_state, weight, bias, silu=silu, slot_idx=slot_idx)
    out = torch.zeros_like(x)
    if x.shape[0] and x.shape[1]:
        _launch(x[:, None], conv_state, weight, bias, out[:, None], slot_idx, conv_state, silu=silu, in_place=True)
    return out


def causal_conv1d_verify(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool,
    slot_idx: torch.Tensor,
    check_slots: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify: ``x [batch, T, dim]`` -> ``(out [batch, T, dim], states [batch, T, dim, width - 1])``.

    ``states[:, t]`` is the conv state after token ``t``; the pool is not written.
    """
    _validate(x, conv_state, weight, bias, slot_idx, tokens_dims=2, check_slots=check_slots)
    if not use_triton(x):
        return torch_paths.causal_conv1d_verify(x, conv_state, weight, bias, silu=silu, slot_idx=slot_idx)
    batch, T, dim = x.shape
    out = torch.zeros_like(x)
    states = torch.zeros((batch, T, dim, conv_state.shape[-1]), dtype=conv_state.dtype, device=x.device)
    if batch and T and dim:
        _launch(x, conv_state, weight, bias, out, slot_idx, states, silu=silu, in_place=False)
    return out, states
