"""The README is a front page that stays true: the commands up top are the ones CI runs, it fits in 150
lines, and its links into the docs lead somewhere. Its code block runs and prints what it says
(``tests/test_docs.py`` runs it with the docs' blocks, among them the full API walkthrough)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _block(text: str, lang: str, start: int = 0) -> tuple[str, int]:
    begin = text.index(f"```{lang}\n", start) + len(lang) + 4
    end = text.index("```", begin)
    return text[begin:end], end


def test_readme_starts_with_the_two_commands_and_ci_runs_the_second() -> None:
    first, _ = _block(README, "bash")
    assert README.index("```bash") < README.index("\n## ")
    commands = [line for line in first.splitlines() if line.strip()]
    assert commands == [
        "pip install -e . && batchc run",
        "pip install -e '.[test]' && python -m pytest",
    ]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_is_a_front_page_of_at_most_150_lines() -> None:
    assert len(README.splitlines()) <= 150


def test_readme_links_into_the_docs_lead_to_pages() -> None:
    links = re.findall(r"\]\((docs/[^)#]+)", README)
    assert len(links) >= 10
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing


def _table_rows(text: str) -> list[tuple[str, str]]:
    """The (metric, value) pairs of a rich table's body rows, whatever the table's width."""
    return [(cells[1].strip(), cells[2].strip()) for line in text.splitlines() for cells in [line.split("│")] if len(cells) == 4]


def test_readme_and_getting_started_show_rows_that_batchc_run_prints() -> None:
    """The sample output of ``batchc run`` in the README and in Getting started is an excerpt of what
    the command prints on its bundled default: each row shown, with its value, is a row of a real
    run's summary (run as the README's first command does, in a process of its own: forked from the
    suite's template, ``tests/forkserver.py``)."""
    import sys

    from tests import forkserver

    exe = [sys.executable, "-c", "import sys; from compiler.launch import main; sys.exit(main())", "run"]
    result = forkserver.run(exe, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = set(_table_rows(result.stdout))
    assert ("lossless_check", "passed: 4 requests equal plain greedy of the target") in printed
    for page in (README, (ROOT / "docs" / "getting-started.md").read_text()):
        marker = page.index("```text\n│ target_clears_minted_consumed")
        shown = _table_rows(_block(page, "text", marker)[0])
        assert len(shown) >= 10
        assert not [row for row in shown if row not in printed], result.stdout
