"""The sampler: the one place where a token is chosen from logits.

``sample`` is what every backend applies to a forward's logits today (``backend.executor``, and
the model hooks' verify and draft proposal through ``greedy_or_flag``); the engine only reads
tokens (``ir.results``). The sampled path below (``RowParams``, ``distribution``, ``sample_rows``,
``rejection_sample``) is library code the engine is not wired to yet.

Greedy tokens say when the logits behind them were not finite.

A row of logits that holds a NaN or a positive infinity has no meaningful argmax (``torch.argmax``
returns the NaN's or the infinity's index; a row of ``-inf`` gives 0): a token taken from it is
noise that looks like output. ``greedy_or_flag`` takes the argmax of every row and gives
``NON_FINITE`` (``-1``, never a token id) for a row whose largest logit is a NaN or an infinity:
a NaN anywhere in the row is its maximum (``torch.max`` propagates NaN), so is a ``+inf``, and a
row of ``-inf`` has ``-inf`` as its maximum. A row whose maximum is finite keeps its token even if
other entries are ``-inf``: its greedy choice is made by finite values. The check rides on the
reduction the argmax does anyway (``torch.max`` returns the value with the index), so it costs
almost nothing: on a CPU, 64 rows of 131,072 logits take 15.8 ms against argmax's 10.4 ms, where
``torch.isfinite(logits).all(dim=-1)`` alone takes 99 ms. Whoever reads the tokens (the engine; a
verify's caller) ends the requests of flagged rows instead of emitting the flag.

Sampled rows, all rows at once (per-row parameters are tensors; no Python loop over rows):

1. ``distribution``: penalties (repetition, transformers semantics, over prompt and generated
   tokens; then frequency and presence, OpenAI semantics, over generated tokens), temperature,
   top-k, top-p, min-p, in transformers' order (``RepetitionPenaltyLogitsProcessor``,
   ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``,
   each with ``min_tokens_to_keep=1``; top-k keeps every token tied with the k-th; where top-p's
   cut falls inside a tie, the lower ids stay, as greedy's argmax), then softmax.
   Its ``top`` is ``greedy_or_flag`` of the penalised logits: a greedy row (temperature 0) is that
   argmax, bit for bit ``greedy_or_flag(logits)`` when the row has no penalty (the penalty
   arithmetic is skipped for such rows, not merely neutral). A row whose ``top`` is ``NON_FINITE``
   samples ``NON_FINITE`` whatever its temperature.
2. ``sample_rows``: one token per row by inverse CDF (float64 cumulative sums) at one uniform of the
   row's counter-based stream (``backend.rng``): the token is a function of the row's probabilities
   and its key only, so a seeded row gets the same token whatever else is in the batch. A
   zero-probability token is never chosen.
3. ``rejection_sample``: speculative verification with sampling (Leviathan et al.), per row and
   window position at once. The draft's distribution is a ``DraftDistribution``: ``OneHotDraft``
   (argmax proposals: accept ``x`` when ``u < p(x)``; the residual is ``p`` without ``x``) or
   ``FullDraft`` (sampled proposals ``x ~ q``: accept when ``u < p(x) / q(x)``; the residual is
   ``max(0, p - q)``, all of ``q`` subtracted). The emitted tokens are then distributed exactly as
   tokens sampled from ``p`` alone (``tests/backend/test_rejection_sampling.py`` checks it in closed
   form and empirically). Greedy rows accept while the proposal equals ``top`` and emit ``top`` at
   the first mismatch or as the bonus: ``passes.accept`` on the target's greedy tokens, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeAlias, final

import attrs
import numpy as np
import torch

from backend.rng import Purpose, uniform
from ir.columns import I64, frozen_i64
from ir.results import NON_FINITE
from ir.sampling import SamplingParams

__all__ = [
    "NON_FINITE",
    "PAD",
    "Distribution",
    "DraftDistribution",
    "FullDraft",
    "OneHotDraft",
    "RowParams",
    "Speculated",
    "distribution",
    "greedy_or_flag",
    "rejection_sample",
    "sample",
    "sample_rows",
    "window_counts",
]

PAD = -2
"""A ``Speculated.tokens`` entry past the row's emitted tokens (never a token id nor ``NON_FINITE``)."""


