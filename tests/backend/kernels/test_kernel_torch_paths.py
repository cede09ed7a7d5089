"""The torch path of decode, verify and commit (``backend.kernels.torch_paths``, what the wrappers run
on a CPU) against the per-row references in ``backend.reference``: equal bit for bit, in every state
dtype, and the pool rows a call does not name keep their bytes.

The kernel conftest turns the Triton interpreter on for this folder, so the wrappers would take the
Triton path here: these tests call ``torch_paths`` directly (and the wrappers with the switch off).
Everything runs on CPU tensors, the path's home, on a GPU machine too.

Batches of more than eight rows matter: torch evaluates ``exp``/``softplus``/``silu`` with SIMD code
over runs of elements and with scalar code for a run's tail, which differ in the last bit, and a
contiguous ``[rows, ...]`` tensor is one run; small per-row sizes (4 heads) make a batch of eight
or more rows cross that line.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend import reference
from backend.kernels import torch_paths
from backend.kernels.commit import commit_accepted
from backend.kernels.conv import causal_conv1d_update, causal_conv1d_verify
from backend.kernels.dispatch import CPU_KERNELS_ENV, use_triton
from backend.kernels.ssm import selective_state_update, selective_state_verify
from backend.pool import MambaStatePool
from tests.helpers import SSM_D_STATE, SSM_HEAD_DIM, SSM_NHEADS, SsmInputs, index, make_pool, randn, ssm_inputs

CPU = torch.device("cpu")
CAPACITY = 12
DIM = 20  # conv channels
T = 3
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SLOTS = {
    "padded": [5, -1, 2, 0, -1, 9],  # padding rows in the middle, slots out of order, slot 0 used
    "full": [11, 3, 0, 7, 1, 9, 4, 12, 2, 6],  # every row live, out of order, more than 8 rows
    "wide-padded": [11, 3, -1, 7, 1, 9, 4, 12, 2, -1, 6, 8],
    "all-padding": [-1, -1],
    "empty": [],
}
"""Slot lists over a pool of ``CAPACITY`` slots (plus the padding slot 0)."""


def _pool(state_dtype: torch.dtype, *, width: int = 4, seed: int = 0) -> MambaStatePool:
    return make_pool(
        capacity=CAPACITY,
        conv_dim=DIM,
        kernel_width=width,
        nheads=SSM_NHEADS,
        head_dim=SSM_HEAD_DIM,
        d_state=SSM_D_STATE,
        conv_dtype=state_dtype,
        ssm_dtype=state_dtype,
        seed=seed,
        device=CPU,
    )


def _slots(name: str) -> torch.Tensor:
    return index(SLOTS[name], device=CPU)


def _ssm(lead: tuple[int, ...], *, ngroups: int, full: bool, seed: int = 0) -> SsmInputs:
    return ssm_inputs(lead, ngroups=ngroups, full=full, seed=seed, device=CPU)


def _same(actual: torch.Tensor, expected: torch.Tensor, where: str = "") -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, where
    if actual.numel():
        difference = (actual.float() - expected.float()).abs().max().item()
        assert torch.equal(actual, expected), f"{where}: max difference {difference}"


def _untouched(after: MambaStatePool, before: torch.Tensor, slot_idx: list[int], where: str = "") -> None:
    """The rows of every slot not in ``slot_idx`` kept their bytes."""
    others = torch.ones(after.buffer.shape[0], dtype=torch.bool)
    others[[s for s in slot_idx if s >= 0]] = False
    assert torch.equal(after.buffer[others], before[others]), f"{where}: a slot not named changed"


@pytest.fixture
def two_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- SSM -----------------------------------------------------------------------------------------

GROUPS_FULL = [(1, False), (2, True), (1, True), (2, False)]


@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize(("ngroups", "full"), GROUPS_FULL)
def test_ssm_update_equals_reference(state_dtype: torch.dtype, ngroups: int, full: bool) -> None:
    for name, slot_list in SLOTS.items():
        expected_pool, pool = _pool(state_dtype), _pool(state_dtype)
        before = pool.copy_buffer()
        assert not pool.ssm_state(1).is_contiguous()
        inp = _ssm((len(slot_list),), ngroups=ngroups, full=full)
        kw = {"z": inp.z, "dt_bias": inp.dt_bias, "dt_softplus": full, "slot_idx": _slots(name)}
        expected = reference.selective_state_update_reference(expected_pool.ssm_state(1), *inp[:6], **kw)
        y = torch_paths.selective_state_update(pool.ssm_state(1), *inp[:6], **kw)
        _same(y, expected, name)
        assert torch.equal(pool.buffer, expected_pool.buffer), name
        _untouched(pool, before, slot_list, name)


@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("slot_list", [[3, 4, 5, 6, 7, 8, 9, 10, 11], [6, 5, 4, 3], [2, 9, 4, 1], [5, 6, 2, 3, 9, 1]],
                         ids=["consecutive", "descending", "scattered", "runs out of order"])
@pytest.mark.parametrize("block_bytes", [1, 1 << 20], ids=["a head a block", "one block"])
def test_ssm_update_in_place_or_in_blocks_equals_reference(
    monkeypatch: pytest.MonkeyPatch, state_dtype: torch.dtype, slot_list: list[int], block_bytes: int
) -> None:
    # a float32 pool is advanced in place (no gather, no scatter), each run of consecutive slots through
    # a view of its rows, whatever order the batch names them in; another dtype through a working
    # copy; either a block of heads at a time: every way, the reference's bits
    from backend.parts import STATE, timing_parts

    monkeypatch.setattr(torch_paths, "STATE_BLOCK_BYTES", block_bytes)
    expected_pool, pool = _pool(state_dtype), _pool(state_dtype)
    before = pool.copy_buffer()
    inp = _ssm((len(slot_list),), ngroups=2, full=True)
    kw = {"z": inp.z, "dt_bias": inp.dt_bias, "dt_softplus": True, "slot_idx": index(slot_list, device=CPU)}
    expected = reference.selective_state_update_reference(expected_pool.ssm_state(1), *inp[:6], **kw)
    with timing_parts() as clock:
        y = torch_paths.selective_state_update(pool.ssm_state(1), *inp[:6], **kw)
    _same(y, expected)
    assert torch.equal(pool.buffer, expected_pool.buffer)
    _untouched(pool, before, slot_list)
    in_place = state_dtype == torch.float32
    blocks = SSM_NHEADS if block_bytes == 1 else 1
    assert clock.calls.get(STATE.name, 0) == (0 if in_place else 2 * blocks)


@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize(("ngroups", "full"), GROUPS_FULL)
def test_ssm_verify_equals_reference_and_leaves_the_pool(state_dtype: torch.dtype, ngroups: int, full: bool) -> None:
    for name, slot_list in SLOTS.items():
        pool = _pool(state_dtype)
        before = pool.copy_buffer()
        inp = _ssm((len(slot_list), T), ngroups=ngroups, full=full, seed=3)
        kw = {"z": inp.z, "dt_bias": inp.dt_bias, "dt_softplus": full, "slot_idx": _slots(name)}
        exp_y, exp_states = reference.selective_state_verify_reference(pool.ssm_state(0), *inp[:6], **kw)
        y, states = torch_paths.selective_state_verify(pool.ssm_state(0), *inp[:6], **kw)
        _same(y, exp_y, name)
        _same(states, exp_states, name)
        assert torch.equal(pool.buffer, before), name


def test_ssm_inputs_in_the_model_layout_equal_reference() -> None:
    # The hybrid model passes x, B, C and z as views of wider projections (rows with a gap after them).
    batch, nheads, head_dim, d_state = 10, SSM_NHEADS, SSM_HEAD_DIM, SSM_D_STATE
    width = 2 * nheads * head_dim + 2 * d_state + 5
    proj = randn(batch, T, width, seed=7, device=CPU)
    x = proj[..., : nheads * head_dim].reshape(batch, T, nheads, head_dim)
    z = proj[..., nheads * head_dim : 2 * nheads * head_dim].reshape(batch, T, nheads, head_dim)
    B = proj[..., 2 * nheads * head_dim : 2 * nheads * head_dim + d_state].reshape(batch, T, 1, d_state)
    C = proj[..., 2 * nheads * head_dim + d_state : -5].reshape(batch, T, 1, d_state)
    inp = _ssm((batch, T), ngroups=1, full=True, seed=8)
    slots = index([4, 1, 9, -1, 3, 11, 2, 7, 5, 6], device=CPU)
    pool = _pool(torch.float32)
    args = (x, inp.dt, inp.A, B, C, inp.D)
    kw = {"z": z, "dt_bias": inp.dt_bias, "dt_softplus": True, "slot_idx": slots}
    for got, want in zip(
        torch_paths.selective_state_verify(pool.ssm_state(0), *args, **kw),
        reference.selective_state_verify_reference(pool.ssm_state(0), *args, **kw),
        strict=True,
    ):
        _same(got, want)
    step = (x[:, 0], inp.dt[:, 0], inp.A, B[:, 0], C[:, 0], inp.D)
    kw = {**kw, "z": z[:, 0]}
    expected_pool = _pool(torch.float32)
    _same(
        torch_paths.selective_state_update(pool.ssm_state(0), *step, **kw),
        reference.selective_state_update_reference(expected_pool.ssm_state(0), *step, **kw),
    )
    assert torch.equal(pool.buffer, expected_pool.buffer)


# -- conv ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize(("silu", "with_bias"), [(True, True), (False, False), (True, False)])
def test_conv_update_equals_reference(width: int, state_dtype: torch.dtype, silu: bool, with_bias: bool) -> None:
    for name, slot_list in SLOTS.items():
        expected_pool, pool = _pool(state_dtype, width=width), _pool(state_dtype, width=width)
        before = pool.copy_buffer()
        x, weight = randn(len(slot_list), DIM, seed=1, device=CPU), randn(DIM, width, seed=2, device=CPU)
        bias = randn(DIM, seed=3, device=CPU) if with_bias else None
        kw = {"silu": silu, "slot_idx": _slots(name)}
        expected = reference.causal_conv1d_update_reference(x, expected_pool.conv_state(1), weight, bias, **kw)
        out = torch_paths.causal_conv1d_update(x, pool.conv_state(1), weight, bias, **kw)
        _same(out, expected, name)
        assert torch.equal(pool.buffer, expected_pool.buffer), name
        _untouched(pool, before, slot_list, name)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize(("silu", "with_bias"), [(True, True), (False, False)])
def test_conv_verify_equals_reference_and_leaves_the_pool(width: int, state_dtype: torch.dtype, silu: bool, with_bias: bool) -> None:
    for name, slot_list in SLOTS.items():
        pool = _pool(state_dtype, width=width)
        before = pool.copy_buffer()
        x, weight = randn(len(slot_list), T, DIM, seed=4, device=CPU), randn(DIM, width, seed=5, device=CPU)
        bias = randn(DIM, seed=6, device=CPU) if with_bias else None
        kw = {"silu": silu, "slot_idx": _slots(name)}
        exp_out, exp_states = reference.causal_conv1d_verify_reference(x, pool.conv_state(0), weight, bias, **kw)
        out, states = torch_paths.causal_conv1d_verify(x, pool.conv_state(0), weight, bias, **kw)
        _same(out, exp_out, name)
        _same(states, exp_states, name)
        assert states.is_contiguous(), name  # commit requires contiguous intermediate states
        assert torch.equal(pool.buffer, before), name


def test_conv_verify_of_one_position_and_of_low_precision_inputs_equals_reference() -> None:
    pool = _pool(torch.bfloat16)
    slots = _slots("wide-padded")
    weight, bias = randn(DIM, 4, seed=5, device=CPU), randn(DIM, seed=6, device=CPU)
    for x in (randn(len(SLOTS["wide-padded"]), 1, DIM, seed=4, device=CPU),
              randn(len(SLOTS["wide-padded"]), T, DIM, seed=4, dtype=torch.float16, device=CPU)):
        for got, want in zip(
            torch_paths.causal_conv1d_verify(x, pool.conv_state(0), weight, bias, silu=True, slot_idx=slots),
            reference.causal_conv1d_verify_reference(x, pool.conv_state(0), weight, bias, silu=True, slot_idx=slots),
            strict=True,
        ):
            _same(got, want)


# -- commit --------------------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize(
    ("accept", "slots"),
    [
        ([2, -1, 0, 1, 2, 0], [5, 3, -1, 11, 0, 8]),  # a rejected row, a padding row, slot 0, out of order
        ([0, 1, 2, 1, 0, 2, 1, 0, 2, 1], SLOTS["full"]),
        ([-1, 1, -1], [4, 4, 6]),  # a slot named twice, committed once
        ([-1, -1], [1, 2]),
        ([], []),
    ],
)
@pytest.mark.parametrize("position_major", [False, True])
def test_commit_equals_reference(state_dtype: torch.dtype, accept: list[int], slots: list[int], position_major: bool) -> None:
    expected_pool, pool = _pool(state_dtype), _pool(state_dtype)
    before = pool.copy_buffer()
    batch = len(slots)

    def intermediate(*state: int, seed: int) -> torch.Tensor:
        # a verify's layout, or [T, batch] transposed (each state still contiguous, the two axes not mergeable)
        if position_major:
            return randn(T, batch, *state, seed=seed, dtype=state_dtype, device=CPU).transpose(0, 1)
        return randn(batch, T, *state, seed=seed, dtype=state_dtype, device=CPU)

    conv_inter = intermediate(DIM, 3, seed=9)
    ssm_inter = intermediate(SSM_NHEADS, SSM_HEAD_DIM, SSM_D_STATE, seed=10)
    a, s = index(accept, device=CPU), index(slots, dtype=torch.int32, device=CPU)
    for layer in (0, 1):
        reference.commit_reference(expected_pool.conv_state(layer), conv_inter, a, s)
        reference.commit_reference(expected_pool.ssm_state(layer), ssm_inter, a, s)
        torch_paths.commit_accepted(pool.conv_state(layer), conv_inter, a, s)
        torch_paths.commit_accepted(pool.ssm_state(layer), ssm_inter, a, s)
    assert torch.equal(pool.buffer, expected_pool.buffer)
    _untouched(pool, before, [sl for sl, p in zip(slots, accept, strict=True) if p >= 0])


def test_commit_of_a_verify_without_positions_is_a_no_op() -> None:
    pool = _pool(torch.float32)
    before = pool.copy_buffer()
    for batch in (0, 2):
        inter = randn(batch, 0, DIM, 3, seed=1, device=CPU)
        torch_paths.commit_accepted(pool.conv_state(0), inter, index([-1] * batch, device=CPU), index([1, 2][:batch], device=CPU))
    assert torch.equal(pool.buffer, before)


# -- speculative decoding on the torch path -------------------------------------------------------


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_then_commit_equals_the_accepted_decode_steps(state_dtype: torch.dtype) -> None:
    """What lossless speculative decoding needs: verify + commit is bit for bit the decode steps."""
    slot_list = [11, 3, 0, 7, 1, 9, 4, 12, 2, 6, -1]
    accept_list = [2, 1, 0, -1, 2, 2, 1, 0, 2, 1, -1]
    batch = len(slot_list)
    x_conv = randn(batch, T, DIM, seed=1, device=CPU)
    weight, bias = randn(DIM, 4, seed=2, device=CPU), randn(DIM, seed=3, device=CPU)
    inp = _ssm((batch, T), ngroups=2, full=True, seed=20)

    decoded = _pool(state_dtype, seed=11)
    conv_outs, ssm_outs = [], []
    for t in range(T):
        step = index([s if t <= a else -1 for s, a in zip(slot_list, accept_list, strict=True)], device=CPU)
        conv_outs.append(torch_paths.causal_conv1d_update(x_conv[:, t], decoded.conv_state(0), weight, bias, silu=True, slot_idx=step))
        ssm_outs.append(
            torch_paths.selective_state_update(
                decoded.ssm_state(0), inp.x[:, t], inp.dt[:, t], inp.A, inp.B[:, t], inp.C[:, t], inp.D,
                z=inp.z[:, t] if inp.z is not None else None, dt_bias=inp.dt_bias, dt_softplus=True, slot_idx=step,
            )
        )

    verified = _pool(state_dtype, seed=11)
    slots, accept = index(slot_list, device=CPU), index(accept_list, device=CPU)
    conv_out, conv_states = torch_paths.causal_conv1d_verify(x_conv, verified.conv_state(0), weight, bias, silu=True, slot_idx=slots)
    ssm_out, ssm_states = torch_paths.selective_state_verify(
        verified.ssm_state(0), *inp[:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=True, slot_idx=slots
    )
    torch_paths.commit_accepted(verified.conv_state(0), conv_states, accept, slots)
    torch_paths.commit_accepted(verified.ssm_state(0), ssm_states, accept, slots)

    assert torch.equal(verified.buffer, decoded.buffer)
    for row, accepted in enumerate(accept_list):
        for t in range(accepted + 1):
            assert torch.equal(conv_out[row, t], conv_outs[t][row])
            assert torch.equal(ssm_out[row, t], ssm_outs[t][row])


# -- shapes, slot orders and thread splits --------------------------------------------------------


class Case(NamedTuple):
    nheads: int
    ngroups: int
    head_dim: int
    d_state: int
    dim: int
    width: int
    steps: int
    full: bool  # D, z and dt_bias given, softplus on dt, silu after the conv
    dtype: torch.dtype
    slots: list[int]
    index_dtype: torch.dtype
    seed: int


def _distinct_live(values: list[int]) -> list[int]:
    return [v for i, v in enumerate(values) if v < 0 or v not in values[:i]]


@st.composite
def _cases(draw: st.DrawFn) -> Case:
    nheads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    return Case(
        nheads=nheads,
        ngroups=draw(st.sampled_from([g for g in (1, 2, 3) if nheads % g == 0])),
        head_dim=draw(st.integers(1, 9)),
        d_state=draw(st.integers(1, 9)),
        dim=draw(st.integers(1, 40)),
        width=draw(st.integers(2, 4)),
        steps=draw(st.integers(1, 3)),
        full=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        slots=draw(st.lists(st.integers(-1, 6), max_size=12).map(_distinct_live)),
        index_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_every_path_equals_reference_on_random_shapes_and_slot_orders(case: Case) -> None:
    c = case
    batch, slots = len(c.slots), index(c.slots, c.index_dtype, device=CPU)

    def pool() -> MambaStatePool:
        return make_pool(
            capacity=6, conv_dim=c.dim, kernel_width=c.width, nheads=c.nheads, head_dim=c.head_dim, d_state=c.d_state,
            conv_dtype=c.dtype, ssm_dtype=c.dtype, layers=1, seed=c.seed, device=CPU,
        )

    def inputs(lead: tuple[int, ...], seed: int) -> SsmInputs:
        return ssm_inputs(
            lead, ngroups=c.ngroups, full=c.full, seed=seed, nheads=c.nheads, head_dim=c.head_dim, d_state=c.d_state, device=CPU
        )

    expected, actual = pool(), pool()
    inp = inputs((batch,), c.seed)
    kw = {"z": inp.z, "dt_bias": inp.dt_bias, "dt_softplus": c.full, "slot_idx": slots}
    _same(
        torch_paths.selective_state_update(actual.ssm_state(0), *inp[:6], **kw),
        reference.selective_state_update_reference(expected.ssm_state(0), *inp[:6], **kw),
    )
    x = randn(batch, c.dim, seed=c.seed, device=CPU)
    weight, bias = randn(c.dim, c.width, seed=c.seed + 1, device=CPU), randn(c.dim, seed=c.seed + 2, device=CPU)
    _same(
        torch_paths.causal_conv1d_update(x, actual.conv_state(0), weight, bias, silu=c.full, slot_idx=slots),
        reference.causal_conv1d_update_reference(x, expected.conv_state(0), weight, bias, silu=c.full, slot_idx=slots),
    )
    assert torch.equal(actual.buffer, expected.buffer)

    inp = inputs((batch, c.steps), c.seed + 3)
    kw = {"z": inp.z, "dt_bias": inp.dt_bias, "dt_softplus": c.full, "slot_idx": slots}
    ssm_got = torch_paths.selective_state_verify(actual.ssm_state(0), *inp[:6], **kw)
    for got, want in zip(ssm_got, reference.selective_state_verify_reference(actual.ssm_state(0), *inp[:6], **kw), strict=True):
        _same(got, want)
    x = randn(batch, c.steps, c.dim, seed=c.seed + 4, device=CPU)
    conv_got = torch_paths.causal_conv1d_verify(x, actual.conv_state(0), weight, bias, silu=c.full, slot_idx=slots)
    conv_want = reference.causal_conv1d_verify_reference(x, actual.conv_state(0), weight, bias, silu=c.full, slot_idx=slots)
    for got, want in zip(conv_got, conv_want, strict=True):
        _same(got, want)

    accept = index([(c.seed + row) % (c.steps + 1) - 1 for row in range(batch)], c.index_dtype, device=CPU)
    for view, states in ((actual.ssm_state(0), ssm_got[1]), (actual.conv_state(0), conv_got[1])):
        torch_paths.commit_accepted(view, states, accept, slots)
    for view, states in ((expected.ssm_state(0), ssm_got[1]), (expected.conv_state(0), conv_got[1])):
        reference.commit_reference(view, states, accept, slots)
    assert torch.equal(actual.buffer, expected.buffer)


@pytest.mark.usefixtures("two_threads")
def test_ops_above_the_thread_grain_equal_reference() -> None:
    # 11 rows x 3 positions: the conv's silu over 1010 channels and the SSM's softplus and gate over
    # 1100 heads exceed the grain, and torch would split each across the two threads inside a row.
    batch, steps, dim, nheads = 11, 3, 1010, 1100
    assert min(batch * steps * dim, batch * steps * nheads) >= torch_paths.GRAIN
    slots = index([11, 3, 0, 7, 1, 9, 4, 12, 2, 6, 5], device=CPU)
    conv = randn(CAPACITY + 1, dim, 3, seed=1, device=CPU)
    x, weight, bias = randn(batch, steps, dim, seed=3, device=CPU), randn(dim, 4, seed=3, device=CPU), randn(dim, seed=4, device=CPU)
    for got, want in zip(
        torch_paths.causal_conv1d_verify(x, conv, weight, bias, silu=True, slot_idx=slots),
        reference.causal_conv1d_verify_reference(x, conv, weight, bias, silu=True, slot_idx=slots),
        strict=True,
    ):
        _same(got, want)
    state = randn(CAPACITY + 1, nheads, 1, 2, seed=5, device=CPU)
    inp = ssm_inputs((batch, steps), ngroups=1, nheads=nheads, head_dim=1, d_state=2, seed=6, device=CPU)
    z = randn(batch, steps, nheads + 3, seed=7, device=CPU)[..., :nheads].reshape(batch, steps, nheads, 1)  # rows with gaps
    kw = {"z": z, "dt_bias": inp.dt_bias, "dt_softplus": True, "slot_idx": slots}
    for got, want in zip(
        torch_paths.selective_state_verify(state, *inp[:6], **kw),
        reference.selective_state_verify_reference(state, *inp[:6], **kw),
        strict=True,
    ):
        _same(got, want)
    # One row's 3 positions x 11000 heads exceed the grain on their own.
    batch, nheads = 2, 11000
    state = randn(CAPACITY + 1, nheads, 1, 2, seed=8, device=CPU)
    inp = ssm_inputs((batch, steps), ngroups=1, nheads=nheads, head_dim=1, d_state=2, seed=9, device=CPU)
    z = randn(batch, steps, nheads + 3, seed=10, device=CPU)[..., :nheads].reshape(batch, steps, nheads, 1)
    kw = {"z": z, "dt_bias": inp.dt_bias, "dt_softplus": True, "slot_idx": index([4, 9], device=CPU)}
    for got, want in zip(
        torch_paths.selective_state_verify(state, *inp[:6], **kw),
        reference.selective_state_verify_reference(state, *inp[:6], **kw),
        strict=True,
    ):
        _same(got, want)


# -- the wrappers take this path when Triton is off ------------------------------------------------


def test_wrappers_run_the_torch_path_after_their_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_KERNELS_ENV, raising=False)
    pool, expected = _pool(torch.float32), _pool(torch.float32)
    assert not use_triton(pool.buffer)
    slots = _slots("padded")
    inp = _ssm((len(SLOTS["padded"]),), ngroups=2, full=True)
    y = selective_state_update(pool.ssm_state(0), *inp[:6], z=inp.z, dt_bias=inp.dt_bias, slot_idx=slots)
    _same(y, torch_paths.selective_state_update(expected.ssm_state(0), *inp[:6], z=inp.z, dt_bias=inp.dt_bias, dt_softplus=True, slot_idx=slots))
    x, weight = randn(len(SLOTS["padded"]), T, DIM, seed=1, device=CPU), randn(DIM, 4, seed=2, device=CPU)
    out, conv_states = causal_conv1d_verify(x, pool.conv_state(0), weight, None, silu=True, slot_idx=slots)
    _same(out, torch_paths.causal_conv1d_verify(x, expected.conv_state(0), weight, None, silu=True, slot_idx=slots)[0])
    vin = _ssm((len(SLOTS["padded"]), T), ngroups=2, full=False)
    _, ssm_states = selective_state_verify(pool.ssm_state(0), *vin[:6], dt_softplus=False, slot_idx=slots)
    accept = index([0, -1, 2, 1, -1, 0], device=CPU)
    commit_accepted(pool.ssm_state(0), ssm_states, accept, slots)
    torch_paths.commit_accepted(expected.ssm_state(0), ssm_states, accept, slots)
    commit_accepted(pool.conv_state(0), conv_states, accept, slots)
    torch_paths.commit_accepted(expected.conv_state(0), conv_states, accept, slots)
    assert torch.equal(pool.buffer, expected.buffer)

    before = pool.copy_buffer()
    with pytest.raises(ValueError, match="repeats slots"):
        causal_conv1d_update(x[:, 0], pool.conv_state(0), weight, None, silu=True, slot_idx=index([1, 1, 2, 3, 4, 5], device=CPU))
    with pytest.raises(ValueError, match="more than once"):
        commit_accepted(pool.ssm_state(0), ssm_states, index([0] * 6, device=CPU), index([1, 1, 2, 3, 4, 5], device=CPU))
    with pytest.raises(ValueError, match="out of range"):
        selective_state_verify(pool.ssm_state(0), *vin[:6], slot_idx=index([1, 2, 3, 4, 5, CAPACITY + 1], device=CPU))
    assert torch.equal(pool.buffer, before)
