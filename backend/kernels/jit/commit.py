"""``@triton.jit`` body of the commit after verify: one accepted state per row, intermediate -> pool.

Generic over state kind: a state is ``row_numel`` contiguous elements in both the intermediate
buffer ``[batch, T, ...]`` and the pool view ``[num_slots, ...]``. Grid: axis 0 = column chunk,
axis 1 = batch row. Rows with ``accept_pos == -1`` or ``slot == -1`` are masked out entirely.
"""

from typing import no_type_check

import triton
import triton.language as tl


@triton.jit
@no_type_check  # Triton compiles (or interprets) this from source: typeguard must not rewrite it
def commit_kernel(
    inter_ptr,
    pool_ptr,
    pos_ptr,
    slot_ptr,
    row_numel,
    inter_b,
    inter_t,
    pool_slot,
    BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    # A skipped row gets an empty range (scalar limit: the interpreter mistypes `mask & scalar`).
    live_numel = tl.where((pos >= 0) & (slot >= 0), row_numel, 0)
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < live_numel
    v = tl.load(inter_ptr + row * inter_b + pos * inter_t + offs, mask=mask)
    tl.store(pool_ptr + slot * pool_slot + offs, v, mask=mask)
