"""Verify without a state per position: the SSM part of a verify window, kept as its factors.

``selective_state_verify`` (``backend.kernels.ssm``) writes the state after every position of the
window, ``[batch, T, nheads, head_dim, d_state]``, and the commit copies one of them into the pool.
On a CPU that is ``T`` states' worth of memory traffic per row and layer, several passes each (the
recurrence step by step), for one state kept. Mamba2's state is linear in its inputs, so a window's
outputs and any one position's state follow in closed form from the committed state and per-token
factors (the chunked scan's own algebra, for one chunk):

    L[t]   = sum_{i <= t} dt[i] * A                       (per head, cumulative)
    s[t]   = exp(L[t]) * s0 + sum_{i <= t} exp(L[t] - L[i]) * (dt[i] x[i]) B[i]^T
    y[t]   = C[t] . s[t] + D x[t], gated by silu(z[t])
           = exp(L[t]) (C[t] . s0) + sum_{i <= t} exp(L[t] - L[i]) (C[t] . B[i]) dt[i] x[i] + ...

``selective_state_verify_window`` computes ``y`` that way (the committed state is read once) and
returns an ``SsmWindow``: the committed state and the factors, ``O(T)`` numbers per head besides the
state. ``commit_window`` computes the state at each row's accepted position only and writes it.

Against the step-by-step verify (and ``T`` decode steps) the results agree to float32 rounding, not
bit for bit: the closed form sums in another order and rounds the state to the pool's dtype once,
at the commit, where the steps round it after every position. The model's verify uses this form
where the torch path runs (``backend.hybrid.model``); the Triton kernels keep per-position states.
Inputs are validated by the same checks as ``selective_state_verify``; padding rows (slot -1) read
a zero state and give zero outputs; ``commit_window`` checks the commit's arguments like
``commit_accepted``.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from backend.kernels.checks import require
from backend.kernels.commit import commit_accepted, committing_rows
from backend.readback import host_values

__all__ = ["SsmWindow", "commit_states", "commit_window", "selective_state_verify_window"]


@attrs.frozen(eq=False)
class SsmWindow:
    """A verify window's SSM states, as factors (see the module); ``float32`` throughout."""

    start: torch.Tensor
    """``[batch, nheads, head_dim, d_state]``: each row's committed state (zeros for a padding row)."""
    log_decay: torch.Tensor
    """``[batch, nheads, T]``: ``L``, the cumulative ``dt * A`` up to and including each position."""
    dt_x: torch.Tensor
    """``[batch, nheads, T, head_dim]``: ``dt * x`` at each position."""
    B: torch.Tensor
    """``[batch, nheads, T, d_state]``: ``B`` at each position, repeated to the heads of its group."""
    state_dtype: torch.dtype
    """The pool's SSM state dtype: ``state_at`` rounds to it."""

    @property
    def positions(self) -> int:
        """``T``: the window's positions per row."""
        return int(self.log_decay.shape[-1])

    def state_at(self, rows: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
        """The state after window position ``pos[j]`` of row ``rows[j]`` (``rows`` None: every row,
        in order; both int64 ``[m]``), ``[m, nheads, head_dim, d_state]`` in the pool's dtype."""
        def take(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t[rows]

        L = take(self.log_decay)  # [m, H, T]
        at = L.gather(2, pos[:, None, None].expand(-1, L.shape[1], 1))  # [m, H, 1]
        past = torch.arange(L.shape[2], device=L.device)[None, None, :] > pos[:, None, None]  # [m, 1, T]
        w = torch.exp((at - L).masked_fill_(past, float("-inf")))  # [m, H, T]: exp(L[pos] - L[i]), 0 past pos
        state = torch.baddbmm(  # exp(L[pos]) s0 + sum_i w[i] (dt x)[i] B[i]^T, one batched matmul over (row, head)
            (torch.exp(at)[..., None] * take(self.start)).flatten(0, 1),
            (w[..., None] * take(self.dt_x)).transpose(-1, -2).flatten(0, 1), take(self.B).flatten(0, 1),
        )
        return state.view(L.shape[0], *self.start.shape[1:]).to(self.state_dtype)


def selective_state_verify_window(
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
) -> tuple[torch.Tensor, SsmWindow]:
    """``selective_state_verify``'s arguments (validated by the caller) -> ``(y [batch, T, H, P],
    SsmWindow)``; the pool is only read."""
    batch, T, H, P = x.shape
    heads_per_group = H // B.shape[-2]
    slots = slot_idx.long()
    live = slots >= 0
    all_live = bool((host_values(slot_idx) >= 0).all())  # (staged slots: the host's values, no readback)
    start = state[slots.clamp(min=0)].float()  # [batch, H, P, N]
    if not all_live:
        start[~live] = 0.0
    dtf = dt.float()
    if dt_bias is not None:
        dtf = dtf + dt_bias.float()
    if dt_softplus:
        dtf = F.softplus(dtf)
    L = torch.cumsum(dtf * A.float(), dim=1).transpose(1, 2)  # [batch, H, T]
    xf = x.float()
    dt_x = (dtf[..., None] * xf).transpose(1, 2)  # [batch, H, T, P]
    Bh = B.float().repeat_interleave(heads_per_group, dim=2).transpose(1, 2)  # [batch, H, T, N]
    Ch = C.float().repeat_interleave(heads_per_group, dim=2).transpose(1, 2)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((L[..., :, None] - L[..., None, :]).masked_fill(~causal, float("-inf")))  # [batch, H, T, T]
    y = (decay * (Ch @ Bh.transpose(-1, -2))) @ dt_x + torch.exp(L)[..., None] * (Ch @ start.transpose(-1, -2))  # [batch, H, T, P]
    y = y.transpose(1, 2)  # [batch, T, H, P]
    if D is not None:
        y = y + D.float()[:, None] * xf
    if z is not None:
        y = y * F.silu(z.float())
    if not all_live:
        y[~live] = 0.0
    return y.to(x.dtype), SsmWindow(start=start, log_decay=L, dt_x=dt_x, B=Bh, state_dtype=state.dtype)


def commit_window(pool_state: torch.Tensor, window: SsmWindow, accept_pos: torch.Tensor, slot_idx: torch.Tensor) -> None:
    """``pool_state[slot_idx[row]] = `` the state after window position ``accept_pos[row]``, for every
    row with both non-negative (``commit_accepted``'s contract, from the factors)."""
    batch = int(window.start.shape[0])
    device = pool_state.device
    require(tuple(window.start.shape[1:]) == tuple(pool_state.shape[1:]),
            f"window states {tuple(window.start.shape[1:])} do not match pool states {tuple(pool_state.shape[1:])}")
    require(window.state_dtype == pool_state.dtype, f"dtype mismatch: {window.state_dtype} vs pool {pool_state.dtype}")
    require(window.start.device == device, f"the window is on {window.start.device}, the pool on {device}")
    committing = committing_rows(pool_state, batch, window.positions, accept_pos, slot_idx)
    if not committing:
        return
    if len(committing) == batch:  # the serving case: every row accepted at least its first position
        pool_state.index_copy_(0, slot_idx.long(), window.state_at(None, accept_pos.long()))
        return
    rows = torch.tensor(committing, dtype=torch.int64, device=device)
    pool_state.index_copy_(0, slot_idx.long()[rows], window.state_at(rows, accept_pos.long()[rows]))


def commit_states(pool_state: torch.Tensor, states: torch.Tensor | SsmWindow, accept_pos: torch.Tensor, slot_idx: torch.Tensor) -> None:
    """Commit a verify's kept SSM states of either form (``selective_state_verify_kept``)."""
    if isinstance(states, SsmWindow):
        commit_window(pool_state, states, accept_pos, slot_idx)
    else:
        commit_accepted(pool_state, states, accept_pos, slot_idx)
