"""The sampler applied to a plan's rows: where a backend turns a forward's logits into the tokens of
its result (``ir.results``), with the rows' ``SamplingRows`` (``ir.sampling``).

- ``row_params``: a plan's ``SamplingRows`` as the sampler's per-row tensors (``RowParams``): one
  tensor per column, no loop over rows.
- ``sample_logits``: one token per row of ``[N, V]`` logits: ``backend.sampling.sample`` (the argmax,
  ``NON_FINITE`` for a row whose logits are not finite) when every row is greedy, so a greedy run
  gives the tokens it gave before sampling existed, bit for bit; else ``distribution`` and
  ``sample_rows`` with each row's key (its seed, completion index and the position of the token
  being chosen), so a row's token depends on its logits and its key only, never on the batch.
- ``verify_tokens``: the target's tokens over a verify window ``[N, k + 1, V]``. Greedy rows read the
  argmax at each position (``passes.accept`` then accepts while the proposal equals it). With a
  sampled row, ``rejection_sample`` with a one-hot draft (the draft proposes its argmax): the tokens
  it gives are the accepted proposals, then the replacement or bonus token; the positions after it
  hold the argmax, which ``passes.accept`` never reads (it stops at the first token that differs
  from the proposal, and a replacement never equals the rejected proposal: its residual has no mass
  there). So the result keeps the ``Verified`` form, and the accept pass and the engine treat sampled
  and greedy rows alike.

Bans (``min_tokens``): before any of the above, a row whose token being chosen sits at a position
below its ``ban_until`` has its ``banned`` ids' logits set to ``-inf`` (``_banned``; a verify window
per position), greedy rows too: a greedy row with ``min_tokens`` takes the argmax of the other ids.
Rows without an active ban keep their logits bit for bit, and a plan whose rows are ``None`` or ban
nothing never copies its logits, so a greedy run without ``min_tokens`` is the argmax it was.
Banned ids at or past the vocabulary are ignored (no logit to mask; the model cannot emit them).

Penalties: ``sample_logits`` and ``verify_tokens`` take the rows' token counts as a keyword
(``counts``: ``output_counts`` and ``prompt_mask`` rows of the plan's slots, ``backend.counts``), and
pass them to ``distribution`` when some row has a penalty (``penalised``); a greedy row with a
penalty then takes the argmax of its penalised logits. A verify window's position ``j`` counts the
``j`` proposals before it (``window_counts``). Without ``counts`` the penalties are not applied
(the engine refuses penalised requests unless it keeps counts).

Positions: the key's position is the position in its sequence of the token being chosen (prompt
length plus output position): an extend row's first token is at ``prefix_len + extend_len``, a
decode row's at ``seq_len``, a verify window's token ``j`` at ``seq_len + j``. For one prompt that is
the output position shifted by a constant, the same whatever the chunking, batching, retraction or
speculation: the ``--seed`` reproducibility the sampling module promises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar, final

import attrs
import numpy as np
import torch

from backend.readback import staged
from backend.sampling import HostColumns, OneHotDraft, RowParams, distribution, greedy_or_flag, rejection_sample, sample, sample_rows, window_counts
from backend.staging import to_device
from ir.columns import I64, frozen_i64
from ir.sampling import SamplingRows

__all__ = ["Counts", "penalised", "row_params", "sample_logits", "verify_tokens"]

_K = TypeVar("_K")
_V = TypeVar("_V")

Counts = tuple[torch.Tensor, torch.Tensor]
"""A plan's rows' ``output_counts`` [N, V] and ``prompt_mask`` [N, V] (``backend.counts``)."""


def _i64(col: np.ndarray[Any, Any] | Sequence[int], device: torch.device, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``col`` as an int64 tensor on ``device`` (a NumPy copy shared with torch: ``torch.tensor`` of
    an array costs several times more for a handful of entries), reshaped to ``shape``, and marked
    with its host values (``backend.readback.staged``: the sampler reads them, not the tensor)."""
    host = np.array(col, dtype=np.int64)
    if shape is not None:
        host = host.reshape(shape)
    return staged(to_device(host, device), host)


