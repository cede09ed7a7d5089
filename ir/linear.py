"""Markers of linear use, read by the mypy plugin ``ir.mypy_linear``; every one is the identity at run time.

A plan that carries one-shot tickets may be consumed once per executor, and must not outlive the
step that lowered it: the ledger refuses a second consumption at run time, and these markers let
mypy refuse the code that would attempt one (batchc's guide "The linearity checker in your mypy CI").

- ``@linear`` declares a class linear: a value of it (or of a type holding one: a union, a tuple,
  a container of it) is tracked by the plugin. The IR declares ``Ticket`` (``InitTicket``, ``SnapshotTicket``),
  ``ExtendPlan`` and ``MixedPlan``, ``Proposals``, and a draft head's ``HiddenStates``, its plans and the
  results that hold one (``ir.hidden``); a class that holds a linear value in a field must be declared
  linear too (or ``@keeps_linear``), otherwise its field is the escape the check exists for.
- ``@consumes`` marks a method that consumes the linear values passed to it on its receiver (an
  executor's entry points); ``@consumes_on("pool")`` one that consumes them on the executor or pool
  named by that parameter (the ledger's claims, a runner's ``run(ex, plan)``). Methods only: mypy's
  cache keeps a class's metadata, not the decorators of a module-level function.
- ``@retires`` marks a method after which no executor may consume the linear values passed to it
  (a plan withdrawn before it ran: ``compiler.steps.Pipeline.withdraw``); a consuming call after it,
  on any executor, is a ``linear-reuse`` error, as is retiring a value some executor consumed.
- The escape hatches, explicit and greppable: ``stash(value)`` around one store that is meant to
  outlive the function (an in-flight queue), and ``@keeps_linear`` on a class whose job is to hold
  linear values across steps (the ledger, an in-flight record).

This module imports nothing: the library never needs mypy (only mypy loads the plugin).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "linear",
    "keeps_linear",
    "consumes",
    "retires",
    "ConsumesOn",
    "consumes_on",
    "stash",
]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def linear(cls: type[T]) -> type[T]:
    """Declare ``cls`` linear (see the module docstring)."""
    return cls


def keeps_linear(cls: type[T]) -> type[T]:
    """Declare ``cls`` a keeper: it stores linear values in its own attributes on purpose."""
    return cls


def consumes(method: F) -> F:
    """Mark ``method`` as consuming its linear arguments on its receiver."""
    return method


def retires(method: F) -> F:
    """Mark ``method`` as retiring its linear arguments: no executor consumes them after it."""
    return method


class ConsumesOn:
    """The decorator ``consumes_on(executor)`` returns (a class, so that mypy's plugin sees where it
    is applied)."""

    def __init__(self, executor: str) -> None:
        self.executor = executor

    def __call__(self, method: F) -> F:
        return method


def consumes_on(executor: str) -> ConsumesOn:
    """Mark a method as consuming its linear arguments on the executor its parameter ``executor``
    names (a literal string: the plugin reads it from the source)."""
    return ConsumesOn(executor)


def stash(value: T) -> T:
    """Store ``value`` where it outlives the function on purpose (an engine's in-flight queue): the
    plugin's escape check accepts a store whose value is wrapped in this call."""
    return value
