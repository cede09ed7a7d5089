"""``ServeConfig`` checks what it promises on construction: every integer option at its bounds (the
lowest value accepted, one below refused; the largest accepted, one above refused, where there is a
largest), the two switches as bools only, and ``max_len`` between ``k + 3`` and ``MAX_CONTEXT``; each
refusal a ``ServeError`` naming the option and the value."""

from __future__ import annotations

import re

import attrs
import pytest

from compiler.engine.config import MAX_PREFILL_STREAK, ServeConfig
from compiler.workload import MAX_CONTEXT, MAX_K, MAX_SEED, MAX_THREADS, ServeError

LOWEST = {name: 0 if name in ("k", "lossless_sample", "prefill_streak", "seed") else 1
          for name in (f.name for f in attrs.fields(ServeConfig)) if name not in ("overlap", "penalties")}
"""The smallest value of each integer option."""
HIGHEST = {"k": MAX_K, "prefill_streak": MAX_PREFILL_STREAK, "seed": MAX_SEED, "threads": MAX_THREADS, "max_len": MAX_CONTEXT}
"""The largest value of the options that have one."""


def _at(name: str, value: object) -> ServeConfig:
    # (max_len must leave k + 3 positions: the k bounds are probed with a context that has room)
    extra: dict[str, object] = {"max_len": MAX_CONTEXT} if name == "k" else {}
    return ServeConfig(**{name: value, **extra})  # type: ignore[arg-type]  # (the bad values are the point)


@pytest.mark.parametrize("name", sorted(LOWEST))
def test_each_integer_option_takes_its_lowest_value_and_refuses_one_below(name: str) -> None:
    lo = LOWEST[name]
    if name == "max_len":  # (its own floor, k + 3, is above 1: tested below)
        lo = ServeConfig().k + 3
    assert attrs.asdict(_at(name, lo))[name] == lo
    with pytest.raises(ServeError, match=re.escape(name)) as caught:
        _at(name, lo - 1)
    assert str(lo - 1) in str(caught.value)


@pytest.mark.parametrize("name", sorted(HIGHEST))
def test_each_bounded_option_takes_its_highest_value_and_refuses_one_above(name: str) -> None:
    hi = HIGHEST[name]
    assert attrs.asdict(_at(name, hi))[name] == hi
    with pytest.raises(ServeError, match=re.escape(name)) as caught:
        _at(name, hi + 1)
    assert str(hi + 1) in str(caught.value)


@pytest.mark.parametrize("value", [True, 2.0, "2", None])
@pytest.mark.parametrize("name", ["k", "max_running", "token_budget", "seed"])
def test_integer_options_take_ints_only(name: str, value: object) -> None:
    with pytest.raises(ServeError, match=rf"{name} must be an int, got {re.escape(repr(value))}"):
        ServeConfig(**{name: value})  # type: ignore[arg-type]  # (the bad values are the point)


@pytest.mark.parametrize("value", [0, 1, "no", None])
@pytest.mark.parametrize("name", ["overlap", "penalties"])
def test_switches_take_bools_only(name: str, value: object) -> None:
    assert attrs.asdict(ServeConfig(**{name: True}))[name] is True  # type: ignore[arg-type]  # (a dict of one option: mypy cannot tell its type)
    with pytest.raises(ServeError, match=rf"{name} must be a bool, got {re.escape(repr(value))}"):
        ServeConfig(**{name: value})  # type: ignore[arg-type]  # (the bad values are the point)


@pytest.mark.parametrize("k", [0, 2, MAX_K])
def test_the_context_leaves_room_for_a_prompt_token_a_new_token_and_the_window(k: int) -> None:
    assert ServeConfig(k=k, max_len=k + 3).max_len == k + 3
    with pytest.raises(ServeError, match=rf"max_len {k + 2} leaves no room .* k \+ 1 = {k + 1}"):
        ServeConfig(k=k, max_len=k + 2)
    assert ServeConfig(k=k, max_len=k + 3).reserve == k + 1
