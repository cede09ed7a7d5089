"""Field helpers for IR nodes: read-only int64 columns, tuple converters, and their checks.

Bulk per-request and per-token data is held as read-only ``numpy`` int64 arrays, declared as
``attrs.field(converter=as_i64, eq=column_key)`` so that node equality compares contents and mypy's
attrs plugin types the constructor argument as ``IntColumn``. The converter copies whatever it is
given, so a caller who later mutates its own list or array cannot change a node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import attrs
import numpy as np
import numpy.typing as npt

from ir.errors import IRValidationError

I64: TypeAlias = npt.NDArray[np.int64]
BoolArray: TypeAlias = npt.NDArray[np.bool_]
IntColumn: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
"""What an int column accepts: a list, tuple, range, ``bytes`` (byte tokens) or integer array."""
BoolColumn: TypeAlias = Sequence[bool] | BoolArray


def _node_name(node: object) -> str:
    return type(node).__name__


def _frozen(arr: npt.NDArray[Any]) -> bool:
    """True when neither ``arr`` nor any array it views can be written through."""
    base: object = arr
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    return True


def _opaque(value: object) -> npt.NDArray[Any]:
    """Wrap a value numpy cannot read as a column, so the node's check names it."""
    arr = np.empty(1, dtype=object)
    arr[0] = value
    return arr


def _as_i64(value: object) -> I64:
    """Converter of int columns: a read-only int64 copy, or the input itself if it already is one.

    Input that is not a 1-D integer column passes through unconverted (as an array of another
    dtype or shape) and the node's ``check_fields`` rejects it with the field's name.
    """
    if isinstance(value, np.ndarray):
        if value.dtype == np.int64 and value.ndim == 1 and _frozen(value):
            return cast(I64, value)  # already an immutable column (e.g. shared between a batch and its plan)
        if value.dtype.kind not in "iu":
            return cast(I64, value)  # rejected, with the field's name, by check_fields
        arr = value.astype(np.int64, copy=True)
    elif isinstance(value, (bytes, bytearray)):
        arr = np.frombuffer(bytes(value), dtype=np.uint8).astype(np.int64)
    elif isinstance(value, str):
        return _opaque(value)  # a str is a sequence, but not of ints
    else:
        try:
            arr = np.array(value)
        except (TypeError, ValueError):
            return _opaque(value)
        if arr.size == 0 and arr.ndim == 1:
            arr = arr.astype(np.int64)
        elif arr.dtype.kind not in "iu":
            return arr  # rejected, with the field's name, by check_fields
        else:
            arr = arr.astype(np.int64, copy=False)
    arr.flags.writeable = False
    return arr


def _as_bool(value: object) -> BoolArray:
    """Converter of bool columns (same contract as ``as_i64``)."""
    if isinstance(value, np.ndarray) and value.dtype == np.bool_ and value.ndim == 1 and _frozen(value):
        return value
    try:
        arr = np.array(value)
    except (TypeError, ValueError):
        return _opaque(value)
    if arr.size == 0 and arr.ndim == 1:
        arr = arr.astype(np.bool_)
    if arr.dtype != np.bool_:
        return arr
    arr.flags.writeable = False
    return arr


# The converters accept anything at run time (bad input is reported by the node's check, with the
# field's name), while mypy's attrs plugin types each constructor argument from the declared form.
if TYPE_CHECKING:

    def as_i64(value: IntColumn) -> I64: ...
    def as_bool(value: BoolColumn) -> BoolArray: ...

else:
    as_i64 = _as_i64
    as_bool = _as_bool


