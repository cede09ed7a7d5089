"""The sampler's final probability vector (``backend.sampling.distribution``) against references:

- transformers' ``RepetitionPenaltyLogitsProcessor``, ``TemperatureLogitsWarper``,
  ``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper`` applied in that order (as
  ``generate`` does) to the same logits, one row at a time, then softmax: equal to 1e-6;
- presence and frequency penalties against a hand-written OpenAI-semantics reference;
- greedy rows: bit for bit ``greedy_or_flag``, ``NON_FINITE`` where the logits are not finite;
- ``window_counts`` against counting by hand.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from backend.sampling import NON_FINITE, RowParams, distribution, greedy_or_flag, sample, sample_rows, window_counts
from ir.sampling import GREEDY, SamplingParams


def _hf_probs(logits: torch.Tensor, p: SamplingParams, seen_ids: list[int]) -> torch.Tensor:
    from transformers.generation.logits_process import (  # (here: transformers takes a second to import, in every worker that collects)
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits[None].clone()
    if p.repetition_penalty != 1.0 and seen_ids:
        scores = RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty)(torch.tensor([seen_ids]), scores)
    ids = torch.zeros((1, 1), dtype=torch.int64)  # the warpers ignore input_ids
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(top_k=p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(top_p=p.top_p)(ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(min_p=p.min_p)(ids, scores)
    return scores.softmax(dim=-1)[0]


def _random_params(g: torch.Generator, n: int, vocab: int) -> list[SamplingParams]:
    def pick(options: list[float]) -> float:
        return options[int(torch.randint(len(options), (1,), generator=g))]

    out = []
    for i in range(n):
        out.append(
            SamplingParams(
                temperature=pick([0.3, 0.7, 1.0, 1.5, 3.0]),
                top_k=int(pick([-1, 0, 1, 2, 10, 50, vocab - 1, vocab + 5])),
                top_p=pick([1.0, 0.99, 0.9, 0.5, 0.1]),
                min_p=pick([0.0, 0.0, 0.01, 0.1, 0.5]),
                repetition_penalty=pick([1.0, 1.0, 1.3, 0.8, 2.0]),
                seed=i,
            )
        )
    return out


@pytest.mark.parametrize("scale", [1.0, 4.0, 12.0])
def test_probabilities_equal_transformers_warpers(scale: float) -> None:
    """48 rows of 1,000 logits with random parameter mixes (every filter alone and combined). One
    row in four has ties (logits rounded to a coarse grid) and no top-p: transformers' top-k and
    min-p are threshold rules, so ties at their boundaries have one answer; where top-p's cut
    falls inside a tie transformers' answer depends on its unstable sort (see the next test)."""
    g = torch.Generator().manual_seed(int(scale * 10))
    n, vocab = 48, 1000
    logits = torch.randn(n, vocab, generator=g) * scale
    logits[::4] = (logits[::4] * 2).round() / 2  # ties at the top-k and min-p boundaries
    params = _random_params(g, n, vocab)
    params[::4] = [attrs.evolve(p, top_p=1.0) for p in params[::4]]
    prompt = torch.randint(0, vocab, (n, 12), generator=g)
    generated = torch.randint(0, vocab, (n, 20), generator=g)
    counts = torch.zeros(n, vocab, dtype=torch.int64)
    counts.scatter_add_(1, generated, torch.ones_like(generated))
    prompt_mask = torch.zeros(n, vocab, dtype=torch.bool).scatter_(1, prompt, True)
    dist = distribution(logits, RowParams.of(params), output_counts=counts, prompt_mask=prompt_mask)
    for i, p in enumerate(params):
        ref = _hf_probs(logits[i], p, prompt[i].tolist() + generated[i].tolist())
        assert torch.allclose(dist.probs[i], ref, atol=1e-6, rtol=0), (i, p, (dist.probs[i] - ref).abs().max())
        assert torch.equal(dist.probs[i] > 0, ref > 0), (i, p)  # the same tokens survive the filters


def test_top_p_cut_inside_a_tie_keeps_the_lower_ids() -> None:
    logits = torch.tensor([[1.0, 3.0, 0.0, 3.0, 3.0, -1.0]])
    # three tied maxima of 0.32 each: top_p 0.5 keeps two of them (0.64 > 0.5), the lower ids
    dist = distribution(logits, RowParams.of([SamplingParams(temperature=1.0, top_p=0.5, seed=0)]))
    assert (dist.probs[0] > 0).nonzero().flatten().tolist() == [1, 3]
    dist = distribution(logits, RowParams.of([SamplingParams(temperature=1.0, top_p=1e-6, seed=0)]))
    assert (dist.probs[0] > 0).nonzero().flatten().tolist() == [int(greedy_or_flag(logits))] == [1]
    # top-k keeps every token tied with the k-th largest, as transformers
    dist = distribution(logits, RowParams.of([SamplingParams(temperature=1.0, top_k=2, seed=0)]))
    assert (dist.probs[0] > 0).nonzero().flatten().tolist() == [1, 3, 4]


def _openai_reference(logits: torch.Tensor, generated: list[int], presence: float, frequency: float) -> torch.Tensor:
    out = logits.clone()
    for t in set(generated):
        c = generated.count(t)
        out[t] = out[t] - c * frequency - presence  # OpenAI: mu[j] - c[j] * a_freq - float(c[j] > 0) * a_pres
    return out


