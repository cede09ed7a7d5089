"""The declared public API (docs/reference/public-api.md; the rule and the checks: ``tests.public_api``).

- The rule: which modules are public, stated once in code and once on the docs page, the two equal.
- The docstring check, per package: every public module imports, has a docstring and an ``__all__``
  naming only what exists, and every class and function in ``__all__`` (and every public method,
  property and nested class of such a class) has a docstring. The counts are printed
  (``pytest -rP``), and ``python -m tests.public_api report`` prints them with the problems.
- The API-break check: the tree, loaded statically by griffe, breaks nothing of the recorded API of
  the version in pyproject.toml (``tests/api/batchc-<version>.json``); a recording exists for that
  version; consecutive recordings break only where the version step allows it. Temporary packages
  show that what the check must catch, it catches: a removed function, a renamed parameter, a new
  required parameter or attrs field, a removed method or module, a change behind a re-export.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs
import griffe
import pytest

from tests import public_api as api
from tests.test_layering import QUARANTINED

# -- the rule -----------------------------------------------------------------------------------------


def test_the_rule_names_public_and_internal_modules() -> None:
    for module in ("ir", "ir.batch", "passes", "passes.lower", "backend.ledger", "backend.kernels", "backend.kernels.ssm",
                   "compiler.engine", "compiler.engine.api", "compiler.steps", "compiler.testing"):
        assert api.is_public(module), module
    for module in ("passes._args", "backend._private.thing", "compiler.baselines", "compiler.baselines.mutable", "compiler.tools.ab",
                   "backend.tools", "backend.tools.train", "backend.kernels.jit", "backend.kernels.jit.ssm", "compiler.cli",
                   "compiler.cli.run", "compiler.launch", "ir.mypy_linear", "compiler.cli.__main__", "tests.helpers", "torch"):
        assert not api.is_public(module), module
    # a prefix is a dotted path, not a string prefix
    assert api.is_public("compiler.toolsmith") and api.is_public("backend.kernels.jitter")


def test_every_quarantined_package_is_internal_and_every_exception_exists() -> None:
    assert set(QUARANTINED) <= set(api.NOT_PUBLIC)
    every = {m for p in api.PACKAGES for m in api.modules(p)}
    assert sorted(p for p in api.NOT_PUBLIC if p not in every) == []


def _docs_exceptions(text: str) -> set[str]:
    """The dotted paths that the items of the page's list of exceptions name before their colon."""
    section = text.split("## Which modules are public", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("- "):
            head = line.split(":", 1)[0]
            names.update(n for n in re.findall(r"`([a-z_.]+)`", head) if n.split(".")[0] in api.PACKAGES)
    return names


def test_the_docs_page_states_the_rule_of_the_code() -> None:
    text = api.DOCS_PAGE.read_text()
    assert _docs_exceptions(text) == set(api.NOT_PUBLIC)
    assert "python -m tests.public_api record" in text and "python -m tests.public_api report" in text


def test_the_docs_page_is_in_the_nav_and_the_reference_index() -> None:
    root = api.ROOT
    assert "reference/public-api.md" in (root / "mkdocs.yml").read_text()
    assert "(public-api.md)" in (root / "docs" / "reference" / "index.md").read_text()


def test_the_changelog_links_the_rule_and_says_how_to_record() -> None:
    text = (api.ROOT / "CHANGELOG.md").read_text()
    assert "docs/reference/public-api.md" in text and "python -m tests.public_api record" in text
    assert f"## [{api.version()}]" in text or f"## {api.version()}" in text


# -- the docstring check ------------------------------------------------------------------------------


@pytest.mark.parametrize("package", api.PACKAGES)
def test_public_modules_have_all_and_docstrings(package: str) -> None:
    report = api.check_docstrings(package)
    print(report.summary())
    assert report.modules == len(api.public_modules(package))
    assert not report.problems, "\n".join([report.summary(), *report.problems])


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on ``sys.path`` for throwaway packages (each test names its own, and the modules
    it imported are dropped afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    ours = {p.name.removesuffix(".py") for p in tmp_path.iterdir()}
    for name in [n for n in sys.modules if n.split(".")[0] in ours]:
        del sys.modules[name]


def test_the_docstring_check_names_every_problem(scratch: Path) -> None:
    _write(scratch, {
        "dsk/__init__.py": '"""A package."""\n__all__ = ["helper", "gone"]\nfrom dsk._impl import helper\n',
        "dsk/_impl.py": "def helper():\n    pass\n\nclass _Base:\n    def shared(self):\n        pass\n",
        "dsk/nodoc.py": '__all__ = []\n',
        "dsk/noall.py": '"""No __all__."""\ndef f():\n    """f"""\n',
        "dsk/mod.py": '''\
            """A module."""
            import functools
            from dsk._impl import _Base
            __all__ = ["Good", "Bad", "undocumented", "CONSTANT", "Good"]
            CONSTANT = 3
            class Good(_Base):
                """Documented."""
                def method(self):
                    """Documented."""
                @property
                def prop(self):
                    """Documented."""
                def _private(self):
                    pass
            class Bad:
                def method(self):
                    pass
                @property
                def prop(self):
                    pass
                @staticmethod
                def static():
                    pass
                @functools.cached_property
                def cached(self):
                    pass
            class Override(Good):
                """Documented."""
                def method(self):
                    pass
            def undocumented():
                pass
        ''',
        "dsk/sub/__init__.py": '"""Sub."""\n__all__ = ["Override"]\nfrom dsk.mod import Override\n',
    })
    report = api.check_docstrings("dsk", scratch)
    assert sorted(report.problems) == sorted([
        "dsk.helper: no docstring",  # defined in a private module: named where it is offered
        "dsk.gone: in __all__ but the module has no such name",
        "dsk.nodoc: the module has no docstring",
        "dsk.noall: the module has no __all__",
        "dsk.mod.Good: listed twice in __all__",
        "dsk.mod.Good.shared: no docstring",  # inherited from an internal base: offered all the same
        "dsk.mod.Bad: no docstring",
        "dsk.mod.Bad.method: no docstring",
        "dsk.mod.Bad.prop: no docstring",
        "dsk.mod.Bad.static: no docstring",
        "dsk.mod.Bad.cached: no docstring",
        "dsk.mod.undocumented: no docstring",
        # Override.method overrides a documented method: documented by it
    ])
    # dsk, dsk.mod, dsk.nodoc, dsk.noall, dsk.sub (dsk._impl is private); helper, Good, Bad,
    # undocumented, Override (CONSTANT is no class or function); method, prop (Good), shared
    # (_Base), method, prop, static, cached (Bad), method (Override)
    assert (report.modules, report.symbols, report.members) == (5, 5, 8)


def test_a_docstring_that_only_the_source_still_has_counts(scratch: Path) -> None:
    """typeguard (on in the suite) drops the docstring of a function whose body is only a docstring."""
    _write(scratch, {"dsk3.py": 'class C:\n    def noop(self):\n        """Does nothing."""\n    def bare(self):\n        pass\n'})
    cls = importlib.import_module("dsk3").C
    cls.noop.__doc__ = None
    assert api._has_doc(cls.noop) and not api._has_doc(cls.bare)


def test_a_module_that_does_not_import_is_a_problem_not_a_crash(scratch: Path) -> None:
    _write(scratch, {"dsk2/__init__.py": '"""A package."""\n__all__ = []\n', "dsk2/broken.py": "import no_such_module_anywhere\n"})
    report = api.check_docstrings("dsk2", scratch)
    assert len(report.problems) == 1 and report.problems[0].startswith("dsk2.broken: cannot be imported: ")


# -- the attrs constructors griffe is given -------------------------------------------------------------


@functools.cache
def _loaded() -> dict[str, griffe.Module]:
    return api.load_api()


def _griffe_object(module: str, name: str) -> griffe.Object | griffe.Alias | None:
    obj: griffe.Object | griffe.Alias = _loaded()[module.split(".")[0]]
    for part in [*module.split(".")[1:], name]:
        if part not in obj.members:
            return None
        obj = obj.members[part]
    return obj


_KINDS = {griffe.ParameterKind.keyword_only: inspect.Parameter.KEYWORD_ONLY,
          griffe.ParameterKind.positional_or_keyword: inspect.Parameter.POSITIONAL_OR_KEYWORD}


@pytest.mark.parametrize("package", api.PACKAGES)
def test_the_static_attrs_constructors_are_the_ones_attrs_makes(package: str) -> None:
    """``AttrsInit`` gives griffe each attrs class's ``__init__``: its parameters (names, kinds, which
    have defaults) must be those of the class attrs made, or the break check would compare fiction."""
    checked, wrong = 0, []
    for module_name in api.public_modules(package):
        module = importlib.import_module(module_name)
        for name, cls in vars(module).items():
            if not (inspect.isclass(cls) and attrs.has(cls) and cls.__module__ == module_name and cls.__name__ == name):
                continue
            real = [(p.name, p.kind, p.default is inspect.Parameter.empty)
                    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]]
            obj = _griffe_object(module_name, name)
            init = obj.members.get("__init__") if obj is not None else None
            static = None if not isinstance(init, griffe.Function) else [
                (p.name, _KINDS.get(p.kind), p.required) for p in list(init.parameters)[1:]
            ]
            checked += 1
            if static != real:
                wrong.append(f"{module_name}.{name}: attrs {real}, static {static}")
    assert not wrong, "\n".join(wrong)
    assert checked > 0


# -- the API-break check ---------------------------------------------------------------------------------


@functools.cache
def _current() -> dict[str, griffe.Module]:
    """The tree's API as a recording, for the tests that only read it."""
    return api.current_api()


def test_the_tree_breaks_nothing_of_the_recorded_api_of_its_version() -> None:
    release = api.version()
    path = api.snapshot_path(release)
    assert path.exists(), (
        f"no recorded API for version {release} ({path.relative_to(api.ROOT)}): a new version records its API, "
        "with `python -m tests.public_api record` (docs/reference/public-api.md)"
    )
    recorded_version, recorded = api.loads(path.read_text())
    assert recorded_version == release
    broken = api.breaking_changes(recorded, _current())
    assert not broken, (
        f"the tree breaks the public API of batchc {release} (tests/api/batchc-{release}.json):\n"
        + "\n".join(f"  {line}" for line in broken)
        + "\nKeep the old name or signature working, or make the break deliberate: bump the version in pyproject.toml "
        "(a new minor version below 1.0), say so in CHANGELOG.md, and record the new API: python -m tests.public_api record"
    )


def test_the_recording_of_the_tree_holds_every_public_module() -> None:
    """Every public module by the rule is in what the tree would record (griffe does not lose one,
    e.g. a submodule behind a package attribute of the same name, like ``passes.lower``)."""
    every = {m for p in api.PACKAGES for m in api.public_modules(p)}
    assert set(api.recorded_modules(_current())) == every


def test_the_recordings_hold_only_public_modules() -> None:
    for release in api.recorded_versions():
        _, recorded = api.loads(api.snapshot_path(release).read_text())
        modules = api.recorded_modules(recorded)
        assert modules and all(api.is_public(m) for m in modules), [m for m in modules if not api.is_public(m)]


def test_recorded_versions_break_only_where_the_version_allows() -> None:
    assert api.history_breaks() == []


def test_a_version_step_allows_a_break_below_one_only_at_a_new_minor() -> None:
    assert api.may_break("0.1.0", "0.2.0") and api.may_break("0.1.3", "1.0.0") and api.may_break("1.4.2", "2.0.0")
    assert not api.may_break("0.1.0", "0.1.1") and not api.may_break("1.0.0", "1.1.0") and not api.may_break("0.2.0", "0.1.0")
    with pytest.raises(ValueError, match="not a release version"):
        api.version_key("0.2.0rc1")


_PKG = {
    "pyproject.toml": '[project]\nname = "apk"\nversion = "0.1.0"\n',
    "apk/__init__.py": '"""A package."""\nfrom apk._impl import helper\n__all__ = ["helper"]\n',
    "apk/_impl.py": 'def helper(x: int) -> int:\n    """Re-exported."""\n    return x\n\ndef _private(a: int) -> None:\n    pass\n',
    "apk/extra.py": '"""A public module."""\n__all__ = ["thing"]\ndef thing() -> None:\n    """A thing."""\n',
    "apk/mod.py": '''\
        """A module."""
        import attrs
        __all__ = ["f", "g", "C", "Node"]
        def f(a: int, b: int = 1) -> int:
            """f."""
            return a
        def g(x: int) -> None:
            """g."""
        def internal(y: int) -> None:
            """Not in __all__."""
        class Base:
            """A base."""
            def inherited(self, q: int) -> None:
                """Inherited."""
        class C(Base):
            """C."""
            def m(self, y: int) -> None:
                """m."""
            @property
            def p(self) -> int:
                """p."""
                return 1
        @attrs.frozen(kw_only=True)
        class Node:
            """An attrs class."""
            a: int
            b: int = 0
    ''',
}


@pytest.fixture
def recorded_pkg(tmp_path: Path) -> tuple[Path, dict[str, griffe.Module]]:
    """A small package under ``tmp_path``, and its recorded API (through the JSON text, as committed)."""
    _write(tmp_path, _PKG)
    done, _ = api.record(tmp_path, ("apk",), api_dir=tmp_path / "api")
    assert done
    release, recorded = api.loads(api.snapshot_path("0.1.0", tmp_path / "api").read_text())
    assert release == "0.1.0"
    return tmp_path, recorded


def _edit(root: Path, name: str, old: str, new: str) -> None:
    path = root / name
    text = path.read_text()
    assert old in text, (name, old)
    path.write_text(text.replace(old, new))


BREAKS = {
    "a removed public function": ("apk/mod.py", 'def g(x: int) -> None:\n    """g."""\n', "", ["g: Public object was removed"]),
    "a renamed parameter": ("apk/mod.py", "b: int = 1) -> int", "c: int = 1) -> int", ["f(b): Parameter was removed"]),
    "a new required parameter": ("apk/mod.py", "def f(a: int, b: int = 1)", "def f(a: int, b: int = 1, *, z: int)",
                                 ["f(z): Parameter was added as required"]),
    "a default removed": ("apk/mod.py", "b: int = 1)", "b: int)", ["f(b): Parameter is now required"]),
    "a new required attrs field": ("apk/mod.py", "    b: int = 0\n", "    b: int = 0\n    c: str\n",
                                   ["Node.__init__(c): Parameter was added as required"]),
    "a renamed attrs field": ("apk/mod.py", "    b: int = 0\n", "    bb: int = 0\n", ["Node.__init__(b): Parameter was removed", "Node.b: Public object was removed"]),
    "a removed method": ("apk/mod.py", '    def m(self, y: int) -> None:\n        """m."""\n', "", ["C.m: Public object was removed"]),
    "a removed property": ("apk/mod.py", '    @property\n    def p(self) -> int:\n        """p."""\n        return 1\n', "",
                           ["C.p: Public object was removed"]),
    "a changed inherited method": ("apk/mod.py", "def inherited(self, q: int)", "def inherited(self, r: int)", ["C.inherited(q): Parameter was removed"]),
    "a name dropped from __all__": ("apk/mod.py", '__all__ = ["f", "g", "C", "Node"]', '__all__ = ["f", "C", "Node"]', ["g: Public object was removed"]),
    "a changed re-export": ("apk/_impl.py", "def helper(x: int)", "def helper(value: int)", ["helper(x): Parameter was removed"]),
    "a removed module": ("apk/extra.py", None, None, ["apk/extra.py:0: <module>: Public object was removed"]),
}


@pytest.mark.parametrize("change", list(BREAKS))
def test_the_break_check_catches(change: str, recorded_pkg: tuple[Path, dict[str, griffe.Module]]) -> None:
    root, recorded = recorded_pkg
    name, old, new, expected = BREAKS[change]
    if old is None or new is None:
        (root / name).unlink()
    else:
        _edit(root, name, old, new)
    broken = api.breaking_changes(recorded, api.current_api(root, ("apk",)))
    for what in expected:
        assert any(what in line for line in broken), (what, broken)


NOT_BREAKS = {
    "a new optional parameter": ("apk/mod.py", "def f(a: int, b: int = 1)", "def f(a: int, b: int = 1, c: int = 2)"),
    "a new function": ("apk/mod.py", '__all__ = ["f", "g", "C", "Node"]', '__all__ = ["f", "g", "C", "Node", "h"]\ndef h() -> None:\n    """h."""\n'),
    "a changed docstring": ("apk/mod.py", '"""f."""', '"""f, documented better."""'),
    "a changed internal function": ("apk/mod.py", "def internal(y: int)", "def internal(z: int, w: int)"),
    "a changed private helper": ("apk/_impl.py", "def _private(a: int)", "def _private(b: str, c: str)"),
    "a new optional attrs field": ("apk/mod.py", "    b: int = 0\n", "    b: int = 0\n    c: str = 'x'\n"),
}


@pytest.mark.parametrize("change", list(NOT_BREAKS))
def test_the_break_check_lets_pass(change: str, recorded_pkg: tuple[Path, dict[str, griffe.Module]]) -> None:
    root, recorded = recorded_pkg
    _edit(root, *NOT_BREAKS[change])
    assert api.breaking_changes(recorded, api.current_api(root, ("apk",))) == []


def test_a_removed_member_of_the_real_recording_is_reported() -> None:
    """The committed recording itself, compared with the tree less one public function."""
    _, recorded = api.loads(api.snapshot_path(api.version()).read_text())
    current = api.current_api()
    current["passes"].members["accept"].del_member("accept")
    assert any("accept: Public object was removed" in line for line in api.breaking_changes(recorded, current))


def test_recording_refuses_to_overwrite_a_version_the_tree_breaks(recorded_pkg: tuple[Path, dict[str, griffe.Module]]) -> None:
    root, _ = recorded_pkg
    _edit(root, "apk/mod.py", 'def g(x: int) -> None:\n    """g."""\n', "")
    done, message = api.record(root, ("apk",), api_dir=root / "api")
    assert not done and "g: Public object was removed" in message and "bump the version" in message
    done, _ = api.record(root, ("apk",), api_dir=root / "api", force=True)
    assert done
    _, rerecorded = api.loads(api.snapshot_path("0.1.0", root / "api").read_text())
    assert "g" not in rerecorded["apk"].members["mod"].members


def test_the_history_check_refuses_a_break_at_a_patch_version(recorded_pkg: tuple[Path, dict[str, griffe.Module]]) -> None:
    root, _ = recorded_pkg
    api_dir = root / "api"
    _edit(root, "apk/mod.py", 'def g(x: int) -> None:\n    """g."""\n', "")
    for release, step_breaks in (("0.1.1", True), ("0.2.0", False)):
        _edit(root, "pyproject.toml", f'version = "{api.version(root)}"', f'version = "{release}"')
        assert api.record(root, ("apk",), api_dir=api_dir)[0]
        breaks = api.history_breaks(api_dir)
        assert bool(breaks) is step_breaks and all(b.startswith("0.1.0 -> 0.1.1: ") for b in breaks), breaks
        api.snapshot_path(release, api_dir).unlink()
