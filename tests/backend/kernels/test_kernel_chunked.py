"""Chunked prefill (torch): the chunked SSD scan and the conv1d prefill against token-by-token references.

Both kernels are batched over the sequences of a varlen batch (padded to the longest one), so the
cases mix long and short sequences, empty ones, skipped (slot -1) ones and unsorted slots; the pool
rows a batch does not name (and every row of the other layers) must keep their bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from backend import reference
from backend.kernels import chunked
from backend.kernels.chunked import causal_conv1d_prefill, ssd_prefill
from backend.kernels.conv import causal_conv1d_update
from backend.kernels.ssm import selective_state_update
from backend.pool import MambaStatePool
from tests.helpers import SSM_D_STATE, SSM_HEAD_DIM, SSM_NHEADS, index, make_pool, randn, ssm_inputs

DIM, WIDTH = 20, 4
SEQLENS = [5, 0, 37, 1, 12]  # a zero-length sequence, and one spanning several chunks
SLOTS = [2, 6, 4, -1, 1]


def _cu(seqlens: list[int]) -> torch.Tensor:
    bounds = [0]
    for n in seqlens:
        bounds.append(bounds[-1] + n)
    return index(bounds)


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_ssd_chunked_matches_sequential_scan(chunk_size: int) -> None:
    total = sum(SEQLENS)
    inp = ssm_inputs((total,), seed=3)
    pool = make_pool(nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE)
    state = pool.ssm_state(0)
    expected_state = state.clone()
    cu, slots = _cu(SEQLENS), index(SLOTS)
    expected = reference.ssd_prefill_reference(
        expected_state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=True, cu_seqlens=cu, slot_idx=slots
    )
    y = ssd_prefill(state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, cu_seqlens=cu, slot_idx=slots, chunk_size=chunk_size)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)
    padded = slice(sum(SEQLENS[:3]), sum(SEQLENS[:4]))
    assert torch.all(y[padded] == 0)


def test_ssd_chunked_with_a_precomputed_dt_matches_the_sequential_scan() -> None:
    """dt already ``softplus(dt + dt_bias)`` and clamped by the model: no bias, no softplus here."""
    total = sum(SEQLENS)
    inp = ssm_inputs((total,), seed=4)
    dt = torch.nn.functional.softplus(inp.dt + inp.dt_bias).clamp(min=0.5)
    pool = make_pool(nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE)
    state = pool.ssm_state(0)
    expected_state = state.clone()
    cu, slots = _cu(SEQLENS), index(SLOTS)
    expected = reference.ssd_prefill_reference(
        expected_state, inp.x, dt, *inp[2:6], z=inp.z, dt_bias=None, dt_softplus=False, cu_seqlens=cu, slot_idx=slots
    )
    y = ssd_prefill(state, inp.x, dt, *inp[2:6], z=inp.z, dt_bias=None, dt_softplus=False, cu_seqlens=cu, slot_idx=slots, chunk_size=16)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)


def test_conv_prefill_matches_reference() -> None:
    total = sum(SEQLENS)
    pool = make_pool(conv_dim=DIM, kernel_width=WIDTH)
    state = pool.conv_state(1)
    expected_state = state.clone()
    x, weight, bias = randn(total, DIM, seed=1), randn(DIM, WIDTH, seed=2), randn(DIM, seed=3)
    cu, slots = _cu(SEQLENS), index(SLOTS)
    expected = reference.causal_conv1d_prefill_reference(
        x, expected_state, weight, bias, silu=True, cu_seqlens=cu, slot_idx=slots
    )
    out = causal_conv1d_prefill(x, state, weight, bias, silu=True, cu_seqlens=cu, slot_idx=slots)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-6, rtol=1e-6)


def test_prefill_equals_decode_steps() -> None:
    """A prompt prefilled in one go leaves the state a token-by-token decode would (float32)."""
    L = 9
    inp = ssm_inputs((L,), seed=7)
    x_conv, weight, bias = randn(L, DIM, seed=8), randn(DIM, WIDTH, seed=9), randn(DIM, seed=10)
    kwargs = {"conv_dim": DIM, "kernel_width": WIDTH, "nheads": SSM_NHEADS, "head_dim": SSM_HEAD_DIM, "d_state": SSM_D_STATE}
    prefilled, decoded = make_pool(**kwargs), make_pool(**kwargs)  # type: ignore[arg-type]
    conv_out = causal_conv1d_prefill(
        x_conv, prefilled.conv_state(0), weight, bias, silu=True, cu_seqlens=index([0, L]), slot_idx=index([3])
    )
    y = ssd_prefill(
        prefilled.ssm_state(0), *inp[:6], z=inp.z, dt_bias=inp.dt_bias, cu_seqlens=index([0, L]), slot_idx=index([3]),
        chunk_size=4,
    )
    for t in range(L):
        step_conv = causal_conv1d_update(
            x_conv[t : t + 1], decoded.conv_state(0), weight, bias, silu=True, slot_idx=index([3])
        )
        step_y = selective_state_update(
            decoded.ssm_state(0), inp.x[t : t + 1], inp.dt[t : t + 1], inp.A, inp.B[t : t + 1], inp.C[t : t + 1],
            inp.D, z=inp.z[t : t + 1], dt_bias=inp.dt_bias, slot_idx=index([3]),
        )
        torch.testing.assert_close(conv_out[t], step_conv[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y[t], step_y[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prefilled.buffer.view(torch.float32), decoded.buffer.view(torch.float32), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("cu", "slots", "message"),
    [
        ([0, 6, 5], [1, 2], "non-decreasing"),
        ([0, 3], [1, 2], "entries"),
        ([1, 5], [1], "run from 0"),
        ([0, 2, 5], [1, 1], "repeats slots"),
        ([0, 5], [7], "out of range"),
    ],
)
def test_prefill_rejects_bad_varlen(cu: list[int], slots: list[int], message: str) -> None:
    pool = make_pool(nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE)
    inp = ssm_inputs((5,))
    before = pool.copy_buffer()
    with pytest.raises(ValueError, match=message):
        ssd_prefill(pool.ssm_state(0), *inp[:6], cu_seqlens=index(cu), slot_idx=index(slots))
    assert torch.equal(pool.buffer, before)


# -- batched over sequences ----------------------------------------------------------------------

CAPACITY = 10  # slots 0..10


def _mixed(chunk: int) -> tuple[list[int], list[int]]:
    """Lengths around the chunk boundaries, an empty sequence with a live slot, a skipped (-1) row
    in the middle, slots in no particular order."""
    return [chunk + 1, 1, 0, 2 * chunk + 3, chunk - 1, 3, chunk], [7, 2, 5, -1, 0, 9, 3]


def _tolerance(dtype: torch.dtype, fp32: float) -> dict[str, float]:
    """``fp32`` for float32; two units in the last place for half-precision stores, where the
    reference and the kernel may round float32 values a few float32 ulps apart to neighbours."""
    tol = fp32 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    return {"atol": tol, "rtol": tol}


def _views(pool: MambaStatePool) -> list[torch.Tensor]:
    return [pool.conv_state(0), pool.ssm_state(0), pool.conv_state(1), pool.ssm_state(1)]


def _others(pool: MambaStatePool, touched: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the pool's state views other than ``touched`` (a kernel on it must not write them)."""
    return [v.clone() for v in _views(pool) if v.data_ptr() != touched.data_ptr()]


