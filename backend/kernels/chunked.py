"""Chunked prefill of Mamba2 layers over a varlen batch: causal conv1d and the SSD scan.

A prefill batch packs the tokens of several prompts: ``x[cu_seqlens[i]:cu_seqlens[i+1]]`` is
sequence ``i``. Each sequence starts from the state in its slot ``slot_idx[i]`` (zero after a
clear, the checkpoint after a copy-on-write, its own state for a chunked-prefill continuation),
leaves its final state there and returns per-token outputs. ``slot_idx[i] == -1`` skips a
sequence (outputs zero, pool untouched); so does an empty sequence (its state stays as it is).

Status: **torch on every device** (no Triton kernel yet), batched over the sequences: the number
of torch operations does not grow with the number of sequences. The live sequences (slot not -1,
at least one token) are padded to the longest one, ``[sequences, longest, ...]``:

- the conv pads each sequence into a stream "conv state, then its tokens", runs the depthwise
  conv over all streams at once (``width`` shifted multiply-adds, cheaper than ``conv1d`` at these
  widths), gathers the valid outputs back to the packed layout and takes each sequence's final
  state from the last ``width - 1`` entries of its own stream;
- the SSD scan is the chunked (block-decomposed) form, batched over sequences: within a chunk of
  ``chunk_size`` tokens the output is a masked, decay-weighted ``C Bᵀ`` product, across chunks the
  state is carried in float32 (a Python loop over the chunk index of the longest sequence, never
  over sequences). Padded positions get ``dt = 0`` (after bias and softplus), so they neither
  decay nor feed the state, and their outputs are dropped. ``B`` and ``C`` stay per group (heads
  are viewed as ``[ngroups, heads per group]``). When one ``[sequences, Q, Q, nheads]`` tensor of
  the scan would exceed ``SCAN_GROUP_ELEMENTS`` the sequences are scanned in groups, so the scan's
  working memory stays that of one sequence or of ``SCAN_GROUP_ELEMENTS``, whichever is larger.

Both kernels compute in float32 and store in the state and output dtypes. ``backend.reference``
holds the token-by-token scans the tests compare against.

Invariants checked before computing (``ValueError``): shapes as in ``backend.kernels.conv`` /
``backend.kernels.ssm`` with the token axis packed; ``cu_seqlens`` 1-D integer, starting at 0,
non-decreasing, ending at the token count, one entry more than ``slot_idx``; slots -1 or in
``[0, num_slots)`` and not repeated (unless ``check_slots=False``).
"""

from __future__ import annotations

from itertools import pairwise

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from backend.kernels import checks
from backend.kernels.checks import require

SCAN_GROUP_ELEMENTS = 1 << 22
"""Elements of one ``[sequences, Q, Q, nheads]`` float32 tensor of the batched SSD scan above which
``ssd_prefill`` scans the sequences in groups (a group holds at least one sequence)."""


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


