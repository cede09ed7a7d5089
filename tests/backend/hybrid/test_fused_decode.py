"""The fused float32 decode step on the CPU (``backend.kernels.lowp.mamba_decode_step`` and
``add_rms_norm``): each Mamba layer's conv, scan and gated norm in one C call, and the residual adds
with the norms after them. Compared with the torch path they replace, states included (the pool's
conv and SSM states, every slot), on shapes off the kernel's vector widths, padding rows, slots out
of order, groups, clamps and widths 2 to 4; a row's result is its own whatever rows or threads run
beside it; a model decoding through them serves the reference's tokens and leaves the states the
torch path leaves, on every tiny architecture."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backend.hybrid import HybridModel
from backend.hybrid.model import rms_norm
from backend.hybrid.reference import greedy_generate_reference
from backend.kernels import lowp, torch_paths
from backend.pool import MambaLayerSpec, MambaStatePool, PoolLayout
from compiler.testing.models import state_sensitive
from ir.ids import TARGET_POOL
from tests.helpers import ARCHITECTURES, served_greedy

needs_kernel = pytest.mark.skipif(lowp.kernel_status() != "c-avx2-f16c", reason="the C kernel does not run here")



def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to float32 rounding: the C library's expf/log1pf and the sums' order differ from torch's."""
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)


class _Counting:
    """A stand-in for the kernel library that counts the fused calls it forwards."""

    def __init__(self, lib: Any) -> None:
        self.lib, self.mamba, self.norms = lib, 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)

    def batchc_mamba_decode(self, *args: Any) -> int:
        self.mamba += 1
        return int(self.lib.batchc_mamba_decode(*args))

    def batchc_add_rms_norm(self, *args: Any) -> None:
        self.norms += 1
        self.lib.batchc_add_rms_norm(*args)


