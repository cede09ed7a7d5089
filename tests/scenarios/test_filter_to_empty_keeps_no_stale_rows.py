"""A batch filtered to zero rows keeps stale per-request metadata (SGLang PR #28514,
https://github.com/sgl-project/sglang/pull/28514).

Upstream: filtering a batch whose requests had all finished returned early on "nothing kept" and
left the batch's per-request fields (sequence lengths, state indices, sampling info) as they were;
the next merge and decode then ran the finished requests' rows again, on slots that were free or
given to someone else.

batchc: ``passes.filter_batch`` builds the filtered node from the kept rows only, so a batch with
none left has no rows at all (every column empty, no init, no snapshot, no sampling rows); merging
it returns the running batch itself, and lowering and running it is an empty forward that writes
nothing. The scenario, at the IR level on the tiny target and through the engine:

- an extend batch and a decode batch filtered to zero rows, then merged and decoded: empty
  results, the running batch unchanged, the pool's bytes unchanged by the empty forwards, and the
  next request in a freed slot starts alone (no stale row beside it);
- a prefill filtered to nothing before it runs (every request aborted) goes through
  ``Pipeline.withdraw``: its tickets are cancelled with the reason, and the empty plan runs nothing;
- through the engine, requests that all finish in the step their prefill ends
  (``max_new_tokens=1``), beside a running request and with nothing running: the running batch
  keeps exactly the requests still running.

Each request's state rows after its prefill equal a from-scratch prefill of its prompt; outputs
equal the reference run; every ledger is drained (or its cancellations recorded); every slot is live
or free.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from compiler.engine import Engine, StepKind
from ir.batch import DecodeBatch
from ir.ids import RequestId
from ir.sampling import GREEDY, SamplingRows
from ir.verify import verify
from passes import DecodeContext, lower
from tests.helpers import fresh, tiny_models
from tests.scenarios.state_checks import (
    Recorder,
    TinyWorld,
    assert_accounted,
    assert_states_match,
    reference_outputs,
    scratch_states,
    state_rows,
)

RUNNING = list(b"print('hello')")
SHORT = [list(b"import os"), list(b"x = 1")]
LATER = list(b"def g():")


def _columns(node: object) -> dict[str, int]:
    """The length of every column (per request or per token) of an IR node."""
    return {a.name: int(v.shape[0]) for a in attrs.fields(type(node)) if isinstance(v := getattr(node, a.name), np.ndarray)}


def test_an_extend_and_a_decode_filtered_to_nothing_merge_and_decode_to_nothing() -> None:
    w = TinyWorld()
    tokens: dict[int, list[int]] = {}
    # request 3 runs; requests 1 and 2 prefill (with sampling rows: per-request metadata) and finish there
    batch3, plan3 = w.pipeline.prefill([fresh(3, 3, RUNNING, w.kv(len(RUNNING)))])
    tokens[3] = w.executor.execute(plan3).tokens.tolist()
    assert_states_match(state_rows(w.pool, 3), scratch_states(RUNNING), "request 3 after its prefill", exact=True)
    running = w.pipeline.merge(DecodeBatch.empty(), batch3)
    rows = SamplingRows.of([GREEDY, GREEDY])
    short, splan = w.pipeline.prefill([fresh(1, 1, SHORT[0], w.kv(len(SHORT[0]))), fresh(2, 2, SHORT[1], w.kv(len(SHORT[1])))], sampling=rows)
    out = w.executor.execute(splan)
    for rid, tok in zip(out.rids.tolist(), out.tokens.tolist(), strict=True):
        tokens[rid] = [tok]
    for slot, prompt in ((1, SHORT[0]), (2, SHORT[1])):
        assert_states_match(state_rows(w.pool, slot), scratch_states(prompt), f"slot {slot} after its prefill")

    empty = w.pipeline.filter_extend(short, [RequestId(1), RequestId(2)])  # both finished at their prefill
    assert empty.num_requests == 0 and empty.num_tokens == 0
    assert (empty.init, empty.snapshot, empty.intents) == (None, None, ())
    assert empty.sampling is not None and set(_columns(empty.sampling).values()) == {0}  # the rows' sampling metadata went with them
    assert set(_columns(empty).values()) == {0}, _columns(empty)
    verify(empty)
    kept = DecodeBatch(rids=running.rids, slots=running.slots, seq_lens=running.seq_lens, input_ids=running.input_ids, kv_locs=running.kv_locs)
    merged = w.pipeline.merge(running, empty)
    assert merged is running and merged == kept  # the running batch unchanged: no row of 1 or 2 joins it
    # the empty prefill lowered and run: no ticket, no row, nothing written
    eplan = lower(empty, w.pipeline.lower_ctx)
    before = w.pool.buffer.clone()
    res = w.executor.execute(eplan)
    assert eplan.tickets == () and res.rids.shape == (0,) and res.tokens.shape == (0,)
    assert torch.equal(w.pool.buffer, before)

    for _ in range(2):  # request 3 decodes on, alone
        ctx = DecodeContext(next_tokens=[tokens[3][-1]], kv_locs=[w.kv(1)])
        running, dplan = w.pipeline.decode(running, ctx)
        assert dplan.rid_list() == [3]
        tokens[3] += w.executor.execute(dplan).tokens.tolist()
    nothing = w.pipeline.filter_decode(running, [RequestId(3)])  # request 3 finished too
    assert nothing.num_requests == 0 and nothing.sampling is None and set(_columns(nothing).values()) == {0}
    merged = w.pipeline.merge(nothing, empty)
    assert merged is nothing
    after, dplan = w.pipeline.decode(merged, DecodeContext(next_tokens=[], kv_locs=[]))
    before = w.pool.buffer.clone()
    res = w.executor.execute(dplan)
    assert after.num_requests == 0 and dplan.num_requests == 0 and res.rids.shape == (0,) and res.tokens.shape == (0,)
    assert torch.equal(w.pool.buffer, before)

    # the next request takes slot 1 (its previous owner finished): it starts alone, from a clear
    batch4, plan4 = w.pipeline.prefill([fresh(4, 1, LATER, w.kv(len(LATER)))])
    tokens[4] = w.executor.execute(plan4).tokens.tolist()
    running = w.pipeline.merge(after, batch4)
    assert (running.rid_list(), running.slot_list(), running.seq_lens.tolist()) == ([4], [1], [len(LATER)])
    assert_states_match(state_rows(w.pool, 1), scratch_states(LATER), "slot 1's next owner", exact=True)
    assert tokens == {
        1: reference_outputs(SHORT[0], 1), 2: reference_outputs(SHORT[1], 1), 3: reference_outputs(RUNNING, 3), 4: reference_outputs(LATER, 1),
    }
    w.ledger.assert_drained()
    w.release_all()


def test_a_prefill_filtered_to_nothing_before_it_runs_is_withdrawn_with_its_tickets_cancelled() -> None:
    w = TinyWorld()
    batch, plan = w.pipeline.prefill([fresh(1, 1, SHORT[0], w.kv(len(SHORT[0]))), fresh(2, 2, SHORT[1], w.kv(len(SHORT[1])))])
    out, new_plan = w.pipeline.withdraw(batch, plan, [RequestId(1), RequestId(2)], reason="both aborted before their forward")
    assert out.num_requests == 0 and out.init is None and new_plan.tickets == ()
    assert list(w.ledger.cancelled().values()) == ["both aborted before their forward"]
    before = w.pool.buffer.clone()
    res = w.executor.execute(new_plan)
    assert res.rids.shape == (0,) and torch.equal(w.pool.buffer, before)
    w.ledger.assert_drained()  # the cancelled tickets are recorded, none outstanding
    # the freed slots serve the next requests, each from its own clear
    _, plan = w.pipeline.prefill([fresh(3, 2, LATER, w.kv(len(LATER)))])
    assert w.executor.execute(plan).tokens.tolist() == reference_outputs(LATER, 1)
    assert_states_match(state_rows(w.pool, 2), scratch_states(LATER), "slot 2 after the withdrawn prefill", exact=True)
    w.ledger.assert_drained()
    w.release_all()


def test_through_the_engine_requests_that_finish_at_their_prefill_leave_no_row_behind() -> None:
    e = Engine(tiny_models()[0], None, k=0, capacity=4)
    rec = Recorder(e.target)
    prompts = {RequestId(9): RUNNING, RequestId(1): SHORT[0], RequestId(2): SHORT[1], RequestId(4): LATER, RequestId(5): SHORT[1]}
    new = {RequestId(9): 5, RequestId(1): 1, RequestId(2): 1, RequestId(4): 1, RequestId(5): 3}
    e.admit(RequestId(9), RUNNING, max_new_tokens=new[RequestId(9)])
    assert e.step().kind is StepKind.EXTEND
    seq = e.running.seq_lens.tolist()
    for rid in (1, 2):  # beside a running request: one mixed forward, where both finish
        e.admit(RequestId(rid), prompts[RequestId(rid)], max_new_tokens=1)
    report = e.step()
    assert report.kind is StepKind.MIXED and set(report.finished) == {1, 2}
    assert e.running.rid_list() == [9] and e.running.seq_lens.tolist() == [seq[0] + 1] and e.running.sampling is None
    e.run_until_done()
    for rid in (4, 5):  # with nothing running: a prefill where one finishes, the other runs on
        e.admit(RequestId(rid), prompts[RequestId(rid)], max_new_tokens=new[RequestId(rid)])
    report = e.step()
    assert report.kind is StepKind.EXTEND and report.finished == (4,) and e.running.rid_list() == [5]
    e.run_until_done()
    assert e.running.num_requests == 0 and e.slots.num_live == 0
    assert e.outputs == {rid: reference_outputs(p, new[rid]) for rid, p in prompts.items()}
    for rid, p in prompts.items():
        assert_states_match(rec.prefilled[rid], scratch_states(p), f"request {rid} after its prefill")
    assert_accounted(e)
    e.close()
