"""The counter-based random stream (``backend.rng``) and the inverse-CDF draw of ``sample_rows``.

- the torch hash equals a pure-Python reference of the same construction bit for bit (int64
  wrapping multiplication is what the torch code relies on);
- a row's numbers and its sampled token depend on its key only: alone, in a batch of 7 others and
  in another order they are identical;
- different purposes, positions, completion indices and seeds give different numbers;
- the uniforms look uniform (a stated false-failure rate) and the inverse CDF draws each token with
  its probability (exactly, over a grid of uniforms) and never a zero-probability token.
"""

from __future__ import annotations

import math

import pytest
import torch

from backend.rng import Keys, Purpose, bits, uniform
from backend.sampling import NON_FINITE, RowParams, _inverse_cdf, distribution, sample_rows
from ir.sampling import SamplingParams

M64 = (1 << 64) - 1


def _mix_ref(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _bits_ref(seed: int, index: int, position: int, purpose: int) -> int:
    """The stream's hash on Python integers modulo 2**64 (the documented construction)."""
    word = position | (index << 44) | (purpose << 56)
    h = _mix_ref(_mix_ref(seed ^ 0x9E3779B97F4A7C15) ^ word)
    return _mix_ref((h + 0xD1B54A32D192ED03) & M64)


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_torch_hash_equals_the_integer_reference() -> None:
    keys = [(0, 0, 0, 1), (1, 0, 0, 1), (2**63 - 1, 15, 2**44 - 1, 4), (123456789, 3, 77, 3), (2**62 + 5, 4095, 1 << 30, 2)]
    keys += [(s * 0x1F3D5B79 % 2**63, s % 16, s * 31 % 5000, 1 + s % 4) for s in range(200)]
    seed, index, position, purpose = (list(col) for col in zip(*keys, strict=True))
    got = bits(_t(seed), _t(index), _t(position), _t(purpose))
    for i, key in enumerate(keys):
        assert int(got[i]) & M64 == _bits_ref(*key), key
    u = uniform(_t(seed), _t(index), _t(position), _t(purpose))
    for i, key in enumerate(keys):
        assert float(u[i]) == (_bits_ref(*key) >> 11) * 2.0**-53
    assert bool(((u >= 0) & (u < 1)).all())


def test_absorbed_keys_draw_the_streams_numbers() -> None:
    """``Keys`` (seed and index hashed once per batch) gives ``uniform``'s numbers bit for bit: per
    row, over a window of positions per row, with one purpose or one per entry, and after ``take``."""
    g = torch.Generator().manual_seed(3)
    seed = torch.cat([torch.randint(0, 2**62, (30,), generator=g), _t([0, 2**63 - 1])])
    index = torch.randint(0, 16, (32,), generator=g)
    position = torch.randint(0, 2**44, (32,), generator=g)
    keys = Keys.of(seed.numpy(), index.numpy())
    for purpose in Purpose:
        assert torch.equal(torch.from_numpy(keys.uniform(position.numpy(), purpose)), uniform(seed, index, position, purpose))
    purposes = torch.randint(1, 5, (32,), generator=g)
    assert torch.equal(torch.from_numpy(keys.uniform(position.numpy(), purposes.numpy())), uniform(seed, index, position, purposes))
    window = position[:, None] % 1000 + torch.arange(3)
    assert torch.equal(torch.from_numpy(keys.uniform(window.numpy(), Purpose.ACCEPT)), uniform(seed[:, None], index[:, None], window, Purpose.ACCEPT))
    some = torch.tensor([5, 0, 31])
    assert torch.equal(torch.from_numpy(keys.take(some.numpy()).uniform(position[some].numpy(), Purpose.TARGET)),
                       uniform(seed[some], index[some], position[some], Purpose.TARGET))


def test_uniform_is_batch_invariant() -> None:
    """Row 3 of a batch of 8, alone, and after a permutation: the same number, bit for bit."""
    g = torch.Generator().manual_seed(1)
    seed = torch.randint(0, 2**62, (8,), generator=g)
    index = torch.randint(0, 16, (8,), generator=g)
    position = torch.randint(0, 10_000, (8,), generator=g)
    whole = uniform(seed, index, position, Purpose.ACCEPT)
    alone = uniform(seed[3:4], index[3:4], position[3:4], Purpose.ACCEPT)
    perm = torch.tensor([5, 3, 7, 0, 1, 6, 2, 4])
    shuffled = uniform(seed[perm], index[perm], position[perm], Purpose.ACCEPT)
    assert torch.equal(whole[3:4], alone)
    assert torch.equal(shuffled, whole[perm])


def test_purposes_positions_indices_and_seeds_give_different_numbers() -> None:
    seed, index, position = _t([42]), _t([0]), _t([7])
    base = int(bits(seed, index, position, Purpose.TARGET))
    others = [int(bits(seed, index, position, p)) for p in (Purpose.DRAFT, Purpose.ACCEPT, Purpose.RESIDUAL)]
    others += [int(bits(seed, index, _t([8]), Purpose.TARGET)), int(bits(seed, _t([1]), position, Purpose.TARGET))]
    others += [int(bits(_t([43]), index, position, Purpose.TARGET))]
    assert len({base, *others}) == 7
    # 4096 positions x 4 purposes of one key: all 64-bit words distinct (guaranteed: injective in the word)
    pos = torch.arange(4096)
    words = torch.cat([bits(seed, index, pos, p) for p in Purpose])
    assert words.unique().numel() == words.numel()


def test_uniforms_look_uniform() -> None:
    """Kolmogorov-Smirnov distance of 100,000 uniforms (consecutive positions of one seed) from
    U[0, 1), against the DKW bound: P(D > eps) <= 2 exp(-2 n eps^2) = 1e-9 for eps below, so this
    test fails falsely with probability at most 1e-9 if the stream behaves as independent uniforms.
    Also the first-order serial correlation of neighbours, |r| < 6 / sqrt(n) (false failure about 2e-9)."""
    n = 100_000
    u = uniform(_t([2024]), _t([0]), torch.arange(n), Purpose.TARGET).sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    d = float(torch.maximum((grid - u).abs(), (u - (grid - 1 / n)).abs()).max())
    eps = math.sqrt(math.log(2 / 1e-9) / (2 * n))
    assert d < eps, (d, eps)
    v = uniform(_t([2024]), _t([0]), torch.arange(n), Purpose.TARGET) - 0.5
    r = float((v[1:] * v[:-1]).mean() / (v * v).mean())
    assert abs(r) < 6 / math.sqrt(n), r


def test_inverse_cdf_draws_each_token_with_its_probability() -> None:
    """Over a grid of 2**16 evenly spaced uniforms, token t is chosen for a fraction within 2**-16
    (+ rounding) of w_t / sum(w); zero-weight tokens are never chosen, even at u = 1 - 2**-53."""
    w = torch.tensor([[0.0, 0.1, 0.0, 0.25, 0.05, 0.0, 0.6, 0.0]])
    grid = torch.arange(2**16, dtype=torch.float64) / 2**16
    picks = _inverse_cdf(w.expand(grid.numel(), -1), grid)
    freq = torch.bincount(picks, minlength=8).double() / grid.numel()
    assert torch.allclose(freq, w[0].double() / w.sum(), atol=2**-16 + 1e-12)
    near_one = torch.tensor([1 - 2**-53], dtype=torch.float64)
    assert int(_inverse_cdf(w, near_one)) == 6
    # a rounding that reaches past the last positive weight falls back to it
    tiny = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert int(_inverse_cdf(tiny, torch.tensor([0.999999999999], dtype=torch.float64))) == 1



def test_two_level_inverse_cdf_draws_each_token_with_its_probability() -> None:
    """Past ``CDF_BLOCK`` tokens (here 1,000: three blocks of 256 and a padded one) the block, then
    the token within it: over the grid each token's share is within 2**-16 (+ float32 block-sum
    rounding) of its weight's; zero weights (a whole zero block, zeros at block edges, the padding)
    are never chosen, even at u = 1 - 2**-53; the draw agrees with the one-level search on all but
    a rounding sliver of the grid; an all-zero row gives the last token."""
    g = torch.Generator().manual_seed(3)
    w = torch.rand(1, 1000, generator=g) * (torch.rand(1, 1000, generator=g) < 0.3)
    w[0, 256:512] = 0.0  # a zero block
    w[0, 255] = w[0, 512] = 0.0
    w[0, 511] = 0.0
    w[0, 700] = 5.0  # a heavy token
    w[0, 999] = 0.0
    grid = torch.arange(2**16, dtype=torch.float64) / 2**16
    picks = _inverse_cdf(w.expand(grid.numel(), -1), grid)
    freq = torch.bincount(picks, minlength=1000).double() / grid.numel()
    assert torch.allclose(freq, w[0].double() / w.sum(), atol=2**-16 + 1e-6)
    assert bool((w[0, picks] > 0).all())
    last = int(w[0].nonzero().max())
    assert int(_inverse_cdf(w, torch.tensor([1 - 2**-53], dtype=torch.float64))) == last
    c = w.cumsum(dim=-1, dtype=torch.float64)
    one_level = torch.searchsorted(c.expand(grid.numel(), -1).contiguous(), (grid * c[0, -1])[:, None], right=True).squeeze(1)
    assert int((one_level != picks).sum()) <= 4
    assert int(_inverse_cdf(torch.zeros(2, 1000), torch.tensor([0.0, 0.5], dtype=torch.float64))[1]) == 999


def _batch(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.0, top_k=20, seed=12),
        SamplingParams(temperature=1.2, top_p=0.9, seed=13),
        SamplingParams(temperature=0.7, min_p=0.05, seed=14),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.8, min_p=0.01, seed=15),
        SamplingParams(temperature=2.0, seed=16),
        SamplingParams(temperature=1.0, seed=17),
    ]
    return logits, params[:n]


