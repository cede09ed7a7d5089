"""Read the text form of ``ir.printer.dump`` back into nodes: ``parse(dump(node, exact=True)) == node``.

The format, one node per header line (``ExtendBatch requests=2 tokens=3``), its rows and parts
indented two spaces under it; words are separated by spaces, ``[...]`` groups one word::

    ExtendBatch requests=2 tokens=3
      init #1 clear[s1] cow[s3->s2]
      r0 s1 prefix=0 extend=2 init=clear tokens=[5 6] kv=k0..k1
      r1 s2 prefix=4 extend=1 init=cow more tokens=[7] kv=k2

- names: request ``r<int>``, slot ``s<int>``, KV location ``k<int>``, serial ``#<int>`` (the value
  itself: a renumbered dump parses to the renumbered node, an ``exact`` one to the node);
- ``kv=``: comma-separated runs ``k3..k7,k9``, or ``-`` for none; ``tokens=[5 6 7]``: token ids;
- ``requests=`` and ``tokens=`` in a header must match the rows (a check on hand-written text);
- every node is built through its constructor, so its local checks run; a node that fails them
  is refused like a syntax error.

The reader is derived from the node declarations, as the printer is (``ir.printer.layout``): it
reads each field the way ``Shown`` says it prints, so a new node needs no code here.

A hand-written batch parses like a dump (this example runs in the test suite)::

    >>> from ir.parse import parse
    >>> batch = parse('''
    ... DecodeBatch requests=2
    ...   r7 s1 seq=10 token=42 kv=k100
    ...   r8 s2 seq=3 token=9 kv=k101
    ... ''')
    >>> batch.rid_list(), batch.seq_lens.tolist()
    ([7, 8], [10, 3])

Errors raise ``ParseError`` naming the line (1-based), the offending word and what was expected.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

from ir.columns import Composite
from ir.errors import BatchcError, IRValidationError
from ir.printer import PRINTABLE, Layout, Printable, Word, layout

__all__ = [
    "ParseError",
    "parse",
    "parse_all",
]


class ParseError(BatchcError, ValueError):
    """Text that is not the form ``ir.printer.dump`` writes; ``line`` (1-based) and ``token`` locate it."""

    def __init__(self, line: int, token: str, message: str) -> None:
        self.line = line
        self.token = token
        super().__init__(f"line {line}: {message} (at {token!r})")


_WORD = re.compile(r'[^\s"]*"(?:[^"\\]|\\.)*"|[^\s\[]*\[[^\]]*\]\S*|\S+')
_NAME = re.compile(r"-?\d+")
_KV_RUN = re.compile(r"k(-?\d+)(?:\.\.k(-?\d+))?")

T = TypeVar("T")


class _Line:
    def __init__(self, no: int, text: str) -> None:
        self.no = no
        stripped = text.lstrip(" ")
        self.indent = len(text) - len(stripped)
        self.tabbed = stripped[:1] == "\t"
        """The indentation holds a tab (the words never do: a tab separates them)."""
        self.words: list[str] = _WORD.findall(stripped)
        self.pos = 0

    def fail(self, message: str, token: str | None = None) -> NoReturn:
        raise ParseError(self.no, token if token is not None else (self.words[self.pos] if self.pos < len(self.words) else "<end of line>"), message)

    def word(self, what: str) -> str:
        if self.pos >= len(self.words):
            self.fail(f"expected {what}")
        self.pos += 1
        return self.words[self.pos - 1]

    def peek(self) -> str | None:
        return self.words[self.pos] if self.pos < len(self.words) else None

    def key(self, key: str) -> str:
        w = self.word(f"{key}=...")
        if not w.startswith(key + "="):
            self.fail(f"expected {key}=...", w)
        return w[len(key) + 1 :]

    def int_key(self, key: str) -> int:
        w = self.key(key)
        return self.to_int(w, f"{key}=")

    def float_key(self, key: str) -> float:
        w = self.key(key)
        try:
            return float(w)
        except ValueError:
            self.fail("expected a number", f"{key}={w}")

    def to_int(self, text: str, token: str) -> int:
        if not _NAME.fullmatch(text):
            self.fail("expected an integer", token + text if token.endswith("=") else text)
        return int(text)

    def name(self, kind: str, text: str | None = None) -> int:
        w = self.word(f"a {kind}<int> name") if text is None else text
        if not (w.startswith(kind) and _NAME.fullmatch(w[len(kind) :])):
            self.fail(f"expected a {kind}<int> name", w)
        return int(w[len(kind) :])

    def optional(self, word: str) -> bool:
        if self.peek() == word:
            self.pos += 1
            return True
        return False

    def end(self) -> None:
        if self.pos < len(self.words):
            self.fail("unexpected word")

    def kv(self, text: str) -> list[int]:
        if text == "-":
            return []
        out: list[int] = []
        for run in text.split(","):
            m = _KV_RUN.fullmatch(run)
            if m is None:
                self.fail("expected KV locations (k3..k7,k9 or -)", run)
            a = int(m[1])
            b = a if m[2] is None else int(m[2])
            if b < a:
                self.fail("a KV run must not descend", run)
            out.extend(range(a, b + 1))
        return out

    def tokens(self, text: str, token: str) -> list[int]:
        if not (text.startswith("[") and text.endswith("]")):
            self.fail("expected [token ids]", token + text)
        return [self.to_int(t, t) for t in text[1:-1].split()]

    def bracket(self, text: str, prefix: str) -> list[str]:
        if not (text.startswith(prefix + "[") and text.endswith("]")):
            self.fail(f"expected {prefix}[...]", text)
        return text[len(prefix) + 1 : -1].split()

    def pairs(self, items: list[str], kind: str) -> tuple[list[int], list[int]]:
        src: list[int] = []
        dst: list[int] = []
        for item in items:
            a, sep, b = item.partition("->")
            if not sep:
                self.fail(f"expected a copy {kind}<src>->{kind}<dst>", item)
            src.append(self.name(kind, a))
            dst.append(self.name(kind, b))
        return src, dst

    def string(self, key: str) -> str:
        """A bare word or a JSON string (``pool=target``, ``pool="a b"``)."""
        w = self.key(key)
        if w.startswith('"'):
            try:
                value = json.loads(w)
            except json.JSONDecodeError:
                self.fail(f"expected a {key} name", f"{key}={w}")
            if not isinstance(value, str):
                self.fail(f"expected a {key} name", f"{key}={w}")
            return value
        return w

    def has(self, key: str) -> bool:
        """Whether the next word is ``key=...``."""
        word = self.peek()
        return word is not None and word.startswith(key + "=")

    def starts(self, label: str) -> bool:
        """Whether the line's words begin with ``label`` (one word or several)."""
        words = label.split()
        return self.words[: len(words)] == words

    def skip(self, label: str) -> None:
        self.pos = len(label.split())


