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
from typing import NoReturn, TypeVar

import numpy as np

from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.columns import Composite
from ir.errors import BatchcError, IRValidationError
from ir.ids import MambaSlot, PoolId, RequestId, TicketSerial
from ir.init import InitIntent, InitTicket, MambaInit, MambaSnapshot, SnapshotTicket
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.printer import Printable
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom, Intent
from ir.spec import (
    AcceptResult,
    CommitBatch,
    CommitPlan,
    DraftBatch,
    DraftCommitBatch,
    DraftCommitPlan,
    DraftExtendBatch,
    DraftExtendPlan,
    DraftPlan,
    VerifyBatch,
    VerifyPlan,
)


class ParseError(BatchcError, ValueError):
    """Text that is not the form ``ir.printer.dump`` writes; ``line`` (1-based) and ``token`` locate it."""

    def __init__(self, line: int, token: str, message: str) -> None:
        self.line = line
        self.token = token
        super().__init__(f"line {line}: {message} (at {token!r})")


_WORD = re.compile(r'[^\s"]*"(?:[^"\\]|\\.)*"|[^\s\[]*\[[^\]]*\]\S*|\S+')
_NAME = re.compile(r"-?\d+")
_KV_RUN = re.compile(r"k(-?\d+)(?:\.\.k(-?\d+))?")
_INTENTS = {i.value: i for i in InitIntent}

T = TypeVar("T")
C = TypeVar("C", bound=Composite)


class _Line:
    def __init__(self, no: int, text: str) -> None:
        self.no = no
        stripped = text.lstrip(" ")
        self.indent = len(text) - len(stripped)
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

    def literal(self, text: str) -> None:
        w = self.word(repr(text))
        if w != text:
            self.fail(f"expected {text!r}", w)

    def key(self, key: str) -> str:
        w = self.word(f"{key}=...")
        if not w.startswith(key + "="):
            self.fail(f"expected {key}=...", w)
        return w[len(key) + 1 :]

    def int_key(self, key: str) -> int:
        w = self.key(key)
        return self.to_int(w, f"{key}=")

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
            self.fail("expected [token ids]", token)
        return [self.to_int(t, t) for t in text[1:-1].split()]

    def bracket(self, text: str, prefix: str) -> list[str]:
        if not (text.startswith(prefix + "[") and text.endswith("]")):
            self.fail(f"expected {prefix}[...]", text)
        return text[len(prefix) + 1 : -1].split()

    def pairs(self, items: list[str]) -> tuple[list[int], list[int]]:
        src: list[int] = []
        dst: list[int] = []
        for item in items:
            a, sep, b = item.partition("->")
            if not sep:
                self.fail("expected a copy s<src>->s<dst>", item)
            src.append(self.name("s", a))
            dst.append(self.name("s", b))
        return src, dst

    def pool(self) -> PoolId:
        w = self.key("pool")
        if w.startswith('"'):
            try:
                value = json.loads(w)
            except json.JSONDecodeError:
                self.fail("expected a pool name", "pool=" + w)
            if not isinstance(value, str):
                self.fail("expected a pool name", "pool=" + w)
            return PoolId(value)
        return PoolId(w)


