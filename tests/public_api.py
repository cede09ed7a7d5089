"""batchc's declared public API: the rule of which modules are public, the docstring check, and the
recorded API of a release that the API-break check compares the tree against.

The rule (docs/reference/public-api.md says the same, and ``tests/test_public_api.py`` checks that it
does): every module of the four packages is public except a module or package whose dotted path has a
component starting with ``_``, and the modules at or under one of ``NOT_PUBLIC``. In a public module the
names in ``__all__`` are the public API; everything else is internal and may change.

The rule lives here, in the test tree, because nothing at run time asks it: it is a promise about the
packages that the suite keeps, not something the packages do. Put in a package it would itself be a
public module, and shipped in the wheel for no user.

Two command-line entries (``python -m tests.public_api ...`` from the repository root):

- ``report``: the docstring check of every package, its counts and its problems (what
  ``tests/test_public_api.py`` fails on);
- ``record [--force]``: writes the public API of the tree as the recorded API of the version in
  pyproject.toml (``tests/api/batchc-<version>.json``), the reference of the API-break check. It
  refuses to overwrite a recorded version with an API that breaks it unless ``--force`` is given
  (before that version is released).

The API-break check loads the tree statically with griffe (no package is imported, so neither torch
nor anything else heavy is), records it the way a release is recorded (``current_api``), and asks
``griffe.find_breaking_changes`` to compare the recording of the version with it, package by package
and so module by module. A recording holds each public module's ``__all__`` names, each re-export and
each class's inherited public members as the objects they are (griffe compares a re-export or an
inherited member in detail only when both sides hold it alike), expressions as their source text, and
nothing that is not API (docstrings, line numbers, values of constants). One thing is added to what
griffe sees on its own: the ``__init__`` that attrs generates for an attrs class (``AttrsInit``), so
that a new required field or a renamed one is a broken constructor.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.metadata
import inspect
import itertools
import json
import re
import sys
import textwrap
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import griffe

from tests.test_layering import QUARANTINED

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ir", "passes", "backend", "compiler")
API_DIR = ROOT / "tests" / "api"
DOCS_PAGE = ROOT / "docs" / "reference" / "public-api.md"

_QUARANTINE_WHY = "quarantined: development tools and the mutable baseline, used by the command line, each other and tests"
_CLI_WHY = "the command line is the public interface (docs/reference/cli.md), not the modules that implement it"
NOT_PUBLIC: Mapping[str, str] = {
    **dict.fromkeys(QUARANTINED, _QUARANTINE_WHY),
    "backend.kernels.jit": "raw Triton kernels: their launch wrappers in backend.kernels are the API",
    "compiler.cli": _CLI_WHY,
    "compiler.launch": _CLI_WHY,
    "ir.mypy_linear": 'the mypy plugin: public by its configuration name (plugins = ["ir.mypy_linear"]), not by its Python API',
}
"""The modules that are not public although no component of their path starts with ``_``, each at or
under the dotted prefix, with the reason."""


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def is_public(module: str) -> bool:
    """The rule: ``module`` (a dotted path) is one of the four packages' public modules."""
    return module.split(".")[0] in PACKAGES and public_path(module)


def public_path(module: str) -> bool:
    """The rule for a module of any package: no component of its path starts with ``_``, and it is
    not at or under one of ``NOT_PUBLIC``."""
    if any(p.startswith("_") for p in module.split(".")):
        return False
    return not any(_under(module, prefix) for prefix in NOT_PUBLIC)


def modules(package: str, root: Path = ROOT) -> list[str]:
    """Every module of ``package`` by its files (a package is its ``__init__``), sorted; nothing is imported."""
    found = []
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(found)


def public_modules(package: str, root: Path = ROOT) -> list[str]:
    """The public modules of ``package`` (``public_path``), sorted."""
    return [m for m in modules(package, root) if public_path(m)]


# -- the docstring check ----------------------------------------------------------------------------


class DocReport(NamedTuple):
    """What the docstring check of one package found."""

    package: str
    modules: int
    """Public modules checked (each imported, with its docstring and ``__all__``)."""
    symbols: int
    """Classes and functions named in some public module's ``__all__`` (each object once)."""
    members: int
    """Public methods, properties and nested classes defined in those classes."""
    problems: tuple[str, ...]
    """One line per problem, naming the module and the symbol."""

    @property
    def checked(self) -> int:
        """Everything that must have a docstring and was looked at."""
        return self.modules + self.symbols + self.members

    def summary(self) -> str:
        """One line: the counts and the number of problems."""
        return (
            f"public API of {self.package}: {self.modules} modules, {self.symbols} classes and functions, "
            f"{self.members} methods and properties: {self.checked} checked, {len(self.problems)} problems"
        )


