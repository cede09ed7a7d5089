"""mypy is part of the suite.

- The four packages are clean under the strict configuration in pyproject.toml.
- Every case under ``tests/typecheck/`` is still rejected, with the expected error code on the
  expected line: the cases are checked twice, once as written (``warn_unused_ignores`` is on under
  strict, so an ignore that stops being needed fails), and once with the ignores stripped, where
  mypy's ``(line, code)`` pairs must equal the ones the ignores declare.
- Every file under ``tests/typecheck_clean/`` type-checks clean: what the linear-use plugin
  (``ir.mypy_linear``, enabled in pyproject.toml) must accept.
- The plugin's errors name the value, the line of the first use and the README section.
- No ``hasattr``/``getattr``/``setattr`` back doors around the node types in the library.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
CASES = sorted((ROOT / "tests" / "typecheck").glob("*.py"))
CLEAN = sorted((ROOT / "tests" / "typecheck_clean").glob("*.py"))
_IGNORE = re.compile(r"#\s*type:\s*ignore\[([a-z-]+)\]")
_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


def _mypy(*paths: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--no-error-summary", *map(str, paths)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


LINEAR_MESSAGE = (
    "from backend.executor import Executor\n"
    "from ir.plan import ExtendPlan\n"
    "\n"
    "\n"
    "def f(ex: Executor, deferred_plan: ExtendPlan) -> None:\n"
    "    ex.execute(deferred_plan)\n"
    "    ex.execute(deferred_plan)\n"
)
"""A program the plugin refuses, for the wording of its error (``linear_message.py``)."""

STRIPPED = "stripped_"
"""The prefix of a case's copy with its ignores stripped (a module name of its own beside the case)."""


@attrs.frozen
class MypyRun:
    """mypy's one run over the packages, the cases as written, the clean files, and the cases with
    their ignores stripped beside ``LINEAR_MESSAGE`` (every program loads the library's types,
    torch's included, which is most of a run, so the suite pays for it once; the programs import
    none of one another, so the errors in each file are the ones it gets alone)."""

    as_written: list[str]
    """Output lines about every file but the stripped copies and ``linear_message.py``."""
    rejected: str
    """Output lines about the stripped copies (named as the cases) and ``linear_message.py``."""
    returncode: int


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory: pytest.TempPathFactory) -> MypyRun:
    d = tmp_path_factory.mktemp("rejected")
    for case in CASES:
        (d / f"{STRIPPED}{case.name}").write_text(_IGNORE.sub("", case.read_text()).replace("# type: ignore", ""))
    (d / "linear_message.py").write_text(LINEAR_MESSAGE)
    names = [f"{STRIPPED}{c.name}" for c in CASES] + ["linear_message.py"]
    assert len(set(names + [c.name for c in CASES + CLEAN])) == len(names) + len(CASES) + len(CLEAN)  # (one module name each)
    result = _mypy("ir", "passes", "compiler", "backend", *CASES, *CLEAN, *(d / name for name in names))
    # (by the file's name, not its folder: mypy replays a module's errors from its cache under the path
    # that module had when they were cached, another run's temporary folder)
    stripped = {f"{STRIPPED}{c.name}": c.name for c in CASES} | {"linear_message.py": "linear_message.py"}
    mine, theirs = [], []
    for line in result.stdout.splitlines():
        name = Path(line.split(":", 1)[0]).name
        if name in stripped:
            theirs.append(stripped[name] + line[line.index(":"):])
        else:
            mine.append(line)
    return MypyRun(as_written=mine + result.stderr.splitlines(), rejected="\n".join(theirs), returncode=result.returncode)


@pytest.fixture(scope="module")
def rejected(mypy_run: MypyRun) -> str:
    """mypy's output on every case with its ignores stripped and on ``LINEAR_MESSAGE`` (paths relative
    to their folder, each stripped copy named as its case)."""
    return mypy_run.rejected


def test_packages_and_cases_type_check_as_written(mypy_run: MypyRun) -> None:
    assert CLEAN
    assert mypy_run.returncode in (0, 1), mypy_run.as_written  # (1: the stripped copies' errors; 2 and up: mypy itself failed)
    assert mypy_run.rejected, "the stripped cases gave no error: the run did not check them"
    assert not mypy_run.as_written, "\n".join(mypy_run.as_written)


def _declared(path: Path) -> set[tuple[int, str]]:
    return {
        (n, m.group(1)) for n, line in enumerate(path.read_text().splitlines(), 1) for m in [_IGNORE.search(line)] if m
    }


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_case_is_rejected_with_declared_codes(case: Path, rejected: str) -> None:
    expected = _declared(case)
    assert expected, f"{case.name} declares no rejected line"
    found = {
        (int(m["line"]), m["code"])
        for line in rejected.splitlines()
        for m in [_ERROR.match(line)]
        if m and Path(m["file"]).name == case.name
    }
    assert found == expected, "mypy output:\n" + "\n".join(line for line in rejected.splitlines() if case.name in line)


def test_linear_errors_name_the_value_the_first_use_and_the_docs(rejected: str) -> None:
    assert re.search(
        r'linear_message\.py:7: error: "deferred_plan" \(ExtendPlan\) is consumed again by "ex": line 6 consumed it .*'
        r'see the batchc guide "The linearity checker in your mypy CI", or: python -m pydoc ir\.mypy_linear\)  \[linear-reuse\]$',
        rejected,
        re.M,
    ), rejected
    # the guide the message names by its title is the page of that title, in the docs' navigation under it
    assert (ROOT / "docs" / "guides" / "linearity-checker.md").read_text().startswith("# The linearity checker in your mypy CI\n")
    assert "- The linearity checker in your mypy CI: guides/linearity-checker.md" in (ROOT / "mkdocs.yml").read_text()


def test_no_attribute_back_doors_in_the_library() -> None:
    """IR nodes are read through their declared fields only; reflection would bypass mypy."""
    pattern = re.compile(r"\b(hasattr|getattr|setattr|delattr)\s*\(|__dict__")
    offenders = []
    for pkg in ("ir", "passes", "compiler", "backend"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    # the one sanctioned write: ir.columns.build_unchecked, the passes' trusted node builder
    allowed = {"ir/columns.py"}
    offenders = [o for o in offenders if o.split(":")[0] not in allowed]
    assert not offenders, "\n".join(offenders)

