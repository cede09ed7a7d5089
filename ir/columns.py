"""Columns of IR nodes: declared column fields, the node bases that check them, int checks.

Bulk per-request and per-token data is held as read-only ``numpy`` int64 (or bool) arrays. A node
declares each column once, at the field, with its dtype (the converter), its length relation and
its bounds::

    @final
    @attrs.frozen(kw_only=True)
    class DecodeBatch(ColumnNode, RequestRows):
        rids: I64 = column(converter=as_i64, metadata=per(REQUEST))
        slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1))
        input_ids: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0))

- ``per(REQUEST)``: one entry per request (the first ``REQUEST`` column defines ``num_requests``);
  ``per(tokens_of("extend_lens"))``: packed per-token entries, ``sum(extend_lens)`` of them;
  ``per(WINDOW)``: ``k + 1`` per request; ``per(length_of("input_ids"))``; ``per(ANY)``.
- ``min=`` / ``max=``: bounds on every value; ``max`` may be a ``Bound`` computed from the node
  (``MAX_SEQ_LEN - extend_lens``).

``ColumnNode`` compiles these declarations into the class's checks once, when attrs makes the
class, and runs them on construction (``__attrs_post_init__`` -> ``check_fields``), around two
optional hooks: ``_check_first`` (scalars the checks use, like ``k``) and ``_check`` (the node's own
invariants). Fields annotated with a node class (``MambaInit | None``) are type-checked too
(``Node``). Errors name the node, the field and the bad value.

``column`` is ``attrs.field`` for mypy, so its attrs plugin types each constructor argument from the
converter (``IntColumn`` for ``as_i64``): the declaration rides in ``metadata``, and at run time
``column`` adds the by-contents equality (``eq=column_key``).

Immutability (a node's columns can never change, whoever holds a reference to them):

- **IR-owned memory.** Every column's memory is owned by an immutable ``bytes`` object: columns are
  made as an array over ``arr.tobytes()`` (``own``). numpy refuses
  ``arr.flags.writeable = True`` on such an array and on every view of it, because the buffer it
  came from is read-only; a plain read-only array (``flags.writeable = False`` on memory the array
  owns) could be flipped back, and a read-only view of someone else's memory (a ``bytearray``, a
  ``torch`` tensor, a writeable array) changes when its owner does.
- **Converters copy anything else.** ``as_i64``/``as_bool`` pass an array through unchanged only
  when it is 1-D, of the column's dtype, and its ``.base`` chain ends in a ``bytes`` object
  (``is_owned``; e.g. ``np.frombuffer(some_bytes, np.int64)`` or a view of a column): immutable
  memory, so sharing it is safe whoever made it. That is what
  lets a plan share its batch's columns, and a node built from another node's columns, without a
  copy. Every other input (lists, writeable or foreign-backed arrays, tensors) is copied once.
- **Pickle and deep copies.** numpy unpickles (and deep-copies) arrays as writeable arrays owning
  their memory. Nodes with columns derive from ``ColumnNode``, whose ``__reduce__`` rebuilds the
  node through its constructor: the converters turn the unpickled arrays into IR-owned columns
  again and the node's local checks run on the rebuilt node. ``copy.copy`` shares the columns,
  ``copy.deepcopy`` and ``pickle`` give fresh IR-owned ones. (Alternatives considered: an
  ``ndarray`` subclass with its own ``__reduce__`` would also cover arrays outside nodes, but every
  numpy operation on a column would then return the subclass, with ``__array_finalize__`` on the
  hot path; registering a reducer for ``np.ndarray`` in ``copyreg`` would change every array of the
  process and would not affect ``deepcopy``.)
- **Cost.** ``own`` is one ``tobytes`` copy and an array over the bytes. Passes that compute a
  column call ``freeze``/``frozen_i64``, which make it IR-owned, so it crosses constructors and
  ``build_unchecked`` without further copies; ``is_owned`` (the pass-through test) is one walk of
  the ``.base`` chain. ``batchc bench pipeline`` measures the per-step cost.

No silent coercion: an int column or an int field takes Python ``int`` (not ``bool``) and numpy
integer scalars or arrays, within int64. ``bool``, ``float`` (``3.0`` too), ``str``, ``None`` and
values outside int64 are refused with ``IRValidationError`` naming the node, the field and the bad
value, never an ``OverflowError`` from numpy or a ``TypeError`` from a comparison. The converters
cannot raise (they do not know the field's name): they return a one-element object array holding a
``_Bad`` marker, and ``check_column`` (which every node runs on every column) raises with the name.

Every other field is type-checked by its node's ``check_fields`` too: node-typed fields with
``check_instance`` (``Ticket(pool=..., op=None)`` is refused naming ``Ticket.op``), pool names with
``check_pool`` (a non-empty ``str``, never ``str(value)``). Nodes built by passes through
``build_unchecked`` skip these checks like every other local check; ``ir.verify`` re-runs them.
"""

from __future__ import annotations

import operator
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, TypeVar, cast

import attrs
import numpy as np
import numpy.ma  # noqa: F401  (np.unique imports it on its first call: here, so no serving step pays for that import)
import numpy.typing as npt

from ir.errors import IRValidationError
from ir.ids import MambaSlot, RequestId

