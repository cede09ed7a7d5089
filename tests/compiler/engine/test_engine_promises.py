"""What the engine's modules promise, each at its bound: every refusal of ``check_engine_args``,
``check_request`` and ``checked_prompt`` triggered just outside its bound and not just inside (the
bad value named); ``Pipeline.withdraw``'s check that a plan was lowered from its batch, each of its
halves on its own; and engine runs compared with an independent reference (the from-scratch greedy
model, one request at a time), with the engine's ledger drained and its slots and KV free after."""

from __future__ import annotations

from functools import cache
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from typeguard import suppress_type_checks

from backend.boundary import BackendBroken, Pending
from backend.counts import TokenCounts
from backend.hybrid.head import HeadConfig, HeadModel
from backend.hybrid.reference import greedy_generate_reference, reference_logits
from backend.ledger import Ledger
from backend.transports import in_process
from compiler.engine import Engine
from compiler.engine.admission import (
    MAX_CAPACITY,
    MAX_K,
    MAX_KV_CAPACITY,
    MAX_LEN,
    MAX_POOL_BYTES,
    MAX_RETRIES,
    MAX_STOPS,
    MAX_TABLE_ENTRIES,
    check_engine_args,
    check_request,
    checked_prompt,
)
from compiler.engine.config import DEFAULT_PREFILL_STREAK, ServeConfig
from compiler.engine.nonfinite import bonus_tokens
from compiler.engine.policy import ALTERNATE, DEFAULT_POLICY, MAX_STREAK, PrefillFirst, prefill_first
from compiler.engine.report import PrefixState, SpecStats, StepKind, StepReport
from compiler.engine.requests import Request, RequestTable
from compiler.engine.runner import ForwardRunner, StepFailed, Submitted, cause_words
from compiler.manager import PassManager
from compiler.prefix_cache import CacheEntry, PrefixCache, PrefixCacheError
from compiler.steps import Pipeline
from compiler.workload import LONGEST_BUILTIN_PROMPT
from ir.columns import frozen_i64
from ir.errors import IRValidationError, PlanExecutionError, PreconditionError, SlotError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, RequestId
from ir.plan import DecodePlan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.sampling import GREEDY, SEED_MAX, SamplingParams
from passes.prepare_for_extend import prepare_for_extend
from tests.compiler.engine.test_engine_inline_processes import InlineBackend, _inline
from tests.compiler.engine.test_engine_units import FlakyBackend, _plan
from tests.helpers import engine, greedy_reference, tiny_models
from tests.scenarios.state_checks import sensitive_models

# -- check_engine_args: every bound, just inside accepted and just outside refused -----------------


@attrs.frozen
class _Layout:
    row_bytes: int


@attrs.frozen
class _StubModel:
    """A ``ServedModel`` by its methods, with the vocabulary and state row size a bound needs: the
    argument checks read only those (nothing is allocated before they pass)."""

    vocab: int = 256
    row_bytes: int = 64

    def pool_layout(self) -> _Layout:
        return _Layout(self.row_bytes)

    def new_pool(self, capacity: int, *, pool_id: object) -> object:
        raise AssertionError("the argument checks allocate nothing")

    def serving_hook(self, *, capacity: int, kv_capacity: int, max_len: int) -> object:
        raise AssertionError("the argument checks allocate nothing")


def _check(**kw: Any) -> None:
    """``check_engine_args`` over the tiny models with valid arguments but those in ``kw``."""
    target, draft = tiny_models()
    args: dict[str, Any] = {
        "target": target, "draft": draft, "k": 2, "capacity": 4, "kv_capacity": 64, "max_len": 32, "chunk_size": None,
        "token_budget": None, "prefix_cache": None, "retries": 0, "mixed": True, "pm": None, "transport": in_process(),
        "policy": DEFAULT_POLICY, "seed": 0, "penalties": False, **kw,
    }
    check_engine_args(args.pop("target"), args.pop("draft"), **args)


def _refused(match: str, **kw: Any) -> None:
    with pytest.raises(PreconditionError, match=r"^Engine: " + match):
        _check(**kw)


def test_valid_engine_arguments_pass() -> None:
    _check()
    _check(k=0, draft=None)


@pytest.mark.parametrize(("name", "lo", "hi", "extra"), [
    ("k", 0, MAX_K, {"max_len": MAX_K + 3}),
    ("capacity", 1, MAX_CAPACITY, {"max_len": 8}),
    ("kv_capacity", 1, MAX_KV_CAPACITY, {}),
    ("retries", 0, MAX_RETRIES, {}),
])
def test_each_bounded_count_takes_both_ends_and_refuses_one_beyond_each(name: str, lo: int, hi: int, extra: dict[str, Any]) -> None:
    for ok in (lo, hi):
        _check(**{name: ok, **extra})
    for bad in (lo - 1, hi + 1):
        _refused(rf"{name} must be in \[{lo}, {hi}\], got {bad}$", **{name: bad, **extra})


def test_max_len_runs_from_k_plus_3_to_its_bound() -> None:
    for k in (0, 2, MAX_K):
        _check(k=k, max_len=k + 3)
        _refused(rf"max_len {k + 2} leaves no room for a prompt token and a new token next to the k \+ 1 = {k + 1} speculative positions$",
                 k=k, max_len=k + 2)
    _check(k=0, max_len=MAX_LEN, capacity=1)
    _refused(rf"max_len must be in \[1, {MAX_LEN}\], got {MAX_LEN + 1}$", k=0, max_len=MAX_LEN + 1, capacity=1)


def test_the_token_table_bound_is_capacity_plus_one_times_max_len() -> None:
    length = MAX_LEN  # 2**20: (capacity + 1) * length reaches 2**31 at capacity 2**11 - 1
    at_bound = MAX_TABLE_ENTRIES // length - 1
    _check(capacity=at_bound, max_len=length)
    _refused(rf"\(capacity \+ 1\) \* max_len = {(at_bound + 2) * length} token-table entries, over the bound {MAX_TABLE_ENTRIES}$",
             capacity=at_bound + 1, max_len=length)


@pytest.mark.parametrize("name", ["chunk_size", "token_budget"])
def test_chunk_size_and_token_budget_are_none_or_at_least_one(name: str) -> None:
    _check(**{name: None})
    _check(**{name: 1})
    _check(**{name: 10**9})  # (no upper bound)
    _refused(rf"{name} must be >= 1, got 0$", **{name: 0})
    _refused(rf"{name} must be an int, not bool \(got True\)$", **{name: True})


@pytest.mark.parametrize("which", ["target", "draft"])
def test_each_models_state_pool_is_bounded_in_bytes(which: str) -> None:
    half = MAX_POOL_BYTES // 2  # capacity 1: the pool has 2 rows (the padding row counted)
    _check(capacity=1, **{which: _StubModel(row_bytes=half)})
    _refused(rf"capacity 1: the {which}'s state pool would take {2 * (half + 1)} bytes, over the bound {MAX_POOL_BYTES}$",
             capacity=1, **{which: _StubModel(row_bytes=half + 1)})


def test_the_drafts_pool_and_vocabulary_do_not_matter_without_speculation() -> None:
    huge = _StubModel(vocab=7, row_bytes=MAX_POOL_BYTES)
    _check(k=0, draft=huge)  # not served at k = 0
    _refused(r"draft vocabulary 7 differs from the target's 256$", k=2, draft=huge)
    _refused(r"speculative decoding \(k = 1\) needs a draft model, got draft=None$", k=1, draft=None)


def test_the_penalties_token_counts_are_bounded_in_bytes() -> None:
    per_slot = TokenCounts.nbytes(1, 1)  # capacity 1: bytes per vocabulary entry
    vocab = MAX_POOL_BYTES // per_slot
    wide = _StubModel(vocab=vocab)
    _check(k=0, draft=None, target=wide, capacity=1, penalties=True)
    over = _StubModel(vocab=vocab + 1)
    _check(k=0, draft=None, target=over, capacity=1, penalties=False)  # without penalties no counts are kept
    _refused(rf"capacity 1: the penalties' token counts would take {TokenCounts.nbytes(1, vocab + 1)} bytes, over the bound {MAX_POOL_BYTES}$",
             k=0, draft=None, target=over, capacity=1, penalties=True)


@pytest.mark.parametrize(("name", "value", "match"), [
    ("penalties", 1, r"penalties must be a bool, not int \(got 1\)$"),
    ("penalties", None, r"penalties must be a bool, not NoneType \(got None\)$"),
    ("mixed", 0, r"mixed must be a bool, not int \(got 0\)$"),
    ("policy", None, r"policy must be a SchedulePolicy \(compiler\.engine\.policy\), not NoneType \(got None\)$"),
    ("transport", None, r"transport must be a backend\.boundary\.Transport, not NoneType \(got None\)$"),
    ("transport", "local", r"transport must be a backend\.boundary\.Transport, not str \(got 'local'\)$"),
    ("prefix_cache", 3, r"prefix_cache must be a PrefixCache or None, not int \(got 3\)$"),
    ("pm", 3, r"pm must be a PassManager or None, not int \(got 3\)$"),
    ("seed", -1, r"seed must be an int in \[0, 2\*\*63 - 1\] \(got -1\)$"),
    ("seed", SEED_MAX + 1, r"seed must be an int in \[0, 2\*\*63 - 1\] \(got 9223372036854775808\)$"),
    ("seed", 1.0, r"seed must be an int in \[0, 2\*\*63 - 1\] \(got 1\.0\)$"),
    ("seed", True, r"seed must be an int in \[0, 2\*\*63 - 1\] \(got True\)$"),
])
def test_each_typed_argument_is_refused_naming_it_and_the_value(name: str, value: object, match: str) -> None:
    _refused(match, **{name: value})


def test_the_switches_and_seed_take_their_whole_range() -> None:
    for on in (True, False):
        _check(penalties=on, mixed=on)
    for seed in (0, SEED_MAX, np.int64(7)):
        _check(seed=seed)
    _check(pm=PassManager(verify_level=0))


# -- check_request and checked_prompt -------------------------------------------------------------

VOCAB, LEN, K = 256, 20, 2


def _request(prompt: Any = (1, 2, 3), new: object = 4, stop: object = None, *, rid: object = 5, in_use: bool = False) -> tuple[Any, ...]:
    return check_request(rid, prompt, new, stop, in_use=lambda r: in_use, vocab=VOCAB, max_len=LEN, k=K)