@pytest.mark.parametrize("trial", range(3))
def test_sampled_token_is_batch_invariant(trial: int) -> None:
    """The sampler's token for a row is the same alone, in a batch of 8 and in another order."""
    logits, params = _batch(8, 512, trial)
    position = torch.tensor([3, 9, 0, 41, 5, 5, 17, 2])
    rows = RowParams.of(params, indices=[0, 1, 2, 0, 1, 3, 0, 0])
    whole = sample_rows(distribution(logits, rows), rows, position)
    for i in range(8):
        one = RowParams.of([params[i]], indices=[[0, 1, 2, 0, 1, 3, 0, 0][i]])
        assert int(sample_rows(distribution(logits[i : i + 1], one), one, position[i : i + 1])) == int(whole[i])
    perm = torch.tensor([7, 2, 5, 0, 3, 6, 1, 4])
    prow = RowParams.of([params[int(j)] for j in perm], indices=[[0, 1, 2, 0, 1, 3, 0, 0][int(j)] for j in perm])
    assert torch.equal(sample_rows(distribution(logits[perm], prow), prow, position[perm]), whole[perm])


def test_seeded_rows_reproduce_and_positions_vary() -> None:
    logits, _ = _batch(1, 64, 5)
    rows = RowParams.of([SamplingParams(temperature=1.5, seed=99)] * 64)
    dist = distribution(logits.expand(64, -1), rows)
    a = sample_rows(dist, rows, torch.arange(64))
    assert torch.equal(a, sample_rows(dist, rows, torch.arange(64)))
    assert a.unique().numel() > 10  # 64 draws at temperature 1.5 over 64 tokens are not one token
    assert not torch.equal(a, sample_rows(dist, RowParams.of([SamplingParams(temperature=1.5, seed=100)] * 64), torch.arange(64)))
    assert not torch.equal(a, sample_rows(dist, rows, torch.arange(64), Purpose.DRAFT))


