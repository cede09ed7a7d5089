"""Scheduling policies: when requests both wait for their prefill and run, which kind of forward an
engine step runs. A policy is a frozen value the engine takes (``Engine(policy=...)``); its one
decision, ``prefill_now``, is a pure function of what the step sees (``QueueState``), so a policy is
tested on its own and an engine's steps follow from it.

The question only arises when prefill and decoding cannot share a forward: with a draft (a
speculative iteration is four forwards over two models, never mixed with a prefill) or with mixed
forwards turned off. At ``k == 0`` with mixed forwards (the default) every step decodes the running
rows and prefills the queued chunks in one MIXED forward, and no policy is consulted.

- ``PrefillFirst(max_streak=None)`` prefills whatever is queued before the next decode or
  speculative step (SGLang's default): fewest forwards, but under a steady stream of arrivals the
  running requests stall for as long as prompts keep coming.
- ``PrefillFirst(max_streak=1)`` alternates one prefill step with one running step: running rows
  never wait more than one forward, but a burst's prompts take many steps to start, and every
  speculative iteration in between runs on fewer rows while a verify costs nearly as much at one
  row as at eight.
- ``PrefillFirst(max_streak=n)`` is the bound in between: prefill first, but after ``n`` prefill
  steps in a row while requests run, one running step.

``DEFAULT_POLICY`` is the measured choice (docs: measurements, "Scheduling"): together with the
prefill chunk size and token budget it decides how many forwards a burst's prompts take.
"""

from __future__ import annotations

from typing import Protocol, cast, runtime_checkable

import attrs

from compiler.engine.config import DEFAULT_PREFILL_STREAK, MAX_PREFILL_STREAK
from ir.columns import int_problem
from ir.errors import PreconditionError, short_repr

__all__ = ["ALTERNATE", "DEFAULT_POLICY", "MAX_STREAK", "PrefillFirst", "QueueState", "SchedulePolicy", "prefill_first"]

MAX_STREAK = MAX_PREFILL_STREAK
"""Largest bound on prefill steps in a row a policy takes (``None`` means no bound)."""


@attrs.frozen(kw_only=True)
class QueueState:
    """What a step's scheduling decision sees."""

    queued: int
    """Requests waiting for (more of) their prefill."""
    running: int
    """Rows of the running batch (requests that decode or speculate)."""
    prefill_streak: int
    """Prefill steps in a row just before this one while rows were running (0 after a running step)."""


@runtime_checkable
class SchedulePolicy(Protocol):
    """How an engine chooses between a prefill step and a running step."""

    def prefill_now(self, state: QueueState) -> bool:
        """Whether this step prefills (only asked when requests are queued and rows run)."""
        ...

    def describe(self) -> str:
        """The policy in a few words, for reports."""
        ...


def _streak(value: object) -> int | None:
    """``max_streak`` checked (``PreconditionError`` naming the value) and as a plain int."""
    if value is None:
        return None
    problem = int_problem(value)
    if problem is not None:
        raise PreconditionError("PrefillFirst", f"max_streak {problem} (got {short_repr(value)})")
    n = int(cast("int", value))  # int_problem accepted it: an int or a numpy integer
    if not 1 <= n <= MAX_STREAK:
        raise PreconditionError("PrefillFirst", f"max_streak must be None or in [1, {MAX_STREAK}], got {n}")
    return n


@attrs.frozen
class PrefillFirst:
    """Prefill what is queued before the next running step, at most ``max_streak`` prefill steps
    in a row while rows run (``None``: no bound; ``1``: alternate)."""

    max_streak: int | None = attrs.field(default=None, converter=_streak)

    def prefill_now(self, state: QueueState) -> bool:
        """True when requests are queued and either nothing runs, there is no bound, or fewer than
        ``max_streak`` prefill steps ran in a row."""
        if state.queued == 0:
            return False
        return self.max_streak is None or state.running == 0 or state.prefill_streak < self.max_streak

    def describe(self) -> str:
        """"prefill first", "alternate" or "prefill first, at most n in a row"."""
        if self.max_streak is None:
            return "prefill first"
        if self.max_streak == 1:
            return "alternate"
        return f"prefill first, at most {self.max_streak} in a row"


def prefill_first(streak: int) -> PrefillFirst:
    """The policy of ``--prefill-streak`` / ``ServeConfig.prefill_streak``: ``0`` means no bound."""
    return PrefillFirst(max_streak=streak or None)


ALTERNATE = PrefillFirst(max_streak=1)
"""One prefill step, then one running step (the engine's policy before the measured default)."""
DEFAULT_POLICY = PrefillFirst(max_streak=DEFAULT_PREFILL_STREAK)
"""The measured default (docs: measurements, "Scheduling")."""
