"""Torch reference implementations of every pool kernel, written to be read, not to be fast.

These are the executable specification: the Triton kernels and the batched torch paths of the
decode, verify and commit wrappers (``backend.kernels.torch_paths``, what runs on machines without
a GPU) are tested against them; ``init_rows`` falls back to its reference here directly. They
assume arguments already validated by the wrappers (shapes, dtypes, slot ranges, no repeated slots).

Conventions kept by every function here and by the kernels:

- Pool state tensors are per-layer views ``[num_slots, ...]`` (strided, see ``backend.pool``);
  ``slot_idx[row] == -1`` marks a padding row: it is skipped entirely, the pool is untouched and
  its outputs stay zero.
- Arithmetic is float32; states are stored back in the state tensor's dtype. Verify variants
  carry the state between positions rounded to that dtype, exactly as a decode step would read it
  back from the pool, so T decode steps equal one verify plus a commit bit for bit in spirit and
  within float tolerance in fact.
- Conv state ``[conv_dim, width - 1]`` holds the last ``width - 1`` inputs, oldest first; the
  window of a step is ``[state, x]`` and ``weight[:, width - 1]`` multiplies the newest input.
- Mamba2 SSM step per head h (group ``g = h // (nheads // ngroups)``)::

      dt    = softplus(dt + dt_bias)            (softplus optional)
      state = state * exp(dt * A[h]) + dt * x ⊗ B[g]
      y     = state · C[g] + D[h] * x,   then y *= silu(z) when z is given
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "causal_conv1d_prefill_reference", "causal_conv1d_update_reference", "causal_conv1d_verify_reference", "commit_reference",
    "init_rows_layer_major", "init_rows_reference", "selective_state_update_reference", "selective_state_verify_reference", "ssd_prefill_reference",
    "ssm_step",
]

# ---------------------------------------------------------------------------------------------
# Init ops: clears and copy-on-write rows
# ---------------------------------------------------------------------------------------------


def init_rows_reference(buffer: torch.Tensor, clear: torch.Tensor, cow_src: torch.Tensor, cow_dst: torch.Tensor) -> None:
    """Slot-major pool: zero rows ``clear``, then copy rows ``cow_src[i]`` -> ``cow_dst[i]``.

    Sources are read before anything is written, so a copy sees its source as it was before the op.
    """
    sources = buffer[cow_src]  # indexing with a tensor copies: the sources as they were
    buffer[clear] = 0
    buffer[cow_dst] = sources


def init_rows_layer_major(
    states: Sequence[torch.Tensor], clear: torch.Tensor, cow_src: torch.Tensor, cow_dst: torch.Tensor
) -> None:
    """The baseline of a layer-major pool: per state tensor ``[L, slots, ...]`` one indexed fill
    and one indexed copy (what SGLang does), i.e. two launches (plus gathers) per state tensor."""
    for state in states:
        state[:, clear] = 0
        state[:, cow_dst] = state[:, cow_src]


# ---------------------------------------------------------------------------------------------
# Causal conv1d: decode, verify, prefill
# ---------------------------------------------------------------------------------------------


def _conv_output(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """One output position from a float32 window ``[dim, width]``."""
    y = (window * weight.float()).sum(dim=-1)
    if bias is not None:
        y = y + bias.float()
    return F.silu(y) if silu else y


def causal_conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool,
    slot_idx: torch.Tensor,
) -> torch.Tensor:
    """Decode step: ``x [batch, dim]``; shifts ``x`` into ``conv_state[slot]`` in place; returns ``[batch, dim]``."""
    out = torch.zeros_like(x)
    for row, slot in enumerate(slot_idx.tolist()):
        if slot < 0:
            continue
        window = torch.cat([conv_state[slot].float(), x[row].float()[:, None]], dim=1)
        out[row] = _conv_output(window, weight, bias, silu).to(out.dtype)
        conv_state[slot] = window[:, 1:].to(conv_state.dtype)
    return out


def causal_conv1d_verify_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool,
    slot_idx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify over ``x [batch, T, dim]``: the pool is read, never written.

    Returns ``(out [batch, T, dim], states [batch, T, dim, width - 1])``; ``states[:, t]`` is the
    conv state after consuming token ``t``.
    """
    batch, T, dim = x.shape
    out = torch.zeros_like(x)
    states = torch.zeros((batch, T, dim, conv_state.shape[-1]), dtype=conv_state.dtype, device=x.device)
    for row, slot in enumerate(slot_idx.tolist()):
        if slot < 0:
            continue
        state = conv_state[slot].clone()
        for t in range(T):
            window = torch.cat([state.float(), x[row, t].float()[:, None]], dim=1)
            out[row, t] = _conv_output(window, weight, bias, silu).to(out.dtype)
            state = window[:, 1:].to(conv_state.dtype)
            states[row, t] = state
    return out, states


