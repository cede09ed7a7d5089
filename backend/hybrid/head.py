"""An MTP/EAGLE-style draft head: a small hybrid stack that reads the target's hidden states.

Math (the pairing every part of batchc uses: model, reference, training, serving). Target tokens
``x_0, x_1, ...``; ``h_j`` is the target's residual stream after its last layer, before the final
norm, at position ``j`` (``ForwardOut.hidden`` / ``VerifyOut.hidden``). Head position ``j``
consumes the pair ``(h_{j-1}, x_j)`` with ``h_{-1} = 0``::

    u_j = fc( concat( rmsnorm_e(embed(x_j)), rmsnorm_h(h_{j-1}) ) )    # embedding first
    o_j = head_layers(u_0 .. u_j)        # L hybrid layers: own Mamba states, own KV cache
    logits_j = lm_head(final_norm(o_j))  # predicts x_{j+1}

``embed``, ``final_norm`` and ``lm_head`` are the target's tensors, shared (never copied into the
head's checkpoint), with the target's embedding scale, tied embeddings and logit scale; the head's
norms use the target's ``rms_eps``. The head's own weights (``head_weight_shapes``)::

    fc            [d_model, 2 * d_model]   no bias; input = [normed embedding, normed hidden]
    norm_embed    [d_model]                rmsnorm_e
    norm_hidden   [d_model]                rmsnorm_h
    layers.{i}.*  as backend.hybrid.weights names them (mixer_mlp blocks, SwiGLU, full rotary)

Invariants:

- a head is bound to one target (``HeadModel(config, weights, target)``), whose ``d_model`` and
  ``vocab`` must equal the head's (``ValueError`` naming both);
- the head's layer pattern may be attention only (``HeadLayersConfig`` does not require a Mamba
  layer): its pool still exists, since every row carries ``h_{L-1}``, the target hidden state at
  the slot's last committed position (``PoolLayout.carried_hidden``), zeroed by a clear
  (``h_{-1} = 0``) and copied by a COW or snapshot with the rest of the row;
- a head's length always equals the target's committed length, so a head state at length ``L``
  depends on ``x_0 .. x_{L-1}`` only and is cacheable under the target's prefix key.

Checkpoints: one safetensors file with the head's own tensors (float32) and the metadata
``format = "batchc.head/1"`` (``checkpoint.HEAD_FORMAT``) and ``config`` (the ``HeadConfig`` as a JSON
object); ``load_head`` refuses a full model's file and ``load_checkpoint`` a head's, each by name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import numpy as np
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F

from backend.files import CheckpointError
from backend.hybrid import functional, reference
from backend.hybrid.checkpoint import FORMAT, HEAD_FORMAT, _regular_size, config_kwargs, read_safetensors
from backend.hybrid.config import LAYER_KINDS, MAX_LAYERS, HybridConfig, LayerKind
from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.model import HybridModel, greedy, rms_norm
from backend.hybrid.outputs import ForwardOut
from backend.hybrid.weights import Weights, _init_one, weight_shapes
from backend.kernels import checks
from backend.kernels.checks import require
from backend.model import HeadHook
from backend.pool import MambaStatePool, PoolLayout
from backend.readback import host_values, staged
from backend.staging import Captures, StagedExtend, StagedWindow
from ir.errors import short_repr
from ir.ids import DRAFT_POOL, PoolId

__all__ = [
    "DraftHeadHook", "HeadConfig", "HeadLayersConfig", "HeadModel", "check_head_weights", "checkpoint_format", "head_config_from_json",
    "head_weight_shapes", "init_head_weights", "is_head_checkpoint", "load_head", "pack_accepted", "read_head", "save_head",
]

_SHARED = ("embed", "final_norm", "lm_head")
"""The target's tensors the head uses and never owns."""


@attrs.frozen(kw_only=True)
class HeadLayersConfig(HybridConfig):
    """The head's layer stack as a ``HybridConfig`` (so the model, the training forward and the
    reference run it with the target's code): like any hybrid config, but an attention-only
    pattern is allowed (the head's pool carries the target's hidden state in any case)."""

    needs_mamba: ClassVar[bool] = False


