"""Applying one ``MambaInit`` to one slot-major pool: clears, then copy-on-writes.

``apply_init`` is the only function that writes init ops into a pool, and the executor calls it
only inside ``Ledger.consuming``. It validates every slot against the pool before touching a byte
(``PlanExecutionError``), then runs one fused launch through ``backend.kernels.init_rows``: the
Triton kernel when the pool is on a GPU (or under ``TRITON_INTERPRET=1``), the torch reference
(one indexed fill and one indexed copy over whole rows) otherwise.
Copies read their sources as they were before the launch; the IR guarantees a source is never
cleared or written in the same forward.

Both ``apply_init`` and ``apply_snapshot`` restore the rows they write if they fail midway, so an
op is applied whole or not at all; the executor returns the ticket to outstanding in that case.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from backend import faults
from backend.kernels.init_rows import init_rows
from backend.pool import MambaStatePool
from ir.errors import PlanExecutionError
from ir.ids import MambaSlot
from ir.init import MambaInit, MambaSnapshot


def check_slots_fit(pool: MambaStatePool, what: str, groups: tuple[tuple[str, tuple[MambaSlot, ...]], ...]) -> None:
    for name, slots in groups:
        for s in slots:
            if not 1 <= s <= pool.capacity:
                raise PlanExecutionError(f"{what}: {name} slot {s} out of range [1, {pool.capacity}] of pool {pool.pool_id!r}")


def check_init_fits(pool: MambaStatePool, init: MambaInit) -> None:
    check_slots_fit(
        pool, f"init #{init.serial}", (("clear", init.clear_slots), ("cow src", init.cow_src), ("cow dst", init.cow_dst))
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


def apply_init(pool: MambaStatePool, init: MambaInit) -> None:
    """All clears and copies of ``init`` in one launch; if anything fails, the target rows are
    restored, so an init is either fully applied or not at all."""
    check_init_fits(pool, init)
    dev = pool.device
    clear = torch.tensor(init.clear_slots, dtype=torch.int64, device=dev)
    src = torch.tensor(init.cow_src, dtype=torch.int64, device=dev)
    dst = torch.tensor(init.cow_dst, dtype=torch.int64, device=dev)
    with restoring(pool, init.targets()):
        init_rows(pool.buffer, clear, src, dst)
        faults.check(faults.FaultPoint.INIT_LAUNCH)


def apply_snapshot(pool: MambaStatePool, snap: MambaSnapshot) -> None:
    """Copy each source row into its cache row (one launch of the same fused kernel, copies only)."""
    check_slots_fit(pool, f"snapshot #{snap.serial}", (("src", snap.src), ("dst", snap.dst)))
    dev = pool.device
    none = torch.empty(0, dtype=torch.int64, device=dev)
    src = torch.tensor(snap.src, dtype=torch.int64, device=dev)
    dst = torch.tensor(snap.dst, dtype=torch.int64, device=dev)
    with restoring(pool, snap.dst):
        init_rows(pool.buffer, none, src, dst)
        faults.check(faults.FaultPoint.SNAPSHOT)
