"""``backend.logprobs.token_logprobs`` against a straightforward per-row reference
(``torch.log_softmax`` and a stable sort of each row), with ties, ``n = 0``, per-row ``n``,
``-inf`` logits, non-finite rows, and refused arguments."""

from __future__ import annotations

import math

import pytest
import torch

from backend.logprobs import PAD, token_logprobs
from backend.sampling import NON_FINITE, greedy_or_flag


def _reference(logits: torch.Tensor, token: int, n: int) -> tuple[float, list[int], list[float]]:
    lp = torch.log_softmax(logits.double(), dim=-1)
    # descending by value, equal values by lower id: sort (-value, id) pairs
    order = sorted(range(logits.shape[0]), key=lambda i: (-float(lp[i]), i))[:n]
    return float(lp[token]), order, [float(lp[i]) for i in order]


@pytest.mark.parametrize("vocab", [7, 300, 5000])
def test_matches_the_per_row_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = 12
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[::3] = logits[::3].round()  # ties
    logits[1, : vocab // 2] = -math.inf
    logits[2] = 0.0  # every token tied
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    tokens[1] = 0  # a token of probability 0: log-probability -inf
    n = torch.randint(0, min(20, vocab) + 1, (rows,), generator=g)
    n[0], n[2] = min(20, vocab), 0
    out = token_logprobs(logits, tokens, n)
    width = int(n.max())
    assert out.top_ids.shape == out.top_logprobs.shape == (rows, width)
    for i in range(rows):
        lp, ids, lps = _reference(logits[i], int(tokens[i]), int(n[i]))
        assert math.isclose(float(out.logprob[i]), lp, abs_tol=1e-5) or (lp == -math.inf and float(out.logprob[i]) == -math.inf), i
        k = int(n[i])
        assert out.top_ids[i, :k].tolist() == ids, i
        assert torch.allclose(out.top_logprobs[i, :k].double(), torch.tensor(lps, dtype=torch.float64), atol=1e-5), i
        assert out.top_ids[i, k:].tolist() == [PAD] * (width - k)
        assert bool(out.top_logprobs[i, k:].isnan().all())
        if k:
            assert int(out.top_ids[i, 0]) == int(greedy_or_flag(logits[i]))  # greedy's tie-break
    assert out.top_ids[2, :0].tolist() == [] and out.top_ids[0, :3].tolist() == _reference(logits[0], 0, 3)[1]
    entries = out.entries()
    assert [len(e["top"]) for e in entries] == n.tolist()
    assert entries[0]["id"] == int(tokens[0]) and entries[0]["top"][0]["id"] == int(out.top_ids[0, 0])


def test_one_n_for_all_rows_and_n_zero() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, -1.0, 3.0, 3.0]])
    tokens = torch.tensor([3, 1])
    out = token_logprobs(logits, tokens, 2)
    assert out.top_ids.tolist() == [[1, 2], [0, 2]]
    assert out.n.tolist() == [2, 2]
    none = token_logprobs(logits, tokens, 0)
    assert none.top_ids.shape == (2, 0) and [e["top"] for e in none.entries()] == [[], []]
    assert torch.equal(none.logprob, out.logprob)
    assert torch.allclose(out.logprob, torch.log_softmax(logits, dim=-1)[[0, 1], [3, 1]])


def test_non_finite_rows_have_nan_logprobs_and_flag_ids() -> None:
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(1))
    logits[1, 4] = math.nan
    logits[2, 0] = math.inf
    logits[3] = -math.inf
    tokens = greedy_or_flag(logits)
    tokens[4] = NON_FINITE  # a flagged token is treated the same way
    out = token_logprobs(logits, tokens, 3)
    assert not bool(out.logprob[0].isnan())
    assert bool(out.logprob[1:].isnan().all())
    assert out.top_ids[1:].tolist() == [[NON_FINITE] * 3] * 4
    assert bool(out.top_logprobs[1:].isnan().all())
    assert out.top_ids[0].tolist() == torch.log_softmax(logits[0], dim=-1).sort(descending=True, stable=True).indices[:3].tolist()


def test_bad_arguments_are_refused() -> None:
    logits = torch.zeros(2, 5)
    tokens = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="at most the vocabulary"):
        token_logprobs(logits, tokens, 6)
    with pytest.raises(ValueError, match=r"in \[0, 20\], got 21"):
        token_logprobs(torch.zeros(2, 50), tokens, 21)
    with pytest.raises(ValueError, match="got -1"):
        token_logprobs(logits, tokens, torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match="shape"):
        token_logprobs(logits, tokens, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="got 5"):
        token_logprobs(logits, torch.tensor([0, 5]), 1)
    with pytest.raises(ValueError, match="got -3"):
        token_logprobs(logits, torch.tensor([-3, 0]), 1)
