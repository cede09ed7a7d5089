"""Padding rows aliasing live slots (TensorRT-LLM PR #13151, https://github.com/NVIDIA/TensorRT-LLM/pull/13151).

Upstream: a batch padded up to a captured size (CUDA graphs) filled its padding rows with a state
index that a live request also held, so every padded forward advanced, or overwrote, that request's
Mamba state; requests whose chunked prefill was parked outside the batch were hit the same way.

batchc: slot 0 is the padding slot, never handed out and refused in any IR node that names a slot
(``IRValidationError`` naming the field), and an executor refuses a plan built around the checks
that names it (out of range) before the pool moves. Padded rows are slot ``-1``: the model's Mamba
kernels skip them, and their attention writes go to the padding KV location 0 and the padding row 0
of the token table. The scenario:

- every IR node that names a slot refuses slot 0, naming the field; a plan built unchecked with it
  is refused by the executor, the pool unchanged;
- on the tiny target, with padding in play: forwards whose batch is smaller than the pool, with a
  chunked prefill parked outside the plan and an idle (data-parallel padding) plan, leave every row
  outside the plan byte-identical (the Mamba pool, the token table, the KV locations it does not
  write); a decode and a prefill padded with ``-1`` rows write only their live rows and the padding
  slot's row 0 (table and KV), and give the live rows what the unpadded forward gives;
- through the engine at ``k = 0`` and ``k = 2``, with a pool larger than the batch, stale bytes in
  every free slot and chunked prefills parked while others decode: around every forward on either
  pool, the rows outside its plan (row 0 included) keep their bytes.

Each request's state rows after its prefill equal a from-scratch prefill; outputs equal the
reference run; every ledger is drained; every slot is live or free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from backend.executor import Executor
from backend.hybrid.hook import HybridHook
from compiler.engine import Engine
from compiler.engine.policy import ALTERNATE
from ir import spec
from ir.batch import DecodeBatch, ExtendBatch
from ir.columns import build_unchecked
from ir.errors import IRValidationError, PlanExecutionError
from ir.ids import MambaSlot, RequestId
from ir.init import MambaInit, MambaSnapshot
from ir.mint import mint_draft_id
from ir.nodes import Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.request import AdmittedRequest, Clear, CopyFrom
from ir.results import Result
from ir.spec import CommitPlan, DraftCommitPlan, DraftPlan, VerifyPlan
from passes import DecodeContext
from tests.helpers import Backend, cont, fresh, ids, tiny_models
from tests.scenarios.state_checks import (
    Recorder,
    TinyWorld,
    assert_accounted,
    assert_states_match,
    reference_outputs,
    scratch_states,
    stale_fill,
    state_rows,
)

_TOKENS = np.array([1, 2], dtype=np.int64)
_KV = np.array([5, 6], dtype=np.int64)

SLOT_ZERO: list[tuple[str, Callable[[], object], str]] = [
    ("AdmittedRequest", lambda: AdmittedRequest(rid=RequestId(1), slot=MambaSlot(0), intent=Clear(), input_ids=_TOKENS, kv_locs=_KV), "slot"),
    ("AdmittedRequest snapshot", lambda: AdmittedRequest(rid=RequestId(1), slot=MambaSlot(1), intent=Clear(), input_ids=_TOKENS, kv_locs=_KV,
                                                         snapshot_to=MambaSlot(0)), "snapshot_to"),
    ("CopyFrom", lambda: CopyFrom(src=MambaSlot(0), prefix_len=4), "src"),
    ("MambaInit clear", lambda: MambaInit(serial=1, clear_slots=[0], cow_src=[], cow_dst=[]), "clear_slots"),
    ("MambaInit copy", lambda: MambaInit(serial=1, clear_slots=[], cow_src=[0], cow_dst=[1]), "cow_src"),
    ("MambaSnapshot", lambda: MambaSnapshot(serial=1, src=[1], dst=[0]), "dst"),
    ("ExtendBatch", lambda: ExtendBatch(rids=[1], slots=[0], prefix_lens=[0], extend_lens=[2], intents=(Clear.kind,), more_chunks=[False],
                                        input_ids=_TOKENS, kv_locs=_KV, init=MambaInit(serial=1, clear_slots=[1], cow_src=[], cow_dst=[])), "slots"),
    ("DecodeBatch", lambda: DecodeBatch(rids=[1], slots=[0], seq_lens=[3], input_ids=[1], kv_locs=[5]), "slots"),
    ("DecodePlan", lambda: DecodePlan(rids=[1], slots=[0], seq_lens=[3], input_ids=[1], kv_locs=[5]), "slots"),
    ("DraftBatch", lambda: spec.DraftBatch(k=1, draft_id=mint_draft_id(), rids=[1], slots=[0], seq_lens=[3], input_ids=[1], kv_locs=[5, 6]), "slots"),
]


@pytest.mark.parametrize(("node", "build", "field"), SLOT_ZERO, ids=[c[0] for c in SLOT_ZERO])
def test_an_ir_node_naming_the_padding_slot_is_refused_naming_the_field(node: str, build: Callable[[], object], field: str) -> None:
    with pytest.raises(IRValidationError) as caught:
        build()
    kind = node.split()[0]
    assert (caught.value.node, caught.value.field, caught.value.value) == (kind, field, 0), str(caught.value)
    assert str(caught.value).startswith(f"{kind}.{field}: ") and str(caught.value).endswith("(got 0)")


def test_a_plan_built_unchecked_around_the_padding_slot_is_refused_before_the_pool_moves() -> None:
    w = TinyWorld(4)
    before = w.pool.buffer.clone()
    decode = build_unchecked(DecodePlan, rids=np.array([1]), slots=np.array([0]), seq_lens=np.array([3]), input_ids=np.array([1]),
                             kv_locs=np.array([w.kv(1)]), sample_id=None, inputs_from=None, sampling=None)
    with pytest.raises(PlanExecutionError, match=r"^DecodePlan: slot 0 out of range \[1, 4\] of pool 'target'$"):
        w.executor.execute(decode)
    _, good = w.pipeline.prefill([fresh(1, 1, [1, 2], w.kv(2))])
    aliased = build_unchecked(ExtendPlan, rids=np.array([1]), slots=np.array([0]), prefix_lens=good.prefix_lens, extend_lens=good.extend_lens,
                              more_chunks=good.more_chunks, input_ids=good.input_ids, kv_locs=good.kv_locs, tickets=good.tickets, snapshots=(),
                              sample_id=None, sampling=None, keep_hidden=None)
    with pytest.raises(PlanExecutionError, match=r"^ExtendPlan: slot 0 out of range \[1, 4\] of pool 'target'$"):
        w.executor.execute(aliased)
    assert torch.equal(w.pool.buffer, before)
    w.executor.execute(good)
    w.ledger.assert_drained()
    w.release_all()


def _rows_of(plan: Plan) -> set[int]:
    """The rows a plan may write: its own, and its snapshots' cache slots."""
    if isinstance(plan, (DraftPlan, VerifyPlan, CommitPlan, DraftCommitPlan)):
        return set(plan.batch.slot_list())
    rows = set(plan.slot_list())
    ext = plan if isinstance(plan, ExtendPlan) else plan.extend if isinstance(plan, MixedPlan) else None
    if ext is not None:
        rows |= {s for t in ext.snapshots for s in t.op.dst}
    return rows