def _assert_untouched(pool: MambaStatePool, touched: torch.Tensor, others: list[torch.Tensor]) -> None:
    rest = [v for v in _views(pool) if v.data_ptr() != touched.data_ptr()]
    assert all(torch.equal(a, b) for a, b in zip(rest, others, strict=True))


def _assert_rows(after: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, named: list[int], tol: dict[str, float]) -> None:
    """Rows ``named`` match the reference; every other row keeps its bytes."""
    others = [r for r in range(after.shape[0]) if r not in named]
    torch.testing.assert_close(after[named].float(), expected[named].float(), **tol)
    assert torch.equal(after[others], before[others])


def _live(seqlens: list[int], slots: list[int]) -> list[int]:
    """The rows a batch writes: slots of the non-empty sequences (an empty one leaves its row alone)."""
    return sorted(s for s, n in zip(slots, seqlens, strict=True) if s >= 0 and n > 0)


def _assert_skipped_rows_zero(out: torch.Tensor, seqlens: list[int], slots: list[int]) -> None:
    start = 0
    for n, slot in zip(seqlens, slots, strict=True):
        if slot < 0:
            assert torch.all(out[start : start + n] == 0)
        start += n


def _run_ssd(
    seqlens: list[int], slots: list[int], *, chunk: int, dtype: torch.dtype = torch.float32, ngroups: int = 2, seed: int = 0
) -> None:
    inp = ssm_inputs((sum(seqlens),), ngroups=ngroups, seed=seed)
    pool = make_pool(capacity=CAPACITY, nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE, ssm_dtype=dtype, seed=seed)
    state = pool.ssm_state(1)
    others = _others(pool, state)
    initial, expected_state = state.clone(), state.clone()
    cu, idx = _cu(seqlens), index(slots)
    expected = reference.ssd_prefill_reference(
        expected_state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=True, cu_seqlens=cu, slot_idx=idx
    )
    y = ssd_prefill(state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, cu_seqlens=cu, slot_idx=idx, chunk_size=chunk)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
    _assert_skipped_rows_zero(y, seqlens, slots)
    _assert_rows(state, expected_state, initial, _live(seqlens, slots), _tolerance(dtype, 1e-4))
    _assert_untouched(pool, state, others)