class _Parser:
    def __init__(self, text: str) -> None:
        self.lines = [_Line(no, t) for no, t in enumerate(text.split("\n"), 1) if t.strip()]
        for line in self.lines:
            if "\t" in line.words[0] or line.indent % 2:
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

    def rows(self, indent: int) -> list[_Line]:
        out = []
        while (line := self.peek(indent)) is not None and line.words and re.fullmatch(r"r-?\d+", line.words[0]):
            self.i += 1
            out.append(line)
        return out

    # -- nodes -----------------------------------------------------------------------------------

    def node(self, indent: int) -> Printable:
        line = self.take(indent, "a node")
        kind = line.word("a node kind")
        parse = _KINDS.get(kind)
        if parse is None:
            line.fail(f"unknown node kind (one of {', '.join(sorted(_KINDS))})", kind)
        return _built(line, lambda: parse(self, line, indent + 2))

    def header_count(self, line: _Line, rows: list[_Line], declared: int) -> None:
        if declared != len(rows):
            line.fail(f"requests={declared} but {len(rows)} rows follow", f"requests={declared}")

    def extend_rows(self, line: _Line, indent: int, *, intents: bool) -> dict[str, object]:
        declared = line.int_key("requests")
        total = line.int_key("tokens")
        return self._extend_rows(line, indent, declared, total, intents=intents)

    def _extend_rows(self, line: _Line, indent: int, declared: int, total: int, *, intents: bool) -> dict[str, object]:
        rows = self.rows(indent)
        self.header_count(line, rows, declared)
        cols: dict[str, list[object]] = {k: [] for k in ("rids", "slots", "prefix_lens", "extend_lens", "more_chunks", "intents", "input_ids", "kv_locs")}
        for row in rows:
            cols["rids"].append(row.name("r"))
            cols["slots"].append(row.name("s"))
            cols["prefix_lens"].append(row.int_key("prefix"))
            extend = row.int_key("extend")
            cols["extend_lens"].append(extend)
            if intents:
                w = row.key("init")
                if w not in _INTENTS:
                    row.fail("expected init=clear, init=cow or init=continue", "init=" + w)
                cols["intents"].append(_INTENTS[w])
            cols["more_chunks"].append(row.optional("more"))
            tokens = row.tokens(row.key("tokens"), "tokens=")
            kv = row.kv(row.key("kv"))
            row.end()
            if len(tokens) != extend or len(kv) != extend:
                row.fail(f"extend={extend} needs {extend} tokens and KV locations, got {len(tokens)} and {len(kv)}", f"extend={extend}")
            cols["input_ids"].extend(tokens)
            cols["kv_locs"].extend(kv)
        if len(cols["input_ids"]) != total:
            line.fail(f"tokens={total} but the rows hold {len(cols['input_ids'])}", f"tokens={total}")
        out: dict[str, object] = {k: v for k, v in cols.items() if k not in ("intents", "more_chunks")}
        out["more_chunks"] = np.array(cols["more_chunks"], dtype=np.bool_)
        if intents:
            out["intents"] = tuple(cols["intents"])
        return out

    def init_ops(self, line: _Line) -> MambaInit:
        serial = line.name("#")
        clears = [line.name("s", w) for w in line.bracket(line.word("clear[...]"), "clear")]
        src, dst = line.pairs(line.bracket(line.word("cow[...]"), "cow"))
        return _built(line, lambda: MambaInit(serial=TicketSerial(serial), clear_slots=clears, cow_src=src, cow_dst=dst))

    def snapshot_ops(self, line: _Line) -> MambaSnapshot:
        serial = line.name("#")
        src, dst = line.pairs(line.bracket(line.word("[...]"), ""))
        return _built(line, lambda: MambaSnapshot(serial=TicketSerial(serial), src=src, dst=dst))


def _built(line: _Line, build: Callable[[], T]) -> T:
    """``build()``; a node that fails its local checks is a ``ParseError`` at ``line``."""
    try:
        return build()
    except IRValidationError as e:
        raise ParseError(line.no, line.words[0] if line.words else "", str(e)) from e


def _extend_batch(p: _Parser, line: _Line, indent: int) -> ExtendBatch:
    declared, total = line.int_key("requests"), line.int_key("tokens")
    line.end()
    init_line = p.take(indent, "init ... or init none")
    init_line.literal("init")
    init: MambaInit | None = None
    if not init_line.optional("none"):
        init = p.init_ops(init_line)
    init_line.end()
    snapshot: MambaSnapshot | None = None
    if (snap_line := p.peek(indent)) is not None and snap_line.words[0] == "snapshot":
        p.i += 1
        snap_line.literal("snapshot")
        snapshot = p.snapshot_ops(snap_line)
        snap_line.end()
    cols = p._extend_rows(line, indent, declared, total, intents=True)
    return ExtendBatch(**cols, init=init, snapshot=snapshot)  # type: ignore[arg-type]  # columns checked by the constructor


