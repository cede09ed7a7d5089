"""Slot-major Mamba state pool.

One pool is one ``uint8`` buffer of shape ``[num_slots, row_bytes]``. Row ``s`` holds the whole
recurrent state of slot ``s``: for every Mamba layer its conv state ``[conv_dim, kernel_width - 1]``
and its SSM state ``[nheads, head_dim, d_state]``, each sub-state starting at a multiple of
``PoolLayout.align`` bytes. Per-layer tensors are strided views into the buffer
(``conv_state(layer)`` is ``[num_slots, conv_dim, kernel_width - 1]`` with a slot stride of
``row_bytes / itemsize`` elements), so kernels index them by slot like a layer-major pool, while a
clear is one row fill and a copy-on-write is one row copy.

Invariants:

- Row 0 is the reserved padding slot (``ir.ids.PADDING_SLOT``); kernels may read it for padded
  rows, nothing allocates it.
- ``row_bytes`` and every sub-state offset are multiples of ``align`` (256 by default, at least 16),
  so every view has an aligned base for any dtype and the init-op kernel can move 16-byte words.
- The buffer is allocated once; views never reallocate, so a view taken before an op sees the op.
- A layout may also carry one hidden vector per row (``PoolLayout.carried_hidden`` elements of
  ``carried_dtype``, after the last layer's SSM state, aligned like the others): a draft head's
  target hidden state at the slot's last committed position (``backend.hybrid.head``). It is part
  of the row, so a clear zeroes it and a copy-on-write or snapshot copies it with no op of its own.
  With ``carried_hidden == 0`` (every model but a head) the layout is exactly what it was without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import attrs
import torch

from ir.columns import check_instance, check_int, check_pool
from ir.errors import IRValidationError
from ir.ids import PoolId

__all__ = ["MAX_LAYER_DIM", "MAX_POOL_BYTES", "MAX_POOL_SLOTS", "MambaLayerSpec", "MambaStatePool", "PoolLayout", "device_problem"]

_DTYPES: Final = {torch.float32, torch.float16, torch.bfloat16}

MAX_POOL_SLOTS: Final = 2**20
"""Most usable slots of one pool."""
MAX_POOL_BYTES: Final = 1 << 38
"""Most bytes of one pool's buffer (256 GiB: more than one accelerator holds)."""


MAX_LAYER_DIM: Final = 1 << 20
"""Largest conv_dim, nheads, head_dim or d_state of one layer's state."""


def device_problem(device: object) -> str | None:
    """Why ``device`` cannot hold a pool or a model here (a message fragment), or ``None``: it must
    be a ``torch.device`` or a device name, ``cpu`` or an available CUDA device."""
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError):
            return f"device must be 'cpu' or an available CUDA device, got {device!r} (not a device name)"
    elif isinstance(device, torch.device):
        dev = device
    else:
        return f"device must be a str or a torch.device, not {type(device).__name__} (got {device!r})"
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return f"device {device!r}: CUDA is not available in this process"
        if not 0 <= (dev.index or 0) < count:
            return f"device {device!r}: there are {count} CUDA device(s)"
    elif dev.type != "cpu":
        return f"device must be 'cpu' or an available CUDA device, got {device!r}"
    return None


