"""Property: random admit / abort / step sequences through the serving ``Engine`` (k = 0) keep every
request's recurrent state exactly what a pure-Python reference says, and run every init op exactly once.

The model is a toy recurrence served through the ``ServedModel`` protocol with the tiny hybrid
model's state layout (the engine is the one ``batchc run`` serves with): it writes layer 0's SSM
state of each request's row, ``state = state * 0.5 + (sum of the tokens this request fed in this
forward) * WEIGHTS``, and emits the token ``token_for(rid, position)`` as one-hot logits. COWs come
from two prefix states of different lengths (``Engine.make_prefix``, prefilled through the
same toy). The shadow reference keeps one tensor per *request id* (not per slot, so a slot mix-up
shows) and applies, on a request's first forward, zeros (fresh) or a copy of its own prefix state's
state (cached prefix), then the same recurrence in the same dtype and order, so the comparison is
exact.

The shadow derives on its own which init op each request needs and which tokens it emits; it only
reads from the plans which tokens the engine fed, and checks those against the prompt (prefill) or
the last emitted token (decode). After every step: tickets minted == tickets consumed, nothing
outstanding, the plan's init ops are exactly the expected clears and COWs, slots are owned by one
request each, every KV location is held exactly by the requests and prefix states whose context holds
it (a request's own locations by it alone; each context exactly as long as what it fed),
``live + free == capacity`` for slots and KV, the prefix rows are untouched, every live state
matches, and every finished or aborted request's output is the tokens it emitted.
"""

from __future__ import annotations

from collections import Counter
from functools import cache

import attrs
import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from backend.hybrid.config import tiny
from backend.hybrid.model import HybridModel
from backend.model import ForwardPlan
from backend.pool import MambaStatePool, PoolLayout
from backend.staging import StagedDecode, StagedExtend, StagedWindow
from compiler.engine import Engine, PrefixState, StepKind
from ir.ids import TARGET_POOL, PoolId, RequestId
from ir.init import MambaInit
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from ir.spec import CommitPlan, DraftPlan, VerifyPlan
from tests.helpers import random_fill

CAPACITY = 7  # two slots hold the prefix states, so at most 5 requests may hold a slot at once
KV_CAPACITY = 256  # never short: a retraction would re-prefill, which this reference does not model
MAX_LEN = 32
CKPT_TOKENS = ([11, 22, 33], [44, 55, 66, 77, 88])
MAX_LIVE = CAPACITY - len(CKPT_TOKENS)


@cache
def _target() -> HybridModel:
    return HybridModel.from_seed(tiny(), seed=0)


def token_for(rid: int, position: int) -> int:
    """The token the toy emits for request ``rid`` when its context has ``position`` tokens."""
    return (rid * 1_000_003 + position * 7919) % 251 + 1


def _weights(state: torch.Tensor) -> torch.Tensor:
    return torch.arange(state.numel(), dtype=state.dtype).reshape(state.shape) * 0.25 + 1.0


def _toy(state: torch.Tensor, fed: float) -> torch.Tensor:
    return state * 0.5 + fed * _weights(state)