def _admit_refused(match: str, **kw: Any) -> None:
    with pytest.raises(PreconditionError, match=r"^admit: " + match):
        _request(**kw)


def test_a_request_is_returned_checked() -> None:
    rid, arr, new, stops = _request([4, 5, 6], 3, [7, 7, 9])
    assert rid == 5 and type(rid) is int and arr.tolist() == [4, 5, 6] and new == 3 and stops == frozenset({7, 9})
    assert _request(stop=None)[3] == frozenset()
    assert _request(stop=0)[3] == frozenset({0})
    assert _request(stop=(VOCAB - 1,))[3] == frozenset({VOCAB - 1})
    assert _request(rid=np.int64(8))[0] == 8


def test_a_request_id_in_use_is_refused() -> None:
    _admit_refused(r"request id 5 is already in use$", in_use=True)
    _admit_refused(r"rid must be an int, not bool \(got True\)$", rid=True)


def test_max_new_tokens_is_at_least_one_and_fits_the_context_with_the_window() -> None:
    _request(new=1)
    _admit_refused(r"request 5: max_new_tokens must be >= 1, got 0$", new=0)
    _admit_refused(r"request 5: max_new_tokens must be an int, not float \(got 2\.0\)$", new=2.0)
    room = LEN - 3 - (K + 1)  # a 3-token prompt, k + 1 speculative positions
    _request(new=room)
    _admit_refused(rf"request 5: prompt 3 \+ {room + 1} new tokens exceed max_len {LEN}$", new=room + 1)


def test_stop_ids_are_at_most_max_stops_token_ids() -> None:
    assert len(_request(stop=list(range(MAX_STOPS)))[3]) == MAX_STOPS
    _admit_refused(rf"request 5: at most {MAX_STOPS} stop ids, got {MAX_STOPS + 1}$", stop=list(range(MAX_STOPS + 1)))
    _admit_refused(rf"request 5: stop must be a token id in \[0, {VOCAB}\), got {VOCAB}$", stop=[1, VOCAB])
    _admit_refused(rf"request 5: stop must be a token id in \[0, {VOCAB}\), got -1$", stop=-1)
    _admit_refused(r"request 5: stop must be an int, not str \(got 'x'\)$", stop="x")
    _admit_refused(r"request 5: stop must be an int, not bool \(got True\)$", stop=(True,))


def test_a_prompt_is_a_non_empty_sequence_of_token_ids_of_the_vocabulary() -> None:
    assert checked_prompt("request 1", [0, VOCAB - 1], VOCAB).tolist() == [0, VOCAB - 1]
    with pytest.raises(IRValidationError, match=rf"^request 1\.prompt: token ids must be < the vocabulary size {VOCAB} \(got {VOCAB}\)"):
        checked_prompt("request 1", [0, VOCAB], VOCAB)
    with pytest.raises(IRValidationError, match=r"^request 1\.prompt: token ids must be >= 0 \(got -1\)"):
        checked_prompt("request 1", [3, -1], VOCAB)
    with pytest.raises(IRValidationError, match=r"^request 1\.prompt: must hold at least one token"):
        checked_prompt("request 1", [], VOCAB)
    with suppress_type_checks(), pytest.raises(IRValidationError, match=r"^request 1\.prompt: must be a sequence of int token ids, not generator"):
        checked_prompt("request 1", (t for t in [1, 2]), VOCAB)  # type: ignore[arg-type]  # (the bad type is the point)
    with suppress_type_checks(), pytest.raises(IRValidationError, match=r"^request 1\.prompt: must be a 1-D sequence of int token ids"):
        checked_prompt("request 1", [[1, 2]], VOCAB)  # type: ignore[list-item]  # (the bad shape is the point)
    assert checked_prompt("p", [10**6]).tolist() == [10**6]  # no vocabulary given: any id >= 0


def test_a_prompt_at_the_length_bound_is_read_and_one_longer_is_refused_unread() -> None:
    assert checked_prompt("request 1", range(8), VOCAB, 8).shape == (8,)
    with pytest.raises(IRValidationError, match=r"^request 1\.prompt: is longer than 8 tokens \(got '<9 tokens>'\)"):
        checked_prompt("request 1", range(9), VOCAB, 8)
    with pytest.raises(IRValidationError, match=rf"^request 5\.prompt: is longer than {MAX_LEN} tokens"):
        _request(prompt=range(MAX_LEN + 1))


# -- Pipeline.withdraw: a plan must be the batch's, lowered ----------------------------------------


def _cow_or_cont(intent: Any, snapshot: bool = False) -> list[AdmittedRequest]:
    """One request in slot 1 whose columns do not depend on how it starts: after a 2-token prefix,
    from a copy of slot 6 (an init op) or continuing its own state (none); with a snapshot into 7."""
    return [AdmittedRequest(rid=RequestId(1), slot=MambaSlot(1), input_ids=[4, 5], kv_locs=[10, 11], intent=intent,
                            snapshot_to=MambaSlot(7) if snapshot else None)]


def test_withdraw_refuses_a_plan_with_tickets_for_a_batch_without_an_init_op_and_the_reverse() -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, pm=PassManager(verify_level=2))
    cow_batch, cow_plan = pipe.prefill(_cow_or_cont(CopyFrom(src=MambaSlot(6), prefix_len=2)))
    cont_batch, cont_plan = pipe.prefill(_cow_or_cont(Continue(prefix_len=2)))
    assert cow_plan.tickets and not cont_plan.tickets and not cow_plan.snapshots and not cont_plan.snapshots
    with pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: the batch's ops \(init None, snapshot None\) are not the plan's tickets "
                       r"\(1 init, 0 snapshot\): the plan was not lowered from it$"):
        pipe.withdraw(cont_batch, cow_plan, [], reason="mixed up")
    with pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: the batch's ops \(init \d+, snapshot None\) are not the plan's tickets "
                       r"\(0 init, 0 snapshot\): the plan was not lowered from it$"):
        pipe.withdraw(cow_batch, cont_plan, [], reason="mixed up")
    assert ledger.cancelled() == {} and len(ledger.outstanding()) == 1
    out, plan = pipe.withdraw(cow_batch, cow_plan, [RequestId(1)], reason="test over")  # its own plan: withdrawn
    assert out.rids.tolist() == [] and plan.tickets == ()
    assert ledger.outstanding() == () and len(ledger.cancelled()) == 1


def test_withdraw_refuses_a_plan_without_the_snapshot_its_batch_declares_and_the_reverse() -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, pm=PassManager(verify_level=2))
    snap_batch, snap_plan = pipe.prefill(_cow_or_cont(Continue(prefix_len=2), snapshot=True))
    plain_batch, plain_plan = pipe.prefill(_cow_or_cont(Continue(prefix_len=2)))
    assert snap_plan.snapshots and not snap_plan.tickets and not plain_plan.snapshots
    with pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: the batch's ops \(init None, snapshot \d+\) are not the plan's tickets "
                       r"\(0 init, 0 snapshot\): the plan was not lowered from it$"):
        pipe.withdraw(snap_batch, plain_plan, [], reason="mixed up")
    with pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: the batch's ops \(init None, snapshot None\) are not the plan's tickets "
                       r"\(0 init, 1 snapshot\): the plan was not lowered from it$"):
        pipe.withdraw(plain_batch, snap_plan, [], reason="mixed up")
    again = prepare_for_extend(_cow_or_cont(Continue(prefix_len=2), snapshot=True), None)  # the same request, another snapshot serial
    with pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: .* is not of this batch's snapshot \(serial \d+\): the plan was not lowered from it$"):
        pipe.withdraw(again, snap_plan, [], reason="mixed up")
    assert ledger.cancelled() == {}
    pipe.withdraw(snap_batch, snap_plan, [RequestId(1)], reason="test over")
    assert ledger.outstanding() == ()


@pytest.mark.parametrize(("column", "other"), [
    ("slots", attrs.evolve(_cow_or_cont(Clear())[0], slot=MambaSlot(2))),
    ("extend_lens", attrs.evolve(_cow_or_cont(Clear())[0], input_ids=[4, 5, 6], kv_locs=[10, 11, 12])),
    ("input_ids", attrs.evolve(_cow_or_cont(Clear())[0], input_ids=[4, 9])),
    ("prefix_lens", attrs.evolve(_cow_or_cont(Clear())[0], intent=Continue(prefix_len=3))),
])
def test_withdraw_refuses_a_plan_whose_columns_are_another_batchs(column: str, other: AdmittedRequest) -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, pm=PassManager(verify_level=2))
    batch, plan = pipe.prefill(_cow_or_cont(Clear()))
    _, other_plan = pipe.prefill([other])
    with pytest.raises(PreconditionError, match=rf"^Pipeline\.withdraw: the plan's {column} are not the batch's: the plan was not lowered from it$"):
        pipe.withdraw(batch, other_plan, [], reason="mixed up")
    assert ledger.cancelled() == {}


class _RegistryOnly:
    """A ticket registry that cannot cancel."""

    def register(self, tickets: Any, starts: Any = None) -> None:
        pass


def test_withdraw_needs_a_prefill_and_a_ledger_that_can_cancel() -> None:
    pipe = Pipeline(_RegistryOnly(), pm=PassManager(verify_level=2))
    batch, plan = pipe.prefill(_cow_or_cont(Clear()))
    with suppress_type_checks(), pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: the pipeline's ledger \(_RegistryOnly\) has no cancel_all"):
        pipe.withdraw(batch, plan, [], reason="x")
    with suppress_type_checks(), pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: takes a prefill's ExtendBatch and its ExtendPlan, got a list and a ExtendPlan$"):
        pipe.withdraw([], plan, [], reason="x")  # type: ignore[arg-type]  # (the bad type is the point)
    with suppress_type_checks(), pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: takes a prefill's ExtendBatch and its ExtendPlan, got a ExtendBatch and a NoneType$"):
        pipe.withdraw(batch, None, [], reason="x")  # type: ignore[arg-type]  # (the bad type is the point)


# -- the request record and table -----------------------------------------------------------------


def _record(rid: int = 1, prompt: tuple[int, ...] = (1, 2, 3), *, new: int = 4, stop: frozenset[int] = frozenset(),
            min_tokens: int = 0, source: PrefixState | None = None) -> Request:
    p = frozen_i64(list(prompt))
    sampling = SamplingParams(min_tokens=min_tokens, temperature=0.0) if min_tokens else GREEDY
    return Request(rid=RequestId(rid), prompt=p, original=p, max_new_tokens=new, stop=stop, sampling=sampling, source=source)


