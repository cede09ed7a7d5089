"""The hybrid Mamba2/attention model over batchc's slot-major pool, KV cache and table.

Architecture (per layer, pre-norm residual): ``h += mixer(rmsnorm(h))`` then
``h += mlp(rmsnorm(h))``; then a final RMSNorm and an untied ``lm_head``. Byte vocabulary (256).
That is the bundled models'; the config's switches (``backend.hybrid.config``) add what the Hugging
Face families need: one operation per layer (Nemotron-H), grouped-query attention, partial or no
rotary, a softmax scale, squared-ReLU MLPs, tied embeddings, embedding / residual / logit scales,
gated-norm groups and a ``dt`` clamp. Below, the bundled architecture; the switches change only the
parts they name.

- Mamba2 mixer: ``in_proj`` -> ``(z, xBC, dt)``; causal depthwise conv1d (width 4, SiLU) over xBC
  whose last inputs live in the pool's conv state; split ``x, B, C``; selective scan with
  ``A = -exp(A_log)`` per head, ``dt = softplus(dt + dt_bias)``, ``D`` skip; the scan kernels apply
  the ``z`` gate, ``y *= silu(z)``, and then the gated RMSNorm normalises per group of
  ``d_inner / ngroups`` channels (Mamba2's ``RMSNormGated``, norm after gate); ``out_proj``.
- Attention: q/k/v projections, rotary position embedding (rotate-half form, ``rope_theta``,
  applied at the absolute position) on q and k, causal softmax attention over the request's whole
  context read through ``TokenTable`` from ``KVCache`` (keys stored after rotation), ``o_proj``.
  One KV head per query head (no GQA).
- MLP: SwiGLU, ``down(silu(gate(x)) * up(x))``.

State the entry points read and write (all on the pool's device; index tensors int64):

- the Mamba pool, row = slot (``config.pool_layout``): ``extend`` and ``decode`` update the slots of
  their rows in place; ``verify`` only reads them and returns per-position states that ``commit``
  scatters (on the torch path, the SSM states as factors: ``backend.kernels.window``); ``propose`` works on a gathered scratch copy and leaves the pool untouched;
- the KV cache at the given locations and the token table at ``(slot, position)`` for every token
  processed (``propose`` included: it writes its draft tokens' entries).

Rows with slot ``-1`` are padding: the Mamba kernels skip them, their KV and table writes are
redirected to the padding location 0 / the padding row 0, their outputs are garbage. Slot ``0`` may
appear once per call like any other slot (it is the pool's padding row).

Compute runs in the weights' dtype (norms, attention and the scan in float32 inside); logits are
returned in float32. ``hidden`` outputs are the residual stream after the last layer, before the
final norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import pairwise
from typing import Protocol, runtime_checkable

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from backend.hybrid.config import HybridConfig
from backend.hybrid.hook import HybridHook
from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.outputs import ForwardOut, VerifyOut, VerifyStates
from backend.hybrid.weights import Weights, check_weights, init_weights, projections, with_weight_dtype
from backend.kernels import checks
from backend.kernels.checks import require
from backend.kernels.chunked import Capture, causal_conv1d_prefill, ssd_prefill
from backend.kernels.commit import commit_accepted
from backend.kernels.conv import causal_conv1d_update, causal_conv1d_verify
from backend.kernels.lowp import KERNEL_MAX_ROWS, add_rms_norm, f32_linear, fused_decode_enabled, lowp_linear, mamba_decode_step
from backend.kernels.ssm import selective_state_update, selective_state_verify_kept
from backend.kernels.window import SsmWindow, commit_states
from backend.parts import ATTENTION, EMBED, FORWARD, KV, LM_HEAD, MAMBA, MLP, NORMS
from backend.pool import MambaStatePool, PoolLayout
from backend.readback import host_values, staged
from backend.staging import Captures
from ir.ids import TARGET_POOL, PoolId

__all__ = ["Collective", "HybridModel", "NormSplit", "ShardOrigin", "greedy", "rms_norm", "rotary"]

# (layer index, normed input) -> mixer output, for one token layout (packed, per-row, [n, T]).
_Mixer = Callable[[int, torch.Tensor], torch.Tensor]


@attrs.frozen
class _Cores:
    """What a forward does between a layer's projections, for one token layout: ``mamba(i, z,
    xBC, dt)`` -> the gated scan output ``y [tokens, H, P]`` (conv, scan and state update), and
    ``attn(i, q, k, v)`` -> the heads' outputs ``[tokens, H * hd]`` (KV written, context read)."""

    mamba: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    attn: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _no_mamba(i: int, z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a forward with no rows runs no layer")


def _no_attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a forward with no rows runs no layer")


@runtime_checkable
class Collective(Protocol):
    """Tensor parallelism: an in-place sum of a tensor over every rank (``backend.tp``)."""

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        """Replace ``t`` with its elementwise sum over every rank of the group, in place."""
        ...


@attrs.frozen
class ShardOrigin:
    """Where a tensor-parallel shard was cut from: the whole model's fingerprint
    (``backend.tp.shard.fingerprint``) and the shard's place."""

    fingerprint: str
    rank: int
    world: int


@attrs.frozen
class NormSplit:
    """A tensor-parallel shard whose slice of the mixer width lies inside one gated-norm group that
    other ranks share: the group's sum of squares is summed across ranks before it normalises."""

    groups: int
    """Gated-norm groups of the whole model."""
    width: int
    """Channels of one group (of the whole model)."""
    group: int
    """The group this rank's channels are in."""


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the vocabulary (last) axis; ties go to the lowest token id."""
    return logits.argmax(dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last axis, times ``weight``: computed in float32, returned in ``x``'s
    dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float, dims: int | None = None) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x [..., heads, head_dim]`` at ``positions [...]``, on the
    first ``dims`` dims of each head (``None``: all; ``0``: ``x`` unchanged)."""
    if dims is not None and dims != x.shape[-1]:
        if dims == 0:
            return x
        return torch.cat([rotary(x[..., :dims], positions, theta), x[..., dims:]], dim=-1)
    half = x.shape[-1] // 2
    inv_freq = (theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)).float()
    angles = positions.float()[..., None] * inv_freq  # [..., half]
    cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    require(t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}")
    checks.check_tensor(name, t, shape=shape, device=device)