class ToyRecurrence:
    """A deterministic, request-dependent recurrence on layer 0's SSM state; it keeps every plan it ran."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.plans: list[ForwardPlan] = []

    def take(self) -> list[ForwardPlan]:
        plans, self.plans = self.plans, []
        return plans

    def forward(
        self, plan: ForwardPlan, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool
    ) -> torch.Tensor:
        self.plans.append(plan)
        ssm = pool.ssm_state(0)
        rows: list[tuple[int, int]] = []  # (rid, context length) per output row, extend rows first
        if extend is not None:
            ext = plan.extend if isinstance(plan, MixedPlan) else plan
            assert isinstance(ext, ExtendPlan)
            cu = extend.cu_seqlens.tolist()
            for i, slot in enumerate(extend.slots.tolist()):
                ssm[slot] = _toy(ssm[slot], float(extend.input_ids[cu[i] : cu[i + 1]].sum().item()))
            rows += [(int(r), int(p + n)) for r, p, n in zip(ext.rids, ext.prefix_lens, ext.extend_lens, strict=True)]
        if decode is not None:
            dec = plan.decode if isinstance(plan, MixedPlan) else plan
            assert isinstance(dec, DecodePlan)
            for slot, tok in zip(decode.slots.tolist(), decode.input_ids.tolist(), strict=True):
                ssm[slot] = _toy(ssm[slot], float(tok))
            rows += [(int(r), int(n)) for r, n in zip(dec.rids, dec.seq_lens, strict=True)]
        logits = torch.zeros(len(rows), self.vocab)
        for i, (rid, pos) in enumerate(rows):
            logits[i, token_for(rid, pos)] = 1.0
        return logits

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """The toy keeps no per-slot context besides the pool."""

    def propose(self, plan: DraftPlan, staged: StagedWindow, pool: MambaStatePool) -> torch.Tensor:
        raise AssertionError("the engine at k = 0 never speculates")

    def verify(self, plan: VerifyPlan, staged: StagedWindow, pool: MambaStatePool) -> tuple[torch.Tensor, object]:
        raise AssertionError("the engine at k = 0 never speculates")

    def commit(self, plan: CommitPlan, states: object, pool: MambaStatePool) -> None:
        raise AssertionError("the engine at k = 0 never speculates")


class ToyServed:
    """The toy recurrence as a served model, with the tiny hybrid model's vocabulary and state layout."""

    def __init__(self, toy: ToyRecurrence) -> None:
        self.toy = toy
        self.vocab = toy.vocab

    def pool_layout(self) -> PoolLayout:
        return _target().pool_layout()

    def new_pool(self, capacity: int, *, pool_id: PoolId) -> MambaStatePool:
        return MambaStatePool(pool_id, self.pool_layout(), capacity)

    def serving_hook(self, *, capacity: int, kv_capacity: int, max_len: int) -> ToyRecurrence:
        return self.toy


def prompt_of(rid: int, n: int) -> list[int]:
    return [(rid * 37 + j * 11) % 97 + 1 for j in range(n)]


@attrs.define
class ShadowRequest:
    prompt: list[int]
    source: int | None  # index of the prefix it copies, or None (fresh)
    prefix0: int
    max_new: int
    slot: int | None = None
    done: int = 0  # prompt tokens fed after the cached prefix
    decoded: int = 0  # tokens fed by decodes
    state: torch.Tensor | None = None
    outputs: list[int] = attrs.Factory(list)


