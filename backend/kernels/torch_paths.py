"""The torch path of the decode, verify and commit wrappers: the reference arithmetic, vectorized over rows.

``backend.kernels.conv``, ``backend.kernels.ssm`` and ``backend.kernels.commit`` run these when
``backend.kernels.dispatch.use_triton`` says no (a CPU, or a machine without Triton), after their
own argument checks. Each function computes what its per-row counterpart in ``backend.reference``
computes, with the same ops in the same order and dtypes, as a handful of batched torch ops
instead of a Python loop over rows: the live rows (``slot_idx >= 0``) are gathered from the pool
once, advanced together, and scattered back with one indexed copy; the SSM decode step, whose
states are the largest, advances them a cache-sized block of heads at a time, in place in the pool
when the rows' slots are consecutive (``STATE_BLOCK_BYTES``). Padding rows (-1) leave the
pool untouched and their outputs zero. ``backend.reference`` stays the readable specification and
the tests' oracle.

On a CPU the results equal the reference's bit for bit (states, outputs, every state dtype). Two
details of torch's CPU loops make that take care, and ``_per_row`` takes it (on other devices it
applies the op as is: equal within float rounding there):

- Torch evaluates a contiguous run of elements with SIMD code and the tail of the run (shorter
  than two vectors) with scalar code, and ``exp``, ``softplus`` and ``silu`` may differ between the
  two in the last bit. A per-row call sees one row as its run; a batched call over a contiguous
  ``[rows, ...]`` tensor sees all rows as one run, so some elements would change path. ``_per_row``
  lays rows out one element apart so that each row stays a run of its own.
- An op over more than ``GRAIN`` elements is split across threads at arbitrary elements, which moves
  run boundaries too; ``_per_row`` computes larger tensors in blocks of rows under it.

Only those transcendental ops need this: products, sums, casts and the ``d_state`` reduction (over
a contiguous last axis either way) give the same bits in any layout. The guarantee assumes what
every caller passes: per-token inputs whose rows lie after one another (a row's stride at least
its extent), e.g. contiguous tensors and slices of them.

SSM verify keeps a loop over the ``T`` positions (each step batched over rows), carrying the state
rounded to the state dtype between positions exactly as the reference (and a decode step reading
the pool back) does, so a verify equals ``T`` decode steps bit for bit. (The model's verify runs
``backend.kernels.window`` instead: no state per position, equal to this to float32 rounding.) Conv verify has no
recurrence to carry: all positions' windows are built at once from the stream "state, then the
inputs rounded to the state dtype" (what the reference's carried state holds), each ending in its
own input unrounded.

Inputs are assumed validated by the wrappers (shapes, dtypes, devices, slot ranges, no slot twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from backend.parts import STATE
from backend.readback import host_values, staged

__all__ = [
    "GRAIN", "STATE_BLOCK_BYTES", "causal_conv1d_update", "causal_conv1d_verify", "commit_accepted", "selective_state_update",
    "selective_state_verify",
]

GRAIN = 32768
"""Elements from which torch splits a CPU elementwise op across threads (ATen's ``GRAIN_SIZE``)."""
STATE_BLOCK_BYTES = 1 << 20
"""Float32 bytes of SSM state a decode step advances at a time (``selective_state_update``): a block
of heads over the rows, small enough to stay in the CPU's caches between its reads and writes."""


def _run_crosses_rows(t: torch.Tensor, row_dims: int) -> bool:
    """True when the innermost contiguous run of ``t`` (what torch's loops vectorize) spans more
    than one row, i.e. each row is contiguous and the next row follows without a gap."""
    expected = 1
    for d in reversed(range(t.dim())):
        if t.shape[d] == 1:
            continue
        if t.stride(d) != expected:
            return False
        if d < row_dims:
            return True
        expected *= t.shape[d]
    return False


def _per_row(op: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor, row_dims: int) -> torch.Tensor:
    """``op(t)`` for an elementwise ``op`` whose first ``row_dims`` axes index rows, giving each
    row's elements the bits ``op(t[row])`` gives them (see the module docstring)."""
    rows, row_numel = math.prod(t.shape[:row_dims]), math.prod(t.shape[row_dims:])
    if rows <= 1 or row_numel == 0 or t.device.type != "cpu":
        return op(t)
    if not _run_crosses_rows(t, row_dims):
        return _unsplit(op, t, row_dims)
    gapped = torch.empty((rows, row_numel + 1), dtype=t.dtype, device=t.device)[:, :row_numel]
    gapped.copy_(t.reshape(rows, row_numel))
    return _unsplit(op, gapped, 1).view(t.shape)


def _unsplit(op: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor, row_dims: int) -> torch.Tensor:
    """``op(t)`` in blocks along the first axis that torch does not split across threads; an entry
    of the first axis over the grain on its own is computed row by row along the next."""
    if t.numel() < GRAIN or torch.get_num_threads() == 1:
        return op(t)
    per_entry = t.numel() // t.shape[0]
    if per_entry >= GRAIN and row_dims > 1:
        return torch.stack([_unsplit(op, entry, row_dims - 1) for entry in t.unbind(0)])
    per_block = max(1, (GRAIN - 1) // per_entry)
    return torch.cat([op(block) for block in torch.split(t, per_block)])


def _live_rows(slot_idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(rows, slots)``: the batch positions of the live rows (``None`` when every row is live, so
    nothing needs gathering) and their slots, both int64."""
    slots = slot_idx.long()
    known = host_values(slot_idx)  # (staged slots: decided on the host; else one readback)
    if slots is not slot_idx:
        staged(slots, known)
    live = known >= 0
    if live.all():
        return None, slots
    picked = np.flatnonzero(live)
    rows = torch.from_numpy(picked).to(slots.device)
    return rows, staged(slots[rows], known[picked])


def _take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def _spread(live: torch.Tensor, rows: torch.Tensor | None, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """The batch-sized tensor whose ``rows`` hold ``live`` (cast to ``dtype``) and whose other rows
    are zero; ``rows is None`` means every row, and then ``live`` itself is returned, cast."""
    if rows is None:
        return live.to(dtype)
    out = torch.zeros((batch, *live.shape[1:]), dtype=dtype, device=live.device)
    out.index_copy_(0, rows, live.to(dtype))
    return out


# ---------------------------------------------------------------------------------------------
# Causal conv1d: decode, verify
# ---------------------------------------------------------------------------------------------


def _conv_outputs(
    windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool, row_dims: int
) -> torch.Tensor:
    """``backend.reference._conv_output`` over float32 windows ``[*rows, dim, width]``: ``[*rows, dim]``."""
    y = (windows * weight.float()).sum(dim=-1)
    if bias is not None:
        y = y + bias.float()
    return _per_row(F.silu, y, row_dims) if silu else y


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool,
    slot_idx: torch.Tensor,
) -> torch.Tensor:
    """Decode step: ``x [batch, dim]``; shifts ``x`` into ``conv_state[slot]`` in place; returns ``[batch, dim]``."""
    rows, slots = _live_rows(slot_idx)
    if slots.numel() == 0:
        return torch.zeros_like(x)
    with STATE:
        windows = torch.cat([conv_state[slots].float(), _take(x, rows).float()[:, :, None]], dim=2)  # [live, dim, width]
    y = _conv_outputs(windows, weight, bias, silu, row_dims=1)
    with STATE:
        conv_state.index_copy_(0, slots, windows[:, :, 1:].to(conv_state.dtype))
    return _spread(y, rows, x.shape[0], x.dtype)


def causal_conv1d_verify(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool,
    slot_idx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify over ``x [batch, T, dim]``, all positions at once; the pool is read, never written.

    Returns ``(out [batch, T, dim], states [batch, T, dim, width - 1])``; ``states[:, t]`` is the
    conv state after consuming token ``t``.
    """
    batch, T, dim = x.shape
    keep = conv_state.shape[-1]  # width - 1
    rows, slots = _live_rows(slot_idx)
    if T == 0 or slots.numel() == 0:
        return torch.zeros_like(x), torch.zeros((batch, T, dim, keep), dtype=conv_state.dtype, device=x.device)
    xf = _take(x, rows).float()  # [live, T, dim]
    # stream[:, :, j] is input j of "the state, then the tokens", as the carried state holds it
    stream = torch.cat([conv_state[slots], xf.transpose(1, 2).to(conv_state.dtype)], dim=2)  # [live, dim, keep + T]
    older = stream[:, :, : keep + T - 1].float().unfold(2, keep, 1).transpose(1, 2)  # [live, T, dim, keep]
    windows = torch.cat([older, xf[..., None]], dim=3)  # [live, T, dim, width]
    y = _conv_outputs(windows, weight, bias, silu, row_dims=2)  # [live, T, dim]
    states = stream[:, :, 1:].unfold(2, keep, 1).transpose(1, 2).contiguous()  # [live, T, dim, keep]
    return _spread(y, rows, batch, x.dtype), _spread(states, rows, batch, conv_state.dtype)


# ---------------------------------------------------------------------------------------------
# Mamba2 selective state update: decode, verify
# ---------------------------------------------------------------------------------------------


class _SsmTerms:
    """The per-token factors of ``backend.reference.ssm_step`` that do not depend on the state,
    float32, for every token at once (leading axes ``[batch]`` or ``[batch, T]``): computed with
    the reference's ops in its order, so a step from them is the reference's step."""

    def __init__(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor | None,
        z: torch.Tensor | None,
        dt_bias: torch.Tensor | None,
        dt_softplus: bool,
        row_dims: int,
    ) -> None:
        heads_per_group = x.shape[-2] // B.shape[-2]
        dt = dt.float()
        if dt_bias is not None:
            dt = dt + dt_bias.float()
        if dt_softplus:
            dt = _per_row(F.softplus, dt, row_dims)
        xf = x.float()
        self.decay = _per_row(torch.exp, dt * A.float(), row_dims)[..., None, None]  # [*, H, 1, 1]
        self.dt_x = (dt[..., None] * xf)[..., None]  # [*, H, P, 1]
        self.B = B.float().repeat_interleave(heads_per_group, dim=-2)[..., None, :]  # [*, H, 1, N]
        self.C = C.float().repeat_interleave(heads_per_group, dim=-2)[..., None, :]
        self.D_x = None if D is None else D.float()[:, None] * xf  # [*, H, P]
        self.gate = None if z is None else _per_row(F.silu, z.float(), row_dims)

    def take(self, rows: torch.Tensor | None) -> _SsmTerms:
        """Keep the tokens of ``rows`` only (all when ``None``)."""
        if rows is not None:
            self.decay, self.dt_x, self.B, self.C = self.decay[rows], self.dt_x[rows], self.B[rows], self.C[rows]
            self.D_x = None if self.D_x is None else self.D_x[rows]
            self.gate = None if self.gate is None else self.gate[rows]
        return self

    def step(self, state: torch.Tensor, t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row from float32 ``state [rows, H, P, N]`` (position ``t`` of a verify):
        ``(y [rows, H, P], new state)``."""
        at = slice(None) if t is None else t
        state = state * self.decay[:, at] + self.dt_x[:, at] * self.B[:, at]
        y = (state * self.C[:, at]).sum(dim=-1)
        if self.D_x is not None:
            y = y + self.D_x[:, at]
        if self.gate is not None:
            y = y * self.gate[:, at]
        return y, state


def selective_state_update(
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
    rows, slots = _live_rows(slot_idx)
    if slots.numel() == 0:
        return torch.zeros_like(x)
    terms = _SsmTerms(x, dt, A, B, C, D, z, dt_bias, dt_softplus, row_dims=1).take(rows)
    return _spread(_advance_in_blocks(state, slots, terms), rows, x.shape[0], x.dtype)


def _slot_runs(slots: torch.Tensor) -> list[tuple[slice, slice | torch.Tensor]] | None:
    """``slots`` as runs of consecutive pool rows: per run, the slice of pool rows and the batch rows
    that hold them (a slice when they are in order, else their indices), covering every row once;
    ``None`` when a slot is named twice (the rows then go through a working copy)."""
    listed = host_values(slots).tolist()  # (the host's values: no readback per layer)
    if len(set(listed)) != len(listed):
        return None
    order = sorted(range(len(listed)), key=listed.__getitem__)
    runs: list[tuple[slice, slice | torch.Tensor]] = []
    start = 0
    for j in range(1, len(order) + 1):
        if j == len(order) or listed[order[j]] != listed[order[j - 1]] + 1:
            rows = order[start:j]
            at: slice | torch.Tensor = (slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1))
                                        else torch.tensor(rows, dtype=torch.int64, device=slots.device))
            runs.append((slice(listed[rows[0]], listed[rows[-1]] + 1), at))
            start = j
    return runs


def _advance_in_blocks(state: torch.Tensor, slots: torch.Tensor, terms: _SsmTerms) -> torch.Tensor:
    """``_SsmTerms.step`` of every row from ``state[slots]``, written back there: ``y [rows, H, P]``
    (float32, before ``D`` and the gate).

    The rows' states are advanced a block of heads at a time (``STATE_BLOCK_BYTES``), each block read
    from the pool, advanced and written back while it is in the CPU's caches, so the pool's state
    memory is read once and written once per step. A float32 pool is advanced in place, each run of
    consecutive slots through a view of its rows (in whatever order the batch names them); another
    dtype, or a slot named twice, is gathered a block at a time into a working copy and scattered
    back. Every element gets the same ops, in the same order and dtype,
    as ``step`` gives it (products and sums are exact in any layout, and the ``d_state`` reduction
    runs over a contiguous last axis either way), so the bits are ``step``'s."""
    live, heads, head_dim, d_state = slots.shape[0], *state.shape[1:]
    per_head = live * head_dim * d_state * 4
    block = max(1, min(heads, STATE_BLOCK_BYTES // per_head))
    runs = _slot_runs(slots) if state.dtype == torch.float32 else None
    y = torch.empty((live, heads, head_dim), dtype=torch.float32, device=state.device)
    for h0 in range(0, heads, block):
        h = slice(h0, min(heads, h0 + block))
        if runs is not None:
            for span, rows in runs:  # each run of consecutive slots advanced in place, through a view of its rows
                s = state[span, h]
                s.mul_(terms.decay[rows, h]).add_(terms.dt_x[rows, h] * terms.B[rows, h])
                if isinstance(rows, slice):
                    torch.sum(s * terms.C[rows, h], dim=-1, out=y[rows, h])
                else:
                    y[rows, h] = torch.sum(s * terms.C[rows, h], dim=-1)
            continue
        with STATE:
            s = state[slots, h].float()
        s.mul_(terms.decay[:, h]).add_(terms.dt_x[:, h] * terms.B[:, h])
        torch.sum(s * terms.C[:, h], dim=-1, out=y[:, h])
        with STATE:
            state[:, h].index_copy_(0, slots, s.to(state.dtype))
    if terms.D_x is not None:
        y = y + terms.D_x
    if terms.gate is not None:
        y = y * terms.gate
    return y


def selective_state_verify(
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
    """Verify over ``x [batch, T, H, P]`` (``dt [batch, T, H]``, ``B, C [batch, T, G, N]``): one
    batched step per position; the pool is read, never written. Returns
    ``(y [batch, T, H, P], states [batch, T, H, P, N])``."""
    batch, T = x.shape[:2]
    rows, slots = _live_rows(slot_idx)
    if T == 0 or slots.numel() == 0:
        return torch.zeros_like(x), torch.zeros((batch, T, *state.shape[1:]), dtype=state.dtype, device=x.device)
    terms = _SsmTerms(x, dt, A, B, C, D, z, dt_bias, dt_softplus, row_dims=2).take(rows)
    live = slots.shape[0]
    ys = torch.empty((live, T, *x.shape[2:]), dtype=x.dtype, device=x.device)
    states = torch.empty((live, T, *state.shape[1:]), dtype=state.dtype, device=x.device)
    s = state[slots]
    for t in range(T):
        y_t, new = terms.step(s.float(), t)
        ys[:, t] = y_t
        s = new.to(state.dtype)  # what a decode step would have stored in the pool
        states[:, t] = s
    return _spread(ys, rows, batch, x.dtype), _spread(states, rows, batch, state.dtype)


# ---------------------------------------------------------------------------------------------
# Commit after verify
# ---------------------------------------------------------------------------------------------


def commit_accepted(
    pool_state: torch.Tensor, intermediate: torch.Tensor, accept_pos: torch.Tensor, slot_idx: torch.Tensor
) -> None:
    """``pool_state[slot_idx[row]] = intermediate[row, accept_pos[row]]`` for every row with both
    non-negative, as one indexed copy.

    The accepted states are gathered with one ``index_select`` over the (batch, T) axes merged into
    one when they merge (a verify's output), which costs less than indexing the two axes."""
    batch, T = intermediate.shape[:2]
    if batch == 0 or T == 0:  # no row, or no position to accept (every accept_pos is -1)
        return
    pos, slots = accept_pos.long(), slot_idx.long()
    commits = (pos >= 0) & (slots >= 0)
    if bool(((host_values(accept_pos) >= 0) & (host_values(slot_idx) >= 0)).all()):  # the serving case: every row accepted at least its first position
        first = torch.arange(0, batch * T, T, device=pos.device)  # flat index of each row's position 0
    else:
        rows = commits.nonzero().squeeze(1)
        pos, slots, first = pos[rows], slots[rows], rows * T
    if intermediate.stride(0) == T * intermediate.stride(1):
        accepted = intermediate.flatten(0, 1).index_select(0, first + pos)
    else:
        accepted = intermediate[first // T, pos]
    pool_state.index_copy_(0, slots, accepted)
