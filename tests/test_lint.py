"""ruff (configuration in pyproject.toml) is clean on the four packages and the tests; no file a user
reads (code, docstrings, docs) names this project's issue numbers, which mean nothing outside its
tracker (an upstream project's issue or pull request is cited with its project and ``#``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OWN_ISSUE = re.compile(r"\b[Ii]ssues? \d+")
"""``issue 29``, ``issues 28 and 30``: this tracker's spelling (upstream ones read ``vLLM #32118``)."""


def test_ruff_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_file_names_an_issue_number() -> None:
    files = _tracked("*.py", "*.md", "*.toml", "*.yml", "*.pyi", ".ci/*", "scripts/*", "examples/*")
    assert len(files) > 100  # (the listing worked)
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files if p.is_file() and p != Path(__file__).resolve()  # (this file's examples)
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OWN_ISSUE.search(line)]
    assert not found, "issue numbers in what users read:\n" + "\n".join(found)


def test_the_issue_number_check_finds_them() -> None:
    assert OWN_ISSUE.search('"""The draft head (issue 29): ...') and OWN_ISSUE.search("measured on the EPYC of Issue 47")
    assert not OWN_ISSUE.search("(vLLM PR #32118: ...)") and not OWN_ISSUE.search("one issue 'x' at a time")
