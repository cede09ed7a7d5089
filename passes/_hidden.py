"""The head passes' check of a ``HiddenStates`` handle against the rows that will read it."""

from __future__ import annotations

from ir.columns import I64, same_column
from ir.errors import PreconditionError
from ir.hidden import HiddenStates


def check_hidden_rows(pass_name: str, hidden: HiddenStates, whose: str, rids: I64, starts: I64, lens: I64) -> None:
    """``hidden`` kept exactly the positions ``whose`` reads: its rows ``rids`` in that order, from
    ``starts[i]`` on, ``lens[i]`` of them; else ``PreconditionError`` naming both values of the
    first column that differs."""
    for name, mine, theirs in (("rows", hidden.rids, rids), ("first positions", hidden.starts, starts), ("lengths", hidden.lens, lens)):
        if not same_column(mine, theirs):
            raise PreconditionError(
                pass_name,
                f"{hidden.described()} kept {name} {mine.tolist()[:8]}, {whose} reads {name} {theirs.tolist()[:8]}: "
                "a head phase reads the hidden states of the target forward it follows",
            )
