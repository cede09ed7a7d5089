"""``backend.plan_sampling``'s bans (``min_tokens``): a row's banned ids get ``-inf`` exactly at the
positions below its ``ban_until``, for greedy and sampled rows, in ``sample_logits`` and at each
position of a verify window; rows without a ban, and ids past the vocabulary, change nothing.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from backend.plan_sampling import sample_logits, verify_tokens
from backend.sampling import greedy_or_flag
from ir.columns import frozen_i64
from ir.sampling import GREEDY, SamplingParams, SamplingRows

VOCAB = 50


def _logits(*shape: int) -> torch.Tensor:
    x = torch.randn(*shape, VOCAB, generator=torch.Generator().manual_seed(4))
    x[..., 7] = 10.0  # the argmax everywhere, and nearly all of a sampled row's mass
    return x


def test_sample_logits_bans_below_ban_until_only() -> None:
    logits = _logits(4)
    rows = SamplingRows.of(
        [GREEDY, GREEDY, SamplingParams(temperature=1.0, seed=5), GREEDY],
        bans=[(20, [7, 99]), (10, [7]), (20, [7]), (0, [7])],  # (99: past the vocabulary, ignored)
    )
    tokens = sample_logits(logits, rows, frozen_i64([19, 10, 19, 3])).tolist()
    without = logits.clone()
    without[:, 7] = -math.inf
    assert tokens[0] == int(greedy_or_flag(without[0])) and tokens[2] != 7
    assert tokens[1] == 7 and tokens[3] == 7  # at ban_until the ban is over; ban_until 0 bans nothing
    # no ban anywhere: the plain argmax, the same as with no rows at all
    plain = SamplingRows.of([GREEDY] * 4)
    assert sample_logits(logits, plain, frozen_i64([0, 0, 0, 0])).tolist() == sample_logits(logits, None, frozen_i64([0] * 4)).tolist() == [7] * 4


def test_verify_bans_each_window_position_by_its_own_position() -> None:
    k = 3
    logits = _logits(2, k + 1)
    drafts = frozen_i64(np.full(2 * k, 7))  # the draft proposes the banned argmax everywhere
    rows = SamplingRows.of([GREEDY, GREEDY], bans=[(12, [7]), (0, [7])])
    tokens = verify_tokens(logits, drafts, rows, frozen_i64([10, 10])).tolist()
    first, second = tokens[: k + 1], tokens[k + 1 :]
    # row 0: positions 10 and 11 are banned: the first proposal is rejected at once and the row
    # emits the best other token there (passes.accept reads no further)
    assert first[0] != 7 and first[1] != 7 and first[2:] == [7, 7]
    assert second == [7] * (k + 1)
    sampled = SamplingRows.of([SamplingParams(temperature=1.0, seed=s) for s in (1, 2)], bans=[(12, [7]), (12, [7])])
    got = verify_tokens(logits, drafts, sampled, frozen_i64([10, 11])).tolist()
    assert got[0] != 7 and got[k + 1] != 7  # position 10 and 11: banned, so the proposal 7 is rejected there


def test_all_minus_inf_after_a_ban_is_flagged_not_emitted() -> None:
    logits = torch.full((1, VOCAB), -math.inf)
    logits[0, 3] = 1.0
    rows = SamplingRows.of([GREEDY], bans=[(5, [3])])
    assert sample_logits(logits, rows, frozen_i64([0])).tolist() == [-1]  # NON_FINITE: nothing left to emit