def test_a_request_is_done_at_max_new_tokens_or_at_a_stop_id_past_min_tokens() -> None:
    r = _record(new=3)
    r.output = [5, 6]
    assert not r.is_done()
    r.output = [5, 6, 7]
    assert r.is_done() and r.final_output() == [5, 6, 7]
    r.output = [5, 6, 7, 8]  # (a speculative step may emit past the bound: cut)
    assert r.final_output() == [5, 6, 7]
    s = _record(new=5, stop=frozenset({9, 4}))
    s.output = [1, 4, 2, 9]
    assert s.is_done() and s.final_output() == [1, 4]  # cut after the first stop id, whichever it is
    s.output = [1, 2]
    assert not s.is_done()
    m = _record(new=6, stop=frozenset({9}), min_tokens=2)
    m.output = [9, 9]  # stop ids before min_tokens end nothing
    assert not m.is_done() and m.final_output() == [9, 9]
    m.output = [9, 9, 9, 1]  # the one at index min_tokens does
    assert m.is_done() and m.final_output() == [9, 9, 9]
    late = _record(new=2, stop=frozenset({9}))
    late.output = [1, 2, 9]  # a stop id past max_new_tokens is cut away with it
    assert late.final_output() == [1, 2]


def test_a_request_starts_after_its_prefix_source_and_continues_where_its_chunks_stopped() -> None:
    fresh = _record()
    assert fresh.start == 0 and fresh.next_pos == 0
    cp = PrefixState(slot=MambaSlot(3), tokens=(1, 2), kv_locs=(7, 8))
    r = _record(prompt=(1, 2, 3, 4, 5), source=cp)
    assert r.start == 2 and r.next_pos == 2
    r.done = 4
    assert r.next_pos == 4


def test_the_request_table_keeps_the_queue_in_serving_order() -> None:
    table = RequestTable()
    a, b, c = _record(1, (1, 2, 3, 4)), _record(2, (1, 2)), _record(3, (5,))
    for r in (a, b, c):
        table.add(r)
    assert table.queued == [1, 2, 3] and table.num_queued == 3 and table.has_queued and len(table) == 3
    assert table.kv_owed() == 0  # nothing started
    table.started(a, MambaSlot(0))
    a.done = 1
    table.started(b, MambaSlot(1))
    assert table.kv_owed() == (4 - 1) + (2 - 0)  # started prefills only, what their prompts still need
    back = _record(1, (1, 2, 3, 4, 5))  # a PREFILLING request retracted: its old place goes, it is first
    table.requeue(back)
    assert table.queued == [1, 2, 3] and table[RequestId(1)] is back and table.kv_owed() == 2
    table.remove(RequestId(2))
    assert table.queued == [1, 3] and table.get(RequestId(2)) is None and RequestId(2) not in table
    table.started(c, MambaSlot(2))
    c.done = 1
    table.prefilled(c)
    assert table.queued == [1] and table.records([RequestId(3), RequestId(1)]) == [c, back]
    assert table.remove(RequestId(3)) is c and table.queued == [1] and len(table) == 1  # a RUNNING one has no place in the queue
    with pytest.raises(KeyError):
        table.records([RequestId(3)])
    assert [r.rid for r in table] == [1]


# -- what the engine reports --------------------------------------------------------------------


def test_spec_stats_rates() -> None:
    assert SpecStats().acceptance_rate == 0.0 and SpecStats().mean_accepted_length == 0.0
    s = SpecStats(row_iterations=4, proposed=8, accepted=6)
    assert s.acceptance_rate == 6 / 8 and s.mean_accepted_length == (6 + 4) / 4


def test_bonus_tokens_are_the_target_tokens_at_each_rows_accepted_position() -> None:
    targets = np.array([10, 11, 12, 20, 21, 22, 30, 31, 32], dtype=np.int64)  # k = 2: three positions per row
    assert bonus_tokens(targets, [0, 2, 1], 2) == [10, 22, 31]


class _Busy:
    def __init__(self, intervals: list[tuple[float, float]]) -> None:
        self.intervals = intervals

    def busy_intervals(self) -> list[tuple[float, float]]:
        return self.intervals


def test_busy_seconds_is_the_union_of_the_busy_intervals_inside_the_window() -> None:
    busy = _Busy([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (2.5, 2.75), (7.0, 9.0)])
    assert Engine.busy_seconds(busy, 0.5, 5.5) == pytest.approx(2.5 + 0.5)  # type: ignore[arg-type]  # (only busy_intervals is read)
    assert Engine.busy_seconds(busy, 0.0, 10.0) == pytest.approx(3.0 + 1.0 + 2.0)  # type: ignore[arg-type]
    assert Engine.busy_seconds(busy, 3.0, 5.0) == 0.0  # type: ignore[arg-type]
    assert Engine.busy_seconds(_Busy([]), 0.0, 1.0) == 0.0  # type: ignore[arg-type]


# -- engine runs against the reference ------------------------------------------------------------

PROMPTS = [list(b"The quick brown fox"), list(b"abc"), list(b"def f(x):\n  return"), list(b"hello, hello")]


def _drained(e: Engine) -> None:
    """Nothing is left held once no request is live: every ticket consumed or cancelled, every slot and
    KV location back (the prefix cache's entries dropped first), no reference counted, no prefix state."""
    assert e.live == 0 and e.requests.queued == [] and e.running.num_requests == 0
    e.ledger.assert_drained()
    assert e.ledger.outstanding() == ()
    e.drop_cache()
    assert e.prefixes.held() == {} and e.kv_refs.held() == {}
    assert e.slots.num_live == 0 and e.kv.num_free == e.kv.capacity and e.live_slots() == {}


def _steps(e: Engine) -> list[StepReport]:
    out = []
    while e.live:
        out.append(e.step())
        assert len(out) < 500
    return out


@pytest.mark.parametrize(("k", "options"), [
    (0, {}),
    (0, {"mixed": False, "chunk_size": 5}),
    (2, {"chunk_size": 7, "token_budget": 9}),
    (2, {"prefix_cache": "cache", "capacity": 3, "kv_capacity": 90}),
    (0, {"prefix_cache": "cache", "capacity": 2, "kv_capacity": 40, "chunk_size": 4}),
])
def test_every_request_gets_the_greedy_tokens_and_the_engine_reports_what_it_did(k: int, options: dict[str, Any]) -> None:
    if options.get("prefix_cache") == "cache":
        options = {**options, "prefix_cache": PrefixCache(capacity=2, block=4)}
    prompts = [PROMPTS[0], PROMPTS[0][:8] + list(b"jumps"), *PROMPTS[1:]]
    new = [6, 3, 5, 1, 4]
    e = engine(k, **{"capacity": 4, "kv_capacity": 256, "max_len": 48, **options})
    with e:
        for i, (p, n) in enumerate(zip(prompts, new, strict=True)):
            e.admit(RequestId(i), p, max_new_tokens=n)
        assert e.live == len(prompts) and e.requests.queued == list(range(len(prompts)))
        reports = _steps(e)
        assert {RequestId(i): e.outputs[RequestId(i)] for i in range(len(prompts))} == {
            RequestId(i): greedy_reference(p, n) for i, (p, n) in enumerate(zip(prompts, new, strict=True))
        }
        _drained(e)
        st = e.stats
        kinds = [r.kind for r in reports]
        assert sorted(rid for r in reports for rid in r.finished) == list(range(len(prompts)))
        assert all(r.aborted == () and r.errored == () for r in reports)
        assert st.prefills == kinds.count(StepKind.EXTEND) + kinds.count(StepKind.MIXED)
        assert st.mixed == kinds.count(StepKind.MIXED)
        assert st.decodes == kinds.count(StepKind.DECODE) + kinds.count(StepKind.MIXED)
        assert st.iterations == kinds.count(StepKind.SPEC) and st.aborts == st.failed_steps == st.retries == 0
        assert (st.mixed > 0) == (k == 0 and options.get("mixed", True))
        assert st.proposed == k * st.row_iterations and 0 <= st.accepted <= st.proposed
        spec = [r for r in reports if r.kind is StepKind.SPEC]
        assert st.row_iterations == sum(r.requests for r in spec)
        assert sum(r.tokens for r in spec) == st.accepted + st.row_iterations  # each row: its accepted drafts and a bonus token
        # every emitted token was reported (a speculative step may emit past max_new_tokens: cut after)
        assert sum(r.tokens for r in reports) >= sum(new)
        if options.get("prefix_cache") is None:
            assert sum(r.prefill_tokens for r in reports) == sum(len(p) for p in prompts)  # each prompt token prefilled once
            assert e.stats.retractions == 0
        for r in reports:
            assert r.prefill_tokens <= min(e.token_budget, e.chunk_size * r.requests)
            if r.kind is StepKind.DECODE:  # one token per running row, each row named
                assert r.tokens == r.requests == len(r.emitted) and r.prefill_tokens == 0
            elif r.kind is StepKind.EXTEND:  # a chunk per row; a first token for each prompt completed
                assert r.requests <= r.prefill_tokens and len(r.emitted) == r.tokens <= r.requests
            elif r.kind is StepKind.MIXED:
                assert 0 < r.prefill_tokens and len(r.emitted) == r.tokens < r.requests + r.prefill_tokens
            else:
                assert r.kind is StepKind.SPEC and r.prefill_tokens == 0 and r.requests <= r.tokens <= (k + 1) * r.requests
        first = {}
        for i, r in enumerate(reports):
            for rid in r.emitted:
                first.setdefault(rid, i)
        assert sorted(first) == list(range(len(prompts)))
        assert e.step().kind is StepKind.IDLE


