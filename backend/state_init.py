"""Applying one-shot ops (``ir.init.Op``) to one slot-major pool.

``apply_op`` is the only function that writes one-shot ops into a pool, and the executor calls it
only on tickets the ledger let it claim. It validates every slot the op names (``ir.init.op_slots``:
what its kind declares it reads and writes) against the pool before touching a byte
(``PlanExecutionError``), then applies the op with the one function of its kind (the ``match`` in
``apply_op``: mypy points at it when a kind is added). An op whose application fails midway
restores the rows it declares it writes (``ir.init.op_writes``), so it is applied whole or not at
all; the executor returns the ticket to outstanding in that case.

- ``MambaInit``: clears, then copy-on-writes, in one fused launch through
  ``backend.kernels.init_rows`` (the Triton kernel when the pool is on a GPU or under
  ``TRITON_INTERPRET=1``, the torch reference otherwise: one indexed fill and one indexed copy over
  whole rows). Copies read their sources as they were before the launch; the IR guarantees a source
  is never cleared or written in the same forward.
- ``MambaSnapshot``: each source row into its cache row, one launch of the same kernel, copies only;
  an entry taken inside its request's chunk (``at`` below its ``extend_len``) copies the state the
  forward captured there instead (``backend.staging.Captures``: a row of a capture pool, moved by
  ``copy_rows``, the same kernel between two buffers).

``apply_counts_op`` applies the same op to an executor's token counts (``backend.counts``: the
penalties' per-slot state, which starts as the slot's Mamba state does, on the same ticket): a clear
zeroes the rows, a copy (COW or snapshot) copies them. It runs before ``apply_op`` on the same claimed
ticket; both are idempotent for a given op (clears and copies whose sources the op never writes), so
when ``apply_op`` fails and the ticket goes back to outstanding, applying both again later is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import assert_never

import numpy as np
import torch

from backend import faults
from backend.counts import TokenCounts
from backend.kernels.init_rows import copy_rows, init_rows
from backend.pool import MambaStatePool
from backend.readback import staged
from backend.staging import Captures
from ir.errors import PlanExecutionError
from ir.init import MambaInit, MambaSnapshot, Op, op_decl, op_groups, op_writes

__all__ = ["apply_counts_op", "apply_op", "check_fits", "restoring"]


def check_fits(pool: MambaStatePool, op: Op) -> None:
    """Every slot ``op`` names is in range of ``pool`` (``PlanExecutionError`` naming the first
    one that is not, by its declared label: ``init #5: cow src slot 9 out of range``)."""
    for g in op_groups(op):
        for s in g.slots:
            if not 1 <= s <= pool.capacity:
                raise PlanExecutionError(
                    f"{op_decl(op).name} #{op.serial}: {g.label} slot {s} out of range [1, {pool.capacity}] of pool {pool.pool_id!r}"
                )


@contextmanager
def restoring(pool: MambaStatePool, slots: Iterable[int]) -> Iterator[None]:
    """Run the block; if it raises, put the rows of ``slots`` back as they were (all or nothing)."""
    idx = torch.tensor(sorted(set(int(s) for s in slots)), dtype=torch.int64, device=pool.device)
    saved = pool.buffer.index_select(0, idx) if idx.numel() else None
    try:
        yield
    except BaseException:
        if saved is not None:
            pool.buffer.index_copy_(0, idx, saved)
        raise


def apply_op(pool: MambaStatePool, op: Op, captures: Captures | None = None) -> None:
    """Apply ``op`` to ``pool`` whole or not at all (see the module). ``captures``: the states the
    forward captured inside its chunks, which the snapshot entries they name copy."""
    check_fits(pool, op)
    with restoring(pool, op_writes(op)):
        match op:
            case MambaInit():
                _apply_init(pool, op)
            case MambaSnapshot():
                _apply_snapshot(pool, op, captures)
            case _:
                assert_never(op)


def _slots(pool: MambaStatePool, slots: tuple[int, ...]) -> torch.Tensor:
    host = np.asarray(slots, dtype=np.int64)
    return staged(torch.from_numpy(host).to(pool.device), host)  # (the kernels' checks read the host's values)


def _apply_init(pool: MambaStatePool, init: MambaInit) -> None:
    """All clears and copies of ``init`` in one launch."""
    init_rows(pool.buffer, _slots(pool, init.clear_slots), _slots(pool, init.cow_src), _slots(pool, init.cow_dst))
    faults.check(faults.FaultPoint.INIT_LAUNCH)


def _apply_snapshot(pool: MambaStatePool, snap: MambaSnapshot, captures: Captures | None) -> None:
    """Each source row into its cache row (the same fused kernel, copies only); an entry taken
    inside its chunk copies the captured row instead (``copy_rows``, one more launch)."""
    inner = frozenset(captures.entries) if captures is not None else frozenset()
    whole = [j for j in range(len(snap.dst)) if j not in inner]
    init_rows(pool.buffer, _slots(pool, ()), _slots(pool, tuple(snap.src[j] for j in whole)), _slots(pool, tuple(snap.dst[j] for j in whole)))
    if captures is not None and captures.entries:
        if captures.into.layout != pool.layout:
            raise PlanExecutionError(f"snapshot #{snap.serial}: the capture pool's layout is not pool {pool.pool_id!r}'s")
        rows = tuple(range(1, len(captures.entries) + 1))
        copy_rows(pool.buffer, captures.into.buffer, _slots(pool, rows), _slots(pool, tuple(snap.dst[j] for j in captures.entries)))
    faults.check(faults.FaultPoint.SNAPSHOT)


def apply_counts_op(counts: TokenCounts, op: Op) -> None:
    """Apply ``op`` to ``counts`` as ``apply_op`` applies it to the pool (the module; its slots
    were checked against the pool, whose capacity the counts share)."""
    match op:
        case MambaInit():
            if op.clear_slots:
                counts.clear(op.clear_slots)
            if op.cow_dst:
                counts.copy(op.cow_src, op.cow_dst)
        case MambaSnapshot():
            # the counts of the request's row after this forward: its tokens up to the forward's end.
            # A snapshot inside a chunk (``at``) would need them at that position, which the counts
            # do not keep: an engine with penalties ends its chunks at snapshot points instead
            # (``compiler.engine.chunks``), and anything else is refused here.
            if op.at:
                raise PlanExecutionError(
                    f"snapshot #{op.serial} is taken inside a chunk (at {list(op.at)}), which the token counts of penalties cannot follow"
                )
            counts.copy(op.src, op.dst)
        case _:
            assert_never(op)