def causal_conv1d_prefill_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool,
    cu_seqlens: torch.Tensor,
    slot_idx: torch.Tensor,
) -> torch.Tensor:
    """Varlen prefill over packed ``x [total_tokens, dim]``: sequence ``i`` is
    ``x[cu_seqlens[i]:cu_seqlens[i+1]]``, starts from ``conv_state[slot_idx[i]]`` and leaves its
    last ``width - 1`` inputs there. Inputs enter the window unrounded (one op, one final store)."""
    out = torch.zeros_like(x)
    width = weight.shape[1]
    bounds = cu_seqlens.tolist()
    for seq, slot in enumerate(slot_idx.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        if slot < 0:
            continue
        # full[:, j] is input j of the stream "state then this sequence's tokens".
        full = torch.cat([conv_state[slot].float(), x[start:end].float().T], dim=1)
        for t in range(end - start):
            out[start + t] = _conv_output(full[:, t : t + width], weight, bias, silu).to(out.dtype)
        conv_state[slot] = full[:, full.shape[1] - (width - 1) :].to(conv_state.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Mamba2 selective state update: decode, verify, prefill (sequential scan)
# ---------------------------------------------------------------------------------------------


def ssm_step(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of one sequence, float32: ``state [H, P, N]``, ``x [H, P]``, ``dt [H]``,
    ``B, C [G, N]``. Returns ``(y [H, P], new state [H, P, N])``."""
    nheads = x.shape[0]
    heads_per_group = nheads // B.shape[0]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    B_h = B.float().repeat_interleave(heads_per_group, dim=0)  # [H, N]
    C_h = C.float().repeat_interleave(heads_per_group, dim=0)
    xf = x.float()
    decay = torch.exp(dt * A.float())[:, None, None]
    state = state * decay + (dt[:, None] * xf)[:, :, None] * B_h[:, None, :]
    y = (state * C_h[:, None, :]).sum(dim=-1)
    if D is not None:
        y = y + D.float()[:, None] * xf
    if z is not None:
        y = y * F.silu(z.float())
    return y, state


def selective_state_update_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    slot_idx: torch.Tensor,
) -> torch.Tensor:
    """Decode step over the pool: ``state[slot]`` updated in place; returns ``y [batch, H, P]``."""
    y = torch.zeros_like(x)
    for row, slot in enumerate(slot_idx.tolist()):
        if slot < 0:
            continue
        z_row = None if z is None else z[row]
        y_row, new = ssm_step(state[slot].float(), x[row], dt[row], A, B[row], C[row], D, z_row, dt_bias, dt_softplus)
        y[row] = y_row.to(y.dtype)
        state[slot] = new.to(state.dtype)
    return y


def selective_state_verify_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    slot_idx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify over ``x [batch, T, H, P]`` (``dt [batch, T, H]``, ``B, C [batch, T, G, N]``): the pool
    is read, never written. Returns ``(y [batch, T, H, P], states [batch, T, H, P, N])``."""
    batch, T = x.shape[:2]
    y = torch.zeros_like(x)
    states = torch.zeros((batch, T, *state.shape[1:]), dtype=state.dtype, device=x.device)
    for row, slot in enumerate(slot_idx.tolist()):
        if slot < 0:
            continue
        s = state[slot].clone()
        for t in range(T):
            z_t = None if z is None else z[row, t]
            y_t, new = ssm_step(s.float(), x[row, t], dt[row, t], A, B[row, t], C[row, t], D, z_t, dt_bias, dt_softplus)
            y[row, t] = y_t.to(y.dtype)
            s = new.to(state.dtype)  # what a decode step would have stored in the pool
            states[row, t] = s
    return y, states


def ssd_prefill_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    cu_seqlens: torch.Tensor,
    slot_idx: torch.Tensor,
) -> torch.Tensor:
    """Varlen prefill, sequential scan: packed ``x [total, H, P]``, ``dt [total, H]``,
    ``B, C [total, G, N]``. Sequence ``i`` starts from ``state[slot_idx[i]]``, carries float32
    between tokens and stores its final state once. Returns ``y [total, H, P]``."""
    y = torch.zeros_like(x)
    bounds = cu_seqlens.tolist()
    for seq, slot in enumerate(slot_idx.tolist()):
        if slot < 0:
            continue
        s = state[slot].float()
        for t in range(bounds[seq], bounds[seq + 1]):
            z_t = None if z is None else z[t]
            y_t, s = ssm_step(s, x[t], dt[t], A, B[t], C[t], D, z_t, dt_bias, dt_softplus)
            y[t] = y_t.to(y.dtype)
        state[slot] = s.to(state.dtype)
    return y


# ---------------------------------------------------------------------------------------------
# Commit after verify
# ---------------------------------------------------------------------------------------------


def commit_reference(
    pool_state: torch.Tensor, intermediate: torch.Tensor, accept_pos: torch.Tensor, slot_idx: torch.Tensor
) -> None:
    """``pool_state[slot_idx[row]] = intermediate[row, accept_pos[row]]``; ``-1`` in either skips the row."""
    for row, (pos, slot) in enumerate(zip(accept_pos.tolist(), slot_idx.tolist(), strict=True)):
        if pos < 0 or slot < 0:
            continue
        pool_state[slot] = intermediate[row, pos]
