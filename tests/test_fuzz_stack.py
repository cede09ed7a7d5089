"""Whole-stack fuzzing on the CPU: a hypothesis state machine drives ``Engine`` (seeded tiny
target, draft = target + 5% weight noise, ``k`` in {0, 1, 2}) with a small prefix cache, chunked
prefill under a token budget, few slots and few KV locations, so eviction, retraction and pool
pressure all happen.

Rules: a fresh prompt arrives; a prompt with a shared prefix arrives (a small fixed set of
prefixes, so the cache gets hits and snapshots); a long prompt arrives (prefilled in chunks); a
request with a long output arrives (its KV grows until requests are retracted); more
requests than there are slots arrive at once; scheduler steps run (prefill chunks, decode or
speculative iterations with whatever acceptance the models give; requests finish at their token
limit or stop token); the scheduler drains; a random live request is aborted; the cache is dropped
when no entry is pinned.

After every rule (and inside the step rules, after every scheduler step):

- exactly once: nothing outstanding in the ledger, ops minted == ops consumed on each pool, the
  draft pool saw exactly the target pool's init and snapshot ops, no replay was blocked, no verify's
  intermediate states are left behind;
- slots: no slot is live twice (requests, cache entries, snapshots in flight are disjoint), the
  allocator's live set is exactly their union, ``live + free == capacity``;
- KV: every live location has a positive reference count, the live set equals the referenced set,
  and each count equals the number of holders (request contexts, cache entries); a running row's
  context is as long as its committed tokens;
- outputs: a finished request's tokens equal plain greedy decoding of the target alone (a separate
  ``Engine(target, None, k=0)`` run per prompt, cached), an aborted one's are a prefix of them;
- liveness: a step never idles with live requests twice in a row (it could never progress);
- state (every ``SHADOW_EVERY`` scheduler steps): the target pool row of every running request,
  every mid-prefill request and every cache entry equals the state of the target run from scratch
  (fresh pool, ``HybridModel.extend``) over that row's committed tokens (``allclose``, atol 1e-4);
  in speculative mode the draft pool row likewise equals the draft run from scratch.

``backend.hybrid.reference`` exposes logits, not states, so the state oracle is the model's own
extend path over the whole context in one forward: it differs from the driver's run in chunking,
COW sources, snapshots, verify/commit and retraction, which is what is under test.

Two library bugs this fuzzer found are fixed and pinned by the tests at the end of the module: a
livelock of mid-prefill requests holding all KV, and a request retracted twice re-prefilling its
output twice. The machine still has a counted allowance for each (``known ...`` in the printed
figures), used only with ``BATCHC_FUZZ_STRICT=0``; by default any occurrence fails.

With ``k = 0`` half the examples pipeline their decodes (``Forwards.pipelined``: the plans of
``Engine(overlap=True)``, each decode built while the previous one is in flight and naming its
input tokens by the previous one's sample id), with the executor in process; a row in the decode in
flight has fed its last output token already.

The checks read the engine's bookkeeping (``requests``, ``kv_refs``, ``requests.queued``, the decode
in flight) and the executors' ``_intermediates``: there is no public view of per-request KV references, and a fuzzer
that only looks at the public surface cannot tell a leaked reference from a shared prefix.

Profiles (``tests/hypothesis_profiles.py``): by default ``batchc-fuzz-ci`` (3 examples x 30 steps);
the ``long`` profile runs 450 examples of up to 30 steps (over 10,000 state-machine steps):
``BATCHC_FUZZ_PROFILE=long pytest -s tests/test_fuzz_stack.py`` or
``pytest -p tests.hypothesis_profiles --hypothesis-profile=long -s tests/test_fuzz_stack.py``.
The counts of rules and scheduler steps actually executed are printed at the end of the module.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from backend.hybrid.reference import greedy_generate_reference
from compiler.engine import Engine
from compiler.prefix_cache import PrefixCache
from ir.ids import DRAFT_POOL, TARGET_POOL, RequestId
from tests.helpers import tiny_models
from tests.hypothesis_profiles import FUZZ_CI, FUZZ_LONG

CAPACITY = 5  # Mamba slots, shared by running requests, mid-prefill requests and cache entries
KV_CAPACITIES = [160, 220, 300]  # token-granular KV locations: a few long requests fill them
MAX_LEN = 96
BLOCK = 8
MAX_LIVE = 10  # arrivals stop above this many live requests (keeps a step cheap)
PREFIXES = [
    list(b"You are a terse assistant.\n"),  # 27 bytes: cache boundaries at 8, 16, 24
    list(b"# Python 3. Answer in code.\n"),  # 28
    list(b"SYSTEM: be brief!"),  # 17
]
SHADOW_EVERY = int(os.environ.get("BATCHC_FUZZ_SHADOW_EVERY", "1"))
ATOL = 1e-4
# BATCHC_FUZZ_STRICT=1: no allowance for the two known bugs (the xfail tests at the end pin them)
STRICT = os.environ.get("BATCHC_FUZZ_STRICT", "1") == "1"  # both bugs are fixed: strict unless asked

STATS: Counter[str] = Counter()  # rules, scheduler steps, outcomes: printed at the end of the module


_REFERENCE: dict[tuple[tuple[int, ...], int, int | None], list[int]] = {}


def greedy_reference(prompt: tuple[int, ...], max_new_tokens: int, stop: int | None) -> list[int]:
    """Plain greedy decoding of the target by the from-scratch reference model (no pools, caches,
    chunking or engine at all), cut after the stop token."""
    key = (prompt, max_new_tokens, stop)
    if key not in _REFERENCE:
        out = greedy_generate_reference(tiny_models()[0], list(prompt), max_new_tokens)
        _REFERENCE[key] = out[: out.index(stop) + 1] if stop is not None and stop in out else out
        STATS["reference runs"] += 1
    return _REFERENCE[key]


_SCRATCH: dict[tuple[bool, tuple[int, ...]], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}


def scratch_state(draft: bool, tokens: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Conv and SSM state of every Mamba layer after running the model from scratch over ``tokens``
    in one forward (fresh pool, KV cache and table; slot 1)."""
    key = (draft, tokens)
    if key not in _SCRATCH:
        model = tiny_models()[1 if draft else 0]
        n = len(tokens)
        pool = model.new_pool(1)
        model.extend(
            pool, model.new_kv_cache(n + 1), model.new_token_table(1, n),
            slots=torch.tensor([1]), cu_seqlens=torch.tensor([0, n]), prefix_lens=torch.tensor([0]),
            input_ids=torch.tensor(tokens, dtype=torch.int64), positions=torch.arange(n),
            kv_locs=torch.arange(1, n + 1),
        )
        layers = range(model.config.n_mamba)
        if len(_SCRATCH) >= 4096:  # bound the memory of a long run
            _SCRATCH.clear()
        _SCRATCH[key] = ([pool.conv_state(m)[1].clone() for m in layers], [pool.ssm_state(m)[1].clone() for m in layers])
    return _SCRATCH[key]


class StackMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.next_rid = 0
        self.prompts: dict[RequestId, tuple[int, ...]] = {}  # the original prompt of every request
        self.limits: dict[RequestId, tuple[int, int | None]] = {}
        self.aborted: set[RequestId] = set()
        self.checked: set[RequestId] = set()
        self.steps_since_shadow = 0
        self.retracted_twice: set[RequestId] = set()  # the known retraction bug: not checked exactly

    # -- setup ---------------------------------------------------------------------------------

    @initialize(
        k=st.sampled_from([0, 1, 2]),
        cache_capacity=st.integers(2, 3),
        chunk=st.integers(4, 8),
        budget=st.sampled_from([12, 16, 20]),
        kv_capacity=st.sampled_from(KV_CAPACITIES),
        pipelined=st.booleans(),
    )
    def setup(self, k: int, cache_capacity: int, chunk: int, budget: int, kv_capacity: int, pipelined: bool) -> None:
        STATS["state-machine steps"] += 1
        STATS["rule setup"] += 1
        target, draft = tiny_models()
        self.k = k
        self.cache = PrefixCache(capacity=cache_capacity, block=BLOCK)
        self.driver = Engine(
            target, draft if k else None, k=k, capacity=CAPACITY, kv_capacity=kv_capacity, max_len=MAX_LEN,
            chunk_size=chunk, token_budget=budget, prefix_cache=self.cache,
        )
        if k == 0 and pipelined:
            # the decodes of overlap (each built while the previous one runs, its inputs named by the
            # previous one's sample), here with the executor in process: the same plans, no processes
            self.driver.forwards.pipelined = True
            STATS["examples pipelined"] += 1
        STATS["examples"] += 1
        STATS[f"examples k={k}"] += 1
        STATS[f"examples kv={kv_capacity}"] += 1

    # -- arrivals --------------------------------------------------------------------------------

    def _admit(self, prompt: list[int], max_new: int, stop_at: int | None) -> None:
        stop = None
        if stop_at is not None:  # a stop token the target will actually emit (or not, if past the end)
            free_run = greedy_reference(tuple(prompt), max_new, None)
            stop = free_run[stop_at % len(free_run)]
        rid = RequestId(self.next_rid)
        self.next_rid += 1
        self.driver.admit(rid, prompt, max_new_tokens=max_new, stop=stop)
        self.prompts[rid] = tuple(prompt)
        self.limits[rid] = (max_new, stop)
        STATS["arrivals"] += 1
        note(f"admit {rid}: {len(prompt)} tokens, max_new {max_new}, stop {stop}")

    def _room(self) -> bool:
        return self.driver.live < MAX_LIVE

    @precondition(_room)
    @rule(
        prompt=st.lists(st.integers(0, 255), min_size=1, max_size=20),
        max_new=st.integers(1, 10),
        stop_at=st.none() | st.integers(0, 9),
    )
    def arrive_fresh(self, prompt: list[int], max_new: int, stop_at: int | None) -> None:
        STATS["state-machine steps"] += 1
        STATS["rule arrive_fresh"] += 1
        self._admit(prompt, max_new, stop_at)

    @precondition(_room)
    @rule(
        which=st.integers(0, len(PREFIXES) - 1),
        suffix=st.lists(st.sampled_from(list(b"abcxyz ()\n")), min_size=1, max_size=12),
        max_new=st.integers(1, 10),
        stop_at=st.none() | st.integers(0, 9),
    )
    def arrive_shared_prefix(self, which: int, suffix: list[int], max_new: int, stop_at: int | None) -> None:
        STATS["state-machine steps"] += 1
        STATS["rule arrive_shared_prefix"] += 1
        self._admit(PREFIXES[which] + suffix, max_new, stop_at)

    @precondition(_room)
    @rule(
        seed=st.integers(0, 2**16),
        length=st.integers(30, 56),
        shared=st.booleans(),
        max_new=st.integers(1, 10),
    )
    def arrive_long(self, seed: int, length: int, shared: bool, max_new: int) -> None:
        STATS["state-machine steps"] += 1
        STATS["rule arrive_long"] += 1
        gen = torch.Generator().manual_seed(seed)
        body = torch.randint(0, 256, (length,), generator=gen).tolist()
        prompt = (PREFIXES[seed % len(PREFIXES)] + body)[:length] if shared else body
        self._admit(prompt, max_new, None)

    @precondition(_room)
    @rule(
        which=st.integers(-1, len(PREFIXES) - 1),
        suffix=st.lists(st.integers(0, 255), min_size=1, max_size=16),
        max_new=st.integers(16, 40),
    )
    def arrive_long_generation(self, which: int, suffix: list[int], max_new: int) -> None:
        """A long output: running requests grow their KV until the next step cannot get its
        locations and the newest are retracted (and later re-prefilled with their output)."""
        STATS["state-machine steps"] += 1
        STATS["rule arrive_long_generation"] += 1
        self._admit((PREFIXES[which] if which >= 0 else []) + suffix, max_new, None)

    @precondition(lambda self: self.driver.live <= 2)
    @rule(n=st.integers(CAPACITY + 1, CAPACITY + 3), seed=st.integers(0, 2**16), max_new=st.integers(1, 8))
    def pool_pressure(self, n: int, seed: int, max_new: int) -> None:
        """More requests than slots at once: the scheduler must queue, evict and retract."""
        STATS["state-machine steps"] += 1
        STATS["rule pool_pressure"] += 1
        gen = torch.Generator().manual_seed(seed)
        for i in range(n):
            length = int(torch.randint(1, 24, (1,), generator=gen))
            body = torch.randint(0, 256, (length,), generator=gen).tolist()
            self._admit(PREFIXES[i % len(PREFIXES)] + body if i % 2 else body, max_new, None)
        STATS["pressure bursts"] += 1

    # -- scheduler -----------------------------------------------------------------------------------

    def _step(self) -> str:
        kind = self.driver.step().kind.value
        STATS["scheduler steps"] += 1
        STATS[f"step {kind}"] += 1
        assert kind != "failed", f"a forward failed: {self.driver.stats}"
        if kind == "idle" and self.driver.live:
            # a failed prefill may still take a slot or evict; a second idle means nothing can move
            again = self.driver.step().kind.value
            STATS["scheduler steps"] += 1
            if again == "idle":
                self._livelocked()
            kind = again
        self._check_step()
        return kind

    def _livelocked(self) -> None:
        drv = self.driver
        stuck = [r for r in drv.requests if r.slot is not None and r.done > 0]
        known = not drv.running.num_requests and stuck and drv.kv.num_free < drv.chunk_size
        assert known and not STRICT, (
            f"livelock: {drv.live} live requests, every step idles (running {drv.running.num_requests}, "
            f"mid-prefill {len(stuck)}, free KV {drv.kv.num_free}, free slots {drv.slots.num_free})"
        )
        # the known bug (test_overcommitted_chunked_prefills_make_progress): mid-prefill requests hold
        # all KV and none can finish. Abort them so the machine goes on exploring.
        STATS["known livelocks (mid-prefill requests hold all KV)"] += 1
        note(f"known livelock: aborting {len(drv.requests)} requests")
        for rid in [r.rid for r in drv.requests]:
            drv.abort(rid)
            self.aborted.add(rid)

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        STATS["state-machine steps"] += 1
        STATS["rule step"] += 1
        for _ in range(n):
            self._step()

    @precondition(lambda self: self.driver.live > 0)
    @rule()
    def drain(self) -> None:
        """Run until every live request has finished."""
        STATS["state-machine steps"] += 1
        STATS["rule drain"] += 1
        for _ in range(400):
            if not self.driver.live:
                return
            self._step()
        raise AssertionError(f"{self.driver.live} requests still live after 400 steps")

    @precondition(lambda self: self.driver.live > 0)
    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick: int) -> None:
        STATS["state-machine steps"] += 1
        STATS["rule abort"] += 1
        live = sorted(r for r in self.prompts if r not in self.driver.outputs)
        rid = live[pick % len(live)]
        self.driver.abort(rid)
        self.aborted.add(rid)
        STATS["aborts"] += 1
        note(f"abort {rid}")

    @precondition(lambda self: len(self.cache) > 0 and all(e.pins == 0 for e in self.cache.entries()))
    @rule()
    def drop_cache(self) -> None:
        STATS["state-machine steps"] += 1
        STATS["rule drop_cache"] += 1
        self.driver.drop_cache()
        assert len(self.cache) == 0
        STATS["cache drops"] += 1

    # -- checks ----------------------------------------------------------------------------------

    def _check_step(self) -> None:
        self._check_books()
        self.steps_since_shadow += 1
        if self.steps_since_shadow >= SHADOW_EVERY:
            self.steps_since_shadow = 0
            self._check_rows()

    @invariant()
    def books_balance(self) -> None:
        self._check_books()
        self._check_outputs()

    def _check_books(self) -> None:
        drv = self.driver
        # exactly once, per pool
        assert drv.ledger.outstanding() == ()
        assert drv.ledger.replays_blocked == 0
        pools = (TARGET_POOL, DRAFT_POOL) if self.k else (TARGET_POOL,)
        for pool in pools:
            assert drv.ledger.minted(pool) == drv.ledger.counts(pool), pool
        if self.k:
            assert drv.ledger.counts(DRAFT_POOL) == drv.ledger.counts(TARGET_POOL)
        for ex in (drv.target, drv.draft):
            if ex is not None:
                assert not ex.kept_states, "a verify's states were never committed"

        # slots: requests, cache entries and snapshots in flight own disjoint slots, and nothing else is live
        live = drv.live_slots()
        request_slots = list(live.values())
        cache_slots = [e.slot for e in self.cache.entries()]
        snap_slots = [r.snapshot_slot for r in drv.requests if r.snapshot_slot is not None]
        owned = request_slots + cache_slots + snap_slots
        assert len(set(owned)) == len(owned), f"a slot is live twice: {live}, cache {cache_slots}, snapshots {snap_slots}"
        assert drv.slots.live() == frozenset(int(s) for s in owned)
        assert drv.slots.num_live + drv.slots.num_free == drv.slots.capacity == CAPACITY
        assert drv.kv.num_live + drv.kv.num_free == drv.kv.capacity

        # KV references
        refs = drv.kv_refs.held()
        assert all(c > 0 for c in refs.values()), refs
        assert drv.kv.live() == frozenset(refs), "live KV locations differ from the referenced ones"
        holders: Counter[int] = Counter()
        for r in drv.requests:
            holders.update(r.context)
        for e in self.cache.entries():
            holders.update(e.kv_locs)
        assert holders == refs, "a KV reference count differs from its number of holders"

        # every live request is either waiting or running, never both
        running = {int(r) for r in drv.running.rids}
        waiting = {int(r) for r in drv.requests.queued}
        assert not running & waiting
        assert running | waiting == {int(r.rid) for r in drv.requests}
        assert drv.live == len(drv.requests)
        for rid_, r in ((r.rid, r) for r in drv.requests):
            if r.retractions >= 2 and not STRICT and rid_ not in self.retracted_twice:
                # known bug (test_a_request_retracted_twice_re_prefills_its_context_once): its context
                # holds its early output twice, so its tokens are not greedy's; count it, skip it
                self.retracted_twice.add(rid_)
                STATS["known bug: requests retracted twice (output not checked)"] += 1
        for rid, slot, seq_len in zip(drv.running.rids, drv.running.slots, drv.running.seq_lens, strict=True):
            r = drv.requests[RequestId(int(rid))]
            assert r.slot == int(slot)
            assert len(r.context) == int(seq_len), (int(rid), len(r.context), int(seq_len))
            if RequestId(int(rid)) in self.retracted_twice:
                continue
            committed = self._committed(RequestId(int(rid)))
            assert len(committed) == int(seq_len), (int(rid), len(committed), int(seq_len))

    def _committed(self, rid: RequestId) -> tuple[int, ...]:
        """The tokens a running request's row holds: its prompt and its output but the last token,
        which the next decode feeds; a pipelined decode in flight has fed that one too."""
        r = self.driver.requests[rid]
        inflight = self.driver.in_flight
        fed = r.output if inflight is not None and rid in inflight.rids else r.output[:-1]
        return self.prompts[rid] + tuple(fed)

    def _check_outputs(self) -> None:
        for rid, out in self.driver.outputs.items():
            if rid in self.checked:
                continue
            self.checked.add(rid)
            if rid in self.retracted_twice:
                continue
            max_new, stop = self.limits[rid]
            expected = greedy_reference(self.prompts[rid], max_new, stop)
            if rid in self.aborted:
                assert out == expected[: len(out)], (rid, out, expected)
                STATS["aborted requests checked"] += 1
            else:
                assert out == expected, (rid, out, expected)
                STATS["finished requests checked"] += 1

    def _check_rows(self) -> None:
        """Pool rows against the models run from scratch over each row's committed tokens."""
        drv = self.driver
        rows: list[tuple[str, int, tuple[int, ...]]] = []
        for rid, slot, seq_len in zip(drv.running.rids, drv.running.slots, drv.running.seq_lens, strict=True):
            r = drv.requests[RequestId(int(rid))]
            if RequestId(int(rid)) in self.retracted_twice:
                # its context is what it re-prefilled, then the tokens fed since (all but the pending one)
                fed_since = int(seq_len) - len(r.prompt)
                since = r.output[len(r.output) - 1 - fed_since : -1]
                rows.append((f"request {int(rid)} (retracted twice)", int(slot), tuple(int(t) for t in r.prompt) + tuple(since)))
                continue
            rows.append((f"request {int(rid)}", int(slot), self._committed(RequestId(int(rid)))))
        for rid in drv.requests.queued:
            r = drv.requests[rid]
            if r.slot is not None and r.done > 0:  # mid-prefill: the state after its first `done` tokens
                rows.append((f"request {int(rid)} (mid-prefill)", int(r.slot), tuple(int(t) for t in r.prompt[: r.done])))
        for e in self.cache.entries():
            rows.append((f"cache entry of {len(e.tokens)} tokens", int(e.slot), e.tokens))
        executors = [(False, drv.target)] + ([(True, drv.draft)] if drv.draft is not None else [])
        for what, slot, tokens in rows:
            for is_draft, ex in executors:
                assert ex is not None
                conv, ssm = scratch_state(is_draft, tokens)
                pool = ex.pool
                for m in range(len(conv)):
                    got_conv, got_ssm = pool.conv_state(m)[slot], pool.ssm_state(m)[slot]
                    name = f"{'draft' if is_draft else 'target'} pool, {what}, slot {slot}, layer {m}"
                    assert torch.allclose(got_conv, conv[m], atol=ATOL), f"conv state differs: {name}"
                    assert torch.allclose(got_ssm, ssm[m], atol=ATOL), (
                        f"SSM state differs: {name}, max err {float((got_ssm - ssm[m]).abs().max()):.2e}"
                    )
        STATS["shadow checks"] += 1
        STATS["shadow rows compared"] += len(rows)

    def teardown(self) -> None:
        # everything can still finish and give everything back
        drv = getattr(self, "driver", None)
        if drv is None:
            return
        for _ in range(400):
            if not drv.live:
                break
            self._step()
        assert drv.live == 0
        self._check_outputs()
        drv.drop_cache()
        assert drv.slots.num_live == 0 and drv.kv.num_live == 0 and not drv.kv_refs.held()
        drv.ledger.assert_drained()
        st_, cs = drv.stats, self.cache.stats
        for key, value in (
            ("driver retractions", st_.retractions), ("driver spec iterations", st_.iterations),
            ("draft tokens proposed", st_.proposed), ("draft tokens accepted", st_.accepted),
            ("cache hits", cs.hits), ("cache snapshots", cs.snapshots), ("cache evictions", cs.evictions),
        ):
            STATS[key] += value


