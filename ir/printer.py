"""Deterministic text form of IR nodes, for golden tests, dumps and error excerpts; ``ir.parse``
reads it back.

Rules: one header line per node, one line per request, nested nodes indented by two spaces. Request
ids, slots, KV locations and serials print as names: ``r0``, ``s1``, ``k0``, ``#1``. By default they
are renumbered in order of first appearance in the text (request ids and KV locations from 0, slots
and serials from 1, the smallest valid ones), so a dump does not depend on allocator state, process
history or addresses; ``dump(node, exact=True)`` prints the values themselves instead, and
``ir.parse.parse(dump(node, exact=True)) == node``. Runs of consecutive KV locations print as
``k3..k7`` (``-`` for none); token ids are data and print as they are, every one of them. Pool names
print bare when they are plain words (``pool=target``), else as a JSON string.

The form of every node is derived from its declaration (``layout``), so a new node needs no code
here: each field says how it reads (``ir.columns.Shown``: ``per(..., text=...)`` on a column,
``shown(...)`` on any other field; a field without one reads ``<field name>=<value>``, a node-typed
one as a nested node). A node prints as:

- its header: the class name, ``requests=N`` (a node with per-request columns, or made of parts),
  ``tokens=N`` (one with per-token columns), then its words: first those without a key (names
  printed bare, parts spliced in), then the ``key=value`` ones, each in declaration order. A word
  whose value is ``None`` or ``False`` is left out, and so is a tuple of data ints (not ids:
  ``at[5 9]``) that is empty and has a default;
- under it: a line per part that declares one (``init #1 clear[s1] cow[]``; a part that is absent
  and required prints ``<field> none``), one line per request (its per-request, per-token and
  per-window values: the same word rules), lines of the other columns that declare one
  (``released kv=k2``), and the nested nodes.
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from collections.abc import Iterable
from enum import Enum
from typing import Any, Final, TypeAlias, cast

import attrs
import numpy as np

from ir.columns import I64, REQUEST, ColumnNode, Composite, Node, Per, Shown, shown_of
from ir.init import Op, Ticket
from ir.nodes import Batch, Plan
from ir.request import AdmittedRequest
from ir.sampling import SamplingRows
from ir.spec import AcceptResult

__all__ = [
    "Printable",
    "PRINTABLE",
    "dump",
    "dump_all",
]

Printable: TypeAlias = Batch | Plan | Op | Ticket[Any] | AdmittedRequest | AcceptResult | SamplingRows
"""Every node ``dump`` prints (and ``ir.parse.parse`` reads)."""

PRINTABLE: Final[dict[str, type]] = {(typing.get_origin(c) or c).__name__: typing.get_origin(c) or c for c in typing.get_args(Printable)}
"""The node classes of ``Printable`` by name: the header word ``ir.parse`` looks a node up by."""

_FIRST = {"r": 0, "k": 0, "s": 1, "#": 1}
_PLAIN_POOL = re.compile(r"[A-Za-z0-9_.:-]+")


@attrs.frozen
class Word:
    """How one field reads. ``kind``: ``name``, ``int``, ``flag``, ``str``, ``enum`` (one value);
    ``names``, ``pairs`` (a tuple of ids in brackets; ``pairs`` zips ``other``); ``tokens``,
    ``kv`` (a column: one value per row with ``one``, else several); ``splice`` (a node's own
    words), ``union`` (``key=<tag>`` then the variant's words); ``line``/``lines`` (a part, or a
    tuple of parts, on lines of their own); ``nested`` (a node under the header)."""

    field: str
    kind: str
    shown: Shown
    optional: bool = False
    required: bool = True
    one: bool = True
    per: Per | None = None
    cls: Any = None
    other: str = ""


@attrs.frozen
class Layout:
    """The text form of one node class: header counts, header words, part lines, row cells,
    column lines and nested parts, each in print order."""

    cls: type
    requests: bool
    tokens: str | None
    head: tuple[Word, ...]
    lines: tuple[Word, ...]
    rows: tuple[Word, ...]
    tail: tuple[Word, ...]
    nested: tuple[Word, ...]


_LAYOUTS: dict[type, Layout] = {}


def layout(cls: type) -> Layout:
    """The text form of ``cls``, derived from its attrs fields and their ``Shown`` once."""
    found = _LAYOUTS.get(cls)
    if found is None:
        found = _LAYOUTS[cls] = _derive(cls)
    return found


def _ints(t: object) -> bool:
    """``int`` or a ``NewType`` of it (an id)."""
    while isinstance(t, typing.NewType):
        t = t.__supertype__
    return t is int


def _strs(t: object) -> bool:
    while isinstance(t, typing.NewType):
        t = t.__supertype__
    return t is str


def _node_type(t: object) -> bool:
    return isinstance(t, type) and issubclass(t, Node)


def _word(cls: type, a: Any, namespace: dict[str, Any]) -> Word:
    decl, shown = shown_of(a)
    where = f"{cls.__name__}.{a.name}"
    required = a.default is attrs.NOTHING
    if decl is not None:
        if shown is None:
            raise TypeError(f"{where}: a printed column needs per(..., text=...)")
        one = decl.per == REQUEST
        kind = "flag" if decl.bools else "float" if decl.floats else "kv" if shown.name == "k" else ("name" if shown.name else "int") if one else "tokens"
        return Word(a.name, kind, shown, one=one, per=decl.per)
    tp = eval(a.type, namespace) if isinstance(a.type, str) else a.type  # noqa: S307 (an annotation of our own module)
    if isinstance(tp, typing.TypeVar) and tp.__bound__ is not None:  # a generic node's field (``Ticket.op``) reads as its bound
        tp = tp.__bound__
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    optional = type(None) in args
    args = tuple(t for t in args if t is not type(None))
    if len(args) > 1:
        if not (shown and shown.tags and all(_node_type(t) for t in args)):
            raise TypeError(f"{where}: a union of nodes needs shown(..., tags=...)")
        return Word(a.name, "union", shown, optional, required)
    (t,) = args
    if _node_type(t):
        if shown is None:
            return Word(a.name, "nested", Shown(), optional, required, cls=t)
        return Word(a.name, "line" if shown.line else "splice", shown, optional, required, cls=t)
    shown = shown or Shown(a.name)
    if typing.get_origin(t) is tuple:
        (item, _) = typing.get_args(t)
        item = typing.get_origin(item) or item  # ``Ticket[MambaInit]``: the node class
        if _node_type(item):
            if not shown.line:
                raise TypeError(f"{where}: a tuple of nodes needs shown(line=...)")
            return Word(a.name, "lines", shown, required=required, one=False, cls=item)
        if isinstance(item, type) and issubclass(item, Enum):
            return Word(a.name, "enum", shown, required=required, per=REQUEST, cls=item)  # one per request
        if _ints(item):
            return Word(a.name, "pairs" if shown.pair else "names", shown, required=required, one=False, other=shown.pair)
    elif t is bool:
        return Word(a.name, "flag", shown, optional, required)
    elif isinstance(t, type) and issubclass(t, Enum):
        return Word(a.name, "enum", shown, optional, required, cls=t)
    elif _strs(t):
        return Word(a.name, "str", shown, optional, required)
    elif _ints(t):
        return Word(a.name, "name" if shown.name else "int", shown, optional, required)
    raise TypeError(f"{where}: no text form for {a.type!r}")


def _derive(cls: type) -> Layout:
    namespace = vars(sys.modules[cls.__module__])
    fields = attrs.fields(cast("type[attrs.AttrsInstance]", cls))
    paired = {shown.pair for _, shown in map(shown_of, fields) if shown is not None and shown.pair}
    words = [_word(cls, a, namespace) for a in fields if a.name not in paired]
    key = cls._columns.key if issubclass(cls, ColumnNode) else None
    rows = [w for w in words if w.per is not None and w.per.kind in ("request", "tokens", "window")] if key else []
    tail = [w for w in words if w.per is not None and w not in rows and w.shown.line]
    head = [w for w in words if w not in rows and w not in tail and w.kind not in ("line", "lines", "nested")]

    def ordered(ws: list[Word]) -> tuple[Word, ...]:
        return tuple(sorted(ws, key=lambda w: w.shown.key != ""))  # (a stable sort: declaration order within each)

    tokens = next((w.field for w in rows if w.per is not None and w.per.kind == "tokens"), None)
    return Layout(
        cls=cls,
        requests=key is not None or issubclass(cls, Composite),
        tokens=tokens,
        head=ordered(head),
        lines=tuple(w for w in words if w.kind in ("line", "lines")),
        rows=ordered(rows),
        tail=tuple(tail),
        nested=tuple(w for w in words if w.kind == "nested"),
    )


class _Names:
    def __init__(self, exact: bool) -> None:
        self._exact = exact
        self._maps: dict[str, dict[int, int]] = {}

    def __call__(self, kind: str, value: int | np.integer[Any]) -> str:
        if self._exact:
            return f"{kind}{int(value)}"
        m = self._maps.setdefault(kind, {})
        return f"{kind}{m.setdefault(int(value), len(m) + _FIRST[kind])}"

    def kv(self, locs: I64) -> str:
        nums = [int(self("k", v)[1:]) for v in locs.tolist()]
        if not nums:
            return "-"
        runs: list[str] = []
        start = 0
        for i in range(1, len(nums) + 1):
            if i == len(nums) or nums[i] != nums[i - 1] + 1:
                a, b = nums[start], nums[i - 1]
                runs.append(f"k{a}" if a == b else f"k{a}..k{b}")
                start = i
        return ",".join(runs)


def _keyed(shown: Shown, value: str) -> str:
    return f"{shown.key}={value}" if shown.key else value


def _value(w: Word, v: Any, names: _Names, node: Any) -> list[str]:
    """The words of field ``w`` holding ``v`` (a row's share, for a row cell)."""
    s = w.shown
    if v is None or (w.kind == "flag" and not v):
        return []
    match w.kind:
        case "name":
            return [_keyed(s, names(s.name, v))]
        case "int":
            return [_keyed(s, str(int(v)))]
        case "float":
            return [_keyed(s, repr(float(v)))]  # (repr: the shortest text that reads back to the same float)
        case "flag":
            return [s.key]
        case "str":
            return [_keyed(s, v if _PLAIN_POOL.fullmatch(v) else json.dumps(v))]
        case "enum":
            return [_keyed(s, str(v.value))]
        case "names":
            if not s.name:  # data ints (``MambaSnapshot.at``); empty and defaulted: omitted
                return [f"{s.key}[{' '.join(str(int(x)) for x in v)}]"] if v or w.required else []
            return [f"{s.key}[{' '.join(names(s.name, x) for x in v)}]"]
        case "pairs":
            pairs = zip(v, _field(node, w.other), strict=True)
            return [f"{s.key}[{' '.join(f'{names(s.name, a)}->{names(s.name, b)}' for a, b in pairs)}]"]
        case "tokens":
            return [_keyed(s, "[" + " ".join(str(t) for t in v.tolist()) + "]")]
        case "kv":
            return [_keyed(s, names.kv(v if v.ndim else v.reshape(1)))]
        case "splice":
            return _words(v, names)
        case "union":
            tag = next(t for t, c in s.tags if type(v) is c)
            return [_keyed(s, tag), *_words(v, names)]
    raise AssertionError(w.kind)  # (every kind a field gets from ``_word``)


def _field(node: Any, name: str) -> Any:
    """The value of ``node``'s declared field ``name``, read through attrs (as ``ir.wire`` reads
    nodes): the printer walks the declarations, never attributes past them."""
    return attrs.asdict(node, recurse=False)[name]


def _words(node: Any, names: _Names) -> list[str]:
    """The header words of ``node`` (without its class name and counts)."""
    out: list[str] = []
    for w in layout(type(node)).head:
        out += _value(w, _field(node, w.field), names, node)
    return out


def _slices(node: Any, lay: Layout) -> dict[str, list[tuple[int, int]]]:
    """Row ``i``'s share ``[lo, hi)`` of each multi-valued row column."""
    n = int(node.num_requests)
    out: dict[str, list[tuple[int, int]]] = {}
    for w in lay.rows:
        if w.per is not None and w.per.kind == "tokens":
            ends = np.concatenate(([0], np.cumsum(_field(node, w.per.of)))).tolist()
            out[w.field] = [(ends[i], ends[i + 1]) for i in range(n)]
        elif w.per is not None and w.per.kind == "window":
            k = int(node.k) + 1
            out[w.field] = [(i * k, (i + 1) * k) for i in range(n)]
    return out


def _dump(node: Any, names: _Names, indent: str) -> list[str]:
    lay = layout(type(node))
    fields = attrs.asdict(node, recurse=False)
    inner = indent + "  "
    head = [type(node).__name__]
    if lay.requests:
        head.append(f"requests={node.num_requests}")
    if lay.tokens is not None:
        head.append(f"tokens={fields[lay.tokens].shape[0]}")
    lines = [indent + " ".join(head + _words(node, names))]
    for w in lay.lines:
        v = fields[w.field]
        parts = (v if v is not None else ()) if w.kind == "lines" else (() if v is None else (v,))
        lines += [f"{inner}{w.shown.line} {' '.join(_words(part, names))}".rstrip() for part in parts]
        if not parts and w.required:
            lines.append(f"{inner}{w.field} none")
    if lay.rows:
        shares = _slices(node, lay)
        for i in range(int(node.num_requests)):
            cells: list[str] = []
            for w in lay.rows:
                col = fields[w.field]
                v = col[slice(*shares[w.field][i])] if w.field in shares else col[i]
                cells += _value(w, v, names, node)
            lines.append(inner + " ".join(cells))
    for w in lay.tail:
        lines.append(f"{inner}{w.shown.line} {' '.join(_value(w, fields[w.field], names, node))}")
    for w in lay.nested:
        if fields[w.field] is not None:  # (an optional nested node that is absent prints nothing)
            lines += _dump(fields[w.field], names, inner)
    return lines


def dump(node: Printable, *, exact: bool = False) -> str:
    """The deterministic text form of ``node`` (ends with a newline); ids renumbered unless ``exact``."""
    return "\n".join(_dump(node, _Names(exact), "")) + "\n"


def dump_all(nodes: Iterable[Printable], *, exact: bool = False) -> str:
    """Several nodes one after another, renumbered together (a request id or slot keeps one name
    across them); ``ir.parse.parse_all`` reads them back."""
    names = _Names(exact)
    return "".join("\n".join(_dump(node, names, "")) + "\n" for node in nodes)