class _Layer:
    """One Mamba layer's parameters and a pool of ``slots`` rows holding random states."""

    def __init__(self, *, nheads: int, head_dim: int, d_state: int, ngroups: int, width: int, norm_groups: int,
                 clamp: tuple[float, float] | None, bias: bool, slots: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.nheads, self.head_dim, self.d_state, self.ngroups = nheads, head_dim, d_state, ngroups
        self.norm_groups, self.clamp = norm_groups, clamp
        self.d_inner = nheads * head_dim
        self.conv_dim = self.d_inner + 2 * ngroups * d_state
        spec = MambaLayerSpec(conv_dim=self.conv_dim, kernel_width=width, nheads=nheads, head_dim=head_dim, d_state=d_state)
        self.pool = MambaStatePool(TARGET_POOL, PoolLayout(layers=(spec,), align=64), slots)
        self.pool.conv_state(0).copy_(torch.randn(self.pool.conv_state(0).shape, generator=gen))
        self.pool.ssm_state(0).copy_(torch.randn(self.pool.ssm_state(0).shape, generator=gen))
        self.conv_weight = torch.randn(self.conv_dim, width, generator=gen) * 0.5
        self.conv_bias = torch.randn(self.conv_dim, generator=gen) * 0.1 if bias else None
        self.A_log = torch.rand(nheads, generator=gen) * 2 - 1
        self.D = torch.randn(nheads, generator=gen)
        self.dt_bias = torch.randn(nheads, generator=gen) - 2
        self.norm = 1 + 0.1 * torch.randn(self.d_inner, generator=gen)
        self.gen = gen

    def proj(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.d_inner + self.conv_dim + self.nheads, generator=self.gen)

    def fused(self, proj: torch.Tensor, slots: list[int]) -> torch.Tensor | None:
        return lowp.mamba_decode_step(
            proj, self.pool.conv_state(0), self.conv_weight, self.conv_bias, self.pool.ssm_state(0), self.A_log, self.D,
            self.dt_bias, self.norm, slots=torch.tensor(slots, dtype=torch.int64), ngroups=self.ngroups, dt_softplus=True,
            dt_clamp=self.clamp, norm_groups=self.norm_groups, eps=1e-5,
        )

    def torch_path(self, proj: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """What the model's decode runs without the kernel: conv, scan, gate (torch paths), gated norm."""
        d, c = self.d_inner, self.conv_dim
        rows = proj.shape[0]
        idx = torch.tensor(slots, dtype=torch.int64)
        xbc = torch_paths.causal_conv1d_update(proj[:, d:d + c].contiguous(), self.pool.conv_state(0), self.conv_weight,
                                               self.conv_bias, silu=True, slot_idx=idx)
        dt_bias: torch.Tensor | None = self.dt_bias
        dt, softplus = proj[:, d + c:], True
        if self.clamp is not None:
            dt, dt_bias, softplus = torch.nn.functional.softplus(dt + self.dt_bias).clamp(*self.clamp), None, False
        gn = self.ngroups * self.d_state
        y = torch_paths.selective_state_update(
            self.pool.ssm_state(0), xbc[:, :d].reshape(rows, self.nheads, self.head_dim), dt.contiguous(), -torch.exp(self.A_log),
            xbc[:, d:d + gn].reshape(rows, self.ngroups, self.d_state), xbc[:, d + gn:].reshape(rows, self.ngroups, self.d_state),
            self.D, z=proj[:, :d].reshape(rows, self.nheads, self.head_dim), dt_bias=dt_bias, dt_softplus=softplus, slot_idx=idx,
        )
        grouped = y.reshape(rows, self.norm_groups, d // self.norm_groups)
        return rms_norm(grouped, torch.ones(grouped.shape[-1]), 1e-5).reshape(rows, d) * self.norm

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.conv_state(0).clone(), self.pool.ssm_state(0).clone()


SHAPES = [
    # nheads, head_dim, d_state, ngroups, width, norm_groups, clamp, bias
    (4, 8, 16, 1, 4, 1, None, True),
    (6, 5, 20, 2, 3, 3, (0.01, 0.05), False),  # d_state past the 16-wide steps, groups of heads, a binding clamp
    (2, 4, 8, 2, 2, 2, None, True),  # d_state under one step: the scalar tail only
    (8, 16, 64, 4, 4, 4, (0.001, 10.0), True),
]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}p{}n{}g{}w{}".format(*s[:5]))
def test_a_fused_step_is_the_torch_paths_step_states_included(shape: tuple[Any, ...]) -> None:
    nheads, head_dim, d_state, ngroups, width, norm_groups, clamp, bias = shape
    fused = _Layer(nheads=nheads, head_dim=head_dim, d_state=d_state, ngroups=ngroups, width=width, norm_groups=norm_groups,
                   clamp=clamp, bias=bias, slots=7, seed=11)
    ref = _Layer(nheads=nheads, head_dim=head_dim, d_state=d_state, ngroups=ngroups, width=width, norm_groups=norm_groups,
                 clamp=clamp, bias=bias, slots=7, seed=11)
    slots = [5, -1, 0, 3, 6]  # out of order, a padding row, slots 1, 2 and 4 not in the batch
    for step in range(3):  # states carried from step to step
        proj = fused.proj(len(slots))
        ref.proj(len(slots))  # (keeps both generators in step)
        before = fused.states()
        out = fused.fused(proj, slots)
        expected = ref.torch_path(proj, slots)
        assert out is not None and out.shape == (len(slots), fused.d_inner) and out.dtype == torch.float32
        _close(out, expected)
        assert torch.equal(out[1], torch.zeros(fused.d_inner)), "a padding row's output is zero"
        conv, ssm = fused.states()
        ref_conv, ref_ssm = ref.states()
        _close(conv, ref_conv)
        _close(ssm, ref_ssm)
        for untouched in (1, 2, 4):
            assert torch.equal(conv[untouched], before[0][untouched]) and torch.equal(ssm[untouched], before[1][untouched]), step
        assert not torch.equal(ssm[5], before[1][5]) and not torch.equal(conv[0], before[0][0]), "the named slots moved"


@needs_kernel
def test_a_rows_fused_step_is_the_same_bits_whatever_rows_and_threads_run_beside_it() -> None:
    def layer() -> _Layer:
        return _Layer(nheads=6, head_dim=5, d_state=20, ngroups=2, width=4, norm_groups=2, clamp=None, bias=True, slots=6, seed=3)

    whole = layer()
    proj = whole.proj(4)
    slots = [4, 1, 5, 0]
    out = whole.fused(proj, slots)
    assert out is not None
    conv, ssm = whole.states()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for row in range(4):
                alone = layer()
                one = alone.fused(proj[row:row + 1], [slots[row]])
                assert one is not None and torch.equal(one[0], out[row]), (threads, row)
                a_conv, a_ssm = alone.states()
                assert torch.equal(a_conv[slots[row]], conv[slots[row]]) and torch.equal(a_ssm[slots[row]], ssm[slots[row]])
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_the_fused_step_declines_what_it_does_not_run_and_leaves_the_pool_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _Layer(nheads=2, head_dim=4, d_state=8, ngroups=1, width=4, norm_groups=1, clamp=None, bias=True, slots=3, seed=5)
    proj = layer.proj(2)
    before = layer.states()
    assert layer.fused(proj.double(), [0, 1]) is None
    assert layer.fused(proj.requires_grad_(), [0, 1]) is None
    proj = proj.detach()
    assert layer.fused(proj.T.contiguous().T, [0, 1]) is None  # columns not unit-strided
    half = MambaStatePool(TARGET_POOL, PoolLayout(layers=(MambaLayerSpec(
        conv_dim=layer.conv_dim, kernel_width=4, nheads=2, head_dim=4, d_state=8, ssm_dtype=torch.float16),)), 3)
    assert lowp.mamba_decode_step(proj, half.conv_state(0), layer.conv_weight, layer.conv_bias, half.ssm_state(0), layer.A_log,
                                  layer.D, layer.dt_bias, layer.norm, slots=torch.tensor([0, 1]), ngroups=1, dt_softplus=True,
                                  dt_clamp=None, norm_groups=1, eps=1e-5) is None
    monkeypatch.setenv("BATCHC_FUSED_DECODE", "0")
    assert layer.fused(proj, [0, 1]) is None
    assert lowp.add_rms_norm(torch.ones(1, 4), None, torch.ones(4), 1e-5) is None
    after = layer.states()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@needs_kernel
def test_the_fused_step_refuses_shapes_and_slots_that_do_not_fit_before_it_writes() -> None:
    layer = _Layer(nheads=4, head_dim=4, d_state=8, ngroups=2, width=4, norm_groups=2, clamp=None, bias=True, slots=3, seed=7)
    proj = layer.proj(2)
    before = layer.states()

    def step(**change: Any) -> torch.Tensor | None:
        args: dict[str, Any] = {
            "proj": proj, "conv_state": layer.pool.conv_state(0), "conv_weight": layer.conv_weight, "conv_bias": layer.conv_bias,
            "ssm_state": layer.pool.ssm_state(0), "A_log": layer.A_log, "D": layer.D, "dt_bias": layer.dt_bias,
            "norm_weight": layer.norm, "slots": torch.tensor([0, 2]), "ngroups": 2, "norm_groups": 2,
        }
        args.update(change)
        return lowp.mamba_decode_step(args.pop("proj"), args.pop("conv_state"), args.pop("conv_weight"), args.pop("conv_bias"),
                                      args.pop("ssm_state"), args.pop("A_log"), args.pop("D"), args.pop("dt_bias"),
                                      args.pop("norm_weight"), dt_softplus=True, **{"dt_clamp": None, "eps": 1e-5, **args})

    for change, words in (
        ({"proj": proj[:, :-1].contiguous()}, "proj must be"),
        ({"conv_weight": layer.conv_weight[:, :3].contiguous()}, "conv_state must be"),  # width 3 against a width-4 state
        ({"conv_weight": torch.zeros(layer.conv_dim, 5)}, "conv_weight must be"),
        ({"A_log": torch.zeros(3)}, "A_log must be"),
        ({"D": torch.zeros(5)}, "D must be"),
        ({"norm_weight": torch.zeros(7)}, "norm_weight must be"),
        ({"conv_bias": torch.zeros(3)}, "conv_bias must be"),
        ({"ngroups": 3}, "not a multiple of ngroups"),
        ({"norm_groups": 3}, "does not divide"),
        ({"slots": torch.tensor([0, 4])}, r"distinct slots in \[0, 4\)"),  # past the pool (3 slots and its padding row)
        ({"slots": torch.tensor([1, 1])}, "distinct slots"),
        ({"slots": torch.tensor([-2, 0])}, "distinct slots"),
        ({"slots": torch.tensor([0])}, "slots must be"),
    ):
        with pytest.raises(ValueError, match=words):
            step(**change)
        after = layer.states()
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]), change
    for change, error, words in (
        ({"ngroups": True}, ValueError, "ngroups"),  # (IRValidationError: a ValueError naming the argument)
        ({"norm_groups": 2.0}, ValueError, "norm_groups"),
        ({"eps": "1e-5"}, TypeError, "eps must be a real number"),
        ({"dt_clamp": (0.0, None)}, TypeError, "dt_clamp must be a real number"),
    ):
        with pytest.raises(error, match=words):
            step(**change)
        after = layer.states()
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]), change
    assert step() is not None  # the same arguments, unchanged, run
    with pytest.raises(ValueError, match="weight must be"):
        lowp.add_rms_norm(torch.ones(2, 4), None, torch.ones(5), 1e-5)
    h = torch.ones(2, 4)
    with pytest.raises(TypeError, match="scale must be a real number"):
        lowp.add_rms_norm(h, None, torch.ones(4), 1e-5, True)
    with pytest.raises(ValueError, match="add must be"):
        lowp.add_rms_norm(h, torch.ones(2, 3), torch.ones(4), 1e-5)
    assert torch.equal(h, torch.ones(2, 4))


