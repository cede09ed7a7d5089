"""Every refusal of a malformed IR node, one case each: the node is not built (or does not verify)
and the error names the field and the value in the words a caller reads.

Table-driven so that each check of ``ir.init``, ``ir.batch``, ``ir.plan``, ``ir.spec`` and ``ir.verify``
has a case that only that check refuses (a well-formed neighbour of the bad node is accepted), the
pass registry's refusal of a function that is not a pass, and the refusal of a node class whose
column declarations cannot be checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest

from ir.batch import DecodeBatch, ExtendBatch, MixedBatch
from ir.columns import I64, MAX_SEQ_LEN, REQUEST, ColumnNode, as_i64, build_unchecked, column, length_of, per, tokens_of
from ir.errors import IRValidationError, IRVerificationError, PreconditionError
from ir.ids import TARGET_POOL, DraftId, MambaSlot, PoolId, RequestId, SampleId, TicketSerial
from ir.init import InitIntent, MambaInit, MambaSnapshot, Ticket, op_writes
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.spec import Proposals
from ir.verify import verify
from tests.helpers import AFTER_NAMED, BEFORE_NAMED

CLEAR, COW, CONT = InitIntent.CLEAR, InitIntent.COW, InitIntent.CONTINUE
S = TicketSerial(11)
SID = SampleId(11)


def _ext_cols(**over: Any) -> dict[str, Any]:
    """Two requests (slots 1 and 2), one token each at KV 0 and 1."""
    cols: dict[str, Any] = {
        "rids": [1, 2], "slots": [1, 2], "prefix_lens": [0, 0], "extend_lens": [1, 1], "more_chunks": [False, False],
        "input_ids": [5, 6], "kv_locs": [0, 1],
    }
    cols.update(over)
    return cols


def ext_batch(**over: Any) -> ExtendBatch:
    fields: dict[str, Any] = {"intents": (CLEAR, CLEAR), "init": MambaInit(serial=S, clear_slots=(1, 2))}
    fields.update(over)
    cols = _ext_cols(**{k: v for k, v in fields.items() if k not in ("intents", "init", "snapshot")})
    rest = {k: v for k, v in fields.items() if k in ("intents", "init", "snapshot")}
    return ExtendBatch(**cols, **rest)


def dec_cols(**over: Any) -> dict[str, Any]:
    """Two running requests (rids 3, 4 in slots 3, 4) at KV 10 and 11."""
    cols: dict[str, Any] = {"rids": [3, 4], "slots": [3, 4], "seq_lens": [5, 5], "input_ids": [7, 7], "kv_locs": [10, 11]}
    cols.update(over)
    return cols


def _four(**over: Any) -> dict[str, Any]:
    """Four running requests, distinct everywhere unless ``over`` repeats something."""
    cols: dict[str, Any] = {"rids": [3, 4, 5, 6], "slots": [3, 4, 5, 6], "seq_lens": [5] * 4, "input_ids": [7] * 4, "kv_locs": [10, 11, 12, 13]}
    cols.update(over)
    return cols


def ext_plan(init: MambaInit | None = None, **over: Any) -> ExtendPlan:
    tickets = over.pop("tickets", (Ticket(pool=TARGET_POOL, op=init or MambaInit(serial=S, clear_slots=(1, 2))),))
    snapshots = over.pop("snapshots", ())
    sample = over.pop("sample_id", None)
    return ExtendPlan(**_ext_cols(**over), tickets=tickets, snapshots=snapshots, sample_id=sample)


def _snap(src: tuple[int, ...], dst: tuple[int, ...], serial: int = 12) -> MambaSnapshot:
    return MambaSnapshot(serial=TicketSerial(serial), src=src, dst=dst)


def test_the_well_formed_neighbours_are_accepted() -> None:
    """The baseline every case below changes in one place."""
    verify(ext_batch())
    verify(ext_batch(intents=(CLEAR, COW), init=MambaInit(serial=S, clear_slots=(1,), cow_src=(5,), cow_dst=(2,))))
    verify(ext_batch(intents=(CONT, CONT), init=None, prefix_lens=[3, 3], snapshot=_snap((1,), (5,))))
    verify(DecodeBatch(**dec_cols()))
    verify(MixedBatch(extend=ext_batch(), decode=DecodeBatch(**dec_cols())))
    verify(ext_plan())
    verify(ext_plan(tickets=(), snapshots=(Ticket(pool=TARGET_POOL, op=_snap((1,), (5,))),)))
    verify(DecodePlan(**dec_cols()))
    verify(MixedPlan(extend=ext_plan(sample_id=SID), decode=DecodePlan(**dec_cols(), sample_id=SID)))


VALIDATION: list[tuple[str, Callable[[], object], str]] = [
    # ir.init
    ("serial 0", lambda: MambaInit(serial=TicketSerial(0), clear_slots=(1,)), r"MambaInit\.serial: must be positive .*\(got 0\)"),
    ("slots not a tuple", lambda: MambaInit(serial=S, clear_slots=3), r"MambaInit\.clear_slots: must be a tuple or list of ints \(got 3\)"),
    ("cow lengths", lambda: MambaInit(serial=S, cow_src=(3, 4), cow_dst=(5,)), r"MambaInit\.cow_dst: length must equal len\(cow_src\) \(2\) \(got \(5,\)\)"),
    ("padding slot cleared", lambda: MambaInit(serial=S, clear_slots=(0,)), r"MambaInit\.clear_slots: slot must be >= 1 .*\(got 0\)"),
    ("padding slot as cow dst", lambda: MambaInit(serial=S, cow_src=(2,), cow_dst=(0,)), r"MambaInit\.cow_dst: slot must be >= 1 .*\(got 0\)"),
    ("cleared twice", lambda: MambaInit(serial=S, clear_slots=(2, 2)), r"MambaInit\.clear_slots: slot 2 appears twice \(got 2\)"),
    ("cow dst twice", lambda: MambaInit(serial=S, cow_src=(3, 4), cow_dst=(5, 5)), r"MambaInit\.cow_dst: slot 5 appears twice"),
    ("cow onto itself", lambda: MambaInit(serial=S, cow_src=(3,), cow_dst=(3,)), r"MambaInit\.cow_src: COW copies slot 3 onto itself"),
    ("cow src cleared", lambda: MambaInit(serial=S, clear_slots=(3,), cow_src=(3,), cow_dst=(4,)), r"MambaInit\.cow_src: COW src slot 3 is cleared in the same forward"),
    ("cow dst cleared", lambda: MambaInit(serial=S, clear_slots=(4,), cow_src=(3,), cow_dst=(4,)), r"MambaInit\.cow_dst: slot 4 is both cleared and a COW dst"),
    ("chained cow", lambda: MambaInit(serial=S, cow_src=(3, 4), cow_dst=(4, 5)), r"MambaInit\.cow_src: slot 4 is both a COW src and a COW dst"),
    ("snapshot serial", lambda: _snap((1,), (2,), serial=0), r"MambaSnapshot\.serial: must be positive"),
    ("empty snapshot", lambda: _snap((), ()), r"MambaSnapshot\.dst: a snapshot copies at least one slot"),
    ("snapshot lengths", lambda: _snap((1, 2), (3,)), r"MambaSnapshot\.dst: length must equal len\(src\) \(2\)"),
    ("snapshot of padding", lambda: _snap((0,), (3,)), r"MambaSnapshot\.src: slot must be >= 1 .*\(got 0\)"),
    ("snapshot into padding", lambda: _snap((1,), (0,)), r"MambaSnapshot\.dst: slot must be >= 1 .*\(got 0\)"),
    ("snapshot dst twice", lambda: _snap((1, 2), (3, 3)), r"MambaSnapshot\.dst: slot 3 appears twice"),
    ("snapshot chained", lambda: _snap((1, 2), (2, 3)), r"MambaSnapshot\.dst: slot 2 is both a snapshot source and a snapshot target"),
    ("ticket pool empty", lambda: Ticket(pool=PoolId(""), op=MambaInit(serial=S, clear_slots=(1,))), r"Ticket\.pool: must be a non-empty pool name"),
    ("snapshot ticket pool", lambda: Ticket(pool=None, op=_snap((1,), (2,))), r"Ticket\.pool: must be a pool name \(a non-empty str\), not NoneType"),  # type: ignore[arg-type]  # the refusal under test
    # ir.batch
    ("intents not a tuple", lambda: ext_batch(intents=CLEAR), r"ExtendBatch\.intents: must be a tuple of InitIntent \(got <InitIntent\.CLEAR"),
    ("intent not an InitIntent", lambda: ext_batch(intents=(CLEAR, "clear")), r"ExtendBatch\.intents: every entry must be an InitIntent \(got 'clear'\)"),
    ("one intent short", lambda: ext_batch(intents=(CLEAR,)), r"ExtendBatch\.intents: length must equal len\(rids\) \(2\) \(got 1\)"),
    ("empty init", lambda: ext_batch(intents=(CONT, CONT), prefix_lens=[3, 3], init=MambaInit(serial=S)), r"ExtendBatch\.init: an empty MambaInit must be None"),
    # ir.plan
    ("tickets not a tuple", lambda: ext_plan(tickets=None), rf"ExtendPlan\.tickets: must be a tuple of a Ticket of {BEFORE_NAMED} \(got None\)"),
    ("snapshot in tickets", lambda: ext_plan(tickets=(Ticket(pool=TARGET_POOL, op=_snap((1,), (5,))),)), rf"ExtendPlan\.tickets: every entry must be a Ticket of {BEFORE_NAMED}, not a Ticket of a MambaSnapshot"),
    ("init ticket in snapshots", lambda: ext_plan(snapshots=(Ticket(pool=TARGET_POOL, op=MambaInit(serial=S, clear_slots=(1, 2))),)), rf"^ExtendPlan\.snapshots: every entry must be a Ticket of {AFTER_NAMED}, not a Ticket of a MambaInit \(got Ticket\("),
    ("two tickets for a pool", lambda: ext_plan(tickets=(Ticket(pool=TARGET_POOL, op=MambaInit(serial=S, clear_slots=(1, 2))),) * 2), r"ExtendPlan\.tickets: two tickets for one pool \(got 'target'\)"),
    ("tickets of two serials", lambda: ext_plan(tickets=(Ticket(pool=PoolId("a"), op=MambaInit(serial=S, clear_slots=(1, 2))), Ticket(pool=PoolId("b"), op=MambaInit(serial=TicketSerial(13), clear_slots=(1, 2))))), r"ExtendPlan\.tickets: tickets of one plan share one serial \(got \[11, 13\]\)"),
    ("tickets of two ops", lambda: ext_plan(tickets=(Ticket(pool=PoolId("a"), op=MambaInit(serial=S, clear_slots=(1, 2))), Ticket(pool=PoolId("b"), op=MambaInit(serial=S, clear_slots=(1,))))), r"ExtendPlan\.tickets: tickets of one plan carry the same ops for every pool"),
    ("snapshots of two serials", lambda: ext_plan(snapshots=(Ticket(pool=PoolId("a"), op=_snap((1,), (5,))), Ticket(pool=PoolId("b"), op=_snap((1,), (5,), serial=14)))), r"ExtendPlan\.snapshots: tickets of one plan share one serial \(got \[12, 14\]\)"),
    ("extend sample 0", lambda: ext_plan(sample_id=SampleId(0)), r"ExtendPlan\.sample_id: must be a positive sample id \(ir\.mint\.mint_sample_id\(\)\)"),
    ("decode sample 0", lambda: DecodePlan(**dec_cols(), sample_id=SampleId(0)), r"DecodePlan\.sample_id: must be a positive sample id"),
    ("decode inputs_from 0", lambda: DecodePlan(**dec_cols(input_ids=[0, 0]), inputs_from=SampleId(0)), r"DecodePlan\.inputs_from: must be a positive sample id"),
    ("inputs from itself", lambda: DecodePlan(**dec_cols(input_ids=[0, 0]), sample_id=SID, inputs_from=SID), r"DecodePlan\.inputs_from: names this plan's own sample_id \(got 11\)"),
    ("tokens with inputs_from", lambda: DecodePlan(**dec_cols(input_ids=[0, 7]), inputs_from=SID), r"DecodePlan\.input_ids: must be placeholders \(all 0\) when inputs_from names them \(got \[0, 7\]\)"),
    ("two samples in one forward", lambda: MixedPlan(extend=ext_plan(sample_id=SID), decode=DecodePlan(**dec_cols(), sample_id=SampleId(13))), r"MixedPlan\.decode: keeps its tokens under sample #13, the extend part under #11"),
    # ir.spec
    ("proposals not whole rows", lambda: Proposals(k=2, draft_id=DraftId(11), tokens=[4, 5, 6]), r"^Proposals\.tokens: must hold k \(2\) tokens per row \(got 3\)$"),
]


@pytest.mark.parametrize(("build", "match"), [pytest.param(b, m, id=i) for i, b, m in VALIDATION])
def test_a_malformed_node_is_not_built(build: Callable[[], object], match: str) -> None:
    with pytest.raises(IRValidationError, match=match):
        build()


def test_one_sample_per_forward_allows_a_part_without_one() -> None:
    """Only two *different* ids are refused: one part keeping its tokens, or both under one id, is fine."""
    for e, d in ((SID, None), (None, SID), (SID, SID), (None, None)):
        plan = MixedPlan(extend=ext_plan(sample_id=e), decode=DecodePlan(**dec_cols(), sample_id=d))
        assert (plan.extend.sample_id, plan.decode.sample_id) == (e, d)


def test_pipelined_decode_and_distinct_ids_are_accepted() -> None:
    plan = DecodePlan(**dec_cols(input_ids=[0, 0]), sample_id=SampleId(13), inputs_from=SID)
    assert plan.inputs_from == SID


def test_a_snapshot_ticket_and_a_plan_find_their_pool() -> None:
    t = Ticket(pool=PoolId("a"), op=MambaInit(serial=S, clear_slots=(1, 2)))
    st = Ticket(pool=PoolId("a"), op=_snap((1,), (5,)))
    plan = ext_plan(tickets=(t,), snapshots=(st,))
    assert plan.ticket_for(PoolId("a")) == t and plan.ticket_for(TARGET_POOL) is None
    assert plan.snapshot_for(PoolId("a")) == st and plan.snapshot_for(TARGET_POOL) is None
    assert MambaInit(serial=S, clear_slots=(1, 2), cow_src=(5,), cow_dst=(3,)).num_ops == 3
    assert op_writes(MambaInit(serial=S, cow_src=(5,), cow_dst=(3,))) == (3,)
    assert not MambaInit(serial=S, cow_src=(5,), cow_dst=(3,)).is_empty and MambaInit(serial=S).is_empty


def _mixed_batch(ext: ExtendBatch, **dec: Any) -> MixedBatch:
    return MixedBatch(extend=ext, decode=DecodeBatch(**dec_cols(**dec)))


def _mixed_plan(ext: ExtendPlan, **dec: Any) -> MixedPlan:
    return MixedPlan(extend=ext, decode=DecodePlan(**dec_cols(**dec)))


VERIFICATION: list[tuple[str, Callable[[], Any], str]] = [
    ("extend rid twice", lambda: ext_batch(rids=[1, 1]), r"^ExtendBatch\.rids\[1\]: request id 1 already used at index 0$"),
    ("extend slot twice", lambda: ext_batch(slots=[2, 2], init=MambaInit(serial=S, clear_slots=(2,)), intents=(CONT, CLEAR)), r"^ExtendBatch\.slots\[1\]: slot 2 already used at index 0$"),
    ("extend KV twice", lambda: ext_batch(kv_locs=[4, 4]), r"^ExtendBatch\.kv_locs\[1\]: KV location 4 already used at index 0$"),
    ("snapshot of a stranger", lambda: ext_batch(snapshot=_snap((3,), (5,))), r"^ExtendBatch\.snapshot\.src\[0\]: slot 3 is not a request of this batch$"),
    ("snapshot over a live slot", lambda: ext_batch(snapshot=_snap((1,), (2,))), r"^ExtendBatch\.snapshot\.dst\[0\]: cache slot 2 is the live slot of a request$"),
    ("init missing", lambda: ext_batch(init=None), r"^ExtendBatch\.init: requests need init ops \(clear \(1, 2\), COW into \(\)\) but init is None$"),
    ("cow init missing", lambda: ext_batch(intents=(CONT, COW), init=None), r"^ExtendBatch\.init: requests need init ops \(clear \(\), COW into \(2,\)\) but init is None$"),
    ("clears differ", lambda: ext_batch(init=MambaInit(serial=S, clear_slots=(2, 1))), r"^ExtendBatch\.init\.clear_slots: \(2, 1\) differ from the CLEAR requests' slots \(1, 2\)$"),
    ("cow dsts differ", lambda: ext_batch(intents=(CLEAR, COW), init=MambaInit(serial=S, clear_slots=(1,), cow_src=(5,), cow_dst=(3,))), r"^ExtendBatch\.init\.cow_dst: \(3,\) differ from the COW requests' slots \(2,\)$"),
    ("cow from a live slot", lambda: ext_batch(slots=[1, 2], intents=(CONT, COW), init=MambaInit(serial=S, cow_src=(1,), cow_dst=(2,))), r"^ExtendBatch\.init\.cow_src\[0\]: COW src 1 is the live slot of a request in this batch$"),
    ("decode rid twice", lambda: DecodeBatch(**dec_cols(rids=[3, 3])), r"^DecodeBatch\.rids\[1\]: request id 3 already used at index 0$"),
    ("decode slot twice", lambda: DecodeBatch(**dec_cols(slots=[3, 3])), r"^DecodeBatch\.slots\[1\]: slot 3 already used at index 0$"),
    ("decode KV twice", lambda: DecodeBatch(**dec_cols(kv_locs=[9, 9])), r"^DecodeBatch\.kv_locs\[1\]: KV location 9 already used at index 0$"),
    ("the first of two repeats", lambda: DecodeBatch(**_four(rids=[7, 3, 3, 7])), r"^DecodeBatch\.rids\[2\]: request id 3 already used at index 1$"),
    ("a repeat among four", lambda: DecodeBatch(**_four(kv_locs=[4, 9, 4, 7])), r"^DecodeBatch\.kv_locs\[2\]: KV location 4 already used at index 0$"),
    ("a repeat at the end", lambda: DecodeBatch(**_four(slots=[5, 8, 6, 8])), r"^DecodeBatch\.slots\[3\]: slot 8 already used at index 1$"),
    ("mixed extend part", lambda: _mixed_batch(ext_batch(kv_locs=[4, 4])), r"^MixedBatch\.extend\.kv_locs\[1\]: KV location 4"),
    ("mixed decode part", lambda: _mixed_batch(ext_batch(), kv_locs=[9, 9]), r"^MixedBatch\.decode\.kv_locs\[1\]: KV location 9"),
    ("mixed cow from a decode slot", lambda: _mixed_batch(ext_batch(intents=(CLEAR, COW), init=MambaInit(serial=S, clear_slots=(1,), cow_src=(4,), cow_dst=(2,)))), r"^MixedBatch\.extend\.init\.cow_src\[0\]: COW src 4 is the live slot of a request in the decode part$"),
    ("mixed rid in both", lambda: _mixed_batch(ext_batch(), rids=[3, 2]), r"^MixedBatch\.rids: request id 2 is in both the extend and the decode part$"),
    ("mixed slot in both", lambda: _mixed_batch(ext_batch(), slots=[3, 1]), r"^MixedBatch\.slots: slot 1 is in both the extend and the decode part$"),
    ("mixed KV in both", lambda: _mixed_batch(ext_batch(), kv_locs=[1, 11]), r"^MixedBatch\.kv_locs: KV location 1 is in both the extend and the decode part$"),
    ("plan rid twice", lambda: ext_plan(rids=[1, 1]), r"^ExtendPlan\.rids\[1\]: request id 1 already used at index 0$"),
    ("plan slot twice", lambda: ext_plan(MambaInit(serial=S, clear_slots=(1,)), slots=[1, 1]), r"^ExtendPlan\.slots\[1\]: slot 1 already used at index 0$"),
    ("plan KV twice", lambda: ext_plan(kv_locs=[4, 4]), r"^ExtendPlan\.kv_locs\[1\]: KV location 4 already used at index 0$"),
    ("ticket writes a stranger", lambda: ext_plan(MambaInit(serial=S, clear_slots=(1, 3))), r"^ExtendPlan\.tickets\[0\]: ticket #11 for pool 'target' writes slot 3, which no request of the plan owns$"),
    ("ticket copies a live slot", lambda: ext_plan(MambaInit(serial=S, cow_src=(1,), cow_dst=(2,))), r"^ExtendPlan\.tickets\[0\]\.op\.cow_src\[0\]: cow src 1 is the live slot of a request in this plan$"),
    # a plan with snapshots and no init ticket (a continued chunk that ends at a snapshot) is verified all the same
    ("snapshot-only plan reads a stranger", lambda: ext_plan(tickets=(), snapshots=(Ticket(pool=TARGET_POOL, op=_snap((3,), (5,))),)), r"^ExtendPlan\.snapshots\[0\]: snapshot ticket #12 for pool 'target' reads slot 3, which no request of the plan owns$"),
    ("snapshot-only plan writes a live slot", lambda: ext_plan(tickets=(), snapshots=(Ticket(pool=TARGET_POOL, op=_snap((1,), (2,))),)), r"^ExtendPlan\.snapshots\[0\]\.op\.dst\[0\]: dst 2 is the live slot of a request in this plan$"),
    ("decode plan rid twice", lambda: DecodePlan(**dec_cols(rids=[3, 3])), r"^DecodePlan\.rids\[1\]: request id 3"),
    ("decode plan slot twice", lambda: DecodePlan(**dec_cols(slots=[3, 3])), r"^DecodePlan\.slots\[1\]: slot 3"),
    ("decode plan KV twice", lambda: DecodePlan(**dec_cols(kv_locs=[9, 9])), r"^DecodePlan\.kv_locs\[1\]: KV location 9"),
    ("mixed plan extend part", lambda: _mixed_plan(ext_plan(kv_locs=[4, 4])), r"^MixedPlan\.extend\.kv_locs\[1\]: KV location 4"),
    ("mixed plan decode part", lambda: _mixed_plan(ext_plan(), kv_locs=[9, 9]), r"^MixedPlan\.decode\.kv_locs\[1\]: KV location 9"),
    ("mixed plan cow from a decode slot", lambda: _mixed_plan(ext_plan(MambaInit(serial=S, clear_slots=(1,), cow_src=(3,), cow_dst=(2,)))), r"^MixedPlan\.extend\.tickets\[0\]\.op\.cow_src\[0\]: cow src 3 is the live slot of a request in the decode part$"),
    ("mixed plan slot in both", lambda: _mixed_plan(ext_plan(), slots=[3, 2]), r"^MixedPlan\.slots: slot 2 is in both the extend and the decode part$"),
    ("mixed plan KV in both", lambda: _mixed_plan(ext_plan(), kv_locs=[10, 0]), r"^MixedPlan\.kv_locs: KV location 0 is in both the extend and the decode part$"),
]


@pytest.mark.parametrize(("build", "match"), [pytest.param(b, m, id=i) for i, b, m in VERIFICATION])
def test_a_node_that_breaks_an_invariant_does_not_verify(build: Callable[[], Any], match: str) -> None:
    node = build()  # every field is fine on its own
    with pytest.raises(IRVerificationError, match=match):
        verify(node)


def _unchecked(node: Any, **over: Any) -> Any:
    """``node`` with ``over`` set, built without its converters and checks (as the wire decoder
    and the passes' fast paths build nodes)."""
    fields = {a.name: getattr(node, a.name) for a in attrs.fields(type(node))}
    fields.update(over)
    return build_unchecked(type(node), **fields)


def test_verify_re_runs_the_field_checks_of_every_part() -> None:
    """A node built without its checks is refused by ``verify``, for a plain node and for each part
    of a mixed one."""
    bad = _unchecked(ext_batch(), intents=(CLEAR,))
    with pytest.raises(IRValidationError, match=r"ExtendBatch\.intents: length must equal len\(rids\) \(2\)"):
        verify(bad)
    with pytest.raises(IRValidationError, match=r"ExtendBatch\.intents: length must equal"):
        verify(_unchecked(MixedBatch(extend=ext_batch(), decode=DecodeBatch(**dec_cols())), extend=bad))
    good_dec = DecodePlan(**dec_cols(input_ids=[0, 0]), inputs_from=SID)
    bad_dec = _unchecked(good_dec, input_ids=DecodePlan(**dec_cols(input_ids=[0, 5])).input_ids)
    with pytest.raises(IRValidationError, match=r"DecodePlan\.input_ids: must be placeholders"):
        verify(_unchecked(MixedPlan(extend=ext_plan(), decode=good_dec), decode=bad_dec))
    mixed = MixedPlan(extend=ext_plan(sample_id=SID), decode=DecodePlan(**dec_cols(), sample_id=SID))
    two = _unchecked(mixed, decode=DecodePlan(**dec_cols(), sample_id=SampleId(13)))
    with pytest.raises(IRValidationError, match=r"MixedPlan\.decode: keeps its tokens under sample #13"):
        verify(two)


def test_the_registry_refuses_a_function_that_is_not_a_pass() -> None:
    from passes.lower import lower
    from passes.registry import spec_of

    assert spec_of(lower).name == "lower" and spec_of(lower).ends_step
    for fn in (np.sum, print, "lower", None):
        with pytest.raises(PreconditionError, match=r"^PassManager\.run: .* is not a declared pass \(batchc's own, or one made with passes\.registry\.declare_pass\)$"):
            spec_of(fn)


def test_a_node_class_whose_column_is_sized_by_a_column_not_declared_before_it_is_refused() -> None:
    """A column's length is checked from columns declared before it: a node class that sizes one by
    a later column, or by a name that is no column, is refused when the class is made (not at its
    first construction, with a NameError from generated code)."""
    with pytest.raises(TypeError, match=r"^Later\.ids: per tokens of 'lens', which is not a column declared before it$"):

        @attrs.frozen(kw_only=True)
        class Later(ColumnNode):
            rids: I64 = column(converter=as_i64, metadata=per(REQUEST))
            ids: I64 = column(converter=as_i64, metadata=per(tokens_of("lens")))
            lens: I64 = column(converter=as_i64, metadata=per(REQUEST))

    with pytest.raises(TypeError, match=r"^Nowhere\.ids: per same of 'rid', which is not a column declared before it$"):

        @attrs.frozen(kw_only=True)
        class Nowhere(ColumnNode):
            rids: I64 = column(converter=as_i64, metadata=per(REQUEST))
            ids: I64 = column(converter=as_i64, metadata=per(length_of("rid")))


# -- admitted requests and their intents (ir.request) ---------------------------------------------


def _admitted(tokens: int = 2, **over: Any) -> AdmittedRequest:
    fields: dict[str, Any] = {"rid": RequestId(1), "slot": MambaSlot(2), "input_ids": list(range(tokens)), "kv_locs": list(range(tokens)), "intent": Clear()}
    fields.update(over)
    return AdmittedRequest(**fields)


REQUESTS: list[tuple[str, Callable[[], object], str]] = [
    ("cow from the padding slot", lambda: CopyFrom(src=MambaSlot(0), prefix_len=3), r"^CopyFrom\.src: must be >= 1 \(slot 0 is the padding slot\) \(got 0\)$"),
    ("cow without a prefix", lambda: CopyFrom(src=MambaSlot(3), prefix_len=0), r"^CopyFrom\.prefix_len: a COW starts after a cached prefix \(> 0 tokens\) \(got 0\)$"),
    ("continue without a prefix", lambda: Continue(prefix_len=0), r"^Continue\.prefix_len: a continuation follows earlier chunks \(> 0 tokens\) \(got 0\)$"),
    ("prefix past MAX_SEQ_LEN", lambda: Continue(prefix_len=MAX_SEQ_LEN + 1), r"^Continue\.prefix_len: must be <= MAX_SEQ_LEN \(2\*\*31 - 1\)"),
    ("more_chunks not a bool", lambda: _admitted(more_chunks=1), r"^AdmittedRequest\.more_chunks: must be a bool, not int \(got 1\)$"),
    ("padding slot", lambda: _admitted(slot=MambaSlot(0)), r"^AdmittedRequest\.slot: must be >= 1 \(slot 0 is the padding slot\) \(got 0\)$"),
    ("no token", lambda: _admitted(0), r"^AdmittedRequest\.input_ids: a prefill processes at least one token \(got \(\)\)$"),
    ("past MAX_SEQ_LEN", lambda: _admitted(3, intent=Continue(prefix_len=MAX_SEQ_LEN - 2)), r"^AdmittedRequest\.prefix_len: prefix_len \+ len\(input_ids\) must be <= MAX_SEQ_LEN"),
    ("snapshot into the padding slot", lambda: _admitted(snapshot_to=MambaSlot(0)), r"^AdmittedRequest\.snapshot_to: must be a cache slot >= 1 other than the request's own \(got 0\)$"),
    ("snapshot into its own slot", lambda: _admitted(snapshot_to=MambaSlot(2)), r"^AdmittedRequest\.snapshot_to: must be a cache slot >= 1 other than the request's own \(got 2\)$"),
    ("cow from its own slot", lambda: _admitted(intent=CopyFrom(src=MambaSlot(2), prefix_len=4)), r"^AdmittedRequest\.intent: COW src equals the request's own slot \(got 2\)$"),
]


@pytest.mark.parametrize(("build", "match"), [pytest.param(b, m, id=i) for i, b, m in REQUESTS])
def test_a_malformed_request_is_not_built(build: Callable[[], object], match: str) -> None:
    with pytest.raises(IRValidationError, match=match):
        build()


def test_requests_at_the_bounds_are_accepted() -> None:
    assert _admitted(2, intent=Continue(prefix_len=MAX_SEQ_LEN - 2)).prefix_len == MAX_SEQ_LEN - 2  # exactly MAX_SEQ_LEN
    assert _admitted(snapshot_to=MambaSlot(1)).snapshot_to == 1
    assert _admitted(more_chunks=np.bool_(True)).more_chunks
    assert CopyFrom(src=MambaSlot(1), prefix_len=MAX_SEQ_LEN).prefix_len == MAX_SEQ_LEN
    assert Continue(prefix_len=1).prefix_len == 1 and Clear().prefix_len == 0


def test_a_long_value_is_cut_to_the_limit_in_a_message() -> None:
    from ir.errors import short_repr

    long = "x" * 200
    assert short_repr(long) == repr(long)[:117] + "..." and len(short_repr(long)) == 120
    assert short_repr(long, limit=10) == "'xxxxxx..." and len(short_repr(long, limit=10)) == 10
    exact = "y" * 118  # its repr has exactly 120 characters: shown whole
    assert short_repr(exact) == repr(exact)
    err = IRValidationError("ExtendBatch", "rids", list(range(100)), "must be short")
    assert str(err).startswith("ExtendBatch.rids: must be short (got [0, 1, 2,") and str(err).endswith("...)") and (err.node, err.field) == ("ExtendBatch", "rids")
    ver = IRVerificationError("ExtendBatch.slots[1]", "slot 2 already used at index 0")
    assert str(ver) == "ExtendBatch.slots[1]: slot 2 already used at index 0" and ver.path == "ExtendBatch.slots[1]"
    pre = PreconditionError("commit", "accepted 3 > k=2")
    assert str(pre) == "commit: accepted 3 > k=2" and pre.pass_name == "commit"


def test_verify_re_runs_the_checks_of_a_speculative_plan_and_of_its_batch() -> None:
    from ir.spec import DraftPlan, Proposals
    from passes.prepare_for_draft import SpecContext, prepare_for_draft
    from passes.prepare_for_verify import prepare_for_verify

    draft = prepare_for_draft(DecodeBatch(**dec_cols()), SpecContext(k=2, next_tokens=[3, 3], kv_locs=list(range(30, 36))))
    verify(DraftPlan(batch=draft))
    bad = _unchecked(draft, k=0)
    with pytest.raises(IRValidationError, match=r"^DraftBatch\.k: speculative steps must be >= 1 \(got 0\)$"):
        verify(bad)
    with pytest.raises(IRValidationError, match=r"^DraftBatch\.k: speculative steps must be >= 1 \(got 0\)$"):
        verify(_unchecked(DraftPlan(batch=draft), batch=bad))
    other = prepare_for_verify(draft, Proposals(k=2, draft_id=draft.draft_id, tokens=np.full(4, 7, dtype=np.int64)))
    with pytest.raises(IRValidationError, match=r"^DraftPlan\.batch: must be a DraftBatch, not VerifyBatch"):
        verify(_unchecked(DraftPlan(batch=draft), batch=other))


def test_a_dumped_prefill_whose_header_miscounts_its_rows_is_refused() -> None:
    from ir.parse import ParseError, parse

    rows = "  init #1 clear[s1] cow[s3->s2]\n  r0 s1 prefix=0 extend=2 init=clear tokens=[5 6] kv=k0..k1\n  r1 s2 prefix=4 extend=1 init=cow more tokens=[7] kv=k2\n"
    assert parse("ExtendBatch requests=2 tokens=3\n" + rows).rid_list() == [0, 1]  # type: ignore[union-attr]  # an ExtendBatch
    for declared in (1, 3):
        with pytest.raises(ParseError, match=rf"^line 1: requests={declared} but 2 rows follow \(at 'requests={declared}'\)$"):
            parse(f"ExtendBatch requests={declared} tokens=3\n" + rows)


def test_a_copy_of_a_cache_slot_the_same_forward_snapshots_into_is_refused_naming_both_rows() -> None:
    """The copy runs before the forward and the snapshot after it: the copy would read the cache
    slot's old contents. Refused by the verifier on the batch, on the lowered plan (what a pipeline
    verifies at its default level), and inside a MIXED forward; a copy of another cache slot passes."""
    from backend.ledger import Ledger
    from compiler.manager import PassError
    from compiler.steps import Pipeline
    from passes import LowerContext, lower, prepare_for_extend

    a = AdmittedRequest(rid=RequestId(7), slot=MambaSlot(1), input_ids=[1, 2, 3], kv_locs=[0, 1, 2], intent=Clear(), snapshot_to=MambaSlot(5))
    b = AdmittedRequest(rid=RequestId(8), slot=MambaSlot(2), input_ids=[4], kv_locs=[3], intent=CopyFrom(src=MambaSlot(5), prefix_len=3))
    words = r"row 1 \(request 8, slot 2\) copies cache slot 5, which row 0 \(request 7, slot 1\) snapshots into in the same forward"
    batch = prepare_for_extend([a, b])
    with pytest.raises(IRVerificationError, match=r"ExtendBatch\.init\.cow_src\[0\]: " + words):
        verify(batch)
    with pytest.raises(IRVerificationError, match=r"ExtendPlan\.tickets\[0\]\.op\.cow_src\[0\]: " + words):
        verify(lower(batch, LowerContext()))
    mixed = MixedBatch(extend=batch, decode=DecodeBatch(rids=[9], slots=[3], seq_lens=[4], input_ids=[1], kv_locs=[9]))
    with pytest.raises(IRVerificationError, match=r"MixedBatch\.extend\.init\.cow_src\[0\]: " + words):
        verify(mixed)
    ledger = Ledger()
    with pytest.raises(PassError, match=words):
        Pipeline(ledger, LowerContext()).prefill([a, b])
    assert not ledger.outstanding()  # refused before its tickets were registered
    # the neighbour: the copy reads another cache slot
    ok = attrs.evolve(b, intent=CopyFrom(src=MambaSlot(6), prefix_len=3))
    verify(lower(prepare_for_extend([a, ok]), LowerContext()))
