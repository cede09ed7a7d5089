"""A differentiable, batched full-sequence forward of the hybrid model, for training.

It computes the same function as ``HybridModel`` and the cache-free oracle
``backend.hybrid.reference.reference_logits`` (same weight names and semantics, see
``backend.hybrid.weights``), but over a batch of equal-length sequences ``[batch, length]`` starting
at position 0, with operations autograd can differentiate and that run fast on a CPU:

- the causal depthwise conv is ``F.conv1d`` with ``width - 1`` zeros of left padding;
- the Mamba2 selective scan is the chunked ("SSD") form: within a chunk of ``chunk`` positions the
  output is a masked, decay-weighted ``C B^T`` matrix applied to ``dt * x``; between chunks a short
  loop carries the ``[H, P, N]`` state, decayed by each chunk's total ``exp(sum dt * A)``. The
  decays are computed as ``exp`` of non-positive cumulative-sum differences (masked to ``-inf``
  above the diagonal before the ``exp``), so nothing overflows;
- attention is ``F.scaled_dot_product_attention`` with a causal mask, rotary (rotate-half) on q and k.

Everything runs in float32 (weights are upcast). ``weights`` may require grad; nothing is modified in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.hybrid.config import HybridConfig
from backend.hybrid.weights import Weights

__all__ = ["forward_hidden", "forward_layers", "forward_logits", "ssd_scan"]


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """``x [batch, L, heads, hd]`` at positions ``0..L-1`` (rotate-half form)."""
    length, hd = x.shape[1], x.shape[-1]
    half = hd // 2
    inv_freq = (theta ** (-torch.arange(half, dtype=torch.float64) / half)).float().to(x.device)
    angles = torch.arange(length, device=x.device).float()[:, None] * inv_freq  # [L, half]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk: int
) -> torch.Tensor:
    """The Mamba2 recurrence ``s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T``, ``y_t = s_t C_t``
    from a zero state, in chunks of ``chunk`` positions.

    ``x [b, L, H, P]``, ``dt [b, L, H]`` (after softplus), ``A [H]`` (negative), ``B, C [b, L, H, N]``
    (already expanded from groups to heads) -> ``y [b, L, H, P]`` (without the ``D`` skip).
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    b, length, H, P = x.shape
    N = B.shape[-1]
    q = min(chunk, length)
    pad = (-length) % q
    if pad:  # dt = 0 and x = 0 on the padding: no decay, no input; its outputs are dropped
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    nc = (length + pad) // q
    # head-major chunks, so every contraction below is a batched matmul over (b, c, H)
    x = x.reshape(b, nc, q, H, P).permute(0, 1, 3, 2, 4)  # [b, c, H, q, P]
    B = B.reshape(b, nc, q, H, N).permute(0, 1, 3, 2, 4)  # [b, c, H, q, N]
    C = C.reshape(b, nc, q, H, N).permute(0, 1, 3, 2, 4)
    dt = dt.reshape(b, nc, q, H).permute(0, 1, 3, 2)  # [b, c, H, q]
    cs = (dt * A[:, None]).cumsum(dim=-1)  # log of the decay from the chunk start
    dtx = dt[..., None] * x  # [b, c, H, q, P]

    # within a chunk: y_t = sum_{s <= t} exp(cs_t - cs_s) (C_t . B_s) dt_s x_s
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()  # [t, s]
    seg = cs[..., :, None] - cs[..., None, :]  # [b, c, H, t, s]
    decay = torch.exp(seg.masked_fill(~causal, float("-inf")))
    y = ((C @ B.transpose(-1, -2)) * decay) @ dtx  # [b, c, H, q, P]

    # each chunk's own contribution to the state at its end, [b, c, H, P, N]
    to_end = torch.exp(cs[..., -1:] - cs)  # [b, c, H, q]
    chunk_states = dtx.transpose(-1, -2) @ (to_end[..., None] * B)
    totals = torch.exp(cs[..., -1])  # [b, c, H]
    state = torch.zeros(b, H, P, N, dtype=x.dtype, device=x.device)
    entering = []
    for ci in range(nc):
        entering.append(state)
        state = state * totals[:, ci, :, None, None] + chunk_states[:, ci]
    s_in = torch.stack(entering, dim=1)  # [b, c, H, P, N]: the state before each chunk
    y = y + (C * torch.exp(cs)[..., None]) @ s_in.transpose(-1, -2)
    return y.permute(0, 1, 3, 2, 4).reshape(b, nc * q, H, P)[:, :length]


