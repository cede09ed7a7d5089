"""Argument checks at the entry of the passes.

Each pass checks the type of each argument with one ``isinstance`` before it reads any attribute,
so a caller that passes the wrong thing (``None``, a list where a batch is expected, a batch of the
wrong phase) gets a ``PreconditionError`` naming the pass, the argument, the type it got and the
value, never an ``AttributeError``, ``TypeError`` or ``AssertionError`` from deep inside. Column
arguments that are not nodes (``draft_tokens``, ``target_tokens``) must be 1-D int64 numpy arrays:
a list or another dtype is refused, not converted (a float is never truncated to a token id). The
checks cost one ``isinstance`` per argument (no per-row Python loop), so the per-step pipeline
does not pay measurably for them.
"""

from __future__ import annotations

from typing import Never, NoReturn

from ir.errors import PreconditionError, short_repr


def bad_arg(pass_name: str, arg: str, value: object, expected: str) -> PreconditionError:
    """The error for argument ``arg`` of ``pass_name`` that is not ``expected``: it names the pass,
    the argument, the type received and the value."""
    return PreconditionError(pass_name, f"{arg} must be {expected}, got {type(value).__name__} ({short_repr(value)})")


def unexpected_arg(pass_name: str, arg: str, value: Never, expected: str) -> NoReturn:
    """The ``case _`` of a pass's ``match`` over its argument's union: mypy checks the match is
    exhaustive (like ``assert_never``, ``value`` must be ``Never`` there), and a value of another
    type at run time gets ``bad_arg``'s ``PreconditionError`` rather than an ``AssertionError``."""
    raise bad_arg(pass_name, arg, value, expected)