@pytest.mark.parametrize("k", [0, 2])
def test_a_run_under_kv_pressure_retracts_and_still_gives_each_request_its_tokens(k: int) -> None:
    """Retracted requests re-prefill their prompt and output so far and go on as if never retracted:
    the greedy ones give the reference's tokens; at k = 0 the seeded sampled one (with its logprobs)
    gives what it gives served alone with room to spare. (At k > 0 a retraction moves where the
    sampled request's speculative iterations start, so its tokens may differ: only their count is
    checked.)"""
    prompts, new = PROMPTS, [10, 10, 10, 10]
    hot = SamplingParams(temperature=1.5, seed=11, logprobs=1)
    alone = engine(k, capacity=4, kv_capacity=256, max_len=40)
    with alone:
        alone.admit(RequestId(3), prompts[3], max_new_tokens=new[3], sampling=hot)
        alone.run_until_done()
    e = engine(k, capacity=4, kv_capacity=60, max_len=40)
    with e:
        for i, p in enumerate(prompts):
            e.admit(RequestId(i), p, max_new_tokens=new[i], sampling=hot if i == 3 else None)
        reports = _steps(e)
        assert e.stats.retractions > 0
        assert sum(r.prefill_tokens for r in reports) > sum(len(p) for p in prompts)  # a retracted request re-prefilled
        for i, p in enumerate(prompts[:3]):
            assert e.outputs[RequestId(i)] == greedy_reference(p, new[i])
        assert len(e.outputs[RequestId(3)]) == 10 and set(e.logprobs) == {3}
        assert [x["id"] for x in e.logprobs[RequestId(3)]] == e.outputs[RequestId(3)]
        if k == 0:
            assert e.outputs[RequestId(3)] == alone.outputs[RequestId(3)]
            for mine, theirs in zip(e.logprobs[RequestId(3)], alone.logprobs[RequestId(3)], strict=True):
                assert mine["logprob"] == pytest.approx(theirs["logprob"], abs=1e-4)
                assert [t["id"] for t in mine["top"]] == [t["id"] for t in theirs["top"]]
        _drained(e)


def test_stop_ids_end_a_request_after_the_first_one_emitted() -> None:
    ref = greedy_reference(PROMPTS[0], 8)
    stops = [ref[3], ref[5]]
    e = engine(2, capacity=2, kv_capacity=128, max_len=48)
    with e:
        e.admit(RequestId(1), PROMPTS[0], max_new_tokens=8, stop=stops)
        e.admit(RequestId(2), PROMPTS[0], max_new_tokens=8, stop=ref[5])
        e.admit(RequestId(3), PROMPTS[0], max_new_tokens=8, stop=[t for t in range(256) if t not in ref][:64])
        e.admit(RequestId(4), PROMPTS[0], max_new_tokens=8, sampling=SamplingParams(temperature=0.0, stop_token_ids=(ref[4],)))
        e.admit(RequestId(5), PROMPTS[0], max_new_tokens=8, stop=ref[6], sampling=SamplingParams(temperature=0.0, stop_token_ids=(ref[2],)))
        e.run_until_done()
        assert e.outputs[RequestId(4)] == ref[: ref.index(ref[4]) + 1]  # the sampling's stop ids end it too
        assert e.outputs[RequestId(5)] == ref[: min(ref.index(ref[2]), ref.index(ref[6])) + 1]  # both kinds together
        first = min(ref.index(s) for s in stops)
        assert e.outputs[RequestId(1)] == ref[: first + 1]
        assert e.outputs[RequestId(2)] == ref[: ref.index(ref[5]) + 1]
        assert e.outputs[RequestId(3)] == ref
        _drained(e)


def test_finish_cuts_the_output_to_its_length_and_abort_keeps_it_all() -> None:
    ref = greedy_reference(PROMPTS[1], 12)
    e = engine(0, capacity=4, kv_capacity=128, max_len=48)
    with e:
        for rid in (1, 2, 3, 4):
            e.admit(RequestId(rid), PROMPTS[1], max_new_tokens=12)
        for _ in range(4):
            e.step()
        got = len(e.requests[RequestId(1)].output)
        assert 2 < got < 12
        with pytest.raises(PreconditionError, match=r"^finish: length must be an int >= 0 \(got -1\)$"):
            e.finish(RequestId(1), length=-1)
        with suppress_type_checks(), pytest.raises(PreconditionError, match=r"^finish: length must be an int >= 0 \(got True\)$"):
            e.finish(RequestId(1), length=True)  # type: ignore[arg-type]  # (the bad type is the point)
        with pytest.raises(PreconditionError, match=r"^finish: request 9 is not live$"):
            e.finish(RequestId(9))
        with pytest.raises(PreconditionError, match=r"^abort: request 9 is not live$"):
            e.abort(RequestId(9))
        assert e.live == 4 and e.stats.aborts == 0
        e.finish(RequestId(1), length=2)
        e.finish(RequestId(2), length=0)
        e.finish(RequestId(3), length=100)
        e.abort(RequestId(4))
        assert e.outputs[RequestId(1)] == ref[:2] and e.outputs[RequestId(2)] == []
        assert e.outputs[RequestId(3)] == e.outputs[RequestId(4)] == ref[:got]
        assert e.stats.aborts == 1 and e.live == 0 and e.errored == set()
        with pytest.raises(PreconditionError, match=r"^finish: request 1 is not live$"):
            e.finish(RequestId(1))
        _drained(e)


def test_run_until_done_takes_a_bound_and_says_when_it_is_not_enough() -> None:
    e = engine(0, capacity=2, kv_capacity=64, max_len=32)
    with e:
        e.run_until_done(0)  # nothing live: done at once
        with pytest.raises(PreconditionError, match=r"^run_until_done: max_steps must be an int >= 0 \(got -1\)$"):
            e.run_until_done(-1)
        e.admit(RequestId(1), PROMPTS[1], max_new_tokens=3)
        with pytest.raises(RuntimeError, match=r"^1 requests still live after 0 steps$"):
            e.run_until_done(0)
        with pytest.raises(RuntimeError, match=r"^1 requests still live after 2 steps$"):
            e.run_until_done(2)  # (a prefill, then a decode: the third token is still to come)
        e.run_until_done(1)
        assert e.outputs[RequestId(1)] == greedy_reference(PROMPTS[1], 3)


def test_a_penalised_request_needs_an_engine_with_penalties() -> None:
    e = engine(0, capacity=2, kv_capacity=64, max_len=32)
    with e:
        with pytest.raises(PreconditionError, match=r"^admit: request 1: presence_penalty=0\.5, frequency_penalty=0\.0, repetition_penalty=1\.0 "
                           r"need an engine built with penalties=True"):
            e.admit(RequestId(1), PROMPTS[1], max_new_tokens=2, sampling=SamplingParams(presence_penalty=0.5, temperature=0.0))
        assert e.live == 0
    p = engine(0, capacity=2, kv_capacity=64, max_len=32, penalties=True)
    with p:
        p.admit(RequestId(1), PROMPTS[1], max_new_tokens=2, sampling=SamplingParams(presence_penalty=0.5, temperature=0.0))
        p.run_until_done()
        assert len(p.outputs[RequestId(1)]) == 2


# -- prefix states ------------------------------------------------------------------------------


def test_a_prefix_leaves_room_for_one_more_prompt_token_a_new_token_and_the_window() -> None:
    e = engine(2, capacity=3, kv_capacity=128, max_len=24)
    with e:
        longest = 24 - 2 - 3
        with pytest.raises(PreconditionError, match=rf"^make_prefix: tokens: a prefix of {longest + 1} tokens leaves no room under max_len 24 "
                           rf"for a request extending it \(at least {longest + 1} \+ 1 prompt tokens, 1 new token and k \+ 1 = 3 speculative positions\)$"):
            e.make_prefix([7] * (longest + 1))
        prompt = list(b"The quick brown fox jumps over")
        cp = e.make_prefix(prompt[:longest])
        assert len(cp.kv_locs) == longest and e.slots.num_live == 1
        e.admit(RequestId(1), prompt[: longest + 1], max_new_tokens=1, prefix=cp)  # the longest request it can start
        e.run_until_done()
        assert e.outputs[RequestId(1)] == greedy_reference(prompt[: longest + 1], 1)
        e.release_prefix(cp)
        _drained(e)


def test_a_prefix_needs_a_free_slot_and_as_many_free_kv_locations_as_tokens() -> None:
    e = engine(0, capacity=2, kv_capacity=10, max_len=32)
    with e:
        with pytest.raises(PreconditionError, match=r"^make_prefix: no room for a 11-token prefix \(2 free slots, 10 free KV locations\)$"):
            e.make_prefix([5] * 11)
        first = e.make_prefix([5] * 10)  # every KV location
        assert e.kv.num_free == 0
        e.release_prefix(first)
        a, b = e.make_prefix([1, 2]), e.make_prefix([3])
        with pytest.raises(PreconditionError, match=r"^make_prefix: no room for a 1-token prefix \(0 free slots, 7 free KV locations\)$"):
            e.make_prefix([4])
        e.release_prefix(a)
        e.release_prefix(b)
        _drained(e)


def test_a_request_from_a_prefix_gives_the_tokens_of_its_whole_prompt() -> None:
    e = engine(2, capacity=4, kv_capacity=128, max_len=48, chunk_size=3)
    with e:
        cp = e.make_prefix(PROMPTS[2][:6])
        e.admit(RequestId(1), PROMPTS[2], max_new_tokens=5, prefix=cp)
        e.admit(RequestId(2), PROMPTS[2][:7], max_new_tokens=5, prefix=cp)
        with pytest.raises(PreconditionError, match=r"^release_prefix: prefix in slot \d+ is still to be copied by request\(s\) \[1, 2\]"):
            e.release_prefix(cp)
        reports = _steps(e)
        assert sum(r.prefill_tokens for r in reports) == (len(PROMPTS[2]) - 6) + 1  # the prefix is not prefilled again
        assert e.outputs[RequestId(1)] == greedy_reference(PROMPTS[2], 5)
        assert e.outputs[RequestId(2)] == greedy_reference(PROMPTS[2][:7], 5)
        e.release_prefix(cp)
        _drained(e)


# -- n completions --------------------------------------------------------------------------------


def test_n_completions_share_one_prefill_of_the_prompt_and_end_holding_nothing() -> None:
    prompt = PROMPTS[0]
    e = engine(0, capacity=6, kv_capacity=256, max_len=48, seed=3)
    with e:
        e.admit(RequestId(1), prompt, max_new_tokens=5, sampling=SamplingParams(temperature=2.0, n=3, seed=4), forks=[RequestId(11), RequestId(12)])
        e.admit(RequestId(2), prompt, max_new_tokens=5, sampling=SamplingParams(temperature=0.0, n=2), forks=(RequestId(21),))
        assert len(e.prefixes.held()) == 2 and e.live == 5
        reports = _steps(e)
        assert sum(r.prefill_tokens for r in reports) == 5  # each completion prefills the last prompt token only
        hot = [e.outputs[RequestId(r)] for r in (1, 11, 12)]
        assert all(len(h) == 5 for h in hot) and len({tuple(h) for h in hot}) == 3
        assert e.outputs[RequestId(2)] == e.outputs[RequestId(21)] == greedy_reference(prompt, 5)
        _drained(e)


