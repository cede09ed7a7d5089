"""Configs of the trained byte-level models shipped in ``backend/hybrid/weights/``.

Both were trained by ``python -m backend.tools.train`` on the Python standard library's source
(see that module). The draft is a separate, smaller model with its own config: it shares only the
byte vocabulary with the target, which is all greedy speculative decoding needs.
"""

from __future__ import annotations

from backend.hybrid.config import HybridConfig

__all__ = ["trained_draft", "trained_target"]


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
    """The draft: 2 Mamba layers and no attention, d_model 64, Mamba expand 2 (4 heads x 32),
    d_state 32, SwiGLU hidden 160.

    A small SSM drafter: its whole context lives in its recurrent state (its KV cache has no
    layers), so it is the draft for which exactly-once state init matters most. An earlier draft
    with one attention layer recovered from a re-zeroed state through attention over its own KV
    cache: with its state cleared before every draft extend, its acceptance on the default workload
    fell only from 0.715 to 0.713, so the stale-replay bug left no trace on it. This one falls from
    0.73 to 0.48 under the same abuse (both measured with ``compiler.baselines.spec``)."""
    return HybridConfig(
        d_model=64,
        layers=("mamba", "mamba"),
        nheads=4,
        head_dim=32,
        d_state=32,
        ngroups=1,
        conv_width=4,
        chunk_size=64,
        attn_heads=2,  # unused: no attention layer
        attn_head_dim=32,
        mlp_hidden=160,
    )
