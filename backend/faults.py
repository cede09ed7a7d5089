"""Fault injection, for tests: named points in the backend raise ``InjectedFault`` when armed.

Points: ``init_launch`` (right after the init-op launch has written its rows, before its ticket is
done: every row it wrote must be put back), ``model_forward`` (after the model hook has run and
written the pool), ``commit`` (after the commit scatter) and ``snapshot`` (after the snapshot copy).
Each point is a plain ``check`` call at a fixed place: arming one never changes the path the
product code takes. Nothing is armed in production, where ``check`` is one dictionary test. Arming
is process-wide and thread-safe.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

__all__ = ["POINTS", "FaultPoint", "InjectedFault", "arm", "armed", "check", "disarm"]


class FaultPoint(enum.StrEnum):
    """The named places in the backend where a test can make a fault happen (see the module)."""

    INIT_LAUNCH = "init_launch"
    MODEL_FORWARD = "model_forward"
    COMMIT = "commit"
    SNAPSHOT = "snapshot"


POINTS: Final = tuple(FaultPoint)

_armed: dict[FaultPoint, int] = {}  # point -> passes left before it fires
_fired: dict[FaultPoint, int] = {}
_lock = threading.Lock()


class InjectedFault(RuntimeError):
    """Raised by an armed fault point."""


def check(point: FaultPoint) -> None:
    """Raise ``InjectedFault`` if ``point`` is armed and its passes are used up (it then disarms and
    counts as fired); otherwise return. One dictionary test when nothing is armed."""
    if not _armed:
        return
    with _lock:
        left = _armed.get(point)
        if left is None:
            return
        if left > 0:
            _armed[point] = left - 1
            return
        del _armed[point]
        _fired[point] = _fired.get(point, 0) + 1
    raise InjectedFault(f"injected fault at {point}")


@contextmanager
def armed(point: FaultPoint, *, after: int = 0) -> Iterator[dict[FaultPoint, int]]:
    """Fire once at the ``after + 1``-th pass through ``point`` inside the block; yields the counts
    of faults fired so far, by point."""
    arm(point, after=after)
    try:
        yield _fired
    finally:
        with _lock:
            _armed.pop(point, None)


def arm(point: FaultPoint, *, after: int = 0) -> None:
    """``armed`` without the block, for a process driven by messages (an executor process): fire
    once at the ``after + 1``-th pass through ``point`` until ``disarm``."""
    if not isinstance(point, FaultPoint):
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    with _lock:
        _armed[point] = after
        _fired.clear()


def disarm() -> None:
    """Disarm every point."""
    with _lock:
        _armed.clear()