def test_n_completions_need_room_for_their_shared_prompt_state_now() -> None:
    two = SamplingParams(temperature=1.0, n=2, seed=1)
    e = engine(0, capacity=2, kv_capacity=16, max_len=32)
    with e:
        with pytest.raises(PreconditionError, match=r"^admit: request 1: prompt 17 \+ 2 new tokens \+ 0 speculative positions, less its last "
                           r"token, need 18 KV locations at once, over the engine's kv_capacity 16$"):
            e.admit(RequestId(1), [3] * 17, max_new_tokens=2, sampling=two, forks=[RequestId(2)])  # never, not just not now
        assert e.live == 0 and e.prefixes.held() == {}
        e.admit(RequestId(1), [3] * 14, max_new_tokens=2, sampling=two, forks=[RequestId(2)])  # 13 shared tokens
        assert e.slots.num_free == 1 and e.kv.num_free == 3 and len(e.prefixes.held()) == 1
        with pytest.raises(PreconditionError, match=r"^admit: request 3: no room for its completions' shared prompt state now "
                           r"\(1 free slots, 3 free KV locations; it needs 1 and 4\)$"):
            e.admit(RequestId(3), [4] * 5, max_new_tokens=2, sampling=two, forks=[RequestId(4)])
        e.admit(RequestId(3), [4], max_new_tokens=2, sampling=two, forks=[RequestId(4)])  # one token: nothing shared, nothing needed now
        assert e.live == 4 and len(e.prefixes.held()) == 1
        with pytest.raises(PreconditionError, match=r"^admit: request 5: sampling\.n = 2 needs 1 fork ids, got 0$"):
            e.admit(RequestId(5), [4], max_new_tokens=2, sampling=two)
        with pytest.raises(PreconditionError, match=r"^admit: request 5: sampling\.n = 1 needs 0 fork ids, got 1$"):
            e.admit(RequestId(5), [4], max_new_tokens=2, forks=[RequestId(6)])
        e.abort(RequestId(1))
        e.abort(RequestId(2))
        e.step()  # no completion is left to copy the shared state: it is released
        assert e.prefixes.held() == {}
        e.run_until_done()
        assert e.outputs[RequestId(1)] == e.outputs[RequestId(2)] == [] and len(e.outputs[RequestId(3)]) == len(e.outputs[RequestId(4)]) == 2
        a, b = e.make_prefix([1]), e.make_prefix([2])
        with pytest.raises(PreconditionError, match=r"^admit: request 5: no room for its completions' shared prompt state now "
                           r"\(0 free slots, 14 free KV locations; it needs 1 and 1\)$"):
            e.admit(RequestId(5), [4, 5], max_new_tokens=2, sampling=two, forks=[RequestId(6)])
        e.release_prefix(a)
        e.release_prefix(b)
        _drained(e)


# -- the prefix cache in an engine ----------------------------------------------------------------


def _cache_clean(cache: PrefixCache) -> None:
    assert cache.reserved == 0 and cache.planned() == frozenset() and all(e.pins == 0 for e in cache.entries())


@pytest.mark.parametrize(("k", "penalties"), [(0, False), (2, False), (0, True)])
def test_a_prefix_seen_twice_is_cached_once_and_a_later_prompt_starts_from_it(k: int, penalties: bool) -> None:
    # (with penalties a snapshot is taken at the end of a chunk that stops at its boundary, not inside one)
    shared = list(b"shared prefix!")  # 14 tokens: with blocks of 4, the longest boundary two prompts share is 12
    first, second, later = shared + list(b"one"), shared + list(b"two"), shared + list(b"three")
    cache = PrefixCache(capacity=2, block=4)
    e = engine(k, capacity=4, kv_capacity=256, max_len=48, prefix_cache=cache, penalties=penalties)
    with e:
        assert e.planner.inner_snapshots is not penalties
        e.admit(RequestId(1), first, max_new_tokens=4)
        e.admit(RequestId(2), second, max_new_tokens=4)
        assert cache.observed()[tuple(shared[:12])] == 2
        reports = _steps(e)
        # the first prompt snapshots the longest shared boundary, the second the next one (12 is promised already)
        assert [len(x.tokens) for x in cache.entries()] == [12, 8] and cache.stats.snapshots == 2
        assert sum(r.prefill_tokens for r in reports) == len(first) + len(second)  # (both started before the snapshot ran)
        _cache_clean(cache)
        e.admit(RequestId(3), later, max_new_tokens=4)
        reports = _steps(e)
        assert sum(r.prefill_tokens for r in reports) == len(later) - 12
        assert cache.stats.hits == 1 and cache.stats.hit_tokens == 12 and cache.stats.snapshots == 2
        assert [len(x.tokens) for x in cache.entries()] == [8, 12]  # the hit is the most recently used
        for rid, p in ((1, first), (2, second), (3, later)):
            assert e.outputs[RequestId(rid)] == greedy_reference(p, 4)
        _cache_clean(cache)
        assert e.slots.num_live == 2  # the entries' slots
        _drained(e)
        assert len(cache) == 0 and cache.stats.evictions == 2


def test_a_request_that_leaves_before_its_snapshot_gives_back_the_plan() -> None:
    shared = list(b"another shared one")
    cache = PrefixCache(capacity=2, block=4)
    e = engine(0, capacity=4, kv_capacity=256, max_len=48, prefix_cache=cache, chunk_size=3)
    with e:
        e.admit(RequestId(1), shared + [1], max_new_tokens=2)
        e.admit(RequestId(2), shared + [2], max_new_tokens=2)
        e.step()  # first chunks: 3 tokens each, the boundary (16) not reached
        # each planned a snapshot of its own boundary (the second's: the next shared one, 16 being promised)
        assert cache.planned() == {tuple(shared[:16]), tuple(shared[:12])} and cache.stats.snapshots == 0
        e.abort(RequestId(1))
        e.abort(RequestId(2))
        _cache_clean(cache)
        assert len(cache) == 0
        _drained(e)
        e.admit(RequestId(3), shared + [3], max_new_tokens=2)  # the plan can be made again (the prefix was seen thrice)
        e.run_until_done()
        assert [len(x.tokens) for x in cache.entries()] == [16] and e.outputs[RequestId(3)] == greedy_reference(shared + [3], 2)
        _cache_clean(cache)
        _drained(e)


def test_the_prefill_streak_bound_runs_from_one_to_max_streak_and_zero_means_none() -> None:
    assert PrefillFirst(max_streak=MAX_STREAK).max_streak == MAX_STREAK and PrefillFirst(max_streak=1) == ALTERNATE
    with pytest.raises(PreconditionError, match=rf"^PrefillFirst: max_streak must be None or in \[1, {MAX_STREAK}\], got {MAX_STREAK + 1}$"):
        PrefillFirst(max_streak=MAX_STREAK + 1)
    with pytest.raises(PreconditionError, match=rf"^PrefillFirst: max_streak must be None or in \[1, {MAX_STREAK}\], got 0$"):
        PrefillFirst(max_streak=0)
    assert prefill_first(0).max_streak is None and prefill_first(1) == ALTERNATE and prefill_first(5).max_streak == 5
    assert DEFAULT_POLICY.max_streak == DEFAULT_PREFILL_STREAK


def test_chunks_default_to_the_context_and_the_budget_to_every_slots_context() -> None:
    e = engine(0, capacity=3, kv_capacity=64, max_len=40)
    with e:
        assert (e.chunk_size, e.token_budget, e.max_len, e.k, e.vocab) == (40, 120, 40, 0, 256)
        assert e.in_flight is None and e.running.num_requests == 0 and e.live == 0 and e.live_slots() == {}
    e.close()  # (closing again does nothing)
    given = engine(2, capacity=3, kv_capacity=64, max_len=40, chunk_size=5, token_budget=7)
    with given:
        assert (given.chunk_size, given.token_budget, given.k) == (5, 7, 2)


@pytest.mark.parametrize("k", [0, 2, 5])
def test_the_builtin_workloads_new_tokens_fill_the_context_beside_its_longest_prompt_and_the_window(k: int) -> None:
    cfg = ServeConfig(k=k, max_len=1000)
    assert cfg.reserve == k + 1
    assert LONGEST_BUILTIN_PROMPT + cfg.builtin_max_new_tokens + cfg.reserve == cfg.max_len


@pytest.mark.parametrize("k", [0, 2])
def test_a_stop_id_is_banned_before_min_tokens_and_ends_the_request_from_there(k: int) -> None:
    free = greedy_reference(PROMPTS[0], 8)  # its tokens 0 and 5 appear once each in its first six
    s0, s5 = free[0], free[5]
    greedy = SamplingParams(temperature=0.0)
    e = engine(k, capacity=4, kv_capacity=256, max_len=48)
    with e:
        e.admit(RequestId(0), PROMPTS[0], max_new_tokens=8, stop=s0, sampling=attrs.evolve(greedy, min_tokens=3))  # the argmax at 0: banned
        e.admit(RequestId(1), PROMPTS[0], max_new_tokens=8, stop=s5, sampling=attrs.evolve(greedy, min_tokens=5))  # at 5: allowed, it ends there
        e.admit(RequestId(2), PROMPTS[0], max_new_tokens=8, stop=s5, sampling=attrs.evolve(greedy, min_tokens=6))  # banned at 5
        e.admit(RequestId(3), PROMPTS[0], max_new_tokens=8, stop=s0)  # no min_tokens: ends at once
        e.admit(RequestId(4), PROMPTS[0], max_new_tokens=2, stop=s5, sampling=attrs.evolve(greedy, min_tokens=6))  # (the bound first)
        e.run_until_done()
        out = [e.outputs[RequestId(i)] for i in range(5)]
        _drained(e)
    assert s0 not in out[0][:3] and len(out[0]) >= 3
    assert out[1] == free[:6]
    assert out[2][:5] == free[:5] and out[2][5] != s5
    assert out[3] == [s0]
    assert out[4] == free[:2]


# -- a draft head (MTP/EAGLE) ---------------------------------------------------------------------


@cache
def _sensitive_head() -> HeadModel:
    target = sensitive_models()[0]
    return HeadModel.from_seed(HeadConfig.for_target(target.config, ("mamba", "attn")), target, 3)


