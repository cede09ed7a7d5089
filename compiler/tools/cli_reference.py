"""The command-line reference, generated from the parser itself (``compiler.cli.args.parser``).

Every command and group of ``batchc`` gets a section holding exactly what ``batchc ... --help``
prints (at a fixed width of 100 columns, so the text does not depend on the terminal), in the order
the parser declares them. The docs site inserts it where a page says ``<!-- batchc:cli -->``
(``compiler.tools.docs_hooks``), so the reference cannot drift from the parser.

    python -m compiler.tools.cli_reference      # prints the markdown
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

WIDTH = 100


def _fixed_width(p: argparse.ArgumentParser) -> None:
    p.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH, max_help_position=32)


def commands(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser under ``p`` with the words that select it (``()`` for ``p``), depth first."""
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from commands(child, (*path, name))


def render() -> str:
    """The reference as markdown: one section per command, its ``--help`` in a text block."""
    from compiler.cli.args import parser

    out: list[str] = []
    for path, p in commands(parser()):
        _fixed_width(p)
        title = " ".join(("batchc", *path))
        level = "#" * (3 if not path else 4)  # under the page's "Commands" section
        out += [f"{level} `{title}`", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def main() -> int:
    print(render(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