@attrs.define
class Harness:
    engine: Engine
    toy: ToyRecurrence
    prefixes: list[PrefixState]
    ckpt_states: list[torch.Tensor]
    ckpt_rows: list[torch.Tensor]
    shadow: dict[int, ShadowRequest] = attrs.Factory(dict)
    next_rid: int = 0
    tickets_minted: int = 0
    expect_clears: int = 0  # of requests (the prefix states' own clears are counted apart)
    expect_cows: int = 0
    steps: int = 0
    kinds: set[StepKind] = attrs.Factory(set)

    # -- actions ------------------------------------------------------------------------------------

    def admit(self, n: int, max_new: int, cow: bool, which: int) -> None:
        if len(self.shadow) >= MAX_LIVE:
            return
        rid = self.next_rid
        self.next_rid += 1
        source = which % len(self.prefixes) if cow else None
        head = list(self.prefixes[source].tokens) if source is not None else []
        prompt = head + prompt_of(rid, n)
        self.engine.admit(
            RequestId(rid), prompt, max_new_tokens=max_new, prefix=self.prefixes[source] if source is not None else None
        )
        self.shadow[rid] = ShadowRequest(prompt=prompt, source=source, prefix0=len(head), max_new=max_new)

    def abort(self, pick: int) -> None:
        if not self.shadow:
            return
        rid = sorted(self.shadow)[pick % len(self.shadow)]
        self.engine.abort(RequestId(rid))
        assert self.engine.outputs[RequestId(rid)] == self.shadow[rid].outputs
        del self.shadow[rid]
        self.check()

    def step(self) -> None:
        report = self.engine.step()
        self.steps += 1
        self.kinds.add(report.kind)
        plans = self.toy.take()
        assert report.kind in (StepKind.EXTEND, StepKind.MIXED, StepKind.DECODE, StepKind.IDLE), report
        assert len(plans) == (0 if report.kind is StepKind.IDLE else 1), "one forward per step at k = 0"
        self.apply(report.kind, plans[0] if plans else None, {int(r) for r in report.finished})
        self.check()

    # -- the reference ------------------------------------------------------------------------------

    def apply(self, kind: StepKind, plan: ForwardPlan | None, finished: set[int]) -> None:
        ext: ExtendPlan | None
        dec: DecodePlan | None
        match plan:
            case ExtendPlan():
                ext, dec, want = plan, None, StepKind.EXTEND
            case MixedPlan():
                ext, dec, want = plan.extend, plan.decode, StepKind.MIXED
            case DecodePlan():
                ext, dec, want = None, plan, StepKind.DECODE
            case None:
                ext, dec, want = None, None, StepKind.IDLE
            case _:
                raise AssertionError(f"the engine at k = 0 ran a {type(plan).__name__}")
        assert kind is want
        if kind is StepKind.IDLE:
            assert not self.shadow, "idle step with live requests"
        exp_clear: list[int] = []
        exp_src: list[int] = []
        exp_dst: list[int] = []
        sampled_now: dict[int, int] = {}  # rid -> its context length when it emits
        if ext is not None:
            offs = np.concatenate(([0], np.cumsum(ext.extend_lens)))
            for i, rid_ in enumerate(ext.rids.tolist()):
                r = self.shadow[rid_]
                slot, prefix = int(ext.slots[i]), int(ext.prefix_lens[i])
                tokens = ext.input_ids[offs[i] : offs[i + 1]]
                if r.state is None:  # first forward of this request
                    assert prefix == r.prefix0
                    r.slot = slot
                    if r.source is not None:
                        r.state = self.ckpt_states[r.source].clone()
                        exp_src.append(int(self.prefixes[r.source].slot))
                        exp_dst.append(slot)
                    else:
                        r.state = torch.zeros_like(self.ckpt_states[0])
                        exp_clear.append(slot)
                else:
                    assert slot == r.slot, "a request changed slots between chunks"
                    assert prefix == r.prefix0 + r.done
                assert tokens.tolist() == r.prompt[prefix : prefix + tokens.shape[0]]
                r.state = _toy(r.state, float(tokens.sum()))
                r.done += int(tokens.shape[0])
                complete = r.prefix0 + r.done == len(r.prompt)
                assert bool(ext.more_chunks[i]) == (not complete)
                assert tokens.shape[0] <= self.engine.chunk_size
                if complete:
                    sampled_now[rid_] = len(r.prompt)
        if dec is not None:
            for rid_, slot, tok, seq in zip(dec.rids.tolist(), dec.slots.tolist(), dec.input_ids.tolist(), dec.seq_lens.tolist(), strict=True):
                r = self.shadow[rid_]
                assert r.state is not None and r.prefix0 + r.done == len(r.prompt)
                assert slot == r.slot
                assert r.outputs and tok == r.outputs[-1], "decode fed a token other than the last emitted one"
                r.decoded += 1
                assert seq == len(r.prompt) + r.decoded
                r.state = _toy(r.state, float(tok))
                sampled_now[rid_] = seq
        # the init ops of this forward are exactly the expected ones, in one ticket for the target pool
        tickets = ext.tickets if ext is not None else ()
        if exp_clear or exp_dst:
            assert len(tickets) == 1
            (t,) = tickets
            assert isinstance(t.op, MambaInit) and t.pool == TARGET_POOL
            assert list(t.op.clear_slots) == exp_clear
            assert list(t.op.cow_src) == exp_src and list(t.op.cow_dst) == exp_dst
        else:
            assert tickets == ()
        self.tickets_minted += len(tickets)
        self.expect_clears += len(exp_clear)
        self.expect_cows += len(exp_dst)
        # emitting and finishing
        for rid_, pos in sampled_now.items():
            self.shadow[rid_].outputs.append(token_for(rid_, pos))
        assert finished == {rid_ for rid_ in sampled_now if len(self.shadow[rid_].outputs) >= self.shadow[rid_].max_new}
        for rid_ in finished:
            assert self.engine.outputs[RequestId(rid_)] == self.shadow[rid_].outputs
            assert len(self.shadow[rid_].outputs) == self.shadow[rid_].max_new
            del self.shadow[rid_]

    # -- invariants ---------------------------------------------------------------------------------

    def check(self) -> None:
        e = self.engine
        assert e.ledger.outstanding() == ()
        assert e.ledger.num_consumed == self.tickets_minted
        counts = e.ledger.counts(TARGET_POOL)
        assert (counts.tickets, counts.clears, counts.cows) == (self.tickets_minted, self.expect_clears + len(self.prefixes), self.expect_cows)
        assert e.stats.retractions == 0
        live = e.live_slots()
        assert {int(r) for r in live} <= set(self.shadow)
        slots = [int(s) for s in live.values()]
        assert len(slots) == len(set(slots)), f"a slot is live for two requests: {live}"
        ckpt_slots = {int(cp.slot) for cp in self.prefixes}
        assert not ckpt_slots & set(slots)
        assert e.slots.live() == frozenset(slots) | ckpt_slots
        assert e.slots.num_live + e.slots.num_free == CAPACITY
        # KV: a prefix state's locations are shared (by reference) with the requests copying it; every
        # other location belongs to one request; each context is exactly as long as what was fed
        holders: Counter[int] = Counter()
        for cp in self.prefixes:
            holders.update(cp.kv_locs)
        own: list[int] = []
        for rid, r in self.shadow.items():
            context = e.requests[RequestId(rid)].context
            if r.state is None:
                assert context == [], f"request {rid} holds KV before its first forward"
                continue
            assert len(context) == r.prefix0 + r.done + r.decoded
            if r.source is not None:
                assert tuple(context[: r.prefix0]) == self.prefixes[r.source].kv_locs
            own += context[r.prefix0 :]
            holders.update(context)
        assert len(own) == len(set(own)), "a KV location is owned by two requests"
        assert not set(own) & {loc for cp in self.prefixes for loc in cp.kv_locs}
        assert e.kv_refs.held() == dict(holders)
        assert e.kv.live() == frozenset(holders)
        assert e.kv.num_live + e.kv.num_free == KV_CAPACITY
        pool = e.target.pool
        for cp, row in zip(self.prefixes, self.ckpt_rows, strict=True):
            assert torch.equal(pool.buffer[cp.slot], row), f"the prefix row {cp.slot} was written"
        ssm = pool.ssm_state(0)
        for rid, r in self.shadow.items():
            if r.state is None:
                assert RequestId(rid) not in live
                continue
            assert live[RequestId(rid)] == r.slot
            assert r.slot is not None
            assert torch.equal(ssm[r.slot], r.state), f"request {rid} (slot {r.slot}) diverged from the reference"


