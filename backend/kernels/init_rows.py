"""Launch wrapper of the fused init-rows kernel: every clear and copy-on-write of one forward.

Semantics (``backend.reference.init_rows_reference`` is the executable statement): clears first,
then copies, and every copy reads its source as it was before the launch. The IR guarantees the
sets that make that order-free (no src cleared, no src that is also a dst, no dst cleared or
repeated); this wrapper re-checks them, because the fused kernel runs all ops concurrently and
would silently race otherwise.

Invariants checked before any launch (``ValueError``):

- ``buffer`` is a 2-D ``uint8`` tensor with unit column stride (a strided row view is fine);
- index tensors are 1-D ``int64`` on the buffer's device;
- every target slot is in ``[1, num_slots - 1]``: row 0 is the padding slot, never a target;
- clears unique; copy dsts unique; no dst cleared; no src cleared; no src == dst; no src also a dst;
- ``cow_src`` and ``cow_dst`` have equal length.

``copy_rows`` moves rows of another buffer (a capture pool's: the states a forward captured inside
a chunk, ``backend.staging.Captures``) into a pool's rows with the same kernel, copies only.

Bandwidth: bytes move as the widest word (8/4/2/1 bytes) that divides the row length, the row
stride and the base address; with the pool's 256-byte alignment that is always int64, and Triton
then sees 16-byte-divisible strides and emits 128-bit accesses. Each program moves
``BLOCK * BLOCKS_PER_PROGRAM`` words (64 KiB) of one row.
"""

from __future__ import annotations

from collections import Counter

import torch

from backend import reference
from backend.kernels.checks import require
from backend.kernels.dispatch import jit_module, use_triton
from backend.readback import host_values

__all__ = ["copy_rows", "init_rows", "init_rows_torch", "validate_init_rows"]

BLOCK = 1024
BLOCKS_PER_PROGRAM = 8