def greedy_or_flag(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the vocabulary (last) axis, ties to the lowest id as ``torch.argmax``, and
    ``NON_FINITE`` where the row's maximum is a NaN or an infinity; int64, the shape of ``logits``
    without its last axis."""
    best, index = logits.max(dim=-1)
    return torch.where(torch.isfinite(best), index, NON_FINITE)


def sample(logits: torch.Tensor) -> I64:
    """The token of each row of ``[rows, vocab]`` logits (``greedy_or_flag``), as an IR column."""
    return frozen_i64(greedy_or_flag(logits).cpu().numpy().astype(np.int64, copy=False))


@final
@attrs.frozen(kw_only=True)
class RowParams:
    """The sampling parameters of a batch's rows, one tensor entry per row (the columns the sampler
    reads; ``of`` builds them from ``SamplingParams``). ``top_p`` is float64 so that ``1 - top_p``
    rounds as transformers' Python float does; ``top_k <= 0`` is off. ``seed`` and ``index`` (the
    completion index) key the row's random stream; a greedy row's are never read."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    repetition_penalty: torch.Tensor
    seed: torch.Tensor
    index: torch.Tensor

    @classmethod
    def of(cls, params: Sequence[SamplingParams], indices: Sequence[int] | None = None, device: torch.device | str = "cpu") -> RowParams:
        """The rows of ``params`` (completion ``indices``, default 0). A sampled row must carry its
        seed (``SamplingParams.seeded``): ``ValueError`` naming the row otherwise."""
        for i, p in enumerate(params):
            if p.seed is None and not p.greedy:
                raise ValueError(f"row {i}: a sampled row needs a seed (SamplingParams.seeded), got seed=None")

        def col(values: Sequence[float | int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(list(values), dtype=dtype, device=device)

        f32 = torch.float32
        return cls(
            temperature=col([p.temperature for p in params], f32),
            top_k=col([p.top_k for p in params], torch.int64),
            top_p=col([p.top_p for p in params], torch.float64),
            min_p=col([p.min_p for p in params], f32),
            presence_penalty=col([p.presence_penalty for p in params], f32),
            frequency_penalty=col([p.frequency_penalty for p in params], f32),
            repetition_penalty=col([p.repetition_penalty for p in params], f32),
            seed=col([p.seed or 0 for p in params], torch.int64),
            index=col(indices if indices is not None else [0] * len(params), torch.int64),
        )

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0

    def repeat(self, times: int) -> RowParams:
        """Each row ``times`` times in a row (the ``k + 1`` window positions of a verify)."""
        return RowParams(**{name: value.repeat_interleave(times) for name, value in attrs.asdict(self, recurse=False).items()})


@final
@attrs.frozen(kw_only=True)
class Distribution:
    """What ``distribution`` gives: ``probs`` [N, V] float32 (a sampled row's final distribution;
    a greedy row's one-hot at ``top``; zeros where ``top`` is ``NON_FINITE``), ``top`` [N] int64
    (``greedy_or_flag`` of the penalised logits) and ``greedy`` [N] bool."""

    probs: torch.Tensor
    top: torch.Tensor
    greedy: torch.Tensor


def _penalised(logits: torch.Tensor, rows: RowParams, output_counts: torch.Tensor | None, prompt_mask: torch.Tensor | None) -> torch.Tensor:
    rep = rows.repetition_penalty
    freq, pres = rows.frequency_penalty, rows.presence_penalty
    on = (rep != 1) | (freq != 0) | (pres != 0)
    if output_counts is None and prompt_mask is None or not bool(on.any()):
        return logits
    x = logits.float()
    seen_out = output_counts > 0 if output_counts is not None else torch.zeros_like(x, dtype=torch.bool)
    seen = seen_out | prompt_mask if prompt_mask is not None else seen_out
    r = rep[:, None]
    x = torch.where(seen, torch.where(x < 0, x * r, x / r), x)
    if output_counts is not None:
        x = x - output_counts.to(x.dtype) * freq[:, None] - seen_out.to(x.dtype) * pres[:, None]
    # rows without a penalty keep their logits bit for bit (float32 holds every float16 and bfloat16
    # value exactly, so their argmax stays greedy_or_flag's)
    return torch.where(on[:, None], x, logits.float())


def distribution(
    logits: torch.Tensor, rows: RowParams, *, output_counts: torch.Tensor | None = None, prompt_mask: torch.Tensor | None = None
) -> Distribution:
    """The final distribution of each row of ``[N, V]`` logits (module docstring, step 1).

    ``output_counts`` [N, V]: how often each token was generated so far (frequency, presence and
    repetition penalties); ``prompt_mask`` [N, V] bool: the prompt's tokens (repetition penalty
    only). Either may be ``None`` (no such tokens)."""
    n, vocab = logits.shape
    pen = _penalised(logits, rows, output_counts, prompt_mask)
    best, top = pen.max(dim=-1)
    finite = torch.isfinite(best)
    top = torch.where(finite, top, NON_FINITE)
    greedy = rows.greedy
    rows_idx = torch.arange(n, device=logits.device)
    onehot = torch.zeros((n, vocab), dtype=torch.float32, device=logits.device)
    onehot[rows_idx[finite], top[finite]] = 1.0
    if bool(greedy.all()):
        return Distribution(probs=onehot, top=top, greedy=greedy)
    temperature = torch.where(greedy, 1.0, rows.temperature)
    # shifting by the maximum first changes no filter (each is invariant under a shift) and keeps
    # a small temperature from overflowing to inf
    z = (pen.float() - best.float()[:, None]) / temperature[:, None]
    z = torch.where(finite[:, None], z, 0.0)
    use_k = (rows.top_k > 0) & (rows.top_k < vocab)
    use_p = rows.top_p < 1.0
    sampled = ~greedy
    if bool(((use_k | use_p) & sampled).any()):
        # a stable descending sort, read backwards: ascending, with equal logits in decreasing id
        # order, so top-p drops the higher ids of a tie first and a tiny top_p keeps exactly the
        # greedy token (transformers' unstable sort leaves that order unspecified)
        desc, order = z.sort(dim=-1, descending=True, stable=True)
        asc, order = desc.flip(-1), order.flip(-1)
        keep = torch.where(use_k, rows.top_k, vocab)
        # transformers' top-k: remove what is below the k-th largest (ties with it stay)
        kth = asc.gather(1, (vocab - keep)[:, None])
        removed = asc < kth
        asc = asc.masked_fill(removed, -math.inf)
        # transformers' top-p: remove the ascending prefix whose cumulative probability is at most
        # 1 - top_p, never the largest
        tail = asc.softmax(dim=-1).cumsum(dim=-1)
        cut = tail <= (1.0 - rows.top_p).to(torch.float32)[:, None]
        cut[:, -1] = False
        removed |= cut & use_p[:, None]
        z = z.masked_fill(removed.scatter(1, order, removed), -math.inf)
    # min-p (after top-p; the maximum, 0 after the shift, always survives both): a token's
    # probability over the maximum's is exp(z), so "p < min_p * p_max" is "z < log(min_p)"
    min_p = rows.min_p
    if bool(((min_p > 0) & sampled).any()):
        z = z.masked_fill(z < torch.log(min_p)[:, None], -math.inf)
    probs = z.softmax(dim=-1)
    probs = torch.where((greedy | ~finite)[:, None], onehot, probs)
    return Distribution(probs=probs, top=top, greedy=greedy)


def window_counts(output_counts: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The generated-token counts at each of the ``k + 1`` positions of a verify window, row-major
    ``[N * (k + 1), V]``: position ``j`` has also generated the proposals before it (it is the
    target's distribution given that they were accepted)."""
    n, k = drafts.shape
    vocab = output_counts.shape[1]
    added = torch.zeros((n, k + 1, vocab), dtype=output_counts.dtype, device=output_counts.device)
    added[:, 1:].scatter_add_(2, drafts[:, :, None], torch.ones_like(drafts[:, :, None], dtype=output_counts.dtype))
    return (output_counts[:, None, :] + added.cumsum(dim=1)).reshape(n * (k + 1), vocab)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token ``t`` of each row with ``c[t - 1] <= u * c[-1] < c[t]`` for ``c`` the row's
    cumulative weights (float64): ``t`` is drawn with probability ``weights[t] / sum`` when ``u``
    is uniform in [0, 1), and a zero-weight token is never drawn (a rounding that would reach past
    the last positive weight takes that weight's token)."""
    vocab = weights.shape[-1]
    c = weights.to(torch.float64).cumsum(dim=-1)
    t = (u * c[:, -1])[:, None]
    idx = torch.searchsorted(c, t, right=True).squeeze(1).clamp(max=vocab - 1)
    zero = weights.gather(1, idx[:, None]).squeeze(1) <= 0
    if bool(zero.any()):
        ids = torch.arange(vocab, device=weights.device)
        last = torch.where(weights > 0, ids, 0).amax(dim=-1)
        idx = torch.where(zero, last, idx)
    return idx


def sample_rows(dist: Distribution, rows: RowParams, position: torch.Tensor, purpose: Purpose = Purpose.TARGET) -> torch.Tensor:
    """One token per row of ``dist`` (int64 [N]): ``top`` for greedy rows and ``NON_FINITE`` rows;
    a sampled row's token is drawn from ``probs`` with the uniform of its key (``rows.seed``,
    ``rows.index``, ``position`` [N], ``purpose``)."""
    if bool(dist.greedy.all()):
        return dist.top
    u = uniform(rows.seed, rows.index, position, purpose)
    drawn = _inverse_cdf(dist.probs, u)
    return torch.where(dist.greedy | (dist.top == NON_FINITE), dist.top, drawn)


@final
@attrs.frozen
class OneHotDraft:
    """The draft proposed its argmax (q is one-hot at each proposal): vLLM's EAGLE/MTP drafts."""


@final
@attrs.frozen
class FullDraft:
    """The draft sampled each proposal from ``q`` [N, k, V] (its probabilities after the request's
    transforms), with noise other than the acceptance test's (``Purpose.DRAFT``)."""

    q: torch.Tensor


DraftDistribution: TypeAlias = OneHotDraft | FullDraft
"""How the proposals were drawn: it fixes the acceptance rule and the residual."""


def acceptance(p_x: torch.Tensor, drafts: torch.Tensor, draft: DraftDistribution) -> torch.Tensor:
    """The probability (float64, [N, k]) of accepting each proposal given the target's ``p(x)``
    ``p_x`` [N, k]: ``p(x)`` for a one-hot draft, ``min(1, p(x) / q(x))`` for a full one (0 where
    ``q(x) = 0``: a proposal the draft could not have made is never accepted)."""
    p = p_x.to(torch.float64)
    match draft:
        case OneHotDraft():
            return p.clamp(max=1.0)
        case FullDraft(q=q):
            q_x = q.gather(2, drafts[:, :, None]).squeeze(2).to(torch.float64)
            return torch.where(q_x > 0, (p / torch.where(q_x > 0, q_x, 1.0)).clamp(max=1.0), 0.0)


def residual(p_m: torch.Tensor, drafts: torch.Tensor, draft: DraftDistribution, m: torch.Tensor) -> torch.Tensor:
    """The unnormalised distribution (float32 [N, V]) a row draws from when its proposal at window
    position ``m`` [N] (``m < k``) is rejected, given the target's ``p_m`` [N, V] there: ``p`` with
    the proposal's mass removed for a one-hot draft, ``max(0, p - q)`` for a full one (every
    token's ``q`` subtracted, not only the proposal's). Where it is all zero (only by rounding:
    rejection means ``p(x) < q(x)``, so ``p > q`` somewhere) it is ``p_m`` itself."""
    n = p_m.shape[0]
    rows_idx = torch.arange(n, device=p_m.device)
    match draft:
        case OneHotDraft():
            r = p_m.scatter(1, drafts[rows_idx, m][:, None], 0.0)
        case FullDraft(q=q):
            r = (p_m - q[rows_idx, m]).clamp(min=0.0)
    return torch.where((r.sum(dim=-1) > 0)[:, None], r, p_m)


@final
@attrs.frozen(kw_only=True)
class Speculated:
    """What ``rejection_sample`` gives: ``accepted`` [N] (proposals accepted, 0 to k) and ``tokens``
    [N, k + 1]: the accepted proposals, then the replacement (first rejection) or bonus token (or
    ``NON_FINITE``), then ``PAD``."""

    accepted: torch.Tensor
    tokens: torch.Tensor


def rejection_sample(target: Distribution, drafts: torch.Tensor, draft: DraftDistribution, rows: RowParams, start: torch.Tensor) -> Speculated:
    """Verify ``drafts`` [N, k] against the target's window distributions ``target`` (``N * (k + 1)``
    rows, row-major: position ``j`` is the distribution after the row's first ``j`` proposals,
    ``distribution`` with ``rows.repeat(k + 1)`` and ``window_counts``); ``rows`` are the ``N``
    rows' parameters and ``start`` [N] the output position of each row's first proposal.

    Position ``j``'s test reads the uniform keyed (``start + j``, ``ACCEPT``); the token drawn at
    the first rejection ``m`` reads (``start + m``, ``RESIDUAL``); the bonus (all ``k`` accepted)
    reads (``start + k``, ``TARGET``), the key plain decoding would use there. A position whose
    target logits were not finite rejects, and the row emits ``NON_FINITE`` there."""
    n, k = drafts.shape
    vocab = target.probs.shape[-1]
    p = target.probs.reshape(n, k + 1, vocab)
    top = target.top.reshape(n, k + 1)
    greedy = rows.greedy
    device = drafts.device
    rows_idx = torch.arange(n, device=device)
    if k:
        p_x = p[:, :k].gather(2, drafts[:, :, None]).squeeze(2)
        steps = torch.arange(k, device=device)
        u = uniform(rows.seed[:, None], rows.index[:, None], start[:, None] + steps, Purpose.ACCEPT)
        ok = (u < acceptance(p_x, drafts, draft)) & (top[:, :k] != NON_FINITE)
        ok = torch.where(greedy[:, None], drafts == top[:, :k], ok)
        m = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        m = torch.zeros(n, dtype=torch.int64, device=device)
    p_m = p[rows_idx, m]
    rejected = m < k
    weights = torch.where(rejected[:, None], residual(p_m, drafts, draft, m.clamp(max=k - 1)), p_m) if k else p_m
    purpose = torch.where(rejected, int(Purpose.RESIDUAL), int(Purpose.TARGET))
    top_m = top[rows_idx, m]
    if bool(greedy.all()):
        final = top_m
    else:
        drawn = _inverse_cdf(weights, uniform(rows.seed, rows.index, start + m, purpose))
        final = torch.where(greedy | (top_m == NON_FINITE), top_m, drawn)
    slots = torch.arange(k + 1, device=device)[None, :]
    padded = torch.cat([drafts, torch.full((n, 1), PAD, dtype=torch.int64, device=device)], dim=1)
    tokens = torch.where(slots < m[:, None], padded, PAD)
    tokens = torch.where(slots == m[:, None], final[:, None], tokens)
    return Speculated(accepted=m, tokens=tokens)