def make_harness(chunk_size: int, seed: int) -> Harness:
    toy = ToyRecurrence(_target().vocab)
    e = Engine(ToyServed(toy), None, k=0, capacity=CAPACITY, kv_capacity=KV_CAPACITY, max_len=MAX_LEN, chunk_size=chunk_size)
    # stale bytes everywhere: a slot that is not cleared on (re)use poisons its request
    random_fill(e.target.pool, seed)
    prefixes, states, rows = [], [], []
    ssm = e.target.pool.ssm_state(0)
    for tokens in CKPT_TOKENS:
        cp = e.make_prefix(tokens)
        (plan,) = toy.take()
        assert isinstance(plan, ExtendPlan) and plan.tickets[0].op.clear_slots == (cp.slot,)
        state = _toy(torch.zeros_like(ssm[cp.slot]), float(sum(tokens)))
        assert torch.equal(ssm[cp.slot], state)
        prefixes.append(cp)
        states.append(state)
        rows.append(e.target.pool.buffer[cp.slot].clone())
    h = Harness(engine=e, toy=toy, prefixes=prefixes, ckpt_states=states, ckpt_rows=rows, tickets_minted=len(prefixes))
    h.check()
    return h


def finish(h: Harness) -> None:
    """Step until every request has left, then an idle step; give the prefix states back and check
    that nothing is left anywhere."""
    for _ in range(200):
        if not h.shadow:
            break
        h.step()
    assert not h.shadow, "requests still live after 200 steps"
    assert h.engine.live == 0
    h.step()  # nothing left: an idle step
    e = h.engine
    assert e.slots.live() == frozenset(int(cp.slot) for cp in h.prefixes)
    for cp in h.prefixes:
        e.release_prefix(cp)
    assert e.slots.num_live == 0 and e.kv.num_free == KV_CAPACITY and e.kv_refs.held() == {}
    e.ledger.assert_drained()
    assert e.ledger.num_consumed == h.tickets_minted


