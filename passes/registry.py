"""The passes, declared once: each pass function with its name and whether it ends a step (its
output is a plan for the backend, verified at the default level). The node types a pass takes and
returns are its signature's, which mypy checks at every call through the pass manager; the
declaration does not repeat them.

``compiler.manager.PassManager.run`` takes the pass itself and reads its declaration, so a pass is
never named twice at a call site; a function that is not declared is refused. batchc's own passes
are declared here (``PASSES``); a pass of one's own, in one's own package, is declared where it is
defined, with ``@declare_pass``, which returns a ``Pass``: the function, typed as it was (mypy checks
its calls, direct or through the manager, against its own signature), carrying its declaration. The
manager gives it everything a built-in pass gets (verification, dumps, timings, errors naming it).

A declared name is the pass's name in dumps, timings and errors: a Python identifier, not the name
of a built-in pass; one pass manager refuses two different passes under one name.
"""

from __future__ import annotations

import functools
import keyword
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, Generic, ParamSpec, TypeVar, final, overload

import attrs

from ir.errors import PreconditionError, short_repr
from passes.accept import accept
from passes.commit import commit
from passes.filter_batch import filter_batch
from passes.lower import lower
from passes.merge_batch import merge_batch
from passes.mix_with_running import mix_with_running
from passes.prepare_for_decode import prepare_for_decode
from passes.prepare_for_draft import prepare_for_draft
from passes.prepare_for_draft_commit import prepare_for_draft_commit
from passes.prepare_for_draft_extend import prepare_for_draft_extend
from passes.prepare_for_extend import prepare_for_extend
from passes.prepare_for_head_commit import prepare_for_head_commit
from passes.prepare_for_head_extend import prepare_for_head_extend
from passes.prepare_for_verify import prepare_for_verify
from passes.withdraw import withdraw

__all__ = [
    "Pass",
    "PassSpec",
    "PASSES",
    "REGISTRY",
    "declare_pass",
    "spec_of",
]

P = ParamSpec("P")
R = TypeVar("R")


@attrs.frozen(kw_only=True)
class PassSpec:
    """One pass: ``fn`` under ``name`` in dumps, errors and timings; ``ends_step``: its output is a
    plan for the backend (``compiler.manager.PassManager`` reads both)."""

    fn: Callable[..., object]
    name: str
    ends_step: bool = False


PASSES: Final[tuple[PassSpec, ...]] = (
    PassSpec(fn=prepare_for_extend, name="prepare_for_extend"),
    PassSpec(fn=prepare_for_decode, name="prepare_for_decode"),
    PassSpec(fn=mix_with_running, name="mix_with_running"),
    PassSpec(fn=filter_batch, name="filter_batch"),
    PassSpec(fn=withdraw, name="withdraw"),
    PassSpec(fn=merge_batch, name="merge_batch"),
    PassSpec(fn=prepare_for_draft, name="prepare_for_draft"),
    PassSpec(fn=prepare_for_verify, name="prepare_for_verify"),
    PassSpec(fn=accept, name="accept"),
    PassSpec(fn=commit, name="commit"),
    PassSpec(fn=prepare_for_draft_commit, name="prepare_for_draft_commit"),
    PassSpec(fn=prepare_for_draft_extend, name="prepare_for_draft_extend"),
    PassSpec(fn=prepare_for_head_extend, name="prepare_for_head_extend"),
    PassSpec(fn=prepare_for_head_commit, name="prepare_for_head_commit"),
    PassSpec(fn=lower, name="lower", ends_step=True),
)
"""Every pass, in lifecycle order."""

REGISTRY: Final[Mapping[Callable[..., object], PassSpec]] = MappingProxyType({p.fn: p for p in PASSES})


BUILT_IN_NAMES: Final[frozenset[str]] = frozenset(p.name for p in PASSES)


@final
class Pass(Generic[P, R]):
    """A pass declared outside batchc (``declare_pass``): calling it calls ``fn`` with the same
    arguments (its type is ``fn``'s: mypy checks each call, direct or through
    ``PassManager.run``, against ``fn``'s signature), and ``spec`` is its declaration. Immutable;
    equal to another ``Pass`` only when it is the same object."""

    __name__: str
    __qualname__: str
    __wrapped__: Callable[P, R]
    """``fn`` (``functools.update_wrapper`` sets both, and the rest of ``fn``'s metadata)."""

    _frozen = False

    def __init__(self, fn: Callable[P, R], spec: PassSpec) -> None:
        """Use ``declare_pass``; built directly, the same checks apply (``PreconditionError``): ``spec``
        a ``PassSpec`` of ``fn`` whose name is an identifier and not a built-in pass's."""
        declared: object = spec  # typed; checked because callers need not be typed
        if not isinstance(declared, PassSpec) or declared.fn is not fn:
            raise PreconditionError("Pass", f"spec must be a PassSpec of the function itself, got {short_repr(spec)}")
        _check_name(declared.name)
        _check_flag(declared.ends_step)
        self._spec = spec
        functools.update_wrapper(self, fn)  # name, qualname, module and docstring: help() and docs read fn's
        self._frozen = True

    @property
    def spec(self) -> PassSpec:
        """The declaration: ``fn`` (the function itself), ``name`` and ``ends_step``."""
        return self._spec

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        fn: Callable[P, R] = self._spec.fn  # type: ignore[assignment]  # the spec keeps fn as Callable[..., object]; __init__ took it as Callable[P, R]
        return fn(*args, **kwargs)

    def __setattr__(self, name: str, value: object) -> None:
        if self._frozen:
            raise AttributeError(f"pass {self._spec.name!r} is immutable (cannot set {name!r})")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        try:
            where = f"{self.__module__}.{self.__qualname__}"
        except AttributeError:  # a callable object carries no qualified name
            where = repr(self._spec.fn)
        return f"<pass {self._spec.name!r} ({where})>"