@needs_kernel
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_add_rms_norm_adds_in_place_and_normalises(scale: float) -> None:
    gen = torch.Generator().manual_seed(9)
    for rows, width in ((1, 768), (3, 13), (16, 40)):
        h = torch.randn(rows, width, generator=gen)
        add = torch.randn(rows, 2 * width, generator=gen)[:, ::2]  # a strided add: its rows are what counts
        weight = torch.randn(width, generator=gen)
        expected_h = h + add * scale
        out = lowp.add_rms_norm(h, add.contiguous(), weight, 1e-5, scale)
        assert out is not None
        torch.testing.assert_close(h, expected_h, rtol=1e-6, atol=1e-6)
        _close(out, rms_norm(expected_h, weight, 1e-5))
        plain = lowp.add_rms_norm(h, None, weight, 1e-5)
        assert plain is not None
        _close(plain, rms_norm(h, weight, 1e-5))
    assert lowp.add_rms_norm(torch.ones(17, 4), None, torch.ones(4), 1e-5) is None  # more rows than a decode's few


def _decode_states(model: HybridModel, switch: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three decode steps of three rows (slots out of order, one padding row) after a prefill: logits
    of each step and the pool's bytes, with the fused path ``switch``ed."""
    monkeypatch.setenv("BATCHC_FUSED_DECODE", switch)
    pool, kv, table = model.new_pool(5), model.new_kv_cache(128), model.new_token_table(5, 64)
    slots = torch.tensor([3, 0, 2])
    prompts = torch.tensor([5, 17, 33, 8, 60, 3, 44, 90, 12])
    model.extend(pool, kv, table, slots=slots, cu_seqlens=torch.tensor([0, 3, 6, 9]), prefix_lens=torch.zeros(3, dtype=torch.long),
                 input_ids=prompts, positions=torch.arange(3).repeat(3), kv_locs=torch.arange(9))
    logits = []
    for step in range(3):
        out = model.decode(pool, kv, table, slots=torch.tensor([3, -1, 0, 2]), input_ids=torch.tensor([7 + step, 0, 9, 11 * step]),
                           positions=torch.tensor([3 + step, 0, 3 + step, 3 + step]), kv_locs=torch.tensor([9 + 4 * step + j for j in range(4)]))
        logits.append(out.logits)
    return logits, pool.buffer.view(torch.float32).clone()


@needs_kernel
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_model_decoding_through_the_fused_step_matches_its_torch_path(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = HybridModel.from_seed(ARCHITECTURES[arch](), 0)
    spy = _Counting(lowp._lib)
    monkeypatch.setattr(lowp, "_lib", spy)
    torch_logits, torch_pool = _decode_states(model, "0", monkeypatch)
    assert spy.mamba == spy.norms == 0
    fused_logits, fused_pool = _decode_states(model, "1", monkeypatch)
    mamba_layers = model.config.layers.count("mamba")
    assert spy.mamba == 3 * mamba_layers and spy.norms > 0
    for a, b in zip(fused_logits, torch_logits, strict=True):
        _close(a, b)
    _close(fused_pool, torch_pool)  # every layer's conv and SSM state, every slot
    # served through the engine, on a copy whose tokens depend on its Mamba state: the reference's tokens
    sensitive = state_sensitive(model)
    prompts = [[5, 17, 33, 8, 60, 3], [44, 90, 12], [7, 7, 7, 7, 1]]
    calls = spy.mamba
    outputs = served_greedy(sensitive, prompts, 6)
    assert spy.mamba > calls
    assert outputs == {i + 1: greedy_generate_reference(sensitive, p, 6) for i, p in enumerate(prompts)}
