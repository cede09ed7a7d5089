"""States at inner positions of a chunked prefill (``chunked.Capture``): the state a sequence has
after its first ``at`` tokens, taken inside the forward that runs past ``at``, equals the state a
forward that stopped at ``at`` leaves in the slot.

The conv state is a copy of inputs, so it is compared bit for bit. The SSD scan restarts the
captured sequence's chunks at ``at``, so its first ``at`` tokens go through the chunk steps of a
forward that stops there; the states agree to 1e-6 for one sequence and 1e-5 in a batch, not bit
for bit: on the CPU torch's elementwise kernels (softplus, exp) round a value differently in a
vector lane and in the scalar tail of a shorter tensor, and in a batch the batched matmuls group
other rows with it (a short batch also chunks shorter).
"""

from __future__ import annotations

import pytest
import torch

from backend import reference
from backend.kernels.chunked import Capture, causal_conv1d_prefill, ssd_prefill
from tests.helpers import SSM_D_STATE, SSM_HEAD_DIM, SSM_NHEADS, index, make_pool, randn, ssm_inputs

DIM, WIDTH = 20, 4
SEQLENS = [5, 0, 37, 1, 12, 20]
SLOTS = [2, 6, 4, -1, 1, 5]
CAPTURE = Capture(seq=(0, 2, 4, 5), at=(5, 9, 1, 16))  # at the end, mid-chunk, first token, a chunk end


def _cu(seqlens: list[int]) -> torch.Tensor:
    bounds = [0]
    for n in seqlens:
        bounds.append(bounds[-1] + n)
    return index(bounds)


def _stopped(seqlens: list[int], capture: Capture, j: int) -> tuple[list[int], list[int]]:
    """The same batch with sequence ``capture.seq[j]`` cut at its captured position, and the token
    indices of the cut batch in the packed original."""
    s, at = capture.seq[j], capture.at[j]
    lens = list(seqlens)
    lens[s] = at
    keep: list[int] = []
    start = 0
    for i, n in enumerate(seqlens):
        keep += range(start, start + lens[i])
        start += n
    return lens, keep


@pytest.mark.parametrize("chunk_size", [4, 8, 64])
def test_ssd_captured_state_is_the_state_of_a_forward_that_stopped_there(chunk_size: int) -> None:
    total = sum(SEQLENS)
    inp = ssm_inputs((total,), seed=11)
    pool = make_pool(nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE, capacity=8)
    start = pool.ssm_state(0).clone()
    out = torch.full((len(CAPTURE.seq), SSM_NHEADS, SSM_HEAD_DIM, SSM_D_STATE), float("nan"))
    state = pool.ssm_state(0)
    y = ssd_prefill(
        state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, cu_seqlens=_cu(SEQLENS), slot_idx=index(SLOTS),
        chunk_size=chunk_size, capture=CAPTURE, capture_state=out,
    )
    # the forward itself still computes the whole sequences (token-by-token reference)
    ref_state = start.clone()
    expected = reference.ssd_prefill_reference(
        ref_state, *inp[:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=True, cu_seqlens=_cu(SEQLENS), slot_idx=index(SLOTS)
    )
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)
    for j, s in enumerate(CAPTURE.seq):
        lens, keep = _stopped(SEQLENS, CAPTURE, j)
        stopped = start.clone()
        k = index(keep)
        ssd_prefill(
            stopped, inp.x[k], inp.dt[k], inp.A, inp.B[k], inp.C[k], inp.D, z=inp.z[k], dt_bias=inp.dt_bias,  # type: ignore[index]
            cu_seqlens=_cu(lens), slot_idx=index(SLOTS), chunk_size=chunk_size,
        )
        torch.testing.assert_close(out[j], stopped[SLOTS[s]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("at", [1, 5, 8, 13, 23])
def test_ssd_captured_state_of_one_sequence_at_every_kind_of_position(at: int) -> None:
    """One sequence: a capture on the first token, inside a chunk, on a chunk end, one before the end."""
    n = 24
    inp = ssm_inputs((n,), seed=12)
    pool = make_pool(nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE)
    start = pool.ssm_state(0).clone()
    out = torch.empty((1, SSM_NHEADS, SSM_HEAD_DIM, SSM_D_STATE))
    ssd_prefill(
        pool.ssm_state(0), *inp[:6], z=inp.z, dt_bias=inp.dt_bias, cu_seqlens=index([0, n]), slot_idx=index([3]),
        chunk_size=4, capture=Capture(seq=(0,), at=(at,)), capture_state=out,
    )
    stopped = start.clone()
    ssd_prefill(
        stopped, inp.x[:at], inp.dt[:at], inp.A, inp.B[:at], inp.C[:at], inp.D, z=inp.z[:at] if inp.z is not None else None,
        dt_bias=inp.dt_bias, cu_seqlens=index([0, at]), slot_idx=index([3]), chunk_size=4,
    )
    torch.testing.assert_close(out[0], stopped[3], atol=1e-6, rtol=1e-6)


def test_conv_captured_state_is_the_state_of_a_forward_that_stopped_there() -> None:
    total = sum(SEQLENS)
    pool = make_pool(conv_dim=DIM, kernel_width=WIDTH, capacity=8)
    start = pool.conv_state(1).clone()
    x, weight, bias = randn(total, DIM, seed=1), randn(DIM, WIDTH, seed=2), randn(DIM, seed=3)
    out = torch.full((len(CAPTURE.seq), DIM, WIDTH - 1), float("nan"))
    full = causal_conv1d_prefill(
        x, pool.conv_state(1), weight, bias, silu=True, cu_seqlens=_cu(SEQLENS), slot_idx=index(SLOTS),
        capture=CAPTURE, capture_state=out,
    )
    uncaptured_state = start.clone()
    plain = causal_conv1d_prefill(x, uncaptured_state, weight, bias, silu=True, cu_seqlens=_cu(SEQLENS), slot_idx=index(SLOTS))
    assert torch.equal(full, plain) and torch.equal(pool.conv_state(1), uncaptured_state)  # capturing changes nothing else
    for j, s in enumerate(CAPTURE.seq):
        lens, keep = _stopped(SEQLENS, CAPTURE, j)
        stopped = start.clone()
        causal_conv1d_prefill(x[index(keep)], stopped, weight, bias, silu=True, cu_seqlens=_cu(lens), slot_idx=index(SLOTS))
        assert torch.equal(out[j], stopped[SLOTS[s]])


@pytest.mark.parametrize(
    ("capture", "message"),
    [
        (Capture(seq=(0,), at=(0,)), "outside"),
        (Capture(seq=(0,), at=(6,)), "outside"),
        (Capture(seq=(3,), at=(1,)), "skipped"),
        (Capture(seq=(9,), at=(1,)), "out of range"),
    ],
)
def test_a_capture_outside_its_sequence_is_refused(capture: Capture, message: str) -> None:
    pool = make_pool(nheads=SSM_NHEADS, head_dim=SSM_HEAD_DIM, d_state=SSM_D_STATE, capacity=8)
    inp = ssm_inputs((sum(SEQLENS),))
    before = pool.copy_buffer()
    out = torch.zeros((1, SSM_NHEADS, SSM_HEAD_DIM, SSM_D_STATE))
    with pytest.raises(ValueError, match=message):
        ssd_prefill(pool.ssm_state(0), *inp[:6], cu_seqlens=_cu(SEQLENS), slot_idx=index(SLOTS), capture=capture, capture_state=out)
    assert torch.equal(pool.buffer, before)


def test_a_capture_twice_of_one_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="captured twice"):
        Capture(seq=(1, 1), at=(2, 3))