class _Parser:
    def __init__(self, text: str) -> None:
        self.lines = [_Line(no, t) for no, t in enumerate(text.split("\n"), 1) if t.strip()]
        for line in self.lines:
            if line.tabbed or line.indent % 2:
                line.fail("indent by two spaces per level", line.words[0])
        self.i = 0

    def peek(self, indent: int) -> _Line | None:
        if self.i < len(self.lines) and self.lines[self.i].indent == indent:
            return self.lines[self.i]
        return None

    def take(self, indent: int, what: str) -> _Line:
        line = self.peek(indent)
        if line is None:
            if self.i < len(self.lines):
                self.lines[self.i].fail(f"expected {what} indented by {indent} spaces", self.lines[self.i].words[0])
            last = self.lines[-1] if self.lines else _Line(1, "")
            raise ParseError(last.no, "<end of text>", f"expected {what}")
        self.i += 1
        return line

    def node(self, indent: int) -> Printable:
        return cast("Printable", self.any_node(indent))  # (a top-level kind is looked up in ``PRINTABLE``)

    def any_node(self, indent: int, nested: type | None = None) -> object:
        """A node of a ``PRINTABLE`` kind, or of the class ``nested`` (a node-typed field's, such as
        a batch's ``SamplingRows``, which is not printable alone)."""
        line = self.take(indent, "a node")
        kind = line.word("a node kind")
        cls = nested if nested is not None and kind == nested.__name__ else PRINTABLE.get(kind)
        if cls is None:
            line.fail(f"unknown node kind (one of {', '.join(sorted(PRINTABLE))})", kind)
        lay = layout(cls)
        declared = line.int_key("requests") if lay.requests else 0
        total = line.int_key("tokens") if lay.tokens is not None else 0
        fields = _words(line, lay)
        line.end()
        for w in lay.lines:
            fields[w.field] = self.part_lines(w, indent + 2)
        if lay.rows:
            fields.update(self.rows(line, lay, indent + 2, declared, total, fields))
        for w in lay.tail:
            tail = self.take(indent + 2, f"{w.shown.line} {w.shown.key}=...")
            if not tail.starts(w.shown.line):
                tail.fail(f"expected {w.shown.line} {w.shown.key}=...", tail.words[0])
            tail.skip(w.shown.line)
            fields[w.field] = _value(tail, w, fields)
            tail.end()
        for w in lay.nested:
            if w.optional:
                nxt = self.peek(indent + 2)
                if nxt is None or not nxt.words or nxt.words[0] != w.cls.__name__:
                    fields[w.field] = None
                    continue
            fields[w.field] = self.any_node(indent + 2, w.cls)
        node = _built(line, lambda: cls(**fields))
        if isinstance(node, Composite) and node.num_requests != declared:
            line.fail(f"requests={declared} but its parts hold {node.num_requests}", f"requests={declared}")
        return node

    def part_lines(self, w: Word, indent: int) -> object:
        """A part on its line (``None`` when absent), or a tuple of parts, a line each."""
        parts: list[object] = []
        none = f"{w.field} none"
        if w.required and (line := self.peek(indent)) is not None and line.starts(none):
            self.i += 1
            line.skip(none)
            line.end()
            return () if w.kind == "lines" else None
        while (line := self.peek(indent)) is not None and line.starts(w.shown.line) and (w.kind == "lines" or not parts):
            self.i += 1
            line.skip(w.shown.line)
            parts.append(_part(line, w.cls))
            line.end()
        if not parts and w.required:
            self.take(indent, f"{w.shown.line} ... or {none}").fail(f"expected {w.shown.line} ... or {none}")
        return tuple(parts) if w.kind == "lines" else (parts[0] if parts else None)

    def rows(self, line: _Line, lay: Layout, indent: int, declared: int, total: int, fields: dict[str, Any]) -> dict[str, Any]:
        """The row cells under ``line``, as the node's columns; the header counts must match them."""
        first = lay.rows[0].shown
        starts = (lambda word: re.fullmatch(re.escape(first.name) + r"-?\d+", word) is not None) if not first.key else (
            lambda word: word.startswith(first.key + "="))
        rows = []
        while (row := self.peek(indent)) is not None and row.words and starts(row.words[0]):
            self.i += 1
            rows.append(row)
        if declared != len(rows):
            line.fail(f"requests={declared} but {len(rows)} rows follow", f"requests={declared}")
        cols: dict[str, list[Any]] = {w.field: [] for w in lay.rows}
        for row in rows:
            cells: dict[str, Any] = {}
            for w in lay.rows:
                at = row.pos
                v = _value(row, w, cells)
                cells[w.field] = v
                if w.one:
                    if w.kind == "kv":
                        if len(v) != 1:
                            row.fail(f"a row has one KV location in {w.shown.key}=", row.words[at])
                        v = v[0]
                    cols[w.field].append(v)
                    continue
                want, by = _share(w, lay, cells, fields)
                if want is not None and len(v) != want:
                    row.fail(f"{by} needs {want} values in {w.shown.key}=, got {len(v)}", row.words[at])
                cols[w.field].extend(v)
            row.end()
        if lay.tokens is not None and len(cols[lay.tokens]) != total:
            line.fail(f"tokens={total} but the rows hold {len(cols[lay.tokens])}", f"tokens={total}")
        return {w.field: tuple(cols[w.field]) if w.kind == "enum" else cols[w.field] for w in lay.rows}


