"""The sampler's fast paths change no row's result (``backend.sampling``):

- a row's probabilities (bit for bit) and token are the same alone and inside batches that mix
  greedy, temperature-only, top-k, top-p, min-p and penalised rows, non-finite rows, in any order:
  the transforms a batch skips, the subset of sampled rows and the host-side sort are per row;
- the NumPy sort of composite keys and torch's stable sort give the same order (ties, ``-0.0``,
  ``-inf``);
- the dense ``probs`` built on demand are one-hot for greedy rows and zero for non-finite ones.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backend import sampling
from backend.sampling import NON_FINITE, RowParams, _order_asc, distribution, greedy_or_flag, sample_rows
from ir.sampling import GREEDY, SamplingParams

VOCAB = 3000

KINDS = [
    GREEDY,
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, seed=2),
    SamplingParams(temperature=1.3, top_k=50, seed=3),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.8, min_p=0.02, seed=4),
    SamplingParams(temperature=0.9, min_p=0.1, seed=5),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, seed=6),
    SamplingParams(temperature=0.0, presence_penalty=2.0),
    SamplingParams(temperature=2.0, top_k=VOCAB + 3, seed=7),
    SamplingParams(temperature=0.5, top_p=1e-6, seed=8),
]


def _logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, VOCAB, generator=g) * 3
    x[:, ::7] = (x[:, ::7] * 2).round() / 2  # ties
    return x


def _run(logits: torch.Tensor, params: list[SamplingParams], counts: torch.Tensor | None, prompt: torch.Tensor | None, position: torch.Tensor,
         indices: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rows = RowParams.of(params, indices=indices if indices is not None else [i % 3 for i in range(len(params))])
    dist = distribution(logits, rows, output_counts=counts, prompt_mask=prompt)
    return dist.probs, sample_rows(dist, rows, position)


@pytest.mark.parametrize("trial", range(3))
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(trial: int) -> None:
    g = torch.Generator().manual_seed(100 + trial)
    n = 24
    logits = _logits(n, trial)
    logits[5, 17] = math.nan
    logits[11, :] = -math.inf
    logits[19, 3] = math.inf
    params = [KINDS[int(torch.randint(len(KINDS), (1,), generator=g))] for _ in range(n)]
    params[5], params[11] = KINDS[2], KINDS[1]  # sampled rows with non-finite logits
    counts = torch.randint(0, 3, (n, VOCAB), generator=g) * (torch.rand(n, VOCAB, generator=g) < 0.01)
    prompt = torch.rand(n, VOCAB, generator=g) < 0.01
    position = torch.randint(0, 1000, (n,), generator=g)
    index = [i % 3 for i in range(n)]
    rows = RowParams.of(params, indices=index)
    dist = distribution(logits, rows, output_counts=counts, prompt_mask=prompt)
    whole_probs, whole = dist.probs, sample_rows(dist, rows, position)
    assert whole[[5, 11, 19]].tolist() == [NON_FINITE] * 3
    assert float(whole_probs[[5, 11, 19]].abs().sum()) == 0.0
    batches = [torch.tensor([i]) for i in range(n)]  # alone
    batches += [torch.randperm(n, generator=g)[: int(m)] for m in torch.randint(2, n + 1, (6,), generator=g)]
    for b in batches:
        sub = RowParams.of([params[int(i)] for i in b], indices=[index[int(i)] for i in b])
        d = distribution(logits[b], sub, output_counts=counts[b], prompt_mask=prompt[b])
        tokens = sample_rows(d, sub, position[b])
        assert torch.equal(tokens, whole[b]), b
        assert torch.equal(d.probs, whole_probs[b]), b  # bit for bit
    # greedy rows are greedy_or_flag of their (unpenalised) logits; sampled ones drew a kept token
    for i, p in enumerate(params):
        if p.greedy and p.presence_penalty == 0:
            assert int(whole[i]) == int(greedy_or_flag(logits[i]))
        elif int(whole[i]) != NON_FINITE:
            assert float(whole_probs[i, int(whole[i])]) > 0


def test_host_sort_is_the_stable_sort() -> None:
    g = torch.Generator().manual_seed(5)
    z = -(torch.randn(64, 500, generator=g).abs() * 4).round() / 4  # many ties, all <= 0
    z[:, ::11] = -math.inf
    z[3, :] = 0.0
    z[4, ::2] = -0.0  # equal to 0.0: ties by id with the zeros
    z[5] = -math.inf
    z[5, 9] = 0.0
    host = _order_asc(z, host=True)
    torch_sort = _order_asc(z, host=False)
    assert torch.equal(host[1], torch_sort[1])
    assert torch.equal(host[0], torch_sort[0])
    # ascending, ties in decreasing id order
    vals, ids = host
    assert bool((vals[:, 1:] >= vals[:, :-1]).all())
    tie = vals[:, 1:] == vals[:, :-1]
    assert bool((ids[:, 1:][tie] < ids[:, :-1][tie]).all())


@pytest.mark.parametrize("sort_on_host", [True, False])
def test_host_top_p_is_the_sorted_scatter_bit_for_bit(sort_on_host: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_top_p_sorted_host`` (the kept entries as a threshold on the sort keys) keeps what
    ``_top_p_sorted`` (the kept prefix scattered back to token order) keeps, with the host's sort and
    with torch's: at ties crossing the cut, zeros of both signs, ``-inf`` tails, a limit reached at
    the first entry and never reached (float64 limits 1 - float32(1 - top_p))."""
    g = torch.Generator().manual_seed(11)
    z = -(torch.randn(48, 300, generator=g).abs() * 3).round() / 4  # many ties, all <= 0
    z[:, ::7] = -math.inf
    z[3] = 0.0  # flat: the cut falls inside one tie
    z[4, ::2] = -0.0
    z[5] = -math.inf
    z[5, 9] = 0.0  # one token: kept whatever the limit
    top_p = torch.rand(48, generator=g, dtype=torch.float64).numpy() * 0.999 + 0.001
    top_p[:4] = (0.999999, 0.5, 0.9, 0.1)
    limit = torch.from_numpy(1.0 - (1.0 - top_p[:, None]).astype(np.float32).astype(np.float64))
    e = z.softmax(dim=-1)
    order = sampling._order_desc

    def sort(x: torch.Tensor, *, host: bool | None = None) -> torch.Tensor:
        return order(x, host=sort_on_host)

    monkeypatch.setattr(sampling, "_order_desc", sort)
    scattered = sampling._top_p_sorted(z, e, limit)
    assert torch.equal(sampling._top_p_sorted_host(z, e, limit), scattered)
    assert 1 < int(torch.isfinite(scattered[3]).sum()) < 300  # the flat row's cut is inside its tie


