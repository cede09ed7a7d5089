"""The pass manager: runs passes with verification, dumps and timing.

``PassManager.run(pass_fn, *args)`` calls the pass with its own arguments (typed through a
``ParamSpec``, so mypy checks every call edge as if the pass were called directly). The pass is one
of batchc's (``passes.registry.PASSES``) or one's own, declared with ``passes.registry.declare_pass``
where it is defined; both get the same treatment. Around the call it:

- verifies the output (an IR node, or each IR node of a tuple the pass returns) (``BATCHC_VERIFY``: 0 = off, 1 = outputs of passes that end a step, 2 = every
  pass output; tests run with 2, the default is 1);
- writes ``dump(output)`` to ``BATCHC_DUMP_DIR/<seq>-<name>.txt`` when a dump folder is set, and
  keeps it in ``trace`` when constructed with ``record=True``;
- adds the pass's wall time to ``timings()``.

Any exception raised by the pass or its verification is re-raised as ``PassError`` naming the
failing pass, the passes that ran before it in this manager (the last 8), and a bounded excerpt of
the dump of the pass's first IR argument. The original exception is chained as ``__cause__`` and
kept as ``.error``.

Settings from the environment (``settings_from_env``, the one parser of both variables; the CLI
calls it before anything runs): ``BATCHC_VERIFY`` must be exactly ``0``, ``1`` or ``2`` (unset or
empty: 1); ``BATCHC_DUMP_DIR`` must not name an existing non-directory, nor a folder that holds a
symbolic link. Dump files are opened with ``O_NOFOLLOW`` and must be single-link regular files, so a
link planted at a dump file's name is refused, never written through. A bad setting or a refused
dump file raises ``SettingsError`` (one line, naming the variable or file and the value).
"""

from __future__ import annotations

import os
import stat
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import ParamSpec, TypeVar, get_args

import attrs

from ir.errors import BatchcError, PreconditionError, SettingsError, short_repr
from ir.nodes import NODE_TYPES, Batch, Plan
from ir.printer import dump
from ir.verify import VerifyLevel, parse_verify_level, verify
from passes.registry import REGISTRY, PassSpec, spec_of

__all__ = ["PassError", "PassManager", "PassTiming", "check_dump_dir", "settings_from_env"]

P = ParamSpec("P")
R = TypeVar("R")

_IR_TYPES = NODE_TYPES
_PLAN_TYPES: tuple[type, ...] = get_args(Plan)  # (the nested unions are flattened: every plan class)
_SPECS = dict(REGISTRY)
"""The passes' declarations by function (a plain dict: ``run`` looks one up per pass)."""
_EXCERPT_LINES = 12
_EXCERPT_CHARS = 1500
_HISTORY = 8


class PassError(BatchcError):
    """A pass (or the verification of its output) raised: names the pass, the passes that ran before it
    in this manager (``before``, the last 8) and an excerpt of its first IR argument's dump
    (``excerpt``). The original exception is ``error`` and the ``__cause__``."""

    def __init__(self, pass_name: str, before: tuple[str, ...], excerpt: str, error: BaseException) -> None:
        self.pass_name = pass_name
        self.before = before
        self.excerpt = excerpt
        self.error = error
        chain = " -> ".join(before) if before else "(none)"
        body = "\n".join("    " + line for line in excerpt.splitlines())
        super().__init__(
            f"pass {pass_name!r} failed: {type(error).__name__}: {error}\n"
            f"  passes before it: {chain}\n"
            f"  input IR (excerpt):\n{body}"
        )


def _ir_nodes(out: object) -> tuple[Batch | Plan, ...]:
    """The IR nodes a pass returned: the output itself, or the IR nodes of a tuple or list it returned."""
    if isinstance(out, _IR_TYPES):
        return (out,)
    if isinstance(out, (tuple, list)):  # (a NamedTuple too)
        return tuple(x for x in out if isinstance(x, _IR_TYPES))
    return ()


def _check_own_output(spec: PassSpec, out: object) -> None:
    """A pass of one's own returns IR the manager can verify and dump: a node, or a tuple or list
    holding nodes, or an empty one (a plan among them when it ends a step). ``PreconditionError``
    naming what it got."""
    nodes = _ir_nodes(out)
    if not nodes and not (isinstance(out, (tuple, list)) and not out and not spec.ends_step):  # ([]: a split into nothing, nothing to verify)
        raise PreconditionError(
            spec.name, f"returned {short_repr(out)} ({type(out).__name__}), not IR: a pass of one's own returns a batch or a plan, "
            "or a tuple or list holding them, for the pass manager to verify and dump",
        )
    if spec.ends_step and not any(isinstance(n, _PLAN_TYPES) for n in nodes):
        raise PreconditionError(
            spec.name, f"is declared ends_step=True but returned no plan (got {', '.join(type(n).__name__ for n in nodes)}): "
            "a pass that ends a step returns the plan for the backend",
        )


