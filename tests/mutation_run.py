"""A mutation run: deliberate bugs in the code that keeps the exactly-once promise, and whether the
fast tests kill each one.

    python -m tests.mutation_run [--per-file N] [--workers W] [--seed S] [--only PATTERN] [--out FILE]

Targets: ``ir/``, ``passes/``, ``backend/ledger.py``, ``backend/executor.py`` and the engine
(``compiler/engine/``, ``compiler/steps.py``, ``compiler/prefix_cache.py``). Every function
body is parsed and each of these sites becomes one mutant:

- a comparison flipped (``==``/``!=``, ``<``/``<=``, ``>``/``>=``, ``in``/``not in``, ``is``/``is not``);
- ``and``/``or`` swapped; a ``not`` removed;
- ``+``/``-`` swapped; an integer constant moved by one;
- a ``raise`` replaced by ``pass`` (a check that no longer refuses);
- a call statement removed (a step that no longer happens: a ``check_live``, a ``claim.done``).

Sites are drawn at random (``--seed``), at most ``--per-file`` per module, so a run fits a 2-core
machine. Each mutant is written into a scratch copy of the tree (``git ls-files``), and the tests
that exercise its module run there with ``-x`` (stop at the first failure) and a timeout; a mutant
is *killed* when a test fails or errors, *survived* when they all pass, *timeout* when they do not
finish (counted as killed: the bug hangs the tests). Tests run without typeguard (its
instrumentation is not what is under test, and it triples the time). The figures and every
survivor (file, line, the mutated line) are printed, and written as JSON with ``--out``.

Survivors are not all bugs in the tests: some mutants are equivalent (the mutated code behaves the
same), e.g. ``<`` to ``<=`` where equality cannot occur. Judge each one by reading it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent

CORE_TESTS = [
    "tests/backend/test_backend_core.py", "tests/backend/test_ledger_truth.py", "tests/test_bad_input.py", "tests/ir/test_immutable_ir.py",
    "tests/passes/test_passes.py", "tests/passes/test_spec_passes.py", "tests/backend/test_snapshot.py", "tests/test_regression_stale_init.py",
    "tests/ir/test_column_sets.py", "tests/compiler/tools/test_golden.py", "tests/backend/test_mutation_detector.py", "tests/compiler/engine/test_faults.py",
    "tests/backend/test_concurrency.py", "tests/test_hostile_corpus.py", "tests/passes/test_pass_arguments.py",
    "tests/passes/test_pass_registry.py", "tests/ir/test_refusals.py", "tests/backend/test_executor_gate.py",
    "tests/ir/test_linear_plugin.py", "tests/ir/test_parse.py", "tests/ir/test_wire.py", "tests/passes/test_pass_preconditions.py",
    "tests/passes/test_head_passes.py", "tests/ir/test_sampling_params.py", "tests/ir/test_sampling_rows.py", "tests/ir/test_sampling_bans.py",
    "tests/ir/test_ir_promises.py", "tests/backend/test_ledger_promises.py", "tests/backend/test_executor_promises.py",
    "tests/ir/test_linear_flow.py",
    "tests/passes/test_pass_promises.py",
]
ENGINE_TESTS = [
    "tests/compiler/engine/test_engine_stop.py", "tests/compiler/engine/test_engine_spec.py", "tests/compiler/engine/test_serving.py", "tests/compiler/engine/test_faults.py",
    "tests/test_hostile_corpus.py", "tests/test_bad_input.py", "tests/compiler/engine/test_property_lifecycle.py",
    "tests/test_api_validation.py", "tests/compiler/engine/test_engine_parts.py", "tests/compiler/engine/test_engine_units.py",
    "tests/compiler/engine/test_engine_inline_processes.py", "tests/compiler/test_prefix_cache_unit.py", "tests/compiler/engine/test_policy.py", "tests/compiler/engine/test_nonfinite.py",
    "tests/compiler/engine/test_retraction_progress.py", "tests/compiler/engine/test_config.py",
    "tests/compiler/engine/test_engine_head.py",
    "tests/compiler/engine/test_engine_promises.py",
]
TARGETS: dict[str, list[str]] = {
    "ir/*.py": CORE_TESTS,
    "passes/*.py": CORE_TESTS,
    "backend/ledger.py": CORE_TESTS,
    "backend/executor.py": CORE_TESTS + ["tests/compiler/engine/test_engine_spec.py", "tests/test_api_validation.py"],
    "compiler/engine/*.py": ENGINE_TESTS,
    "compiler/steps.py": ENGINE_TESTS,
    "compiler/prefix_cache.py": ENGINE_TESTS,
}

_FLIP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}


@attrs.frozen
class Site:
    path: str
    line: int
    kind: str
    index: int
    """Position of the node among the module's nodes of this kind (how the mutator finds it again)."""


@attrs.frozen
class Result:
    site: Site
    outcome: str  # killed, survived, timeout, error
    seconds: float
    source_line: str


def _function_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node inside a function body (module and class level code runs at import, not in tests)."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in fn.body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    continue  # the docstring
                yield from ast.walk(stmt)


def _kind(node: ast.AST) -> str | None:
    match node:
        case ast.Compare(ops=[op]) if type(op) in _FLIP:
            return "compare"
        case ast.BoolOp():
            return "boolop"
        case ast.UnaryOp(op=ast.Not()):
            return "not"
        case ast.BinOp(op=ast.Add() | ast.Sub()):
            return "arith"
        case ast.Constant(value=int() as v) if not isinstance(v, bool):
            return "int"
        case ast.Raise():
            return "raise"
        case ast.Expr(value=ast.Call()):
            return "call"
    return None


