"""Launch wrapper of the commit after speculative verify.

``commit_accepted(pool_state, intermediate, accept_pos, slot_idx)`` writes, per row,
``intermediate[row, accept_pos[row]]`` into ``pool_state[slot_idx[row]]``: the state after the last
accepted token becomes the committed state. One generic kernel serves conv and SSM states (a state
is a run of contiguous elements in both tensors).

Invariants checked before any launch (``ValueError``): ``intermediate`` is ``[batch, T, *S]`` with
contiguous states, ``pool_state`` is ``[num_slots, *S]`` with each slot's state contiguous (true of
``MambaStatePool`` views), same dtype and device; ``accept_pos`` and ``slot_idx`` are 1-D
int64/int32 of length batch; ``accept_pos`` in ``[-1, T - 1]``; slots -1 or in ``[0, num_slots)``
and not repeated among committing rows. A row with ``accept_pos == -1`` or ``slot == -1`` commits
nothing.
"""

from __future__ import annotations

from collections import Counter

import torch

from backend.kernels import checks, torch_paths
from backend.kernels.checks import require
from backend.kernels.dispatch import jit_module, use_triton
from backend.readback import host_values

__all__ = ["commit_accepted", "committing_rows"]

BLOCK = 2048


def _states_contiguous(t: torch.Tensor, lead: int) -> bool:
    """True when the dims after the first ``lead`` ones are laid out densely in row-major order."""
    expected = 1
    for size, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def validate_commit(
    pool_state: torch.Tensor, intermediate: torch.Tensor, accept_pos: torch.Tensor, slot_idx: torch.Tensor
) -> None:
    """The module's invariants for one commit (``ValueError`` naming the argument), checked before any
    launch."""
    device = pool_state.device
    require(intermediate.dim() >= 2, f"intermediate must be [batch, T, ...], got {tuple(intermediate.shape)}")
    batch, T = intermediate.shape[:2]
    require(
        tuple(intermediate.shape[2:]) == tuple(pool_state.shape[1:]),
        f"intermediate states {tuple(intermediate.shape[2:])} do not match pool states {tuple(pool_state.shape[1:])}",
    )
    require(intermediate.dtype == pool_state.dtype, f"dtype mismatch: {intermediate.dtype} vs pool {pool_state.dtype}")
    require(intermediate.device == device, f"intermediate is on {intermediate.device}, the pool on {device}")
    require(_states_contiguous(intermediate, 2), "intermediate states must be contiguous")
    require(_states_contiguous(pool_state, 1), "each pool slot's state must be contiguous")
    committing_rows(pool_state, batch, T, accept_pos, slot_idx)


def committing_rows(pool_state: torch.Tensor, batch: int, T: int, accept_pos: torch.Tensor, slot_idx: torch.Tensor) -> list[int]:
    """The rows of a commit over ``batch`` rows of ``T`` positions that write a slot (both their
    accepted position and their slot non-negative), after checking ``accept_pos`` (in ``[-1, T - 1]``)
    and ``slot_idx`` (-1 or a slot of ``pool_state``, none written twice) (``ValueError``)."""
    device = pool_state.device
    checks.check_index("accept_pos", accept_pos, length=batch, device=device)
    checks.check_index("slot_idx", slot_idx, length=batch, device=device)
    positions = host_values(accept_pos).tolist()  # (staged by the commit's caller: the host's values, no readback)
    slots = host_values(slot_idx).tolist()
    bad = [p for p in positions if not -1 <= p < T]
    require(not bad, f"accept_pos out of range [-1, {T - 1}]: {bad[:8]}")
    bad = [s for s in slots if not (s == -1 or 0 <= s < pool_state.shape[0])]
    require(not bad, f"slot_idx has slots out of range [0, {pool_state.shape[0] - 1}] (or -1): {bad[:8]}")
    rows = [i for i, (s, p) in enumerate(zip(slots, positions, strict=True)) if s >= 0 and p >= 0]
    dupes = sorted(s for s, n in Counter(slots[i] for i in rows).items() if n > 1)
    require(not dupes, f"slot_idx commits into slots {dupes[:8]} more than once")
    return rows


def commit_accepted(
    pool_state: torch.Tensor, intermediate: torch.Tensor, accept_pos: torch.Tensor, slot_idx: torch.Tensor
) -> None:
    """Scatter each row's accepted-position state from ``intermediate`` into its pool slot."""
    validate_commit(pool_state, intermediate, accept_pos, slot_idx)
    if not use_triton(pool_state):
        torch_paths.commit_accepted(pool_state, intermediate, accept_pos, slot_idx)
        return
    batch, T = intermediate.shape[:2]
    row_numel = intermediate[0, 0].numel() if batch and T else 0
    if batch == 0 or row_numel == 0:
        return
    grid = ((row_numel + BLOCK - 1) // BLOCK, batch)
    jit_module("commit").commit_kernel[grid](
        intermediate,
        pool_state,
        accept_pos,
        slot_idx,
        row_numel,
        intermediate.stride(0),
        intermediate.stride(1),
        pool_state.stride(0),
        BLOCK=BLOCK,
    )
