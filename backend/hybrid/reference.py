"""A cache-free, kernel-free oracle of ``HybridModel``: the whole sequence from scratch.

Written independently of ``backend.hybrid.model`` and of ``backend.kernels``/``backend.reference``:
no pool, no KV cache, no table; the conv is an explicit window over a zero-padded stream, the scan
a token loop, attention a full causal matrix. Float32 throughout (weights are upcast), so the tests
compare the cached, kernel-driven forward against it at float32 precision.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from backend.hybrid.model import HybridModel

__all__ = ["greedy_generate_reference", "reference_hidden", "reference_layers", "reference_logits"]


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float, dims: int) -> torch.Tensor:
    """``x [L, H, hd]`` at positions ``0..L-1``, rotate-half form on the first ``dims`` dims."""
    length, _, hd = x.shape
    if dims < hd:
        return x if dims == 0 else torch.cat([_rope(x[..., :dims], theta, dims), x[..., dims:]], dim=-1)
    half = hd // 2
    inv_freq = (theta ** (-torch.arange(half, dtype=torch.float64) / half)).float().to(x.device)
    angles = torch.arange(length, device=x.device).float()[:, None] * inv_freq  # [L, half]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _mamba(model: HybridModel, i: int, x: torch.Tensor) -> torch.Tensor:
    c = model.config
    w = {name: t.float() for name, t in model.weights.items() if name.startswith(f"layers.{i}.mixer.")}
    p = f"layers.{i}.mixer"
    length = x.shape[0]
    proj = x @ w[f"{p}.in_proj"].T
    z, xbc, dt = proj[:, : c.d_inner], proj[:, c.d_inner : c.d_inner + c.conv_dim], proj[:, c.d_inner + c.conv_dim :]

    # causal depthwise conv: output t sees inputs t-width+1 .. t (zeros before the sequence)
    width = c.conv_width
    stream = torch.cat([torch.zeros(width - 1, c.conv_dim, device=x.device), xbc], dim=0)
    conv = torch.stack([(stream[t : t + width].T * w[f"{p}.conv_weight"]).sum(dim=1) for t in range(length)])
    conv = F.silu(conv + w[f"{p}.conv_bias"])

    gn = c.ngroups * c.d_state
    xs = conv[:, : c.d_inner].reshape(length, c.nheads, c.head_dim)
    per_group = c.nheads // c.ngroups
    Bs = conv[:, c.d_inner : c.d_inner + gn].reshape(length, c.ngroups, c.d_state).repeat_interleave(per_group, dim=1)
    Cs = conv[:, c.d_inner + gn :].reshape(length, c.ngroups, c.d_state).repeat_interleave(per_group, dim=1)
    A = -torch.exp(w[f"{p}.A_log"])
    D = w[f"{p}.D"]
    dts = F.softplus(dt + w[f"{p}.dt_bias"])  # [L, H]
    if c.clamps_dt:
        dts = dts.clamp(c.dt_min, c.dt_max)

    state = torch.zeros(c.nheads, c.head_dim, c.d_state, device=x.device)
    ys = []
    for t in range(length):
        decay = torch.exp(dts[t] * A)  # [H]
        state = state * decay[:, None, None] + dts[t][:, None, None] * xs[t][:, :, None] * Bs[t][:, None, :]
        y = torch.einsum("hpn,hn->hp", state, Cs[t]) + D[:, None] * xs[t]
        ys.append(y.reshape(c.d_inner) * F.silu(z[t]))
    y = torch.stack(ys)  # [L, d_inner]

    groups = c.gated_norm_groups
    grouped = y.reshape(length, groups, c.d_inner // groups)
    y = (grouped * torch.rsqrt(grouped.square().mean(dim=-1, keepdim=True) + c.rms_eps)).reshape(length, c.d_inner)
    return (y * w[f"{p}.norm"]) @ w[f"{p}.out_proj"].T


def _attention(model: HybridModel, i: int, x: torch.Tensor) -> torch.Tensor:
    c = model.config
    p = f"layers.{i}.mixer"
    w = {name: model.weights[f"{p}.{name}"].float() for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    length = x.shape[0]
    q = _rope((x @ w["q_proj"].T).reshape(length, c.attn_heads, c.attn_head_dim), c.rope_theta, c.rope_dims)
    k = _rope((x @ w["k_proj"].T).reshape(length, c.kv_heads, c.attn_head_dim), c.rope_theta, c.rope_dims)
    v = (x @ w["v_proj"].T).reshape(length, c.kv_heads, c.attn_head_dim)
    rep = c.attn_heads // c.kv_heads  # query head h reads KV head h // rep
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = 1 / math.sqrt(c.attn_head_dim) if c.attn_scale is None else c.attn_scale
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hts,shd->thd", probs, v).reshape(length, c.attn_dim)
    return out @ w["o_proj"].T


def reference_hidden(model: HybridModel, tokens: list[int]) -> torch.Tensor:
    """Residual stream after the last layer (before the final norm), ``[len(tokens), d_model]``."""
    if not tokens:
        raise ValueError("reference_hidden needs at least one token")
    c = model.config
    return reference_layers(model, model.weights["embed"].float()[torch.tensor(tokens, dtype=torch.int64, device=model.device)] * c.embed_scale)


def reference_layers(model: HybridModel, h: torch.Tensor) -> torch.Tensor:
    """The layer stack of ``model`` on the float32 residual stream ``h [L, d_model]`` (positions
    ``0..L-1``) -> the stream after the last layer (a draft head feeds its own input through this)."""
    c = model.config
    for i, kind in enumerate(c.layers):
        x = _norm(h, model.weights[f"layers.{i}.norm"].float(), c.rms_eps)
        if kind == "mlp":
            h = h + _mlp(model, i, x) * c.residual_scale
            continue
        h = h + (_mamba(model, i, x) if kind == "mamba" else _attention(model, i, x)) * c.residual_scale
        if c.block == "mixer_mlp":
            x = _norm(h, model.weights[f"layers.{i}.mlp_norm"].float(), c.rms_eps)
            h = h + _mlp(model, i, x) * c.residual_scale
    return h


def _mlp(model: HybridModel, i: int, x: torch.Tensor) -> torch.Tensor:
    mlp = f"layers.{i}.mlp"
    up = x @ model.weights[f"{mlp}.up_proj"].float().T
    if model.config.mlp_kind == "relu2":
        act = torch.relu(up) ** 2
    else:
        act = F.silu(x @ model.weights[f"{mlp}.gate_proj"].float().T) * up
    return act @ model.weights[f"{mlp}.down_proj"].float().T


def reference_logits(model: HybridModel, tokens: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(tokens), vocab]``: position ``t`` predicts token ``t + 1``."""
    h = reference_hidden(model, tokens)
    c = model.config
    head = model.weights["embed" if c.tie_embeddings else "lm_head"].float()
    return (_norm(h, model.weights["final_norm"].float(), c.rms_eps) @ head.T) * c.logit_scale


def greedy_generate_reference(model: HybridModel, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, recomputing the whole sequence for each one."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(n):
        token = int(reference_logits(model, seq)[-1].argmax())
        seq.append(token)
        out.append(token)
    return out