def sites(path: str) -> list[Site]:
    tree = ast.parse((ROOT / path).read_text())
    seen: dict[int, None] = {}
    out: list[Site] = []
    counts: dict[str, int] = {}
    for node in _function_nodes(tree):
        if id(node) in seen:
            continue
        seen[id(node)] = None
        kind = _kind(node)
        if kind is None:
            continue
        out.append(Site(path, node.lineno, kind, counts.get(kind, 0)))
        counts[kind] = counts.get(kind, 0) + 1
    return out


def mutate(source: str, site: Site) -> str:
    """``source`` with the one change ``site`` names."""
    tree = ast.parse(source)
    target: ast.AST | None = None
    count = 0
    seen: dict[int, None] = {}
    for node in _function_nodes(tree):
        if id(node) in seen:
            continue
        seen[id(node)] = None
        if _kind(node) == site.kind:
            if count == site.index:
                target = node
                break
            count += 1
    if target is None:
        raise LookupError(f"{site} not found")
    match target:
        case ast.Compare(ops=[op]):
            target.ops = [_FLIP[type(op)]()]
        case ast.BoolOp(op=op):
            target.op = ast.Or() if isinstance(op, ast.And) else ast.And()
        case ast.UnaryOp():
            _replace(tree, target, target.operand)
        case ast.BinOp(op=op):
            target.op = ast.Sub() if isinstance(op, ast.Add) else ast.Add()
        case ast.Constant(value=int() as v):
            target.value = v + 1
        case ast.Raise() | ast.Expr():
            _replace(tree, target, ast.Pass())
    return ast.unparse(ast.fix_missing_locations(tree))


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                value[[i for i, v in enumerate(value) if v is old][0]] = new
                return
    raise LookupError("node not found in its tree")


def _tests_for(path: str) -> list[str]:
    for pattern, tests in TARGETS.items():
        if Path(path).match(pattern):
            return list(dict.fromkeys(tests))
    raise LookupError(path)


def _scratch() -> Path:
    dst = Path(tempfile.mkdtemp(prefix="batchc-mutants-"))
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files += subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    return dst


def _pytest(tree: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(tree), BATCHC_VERIFY="2", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *tests]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    if proc.returncode == 0:
        return "survived", seconds
    if proc.returncode == 1:
        return "killed", seconds
    return "error", seconds  # collection or import error: the mutant broke the module (also a kill)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.mutation_run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-file", type=int, default=20, help="mutants drawn per module (default 20)")
    ap.add_argument("--workers", type=int, default=2, help="scratch trees run side by side (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="only modules whose path contains this")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    modules = sorted(
        str(p.relative_to(ROOT)) for pattern in TARGETS for p in ROOT.glob(pattern)
        if p.name != "__init__.py" and (args.only is None or args.only in str(p))
    )
    rng = random.Random(args.seed)
    drawn: list[Site] = []
    for m in modules:
        all_sites = sites(m)
        drawn += sorted(rng.sample(all_sites, min(args.per_file, len(all_sites))), key=lambda s: s.line)
    trees = [_scratch() for _ in range(args.workers)]
    baseline: dict[str, float] = {}
    for m in modules:
        key = " ".join(_tests_for(m))
        if key not in baseline:
            outcome, seconds = _pytest(trees[0], _tests_for(m), 1800)
            if outcome != "survived":
                print(f"the unmutated tests do not pass for {m}: {outcome}", file=sys.stderr)
                return 1
            baseline[key] = seconds
    print(f"{len(drawn)} mutants over {len(modules)} modules; baseline test times: " + ", ".join(f"{v:.0f} s" for v in baseline.values()), flush=True)

    free = list(trees)
    results: list[Result] = []

    def run(site: Site) -> Result:
        tree = free.pop()
        try:
            original = (ROOT / site.path).read_text()
            mutated = mutate(original, site)
            (tree / site.path).write_text(mutated)
            tests = _tests_for(site.path)
            outcome, seconds = _pytest(tree, tests, 3 * baseline[" ".join(tests)] + 30)
            (tree / site.path).write_text(original)
            line = original.splitlines()[site.line - 1].strip()
            return Result(site, outcome, seconds, line)
        finally:
            free.append(tree)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        for i, r in enumerate(pool.map(run, drawn), 1):
            results.append(r)
            print(f"[{i}/{len(drawn)}] {r.outcome:8} {r.seconds:5.1f} s  {r.site.path}:{r.site.line} {r.site.kind}: {r.source_line[:90]}", flush=True)
    for t in trees:
        shutil.rmtree(t, ignore_errors=True)
    killed = sum(r.outcome in ("killed", "timeout", "error") for r in results)
    print(f"\n{killed}/{len(results)} killed ({100 * killed / max(1, len(results)):.1f}%) in {time.perf_counter() - t0:.0f} s")
    by_kind: dict[str, list[int]] = {}
    for r in results:
        k = by_kind.setdefault(r.site.kind, [0, 0])
        k[0] += r.outcome != "survived"
        k[1] += 1
    print("by kind: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(by_kind.items())))
    print("survivors:")
    for r in results:
        if r.outcome == "survived":
            print(f"  {r.site.path}:{r.site.line} {r.site.kind}: {r.source_line}")
    if args.out:
        Path(args.out).write_text(json.dumps([attrs.asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
