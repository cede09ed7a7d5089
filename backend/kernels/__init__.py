"""Triton kernels and their launch wrappers. ``@triton.jit`` bodies live in ``backend.kernels.jit``."""

__all__: list[str] = []