def _profile() -> settings:
    chosen = os.environ.get("BATCHC_FUZZ_PROFILE") or settings.get_current_profile_name()
    return settings.get_profile(FUZZ_LONG if chosen == FUZZ_LONG else FUZZ_CI)


TestStack = StackMachine.TestCase
TestStack.settings = _profile()

_T0 = time.perf_counter()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """The tiny model's ops are microseconds long: with a second intra-op thread on a busy 2-core
    machine each one waits milliseconds for a core (measured: 5 us -> 10 ms per matmul)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def teardown_module() -> None:
    wall = time.perf_counter() - _T0
    profile = FUZZ_LONG if TestStack.settings.max_examples == settings.get_profile(FUZZ_LONG).max_examples else FUZZ_CI
    lines = [f"fuzz_stack profile {profile}: {wall:.1f} s wall"] + [f"  {key}: {value}" for key, value in sorted(STATS.items())]
    print("\n" + "\n".join(lines))
    out = os.environ.get("BATCHC_FUZZ_STATS")
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def test_overcommitted_chunked_prefills_make_progress() -> None:
    """Five 70-token prompts, chunks of 8 under a budget of 40, 300 KV locations: after 8 prefill
    steps the five hold 296 locations, the first two need 6 more each, and only 4 are free."""
    target, _ = tiny_models()
    drv = Engine(target, None, k=0, capacity=5, kv_capacity=300, max_len=128, chunk_size=8, token_budget=40)
    prompts = {RequestId(i): [(7 * i + j) % 256 for j in range(70)] for i in range(5)}
    for rid, prompt in prompts.items():
        drv.admit(rid, prompt, max_new_tokens=4)
    drv.run_until_done(max_steps=300)
    assert drv.outputs == {rid: greedy_reference(tuple(p), 4, None) for rid, p in prompts.items()}


def test_a_request_retracted_twice_re_prefills_its_context_once() -> None:
    """Retract one request twice (``Forwards.retract``, the scheduler's own move under KV pressure):
    whenever it waits for its re-prefill its prompt is its original prompt + its output, and its
    final output is greedy's."""
    target, _ = tiny_models()
    drv = Engine(target, None, k=0, capacity=3, kv_capacity=400, max_len=128)
    prompts = {RequestId(i): list(b"request number %d:" % i) for i in range(2)}
    for rid, prompt in prompts.items():
        drv.admit(rid, prompt, max_new_tokens=12)
    victim = RequestId(1)
    for _ in range(2):
        while victim in drv.requests.queued or len(drv.requests[victim].output) < 3 * (drv.requests[victim].retractions + 1):
            drv.step()
        drv.forwards.retract(victim)  # forces the retraction the KV pressure would cause
        r = drv.requests[victim]
        assert r.prompt.tolist() == prompts[victim] + r.output
    assert drv.requests[victim].retractions == 2
    drv.run_until_done()
    assert drv.outputs == {rid: greedy_reference(tuple(p), 12, None) for rid, p in prompts.items()}


def test_profiles_are_registered() -> None:
    long = settings.get_profile(FUZZ_LONG)
    assert long.max_examples * long.stateful_step_count >= 10_000
    ci = settings.get_profile(FUZZ_CI)
    assert ci.max_examples * ci.stateful_step_count <= 600