def _pattern(value: object) -> tuple[LayerKind, ...]:
    """A layer pattern from a tuple/list of kinds or a string of them separated by commas or spaces."""
    if isinstance(value, str):
        value = [part for part in value.replace(",", " ").split() if part]
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"layers must be a tuple of {LAYER_KINDS} or a string of them, got {short_repr(value)}")
    return tuple(value)


_INT_FIELDS = ("d_model", "vocab", "nheads", "head_dim", "d_state", "ngroups", "conv_width", "chunk_size", "attn_heads",
               "attn_head_dim", "mlp_hidden")


@attrs.frozen(kw_only=True)
class HeadConfig:
    """The head's shape: ``d_model`` and ``vocab`` (the target's, checked when bound), its layer
    pattern (``"mamba"`` / ``"attn"``; a tuple, or a string such as ``"mamba,attn"``) and the
    Mamba2 / attention / MLP sizes as ``HybridConfig`` takes them (same bounds). ``ValueError``
    with a one-line message naming the bad value."""

    d_model: int
    vocab: int
    layers: tuple[LayerKind, ...] = attrs.field(converter=_pattern)
    nheads: int
    head_dim: int
    d_state: int
    ngroups: int = 1
    conv_width: int = 4
    chunk_size: int = 64
    attn_heads: int
    attn_head_dim: int
    rope_theta: float = 10000.0
    mlp_hidden: int

    def __attrs_post_init__(self) -> None:
        values = attrs.asdict(self, recurse=False)  # (read by name through attrs: no reflection)
        for name in _INT_FIELDS:
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {short_repr(value)}")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)):
            raise ValueError(f"rope_theta must be a number, got {short_repr(self.rope_theta)}")
        if not self.layers:
            raise ValueError("layers: a head needs at least one layer, got ()")
        if len(self.layers) > MAX_LAYERS:
            raise ValueError(f"layers: at most {MAX_LAYERS} layers, got {len(self.layers)}")
        bad = [k for k in self.layers if k not in ("mamba", "attn")]
        if bad:
            raise ValueError(f"head layer kinds must be 'mamba' or 'attn', got {bad[0]!r}")
        self.layers_config()  # the hybrid config's checks (sizes, groups, conv width, rotary)

    @classmethod
    def for_target(cls, target: HybridConfig, layers: tuple[LayerKind, ...] | str = ("mamba",)) -> HeadConfig:
        """A head of ``layers`` with the target's sizes (its Mamba2, attention and MLP dims)."""
        return cls(
            d_model=target.d_model, vocab=target.vocab, layers=layers, nheads=target.nheads, head_dim=target.head_dim,
            d_state=target.d_state, ngroups=target.ngroups, conv_width=target.conv_width, chunk_size=target.chunk_size,
            attn_heads=target.attn_heads, attn_head_dim=target.attn_head_dim, rope_theta=target.rope_theta,
            mlp_hidden=target.mlp_hidden,
        )

    def layers_config(self, target: HybridConfig | None = None) -> HeadLayersConfig:
        """The layer stack as a hybrid config: the head's sizes, with the target's ``rms_eps`` and
        shared-output switches (embedding scale, tied embeddings, logit scale) when given."""
        shared: dict[str, Any] = {}
        if target is not None:
            shared = {"rms_eps": target.rms_eps, "tie_embeddings": target.tie_embeddings, "embed_scale": target.embed_scale,
                      "logit_scale": target.logit_scale}
        return HeadLayersConfig(
            d_model=self.d_model, vocab=self.vocab, layers=self.layers, nheads=self.nheads, head_dim=self.head_dim,
            d_state=self.d_state, ngroups=self.ngroups, conv_width=self.conv_width, chunk_size=self.chunk_size,
            attn_heads=self.attn_heads, attn_head_dim=self.attn_head_dim, rope_theta=float(self.rope_theta),
            mlp_hidden=self.mlp_hidden, **shared,
        )

    @property
    def n_mamba(self) -> int:
        """How many Mamba layers the head's pattern has (0 for an attention-only head)."""
        return sum(1 for k in self.layers if k == "mamba")

    def pool_layout(self, conv_dtype: torch.dtype = torch.float32, ssm_dtype: torch.dtype = torch.float32) -> PoolLayout:
        """One ``MambaLayerSpec`` per Mamba layer, then the carried hidden vector (``d_model``
        elements of ``ssm_dtype``)."""
        c = self.layers_config()
        return PoolLayout(layers=[c.mamba_spec(conv_dtype, ssm_dtype)] * c.n_mamba, carried_hidden=self.d_model, carried_dtype=ssm_dtype)

    def to_json(self) -> str:
        """The config as a JSON object (``layers`` a list of strings), as a head checkpoint's ``config``
        metadata holds it."""
        fields = attrs.asdict(self)
        fields["layers"] = list(self.layers)
        return json.dumps(fields, sort_keys=True)


