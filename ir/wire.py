"""Plans as packed, versioned messages: the one format in which a plan leaves the process that built it.

A message carries one forward plan and the scheduler's step number, for a backend in another process
(an executor process beside the scheduler, a tensor-parallel rank). It is not a pickle: the reader
builds nothing but IR nodes, and builds them through their constructors, so every invariant a node
checks on construction is checked again on arrival.

Layout (little-endian)::

    magic b"BCPL" | version u16 | reserved u16 | step u64 | header bytes u32 | column bytes u32
    header: compact ASCII JSON, the node tree, each column replaced by {"c": [dtype, offset, length]}
    spaces to 8 bytes, then every column's data in field order, each zero-padded to 8 bytes

Node fields are the declared attrs fields of the node classes registered below (every plan and the
tickets and ops they carry, and the sampling rows of a batch or plan): an int64, float64 or bool column, an int, a string (a pool name), ``None``, a
tuple of ints (slots of an init op) or of nodes, or a node. Columns are read-only views of the
message's bytes, which are immutable, so they are IR-owned as they are (``ir.columns.is_owned``); a
message handed over as a mutable buffer (``bytearray``, ``memoryview``) is copied once first.

Every malformed message is refused with ``WireError`` naming what is wrong, and nothing else
escapes ``unpack`` (no ``ValueError`` from a 5,000-digit integer, no ``RecursionError``, no
allocation sized by a declared length): a message of another version, a truncated or padded one,
(with ``expect_step``) one for another step, a header that is not JSON or nests more than
``MAX_DEPTH`` nodes and tuples, an unknown node kind or field set, a column outside the column
bytes, and a node whose fields break its invariants (the constructor's refusal, as ``WireError``).

Decoding is canonical: ``unpack`` accepts exactly the messages ``pack`` writes, so every accepted
message re-encodes to the same bytes (``pack(m.step, m.plan) == message``) and two messages of equal
plans are equal bytes. The degrees of freedom the layout would otherwise leave, each refused:

- prefix: a reserved field other than 0; a step of ``2**63`` or more (``pack``'s range);
- header: anything but ``pack``'s compact ASCII JSON (whitespace, key order, duplicate keys, string
  escapes, ``-0``, fractions, exponents, ``NaN``, integers over 20 characters, ``true`` for ``1``);
  padding other than the fewest spaces that align the columns;
- columns: bool bytes other than 0 and 1; a column that is not where ``pack`` puts it (the next
  8-aligned offset, in field order: no gaps, overlaps or unreferenced bytes); padding bytes other
  than zero; an int field sent as a column or the reverse. (int64 columns are little-endian, and
  every bit pattern is a distinct value: no freedom there.)

The explicit checks say what is wrong where it can; a final comparison of the message with the
re-encoded plan catches every remaining difference, naming the first differing byte and its region.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Final, cast, get_args

import attrs
import numpy as np

from ir.columns import int_problem
from ir.errors import BatchcError
from ir.init import OP_TYPES, Ticket
from ir.linear import linear
from ir.nodes import Plan

__all__ = [
    "MAGIC",
    "WIRE_VERSION",
    "MAX_MESSAGE_BYTES",
    "MAX_DEPTH",
    "WireError",
    "PlanMessage",
    "pack",
    "unpack",
]

MAGIC: Final = b"BCPL"
WIRE_VERSION: Final = 2
"""2: plans carry ``keep_hidden`` (``ExtendPlan``, ``VerifyPlan``) and the draft head's plans exist
(``HeadExtendPlan``, ``HeadCommitPlan``); a version 1 reader would refuse their nodes further in."""
_PREFIX = struct.Struct("<4sHHQII")
_DTYPES: Final[dict[str, np.dtype[Any]]] = {"i8": np.dtype("<i8"), "b1": np.dtype(np.bool_), "f8": np.dtype("<f8")}
MAX_MESSAGE_BYTES: Final = 1 << 31
"""Largest message ``pack`` writes and ``unpack`` reads (the length fields are 32-bit)."""
MAX_DEPTH: Final = 16
"""Most nodes and tuples a value of a message may sit in (the deepest plan today is 6: a mixed
plan's extend plan's tickets' op's slots); a deeper header is refused before it is walked."""
_MAX_INT_CHARS: Final = len(str(-(2**63)))  # every integer of the format is an int64: 20 characters at most
_MAX_STEP: Final = 2**63 - 1

_PLAN_TYPES: Final[tuple[type, ...]] = get_args(Plan)


def _registry() -> dict[str, type]:
    """Every class a message may hold: the plans, the batches inside the speculative plans, and
    the tickets of a prefill plan with every op kind (``ir.init.OP_TYPES``)."""
    from ir.nodes import NODE_TYPES
    from ir.sampling import SamplingRows

    classes: list[type] = [*NODE_TYPES, Ticket, *OP_TYPES, SamplingRows]
    return {c.__name__: c for c in classes}


_CLASSES: Final = _registry()


class WireError(BatchcError, ValueError):
    """A message that is not a well-formed plan message of this version (or not for this step)."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"plan message: {detail}")


