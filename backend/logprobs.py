"""Log-probabilities of emitted tokens and their top alternatives (``token_logprobs``).

What the outputs' ``logprobs`` report, for all rows of a forward at once:

- the distribution is the target's **before any sampling transform**: ``log_softmax`` of the raw
  logits, with no temperature, penalty, top-k, top-p or min-p (vLLM's default). A sampled token
  that a transform made likelier still reports its raw log-probability;
- per row, the emitted token's log-probability and the ``n`` most likely tokens, sorted by
  log-probability descending, equal values by lower id (the order ``greedy_or_flag`` breaks ties
  in, so a greedy row's token is its first alternative). ``n`` is 0 to ``MAX_LOGPROBS``, one for
  all rows or one per row: every row is computed to the largest ``n`` and a row asking fewer
  reads a prefix (the entries past it are ``PAD`` ids with NaN log-probabilities);
- a row whose logits are not finite (``greedy_or_flag`` flags it: a NaN or infinite maximum, or a
  row of ``-inf``), or whose token is ``NON_FINITE``, has no distribution: its token's
  log-probability is NaN and its alternatives are ``NON_FINITE`` ids with NaN log-probabilities.
  Its request ends instead of emitting (``compiler.engine.nonfinite``); nothing reads them.

The top alternatives are a ``topk`` of int64 keys, not of the floats: ``log_softmax <= 0``
(``x - logsumexp >= x - max``, never positive), so a value's magnitude bits grow as it falls and
``(|bits| << 32) | id`` orders by log-probability descending then id ascending, one total order
whatever ``topk``'s tie handling (``-0.0`` equals ``0.0`` as in float comparison).
"""

from __future__ import annotations

from typing import Any, final

import attrs
import numpy as np
import torch

from backend.readback import host_values, staged
from backend.staging import to_device
from ir.columns import I64
from ir.results import NON_FINITE, Logprobs
from ir.sampling import MAX_LOGPROBS, SamplingRows

__all__ = ["PAD", "LogprobRows", "logprobs_of", "token_logprobs"]

PAD = -2
"""A ``top_ids`` entry past the row's own ``n`` (never a token id nor ``NON_FINITE``)."""


@final
@attrs.frozen(kw_only=True, eq=False)
class LogprobRows:
    """``token_logprobs``'s result for ``N`` rows: ``token`` [N] int64 (the emitted tokens),
    ``logprob`` [N] float32 (theirs), ``top_ids`` [N, n_max] int64 and ``top_logprobs`` [N, n_max]
    float32 (the alternatives, best first), ``n`` [N] int64 (how many each row asked for)."""

    token: torch.Tensor
    logprob: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    n: torch.Tensor

    def entries(self) -> list[dict[str, Any]]:
        """One output entry per row, ``{"id", "logprob", "top": [{"id", "logprob"}, ...]}`` with
        the row's own ``n`` alternatives (the ``--outputs`` format)."""
        tokens, lps = self.token.tolist(), self.logprob.tolist()
        ids, tops, ns = self.top_ids.tolist(), self.top_logprobs.tolist(), self.n.tolist()
        return [
            {"id": t, "logprob": lp, "top": [{"id": i, "logprob": v} for i, v in zip(row_ids[:k], row_lps[:k], strict=True)]}
            for t, lp, row_ids, row_lps, k in zip(tokens, lps, ids, tops, ns, strict=True)
        ]


