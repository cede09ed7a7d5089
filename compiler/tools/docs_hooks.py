"""mkdocs hook (``hooks:`` in mkdocs.yml): fills the generated parts of the docs at build time.

``<!-- batchc:cli -->`` becomes the command-line reference built from the parser
(``compiler.tools.cli_reference``); ``<!-- batchc:measurement NAME -->`` becomes the table of
``docs/measurements/NAME.json`` with its provenance (``compiler.tools.docs_tables``). A marker
naming a missing or malformed file fails the build. mkdocs itself is not imported: the hook is a
plain function of the page's markdown, which the tests call too.
"""

from __future__ import annotations

import re
from typing import Any

from compiler.tools import cli_reference, docs_tables

CLI_MARKER = "<!-- batchc:cli -->"
MEASUREMENT = re.compile(r"<!-- batchc:measurement ([a-z0-9-]+) -->")


def expand(markdown: str) -> str:
    """``markdown`` with every marker replaced by what it stands for."""
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference.render())
    return MEASUREMENT.sub(lambda m: docs_tables.render(m.group(1)), markdown)


def on_page_markdown(markdown: str, /, **_: Any) -> str:
    return expand(markdown)
