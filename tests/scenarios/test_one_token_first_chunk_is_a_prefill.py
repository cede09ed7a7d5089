"""A new request given one token by the token budget was scheduled as a decode (vLLM PR #32118,
https://github.com/vllm-project/vllm/pull/32118).

Upstream: whether a request's forward was a prefill or a decode was read off the number of tokens
scheduled for it; a new request that the token budget cut to one token looked like a decode, so its
Mamba state was not initialised and it ran on whatever its (freshly freed) slot held.

batchc: a row's kind is its type, not its token count. A request's first chunk is an
``AdmittedRequest`` with a ``Clear()`` intent however short, lowered into an ``ExtendPlan`` row at
prefix 0 whose init clears the slot; a decode row is one the passes advanced from a finished prefill.
The scenario:

- IR: a one-token first chunk in a slot full of a previous owner's state is a prefill with its clear
  (the dumped plan); stripped of its clear it is refused; and a hand-built decode of a request's
  first token (``seq_lens`` 1), the upstream bug's shape, is refused by the executor before the pool
  moves (``backend.executor._check_not_first``: that refusal is the fix this scenario brought;
  before it the decode ran on the stale state);
- engine: after requests have finished in every slot, a token budget that leaves one token for a
  new request beside a running one gives a MIXED forward whose extend part starts that request at
  prefix 0 with one token and the clear of its freed slot (never in the decode part);
- ``batchc serve``'s engine loop (``compiler.online.engine_process.Loop``, in process, on a thread,
  as ``tests/compiler/online/test_parts.py`` drives it; no server subprocess): the same one-token
  first chunk over stale slots, and the request's tokens equal those of a fresh engine of the same
  launch serving it alone; and ``batchc serve`` itself, on the server that
  ``tests/compiler/online/test_server.py`` starts for its crash test (``--token-budget 1``, its plans
  dumped): the one-token first chunk in a freshly freed slot carries its clear in the dumped plan, and
  its text equals the same prompt's on the engine before that slot held anything.

Each request's state rows after its prefill equal a from-scratch prefill; outputs equal the
reference run; every ledger is drained; every slot is live or free.
"""

from __future__ import annotations

import multiprocessing
import threading

import attrs
import pytest
import torch

from backend.hybrid.hook import HybridHook
from compiler.engine import Engine, StepKind
from ir.batch import DecodeBatch
from ir.errors import PlanExecutionError, TicketMismatchError
from ir.ids import RequestId
from ir.init import MambaInit
from ir.plan import ExtendPlan, MixedPlan
from ir.printer import dump
from passes import lower
from tests.helpers import cont, fresh, tiny_models
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

PROMPT = list(b"def f(x): pass")  # 14 tokens: the request whose first chunk is one token
SLOT = 2


def _clears(plan: ExtendPlan) -> tuple[int, ...]:
    return tuple(s for t in plan.tickets if isinstance(t.op, MambaInit) for s in t.op.clear_slots)


def test_a_one_token_first_chunk_is_a_prefill_with_its_clear_and_a_first_token_decode_is_refused() -> None:
    w = TinyWorld()  # every slot holds a previous owner's state
    kv = w.kv(len(PROMPT))
    # the upstream bug's shape: the first token run as a decode of the slot's state
    first_as_decode = lower(DecodeBatch(rids=[1], slots=[SLOT], seq_lens=[1], input_ids=PROMPT[:1], kv_locs=[kv]), w.pipeline.lower_ctx)
    before = w.pool.buffer.clone()
    with pytest.raises(PlanExecutionError, match=rf"^DecodePlan: the row of slot {SLOT} feeds the token at position 0 \(seq_lens 1\): a request's first token is a prefill"):
        w.executor.execute(first_as_decode)
    assert torch.equal(w.pool.buffer, before)

    _, p1 = w.pipeline.prefill([fresh(1, SLOT, PROMPT[:1], kv, more=True)])
    text = dump(p1, exact=True)
    assert f"clear[s{SLOT}] cow[] pool=target" in text and f"r1 s{SLOT} prefix=0 extend=1 more tokens=[{PROMPT[0]}]" in text, text
    with pytest.raises(TicketMismatchError, match=rf"over slot {SLOT} of pool 'target' does not carry ticket #\d+ .*clear \[{SLOT}\]"):
        w.executor.execute(attrs.evolve(p1, tickets=()))  # the one-token chunk without its clear
    assert torch.equal(w.pool.buffer, before)
    w.executor.execute(p1)
    # one token from a cleared slot: the same computation as the from-scratch prefill, bit for bit
    assert_states_match(state_rows(w.pool, SLOT), scratch_states(PROMPT[:1]), "after the one-token first chunk", exact=True)
    _, p2 = w.pipeline.prefill([cont(1, SLOT, 1, PROMPT[1:], kv + 1)])
    assert p2.tickets == ()
    sampled = w.executor.execute(p2)
    assert_states_match(state_rows(w.pool, SLOT), scratch_states(PROMPT), "after the whole prompt")
    assert sampled.tokens.tolist() == reference_outputs(PROMPT, 1)
    w.ledger.assert_drained()
    w.release_all()


EARLIER = [list(b"import os"), list(b"x = 12"), list(b"while True:")]
RUNNING = list(b"print(1)")
BESIDE = list(b"class A:")  # 8 tokens: with a budget of 9 it leaves one for the new request