@attrs.frozen
class _Padded:
    """The live sequences of a varlen batch (slot not -1, at least one token) as rows
    ``0..rows-1`` of a ``[rows, longest, ...]`` padded layout, longest first (ties in batch order).

    Live token ``j`` (in packed order) sits at ``[row[j], offset[j]]``; ``tokens`` are the packed
    indices of the live tokens, ``None`` when every token is live; ``slots`` and ``lengths`` are per
    row."""

    rows: int
    longest: int
    lengths: list[int]
    slots: torch.Tensor
    lengths_t: torch.Tensor
    row: torch.Tensor
    offset: torch.Tensor
    tokens: torch.Tensor | None

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        """The live tokens of a packed ``[total, ...]`` tensor, in float32."""
        return (packed if self.tokens is None else packed[self.tokens]).float()

    def scatter(self, live: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A packed tensor shaped and typed like ``like``: ``live`` at the live tokens, zero elsewhere."""
        if self.tokens is None:
            return live.to(like.dtype)
        out = torch.zeros_like(like)
        out[self.tokens] = live.to(like.dtype)
        return out


def _padded(bounds: list[int], slot_idx: torch.Tensor) -> _Padded | None:
    """The padded layout of the live sequences, ``None`` when there are none (index arithmetic on
    the host, then one copy of each index to the device)."""
    device = slot_idx.device
    cu = np.asarray(bounds, dtype=np.int64)
    lengths = np.diff(cu)
    slots = np.asarray(slot_idx.tolist(), dtype=np.int64)
    live = (slots >= 0) & (lengths > 0)
    if not live.any():
        return None
    lens = lengths[live]  # batch order
    order = np.argsort(-lens, kind="stable")  # row -> live sequence
    rank = np.empty_like(order)  # live sequence -> row
    rank[order] = np.arange(order.shape[0])
    offset = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    every_token = int(lens.sum()) == bounds[-1]
    return _Padded(
        rows=int(order.shape[0]),
        longest=int(lens.max()),
        lengths=lens[order].tolist(),
        slots=torch.as_tensor(slots[live][order], device=device),
        lengths_t=torch.as_tensor(lens[order], device=device),
        row=torch.as_tensor(np.repeat(rank, lens), device=device),
        offset=torch.as_tensor(offset, device=device),
        tokens=None if every_token else torch.as_tensor(np.repeat(cu[:-1][live], lens) + offset, device=device),
    )


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
    pad = _padded(bounds, slot_idx)
    if pad is None:
        return torch.zeros_like(x)

    keep = width - 1
    # stream[r, j]: input j of row r's stream "conv state, then its tokens" (zero past its end)
    stream = torch.zeros((pad.rows, keep + pad.longest, dim), dtype=torch.float32, device=x.device)
    stream[:, :keep] = conv_state[pad.slots].transpose(1, 2)
    stream[pad.row, keep + pad.offset] = pad.gather(x)
    # the depthwise conv as `width` shifted multiply-adds over every stream at once
    w = weight.float().T.contiguous()  # [width, dim]: contiguous rows keep the multiply-adds vectorized
    y = stream[:, : pad.longest] * w[0] if bias is None else torch.addcmul(bias.float(), stream[:, : pad.longest], w[0])
    for k in range(1, width):
        y.addcmul_(stream[:, k : k + pad.longest], w[k])
    y_live = y[pad.row, pad.offset]  # [live tokens, dim]
    # a row of length L leaves stream inputs L .. L + keep - 1: its last `keep` inputs
    last = pad.lengths_t[:, None, None] + torch.arange(keep, device=x.device)[:, None]  # [rows, keep, 1]
    conv_state[pad.slots] = stream.gather(1, last.expand(pad.rows, keep, dim)).transpose(1, 2).to(conv_state.dtype)
    return pad.scatter(F.silu(y_live) if silu else y_live, x)


def _ssd_scan(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk: int,
    lengths: list[int],
) -> torch.Tensor:
    """Padded sequences, float32, head-major with heads as ``[G, h]`` (groups, heads per group):
    ``state [b, G, h, P, N]``, ``x [b, G, h, L, P]``, ``dt [b, G, h, L]`` (final, after
    bias/softplus; zero past each sequence's end), ``A [G, h]``, ``B, C [b, G, L, N]``; ``lengths``
    non-increasing (row 0 the longest). Returns ``y [b, G, h, L, P]`` without the ``D`` skip and
    the ``z`` gate (undefined past a row's length); ``state`` is scanned in place to the final one.

    A chunk runs on the rows still running at its start (a prefix, as the rows are sorted), so a
    short row costs no chunks of padding; every contraction is a batched matmul over ``(b, G, h)``."""
    length = x.shape[3]
    groups, per_group, head_dim, d_state = state.shape[1:]
    y = torch.empty_like(x)
    running = len(lengths)
    for c0 in range(0, length, chunk):
        while lengths[running - 1] <= c0:
            running -= 1
        c1 = min(c0 + chunk, length)
        xs, dts = x[:running, :, :, c0:c1], dt[:running, :, :, c0:c1]
        Bs, Cs = B[:running, :, c0:c1], C[:running, :, c0:c1]  # [b, G, Q, N]
        log_decay = (dts * A[:, :, None]).cumsum(dim=-1)  # [b, G, h, Q]: log of the decay from chunk start through t
        # decay from token i to token t (i <= t), zero for t < i: zeroed before the exp so t < i
        # cannot overflow, and after it (exp(0) = 1); a -inf fill would send half of the entries
        # down the slow path of exp
        weights = (log_decay[..., :, None] - log_decay[..., None, :]).tril_().exp_().tril_()  # [b, G, h, t, i]
        weights.mul_((Cs @ Bs.transpose(-1, -2))[:, :, None])  # times C_t . B_i
        dtx = xs * dts[..., None]  # [b, G, h, Q, P]
        s0 = state[:running]
        # C_t . (carried state), all heads of a group in one matmul: [b, G, Q, N] @ [b, G, N, h * P]
        carried = (Cs @ s0.reshape(running, groups, per_group * head_dim, d_state).transpose(-1, -2))
        carried = carried.view(running, groups, c1 - c0, per_group, head_dim).transpose(2, 3)  # [b, G, h, Q, P]
        y[:running, :, :, c0:c1] = weights @ dtx + carried * torch.exp(log_decay)[..., None]
        to_end = torch.exp(log_decay[..., -1:] - log_decay)  # [b, G, h, Q]: decay from token i to the chunk end
        fed = (dtx * to_end[..., None]).transpose(-1, -2).reshape(running, groups, per_group * head_dim, c1 - c0) @ Bs
        state[:running] = s0 * torch.exp(log_decay[..., -1])[..., None, None] + fed.view(s0.shape)
    return y


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
    pad = _padded(bounds, slot_idx)
    if pad is None:
        return torch.zeros_like(x)

    per_group = nheads // ngroups
    x_live = pad.gather(x)  # [live, H, P]
    dt_live = pad.gather(dt)
    if dt_bias is not None:
        dt_live = dt_live + dt_bias.float()
    if dt_softplus:
        dt_live = F.softplus(dt_live)
    rows, longest = pad.rows, pad.longest
    at = (pad.row, slice(None), slice(None), pad.offset)  # [row, G, h, offset] of every live token

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=device)

    x_pad = zeros(rows, ngroups, per_group, longest, head_dim)
    x_pad[at] = x_live.reshape(-1, ngroups, per_group, head_dim)
    dt_pad = zeros(rows, ngroups, per_group, longest)  # zero past each row's end: padding is inert
    dt_pad[at] = dt_live.reshape(-1, ngroups, per_group)
    B_pad = zeros(rows, ngroups, longest, d_state)
    B_pad[pad.row, :, pad.offset] = pad.gather(B)
    C_pad = torch.zeros_like(B_pad)
    C_pad[pad.row, :, pad.offset] = pad.gather(C)
    A_g = A.float().reshape(ngroups, per_group)
    final = state[pad.slots].float().reshape(rows, ngroups, per_group, head_dim, d_state)  # scanned in place

    # rows per scan: the [rows, Q, Q, nheads] tensors stay within SCAN_GROUP_ELEMENTS (or one row)
    q = min(chunk_size, longest)
    per_scan = max(1, SCAN_GROUP_ELEMENTS // (q * q * nheads))
    if per_scan >= rows:
        y_pad = _ssd_scan(final, x_pad, dt_pad, A_g, B_pad, C_pad, chunk_size, pad.lengths)
    else:
        y_pad = torch.empty_like(x_pad)
        for r0 in range(0, rows, per_scan):
            r1 = min(r0 + per_scan, rows)
            n = pad.lengths[r0]  # the group's longest row: no chunks of padding only
            y_pad[r0:r1, :, :, :n] = _ssd_scan(
                final[r0:r1], x_pad[r0:r1, :, :, :n], dt_pad[r0:r1, :, :, :n], A_g, B_pad[r0:r1, :, :n], C_pad[r0:r1, :, :n],
                chunk_size, pad.lengths[r0:r1],
            )
    y_live = y_pad[at].reshape(-1, nheads, head_dim)  # [live, H, P]
    if D is not None:
        y_live = y_live + D.float()[:, None] * x_live
    if z is not None:
        y_live = y_live * F.silu(pad.gather(z))
    state[pad.slots] = final.reshape(rows, nheads, head_dim, d_state).to(state.dtype)
    return pad.scatter(y_live, x)