@linear  # as one-shot as the plan it carries
@attrs.frozen(kw_only=True)
class PlanMessage:
    """What ``unpack`` returns: the scheduler's ``step`` the message was packed for and the plan it
    carries, rebuilt through the constructors (as one-shot as a plan: linear for the mypy plugin)."""

    step: int
    plan: Plan


class _Writer:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0

    def column(self, arr: np.ndarray[Any, Any]) -> dict[str, list[object]]:
        if arr.dtype == np.bool_:  # as bytes 0 and 1 whatever the array's memory holds: the reader refuses any other byte
            code, data = "b1", (np.ascontiguousarray(arr).view(np.uint8) != 0).tobytes()
        elif arr.dtype == np.float64:
            code, data = "f8", np.ascontiguousarray(arr, dtype=_DTYPES["f8"]).tobytes()
        else:
            code, data = "i8", np.ascontiguousarray(arr, dtype=_DTYPES["i8"]).tobytes()
        offset = self.size
        pad = -len(data) % 8
        self.chunks.append(data + bytes(pad))
        self.size += len(data) + pad
        return {"c": [code, offset, int(arr.shape[0])]}

    def value(self, v: object) -> object:
        if isinstance(v, np.ndarray):
            if v.ndim != 1 or v.dtype not in (np.dtype(np.int64), np.dtype(np.bool_), np.dtype(np.float64)):
                raise WireError(f"a column must be 1-D int64, float64 or bool, got {v.dtype} of shape {v.shape}")
            return self.column(v)
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, np.integer)):
            return int(v)
        if isinstance(v, tuple):
            return {"t": [self.value(x) for x in v]}
        if type(v).__name__ in _CLASSES and type(v) is _CLASSES[type(v).__name__]:
            fields = attrs.asdict(cast(attrs.AttrsInstance, v), recurse=False)
            return {"n": type(v).__name__, "f": {k: self.value(x) for k, x in fields.items()}}
        raise WireError(f"cannot pack a {type(v).__name__}")


def pack(step: int, plan: Plan) -> bytes:
    """The message for ``plan`` at scheduler step ``step`` (an int in ``[0, 2**63)``)."""
    problem = int_problem(step)
    if problem is not None or int(step) < 0:
        raise WireError(f"step {problem or 'must be >= 0'} (got {step!r})")
    if not isinstance(plan, _PLAN_TYPES):
        raise WireError(f"only plans travel, not {type(plan).__name__}")
    return _encode(int(step), plan)


def _encode(step: int, plan: object) -> bytes:
    w = _Writer()
    header = json.dumps(w.value(plan), separators=(",", ":")).encode()
    head_pad = -(_PREFIX.size + len(header)) % 8
    total = _PREFIX.size + len(header) + head_pad + w.size
    if total > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {total} bytes is over the bound {MAX_MESSAGE_BYTES}")
    prefix = _PREFIX.pack(MAGIC, WIRE_VERSION, 0, step, len(header) + head_pad, w.size)
    return b"".join([prefix, header, b" " * head_pad, *w.chunks])