def _descending_keys(lp: torch.Tensor) -> torch.Tensor:
    """int64 keys whose ascending order is ``lp`` descending, ties by increasing id (``lp <= 0``)."""
    mag = lp.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    return (mag << 32) | torch.arange(lp.shape[-1], device=lp.device)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int | torch.Tensor) -> LogprobRows:
    """The log-probabilities of ``tokens`` [N] under ``log_softmax(logits)`` ([N, V], raw logits)
    and each row's top ``n`` alternatives (module docstring). ``n`` is an int or an [N] tensor,
    each in [0, ``MAX_LOGPROBS``] and at most V; ``tokens`` are ids in [0, V) or ``NON_FINITE``.
    ``ValueError`` naming the bad value otherwise. The checks read ``n`` and ``tokens`` on the host:
    their staged host values where marked (``backend.readback.staged``), else read back."""
    rows, vocab = logits.shape
    per_row = n if isinstance(n, torch.Tensor) else torch.full((rows,), n, dtype=torch.int64)
    if per_row.shape != (rows,):
        raise ValueError(f"n: one value per row ({rows}) or one int, got shape {tuple(per_row.shape)}")
    n_host = np.full(rows, n, dtype=np.int64) if not isinstance(n, torch.Tensor) else host_values(per_row)
    per_row = per_row.to(device=logits.device, dtype=torch.int64)
    k = int(n_host.max()) if rows else 0
    low = int(n_host.min()) if rows else 0
    if low < 0 or k > MAX_LOGPROBS:
        raise ValueError(f"n must be in [0, {MAX_LOGPROBS}], got {low if low < 0 else k}")
    if k > vocab:
        raise ValueError(f"n must be at most the vocabulary ({vocab}), got {k}")
    t_host = host_values(tokens)
    bad = ((t_host < 0) & (t_host != NON_FINITE)) | (t_host >= vocab)
    if bad.any():
        raise ValueError(f"tokens must be ids in [0, {vocab}) or NON_FINITE, got {int(t_host[bad][0])}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    best = logits.max(dim=-1).values
    flagged = ~torch.isfinite(best) | (tokens == NON_FINITE)
    nan = torch.tensor(float("nan"), device=logits.device)
    logprob = torch.where(flagged, nan, lp.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1))
    if k:
        keys = torch.topk(_descending_keys(torch.where(flagged[:, None], 0.0, lp)), k, dim=-1, largest=False, sorted=True).values
        top_ids = keys & 0xFFFFFFFF
        top_lps = lp.gather(1, top_ids)
    else:
        top_ids = torch.zeros((rows, 0), dtype=torch.int64, device=logits.device)
        top_lps = torch.zeros((rows, 0), dtype=torch.float32, device=logits.device)
    past = torch.arange(k, device=logits.device)[None, :] >= per_row[:, None]
    top_ids = torch.where(flagged[:, None], NON_FINITE, torch.where(past, PAD, top_ids))
    top_lps = torch.where(flagged[:, None] | past, nan, top_lps)
    return LogprobRows(token=tokens, logprob=logprob, top_ids=top_ids, top_logprobs=top_lps, n=per_row)


def logprobs_of(logits: torch.Tensor, tokens: I64, rows: SamplingRows | None, per_row: int = 1) -> Logprobs | None:
    """The ``Logprobs`` of a result's ``tokens`` (one per row of ``[N, V]`` ``logits``), or ``None``
    when no row asks (``rows`` ``None``, or every ``rows.logprobs`` -1). ``per_row``: the entries of
    each of ``rows``' rows (``k + 1`` for a verify window, whose logits are row-major). A row that
    asks for none gets a NaN log-probability and no alternatives."""
    if rows is None or not (rows.logprobs >= 0).any():
        return None
    device = logits.device
    asked = np.repeat(np.asarray(rows.logprobs, dtype=np.int64), per_row)
    lens = asked.clip(min=0)
    ids = np.array(tokens, dtype=np.int64)
    out = token_logprobs(logits, staged(to_device(ids, device), ids), staged(to_device(lens, device), lens))
    # one readback: the log-probabilities and the alternatives' ids and log-probabilities in one
    # float64 tensor (ids and the PAD and NON_FINITE flags are exact in float64)
    n, k = out.top_ids.shape
    packed = torch.cat((out.logprob.double(), out.top_ids.double().reshape(-1), out.top_logprobs.double().reshape(-1))).numpy(force=True)
    keep = np.arange(k)[None, :] < lens[:, None]
    return Logprobs(
        logprob=np.where(asked < 0, np.nan, packed[:n]),
        top_lens=lens,
        top_ids=packed[n : n + n * k].reshape(n, k)[keep].astype(np.int64),
        top_logprobs=packed[n + n * k :].reshape(n, k)[keep],
    )
