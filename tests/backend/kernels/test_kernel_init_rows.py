"""init_rows: the fused clear + copy-on-write launch over a slot-major pool buffer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend import reference
from backend.kernels.dispatch import use_triton
from backend.kernels.init_rows import ROW_OPS_MAX, copy_rows, init_rows, init_rows_torch
from tests.helpers import DEVICE, index, make_pool


def _random_bytes(shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(DEVICE)


def test_triton_path_is_taken() -> None:
    assert use_triton(torch.empty(1, device=DEVICE))


def test_matches_reference_on_pool_buffer() -> None:
    pool = make_pool(capacity=8)
    expected = pool.copy_buffer()
    clear, src, dst = index([2, 7]), index([1, 3]), index([4, 8])
    init_rows(pool.buffer, clear, src, dst)
    reference.init_rows_reference(expected, clear, src, dst)
    assert torch.equal(pool.buffer, expected)
    assert torch.all(pool.buffer[2] == 0) and torch.all(pool.buffer[7] == 0)
    assert torch.equal(pool.buffer[4], pool.buffer[1])


def test_strided_buffer_view_leaves_gap_bytes_alone() -> None:
    # Row stride 1280 bytes, row length 1024: the 256 bytes after each row are not the pool's.
    backing = _random_bytes((6, 1280), seed=1)
    before = backing.clone()
    buffer = backing[:, :1024]
    assert buffer.stride(0) != buffer.shape[1]
    init_rows(buffer, index([5]), index([1, 2]), index([3, 4]))
    reference.init_rows_reference(before[:, :1024], index([5]), index([1, 2]), index([3, 4]))
    assert torch.equal(backing, before)


def test_odd_row_length_uses_narrow_words() -> None:
    buffer = _random_bytes((4, 37), seed=2)
    expected = buffer.clone()
    init_rows(buffer, index([1]), index([2]), index([3]))
    reference.init_rows_reference(expected, index([1]), index([2]), index([3]))
    assert torch.equal(buffer, expected)


def test_no_ops_is_a_no_op() -> None:
    buffer = _random_bytes((4, 256), seed=3)
    before = buffer.clone()
    init_rows(buffer, index([]), index([]), index([]))
    assert torch.equal(buffer, before)


def test_layer_major_baseline_agrees_with_slot_major() -> None:
    pool = make_pool(capacity=6, layers=2)
    layers = range(len(pool.layout.layers))
    conv = torch.stack([pool.conv_state(layer) for layer in layers])  # [L, slots, ...] copies
    ssm = torch.stack([pool.ssm_state(layer) for layer in layers])
    clear, src, dst = index([1, 6]), index([2]), index([5])
    init_rows(pool.buffer, clear, src, dst)
    reference.init_rows_layer_major([conv, ssm], clear, src, dst)
    for layer in layers:
        assert torch.equal(pool.conv_state(layer), conv[layer])
        assert torch.equal(pool.ssm_state(layer), ssm[layer])


@st.composite
def _init_ops(draw: st.DrawFn) -> tuple[int, list[int], list[int], list[int]]:
    num_slots = draw(st.integers(min_value=2, max_value=12))
    slots = draw(st.permutations(list(range(1, num_slots))))
    n_clear = draw(st.integers(min_value=0, max_value=len(slots)))
    n_copy = draw(st.integers(min_value=0, max_value=(len(slots) - n_clear) // 2))
    clear = slots[:n_clear]
    dst = slots[n_clear : n_clear + n_copy]
    # Sources: any slot that is neither cleared nor a destination (0 excluded; repeats allowed).
    free = [s for s in range(1, num_slots) if s not in clear and s not in dst]
    src = [draw(st.sampled_from(free)) for _ in dst] if free else []
    return num_slots, clear, src[: len(dst)], dst[: len(src)]


@settings(max_examples=40, deadline=None)
@given(ops=_init_ops(), row_words=st.sampled_from([64, 96, 2050]), seed=st.integers(0, 2**16))
def test_property_cleared_zero_copied_equal_others_untouched(
    ops: tuple[int, list[int], list[int], list[int]], row_words: int, seed: int
) -> None:
    num_slots, clear, src, dst = ops
    buffer = _random_bytes((num_slots, row_words * 4), seed=seed)
    before = buffer.clone()
    init_rows(buffer, index(clear), index(src), index(dst))
    for s in clear:
        assert torch.all(buffer[s] == 0)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(buffer[d], before[s])
    touched = set(clear) | set(dst)
    for row in range(num_slots):
        if row not in touched:
            assert torch.equal(buffer[row], before[row])


@pytest.mark.parametrize(
    ("clear", "src", "dst", "message"),
    [
        ([0], [], [], "out of range"),
        ([6], [], [], "out of range"),
        ([], [1], [0], "out of range"),
        ([], [-1], [2], "out of range"),
        ([1, 1], [], [], "clear repeats"),
        ([], [1, 2], [3, 3], "cow_dst repeats"),
        ([3], [1], [3], "both cleared and a copy destination"),
        ([1], [1], [3], "cleared in the same launch"),
        ([], [2], [2], "src == dst"),
        ([], [1, 2], [2, 3], "also copy destinations"),
        ([], [1, 2], [3], "differ in length"),
    ],
)
def test_bad_ops_raise_before_launch(clear: list[int], src: list[int], dst: list[int], message: str) -> None:
    buffer = _random_bytes((6, 256), seed=4)
    before = buffer.clone()
    with pytest.raises(ValueError, match=message):
        init_rows(buffer, index(clear), index(src), index(dst))
    assert torch.equal(buffer, before)


def test_bad_tensors_raise_before_launch() -> None:
    buffer = _random_bytes((6, 256), seed=5)
    before = buffer.clone()
    ok = index([1])
    with pytest.raises(ValueError, match="int64"):
        init_rows(buffer, index([1], torch.int32), index([]), index([]))
    with pytest.raises(ValueError, match="uint8"):
        init_rows(buffer.view(torch.int32), ok, index([]), index([]))
    with pytest.raises(ValueError, match="2-D"):
        init_rows(buffer.view(-1), ok, index([]), index([]))
    with pytest.raises(ValueError, match="1-D"):
        init_rows(buffer, index([[1]]), index([]), index([]))
    with pytest.raises(ValueError, match="contiguous"):
        init_rows(buffer[:, ::2], ok, index([]), index([]))
    with pytest.raises(ValueError, match="is on"):
        init_rows(buffer, torch.tensor([1], device="meta"), index([]), index([]))
    assert torch.equal(buffer, before)


@pytest.mark.parametrize("row_bytes", [4096, 4099])
@pytest.mark.parametrize("ops", [3, ROW_OPS_MAX, ROW_OPS_MAX + 1, 3 * ROW_OPS_MAX])
def test_the_row_by_row_and_the_indexed_paths_both_equal_the_reference(ops: int, row_bytes: int) -> None:
    """The path ``init_rows`` takes without a GPU or Triton's interpreter: a few ops run row by row
    and many as indexed ops over words; both, on rows of whole and of odd words, leave the buffer
    exactly as the reference does."""
    n_clear, n_copy = ops // 2, ops - ops // 2
    num_slots = 1 + n_clear + 2 * n_copy + 3
    perm = (torch.randperm(num_slots - 1, generator=torch.Generator().manual_seed(ops)) + 1).tolist()
    clear, src, dst = perm[:n_clear], perm[n_clear : n_clear + n_copy], perm[n_clear + n_copy : n_clear + 2 * n_copy]
    buffer = _random_bytes((num_slots, row_bytes), seed=ops + row_bytes)
    expected = buffer.clone()
    init_rows_torch(buffer, index(clear), index(src), index(dst))
    reference.init_rows_reference(expected, index(clear), index(src), index(dst))
    assert torch.equal(buffer, expected)


@pytest.mark.parametrize("triton_path", [True, False])
def test_copy_rows_moves_rows_of_another_buffer(triton_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture pool's rows into a pool's rows: the Triton kernel and the torch path alike; the
    source and every other row of the pool keep their bytes."""
    if not triton_path:
        monkeypatch.delenv("BATCHC_TRITON_ON_CPU", raising=False)
    pool, capture = make_pool(capacity=8, seed=1), make_pool(capacity=3, seed=2)
    assert use_triton(pool.buffer) == (triton_path or pool.buffer.is_cuda)
    before, source = pool.copy_buffer(), capture.copy_buffer()
    copy_rows(pool.buffer, capture.buffer, index([2, 1]), index([5, 7]))
    expected = before.clone()
    expected[5], expected[7] = source[2], source[1]
    assert torch.equal(pool.buffer, expected)
    assert torch.equal(capture.buffer, source)


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [([1], [9], "out of range"), ([0], [2], "out of range"), ([1, 2], [3, 3], "repeats"), ([1], [2, 3], "differ in length")],
)
def test_copy_rows_refuses_a_bad_launch(src: list[int], dst: list[int], message: str) -> None:
    pool, capture = make_pool(capacity=8, seed=1), make_pool(capacity=3, seed=2)
    before = pool.copy_buffer()
    with pytest.raises(ValueError, match=message):
        copy_rows(pool.buffer, capture.buffer, index(src), index(dst))
    assert torch.equal(pool.buffer, before)
