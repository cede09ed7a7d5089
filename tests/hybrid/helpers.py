"""Shared builders for the hybrid-model tests: a tiny float32 model on the CPU and its backend state.

``Backend`` bundles a pool, a KV cache, a token table and a bump allocator of KV locations, and
wraps the model's entry points in list-of-ints helpers so a test reads as the scenario it checks.
"""

from __future__ import annotations

import torch

from backend.hybrid import ForwardOut, HybridModel, KVCache, TokenTable, tiny
from backend.pool import MambaStatePool

# The Triton kernels run on CUDA when there is a GPU; otherwise their torch references on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS = [list(b"The quick brown fox"), list(b"def f(x):\n    return"), list(b"0123456789abcdef0123456")]


ATOL = RTOL = 2e-5  # float32 end to end: cached/kernel forward vs the cache-free reference


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def tiny_model(seed: int = 0) -> HybridModel:
    return HybridModel.from_seed(tiny(), seed, device=DEVICE)


def ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def grid(rows: list[list[int]]) -> torch.Tensor:
    """An int64 ``[n, T]`` tensor on the test device."""
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


class Backend:
    """One model's backend state: ``capacity`` slots, ``kv_capacity`` KV locations."""

    def __init__(self, model: HybridModel, *, capacity: int = 8, kv_capacity: int = 1024, max_len: int = 96) -> None:
        self.model = model
        self.pool: MambaStatePool = model.new_pool(capacity)
        self.kv: KVCache = model.new_kv_cache(kv_capacity)
        self.table: TokenTable = model.new_token_table(capacity, max_len)
        self._next = 1  # location 0 is padding

    def alloc(self, n: int) -> list[int]:
        locs = list(range(self._next, self._next + n))
        self._next += n
        assert self._next <= self.kv.capacity + 1, "test KV cache too small"
        return locs

    def extend(self, rows: list[tuple[int, list[int], int]]) -> ForwardOut:
        """``rows``: ``(slot, tokens, prefix_len)``; fresh KV locations for every token."""
        cu = [0]
        for _, tokens, _ in rows:
            cu.append(cu[-1] + len(tokens))
        flat = [t for _, tokens, _ in rows for t in tokens]
        positions = [p + j for _, tokens, p in rows for j in range(len(tokens))]
        return self.model.extend(
            self.pool,
            self.kv,
            self.table,
            slots=ids([s for s, _, _ in rows]),
            cu_seqlens=ids(cu),
            prefix_lens=ids([p for _, _, p in rows]),
            input_ids=ids(flat),
            positions=ids(positions),
            kv_locs=ids(self.alloc(len(flat))),
        )

    def decode(self, rows: list[tuple[int, int, int]]) -> ForwardOut:
        """``rows``: ``(slot, token, position)``."""
        return self.model.decode(
            self.pool,
            self.kv,
            self.table,
            slots=ids([s for s, _, _ in rows]),
            input_ids=ids([t for _, t, _ in rows]),
            positions=ids([p for _, _, p in rows]),
            kv_locs=ids(self.alloc(len(rows))),
        )