def _mamba(config: HybridConfig, w: Weights, i: int, x: torch.Tensor, chunk: int) -> torch.Tensor:
    c = config
    p = f"layers.{i}.mixer"
    b, length, _ = x.shape
    proj = x @ w[f"{p}.in_proj"].T
    z = proj[..., : c.d_inner]
    xbc = proj[..., c.d_inner : c.d_inner + c.conv_dim]
    dt = proj[..., c.d_inner + c.conv_dim :]

    conv = F.conv1d(
        F.pad(xbc.transpose(1, 2), (c.conv_width - 1, 0)),
        w[f"{p}.conv_weight"][:, None, :],
        w[f"{p}.conv_bias"],
        groups=c.conv_dim,
    ).transpose(1, 2)  # [b, L, conv_dim]
    conv = F.silu(conv)

    gn = c.ngroups * c.d_state
    per_group = c.nheads // c.ngroups
    xs = conv[..., : c.d_inner].reshape(b, length, c.nheads, c.head_dim)
    Bs = conv[..., c.d_inner : c.d_inner + gn].reshape(b, length, c.ngroups, c.d_state)
    Cs = conv[..., c.d_inner + gn :].reshape(b, length, c.ngroups, c.d_state)
    Bs = Bs.repeat_interleave(per_group, dim=2)
    Cs = Cs.repeat_interleave(per_group, dim=2)
    A = -torch.exp(w[f"{p}.A_log"])
    dts = F.softplus(dt + w[f"{p}.dt_bias"])  # [b, L, H]

    y = ssd_scan(xs, dts, A, Bs, Cs, chunk) + w[f"{p}.D"][:, None] * xs  # [b, L, H, P]
    y = y.reshape(b, length, c.d_inner) * F.silu(z)
    grouped = _rms(y.reshape(b, length, c.ngroups, c.d_inner // c.ngroups), c.rms_eps)
    return (grouped.reshape(b, length, c.d_inner) * w[f"{p}.norm"]) @ w[f"{p}.out_proj"].T


def _attention(config: HybridConfig, w: Weights, i: int, x: torch.Tensor) -> torch.Tensor:
    c = config
    p = f"layers.{i}.mixer"
    b, length, _ = x.shape
    shape = (b, length, c.attn_heads, c.attn_head_dim)
    q = _rope((x @ w[f"{p}.q_proj"].T).reshape(shape), c.rope_theta)
    k = _rope((x @ w[f"{p}.k_proj"].T).reshape(shape), c.rope_theta)
    v = (x @ w[f"{p}.v_proj"].T).reshape(shape)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2).reshape(b, length, c.attn_dim) @ w[f"{p}.o_proj"].T


def forward_hidden(config: HybridConfig, weights: Weights, tokens: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """Residual stream after the last layer, ``[batch, L, d_model]``, for ``tokens [batch, L]``
    (int64, every row starting at position 0). ``chunk`` defaults to ``config.chunk_size``."""
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be an int64 [batch, length] tensor, got {tokens.dtype} {tuple(tokens.shape)}")
    if tokens.shape[1] == 0:
        raise ValueError("tokens must hold at least one position")
    c = config
    if c.switched():
        raise ValueError(f"the training forward implements the bundled architecture only; this config sets {list(c.switched())}")
    return forward_layers(c, weights, F.embedding(tokens, weights["embed"].float()), chunk=chunk)


def forward_layers(config: HybridConfig, weights: Weights, h: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """The layer stack of ``config`` (bundled architecture: ``mixer_mlp`` blocks, SwiGLU, full
    rotary; the caller checks that) on the residual stream ``h [batch, L, d_model]`` (float32,
    positions ``0..L-1``) -> the residual stream after the last layer. Only the ``layers.*``
    weights are read (a draft head runs its own layers on its own input through this)."""
    c = config
    q = c.chunk_size if chunk is None else chunk
    w = {name: t.float() for name, t in weights.items() if name.startswith("layers.")}  # a no-op (grad kept) for float32
    for i, kind in enumerate(c.layers):
        x = _rms(h, c.rms_eps) * w[f"layers.{i}.norm"]
        h = h + (_mamba(c, w, i, x, q) if kind == "mamba" else _attention(c, w, i, x))
        x = _rms(h, c.rms_eps) * w[f"layers.{i}.mlp_norm"]
        mlp = f"layers.{i}.mlp"
        h = h + (F.silu(x @ w[f"{mlp}.gate_proj"].T) * (x @ w[f"{mlp}.up_proj"].T)) @ w[f"{mlp}.down_proj"].T
    return h


def forward_logits(config: HybridConfig, weights: Weights, tokens: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """Float32 logits ``[batch, L, vocab]``: position ``t`` predicts token ``t + 1`` (as ``reference_logits``)."""
    h = forward_hidden(config, weights, tokens, chunk=chunk)
    return (_rms(h, config.rms_eps) * weights["final_norm"].float()) @ weights["lm_head"].float().T
