"""Every pass checks its arguments at entry.

A pass handed an argument of the wrong type (``None``, a list where a batch or an int64 array is
expected, a node of another phase) raises exactly ``PreconditionError``, whose message starts with
the pass's name and names the argument and the bad type or value: never an ``AttributeError``,
``TypeError``, ``AssertionError`` or ``OverflowError`` from deep inside, and never a silent
coercion (``filter_batch(b, [True])`` does not drop request 1; ``accept`` does not truncate 7.9 to
token 7). Token arrays (``target_tokens``) must be 1-D int64 numpy arrays of
non-negative ids: a list, a tensor or another dtype is refused, not converted; a verify takes the
draft step's ``Proposals`` and nothing else (a token array is refused like a list).

The suite runs under typeguard, which would refuse these calls at the signature; production runs
without it, so each call runs under ``suppress_type_checks`` and the pass's own check is what is
tested. Inputs are immutable nodes, so a refusal changes nothing by construction; the test also
checks that the inputs still compare equal to fresh copies.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Iterator

import attrs
import numpy as np
import pytest
import torch
from typeguard import suppress_type_checks

import passes
from backend.ledger import Ledger
from compiler.manager import PassError, PassManager
from compiler.steps import Pipeline
from ir.batch import DecodeBatch, ExtendBatch, MixedBatch
from ir.columns import frozen_i64
from ir.errors import PreconditionError, short_repr
from ir.hidden import asked_hidden
from ir.ids import HiddenId, RequestId, SampleId
from ir.mint import mint_hidden_id
from ir.sampling import GREEDY
from ir.spec import AcceptResult, CommitBatch, DraftBatch, VerifyBatch
from passes import (
    DecodeContext,
    LowerContext,
    SpecContext,
    accept,
    commit,
    filter_batch,
    lower,
    merge_batch,
    mix_with_running,
    prepare_for_decode,
    prepare_for_draft,
    prepare_for_draft_commit,
    prepare_for_draft_extend,
    prepare_for_extend,
    prepare_for_head_commit,
    prepare_for_head_extend,
    prepare_for_verify,
    withdraw,
)
from tests.helpers import decode_batch, proposed, request, verified

# -- inputs (valid ones; each case swaps one argument for a bad one) ---------------------------------

RUNNING = decode_batch([1, 2], [1, 3], [4, 6], [20, 21])
EXTEND = prepare_for_extend([request(7, 2, [5, 6], 10)])
DECODE_CTX = DecodeContext(next_tokens=[8, 9], kv_locs=[40, 41])
MIXED = mix_with_running(EXTEND, prepare_for_decode(RUNNING, DECODE_CTX))
LOWER_CTX = LowerContext()
SPEC_CTX = SpecContext(k=2, next_tokens=[3, 4], kv_locs=list(range(30, 36)))
DRAFT = prepare_for_draft(RUNNING, SPEC_CTX)
PROPOSED = proposed(DRAFT, [5, 6, 5, 6])
VERIFY = prepare_for_verify(DRAFT, PROPOSED)
RESULT = accept(VERIFY, verified(VERIFY, frozen_i64([5, 6, 1, 5, 2, 3])))
COMMIT = commit(VERIFY, RESULT)
PLAN = lower(RUNNING, LOWER_CTX)
REQUEST = request(7, 2, [5, 6], 10)

PREFILL_HIDDEN = asked_hidden(lower(EXTEND, LOWER_CTX, keep_hidden=mint_hidden_id()))
VERIFY_HIDDEN = asked_hidden(lower(VERIFY, LOWER_CTX, keep_hidden=mint_hidden_id()))
assert PREFILL_HIDDEN is not None and VERIFY_HIDDEN is not None

INPUTS: tuple[object, ...] = (
    RUNNING, EXTEND, DECODE_CTX, MIXED, LOWER_CTX, SPEC_CTX, DRAFT, VERIFY, RESULT, COMMIT, PLAN, REQUEST, PREFILL_HIDDEN, VERIFY_HIDDEN,
)


@attrs.frozen
class ArgCase:
    id: str
    call: Callable[[], object]
    pass_name: str
    arg: str
    """The argument the message must name (``requests[1]`` for an entry of a sequence argument)."""
    shown: str
    """Regex: how the message shows the bad value or its type."""


def _got(value: object) -> str:
    """``got <type> (<repr>)``: how ``bad_arg`` shows the argument it refuses (a long repr cut)."""
    return rf"got {re.escape(type(value).__name__)} \({re.escape(short_repr(value))}\)"


def _arg_cases(pass_name: str, arg: str, call: Callable[[object], object], bad: list[tuple[str, object]]) -> list[ArgCase]:
    """One case per bad value of argument ``arg``, each shown as ``got <type> (<repr>)``."""
    return [ArgCase(f"{pass_name}-{arg}-{kind}", (lambda v=v: call(v)), pass_name, arg, _got(v)) for kind, v in bad]


def _nodes(*values: object) -> list[tuple[str, object]]:
    """Nodes of the wrong phase (or plans, contexts) as bad values, named by their type."""
    return [(type(v).__name__, v) for v in values]


NOT_A_NODE: list[tuple[str, object]] = [("none", None), ("str", "batch"), ("int", 7), ("list", [1, 2])]
"""Bad values every node-typed argument is tried with, besides nodes of the wrong phase."""


CASES: list[ArgCase] = [
    # -- prepare_for_extend: a sequence of AdmittedRequest ------------------------------------------
    *_arg_cases("prepare_for_extend", "requests", prepare_for_extend, [("none", None), ("str", "ab"), ("bytes", b"ab"), ("int", 7), ("set", {1})]),  # type: ignore[arg-type]
    *_arg_cases("prepare_for_extend", "requests", prepare_for_extend, _nodes(REQUEST, RUNNING)),  # type: ignore[arg-type]
    ArgCase("prepare_for_extend-none-entry", lambda: prepare_for_extend([None]), "prepare_for_extend", r"requests\[0\]", _got(None)),  # type: ignore[list-item]
    ArgCase("prepare_for_extend-int-entry", lambda: prepare_for_extend([REQUEST, 7]), "prepare_for_extend", r"requests\[1\]", _got(7)),  # type: ignore[list-item]
    ArgCase("prepare_for_extend-batch-entry", lambda: prepare_for_extend((REQUEST, EXTEND)), "prepare_for_extend", r"requests\[1\]", r"got ExtendBatch"),  # type: ignore[arg-type]
    ArgCase("prepare_for_extend-range", lambda: prepare_for_extend(range(2)), "prepare_for_extend", r"requests\[0\]", _got(0)),  # type: ignore[arg-type]
    *_arg_cases(
        "prepare_for_extend", "sampling", lambda v: prepare_for_extend([REQUEST], v),  # type: ignore[arg-type]
        [("str", "greedy"), ("int", 7), ("dict", {"temperature": 1.0}), *_nodes(RUNNING, GREEDY)],
    ),
    # -- merge_batch -----------------------------------------------------------------------------------
    *_arg_cases("merge_batch", "running", lambda v: merge_batch(v, EXTEND), [*NOT_A_NODE, *_nodes(EXTEND, PLAN)]),  # type: ignore[arg-type]
    *_arg_cases("merge_batch", "prefilled", lambda v: merge_batch(RUNNING, v), [*NOT_A_NODE, *_nodes(MIXED, DRAFT, PLAN)]),  # type: ignore[arg-type]
    # -- mix_with_running --------------------------------------------------------------------------------
    *_arg_cases("mix_with_running", "extend", lambda v: mix_with_running(v, RUNNING), [*NOT_A_NODE, *_nodes(RUNNING, MIXED)]),  # type: ignore[arg-type]
    *_arg_cases("mix_with_running", "running", lambda v: mix_with_running(EXTEND, v), [*NOT_A_NODE, *_nodes(EXTEND, PLAN)]),  # type: ignore[arg-type]
    # -- prepare_for_decode ------------------------------------------------------------------------------
    *_arg_cases("prepare_for_decode", "batch", lambda v: prepare_for_decode(v, DECODE_CTX), [*NOT_A_NODE, *_nodes(DRAFT, PLAN)]),  # type: ignore[arg-type]
    *_arg_cases("prepare_for_decode", "ctx", lambda v: prepare_for_decode(RUNNING, v), [*NOT_A_NODE, *_nodes(SPEC_CTX, LOWER_CTX)]),  # type: ignore[arg-type]
    # -- lower ---------------------------------------------------------------------------------------------
    *_arg_cases("lower", "batch", lambda v: lower(v, LOWER_CTX), [*NOT_A_NODE, *_nodes(PLAN, REQUEST, DECODE_CTX)]),  # type: ignore[call-overload]
    *_arg_cases("lower", "ctx", lambda v: lower(RUNNING, v), [*NOT_A_NODE, ("pools", ("target",)), *_nodes(DECODE_CTX)]),  # type: ignore[call-overload]
    # a sample only for the forwards that keep one (extend, decode, mixed), inputs read only by decode rows
    *_arg_cases("lower", "sample_id", lambda v: lower(DRAFT, LOWER_CTX, sample_id=v), [("sample", SampleId(5))]),  # type: ignore[call-overload]
    *_arg_cases("lower", "sample_id", lambda v: lower(COMMIT, LOWER_CTX, sample_id=v), [("sample-commit", SampleId(5))]),  # type: ignore[call-overload]
    *_arg_cases("lower", "inputs_from", lambda v: lower(EXTEND, LOWER_CTX, inputs_from=v), [("sample", SampleId(5))]),  # type: ignore[call-overload]
    *_arg_cases("lower", "inputs_from", lambda v: lower(VERIFY, LOWER_CTX, inputs_from=v), [("sample-verify", SampleId(5))]),  # type: ignore[call-overload]
    # hidden states kept only by the forwards a head reads (a prefill, a verify)
    *_arg_cases("lower", "keep_hidden", lambda v: lower(DRAFT, LOWER_CTX, keep_hidden=v), [("hidden-draft", HiddenId(5))]),  # type: ignore[call-overload]
    *_arg_cases("lower", "keep_hidden", lambda v: lower(RUNNING, LOWER_CTX, keep_hidden=v), [("hidden-decode", HiddenId(5))]),  # type: ignore[call-overload]
    *_arg_cases("lower", "keep_hidden", lambda v: lower(COMMIT, LOWER_CTX, keep_hidden=v), [("hidden-commit", HiddenId(5))]),  # type: ignore[call-overload]
    # -- withdraw: a prefill's batch, and drop (request ids of it, each once) -------------------------------
    *_arg_cases("withdraw", "batch", lambda v: withdraw(v, [7]), [*NOT_A_NODE, *_nodes(RUNNING, MIXED, PLAN)]),  # type: ignore[arg-type]
    *_arg_cases("withdraw", "drop", lambda v: withdraw(EXTEND, v), [("none", None), ("str", "7"), ("int", 7)]),  # type: ignore[arg-type]
    ArgCase("withdraw-drop-bool", lambda: withdraw(EXTEND, [True]), "withdraw", "drop", r"must be an int, not bool \(got True\)"),  # type: ignore[list-item]
    ArgCase("withdraw-drop-absent", lambda: withdraw(EXTEND, [8]), "withdraw", "drop", r"^withdraw: drop: request 8 is not in this prefill \(its requests: \[7\]\)$"),
    ArgCase("withdraw-drop-twice", lambda: withdraw(EXTEND, [7, 7]), "withdraw", "drop", r"^withdraw: drop names request 7 twice$"),
    # -- filter_batch: the batch, and drop (request ids, checked like IR int fields) ------------------------
    *_arg_cases("filter_batch", "batch", lambda v: filter_batch(v, [1]), [*NOT_A_NODE, *_nodes(MIXED, DRAFT)]),  # type: ignore[type-var]
    *_arg_cases("filter_batch", "drop", lambda v: filter_batch(RUNNING, v), [("none", None), ("str", "12"), ("bytes", b"\x01"), ("int", 1)]),  # type: ignore[arg-type]
    ArgCase("filter_batch-drop-bool", lambda: filter_batch(RUNNING, [True]), "filter_batch", "drop", r"must be an int, not bool \(got True\)"),  # type: ignore[list-item]
    ArgCase("filter_batch-drop-float", lambda: filter_batch(RUNNING, [1.0]), "filter_batch", "drop", r"must be an int, not float \(got 1\.0\)"),  # type: ignore[list-item]
    ArgCase("filter_batch-drop-digit-str", lambda: filter_batch(RUNNING, ["1"]), "filter_batch", "drop", r"must be an int, not str \(got '1'\)"),  # type: ignore[list-item]
    ArgCase("filter_batch-drop-none-entry", lambda: filter_batch(RUNNING, [2, None]), "filter_batch", "drop", r"must be an int, not NoneType \(got None\)"),  # type: ignore[list-item]
    ArgCase("filter_batch-drop-numpy-float", lambda: filter_batch(RUNNING, [np.float64(1)]), "filter_batch", "drop", r"not float64 \(got np\.float64\(1\.0\)\)|not float64 \(got 1\.0\)"),  # type: ignore[list-item]
    ArgCase("filter_batch-drop-above-int64", lambda: filter_batch(RUNNING, [2**64]), "filter_batch", "drop", rf"must fit in int64 \(got {2**64}\)"),
    ArgCase("filter_batch-drop-below-int64", lambda: filter_batch(RUNNING, [-(2**63) - 1]), "filter_batch", "drop", rf"must fit in int64 \(got {-(2**63) - 1}\)"),
    ArgCase("filter_batch-drop-float-array", lambda: filter_batch(RUNNING, np.array([1.0])), "filter_batch", "drop", r"dtype float64"),  # type: ignore[arg-type]
    ArgCase("filter_batch-drop-bool-array", lambda: filter_batch(RUNNING, np.array([True])), "filter_batch", "drop", r"dtype bool"),  # type: ignore[arg-type]
    ArgCase("filter_batch-drop-2d-array", lambda: filter_batch(RUNNING, np.array([[1]])), "filter_batch", "drop", r"shape \(1, 1\)"),
    ArgCase("filter_batch-drop-uint64-above-int64", lambda: filter_batch(RUNNING, np.array([1, 2**63], dtype=np.uint64)), "filter_batch", "drop", rf"must fit in int64 \(got {2**63}\)"),
    # -- prepare_for_draft ------------------------------------------------------------------------------------
    *_arg_cases("prepare_for_draft", "batch", lambda v: prepare_for_draft(v, SPEC_CTX), [*NOT_A_NODE, *_nodes(EXTEND, DRAFT)]),  # type: ignore[arg-type]
    *_arg_cases("prepare_for_draft", "ctx", lambda v: prepare_for_draft(RUNNING, v), [*NOT_A_NODE, *_nodes(DECODE_CTX)]),  # type: ignore[arg-type]
    # -- prepare_for_verify: the draft's Proposals, nothing else (raw token arrays included) --------------------
    *_arg_cases("prepare_for_verify", "batch", lambda v: prepare_for_verify(v, PROPOSED), [*NOT_A_NODE, *_nodes(VERIFY, RUNNING)]),  # type: ignore[arg-type]
    *_arg_cases(
        "prepare_for_verify", "proposals", lambda v: prepare_for_verify(DRAFT, v),  # type: ignore[arg-type]
        [("none", None), ("list", [7, 7, 7, 7]), ("tuple", (7, 7, 7, 7)), ("int", 7), ("array", frozen_i64([7, 7, 7, 7])),
         ("tensor", torch.tensor([7, 7, 7, 7])), *_nodes(DRAFT)],
    ),
    # -- accept: target_tokens is a 1-D int64 array of token ids ---------------------------------------------
    *_arg_cases("accept", "batch", lambda v: accept(v, verified(VERIFY, frozen_i64([7] * 6))), [*NOT_A_NODE, *_nodes(DRAFT, COMMIT)]),  # type: ignore[arg-type]
    *_arg_cases("accept", "verified", lambda v: accept(VERIFY, v), [*NOT_A_NODE, ("tokens", frozen_i64([7] * 6)), *_nodes(RESULT, PROPOSED)]),  # type: ignore[arg-type]
    # -- commit -------------------------------------------------------------------------------------------------
    *_arg_cases("commit", "batch", lambda v: commit(v, RESULT), [*NOT_A_NODE, *_nodes(DRAFT, COMMIT)]),  # type: ignore[arg-type]
    *_arg_cases("commit", "result", lambda v: commit(VERIFY, v), [*NOT_A_NODE, ("tuple", ((1, 1), (9, 9))), *_nodes(COMMIT)]),  # type: ignore[arg-type]
    # -- prepare_for_draft_commit: the commit and the draft of its own iteration -----------------------------------
    *_arg_cases("prepare_for_draft_commit", "batch", lambda v: prepare_for_draft_commit(v, DRAFT), [*NOT_A_NODE, *_nodes(VERIFY, lower(COMMIT, LOWER_CTX), EXTEND)]),  # type: ignore[arg-type]
    *_arg_cases("prepare_for_draft_commit", "draft", lambda v: prepare_for_draft_commit(COMMIT, v), [*NOT_A_NODE, *_nodes(VERIFY, lower(DRAFT, LOWER_CTX), COMMIT)]),  # type: ignore[arg-type]
    # -- prepare_for_draft_extend ---------------------------------------------------------------------------------
    *_arg_cases("prepare_for_draft_extend", "batch", prepare_for_draft_extend, [*NOT_A_NODE, *_nodes(VERIFY, lower(COMMIT, LOWER_CTX), EXTEND)]),  # type: ignore[arg-type]
    # -- the draft head's phases: a prefill's batch and its hidden states; a commit and its verify's ----------------
    *_arg_cases("prepare_for_head_extend", "batch", lambda v: prepare_for_head_extend(v, PREFILL_HIDDEN), [*NOT_A_NODE, *_nodes(MIXED, COMMIT, RUNNING)]),  # type: ignore[arg-type]
    *_arg_cases(
        "prepare_for_head_extend", "hidden", lambda v: prepare_for_head_extend(EXTEND, v),  # type: ignore[arg-type]
        [("none", None), ("int", 7), ("array", frozen_i64([1, 2])), *_nodes(PROPOSED, EXTEND)],
    ),
    *_arg_cases("prepare_for_head_commit", "batch", lambda v: prepare_for_head_commit(v, VERIFY_HIDDEN), [*NOT_A_NODE, *_nodes(EXTEND, VERIFY, lower(COMMIT, LOWER_CTX))]),  # type: ignore[arg-type]
    *_arg_cases(
        "prepare_for_head_commit", "hidden", lambda v: prepare_for_head_commit(COMMIT, v),  # type: ignore[arg-type]
        [("none", None), ("int", 7), ("array", frozen_i64([1, 2])), *_nodes(PROPOSED, COMMIT)],
    ),
]


def _snapshot() -> list[object]:
    return [copy.deepcopy(v) for v in INPUTS]


def test_case_ids_unique_and_every_pass_covered() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    pass_functions = {name for name in passes.__all__ if inspect.isfunction(getattr(passes, name))}
    assert {c.pass_name for c in CASES} == pass_functions
    # every parameter of every pass is tried
    tried = {(c.pass_name, c.arg.split("[")[0]) for c in CASES}
    for name in pass_functions:
        for param in inspect.signature(getattr(passes, name)).parameters:
            assert (name, param) in tried, f"no case passes a bad {param!r} to {name}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_argument_is_refused_with_a_precondition_error(case: ArgCase) -> None:
    before = _snapshot()
    with suppress_type_checks():  # production runs without typeguard: the pass's own check must hold
        with pytest.raises(PreconditionError) as info:
            case.call()
    err = info.value
    assert type(err) is PreconditionError, f"expected exactly PreconditionError, got {type(err).__name__}"
    assert err.pass_name == case.pass_name
    message = str(err)
    assert message.startswith(f"{case.pass_name}: "), message
    assert re.search(rf"(?<![\w.]){case.arg}(?!\w)", message), f"argument {case.arg!r} not named in: {message}"
    assert re.search(case.shown, message), f"bad value {case.shown!r} not shown in: {message}"
    assert before == _snapshot(), "an input changed"


# -- what stays accepted -------------------------------------------------------------------------------------


def _drop_forms() -> Iterator[object]:
    yield [RequestId(2)]
    yield (2,)
    yield {2}
    yield frozenset({2, 99})
    yield (r for r in [2])
    yield [np.int64(2)]
    yield [np.uint8(2)]
    yield np.array([2], dtype=np.int32)
    yield np.array([2], dtype=np.uint64)


@pytest.mark.parametrize("drop", list(_drop_forms()), ids=lambda d: type(d).__name__)
def test_filter_batch_takes_any_iterable_of_int_ids(drop: object) -> None:
    with suppress_type_checks():
        kept = filter_batch(RUNNING, drop)  # type: ignore[arg-type]
    assert kept.rids.tolist() == [1]


def test_filter_batch_empty_or_unknown_drop_returns_the_batch() -> None:
    assert filter_batch(RUNNING, []) is RUNNING
    assert filter_batch(RUNNING, np.array([], dtype=np.int64)) is RUNNING  # type: ignore[arg-type]
    assert filter_batch(RUNNING, [RequestId(-5), RequestId(2**63 - 1)]) is RUNNING
    assert filter_batch(RUNNING, np.array([2**63 - 1], dtype=np.uint64)) is RUNNING  # the largest id a uint64 array may hold


def test_token_id_0_and_kv_location_0_are_accepted() -> None:
    """0 is a token id and a KV location like any other: the contexts and the draft tokens take it."""
    decoded = prepare_for_decode(RUNNING, DecodeContext(next_tokens=[0, 0], kv_locs=[0, 1]))
    assert decoded.input_ids.tolist() == [0, 0] and decoded.kv_locs.tolist() == [0, 1]
    draft = prepare_for_draft(RUNNING, SpecContext(k=2, next_tokens=[0, 0], kv_locs=list(range(6))))
    verified = prepare_for_verify(draft, proposed(draft, [0, 0, 0, 0]))
    assert verified.input_ids.tolist() == [0] * 6 and verified.kv_locs.tolist() == list(range(6))


def test_prepare_for_extend_takes_a_list_or_a_tuple() -> None:
    a = prepare_for_extend([REQUEST])
    b = prepare_for_extend((REQUEST,))
    assert a.rids.tolist() == b.rids.tolist() == [7]


def test_token_arrays_that_are_int64_pass_whoever_owns_them() -> None:
    """A writeable int64 array (not IR-owned) is accepted and copied into the IR, never aliased."""
    toks = np.array([5, 6, 5, 6], dtype=np.int64)
    v = prepare_for_verify(DRAFT, proposed(DRAFT, toks))
    toks[0] = 99
    assert v.input_ids.tolist() == [3, 5, 6, 4, 5, 6]
    target = np.array([5, 6, 1, 5, 2, 3], dtype=np.int64)
    r = accept(v, verified(v, target))
    target[:] = 0
    assert r.accepted.tolist() == [2, 1] and r.bonus.tolist() == [1, 2]


def test_refusal_through_the_pipeline_names_the_pass() -> None:
    """Through a pass manager the refusal is wrapped in ``PassError`` naming the pass; the ledger
    registers nothing."""
    ledger = Ledger()
    pipe = Pipeline(ledger, pm=PassManager(verify_level=2))
    with suppress_type_checks():
        with pytest.raises(PassError, match=r"pass 'filter_batch' failed: PreconditionError.*drop: every entry must be an int, not bool \(got True\)") as info:
            pipe.filter_decode(RUNNING, [True])  # type: ignore[list-item]
        with pytest.raises(PassError, match=r"pass 'prepare_for_extend' failed: PreconditionError.*requests\[0\] must be an AdmittedRequest"):
            pipe.prefill([None])  # type: ignore[list-item]
    assert isinstance(info.value.error, PreconditionError)
    assert ledger.outstanding() == ()


def test_mixed_batch_of_a_refused_part_never_exists() -> None:
    """``MixedBatch`` itself refuses a part of the wrong type, so no pass receives one."""
    with pytest.raises(ValueError, match=r"MixedBatch\.decode: must be a DecodeBatch, not ExtendBatch"):
        MixedBatch(extend=EXTEND, decode=EXTEND)  # type: ignore[arg-type]
    assert isinstance(MIXED, MixedBatch) and isinstance(MIXED.decode, DecodeBatch) and isinstance(MIXED.extend, ExtendBatch)
    assert isinstance(DRAFT, DraftBatch) and isinstance(VERIFY, VerifyBatch) and isinstance(COMMIT, CommitBatch) and isinstance(RESULT, AcceptResult)


def test_prepare_for_extend_refuses_sampling_rows_of_another_row_count() -> None:
    from ir.errors import IRValidationError
    from ir.sampling import SamplingRows

    with pytest.raises(IRValidationError, match=r"^ExtendBatch\.sampling: must hold one row per request: len\(rids\) = 1 \(got 2\)$"):
        prepare_for_extend([REQUEST], SamplingRows.greedy(2))
