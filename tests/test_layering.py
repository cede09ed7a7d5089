"""Dependencies point down: ``ir`` imports nothing of ours, ``passes`` only ``ir``, ``backend`` never
``passes`` or ``compiler``; product code never imports the mutable baseline or the tools (``compiler/tools/``
and ``backend/tools/``: the runtime of ``backend`` never imports training or the kernel benchmark), and
compiling a step does not import the backend. Every import statement counts, including the ones
inside functions; the command line, which may use the tools, imports them only inside the functions
that need them, so starting it loads none of them.

No two modules import each other, directly or round a longer loop, counting every import statement
(inside functions and ``if TYPE_CHECKING:`` blocks too): a cycle hidden in a function is still one
design knot. An edge goes to the module an import names (``from a import b`` names ``a.b`` when that
is a module, else ``a``); the parent packages an import runs on the way are not edges, or every
package whose ``__init__`` re-exports its submodules would be a cycle.

A rule is one line of ``RULES``: (importer prefix, forbidden prefix, why)."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("ir", "passes", "backend", "compiler")

# development tools and the mutable baseline: used only by the command line, each other and tests
QUARANTINED = ("compiler.baselines", "compiler.tools", "backend.tools")


class Rule(NamedTuple):
    importer: str
    """Modules at or under this dotted prefix (``""``: every module) ..."""
    forbidden: str
    """... import nothing at or under this one ..."""
    why: str
    unless: tuple[str, ...] = ()
    """... except importers at or under one of these."""


_TOOLS_WHY = "quarantined: only the command line (inside its functions), the tools and tests use it"
RULES: tuple[Rule, ...] = (
    Rule("ir", "passes", "the IR is the bottom layer: it imports nothing of ours but itself"),
    Rule("ir", "backend", "the IR is the bottom layer: it imports nothing of ours but itself"),
    Rule("ir", "compiler", "the IR is the bottom layer: it imports nothing of ours but itself"),
    Rule("passes", "backend", "passes are pure functions between IR types: they import only ir"),
    Rule("passes", "compiler", "passes are pure functions between IR types: they import only ir"),
    Rule("backend", "passes", "the backend runs plans, whoever compiled them"),
    Rule("backend", "compiler", "the backend serves whatever engine drives it; it never reaches up into it"),
    Rule("compiler.steps", "backend", "compiling a step neither needs nor loads the backend"),
    *(Rule("compiler.engine", t, "the engine talks to its backends through backend.boundary only and cannot tell how they run; "
           "whoever builds it picks the transport") for t in ("backend.local", "backend.remote", "backend.tp", "backend.executor")),
    *(Rule("", q, _TOOLS_WHY, unless=(*QUARANTINED, "compiler.cli")) for q in QUARANTINED),
)


def _modules(root: Path = ROOT) -> list[Path]:
    return sorted(p for pkg in OURS for p in (root / pkg).rglob("*.py"))


def _under(module: str, prefix: str) -> bool:
    return prefix == "" or module == prefix or module.startswith(prefix + ".")


def _broken(module: str, imported: str) -> list[Rule]:
    """The rules that ``module`` importing ``imported`` breaks."""
    return [
        r for r in RULES
        if _under(module, r.importer) and _under(imported, r.forbidden) and not any(_under(module, u) for u in r.unless)
    ]


def _allowed(module: str, imported: str) -> bool:
    return not _broken(module, imported)


def _imported(nodes: list[ast.AST], package: str = "", *, from_packages: bool = True) -> set[str]:
    """The modules of ours that the import statements among ``nodes`` name; ``package`` (the
    importing module's package) resolves relative imports. ``from_packages``: ``from a import b``
    names ``a`` as well as ``a.b`` (the rules want both; the cycle graph only ``a.b``, which it
    resolves to ``a`` when ``b`` is no module)."""
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                assert node.module is not None  # ``from import x`` does not parse
                base = node.module
            # ``from backend import tools`` imports ``backend.tools``: the names may be submodules
            if from_packages:
                found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in OURS}


def _package(path: Path, root: Path = ROOT) -> str:
    """The package a module's relative imports start from (a package's ``__init__`` is its own)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1])


def _imports(path: Path, root: Path = ROOT, *, from_packages: bool = True) -> set[str]:
    package = _package(path, root) if path.is_relative_to(root) else ""
    return _imported(list(ast.walk(ast.parse(path.read_text(), str(path)))), package, from_packages=from_packages)


