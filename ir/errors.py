"""Error types of batchc.

Every error a user can trigger derives from ``BatchcError`` and names the bad value. The families:

- ``IRValidationError``: a node field is malformed (raised while constructing the node; nothing is
  built). Also a ``ValueError``, so generic input handling catches it.
- ``IRVerificationError``: a whole-node invariant does not hold (``ir.verify``); carries the path
  of the offending element.
- ``ResourceError`` and its subclasses: a one-shot init ticket was used wrongly (replayed, sent to
  the wrong pool, never registered, forged, or never consumed). Raised by ``backend.ledger.Ledger``.
- ``SlotError``: slot allocator misuse (double free, use after free, exhaustion).
- ``PlanExecutionError``: a plan does not fit the backend it was handed to; raised before any
  tensor is touched.
"""

from __future__ import annotations

__all__ = [
    "BatchcError",
    "IRValidationError",
    "IRVerificationError",
    "ResourceError",
    "ResourceReplayError",
    "ResourceLeakError",
    "WrongPoolError",
    "UnknownTicketError",
    "TicketMismatchError",
    "SlotError",
    "PlanExecutionError",
    "PreconditionError",
    "MutationError",
    "EngineStoppedError",
    "SettingsError",
    "short_repr",
]


class BatchcError(Exception):
    """Base of every error batchc raises on purpose."""


class IRValidationError(BatchcError, ValueError):
    """A node field failed its local check; ``field`` and ``value`` name it."""

    def __init__(self, node: str, field: str, value: object, message: str) -> None:
        self.node = node
        self.field = field
        self.value = value
        super().__init__(f"{node}.{field}: {message} (got {short_repr(value)})")


class IRVerificationError(BatchcError):
    """A whole-node invariant does not hold; ``path`` locates it (``ExtendBatch.requests[1].slot``)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


class ResourceError(BatchcError):
    """Misuse of a one-shot init ticket."""


class ResourceReplayError(ResourceError):
    """A ticket serial was consumed a second time on the same pool (a replayed init op)."""


class ResourceLeakError(ResourceError):
    """Minted tickets were never consumed (a dropped init op)."""


class WrongPoolError(ResourceError):
    """A ticket was handed to a pool it was not addressed to."""


class UnknownTicketError(ResourceError):
    """A ticket was consumed by a ledger that never registered it, or registered with a serial that
    neither this process minted nor a trusted peer sent."""


class TicketMismatchError(ResourceError):
    """A ticket carries other ops than the ticket registered under its ``(serial, pool)``: the
    registered ticket is the truth, and the impostor is refused before any byte moves."""


class SlotError(BatchcError, ValueError):
    """Slot allocator misuse: double free, use after free, exhaustion, out of range."""


class PlanExecutionError(BatchcError, ValueError):
    """A plan cannot run on this backend (wrong pool, slot out of range, malformed staging)."""


def short_repr(value: object, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters: how an error message shows a bad value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PreconditionError(BatchcError, ValueError):
    """A pass was called on input outside its precondition (named in the pass's docstring)."""

    def __init__(self, pass_name: str, message: str) -> None:
        self.pass_name = pass_name
        super().__init__(f"{pass_name}: {message}")


class MutationError(BatchcError):
    """A tensor the backend owns or staged was written in place by code that had no right to."""


class EngineStoppedError(BatchcError):
    """The serving engine refuses further steps: an earlier step raised, and its bookkeeping may be
    partial (the message names the first exception)."""


class SettingsError(BatchcError, ValueError):
    """A bad ``BATCHC_VERIFY`` or ``BATCHC_DUMP_DIR`` setting, or a dump file that cannot be written
    safely; the message is one line naming the variable or file and the value."""
