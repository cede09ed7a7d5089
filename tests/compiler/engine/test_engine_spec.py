"""Speculative decoding end to end on the reference hybrid model (float32, CPU).

- Lossless oracle: speculative greedy output equals greedy decoding of the target by the
  from-scratch reference model (``backend.hybrid.reference``, not the engine at k = 0), token for
  token, at k = 0, 1, 2, 4, for fresh prompts and cached-prefix (COW) prompts, on the state-sensitive
  target (``compiler.testing.models.state_sensitive`` of the tiny one, its draft made from it as the
  tiny draft is: ``tests.scenarios.state_checks.sensitive_models``), whose tokens a wrong, stale or
  missing Mamba init changes (``tests/testing/test_models.py``); on the tiny target the attention
  layer would carry the context past such a state.
- Exactly once per pool: each prefill's init ops are consumed once on the target pool and once on
  the draft pool; nothing is outstanding; no slot or KV location leaks (the same runs).
- The default draft (target + 5% weight noise) accepts between 0.4 and 0.95 of its proposals.
- The A/B: the mutable baseline replays the stale init ops on the draft pool and loses acceptance
  while its output stays equal to greedy; the ledger refuses its first replay.
- Property: random k, draft noise, arrivals and lengths keep all of the above.
"""

from __future__ import annotations

from functools import cache

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.hybrid import HybridModel
from backend.hybrid.reference import greedy_generate_reference
from backend.hybrid.weights import perturb
from compiler.engine import Engine, StepKind
from compiler.tools.ab import run_ab
from ir.ids import DRAFT_POOL, TARGET_POOL, RequestId
from tests.helpers import Backend, tiny_models
from tests.scenarios.state_checks import sensitive_models

PREFIX = list(b"You are terse.\n")
PROMPTS = [list(b"def add(a, b):"), PREFIX + list(b"print(1)"), list(b"class A:\n  x"), PREFIX + list(b"for i in x:")]
NEW = 12


@cache
def _serve(k: int, *, sensitive: bool = True) -> Engine:
    """The four prompts served at ``k`` (on the state-sensitive models unless ``sensitive`` is False:
    then the tiny target and its default draft); one run per ``k`` that the tests only read."""
    target, draft = sensitive_models() if sensitive else tiny_models()
    drv = Engine(target, draft if k else None, k=k)
    cp = drv.make_prefix(PREFIX)
    for i, p in enumerate(PROMPTS):
        drv.admit(RequestId(i), p, max_new_tokens=NEW, prefix=cp if p[: len(PREFIX)] == PREFIX else None)
    drv.run_until_done()
    drv.release_prefix(cp)
    return drv


@cache
def _greedy() -> dict[RequestId, list[int]]:
    """The reference model's greedy output for each prompt (request ``i`` is ``PROMPTS[i]``), on the
    state-sensitive target."""
    target, _ = sensitive_models()
    return {RequestId(i): greedy_generate_reference(target, p, NEW) for i, p in enumerate(PROMPTS)}


def test_plain_greedy_driver_matches_the_from_scratch_reference() -> None:
    drv = _serve(0)  # fresh prompts and prompts copied from the prefix
    assert drv.outputs == _greedy()
    assert drv.stats.iterations == 0 and drv.stats.decodes > 0


@pytest.mark.parametrize("k", [1, 2, 4])
def test_speculative_output_equals_plain_greedy(k: int) -> None:
    drv = _serve(k)
    assert drv.outputs == _greedy()
    assert drv.stats.iterations > 0


@pytest.mark.parametrize("k", [1, 2, 4])
def test_init_ops_consumed_once_per_pool_and_nothing_leaks(k: int) -> None:
    drv = _serve(k)
    drv.ledger.assert_drained()
    t, d = drv.ledger.counts(TARGET_POOL), drv.ledger.counts(DRAFT_POOL)
    # the prefix prefill (1 clear) and one prefill of the 4 prompts (2 clears + 2 COWs)
    assert (t.tickets, t.clears, t.cows) == (d.tickets, d.clears, d.cows) == (2, 3, 2)
    assert drv.ledger.replays_blocked == 0
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0


def test_run_until_done_gives_up_after_max_steps() -> None:
    target, _ = tiny_models()
    drv = Engine(target, None, k=0)
    drv.admit(RequestId(0), PROMPTS[0], max_new_tokens=4)  # a prefill and 3 decodes
    with pytest.raises(RuntimeError, match=r"^1 requests still live after 2 steps$"):
        drv.run_until_done(max_steps=2)
    assert drv.live == 1 and drv.outputs == {}
    drv.run_until_done()  # the engine is still serving: the request completes
    assert drv.live == 0 and len(drv.outputs[RequestId(0)]) == 4


