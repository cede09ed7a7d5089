"""A late write into a slot reused after retraction (SGLang PR #38179,
https://github.com/sgl-project/sglang/pull/38179; vLLM PR #49620,
https://github.com/vllm-project/vllm/pull/49620).

Upstream: with overlapped scheduling, a request was retracted (out of KV room) while the forward
of its iteration was still in flight; its Mamba slot went at once to another request, and the
in-flight work (the decode's state update, a deferred commit) then landed in that slot, over the
new owner's freshly initialised state.

batchc: the retracted request's in-flight forward is dropped when it lands (its token is never
read), a slot's new owner is lowered with a clear of its own that runs in its prefill's forward,
and a plan may name only slots live with the allocator and free of pending tickets. The scenario,
in process with the decodes pipelined as ``overlap`` pipelines them (``Engine.forwards.pipelined``:
the same plans, no processes: executor processes cost seconds to start, beyond this module's
budget; ``tests/compiler/engine/test_overlap.py`` runs that transport), two slots, KV room for
less than the requests' growth:

- a request is retracted while its pipelined decode is in flight, its slot goes to a waiting
  request's prefill (the retracted one re-prefills in another slot), and every plan that ran after that owner's prefill names the slot only for the
  new owner (no write of the retracted request's lands there): ownership replayed from the plans;
- each request's last prefill (the retracted one's re-prefill of its prompt and output so far)
  leaves a state equal to a from-scratch prefill of its tokens (the decodes' states are covered
  by the token equality only);
- outputs equal the engine without pipelining and the ``k = 0`` reference, on the tiny target and
  on the state-sensitive one (``state_checks.MODELS``), where the new owner's tokens would change
  had its state been replaced right after its prefill (``assert_tokens_need_state``).

With executor processes and speculation (``k = 2``: the commits of an iteration are sent and not
waited for), marked slow (about 8 s here, most of it starting the processes): every step settles the
commits still in flight before it chooses its forward (``compiler.engine.forwards.Forwards.run``),
so a retraction never happens while its iteration's commits are deferred (their count at each
retraction is 0, while commits were deferred during the run), and the outputs equal the in-process
engine's and the reference.

Every ledger drained, every slot live or free, live == 0 at the end. Immune: no fix was needed.
"""

from __future__ import annotations

import pytest

from backend.hybrid.model import HybridModel
from backend.remote import Processes
from compiler.engine import Engine
from ir.ids import RequestId
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from tests.helpers import tiny_models
from tests.scenarios.state_checks import (
    MODELS,
    Recorder,
    assert_accounted,
    assert_states_match,
    assert_tokens_need_state,
    reference_outputs,
    scratch_states,
)

PROMPTS = [list(b"def f(x):\n  return"), list(b"class K:\n  def"), list(b"import numpy as")]
NEW = 12
KV = 50  # the two first prompts fit, their growth does not: one retraction


def _serve(pipelined: bool, model: HybridModel) -> tuple[Engine, Recorder]:
    e = Engine(model, None, k=0, capacity=2, kv_capacity=KV)
    e.forwards.pipelined = pipelined
    rec = Recorder(e.target)
    for i, p in enumerate(PROMPTS):
        e.admit(RequestId(i), p, max_new_tokens=NEW)
    e.run_until_done()
    return e, rec


def _rows(plan: object) -> list[tuple[int, int, int | None]]:
    """(rid, slot, prefix_len or None for a decode row) of every row of a plan."""
    out: list[tuple[int, int, int | None]] = []
    ext = plan if isinstance(plan, ExtendPlan) else plan.extend if isinstance(plan, MixedPlan) else None
    if ext is not None:
        out += list(zip(ext.rids.tolist(), ext.slots.tolist(), ext.prefix_lens.tolist(), strict=True))
    dec = plan if isinstance(plan, DecodePlan) else plan.decode if isinstance(plan, MixedPlan) else None
    if dec is not None:
        out += [(r, s, None) for r, s in zip(dec.rids.tolist(), dec.slots.tolist(), strict=True)]
    return out


