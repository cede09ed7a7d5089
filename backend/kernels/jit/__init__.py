"""``@triton.jit`` kernel bodies (relaxed mypy settings; wrappers in the parent package stay strict)."""