@attrs.frozen(kw_only=True)
class MambaLayerSpec:
    """Shapes and dtypes of one Mamba2 layer's recurrent state. Dimensions are ints (numpy
    integers too; never ``bool``, ``float``, ``str`` or ``None``) in ``[1, MAX_LAYER_DIM]``,
    ``kernel_width`` in ``[2, 4]``, dtypes float32, float16 or bfloat16; else ``IRValidationError``
    naming the field and the value."""

    conv_dim: int
    kernel_width: int
    nheads: int
    head_dim: int
    d_state: int
    conv_dtype: torch.dtype = torch.float32
    ssm_dtype: torch.dtype = torch.float32

    def __attrs_post_init__(self) -> None:
        for name, value in (
            ("conv_dim", self.conv_dim),
            ("nheads", self.nheads),
            ("head_dim", self.head_dim),
            ("d_state", self.d_state),
        ):
            n = check_int(self, name, value)
            if not 1 <= n <= MAX_LAYER_DIM:
                raise IRValidationError("MambaLayerSpec", name, value, f"must be in [1, {MAX_LAYER_DIM}]")
            object.__setattr__(self, name, n)  # a numpy integer is kept as a Python int
        width = check_int(self, "kernel_width", self.kernel_width)
        if not 2 <= width <= 4:
            raise IRValidationError("MambaLayerSpec", "kernel_width", self.kernel_width, "must be in [2, 4]")
        object.__setattr__(self, "kernel_width", width)
        dtypes: tuple[tuple[str, object], ...] = (("conv_dtype", self.conv_dtype), ("ssm_dtype", self.ssm_dtype))
        for name, dtype in dtypes:  # typed torch.dtype; checked because callers need not be typed
            if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
                raise IRValidationError("MambaLayerSpec", name, dtype, "must be torch.float32, torch.float16 or torch.bfloat16")

    @property
    def conv_shape(self) -> tuple[int, int]:
        """One slot's conv state shape: ``(conv_dim, kernel_width - 1)``."""
        return (self.conv_dim, self.kernel_width - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        """One slot's SSM state shape: ``(nheads, head_dim, d_state)``."""
        return (self.nheads, self.head_dim, self.d_state)

    @property
    def conv_bytes(self) -> int:
        """Bytes of one slot's conv state, unpadded."""
        return self.conv_dim * (self.kernel_width - 1) * self.conv_dtype.itemsize

    @property
    def ssm_bytes(self) -> int:
        """Bytes of one slot's SSM state, unpadded."""
        return self.nheads * self.head_dim * self.d_state * self.ssm_dtype.itemsize


def _layer_tuple(layers: object) -> tuple[MambaLayerSpec, ...]:
    """The layers as a tuple (each is type-checked in ``PoolLayout``); a str or a non-iterable is
    refused, not iterated."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise IRValidationError("PoolLayout", "layers", layers, "must be a sequence of MambaLayerSpec")
    return tuple(layers)


def _round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


@attrs.frozen(kw_only=True)
class PoolLayout:
    """Byte layout of one slot-major row: per layer, conv state then SSM state, each aligned; then
    the carried hidden vector when ``carried_hidden > 0`` (a layout needs a Mamba layer or one)."""

    layers: tuple[MambaLayerSpec, ...] = attrs.field(converter=_layer_tuple)
    align: int = 256
    carried_hidden: int = 0
    """Elements of the carried hidden vector per row (0: none)."""
    carried_dtype: torch.dtype = torch.float32
    conv_offsets: tuple[int, ...] = attrs.field(init=False)
    ssm_offsets: tuple[int, ...] = attrs.field(init=False)
    carried_offset: int = attrs.field(init=False)
    """Byte offset of the carried hidden vector (``row_bytes`` when there is none)."""
    row_bytes: int = attrs.field(init=False)

    @conv_offsets.default
    def _conv_offsets(self) -> tuple[int, ...]:
        return self._offsets()[0]

    @ssm_offsets.default
    def _ssm_offsets(self) -> tuple[int, ...]:
        return self._offsets()[1]

    @carried_offset.default
    def _carried_offset(self) -> int:
        return self._offsets()[2]

    @row_bytes.default
    def _row_bytes(self) -> int:
        return self._offsets()[3]

    @property
    def carried_bytes(self) -> int:
        """Bytes of the carried hidden vector of one row, unpadded (0 when there is none)."""
        return self.carried_hidden * self.carried_dtype.itemsize

    def _offsets(self) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
        carried = check_int(self, "carried_hidden", self.carried_hidden)
        if not 0 <= carried <= MAX_LAYER_DIM:
            raise IRValidationError("PoolLayout", "carried_hidden", self.carried_hidden, f"must be in [0, {MAX_LAYER_DIM}]")
        dtype: object = self.carried_dtype  # typed torch.dtype; checked because callers need not be typed
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
            raise IRValidationError("PoolLayout", "carried_dtype", dtype, "must be torch.float32, torch.float16 or torch.bfloat16")
        if not self.layers and not carried:
            raise IRValidationError(
                "PoolLayout", "layers", self.layers, "a pool layout needs at least one Mamba layer or a carried hidden state"
            )
        for i, spec in enumerate(self.layers):
            check_instance(self, f"layers[{i}]", spec, MambaLayerSpec)
        align = check_int(self, "align", self.align)
        if not 16 <= align <= 4096 or align & (align - 1):
            raise IRValidationError("PoolLayout", "align", self.align, "must be a power of two in [16, 4096]")
        conv: list[int] = []
        ssm: list[int] = []
        off = 0
        for spec in self.layers:
            conv.append(off)
            off = _round_up(off + spec.conv_bytes, self.align)
            ssm.append(off)
            off = _round_up(off + spec.ssm_bytes, self.align)
        carried_at = off
        off = _round_up(off + carried * self.carried_dtype.itemsize, self.align)
        return tuple(conv), tuple(ssm), carried_at, off


class MambaStatePool:
    """The recurrent state of every slot of one model (target or a draft), slot-major.

    ``capacity`` usable slots are ``1..capacity``; row 0 is padding, so the buffer has
    ``capacity + 1`` rows. The buffer is zeroed and allocated once, on ``device``; the per-layer
    views (``conv_state``, ``ssm_state``, ``carried_hidden``) alias it, so a write through one is
    seen by every later read. One executor owns a pool: it applies the init ops (clears,
    copy-on-writes, snapshots) to it, and hands it to the model hook, which advances the rows of
    its plan in place. Code outside the two that writes the buffer is what the executor's ``watch``
    reports.

    Arguments are checked before the buffer is allocated (``IRValidationError`` naming
    ``MambaStatePool.<argument>`` and the value): ``pool_id`` a non-empty ``str``, ``layout`` a
    ``PoolLayout``, ``capacity`` an int (numpy integers too; never ``bool``, ``float``, ``str`` or
    ``None``) in ``[1, MAX_POOL_SLOTS]`` whose ``(capacity + 1) * row_bytes`` is at most
    ``MAX_POOL_BYTES``.
    """

    def __init__(
        self,
        pool_id: PoolId,
        layout: PoolLayout,
        capacity: int,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        check_pool("MambaStatePool", "pool_id", pool_id)
        check_instance("MambaStatePool", "layout", layout, PoolLayout)
        slots = check_int("MambaStatePool", "capacity", capacity)
        if not 1 <= slots <= MAX_POOL_SLOTS:
            raise IRValidationError("MambaStatePool", "capacity", capacity, f"must be in [1, {MAX_POOL_SLOTS}]")
        if (slots + 1) * layout.row_bytes > MAX_POOL_BYTES:
            raise IRValidationError(
                "MambaStatePool", "capacity", capacity,
                f"{slots + 1} rows of {layout.row_bytes} bytes exceed the pool bound of {MAX_POOL_BYTES} bytes",
            )
        problem = device_problem(device)
        if problem is not None:
            raise IRValidationError("MambaStatePool", "device", device, problem)
        self.pool_id: Final = pool_id
        self.layout: Final = layout
        self.capacity: Final = slots
        self.buffer: Final = torch.zeros((capacity + 1, layout.row_bytes), dtype=torch.uint8, device=device)

    # -- the state-store contract (``backend.state_store.RestorableStore``): whole rows of the buffer

    def _idx(self, slots: Iterable[int]) -> torch.Tensor:
        return torch.tensor([int(s) for s in slots], dtype=torch.int64, device=self.buffer.device)

    def clear_rows(self, slots: Sequence[int]) -> None:
        """Zero the rows of ``slots``."""
        self.buffer.index_fill_(0, self._idx(slots), 0)

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Row ``dst[i]`` becomes row ``src[i]``, every source read before any write."""
        self.buffer.index_copy_(0, self._idx(dst), self.buffer.index_select(0, self._idx(src)))

    def save_rows(self, slots: Sequence[int]) -> object:
        """A copy of the rows of ``slots``."""
        return self.buffer.index_select(0, self._idx(slots))

    def restore_rows(self, slots: Sequence[int], saved: object) -> None:
        """Put back the rows ``save_rows(slots)`` copied."""
        if not isinstance(saved, torch.Tensor):
            raise TypeError(f"MambaStatePool.restore_rows: saved must be what save_rows returned, got a {type(saved).__name__}")
        self.buffer.index_copy_(0, self._idx(slots), saved)

    @property
    def num_slots(self) -> int:
        """Rows in the buffer, padding row included."""
        return self.capacity + 1

    @property
    def device(self) -> torch.device:
        """The device the buffer lives on."""
        return self.buffer.device

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        flat = self.buffer[:, offset : offset + nbytes].view(dtype)
        return flat.view((self.num_slots, *shape))

    def _layer(self, layer: object) -> int:
        i = check_int("MambaStatePool", "layer", layer)
        if not 0 <= i < len(self.layout.layers):
            raise IRValidationError("MambaStatePool", "layer", layer, f"must be a layer index in [0, {len(self.layout.layers)})")
        return i

    def conv_state(self, layer: int) -> torch.Tensor:
        """``[num_slots, conv_dim, kernel_width - 1]`` strided view of layer ``layer``'s conv state."""
        layer = self._layer(layer)
        spec = self.layout.layers[layer]
        return self._view(self.layout.conv_offsets[layer], spec.conv_bytes, spec.conv_dtype, spec.conv_shape)

    def ssm_state(self, layer: int) -> torch.Tensor:
        """``[num_slots, nheads, head_dim, d_state]`` strided view of layer ``layer``'s SSM state."""
        layer = self._layer(layer)
        spec = self.layout.layers[layer]
        return self._view(self.layout.ssm_offsets[layer], spec.ssm_bytes, spec.ssm_dtype, spec.ssm_shape)

    def carried_hidden(self) -> torch.Tensor:
        """``[num_slots, carried_hidden]`` strided view of the carried hidden vectors (``ValueError``
        for a layout without one)."""
        lay = self.layout
        if not lay.carried_hidden:
            raise ValueError(f"pool {self.pool_id!r} carries no hidden state (its layout has carried_hidden=0)")
        return self._view(lay.carried_offset, lay.carried_bytes, lay.carried_dtype, (lay.carried_hidden,))

    def copy_buffer(self) -> torch.Tensor:
        """A copy of the whole buffer, for tests and fault checks (not a prefix-cache snapshot)."""
        return self.buffer.clone()

    def __repr__(self) -> str:
        return (
            f"MambaStatePool({self.pool_id!r}, layers={len(self.layout.layers)}, capacity={self.capacity}, "
            f"row_bytes={self.layout.row_bytes}, device={self.device})"
        )