@cache
def _sensitive_greedy(prompt: tuple[int, ...], n: int) -> list[int]:
    return greedy_generate_reference(sensitive_models()[0], list(prompt), n)


@pytest.mark.parametrize(("chunk_size", "cache_entries"), [(None, 0), (4, 3)])
def test_a_head_serves_the_targets_greedy_tokens_and_runs_each_init_op_once_on_each_pool(chunk_size: int | None, cache_entries: int) -> None:
    prefix = list(b"You are terse.\n")
    prompts = [list(b"def add(a, b):"), prefix + list(b"print(1)"), prefix + list(b"for i in x:"), list(b"x")]
    target = sensitive_models()[0]
    cache = PrefixCache(capacity=cache_entries, block=4) if cache_entries else None
    e = Engine(target, _sensitive_head(), k=2, capacity=6, kv_capacity=512, max_len=64, chunk_size=chunk_size, prefix_cache=cache)
    with e:
        assert e.head
        cp = e.make_prefix(prefix)
        for i, p in enumerate(prompts):
            e.admit(RequestId(i), p, max_new_tokens=6, prefix=cp if i == 1 else None)
        reports = _steps(e)
        e.release_prefix(cp)
        for i, p in enumerate(prompts):
            assert e.outputs[RequestId(i)] == _sensitive_greedy(tuple(p), 6), i
        kinds = [r.kind for r in reports]
        st = e.stats
        assert st.prefills == kinds.count(StepKind.EXTEND) and st.iterations == kinds.count(StepKind.SPEC) > 0
        assert st.proposed == 2 * st.row_iterations and 0 <= st.accepted <= st.proposed
        assert sum(r.tokens for r in reports if r.kind is StepKind.SPEC) == st.accepted + st.row_iterations
        ledger = e.ledger
        for pool in (TARGET_POOL, DRAFT_POOL):
            assert ledger.minted(pool) == ledger.counts(pool), pool
        assert ledger.counts(DRAFT_POOL) == ledger.counts(TARGET_POOL)  # the head pool saw every prefill's ops, once
        assert ledger.counts(DRAFT_POOL).clears > 0 and ledger.counts(DRAFT_POOL).cows > 0
        _drained(e)


# -- pipelined forwards (k = 0 with backends beside the host), run in this process -----------------


def _pipelined(**options: Any) -> tuple[Engine, InlineBackend]:
    e = engine(0, **{"capacity": 4, "kv_capacity": 256, "max_len": 48, **options})
    target, _ = _inline(e)
    e.forwards.pipelined = True
    return e, target


def test_pipelined_forwards_enter_their_snapshots_into_the_cache_and_give_the_greedy_tokens() -> None:
    shared = list(b"shared prefix!")
    prompts = [shared + list(b"one"), shared + list(b"two"), shared + list(b"three")]
    cache = PrefixCache(capacity=2, block=4)
    e, _ = _pipelined(prefix_cache=cache, chunk_size=5)
    with e:
        e.admit(RequestId(0), prompts[0], max_new_tokens=4)
        e.admit(RequestId(1), prompts[1], max_new_tokens=4)
        e.run_until_done(200)
        assert sorted(len(x.tokens) for x in cache.entries()) == [8, 12]
        e.admit(RequestId(2), prompts[2], max_new_tokens=4)
        e.run_until_done(200)
        assert cache.stats.hits == 1 and cache.stats.hit_tokens == 12
        for i, p in enumerate(prompts):
            assert e.outputs[RequestId(i)] == greedy_reference(p, 4)
        assert e.in_flight is None
        _cache_clean(cache)
        _drained(e)


def test_a_request_aborted_while_its_pipelined_forward_runs_gets_nothing_more() -> None:
    e, _ = _pipelined()
    with e:
        e.admit(RequestId(0), PROMPTS[0], max_new_tokens=8)
        e.admit(RequestId(1), PROMPTS[1], max_new_tokens=8)
        for _ in range(3):
            e.step()
        flight = e.in_flight
        assert flight is not None and set(flight.rids) == {0, 1}
        got = list(e.requests[RequestId(0)].output)
        e.abort(RequestId(0))
        assert e.outputs[RequestId(0)] == got == greedy_reference(PROMPTS[0], len(got))
        e.run_until_done(200)
        assert e.outputs[RequestId(0)] == got  # the token in flight for it was dropped
        assert e.outputs[RequestId(1)] == greedy_reference(PROMPTS[1], 8)
        _drained(e)


def test_a_failed_pipelined_forward_aborts_its_requests_and_those_sent_after_it() -> None:
    e, target = _pipelined()
    with e:
        e.admit(RequestId(0), PROMPTS[0], max_new_tokens=8)
        e.step()
        e.step()
        target.fail.add(DecodePlan)  # the next decode sent fails
        e.step()  # sends it
        e.admit(RequestId(1), PROMPTS[1], max_new_tokens=3)
        report = e.step()  # sends request 1's prefill beside the next decode, then reads the failed one back
        assert report.kind is StepKind.FAILED and set(report.aborted) == {0, 1}
        assert e.aborted_by_failure == {0, 1} and e.stats.failed_steps == 1 and e.stats.aborts == 2
        assert e.first_failure is not None and "the other process failed DecodePlan" in e.first_failure
        assert e.in_flight is None and e.live == 0
        out = e.outputs[RequestId(0)]
        assert out == greedy_reference(PROMPTS[0], len(out)) and e.outputs[RequestId(1)] == []
        e.admit(RequestId(2), PROMPTS[2], max_new_tokens=3)  # serving goes on
        e.run_until_done(200)
        assert e.outputs[RequestId(2)] == greedy_reference(PROMPTS[2], 3)
        _drained(e)


# -- logprobs, forks and withdraw refusals that no other engine test reaches ---------------------


@pytest.mark.parametrize("k", [0, 2])
def test_logprobs_are_the_targets_own_for_every_token_of_the_output(k: int) -> None:
    target = tiny_models()[0]
    e = engine(k, capacity=4, kv_capacity=256, max_len=48)
    with e:
        e.admit(RequestId(1), PROMPTS[0], max_new_tokens=5, sampling=SamplingParams(temperature=0.0, logprobs=2))
        e.admit(RequestId(2), PROMPTS[1], max_new_tokens=5)
        e.admit(RequestId(3), PROMPTS[2], max_new_tokens=3, sampling=SamplingParams(temperature=0.0, logprobs=0))
        e.run_until_done()
        assert set(e.logprobs) == {1, 3}  # the request that asked for none has none
        for rid, n, prompt in ((1, 2, PROMPTS[0]), (3, 0, PROMPTS[2])):
            out = e.outputs[RequestId(rid)]
            assert out == greedy_reference(prompt, len(out)) and [x["id"] for x in e.logprobs[RequestId(rid)]] == out
            seq = list(prompt)
            for entry in e.logprobs[RequestId(rid)]:
                ref = torch.log_softmax(reference_logits(target, seq)[-1].double(), dim=-1)
                assert entry["logprob"] == pytest.approx(float(ref[entry["id"]]), abs=1e-4)
                assert [t["id"] for t in entry["top"]] == ref.argsort(descending=True, stable=True)[:n].tolist()
                seq.append(entry["id"])
        _drained(e)


def test_forks_are_a_list_of_int_ids_and_not_beside_a_prefix() -> None:
    three = SamplingParams(n=3, temperature=1.0)
    e = engine(0, capacity=4, kv_capacity=128, max_len=48)
    with e:
        for forks, message in [
            ("ab", r"forks must be a list or tuple of request ids \(got 'ab'\)$"),
            ({RequestId(5), RequestId(6)}, r"forks must be a list or tuple of request ids"),
            ([RequestId(5), True], r"fork id must be an int, not bool \(got True\)$"),
            ([RequestId(5), 2.0], r"fork id must be an int, not float \(got 2\.0\)$"),
            ([RequestId(5), RequestId(5)], r"fork id 5 is already in use$"),
            ([RequestId(1), RequestId(5)], r"fork id 1 is already in use$"),
        ]:
            with suppress_type_checks(), pytest.raises(PreconditionError, match=r"^admit: request 1: " + message):
                e.admit(RequestId(1), PROMPTS[0], max_new_tokens=2, sampling=three, forks=forks)  # type: ignore[arg-type]  # (the bad value is the point)
        cp = e.make_prefix(PROMPTS[0][:4])
        with pytest.raises(PreconditionError, match=r"^admit: request 1: sampling\.n = 3 with a prefix \(the completions share a prefix of their own\)$"):
            e.admit(RequestId(1), PROMPTS[0], max_new_tokens=2, sampling=three, forks=[RequestId(2), RequestId(3)], prefix=cp)
        assert e.live == 0 and list(e.prefixes.held()) == [cp.slot] and e.slots.num_live == 1
        e.admit(RequestId(1), PROMPTS[0], max_new_tokens=2, sampling=SamplingParams(n=1, temperature=0.0), prefix=cp, forks=())
        e.run_until_done()
        e.release_prefix(cp)
        assert e.outputs[RequestId(1)] == greedy_reference(PROMPTS[0], 2)
        _drained(e)


def test_withdraw_refuses_another_batchs_plan_or_one_of_the_same_requests_lowered_again() -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, pm=PassManager(verify_level=2))
    batch, plan = pipe.prefill(_cow_or_cont(Clear()))
    other = AdmittedRequest(rid=RequestId(2), slot=MambaSlot(2), input_ids=[4, 5], kv_locs=[20, 21], intent=Clear())
    _, other_plan = pipe.prefill([other])
    with pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: the plan's requests \[2\] are not the batch's \[1\]$"):
        pipe.withdraw(batch, other_plan, [], reason="mixed up")
    again = prepare_for_extend(_cow_or_cont(Clear()), None)  # the same request, another init serial
    with pytest.raises(PreconditionError, match=r"^Pipeline\.withdraw: .* is not of this batch's init \(serial \d+\): the plan was not lowered from it$"):
        pipe.withdraw(again, plan, [], reason="mixed up")
    assert ledger.cancelled() == {} and len(ledger.outstanding()) == 2
    out, rest = pipe.withdraw(batch, plan, [], reason="nothing dropped")  # its own plan: lowered anew, under fresh serials
    assert out.rids.tolist() == [1] and len(rest.tickets) == 1 and rest.tickets[0] not in plan.tickets
    assert len(ledger.cancelled()) == 1 and set(ledger.outstanding()) == {*rest.tickets, *other_plan.tickets}


