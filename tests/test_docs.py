"""The docs are executable and generated where they could drift.

- Every fenced ```` ```python ```` block of ``docs/**/*.md`` and ``README.md`` runs, page by page in
  one namespace, in order; a block followed directly by a ```` ```text ```` block must print exactly
  that text (ticket serials, which differ per process, read ``#SERIAL``). Code that is not meant to run
  (a mypy error, a skeleton) is fenced as ```` ```{.python .no-run} ````; no other spelling of a
  Python block is allowed, so a block cannot stop running by accident.
- The command-line reference is rendered from the parser, and covers every command and option.
- Every measurement table is rendered from a stored ``--json`` output with its full provenance, and
  every stored measurement is shown somewhere.

None of this needs the docs extra (mkdocs): the hook that fills the generated parts is a plain
function of the page's text.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from compiler.tools import cli_reference, docs_hooks, docs_tables

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(r"^```(.*)$")
RUNS = "python"
NO_RUN = "{.python .no-run}"


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of ``text`` as (info string, body), in order; ``("", "")`` marks prose
    between two blocks, so that "directly followed by" can be told."""
    out: list[tuple[str, str]] = []
    lines = text.splitlines(keepends=True)
    i = 0
    prose = False
    while i < len(lines):
        m = FENCE.match(lines[i].rstrip("\n"))
        if m is None:
            prose = prose or bool(lines[i].strip())
            i += 1
            continue
        if prose:
            out.append(("", ""))
            prose = False
        info, body = m.group(1).strip(), []
        i += 1
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        out.append((info, "".join(body)))
        i += 1
    return out


def run_page(path: Path) -> int:
    """Run the page's Python blocks; returns how many ran."""
    found = blocks(path.read_text())
    namespace: dict[str, object] = {"__name__": f"docs:{path.name}"}
    ran = 0
    for n, (info, code) in enumerate(found):
        if info != RUNS:
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{path} block {n}", "exec"), namespace)
        ran += 1
        following = found[n + 1] if n + 1 < len(found) else ("", "")
        if following[0] == "text":
            assert re.sub(r"#\d+ for pool", "#SERIAL for pool", out.getvalue()) == following[1], f"{path.name} block {n}"
    return ran


RUNNABLE = [p for p in [*PAGES, ROOT / "README.md"] if any(info == RUNS for info, _ in blocks(p.read_text()))]


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_code_blocks_run_and_print_what_the_page_says(path: Path) -> None:
    assert run_page(path) > 0


def test_the_walkthroughs_are_among_the_blocks_that_run() -> None:
    names = {str(p.relative_to(ROOT)) for p in RUNNABLE}
    assert {"README.md", "docs/getting-started.md", "docs/guides/speculative-decoding.md"} <= names


@pytest.mark.parametrize("path", [*PAGES, ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_either_run_or_say_they_do_not(path: Path) -> None:
    for info, _ in blocks(path.read_text()):
        if "py" in info:
            assert info in (RUNS, NO_RUN), f"{path.name}: a Python block fenced as {info!r}"


def test_a_block_that_prints_something_else_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nprint('yes')\n```\n\n```text\nno\n```\n")
    with pytest.raises(AssertionError):
        run_page(page)
    page.write_text("```python\nprint('yes')\n```\n\nprose between\n\n```text\nno\n```\n")
    assert run_page(page) == 1  # a text block after prose is not the block's output


def test_cli_reference_covers_every_command_and_option() -> None:
    from compiler.cli.args import parser

    text = cli_reference.render()
    found = list(cli_reference.commands(parser()))
    assert {" ".join(path) for path, _ in found} >= {"", "run", "ab", "dump", "bench", "bench serve", "bench iteration", "bench kernels"}
    for path, p in found:
        assert f"`{' '.join(('batchc', *path))}`" in text
        for action in p._actions:
            if not isinstance(action, argparse._SubParsersAction):
                for option in action.option_strings:
                    assert option in text, (path, option)


def test_cli_reference_is_filled_in_by_the_docs_hook() -> None:
    page = (DOCS / "reference" / "cli.md").read_text()
    assert docs_hooks.CLI_MARKER in page
    assert "--max-running" in docs_hooks.expand(page)


def _measurements_shown() -> set[str]:
    return {m.group(1) for p in PAGES for m in docs_hooks.MEASUREMENT.finditer(p.read_text())}


def test_every_measurement_is_shown_and_every_marker_names_one() -> None:
    stored = {p.stem for p in (DOCS / "measurements").glob("*.json")}
    assert stored and _measurements_shown() == stored


@pytest.mark.parametrize("name", sorted({p.stem for p in (DOCS / "measurements").glob("*.json")}))
def test_measurement_tables_come_from_the_json_with_provenance(name: str) -> None:
    record = json.loads((DOCS / "measurements" / f"{name}.json").read_text())
    assert set(docs_tables.PROVENANCE_KEYS) <= set(record["provenance"])
    assert record["provenance"]["command"].startswith("scripts/gpu-check " if record.get("schema") == "batchc.gpu-check/1" else "batchc ")
    table = docs_tables.render(name)
    assert table.startswith("| ") and "Measured " in table and record["provenance"]["commit"][:12] in table
    # the figures are read from the data, not typed: change one and the table changes with it
    if record.get("schema") == "batchc.gpu-check/1":  # (scripts/gpu-check's file: its sections)
        record["sections"]["kernels"]["data"]["copy"]["gb_s"] = 12345.6
        assert "12345.6" in docs_tables.render_record(record)
        return
    data = record["data"]
    if isinstance(data, list):
        data[0]["tokens_per_s"] = 12345.6
    elif "runs" in data:
        data["runs"]["compiled"]["acceptance_rate"] = 0.1234
    elif "rows" in data:  # bench decode
        data["rows"][0]["prompt_tokens_per_s"] = 12345.6
    else:
        data["tokens_per_s"] = 12345.6
    changed = docs_tables.render_record(record)
    assert changed != table and ("12345.6" in changed or "0.123" in changed)


def test_a_bench_serve_record_of_replayed_runs_shows_their_host_time() -> None:
    record = json.loads((DOCS / "measurements" / "bench-serve.json").read_text())
    plain = docs_tables.render_record(record)
    assert "forwards replayed" not in plain
    for i, row in enumerate(record["data"]):
        row["host_ms_per_step_replayed"] = 0.125 + i
    shown = docs_tables.render_record(record)
    header = shown.splitlines()[0].split(" | ")
    column = header.index("host ms/step, forwards replayed")
    assert header[column - 1] == "host ms/step"
    cells = [line.split(" | ")[column] for line in shown.splitlines()[2 : 2 + len(record["data"])]]
    assert cells == [f"{0.125 + i:.2f}" for i in range(len(record["data"]))]


def test_a_measurement_without_provenance_is_refused() -> None:
    record = json.loads((DOCS / "measurements" / "ab-k2.json").read_text())
    del record["provenance"]["load_average_before"]
    with pytest.raises(docs_tables.MeasurementError, match="load_average_before"):
        docs_tables.render_record(record)