def _ticket(p: _Parser, line: _Line) -> InitTicket:
    line.literal("ticket")
    init = p.init_ops(line)
    pool = line.pool()
    line.end()
    return _built(line, lambda: InitTicket(pool=pool, init=init))


def _snapshot_ticket_line(p: _Parser, line: _Line) -> SnapshotTicket:
    line.literal("snapshot")
    line.literal("ticket")
    snap = p.snapshot_ops(line)
    pool = line.pool()
    line.end()
    return _built(line, lambda: SnapshotTicket(pool=pool, snapshot=snap))


def _extend_plan(p: _Parser, line: _Line, indent: int) -> ExtendPlan:
    declared, total = line.int_key("requests"), line.int_key("tokens")
    word = line.peek()
    sample = TicketSerial(line.name("#", line.key("sample"))) if word is not None and word.startswith("sample=") else None
    line.end()
    first = p.take(indent, "ticket ... or tickets none")
    tickets: list[InitTicket] = []
    if first.words[:2] == ["tickets", "none"]:
        first.pos = 2
        first.end()
    elif first.words[0] == "ticket":
        tickets.append(_ticket(p, first))
        while (t := p.peek(indent)) is not None and t.words[0] == "ticket":
            p.i += 1
            tickets.append(_ticket(p, t))
    else:
        first.fail("expected ticket ... or tickets none", first.words[0])
    snapshots: list[SnapshotTicket] = []
    while (t := p.peek(indent)) is not None and t.words[:2] == ["snapshot", "ticket"]:
        p.i += 1
        snapshots.append(_snapshot_ticket_line(p, t))
    cols = p._extend_rows(line, indent, declared, total, intents=False)
    return ExtendPlan(**cols, tickets=tuple(tickets), snapshots=tuple(snapshots), sample_id=sample)  # type: ignore[arg-type]


def _decode_plan(p: _Parser, line: _Line, indent: int) -> DecodePlan:
    """A decode plan: its columns, and its optional ``sample=#N`` and ``inputs=#N``."""
    declared = line.int_key("requests")
    ids: list[TicketSerial | None] = []
    for key in ("sample", "inputs"):
        word = line.peek()
        ids.append(TicketSerial(line.name("#", line.key(key))) if word is not None and word.startswith(key + "=") else None)
    c = _decode_cols(p, line, indent, declared)
    return DecodePlan(
        rids=c["rids"], slots=c["slots"], seq_lens=c["seq_lens"], input_ids=c["input_ids"], kv_locs=c["kv_locs"],
        sample_id=ids[0], inputs_from=ids[1],
    )


def _decode_cols(p: _Parser, line: _Line, indent: int, declared: int | None = None) -> dict[str, list[int]]:
    if declared is None:
        declared = line.int_key("requests")
    line.end()
    rows = p.rows(indent)
    p.header_count(line, rows, declared)
    cols: dict[str, list[int]] = {k: [] for k in ("rids", "slots", "seq_lens", "input_ids", "kv_locs")}
    for row in rows:
        cols["rids"].append(row.name("r"))
        cols["slots"].append(row.name("s"))
        cols["seq_lens"].append(row.int_key("seq"))
        cols["input_ids"].append(row.int_key("token"))
        kv = row.kv(row.key("kv"))
        if len(kv) != 1:
            row.fail("a decode row has one KV location", "kv=")
        cols["kv_locs"].extend(kv)
        row.end()
    return cols


