"""Argument checks shared by the launch wrappers; every one raises ``ValueError`` before a launch.

A Triton kernel does no bounds checking, so a bad slot index corrupts another request's state (or
faults) instead of failing. The wrappers therefore validate shapes, dtypes, devices and index
contents on the host first. Index contents need one device-to-host copy of the (small) index
tensor; wrappers called per layer let the caller skip that when the indices were already checked
once per forward (``check_slots=False``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from backend.readback import host_values

__all__ = ["INDEX_DTYPES", "STATE_DTYPES", "check_index", "check_optional", "check_slot_rows", "check_tensor", "require"]

INDEX_DTYPES = (torch.int64, torch.int32)
"""The dtypes an index tensor (slots, positions, KV locations) may have."""
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes a state tensor (conv or SSM state) may have."""


def require(ok: bool, message: str) -> None:
    """``ValueError(message)`` unless ``ok``: the one way the wrappers refuse an argument."""
    if not ok:
        raise ValueError(message)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    shape: Sequence[int],
    device: torch.device,
    dtypes: Sequence[torch.dtype] | None = None,
) -> None:
    """``ValueError`` naming ``name`` unless ``t`` is on ``device``, has exactly ``shape`` and (when
    ``dtypes`` is given) one of ``dtypes``."""
    require(t.device == device, f"{name} is on {t.device}, expected {device}")
    require(tuple(t.shape) == tuple(shape), f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtypes is not None:
        require(t.dtype in dtypes, f"{name} has dtype {t.dtype}, expected one of {list(dtypes)}")


def check_optional(
    name: str,
    t: torch.Tensor | None,
    *,
    shape: Sequence[int],
    device: torch.device,
    dtypes: Sequence[torch.dtype] | None = None,
) -> None:
    """``check_tensor`` for an optional argument: ``None`` passes."""
    if t is not None:
        check_tensor(name, t, shape=shape, device=device, dtypes=dtypes)


def check_index(name: str, t: torch.Tensor, *, length: int | None, device: torch.device) -> None:
    """``ValueError`` naming ``name`` unless ``t`` is a 1-D int64 or int32 index tensor on ``device``
    with ``length`` entries (any length when ``None``). Checks no contents: ``check_slot_rows`` does."""
    require(t.dtype in INDEX_DTYPES, f"{name} must be int64 or int32, got {t.dtype}")
    require(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    require(t.device == device, f"{name} is on {t.device}, expected {device}")
    if length is not None:
        require(t.shape[0] == length, f"{name} has {t.shape[0]} entries, expected {length}")


def check_slot_rows(name: str, slots: torch.Tensor, num_slots: int) -> None:
    """Per-row slot indices of a decode-style kernel: -1 (skip) or in ``[0, num_slots)``, no repeats.

    Slot 0 (padding) may be read and written by padded rows, but only once per call like any other
    slot: two rows updating one slot in place would race.
    """
    values = host_values(slots).tolist()  # (the staged values when known: no readback of a device tensor)
    bad = [v for v in values if not (v == -1 or 0 <= v < num_slots)]
    require(not bad, f"{name} has slots out of range [0, {num_slots - 1}] (or -1): {bad[:8]}")
    live = (v for v in values if v >= 0)
    dupes = sorted(v for v, n in Counter(live).items() if n > 1)
    require(not dupes, f"{name} repeats slots {dupes[:8]}; each slot may be updated by one row per call")