# -- the prefix cache's policy on its own ---------------------------------------------------------


def _centry(tokens: tuple[int, ...], slot: int) -> CacheEntry:
    return CacheEntry(slot=MambaSlot(slot), tokens=tokens, kv_locs=tuple(range(100 + slot * 10, 100 + slot * 10 + len(tokens))))


def _filled(pc: PrefixCache, *entries: CacheEntry) -> None:
    for e in entries:
        assert pc.reserve_room()
        pc.insert(e)


def test_the_cache_looks_up_the_longest_cached_prefix_strictly_inside_the_prompt() -> None:
    pc = PrefixCache(capacity=4, block=2)
    p = tuple(range(1, 10))  # 9 tokens: boundaries 8, 6, 4, 2
    short, long_ = _centry(p[:2], 1), _centry(p[:6], 2)
    _filled(pc, short, long_)
    assert pc.lookup(p) is long_ and pc.lookup(p[:7]) is long_
    assert pc.lookup(p[:6]) is short  # a prompt that is the prefix itself: the entry must be strictly shorter
    assert pc.lookup(p[:2]) is None and pc.lookup((9, 9, 9)) is None
    assert (pc.stats.lookups, pc.stats.hits, pc.stats.hit_tokens) == (5, 3, 6 + 6 + 2)
    assert pc.stats.hit_rate == 3 / 5 and PrefixCache(capacity=1).stats.hit_rate == 0.0


def test_the_cache_evicts_the_least_recently_used_unpinned_entry() -> None:
    pc = PrefixCache(capacity=3, block=2)
    a, b, c = _centry((1, 2), 1), _centry((3, 4), 2), _centry((5, 6), 3)
    _filled(pc, a, b, c)
    assert pc.entries() == (a, b, c) and not pc.reserve_room() and pc.reserved == 0
    assert pc.lookup((1, 2, 7)) is a  # a hit makes it the most recently used
    assert pc.entries() == (b, c, a)
    pc.pin(b)
    pc.pin(b)
    assert b.pins == 2
    assert pc.evict_lru() is c and pc.entries() == (b, a)  # b pinned: skipped, not moved
    pc.unpin(b)
    assert pc.evict_lru() is a and pc.evict_lru() is None  # b still pinned once
    pc.unpin(b)
    assert pc.evict_lru() is b and len(pc) == 0 and pc.stats.evictions == 3 and pc.evict_lru() is None


def test_a_snapshot_is_planned_at_the_longest_boundary_seen_twice_past_the_start() -> None:
    pc = PrefixCache(capacity=4, block=2)
    p = tuple(range(1, 10))
    pc.observe(p)
    pc.observe(p[:7])  # shares boundaries 6, 4, 2 with p
    pc.observe(p[:6])  # its boundaries: 4, 2 (6 is the whole prompt, not strictly inside)
    assert pc.observed()[p[:6]] == 2 and pc.observed()[p[:4]] == 3 and p[:8] in pc.observed()
    assert pc.plan_snapshot(p, 0) == 6 and pc.planned() == {p[:6]}
    assert pc.plan_snapshot(p, 0) == 4  # 6 is promised already: the next one
    assert pc.plan_snapshot(p, 4) is None  # nothing past the start is left
    assert pc.plan_snapshot(p, 3) is None  # (4 is promised too)
    pc.cancel_plan(p[:4])
    pc.cancel_plan(p[:3])  # (nothing planned there: nothing happens)
    assert pc.planned() == {p[:6]} and pc.plan_snapshot(p, 3) == 4
    assert pc.reserve_room()
    pc.insert(_centry(p[:6], 1))  # the snapshot ran: the plan is settled
    assert pc.planned() == {p[:4]} and pc.reserved == 0
    assert pc.plan_snapshot(p, 0) == 2  # 6 is cached, 4 promised
    with pytest.raises(PrefixCacheError, match=r"^plan_snapshot\(after\): must be >= 0 \(got -1\)$"):
        pc.plan_snapshot(p, -1)
    with suppress_type_checks(), pytest.raises(PrefixCacheError, match=r"^plan_snapshot\(after\): must be an int, not bool \(got True\)$"):
        pc.plan_snapshot(p, True)  # type: ignore[arg-type]  # (the bad type is the point)


@pytest.mark.parametrize(("over", "shown"), [
    ({"tokens": [1, 2]}, r"tokens must be a tuple of ints, not list \(got \[1, 2\]\)"),
    ({"kv_locs": (1, -2)}, r"every kv_locs entry must be >= 0 \(got -2\)"),
    ({"tokens": (1, -2)}, r"every tokens entry must be >= 0 \(got -2\)"),
    ({"tokens": (1, 2.0)}, r"every tokens entry must be an int, not float \(got 2\.0\)"),
    ({"slot": 1.0}, r"slot must be an int, not float \(got 1\.0\)"),
    ({"slot": -1}, r"slot must be a cache slot >= 1 \(slot 0 is the padding slot\), got -1"),
])
def test_a_malformed_entry_is_refused_by_name_and_changes_nothing(over: dict[str, Any], shown: str) -> None:
    pc = PrefixCache(capacity=2, block=2)
    assert pc.reserve_room()
    bad = attrs.evolve(_centry((1, 2), 1), **over)
    with suppress_type_checks(), pytest.raises(PrefixCacheError, match=rf"^insert\(entry\): {shown}$"):
        pc.insert(bad)
    assert len(pc) == 0 and pc.reserved == 1 and pc.stats.snapshots == 0
    ok = _centry((1, 2), 1)
    pc.insert(ok)
    with suppress_type_checks(), pytest.raises(PrefixCacheError, match=rf"^unpin\(entry\): {shown}$"):
        pc.unpin(bad)
    assert ok.pins == 0 and pc.entries() == (ok,)


# -- the forward runner ---------------------------------------------------------------------------


def test_a_refusal_or_a_broken_backend_met_on_a_retry_is_raised_as_it_is() -> None:
    for refusal in (PlanExecutionError("refused on the retry"), BackendBroken("rank 1 failed")):
        runner, ex = ForwardRunner(3, SpecStats()), FlakyBackend(RuntimeError("first"), refusal)
        with pytest.raises(type(refusal), match=str(refusal)):
            runner.run(ex, _plan())
        assert ex.calls == ["submit", "wait"] * 2 and runner.stats.retries == 1  # no attempt after it
        runner, ex = ForwardRunner(3, SpecStats()), FlakyBackend(refusal)
        with pytest.raises(type(refusal)):
            runner.wait(runner.submit(ex, _plan()))
        assert runner.stats.retries == 0


def test_a_failure_is_named_by_its_kind_and_its_own_words() -> None:
    assert cause_words(RuntimeError("boom")) == "RuntimeError: boom"
    assert cause_words(RuntimeError()) == "RuntimeError"
    failed = StepFailed((RequestId(3),), KeyError())
    assert str(failed) == "forward of requests [3] failed: KeyError" and failed.rids == (RequestId(3),)


@pytest.mark.parametrize("k", [0, 2])
def test_a_request_short_of_kv_evicts_cache_entries_before_anything_is_retracted(k: int) -> None:
    cache = PrefixCache(capacity=2, block=4)
    e = engine(k, capacity=4, kv_capacity=40, max_len=40, prefix_cache=cache)
    with e:
        shared = list(b"shared prefix!")
        e.admit(RequestId(1), shared + [1], max_new_tokens=1)
        e.admit(RequestId(2), shared + [2], max_new_tokens=1)
        e.run_until_done()
        assert [len(x.tokens) for x in cache.entries()] == [12, 8] and e.kv.num_free == 20  # the entries hold 20 locations
        prompt = list(b"0123456789")
        e.admit(RequestId(3), prompt, max_new_tokens=18)  # 28 locations (31 with the last window): one eviction frees enough
        e.run_until_done()
        assert e.outputs[RequestId(3)] == greedy_reference(prompt, 18)
        assert e.stats.retractions == 0 and cache.stats.evictions == 1 and [len(x.tokens) for x in cache.entries()] == [8]
        _drained(e)


def test_a_forged_prefix_state_is_refused_naming_what_does_not_match() -> None:
    e = engine(0, capacity=4, kv_capacity=64, max_len=40)
    with e:
        cp = e.make_prefix(PROMPTS[0][:6])
        prompt = PROMPTS[0]
        for forged, message in [
            (attrs.evolve(cp, kv_locs=(*cp.kv_locs[:-1], 60)), r"prefix KV location 60 is not held \(not a live prefix\)$"),
            (attrs.evolve(cp, kv_locs=cp.kv_locs[:-1]), r"prefix has 5 KV locations for 6 tokens$"),
            (attrs.evolve(cp, kv_locs=(cp.kv_locs[1], cp.kv_locs[0], *cp.kv_locs[2:])), r"prefix .* is not a prefix this engine holds \(forged, or released\)$"),
            (attrs.evolve(cp, slot=MambaSlot(3)), r"prefix slot 3 was released$"),
        ]:
            with pytest.raises(PreconditionError, match=r"^admit: request 1: " + message):
                e.admit(RequestId(1), prompt, max_new_tokens=2, prefix=forged)
        with pytest.raises(PreconditionError, match=r"^admit: request 1: prompt does not extend the prefix state's 6 tokens$"):
            e.admit(RequestId(1), prompt[:6], max_new_tokens=2, prefix=cp)  # the whole prompt is the prefix: nothing to extend it
        assert e.live == 0 and e.kv_refs.held() == dict.fromkeys(cp.kv_locs, 1)
        e.admit(RequestId(1), prompt[:7], max_new_tokens=2, prefix=cp)  # one token more: accepted
        e.run_until_done()
        assert e.outputs[RequestId(1)] == greedy_reference(prompt[:7], 2)
        e.release_prefix(cp)
        _drained(e)


# -- requests that start from a prefix they share need only the rest of their prompt's KV ----------


def test_a_request_from_a_prefix_state_starts_when_the_rest_of_its_prompt_fits() -> None:
    # the prefix holds 30 of the 40 KV locations: a request extending it by one token needs 1 more and
    # its new tokens, not 31 (asking for its whole prompt, it never started and the engine idled)
    e = engine(0, capacity=2, kv_capacity=40, max_len=64)
    with e:
        cp = e.make_prefix(PROMPTS[0] + PROMPTS[2][:11])
        prompt = [*cp.tokens, 7]
        e.admit(RequestId(1), prompt, max_new_tokens=2, prefix=cp)
        e.run_until_done(20)
        assert e.outputs[RequestId(1)] == greedy_reference(prompt, 2)
        e.release_prefix(cp)
        _drained(e)