def _share(w: Word, lay: Layout, cells: dict[str, Any], fields: dict[str, Any]) -> tuple[int | None, str]:
    """How many values row ``cells`` holds in multi-valued column ``w``, and what says so."""
    assert w.per is not None  # (a row column)
    if w.per.kind == "tokens":
        n = cells.get(w.per.of)
        key = next(x.shown.key for x in lay.rows if x.field == w.per.of)
        return (n if isinstance(n, int) else None), f"{key}={n}"
    k = fields.get("k")
    return (k + 1 if isinstance(k, int) and k >= 0 else None), f"k={k}"


def _one_of(key: str, words: list[str]) -> str:
    options = [f"{key}={w}" for w in words]
    return ", ".join(options[:-1]) + " or " + options[-1] if len(options) > 1 else options[0]


def _value(line: _Line, w: Word, fields: dict[str, Any]) -> Any:
    """Field ``w`` read from ``line`` (``None``/``False`` where an optional word is absent)."""
    s = w.shown
    if w.optional and w.kind not in ("splice", "union") and s.key and not line.has(s.key):
        return None
    match w.kind:
        case "name":
            return line.name(s.name, line.key(s.key) if s.key else None)
        case "int":
            return line.int_key(s.key)
        case "float":
            return line.float_key(s.key)
        case "flag":
            return line.optional(s.key)
        case "str":
            return line.string(s.key)
        case "enum":
            text = line.key(s.key)
            values = {e.value: e for e in w.cls}
            if text not in values:
                line.fail(f"expected {_one_of(s.key, list(values))}", f"{s.key}={text}")
            return values[text]
        case "names":
            items = line.bracket(line.word(f"{s.key}[...]"), s.key)
            return [line.to_int(x, x) for x in items] if not s.name else [line.name(s.name, x) for x in items]
        case "pairs":
            src, dst = line.pairs(line.bracket(line.word(f"{s.key}[...]"), s.key), s.name)
            fields[w.other] = dst
            return src
        case "tokens":
            return line.tokens(line.key(s.key), s.key + "=")
        case "kv":
            return line.kv(line.key(s.key))
        case "splice":
            return _part(line, w.cls)
        case "union":
            tag = line.key(s.key)
            tags = dict(s.tags)
            if tag not in tags:
                line.fail(f"expected {_one_of(s.key, list(tags))}", f"{s.key}={tag}")
            return _part(line, tags[tag])
    raise AssertionError(w.kind)  # (every kind a field gets from ``ir.printer``)


