"""Token-granular KV cache and the (slot, position) -> KV location table of the hybrid model.

- ``KVCache.k`` / ``KVCache.v``: ``[n_attn_layers, capacity + 1, n_heads, head_dim]``. Location 0
  is padding: padded rows write there and masked attention reads it, so it always holds finite
  values (zeros at allocation; whatever a padded row wrote since). Usable locations are
  ``1..capacity``; who owns which location is the engine's allocator's business.
- ``TokenTable.table``: int64 ``[max_slots + 1, max_len]``; ``table[slot, pos]`` is the KV location
  of the token at position ``pos`` of the request in ``slot``. Row 0 is the padding slot's row
  (rows of padded batch entries, slot ``-1``, are redirected there). The model writes the entry of
  every token it processes; attention at position ``p`` reads ``table[slot, :p + 1]``, so every
  entry below ``p`` must have been written (by this request or by ``copy_prefix`` from the request
  whose prefix it shares) before position ``p`` is processed.

Keys are stored after the rotary embedding (at their absolute positions), so a shared prefix is
reusable by any request whose positions of that prefix are the same, i.e. always.
"""

from __future__ import annotations

import torch

from backend.hybrid.config import HybridConfig

__all__ = ["KVCache", "TokenTable"]


class KVCache:
    """Per attention layer, ``capacity + 1`` token locations of keys and values."""

    def __init__(
        self,
        n_layers: int,
        capacity: int,
        n_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if n_layers < 0 or min(capacity, n_heads, head_dim) <= 0:
            raise ValueError(f"KV cache sizes must be positive (layers may be 0): {(n_layers, capacity, n_heads, head_dim)}")
        shape = (n_layers, capacity + 1, n_heads, head_dim)
        self.capacity = capacity
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_config(
        cls,
        config: HybridConfig,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """A zeroed KV cache of ``capacity`` token locations for ``config``'s attention layers (its KV heads
        and head dim; no layers for an attention-free model)."""
        return cls(config.n_attn, capacity, config.kv_heads, config.attn_head_dim, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        """The device the keys and values live on."""
        return self.k.device

    def write(self, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k, v [n, n_heads, head_dim]`` into locations ``locs [n]`` of attention layer ``layer``."""
        self.k[layer, locs] = k.to(self.k.dtype)
        self.v[layer, locs] = v.to(self.v.dtype)

    def gather(self, layer: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``locs`` (any shape ``S``): ``[*S, n_heads, head_dim]`` each."""
        return self.k[layer][locs], self.v[layer][locs]

    def __repr__(self) -> str:
        layers, _, heads, head_dim = self.k.shape
        return f"KVCache(layers={layers}, capacity={self.capacity}, heads={heads}, head_dim={head_dim}, dtype={self.k.dtype})"


class TokenTable:
    """``table[slot, pos]`` -> KV location; ``max_slots + 1`` rows (row 0: padding slot)."""

    def __init__(self, max_slots: int, max_len: int, *, device: torch.device | str = "cpu") -> None:
        if max_slots <= 0 or max_len <= 0:
            raise ValueError(f"token table sizes must be positive: max_slots={max_slots}, max_len={max_len}")
        self.max_slots = max_slots
        self.max_len = max_len
        self.table = torch.zeros((max_slots + 1, max_len), dtype=torch.int64, device=device)

    @property
    def device(self) -> torch.device:
        """The device the table lives on."""
        return self.table.device

    def write(self, slots: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor) -> None:
        """Elementwise ``table[slots, positions] = locs`` (equal shapes; slot ``-1`` writes row 0)."""
        self.table[slots.clamp(min=0), positions] = locs

    def rows(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """``table[slots, :length]`` (slot ``-1`` reads row 0): ``[n, length]`` KV locations."""
        return self.table[slots.clamp(min=0), :length]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """``table[dst, :length] = table[src, :length]``: slot ``dst`` shares ``src``'s first
        ``length`` KV locations (prefix sharing for a copy-on-write request)."""
        for name, slot in (("src", src), ("dst", dst)):
            if not 0 <= slot <= self.max_slots:
                raise ValueError(f"{name} slot {slot} out of range [0, {self.max_slots}]")
        if not 0 <= length <= self.max_len:
            raise ValueError(f"prefix length {length} out of range [0, {self.max_len}]")
        self.table[dst, :length] = self.table[src, :length]

    def clear(self, slot: int) -> None:
        """Point every position of ``slot`` at the padding location (for a freed slot; optional)."""
        self.table[slot] = 0

    def __repr__(self) -> str:
        return f"TokenTable(max_slots={self.max_slots}, max_len={self.max_len})"