# (explicit: ``column`` is ``attrs.field`` re-exported for mypy, see below)
__all__ = [
    "ANY",
    "BoolArray",
    "BoolColumn",
    "F64",
    "FloatColumn",
    "Bound",
    "ColumnDecl",
    "ColumnNode",
    "Composite",
    "I64",
    "INT64_MAX",
    "INT64_MIN",
    "IntColumn",
    "MAX_SEQ_LEN",
    "MAX_SEQ_LEN_WHAT",
    "Node",
    "KV_NAMES",
    "Per",
    "REQUEST",
    "REQUEST_NAME",
    "SERIAL_NAME",
    "RequestRows",
    "same_column",
    "Shown",
    "SLOT_NAME",
    "SMALL_COLUMN",
    "WINDOW",
    "as_bool",
    "as_f64",
    "as_i64",
    "build_unchecked",
    "check_column",
    "check_instance",
    "check_int",
    "check_max",
    "check_min",
    "check_opt_int",
    "check_pool",
    "column",
    "column_key",
    "column_total",
    "shown",
    "shown_of",
    "first_bad_int",
    "first_common",
    "first_missing",
    "freeze",
    "frozen_i64",
    "has_duplicates",
    "int_problem",
    "ints",
    "is_owned",
    "length_of",
    "own",
    "per",
    "plain_ints",
    "tokens_of",
    "type_names",
]

I64: TypeAlias = npt.NDArray[np.int64]
BoolArray: TypeAlias = npt.NDArray[np.bool_]
IntColumn: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
"""What an int column accepts: a list, tuple, range, ``bytes`` (byte tokens) or integer array."""
BoolColumn: TypeAlias = Sequence[bool] | BoolArray
F64: TypeAlias = npt.NDArray[np.float64]
FloatColumn: TypeAlias = Sequence[float] | npt.NDArray[np.floating[Any]] | npt.NDArray[np.integer[Any]]
"""What a float column accepts: numbers (ints too, never ``bool``), or a float or integer array."""

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def _node_name(node: object) -> str:
    return node if isinstance(node, str) else type(node).__name__


