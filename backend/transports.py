"""The transports by name: the factory that whoever builds an engine picks from.

``in_process()`` is the engine's default (``backend.local``), ``processes()`` runs each pool's
executor in its own process (``backend.remote``), ``tensor_parallel(leader)`` every plan on every
rank of a group (``backend.tp.serve``). The engine itself names none of those modules: it takes a
``backend.boundary.Transport`` and, when given none, asks this factory for the default. Each
transport module is imported when its transport is asked for, so an engine in process loads neither
the process nor the tensor-parallel code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.boundary import Transport

if TYPE_CHECKING:
    from backend.tp.serve import TPLeader

__all__ = ["in_process", "processes", "tensor_parallel"]


def in_process() -> Transport:
    """Every pool's executor in this process (the engine's default)."""
    from backend.local import IN_PROCESS

    return IN_PROCESS


def processes(threads: int | None = None) -> Transport:
    """Each pool's executor in its own process (``threads``: torch threads each; default this
    process's)."""
    from backend.remote import Processes

    return Processes(threads)


def tensor_parallel(leader: TPLeader) -> Transport:
    """Rank 0 of a tensor-parallel group: every plan runs on every rank."""
    from backend.tp.serve import TensorParallel

    return TensorParallel(leader)
