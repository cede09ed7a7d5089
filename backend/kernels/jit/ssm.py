"""``@triton.jit`` body of the Mamba2 selective state update (decode: T=1 in place; verify: T positions).

Grid: axis 0 = block of ``head_dim``, axis 1 = batch row, axis 2 = head. Each program holds a
``[BLOCK_P, d_state]`` tile of the state in float32 registers for all T positions, so the state is
read from HBM once and written once per position: the kernel is bandwidth-bound on exactly that.
A row whose slot is -1 is masked out of every load and store. In place, every state element is
loaded and stored by the same thread (one tile layout), so no barrier is needed. Between verify
positions the carried state is rounded to the state dtype, as a decode step stores it.
"""

from typing import no_type_check

import triton
import triton.language as tl


@triton.jit
@no_type_check  # Triton compiles (or interprets) this from source: typeguard must not rewrite it
def ssm_update_kernel(
    state_ptr,
    x_ptr,
    dt_ptr,
    dt_bias_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    y_ptr,
    slot_ptr,
    out_state_ptr,
    T,
    heads_per_group,
    head_dim,
    d_state,
    s_slot,
    s_h,
    s_p,
    s_n,
    o_row,
    o_t,
    o_h,
    o_p,
    o_n,
    x_b,
    x_t,
    x_h,
    x_p,
    dt_b,
    dt_t,
    dt_h,
    B_b,
    B_t,
    B_g,
    B_n,
    C_b,
    C_t,
    C_g,
    C_n,
    z_b,
    z_t,
    z_h,
    z_p,
    y_b,
    y_t,
    y_h,
    y_p,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    IN_PLACE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_p = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    group = head // heads_per_group
    slot = tl.load(slot_ptr + row).to(tl.int64)
    # A padding row gets empty ranges: every access below is masked off. (Scalar limits rather
    # than `& (slot >= 0)`, which the interpreter mistypes as an int mask.)
    live_p = tl.where(slot >= 0, head_dim, 0)
    live_n = tl.where(slot >= 0, d_state, 0)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < live_p
    mask_n = offs_n < live_n
    mask = mask_p[:, None] & mask_n[None, :]
    state_ty = out_state_ptr.dtype.element_ty

    s = tl.load(
        state_ptr + slot * s_slot + head * s_h + offs_p[:, None] * s_p + offs_n[None, :] * s_n,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    A = tl.load(A_ptr + head).to(tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + head).to(tl.float32)
    if IN_PLACE:
        out_base = out_state_ptr + slot * o_row + head * o_h
    else:
        out_base = out_state_ptr + row * o_row + head * o_h

    for t in range(T):
        dt = tl.load(dt_ptr + row * dt_b + t * dt_t + head * dt_h).to(tl.float32)
        if HAS_DT_BIAS:
            dt = dt + dt_bias
        if DT_SOFTPLUS:
            # Same threshold as torch's softplus: linear above 20 (and no overflow in exp).
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))), dt)
        x = tl.load(x_ptr + row * x_b + t * x_t + head * x_h + offs_p * x_p, mask=mask_p, other=0.0).to(tl.float32)
        Bv = tl.load(B_ptr + row * B_b + t * B_t + group * B_g + offs_n * B_n, mask=mask_n, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + row * C_b + t * C_t + group * C_g + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
        decay = tl.exp(dt * A)
        s = s * decay + (dt * x)[:, None] * Bv[None, :]
        y = tl.sum(s * Cv[None, :], axis=1)
        if HAS_D:
            y = y + D * x
        if HAS_Z:
            zv = tl.load(z_ptr + row * z_b + t * z_t + head * z_h + offs_p * z_p, mask=mask_p, other=0.0).to(tl.float32)
            y = y * (zv * tl.sigmoid(zv))
        tl.store(y_ptr + row * y_b + t * y_t + head * y_h + offs_p * y_p, y, mask=mask_p)
        stored = s.to(state_ty)
        tl.store(out_base + t * o_t + offs_p[:, None] * o_p + offs_n[None, :] * o_n, stored, mask=mask)
        s = stored.to(tl.float32)
