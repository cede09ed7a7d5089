"""Where a kernel call runs: the Triton kernel or its torch path.

Rule (one place, every wrapper asks it): the Triton path is taken when the tensor is on CUDA, or
when ``TRITON_INTERPRET=1`` and ``BATCHC_TRITON_ON_CPU=1`` are both set (Triton's interpreter then
runs the kernel on the CPU; that is how the kernels are tested without a GPU); otherwise the torch
path runs: ``backend.kernels.torch_paths`` for decode, verify and commit (the references' arithmetic,
batched over rows), ``backend.reference`` for ``init_rows``.

Triton decides interpreter-or-compiler when ``@triton.jit`` runs, i.e. when a ``backend.kernels.jit``
module is imported, not at launch. ``jit_module`` therefore re-imports a jit module whose
decoration mode no longer matches the current setting, so flipping ``TRITON_INTERPRET`` after
import (as the tests do) cannot leave a compiled-mode kernel being launched on CPU tensors.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from types import ModuleType

import torch

__all__ = ["CPU_KERNELS_ENV", "interpret_enabled", "jit_module", "triton_available", "use_triton"]

_JIT_PACKAGE = "backend.kernels.jit"

# The mode each jit module was decorated in, keyed by module name.
_decorated_in: dict[str, bool] = {}


@functools.cache
def _triton_module() -> ModuleType | None:
    """Triton's module, or ``None`` when it does not import: tried once per process (every kernel
    call asks, and an ``import`` statement costs a lock and a lookup each time)."""
    # by importlib, not an import statement: Triton ships no type information, and a user's
    # `mypy --strict` follows batchc's imports; this way no batchc module a checker reads imports
    # an untyped package (the @triton.jit bodies in backend.kernels.jit are loaded the same way)
    try:
        return importlib.import_module("triton")
    except ImportError:
        return None


def triton_available() -> bool:
    """True when Triton imports (it is a Linux-only dependency)."""
    return _triton_module() is not None


def interpret_enabled() -> bool:
    """Triton's own reading of ``TRITON_INTERPRET`` (so "1", "true", ... agree with Triton)."""
    triton = _triton_module()
    return triton is not None and bool(triton.knobs.runtime.interpret)


CPU_KERNELS_ENV = "BATCHC_TRITON_ON_CPU"
"""The environment variable that, with Triton's interpreter on, sends CPU tensors to the Triton
kernels (``use_triton``)."""


def use_triton(t: torch.Tensor) -> bool:
    """The dispatch rule: Triton on CUDA tensors; on CPU tensors only when Triton's interpreter is on
    *and* ``BATCHC_TRITON_ON_CPU=1`` asks for it (the kernel tests); else the torch path.

    The second switch exists because ``TRITON_INTERPRET`` must be set before Triton is first
    imported to take effect everywhere (Triton's own ``@jit`` library functions are decorated at
    import), while the rest of a CPU process should keep the fast torch paths."""
    if t.is_cuda:
        return triton_available()
    return interpret_enabled() and os.environ.get(CPU_KERNELS_ENV) == "1"


def jit_module(name: str) -> ModuleType:
    """``backend.kernels.jit.<name>``, decorated for the current interpreter setting."""
    full = f"{_JIT_PACKAGE}.{name}"
    mode = interpret_enabled()
    module = sys.modules.get(full)
    if module is None:
        module = importlib.import_module(full)
    elif _decorated_in.get(full) != mode:
        module = importlib.reload(module)
    _decorated_in[full] = mode
    return module
