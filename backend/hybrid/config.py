"""Shape hyper-parameters of the reference hybrid Mamba2/attention byte-level model.

Invariants (checked at construction, ``ValueError``):

- the layer pattern has at least one ``"mamba"`` layer (a pool layout needs one); attention layers
  are optional: an attention-free model (the bundled draft) has a KV cache with no layers and keeps
  its whole context in its recurrent state;
- ``nheads % ngroups == 0`` (Mamba2 groups share B and C), ``conv_width`` in ``[2, 4]``;
- rotary head dims are even;
- sanity bounds, so that a hostile config cannot ask for absurd sizes or NaN: every size field
  (``d_model``, head counts and dims, ``d_state``, ``ngroups``, ``mlp_hidden``, ``vocab``,
  ``chunk_size``) in ``[1, MAX_DIM]``, at most ``MAX_LAYERS`` layers, ``rope_theta`` finite and
  ``>= 1`` (below 1 the rotary frequencies exceed one radian per position, and for tiny values
  they overflow float32 and the attention turns NaN), ``rms_eps`` finite in ``(0, 1]``.

Mamba layer ``i`` of the pattern owns pool layer ``mamba_index(i)`` (its ordinal among the Mamba
layers); attention layer ``i`` owns KV layer ``attn_index(i)``.
"""

from __future__ import annotations

import math
from typing import Literal

import attrs
import torch

from backend.pool import MambaLayerSpec, PoolLayout

LayerKind = Literal["mamba", "attn"]
LAYER_KINDS: tuple[LayerKind, ...] = ("mamba", "attn")

MAX_DIM = 1 << 16
"""Largest value of any size field (the bundled models use at most 512)."""
MAX_LAYERS = 256
"""Longest layer pattern."""


def _kinds(value: tuple[LayerKind, ...]) -> tuple[LayerKind, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class HybridConfig:
    """A byte-level (vocab 256) hybrid model: Mamba2 mixers, rotary attention, SwiGLU MLPs."""

    d_model: int
    layers: tuple[LayerKind, ...] = attrs.field(converter=_kinds)
    # Mamba2 mixer
    nheads: int
    head_dim: int
    d_state: int
    ngroups: int = 1
    conv_width: int = 4
    chunk_size: int = 64
    # attention
    attn_heads: int
    attn_head_dim: int
    rope_theta: float = 10000.0
    # MLP, norms, vocabulary
    mlp_hidden: int
    rms_eps: float = 1e-5
    vocab: int = 256

    def __attrs_post_init__(self) -> None:
        sizes = {
            "d_model": self.d_model,
            "nheads": self.nheads,
            "head_dim": self.head_dim,
            "d_state": self.d_state,
            "ngroups": self.ngroups,
            "attn_heads": self.attn_heads,
            "attn_head_dim": self.attn_head_dim,
            "mlp_hidden": self.mlp_hidden,
            "vocab": self.vocab,
            "chunk_size": self.chunk_size,
        }
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
            if value > MAX_DIM:
                raise ValueError(f"{name} must be at most {MAX_DIM}, got {value!r}")
        if len(self.layers) > MAX_LAYERS:
            raise ValueError(f"layers: at most {MAX_LAYERS} layers, got {len(self.layers)}")
        bad = [k for k in self.layers if k not in LAYER_KINDS]
        if bad:
            raise ValueError(f"layer kinds must be one of {LAYER_KINDS}, got {bad!r}")
        if "mamba" not in self.layers:
            raise ValueError(f"the layer pattern needs at least one mamba layer, got {self.layers!r}")
        if self.nheads % self.ngroups:
            raise ValueError(f"nheads {self.nheads} is not a multiple of ngroups {self.ngroups}")
        if not 2 <= self.conv_width <= 4:
            raise ValueError(f"conv_width must be in [2, 4], got {self.conv_width}")
        if self.attn_head_dim % 2:
            raise ValueError(f"attn_head_dim must be even for rotary embeddings, got {self.attn_head_dim}")
        if not math.isfinite(self.rms_eps) or self.rms_eps <= 0:
            raise ValueError(f"rms_eps must be positive, got {self.rms_eps}")
        if self.rms_eps > 1:
            raise ValueError(f"rms_eps must be at most 1, got {self.rms_eps}")
        if not math.isfinite(self.rope_theta) or self.rope_theta < 1:
            raise ValueError(f"rope_theta must be a finite number >= 1, got {self.rope_theta}")

    # ---- derived sizes ----------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def d_inner(self) -> int:
        return self.nheads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C (``d_inner + 2 * ngroups * d_state``)."""
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def in_proj_dim(self) -> int:
        """Rows of ``in_proj``: z, xBC, dt."""
        return self.d_inner + self.conv_dim + self.nheads

    @property
    def attn_dim(self) -> int:
        return self.attn_heads * self.attn_head_dim

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layers) if k == "mamba")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layers) if k == "attn")

    @property
    def n_mamba(self) -> int:
        return len(self.mamba_layers)

    @property
    def n_attn(self) -> int:
        return len(self.attn_layers)

    def mamba_index(self, layer: int) -> int:
        """Pool layer of model layer ``layer`` (which must be a Mamba layer)."""
        return self.mamba_layers.index(layer)

    def attn_index(self, layer: int) -> int:
        """KV-cache layer of model layer ``layer`` (which must be an attention layer)."""
        return self.attn_layers.index(layer)

    def mamba_spec(self, conv_dtype: torch.dtype = torch.float32, ssm_dtype: torch.dtype = torch.float32) -> MambaLayerSpec:
        return MambaLayerSpec(
            conv_dim=self.conv_dim,
            kernel_width=self.conv_width,
            nheads=self.nheads,
            head_dim=self.head_dim,
            d_state=self.d_state,
            conv_dtype=conv_dtype,
            ssm_dtype=ssm_dtype,
        )

    def pool_layout(self, conv_dtype: torch.dtype = torch.float32, ssm_dtype: torch.dtype = torch.float32) -> PoolLayout:
        """One ``MambaLayerSpec`` per Mamba layer, in pattern order."""
        return PoolLayout(layers=[self.mamba_spec(conv_dtype, ssm_dtype)] * self.n_mamba)


def tiny() -> HybridConfig:
    """Test-sized: 3 layers (mamba, attn, mamba), d_model 32; runs in milliseconds on a CPU."""
    return HybridConfig(
        d_model=32,
        layers=("mamba", "attn", "mamba"),
        nheads=4,
        head_dim=8,
        d_state=8,
        ngroups=2,
        chunk_size=8,
        attn_heads=2,
        attn_head_dim=16,
        mlp_hidden=64,
    )


def small() -> HybridConfig:
    """Benchmark-sized: 8 layers (3 mamba : 1 attn, twice), d_model 256, Mamba expand 2."""
    return HybridConfig(
        d_model=256,
        layers=("mamba", "mamba", "mamba", "attn") * 2,
        nheads=8,
        head_dim=64,
        d_state=64,
        ngroups=1,
        attn_heads=4,
        attn_head_dim=64,
        mlp_hidden=768,
    )
