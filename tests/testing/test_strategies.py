"""The shipped hypothesis strategies (``compiler.testing.strategies``).

- Every node kind the printer prints has a strategy (``NODE_STRATEGIES``, ``strategy_for``), and its
  nodes are valid by construction: the whole-node verifier accepts every batch and plan, the text
  form and (for plans) the wire form round-trip, and the nodes hold what the passes would produce
  (a prefill's init ops are exactly its rows' intents, a commit releases exactly its rejected
  positions, a mixed plan keeps one sample id).
- Sizes stay in the bounds asked for and shrink towards the smallest batch; the largest sizes the
  checks accept (batches and step sequences) are drawn under hypothesis's health checks, and ids,
  slots and KV locations range over their whole span in any order.
- An impossible shape is refused when the strategy is built, in one line naming the argument.
- The module (and the runner) load no torch.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any, get_args

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from typeguard import suppress_type_checks

import compiler.testing.strategies as S
from ir.batch import ExtendBatch
from ir.head import HeadExtendBatch
from ir.init import InitIntent, MambaInit, Ticket
from ir.nodes import NODE_TYPES, Plan
from ir.parse import parse
from ir.printer import PRINTABLE, dump
from ir.spec import CommitBatch, Proposals
from ir.verify import verify
from ir.wire import pack, unpack

FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PLANS = get_args(Plan)


def test_every_printable_kind_has_a_strategy_and_strategy_for_finds_it() -> None:
    assert set(S.NODE_STRATEGIES) == set(PRINTABLE)
    for name, cls in PRINTABLE.items():
        assert S.strategy_for(cls) is S.NODE_STRATEGIES[name]
    assert S.strategy_for(Ticket[MambaInit]) is S.NODE_STRATEGIES["Ticket"]
    with pytest.raises(TypeError):
        S.NODE_STRATEGIES["ExtendBatch"] = S.extend_batches()  # type: ignore[index]  # read-only


@pytest.mark.parametrize(
    ("arg", "error", "message"),
    [
        (int, LookupError, r"^strategy_for: no strategy for builtins\.int "),
        (Proposals, LookupError, r"^strategy_for: no strategy for ir\.spec\.Proposals "),
        (3, TypeError, r"^strategy_for: node_type must be an IR node class, got 3 \(int\)$"),
    ],
)
def test_strategy_for_names_a_type_it_has_no_strategy_for(arg: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message) as info, suppress_type_checks():  # (typeguard would refuse the argument first)
        S.strategy_for(arg)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", sorted(S.NODE_STRATEGIES))
def test_nodes_are_valid_and_round_trip(kind: str) -> None:
    @FAST
    @given(S.NODE_STRATEGIES[kind], st.integers(0, 2**63 - 1))
    def check(node: Any, step: int) -> None:
        assert type(node).__name__ == kind
        if isinstance(node, NODE_TYPES):
            verify(node)
        assert parse(dump(node, exact=True)) == node
        if isinstance(node, PLANS):
            plan: Plan = node
            assert unpack(pack(step, plan), expect_step=step).plan == plan

    check()


def _prefill_rows_are_what_prepare_for_extend_gives(batch: ExtendBatch | HeadExtendBatch) -> None:
    intents, slots = batch.intents, batch.slots.tolist()
    for intent, prefix in zip(intents, batch.prefix_lens.tolist(), strict=True):
        assert (prefix == 0) == (intent is InitIntent.CLEAR)
    init = batch.init
    if init is None:
        assert all(i is InitIntent.CONTINUE for i in intents)
        return
    assert list(init.clear_slots) == [s for s, i in zip(slots, intents, strict=True) if i is InitIntent.CLEAR]
    assert list(init.cow_dst) == [s for s, i in zip(slots, intents, strict=True) if i is InitIntent.COW]
    assert not set(init.cow_src) & set(slots)
    if batch.snapshot is not None:
        assert set(batch.snapshot.src) <= set(slots) and not set(batch.snapshot.dst) & (set(slots) | set(init.cow_src))
        assert batch.snapshot.serial != init.serial


@FAST
@given(st.one_of(S.extend_batches(), S.head_extend_batches(), S.mixed_batches().map(lambda m: m.extend)))
def test_a_prefill_carries_exactly_the_ops_its_rows_ask_for(batch: ExtendBatch | HeadExtendBatch) -> None:
    _prefill_rows_are_what_prepare_for_extend_gives(batch)


@FAST
@given(S.extend_plans(pools=("p", "q", "r")))
def test_a_lowered_prefill_has_one_ticket_per_pool_for_each_op(plan: Any) -> None:
    slots = set(plan.slots.tolist())
    for field in (plan.tickets, plan.snapshots):
        assert len({t.pool for t in field}) == len(field) and len({t.op for t in field}) <= 1
    if plan.tickets and plan.snapshots:
        assert {t.pool for t in plan.tickets} == {t.pool for t in plan.snapshots} <= {"p", "q", "r"}
        assert plan.tickets[0].serial != plan.snapshots[0].serial
    for t in plan.tickets:
        assert set(t.op.clear_slots) | set(t.op.cow_dst) <= slots and not set(t.op.cow_src) & slots
    for t in plan.snapshots:
        assert set(t.op.src) <= slots and not set(t.op.dst) & slots


@FAST
@given(S.mixed_plans())
def test_a_mixed_plan_keeps_one_sample_and_no_row_twice(plan: Any) -> None:
    assert plan.extend.sample_id == plan.decode.sample_id
    assert plan.decode.inputs_from is None or plan.decode.inputs_from != plan.decode.sample_id
    assert not set(plan.extend.slots.tolist()) & set(plan.decode.slots.tolist())
    cow_src = {s for t in plan.extend.tickets for s in t.op.cow_src}
    assert not cow_src & set(plan.decode.slots.tolist())


@FAST
@given(S.commit_batches())
def test_a_commit_releases_exactly_its_rejected_positions(batch: CommitBatch) -> None:
    window = batch.kv_locs.reshape(batch.num_requests, batch.k + 1)
    keep = np.arange(batch.k + 1)[None, :] <= batch.accept_pos[:, None]
    assert batch.released_kv.tolist() == window[~keep].tolist()


@pytest.mark.parametrize(
    ("make", "rows", "max_k"),
    [
        (lambda: S.extend_batches(min_rows=2, max_rows=3, max_extend=2), (2, 3), None),
        (lambda: S.decode_batches(min_rows=0, max_rows=2), (0, 2), None),
        (lambda: S.decode_plans(min_rows=5, max_rows=5), (5, 5), None),
        (lambda: S.verify_batches(min_rows=1, max_rows=2, max_k=1), (1, 2), 1),
        (lambda: S.head_commit_batches(min_rows=3, max_rows=4, max_k=2), (3, 4), 2),
    ],
)
def test_sizes_stay_in_bounds(make: Callable[[], st.SearchStrategy[Any]], rows: tuple[int, int], max_k: int | None) -> None:
    @FAST
    @given(make())
    def check(node: Any) -> None:
        assert rows[0] <= node.num_requests <= rows[1]
        if max_k is not None:
            assert 1 <= node.k <= max_k
        if isinstance(node, ExtendBatch):
            assert set(node.extend_lens.tolist()) <= {1, 2}

    check()


_EXTEND_SHAPED = ["extend_batches", "extend_plans", "draft_extend_batches", "draft_extend_plans", "head_extend_batches", "head_extend_plans"]
_SPEC_SHAPED = ["draft_batches", "verify_batches", "commit_batches", "draft_commit_batches", "draft_plans", "verify_plans", "commit_plans",
                "draft_commit_plans", "head_commit_batches", "head_commit_plans"]
_EXTEND_ROWS = S.MAX_MIN_BATCH // (S.MAX_EXTEND + S.ROW_VALUES)
_SPEC_ROWS, _SPEC_ROWS_AT_1 = S.MAX_MIN_BATCH // (64 + S.SPEC_ROW_VALUES), S.MAX_MIN_BATCH // (1 + S.SPEC_ROW_VALUES)
_LARGEST = [
    *((name, {"min_rows": _EXTEND_ROWS, "max_rows": _EXTEND_ROWS, "max_extend": S.MAX_EXTEND}) for name in _EXTEND_SHAPED),
    ("extend_plans", {"min_rows": S.MAX_MIN_BATCH // (4 + S.ROW_VALUES), "max_rows": S.MAX_MIN_BATCH // (4 + S.ROW_VALUES), "max_extend": 4}),
    *((name, {"min_rows": _SPEC_ROWS, "max_rows": _SPEC_ROWS, "max_k": 64}) for name in _SPEC_SHAPED),
    *((name, {"min_rows": _SPEC_ROWS_AT_1, "max_rows": _SPEC_ROWS_AT_1, "max_k": 1}) for name in _SPEC_SHAPED),
    ("decode_batches", {"min_rows": S.MAX_ROWS, "max_rows": S.MAX_ROWS}),
    ("decode_plans", {"min_rows": S.MAX_ROWS, "max_rows": S.MAX_ROWS}),
    ("accept_results", {"min_rows": S.MAX_ROWS, "max_rows": S.MAX_ROWS}),
    ("mixed_plans", {"max_rows": S.MAX_ROWS, "max_extend": S.MAX_EXTEND}),
    ("sampling_rows", {"rows": S.MAX_ROWS}),
]


@pytest.mark.parametrize(("name", "kwargs"), _LARGEST, ids=[f"{n}-{'-'.join(map(str, kw.values()))}" for n, kw in _LARGEST])
def test_the_largest_sizes_a_strategy_takes_are_drawn(name: str, kwargs: dict[str, int]) -> None:
    """A size the argument checks accept is one hypothesis can draw, under its default health checks
    (a batch forced to many rows was rejected as filtered or too large on every draw)."""
    seen: list[int] = []

    @settings(max_examples=2, deadline=None, database=None, derandomize=True)  # (its health checks all on; the same draws every run)
    @given(getattr(S, name)(**kwargs))
    def draw(node: Any) -> None:
        seen.append(node.num_requests if hasattr(node, "num_requests") else len(node.temperature) if hasattr(node, "temperature") else 0)
        if isinstance(node, PLANS):
            verify(node)

    draw()
    forced = kwargs.get("min_rows", kwargs.get("rows"))
    assert seen and (forced is None or all(n == forced for n in seen)), seen


@pytest.mark.parametrize(
    ("what", "condition"),
    [
        ("a request id past 2**39", lambda b: b.rids.max() > 2**39),
        ("a request id below -2**39", lambda b: b.rids.min() < -(2**39)),
        ("a slot past 9000", lambda b: b.slots.max() > 9000),
        ("a KV location past 900000", lambda b: b.kv_locs.max() > 900_000),
        ("request ids out of order", lambda b: bool((np.diff(b.rids) < 0).any())),
        ("slots out of order", lambda b: bool((np.diff(b.slots) < 0).any())),
    ],
)
def test_ids_slots_and_locations_range_over_their_whole_span(what: str, condition: Callable[[Any], bool]) -> None:
    """Distinct by construction, not confined to a corner: large and negative ids, high slots and
    locations, rows in any order."""
    # derandomized: the same draws every run, so no false failures; each condition held in 2 to 5 of
    # every hundred draws (measured over 1000), and find stops at the first of up to 2000
    quiet = settings(database=None, max_examples=2000, phases=[Phase.generate], suppress_health_check=list(HealthCheck), derandomize=True)
    assert find(S.decode_batches(min_rows=2), condition, settings=quiet) is not None, what


def test_the_largest_mixed_forward_stays_in_range() -> None:
    @settings(max_examples=3, deadline=None, database=None)
    @given(S.mixed_plans(max_rows=S.MAX_ROWS, max_extend=S.MAX_EXTEND))
    def check(plan: Any) -> None:
        verify(plan)  # (the parts share no request, slot or KV location)
        for part in (plan.extend, plan.decode):
            if part.num_requests:
                assert 1 <= part.slots.min() and part.slots.max() <= 10_000 and 0 <= part.kv_locs.min() and part.kv_locs.max() <= 1_000_000
                assert -(2**40) <= part.rids.min() and part.rids.max() <= 2**40

    check()


_LONGEST = [
    {"min_steps": S.MAX_MIN_STEPS, "max_steps": S.MAX_MIN_STEPS},
    {"capacity": 10_000, "max_batch": 204, "max_chunk": 1, "max_k": 64, "min_steps": S.MAX_MIN_STEPS, "max_steps": 1000},
    {"capacity": 10_000, "max_batch": 3, "max_chunk": 64, "max_k": 64, "vocab": 2**31, "max_steps": 1000},
    {"capacity": 10_000, "max_batch": 15, "max_chunk": 64, "min_steps": S.MAX_MIN_STEPS, "max_steps": 1000, "speculative": False},
]


@pytest.mark.parametrize("kwargs", _LONGEST, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_the_longest_step_sequences_it_takes_are_drawn(kwargs: dict[str, Any]) -> None:
    """Long sequences of the largest steps fit one example: the running batch is capped by what a
    step holds and the steps by what the sequence has left (such sequences overran hypothesis's
    budget on every draw: a speculative step over 230 running rows asked for 14,720 drafts)."""
    lengths: list[int] = []

    @settings(max_examples=2, deadline=None, database=None, derandomize=True)  # (its health checks all on; the same draws every run)
    @given(S.step_sequences(**kwargs))
    def draw(sequence: S.StepSequence) -> None:
        lengths.append(len(sequence))

    draw()
    assert lengths


def test_batches_shrink_towards_the_fewest_rows() -> None:
    quiet = settings(database=None, max_examples=50, suppress_health_check=list(HealthCheck))
    assert find(S.decode_batches(max_rows=4), lambda b: b.num_requests >= 2, settings=quiet).num_requests == 2
    commit = find(S.commit_batches(), lambda b: b.num_requests >= 1, settings=quiet)
    assert (commit.num_requests, commit.k) == (1, 1)
    sequence = find(S.step_sequences(max_steps=5), lambda s: len(s) >= 2, settings=quiet)
    assert len(sequence) == 2 and sequence.describe().splitlines()[0] == "0: prefill [r0@s1 clear +1]"


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: S.extend_batches(min_rows=3, max_rows=2), ValueError, r"^extend_batches: min_rows=3 > max_rows=2$"),
        (lambda: S.extend_batches(min_rows=0), ValueError, r"^extend_batches: min_rows must be in \[1, 256\], got 0$"),
        (lambda: S.decode_batches(max_rows=-1), ValueError, r"^decode_batches: max_rows must be in \[0, 256\], got -1$"),
        (lambda: S.decode_batches(max_rows=True), TypeError, r"^decode_batches: max_rows must be an int, got True \(bool\)$"),
        (lambda: S.extend_batches(max_extend=0), ValueError, r"^extend_batches: max_extend must be in \[1, 64\], got 0$"),
        (lambda: S.verify_batches(max_k=65), ValueError, r"^verify_batches: max_k must be in \[1, 64\], got 65$"),
        (lambda: S.extend_plans(pools=("target", 3)), TypeError, r"^extend_plans: pools\[1\] must be a pool name \(str\), got 3 \(int\)$"),
        (lambda: S.extend_plans(pools="target"), TypeError, r"^extend_plans: pools must be a sequence of pool names \(str\), got 'target' \(str\)$"),
        (lambda: S.mixed_plans(pools=()), ValueError, r"^mixed_plans: pools must name at least one pool, got \(\)$"),
        (lambda: S.head_extend_plans(pools=("a", "")), ValueError, r"^head_extend_plans: pools\[1\] must be a non-empty pool name, got ''$"),
        (lambda: S.tickets(pools=("a", "a")), ValueError, r"^tickets: pools must be distinct, got 'a' twice$"),
        (lambda: S.sampling_rows(-1), ValueError, r"^sampling_rows: rows must be in \[0, 256\], got -1$"),
        (lambda: S.extend_batches(min_rows=16, max_rows=20, max_extend=64), ValueError,
         r"^extend_batches: min_rows=16 rows of up to max_extend=64 tokens may not fit one hypothesis example \(min_rows \* \(max_extend \+ 4\) "
         r"must be at most 1024; lower either\)$"),
        (lambda: S.verify_batches(min_rows=15, max_rows=16, max_k=64), ValueError,
         r"^verify_batches: min_rows=15 rows of up to max_k=64 drafts may not fit one hypothesis example \(min_rows \* \(max_k \+ 6\) must"),
        (lambda: S.commit_batches(min_rows=147, max_rows=200, max_k=1), ValueError, r"^commit_batches: min_rows=147 rows of up to max_k=1 drafts"),
        (lambda: S.admitted_requests(max_tokens=1.5), TypeError, r"^admitted_requests: max_tokens must be an int, got 1\.5 \(float\)$"),
        (lambda: S.step_sequences(capacity=1), ValueError, r"^step_sequences: capacity must be in \[2, 10000\], got 1$"),
        (lambda: S.step_sequences(min_steps=4, max_steps=3), ValueError, r"^step_sequences: min_steps=4 > max_steps=3$"),
        (lambda: S.step_sequences(min_steps=101, max_steps=200), ValueError, r"^step_sequences: min_steps must be in \[0, 100\], got 101$"),
        (lambda: S.step_sequences(max_batch=16, max_chunk=64, vocab=2**31), ValueError,
         r"^step_sequences: a prefill of max_batch=16 requests of up to max_chunk=64 tokens below vocab=2147483648 may not fit one "
         r"hypothesis example \(max_batch \* \(max_chunk \* 4 \+ 4\) must be at most 1024"),
        (lambda: S.step_sequences(chunked=1), TypeError, r"^step_sequences: chunked must be a bool, got 1 \(int\)$"),
    ],
)
def test_an_impossible_shape_is_refused_when_the_strategy_is_built(build: Callable[[], object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message) as info, suppress_type_checks():  # (a user's call is not type-checked at run time)
        build()  # (building, not drawing: nothing is drawn here)
    assert "\n" not in str(info.value)


def test_the_strategies_and_the_runner_load_no_torch() -> None:
    code = "import sys, compiler.testing.strategies, compiler.testing.runner, compiler.testing.golden; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