def test_dense_probs_of_a_greedy_batch_are_built_when_read() -> None:
    logits = _logits(4, 9)
    logits[2, 0] = math.nan
    rows = RowParams.of([GREEDY] * 4)
    dist = distribution(logits, rows)
    assert dist.all_greedy and dist.sampled_probs is None
    assert torch.equal(sample_rows(dist, rows, torch.zeros(4, dtype=torch.int64)), greedy_or_flag(logits))
    expected = torch.zeros(4, VOCAB)
    for i in (0, 1, 3):
        expected[i, int(greedy_or_flag(logits[i]))] = 1.0
    assert torch.equal(dist.probs, expected)


LARGE = 131_072


def test_candidate_path_gives_the_full_sorts_bits_at_a_large_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a 131,072 vocabulary, top-k and top-p rows take ``torch.topk`` candidates and sort the
    whole row only where the candidates cannot decide: the probabilities and tokens equal those of
    ``FULL_SORT`` (every row sorted) bit for bit, and only the rows expected to fall back are sorted."""
    g = torch.Generator().manual_seed(77)
    logits = torch.randn(10, LARGE, generator=g) * 3
    logits[3, :] = (logits[3, :] * 4).round() / 4  # many ties, at every cut
    logits[4, :] = 0.0
    logits[4, :10] = 1.0  # flat: top-p 0.9 needs most of the vocabulary (falls back to the full sort)
    logits[5, :40] = 20.0  # a 40-way tie at the top crosses top_k 30's cut
    logits[8, 7] = math.nan
    # top-p's cut inside a tie that straddles the first candidate count: 1,000 tokens at 5, then
    # 3,000 tied at 0 (the cut keeps 21 of them: the lowest ids), the rest negligible
    ids = torch.randperm(LARGE, generator=g)
    logits[9, :] = -30.0
    logits[9, ids[:1000]] = 5.0
    logits[9, ids[1000:4000]] = 0.0
    big = 1000 * math.exp(5.0)
    params = [
        SamplingParams(temperature=1.0, top_k=50, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2),  # needs ~5,600 tokens: the second candidate count
        SamplingParams(temperature=0.3, top_p=0.9, seed=3),  # peaked: the first
        SamplingParams(temperature=1.0, top_k=2000, top_p=0.95, seed=4),
        SamplingParams(temperature=1.0, top_p=0.9, seed=5),
        SamplingParams(temperature=1.0, top_k=30, top_p=0.99, seed=6),
        SamplingParams(temperature=0.7, top_p=0.5, min_p=0.01, seed=7),
        GREEDY,
        SamplingParams(temperature=1.0, top_p=0.9, seed=8),
        SamplingParams(temperature=1.0, top_p=(big + 20.5) / (big + 3000), seed=9),
    ]
    position = torch.arange(10) * 13
    sorted_rows: list[int] = []
    real = sampling._order_desc

    def spy(z: torch.Tensor, *, host: bool | None = None) -> torch.Tensor:
        sorted_rows.append(int(z.shape[0]))
        return real(z, host=host)

    monkeypatch.setattr(sampling, "_order_desc", spy)
    fast_probs, fast = _run(logits, params, None, None, position)
    assert sum(sorted_rows) == 2, sorted_rows  # the flat row and the non-finite one
    monkeypatch.setattr(sampling, "FULL_SORT", True)
    full_probs, full = _run(logits, params, None, None, position)
    assert torch.equal(fast, full)
    assert torch.equal(fast_probs, full_probs)
    kept = (fast_probs > 0).sum(dim=1).tolist()
    assert kept[0] == 50 and kept[5] == 40 and kept[7] == 1 and kept[8] == 0
    assert 1000 < kept[1] < 16_384 and kept[2] < 1000 and kept[4] > 16_384, kept
    tied = ids[1000:4000].sort().values
    assert torch.equal((fast_probs[9] > 0).nonzero().squeeze(1), torch.cat([ids[:1000], tied[:21]]).sort().values)
    # alone, each row gets the same bits
    monkeypatch.setattr(sampling, "FULL_SORT", False)
    for i in range(10):
        probs, token = _run(logits[i : i + 1], params[i : i + 1], None, None, position[i : i + 1], [i % 3])
        assert torch.equal(token, fast[i : i + 1]) and torch.equal(probs, fast_probs[i : i + 1]), i


def test_penalties_on_the_seen_entries_equal_the_dense_formula() -> None:
    """``_penalised`` changes only the penalised rows' seen tokens; its values equal the dense
    formula (repetition on prompt and output tokens, then frequency and presence) on every entry
    (a float32, a bfloat16 input; negative penalties; ``-inf`` logits)."""
    g = torch.Generator().manual_seed(12)
    n, vocab = 6, 5000
    counts = torch.randint(0, 4, (n, vocab), generator=g) * (torch.rand(n, vocab, generator=g) < 0.02)
    prompt = torch.rand(n, vocab, generator=g) < 0.02
    params = [
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.7, seed=1),
        GREEDY,
        SamplingParams(temperature=0.0, presence_penalty=-2.0),
        SamplingParams(temperature=1.0, seed=2),
        SamplingParams(temperature=1.0, repetition_penalty=0.8, seed=3),
        SamplingParams(temperature=1.0, frequency_penalty=2.0, seed=4),
    ]
    rows = RowParams.of(params)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
        logits[0, :50] = -math.inf
        got = sampling._penalised(logits, rows, counts, prompt)
        x = logits.float()
        seen_out = counts > 0
        r = rows.repetition_penalty[:, None]
        want = torch.where(seen_out | prompt, torch.where(x < 0, x * r, x / r), x)
        want = want - counts.float() * rows.frequency_penalty[:, None] - seen_out.float() * rows.presence_penalty[:, None]
        on = torch.tensor([p.penalised for p in params])[:, None]
        want = torch.where(on, want, x)
        assert torch.equal(got, want), dtype
        assert not torch.equal(got[0], x[0]) and torch.equal(got[1], x[1]) and torch.equal(got[3], x[3])