def _has_doc(obj: object) -> bool:
    doc = getattr(obj, "__doc__", None)
    return (isinstance(doc, str) and bool(doc.strip())) or _source_has_doc(obj)


def _source_has_doc(obj: object) -> bool:
    """Whether the source of a function (or a property's getter) has a docstring. The suite runs under
    typeguard, which instruments the packages and drops the docstring of a function whose body is
    nothing but its docstring (a no-op method): the source still has it."""
    func = obj.fget if isinstance(obj, property) else obj.func if isinstance(obj, functools.cached_property) else obj
    if not inspect.isfunction(func):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return False
    node = tree.body[0] if tree.body else None
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and bool(ast.get_docstring(node))


def _documentable(obj: object) -> bool:
    """Classes and functions (of any kind: builtins, cached or single-dispatch wrappers) need a
    docstring; constants, type aliases, ``NewType``\\ s and type variables do not."""
    return inspect.isclass(obj) or inspect.isroutine(obj)


def _member_function(raw: object) -> object | None:
    """The object whose docstring documents a class member (``None``: not a method, property or
    nested class: an attrs field, a constant, an enum member)."""
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__
    if isinstance(raw, (property, functools.cached_property)) or inspect.isfunction(raw) or inspect.isclass(raw):
        return raw
    return None


def _class_members(cls: type) -> Iterator[tuple[str, bool]]:
    """The public methods, properties and nested classes that ``cls`` itself defines, each with
    whether it is documented: by its own docstring, or by the one of the member it overrides in a base
    class (an override keeps the contract of what it overrides)."""
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        member = _member_function(raw)
        if member is None:
            continue
        documented = _has_doc(member) or any(
            _has_doc(_member_function(base.__dict__[name])) for base in cls.__mro__[1:] if name in base.__dict__
        )
        yield name, documented


def _label(obj: Any, module: str, symbol: str) -> str:
    """Where a problem is reported: where the object is defined when that module is public (a
    re-export is reported once, at its definition), else where it is offered."""
    defined = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(defined, str) and isinstance(qualname, str) and public_path(defined) and "<" not in qualname:
        return f"{defined}.{qualname}"
    return f"{module}.{symbol}"


def _in(package: str, cls: type) -> bool:
    return cls.__module__.split(".")[0] == package