def _run_conv(seqlens: list[int], slots: list[int], *, dtype: torch.dtype = torch.float32, width: int = WIDTH, seed: int = 0) -> None:
    pool = make_pool(capacity=CAPACITY, conv_dim=DIM, kernel_width=width, conv_dtype=dtype, seed=seed)
    state = pool.conv_state(1)
    others = _others(pool, state)
    initial, expected_state = state.clone(), state.clone()
    total = sum(seqlens)
    x, weight, bias = randn(total, DIM, seed=seed + 1), randn(DIM, width, seed=seed + 2), randn(DIM, seed=seed + 3)
    cu, idx = _cu(seqlens), index(slots)
    expected = reference.causal_conv1d_prefill_reference(x, expected_state, weight, bias, silu=True, cu_seqlens=cu, slot_idx=idx)
    out = causal_conv1d_prefill(x, state, weight, bias, silu=True, cu_seqlens=cu, slot_idx=idx)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    _assert_skipped_rows_zero(out, seqlens, slots)
    _assert_rows(state, expected_state, initial, _live(seqlens, slots), _tolerance(dtype, 1e-6))
    _assert_untouched(pool, state, others)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("chunk", [4, 16])
def test_ssd_batched_mixed_lengths(chunk: int, ngroups: int, dtype: torch.dtype) -> None:
    _run_ssd(*_mixed(chunk), chunk=chunk, dtype=dtype, ngroups=ngroups)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_conv_batched_mixed_lengths(width: int, dtype: torch.dtype) -> None:
    _run_conv(*_mixed(8), dtype=dtype, width=width)


@pytest.mark.parametrize(
    ("seqlens", "slots"),
    [([0, 0], [3, 4]), ([2, 5], [-1, -1]), ([0, 4, 0], [-1, 6, 1]), ([6], [0])],
    ids=["all-empty", "all-skipped", "one-live", "padding-slot"],
)
def test_batched_prefill_edge_batches(seqlens: list[int], slots: list[int]) -> None:
    _run_ssd(seqlens, slots, chunk=4)
    _run_conv(seqlens, slots)


@pytest.mark.parametrize("group", ["one-row", "two-rows"])
def test_ssd_scans_in_groups_past_the_element_bound(monkeypatch: pytest.MonkeyPatch, group: str) -> None:
    """A step whose rows go in groups (one or two rows at a time) gives what one batched step gives."""
    chunk = 4
    monkeypatch.setattr(chunked, "SCAN_GROUP_ELEMENTS", 1 if group == "one-row" else 2 * chunk * chunk * SSM_NHEADS)
    _run_ssd(*_mixed(chunk), chunk=chunk, ngroups=1)


