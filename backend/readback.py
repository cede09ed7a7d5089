"""Reading tensors back to the host: counted, and skipped where the host already knows the values.

On a GPU every read of a device tensor's values on the host (``.item()``, ``.tolist()``, ``bool(t)``,
``int(t)``, ``.cpu()``, ``torch.equal``, a data-dependent shape such as ``nonzero``'s) waits for the
device to finish the work queued before it: a host synchronisation. The engine's k = 0 step makes
one, when the sampled tokens come back; everything else the host needs about a step it already has,
because it staged it (slot ids, positions).

- ``staged(t, values)`` marks an index tensor built from host values with those values, and
  ``host_values(t)`` returns them without touching the tensor; for a tensor not marked it reads it
  back (a readback ``HostReadbacks`` counts). ``backend.staging`` marks the staged plan columns, so
  the model's argument checks, its context length and the kernels' torch paths decide what they
  need on the host. The values of a view or of a new tensor computed from a marked one are not
  known (only the marked object carries them).
- ``HostReadbacks`` is a ``torch.overrides.TorchFunctionMode`` that counts every readback made while
  it is active, by the line that made it (the first frame outside torch). With ``device_only`` it
  counts only tensors that are not on the CPU (on a CUDA device these are the synchronisations);
  without it (the default) it counts every tensor's, which is how a test on the CPU checks what a
  step would synchronise on a device. ``cpu_branch(t)`` reads a CPU tensor in a branch that only the
  CPU takes (a NumPy fast path whose device branch reads nothing back): the counter skips it, so the
  CPU's count stays the device's. What it cannot see: a boolean-mask index (``t[mask]``), which
  syncs on a GPU through ``__getitem__`` (on a device, ``torch.cuda.set_sync_debug_mode`` sees it).
"""

from __future__ import annotations

import collections
import sys
import traceback
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
from torch.overrides import TorchFunctionMode

__all__ = ["READBACK_OPS", "HostReadbacks", "cpu_branch", "host_values", "staged"]

READBACK_OPS: Final = frozenset({
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__array__", "__format__",
    "equal", "allclose", "is_nonzero", "nonzero", "masked_select", "unique",
})
"""The tensor methods and torch functions whose result on the host depends on a tensor's values
(``HostReadbacks`` counts their calls)."""


_known: dict[int, tuple[weakref.ref[torch.Tensor], npt.NDArray[np.int64]]] = {}
"""The host values of each ``staged`` tensor object, by its id, with a weak reference to it (the
entry goes when the tensor does; a lookup checks the reference, so a new object that reuses an id
is never taken for the old one)."""


def staged(t: torch.Tensor, values: npt.NDArray[np.int64]) -> torch.Tensor:
    """``t``, marked as holding ``values`` (the host array it was staged from, same shape); returns ``t``."""
    if tuple(values.shape) != tuple(t.shape):
        raise ValueError(f"staged: host values of shape {tuple(values.shape)} for a tensor of shape {tuple(t.shape)}")
    key = id(t)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        entry = _known.get(key)
        if entry is not None and entry[0] is ref:
            del _known[key]

    _known[key] = (weakref.ref(t, forget), values)  # (this tensor object only: a view or a result is not marked)
    return t


def host_values(t: torch.Tensor) -> npt.NDArray[np.int64]:
    """The int64 values of the integer tensor ``t`` on the host: those it was ``staged`` with, or
    else read back from it (one readback, a host synchronisation on a device)."""
    entry = _known.get(id(t))
    if entry is not None and entry[0]() is t:
        return entry[1]
    return np.asarray(t.numpy(force=True), dtype=np.int64)  # (one readback: a copy to the host where needed)


_quiet: list[int] = [0]
"""How many ``cpu_branch`` reads are under way (``HostReadbacks`` counts nothing meanwhile)."""


def cpu_branch(t: torch.Tensor) -> np.ndarray:
    """The NumPy array sharing the memory of ``t``, a CPU tensor, read in a branch that only the CPU
    takes (its device branch works on the tensor and reads nothing back): no host synchronisation on
    any device, so ``HostReadbacks`` does not count it. ``ValueError`` for a tensor not on the CPU."""
    if not t.is_cpu:
        raise ValueError(f"cpu_branch: a tensor on {t.device}, not on the CPU (reading it back is a host synchronisation)")
    _quiet[0] += 1
    try:
        return t.detach().numpy()
    finally:
        _quiet[0] -= 1


def _op_name(func: Callable[..., Any]) -> str:
    try:
        name: str = func.__name__
    except AttributeError:  # (a callable without a name is no readback of ours)
        return ""
    return name


def _tensors(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


class HostReadbacks(TorchFunctionMode):
    """Counts readbacks (``READBACK_OPS``) while active (``with HostReadbacks() as seen: ...``):
    ``seen.count`` in all, ``seen.sites`` by ``"path:line"`` of the line that made them (the first
    frame outside torch and this module). ``device_only``: only those of tensors not on the CPU."""

    def __init__(self, *, device_only: bool = False) -> None:
        super().__init__()
        self.device_only = device_only
        self.sites: collections.Counter[str] = collections.Counter()
        self._inside = False

    @property
    def count(self) -> int:
        """The readbacks counted so far."""
        return sum(self.sites.values())

    def reset(self) -> None:
        """Forget the readbacks counted so far."""
        self.sites.clear()

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kw = kwargs if kwargs is not None else {}
        if not self._inside and not _quiet[0] and _op_name(func) in READBACK_OPS:
            tensors = _tensors(args, kw)
            if tensors and (not self.device_only or any(not t.is_cpu for t in tensors)):
                self._inside = True  # (the site lookup below reads no tensor; guard against re-entry all the same)
                try:
                    self.sites[_site()] += 1
                finally:
                    self._inside = False
        return func(*args, **kw)


def _site() -> str:
    """``path:line`` of the innermost frame outside torch, numpy and this module."""
    here = __file__
    for frame in reversed(traceback.extract_stack(sys._getframe(2), limit=12)):
        name = frame.filename
        if name == here or "/torch/" in name or "/numpy/" in name:
            continue
        return f"{name}:{frame.lineno}"
    return "?"
