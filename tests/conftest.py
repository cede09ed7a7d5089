"""Suite-wide settings.

- Every pass manager built from the environment verifies after every pass (``BATCHC_VERIFY=2``).
- Without a GPU, Triton's interpreter is on for the whole session, set before anything imports
  Triton so that Triton's own ``@jit`` library functions are interpreted too. CPU code still takes
  the torch references unless a kernel test asks for Triton (``BATCHC_TRITON_ON_CPU``).
"""

from __future__ import annotations

import os

import torch

from tests import hypothesis_profiles  # noqa: F401  # registers the fuzzer's profiles, so --hypothesis-profile=long works

os.environ.setdefault("BATCHC_VERIFY", "2")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