def row_params(rows: SamplingRows, device: torch.device) -> RowParams:
    """``rows`` as the sampler's per-row tensors on ``device``, with their host columns (nothing is
    read back to learn what the rows ask)."""
    return RowParams.from_host(HostColumns(
        temperature=rows.temperature, top_k=rows.top_k, top_p=rows.top_p, min_p=rows.min_p, presence_penalty=rows.presence_penalty,
        frequency_penalty=rows.frequency_penalty, repetition_penalty=rows.repetition_penalty, seed=rows.seed, index=rows.index,
    ), device)


_CACHE_SIZE = 8


@final
class _Prepared:
    """What the sampler needs of one batch's rows, worked out once: whether every row is greedy,
    whether some row has a penalty or an active ban, and (built on first use) the rows as the
    sampler's tensors (``RowParams``, whose ``uses`` summary is then computed once) and their
    repeats over a verify window."""

    __slots__ = ("_params", "_windows", "bans", "device", "greedy", "penalised", "rows")

    def __init__(self, rows: SamplingRows, device: torch.device) -> None:
        self.rows = rows
        self.device = device
        self.greedy = not rows.temperature.any()
        self.penalised = _any_penalty(rows)
        self.bans = rows.bans_any
        self._params: RowParams | None = None
        self._windows: dict[int, RowParams] = {}

    @property
    def params(self) -> RowParams:
        if self._params is None:
            self._params = row_params(self.rows, self.device)
        return self._params

    def window(self, w: int) -> RowParams:
        """``params.repeat(w)``: the rows at each of a verify window's ``w`` positions."""
        got = self._windows.get(w)
        if got is None:
            got = self._windows[w] = self.params.repeat(w)
        return got


_by_id: dict[tuple[int, torch.device], tuple[SamplingRows, _Prepared]] = {}
_by_value: dict[tuple[torch.device, tuple[bytes, ...]], _Prepared] = {}


def _remember(cache: dict[_K, _V], key: _K, value: _V) -> None:
    if len(cache) >= _CACHE_SIZE:
        del cache[next(iter(cache))]
    cache[key] = value


def _prepared(rows: SamplingRows, device: torch.device) -> _Prepared:
    """The ``_Prepared`` of ``rows``, kept for the few most recent rows: a running batch's rows are
    one object from step to step until a request joins or leaves it, and a prefill's rows, the
    decodes' and the verifies' that follow hold the same values in new objects. Looked up by
    identity first (the entry holds the rows, so the id cannot be reused while it is kept), then by
    value (every column's bytes: the rows are immutable, and equal rows give equal tensors)."""
    key = (id(rows), device)
    hit = _by_id.get(key)
    if hit is not None and hit[0] is rows:
        return hit[1]
    value = (device, tuple(col.tobytes() for col in attrs.astuple(rows, recurse=False)))
    prep = _by_value.get(value)
    if prep is None:
        prep = _Prepared(rows, device)
        _remember(_by_value, value, prep)
    _remember(_by_id, key, (rows, prep))
    return prep


def _params(rows: SamplingRows, device: torch.device) -> RowParams:
    """``row_params`` of ``rows``, built once for equal rows (``_prepared``)."""
    return _prepared(rows, device).params


def _any_penalty(rows: SamplingRows) -> bool:
    return bool((rows.presence_penalty != 0).any() or (rows.frequency_penalty != 0).any() or (rows.repetition_penalty != 1).any())


def penalised(rows: SamplingRows | None) -> bool:
    """Whether some row has a presence, frequency or repetition penalty (it reads the counts)."""
    return rows is not None and _prepared(rows, torch.device("cpu")).penalised


def _banned(logits: torch.Tensor, rows: SamplingRows, positions: np.ndarray[tuple[int, int], np.dtype[np.int64]]) -> torch.Tensor:
    """``logits`` [N, W, V] with each row's banned ids at ``-inf`` at the window positions whose
    ``positions`` [N, W] are below the row's ``ban_until`` (module docstring); ``logits`` itself
    when no ban is active there."""
    n, w, vocab = logits.shape
    lens = rows.banned_lens
    owner = np.repeat(np.arange(n, dtype=np.int64), lens)  # the row of each packed banned id
    ok = rows.banned < vocab
    owner, ids = owner[ok], rows.banned[ok]
    active = positions[owner] < rows.ban_until[owner][:, None]  # [banned ids, W]
    which, slot = np.nonzero(active)
    if which.size == 0:
        return logits
    out = logits.clone()
    device = logits.device
    out[to_device(owner[which], device), to_device(slot, device), to_device(ids[which], device)] = -math.inf
    return out