def _words(line: _Line, lay: Layout) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for w in lay.head:
        if w.kind == "names" and not w.shown.name and not w.required and not (line.peek() or "").startswith(w.shown.key + "["):
            continue  # an empty, defaulted tuple of data ints is not printed: its default
        fields[w.field] = _value(line, w, fields)
    return fields


def _part(line: _Line, cls: type) -> object:
    """A node written as its words on ``line`` (a ticket's ops, a request's intent)."""
    fields = _words(line, layout(cls))
    return _built(line, lambda: cls(**fields))


def _built(line: _Line, build: Callable[[], T]) -> T:
    """``build()``; a node that fails its local checks is a ``ParseError`` at ``line``."""
    try:
        return build()
    except IRValidationError as e:
        raise ParseError(line.no, line.words[0] if line.words else "", str(e)) from e


def parse_all(text: str) -> list[Printable]:
    """Every top-level node of ``text``, in order (a dump of several nodes, one after another)."""
    p = _Parser(text)
    out: list[Printable] = []
    while p.i < len(p.lines):
        out.append(p.node(0))
    return out


def parse(text: str) -> Printable:
    """The one node ``text`` holds (``ParseError`` if it holds none, or more than one)."""
    p = _Parser(text)
    if not p.lines:
        raise ParseError(1, "<end of text>", "expected a node")
    node = p.node(0)
    if p.i < len(p.lines):
        extra = p.lines[p.i]
        extra.fail("expected the end of the text after one node", extra.words[0])
    return node
