"""Dependencies point down: ``ir`` imports nothing of ours, ``passes`` only ``ir``, ``backend`` never
``passes`` or ``compiler``; product code never imports the mutable baseline or the tools (``compiler/tools/``
and ``backend/tools/``: the runtime of ``backend`` never imports training or the kernel benchmark), and
compiling a step does not import the backend. Every import statement counts, including the ones
inside functions; the command line, which may use the tools, imports them only inside the functions
that need them, so starting it loads none of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("ir", "passes", "backend", "compiler")


def _modules() -> list[Path]:
    return sorted(p for pkg in OURS for p in (ROOT / pkg).rglob("*.py"))


def _imported(nodes: list[ast.AST]) -> set[str]:
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            # ``from backend import tools`` imports ``backend.tools``: the names may be submodules
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in OURS}


def _imports(path: Path) -> set[str]:
    return _imported(list(ast.walk(ast.parse(path.read_text(), str(path)))))


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
    return _imported(nodes)


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


# development tools and the mutable baseline: used only by the command line, each other and tests
QUARANTINED = ("compiler.baselines", "compiler.tools", "backend.tools")


def _allowed(module: str, imported: str) -> bool:
    top, target = module.split(".")[0], imported.split(".")[0]
    if imported.startswith(QUARANTINED) and not module.startswith((*QUARANTINED, "compiler.cli")):
        return False
    if top == "ir":
        return target == "ir"
    if top == "passes":
        return target in ("ir", "passes")
    if top == "backend":
        return target in ("ir", "backend")
    if module == "compiler.steps":
        return target != "backend"
    return True


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_imports_point_down(path: Path) -> None:
    module = _name(path)
    bad = sorted(m for m in _imports(path) if not _allowed(module, m))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("path", sorted((ROOT / "compiler" / "cli").glob("*.py")), ids=_name)
def test_the_command_line_imports_the_tools_only_when_a_command_runs(path: Path) -> None:
    eager = sorted(m for m in _module_level_imports(path) if m.startswith(QUARANTINED))
    assert not eager, f"{_name(path)} imports {eager} at module level"


def test_the_rules_catch_a_wrong_import() -> None:
    assert not _allowed("ir.batch", "passes.lower")
    assert not _allowed("passes.lower", "backend.ledger")
    assert not _allowed("backend.executor", "compiler.steps")
    assert not _allowed("compiler.serve", "compiler.baselines.spec")
    assert not _allowed("compiler.engine.engine", "compiler.tools.ab")
    assert not _allowed("compiler.steps", "backend.ledger")
    assert _allowed("compiler.cli.tools", "compiler.tools.ab") and _allowed("compiler.tools.ab", "compiler.baselines.spec")
    assert not _allowed("backend.executor", "backend.tools.bench_kernels")
    assert not _allowed("backend.hybrid.presets", "backend.tools.train")
    assert not _allowed("compiler.serve", "backend.tools.train")
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
