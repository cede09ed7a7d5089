"""The README is executable: the commands up top are the ones CI runs, and the API walkthrough's
code block runs and prints exactly the text block that follows it."""

from __future__ import annotations

import contextlib
import io
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


def test_api_walkthrough_runs_and_prints_what_the_readme_says() -> None:
    section = README.index("## API walkthrough")
    code, end = _block(README, "python", section)
    expected, _ = _block(README, "text", end)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    actual = re.sub(r"#\d+ for pool", "#SERIAL for pool", out.getvalue())
    assert actual == expected