def check_docstrings(package: str, root: Path = ROOT) -> DocReport:
    """Import every public module of ``package`` and check it: a module docstring, an ``__all__``
    that names only what exists, a docstring on every class and function in ``__all__`` and on every
    public method, property and nested class that such a class has from a class of ``package`` (its
    own, or a base class's: a method inherited from an internal base is offered all the same; a base
    class of another package is that package's to check). Each object is checked once, however many
    modules offer it."""
    problems: list[str] = []
    seen: set[int] = set()
    n_modules = n_symbols = n_members = 0
    for name in public_modules(package, root):
        try:
            module = importlib.import_module(name)
        except Exception as error:  # a broken module is one problem, not the end of the check
            problems.append(f"{name}: cannot be imported: {error!r}")
            continue
        n_modules += 1
        if not _has_doc(module):
            problems.append(f"{name}: the module has no docstring")
        exports = module.__dict__.get("__all__")
        if exports is None:
            problems.append(f"{name}: the module has no __all__")
            continue
        if not isinstance(exports, (list, tuple)) or not all(isinstance(e, str) for e in exports):
            problems.append(f"{name}: __all__ must be a list of names, not {exports!r}")
            continue
        for dup in sorted({e for e in exports if exports.count(e) > 1}):
            problems.append(f"{name}.{dup}: listed twice in __all__")
        for symbol in exports:
            if hasattr(module, symbol):
                obj = getattr(module, symbol)
            else:
                try:  # a package's __all__ may name a submodule that nothing imported yet
                    obj = importlib.import_module(f"{name}.{symbol}")
                except ImportError:
                    problems.append(f"{name}.{symbol}: in __all__ but the module has no such name")
                    continue
            if not _documentable(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            n_symbols += 1
            if not _has_doc(obj):
                problems.append(f"{_label(obj, name, symbol)}: no docstring")
            if not inspect.isclass(obj):
                continue
            for cls in obj.__mro__:
                if cls is obj or (_in(package, cls) and id(cls) not in seen):
                    seen.add(id(cls))
                    for member, documented in _class_members(cls):
                        n_members += 1
                        if not documented:
                            problems.append(f"{_label(cls, name, symbol)}.{member}: no docstring")
    return DocReport(package, n_modules, n_symbols, n_members, tuple(problems))


# -- the recorded API and the API-break check -------------------------------------------------------


def version(root: Path = ROOT) -> str:
    """The version in pyproject.toml."""
    with (root / "pyproject.toml").open("rb") as f:
        found: str = tomllib.load(f)["project"]["version"]
        return found


_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


def version_key(text: str) -> tuple[int, int, int]:
    """``"0.1.0"`` -> ``(0, 1, 0)``; only plain release versions are recorded."""
    m = _VERSION.match(text)
    if m is None:
        raise ValueError(f"not a release version (MAJOR.MINOR.PATCH): {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def may_break(old: str, new: str) -> bool:
    """Whether going from release ``old`` to ``new`` may break the public API (semantic versioning
    with the 0.x rule): a new major version, or below 1.0 a new minor version."""
    o, n = version_key(old), version_key(new)
    if n[0] != o[0]:
        return n[0] > o[0]
    return n[0] == 0 and n[1] > o[1]


def snapshot_path(release: str, api_dir: Path = API_DIR) -> Path:
    """Where the recorded API of ``release`` lives."""
    return api_dir / f"batchc-{release}.json"


def recorded_versions(api_dir: Path = API_DIR) -> list[str]:
    """The versions with a recorded API, oldest first."""
    found = [p.name.removeprefix("batchc-").removesuffix(".json") for p in api_dir.glob("batchc-*.json")]
    return sorted(found, key=version_key)


_ATTRS_DECORATORS = frozenset(
    f"{m}.{d}" for m in ("attrs", "attr") for d in ("frozen", "define", "mutable", "s", "attrs", "dataclass")
)
_FIELD_CALLS = frozenset({"field", "ib", "attrib", "column"})
"""The last component of a call that declares an attrs field (``column`` is ``ir.columns``' wrapper of ``attrs.field``)."""


def _call_args(expr: object) -> dict[str, Any]:
    if isinstance(expr, griffe.ExprCall):
        return {a.name: a.value for a in expr.arguments if isinstance(a, griffe.ExprKeyword)}
    return {}


def _attrs_decorator(cls: griffe.Class) -> object | None:
    for decorator in cls.decorators:
        value = decorator.value
        target = value.function if isinstance(value, griffe.ExprCall) else value
        path = target.canonical_path if isinstance(target, (griffe.ExprName, griffe.ExprAttribute)) else str(target)
        if path in _ATTRS_DECORATORS:
            return value
    return None


def _attrs_fields(cls: griffe.Class) -> list[griffe.Parameter]:
    """The constructor parameters of an attrs class's own fields, in order."""
    decorator = _attrs_decorator(cls)
    class_kw_only = str(_call_args(decorator).get("kw_only")) == "True"
    params = []
    for member in cls.members.values():
        if not isinstance(member, griffe.Attribute) or member.annotation is None or "property" in member.labels:
            continue
        if "class-attribute" in member.labels and "instance-attribute" not in member.labels:
            continue  # a ClassVar (griffe unwraps the annotation and labels it)
        if str(member.annotation).startswith(("ClassVar", "typing.ClassVar", "Final", "typing.Final")):
            continue
        value = member.value
        args: dict[str, Any] = {}
        if isinstance(value, griffe.ExprCall) and str(value.function).rsplit(".", 1)[-1] in _FIELD_CALLS:
            args = _call_args(value)
            default: str | griffe.Expr | None = args.get("default", args.get("factory"))
        else:
            default = value
        if str(args.get("init")) == "False":
            continue
        name = str(args["alias"]).strip("'\"") if "alias" in args else member.name.lstrip("_")
        kw_only = class_kw_only or str(args.get("kw_only")) == "True"
        kind = griffe.ParameterKind.keyword_only if kw_only else griffe.ParameterKind.positional_or_keyword
        params.append(griffe.Parameter(name, annotation=member.annotation, kind=kind, default=default))
    return params


class AttrsInit(griffe.Extension):
    """The ``__init__`` that attrs generates, for griffe's static view of an attrs class (griffe knows
    dataclasses but not attrs): the fields of the attrs classes in its MRO, base classes first, each
    keyword-only where the class or the field says so. Without it a new required field of an IR node
    would not be a breaking change."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Give every attrs class of ``pkg`` without an ``__init__`` of its own the generated one."""
        for cls in _classes(pkg):
            if _attrs_decorator(cls) is None or "__init__" in cls.members:
                continue
            try:
                mro = cls.mro()
            except ValueError:
                mro = []
            fields: dict[str, griffe.Parameter] = {}
            for base in [*reversed(mro), cls]:
                if base.is_alias or _attrs_decorator(base) is None:
                    continue
                for p in _attrs_fields(base):
                    fields.pop(p.name, None)
                    fields[p.name] = p
            ordered = sorted(fields.values(), key=lambda p: p.kind is griffe.ParameterKind.keyword_only)
            self_param = griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)
            init = griffe.Function("__init__", lineno=0, endlineno=0, parameters=griffe.Parameters(self_param, *ordered), returns="None")
            cls.set_member("__init__", init)


def _classes(obj: griffe.Module | griffe.Class) -> Iterator[griffe.Class]:
    for member in obj.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Class):
            yield member
            yield from _classes(member)
        elif isinstance(member, griffe.Module):
            yield from _classes(member)


