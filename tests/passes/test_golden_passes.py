"""Golden dumps per registered pass, from fixed IR written here (not from a scheduler trace): a
scheduling change leaves them alone, and a change to a pass or the printer shows as a diff of the
full dump of its inputs and output. Every pass in ``passes.registry`` must have one; a pass added
without a golden fails ``test_every_registered_pass_has_a_golden``. To accept an intended change,
rerun with ``BATCHC_UPDATE_GOLDEN=1`` (or ``--batchc-update-golden``) and review the diff
(``compiler.testing.golden.assert_golden``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from compiler.testing.golden import assert_golden
from ir.batch import DecodeBatch, IdleBatch
from ir.hidden import HiddenStates, asked_hidden
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, PoolId, RequestId
from ir.mint import mint_hidden_id
from ir.printer import dump, dump_all
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.results import Verified
from ir.spec import Proposals
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
)
from passes.registry import PASSES
from passes.withdraw import withdraw
from tests.helpers import GOLDEN, proposed, verified

PASS_GOLDEN = GOLDEN / "passes"


def _show(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"tokens {value.tolist()}\n"
    if isinstance(value, (DecodeContext, SpecContext)):
        k = f"k={value.k} " if isinstance(value, SpecContext) else ""
        return f"{type(value).__name__} {k}next_tokens={value.next_tokens.tolist()} kv_locs={value.kv_locs.tolist()}\n"
    if isinstance(value, Proposals):
        return f"Proposals k={value.k} tokens={value.tokens.tolist()}\n"  # (its draft: the DraftBatch dumped beside it)
    if isinstance(value, Verified):
        return f"Verified k={value.k} tokens={value.tokens.tolist()}\n"  # (its verify and rows: the VerifyBatch dumped beside it)
    if isinstance(value, LowerContext):
        heads = f" head_pools={list(value.head_pools)}" if value.head_pools else ""
        return f"LowerContext pools={list(value.pools)}{heads}\n"
    if isinstance(value, HiddenStates):  # (its id and rows: those of the batch dumped beside it)
        return f"HiddenStates source={value.source.value} starts={value.starts.tolist()} lens={value.lens.tolist()}\n"
    if isinstance(value, list):
        if value and isinstance(value[0], AdmittedRequest):
            return dump_all(value)  # one naming across the requests of one call
        return "".join(_show(v) for v in value) if value and not isinstance(value[0], int) else f"rids {value}\n"
    return dump(value)  # type: ignore[arg-type]  # an IR node; anything else fails here, loudly


def _case(label: str, fn: Callable[..., object], *args: object) -> tuple[str, str]:
    out = fn(*args)
    text = f"-- {label} --\n== input ==\n" + "".join(_show(a) for a in args) + "== output ==\n" + _show(out)
    return fn.__name__, text


def _cases() -> dict[str, str]:
    requests = [
        AdmittedRequest(rid=RequestId(10), slot=MambaSlot(1), input_ids=[5, 6, 7], kv_locs=[20, 21, 22], intent=Clear()),
        AdmittedRequest(rid=RequestId(11), slot=MambaSlot(2), input_ids=[8, 9], kv_locs=[30, 31],
                        intent=CopyFrom(src=MambaSlot(6), prefix_len=4), snapshot_to=MambaSlot(7)),
        AdmittedRequest(rid=RequestId(12), slot=MambaSlot(3), input_ids=[1, 2, 3, 4], kv_locs=[40, 41, 42, 43],
                        intent=Continue(prefix_len=8), more_chunks=True),
    ]
    running = DecodeBatch(rids=[20, 21], slots=[4, 5], seq_lens=[9, 12], input_ids=[50, 51], kv_locs=[60, 61])
    both = LowerContext(pools=(TARGET_POOL, DRAFT_POOL))
    cases: list[tuple[str, str]] = []
    extend = prepare_for_extend(requests)
    cases.append(_case("a clear, a COW with a snapshot, a continued chunk", prepare_for_extend, requests))
    decode_ctx = DecodeContext(next_tokens=[70, 71], kv_locs=[23, 32])
    cases.append(_case("the two finished prefills start decoding", prepare_for_decode, extend, decode_ctx))
    running_ctx = DecodeContext(next_tokens=[52, 53], kv_locs=[62, 63])
    decoded = prepare_for_decode(running, running_ctx)
    cases.append(_case("the running batch advances", prepare_for_decode, running, running_ctx))
    cases.append(_case("prefills and decodes in one forward", mix_with_running, extend, decoded))
    cases.append(_case("drop a running request", filter_batch, decoded, [RequestId(20)]))
    cases.append(_case("drop the continued chunk", filter_batch, extend, [RequestId(12)]))
    cases.append(_case("finished prefills join the running batch", merge_batch, running, extend))
    cases.append(_case("withdraw the copy-on-write request (its copy and snapshot go with it)", withdraw, extend, [RequestId(11)]))
    cases.append(_case("withdraw the continued chunk", withdraw, extend, [RequestId(12)]))
    spec_ctx = SpecContext(k=2, next_tokens=[52, 53], kv_locs=[62, 63, 64, 65, 66, 67])
    draft = prepare_for_draft(running, spec_ctx)
    cases.append(_case("k = 2 proposals", prepare_for_draft, running, spec_ctx))
    draft_tokens = proposed(draft, [80, 81, 82, 83])
    verify = prepare_for_verify(draft, draft_tokens)
    cases.append(_case("pending token then the drafts", prepare_for_verify, draft, draft_tokens))
    target_tokens = np.array([80, 90, 91, 82, 83, 92], dtype=np.int64)
    target = verified(verify, target_tokens)
    result = accept(verify, target)
    cases.append(_case("one draft accepted, then all of them", accept, verify, target))
    committed = commit(verify, result)
    cases.append(_case("states at the accepted positions", commit, verify, result))
    draft_committed = prepare_for_draft_commit(committed, draft)
    cases.append(_case("the draft commits its own states at the accepted positions", prepare_for_draft_commit, committed, draft))
    cases.append(_case("the iteration's rows rejoin the running batch", merge_batch, DecodeBatch.empty(), draft_committed))
    cases.append(_case("the draft catches up on the accepted tokens", prepare_for_draft_extend, committed))
    mixed = mix_with_running(extend, decoded)
    for label, batch in (("extend, both pools", extend), ("decode", decoded), ("mixed", mixed), ("draft", draft),
                         ("verify", verify), ("commit", committed), ("draft commit", draft_committed),
                         ("draft extend", prepare_for_draft_extend(committed)),
                         ("idle", IdleBatch())):
        cases.append(_case(f"lower: {label}", lower, batch, both))
    head = LowerContext(pools=(TARGET_POOL,), head_pools=(PoolId("head"),))
    extend_plan = lower(extend, head, keep_hidden=mint_hidden_id())
    cases.append(("lower", "-- lower: a prefill keeping its hidden states for the head --\n== input ==\n" + _show(extend) + _show(head)
                  + "keep_hidden (a fresh HiddenId)\n== output ==\n" + _show(extend_plan)))
    prefill_hidden = asked_hidden(extend_plan)
    assert prefill_hidden is not None
    head_extend = prepare_for_head_extend(extend, prefill_hidden)
    cases.append(_case("the head extends over the chunk, with the prefill's init ops", prepare_for_head_extend, extend, prefill_hidden))
    cases.append(_case("lower: head extend, the head pool's tickets", lower, head_extend, head))
    verify_plan = lower(verify, head, keep_hidden=mint_hidden_id())
    cases.append(("lower", "-- lower: a verify keeping its hidden states for the head --\n== input ==\n" + _show(verify) + _show(head)
                  + "keep_hidden (a fresh HiddenId)\n== output ==\n" + _show(verify_plan)))
    verify_hidden = asked_hidden(verify_plan)
    assert verify_hidden is not None
    head_commit = prepare_for_head_commit(committed, verify_hidden)
    cases.append(_case("the head commits the accepted tokens with the verify's hidden states", prepare_for_head_commit, committed, verify_hidden))
    cases.append(_case("lower: head commit", lower, head_commit, head))
    by_pass: dict[str, str] = {}
    for name, text in cases:
        by_pass[name] = by_pass.get(name, "") + text
    return by_pass


def test_every_registered_pass_has_a_golden() -> None:
    assert set(_cases()) == {p.name for p in PASSES}


@pytest.mark.parametrize("name", [p.name for p in PASSES])
def test_pass_golden(name: str) -> None:
    assert_golden(_cases()[name], PASS_GOLDEN / f"{name}.txt")
