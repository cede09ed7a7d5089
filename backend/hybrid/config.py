"""Shape hyper-parameters of the hybrid Mamba2/attention model: the bundled byte-level models and
the Hugging Face families (Bamba, Granite-4.0-H, Nemotron-H; ``backend.hf`` maps their configs here).

Architecture switches (the defaults are the bundled models' architecture):

- ``block``: ``"mixer_mlp"`` (every layer is a mixer, Mamba or attention, then an MLP, each behind
  its own pre-norm and residual) or ``"single"`` (every layer is one operation behind one pre-norm
  and residual: ``"mamba"``, ``"attn"`` or ``"mlp"``, Nemotron-H's layout);
- attention: ``attn_kv_heads`` (grouped-query attention: query head ``h`` reads KV head
  ``h // (attn_heads // attn_kv_heads)``; the KV cache holds only the KV heads), ``rotary_dim``
  (rotate-half rotary on the first ``rotary_dim`` dims of each head; ``None``: all of them, ``0``:
  no position embedding), ``attn_scale`` (softmax scale; ``None``: ``1/sqrt(attn_head_dim)``);
- ``mlp_kind``: ``"swiglu"`` (``down(silu(gate(x)) * up(x))``) or ``"relu2"`` (``down(relu(up(x))^2)``);
- ``norm_groups``: groups of the Mamba mixer's gated RMSNorm (``None``: ``ngroups``);
- ``dt_min``, ``dt_max``: ``dt = softplus(dt + dt_bias)`` is clamped to ``[dt_min, dt_max]`` in every
  forward (prefill, decode, verify, proposal) when either bound is set;
- ``tie_embeddings`` (the output projection is the embedding matrix), ``embed_scale`` (embeddings
  times it), ``residual_scale`` (every block's output times it before the residual add),
  ``logit_scale`` (logits times it).

Invariants (checked at construction, ``ValueError``):

- the layer pattern has at least one ``"mamba"`` layer (a pool layout needs one); attention layers
  are optional: an attention-free model (the bundled draft) has a KV cache with no layers and keeps
  its whole context in its recurrent state; ``"mlp"`` layers only with ``block="single"``;
- ``nheads % ngroups == 0`` (Mamba2 groups share B and C), ``d_inner % norm_groups == 0``,
  ``attn_heads % attn_kv_heads == 0``, ``conv_width`` in ``[2, 4]``;
- rotary dims are even and at most ``attn_head_dim``;
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
from typing import ClassVar, Literal

import attrs
import torch

from backend.pool import MambaLayerSpec, PoolLayout

__all__ = [
    "ARCHITECTURE_SWITCHES", "BLOCK_KINDS", "LAYER_KINDS", "MAX_DIM", "MAX_LAYERS", "MAX_VOCAB", "MLP_KINDS", "BlockKind", "HybridConfig",
    "LayerKind", "MlpKind", "small", "tiny",
]

LayerKind = Literal["mamba", "attn", "mlp"]
"""What one layer of the pattern is: a Mamba mixer, an attention mixer or (``block="single"``) an MLP."""
LAYER_KINDS: tuple[LayerKind, ...] = ("mamba", "attn", "mlp")
BlockKind = Literal["mixer_mlp", "single"]
"""How a layer is built: a mixer then an MLP, or one operation (see the module)."""
BLOCK_KINDS: tuple[BlockKind, ...] = ("mixer_mlp", "single")
MlpKind = Literal["swiglu", "relu2"]
"""The MLP's form: gated SiLU, or squared ReLU without a gate (see the module)."""
MLP_KINDS: tuple[MlpKind, ...] = ("swiglu", "relu2")

ARCHITECTURE_SWITCHES = frozenset(
    ("block", "attn_kv_heads", "rotary_dim", "attn_scale", "mlp_kind", "norm_groups", "dt_min", "dt_max",
     "tie_embeddings", "embed_scale", "residual_scale", "logit_scale")
)
"""The ``HybridConfig`` fields whose defaults are the bundled models' architecture."""

MAX_DIM = 1 << 16
"""Largest value of any size field but ``vocab`` (the bundled models use at most 512)."""
MAX_VOCAB = 1 << 18
"""Largest vocabulary (the Hugging Face hybrid families use up to 131,072)."""
MAX_LAYERS = 256
"""Longest layer pattern."""