def _window_cols(
    p: _Parser, line: _Line, indent: int, *, single: bool, accept: bool, id_key: str
) -> tuple[int, list[int], dict[str, list[int]]]:
    """A windowed node: ``k``, its ids (``id_key``: ``verify`` or ``draft``; a verify's and a
    commit's are followed by the draft they check, ``draft=#N``) and its columns."""
    declared = line.int_key("requests")
    k = line.int_key("k")
    serials = [line.name("#", line.key(id_key))]
    if id_key == "verify":
        serials.append(line.name("#", line.key("draft")))
    line.end()
    rows = p.rows(indent)
    p.header_count(line, rows, declared)
    cols: dict[str, list[int]] = {c: [] for c in ("rids", "slots", "seq_lens", "accept_pos", "input_ids", "kv_locs")}
    for row in rows:
        cols["rids"].append(row.name("r"))
        cols["slots"].append(row.name("s"))
        cols["seq_lens"].append(row.int_key("seq"))
        if accept:
            cols["accept_pos"].append(row.int_key("accept"))
        if single:
            cols["input_ids"].append(row.int_key("token"))
        else:
            cols["input_ids"].extend(row.tokens(row.key("tokens"), "tokens="))
        cols["kv_locs"].extend(row.kv(row.key("kv")))
        row.end()
    if not accept:
        del cols["accept_pos"]
    return k, serials, cols


def _draft(p: _Parser, line: _Line, indent: int) -> DraftBatch:
    k, (draft,), cols = _window_cols(p, line, indent, single=True, accept=False, id_key="draft")
    return DraftBatch(k=k, draft_id=TicketSerial(draft), **cols)


def _verify(p: _Parser, line: _Line, indent: int) -> VerifyBatch:
    k, (verify, draft), cols = _window_cols(p, line, indent, single=False, accept=False, id_key="verify")
    return VerifyBatch(k=k, verify_id=TicketSerial(verify), draft_id=TicketSerial(draft), **cols)


def _commit(p: _Parser, line: _Line, indent: int) -> CommitBatch:
    k, (verify, draft), cols = _window_cols(p, line, indent, single=False, accept=True, id_key="verify")
    rel = p.take(indent, "released kv=...")
    rel.literal("released")
    released = rel.kv(rel.key("kv"))
    rel.end()
    return CommitBatch(k=k, verify_id=TicketSerial(verify), draft_id=TicketSerial(draft), released_kv=released, **cols)


def _draft_commit(p: _Parser, line: _Line, indent: int) -> DraftCommitBatch:
    k, (draft,), cols = _window_cols(p, line, indent, single=False, accept=True, id_key="draft")
    return DraftCommitBatch(k=k, draft_id=TicketSerial(draft), **cols)


def _draft_extend(p: _Parser, line: _Line, indent: int) -> DraftExtendBatch:
    cols = p.extend_rows(line, indent, intents=False)
    line.end()
    if bool(np.asarray(cols.pop("more_chunks")).any()):
        line.fail("a draft extend has no more chunks", line.words[0])
    return DraftExtendBatch(**cols)  # type: ignore[arg-type]


def _idle(cls: Callable[[], T]) -> Callable[[_Parser, _Line, int], T]:
    def parse(p: _Parser, line: _Line, indent: int) -> T:
        if line.int_key("requests") != 0:
            line.fail("an idle node has no requests", line.words[1])
        line.end()
        return cls()

    return parse


def _parts(build: Callable[..., C], *names: str) -> Callable[[_Parser, _Line, int], C]:
    def parse(p: _Parser, line: _Line, indent: int) -> C:
        declared = line.int_key("requests")
        line.end()
        node = build(**{name: p.node(indent) for name in names})
        if node.num_requests != declared:
            line.fail(f"requests={declared} but its parts hold {node.num_requests}", f"requests={declared}")
        return node

    return parse


def _mamba_init(p: _Parser, line: _Line, indent: int) -> MambaInit:
    init = p.init_ops(line)
    line.end()
    return init


