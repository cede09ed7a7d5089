"""``@triton.jit`` body of the causal conv1d update (decode: T=1 in place; verify: T positions out of place).

Grid: axis 0 = block of channels, axis 1 = batch row. A row whose slot is -1 is masked out of
every load and store (no early return, so the kernel is one straight-line body).

The window of position ``t`` is ``stream[t : t + WIDTH]`` over the stream "state columns, then the
row's tokens". Reading it straight from memory (the state from the pool, tokens from ``x``)
instead of shifting registers keeps the body generic in WIDTH and lets every position be computed
from the untouched pool state. Tokens that sit in a *state* column of a window are rounded through
the state dtype, so a verify position sees exactly what the decode step before it stored.
In place (decode), one thread's store may hit a column another thread still has to load; the
barrier orders all loads of the program before its stores.
"""

from typing import no_type_check

import triton
import triton.language as tl


@triton.jit
@no_type_check  # Triton compiles (or interprets) this from source: typeguard must not rewrite it
def conv_update_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    slot_ptr,
    out_state_ptr,
    T,
    dim,
    x_b,
    x_t,
    x_d,
    s_slot,
    s_d,
    s_w,
    o_row,
    o_t,
    o_d,
    o_w,
    w_d,
    w_w,
    y_b,
    y_t,
    y_d,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    IN_PLACE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_d = tl.program_id(0)
    row = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    # A padding row gets an empty channel range: every access below is masked off. (A scalar
    # limit rather than `& (slot >= 0)`, which the interpreter mistypes as an int mask.)
    live_dim = tl.where(slot >= 0, dim, 0)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < live_dim
    k = tl.arange(0, BLOCK_W)
    state_ty = out_state_ptr.dtype.element_ty

    w = tl.load(
        w_ptr + offs_d[:, None] * w_d + k[None, :] * w_w,
        mask=mask_d[:, None] & (k < WIDTH)[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)

    in_base = state_ptr + slot * s_slot
    x_base = x_ptr + row.to(tl.int64) * x_b
    if IN_PLACE:
        out_base = out_state_ptr + slot * o_row
    else:
        out_base = out_state_ptr + row.to(tl.int64) * o_row

    for t in range(T):
        # Output window: stream[t + k], k < WIDTH.
        j = t + k
        in_state = j < WIDTH - 1
        token = j - (WIDTH - 1)
        sv = tl.load(
            in_base + offs_d[:, None] * s_d + j[None, :] * s_w,
            mask=mask_d[:, None] & in_state[None, :],
            other=0.0,
        ).to(tl.float32)
        xv = tl.load(
            x_base + token[None, :] * x_t + offs_d[:, None] * x_d,
            mask=mask_d[:, None] & (~in_state & (k < WIDTH))[None, :],
            other=0.0,
        ).to(tl.float32)
        xr = xv.to(state_ty).to(tl.float32)
        win = tl.where(in_state[None, :], sv, tl.where((k == WIDTH - 1)[None, :], xv, xr))
        acc = tl.sum(win * w, axis=1) + bias
        if SILU:
            acc = acc * tl.sigmoid(acc)

        # State after token t: stream[t + 1 + c], c < WIDTH - 1.
        jn = t + 1 + k
        col = k < WIDTH - 1
        in_state_n = jn < WIDTH - 1
        sn = tl.load(
            in_base + offs_d[:, None] * s_d + jn[None, :] * s_w,
            mask=mask_d[:, None] & (in_state_n & col)[None, :],
            other=0.0,
        )
        xn = tl.load(
            x_base + (jn - (WIDTH - 1))[None, :] * x_t + offs_d[:, None] * x_d,
            mask=mask_d[:, None] & (~in_state_n & col)[None, :],
            other=0.0,
        )
        new = tl.where(in_state_n[None, :], sn.to(state_ty), xn.to(state_ty))
        if IN_PLACE:
            tl.debug_barrier()
        tl.store(out_ptr + row.to(tl.int64) * y_b + t * y_t + offs_d * y_d, acc, mask=mask_d)
        tl.store(
            out_base + t * o_t + offs_d[:, None] * o_d + k[None, :] * o_w,
            new,
            mask=mask_d[:, None] & col[None, :],
        )