def test_n_completions_of_a_long_prompt_run_where_their_shared_state_takes_most_of_the_kv() -> None:
    two = SamplingParams(temperature=0.0, n=2)
    e = engine(0, capacity=3, kv_capacity=16, max_len=32)
    with e:
        prompt = PROMPTS[2][:12]  # 11 shared locations, 5 left: each completion needs 1 for its last prompt token, then 2
        e.admit(RequestId(1), prompt, max_new_tokens=2, sampling=two, forks=[RequestId(2)])
        e.run_until_done(40)
        assert e.outputs[RequestId(1)] == e.outputs[RequestId(2)] == greedy_reference(prompt, 2)
        _drained(e)


def test_n_completions_of_a_long_prompt_need_a_second_slot() -> None:
    two = SamplingParams(temperature=1.0, n=2, seed=1)
    e = engine(0, capacity=1, kv_capacity=64, max_len=32)
    with e:
        with pytest.raises(PreconditionError, match=r"^admit: request 1: sampling\.n = 2 needs a slot for its completions beside their "
                           r"shared prompt state; capacity 1 has one$"):
            e.admit(RequestId(1), [3, 4, 5], max_new_tokens=2, sampling=two, forks=[RequestId(2)])
        assert e.live == 0 and e.prefixes.held() == {}
        e.admit(RequestId(1), [3], max_new_tokens=2, sampling=two, forks=[RequestId(2)])  # one token: nothing shared, one slot in turn
        e.run_until_done(40)
        assert len(e.outputs[RequestId(1)]) == len(e.outputs[RequestId(2)]) == 2
        _drained(e)


def test_a_snapshot_without_a_free_slot_is_skipped_and_gives_its_room_back() -> None:
    shared = list(b"shared prefix!")
    cache = PrefixCache(capacity=2, block=4)
    # both requests start (taking both slots) before their chunks of 4 reach the boundaries they planned
    e = engine(0, capacity=2, kv_capacity=256, max_len=48, prefix_cache=cache, chunk_size=4)
    with e:
        e.admit(RequestId(1), shared + [1], max_new_tokens=2)
        e.admit(RequestId(2), shared + [2], max_new_tokens=2)
        e.run_until_done()
        assert len(cache) == 0 and cache.stats.snapshots == 0
        _cache_clean(cache)  # the room reserved for the skipped snapshots was given back, their plans cancelled
        for rid in (3, 4):  # one at a time: a slot is free for the snapshot, and the room is all there
            e.admit(RequestId(rid), shared + [rid], max_new_tokens=2)
            e.run_until_done()
        assert [len(x.tokens) for x in cache.entries()] == [12] and cache.stats.hits == 1  # the fourth started from it
        for rid in (1, 2, 3, 4):
            assert e.outputs[RequestId(rid)] == greedy_reference(shared + [rid], 2)
        _cache_clean(cache)
        _drained(e)


def test_a_request_aborted_while_its_snapshot_is_in_flight_gives_back_the_slot_and_the_room() -> None:
    shared = list(b"shared prefix!")
    cache = PrefixCache(capacity=2, block=4)
    e, _ = _pipelined(prefix_cache=cache)
    with e:
        e.admit(RequestId(1), shared + [1], max_new_tokens=3)
        e.admit(RequestId(2), shared + [2], max_new_tokens=3)
        e.step()  # both prefills sent, each with the snapshot it planned; nothing read back yet
        first = e.requests[RequestId(1)]
        assert first.snapshot_slot is not None and cache.reserved == 2 and e.slots.num_live == 4
        e.abort(RequestId(1))
        assert cache.reserved == 1 and e.slots.num_live == 2 and not e.slots.is_live(first.snapshot_slot)
        assert cache.planned() == {tuple(shared[:8])}  # the second one's
        e.run_until_done(100)
        assert [len(x.tokens) for x in cache.entries()] == [8]  # the aborted one's snapshot never became an entry
        assert e.outputs[RequestId(1)] == [] and e.outputs[RequestId(2)] == greedy_reference(shared + [2], 3)
        _cache_clean(cache)
        _drained(e)


@pytest.mark.parametrize("exact", [False, True])
def test_run_until_done_reads_back_the_last_iterations_deferred_commits(exact: bool) -> None:
    """With backends beside the host a speculative iteration's commits are read back at the next
    step; when no request is left, ``run_until_done`` reads back the last ones (``sync``), whether
    it stopped early or after exactly ``max_steps`` steps."""
    steps = len(_steps_of_a_run())
    e = engine(2, capacity=4, kv_capacity=256, max_len=48)
    target, draft = _inline(e)
    assert draft is not None
    with e:
        e.admit(RequestId(1), PROMPTS[1], max_new_tokens=5)
        e.run_until_done(steps if exact else 100)
        assert e.outputs[RequestId(1)] == greedy_reference(PROMPTS[1], 5)
        for ex, commit in ((target, "CommitPlan"), (draft, "DraftCommitPlan")):
            assert ex.log.count(f"submit {commit}") == ex.log.count(f"wait {commit}") > 0
        _drained(e)


def _steps_of_a_run() -> list[StepReport]:
    e = engine(2, capacity=4, kv_capacity=256, max_len=48)
    with e:
        e.admit(RequestId(1), PROMPTS[1], max_new_tokens=5)
        return _steps(e)


def test_a_submitted_plan_is_in_flight_until_read_back_and_failed_once_known_to_have_failed() -> None:
    plan = _plan()
    s = Submitted(FlakyBackend(), plan)  # type: ignore[arg-type]  # (a backend by its methods)
    assert s.failed and not s.in_flight  # not submitted yet: the failure is what it holds
    s.sent = RuntimeError("gone before it left")
    assert s.failed and not s.in_flight
    pending = Pending(plan)
    s.sent = pending
    assert s.in_flight and not s.failed  # runs elsewhere, not read back
    pending.done = True
    assert not s.in_flight and not s.failed  # ran, no error
    pending.error = RuntimeError("failed there")
    assert not s.in_flight and s.failed


def test_a_speculative_iterations_commits_are_read_back_at_the_next_step_only_beside_the_host() -> None:
    e = engine(2, capacity=4, kv_capacity=256, max_len=48)
    target, draft = _inline(e)
    assert draft is not None
    with e:
        e.admit(RequestId(1), PROMPTS[1], max_new_tokens=8)
        assert e.step().kind is StepKind.EXTEND
        assert e.step().kind is StepKind.SPEC
        assert target.log[-1] == "submit CommitPlan" and draft.log[-1] == "submit DraftCommitPlan"  # sent, not read back
        e.step()
        assert "wait CommitPlan" in target.log and "wait DraftCommitPlan" in draft.log
        e.run_until_done()
        _drained(e)
    plain = engine(2, capacity=4, kv_capacity=256, max_len=48)  # in this process: each plan has run when submit returns
    with plain:
        plain.admit(RequestId(1), PROMPTS[1], max_new_tokens=8)
        plain.step()
        plain.step()
        assert plain.forwards._deferred == []  # nothing is left to read back
        plain.run_until_done()
        assert plain.outputs == e.outputs


def test_a_draft_given_without_speculation_is_not_served() -> None:
    target, draft = tiny_models()
    with Engine(target, draft, k=0, capacity=2, kv_capacity=64, max_len=32) as e:
        assert e.draft is None and e.backends.draft is None and not e.head
        e.admit(RequestId(1), PROMPTS[1], max_new_tokens=3)
        e.run_until_done()
        assert e.outputs[RequestId(1)] == greedy_reference(PROMPTS[1], 3)
        assert e.ledger.counts(DRAFT_POOL).clears == 0 and e.ledger.counts(TARGET_POOL).clears == 1
        _drained(e)


def test_releasing_a_prefix_state_is_refused_for_a_forged_one_and_is_a_double_free_for_a_released_one() -> None:
    e = engine(0, capacity=3, kv_capacity=64, max_len=40)
    with e:
        cp = e.make_prefix(PROMPTS[0][:6])
        e.admit(RequestId(1), PROMPTS[1], max_new_tokens=8)
        e.step()
        running = e.live_slots()[RequestId(1)]
        forged = PrefixState(slot=running, tokens=cp.tokens, kv_locs=cp.kv_locs)  # a live slot, but a request's
        with pytest.raises(PreconditionError, match=r"^release_prefix: cp .* is not a prefix this engine holds \(forged, or released already\)$"):
            e.release_prefix(forged)
        with pytest.raises(PreconditionError, match=r"^release_prefix: cp .* is not a prefix this engine holds"):
            e.release_prefix(attrs.evolve(cp, tokens=cp.tokens[:-1]))  # its slot, another record
        assert e.prefixes.held() == {cp.slot: cp} and e.slots.is_live(running)
        e.release_prefix(cp)
        with pytest.raises(SlotError, match=rf"^release_prefix: double free of slot {cp.slot}: no prefix of this engine holds it \(released already\?\)$"):
            e.release_prefix(cp)
        e.run_until_done()
        _drained(e)


@pytest.mark.parametrize("k", [0, 2])
def test_a_request_needing_more_kv_than_the_engine_has_is_refused_at_admit(k: int) -> None:
    """All of a request's positions hold KV at once (its prompt, its new tokens but the last, and k
    speculative ones): one that needs more than ``kv_capacity`` would never finish. It is refused at
    admission, naming the capacity; one that needs exactly the capacity runs to its end alone."""
    e = engine(k, capacity=2, kv_capacity=20, max_len=64)
    prompt = list(range(1, 11))
    fits = 20 - len(prompt) - k + 1  # (its last token is never fed back: it needs no KV)
    with pytest.raises(PreconditionError, match=rf"request 1: prompt 10 \+ {fits + 1} new tokens \+ {k} speculative positions, less its last "
                                                rf"token, need 21 KV locations at once, over the engine's kv_capacity 20"):
        e.admit(RequestId(1), prompt, max_new_tokens=fits + 1)
    assert not e.live and RequestId(1) not in e.requests
    e.admit(RequestId(2), prompt, max_new_tokens=fits)
    e.run_until_done()
    assert len(e.outputs[RequestId(2)]) == fits and e.kv.num_free == 20
