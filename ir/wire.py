"""Plans as packed, versioned messages: the one format in which a plan leaves the process that built it.

A message carries one forward plan and the scheduler's step number, for a backend in another process
(an executor process beside the scheduler, a tensor-parallel rank). It is not a pickle: the reader
builds nothing but IR nodes, and builds them through their constructors, so every invariant a node
checks on construction is checked again on arrival.

Layout (little-endian)::

    magic b"BCPL" | version u16 | reserved u16 | step u64 | header bytes u32 | column bytes u32
    header: UTF-8 JSON, the node tree, each column replaced by {"c": [dtype, offset, length]}
    padding to 8 bytes, then every column's data, each 8-byte aligned

Node fields are the declared attrs fields of the node classes registered below (every plan and the
tickets and ops they carry): an int64 or bool column, an int, a string (a pool name), ``None``, a
tuple of ints (slots of an init op) or of nodes, or a node. ``unpack`` refuses anything else, a
message of another version, a truncated or padded one, or (with ``expect_step``) a step number that
is not the expected one, with ``WireError`` naming what is wrong; a node whose fields break its
invariants raises the constructor's ``IRValidationError``. Each column is read from the message's
buffer and copied once into IR-owned (read-only) memory.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Final, cast, get_args

import attrs
import numpy as np

from ir.columns import int_problem
from ir.errors import BatchcError
from ir.init import InitTicket, MambaInit, MambaSnapshot, SnapshotTicket
from ir.linear import linear
from ir.nodes import Plan

MAGIC: Final = b"BCPL"
WIRE_VERSION: Final = 1
_PREFIX = struct.Struct("<4sHHQII")
_DTYPES: Final[dict[str, np.dtype[Any]]] = {"i8": np.dtype("<i8"), "b1": np.dtype(np.bool_)}
MAX_MESSAGE_BYTES: Final = 1 << 31
"""Largest message ``pack`` writes and ``unpack`` reads (the length fields are 32-bit)."""

_PLAN_TYPES: Final[tuple[type, ...]] = get_args(Plan)


def _registry() -> dict[str, type]:
    """Every class a message may hold: the plans, the batches inside the speculative plans, and
    the tickets and ops of a prefill plan."""
    from ir.nodes import NODE_TYPES

    classes: list[type] = [*NODE_TYPES, InitTicket, SnapshotTicket, MambaInit, MambaSnapshot]
    return {c.__name__: c for c in classes}


_CLASSES: Final = _registry()


class WireError(BatchcError, ValueError):
    """A message that is not a well-formed plan message of this version (or not for this step)."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"plan message: {detail}")


@linear  # as one-shot as the plan it carries
@attrs.frozen(kw_only=True)
class PlanMessage:
    step: int
    plan: Plan


class _Writer:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0

    def column(self, arr: np.ndarray[Any, Any]) -> dict[str, list[object]]:
        code = "b1" if arr.dtype == np.bool_ else "i8"
        data = np.ascontiguousarray(arr, dtype=_DTYPES[code]).tobytes()
        offset = self.size
        pad = -len(data) % 8
        self.chunks.append(data + bytes(pad))
        self.size += len(data) + pad
        return {"c": [code, offset, int(arr.shape[0])]}

    def value(self, v: object) -> object:
        if isinstance(v, np.ndarray):
            if v.ndim != 1 or v.dtype not in (np.dtype(np.int64), np.dtype(np.bool_)):
                raise WireError(f"a column must be 1-D int64 or bool, got {v.dtype} of shape {v.shape}")
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
    w = _Writer()
    header = json.dumps(w.value(plan), separators=(",", ":")).encode()
    head_pad = -(_PREFIX.size + len(header)) % 8
    total = _PREFIX.size + len(header) + head_pad + w.size
    if total > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {total} bytes is over the bound {MAX_MESSAGE_BYTES}")
    prefix = _PREFIX.pack(MAGIC, WIRE_VERSION, 0, int(step), len(header) + head_pad, w.size)
    return b"".join([prefix, header, b" " * head_pad, *w.chunks])


class _Reader:
    def __init__(self, data: memoryview, base: int) -> None:
        self.data = data
        self.base = base
        self.end = len(data)

    def column(self, spec: object) -> np.ndarray[Any, Any]:
        if not (isinstance(spec, list) and len(spec) == 3 and spec[0] in _DTYPES and all(type(x) is int for x in spec[1:])):
            raise WireError(f"bad column descriptor {spec!r}")
        code, offset, length = spec
        dtype = _DTYPES[code]
        start = self.base + offset
        if offset < 0 or length < 0 or offset % 8 or start + length * dtype.itemsize > self.end:
            raise WireError(f"column [{code}, {offset}, {length}] lies outside the message's {self.end - self.base} column bytes")
        return np.frombuffer(self.data, dtype=dtype, count=length, offset=start)

    def value(self, v: object) -> object:
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, dict) and len(v) == 1 and "c" in v:
            return self.column(v["c"])
        if isinstance(v, dict) and len(v) == 1 and "t" in v and isinstance(v["t"], list):
            return tuple(self.value(x) for x in v["t"])
        if isinstance(v, dict) and set(v) == {"n", "f"} and isinstance(v["f"], dict):
            cls = _CLASSES.get(v["n"]) if isinstance(v["n"], str) else None
            if cls is None:
                raise WireError(f"unknown node kind {v['n']!r}")
            names = {f.name for f in attrs.fields(cls)}
            if set(v["f"]) != names:
                raise WireError(f"{cls.__name__} has fields {sorted(names)}, the message {sorted(v['f'])}")
            return cls(**{k: self.value(x) for k, x in v["f"].items()})
        raise WireError(f"bad value {str(v)[:80]!r}")


def unpack(data: bytes | bytearray | memoryview, *, expect_step: int | None = None) -> PlanMessage:
    """The plan and step of a message, every node rebuilt through its constructor. ``expect_step``:
    refuse a message for any other step (a replayed, skipped or reordered message)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"a message is bytes, not {type(data).__name__}")
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise WireError(f"{len(view)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, _, step, head_len, col_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"not a plan message (magic {bytes(magic)!r})")
    if version != WIRE_VERSION:
        raise WireError(f"version {version}, this reader reads version {WIRE_VERSION}")
    if expect_step is not None and step != expect_step:
        raise WireError(f"message for step {step}, expected step {expect_step} (replayed, skipped or out of order)")
    base = _PREFIX.size + head_len
    if base % 8 or len(view) != base + col_len:
        raise WireError(f"length {len(view)} does not match its prefix ({_PREFIX.size} + {head_len} + {col_len} bytes)")
    try:
        tree = json.loads(bytes(view[_PREFIX.size : base]))
        plan = _Reader(view, base).value(tree)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"header is not JSON ({exc})") from None
    except RecursionError:
        raise WireError("header nests deeper than any plan") from None
    if not isinstance(plan, _PLAN_TYPES):
        raise WireError(f"the message holds a {type(plan).__name__}, not a plan")
    return PlanMessage(step=step, plan=cast(Plan, plan))
