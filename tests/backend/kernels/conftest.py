"""Kernel tests: run every Triton kernel on this machine and compare it with its torch reference.

Without a GPU the kernels run under Triton's interpreter. The root conftest sets
``TRITON_INTERPRET=1`` for the whole session before anything imports Triton (Triton decorates its
own library functions at import); ``BATCHC_TRITON_ON_CPU=1`` is set for the duration of each kernel
test module only, so other test packages keep the fast torch references; ``backend.kernels.dispatch.jit_module`` re-decorates a jit module whose mode no
longer matches, so it does not matter who imported the kernels first or in which mode. With a GPU
the tests run the compiled kernels on CUDA tensors instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

# No project imports here: when pytest is pointed at this folder this conftest loads before the
# typeguard plugin installs its import hook, and anything imported now would go unchecked.
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreter() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        if not HAS_CUDA:
            mp.setenv("TRITON_INTERPRET", "1")
            mp.setenv("BATCHC_TRITON_ON_CPU", "1")
        yield