@pytest.mark.parametrize("models", MODELS)
def test_a_slot_given_away_on_retraction_receives_no_write_of_its_previous_owner(models: str) -> None:
    model = MODELS[models]()[0]
    e, rec = _serve(True, model)
    assert e.stats.retractions == 1
    owner: dict[int, int] = {}  # slot -> the request that owns it now
    last: dict[int, int] = {}  # slot -> the last request that prefilled into it
    handovers: list[tuple[int, int, int]] = []  # (slot, previous owner, new owner)
    fed: dict[int, list[int]] = {}  # the tokens of each request's current prefill, chunk by chunk
    prefills: dict[int, list[list[int]]] = {}
    for ran in rec.ran:
        plan = ran.plan
        ext = plan if isinstance(plan, ExtendPlan) else plan.extend if isinstance(plan, MixedPlan) else None
        for rid, slot, start in _rows(plan):
            if start == 0:  # a (re-)prefill from a cleared row: the slot changes hands
                if slot in last and last[slot] != rid:
                    handovers.append((slot, last[slot], rid))
                owner = {s: r for s, r in owner.items() if r != rid}
                owner[slot] = last[slot] = rid
                fed[rid] = []
            assert owner.get(slot) == rid, f"{type(plan).__name__} writes slot {slot} for request {rid}, whose owner is {owner.get(slot)}"
        if ext is not None:
            cu = [0, *ext.extend_lens.cumsum().tolist()]
            for i, (rid, more) in enumerate(zip(ext.rids.tolist(), ext.more_chunks.tolist(), strict=True)):
                fed[rid] += ext.input_ids[cu[i] : cu[i + 1]].tolist()
                if not more:
                    prefills.setdefault(rid, []).append(list(fed[rid]))
    retracted = [rid for rid, ps in prefills.items() if len(ps) > 1]
    assert len(retracted) == 1 and prefills[retracted[0]][1][: len(PROMPTS[retracted[0]])] == PROMPTS[retracted[0]]
    # the retracted request's slot went to another request's prefill (and it re-prefilled elsewhere)
    new_owners = [new for _, prev, new in handovers if prev == retracted[0] and new != prev]
    assert new_owners, handovers
    for rid, ps in prefills.items():
        assert_states_match(rec.prefilled[RequestId(rid)], scratch_states(ps[-1], model=model), f"request {rid} after its last prefill")
    plain, _ = _serve(False, model)
    assert plain.stats.retractions == 1
    assert e.outputs == plain.outputs == {RequestId(i): reference_outputs(p, NEW, model) for i, p in enumerate(PROMPTS)}
    if models == "state-sensitive":
        for rid in new_owners:  # a late write that replaced the new owner's state after its prefill would show in its tokens
            assert_tokens_need_state(PROMPTS[rid], len(PROMPTS[rid]), NEW, model)
    assert e.forwards.in_flight is None
    for drv in (e, plain):
        assert_accounted(drv)
        assert drv.slots.num_live == 0 and drv.kv.num_live == 0
        drv.close()


@pytest.mark.slow
def test_in_executor_processes_a_retraction_waits_for_the_deferred_commits_of_its_iteration() -> None:
    target, draft = tiny_models()
    outputs = {}
    for transport in (None, Processes()):
        options = {} if transport is None else {"transport": transport}
        with Engine(target, draft, k=2, capacity=2, kv_capacity=54, **options) as e:  # type: ignore[arg-type]
            fw = e.forwards
            seen_deferred: list[int] = []  # commits in flight when a step starts
            at_retraction: list[int] = []  # commits in flight when a request is retracted
            settle, retract = fw._settle_commits, fw.retract

            def settling() -> None:
                seen_deferred.append(len(fw._deferred))
                settle()

            def retracting(rid: RequestId) -> None:
                at_retraction.append(len(fw._deferred))
                retract(rid)

            fw._settle_commits = settling  # type: ignore[method-assign]
            fw.retract = retracting  # type: ignore[method-assign]
            for i, p in enumerate(PROMPTS):
                e.admit(RequestId(i), p, max_new_tokens=NEW)
            e.run_until_done()
            assert e.stats.retractions == 1 and at_retraction == [0]
            if transport is not None:
                assert max(seen_deferred) >= 1, "in processes the commits must be deferred"
            outputs[transport is None] = dict(e.outputs)
            e.ledger.assert_drained()
            assert e.slots.num_live == 0 and e.slots.num_free == e.slots.capacity and e.kv.num_live == 0 and e.live == 0
    assert outputs[False] == outputs[True] == {RequestId(i): reference_outputs(p, NEW) for i, p in enumerate(PROMPTS)}