def _level(level: int) -> VerifyLevel:
    """``level`` as a ``VerifyLevel`` (``ValueError`` naming it unless it is 0, 1 or 2, never a bool)."""
    value: object = level  # typed; checked because callers need not be typed
    if isinstance(value, bool) or value not in (0, 1, 2):
        raise ValueError(f"verify_level must be 0, 1 or 2 (a VerifyLevel), got {value!r}")
    return VerifyLevel(level)


def _where(fn: Callable[..., object]) -> str:
    """``module.qualname`` of a pass's function (its repr for a callable object without them)."""
    try:
        return f"{fn.__module__}.{fn.__qualname__}"
    except AttributeError:
        return repr(fn)


def _excerpt(node: object) -> str:
    if not isinstance(node, _IR_TYPES):
        return f"<{type(node).__name__}>"
    text = dump(node)
    lines = text.splitlines()
    out = "\n".join(lines[:_EXCERPT_LINES])
    if len(lines) > _EXCERPT_LINES:
        out += f"\n... ({len(lines) - _EXCERPT_LINES} more lines)"
    return out if len(out) <= _EXCERPT_CHARS else out[: _EXCERPT_CHARS - 3] + "..."


@attrs.frozen
class PassTiming:
    """One pass's total over a manager's runs: how many calls and their wall time in seconds."""

    calls: int
    seconds: float