def _kinds(value: tuple[LayerKind, ...]) -> tuple[LayerKind, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class HybridConfig:
    """A hybrid model: Mamba2 mixers, attention, MLPs (see the module doc for the switches)."""

    needs_mamba: ClassVar[bool] = True
    """Whether the pattern must hold a Mamba layer (a draft head's layers need not: its pool
    carries the target's hidden state, ``backend.hybrid.head``)."""

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
    # architecture switches (defaults: the bundled models)
    block: BlockKind = "mixer_mlp"
    attn_kv_heads: int | None = None
    rotary_dim: int | None = None
    attn_scale: float | None = None
    mlp_kind: MlpKind = "swiglu"
    norm_groups: int | None = None
    dt_min: float = 0.0
    dt_max: float = math.inf
    tie_embeddings: bool = False
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0

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
            bound = MAX_VOCAB if name == "vocab" else MAX_DIM
            if value > bound:
                raise ValueError(f"{name} must be at most {bound}, got {value!r}")
        if len(self.layers) > MAX_LAYERS:
            raise ValueError(f"layers: at most {MAX_LAYERS} layers, got {len(self.layers)}")
        bad = [k for k in self.layers if k not in LAYER_KINDS]
        if bad:
            raise ValueError(f"layer kinds must be one of {LAYER_KINDS}, got {bad!r}")
        if self.needs_mamba and "mamba" not in self.layers:
            raise ValueError(f"the layer pattern needs at least one mamba layer, got {self.layers!r}")
        if self.nheads % self.ngroups:
            raise ValueError(f"nheads {self.nheads} is not a multiple of ngroups {self.ngroups}")
        if not 2 <= self.conv_width <= 4:
            raise ValueError(f"conv_width must be in [2, 4], got {self.conv_width}")
        if self.attn_head_dim % 2 and self.rotary_dim is None:
            raise ValueError(f"attn_head_dim must be even for rotary embeddings, got {self.attn_head_dim}")
        if not math.isfinite(self.rms_eps) or self.rms_eps <= 0:
            raise ValueError(f"rms_eps must be positive, got {self.rms_eps}")
        if self.rms_eps > 1:
            raise ValueError(f"rms_eps must be at most 1, got {self.rms_eps}")
        if not math.isfinite(self.rope_theta) or self.rope_theta < 1:
            raise ValueError(f"rope_theta must be a finite number >= 1, got {self.rope_theta}")
        self._check_switches()

    def _check_switches(self) -> None:
        if self.block not in BLOCK_KINDS:
            raise ValueError(f"block must be one of {BLOCK_KINDS}, got {self.block!r}")
        if self.mlp_kind not in MLP_KINDS:
            raise ValueError(f"mlp_kind must be one of {MLP_KINDS}, got {self.mlp_kind!r}")
        if "mlp" in self.layers and self.block != "single":
            raise ValueError(f"'mlp' layers need block='single', got block={self.block!r}")
        for name, opt in (("attn_kv_heads", self.attn_kv_heads), ("rotary_dim", self.rotary_dim), ("norm_groups", self.norm_groups)):
            if opt is not None and (isinstance(opt, bool) or not isinstance(opt, int)):
                raise ValueError(f"{name} must be an int or None, got {opt!r}")
        if self.attn_kv_heads is not None and not (1 <= self.attn_kv_heads <= self.attn_heads and self.attn_heads % self.attn_kv_heads == 0):
            raise ValueError(f"attn_kv_heads must divide attn_heads {self.attn_heads}, got {self.attn_kv_heads}")
        if self.rotary_dim is not None and not (0 <= self.rotary_dim <= self.attn_head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in [0, attn_head_dim {self.attn_head_dim}], got {self.rotary_dim}")
        if self.norm_groups is not None and not (1 <= self.norm_groups <= self.d_inner and self.d_inner % self.norm_groups == 0):
            raise ValueError(f"norm_groups must divide d_inner {self.d_inner}, got {self.norm_groups}")
        scales: tuple[tuple[str, float | None], ...] = (
            ("embed_scale", self.embed_scale), ("residual_scale", self.residual_scale),
            ("logit_scale", self.logit_scale), ("attn_scale", self.attn_scale),
        )
        for name, scale in scales:
            if scale is not None and (not math.isfinite(scale) or scale <= 0):
                raise ValueError(f"{name} must be a finite positive number, got {scale}")
        if not (math.isfinite(self.dt_min) and 0 <= self.dt_min < self.dt_max) or math.isnan(self.dt_max):
            raise ValueError(f"dt bounds must satisfy 0 <= dt_min < dt_max (dt_max may be inf), got {self.dt_min}, {self.dt_max}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")

    def switched(self) -> tuple[str, ...]:
        """The architecture switches this config sets to something other than their defaults
        (empty: the bundled models' architecture)."""
        values = attrs.asdict(self)
        return tuple(f.name for f in attrs.fields(HybridConfig) if f.name in ARCHITECTURE_SWITCHES and values[f.name] != f.default)

    # ---- derived sizes ----------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        """Layers in the pattern, of every kind."""
        return len(self.layers)

    @property
    def d_inner(self) -> int:
        """Width of the Mamba mixer's inner stream: ``nheads * head_dim``."""
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
        """Width of the attention queries and output: ``attn_heads * attn_head_dim``."""
        return self.attn_heads * self.attn_head_dim

    @property
    def kv_heads(self) -> int:
        """KV heads of an attention layer (``attn_heads`` unless grouped-query)."""
        return self.attn_heads if self.attn_kv_heads is None else self.attn_kv_heads

    @property
    def kv_dim(self) -> int:
        """Width of one token's keys (and of its values) in an attention layer: ``kv_heads * attn_head_dim``."""
        return self.kv_heads * self.attn_head_dim

    @property
    def rope_dims(self) -> int:
        """Dims of each head that the rotary embedding rotates (0: no position embedding)."""
        return self.attn_head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def softmax_scale(self) -> float:
        """The attention's softmax scale: ``attn_scale``, or ``1/sqrt(attn_head_dim)`` when that is ``None``."""
        return 1.0 / math.sqrt(self.attn_head_dim) if self.attn_scale is None else self.attn_scale

    @property
    def gated_norm_groups(self) -> int:
        """Groups of the Mamba mixer's gated RMSNorm: ``norm_groups``, or ``ngroups`` when that is ``None``."""
        return self.ngroups if self.norm_groups is None else self.norm_groups

    @property
    def clamps_dt(self) -> bool:
        """Whether ``dt`` is clamped (``dt_min > 0`` or a finite ``dt_max``)."""
        return self.dt_min > 0 or math.isfinite(self.dt_max)

    @property
    def mlp_layers(self) -> tuple[int, ...]:
        """Layers with an MLP: every layer in a ``mixer_mlp`` block, the ``"mlp"`` layers in ``single``."""
        if self.block == "mixer_mlp":
            return tuple(range(len(self.layers)))
        return tuple(i for i, k in enumerate(self.layers) if k == "mlp")

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """The pattern indices of the Mamba layers, in order (pool layer ``j`` is ``mamba_layers[j]``)."""
        return tuple(i for i, k in enumerate(self.layers) if k == "mamba")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        """The pattern indices of the attention layers, in order (KV layer ``j`` is ``attn_layers[j]``)."""
        return tuple(i for i, k in enumerate(self.layers) if k == "attn")

    @property
    def n_mamba(self) -> int:
        """How many Mamba layers: the pool layout's layer count."""
        return len(self.mamba_layers)

    @property
    def n_attn(self) -> int:
        """How many attention layers: the KV cache's layer count (0 for an attention-free model)."""
        return len(self.attn_layers)

    def mamba_index(self, layer: int) -> int:
        """Pool layer of model layer ``layer`` (which must be a Mamba layer)."""
        return self.mamba_layers.index(layer)

    def attn_index(self, layer: int) -> int:
        """KV-cache layer of model layer ``layer`` (which must be an attention layer)."""
        return self.attn_layers.index(layer)

    def mamba_spec(self, conv_dtype: torch.dtype = torch.float32, ssm_dtype: torch.dtype = torch.float32) -> MambaLayerSpec:
        """The state shapes of one Mamba layer of this config (every Mamba layer has the same), in the
        given dtypes."""
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