def _refuse_fraction(text: str) -> object:
    raise WireError(f"number {text[:40]!r} is not an integer (the format has no fractions or exponents)")


def _refuse_constant(text: str) -> object:
    raise WireError(f"number {text!r} is not an integer")


def _integer(text: str) -> int:
    if len(text) > _MAX_INT_CHARS:  # before int(): Python refuses over 4,300 digits with ValueError, and is slow near it
        raise WireError(f"integer of {len(text)} characters ({text[:20]}...): the format's integers are int64")
    return int(text)


_SCALARS: Final = (type(None), bool, int, str)


class _Reader:
    """Walks the parsed header, building nodes bottom-up; ``where`` names the field being read (for
    messages), ``depth`` counts the nodes and tuples around the value."""

    def __init__(self, data: bytes, base: int) -> None:
        self.data = data  # immutable bytes: columns read from it are IR-owned as they are (``is_owned``), no copy
        self.base = base
        self.end = len(data)

    def column(self, spec: object, where: str) -> np.ndarray[Any, Any]:
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str) and spec[0] in _DTYPES
                and all(type(x) is int for x in spec[1:])):
            raise WireError(f"{where}: bad column descriptor {str(spec)[:80]}")
        code, offset, length = spec
        dtype = _DTYPES[code]
        start = self.base + offset
        if offset < 0 or length < 0 or offset % 8 or start + length * dtype.itemsize > self.end:
            raise WireError(f"{where}: column [{code}, {offset}, {length}] lies outside the message's {self.end - self.base} column bytes")
        if code == "b1":  # numpy would take any byte as a bool, and keep it: 0x02 is not 0x01 to tobytes or ==
            raw = np.frombuffer(self.data, dtype=np.uint8, count=length, offset=start)
            bad = np.flatnonzero(raw > 1)
            if bad.size:
                raise WireError(f"{where}: bool column row {int(bad[0])} is byte {int(raw[bad[0]]):#04x}, not 0 or 1")
        return np.frombuffer(self.data, dtype=dtype, count=length, offset=start)

    def value(self, v: object, where: str, depth: int) -> object:
        if isinstance(v, _SCALARS):  # (the callers pass scalars through themselves: the hot path, no name built)
            return v
        if not isinstance(v, dict):
            raise WireError(f"{where}: bad value {str(v)[:80]}")
        if len(v) == 1 and "c" in v:
            return self.column(v["c"], where)
        if depth > MAX_DEPTH:
            raise WireError(f"{where}: header nests deeper than any plan (over {MAX_DEPTH} nodes and tuples)")
        if len(v) == 1 and "t" in v and isinstance(v["t"], list):
            return tuple(x if isinstance(x, _SCALARS) else self.value(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v["t"]))
        if set(v) == {"n", "f"} and isinstance(v["f"], dict):
            cls = _CLASSES.get(v["n"]) if isinstance(v["n"], str) else None
            if cls is None:
                raise WireError(f"{where}: unknown node kind {str(v['n'])[:80]!r}")
            names = {f.name for f in attrs.fields(cls)}
            if set(v["f"]) != names:
                raise WireError(f"{cls.__name__} has fields {sorted(names)}, the message {str(sorted(v['f']))[:300]}")
            fields = {k: x if isinstance(x, _SCALARS) else self.value(x, f"{cls.__name__}.{k}", depth + 1) for k, x in v["f"].items()}
            try:
                return cls(**fields)
            except BatchcError as exc:  # the node's own refusal (IRValidationError naming the field)
                raise WireError(str(exc)) from exc
            except (TypeError, ValueError, OverflowError, IndexError, KeyError, AttributeError) as exc:
                # a constructor handed a kind of value no encoder writes: refused like any malformed message
                raise WireError(f"{cls.__name__}: {type(exc).__name__}: {str(exc)[:120]}") from exc
        raise WireError(f"{where}: bad value {str(v)[:80]}")