def _kv_of(node: object) -> set[int]:
    """Every KV location a plan names (its ``kv_locs`` columns, nested batches and parts included)."""
    out: set[int] = set()
    for a in attrs.fields(type(node)):
        value = getattr(node, a.name)
        if a.name == "kv_locs" and isinstance(value, np.ndarray):
            out |= set(value.tolist())
        elif attrs.has(type(value)):
            out |= _kv_of(value)
    return out


class _Guard:
    """Checks around every plan an executor runs (its hook a ``HybridHook``): the Mamba pool's rows
    and the token table's rows outside the plan's rows keep their bytes, and so do the KV locations
    it does not name; the padding row 0 and location 0 never move. ``forwards`` counts the plans."""

    def __init__(self, executor: Executor[Any]) -> None:
        hook = executor.model
        assert isinstance(hook, HybridHook)
        self.forwards = 0
        inner = executor.execute

        def execute(plan: Plan) -> Result:
            pool, table, k, v = executor.pool.buffer.clone(), hook.table.table.clone(), hook.kv.k.clone(), hook.kv.v.clone()
            out = inner(plan)
            rows, name = _rows_of(plan), f"{type(plan).__name__} on pool {executor.pool_id!r}"
            for what, changed, allowed in (
                ("Mamba rows", _changed(pool, executor.pool.buffer), rows),
                ("token-table rows", _changed(table, hook.table.table), rows),
                ("KV locations", _kv_changed(k, hook.kv.k) | _kv_changed(v, hook.kv.v), _kv_of(plan)),
            ):
                assert changed <= allowed and 0 not in changed, f"{name} wrote {what} {sorted(changed - allowed)} outside its own {sorted(allowed)}"
            self.forwards += 1
            return out

        executor.execute = execute  # type: ignore[method-assign]  # (the engine's submit calls self.execute)


