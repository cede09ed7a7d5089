"""Scheduling policies: the decision on its own, an engine's steps following it, and outputs that do
not depend on it."""

from __future__ import annotations

import numpy as np
import pytest
from typeguard import suppress_type_checks

from compiler.engine import ALTERNATE, DEFAULT_POLICY, PrefillFirst, QueueState, StepKind
from ir.errors import PreconditionError
from ir.ids import RequestId
from tests.helpers import BODIES, SYSTEM, engine, greedy_reference


def _state(queued: int = 1, running: int = 1, streak: int = 0) -> QueueState:
    return QueueState(queued=queued, running=running, prefill_streak=streak)


def test_prefill_first_bounds_the_prefill_steps_in_a_row_while_rows_run() -> None:
    bounded = PrefillFirst(max_streak=3)
    assert [bounded.prefill_now(_state(streak=s)) for s in range(5)] == [True, True, True, False, False]
    assert bounded.prefill_now(_state(running=0, streak=7))  # nothing runs: nothing to starve
    assert not bounded.prefill_now(_state(queued=0))
    unbounded = PrefillFirst()
    assert all(unbounded.prefill_now(_state(streak=s)) for s in (0, 1, 10, 1 << 30))
    assert [ALTERNATE.prefill_now(_state(streak=s)) for s in range(3)] == [True, False, False]


@pytest.mark.parametrize(
    ("value", "words"),
    [(0, "in [1, "), (-1, "in [1, "), (1 << 21, "in [1, "), (True, "must be an int, not bool"), (2.0, "not float"), ("4", "not str")],
)
def test_a_bad_bound_is_refused_naming_it(value: object, words: str) -> None:
    with suppress_type_checks(), pytest.raises(PreconditionError, match="max_streak") as info:
        PrefillFirst(max_streak=value)  # type: ignore[arg-type]  # the refusal is the point
    assert words in str(info.value)


def test_a_numpy_bound_is_kept_as_a_plain_int() -> None:
    with suppress_type_checks():
        p = PrefillFirst(max_streak=np.int64(2))  # type: ignore[arg-type]  # numpy integers are ints at run time
    assert type(p.max_streak) is int and p == PrefillFirst(max_streak=2)


def test_policies_describe_themselves() -> None:
    assert (PrefillFirst().describe(), ALTERNATE.describe(), PrefillFirst(max_streak=4).describe()) == (
        "prefill first", "alternate", "prefill first, at most 4 in a row",
    )


def test_an_engine_refuses_what_is_not_a_policy() -> None:
    with suppress_type_checks(), pytest.raises(PreconditionError, match=r"policy must be a SchedulePolicy .*not str"):
        engine(2, policy="prefill-first")  # production runs without typeguard: the engine's own check holds


def _prompt(i: int) -> list[int]:
    return SYSTEM + list(BODIES[i % len(BODIES)])


LONG, SHORT = 20, 4
"""New tokens of the two requests that run (they outlast the others' prefill under any policy) and of
the three that arrive later."""


def _kinds(policy: PrefillFirst, *, late: int) -> tuple[list[tuple[StepKind, int]], dict[RequestId, list[int]]]:
    """Two requests run, then ``late`` more arrive: the steps an engine at k = 2 takes, with a
    budget of one chunk per step so each arrival's prompt takes its own prefill steps."""
    e = engine(2, policy=policy, chunk_size=16, token_budget=16)
    for i in range(2):
        e.admit(RequestId(i), _prompt(i), max_new_tokens=LONG)
    while len(e.running.rid_list()) < 2:
        e.step()
    for i in range(2, 2 + late):
        e.admit(RequestId(i), _prompt(i), max_new_tokens=SHORT)
    kinds = []
    for _ in range(1000):
        if not e.live:
            break
        running = e.running.num_requests
        kinds.append((e.step().kind, running))
    return kinds, e.outputs


def _longest_prefill_run(kinds: list[tuple[StepKind, int]]) -> int:
    """The most prefill steps in a row while rows ran (with none running, nothing waits on them)."""
    best = run = 0
    for kind, running in kinds:
        run = run + 1 if kind is StepKind.EXTEND and running else 0
        best = max(best, run)
    return best


def test_an_engine_follows_its_policy_and_the_outputs_do_not_depend_on_it() -> None:
    runs = {p.describe(): _kinds(p, late=3) for p in (ALTERNATE, PrefillFirst(max_streak=2), PrefillFirst())}
    # three prompts of about 50 tokens at 16 a step: about 10 prefill steps in all, while two run
    assert _longest_prefill_run(runs["alternate"][0]) == 1
    assert _longest_prefill_run(runs["prefill first, at most 2 in a row"][0]) == 2
    assert _longest_prefill_run(runs["prefill first"][0]) >= 9
    outputs = [out for _, out in runs.values()]
    assert outputs[0] == outputs[1] == outputs[2]
    for i in range(5):
        assert outputs[0][RequestId(i)] == greedy_reference(_prompt(i), LONG if i < 2 else SHORT)


def test_the_default_policy_is_the_engines() -> None:
    assert engine(2).policy == DEFAULT_POLICY