class HybridModel:
    """Config + weights, and the forward entry points over the backend state (see module doc)."""

    def __init__(
        self, config: HybridConfig, weights: Weights, *, collective: Collective | None = None, norm_split: NormSplit | None = None,
        origin: ShardOrigin | None = None,
    ) -> None:
        """``collective``: this model is one tensor-parallel shard (``backend.tp.shard_model``) and
        sums its row-parallel outputs (``out_proj``, ``o_proj``, ``down_proj``) over the ranks;
        ``norm_split``: and its gated norm's sums of squares too; ``origin``: the whole model it
        was cut from (the ranks of a group check that they serve one model)."""
        check_weights(config, weights)
        self.config = config
        self.weights = weights
        self.collective = collective
        self.norm_split = norm_split
        self.origin = origin

    @classmethod
    def from_seed(
        cls,
        config: HybridConfig,
        seed: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> HybridModel:
        """A model of ``config`` with fresh weights drawn from ``seed`` (``init_weights``: deterministic), in
        ``dtype`` on ``device``."""
        return cls(config, init_weights(config, seed, dtype=dtype, device=device))

    def to(self, device: torch.device | str) -> HybridModel:
        """This model with its weights on ``device``, each moved once (itself when they are there
        already); the pools, KV cache and table it makes from then on live there too."""
        moved = {n: t.to(device) for n, t in self.weights.items()}  # (``Tensor.to`` returns the tensor itself when it is there)
        if all(moved[n] is t for n, t in self.weights.items()):
            return self
        return HybridModel(self.config, moved, collective=self.collective, norm_split=self.norm_split, origin=self.origin)

    @property
    def device(self) -> torch.device:
        """The device the weights live on: the pool, KV cache and table must be there too."""
        return self.weights["embed"].device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the weights' (logits are float32 whatever it is), but for the matrices
        that ``with_weight_dtype`` stored in 16 bits."""
        return self.weights["final_norm"].dtype

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the projection matrices are stored in: ``dtype``, or float16/bfloat16 beside
        float32 compute (``with_weight_dtype``)."""
        return self.weights[projections(self.config)[0]].dtype

    def with_weight_dtype(self, dtype: torch.dtype) -> HybridModel:
        """This float32 model with its projection matrices stored in ``dtype`` (float16 or bfloat16;
        float32: itself), compute, states and logits staying float32
        (``backend.hybrid.weights.with_weight_dtype``; products through ``backend.kernels.lowp``)."""
        if dtype == self.weight_dtype:
            return self
        return HybridModel(self.config, with_weight_dtype(self.config, self.weights, dtype), collective=self.collective,
                           norm_split=self.norm_split, origin=self.origin)

    @property
    def vocab(self) -> int:
        """The vocabulary size (``config.vocab``)."""
        return self.config.vocab

    # ---- backend state of the right shapes --------------------------------------------------

    def pool_layout(self) -> PoolLayout:
        """The Mamba pool layout this model needs, in float32 (``HybridConfig.pool_layout``)."""
        return self.config.pool_layout()

    def new_pool(
        self,
        capacity: int,
        *,
        pool_id: PoolId = TARGET_POOL,
        conv_dtype: torch.dtype = torch.float32,
        ssm_dtype: torch.dtype = torch.float32,
    ) -> MambaStatePool:
        """A fresh, zeroed state pool of ``capacity`` slots for this model (the target's pool id by
        default), on the model's device."""
        return MambaStatePool(pool_id, self.config.pool_layout(conv_dtype, ssm_dtype), capacity, device=self.device)

    def new_kv_cache(self, capacity: int) -> KVCache:
        """A zeroed KV cache of ``capacity`` token locations for this model's attention layers, in its dtype
        on its device."""
        return KVCache.for_config(self.config, capacity, dtype=self.dtype, device=self.device)

    def new_token_table(self, max_slots: int, max_len: int) -> TokenTable:
        """A zeroed token table of ``max_slots`` slots by ``max_len`` positions, on the model's device."""
        return TokenTable(max_slots, max_len, device=self.device)

    def captures_inner_states(self) -> bool:
        """Its hooks' extend forwards capture states inside a chunk (``backend.model.CapturesInnerStates``)."""
        return True

    def serving_hook(self, *, capacity: int, kv_capacity: int, max_len: int) -> HybridHook:
        """This model behind the serving hook protocol, with a fresh KV cache and token table."""
        return HybridHook(self, self.new_kv_cache(kv_capacity), self.new_token_table(capacity, max_len))

    # ---- building blocks ----------------------------------------------------------------------

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.weights[name]
        return f32_linear(x, w) if w.dtype == x.dtype else lowp_linear(x, w)

    def _reduced(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A row-parallel projection: ``_linear``, summed over the ranks of a shard."""
        out = self._linear(x, name)
        if self.collective is not None:
            self.collective.all_reduce_sum(out)
        return out

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The MLP of layer ``i`` on its normed input."""
        p = f"layers.{i}.mlp"
        if self.config.mlp_kind == "relu2":
            return self._reduced(torch.relu(self._linear(x, f"{p}.up_proj")).square(), f"{p}.down_proj")
        return self._reduced(F.silu(self._linear(x, f"{p}.gate_proj")) * self._linear(x, f"{p}.up_proj"), f"{p}.down_proj")

    def _dt(self, i: int, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The kernels' ``(dt, dt_bias, dt_softplus)`` arguments for layer ``i``: the raw ``dt`` and
        the bias for the kernels to add and softplus, or, when the config clamps ``dt``, the
        clamped ``softplus(dt + dt_bias)`` (float32) computed here, for every kernel alike."""
        c = self.config
        dt_bias = self._w(f"layers.{i}.mixer.dt_bias")
        if not c.clamps_dt:
            return dt.contiguous(), dt_bias, True
        return F.softplus(dt.float() + dt_bias.float()).clamp(c.dt_min, c.dt_max).to(dt.dtype).contiguous(), None, False

    def _mamba_in(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [..., d_model]`` -> ``z [..., d_inner]``, ``xBC [..., conv_dim]``, ``dt [..., nheads]``."""
        return self._split_proj(self._linear(x, f"layers.{i}.mixer.in_proj"))

    def _split_proj(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An ``in_proj`` output ``[..., d_inner + conv_dim + nheads]`` -> ``z``, ``xBC`` (contiguous), ``dt``."""
        c = self.config
        z = proj[..., : c.d_inner]
        xbc = proj[..., c.d_inner : c.d_inner + c.conv_dim]
        dt = proj[..., c.d_inner + c.conv_dim :]
        return z, xbc.contiguous(), dt

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``xBC [..., conv_dim]`` -> ``x [..., H, P]``, ``B, C [..., G, N]``."""
        c = self.config
        lead = xbc.shape[:-1]
        gn = c.ngroups * c.d_state
        x, B, C = xbc[..., : c.d_inner], xbc[..., c.d_inner : c.d_inner + gn], xbc[..., c.d_inner + gn :]
        return (
            x.reshape(*lead, c.nheads, c.head_dim),
            B.reshape(*lead, c.ngroups, c.d_state),
            C.reshape(*lead, c.ngroups, c.d_state),
        )

    def _ssm_params(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``A = -exp(A_log)`` (float32), ``D``."""
        p = f"layers.{i}.mixer"
        return -torch.exp(self._w(f"{p}.A_log").float()), self._w(f"{p}.D")

    def _mamba_out(self, i: int, y: torch.Tensor) -> torch.Tensor:
        """``y [..., H, P]`` (already gated by ``silu(z)``) -> group RMSNorm -> ``out_proj``."""
        c = self.config
        lead = y.shape[:-2]
        split = self.norm_split
        if split is not None:  # the norm group spans ranks: its sum of squares is summed across them
            flat = y.reshape(*lead, c.d_inner).float()
            sums = torch.zeros((*lead, split.groups), dtype=torch.float32, device=y.device)
            sums[..., split.group] = flat.square().sum(dim=-1)
            assert self.collective is not None
            self.collective.all_reduce_sum(sums)
            scale = torch.rsqrt(sums[..., split.group : split.group + 1] / split.width + c.rms_eps)
            normed = (flat * scale).to(y.dtype) * self._w(f"layers.{i}.mixer.norm")
        else:
            groups = c.gated_norm_groups
            grouped = y.reshape(*lead, groups, c.d_inner // groups)
            ones = torch.ones(grouped.shape[-1], dtype=torch.float32, device=y.device)
            normed = rms_norm(grouped, ones, c.rms_eps).reshape(*lead, c.d_inner) * self._w(f"layers.{i}.mixer.norm")
        return self._reduced(normed, f"layers.{i}.mixer.out_proj")

    def _qkv(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [..., d_model]`` at ``positions [...]`` -> rotated q, k and v, each ``[..., heads, head_dim]``."""
        c = self.config
        p = f"layers.{i}.mixer"
        q = self._linear(x, f"{p}.q_proj").reshape(*x.shape[:-1], c.attn_heads, c.attn_head_dim)
        k = self._linear(x, f"{p}.k_proj").reshape(*x.shape[:-1], c.kv_heads, c.attn_head_dim)
        v = self._linear(x, f"{p}.v_proj").reshape(*x.shape[:-1], c.kv_heads, c.attn_head_dim)
        return rotary(q, positions, c.rope_theta, c.rope_dims), rotary(k, positions, c.rope_theta, c.rope_dims), v

    def _attend(
        self, i: int, q: torch.Tensor, qpos: torch.Tensor, kv: KVCache, table: TokenTable, table_rows: torch.Tensor, ctx: int
    ) -> torch.Tensor:
        """``q [n, Tq, H, hd]`` at positions ``qpos [n, Tq]`` over ``table[rows, :ctx]`` -> ``o_proj`` output."""
        return self._reduced(self._attention(i, q, qpos, kv, table, table_rows, ctx), f"layers.{i}.mixer.o_proj")

    def _attention(
        self, i: int, q: torch.Tensor, qpos: torch.Tensor, kv: KVCache, table: TokenTable, table_rows: torch.Tensor, ctx: int
    ) -> torch.Tensor:
        """``_attend`` before ``o_proj``: the heads' outputs ``[n, Tq, H * hd]``."""
        c = self.config
        with KV:
            locs = table.rows(table_rows, ctx)  # [n, ctx]
            k, v = kv.gather(c.attn_index(i), locs)  # [n, ctx, kv_heads, hd]
        visible = torch.arange(ctx, device=q.device)[None, None, :] <= qpos[:, :, None]  # [n, Tq, ctx]
        if c.kv_heads == c.attn_heads:
            scores = torch.einsum("nthd,nlhd->nhtl", q.float(), k.float())
            scores = scores / math.sqrt(q.shape[-1]) if c.attn_scale is None else scores * c.attn_scale
            probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1)
            out = torch.einsum("nhtl,nlhd->nthd", probs, v.float()).to(q.dtype)
        else:  # grouped-query: query head g * rep + r reads KV head g (no KV row is repeated in memory)
            n, tq, _, hd = q.shape
            grouped = q.float().reshape(n, tq, c.kv_heads, c.attn_heads // c.kv_heads, hd)
            scores = torch.einsum("ntgrd,nlgd->ngrtl", grouped, k.float()) * c.softmax_scale
            probs = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(dim=-1)
            out = torch.einsum("ngrtl,nlgd->ntgrd", probs, v.float()).reshape(n, tq, c.attn_heads, hd).to(q.dtype)
        return out.reshape(*out.shape[:2], -1)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        with EMBED:
            h = self._w("embed")[input_ids].to(self.dtype)  # (a 16-bit tied embedding's rows widened)
            return h if self.config.embed_scale == 1.0 else h * self.config.embed_scale

    def _layers(self, h: torch.Tensor, mamba: _Mixer, attn: _Mixer, *, fused_norms: bool = False) -> torch.Tensor:
        c = self.config
        scale = c.residual_scale
        if fused_norms and h.dim() == 2 and h.shape[0] <= KERNEL_MAX_ROWS and h.dtype == torch.float32 and h.device.type == "cpu":
            return self._layers_fused_norms(h, mamba, attn)
        with NORMS:  # (the parts inside take their own time: NORMS keeps the norms and residual adds)
            for i, kind in enumerate(c.layers):
                x = rms_norm(h, self._w(f"layers.{i}.norm"), c.rms_eps)
                with MAMBA if kind == "mamba" else ATTENTION if kind == "attn" else MLP:
                    out = mamba(i, x) if kind == "mamba" else attn(i, x) if kind == "attn" else self._mlp(i, x)
                h = h + out if scale == 1.0 else h + out * scale
                if c.block == "mixer_mlp":
                    normed = rms_norm(h, self._w(f"layers.{i}.mlp_norm"), c.rms_eps)
                    with MLP:
                        out = self._mlp(i, normed)
                    h = h + out if scale == 1.0 else h + out * scale
        return h

    def _layers_fused_norms(self, h: torch.Tensor, mamba: _Mixer, attn: _Mixer) -> torch.Tensor:
        """``_layers`` with each residual add and the norm after it in one call of the C kernel
        (``add_rms_norm``), for a decode step's few float32 rows on the CPU: equal to ``_layers`` to
        float32 rounding. ``h`` is copied first (the kernel adds in place; a caller's embeddings stay
        as they were)."""
        c = self.config
        scale = c.residual_scale
        h = h.contiguous().clone()
        pending: torch.Tensor | None = None  # the last sub-block's output, not yet added to h

        def norm(weight: str) -> torch.Tensor:
            nonlocal pending
            add = None if pending is None else pending.contiguous()
            out = add_rms_norm(h, add, self._w(weight), c.rms_eps, scale)
            if out is None:  # the kernel cannot take it: torch, as _layers
                if add is not None:
                    h.add_(add if scale == 1.0 else add * scale)
                out = rms_norm(h, self._w(weight), c.rms_eps)
            pending = None
            return out

        with NORMS:
            for i, kind in enumerate(c.layers):
                x = norm(f"layers.{i}.norm")
                with MAMBA if kind == "mamba" else ATTENTION if kind == "attn" else MLP:
                    pending = mamba(i, x) if kind == "mamba" else attn(i, x) if kind == "attn" else self._mlp(i, x)
                if c.block == "mixer_mlp":
                    normed = norm(f"layers.{i}.mlp_norm")
                    with MLP:
                        pending = self._mlp(i, normed)
            if pending is not None:
                h = h + pending if scale == 1.0 else h + pending * scale
        return h

    def _fused_mamba(self, pool: MambaStatePool, pool_rows: torch.Tensor, cores: _Cores) -> _Mixer | None:
        """A decode's Mamba mixer with the conv, scan and gated norm of each layer in one call of the C
        kernel (``backend.kernels.lowp.mamba_decode_step``), around the same projections; ``None``
        where it does not apply (another dtype or device, a norm split across ranks, the switch off).
        A layer the kernel refuses runs ``cores``' torch path."""
        c = self.config
        if (self.norm_split is not None or self.dtype != torch.float32 or pool.device.type != "cpu"
                or pool_rows.device.type != "cpu" or not fused_decode_enabled()):
            return None
        slots = pool_rows.to(torch.int64).contiguous()
        clamp = (c.dt_min, c.dt_max) if c.clamps_dt else None

        def mamba(i: int, x: torch.Tensor) -> torch.Tensor:
            m, p = c.mamba_index(i), f"layers.{i}.mixer"
            proj = self._linear(x, f"{p}.in_proj")
            normed = mamba_decode_step(
                proj, pool.conv_state(m), self._w(f"{p}.conv_weight"), self._w(f"{p}.conv_bias"), pool.ssm_state(m),
                self._w(f"{p}.A_log"), self._w(f"{p}.D"), self._w(f"{p}.dt_bias"), self._w(f"{p}.norm"),
                slots=slots, ngroups=c.ngroups, dt_softplus=True, dt_clamp=clamp, norm_groups=c.gated_norm_groups, eps=c.rms_eps,
            )
            if normed is None:
                return self._mamba_out(i, cores.mamba(i, *self._split_proj(proj)))
            return self._reduced(normed, f"{p}.out_proj")

        return mamba

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        c = self.config
        with LM_HEAD:
            logits = self._linear(rms_norm(h, self._w("final_norm"), c.rms_eps), "embed" if c.tie_embeddings else "lm_head").float()
            return logits if c.logit_scale == 1.0 else logits * c.logit_scale

    def _check_rows(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, slots: torch.Tensor) -> None:
        device = pool.device
        specs = pool.layout.layers
        require(
            len(specs) == self.config.n_mamba
            and all(s == self.config.mamba_spec(s.conv_dtype, s.ssm_dtype) for s in specs),
            "the pool's layout does not match the model config",
        )
        require(kv.device == device and table.device == device, "pool, KV cache and table must share one device")
        require(self.device == device, f"the model is on {self.device}, the pool on {device}")
        checks.check_index("slots", slots, length=None, device=device)
        checks.check_slot_rows("slots", slots, pool.num_slots)
        if slots.numel():
            require(int(host_values(slots).max()) <= table.max_slots, f"slots exceed the token table's rows (max {table.max_slots})")

    # ---- entry points -------------------------------------------------------------------------

    @FORWARD
    def extend(
        self,
        pool: MambaStatePool,
        kv: KVCache,
        table: TokenTable,
        *,
        slots: torch.Tensor,
        cu_seqlens: torch.Tensor,
        prefix_lens: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_locs: torch.Tensor,
        captures: Captures | None = None,
        embeds: torch.Tensor | None = None,
        keep_hidden: bool = False,
    ) -> ForwardOut:
        """Prefill / chunked continuation of ``n`` packed sequences (each at least one token).

        Sequence ``i`` is ``input_ids[cu_seqlens[i]:cu_seqlens[i+1]]`` at positions
        ``prefix_lens[i] + 0, 1, ...``; it starts from the Mamba state in ``slots[i]`` and leaves
        its final state there; attention sees positions ``< prefix_lens[i]`` through the table.
        ``captures``: also the Mamba state of sequence ``seq[j]`` after its first ``at[j]`` tokens,
        into row ``j + 1`` of ``captures.into`` (attention keeps no per-slot state: the KV of those
        tokens is in the cache as for every token).
        ``embeds``: the first layer's input ``[total, d_model]`` in place of the tokens' embeddings (a
        draft head feeds its projected pairs, ``backend.hybrid.head``); ``keep_hidden``: also return
        every token's hidden state (``ForwardOut.all_hidden``, packed like ``input_ids``).
        """
        device = pool.device
        self._check_rows(pool, kv, table, slots)
        n = slots.shape[0]
        total = input_ids.shape[0] if input_ids.dim() == 1 else -1
        if embeds is not None:
            checks.check_tensor("embeds", embeds, shape=(total, self.config.d_model), device=device)
        cores = self._extend_cores(pool, kv, table, slots, cu_seqlens, prefix_lens, input_ids, positions, kv_locs, captures)
        if n == 0:
            empty = torch.zeros((0, self.config.d_model), dtype=self.dtype, device=device)
            return ForwardOut(torch.zeros((0, self.config.vocab), device=device), empty, empty if keep_hidden else None)
        h = self._layers(self._embed(input_ids) if embeds is None else embeds.to(self.dtype), *self._mixers(positions, cores))
        last = h[cu_seqlens[1:] - 1]
        return ForwardOut(self._logits(last), last, h if keep_hidden else None)

    @FORWARD
    def mixed(
        self,
        pool: MambaStatePool,
        kv: KVCache,
        table: TokenTable,
        *,
        slots: torch.Tensor,
        cu_seqlens: torch.Tensor,
        prefix_lens: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_locs: torch.Tensor,
        decode_slots: torch.Tensor,
        decode_ids: torch.Tensor,
        decode_positions: torch.Tensor,
        decode_kv_locs: torch.Tensor,
        captures: Captures | None = None,
        keep_hidden: bool = False,
    ) -> ForwardOut:
        """``extend`` over the packed sequences and ``decode`` of the ``decode_*`` rows in one pass
        over the layers (a MIXED forward): every projection, MLP and norm runs once over the
        extend's tokens and the decode rows together, each part's attention and Mamba scan as its
        own entry point runs it. Arguments as ``extend``'s and, prefixed ``decode_``, as
        ``decode``'s; each part at least one row, the two parts' slots distinct. Returns the logits and hidden states at
        each sequence's last token and then at each decode row (``keep_hidden``: every extend
        token's hidden state, as ``extend``'s)."""
        device = pool.device
        self._check_rows(pool, kv, table, slots)
        self._check_rows(pool, kv, table, decode_slots)
        n, m = slots.shape[0], decode_slots.shape[0]
        for name, t in (("decode_ids", decode_ids), ("decode_positions", decode_positions), ("decode_kv_locs", decode_kv_locs)):
            _check_index(name, t, (m,), device)
        require(n >= 1 and m >= 1, f"mixed: needs extend and decode rows, got {n} and {m} (run extend or decode)")
        both = [s for s in np.concatenate((host_values(slots), host_values(decode_slots))).tolist() if s >= 0]  # (staged: no readback)
        require(len(set(both)) == len(both), "mixed: a slot is in both the extend and the decode rows, or twice in one")
        ctx = self._decode_ctx(decode_positions, table)  # (both parts' checks before either part writes)
        ext = self._extend_cores(pool, kv, table, slots, cu_seqlens, prefix_lens, input_ids, positions, kv_locs, captures)
        dec = self._decode_cores(pool, decode_slots, kv, table, decode_slots, decode_positions, decode_kv_locs, ctx)
        total = input_ids.shape[0]

        def mamba(i: int, z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
            return torch.cat((ext.mamba(i, z[:total], xbc[:total], dt[:total]), dec.mamba(i, z[total:], xbc[total:], dt[total:])))

        def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.cat((ext.attn(i, q[:total], k[:total], v[:total]), dec.attn(i, q[total:], k[total:], v[total:])))

        mixers = self._mixers(torch.cat((positions, decode_positions)), _Cores(mamba, attn))
        h = self._layers(self._embed(torch.cat((input_ids, decode_ids))), *mixers)
        last = torch.cat((h[cu_seqlens[1:] - 1], h[total:]))
        return ForwardOut(self._logits(last), last, h[:total] if keep_hidden else None)

    def _mixers(self, positions: torch.Tensor, cores: _Cores) -> tuple[_Mixer, _Mixer]:
        """The Mamba and attention mixers of a forward over tokens at ``positions``: the layer's
        projections around ``cores``' scan and attention."""

        def mamba(i: int, x: torch.Tensor) -> torch.Tensor:
            return self._mamba_out(i, cores.mamba(i, *self._mamba_in(i, x)))

        def attn(i: int, x: torch.Tensor) -> torch.Tensor:
            return self._reduced(cores.attn(i, *self._qkv(i, x, positions)), f"layers.{i}.mixer.o_proj")

        return mamba, attn

    def _extend_cores(
        self, pool: MambaStatePool, kv: KVCache, table: TokenTable, slots: torch.Tensor, cu_seqlens: torch.Tensor,
        prefix_lens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, kv_locs: torch.Tensor, captures: Captures | None,
    ) -> _Cores:
        """``extend``'s arguments checked (rows checked by the caller), its table entries written, and
        its scan and attention over the packed sequences (each layer's KV written by its attention)."""
        device = pool.device
        n = slots.shape[0]
        total = input_ids.shape[0] if input_ids.dim() == 1 else -1
        _check_index("cu_seqlens", cu_seqlens, (n + 1,), device)
        _check_index("prefix_lens", prefix_lens, (n,), device)
        _check_index("input_ids", input_ids, (total,), device)
        _check_index("positions", positions, (total,), device)
        _check_index("kv_locs", kv_locs, (total,), device)
        bounds = host_values(cu_seqlens).tolist()  # (staged: the host's values, no readback)
        lens = [b - a for a, b in pairwise(bounds)]
        require(bounds[0] == 0 and bounds[-1] == total, f"cu_seqlens must run from 0 to {total}")
        require(all(length >= 1 for length in lens), f"every sequence needs at least one token, got lengths {lens[:8]}")
        c = self.config
        if n == 0:
            return _Cores(_no_mamba, _no_attn)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
        seq_of = torch.repeat_interleave(torch.arange(n, device=device), lens_t)  # [total]
        offset = torch.arange(total, device=device) - cu_seqlens[seq_of]  # token index within its sequence
        host_prefix = host_values(prefix_lens)
        host_offset = np.arange(total, dtype=np.int64) - np.repeat(np.asarray(bounds[:-1], dtype=np.int64), lens)
        require(np.array_equal(host_values(positions), np.repeat(host_prefix, lens) + host_offset),
                "positions must be prefix_lens[i] + 0, 1, ... per sequence")
        ctx = int((host_prefix + np.asarray(lens, dtype=np.int64)).max())
        require(ctx <= table.max_len, f"context {ctx} exceeds the token table's max_len {table.max_len}")

        capture: Capture | None = None
        into: MambaStatePool | None = None
        if captures is not None and captures.seq:
            capture, into = Capture(seq=captures.seq, at=captures.at), captures.into
            require(into.layout == pool.layout, "the capture pool's layout differs from the pool's")
            require(into.capacity >= len(captures.seq), f"{len(captures.seq)} captures, {into.capacity} capture rows")
            bad = [(q, a) for q, a in zip(captures.seq, captures.at, strict=True) if not (0 <= q < n and 1 <= a <= lens[q])]
            require(not bad, f"captures (sequence, tokens) {bad[:4]} are not inside their sequences")
        rows = slice(1, 1 + len(capture.seq) if capture is not None else 1)  # capture j goes to row j + 1 of `into`

        live = slots[seq_of] >= 0
        locs = torch.where(live, kv_locs, 0)
        table.write(slots[seq_of], positions, locs)
        t_max = max(lens)
        qpos = torch.zeros((n, t_max), dtype=torch.int64, device=device)
        qpos[seq_of, offset] = positions

        def mamba(i: int, z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
            m = c.mamba_index(i)
            p = f"layers.{i}.mixer"
            xbc = causal_conv1d_prefill(
                xbc, pool.conv_state(m), self._w(f"{p}.conv_weight"), self._w(f"{p}.conv_bias"),
                silu=True, cu_seqlens=cu_seqlens, slot_idx=slots, check_slots=False,
                capture=capture, capture_state=into.conv_state(m)[rows] if into is not None else None,
            )
            xs, B, C = self._split_xbc(xbc)
            A, D = self._ssm_params(i)
            dt, dt_bias, dt_softplus = self._dt(i, dt)
            return ssd_prefill(
                pool.ssm_state(m), xs, dt, A, B, C, D,
                z=z.reshape(total, c.nheads, c.head_dim), dt_bias=dt_bias, dt_softplus=dt_softplus,
                cu_seqlens=cu_seqlens, slot_idx=slots, chunk_size=c.chunk_size, check_slots=False,
                capture=capture, capture_state=into.ssm_state(m)[rows] if into is not None else None,
            )

        def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with KV:
                kv.write(c.attn_index(i), locs, k, v)
            q_pad = torch.zeros((n, t_max, *q.shape[1:]), dtype=q.dtype, device=device)
            q_pad[seq_of, offset] = q
            return self._attention(i, q_pad, qpos, kv, table, slots, ctx)[seq_of, offset]

        return _Cores(mamba, attn)

    @FORWARD
    def decode(
        self,
        pool: MambaStatePool,
        kv: KVCache,
        table: TokenTable,
        *,
        slots: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_locs: torch.Tensor,
    ) -> ForwardOut:
        """One token per row at ``positions``; each slot's Mamba state advances in place."""
        self._check_rows(pool, kv, table, slots)
        n = slots.shape[0]
        for name, t in (("input_ids", input_ids), ("positions", positions), ("kv_locs", kv_locs)):
            _check_index(name, t, (n,), pool.device)
        return self._decode(pool, slots, kv, table, slots, input_ids, positions, kv_locs)

    def _decode(
        self,
        pool: MambaStatePool,
        pool_rows: torch.Tensor,
        kv: KVCache,
        table: TokenTable,
        table_rows: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_locs: torch.Tensor,
        embeds: torch.Tensor | None = None,
    ) -> ForwardOut:
        """Decode with the Mamba state in ``pool[pool_rows]`` and the context in ``table[table_rows]``
        (different for ``propose``, which runs on a scratch pool). Inputs validated by the caller;
        ``embeds [n, d_model]``: the first layer's input in place of the embeddings (as ``extend``)."""
        c = self.config
        device = pool.device
        n = input_ids.shape[0]
        if n == 0:
            return ForwardOut(torch.zeros((0, c.vocab), device=device), torch.zeros((0, c.d_model), dtype=self.dtype, device=device))
        cores = self._decode_cores(pool, pool_rows, kv, table, table_rows, positions, kv_locs, self._decode_ctx(positions, table))
        mamba, attn = self._mixers(positions, cores)
        fused = self._fused_mamba(pool, pool_rows, cores)
        h = self._layers(self._embed(input_ids) if embeds is None else embeds.to(self.dtype), fused or mamba, attn, fused_norms=fused is not None)
        return ForwardOut(self._logits(h), h)

    @staticmethod
    def _decode_ctx(positions: torch.Tensor, table: TokenTable) -> int:
        """The context a decode at ``positions`` reads (the highest position + 1), checked against the table."""
        known = host_values(positions)  # (staged positions: decided on the host, no readback)
        ctx = int(known.max()) + 1
        require(int(known.min()) >= 0 and ctx <= table.max_len, f"positions must lie in [0, {table.max_len})")
        return ctx

    def _decode_cores(
        self, pool: MambaStatePool, pool_rows: torch.Tensor, kv: KVCache, table: TokenTable, table_rows: torch.Tensor,
        positions: torch.Tensor, kv_locs: torch.Tensor, ctx: int,
    ) -> _Cores:
        """``_decode``'s table entries written, and its scan and attention over one token per row
        (at least one row; each layer's KV written by its attention) over a context of ``ctx``
        positions (``_decode_ctx``: checked by the caller before anything is written)."""
        c = self.config
        locs = torch.where(table_rows >= 0, kv_locs, 0)
        table.write(table_rows, positions, locs)

        def mamba(i: int, z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
            m = c.mamba_index(i)
            p = f"layers.{i}.mixer"
            xbc = causal_conv1d_update(
                xbc, pool.conv_state(m), self._w(f"{p}.conv_weight"), self._w(f"{p}.conv_bias"),
                silu=True, slot_idx=pool_rows, check_slots=False,
            )
            xs, B, C = self._split_xbc(xbc)
            A, D = self._ssm_params(i)
            dt, dt_bias, dt_softplus = self._dt(i, dt)
            return selective_state_update(
                pool.ssm_state(m), xs, dt, A, B, C, D,
                z=z.reshape(xs.shape[0], c.nheads, c.head_dim), dt_bias=dt_bias, dt_softplus=dt_softplus,
                slot_idx=pool_rows, check_slots=False,
            )

        def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with KV:
                kv.write(c.attn_index(i), locs, k, v)
            return self._attention(i, q[:, None], positions[:, None], kv, table, table_rows, ctx)[:, 0]

        return _Cores(mamba, attn)

    @FORWARD
    def verify(
        self,
        pool: MambaStatePool,
        kv: KVCache,
        table: TokenTable,
        *,
        slots: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_locs: torch.Tensor,
    ) -> VerifyOut:
        """``T`` consecutive positions per row from the committed state; the pool is only read.

        KV and table entries are written for all ``T`` positions (rejected ones are overwritten
        when those positions are processed again). ``commit`` then makes a position's state the
        committed one.
        """
        c = self.config
        device = pool.device
        self._check_rows(pool, kv, table, slots)
        n = slots.shape[0]
        T = input_ids.shape[1] if input_ids.dim() == 2 else -1
        for name, t in (("input_ids", input_ids), ("positions", positions), ("kv_locs", kv_locs)):
            _check_index(name, t, (n, T), device)
        require(T >= 1, "verify needs at least one position per row")
        if n == 0:
            conv = tuple(torch.zeros((0, T, *pool.conv_state(m).shape[1:]), dtype=pool.conv_state(m).dtype, device=device)
                         for m in range(c.n_mamba))
            ssm = tuple(torch.zeros((0, T, *pool.ssm_state(m).shape[1:]), dtype=pool.ssm_state(m).dtype, device=device)
                        for m in range(c.n_mamba))
            return VerifyOut(
                torch.zeros((0, T, c.vocab), device=device),
                torch.zeros((0, T, c.d_model), dtype=self.dtype, device=device),
                VerifyStates(conv, ssm),
            )
        known = host_values(positions)  # (a staged window's positions: decided on the host, no readback)
        require(bool((known == known[:, :1] + np.arange(T)).all()), "verify positions must be consecutive per row")
        ctx = int(known.max()) + 1
        require(int(known.min()) >= 0 and ctx <= table.max_len, f"positions must lie in [0, {table.max_len})")
        live = (slots >= 0)[:, None].expand(n, T)
        locs = torch.where(live, kv_locs, 0)
        table.write(slots[:, None].expand(n, T), positions, locs)
        conv_states: list[torch.Tensor] = []
        ssm_states: list[torch.Tensor | SsmWindow] = []

        def mamba(i: int, x: torch.Tensor) -> torch.Tensor:
            m = c.mamba_index(i)
            p = f"layers.{i}.mixer"
            z, xbc, dt = self._mamba_in(i, x)
            xbc, conv_st = causal_conv1d_verify(
                xbc, pool.conv_state(m), self._w(f"{p}.conv_weight"), self._w(f"{p}.conv_bias"),
                silu=True, slot_idx=slots, check_slots=False,
            )
            xs, B, C = self._split_xbc(xbc)
            A, D = self._ssm_params(i)
            dt, dt_bias, dt_softplus = self._dt(i, dt)
            y, ssm_st = selective_state_verify_kept(
                pool.ssm_state(m), xs, dt, A, B, C, D,
                z=z.reshape(n, T, c.nheads, c.head_dim), dt_bias=dt_bias, dt_softplus=dt_softplus,
                slot_idx=slots, check_slots=False,
            )
            conv_states.append(conv_st)
            ssm_states.append(ssm_st)
            return self._mamba_out(i, y)

        def attn(i: int, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self._qkv(i, x, positions)
            with KV:
                kv.write(c.attn_index(i), locs.reshape(-1), k.reshape(n * T, *k.shape[2:]), v.reshape(n * T, *v.shape[2:]))
            return self._attend(i, q, positions, kv, table, slots, ctx)

        h = self._layers(self._embed(input_ids), mamba, attn)
        return VerifyOut(self._logits(h), h, VerifyStates(tuple(conv_states), tuple(ssm_states)))

    def commit(self, pool: MambaStatePool, states: VerifyStates, *, accept_pos: torch.Tensor, slots: torch.Tensor) -> None:
        """Per row, the state after verify position ``accept_pos[row]`` becomes ``slots[row]``'s
        committed state in every Mamba layer; ``-1`` (or slot ``-1``) commits nothing."""
        require(len(states.conv) == len(states.ssm) == self.config.n_mamba, "states do not match the model's Mamba layers")
        for m in range(self.config.n_mamba):
            commit_accepted(pool.conv_state(m), states.conv[m], accept_pos, slots)
            commit_states(pool.ssm_state(m), states.ssm[m], accept_pos, slots)

    def propose(
        self,
        pool: MambaStatePool,
        kv: KVCache,
        table: TokenTable,
        *,
        slots: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_locs: torch.Tensor,
        k: int,
    ) -> torch.Tensor:
        """Draft proposal: ``k`` greedy steps per row from the committed state, feeding
        ``input_ids`` (at ``positions``) first and then each step's argmax; returns ``[n, k]``.

        The pool is not written: the rows are gathered into a scratch pool first. Step ``j`` writes
        the KV of the token it feeds at ``kv_locs[:, j]`` (table entry ``positions + j``).
        """
        tokens, _ = self._propose(pool, kv, table, slots, input_ids, positions, kv_locs, k=k, keep=False)
        return tokens

    def propose_keeping_states(
        self,
        pool: MambaStatePool,
        kv: KVCache,
        table: TokenTable,
        *,
        slots: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_locs: torch.Tensor,
        k: int,
    ) -> tuple[torch.Tensor, VerifyStates]:
        """Draft proposal for a draft commit: ``k + 1`` greedy steps per row, feeding ``input_ids``
        and then each step's argmax (the last step feeds the ``k``-th proposal), so the KV of every
        window position is written (``kv_locs [n, k + 1]``) and the state after each step is kept.

        Returns the ``[n, k]`` proposals and the per-step states (``VerifyStates`` laid out as a
        verify's: ``[n, k + 1, ...]`` per Mamba layer, position ``j`` after feeding window token
        ``j``), which ``commit`` takes at each row's accepted position. The pool is not written.
        """
        tokens, states = self._propose(pool, kv, table, slots, input_ids, positions, kv_locs, k=k, keep=True)
        assert states is not None
        return tokens, states

    @FORWARD
    def _propose(
        self,
        pool: MambaStatePool,
        kv: KVCache,
        table: TokenTable,
        slots: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_locs: torch.Tensor,
        *,
        k: int,
        keep: bool,
    ) -> tuple[torch.Tensor, VerifyStates | None]:
        """``k`` steps (``k + 1`` and the states after each when ``keep``) on a scratch copy of the rows."""
        device = pool.device
        self._check_rows(pool, kv, table, slots)
        n = slots.shape[0]
        require(k >= 1, f"k must be positive, got {k}")
        steps = k + 1 if keep else k
        _check_index("input_ids", input_ids, (n,), device)
        _check_index("positions", positions, (n,), device)
        _check_index("kv_locs", kv_locs, (n, steps), device)
        tokens = torch.zeros((n, k), dtype=torch.int64, device=device)
        layers = range(self.config.n_mamba if keep else 0)  # the per-step states only when kept
        conv = [torch.zeros((n, steps, *pool.conv_state(m).shape[1:]), dtype=pool.conv_state(m).dtype, device=device) for m in layers]
        ssm = [torch.zeros((n, steps, *pool.ssm_state(m).shape[1:]), dtype=pool.ssm_state(m).dtype, device=device) for m in layers]
        if n > 0:
            scratch = MambaStatePool(pool.pool_id, pool.layout, n, device=device)
            scratch.buffer[1:] = pool.buffer[slots.clamp(min=0)]
            # the rows' scratch slots and each step's positions, their values known on the host (at most one
            # readback each for slots and positions not staged): no step reads them back again
            known_slots, known_positions = host_values(slots), host_values(positions)
            rows_host = np.where(known_slots >= 0, np.arange(1, n + 1, dtype=np.int64), -1)
            rows = staged(torch.where(slots >= 0, torch.arange(1, n + 1, device=device), -1), rows_host)
            fed = input_ids
            for j in range(steps):
                at = staged(positions + j, known_positions + j)
                out = self._decode(scratch, rows, kv, table, slots, fed, at, kv_locs[:, j].contiguous())
                if j < k:
                    fed = greedy(out.logits)
                    tokens[:, j] = fed
                if keep:
                    for m in layers:
                        conv[m][:, j] = scratch.conv_state(m)[1:]
                        ssm[m][:, j] = scratch.ssm_state(m)[1:]
        return tokens, (VerifyStates(tuple(conv), tuple(ssm)) if keep else None)