def _module_level_imports(path: Path) -> set[str]:
    """The imports that run when the module is imported: everything outside function bodies and
    ``if TYPE_CHECKING:`` blocks (read by mypy only)."""
    nodes: list[ast.AST] = []
    todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        nodes.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return _imported(nodes, _package(path) if path.is_relative_to(ROOT) else "")


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _module(path: Path, root: Path) -> str:
    """The dotted name ``import`` uses (a package is its ``__init__``)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere (each import resolved to the longest
    prefix of its name that is one of the modules; a module importing itself is no edge)."""
    files = {_module(p, root): p for p in _modules(root)}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = {resolve(m) for m in _imports(path, root, from_packages=False)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through the first module (in name order) of every strongly connected
    component of more than one module, as ``[a, b, ..., a]``: no cycles, no components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: set[str] = set()
            while not component or v not in component:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles: list[list[str]] = []
    for component in components:
        start = min(component)
        came_from: dict[str, str] = {}
        todo = deque([start])
        while start not in came_from:  # breadth first inside the component, back to ``start``
            v = todo.popleft()
            for w in sorted(graph[v] & component):
                if w not in came_from:
                    came_from[w] = v
                    todo.append(w)
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(came_from[path[-1]])
        cycles.append(path[::-1])
    return sorted(cycles)


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_imports_point_down(path: Path) -> None:
    module = _name(path)
    bad = [f"{m} ({r.why})" for m in sorted(_imports(path)) for r in _broken(module, m)]
    assert not bad, f"{module} imports {bad}"


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_names_each_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"f"}, "f": {"e", "d"}, "g": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_an_import_inside_a_function_closes_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "backend"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from backend.sub import leaf\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("X = 1\n")
    (pkg / "model.py").write_text("from backend import hook\n")
    (pkg / "hook.py").write_text("def f() -> None:\n    from . import model\n")
    assert _cycles(_graph(tmp_path)) == [["backend.hook", "backend.model", "backend.hook"]]
    (pkg / "hook.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import backend.model.x\n")
    assert _cycles(_graph(tmp_path)) == [["backend.hook", "backend.model", "backend.hook"]]
    (pkg / "hook.py").write_text("import backend.sub.leaf\n")
    assert _cycles(_graph(tmp_path)) == []


@pytest.mark.parametrize("path", sorted((ROOT / "compiler" / "cli").glob("*.py")), ids=_name)
def test_the_command_line_imports_the_tools_only_when_a_command_runs(path: Path) -> None:
    eager = sorted(m for m in _module_level_imports(path) if m.startswith(QUARANTINED))
    assert not eager, f"{_name(path)} imports {eager} at module level"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.importer or '*'}-{r.forbidden}")
def test_each_rule_refuses_an_import(rule: Rule) -> None:
    importer = f"{rule.importer}.m" if rule.importer else "compiler.offline.m"
    assert rule in _broken(importer, f"{rule.forbidden}.m")
    assert rule in _broken(importer, rule.forbidden)
    # a prefix matches whole names only: ``backend`` is not ``backendx``
    assert rule not in _broken(importer, f"{rule.forbidden}x")
    for exempt in rule.unless:
        assert rule not in _broken(f"{exempt}.m", f"{rule.forbidden}.m")


def test_the_rules_catch_a_wrong_import() -> None:
    assert not _allowed("ir.batch", "passes.lower")
    assert not _allowed("passes.lower", "backend.ledger")
    assert not _allowed("backend.executor", "compiler.steps")
    assert not _allowed("compiler.offline", "compiler.baselines.spec")
    assert not _allowed("compiler.engine.engine", "compiler.tools.ab")
    assert not _allowed("compiler.steps", "backend.ledger")
    assert _allowed("compiler.cli.tools", "compiler.tools.ab") and _allowed("compiler.tools.ab", "compiler.baselines.spec")
    assert not _allowed("backend.executor", "backend.tools.bench_kernels")
    assert not _allowed("backend.hybrid.presets", "backend.tools.train")
    assert not _allowed("compiler.offline", "backend.tools.train")
    assert _allowed("compiler.cli", "backend.tools.bench_kernels") and _allowed("backend.tools.train", "backend.hybrid.checkpoint")


def test_module_level_imports_skip_function_bodies(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("import ir.ids\n\nclass C:\n    from passes import lower\n\n    def f(self) -> None:\n        from backend import tools\n")
    assert _module_level_imports(path) == {"ir.ids", "passes", "passes.lower"}
    assert _imports(path) == {"ir.ids", "passes", "passes.lower", "backend", "backend.tools"}
    assert not _allowed("backend.pool", "backend.tools")


def test_module_level_imports_skip_type_checking_blocks_only(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from compiler.tools import ab\nelse:\n    import ir.ids\n"
        "if True:\n    import passes.lower\n"
    )
    assert _module_level_imports(path) == {"ir.ids", "passes.lower"}


def test_only_mypy_loads_the_linear_use_plugin() -> None:
    """``ir.mypy_linear`` imports mypy (a test extra): no library module may import it, and it is the
    only one that imports mypy, so the library runs without mypy installed."""
    for path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if _name(path) != "ir.mypy_linear":
            assert "ir.mypy_linear" not in names and not any(m.split(".")[0] == "mypy" for m in names), _name(path)
    assert _imports(ROOT / "ir" / "mypy_linear.py") == set()  # mypy only: none of our packages
