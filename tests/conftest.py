"""Suite-wide settings: every pass manager built from the environment verifies after every pass."""

from __future__ import annotations

import os

os.environ.setdefault("BATCHC_VERIFY", "2")