def test_through_the_engine_the_budgets_last_token_starts_a_prefill_in_a_freed_slot() -> None:
    e = Engine(tiny_models()[0], None, k=0, capacity=3, token_budget=9)
    rec = Recorder(e.target)
    for i, p in enumerate(EARLIER):  # every slot gets an owner, which finishes
        e.admit(RequestId(10 + i), p, max_new_tokens=2)
    e.run_until_done()
    freed = {s: e.target.pool.buffer[s].clone() for s in (1, 2, 3)}
    assert all(bool(row.any()) for row in freed.values())  # each freed slot holds its last owner's state
    e.admit(RequestId(1), RUNNING, max_new_tokens=6)
    assert e.step().kind is StepKind.EXTEND
    e.admit(RequestId(2), BESIDE, max_new_tokens=3)
    e.admit(RequestId(3), PROMPT, max_new_tokens=4)
    assert e.step().kind is StepKind.MIXED
    plan = rec.ran[-1].plan
    assert isinstance(plan, MixedPlan)
    ext = plan.extend
    assert ext.rid_list() == [2, 3] and plan.decode.rid_list() == [1]
    slot = ext.slot_list()[1]
    assert (ext.prefix_lens.tolist()[1], ext.extend_lens.tolist()[1], bool(ext.more_chunks[1])) == (0, 1, True)
    assert slot in _clears(ext) and torch.equal(rec.ran[-1].before[slot], freed[slot])  # a freed slot, cleared by this prefill
    assert f"r3 s{slot} prefix=0 extend=1 more tokens=[{PROMPT[0]}]" in dump(plan, exact=True)
    e.run_until_done()
    prompts = {RequestId(10 + i): (p, 2) for i, p in enumerate(EARLIER)} | {
        RequestId(1): (RUNNING, 6), RequestId(2): (BESIDE, 3), RequestId(3): (PROMPT, 4),
    }
    assert e.outputs == {rid: reference_outputs(p, n) for rid, (p, n) in prompts.items()}
    for rid, (p, _) in prompts.items():
        assert_states_match(rec.prefilled[rid], scratch_states(p), f"request {rid} after its prefill")
    for p in rec.extend_plans():  # every row at token 0 starts from its own plan's clear
        assert set(p.slots[p.prefix_lens == 0].tolist()) <= set(_clears(p))
    assert_accounted(e)
    e.close()


@pytest.mark.slow  # builds two engines on the bundled trained models (a few seconds)
def test_through_the_serve_engine_loop_the_one_token_first_chunk_is_a_prefill() -> None:
    from compiler.online import engine_process
    from compiler.online.messages import Closed, Ended, Launch, Shutdown, StepOut, Submit
    from ir.sampling import SamplingParams

    launch = Launch(model=None, draft=None, k=0, dtype="float32", max_running=2, max_len=64, overlap=False, threads=1, chunk_size=7,
                    token_budget=8, cache_entries=1)
    engine, _, _, _ = engine_process.build(launch)
    stale_fill(engine.target.pool, seed=3)  # every slot as a previous owner left it
    engine.target.adopt_pool_contents()
    rec = Recorder(engine.target)
    hook = engine.target.model
    assert isinstance(hook, HybridHook)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    long = list(b"A long prompt that takes chunks")  # 31 tokens: chunks of 7 leave one token of the budget
    ours, theirs = multiprocessing.Pipe()
    ours.send(Submit(rid=0, prompt=tuple(long), max_new_tokens=2, stop=(), sampling=greedy))
    ours.send(Submit(rid=1, prompt=tuple(PROMPT), max_new_tokens=4, stop=(), sampling=greedy))
    loop = engine_process.Loop(engine, theirs, launch.max_running)
    runner = threading.Thread(target=loop.run)
    runner.start()
    tokens: dict[int, list[int]] = {0: [], 1: []}
    ended: dict[int, Ended] = {}
    while len(ended) < 2:
        assert ours.poll(60), "the engine loop went quiet"
        out = ours.recv()
        assert isinstance(out, StepOut)
        for d in out.deltas:
            tokens[d.rid] += d.ids
        for end in out.ended:
            tokens[end.rid] += end.ids
            ended[end.rid] = end
    ours.send(Shutdown())
    runner.join(60)
    last = ours.recv()
    while isinstance(last, StepOut):
        last = ours.recv()
    assert isinstance(last, Closed) and (last.outstanding_tickets, last.slots_live, last.kv_live) == (0, 0, 0)
    first = rec.extend_plans()[0]
    assert first.rid_list() == [0, 1] and first.extend_lens.tolist() == [7, 1] and first.prefix_lens.tolist() == [0, 0]
    assert set(first.slot_list()) <= set(_clears(first))
    assert f"r1 s{first.slot_list()[1]} prefix=0 extend=1 more tokens=[{PROMPT[0]}]" in dump(first, exact=True)
    assert_states_match(rec.prefilled[RequestId(1)], scratch_states(PROMPT, model=hook.model), "the serve loop's request after its prefill")  # type: ignore[arg-type]  # (the hook's model is a HybridModel)
    # a fresh engine of the same launch, the request alone
    alone, _, _, _ = engine_process.build(launch)
    alone.admit(RequestId(1), PROMPT, max_new_tokens=4)
    alone.run_until_done()
    assert tokens[1] == alone.outputs[RequestId(1)]
    alone.drop_cache()
    assert_accounted(alone)
    alone.close()
