"""The linear-use plugin (``ir.mypy_linear``) on the control flow ``test_linear_plugin.py`` does not
reach: ``while`` with ``break``/``continue``/``else``, ``with``, ``match``, ``try``/``finally``, a
``raise`` inside a ``try``, walrus and tuple rebinding, nested definitions, comprehensions that
bind the executor or the value, linear values inside unions, tuples and containers, ``@retires``,
and the markers the plugin refuses. Each line that must be refused ends in ``# E: <code>``; every
other line must pass (one mypy run over a self-contained program, a few seconds).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parent.parent.parent

PROGRAM = '''
from __future__ import annotations

from collections.abc import Callable, Sequence

from ir.linear import consumes, consumes_on, linear, retires


@linear
class Plan:
    pass


class Ex:
    @consumes
    def execute(self, plan: Plan) -> None: ...

    @consumes
    def run_all(self, plans: tuple[Plan, int]) -> None: ...

    @consumes
    def run_maybe(self, plan: Plan | None) -> None: ...

    @consumes
    def run_list(self, plans: list[Plan]) -> None: ...

    @consumes
    def run_any(self, value: object) -> None: ...


class Pipe:
    @retires
    def withdraw(self, plan: Plan) -> None: ...


def while_break_then_again(ex: Ex, plan: Plan, go: Callable[[], bool]) -> None:
    while go():
        ex.execute(plan)
        break
    ex.execute(plan)  # E: linear-reuse


def while_continue(ex: Ex, plan: Plan, go: Callable[[], bool]) -> None:
    while go():
        if go():
            continue
        ex.execute(plan)  # E: linear-reuse


def fine_while_rebinds(ex: Ex, plan: Plan, make: Callable[[], Plan], go: Callable[[], bool]) -> None:
    while go():
        ex.execute(plan)
        plan = make()


def while_else(ex: Ex, plan: Plan, go: Callable[[], bool]) -> None:
    while go():
        pass
    else:
        ex.execute(plan)
    ex.execute(plan)  # E: linear-reuse


def fine_for_else_breaks(ex: Ex, plan: Plan, items: Sequence[int]) -> None:
    for _ in items:
        ex.execute(plan)
        break
    else:
        ex.execute(plan)


def in_a_with(ex: Ex, plan: Plan, cm: Callable[[], object]) -> None:
    ex.execute(plan)
    with open("x") as f:
        ex.execute(plan)  # E: linear-reuse
        f.read()


def fine_with_rebinds(ex: Ex, plan: Plan, cm: Callable[[], Plan]) -> None:
    ex.execute(plan)
    with cm() as plan:  # type: ignore[attr-defined]
        ex.execute(plan)


def after_a_match(ex: Ex, plan: Plan, n: int) -> None:
    match n:
        case 1:
            ex.execute(plan)
        case _:
            pass
    ex.execute(plan)  # E: linear-reuse


def fine_match_binds(ex: Ex, plan: Plan, other: object) -> None:
    ex.execute(plan)
    match other:
        case Plan() as plan:
            ex.execute(plan)


def in_finally(ex: Ex, plan: Plan) -> None:
    try:
        ex.execute(plan)
    finally:
        ex.execute(plan)  # E: linear-reuse


def fine_raise_skips(ex: Ex, plan: Plan, bad: bool) -> None:
    if bad:
        ex.execute(plan)
        raise RuntimeError("stop")
    ex.execute(plan)


def raise_caught(ex: Ex, plan: Plan) -> None:
    try:
        ex.execute(plan)
        raise RuntimeError("x")
    except RuntimeError:
        ex.execute(plan)  # E: linear-reuse


def fine_return_skips(ex: Ex, plan: Plan, now: bool) -> None:
    if now:
        ex.execute(plan)
        return
    ex.execute(plan)


def fine_walrus(ex: Ex, plan: Plan, make: Callable[[], Plan]) -> None:
    ex.execute(plan)
    if (plan := make()) is not None:
        ex.execute(plan)


def fine_tuple_rebind(ex: Ex, plan: Plan, make: Callable[[], Plan]) -> None:
    ex.execute(plan)
    plan, n = make(), 1
    ex.execute(plan)


def fine_star_rebind(ex: Ex, plan: Plan, make: Callable[[], list[Plan]]) -> None:
    ex.execute(plan)
    [*rest, plan] = make()
    ex.execute(plan)


def tuple_of_other_names(ex: Ex, plan: Plan, make: Callable[[], Plan]) -> None:
    ex.execute(plan)
    other, n = make(), 1
    ex.execute(plan)  # E: linear-reuse


def fine_nested_def(ex: Ex, plan: Plan) -> None:
    ex.execute(plan)

    def inner(p: Plan) -> None:
        ex.execute(p)


def in_a_dict_comprehension(ex: Ex, plan: Plan, n: int) -> None:
    {i: ex.execute(plan) for i in range(n)}  # E: linear-reuse


def fine_comprehension_over_executors(executors: Sequence[Ex], plan: Plan) -> None:
    {id(e): e.execute(plan) for e in executors}


def two_comprehensions_over_the_same_executors(executors: Sequence[Ex], plan: Plan) -> None:
    [e.execute(plan) for e in executors]
    list(e.execute(plan) for e in executors)  # E: linear-reuse


def in_a_generator(ex: Ex, plan: Plan, n: int) -> None:
    list(ex.execute(plan) for _ in range(n))  # E: linear-reuse


def a_tuple_holding_one(ex: Ex, pair: tuple[Plan, int]) -> None:
    ex.run_all(pair)
    ex.run_all(pair)  # E: linear-reuse


def an_optional_one(ex: Ex, plan: Plan | None) -> None:
    ex.run_maybe(plan)
    ex.run_maybe(plan)  # E: linear-reuse


def a_list_of_them(ex: Ex, plans: list[Plan]) -> None:
    ex.run_list(plans)
    ex.run_list(plans)  # E: linear-reuse


def fine_ints(ex: Ex, n: int) -> None:
    ex.run_any(n)
    ex.run_any(n)


def a_long_union(ex: Ex, value: Plan | int | str | bytes | float | complex | list[int] | dict[str, int] | None) -> None:
    ex.run_any(value)
    ex.run_any(value)  # E: linear-reuse


def retired_then_run(ex: Ex, pipe: Pipe, plan: Plan) -> None:
    pipe.withdraw(plan)
    ex.execute(plan)  # E: linear-reuse


def run_then_retired(ex: Ex, pipe: Pipe, plan: Plan) -> None:
    ex.execute(plan)
    pipe.withdraw(plan)  # E: linear-reuse


def fine_retired_on_another_path(ex: Ex, pipe: Pipe, plan: Plan, now: bool) -> None:
    if now:
        pipe.withdraw(plan)
    else:
        ex.execute(plan)


def attribute_executors(a: Ex, holder: Holder, plan: Plan) -> None:
    holder.ex.execute(plan)
    a.execute(plan)
    holder.ex.execute(plan)  # E: linear-reuse


def fine_indexed_executors(exs: list[Ex], plan: Plan) -> None:
    exs[0].execute(plan)
    exs[1].execute(plan)


def indexed_executor_twice(exs: list[Ex], plan: Plan) -> None:
    exs[0].execute(plan)
    exs[0].execute(plan)  # E: linear-reuse


def keyed_executor_twice(exs: dict[str, Ex], plan: Plan) -> None:
    exs["a"].execute(plan)
    exs["b"].execute(plan)
    exs["a"].execute(plan)  # E: linear-reuse


class Holder:
    def __init__(self, ex: Ex) -> None:
        self.ex = ex



PENDING: list[Plan] = []


class Store:
    def __init__(self, plan: Plan, n: int) -> None:
        self.n: int | Plan = n  # E: linear-escape
        self.items: list[Plan] = []  # E: linear-escape
        self.items.append(plan)  # E: linear-escape
        self.table: dict[int, Plan] = {}  # E: linear-escape
        self.table[0] = plan  # E: linear-escape
        self.table.setdefault(1, plan)  # E: linear-escape

    def later(self, k: int, plan: Plan) -> None:
        self.n = 3
        self.n = k
        self.n = -k if k else len(self.items)
        self.n = plan  # E: linear-escape


def into_a_parameter(out: list[Plan], plan: Plan) -> None:
    out.append(plan)  # E: linear-escape


def a_call_result_into_a_global(make: Callable[[], Plan]) -> None:
    PENDING.append(make())  # E: linear-escape


def fine_stores(make_list: Callable[[], list[Plan]], plan: Plan, store: Store) -> None:
    make_list().append(plan)
    local: list[Plan] = []
    local.insert(0, plan)


@linear
class Batcher:
    def __init__(self) -> None:
        self.items: list[Plan] = []

    def add(self, plan: Plan) -> None:
        self.items.append(plan)


EX = "ex"


class Marks:
    @consumes_on(EX)  # E: linear-mark
    def a(self, ex: Ex, plan: Plan) -> None: ...

    @consumes_on("pool")  # E: linear-mark
    def b(self, ex: Ex, plan: Plan) -> None: ...

    @consumes_on(executor="ex")  # E: linear-mark
    def c(self, ex: Ex, plan: Plan) -> None: ...


@retires  # E: linear-mark
def withdraw_anywhere(plan: Plan) -> None: ...


class SubEx(Ex):
    pass


class OverEx(Ex):
    def execute(self, plan: Plan) -> None: ...


def inherited_consumer(sub: SubEx, over: OverEx, plan: Plan) -> None:
    sub.execute(plan)
    over.execute(plan)
    sub.execute(plan)  # E: linear-reuse
    over.execute(plan)  # E: linear-reuse


_MODULE_PLAN = Plan()
PENDING.append(_MODULE_PLAN)  # E: linear-escape
'''

_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<msg>.*)  \[(?P<code>[a-z-]+)\]$")


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    d = tmp_path_factory.mktemp("linear_flow")
    program = d / "flow_program.py"
    program.write_text(textwrap.dedent(PROGRAM))
    config = d / "mypy.ini"
    config.write_text(f"[mypy]\nplugins = {ROOT / 'ir' / 'mypy_linear.py'}\nmypy_path = {ROOT}\n")
    out, err, _ = api.run(["--config-file", str(config), "--cache-dir", str(d / "cache"), "--no-error-summary", "--show-error-codes", str(program)])
    assert not err, err
    return program, out


def test_the_plugin_refuses_exactly_the_marked_lines(checked: tuple[Path, str]) -> None:
    program, out = checked
    expected = {
        (n, m.group(1)) for n, line in enumerate(program.read_text().splitlines(), 1) for m in [re.search(r"# E: ([a-z-]+)$", line)] if m
    }
    found = {(int(m["line"]), m["code"]) for line in out.splitlines() for m in [_ERROR.match(line)] if m}
    assert found == expected, out
    assert len(out.splitlines()) == len(expected), out


def test_the_messages_name_the_retirement_and_the_mark(checked: tuple[Path, str]) -> None:
    _, out = checked
    assert re.search(r'"pair" \(tuple\[Plan, int\]\) is consumed again by "ex"', out), out
    assert re.search(r'"plan" \(Plan \| None\) is consumed again by "ex"', out), out
    assert re.search(r'"value" \(a type that may hold Plan\) is consumed again by "ex"', out), out
    assert re.search(r"consumes_on takes the executor's parameter name as a literal string", out), out
    assert re.search(r'"b" has no parameter "pool" to consume on', out), out
    assert re.search(r'"withdraw_anywhere" is marked as consuming, but only methods can be', out), out
    assert re.search(r'"plan" \(Plan\) is stored in "self\.items", a container that outlives this function', out), out
    assert re.search(r'"n" \(int \| Plan\) is stored in attribute "self\.n" of "Store", which outlives the step', out), out
    # a store names the stored value's own type, not the attribute's wider one
    assert re.search(r'"plan" \(Plan\) is stored in attribute "self\.n" of "Store", which outlives the step', out), out
    assert re.search(r'"plan" \(Plan\) is stored in "out", a container', out), out
    assert re.search(r'A value of type "Plan" is stored in "PENDING", a container', out), out
