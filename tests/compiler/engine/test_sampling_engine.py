"""Sampling through the engine: seeded requests are batch-invariant, greedy stays greedy, and
speculative decoding with sampling keeps the target's distribution.

The distribution test is a chi-square test of homogeneity between the tokens that plain sampling
(k = 0) and speculative sampling (k = 2, rejection sampling of the draft's argmax proposals) emit
at the same output positions over a few hundred seeded requests. Its threshold, p < 1e-3, is its
false-failure rate: were the seeds drawn at random, a correct sampler would fail it once in a
thousand choices. The seeds are fixed (the run's seed and the request ids), so the test's outcome
is the same on every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
import pytest

from backend.hybrid.reference import greedy_generate_reference
from backend.remote import Processes
from compiler.engine import Engine
from ir.ids import RequestId
from ir.sampling import GREEDY, SamplingParams
from tests.helpers import SYSTEM, engine, greedy_reference
from tests.scenarios.state_checks import sensitive_models

PROMPTS = [SYSTEM[: 10 + 5 * i] + [ord(c) for c in f"case {i}:"] for i in range(6)]
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9)


def _serve(eng: Engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams | None], *, new: int, order: Sequence[int] | None = None) -> dict[int, list[int]]:
    with eng:
        for i in order if order is not None else range(len(prompts)):
            eng.admit(RequestId(i + 1), prompts[i], max_new_tokens=new, sampling=params[i])
        while eng.live:
            eng.step()
        return {int(r): list(v) for r, v in eng.outputs.items()}


def _sensitive(k: int, **options: Any) -> Engine:
    """An engine over the state-sensitive tiny models (``tests.scenarios.state_checks.sensitive_models``),
    whose tokens change when a request starts from a slot's leftovers or a wrongly chunked state."""
    target, draft = sensitive_models()
    return Engine(target, draft if k else None, k=k, **options)


@cache
def _sensitive_greedy(i: int) -> list[int]:
    return greedy_generate_reference(sensitive_models()[0], PROMPTS[i], 8)


@pytest.mark.parametrize("k", [0, 2])
def test_a_seeded_request_gives_the_same_tokens_whatever_it_is_batched_with(k: int) -> None:
    """On the state-sensitive models: batched, one at a time in one reused slot with chunked
    prompts, and in executor processes, every request's tokens are the same."""
    params: list[SamplingParams | None] = [SAMPLED, SamplingParams(temperature=0.8, top_k=20, seed=77), None, SAMPLED, SAMPLED, None]
    base = _serve(_sensitive(k, seed=5, capacity=8), PROMPTS, params, new=8)
    # one request at a time, in another order, its prompt in chunks of 7
    assert base == _serve(_sensitive(k, seed=5, capacity=1, chunk_size=7), PROMPTS, params, new=8, order=[5, 3, 1, 0, 2, 4])
    assert base == _serve(_sensitive(k, seed=5, capacity=8, transport=Processes()), PROMPTS, params, new=8)
    # the greedy rows are plain greedy decoding, sampled rows beside them or not
    for i in (2, 5):
        assert base[i + 1] == _sensitive_greedy(i)
    if k == 0:  # and the sampled rows do sample: another run seed gives other tokens
        other = _serve(_sensitive(k, seed=6, capacity=8), PROMPTS, params, new=8)
        assert other[1] != base[1] and other[2] == base[2]  # request 2 brought its own seed


@pytest.mark.parametrize("k", [0, 2])
def test_temperature_zero_and_top_k_one_are_greedy(k: int) -> None:
    greedy = [greedy_reference(p, 8) for p in PROMPTS[:3]]
    cases = [SamplingParams(temperature=0.0, top_p=0.5, seed=3), SamplingParams(temperature=1.5, top_k=1)]
    for params in [GREEDY, *cases] if k == 0 else cases:  # (GREEDY at k = 2: the lossless tests)
        out = _serve(engine(k, seed=1), PROMPTS[:3], [params] * 3, new=8)
        assert [out[i + 1] for i in range(3)] == greedy, params


@cache
def _positions(k: int, n: int) -> np.ndarray:
    """The first three output tokens of ``n`` seeded requests on one prompt, [n, 3] (served once per
    (k, n): the seeds are fixed, so every test reading it reads the same tokens)."""
    params = SamplingParams(temperature=1.0, top_k=6)
    out = _serve(engine(k, seed=11, capacity=64, max_len=64), [PROMPTS[0]] * n, [params] * n, new=3)
    tokens = np.array([out[i + 1] for i in range(n)], dtype=np.int64)
    tokens.setflags(write=False)  # (shared by the tests that read it)
    return tokens


def _homogeneous(a: np.ndarray, b: np.ndarray) -> float:
    """The chi-square p-value that ``a`` and ``b`` come from one distribution (tokens seen fewer than
    five times in both together pooled into one bin)."""
    tokens, counts = np.unique(np.concatenate((a, b)), return_counts=True)
    big = set(tokens[counts >= 5].tolist())
    bins = sorted(big) + [-1]

    def hist(x: np.ndarray) -> list[int]:
        return [int(np.sum(x == t)) for t in bins[:-1]] + [int(sum(1 for v in x.tolist() if v not in big))]

    from scipy.stats import chi2_contingency  # (here: scipy.stats takes a second to import, in every worker that collects)

    table = np.array([hist(a), hist(b)])
    table = table[:, table.sum(axis=0) > 0]
    return float(chi2_contingency(table).pvalue)


