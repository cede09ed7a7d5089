"""``@triton.jit`` body of the fused init-rows launch (clears + copy-on-write rows of one forward).

The buffer arrives as a 2-D tensor of words (int64 when the 256-byte pool alignment allows, which
it always does for a real pool). Grid: axis 0 = column chunk of a row, axis 1 = row op. Ops
``0 .. n_clear-1`` clear ``clear[op]``; ops ``n_clear ..`` copy row ``cow_src[i]`` of the source
buffer (the pool itself for an init; a capture pool for ``copy_rows``) to row ``cow_dst[i]``.
The wrapper guarantees no op reads or writes a row another op writes, so ops need no ordering.
Column chunks go on axis 0 because CUDA limits grid axes 1 and 2 to 65535 and a real row has
tens of thousands of chunks.
"""

from typing import no_type_check

import triton
import triton.language as tl


@triton.jit
@no_type_check  # Triton compiles (or interprets) this from source: typeguard must not rewrite it
def init_rows_kernel(
    buf_ptr,
    clear_ptr,
    src_ptr,
    dst_ptr,
    n_clear,
    row_words,
    row_stride,
    src_buf_ptr,
    src_row_stride,
    BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
):
    chunk = tl.program_id(0)
    op = tl.program_id(1)
    # int64 offsets: a pool buffer is far larger than 2**31 words.
    first = chunk.to(tl.int64) * (BLOCK * BLOCKS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK)
    if op < n_clear:
        dst = tl.load(clear_ptr + op)
        dst_row = buf_ptr + dst * row_stride
        zeros = tl.zeros([BLOCK], dtype=buf_ptr.dtype.element_ty)
        for i in tl.static_range(BLOCKS_PER_PROGRAM):
            offs = first + i * BLOCK + cols
            tl.store(dst_row + offs, zeros, mask=offs < row_words)
    else:
        src = tl.load(src_ptr + (op - n_clear))
        dst = tl.load(dst_ptr + (op - n_clear))
        src_row = src_buf_ptr + src * src_row_stride
        dst_row = buf_ptr + dst * row_stride
        for i in tl.static_range(BLOCKS_PER_PROGRAM):
            offs = first + i * BLOCK + cols
            mask = offs < row_words
            tl.store(dst_row + offs, tl.load(src_row + offs, mask=mask), mask=mask)
