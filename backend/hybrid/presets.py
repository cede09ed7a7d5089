"""Configs of the trained byte-level models shipped in ``backend/hybrid/weights/``.

Both were trained by ``python -m backend.hybrid.train`` on the Python standard library's source
(see that module). The draft is a separate, smaller model with its own config: it shares only the
byte vocabulary with the target, which is all greedy speculative decoding needs.
"""

from __future__ import annotations

from backend.hybrid.config import HybridConfig


def trained_target() -> HybridConfig:
    """The target: 4 layers (mamba, mamba, attn, mamba), d_model 96, Mamba expand 2
    (6 heads x 32), d_state 32, 4 attention heads x 24, SwiGLU hidden 256 (~0.5M parameters)."""
    return HybridConfig(
        d_model=96,
        layers=("mamba", "mamba", "attn", "mamba"),
        nheads=6,
        head_dim=32,
        d_state=32,
        ngroups=1,
        conv_width=4,
        chunk_size=64,
        attn_heads=4,
        attn_head_dim=24,
        mlp_hidden=256,
    )


def trained_draft() -> HybridConfig:
    """The draft: 2 layers (mamba, attn), d_model 48, Mamba expand 2 (4 heads x 24), d_state 16,
    2 attention heads x 24, SwiGLU hidden 128 (~0.08M parameters)."""
    return HybridConfig(
        d_model=48,
        layers=("mamba", "attn"),
        nheads=4,
        head_dim=24,
        d_state=16,
        ngroups=1,
        conv_width=4,
        chunk_size=64,
        attn_heads=2,
        attn_head_dim=24,
        mlp_hidden=128,
    )