def head_weight_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the head owns and its shape (the exact key set of a head's weight dict)."""
    d = config.d_model
    shapes: dict[str, tuple[int, ...]] = {"fc": (d, 2 * d), "norm_embed": (d,), "norm_hidden": (d,)}
    shapes.update({n: s for n, s in weight_shapes(config.layers_config()).items() if n not in _SHARED})
    return shapes


def check_head_weights(config: HeadConfig, weights: Weights) -> None:
    """``ValueError`` unless ``weights`` has exactly the head's names and shapes, on one device, in
    one floating dtype."""
    shapes = head_weight_shapes(config)
    missing = sorted(shapes.keys() - weights.keys())
    extra = sorted(weights.keys() - shapes.keys())
    if missing or extra:
        raise ValueError(f"head weights do not match the config: missing {missing[:6]}, unexpected {extra[:6]}")
    wrong = [f"{n}: {tuple(weights[n].shape)} != {s}" for n, s in shapes.items() if tuple(weights[n].shape) != s]
    if wrong:
        raise ValueError(f"head weight shapes do not match the config: {wrong[:6]}")
    devices = {t.device for t in weights.values()}
    dtypes = {t.dtype for t in weights.values()}
    if len(devices) != 1 or len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(f"head weights must share one device and one floating dtype, got {devices} and {dtypes}")


def init_head_weights(config: HeadConfig, seed: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Weights:
    """Fresh head weights, a deterministic function of ``seed`` (drawn on the CPU in float32 in
    sorted-name order, as ``init_weights``): the layers as the hybrid model's, ``fc`` ``N(0, 1/(2 d))``,
    the two input norms 1."""
    gen = torch.Generator().manual_seed(seed)
    body = config.layers_config()
    shapes = head_weight_shapes(config)
    out: Weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name in ("norm_embed", "norm_hidden"):
            t = torch.ones(shape)
        elif name == "fc":
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        else:
            t = _init_one(name, shape, body, gen)
        out[name] = t.to(device=device, dtype=dtype)
    return out


class HeadModel:
    """A draft head bound to its target: config, own weights, and the target's shared tensors.

    ``body`` is the head's layer stack as a ``HybridModel`` whose weights are the head's layers plus
    the target's ``embed`` / ``final_norm`` / ``lm_head`` (the same tensors, not copies): the
    serving entry points run the target's kernels through it, fed ``u_j`` in place of embeddings.
    """

    def __init__(self, config: HeadConfig, weights: Weights, target: HybridModel) -> None:
        tc = target.config
        if config.d_model != tc.d_model:
            raise ValueError(f"head d_model {config.d_model} does not match the target's d_model {tc.d_model}")
        if config.vocab != tc.vocab:
            raise ValueError(f"head vocab {config.vocab} does not match the target's vocab {tc.vocab}")
        if target.collective is not None:
            raise ValueError("a draft head binds a whole target model, not a tensor-parallel shard")
        check_head_weights(config, weights)
        self.config = config
        self.target = target
        # the target's device and dtype (a no-op, grad kept, when they already are)
        self.weights: Weights = {n: t.to(device=target.device, dtype=target.dtype) for n, t in weights.items()}
        self.layers_config = config.layers_config(tc)
        shared = {n: target.weights[n] for n in _SHARED if n in target.weights}
        self.body = HybridModel(self.layers_config, {**{n: t for n, t in self.weights.items() if n.startswith("layers.")}, **shared})

    @classmethod
    def from_seed(cls, config: HeadConfig, target: HybridModel, seed: int) -> HeadModel:
        """A head of ``config`` bound to ``target`` with fresh weights from ``seed`` (``init_head_weights``),
        on the target's device and in its dtype."""
        return cls(config, init_head_weights(config, seed, dtype=target.dtype, device=target.device), target)

    @property
    def device(self) -> torch.device:
        """The target's device: the head's weights live there too."""
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        """The target's compute dtype: the head's weights are cast to it."""
        return self.target.dtype

    @property
    def vocab(self) -> int:
        """The vocabulary size, the target's."""
        return self.config.vocab

    # ---- the input pair -> u ------------------------------------------------------------------

    def _inputs(self, prev_hidden: torch.Tensor, ids: torch.Tensor, w: Weights | None = None) -> torch.Tensor:
        """``u`` for pairs ``(prev_hidden[..., :], ids[...])`` in the serving dtype (the serving path)."""
        w = self.weights if w is None else w
        eps = self.layers_config.rms_eps
        e = rms_norm(self.body._embed(ids), w["norm_embed"], eps)
        h = rms_norm(prev_hidden.to(self.dtype), w["norm_hidden"], eps)
        return torch.cat((e, h), dim=-1) @ w["fc"].T

    # ---- cache-free forms: training and the reference -------------------------------------------

    def forward_train(
        self, hidden: torch.Tensor, ids: torch.Tensor, *, weights: Weights | None = None, chunk: int | None = None
    ) -> torch.Tensor:
        """Float32 logits ``[B, T, V]`` for target hidden states ``hidden [B, T, d]`` and tokens
        ``ids [B, T]`` (int64, every row from position 0): position ``j`` pairs ``(hidden[:, j-1],
        ids[:, j])`` (zeros before position 0) and predicts ``ids[:, j+1]``. Differentiable in the
        head's weights (``weights``: a dict of the head's names to use instead of ``self.weights``,
        e.g. tensors that require grad) and in ``hidden``; the target's tensors are used as they are."""
        if ids.dim() != 2 or ids.dtype != torch.int64 or ids.shape[1] == 0:
            raise ValueError(f"ids must be an int64 [batch, length] tensor with length >= 1, got {ids.dtype} {tuple(ids.shape)}")
        d = self.config.d_model
        if tuple(hidden.shape) != (*ids.shape, d):
            raise ValueError(f"hidden must be [batch, length, {d}] = {(*ids.shape, d)}, got {tuple(hidden.shape)}")
        w = self.weights if weights is None else weights
        c = self.layers_config
        tw = self.target.weights
        emb = F.embedding(ids, tw["embed"].float()) * c.embed_scale
        prev = torch.cat((torch.zeros_like(hidden[:, :1]), hidden[:, :-1]), dim=1).float()
        u = torch.cat((functional._rms(emb, c.rms_eps) * w["norm_embed"].float(), functional._rms(prev, c.rms_eps) * w["norm_hidden"].float()), dim=-1)
        o = functional.forward_layers(c, w, u @ w["fc"].float().T, chunk=chunk)
        out = tw["embed" if c.tie_embeddings else "lm_head"].float()
        return ((functional._rms(o, c.rms_eps) * tw["final_norm"].float()) @ out.T) * c.logit_scale

    def reference(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The cache-free oracle: float32 logits ``[T, V]`` of the head over a whole sequence from
        ``h_{-1} = 0``, given the target's hidden states ``hidden [T, d]`` of the same tokens
        ``ids [T]`` (e.g. from ``backend.hybrid.reference.reference_hidden``). Written with the
        token-loop reference's layers (``backend.hybrid.reference``), independent of the kernels."""
        return self.reference_outputs(hidden, ids)[0]

    def reference_outputs(self, hidden: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``reference``'s logits and the head's own output hidden states ``o [T, d]`` (float32),
        which a proposal step feeds in place of the target's hidden (``reference_propose``)."""
        if ids.dim() != 1 or ids.dtype != torch.int64 or ids.shape[0] == 0:
            raise ValueError(f"ids must be an int64 [length] tensor with length >= 1, got {ids.dtype} {tuple(ids.shape)}")
        d = self.config.d_model
        if tuple(hidden.shape) != (ids.shape[0], d):
            raise ValueError(f"hidden must be [length, {d}] = {(ids.shape[0], d)}, got {tuple(hidden.shape)}")
        c = self.layers_config
        w = {n: t.float() for n, t in self.weights.items()}
        tw = self.target.weights
        emb = tw["embed"].float()[ids.to(self.device)] * c.embed_scale
        prev = torch.cat((torch.zeros_like(hidden[:1]), hidden[:-1])).float().to(self.device)
        u = torch.cat((reference._norm(emb, w["norm_embed"], c.rms_eps), reference._norm(prev, w["norm_hidden"], c.rms_eps)), dim=-1) @ w["fc"].T
        o = reference.reference_layers(self.body, u)
        out = tw["embed" if c.tie_embeddings else "lm_head"].float()
        return (reference._norm(o, tw["final_norm"].float(), c.rms_eps) @ out.T) * c.logit_scale, o

    def reference_propose(self, hidden: torch.Tensor, ids: torch.Tensor, pending: int, k: int) -> list[int]:
        """The cache-free proposal: ``k`` greedy tokens after the committed ``ids [L]`` (target
        hidden ``hidden [L, d]``) and the pending token, step ``i > 1`` pairing the head's own
        output at the previous position with the previous proposal, all recomputed from scratch."""
        seq_h, seq_ids = hidden.float(), torch.cat((ids, torch.tensor([pending], dtype=torch.int64, device=ids.device)))
        out: list[int] = []
        for _ in range(k):
            logits, o = self.reference_outputs(torch.cat((seq_h, torch.zeros_like(seq_h[:1]))), seq_ids)
            token = int(logits[-1].argmax())
            out.append(token)
            seq_h = torch.cat((seq_h, o[-1:].to(seq_h.device)))
            seq_ids = torch.cat((seq_ids, torch.tensor([token], dtype=torch.int64, device=ids.device)))
        return out

    # ---- backend state ----------------------------------------------------------------------------

    def pool_layout(self) -> PoolLayout:
        """The head's pool layout in float32: its Mamba layers, then the carried target hidden state."""
        return self.config.pool_layout()

    def new_pool(
        self, capacity: int, *, pool_id: PoolId = DRAFT_POOL, conv_dtype: torch.dtype = torch.float32, ssm_dtype: torch.dtype = torch.float32
    ) -> MambaStatePool:
        """A fresh, zeroed state pool of ``capacity`` slots for this head (the draft's pool id by default),
        on the head's device."""
        return MambaStatePool(pool_id, self.config.pool_layout(conv_dtype, ssm_dtype), capacity, device=self.device)

    def new_kv_cache(self, capacity: int) -> KVCache:
        """The head's own KV cache (its attention layers), addressed by the target's KV locations."""
        return self.body.new_kv_cache(capacity)

    def new_token_table(self, max_slots: int, max_len: int) -> TokenTable:
        """A token table (slot and position to KV location) for the head's attention layers."""
        return self.body.new_token_table(max_slots, max_len)

    def reads_target_hidden(self) -> bool:
        """A draft head (``backend.model.ReadsTargetHidden``): its phases read the target's hidden states."""
        return True

    def captures_inner_states(self) -> bool:
        """Its extends capture states inside a chunk, the carried hidden included."""
        return True

    def serving_hook(self, *, capacity: int, kv_capacity: int, max_len: int) -> DraftHeadHook:
        """This head behind ``backend.model.HeadHook``, with a fresh KV cache and token table."""
        hook = DraftHeadHook(self, self.new_kv_cache(kv_capacity), self.new_token_table(capacity, max_len))
        _fits: HeadHook = hook  # mypy checks here that the hook fits the protocol the executor holds
        return hook

    def _check_pool(self, pool: MambaStatePool) -> None:
        lay = pool.layout
        specs_ok = len(lay.layers) == self.config.n_mamba and all(s == self.layers_config.mamba_spec(s.conv_dtype, s.ssm_dtype) for s in lay.layers)
        require(specs_ok and lay.carried_hidden == self.config.d_model,
                f"the pool's layout is not this head's (its Mamba layers and a carried hidden of {self.config.d_model})")

    # ---- serving entry points -------------------------------------------------------------------

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
        hidden: torch.Tensor,
        captures: Captures | None = None,
    ) -> ForwardOut:
        """The head over ``n`` packed sequences (``HybridModel.extend``'s arguments, same meaning),
        given the target's hidden states at the same tokens, ``hidden [total, d_model]``.

        Sequence ``i``'s token ``j`` (position ``s + j``, ``s = prefix_lens[i]``) pairs with the
        target hidden at position ``s + j - 1``: ``hidden`` of the previous token for ``j > 0``, the
        row's carried hidden for ``j = 0`` (zeros after a clear); afterwards the row carries the
        hidden of the sequence's last token. Used for both the head extend after a target prefill
        chunk and the head commit after a verify (window tokens ``p, d1..dm`` with the verify's
        hidden at window positions ``0..m``: ``pack_accepted``). ``captures``: the Mamba states and
        the carried hidden (that of the ``at[j]``-th token) after the first ``at[j]`` tokens.
        Returns the logits and the head's output hidden at each sequence's last token.
        """
        self._check_pool(pool)
        self.body._check_rows(pool, kv, table, slots)
        n = slots.shape[0]
        total = input_ids.shape[0] if input_ids.dim() == 1 else -1
        checks.check_tensor("hidden", hidden, shape=(total, self.config.d_model), device=pool.device)
        require(cu_seqlens.dtype == torch.int64, f"cu_seqlens must be int64, got {cu_seqlens.dtype}")
        checks.check_tensor("cu_seqlens", cu_seqlens, shape=(n + 1,), device=pool.device)
        bounds = host_values(cu_seqlens).tolist()  # (staged: the host's values, no readback)
        require(bounds[0] == 0 and bounds[-1] == total and all(a < b for a, b in zip(bounds, bounds[1:], strict=False)),
                f"cu_seqlens must rise from 0 to {total} by at least one per sequence, got {bounds[:8]}")
        carried = pool.carried_hidden()
        rows = slots.clamp(min=0)
        prev = torch.empty((total, self.config.d_model), dtype=carried.dtype, device=pool.device)
        if total:
            prev[1:] = hidden[:-1].to(carried.dtype)
            prev[cu_seqlens[:-1]] = carried[rows]  # the first token of each sequence: the carried hidden
        out = self.body.extend(
            pool, kv, table, slots=slots, cu_seqlens=cu_seqlens, prefix_lens=prefix_lens, input_ids=input_ids,
            positions=positions, kv_locs=kv_locs, captures=captures, embeds=self._inputs(prev, input_ids),
        )
        if captures is not None and captures.seq:
            at = torch.tensor([int(cu_seqlens[q]) + a - 1 for q, a in zip(captures.seq, captures.at, strict=True)], device=pool.device)
            captures.into.carried_hidden()[1 : 1 + len(captures.seq)] = hidden[at].to(carried.dtype)
        if n:
            live = slots >= 0
            carried[slots[live]] = hidden[cu_seqlens[1:] - 1][live].to(carried.dtype)
        return out

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
        """``k`` greedy proposals per row, ``[n, k]``, after the committed length ``c = positions``
        with the pending token ``input_ids [n]``: step 1 pairs the carried hidden ``h_{c-1}`` with the
        pending token, step ``i > 1`` the head's own output hidden of step ``i - 1`` with proposal
        ``i - 1``. The pool is not written (the rows are copied to a scratch pool); step ``j`` writes
        the head's KV at ``kv_locs[:, j]`` (``kv_locs [n, W]``, ``W >= k``: a window's locations,
        overwritten by the commit) and the table entry ``positions + j``."""
        self._check_pool(pool)
        device = pool.device
        checks.check_index("slots", slots, length=None, device=device)
        n = slots.shape[0]
        require(k >= 1, f"k must be positive, got {k}")
        for name, t, shape in (("input_ids", input_ids, (n,)), ("positions", positions, (n,))):
            require(t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}")
            checks.check_tensor(name, t, shape=shape, device=device)
        require(kv_locs.dtype == torch.int64 and kv_locs.dim() == 2 and kv_locs.shape[0] == n and kv_locs.shape[1] >= k,
                f"kv_locs must be int64 [{n}, >= {k}], got {kv_locs.dtype} {tuple(kv_locs.shape)}")
        self.body._check_rows(pool, kv, table, slots)
        tokens = torch.zeros((n, k), dtype=torch.int64, device=device)
        if n == 0:
            return tokens
        scratch = MambaStatePool(pool.pool_id, pool.layout, n, device=device)
        scratch.buffer[1:] = pool.buffer[slots.clamp(min=0)]
        # the rows' scratch slots and each step's positions, their values known on the host (as ``HybridModel.propose``'s)
        known_slots, known_positions = host_values(slots), host_values(positions)
        rows = staged(torch.where(slots >= 0, torch.arange(1, n + 1, device=device), -1),
                      np.where(known_slots >= 0, np.arange(1, n + 1, dtype=np.int64), -1))
        prev: torch.Tensor = scratch.carried_hidden()[1:]
        fed = input_ids
        for j in range(k):
            out = self.body._decode(
                scratch, rows, kv, table, slots, fed, staged(positions + j, known_positions + j), kv_locs[:, j].contiguous(),
                embeds=self._inputs(prev, fed),
            )
            fed = greedy(out.logits)
            tokens[:, j] = fed
            prev = out.hidden
        return tokens


def pack_accepted(hidden: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The head commit's ``hidden``: row ``i``'s first ``lens[i]`` positions of a verify's hidden
    ``[n, W, d]`` (``lens = accepted + 1``, the commit's extend lengths, rows in the commit's
    order), packed ``[sum(lens), d]``."""
    require(hidden.dim() == 3 and lens.dim() == 1 and lens.shape[0] == hidden.shape[0], f"hidden [n, W, d] and lens [n], got {tuple(hidden.shape)} and {tuple(lens.shape)}")
    if lens.numel():
        require(int(lens.min()) >= 1 and int(lens.max()) <= hidden.shape[1], f"lens must lie in [1, {hidden.shape[1]}], got {lens.tolist()[:8]}")
    keep = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lens.to(hidden.device)[:, None]
    return hidden[keep]


class DraftHeadHook:
    """A head behind ``backend.model.HeadHook``: the head, its KV cache and token table. Row order
    and staging as the target's hook (``backend.hybrid.hook.HybridHook``)."""

    def __init__(self, head: HeadModel, kv: KVCache, table: TokenTable) -> None:
        self.head = head
        self.kv = kv
        self.table = table

    def captures_inner_states(self) -> bool:
        """Always True: the head's extends capture states inside a chunk, the carried hidden included."""
        return True

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst``'s first ``length`` KV locations become slot ``src``'s (the token table's rows)."""
        self.table.copy_prefix(src, dst, length)

    def extend(self, staged: StagedExtend, hidden: torch.Tensor, pool: MambaStatePool) -> torch.Tensor:
        """Head extend (after a prefill chunk: ``staged`` is the chunk's, ``hidden`` the target's
        ``ForwardOut.all_hidden``) or head commit (``staged`` from the ``DraftExtendBatch`` of the
        window tokens ``p, d1..dm``, ``hidden = pack_accepted(verify hidden, accepted + 1)``).
        Returns the logits at each sequence's last token."""
        return self.head.extend(
            pool, self.kv, self.table, slots=staged.slots, cu_seqlens=staged.cu_seqlens, prefix_lens=staged.prefix_lens,
            input_ids=staged.input_ids, positions=staged.positions, kv_locs=staged.kv_locs, hidden=hidden, captures=staged.captures,
        ).logits

    def propose(self, staged: StagedWindow, k: int, pool: MambaStatePool) -> torch.Tensor:
        """``[n, k]`` proposals from a draft window (pending token, window positions and KV locations)."""
        return self.head.propose(
            pool, self.kv, self.table, slots=staged.slots, input_ids=staged.input_ids,
            positions=_first(staged.positions), kv_locs=staged.kv_locs, k=k,
        )


def _first(positions: torch.Tensor) -> torch.Tensor:
    """A staged window's first column, ``[n]``, marked with its host values as the window is."""
    return staged(positions[:, 0].contiguous(), host_values(positions)[:, 0].copy())


# ---- checkpoints ------------------------------------------------------------------------------------


def save_head(path: str | Path, config: HeadConfig, weights: Weights, *, metadata: Mapping[str, str] | None = None) -> None:
    """Write the head's own weights (float32, CPU) and ``config`` to the safetensors file ``path``
    (``ValueError`` for weights that do not match, non-finite values or a reserved metadata key)."""
    check_head_weights(config, weights)
    for name in sorted(weights):
        if not bool(torch.isfinite(weights[name]).all()):
            raise ValueError(f"head weight {name!r} has non-finite values")
    extra = dict(metadata or {})
    reserved = sorted(set(extra) & {"format", "config"})
    if reserved:
        raise ValueError(f"metadata keys {reserved} are reserved")
    tensors = {n: t.detach().to(device="cpu", dtype=torch.float32).contiguous() for n, t in weights.items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(path), metadata={**extra, "format": HEAD_FORMAT, "config": config.to_json()})


def checkpoint_format(path: str | Path) -> str | None:
    """The ``format`` metadata of the safetensors file ``path`` (``None`` when it has none), read
    from the header only (``CheckpointError`` for a file that is not a readable safetensors file)."""
    p = Path(path)
    _regular_size(p)
    try:
        with safetensors.safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # the Rust reader raises SafetensorError; OSError and odd bytes too
        raise CheckpointError(p, f"not a safetensors file or corrupt ({e})") from None
    fmt = meta.get("format")
    return fmt if isinstance(fmt, str) else None


def is_head_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a draft head's checkpoint (its ``format`` is ``HEAD_FORMAT``)."""
    return checkpoint_format(path) == HEAD_FORMAT


def head_config_from_json(path: str | Path, text: str) -> HeadConfig:
    """Parse and validate a head's ``config`` metadata (``CheckpointError`` naming the field)."""
    kwargs = config_kwargs(path, text, HeadConfig, "head config")
    try:
        return HeadConfig(**kwargs)
    except ValueError as e:
        raise CheckpointError(path, f"bad head config: {e}") from None


def read_head(path: str | Path) -> tuple[HeadConfig, Weights, dict[str, str]]:
    """The validated config, float32 CPU weights and all metadata of the head checkpoint ``path``
    (``CheckpointError``, one line starting with the file: a full model's file is refused by
    name). Names and shapes are checked from the header before any tensor is read."""
    p = Path(path)
    _regular_size(p)  # a regular file within MAX_CHECKPOINT_BYTES
    return read_safetensors(p, lambda f: _read_head(p, f, dict(f.metadata() or {})))


def _read_head(p: Path, f: Any, meta: dict[str, str]) -> tuple[HeadConfig, Weights, dict[str, str]]:
    fmt = meta.get("format")
    if fmt is None:
        raise CheckpointError(p, f"has no format metadata: not a draft head checkpoint (format {HEAD_FORMAT!r})")
    if fmt == FORMAT:
        raise CheckpointError(p, f"is a full model checkpoint (format {FORMAT!r}), not a draft head (format {HEAD_FORMAT!r})")
    if fmt != HEAD_FORMAT:
        raise CheckpointError(p, f"unsupported format {short_repr(fmt)}, expected {HEAD_FORMAT!r}")
    if "config" not in meta:
        raise CheckpointError(p, "missing head config metadata 'config'")
    config = head_config_from_json(p, meta["config"])
    shapes = head_weight_shapes(config)
    names = set(f.keys())
    for label, extra in (("missing", sorted(shapes.keys() - names)), ("unexpected", sorted(names - shapes.keys()))):
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(p, f"{label} tensor {extra[0]!r}{more}")
    for name in sorted(shapes):
        shape = tuple(f.get_slice(name).get_shape())
        if shape != shapes[name]:
            raise CheckpointError(p, f"tensor {name!r} has shape {shape}, expected {shapes[name]}")
    weights: Weights = {}
    for name in sorted(shapes):
        t = f.get_tensor(name)
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(p, f"tensor {name!r} has dtype {t.dtype}, expected torch.float32")
        t = t.float()
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise CheckpointError(p, f"tensor {name!r} has {bad} non-finite values (of {t.numel()})")
        weights[name] = t
    return config, weights, meta


def load_head(path: str | Path, target: HybridModel) -> HeadModel:
    """The head stored in ``path`` bound to ``target`` (on its device, in its dtype);
    ``CheckpointError`` for a bad file or a head whose ``d_model``/``vocab`` differ from the target's."""
    config, weights, _ = read_head(path)
    try:
        return HeadModel(config, weights, target)
    except ValueError as e:
        raise CheckpointError(path, str(e)) from None