def check_column(
    node: object, name: str, arr: npt.NDArray[Any], expected: int | None, what: str = "len(rids)", *, bools: bool = False
) -> None:
    """A 1-D int64 column (bool with ``bools``), of length ``expected`` when given."""
    if arr.dtype != (np.bool_ if bools else np.int64):
        shown: object = arr[0] if arr.dtype == object and arr.shape == (1,) else arr
        kind = "bools" if bools else "ints"
        raise IRValidationError(_node_name(node), name, shown, f"must be a 1-D sequence of {kind}, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise IRValidationError(_node_name(node), name, arr, f"must be 1-D, got shape {arr.shape}")
    if expected is not None and arr.shape[0] != expected:
        raise IRValidationError(_node_name(node), name, arr.shape[0], f"length must equal {what} ({expected})")


def frozen_i64(values: npt.ArrayLike) -> I64:
    """A read-only int64 copy of ``values`` (for passes building columns)."""
    arr = np.array(values, dtype=np.int64)
    arr.flags.writeable = False
    return arr


def freeze(arr: I64) -> I64:
    """Mark a fresh int64 array (one nobody else holds) read-only in place and return it."""
    arr.flags.writeable = False
    return arr


def column_key(arr: npt.NDArray[Any]) -> tuple[tuple[int, ...], str, bytes]:
    """Equality key of a column field: nodes compare columns by contents."""
    return (arr.shape, arr.dtype.str, arr.tobytes())


def ints(values: Iterable[int]) -> tuple[int, ...]:
    """Normalise an iterable of ints to a tuple (for small, structural fields)."""
    return tuple(int(v) for v in values)


def check_min(node: object, name: str, arr: I64, minimum: int) -> None:
    if arr.size and int(arr.min()) < minimum:
        bad = int(arr[arr < minimum][0])
        raise IRValidationError(_node_name(node), name, bad, f"every value must be >= {minimum}")


N = TypeVar("N")


def build_unchecked(cls: type[N], **fields: object) -> N:
    """Construct a frozen node without its converters and local checks.

    Only for passes whose output columns are read-only int64/bool arrays derived from already
    checked nodes by operations that keep the local invariants (``seq_lens + 1`` of a checked
    batch is still >= 1). ``ir.verify.verify`` re-runs the local checks, so ``BATCHC_VERIFY=2``
    (the test setting) catches a pass that breaks this promise.
    """
    node = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(node, name, value)
    return node


SMALL_COLUMN = 64
"""Up to this many values (per column, or in both together), set checks go through Python sets:
numpy's sort-based ``intersect1d`` and ``argsort`` cost microseconds of fixed overhead each, which
was most of a serving step's plan verification at scheduler batch sizes (measured: 8 values,
0.7 us against 4.5 us for the duplicate check, 1.1 us against 12 us for the intersection; at 256
values numpy is as fast or faster). Larger columns use numpy."""


def has_duplicates(arr: I64) -> bool:
    """Whether any value of the 1-D column occurs twice (the caller locates it for its message)."""
    n = int(arr.shape[0])
    if n < 2:
        return False
    if n <= SMALL_COLUMN:
        return len(set(arr.tolist())) != n
    ordered = np.sort(arr)
    return bool((ordered[1:] == ordered[:-1]).any())


def first_common(a: I64, b: I64) -> int | None:
    """The smallest value in both columns, or ``None`` when they are disjoint."""
    if a.shape[0] == 0 or b.shape[0] == 0:
        return None
    if a.shape[0] + b.shape[0] <= 2 * SMALL_COLUMN:
        both = set(a.tolist()).intersection(b.tolist())
        return min(both) if both else None
    common = np.intersect1d(a, b)
    return int(common[0]) if common.size else None


def first_missing(a: I64, b: I64) -> int | None:
    """The smallest value of ``a`` that is not in ``b``, or ``None`` when ``a`` is within ``b``."""
    if a.shape[0] == 0:
        return None
    if a.shape[0] + b.shape[0] <= 2 * SMALL_COLUMN:
        stray = set(a.tolist()).difference(b.tolist())
        return min(stray) if stray else None
    missing = np.setdiff1d(a, b)
    return int(missing[0]) if missing.size else None
