"""Chunked prefill of Mamba2 layers over a varlen batch: causal conv1d and the SSD scan.

A prefill batch packs the tokens of several prompts: ``x[cu_seqlens[i]:cu_seqlens[i+1]]`` is
sequence ``i``. Each sequence starts from the state in its slot ``slot_idx[i]`` (zero after a
clear, the checkpoint after a copy-on-write, its own state for a chunked-prefill continuation),
leaves its final state there and returns per-token outputs. ``slot_idx[i] == -1`` skips a
sequence (outputs zero, pool untouched).

Status: **torch on every device** (no Triton kernel yet). The conv is one grouped ``conv1d`` per
sequence; the SSD scan is the chunked (block-decomposed) form: within a chunk of ``chunk_size``
tokens the output is a masked, decay-weighted ``C Bᵀ`` product, across chunks the state is carried
in float32. ``backend.reference`` holds the token-by-token scan the tests compare against.

Invariants checked before computing (``ValueError``): shapes as in ``backend.kernels.conv`` /
``backend.kernels.ssm`` with the token axis packed; ``cu_seqlens`` 1-D integer, starting at 0,
non-decreasing, ending at the token count, one entry more than ``slot_idx``; slots -1 or in
``[0, num_slots)`` and not repeated (unless ``check_slots=False``).
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

from backend.kernels import checks
from backend.kernels.checks import require


def _check_varlen(cu_seqlens: torch.Tensor, slot_idx: torch.Tensor, total: int, num_slots: int, check_slots: bool) -> list[int]:
    device = slot_idx.device
    checks.check_index("cu_seqlens", cu_seqlens, length=None, device=device)
    require(cu_seqlens.shape[0] >= 1, "cu_seqlens needs at least one entry")
    checks.check_index("slot_idx", slot_idx, length=cu_seqlens.shape[0] - 1, device=device)
    bounds = [int(v) for v in cu_seqlens.tolist()]
    require(bounds[0] == 0 and bounds[-1] == total, f"cu_seqlens must run from 0 to {total}, got {bounds[:4]}...")
    require(all(a <= b for a, b in pairwise(bounds)), "cu_seqlens must be non-decreasing")
    if check_slots:
        checks.check_slot_rows("slot_idx", slot_idx, num_slots)
    return bounds


def causal_conv1d_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool,
    cu_seqlens: torch.Tensor,
    slot_idx: torch.Tensor,
    check_slots: bool = True,
) -> torch.Tensor:
    """Packed ``x [total, dim]`` -> ``out [total, dim]``; each slot's conv state is used and replaced."""
    require(x.dim() == 2, f"x must be [total_tokens, dim], got {tuple(x.shape)}")
    require(weight.dim() == 2, f"weight must be [dim, width], got shape {tuple(weight.shape)}")
    total, dim = x.shape
    width = weight.shape[1]
    require(2 <= width <= 4, f"conv width must be in [2, 4], got {width}")
    checks.check_tensor("weight", weight, shape=(dim, width), device=x.device, dtypes=checks.STATE_DTYPES)
    checks.check_optional("bias", bias, shape=(dim,), device=x.device, dtypes=checks.STATE_DTYPES)
    require(conv_state.dim() == 3, f"conv_state must be [num_slots, dim, width - 1], got {tuple(conv_state.shape)}")
    checks.check_tensor(
        "conv_state", conv_state, shape=(conv_state.shape[0], dim, width - 1), device=x.device, dtypes=checks.STATE_DTYPES
    )
    bounds = _check_varlen(cu_seqlens, slot_idx, total, conv_state.shape[0], check_slots)

    out = torch.zeros_like(x)
    kernel = weight.float()[:, None, :]  # [dim, 1, width]: depthwise
    bias_f = None if bias is None else bias.float()
    for seq, slot in enumerate(slot_idx.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        if slot < 0 or start == end:  # an empty sequence leaves its state as it is
            continue
        stream = torch.cat([conv_state[slot].float(), x[start:end].float().T], dim=1)  # [dim, w-1+L]
        y = F.conv1d(stream[None], kernel, bias_f, groups=dim)[0].T  # [L, dim]
        out[start:end] = (F.silu(y) if silu else y).to(out.dtype)
        conv_state[slot] = stream[:, stream.shape[1] - (width - 1) :].to(conv_state.dtype)
    return out


def _ssd_scan(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, float32: ``state [H, P, N]``, ``x [L, H, P]``, ``dt [L, H]`` (final, after
    bias/softplus), ``B, C [L, H, N]`` (per head). Returns ``(y [L, H, P], final state)``
    without the ``D`` skip and the ``z`` gate."""
    y = torch.empty_like(x)
    for c0 in range(0, x.shape[0], chunk):
        c1 = min(c0 + chunk, x.shape[0])
        xs, dts, Bs, Cs = x[c0:c1], dt[c0:c1], B[c0:c1], C[c0:c1]
        log_decay = (dts * A).cumsum(dim=0)  # [Q, H]: log of the decay from chunk start through t
        # decay from token i to token t (i <= t); masked before exp so t < i cannot overflow.
        causal = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=x.device).tril()
        seg = (log_decay[:, None, :] - log_decay[None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
        weights = torch.exp(seg) * torch.einsum("thn,ihn->tih", Cs, Bs) * dts[None, :, :]  # [t, i, H]
        y_intra = torch.einsum("tih,ihp->thp", weights, xs)
        y_carried = torch.einsum("hpn,thn->thp", state, Cs) * torch.exp(log_decay)[:, :, None]
        y[c0:c1] = y_intra + y_carried
        to_end = torch.exp(log_decay[-1][None, :] - log_decay) * dts  # [Q, H]
        state = state * torch.exp(log_decay[-1])[:, None, None] + torch.einsum("ih,ihp,ihn->hpn", to_end, xs, Bs)
    return y, state


def ssd_prefill(
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
    cu_seqlens: torch.Tensor,
    slot_idx: torch.Tensor,
    chunk_size: int = 64,
    check_slots: bool = True,
) -> torch.Tensor:
    """Packed ``x [total, H, P]``, ``dt [total, H]``, ``B, C [total, G, N]`` -> ``y [total, H, P]``;
    each slot's SSM state is the initial state and receives the final one."""
    require(chunk_size > 0, f"chunk_size must be positive, got {chunk_size}")
    require(state.dim() == 4, f"state must be [num_slots, nheads, head_dim, d_state], got {tuple(state.shape)}")
    num_slots, nheads, head_dim, d_state = state.shape
    total = x.shape[0] if x.dim() else 0
    device = x.device
    floats = checks.STATE_DTYPES
    checks.check_tensor("state", state, shape=state.shape, device=device, dtypes=floats)
    checks.check_tensor("x", x, shape=(total, nheads, head_dim), device=device, dtypes=floats)
    checks.check_tensor("dt", dt, shape=(total, nheads), device=device, dtypes=floats)
    checks.check_tensor("A", A, shape=(nheads,), device=device, dtypes=floats)
    require(B.dim() == 3, f"B must be [total, ngroups, d_state], got {tuple(B.shape)}")
    ngroups = B.shape[1]
    require(ngroups > 0 and nheads % ngroups == 0, f"nheads {nheads} is not a multiple of ngroups {ngroups}")
    checks.check_tensor("B", B, shape=(total, ngroups, d_state), device=device, dtypes=floats)
    checks.check_tensor("C", C, shape=(total, ngroups, d_state), device=device, dtypes=floats)
    checks.check_optional("D", D, shape=(nheads,), device=device, dtypes=floats)
    checks.check_optional("z", z, shape=(total, nheads, head_dim), device=device, dtypes=floats)
    checks.check_optional("dt_bias", dt_bias, shape=(nheads,), device=device, dtypes=floats)
    bounds = _check_varlen(cu_seqlens, slot_idx, total, num_slots, check_slots)

    dt_f = dt.float()
    if dt_bias is not None:
        dt_f = dt_f + dt_bias.float()
    if dt_softplus:
        dt_f = F.softplus(dt_f)
    per_group = nheads // ngroups
    B_h = B.float().repeat_interleave(per_group, dim=1)
    C_h = C.float().repeat_interleave(per_group, dim=1)
    x_f = x.float()
    y = torch.zeros_like(x)
    for seq, slot in enumerate(slot_idx.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        if slot < 0 or start == end:
            continue
        ys, final = _ssd_scan(
            state[slot].float(), x_f[start:end], dt_f[start:end], A.float(), B_h[start:end], C_h[start:end], chunk_size
        )
        if D is not None:
            ys = ys + D.float()[:, None] * x_f[start:end]
        if z is not None:
            ys = ys * F.silu(z[start:end].float())
        y[start:end] = ys.to(y.dtype)
        state[slot] = final.to(state.dtype)
    return y