def test_run_until_done_with_exactly_enough_steps_returns() -> None:
    target, _ = tiny_models()
    drv = Engine(target, None, k=0)
    drv.admit(RequestId(0), PROMPTS[0], max_new_tokens=4)  # a prefill and 3 decodes: 4 steps
    drv.run_until_done(max_steps=4)
    assert drv.live == 0 and len(drv.outputs[RequestId(0)]) == 4


def test_default_draft_acceptance_is_in_range() -> None:
    for k in (1, 2, 4):
        rate = _serve(k, sensitive=False).stats.acceptance_rate
        assert 0.4 <= rate <= 0.95, (k, rate)


def test_ab_reproduces_the_seed_bug_and_the_ledger_refuses_it() -> None:
    r = run_ab(k=2, requests=6, max_new_tokens=16, max_running=3)
    compiled, base, fixed = r.runs["compiled"], r.runs["mutable_baseline"], r.runs["mutable_baseline_fixed"]
    assert compiled.equals_greedy and base.equals_greedy and fixed.equals_greedy
    assert compiled.replays == 0 and compiled.outstanding_tickets == 0
    assert compiled.init_ops_target == compiled.init_ops_draft == fixed.init_ops_draft
    assert base.replays > 0
    assert base.init_ops_draft > compiled.init_ops_draft
    assert base.acceptance_rate < compiled.acceptance_rate == fixed.acceptance_rate
    assert r.ledger_on_baseline.startswith("ResourceReplayError: replay of ticket #")
    assert "for pool 'draft'" in r.ledger_on_baseline
    # the --json form keeps the field names of the record
    assert set(r.to_json()["runs"]["compiled"]) == set(attrs.fields_dict(type(compiled)))  # type: ignore[index]  # to_json is a plain dict


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(1, 3),
    noise_seed=st.integers(0, 3),
    noise=st.sampled_from([0.02, 0.1, 0.4]),
    plan=st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(1, 6), st.integers(0, 2)), min_size=1, max_size=5),
)
def test_random_acceptance_and_join_leave_keep_exactly_once_and_losslessness(
    k: int, noise_seed: int, noise: float, plan: list[tuple[int, int, int]]
) -> None:
    target = sensitive_models()[0]  # (on the state-sensitive target: the module docstring)
    drv = Engine(target, HybridModel(target.config, perturb(target.weights, noise, seed=noise_seed)), k=k, capacity=8)
    cp = drv.make_prefix(PREFIX)
    expected: dict[RequestId, list[int]] = {}
    for rid_, (p, n, wait) in enumerate(plan):  # request rid_ joins after `wait` more steps
        rid = RequestId(rid_)
        prompt = PROMPTS[p]
        drv.admit(rid, prompt, max_new_tokens=n, prefix=cp if prompt[: len(PREFIX)] == PREFIX else None)
        expected[rid] = _greedy()[RequestId(p)][:n]
        for _ in range(wait):
            drv.step()
            assert drv.ledger.outstanding() == ()
            assert drv.slots.num_live == len(drv.live_slots()) + 1  # each started request's slot and the prefix state's
    drv.run_until_done()
    drv.release_prefix(cp)
    drv.ledger.assert_drained()
    assert drv.ledger.counts(TARGET_POOL) == drv.ledger.counts(DRAFT_POOL)
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0
    assert drv.outputs == expected


@pytest.mark.parametrize("k", [1, 3])
def test_the_draft_commit_leaves_the_draft_state_of_its_committed_tokens(k: int) -> None:
    """After every speculative iteration, each running request's draft state (its kept proposal state
    at the accepted position) equals the draft model's state over the same committed tokens computed
    without speculation: one prefill of the prompt and every emitted token but the pending one."""
    target, draft = tiny_models()
    drv = Engine(target, draft, k=k, capacity=8)
    prompts = {RequestId(0): PROMPTS[0], RequestId(1): PROMPTS[2]}
    for rid, prompt in prompts.items():
        drv.admit(rid, prompt, max_new_tokens=NEW)
    iterations = 0
    while drv.live:
        report = drv.step()
        if report.kind is not StepKind.SPEC:
            continue
        iterations += 1
        assert drv.draft is not None
        for rid, slot in drv.live_slots().items():
            committed = prompts[rid] + drv.requests[rid].output[:-1]  # the last emitted token is pending, not fed
            reference = Backend(draft, capacity=2)
            reference.extend([(1, committed, 0)])
            for layer in range(len(reference.pool.layout.layers)):
                for name, got, want in (
                    ("conv", drv.draft.pool.conv_state(layer)[slot], reference.pool.conv_state(layer)[1]),
                    ("ssm", drv.draft.pool.ssm_state(layer)[slot], reference.pool.ssm_state(layer)[1]),
                ):
                    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"request {rid} {name} {layer}: {m}")
    assert iterations >= 3