def load_api(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, griffe.Module]:
    """The packages under ``root`` as griffe sees them statically (nothing is imported), with the
    attrs constructors and every alias that can be resolved within them resolved."""
    loader = griffe.GriffeLoader(
        search_paths=[str(root)], extensions=griffe.load_extensions(AttrsInit), allow_inspection=False, store_source=False
    )
    # by name in ``root`` only: griffe would otherwise take a directory of that name in the working
    # directory first, whatever the search paths say
    loaded = {p: loader.load(p, try_relative_path=False) for p in packages}
    loader.resolve_aliases(implicit=False, external=False)
    return {p: m for p, m in loaded.items() if isinstance(m, griffe.Module)}


_KEEP_DUNDERS = frozenset({"__init__", "__call__"})


def _text(annotation: object) -> str | None:
    return None if annotation is None else str(annotation)


def _expression(data: Any) -> Any:
    """An expression of griffe's JSON without the scopes its names were found in."""
    if isinstance(data, list):
        return [_expression(v) for v in data]
    if isinstance(data, dict):
        return {k: _expression(v) for k, v in data.items() if k != "member"}
    return data


def _strip(data: dict[str, Any]) -> dict[str, Any]:
    """An object of griffe's JSON without what does not make an API: docstrings, decorators, labels,
    attribute values, line numbers, and every ``None`` (``_decode`` puts back what griffe's decoder needs)."""
    out = {k: _expression(v) for k, v in data.items() if k not in _NOT_API and v is not None}
    if out.get("runtime") is True:
        del out["runtime"]
    if "members" in out:
        out["members"] = {name: _strip(member) for name, member in data["members"].items()}
    if "parameters" in out:
        out["parameters"] = [{k: v for k, v in p.items() if k != "docstring" and v is not None} for p in out["parameters"]]
    return out


_NOT_API = frozenset({"docstring", "decorators", "labels", "value", "lineno", "endlineno", "analysis"})


def _object_record(obj: griffe.Object | griffe.Alias, name: str) -> dict[str, Any]:
    """One public object as griffe's JSON, under the name it has where it is offered; a class with
    its public members, inherited ones included."""
    try:
        target = obj.final_target if isinstance(obj, griffe.Alias) else obj
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        # a re-export of something outside the four packages: recorded by name only
        return {"kind": "attribute", "name": name}
    if isinstance(target, (griffe.Module, griffe.TypeAlias)):
        # a re-exported module, a ``type X = ...`` alias: recorded by name (griffe compares neither further)
        return {"kind": "attribute", "name": name}
    data: dict[str, Any] = json.loads(json.dumps(target.as_dict(full=False), cls=griffe.JSONEncoder))
    data["name"] = name
    # expressions as their source text: what a reader of the recording wants to see, and what griffe
    # compares is equal as text when it is equal as an expression (both sides are recordings); griffe
    # compares no annotation (a return type only when it goes away)
    if isinstance(target, griffe.Function):
        data["returns"] = _text(target.returns)
        for param, record in zip(target.parameters, data["parameters"], strict=True):
            record["annotation"], record["default"] = _text(param.annotation), _text(param.default)
    elif isinstance(target, griffe.Attribute):
        data["annotation"] = _text(target.annotation)
    elif isinstance(target, griffe.Class):
        data["bases"] = [str(b) for b in target.bases]
    data = _strip(data)
    if isinstance(target, griffe.Class):
        data["members"] = {
            n: _object_record(m, n)
            for n, m in target.all_members.items()
            if not n.startswith("_") or n in _KEEP_DUNDERS
        }
    return data


