"""Rows wider than one Triton program: the init-rows and commit kernels split a row into column chunks
(grid axis 0), and every real pool row spans many of them. Each row here spans two full programs and
a partial third, so a wrong chunk index (always chunk 0, an off-by-one, a wrong stride per chunk)
leaves bytes unwritten or writes them in the wrong place, and the exact comparisons below fail.
Sizes are derived from the kernels' block constants, so the rows stay multi-chunk if those change."""

from __future__ import annotations

import torch

from backend import reference
from backend.kernels import commit as commit_mod
from backend.kernels import init_rows as init_rows_mod
from backend.kernels.commit import commit_accepted
from backend.kernels.dispatch import use_triton
from backend.kernels.init_rows import init_rows
from backend.pool import MambaStatePool
from tests.helpers import DEVICE, index, make_pool, randn

INIT_WORDS_PER_PROGRAM = init_rows_mod.BLOCK * init_rows_mod.BLOCKS_PER_PROGRAM  # int64 words


def _random_bytes(shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(DEVICE)


def test_init_rows_clears_and_copies_every_chunk_of_a_wide_row() -> None:
    row_words = 2 * INIT_WORDS_PER_PROGRAM + 37  # two full programs and a partial third
    buffer = _random_bytes((6, row_words * 8), seed=21)  # int64-divisible rows: the kernel moves words
    assert use_triton(buffer)  # the kernel runs (interpreted without a GPU), not the torch reference
    before = buffer.clone()
    clear, src, dst = index([1, 4]), index([2]), index([3])
    init_rows(buffer, clear, src, dst)
    assert torch.all(buffer[1] == 0) and torch.all(buffer[4] == 0)
    assert torch.equal(buffer[3], before[2])
    for row in (0, 2, 5):  # the padding row, the source and a bystander are untouched
        assert torch.equal(buffer[row], before[row])
    expected = before.clone()
    reference.init_rows_reference(expected, clear, src, dst)
    assert torch.equal(buffer, expected)


def test_init_rows_on_a_wide_strided_row_view_leaves_the_gap_alone() -> None:
    # The pool's own layout: a row view with a stride larger than the row (the gap is not the pool's).
    row_words = INIT_WORDS_PER_PROGRAM + 5
    backing = _random_bytes((5, (row_words + 64) * 8), seed=22)
    buffer = backing[:, : row_words * 8]
    assert use_triton(buffer)
    expected = backing.clone()
    reference.init_rows_reference(expected[:, : row_words * 8], index([4]), index([1]), index([2]))
    init_rows(buffer, index([4]), index([1]), index([2]))
    assert torch.equal(backing, expected)


def _wide_state_pool(seed: int) -> MambaStatePool:
    nheads, head_dim = 4, 8
    d_state = 2 * commit_mod.BLOCK // (nheads * head_dim) + 5  # SSM state: 2 blocks + 160 elements
    conv_dim = (2 * commit_mod.BLOCK) // 3 + 67  # conv state [conv_dim, 3]: 2 blocks + 201 elements
    return make_pool(capacity=5, conv_dim=conv_dim, kernel_width=4, nheads=nheads, head_dim=head_dim, d_state=d_state, layers=1, seed=seed)


def test_commit_writes_every_chunk_of_a_wide_state() -> None:
    pool = _wide_state_pool(seed=23)
    T = 3
    accept, slots = index([2, -1, 0, 1, 1]), index([3, 1, 5, 2, -1])  # a rejected row and a padding row
    for name, state in (("conv", pool.conv_state(0)), ("ssm", pool.ssm_state(0))):
        numel = state[0].numel()
        assert 2 * commit_mod.BLOCK < numel < 3 * commit_mod.BLOCK, (name, numel)
        assert use_triton(state)
        inter = randn(5, T, *state.shape[1:], seed=24)
        before = pool.copy_buffer()
        expected = state.clone()
        reference.commit_reference(expected, inter, accept, slots)
        commit_accepted(state, inter, accept, slots)
        assert torch.equal(state[3], inter[0, 2]), name
        assert torch.equal(state[5], inter[2, 0]), name
        assert torch.equal(state[2], inter[3, 1]), name
        assert torch.equal(state, expected), name
        # rows 0 (padding), 1 (accept -1) and 4 (no committing row) keep every byte
        for row in (0, 1, 4):
            assert torch.equal(pool.buffer[row], before[row]), (name, row)