def _word_view(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` reinterpreted as the widest words that keep rows addressable."""
    row_bytes = buffer.shape[1]
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if row_bytes % size == 0 and buffer.stride(0) % size == 0 and buffer.data_ptr() % size == 0:
            return buffer.view(dtype)
    return buffer


def _duplicates(values: list[int]) -> list[int]:
    return sorted(v for v, n in Counter(values).items() if n > 1)


def validate_init_rows(buffer: torch.Tensor, clear: torch.Tensor, cow_src: torch.Tensor, cow_dst: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the launch is well-formed and its ops are order-independent.
    (Each message is built only when its check fails: every prefill runs this on the host.)"""
    if buffer.dtype != torch.uint8:
        raise ValueError(f"pool buffer must be uint8, got {buffer.dtype}")
    if buffer.dim() != 2:
        raise ValueError(f"pool buffer must be 2-D [num_slots, row_bytes], got shape {tuple(buffer.shape)}")
    if buffer.stride(1) != 1:
        raise ValueError(f"pool buffer rows must be contiguous, got strides {buffer.stride()}")
    for name, t in (("clear", clear), ("cow_src", cow_src), ("cow_dst", cow_dst)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.device != buffer.device:
            raise ValueError(f"{name} is on {t.device}, the pool on {buffer.device}")
    if cow_src.shape != cow_dst.shape:
        raise ValueError(f"cow_src and cow_dst differ in length: {cow_src.shape[0]} vs {cow_dst.shape[0]}")
    num_slots = buffer.shape[0]
    clears: list[int] = host_values(clear).tolist()  # (staged: the host's values, no readback)
    srcs: list[int] = host_values(cow_src).tolist()
    dsts: list[int] = host_values(cow_dst).tolist()
    for name, values in (("clear", clears), ("cow_src", srcs), ("cow_dst", dsts)):
        if values and (min(values) < 1 or max(values) >= num_slots):
            bad = [v for v in values if not 1 <= v < num_slots]
            raise ValueError(f"{name} slots out of range [1, {num_slots - 1}]: {bad[:8]}")
    cleared, sources, targets = set(clears), set(srcs), set(dsts)
    if len(cleared) != len(clears):
        raise ValueError(f"clear repeats slots {_duplicates(clears)[:8]}")
    if len(targets) != len(dsts):
        raise ValueError(f"cow_dst repeats slots {_duplicates(dsts)[:8]}")
    if both := sorted(cleared & targets):
        raise ValueError(f"slots {both[:8]} are both cleared and a copy destination")
    if both := sorted(cleared & sources):
        raise ValueError(f"copy sources {both[:8]} are cleared in the same launch")
    if same := sorted(s for s, d in zip(srcs, dsts, strict=True) if s == d):
        raise ValueError(f"copies with src == dst: {same[:8]}")
    if chained := sorted(sources & targets):
        raise ValueError(f"copy sources {chained[:8]} are also copy destinations in the same launch")


ROW_OPS_MAX = 64
"""Up to this many ops the torch path zeroes and copies row by row (a contiguous fill or copy per
row: a few microseconds each); above it, one indexed fill and one indexed copy."""


def init_rows_torch(buffer: torch.Tensor, clear: torch.Tensor, cow_src: torch.Tensor, cow_dst: torch.Tensor) -> None:
    """``reference.init_rows_reference``'s effect without a GPU, over the widest words: the ops
    are order-independent (``validate_init_rows`` checked it), so each runs on its own. Indexed
    ops on uint8 rows cost about ten times as much as on int64 words, and for the handful of rows
    of one forward a plain fill or copy per row is cheaper still."""
    words = _word_view(buffer)
    if clear.shape[0] + cow_dst.shape[0] <= ROW_OPS_MAX:
        for row in host_values(clear).tolist():
            words[row].zero_()
        for src, dst in zip(host_values(cow_src).tolist(), host_values(cow_dst).tolist(), strict=True):
            words[dst].copy_(words[src])
        return
    reference.init_rows_reference(words, clear, cow_src, cow_dst)


def init_rows(buffer: torch.Tensor, clear: torch.Tensor, cow_src: torch.Tensor, cow_dst: torch.Tensor) -> None:
    """Zero the ``clear`` rows and copy rows ``cow_src[i]`` -> ``cow_dst[i]`` of a pool buffer, in one launch."""
    validate_init_rows(buffer, clear, cow_src, cow_dst)
    n_ops = clear.shape[0] + cow_dst.shape[0]
    if n_ops == 0 or buffer.shape[1] == 0:
        return
    if not use_triton(buffer):
        init_rows_torch(buffer, clear, cow_src, cow_dst)
        return
    words = _word_view(buffer)
    row_words = words.shape[1]
    per_program = BLOCK * BLOCKS_PER_PROGRAM
    grid = ((row_words + per_program - 1) // per_program, n_ops)
    # An empty index tensor may have a null data pointer; hand the kernel a live one instead. It is
    # never read: the op ranges that would read it are empty.
    clear_arg = clear if clear.numel() else cow_dst
    src_arg = cow_src if cow_src.numel() else clear
    dst_arg = cow_dst if cow_dst.numel() else clear
    jit_module("init_rows").init_rows_kernel[grid](
        words,
        clear_arg,
        src_arg,
        dst_arg,
        clear.shape[0],
        row_words,
        words.stride(0),
        words,
        words.stride(0),
        BLOCK=BLOCK,
        BLOCKS_PER_PROGRAM=BLOCKS_PER_PROGRAM,
    )


def copy_rows(buffer: torch.Tensor, source: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy rows ``src[i]`` of another buffer ``source`` (a capture pool's, of the same row length)
    to rows ``dst[i]`` of a pool buffer, in one launch of the same kernel (copies only). The
    buffers are distinct, so the copies are order-free whenever the targets are unique."""
    for name, b in (("pool buffer", buffer), ("source buffer", source)):
        require(b.dtype == torch.uint8 and b.dim() == 2, f"{name} must be 2-D uint8, got {b.dtype} of shape {tuple(b.shape)}")
        require(b.stride(1) == 1, f"{name} rows must be contiguous, got strides {b.stride()}")
    require(source is not buffer and source.data_ptr() != buffer.data_ptr(), "copy_rows copies between two buffers")
    require(source.shape[1] == buffer.shape[1], f"rows of {source.shape[1]} bytes copied into rows of {buffer.shape[1]}")
    for name, t in (("src", src), ("dst", dst)):
        require(t.dtype == torch.int64 and t.dim() == 1, f"{name} must be 1-D int64, got {t.dtype} of shape {tuple(t.shape)}")
        require(t.device == buffer.device and source.device == buffer.device, f"{name} and both buffers must share {buffer.device}")
    require(src.shape == dst.shape, f"src and dst differ in length: {src.shape[0]} vs {dst.shape[0]}")
    srcs, dsts = [int(v) for v in src.tolist()], [int(v) for v in dst.tolist()]
    bad = [v for v in srcs if not 1 <= v < source.shape[0]] + [v for v in dsts if not 1 <= v < buffer.shape[0]]
    require(not bad, f"copy_rows slots out of range (row 0 is padding): {bad[:8]}")
    require(not _duplicates(dsts), f"dst repeats slots {_duplicates(dsts)[:8]}")
    if not dsts or buffer.shape[1] == 0:
        return
    words, source_words = _word_view(buffer), _word_view(source)
    if words.dtype != source_words.dtype:  # (pool rows are 256-byte aligned: never in practice)
        words, source_words = buffer, source
    if not use_triton(buffer):
        if len(dsts) <= ROW_OPS_MAX:
            for s, d in zip(srcs, dsts, strict=True):
                words[d].copy_(source_words[s])
        else:
            words[dst] = source_words[src]
        return
    row_words = words.shape[1]
    per_program = BLOCK * BLOCKS_PER_PROGRAM
    grid = ((row_words + per_program - 1) // per_program, len(dsts))
    jit_module("init_rows").init_rows_kernel[grid](
        words,
        dst,  # never read: there are no clears
        src,
        dst,
        0,
        row_words,
        words.stride(0),
        source_words,
        source_words.stride(0),
        BLOCK=BLOCK,
        BLOCKS_PER_PROGRAM=BLOCKS_PER_PROGRAM,
    )
