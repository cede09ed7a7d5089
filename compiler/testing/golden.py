"""Golden-file assertions: the output of a pass (or of anything printed) against a reviewed text file.

``assert_golden(actual, path)`` compares ``actual`` (a ``str``) with the golden file at ``path``, a
path the test chooses. On a mismatch it fails (``GoldenMismatch``, an ``AssertionError``) with an
excerpt of the unified diff and how to update. With the update switch on it writes ``actual`` to
``path`` (creating its folder) instead, and passes: review the change as a text diff before
committing it. ``assert_golden_ir`` is the same for goldens that are IR dumps (``ir.printer.dump``
or ``dump_all`` text, in sections that ``-- label --`` lines may separate): every section of the
golden must parse with ``ir.parse.parse_all``, and so must ``actual``'s before it is written.

The update switch: ``update=True``/``False`` when given; otherwise on when the environment sets
``BATCHC_UPDATE_GOLDEN=1`` or pytest runs with ``--batchc-update-golden`` (the option batchc's pytest
plugin adds). ``BATCHC_UPDATE_GOLDEN`` must be unset, empty, ``0`` or ``1``: another value is a
``ValueError`` naming it, not silently off.

A golden that cannot be read fails with ``GoldenFileError`` (an ``AssertionError``), one line naming
the file and, where one is to blame, the line: a missing file (and the switch that writes it),
bytes that are not UTF-8, a UTF-8 byte-order mark the output does not start with, an IR dump
that does not parse; so does one the
switch cannot write (a folder in the way, no permission). A golden that differs from the output
only in its line endings (CRLF where the output has LF: a checkout that converts line endings) says
so instead of showing lines that look equal. pytest shows these failures without this module's
frames (``__tracebackhide__``): the test's own line and the message.

Why not syrupy (the maintained snapshot-testing plugin): syrupy keeps its snapshots where it
chooses, beside the test module (``__snapshots__/``, one file per module or per test), names them
after the test, reaches them only through its ``snapshot`` fixture, and with ``--snapshot-update``
deletes the snapshots no test used in that run. batchc's goldens are one plain-text file per pass at
a path the test chooses (``tests/golden/passes/lower.txt``), written by one test and read by others
(the IR parser's round-trip test parses every dump in them), reviewed as text diffs, and updated by
the ``BATCHC_UPDATE_GOLDEN=1`` the docs and the existing goldens use; an engine author's goldens are
the same kind of file. None of that needs a snapshot store, and syrupy's update would delete files
other tests read. So this module is a plain function over a path, with no dependency beyond the
standard library (and ``ir`` for the parse check).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from pathlib import Path

__all__ = [
    "UPDATE_ENV",
    "UPDATE_OPTION",
    "GoldenError",
    "GoldenFileError",
    "GoldenMismatch",
    "assert_golden",
    "assert_golden_ir",
    "read_golden",
    "update_requested",
]

UPDATE_ENV = "BATCHC_UPDATE_GOLDEN"
"""The environment variable that turns the update switch on (``1``)."""
UPDATE_OPTION = "--batchc-update-golden"
"""The pytest option that turns the update switch on (batchc's pytest plugin adds it)."""

_DIFF_LINES = 40
_SECTION = re.compile(r"^-- .* --$")
"""A section line of an IR-dump golden (``-- step 003 --``): a label, not IR."""
_HOW = f"to accept the new output, rerun with {UPDATE_OPTION} (or {UPDATE_ENV}=1) and review the diff"


class GoldenError(AssertionError):
    """A golden assertion failed (a test failure, not an error in the test)."""


class GoldenFileError(GoldenError):
    """The golden file is missing or unreadable (not UTF-8, or, for an IR dump, not parseable):
    one line naming the file and the line."""


class GoldenMismatch(GoldenError):
    """The output differs from the golden file: the message holds a unified-diff excerpt."""


def update_requested() -> bool:
    """Whether the update switch is on: ``BATCHC_UPDATE_GOLDEN=1``, or pytest's ``--batchc-update-golden``
    in the running session. ``ValueError`` (one line) for a ``BATCHC_UPDATE_GOLDEN`` that is not
    unset, empty, ``0`` or ``1``."""
    __tracebackhide__ = True
    value = os.environ.get(UPDATE_ENV)
    if value not in (None, "", "0", "1"):
        raise ValueError(f"{UPDATE_ENV} must be 0 or 1 (or unset), got {value[:40]!r}")
    if value == "1":
        return True
    if "compiler.testing.pytest_plugin" not in sys.modules:  # no pytest session could have set the option
        return False
    from compiler.testing import pytest_plugin

    return pytest_plugin.update_golden_option()


def _path(fn: str, path: object) -> Path:
    __tracebackhide__ = True
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{fn}: path must be a str or a path, got {type(path).__name__}")
    if not os.fspath(path):
        raise ValueError(f"{fn}: path must name a file, got ''")
    return Path(path)


def _text(fn: str, actual: object) -> str:
    __tracebackhide__ = True
    if not isinstance(actual, str):
        raise TypeError(f"{fn}: actual must be the text (str) to compare, got {type(actual).__name__}")
    return actual


def read_golden(path: str | os.PathLike[str]) -> str:
    """The golden file's text; ``GoldenFileError`` when it is missing or not UTF-8 (naming the line
    and column of the first bad byte)."""
    __tracebackhide__ = True
    p = _path("read_golden", path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise GoldenFileError(f"golden file {p} is missing: run with {UPDATE_OPTION} (or {UPDATE_ENV}=1) to write it") from None
    except OSError as e:
        raise GoldenFileError(f"golden file {p} cannot be read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise GoldenFileError(f"golden file {p}: line {line}: not UTF-8 (byte 0x{data[e.start]:02x} at column {column})") from None


def _diff(expected: str, actual: str, path: Path) -> str:
    lines = list(difflib.unified_diff(
        expected.splitlines(keepends=True), actual.splitlines(keepends=True), fromfile=f"{path} (golden)", tofile="actual", n=2,
    ))
    shown = [line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines[:_DIFF_LINES]]
    more = f"... and {len(lines) - _DIFF_LINES} more diff lines\n" if len(lines) > _DIFF_LINES else ""
    return "".join(shown) + more


def _write(p: Path, text: str) -> None:
    __tracebackhide__ = True
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text.encode("utf-8"))
    except OSError as e:
        where = e.filename if e.filename is not None and Path(e.filename) != p else None
        raise GoldenFileError(f"golden file {p} cannot be written: {e.strerror or e}" + (f" ({where})" if where else "")) from None


def _check(fn: str, actual: object, path: object, update: bool | None, parse_ir: bool) -> None:
    __tracebackhide__ = True
    text, p = _text(fn, actual), _path(fn, path)
    if update is not None and not isinstance(update, bool):
        raise TypeError(f"{fn}: update must be True, False or None, got {type(update).__name__}")
    if update if update is not None else update_requested():
        if parse_ir:
            _parse(text, f"the actual output for {p}")
        _write(p, text)
        return
    expected = read_golden(p)
    if expected.startswith("\ufeff") and not text.startswith("\ufeff"):
        raise GoldenFileError(f"golden file {p}: line 1: starts with a UTF-8 byte-order mark (an editor added it): remove it")
    if parse_ir:
        _parse(expected, f"golden file {p}", golden=True)
    if text != expected and expected.replace("\r\n", "\n") == text.replace("\r\n", "\n"):
        raise GoldenMismatch(f"{p}: the golden file differs from the output only in its line endings ({_endings(expected)} where the output has "
                             f"{_endings(text)}: a checkout that converts line endings, such as git's core.autocrlf, changed it); {_HOW}")
    if text != expected:
        ops = difflib.SequenceMatcher(a=expected.splitlines(), b=text.splitlines(), autojunk=False).get_opcodes()
        changed = max(1, sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal"))  # (1: only a final newline)
        raise GoldenMismatch(f"{p}: the output differs from the golden file ({changed} line(s)); {_HOW}\n" + _diff(expected, text, p).rstrip("\n"))


def _endings(text: str) -> str:
    """``CRLF``, ``LF`` or ``CRLF and LF``: the line endings ``text`` uses."""
    crlf = text.count("\r\n")
    lf = text.count("\n") - crlf
    return "CRLF and LF" if crlf and lf else "CRLF" if crlf else "LF"


def _sections(text: str) -> list[tuple[int, str]]:
    """The text between ``-- label --`` lines, each with the number of its first line."""
    out: list[tuple[int, str]] = []
    first, lines = 1, list[str]()
    for no, line in enumerate(text.splitlines(keepends=True), 1):
        if _SECTION.match(line.rstrip("\r\n")):
            out.append((first, "".join(lines)))
            first, lines = no + 1, []
        else:
            lines.append(line)
    out.append((first, "".join(lines)))
    return [(no, body) for no, body in out if body.strip()]


def _parse(text: str, what: str, *, golden: bool = False) -> None:
    __tracebackhide__ = True
    from ir.parse import ParseError, parse_all

    for first, body in _sections(text):
        try:
            parse_all(body)
        except ParseError as e:
            reason = str(e).removeprefix(f"line {e.line}: ")
            error = GoldenFileError if golden else GoldenError
            raise error(f"{what}: line {first + e.line - 1}: not an IR dump: {reason}") from None


def assert_golden(actual: str, path: str | os.PathLike[str], *, update: bool | None = None) -> None:
    """``actual`` equals the golden file at ``path`` (see the module docstring; ``update``: the switch,
    ``None`` to read it from the environment and pytest's option)."""
    __tracebackhide__ = True
    _check("assert_golden", actual, path, update, parse_ir=False)


def assert_golden_ir(actual: str, path: str | os.PathLike[str], *, update: bool | None = None) -> None:
    """``assert_golden`` for a golden of IR dumps, maybe in sections separated by ``-- label --``
    lines: every section must parse with ``ir.parse.parse_all`` (``GoldenFileError`` naming the
    file and the line otherwise), and ``actual``'s must too before the switch writes it."""
    __tracebackhide__ = True
    _check("assert_golden_ir", actual, path, update, parse_ir=True)