def _mamba_snapshot(p: _Parser, line: _Line, indent: int) -> MambaSnapshot:
    snap = p.snapshot_ops(line)
    line.end()
    return snap


def _init_ticket(p: _Parser, line: _Line, indent: int) -> InitTicket:
    init = p.init_ops(line)
    pool = line.pool()
    line.end()
    return InitTicket(pool=pool, init=init)


def _snapshot_ticket(p: _Parser, line: _Line, indent: int) -> SnapshotTicket:
    snap = p.snapshot_ops(line)
    pool = line.pool()
    line.end()
    return SnapshotTicket(pool=pool, snapshot=snap)


def _admitted(p: _Parser, line: _Line, indent: int) -> AdmittedRequest:
    rid, slot = line.name("r"), line.name("s")
    kind = line.key("intent")
    intent: Intent
    match kind:
        case "clear":
            intent = Clear()
        case "cow":
            src = line.name("s", line.key("src"))
            intent = _built(line, lambda: CopyFrom(src=MambaSlot(src), prefix_len=line.int_key("prefix")))
        case "continue":
            intent = _built(line, lambda: Continue(prefix_len=line.int_key("prefix")))
        case _:
            line.fail("expected intent=clear, intent=cow or intent=continue", "intent=" + kind)
    more = line.optional("more")
    snapshot_to = None
    if (w := line.peek()) is not None and w.startswith("snapshot_to="):
        snapshot_to = MambaSlot(line.name("s", line.key("snapshot_to")))
    tokens = line.tokens(line.key("tokens"), "tokens=")
    kv = line.kv(line.key("kv"))
    line.end()
    return AdmittedRequest(
        rid=RequestId(rid), slot=MambaSlot(slot), input_ids=tokens, kv_locs=kv, intent=intent, more_chunks=more, snapshot_to=snapshot_to
    )


def _accept(p: _Parser, line: _Line, indent: int) -> AcceptResult:
    declared = line.int_key("requests")
    line.end()
    accepted: list[int] = []
    bonus: list[int] = []
    while (row := p.peek(indent)) is not None and row.words[0].startswith("accepted="):
        p.i += 1
        accepted.append(row.int_key("accepted"))
        bonus.append(row.int_key("bonus"))
        row.end()
    if len(accepted) != declared:
        line.fail(f"requests={declared} but {len(accepted)} rows follow", f"requests={declared}")
    return AcceptResult(accepted=accepted, bonus=bonus)


_KINDS: dict[str, Callable[[_Parser, _Line, int], Printable]] = {
    "ExtendBatch": _extend_batch,
    "ExtendPlan": _extend_plan,
    "DecodeBatch": lambda p, line, indent: DecodeBatch(**_decode_cols(p, line, indent)),
    "DecodePlan": _decode_plan,
    "MixedBatch": _parts(MixedBatch, "extend", "decode"),
    "MixedPlan": _parts(MixedPlan, "extend", "decode"),
    "IdleBatch": _idle(IdleBatch),
    "IdlePlan": _idle(IdlePlan),
    "DraftBatch": _draft,
    "VerifyBatch": _verify,
    "CommitBatch": _commit,
    "DraftCommitBatch": _draft_commit,
    "DraftExtendBatch": _draft_extend,
    "DraftPlan": _parts(DraftPlan, "batch"),
    "VerifyPlan": _parts(VerifyPlan, "batch"),
    "CommitPlan": _parts(CommitPlan, "batch"),
    "DraftCommitPlan": _parts(DraftCommitPlan, "batch"),
    "DraftExtendPlan": _parts(DraftExtendPlan, "batch"),
    "MambaInit": _mamba_init,
    "MambaSnapshot": _mamba_snapshot,
    "InitTicket": _init_ticket,
    "SnapshotTicket": _snapshot_ticket,
    "AdmittedRequest": _admitted,
    "AcceptResult": _accept,
}


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
