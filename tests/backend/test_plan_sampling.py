"""``backend.plan_sampling``: the sampler applied to a plan's rows (greedy rows bit for bit the argmax,
verify windows in the ``Verified`` form the accept pass reads)."""

from __future__ import annotations

import numpy as np
import torch

from backend import plan_sampling
from backend.sampling import greedy_or_flag, sample
from ir.columns import frozen_i64
from ir.results import NON_FINITE
from ir.sampling import GREEDY, SamplingParams, SamplingRows
from passes.accept import accept
from passes.prepare_for_draft import SpecContext, prepare_for_draft
from passes.prepare_for_verify import prepare_for_verify
from tests.helpers import decode_batch, proposed, verified


def _logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_rows_are_the_argmax_bit_for_bit() -> None:
    logits = _logits(5, 64)
    logits[3, 7] = float("nan")
    pos = frozen_i64([10, 11, 12, 13, 14])
    want = sample(logits)
    assert (plan_sampling.sample_logits(logits, None, pos) == want).all()
    assert (plan_sampling.sample_logits(logits, SamplingRows.greedy(5), pos) == want).all()
    assert want[3] == NON_FINITE
    # a greedy row beside sampled ones is still its argmax
    mixed = SamplingRows.of([GREEDY, SamplingParams(temperature=1.0, seed=4)] * 2 + [GREEDY])
    got = plan_sampling.sample_logits(logits, mixed, pos)
    assert [int(got[i]) for i in (0, 2, 4)] == [int(want[i]) for i in (0, 2, 4)]


def test_a_sampled_rows_token_depends_on_its_key_only() -> None:
    logits = _logits(3, 50, seed=1)
    p = SamplingParams(temperature=1.5, seed=9)
    rows = SamplingRows.of([p, p, p])
    got = plan_sampling.sample_logits(logits, rows, frozen_i64([7, 7, 8]))
    alone = [int(plan_sampling.sample_logits(logits[i : i + 1], SamplingRows.of([p]), frozen_i64([pos]))[0]) for i, pos in enumerate([7, 7, 8])]
    assert got.tolist() == alone


def test_verify_tokens_keep_the_form_the_accept_pass_reads() -> None:
    k, n, vocab = 3, 4, 40
    running = decode_batch([1, 2, 3, 4], [1, 2, 3, 4], [9] * n, list(range(n)))
    draft = prepare_for_draft(running, SpecContext(k=k, next_tokens=[1] * n, kv_locs=list(range(100, 100 + n * (k + 1)))))
    logits = _logits(n, k + 1, vocab, seed=2)
    drafts = greedy_or_flag(logits)[:, :k].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % vocab  # row 1's first proposal is not the argmax
    verify = prepare_for_verify(draft, proposed(draft, drafts.reshape(-1).tolist()))
    start = frozen_i64([9] * n)
    # greedy rows: the argmax at every position; the accept pass accepts while the proposal equals it
    greedy = plan_sampling.verify_tokens(logits, verify.window(verify.input_ids)[:, 1:].reshape(-1), None, start)
    assert (greedy == greedy_or_flag(logits).reshape(-1).numpy()).all()
    assert accept(verify, verified(verify, greedy)).accepted.tolist() == [k, 0, k, k]
    # sampled rows: the accepted proposals, then the replacement or bonus; accept reads the same count
    rows = SamplingRows.of([SamplingParams(temperature=1.0, seed=s) for s in range(1, n + 1)])
    tokens = plan_sampling.verify_tokens(logits, verify.window(verify.input_ids)[:, 1:].reshape(-1), rows, start)
    window = tokens.reshape(n, k + 1)
    result = accept(verify, verified(verify, tokens))
    for i, m in enumerate(result.accepted.tolist()):
        assert window[i, :m].tolist() == drafts[i, :m].tolist()
        if m < k:
            assert window[i, m] != drafts[i, m]  # the residual has no mass on the rejected proposal


def test_the_rows_of_a_running_batch_are_summarised_once() -> None:
    rows = SamplingRows.of([SamplingParams(temperature=1.0, top_p=0.9, seed=3)] * 2)
    device = torch.device("cpu")
    first = plan_sampling._params(rows, device)
    assert plan_sampling._params(rows, device) is first  # the same rows object: the same tensors
    # equal rows in a new object (a prefill's rows, then its decodes'): found by value
    equal = SamplingRows.of([SamplingParams(temperature=1.0, top_p=0.9, seed=3)] * 2)
    assert plan_sampling._params(equal, device) is first
    other = SamplingRows.of([SamplingParams(temperature=1.0, top_p=0.9, seed=4)] * 2)
    assert plan_sampling._params(other, device) is not first
    np.testing.assert_array_equal(plan_sampling._params(other, device).seed.numpy(), other.seed)
    # a verify window's repeated rows: built once per window width
    prep = plan_sampling._prepared(rows, device)
    assert prep.window(3) is prep.window(3) and prep.window(3).seed.tolist() == [3] * 6
    for i in range(plan_sampling._CACHE_SIZE + 1):
        plan_sampling._params(SamplingRows.greedy(i + 1), device)
    assert len(plan_sampling._by_id) == len(plan_sampling._by_value) == plan_sampling._CACHE_SIZE
    np.testing.assert_array_equal(plan_sampling._params(rows, device).seed.numpy(), rows.seed)