def int_problem(value: object) -> str | None:
    """Why ``value`` is not an int64 integer, as a message fragment, or ``None`` when it is one.

    Accepted: ``int`` (and its subclasses, ``bool`` excepted) and numpy integer scalars, within
    int64. ``True`` is not slot 1 and ``3.0`` is not slot 3."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return f"must be an int, not {type(value).__name__}"
    if not INT64_MIN <= int(value) <= INT64_MAX:
        return "must fit in int64"
    return None


def plain_ints(items: Sequence[object]) -> bool:
    """Whether every item is a plain ``int`` (no subclass, so no ``bool``) within int64: the common
    case of a bulk check, decided in C loops (``set(map(type, ...))``, ``min``, ``max``) instead of
    one ``int_problem`` call per item."""
    if not set(map(type, items)) <= {int}:
        return False
    values: Sequence[int] = items  # type: ignore[assignment]  # (every item is an int: checked just above; a cast() is a call on this hot path)
    return not values or (INT64_MIN <= min(values) and max(values) <= INT64_MAX)


def check_int(node: object, name: str, value: object) -> int:
    """``value`` as an ``int``, or ``IRValidationError`` naming ``node.name`` and ``value`` when it is
    not an int64 integer."""
    if type(value) is int and INT64_MIN <= value <= INT64_MAX:  # the common case, without int_problem's call
        return value
    problem = int_problem(value)
    if problem is not None:
        raise IRValidationError(_node_name(node), name, value, problem)
    checked: int = int(value)  # type: ignore[call-overload]  # (an int or numpy integer: int_problem said so; a cast() is a call on this hot path)
    return checked


def check_opt_int(node: object, name: str, value: object) -> int | None:
    """``check_int`` for an optional field (``None`` is allowed)."""
    return None if value is None else check_int(node, name, value)


def first_bad_int(items: Sequence[object]) -> tuple[object, str] | None:
    """The first entry of ``items`` that is not an int64 integer and why (``int_problem``), or
    ``None`` when every entry is one. Plain ints are decided in C loops (``plain_ints``); the
    per-entry loop runs only when some entry is not a plain ``int``."""
    if plain_ints(items):
        return None
    for v in items:
        problem = int_problem(v)
        if problem is not None:
            return v, problem
    return None


def type_names(cls: type | tuple[type, ...], optional: bool = False) -> str:
    """``"a MambaInit"``, ``"a MambaInit or None"``, ``"an ExtendBatch or a DecodeBatch"``."""
    classes = cls if isinstance(cls, tuple) else (cls,)
    names = [f"{'an' if c.__name__[0] in 'AEIOU' else 'a'} {c.__name__}" for c in classes]
    return " or ".join([*names, "None"] if optional else names)


def check_instance(node: object, name: str, value: object, cls: type | tuple[type, ...], *, optional: bool = False) -> None:
    """``IRValidationError`` naming ``node.name``, ``value`` and its type when ``value`` is not an
    instance of ``cls`` (``None`` is allowed with ``optional``): the type check of a node-typed field
    (an attrs ``instance_of`` validator would raise a ``TypeError`` without the node's name)."""
    if isinstance(value, cls) or (optional and value is None):
        return
    raise IRValidationError(_node_name(node), name, value, f"must be {type_names(cls, optional)}, not {type(value).__name__}")


def check_pool(node: object, name: str, value: object) -> None:
    """A pool name (``PoolId``): a non-empty ``str``. Nothing is converted: ``None`` is not pool
    ``'None'``."""
    if not isinstance(value, str):
        raise IRValidationError(_node_name(node), name, value, f"must be a pool name (a non-empty str), not {type(value).__name__}")
    if not value:
        raise IRValidationError(_node_name(node), name, value, "must be a non-empty pool name")


def is_owned(arr: npt.NDArray[Any]) -> bool:
    """True when ``arr``'s memory is immutable: its ``.base`` chain (views of views) ends in a
    ``bytes`` object, as for the arrays ``own`` makes. numpy keeps an array over a read-only buffer,
    and every view of one, read-only and refuses to flip it writeable, so nobody can write it."""
    base: object = arr.base  # numpy types it NDArray | None; it can be any buffer owner
    while isinstance(base, np.ndarray):
        base = base.base
    return type(base) is bytes and not arr.flags.writeable  # (the flag is implied; checked for robustness)


def own(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """An IR-owned copy of ``arr`` (read-only, not flippable, C order): one ``tobytes`` copy, then an
    array over those bytes (``np.ndarray(..., buffer=)``: ``np.frombuffer`` costs twice as long)."""
    return np.ndarray(arr.shape, arr.dtype, arr.tobytes())


@attrs.frozen
class _Bad:
    """What a converter returns (inside a one-element object array) for input it refuses:
    ``check_column`` raises ``IRValidationError`` with the field's name, ``value`` and ``reason``."""

    value: object
    reason: str

    def __repr__(self) -> str:
        return repr(self.value)


def _refuse(value: object, reason: str) -> npt.NDArray[Any]:
    arr = np.empty(1, dtype=object)
    arr[0] = _Bad(value, reason)
    return arr


_OUT_OF_INT64 = "must be a 1-D sequence of ints within int64, got an entry outside it"


def _first_out_of_int64(values: Iterable[object]) -> object:
    return next(v for v in values if int_problem(v) is not None)


_INT64 = np.dtype(np.int64)


def _i64_from_array(value: npt.NDArray[Any]) -> I64:
    if value.ndim == 1 and value.dtype == _INT64:
        # immutable already (e.g. shared between a batch and its plan), or one copy
        return value if is_owned(value) else own(value)
    if value.dtype.kind not in "iu" or value.ndim != 1:
        return cast(I64, value)  # rejected, with the field's name, by check_column
    if value.dtype.kind == "u" and value.size and int(value.max()) > INT64_MAX:
        return _refuse(int(value[value > INT64_MAX][0]), _OUT_OF_INT64)
    return own(value.astype(np.int64, copy=False))


def _i64_from_sequence(value: Sequence[object]) -> I64:
    kinds = set(map(type, value))
    if not all(issubclass(t, (int, np.integer)) and t is not bool for t in kinds):
        bad = next(v for v in value if isinstance(v, bool) or not isinstance(v, (int, np.integer)))
        return _refuse(bad, f"must be a 1-D sequence of ints, got a {type(bad).__name__} entry")
    try:
        arr = np.array(value, dtype=np.int64)
    except OverflowError:
        return _refuse(_first_out_of_int64(value), _OUT_OF_INT64)
    return cast(I64, own(arr))


def _as_i64(value: object) -> I64:
    """Converter of int columns: the input itself when it is an IR-owned int64 column, else an
    IR-owned copy; input it refuses comes back as something ``check_column`` rejects with the
    field's name (an array of another dtype or shape, or a ``_Bad`` marker)."""
    if isinstance(value, np.ndarray):
        return _i64_from_array(value)
    if isinstance(value, (bytes, bytearray)):
        return cast(I64, own(np.frombuffer(value, dtype=np.uint8).astype(np.int64)))
    if isinstance(value, str):
        return _refuse(value, "must be a 1-D sequence of ints, not a str")  # a sequence, but not of ints
    if isinstance(value, Sequence):
        return _i64_from_sequence(value)
    arr = _array_like(value)
    if arr is None:
        return _refuse(value, f"must be a 1-D sequence of ints, not {type(value).__name__}")
    return _i64_from_array(arr)


def _array_like(value: object) -> npt.NDArray[Any] | None:
    """An array-like that is not a sequence (a ``torch`` tensor) as an array, else ``None``."""
    if isinstance(value, np.generic) or not hasattr(value, "__array__"):
        return None
    try:
        return np.asarray(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _as_bool(value: object) -> BoolArray:
    """Converter of bool columns (same contract as ``as_i64``): only ``bool``/``np.bool_`` entries."""
    if isinstance(value, (list, tuple)):
        bad = next((v for v in value if not isinstance(v, (bool, np.bool_))), _NO_BAD)
        if bad is not _NO_BAD:
            return _refuse(bad, f"must be a 1-D sequence of bools, got a {type(bad).__name__} entry")
        return cast(BoolArray, own(np.array(value, dtype=np.bool_)))
    arr = value if isinstance(value, np.ndarray) else _array_like(value)
    if arr is None:
        return _refuse(value, f"must be a 1-D sequence of bools, not {type(value).__name__}")
    if arr.dtype != np.bool_ or arr.ndim != 1:
        return cast(BoolArray, arr)  # rejected by check_column
    return cast(BoolArray, arr) if is_owned(arr) else cast(BoolArray, own(arr))


_NO_BAD = object()

_FLOAT64 = np.dtype(np.float64)


def _as_f64(value: object) -> F64:
    """Converter of float columns (same contract as ``as_i64``): ``int``, ``float`` and numpy
    numbers, never ``bool`` (``True`` is not 1.0); float or integer arrays. NaN and infinities pass
    the converter: a node that refuses them says so in its ``_check``."""
    if isinstance(value, (list, tuple)):
        bad = next(
            (v for v in value if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating))), _NO_BAD
        )
        if bad is not _NO_BAD:
            return cast(F64, _refuse(bad, f"must be a 1-D sequence of numbers, got a {type(bad).__name__} entry"))
        return cast(F64, own(np.array(value, dtype=np.float64)))
    arr = value if isinstance(value, np.ndarray) else _array_like(value)
    if arr is None:
        return cast(F64, _refuse(value, f"must be a 1-D sequence of numbers, not {type(value).__name__}"))
    if arr.ndim != 1 or arr.dtype.kind not in "fiu":
        return cast(F64, arr)  # rejected by check_column
    if arr.dtype == _FLOAT64:
        return cast(F64, arr) if is_owned(arr) else cast(F64, own(arr))
    return cast(F64, own(arr.astype(np.float64)))


# The converters accept anything at run time (bad input is reported by the node's check, with the
# field's name), while mypy's attrs plugin types each constructor argument from the declared form.
if TYPE_CHECKING:

    def as_i64(value: IntColumn) -> I64: ...
    def as_bool(value: BoolColumn) -> BoolArray: ...
    def as_f64(value: FloatColumn) -> F64: ...

else:
    as_i64 = _as_i64
    as_bool = _as_bool
    as_f64 = _as_f64


def check_column(
    node: object, name: str, arr: npt.NDArray[Any], expected: int | None, what: str = "len(rids)", *, bools: bool = False,
    floats: bool = False,
) -> None:
    """A 1-D int64 column (bool with ``bools``, float64 with ``floats``), of length ``expected`` when given."""
    if arr.dtype != (np.bool_ if bools else np.float64 if floats else np.int64):
        if arr.dtype == object and arr.shape == (1,) and isinstance(arr[0], _Bad):
            raise IRValidationError(_node_name(node), name, arr[0].value, arr[0].reason)
        kind = "bools" if bools else "numbers" if floats else "ints"
        raise IRValidationError(_node_name(node), name, arr, f"must be a 1-D sequence of {kind}, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise IRValidationError(_node_name(node), name, arr, f"must be 1-D, got shape {arr.shape}")
    if expected is not None and arr.shape[0] != expected:
        raise IRValidationError(_node_name(node), name, arr.shape[0], f"length must equal {what} ({expected})")


def frozen_i64(values: np.ndarray[Any, Any] | Sequence[int]) -> I64:
    """An IR-owned int64 column of ``values`` (for passes building columns from trusted values:
    no per-entry type check, unlike ``as_i64``). An IR-owned int64 array comes back unchanged."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype == _INT64 and is_owned(values):
        return values
    return own(np.asarray(values, dtype=np.int64))


def freeze(arr: I64) -> I64:
    """An IR-owned copy of an int64 array a pass has just computed (one ``tobytes`` copy)."""
    return own(arr)


def column_key(arr: npt.NDArray[Any]) -> tuple[tuple[int, ...], str, bytes]:
    """Equality key of a column field: nodes compare columns by contents."""
    return (arr.shape, arr.dtype.str, arr.tobytes())


def ints(values: Iterable[object], node: str, name: str) -> tuple[int, ...]:
    """Normalise an iterable of ints (Python or numpy integers) to a tuple of Python ints, for small
    structural fields; ``IRValidationError`` names ``node.name`` and the first entry that is not an
    int64 integer (``bool``, ``float``, ``str``, ``None``, out of int64)."""
    items = tuple(values)
    if plain_ints(items):
        plain: tuple[int, ...] = items  # type: ignore[assignment]  # (plain ints: checked just above)
        return plain
    bad = first_bad_int(items)
    if bad is not None:
        raise IRValidationError(node, name, bad[0], f"every entry {bad[1]}")
    return tuple(int(cast(int, v)) for v in items)


MAX_SEQ_LEN = 2**31 - 1
"""Largest sequence length, prefix length or chunk length a node accepts (positions are int32 in
the kernels). The bound also keeps every sum a pass forms (``prefix_lens + extend_lens``,
``sum(extend_lens)``, ``seq_lens + k + 1``) far inside int64, so nothing wraps around."""


MAX_SEQ_LEN_WHAT = "MAX_SEQ_LEN (2**31 - 1)"
"""How a message names ``MAX_SEQ_LEN`` as a bound (``per(..., max=MAX_SEQ_LEN, max_what=MAX_SEQ_LEN_WHAT)``)."""


def _small_ints(arr: npt.NDArray[Any]) -> list[int] | None:
    """``arr``'s values as Python ints when it is a 1-D int64 column of at most ``SMALL_COLUMN``
    entries (a bound check on them is then two C loops, ``tolist`` and ``min``/``max``, where a
    numpy reduction's fixed cost is several times larger at scheduler batch sizes), else ``None``."""
    if arr.dtype is _INT64 and arr.ndim == 1 and arr.shape[0] <= SMALL_COLUMN:
        values: list[int] = arr.tolist()  # (numpy types tolist as Any: no cast() call on this hot path)
        return values
    return None


def check_max(node: object, name: str, arr: I64, maximum: int | I64, what: str = "") -> None:
    """Every value of ``arr`` is ``<= maximum`` (a bound, or one per entry; ``what`` names it in
    the message)."""
    if arr.size:
        if not isinstance(maximum, np.ndarray):
            small = _small_ints(arr)
            if small is not None and max(small) <= maximum:
                return  # (a violation is located below, in numpy, for its message)
        over = arr > maximum
        if over.any():
            raise IRValidationError(_node_name(node), name, int(arr[over][0]), f"every value must be <= {what or maximum}")


def check_min(node: object, name: str, arr: I64, minimum: int) -> None:
    """Every value of ``arr`` is ``>= minimum``; else ``IRValidationError`` naming ``node``, the field
    ``name`` and the first value below it."""
    if not arr.size:
        return
    small = _small_ints(arr)
    if small is not None and min(small) >= minimum:
        return
    if int(arr.min()) < minimum:
        bad = int(arr[arr < minimum][0])
        raise IRValidationError(_node_name(node), name, bad, f"every value must be >= {minimum}")


N = TypeVar("N")


def build_unchecked(cls: type[N], **fields: object) -> N:
    """Construct a frozen node without its converters and local checks.

    Only for passes whose output columns are IR-owned (another node's columns, or arrays made by
    ``freeze``/``frozen_i64``) int64/bool arrays derived from already checked nodes by operations
    that keep the local invariants (``seq_lens + 1`` of a checked batch is still >= 1).
    ``ir.verify.verify`` re-runs the local checks, so ``BATCHC_VERIFY=2`` (the test setting) catches
    a pass that breaks this promise; ``tests/ir/test_immutable_ir.py`` checks that every pass's output
    columns are IR-owned.
    """
    node = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(node, name, value)
    defaults = _DEFAULTS.get(cls)
    if defaults is None:
        defaults = _DEFAULTS[cls] = tuple((a.name, a.default) for a in attrs.fields(cast(Any, cls)))
    for name, default in defaults:  # a field left out takes its plain default (never a factory)
        if name not in fields:
            if default is attrs.NOTHING or isinstance(default, attrs.Factory):  # type: ignore[arg-type]  # attrs types Factory as a function; it is a class
                raise TypeError(f"build_unchecked({cls.__name__}): field {name!r} has no plain default")
            object.__setattr__(node, name, default)
    return node


_DEFAULTS: dict[type, tuple[tuple[str, object], ...]] = {}
"""Per node class, every field's name and default, in order (``build_unchecked``; read once per
class: ``attrs.fields`` costs two Python calls per node built)."""


def _rebuild(cls: type[N], fields: dict[str, object]) -> N:
    """Unpickling (and deep copying) of a ``ColumnNode``: through the constructor, so the converters
    make every column IR-owned again and the local checks run."""
    return cast("Callable[..., N]", cls)(**fields)


# -- declarations ----------------------------------------------------------------------------------


@attrs.frozen
class Per:
    """How many entries a column has (``per(...)``'s first argument). Build one with ``REQUEST``,
    ``ANY``, ``WINDOW``, ``tokens_of(name)`` or ``length_of(name)``."""

    kind: str
    of: str = ""

    @property
    def derived(self) -> bool:
        """Whether the length is computed from other columns' values (checked after them)."""
        return self.kind in ("tokens", "window")


REQUEST = Per("request")
"""One entry per request. The node's first ``REQUEST`` column (``rids``) defines ``num_requests``;
every other one must have as many entries (message: ``len(rids)``)."""
ANY = Per("any")
"""Any length (a node-specific ``_check`` may relate it to others)."""
WINDOW = Per("window")
"""``k + 1`` entries per request (speculative windows, flattened row-major); the node has ``k``."""


def tokens_of(lengths: str) -> Per:
    """Packed per-token entries: as many as ``sum(lengths)`` (``lengths`` is a per-request column)."""
    return Per("tokens", lengths)


def length_of(column: str) -> Per:
    """As many entries as the (earlier declared) ``column``."""
    return Per("same", column)


@attrs.frozen
class Bound:
    """An upper bound that depends on the node (another column, ``k``): ``value(node)`` is an int or
    one bound per entry; ``what`` names it in the message. Checked after the constant bounds."""

    what: str
    value: Callable[[Any], int | I64]


@attrs.frozen
class Shown:
    """How a field reads in the text form (``ir.printer`` writes it, ``ir.parse`` reads it back).

    ``key`` is the word before ``=`` (``prefix=4``), the word itself for a flag (``more``) and the
    prefix of a bracket (``clear[s1 s2]``); ``""`` prints the value alone. ``name`` makes ids print
    as names: ``"r"`` request ids, ``"s"`` slots, ``"#"`` serials, ``"k"`` KV locations (in runs,
    ``k3..k7``); ``""`` prints data (ints, token ids). ``line``: the field prints on a line of its
    own under the header, after this word (a tuple of nodes: a line per node). ``pair``: the tuple
    field zipped with this one (``cow[s3->s2]``). ``tags``: for a union of nodes, the word of each
    variant (``intent=cow``), its fields following."""

    key: str = ""
    name: str = ""
    line: str = ""
    pair: str = ""
    tags: tuple[tuple[str, type], ...] = ()


REQUEST_NAME = Shown(name="r")
SLOT_NAME = Shown(name="s")
SERIAL_NAME = Shown(name="#")
KV_NAMES = Shown("kv", "k")


@attrs.frozen(kw_only=True)
class ColumnDecl:
    """What ``column`` declares about one column field: its length relation, its bounds, how it
    reads in the text form, and whether it holds bools (``converter=as_bool``) or int64s
    (``converter=as_i64``)."""

    per: Per = REQUEST
    min: int | None = None
    max: int | Bound | None = None
    max_what: str = ""
    """How the message names a constant ``max`` (``MAX_SEQ_LEN (2**31 - 1)``); the number if empty."""
    shown: Shown | None = None
    bools: bool = False
    floats: bool = False


_DECL = "ir.columns"
_SHOWN = "ir.text"


def per(
    per: Per = REQUEST, *, min: int | None = None, max: int | Bound | None = None, max_what: str = "", text: str | Shown | None = None
) -> dict[str, ColumnDecl]:
    """A column declaration, as ``column``'s ``metadata`` (``text``: its ``Shown``, a plain string
    for data under that key)::

        slots: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1, text=SLOT_NAME))
        input_ids: I64 = column(converter=as_i64, metadata=per(tokens_of("extend_lens"), min=0, text="tokens"))
    """
    return {_DECL: ColumnDecl(per=per, min=min, max=max, max_what=max_what, shown=Shown(text) if isinstance(text, str) else text)}


def shown(
    key: str = "", name: str = "", *, line: str = "", pair: str = "", tags: Mapping[str, type] | None = None
) -> dict[str, Shown]:
    """How a field that is not a column reads in the text form, as ``attrs.field``'s ``metadata``
    (see ``Shown``); a field without it reads as ``<field name>=<value>``, a node-typed one as a
    nested node."""
    return {_SHOWN: Shown(key, name, line, pair, tuple((tags or {}).items()))}


def shown_of(field: Any) -> tuple[ColumnDecl | None, Shown | None]:  # (attrs.Attribute: generic only for mypy)
    """The column declaration of an attrs field (``None``: not a column) and its ``Shown``."""
    decl = field.metadata.get(_DECL)
    return decl, decl.shown if decl is not None else field.metadata.get(_SHOWN)


def _column(*, converter: object, metadata: Mapping[str, object] | None = None, **kwargs: Any) -> Any:
    """Declare a column field of a ``ColumnNode``: ``attrs.field`` with a converter (``as_i64``,
    ``as_bool`` or ``as_f64``), the declaration from ``per(...)`` in ``metadata``, and the by-contents
    equality (``column_key``); the other keyword arguments go to ``attrs.field``. Refuses (``TypeError``,
    when the class is defined) any other converter, and metadata that did not come from ``per``."""
    decl = (metadata or {}).get(_DECL, ColumnDecl())
    if converter is not _as_i64 and converter is not _as_bool and converter is not _as_f64:
        raise TypeError(f"column: converter must be as_i64, as_bool or as_f64, not {converter!r}")
    if not isinstance(decl, ColumnDecl):
        raise TypeError(f"column: metadata must come from per(...), got {metadata!r}")
    decl = attrs.evolve(decl, bools=converter is _as_bool, floats=converter is _as_f64)
    return attrs.field(converter=converter, eq=column_key, metadata={_DECL: decl}, **kwargs)


# The column field factory. mypy's attrs plugin types a field's constructor argument from the
# ``converter=`` of an ``attrs.field`` call only, so for mypy ``column`` *is* ``attrs.field`` (and a
# call must use ``attrs.field``'s parameters: the declaration rides in ``metadata``); at run time it
# adds the by-contents equality and checks that the declaration is one.
if TYPE_CHECKING:
    from attrs import field as column
else:
    column = _column


# -- nodes -----------------------------------------------------------------------------------------


@attrs.frozen
class _Length:
    """A column's expected length: ``kind`` is ``key`` (unchecked), ``request``, ``same`` (len of
    ``of``), ``tokens`` (sum of ``of``) or ``window``; ``what`` names it in the message."""

    kind: str
    of: str
    what: str


@attrs.frozen
class _ColumnCheck:
    name: str
    bools: bool
    floats: bool
    length: _Length | None
    min: int | None
    max: int | None
    max_what: str
    bound: Bound | None


@attrs.frozen
class _Columns:
    """The column checks of one node class, in the order they run: first the columns whose length
    is known from lengths alone (shape, then bounds), then those whose length is computed from
    other columns' values (per-token, windows). Dependent bounds (``Bound``) run after constant ones."""

    key: str | None
    plain: tuple[_ColumnCheck, ...]
    derived: tuple[_ColumnCheck, ...]


def _compile_columns(cls: type, fields: Sequence[Any]) -> _Columns:  # (attrs.Attribute: generic only for mypy)
    decls = [(a.name, a.metadata[_DECL]) for a in fields if _DECL in a.metadata]
    key = next((name for name, d in decls if d.per == REQUEST), None)
    seen: set[str] = set()
    plain: list[_ColumnCheck] = []
    derived: list[_ColumnCheck] = []
    for name, d in decls:
        p = d.per
        if p.kind in ("same", "tokens") and p.of not in seen:
            raise TypeError(f"{cls.__name__}.{name}: per {p.kind} of {p.of!r}, which is not a column declared before it")
        if p.kind == "window" and key is None:
            raise TypeError(f"{cls.__name__}.{name}: a window column needs a REQUEST column before it")
        length = {
            "request": None if name == key else _Length("request", cast(str, key), f"len({key})"),
            "any": None,
            "same": _Length("same", p.of, f"len({p.of})"),
            "tokens": _Length("tokens", p.of, f"sum({p.of})"),
            "window": _Length("window", cast(str, key), f"len({key}) * (k + 1)"),
        }[p.kind]
        bound = d.max if isinstance(d.max, Bound) else None
        const = d.max if isinstance(d.max, int) else None
        (derived if p.derived else plain).append(_ColumnCheck(name, d.bools, d.floats, length, d.min, const, d.max_what, bound))
        seen.add(name)
    return _Columns(key, tuple(plain), tuple(derived))


def _generate(cls: type[Node], cols: _Columns, parts: tuple[_Part, ...]) -> Callable[[Any], None]:
    """The local checks of one class as one straight-line function: its ``_check_first`` hook (when
    it has one), the type checks of its node-typed fields, its column checks, its ``_check`` hook.
    Made once per class (at its first check): construction then costs what hand-written checks did,
    with no per-column interpretation of the declarations."""
    lines = ["def check(node):"]
    names = {c.name: f"c{i}" for i, c in enumerate((*cols.plain, *cols.derived))}
    env: dict[str, object] = {
        "check_column": check_column, "check_min": check_min, "check_max": check_max, "check_instance": check_instance, "column_total": column_total,
        "INT64": _INT64, "BOOL": np.dtype(np.bool_), "FLOAT64": _FLOAT64, "SMALL": SMALL_COLUMN,
    }
    if cls._check_first is not Node._check_first:
        lines.append("    node._check_first()")
    for i, part in enumerate(parts):
        env[f"part{i}"] = part.cls
        lines.append(f"    v = node.{part.name}")
        lines.append(f"    if {'v is not None and ' if part.optional else ''}not isinstance(v, part{i}):")
        lines.append(f"        check_instance(node, {part.name!r}, v, part{i}, optional={part.optional})")
    if cols.key is not None:
        lines.append(f"    n = node.{cols.key}.shape[0]")
    for group in (cols.plain, cols.derived):
        for c in group:
            v = names[c.name]
            lines.append(f"    {v} = node.{c.name}")
            expected, what = "None", ""
            if c.length is not None:
                what = c.length.what
                expected = {
                    "request": "n",
                    "same": f"{names[c.length.of]}.shape[0]",
                    "tokens": f"column_total({names[c.length.of]})",
                    "window": "n * (int(node.k) + 1)",  # a window node checks ``k`` in ``_check_first``
                }[c.length.kind]
            # the common case decided inline (the canonical dtype object, 1-D, the length); anything
            # else goes to ``check_column``, which accepts what it accepts and words the refusal
            dtype = "BOOL" if c.bools else "FLOAT64" if c.floats else "INT64"
            if expected == "None":
                lines.append(f"    if {v}.dtype is not {dtype} or {v}.ndim != 1:")
            else:
                lines.append(f"    e = {expected}")
                lines.append(f"    if {v}.dtype is not {dtype} or {v}.ndim != 1 or {v}.shape[0] != e:")
                expected = "e"
            lines.append(f"        check_column(node, {c.name!r}, {v}, {expected}, {what!r}, bools={c.bools}, floats={c.floats})")
        for c in group:
            v = names[c.name]
            if c.min is None and c.max is None:
                continue
            # a small int64 column: its bounds from one ``tolist`` (``_small_ints``' case) without a
            # call per bound; a violation, or any other column, goes to ``check_min``/``check_max``,
            # which locate it for the message
            slow = []
            if c.min is not None:
                slow.append(f"check_min(node, {c.name!r}, {v}, {c.min})")
            if c.max is not None:
                slow.append(f"check_max(node, {c.name!r}, {v}, {c.max}, {c.max_what!r})")
            fails = " or ".join(([f"min(s) < {c.min}"] if c.min is not None else []) + ([f"max(s) > {c.max}"] if c.max is not None else []))
            lines.append(f"    if {v}.dtype is INT64 and 0 < {v}.shape[0] <= SMALL:")
            lines.append(f"        s = {v}.tolist()")
            lines.append(f"        if {fails}:")
            lines += [f"            {call}" for call in slow]
            lines.append(f"    elif {v}.shape[0]:")
            lines += [f"        {call}" for call in slow]
        for c in group:
            if c.bound is not None:
                env[f"bound_{names[c.name]}"] = c.bound
                b = f"bound_{names[c.name]}"
                lines.append(f"    check_max(node, {c.name!r}, {names[c.name]}, {b}.value(node), {b}.what)")
    aligned = [p for p in parts if isinstance(p.cls, type) and issubclass(p.cls, Node) and p.cls.ALIGNED]
    if aligned:
        if cols.key is None:
            raise TypeError(f"{cls.__name__}: a field aligned with the rows needs a per-request column")
        env["check_aligned"] = check_aligned
        for p in aligned:
            lines.append(f"    if node.{p.name} is not None:")
            lines.append(f"        check_aligned(node, {p.name!r}, node.{p.name}, n, {cols.key!r})")
    if cls._check is not Node._check:
        lines.append("    node._check()")
    lines.append("    return None")
    code = compile("\n".join(lines) + "\n", f"<local checks of {cls.__name__}>", "exec")
    exec(code, env)  # our own declarations, rendered above
    return cast("Callable[[Any], None]", env["check"])


def column_total(arr: I64) -> int:
    """The sum of a lengths column (the entries a per-token column must have): a Python sum of a
    small column (``SMALL_COLUMN``), numpy's otherwise. Its bounds are checked before (``_Columns``
    runs the derived lengths last), so the sum fits int64 and both give the same number."""
    if arr.shape[0] <= SMALL_COLUMN and arr.dtype is _INT64:
        values: list[int] = arr.tolist()  # (numpy types tolist as Any)
        return sum(values)
    return int(arr.sum())


def check_aligned(node: object, name: str, value: Any, n: int, key: str) -> None:
    """A node-typed field aligned with ``node``'s rows (its class's ``ALIGNED``) holds one row per
    request: ``None``, or a node of ``n`` rows."""
    if value is not None and value.num_requests != n:
        raise IRValidationError(_node_name(node), name, value.num_requests, f"must hold one row per request: len({key}) = {n}")


def _first_check(node: Any) -> None:
    """A class's checker before its first use: generate it (``_generate``), install it, run it."""
    cls = type(node)
    cls._checker = staticmethod(_generate(cls, cls._columns, cls._node_parts()))
    cls._checker(node)


@attrs.frozen
class _Part:
    """A node-typed field: its value must be an instance of ``cls`` (or ``None`` when optional)."""

    name: str
    cls: type | tuple[type, ...]
    optional: bool


def _node_classes(tp: object) -> tuple[tuple[type, ...], bool] | None:
    """The ``Node`` classes of a resolved annotation (``X``, ``X | None``, ``X | Y``) and whether
    ``None`` is allowed, or ``None`` when it is not (only) node classes."""
    if isinstance(tp, TypeVar) and tp.__bound__ is not None:  # a generic node's field (``Ticket.op``): its bound
        tp = tp.__bound__
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    optional = type(None) in args
    classes = tuple(a for a in args if a is not type(None))
    if classes and all(isinstance(a, type) and issubclass(a, Node) for a in classes):
        return cast("tuple[type, ...]", classes), optional
    return None


def _compile_parts(cls: type) -> tuple[_Part, ...]:
    """The node-typed fields of ``cls``, from its annotations (resolved in its module, once)."""
    namespace = vars(sys.modules[cls.__module__])
    parts = []
    for a in attrs.fields(cast("type[attrs.AttrsInstance]", cls)):
        tp = a.type
        if isinstance(tp, str):
            try:
                tp = eval(tp, namespace)  # noqa: S307 (an annotation of our own module)
            except NameError as e:
                raise TypeError(f"{cls.__name__}.{a.name}: cannot resolve the annotation {a.type!r} ({e})") from None
        found = _node_classes(tp)
        if found is not None:
            classes, optional = found
            parts.append(_Part(a.name, classes[0] if len(classes) == 1 else classes, optional))
    return tuple(parts)


class Node:
    """Base of every IR node (frozen, kw-only attrs classes). Construction runs ``check_fields``,
    which ``ir.verify`` re-runs on nodes built by ``build_unchecked``:

    1. ``_check_first()``: the node's scalar fields that the checks below depend on (``k``);
    2. node-typed fields (annotated with a ``Node`` class, ``X | None`` or a union of them) hold one:
       ``IRValidationError`` naming the node, the field and the value otherwise;
    3. the declared columns (``ColumnNode``);
    4. ``_check()``: the node's own invariants.

    The sequence is generated as one function per class (``_generate``) at the class's first
    check, when every annotation resolves, and installed as its ``_checker``."""

    __slots__ = ()
    ALIGNED: ClassVar[bool] = False
    """Whether a node of this class, held in another node's field, has one row per row of that
    node (``ir.sampling.SamplingRows``): the holder's checks then compare the counts."""
    _parts: ClassVar[tuple[_Part, ...]] = ()
    _parts_of: ClassVar[type | None] = None
    _columns: ClassVar[_Columns] = _Columns(None, (), ())
    _checker: ClassVar[Callable[[Any], None]] = staticmethod(_first_check)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__attrs_attrs__" in cls.__dict__:  # the class attrs made (after the class statement's own)
            cls._checker = staticmethod(_first_check)  # generated at the first check, not inherited

    def __attrs_post_init__(self) -> None:
        type(self)._checker(self)

    @classmethod
    def _node_parts(cls) -> tuple[_Part, ...]:
        if cls._parts_of is not cls:
            cls._parts, cls._parts_of = _compile_parts(cls), cls
        return cls._parts

    def check_fields(self) -> None:
        """The local invariants (run on construction, and again by ``ir.verify`` at level 2)."""
        type(self)._checker(self)

    def _check_first(self) -> None:
        """Checks that must run before the generated ones (fields they use); none by default."""

    def _check(self) -> None:
        """The node's own invariants, after the generated checks; none by default."""



class Composite(Node):
    """A node made of other nodes (``MixedBatch``, ``DraftPlan``, ``IdleBatch``): its
    ``num_requests`` is the sum over its required node-typed fields that hold columns (0 for none)."""

    __slots__ = ()

    def parts(self) -> tuple[Node, ...]:
        """The nodes this one is made of (its node-typed fields that hold one), in declaration order."""
        cls = type(self)
        parts = cls._parts if cls._parts_of is cls else cls._node_parts()
        return tuple(v for p in parts if (v := getattr(self, p.name)) is not None)

    @property
    def num_requests(self) -> int:
        """The rows of the node: the ``num_requests`` of its required parts that hold columns, summed
        (a mixed node's extend rows plus its decode rows; 0 when it has no such part)."""
        return sum(
            int(getattr(self, p.name).num_requests)
            for p in self._node_parts()
            if not p.optional and isinstance(p.cls, type) and issubclass(p.cls, ColumnNode)
        )


class ColumnNode(Node):
    """Base of the IR nodes that hold columns, declared with ``column(converter=as_i64 or as_bool,
    metadata=per(...))``: the class's column checks are compiled once, when attrs makes the class,
    and run by ``check_fields`` (length relations, then bounds; see ``_Columns``).
    ``num_requests`` is the length of the first ``REQUEST`` column.

    ``pickle`` and ``copy`` rebuild the node through its constructor (``_rebuild``), so its columns
    are IR-owned (read-only, and not flippable back to writeable) after
    ``pickle.loads(pickle.dumps(node))`` and ``copy.deepcopy(node)`` too; numpy alone would hand
    back writeable arrays."""

    __slots__ = ()
    _rows_of: ClassVar[Callable[[Any], I64] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields = cls.__dict__.get("__attrs_attrs__")
        if fields is not None:  # the class attrs made (not the class statement's own, made first)
            cls._columns = _compile_columns(cls, fields)
            key = cls._columns.key
            cls._rows_of = None if key is None else staticmethod(operator.attrgetter(key))

    @property
    def num_requests(self) -> int:
        """The rows of the node: the length of its first ``REQUEST`` column. A node class without a
        per-request column raises ``TypeError``."""
        rows = type(self)._rows_of
        if rows is None:
            raise TypeError(f"{type(self).__name__} has no per-request column")
        return int(rows(self).shape[0])

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        cls = type(self)
        fields = attrs.fields(cast("type[attrs.AttrsInstance]", cls))
        return _rebuild, (cls, {a.name: getattr(self, a.name) for a in fields})


class RequestRows:
    """Typed row access of the nodes with ``rids`` and ``slots`` columns: an int64 column holds
    plain ints, and these give them their id types, so callers need no ``RequestId(int(...))``."""

    __slots__ = ()

    @property
    def rids(self) -> I64:
        """The request id of each row, in row order: a read-only int64 column (the node's field, or
        its parts' columns joined)."""
        raise NotImplementedError  # the node's column field

    @property
    def slots(self) -> I64:
        """The Mamba state slot of each row, aligned with ``rids``: a read-only int64 column of slots >= 1."""
        raise NotImplementedError  # the node's column field

    def rid_list(self) -> list[RequestId]:
        """``rids`` as a list of ``RequestId`` (one ``tolist``; the ids are the column's ints)."""
        return cast("list[RequestId]", self.rids.tolist())

    def slot_list(self) -> list[MambaSlot]:
        """``slots`` as a list of ``MambaSlot``."""
        return cast("list[MambaSlot]", self.slots.tolist())

    def rid_at(self, i: int) -> RequestId:
        """The request id of row ``i`` (negative ``i`` counts from the end)."""
        return RequestId(int(self.rids[i]))


SMALL_COLUMN = 64
"""Up to this many values (per column, or in both together), set checks go through Python sets:
numpy's sort-based ``intersect1d`` and ``argsort`` have a fixed overhead that dominates at
scheduler batch sizes, while from a few hundred values numpy is as fast or faster. Larger columns
use numpy. ``tests/ir/test_column_sets.py`` checks both paths agree across the threshold."""


def same_column(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    """``np.array_equal`` of two int or bool columns: the same array, or by their bytes when their
    dtypes agree (numpy's Python-level checks cost more than the comparison at a step's sizes). Not
    for float columns: a NaN would equal itself here."""
    if a is b:
        return True
    if a.dtype != b.dtype:
        return bool(np.array_equal(a, b))
    return a.shape == b.shape and a.tobytes() == b.tobytes()


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