def sample_logits(logits: torch.Tensor, rows: SamplingRows | None, positions: I64, *, counts: Counts | None = None) -> I64:
    """The token of each row of ``[N, V]`` logits (module docstring); ``positions`` [N]: each row's
    position of the token chosen; ``counts``: the rows' token counts (penalties)."""
    if rows is None:  # every row greedy with no penalty: the argmax alone (no autograd to switch off)
        return sample(logits)
    with torch.inference_mode():  # (no autograd bookkeeping: every torch op costs less)
        return _sample_logits(logits, rows, positions, counts)


def _sample_logits(logits: torch.Tensor, rows: SamplingRows | None, positions: I64, counts: Counts | None) -> I64:
    if rows is None:
        return sample(logits)
    prep = _prepared(rows, logits.device)
    if prep.bans:
        logits = _banned(logits[:, None], rows, np.asarray(positions, dtype=np.int64)[:, None])[:, 0]
    pen = counts is not None and prep.penalised
    if prep.greedy and not pen:
        return sample(logits)
    params = prep.params
    dist = distribution(logits, params, **_counts_of(counts if pen else None))
    tokens = sample_rows(dist, params, _i64(positions, logits.device))
    return frozen_i64(tokens.numpy(force=True))  # (the one readback)


def verify_tokens(logits: torch.Tensor, drafts: I64, rows: SamplingRows | None, start: I64, *, counts: Counts | None = None) -> I64:
    """The target's tokens over a verify window (module docstring), row-major ``N * (k + 1)``:
    ``logits`` [N, k + 1, V], ``drafts`` the ``N * k`` proposals (row-major), ``start`` [N] the
    position of each row's first proposal; ``counts``: the rows' token counts at the window's
    first position (its input ``0`` counted; penalties)."""
    if rows is None:  # (as ``sample_logits``) every position's argmax
        return sample(logits.reshape(-1, logits.shape[-1]))
    with torch.inference_mode():  # (as ``sample_logits``)
        return _verify_tokens(logits, drafts, rows, start, counts)


def _verify_tokens(logits: torch.Tensor, drafts: I64, rows: SamplingRows | None, start: I64, counts: Counts | None) -> I64:
    prep = None if rows is None else _prepared(rows, logits.device)
    if prep is not None and prep.bans:
        logits = _banned(logits, prep.rows, np.asarray(start, dtype=np.int64)[:, None] + np.arange(logits.shape[1], dtype=np.int64))
    pen = counts is not None and prep is not None and prep.penalised
    if prep is None or prep.greedy and not pen:
        return frozen_i64(greedy_or_flag(logits).reshape(-1).cpu().numpy())
    n, w, vocab = logits.shape
    device = logits.device
    params = prep.params
    proposed = _i64(drafts, device, (n, w - 1))
    windowed: Counts | None = None
    if pen:
        assert counts is not None
        windowed = (window_counts(counts[0], proposed), counts[1].repeat_interleave(w, dim=0))
    dist = distribution(logits.reshape(n * w, vocab), prep.window(w), **_counts_of(windowed))
    spec = rejection_sample(dist, proposed, OneHotDraft(), params, _i64(start, device))
    # (``dist.top`` is ``greedy_or_flag`` of the logits, penalised where a row has a penalty: a
    # penalised greedy row's argmax is of its penalised logits)
    after = dist.top.reshape(n, w)
    tokens = torch.where(torch.arange(w, device=device)[None, :] <= spec.accepted[:, None], spec.tokens, after)
    return frozen_i64(tokens.reshape(-1).numpy(force=True))  # (the one readback)


def _counts_of(counts: Counts | None) -> dict[str, torch.Tensor | None]:
    return {"output_counts": counts[0], "prompt_mask": counts[1]} if counts is not None else {}