def test_non_finite_rows_sample_the_flag() -> None:
    logits, params = _batch(4, 32, 2)
    logits[1, 5] = float("nan")
    logits[2, :] = -math.inf
    logits[3, 7] = math.inf
    rows = RowParams.of(params[:4])
    tokens = sample_rows(distribution(logits, rows), rows, torch.zeros(4, dtype=torch.int64))
    assert tokens[1:].tolist() == [NON_FINITE] * 3
    assert int(tokens[0]) == int(logits[0].argmax())


def test_torch_hash_equals_the_numpy_hash() -> None:
    """``bits`` and ``uniform`` hash CPU keys in NumPy; the torch hash (every other device) gives
    the same bits, broadcasting included (a column of seeds against a row of positions)."""
    from backend.rng import _bits_torch

    g = torch.Generator().manual_seed(8)
    seed = torch.randint(0, 2**63 - 1, (64, 1), generator=g)
    index = torch.randint(0, 4096, (64, 1), generator=g)
    position = torch.randint(0, 2**44, (1, 5), generator=g)
    for purpose in (*Purpose, torch.randint(1, 5, (64, 5), generator=g)):
        want = _bits_torch(seed, index, position, purpose)
        assert torch.equal(bits(seed, index, position, purpose), want)
        top = (want >> 11) & ((1 << 53) - 1)
        assert torch.equal(uniform(seed, index, position, purpose), top.to(torch.float64) * 2.0**-53)
