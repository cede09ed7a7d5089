"""Dependencies point down: ``ir`` imports nothing of ours, ``passes`` only ``ir``, ``backend`` never
``passes`` or ``compiler``; product code never imports the mutable baseline or the tools, and
compiling a step does not import the backend. Every import statement counts, including the ones
inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("ir", "passes", "backend", "compiler")


def _modules() -> list[Path]:
    return sorted(p for pkg in OURS for p in (ROOT / pkg).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
    return {m for m in found if m.split(".")[0] in OURS}


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _allowed(module: str, imported: str) -> bool:
    top, target = module.split(".")[0], imported.split(".")[0]
    if top == "ir":
        return target == "ir"
    if top == "passes":
        return target in ("ir", "passes")
    if top == "backend":
        return target in ("ir", "backend")
    # compiler: the baselines and tools are used only by the command line, each other and tests
    quarantined = ("compiler.baselines", "compiler.tools")
    if imported.startswith(quarantined):
        return module.startswith((*quarantined, "compiler.cli"))
    if module == "compiler.steps":
        return target != "backend"
    return True


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_imports_point_down(path: Path) -> None:
    module = _name(path)
    bad = sorted(m for m in _imports(path) if not _allowed(module, m))
    assert not bad, f"{module} imports {bad}"


def test_the_rules_catch_a_wrong_import() -> None:
    assert not _allowed("ir.batch", "passes.lower")
    assert not _allowed("passes.lower", "backend.ledger")
    assert not _allowed("backend.executor", "compiler.steps")
    assert not _allowed("compiler.serve", "compiler.baselines.spec")
    assert not _allowed("compiler.engine.engine", "compiler.tools.ab")
    assert not _allowed("compiler.steps", "backend.ledger")
    assert _allowed("compiler.cli", "compiler.tools.ab") and _allowed("compiler.tools.ab", "compiler.baselines.spec")
