"""Tensor-parallel shards of a ``HybridModel``: rank ``r`` of ``world`` holds a slice of every layer,
and ``backend.hybrid.model`` sums the partial outputs across ranks (``Collective``).

How each part is split (Megatron-style; the residual stream, norms, embeddings and the output
projection are replicated):

- Mamba2 mixer, by heads: ``in_proj``'s rows of ``z``, ``x`` and ``dt`` for the rank's heads, and of
  ``B`` and ``C`` for the groups those heads read: split when ``ngroups % world == 0``, else (when
  ``world % ngroups == 0``) the one group of the rank's heads, repeated on the ranks that share it;
  the conv's channels alike; ``dt_bias``, ``A_log``, ``D`` and the gated norm's weight by head;
  ``out_proj`` by columns, its partial outputs summed across ranks. The gated norm is local when
  every rank holds whole norm groups (``norm_groups % world == 0``); otherwise each rank's slice
  lies in one norm group and the group's sum of squares is summed across ranks first.
- attention, by query heads and KV heads (the KV heads split when ``kv_heads % world == 0``, else
  the one KV head of the rank's query heads, repeated on the ranks that share it): ``q/k/v_proj``
  rows, ``o_proj`` columns, partial outputs summed.
- MLP: ``gate/up_proj`` rows, ``down_proj`` columns, partial outputs summed.

Each rank's pools and KV cache are those of its shard's config (the rank's heads and channels);
slot ids, KV locations and the token table are the same on every rank. ``check_tp`` refuses, in one
line naming the size, a ``world`` that does not divide what must be split.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import attrs
import torch

from backend.hybrid.config import HybridConfig
from backend.hybrid.head import HeadModel
from backend.hybrid.model import Collective, HybridModel, NormSplit, ShardOrigin
from backend.hybrid.weights import Weights, check_weights
from ir.columns import int_problem
from ir.errors import short_repr

__all__ = ["check_tp", "fingerprint", "head_fingerprint", "shard_config", "shard_model", "shard_weights"]


def check_tp(config: HybridConfig, world: int) -> None:
    """``ValueError`` naming the size unless ``config`` can be split over ``world`` ranks."""
    given: object = config
    if not isinstance(given, HybridConfig):
        raise ValueError(f"config must be a HybridConfig, got {short_repr(given)}")
    problem = int_problem(world)
    if problem is not None or world < 1:
        raise ValueError(f"tp must be a positive int, got {world!r}")
    c = config
    if c.nheads % world:
        raise ValueError(f"tp {world} does not divide the {c.nheads} Mamba heads")
    if c.ngroups % world and world % c.ngroups:
        raise ValueError(f"tp {world} neither divides the {c.ngroups} Mamba groups nor is a multiple of them")
    ng = c.gated_norm_groups
    if ng % world and world % ng:
        raise ValueError(f"tp {world} neither divides the {ng} gated-norm groups nor is a multiple of them")
    if c.n_attn and c.attn_heads % world:
        raise ValueError(f"tp {world} does not divide the {c.attn_heads} attention heads")
    if c.n_attn and c.kv_heads % world and world % c.kv_heads:
        raise ValueError(f"tp {world} neither divides the {c.kv_heads} KV heads nor is a multiple of them")
    if c.mlp_layers and c.mlp_hidden % world:
        raise ValueError(f"tp {world} does not divide the MLP width {c.mlp_hidden}")


def shard_config(config: HybridConfig, world: int) -> HybridConfig:
    """The config of one rank's shard (every rank's is the same)."""
    check_tp(config, world)
    c = config
    ng = c.gated_norm_groups
    heads, kv = (c.attn_heads // world, max(1, c.kv_heads // world)) if c.n_attn else (c.attn_heads, c.kv_heads)
    return attrs.evolve(
        c, nheads=c.nheads // world, ngroups=c.ngroups // world if c.ngroups % world == 0 else 1,
        attn_heads=heads, attn_kv_heads=None if kv == heads else kv,
        mlp_hidden=c.mlp_hidden // world if c.mlp_layers else c.mlp_hidden,
        norm_groups=ng // world if ng % world == 0 else 1,
    )


def _rows(t: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t[a:b] for a, b in parts], dim=0)


def shard_weights(config: HybridConfig, weights: Weights, rank: int, world: int) -> Weights:
    """Rank ``rank``'s slice of every weight (copies; the full weights are not kept). ``ValueError``
    naming the weight if a slice holds a NaN or an infinity."""
    check_tp(config, world)
    problem = int_problem(rank)
    if problem is not None or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {short_repr(rank)}")
    check_weights(config, weights)
    c = config
    H, P, G, N = c.nheads, c.head_dim, c.ngroups, c.d_state
    d_in = c.d_inner
    h0, h1 = rank * H // world, (rank + 1) * H // world
    if G % world == 0:
        g0, g1 = rank * G // world, (rank + 1) * G // world
    else:  # each rank's heads read one group
        g0 = h0 // (H // G)
        g1 = g0 + 1
    x_rows = (h0 * P, h1 * P)
    b_rows = (d_in + g0 * N, d_in + g1 * N)
    c_rows = (d_in + G * N + g0 * N, d_in + G * N + g1 * N)
    conv_parts = [x_rows, b_rows, c_rows]  # within xBC
    in_parts = [x_rows, *((d_in + a, d_in + b) for a, b in conv_parts), (d_in + c.conv_dim + h0, d_in + c.conv_dim + h1)]
    hd = c.attn_head_dim
    q_rows = (rank * c.attn_heads // world * hd, (rank + 1) * c.attn_heads // world * hd)
    if c.kv_heads % world == 0:
        kv_rows = (rank * c.kv_heads // world * hd, (rank + 1) * c.kv_heads // world * hd)
    else:  # fewer KV heads than ranks: the one KV head this rank's query heads read, repeated on the ranks that share it
        kv_head = (rank * c.attn_heads // world) // (c.attn_heads // c.kv_heads)
        kv_rows = (kv_head * hd, (kv_head + 1) * hd)
    m_rows = (rank * c.mlp_hidden // world, (rank + 1) * c.mlp_hidden // world)
    out: Weights = {}
    for name, w in weights.items():
        leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if leaf == "mixer.in_proj":
            s = _rows(w, in_parts)
        elif leaf in ("mixer.conv_weight", "mixer.conv_bias"):
            s = _rows(w, conv_parts)
        elif leaf in ("mixer.dt_bias", "mixer.A_log", "mixer.D"):
            s = w[h0:h1]
        elif leaf == "mixer.norm":
            s = w[x_rows[0] : x_rows[1]]
        elif leaf == "mixer.out_proj":
            s = w[:, x_rows[0] : x_rows[1]]
        elif leaf == "mixer.q_proj":
            s = w[q_rows[0] : q_rows[1]]
        elif leaf in ("mixer.k_proj", "mixer.v_proj"):
            s = w[kv_rows[0] : kv_rows[1]]
        elif leaf == "mixer.o_proj":
            s = w[:, q_rows[0] : q_rows[1]]
        elif leaf in ("mlp.gate_proj", "mlp.up_proj"):
            s = w[m_rows[0] : m_rows[1]]
        elif leaf == "mlp.down_proj":
            s = w[:, m_rows[0] : m_rows[1]]
        else:  # norms, embeddings, the output projection: replicated
            s = w
        if not bool(torch.isfinite(s).all()):  # every load path refuses these; a model built in memory may hold them
            raise ValueError(f"rank {rank} of {world}: its shard of weight {name!r} has {int((~torch.isfinite(s)).sum())} "
                             "non-finite values (NaN or infinity); a model with them computes no meaningful logits")
        out[name] = s.contiguous().clone()
    return out


_SAMPLE = 4096
"""Elements of each weight that go into a fingerprint (evenly strided over the whole tensor)."""


def fingerprint(model: HybridModel) -> str:
    """A short digest of ``model``: its config, and every weight's name, dtype, shape and an evenly
    strided sample of its values (a few thousand per tensor, so it costs next to nothing on any
    size). Two ranks that loaded different checkpoints, seeds or dtypes get different ones."""
    given: object = model
    if not isinstance(given, HybridModel):
        raise ValueError(f"model must be a HybridModel, got {short_repr(given)}")
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(attrs.asdict(model.config), sort_keys=True, default=str).encode())
    h.update(_weights_digest(model.weights))
    return h.hexdigest()


def _weights_digest(weights: Mapping[str, torch.Tensor]) -> bytes:
    """Every weight's name, dtype, shape and an evenly strided sample of its values, digested."""
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(weights):
        w = weights[name].detach()
        flat = w.reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE)][:_SAMPLE].contiguous()
        h.update(f"{name}|{w.dtype}|{tuple(w.shape)}|".encode())
        h.update(sample.view(torch.uint8).cpu().numpy().tobytes())
    return h.digest()


