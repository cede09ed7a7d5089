"""The linear-use plugin (``ir.mypy_linear``) on small self-contained programs, in a second or two.

``tests/test_typecheck.py`` checks the plugin against the library's own types, which takes mypy
minutes (torch); here the programs declare their own ``@linear`` classes and consumers, so mypy
analyses only them and ``ir.linear``. Each line that must be refused ends in ``# E: <code>``; every
other line must pass. The rules covered: a second consumption on one executor along some path
(sequence, across a ``del``, loop, branches, ``try``, comprehension, ``@consumes_on``, a field read twice from one
binding), what is not one (another executor, a rebound name, a loop over executors, the fields of two values), stores that outlive the step (attributes, ``+=`` on one,
non-local containers, fields of a class that is not ``@linear``), the hatches (``stash``,
``@keeps_linear``, ``None``), and markers the plugin cannot honour.
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
from dataclasses import dataclass

from ir.linear import consumes, consumes_on, keeps_linear, linear, stash


@linear
class Plan:
    def __init__(self, n: int) -> None:
        self.n = n


@linear
class Bundle:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan


class Ex:
    @consumes
    def execute(self, plan: Plan) -> None: ...

    @consumes
    def run_prefill(self, plan: Plan) -> None: ...


class Ledger:
    @consumes_on("pool")
    def claim(self, plan: Plan, pool: str) -> None: ...


class Runner:
    @consumes_on("ex")
    def run(self, ex: Ex, plan: Plan) -> None: ...


PENDING: list[Plan] = []


def twice(ex: Ex, plan: Plan) -> None:
    ex.execute(plan)
    ex.execute(plan)  # E: linear-reuse


def again_after_a_del(ex: Ex, plan: Plan, scratch: list[int]) -> None:
    ex.execute(plan)
    del scratch[0]
    ex.execute(plan)  # E: linear-reuse


def in_a_loop(ex: Ex, plan: Plan) -> None:
    for _ in range(2):
        ex.run_prefill(plan)  # E: linear-reuse


def after_either_branch(ex: Ex, plan: Plan, first: bool) -> None:
    if first:
        ex.execute(plan)
    else:
        ex.run_prefill(plan)
    ex.execute(plan)  # E: linear-reuse


def again_in_except(ex: Ex, plan: Plan) -> None:
    try:
        ex.execute(plan)
    except RuntimeError:
        ex.execute(plan)  # E: linear-reuse


def in_a_comprehension(ex: Ex, plan: Plan, n: int) -> None:
    [ex.execute(plan) for _ in range(n)]  # E: linear-reuse


def claimed_twice_on_one_pool(ledger: Ledger, plan: Plan) -> None:
    ledger.claim(plan, "target")
    ledger.claim(plan, "draft")
    ledger.claim(plan, "target")  # E: linear-reuse


def run_twice_on_one_executor(runner: Runner, ex: Ex, other: Ex, plan: Plan) -> None:
    runner.run(ex, plan)
    runner.run(other, plan)
    runner.run(ex, plan)  # E: linear-reuse


class Engine:
    def __init__(self, target: Ex, draft: Ex) -> None:
        self.target, self.draft = target, draft
        self.inflight: list[Plan] = stash([])
        self.last: Plan | None = None

    def step(self, plan: Plan) -> None:
        self.target.execute(plan)
        self.draft.execute(plan)
        self.inflight.append(stash(plan))
        self.last = None
        self.target.execute(plan)  # E: linear-reuse

    def keep(self, plan: Plan) -> None:
        self.last = plan  # E: linear-escape
        self.inflight.append(plan)  # E: linear-escape

    def keep_more(self, plan: Plan) -> None:
        self.inflight += [plan]  # E: linear-escape


class Holder:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan  # E: linear-escape


def store_elsewhere(holder: Holder, plan: Plan, table: dict[int, Plan]) -> None:
    holder.plan = plan  # E: linear-escape
    PENDING.append(plan)  # E: linear-escape
    table[0] = plan  # E: linear-escape


@dataclass
class Step:
    plan: Plan  # E: linear-escape


@keeps_linear
class Keeper:
    def __init__(self) -> None:
        self.plans: dict[int, Plan] = {}

    def keep(self, key: int, plan: Plan) -> None:
        self.plans[key] = plan


def a_field_twice(ex: Ex, bundle: Bundle) -> None:
    ex.execute(bundle.plan)
    ex.execute(bundle.plan)  # E: linear-reuse


def fine_fields_of_two_values(ex: Ex, a: Bundle, b: Bundle, make: Callable[[], Bundle]) -> None:
    ex.execute(a.plan)
    ex.execute(b.plan)
    a = make()
    ex.execute(a.plan)


@consumes  # E: linear-mark
def module_level(plan: Plan) -> None: ...


class BadMark:
    @consumes_on("pool")  # E: linear-mark
    def run(self, ex: Ex, plan: Plan) -> None: ...


def fine_one_per_executor(executors: Sequence[Ex], a: Ex, b: Ex, plan: Plan) -> None:
    a.execute(plan)
    b.execute(plan)
    for ex in executors:
        ex.execute(plan)


def fine_rebound(ex: Ex, make: Callable[[], Plan], plans: Sequence[Plan]) -> None:
    plan = make()
    ex.execute(plan)
    plan = make()
    ex.execute(plan)
    for _ in range(3):
        plan = make()
        ex.execute(plan)
    [ex.execute(p) for p in plans]


def fine_one_path_each(ex: Ex, plan: Plan, now: bool) -> None:
    if now:
        ex.execute(plan)
        return
    ex.execute(plan)


def fine_other_executors_each_time(get: Callable[[], Ex], plan: Plan) -> None:
    get().execute(plan)


def fine_local_containers(plans: Sequence[Plan]) -> list[Plan]:
    kept: list[Plan] = []
    by_key: dict[int, Plan] = {}
    for i, plan in enumerate(plans):
        kept.append(plan)
        by_key[i] = plan
    return kept


def fine_bundled(plan: Plan) -> Bundle:
    return Bundle(plan)
'''

_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<msg>.*)  \[(?P<code>[a-z-]+)\]$")


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    d = tmp_path_factory.mktemp("linear")
    program = d / "program.py"
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
    assert len(out.splitlines()) == len(expected), out  # one error per refused line, nothing else


def test_the_messages_name_the_value_and_the_first_use(checked: tuple[Path, str]) -> None:
    program, out = checked
    lines = program.read_text().splitlines()
    first = lines.index("    ex.execute(plan)", lines.index("def twice(ex: Ex, plan: Plan) -> None:")) + 1
    assert re.search(
        rf'^.*:{first + 1}: error: "plan" \(Plan\) is consumed again by "ex": line {first} consumed it on a path to here; '
        r"one-shot tickets run once per executor \(rebind it to a new plan; see the batchc guide "
        r'"The linearity checker in your mypy CI", or: python -m pydoc ir\.mypy_linear\)  \[linear-reuse\]$',
        out,
        re.M,
    ), out
    assert re.search(r'"plan" \(Plan\) is consumed by "ex" in a loop without being rebound', out), out
    assert re.search(r'"bundle\.plan" \(Plan\) is consumed again by "ex": line \d+ consumed it on a path to here', out), out
    assert re.search(r'"plan" \(Plan\) is stored in attribute "self\.plan" of "Holder", which outlives the step', out), out
    assert re.search(r'"plan" \(Plan\) is stored in "PENDING", a container that outlives this function', out), out
    assert re.search(r'Field "plan" of "Step" holds Plan, a linear value, but "Step" is not declared @linear', out), out