def test_forwards_smaller_than_the_pool_leave_every_other_row_and_the_padding_row_alone() -> None:
    w = TinyWorld(6)  # stale bytes in every row, the padding row included
    guard = _Guard(w.executor)
    long, short = list(b"while True: pass"), list(b"ok = 1")
    kv_long = w.kv(len(long))
    b1, p1 = w.pipeline.prefill([fresh(1, 2, long[:5], kv_long, more=True), fresh(2, 5, short, w.kv(len(short)))])
    tokens = {2: [int(w.executor.execute(p1).tokens[1])]}
    running = w.pipeline.merge(DecodeBatch.empty(), b1)
    assert running.rid_list() == [2]
    for _ in range(2):  # request 1's prefill is parked outside these plans
        running, dplan = w.pipeline.decode(running, DecodeContext(next_tokens=[tokens[2][-1]], kv_locs=[w.kv(1)]))
        tokens[2] += w.executor.execute(dplan).tokens.tolist()
    w.executor.execute(IdlePlan())  # a data-parallel rank's padding: nothing to run
    _, p2 = w.pipeline.prefill([cont(1, 2, 5, long[5:], kv_long + 5)])  # the parked prefill resumes, alone
    tokens[1] = w.executor.execute(p2).tokens.tolist()
    assert guard.forwards == 5
    assert_states_match(state_rows(w.pool, 2), scratch_states(long), "the parked prefill's state")
    assert_states_match(state_rows(w.pool, 5), scratch_states(short + tokens[2][:-1]), "the decoding request's state")
    assert tokens == {1: reference_outputs(long, 1), 2: reference_outputs(short, 3)}
    w.ledger.assert_drained()
    w.release_all()