def _module_record(module: griffe.Module, root: Path) -> dict[str, Any]:
    """A public module: its public names (``__all__``, or what griffe deems public without one) and
    its public submodules."""
    members: dict[str, Any] = {}
    for name, member in module.members.items():
        if not member.is_alias and isinstance(member, griffe.Module):
            if public_path(member.path):
                members[name] = _module_record(member, root)
        elif member.is_public and (not name.startswith("_") or name in _KEEP_DUNDERS):
            members[name] = _object_record(member, name)
    filepath = module.filepath
    assert isinstance(filepath, Path)
    exports = [str(e) for e in module.exports] if module.exports is not None else None
    record: dict[str, Any] = {"kind": "module", "name": module.name, "filepath": filepath.relative_to(root).as_posix(), "members": members}
    if exports is not None:
        record["exports"] = exports
    return record


def record_api(api: Mapping[str, griffe.Module], release: str, root: Path = ROOT) -> dict[str, Any]:
    """The recorded API of ``release``: the public modules of ``api`` (a ``load_api``) as griffe's JSON."""
    return {
        "batchc": release,
        "griffe": importlib.metadata.version("griffe"),
        "rule": "tests/public_api.py; docs/reference/public-api.md",
        "packages": {name: _module_record(module, root) for name, module in api.items()},
    }


def dumps(recorded: Mapping[str, Any]) -> str:
    """The recorded API as the committed file's text: JSON with sorted keys, a value on one line when
    it fits in 120 characters (a parameter, an annotation), so that a diff of two recordings reads."""
    return _pretty(recorded, 0) + "\n"


