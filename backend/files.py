"""Errors about the files the backend reads (checkpoints, tokenizers), torch-free.

``backend.hybrid.checkpoint`` re-exports both names; they live here so that modules which only
read files or say what is wrong with one (``compiler.offline.tokenizer``, which ``batchc serve``'s
HTTP process loads) do not import torch through ``backend.hybrid``."""

from __future__ import annotations

import stat
from pathlib import Path

from ir.errors import BatchcError

__all__ = ["CheckpointError", "file_kind"]


class CheckpointError(BatchcError, ValueError):
    """A checkpoint file cannot be loaded; ``path`` is the file, the message says what is wrong."""

    def __init__(self, path: str | Path, detail: str) -> None:
        self.path = str(path)
        self.detail = " ".join(detail.split())  # one line, whatever the cause said
        shown = self.path if self.path.isprintable() else repr(self.path)  # a newline or escape in a name stays quoted
        super().__init__(f"{shown}: {self.detail}")


def file_kind(mode: int) -> str:
    """What a ``stat`` mode that is not a regular file names, for messages ("a FIFO")."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"