def test_batched_prefill_reads_strided_views() -> None:
    """The model passes x, B and C as column slices of one projection: the kernels give what they
    give on contiguous copies."""
    seqlens, slots = _mixed(4)
    total, ngroups = sum(seqlens), 2
    inp = ssm_inputs((total,), ngroups=ngroups, seed=5)
    wide = torch.cat([inp.x.flatten(1), inp.B.flatten(1), inp.C.flatten(1), randn(total, 3, seed=6)], dim=1)
    x = wide[:, : SSM_NHEADS * SSM_HEAD_DIM].view(total, SSM_NHEADS, SSM_HEAD_DIM)
    B = wide[:, SSM_NHEADS * SSM_HEAD_DIM :][:, : ngroups * SSM_D_STATE].view(total, ngroups, SSM_D_STATE)
    C = wide[:, SSM_NHEADS * SSM_HEAD_DIM + ngroups * SSM_D_STATE :][:, : ngroups * SSM_D_STATE].view(total, ngroups, SSM_D_STATE)
    assert not (x.is_contiguous() or B.is_contiguous() or C.is_contiguous())
    cu, idx = _cu(seqlens), index(slots)
    x_conv, weight = wide[:, 3 : 3 + DIM], randn(DIM, WIDTH, seed=7)
    results = []
    for copy in (False, True):
        view = (lambda t: t.contiguous()) if copy else (lambda t: t)
        pool = make_pool(capacity=CAPACITY, conv_dim=DIM, nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE)
        y = ssd_prefill(
            pool.ssm_state(0), view(x), inp.dt, inp.A, view(B), view(C), inp.D, z=inp.z, dt_bias=inp.dt_bias, cu_seqlens=cu,
            slot_idx=idx, chunk_size=4,
        )
        out = causal_conv1d_prefill(view(x_conv), pool.conv_state(0), weight, None, silu=False, cu_seqlens=cu, slot_idx=idx)
        results.append((y, out, pool.buffer))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


class _CountOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _count_prefill_ops(seqlens: list[int]) -> tuple[int, int]:
    """Torch calls of one conv prefill and one SSD prefill of a batch (all sequences live)."""
    inp = ssm_inputs((sum(seqlens),), seed=1)
    pool = make_pool(capacity=CAPACITY, conv_dim=DIM, nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE)
    x, weight, bias = randn(sum(seqlens), DIM, seed=2), randn(DIM, WIDTH, seed=3), randn(DIM, seed=4)
    cu, idx = _cu(seqlens), index(list(range(1, len(seqlens) + 1)))
    with _CountOps() as conv:
        causal_conv1d_prefill(x, pool.conv_state(0), weight, bias, silu=True, cu_seqlens=cu, slot_idx=idx)
    with _CountOps() as ssd:
        ssd_prefill(pool.ssm_state(0), *inp[:6], z=inp.z, dt_bias=inp.dt_bias, cu_seqlens=cu, slot_idx=idx, chunk_size=8)
    return conv.calls, ssd.calls


def test_prefill_ops_do_not_grow_with_the_number_of_sequences() -> None:
    """No loop over sequences: a batch of eight issues the torch calls a batch of one does (same
    longest sequence, so the same number of chunks)."""
    assert _count_prefill_ops([19]) == _count_prefill_ops([19, 3, 1, 8, 19, 9, 7, 12])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ngroups=st.sampled_from([1, 2]))
def test_batched_prefill_matches_reference_property(data: st.DataObject, ngroups: int) -> None:
    chunk = 4
    seqlens = data.draw(st.lists(st.integers(0, 2 * chunk + 3), min_size=1, max_size=6), label="seqlens")
    order = data.draw(st.permutations(range(CAPACITY + 1)), label="slot order")
    skipped = data.draw(st.lists(st.booleans(), min_size=len(seqlens), max_size=len(seqlens)), label="skipped")
    slots = [-1 if skip else slot for slot, skip in zip(order, skipped, strict=False)]
    _run_ssd(seqlens, slots, chunk=chunk, ngroups=ngroups, seed=len(seqlens))
    _run_conv(seqlens, slots, seed=len(seqlens))