def _check_name(name: object) -> None:
    """A declared name: a Python identifier (not a keyword), not a built-in pass's."""
    if not isinstance(name, str) or not name.isidentifier():
        raise PreconditionError("declare_pass", f"name must be a Python identifier (it names dump files), got {short_repr(name)}")
    if keyword.iskeyword(name):
        raise PreconditionError("declare_pass", f"name {name!r} is a Python keyword; give your pass another name")
    if name in BUILT_IN_NAMES:
        raise PreconditionError("declare_pass", f"name {name!r} is a built-in pass's; give yours another name")


def _check_flag(ends_step: object) -> None:
    if not isinstance(ends_step, bool):
        raise PreconditionError("declare_pass", f"ends_step must be a bool, got {short_repr(ends_step)}")


def _declare(fn: Callable[P, R], name: str | None, ends_step: bool) -> Pass[P, R]:
    """``fn`` declared (see ``declare_pass``), every argument checked."""
    if isinstance(fn, Pass):
        raise PreconditionError("declare_pass", f"{fn!r} is declared already (a pass is declared once)")
    if isinstance(fn, str):
        raise PreconditionError("declare_pass", f"a pass must be a function, got {short_repr(fn)} (to name one: @declare_pass(name={fn!r}))")
    if not callable(fn):
        raise PreconditionError("declare_pass", f"a pass must be a function, got {short_repr(fn)}")
    if _is_built_in(fn):
        raise PreconditionError("declare_pass", f"{REGISTRY[fn].name!r} is one of batchc's own passes, declared already")
    if name is None:
        try:
            own: object = fn.__name__
        except AttributeError:  # a callable object without a name
            own = None
        if not isinstance(own, str) or not own.isidentifier():
            raise PreconditionError("declare_pass", f"{short_repr(fn)} has no identifier for a name; declare it with name=...")
        name = own
    return Pass(fn, PassSpec(fn=fn, name=name, ends_step=ends_step))  # (Pass checks the name and the flag)


def _is_built_in(fn: object) -> bool:
    try:
        return fn in REGISTRY
    except TypeError:  # unhashable: not one of batchc's functions
        return False


@overload
def declare_pass(fn: Callable[P, R], /, *, name: str | None = None, ends_step: bool = False) -> Pass[P, R]: ...


@overload
def declare_pass(*, name: str | None = None, ends_step: bool = False) -> Callable[[Callable[P, R]], Pass[P, R]]: ...


def declare_pass(
    fn: Callable[P, R] | None = None, /, *, name: str | None = None, ends_step: bool = False
) -> Pass[P, R] | Callable[[Callable[P, R]], Pass[P, R]]:
    """Declare a pass of one's own where it is defined: ``@declare_pass`` (named as the function) or
    ``@declare_pass(name="...", ends_step=True)`` (its output is a plan for the backend, verified
    at the default level too). Returns the ``Pass`` that ``PassManager.run`` runs like a built-in pass.

    One function may be declared more than once, each ``Pass`` its own declaration (the same step
    under two names in dumps and timings); a ``Pass`` itself is not declared again.

    ``PreconditionError``, naming the value: a ``fn`` that is not callable (a name given where the
    function goes says how to name one), is one of batchc's passes or is a ``Pass`` already; a
    ``name`` that is not an identifier (or is a keyword) or is a built-in pass's; an ``ends_step``
    that is not a bool."""
    if fn is not None:
        return _declare(fn, name, ends_step)
    if name is not None:  # at the decorator's line, before any function
        _check_name(name)
    _check_flag(ends_step)

    def declare(f: Callable[P, R]) -> Pass[P, R]:
        return _declare(f, name, ends_step)

    return declare


def spec_of(fn: object) -> PassSpec:
    """The declaration of pass ``fn`` (a built-in pass, or a ``Pass`` made by ``declare_pass``);
    ``PreconditionError`` for anything else."""
    if isinstance(fn, Pass):
        return fn.spec
    spec = REGISTRY.get(fn) if callable(fn) and _is_built_in(fn) else None
    if spec is None:
        raise PreconditionError(
            "PassManager.run", f"{short_repr(fn)} is not a declared pass (batchc's own, or one made with passes.registry.declare_pass)"
        )
    return spec