def test_presence_and_frequency_penalties_follow_openai() -> None:
    g = torch.Generator().manual_seed(3)
    n, vocab = 6, 64
    logits = torch.randn(n, vocab, generator=g) * 2
    generated = torch.randint(0, vocab, (n, 30), generator=g)  # repeats: counts above 1
    counts = torch.zeros(n, vocab, dtype=torch.int64).scatter_add_(1, generated, torch.ones_like(generated))
    settings = [(0.0, 0.5), (0.5, 0.0), (1.5, -0.7), (-2.0, 2.0), (2.0, 2.0), (0.0, 0.0)]
    params = [SamplingParams(temperature=1.0, presence_penalty=pp, frequency_penalty=fp, seed=1) for pp, fp in settings]
    # prompt tokens do not count for these two penalties
    prompt_mask = torch.ones(n, vocab, dtype=torch.bool)
    dist = distribution(logits, RowParams.of(params), output_counts=counts, prompt_mask=prompt_mask)
    for i, (pp, fp) in enumerate(settings):
        ref = _openai_reference(logits[i], generated[i].tolist(), pp, fp).softmax(dim=-1)
        assert torch.allclose(dist.probs[i], ref, atol=1e-6, rtol=0), i


def _torch_greedy_or_flag(logits: torch.Tensor) -> torch.Tensor:
    best, index = logits.max(dim=-1)
    return torch.where(torch.isfinite(best), index, NON_FINITE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6,), (1, 5), (9, 300), (3, 4, 257), (0, 7)])
def test_greedy_or_flag_on_the_host_is_torchs_max_bit_for_bit(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A CPU tensor of float32/float64 takes the numpy path (bfloat16, which numpy lacks, and a
    tensor that needs grad take torch's): every path gives ``torch.max``'s token or the flag, for
    rows with a NaN, a +inf, only -inf, ties (the lower id) and a -inf beside a finite maximum."""
    g = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(*shape, generator=g).to(dtype)
    rows = logits.reshape(-1, shape[-1])
    for i, fill in enumerate(("nan", "inf", "-inf row", "tie", "-inf")):
        if i >= rows.shape[0]:
            break
        if fill == "-inf row":
            rows[i] = -math.inf
        elif fill == "tie":
            rows[i, -1] = rows[i, 0] = 50.0
        else:
            rows[i, shape[-1] // 2] = float(fill)
    expected = _torch_greedy_or_flag(logits)
    for x in (logits, logits.clone().requires_grad_(dtype is not torch.bfloat16)):
        got = greedy_or_flag(x)
        assert got.dtype == torch.int64 and torch.equal(got, expected)
    if len(shape) == 2:
        assert sample(logits).tolist() == expected.tolist()


def test_greedy_rows_are_greedy_or_flag_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 300, generator=g)
    logits[3, 17] = float("nan")
    logits[4, :] = -math.inf
    logits[5, 9] = math.inf
    logits[6, 100] = logits[6, 50] = 9.0  # a tie: the lower id, as torch.argmax
    logits[7, 4] = -math.inf  # a row with a finite maximum keeps its token
    params = [GREEDY] * 8 + [SamplingParams(temperature=0.9, seed=i) for i in range(8)]
    rows = RowParams.of(params)
    counts = torch.zeros(16, 300, dtype=torch.int64)
    counts[:, :40] = 2  # penalties are off for every row: counts must change nothing
    dist = distribution(logits, rows, output_counts=counts)
    expected = greedy_or_flag(logits)
    assert expected[3:6].tolist() == [NON_FINITE] * 3 and int(expected[6]) == 50
    assert torch.equal(dist.top, expected)
    tokens = sample_rows(dist, rows, torch.zeros(16, dtype=torch.int64))
    assert torch.equal(tokens[:8], expected[:8])
    assert torch.equal(torch.from_numpy(sample(logits[:8]).copy()), tokens[:8])
    # a greedy batch is greedy_or_flag for half-precision logits too
    half = logits[:8].to(torch.bfloat16)
    assert torch.equal(sample_rows(distribution(half, RowParams.of([GREEDY] * 8)), RowParams.of([GREEDY] * 8), torch.zeros(8, dtype=torch.int64)), greedy_or_flag(half))
    # one-hot probabilities for finite greedy rows, zeros for flagged ones
    assert torch.equal(dist.probs[:8].sum(dim=-1), torch.tensor([1.0, 1, 1, 0, 0, 0, 1, 1]))


def test_top_k_one_is_greedy_and_penalised_greedy_is_the_penalised_argmax() -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(32, 500, generator=g) * 3
    rows = RowParams.of([SamplingParams(temperature=1.0, top_k=1, seed=s) for s in range(32)])
    assert torch.equal(sample_rows(distribution(logits, rows), rows, torch.arange(32)), greedy_or_flag(logits))
    best = greedy_or_flag(logits)
    counts = torch.zeros(32, 500, dtype=torch.int64).scatter_(1, best[:, None], 1)
    rows = RowParams.of([SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)] * 32)
    dist = distribution(logits, rows, output_counts=counts)
    ref = logits.clone()
    ref[torch.arange(32), best] -= 4.0
    assert torch.equal(dist.top, greedy_or_flag(ref))


def test_window_counts_add_the_proposals_before_each_position() -> None:
    counts = torch.tensor([[1, 0, 0, 2], [0, 0, 0, 0]])
    drafts = torch.tensor([[1, 1, 3], [0, 2, 0]])
    got = window_counts(counts, drafts).reshape(2, 4, 4)
    assert got[0].tolist() == [[1, 0, 0, 2], [1, 1, 0, 2], [1, 2, 0, 2], [1, 2, 0, 3]]
    assert got[1].tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0], [2, 0, 1, 0]]