def head_fingerprint(head: HeadModel) -> str:
    """``fingerprint``'s digest of a draft head (its config and weights) and of the whole target it
    is bound to: ranks that hold another head, or a head bound to another target, differ."""
    given: object = head
    if not isinstance(given, HeadModel):
        raise ValueError(f"head must be a HeadModel, got {short_repr(given)}")
    h = hashlib.blake2b(digest_size=12)
    h.update(head.config.to_json().encode())
    h.update(_weights_digest(head.weights))
    h.update(fingerprint(head.target).encode())
    return h.hexdigest()


def shard_model(model: HybridModel, rank: int, world: int, collective: Collective) -> HybridModel:
    """Rank ``rank``'s shard of ``model``, summing its partial outputs through ``collective``."""
    given: object = model
    if not isinstance(given, HybridModel):
        raise ValueError(f"model must be a HybridModel, got {short_repr(given)}")
    if not isinstance(collective, Collective):
        raise ValueError(f"collective must have all_reduce_sum (a Collective), got {short_repr(collective)}")
    c = model.config
    local = shard_config(c, world)
    ng = c.gated_norm_groups
    split = None
    if ng % world:  # this rank's slice of the mixer width lies inside one norm group, shared with other ranks
        group_width = c.d_inner // ng
        split = NormSplit(groups=ng, width=group_width, group=(rank * c.d_inner // world) // group_width)
    origin = ShardOrigin(fingerprint=fingerprint(model), rank=rank, world=world)
    return HybridModel(local, shard_weights(c, model.weights, rank, world), collective=collective, norm_split=split, origin=origin)