def check_dump_dir(path: Path) -> None:
    """Refuse a dump folder that is a symbolic link (dangling or not), exists as something else,
    or holds a symbolic link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # created when the pass manager is built
    except ValueError:  # a NUL byte
        raise SettingsError(f"dump folder {str(path)!r}: a path cannot hold a NUL byte") from None
    except OSError as exc:
        raise SettingsError(f"dump folder {str(path)!r}: cannot stat it ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise SettingsError(f"dump folder {str(path)!r} is a symbolic link; dump files are never written through links")
    if not stat.S_ISDIR(st.st_mode):
        raise SettingsError(f"dump folder {str(path)!r} exists and is not a directory")
    try:
        links = sorted(e.name for e in os.scandir(path) if e.is_symlink())
    except OSError as exc:
        raise SettingsError(f"dump folder {str(path)!r}: cannot list it ({exc.strerror})") from None
    if links:
        raise SettingsError(f"dump folder {str(path)!r} holds a symbolic link {links[0]!r}; dump files are never written through links")


def settings_from_env(environ: Mapping[str, str] | None = None) -> tuple[VerifyLevel, Path | None]:
    """``(verify level, dump folder or None)`` from ``BATCHC_VERIFY`` and ``BATCHC_DUMP_DIR``, checked."""
    env = os.environ if environ is None else environ
    level = parse_verify_level(env.get("BATCHC_VERIFY"))
    raw = env.get("BATCHC_DUMP_DIR") or None
    dump_dir = Path(raw) if raw is not None else None
    if dump_dir is not None:
        check_dump_dir(dump_dir)
    return level, dump_dir


def _write_dump(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` without following a link there (``O_NOFOLLOW``) and only into a
    regular file with one link (a planted hard link or FIFO is refused too)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise SettingsError(f"dump file {str(path)!r}: cannot open it as a plain file, links are not followed ({exc.strerror})") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise SettingsError(f"dump file {str(path)!r} is not a regular file with a single link; refusing to write it")
        f.truncate(0)
        f.write(text)


class PassManager:
    """Runs passes: the one way the typed steps (``compiler.steps.Pipeline``) call them.

    ``run(pass_fn, *args)`` is typed through the pass's own signature, so mypy checks each call as if
    the pass were called directly; it refuses a function that is not a declared pass (batchc's own, or
    a ``Pass`` of one's own from ``passes.registry.declare_pass``), and a pass of one's own whose name
    another pass of one's own already ran under in this manager (names key the timings and dumps). Around each call it verifies the output at ``verify_level``, writes its dump
    to ``dump_dir`` (when set; files named ``<seq>-<pass>.txt``, never written through a link), keeps
    it in ``trace`` (with ``record=True``) and adds the pass's time to ``timings()``; any failure
    comes back as a ``PassError`` naming the pass. Arguments are checked at construction:
    ``verify_level`` 0, 1 or 2 (``ValueError``), a ``dump_dir`` that is a link, not a folder or holds a
    link is a ``SettingsError``. It holds no lock: one thread at a time uses a manager."""

    def __init__(self, *, verify_level: int = VerifyLevel.LAST, dump_dir: Path | str | None = None, record: bool = False) -> None:
        self.verify_level = _level(verify_level)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        if self.dump_dir is not None:
            check_dump_dir(self.dump_dir)
            try:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SettingsError(f"dump folder {str(self.dump_dir)!r}: cannot create it ({exc.strerror})") from None
        self._history: deque[str] = deque(maxlen=_HISTORY)
        self._seq = 0
        self._spent: dict[str, list[int]] = {}
        """Per pass: ``[calls, nanoseconds]``."""
        self._own: dict[str, PassSpec] = {}
        """The passes of one's own this manager has run, by name (two under one name are refused)."""
        self.trace: list[tuple[str, str]] | None = [] if record else None
        """With ``record=True``: ``(pass name, dump of its output)`` for every IR-producing pass run."""

    @classmethod
    def from_env(cls) -> PassManager:
        """Settings from ``BATCHC_VERIFY`` and ``BATCHC_DUMP_DIR`` (``settings_from_env``)."""
        level, dump_dir = settings_from_env()
        return cls(verify_level=level, dump_dir=dump_dir)

    def run(self, pass_: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run a declared pass (``passes.registry``) on ``args``: its name and whether it ends a
        step (then its output is verified at level 1 too) come from its declaration. ``PreconditionError``
        for a function that is not declared, or a pass of one's own under a name another one ran under."""
        try:
            spec = _SPECS.get(pass_)
        except TypeError:  # (an unhashable argument: not a pass either)
            spec = None
        own = spec is None
        if spec is None:
            spec = spec_of(pass_)  # a Pass of one's own, or refused, naming it
            self._check_own(spec)
        name = spec.name
        t0 = time.perf_counter_ns()
        try:
            out = pass_(*args, **kwargs)
            if own:
                _check_own_output(spec, out)
            if self._verify_last if spec.ends_step else self._verify_every:
                for node in _ir_nodes(out):
                    verify(node)
        except PassError:
            raise
        except Exception as exc:
            raise PassError(name, tuple(self._history), _excerpt(args[0] if args else None), exc) from exc
        finally:
            spent = self._spent.get(name)
            if spent is None:
                spent = self._spent[name] = [0, 0]
            spent[0] += 1
            spent[1] += time.perf_counter_ns() - t0
        self._history.append(name)
        if self.dump_dir is not None or self.trace is not None:
            for node in _ir_nodes(out):
                self._seq += 1
                text = dump(node)
                if self.dump_dir is not None:
                    _write_dump(self.dump_dir / f"{self._seq:05d}-{name}.txt", text)
                if self.trace is not None:
                    self.trace.append((name, text))
        return out

    def _check_own(self, spec: PassSpec) -> None:
        """A pass of one's own: refused when another one already ran under its name here."""
        seen = self._own.setdefault(spec.name, spec)
        if seen.fn is not spec.fn:
            raise PreconditionError(
                "PassManager.run",
                f"two passes are named {spec.name!r}: {_where(spec.fn)} and {_where(seen.fn)} (give one another name in declare_pass)",
            )

    @property
    def verify_level(self) -> VerifyLevel:
        """How much ``run`` verifies: ``OFF``, ``LAST`` (outputs of passes that end a step) or ``EVERY_PASS``.
        Settable."""
        return self._verify_level

    @verify_level.setter
    def verify_level(self, level: VerifyLevel) -> None:
        level = _level(level)  # an int is taken as its VerifyLevel; anything else but 0, 1, 2 is refused
        self._verify_level = level
        self._verify_every = level is VerifyLevel.EVERY_PASS
        """Verify every pass's output."""
        self._verify_last = level is not VerifyLevel.OFF
        """Verify the output of a pass that ends a step."""

    def timings(self) -> dict[str, PassTiming]:
        """Per pass name, its calls and total seconds since the manager was built or last reset."""
        return {k: PassTiming(calls, ns / 1e9) for k, (calls, ns) in self._spent.items()}

    def reset_timings(self) -> None:
        """Forget the timings gathered so far."""
        self._spent.clear()