def _pretty(value: Any, level: int) -> str:
    compact = json.dumps(value, sort_keys=True, separators=(", ", ": "))
    if not isinstance(value, (dict, list)) or not value or len(compact) + level <= 120:
        return compact
    pad = " " * (level + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {_pretty(value[k], level + 1)}" for k in sorted(value)]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    return "[\n" + ",\n".join(f"{pad}{_pretty(v, level + 1)}" for v in value) + "\n" + " " * level + "]"


def loads(text: str) -> tuple[str, dict[str, griffe.Module]]:
    """A recorded API back as (version, griffe modules by package)."""
    data = json.loads(text)
    return data["batchc"], _decoded(data)


def _decode_expression(data: Any) -> Any:
    if isinstance(data, list):
        return [_decode_expression(v) for v in data]
    if isinstance(data, dict):
        return griffe.json_decoder({k: _decode_expression(v) for k, v in data.items()})
    return data


def _decode(data: dict[str, Any]) -> Any:
    """One object of the recording, by its structure. (``griffe.json_decoder`` as a ``json`` object
    hook guesses what a dict is from its keys, and takes the members of a class that has members
    named ``cls`` or ``kind`` for an expression or an object.)"""
    out = {k: _decode_expression(v) for k, v in data.items() if k not in ("members", "parameters", "type_parameters")}
    out.setdefault("lineno", 0)
    if out["kind"] == "function":
        out.setdefault("returns", None)
    if "members" in data:
        out["members"] = {name: _decode(member) for name, member in data["members"].items()}
    for key in ("parameters", "type_parameters"):
        if key in data:
            out[key] = [
                griffe.json_decoder({"annotation": None, "default": None, **{k: _decode_expression(v) for k, v in p.items()}})
                for p in data[key]
            ]
    return griffe.json_decoder(out)


def recorded_modules(api: Mapping[str, griffe.Module]) -> list[str]:
    """The dotted paths of the modules in a (recorded or loaded) API, sorted."""
    out: list[str] = []

    def walk(module: griffe.Module) -> None:
        out.append(module.path)
        for member in module.members.values():
            if not member.is_alias and isinstance(member, griffe.Module):
                walk(member)

    for module in api.values():
        walk(module)
    return sorted(out)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def current_api(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, griffe.Module]:
    """The public API of the tree at ``root`` in the form of a recording (as ``loads`` returns one):
    what ``breaking_changes`` compares a recording with. Both sides alike matters: griffe follows a
    re-export or an inherited member (an alias) to its target, and then skips it as already seen
    when the other side holds it as a plain object, so a recording (which holds them as the objects
    they are) is compared with a recording."""
    return _decoded(record_api(load_api(root, packages), "current", root))


def _decoded(recorded: Mapping[str, Any]) -> dict[str, griffe.Module]:
    return {name: _decode(module) for name, module in recorded["packages"].items()}


def breaking_changes(old: Mapping[str, griffe.Module], new: Mapping[str, griffe.Module]) -> list[str]:
    """What breaks code written against ``old`` when it runs against ``new`` (both recordings:
    ``loads`` or ``current_api``), one line each, griffe's explanation. ``find_breaking_changes`` runs
    on each package and goes down into every module the recording holds, so each public module is
    compared: a public name, module, method or property gone, a parameter gone or renamed, moved,
    made required or given another default, a required parameter added (an attrs class's fields
    are its constructor's parameters)."""
    found: list[str] = []
    for name, old_module in old.items():
        new_module = new.get(name)
        if new_module is None:
            found.append(f"{name}: the package is gone")
            continue
        for breakage in griffe.find_breaking_changes(old_module, new_module):
            line = _ANSI.sub("", breakage.explain(style=griffe.ExplanationStyle.ONE_LINE))
            if line not in found:
                found.append(line)
    return found


def record(root: Path = ROOT, packages: Iterable[str] = PACKAGES, *, api_dir: Path = API_DIR, force: bool = False) -> tuple[bool, str]:
    """Record the public API of the tree at ``root`` as that of its version (``batchc-<version>.json``
    in ``api_dir``): (done, what happened). An existing recording of the version is overwritten only
    when the tree does not break it, or with ``force`` (a version not released yet)."""
    release = version(root)
    recorded = record_api(load_api(root, packages), release, root)
    path = snapshot_path(release, api_dir)
    if path.exists() and not force:
        _, old = loads(path.read_text())
        broken = breaking_changes(old, _decoded(recorded))
        if broken:
            lines = [f"{path.name} records {release}, and the tree breaks it:", *(f"  {b}" for b in broken)]
            lines.append(
                "bump the version in pyproject.toml (a break needs a new minor version below 1.0, a new major one after), "
                "or pass --force if this version is not released yet"
            )
            return False, "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(recorded))
    return True, f"recorded the public API of batchc {release}: {path} ({len(recorded_modules(_decoded(recorded)))} modules)"


def history_breaks(api_dir: Path = API_DIR) -> list[str]:
    """The breaking changes between consecutive recorded versions where the version step does not
    allow one (``may_break``), each as ``"OLD -> NEW: explanation"``."""
    versions = recorded_versions(api_dir)
    found: list[str] = []
    for old, new in itertools.pairwise(versions):
        if may_break(old, new):
            continue
        _, old_api = loads(snapshot_path(old, api_dir).read_text())
        _, new_api = loads(snapshot_path(new, api_dir).read_text())
        found.extend(f"{old} -> {new}: {line}" for line in breaking_changes(old_api, new_api))
    return found


def _record_command(args: argparse.Namespace) -> int:
    done, message = record(force=args.force)
    print(message, file=sys.stdout if done else sys.stderr)
    return 0 if done else 1


def _report_command(args: argparse.Namespace) -> int:
    failed = 0
    for package in args.packages or PACKAGES:
        report = check_docstrings(package)
        print(report.summary())
        for line in report.problems:
            print(f"  {line}")
        failed += len(report.problems)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.public_api report [PACKAGE ...]`` or ``record [--force]``."""
    parser = argparse.ArgumentParser(prog="python -m tests.public_api", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="the docstring check's counts and problems, per package")
    report.add_argument("packages", nargs="*", metavar="PACKAGE", help=f"of {', '.join(PACKAGES)} (default: all)")
    record = commands.add_parser("record", help="record the public API of the version in pyproject.toml")
    record.add_argument("--force", action="store_true", help="overwrite a recorded version even with breaking changes")
    args = parser.parse_args(argv)
    if args.command == "report" and not set(args.packages) <= set(PACKAGES):
        parser.error(f"a package is one of {', '.join(PACKAGES)}")
    return _record_command(args) if args.command == "record" else _report_command(args)


if __name__ == "__main__":
    sys.exit(main())