def test_speculative_sampling_emits_the_distribution_plain_sampling_does() -> None:
    n = 300
    plain, spec = _positions(0, n), _positions(2, n)
    # the first token comes from the prefill with the same key in both: equal token for token
    assert (plain[:, 0] == spec[:, 0]).all()
    # the later ones come through rejection sampling at k = 2: equal in distribution, not per seed
    assert (plain[:, 1:] != spec[:, 1:]).any()
    for pos in (1, 2):
        p = _homogeneous(plain[:, pos], spec[:, pos])
        assert p > 1e-3, f"output position {pos}: chi-square p = {p:.2e}"
    # the joint of positions 1 and 2 too
    pairs_plain, pairs_spec = plain[:, 1] * 1000 + plain[:, 2], spec[:, 1] * 1000 + spec[:, 2]
    assert _homogeneous(pairs_plain, pairs_spec) > 1e-3


def test_the_chi_square_test_can_tell_distributions_apart() -> None:
    # the same test rejects a sampler that differs from the target's: here, plain sampling at another
    # temperature (a sharper top-k 6 distribution) on the same prompt and seeds
    n = 300
    plain = _positions(0, n)
    params = SamplingParams(temperature=0.5, top_k=6)
    out = _serve(engine(0, seed=11, capacity=64, max_len=64), [PROMPTS[0]] * n, [params] * n, new=3)
    sharper = np.array([out[i + 1] for i in range(n)], dtype=np.int64)
    assert _homogeneous(plain[:, 1], sharper[:, 1]) < 1e-3


@pytest.mark.parametrize("k", [0, 2])
def test_logprobs_are_the_targets_own_before_any_transform(k: int) -> None:
    import torch

    from backend.hybrid.reference import reference_logits
    from tests.helpers import tiny_models

    target = tiny_models()[0]
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.7, top_k=5, logprobs=0), None]
    eng = engine(k, seed=2)
    with eng:
        for i, p in enumerate(params):
            eng.admit(RequestId(i + 1), PROMPTS[i], max_new_tokens=6, sampling=p)
        while eng.live:
            eng.step()
        outputs, logprobs = dict(eng.outputs), dict(eng.logprobs)
    assert set(logprobs) == {1, 2}  # the request that asked for none has none
    for rid, n in ((1, 3), (2, 0)):
        seq = list(PROMPTS[rid - 1])
        assert [e["id"] for e in logprobs[rid]] == outputs[rid]
        for e in logprobs[rid]:
            ref = torch.log_softmax(reference_logits(target, seq)[-1].double(), dim=-1)
            assert e["logprob"] == pytest.approx(float(ref[e["id"]]), abs=1e-4)
            top = [t["id"] for t in e["top"]]
            assert len(top) == n and top == ref.argsort(descending=True, stable=True)[:n].tolist()
            assert [t["logprob"] for t in e["top"]] == pytest.approx(ref[top].tolist(), abs=1e-4)
            seq.append(e["id"])
    assert logprobs[1][0]["top"][0]["id"] == outputs[1][0]  # greedy: its token is its best alternative


@pytest.mark.parametrize("k", [0, 2])
def test_n_completions_share_one_prefill_of_the_prompt_and_sample_apart(k: int) -> None:
    prompt = PROMPTS[3]
    hot = SamplingParams(temperature=2.0, n=3, seed=21)
    eng = engine(k, seed=2)
    steps = []
    with eng:
        eng.admit(RequestId(1), prompt, max_new_tokens=6, sampling=hot, forks=[RequestId(11), RequestId(12)])
        eng.admit(RequestId(2), prompt, max_new_tokens=6, sampling=SamplingParams(temperature=0.0, n=2), forks=[RequestId(21)])
        assert len(eng.prefixes.held()) == 2  # the two prompts' shared states, prefilled at admission
        while eng.live:
            steps.append(eng.step())
        outputs = dict(eng.outputs)
        assert eng.prefixes.held() == {} and eng.slots.num_live == 0  # every shared state released, every slot back
    # one prefill of the prompt but its last token (the shared state); each completion prefills that last token only
    assert sum(r.prefill_tokens for r in steps) == 5
    samples = [outputs[RequestId(r)] for r in (1, 11, 12)]
    assert len({tuple(s) for s in samples}) == 3  # each completion its own stream
    assert outputs[RequestId(2)] == outputs[RequestId(21)] == greedy_reference(prompt, 6)  # greedy completions agree
    # completion 0 is the request a plain n = 1 admission with the same seed gives
    alone = _serve(engine(k, seed=2), [prompt], [SamplingParams(temperature=2.0, seed=21)], new=6)
    assert alone[1] == samples[0]


def test_n_completions_are_checked_before_anything_changes() -> None:
    from typeguard import suppress_type_checks

    from ir.errors import PreconditionError

    eng = engine(0)
    with eng:
        three = SamplingParams(n=3, temperature=1.0)
        cases: list[tuple[object, str]] = [
            ([RequestId(5)], r"sampling.n = 3 needs 2 fork ids, got 1"),
            ([RequestId(5), RequestId(5)], r"fork id 5 is already in use"),
            ([RequestId(5), True], r"fork id must be an int"),
            ("ab", r"forks must be a list or tuple of request ids"),
        ]
        for forks, message in cases:
            with suppress_type_checks(), pytest.raises(PreconditionError, match=message):
                eng.admit(RequestId(1), PROMPTS[0], max_new_tokens=4, sampling=three, forks=forks)  # type: ignore[arg-type]  # the bad value is the point
        cp = eng.make_prefix(PROMPTS[0][:4])
        with pytest.raises(PreconditionError, match=r"sampling.n = 3 with a prefix"):
            eng.admit(RequestId(1), PROMPTS[0], max_new_tokens=4, sampling=three, forks=[RequestId(2), RequestId(3)], prefix=cp)
        assert eng.live == 0 and list(eng.prefixes.held()) == [cp.slot]