ADMIT = st.tuples(
    st.just("admit"),
    st.integers(1, 12),  # prompt length (after the prefix state's tokens, for a cached prefix)
    st.integers(1, 4),  # max_new_tokens
    st.booleans(),  # cached prefix (COW from a prefix)
    st.integers(0, 1),  # which prefix
)
STEP = st.tuples(st.just("step"))
ABORT = st.tuples(st.just("abort"), st.integers(0, 10))
# weights: admit 3, step 4, abort 1 (aborts are early exits; too many and little reaches decode)
OPS = st.lists(st.one_of(ADMIT, ADMIT, ADMIT, STEP, STEP, STEP, STEP, ABORT), min_size=4, max_size=50)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, chunk_size=st.integers(3, 5), seed=st.integers(0, 2**16))
def test_random_lifecycles_match_the_reference_and_run_each_init_once(
    ops: list[tuple[object, ...]], chunk_size: int, seed: int
) -> None:
    h = make_harness(chunk_size, seed)
    for op in ops:
        match op:
            case ("admit", int(n), int(max_new), bool(cow), int(which)):
                h.admit(n, max_new, cow, which)
            case ("step",):
                h.step()
            case ("abort", int(pick)):
                h.abort(pick)
            case _:
                raise AssertionError(op)
    finish(h)
    for kind in sorted(k.value for k in h.kinds):
        event(f"step kind {kind}")
    event(f"COWs {min(h.expect_cows, 3)}+")


def test_a_scripted_lifecycle_takes_every_path() -> None:
    """The property's generator can reach every step kind; this pins one run that does."""
    h = make_harness(chunk_size=3, seed=1)
    h.admit(7, 2, False, 0)  # chunked: 3 + 3 + 1
    h.admit(2, 3, True, 0)  # COW from the 3-token prefix, then 2 tokens
    h.step()  # extend
    h.step()  # mixed: r0's second chunk with r1's decode
    h.admit(4, 1, False, 0)
    h.step()  # mixed: r0's last chunk, r2's first, r1 decodes its last token and finishes
    h.abort(1)  # r2, mid-prefill; r0 is left to decode alone
    finish(h)
    assert {StepKind.EXTEND, StepKind.MIXED, StepKind.DECODE, StepKind.IDLE} <= h.kinds
    assert h.expect_cows == 1 and h.expect_clears == 2
    assert h.engine.outputs[RequestId(2)] == []