def _changed(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    diff = (before != after).reshape(before.shape[0], -1).any(dim=1)
    return {int(i) for i in torch.nonzero(diff).reshape(-1)}


def _kv_changed(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """KV locations (dim 1 of ``[layers, locations, heads, head_dim]``) whose keys changed."""
    return {int(i) for i in torch.nonzero((before != after).any(-1).any(-1).any(0)).reshape(-1)}


def _padded_decode(b: Backend, rows: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """One decode of ``rows`` ``(slot, token, position, kv location)`` (slot ``-1``: padding); its logits."""
    cols = list(zip(*rows, strict=True))
    return b.model.decode(b.pool, b.kv, b.table, slots=ids(list(cols[0])), input_ids=ids(list(cols[1])), positions=ids(list(cols[2])),
                          kv_locs=ids(list(cols[3]))).logits


def test_padded_rows_write_only_the_padding_slot_and_leave_the_live_rows_as_unpadded() -> None:
    model = tiny_models()[0]
    prompts = {1: list(b"abc = 12"), 3: list(b"def h():")}
    padded, plain = Backend(model, capacity=4), Backend(model, capacity=4)
    for b in (padded, plain):
        stale_fill(b.pool, seed=1)  # stale bytes everywhere (row 0 included) but in the two live rows, cleared
        b.pool.buffer[list(prompts)] = 0
        b.extend([(s, p, 0) for s, p in prompts.items()])
    assert torch.equal(padded.pool.buffer, plain.pool.buffer)
    # a decode of slot 3 padded to four rows (slot -1, any KV location: a captured graph's batch)
    pool0, table0, kv0 = padded.pool.buffer.clone(), padded.table.table.clone(), padded.kv.k.clone()
    pos, tok = len(prompts[3]), 65
    logits = _padded_decode(padded, [(3, tok, pos, 100), (-1, 7, 0, 101), (-1, 7, 3, 102), (-1, 7, 5, 103)])
    ref = _padded_decode(plain, [(3, tok, pos, 100)])
    assert _changed(pool0, padded.pool.buffer) == {3}  # the Mamba kernels skip padding rows: row 0 untouched too
    assert _changed(table0, padded.table.table) <= {0, 3}
    assert _kv_changed(kv0, padded.kv.k) == {0, 100}  # the padding rows' keys went to location 0, nowhere else
    assert torch.allclose(logits[:1], ref, atol=1e-5, rtol=1e-5)  # (batched beside padding: float32 reordering only)
    assert_states_match(state_rows(padded.pool, 3), state_rows(plain.pool, 3), "slot 3 after a padded decode")
    # a prefill chunk of slot 1 packed with a padding sequence
    pool0, table0, kv0 = padded.pool.buffer.clone(), padded.table.table.clone(), padded.kv.k.clone()
    more = list(b" + 7")
    first = padded._next  # (the helper's bump allocator: the chunk's KV locations start here)
    padded.extend([(1, more, len(prompts[1])), (-1, [0, 0, 0], 0)])
    plain.extend([(1, more, len(prompts[1]))])
    assert _changed(pool0, padded.pool.buffer) == {1}
    assert _changed(table0, padded.table.table) <= {0, 1}
    assert _kv_changed(kv0, padded.kv.k) == {0, *range(first, first + len(more))}
    assert_states_match(state_rows(padded.pool, 1), state_rows(plain.pool, 1), "slot 1 after a padded prefill chunk")
    assert_states_match(state_rows(padded.pool, 1), scratch_states(prompts[1] + more), "slot 1 against a from-scratch prefill")


ENGINE_PROMPTS = {1: list(b"x = 5"), 2: list(b"for i in range(3):"), 3: list(b"import sys")}
NEW = 5


@pytest.mark.parametrize("k", [0, 2])
def test_through_the_engine_no_forward_touches_a_row_outside_its_plan(k: int) -> None:
    """A pool of 6 slots for 3 requests (stale bytes everywhere), chunks of 4 tokens, one prefill
    step then one running step: the long prompts' prefills are parked while the others decode."""
    target, draft = tiny_models()
    e = Engine(target, draft if k else None, k=k, capacity=6, chunk_size=4, token_budget=4, mixed=False, policy=ALTERNATE)
    executors = [e.target] + ([e.draft] if e.draft is not None else [])
    recs, guards = [], []
    for seed, ex in enumerate(executors):
        stale_fill(ex.pool, seed=seed)
        ex.adopt_pool_contents()
        recs.append(Recorder(ex))
        guards.append(_Guard(ex))
    e.admit(RequestId(1), ENGINE_PROMPTS[1], max_new_tokens=NEW)
    e.step()
    e.step()
    for rid in (2, 3):
        e.admit(RequestId(rid), ENGINE_PROMPTS[rid], max_new_tokens=NEW)
    e.run_until_done()
    parked = 0  # forwards that ran while a started prefill waited outside them
    started: dict[int, int] = {}
    for r in recs[0].ran:
        plan = r.plan
        ext = plan if isinstance(plan, ExtendPlan) else None
        rows = _rows_of(plan)
        parked += sum(1 for slot in started.values() if slot not in rows)
        if ext is not None:
            for rid, slot, more in zip(ext.rid_list(), ext.slot_list(), ext.more_chunks.tolist(), strict=True):
                if more:
                    started[rid] = slot
                else:
                    started.pop(rid, None)
    assert parked >= 2 and all(g.forwards > 0 for g in guards)
    assert e.outputs == {RequestId(rid): reference_outputs(p, NEW) for rid, p in ENGINE_PROMPTS.items()}
    for rid, p in ENGINE_PROMPTS.items():
        assert_states_match(recs[0].prefilled[RequestId(rid)], scratch_states(p), f"request {rid} on the target after its prefill")
        if k:
            assert_states_match(recs[1].prefilled[RequestId(rid)], scratch_states(p, draft=True), f"request {rid} on the draft after its prefill")
    assert_accounted(e)
    e.close()