def _first_difference(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return int(np.argmax(np.frombuffer(a, np.uint8, n) != np.frombuffer(b, np.uint8, n)))


def _parts(message: bytes) -> list[tuple[str, bytes]]:
    """A well-framed message's regions, in the order a difference is best reported in: the header
    first (a header that differs moves everything after it), the column bytes, then the prefix."""
    head_len = _PREFIX.unpack_from(message)[4]
    base = _PREFIX.size + head_len
    text = message[_PREFIX.size : base].rstrip(b" ")
    return [("header", text), ("header padding", message[_PREFIX.size + len(text) : base]), ("column bytes", message[base:]),
            ("prefix", message[: _PREFIX.size])]


def _difference(message: bytes, canonical: bytes) -> str:
    for (region, got), (_, want) in zip(_parts(message), _parts(canonical), strict=True):
        if got != want:
            i = _first_difference(got, want)
            return f"{region} at byte {i}: the message has {got[i : i + 16]!r}, the encoding of its plan {want[i : i + 16]!r}"
    return f"at byte {_first_difference(message, canonical)}"  # (unreached: the regions above make up the message)


def unpack(data: bytes | bytearray | memoryview, *, expect_step: int | None = None) -> PlanMessage:
    """The plan and step of a message, every node rebuilt through its constructor. ``expect_step``:
    refuse a message for any other step (a replayed, skipped or reordered message). Raises
    ``WireError`` and nothing else for any message ``pack`` did not write."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"a message is bytes, not {type(data).__name__}")
    try:
        message = bytes(data)  # immutable (a copy unless it is bytes): the columns are read from it as they are
    except (TypeError, ValueError, BufferError) as exc:  # a released or non-contiguous memoryview
        raise WireError(f"unreadable buffer ({exc})") from None
    view = memoryview(message)
    if len(view) < _PREFIX.size:
        raise WireError(f"{len(view)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, reserved, step, head_len, col_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"not a plan message (magic {bytes(magic)!r})")
    if version != WIRE_VERSION:
        raise WireError(f"version {version}, this reader reads version {WIRE_VERSION}")
    if reserved != 0:
        raise WireError(f"reserved field is {reserved}, not 0")
    if step > _MAX_STEP:
        raise WireError(f"step {step} is over 2**63 - 1")
    if expect_step is not None and step != expect_step:
        raise WireError(f"message for step {step}, expected step {expect_step} (replayed, skipped or out of order)")
    base = _PREFIX.size + head_len
    if base % 8 or len(view) != base + col_len:
        raise WireError(f"length {len(view)} does not match its prefix ({_PREFIX.size} + {head_len} + {col_len} bytes)")
    raw = message[_PREFIX.size : base]
    text = raw.rstrip(b" ")
    try:
        tree = json.loads(
            text.decode("ascii"), parse_int=_integer, parse_float=_refuse_fraction, parse_constant=_refuse_constant
        )  # (duplicate keys, key order and whitespace are left to the canonical comparison below)
    except UnicodeDecodeError as exc:
        raise WireError(f"header is not ASCII (byte {exc.start} is {text[exc.start]:#04x})") from None
    except json.JSONDecodeError as exc:
        raise WireError(f"header is not JSON ({exc})") from None
    except RecursionError:
        raise WireError("header nests deeper than any plan") from None
    if len(raw) - len(text) != -(_PREFIX.size + len(text)) % 8:
        raise WireError(f"header padded with {len(raw) - len(text)} spaces, not the {-(_PREFIX.size + len(text)) % 8} that align it")
    plan = _Reader(message, base).value(tree, "message", 1)
    if not isinstance(plan, _PLAN_TYPES):
        raise WireError(f"the message holds a {type(plan).__name__}, not a plan")
    canonical = _encode(step, plan)
    if canonical != message:
        raise WireError(f"not in canonical form: {_difference(message, canonical)}")
    return PlanMessage(step=step, plan=cast(Plan, plan))
