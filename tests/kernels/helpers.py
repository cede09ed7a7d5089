"""Shared builders for the kernel tests: small random pools and inputs on the test device."""

from __future__ import annotations

import torch

from backend.pool import MambaLayerSpec, MambaStatePool, PoolLayout
from ir.ids import PoolId

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def make_pool(
    *,
    capacity: int = 6,
    conv_dim: int = 24,
    kernel_width: int = 4,
    nheads: int = 4,
    head_dim: int = 8,
    d_state: int = 16,
    conv_dtype: torch.dtype = torch.float32,
    ssm_dtype: torch.dtype = torch.float32,
    layers: int = 2,
    seed: int = 0,
) -> MambaStatePool:
    """A small pool on the test device whose every state holds random (finite) values."""
    spec = MambaLayerSpec(
        conv_dim=conv_dim,
        kernel_width=kernel_width,
        nheads=nheads,
        head_dim=head_dim,
        d_state=d_state,
        conv_dtype=conv_dtype,
        ssm_dtype=ssm_dtype,
    )
    pool = MambaStatePool(PoolId("target"), PoolLayout(layers=(spec,) * layers), capacity, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        for view in (pool.conv_state(layer), pool.ssm_state(layer)):
            view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
    return pool


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE)


def index(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)
