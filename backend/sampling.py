"""The sampler: the one place where a token is chosen from logits.

``sample`` is the greedy path: what a backend applies to a forward's logits when every row is
greedy (``backend.plan_sampling``, ``backend.executor``); the engine only reads tokens
(``ir.results``). The sampled path below (``RowParams``, ``distribution``, ``sample_rows``,
``rejection_sample``) is what ``backend.plan_sampling`` applies to a plan whose rows sample.

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
``torch.isfinite(logits).all(dim=-1)`` alone takes 99 ms. On a CPU tensor of float32 or float64 the
same reduction runs in numpy (``np.argmax`` and the value at its index: the same tokens, a fraction of
torch's per-op cost at a decode step's few rows). Whoever reads the tokens (the engine; a
verify's caller) ends the requests of flagged rows instead of emitting the flag.

Sampled rows, all rows at once (per-row parameters are tensors; no Python loop over rows):

1. ``distribution``: penalties (repetition, transformers semantics, over prompt and generated
   tokens; then frequency and presence, OpenAI semantics, over generated tokens), temperature,
   top-k, top-p, min-p, in transformers' order (``RepetitionPenaltyLogitsProcessor``,
   ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``,
   each with ``min_tokens_to_keep=1``; top-k keeps every token tied with the k-th; where top-p's
   cut falls inside a tie, the lower ids stay, as greedy's argmax), then softmax. Nothing sorts a
   whole large row unless it must: top-k is a threshold read from ``torch.topk``, top-p first
   tries the row's largest values as candidates and sorts the row only where they cannot decide
   (``_top_k_top_p``); both ways give the same bits (``FULL_SORT`` forces the sort; tested at
   131,072 tokens). Penalties touch only the seen tokens' entries.
   Its ``top`` is ``greedy_or_flag`` of the penalised logits: a greedy row (temperature 0) is that
   argmax, bit for bit ``greedy_or_flag(logits)`` when the row has no penalty (the penalty
   arithmetic is skipped for such rows, not merely neutral). A row whose ``top`` is ``NON_FINITE``
   samples ``NON_FINITE`` whatever its temperature.
2. ``sample_rows``: one token per row by inverse CDF (float64 cumulative sums; past ``CDF_BLOCK``
   tokens in two levels, block then token, ``_inverse_cdf``) at one uniform of the
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

import functools
import math
from collections.abc import Sequence
from typing import TypeAlias, final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from backend.readback import cpu_branch, host_values
from backend.rng import Keys, Purpose, uniform
from backend.staging import to_device
from ir.columns import I64, frozen_i64
from ir.results import NON_FINITE
from ir.sampling import SamplingParams

__all__ = [
    "NON_FINITE",
    "PAD",
    "Distribution",
    "DraftDistribution",
    "FullDraft",
    "HostColumns",
    "OneHotDraft",
    "RowParams",
    "Speculated",
    "Uses",
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
    host = _on_host(logits)
    if host is not None:
        return torch.from_numpy(_greedy_or_flag_host(host))
    best, index = logits.max(dim=-1)
    return torch.where(torch.isfinite(best), index, NON_FINITE)


_HOST_FLOATS = (torch.float32, torch.float64)


def _on_host(logits: torch.Tensor) -> np.ndarray | None:
    """``logits`` as a numpy array (no copy) when ``greedy_or_flag`` can run in numpy: a CPU tensor
    of float32 or float64 without autograd, with a vocabulary. numpy's per-call cost is a fraction of
    torch's three dispatched ops at a decode step's few rows; else ``None`` (torch)."""
    if logits.device.type != "cpu" or logits.dtype not in _HOST_FLOATS or logits.requires_grad or not logits.dim() or not logits.shape[-1]:
        return None
    return logits.numpy()


def _greedy_or_flag_host(x: np.ndarray) -> npt.NDArray[np.int64]:
    """``greedy_or_flag`` in numpy, the same tokens bit for bit: ``argmax`` gives the first
    maximum's index (ties to the lowest id) and treats a NaN as the maximum, as ``torch.max``
    does, so the value at that index is the row's maximum, NaN or infinity included."""
    index = np.asarray(x.argmax(axis=-1), dtype=np.int64)  # (a 0-d array for one row of logits)
    finite = np.isfinite(x.max(axis=-1))  # (the maximum is the value at ``index``: NaN if any, as there)
    if finite.all():
        return index
    return np.where(finite, index, NON_FINITE).astype(np.int64, copy=False)


def sample(logits: torch.Tensor) -> I64:
    """The token of each row of ``[rows, vocab]`` logits (``greedy_or_flag``), as an IR column."""
    host = _on_host(logits)
    if host is not None:
        return frozen_i64(_greedy_or_flag_host(host))
    return frozen_i64(greedy_or_flag(logits).numpy(force=True).astype(np.int64, copy=False))  # (one readback)


@final
@attrs.frozen(kw_only=True, eq=False)
class Uses:
    """What a batch's rows ask of the sampler, read once on the host (``RowParams.uses``):
    ``distribution`` skips every transform no sampled row uses. Skipping is exact, not merely
    close: a transform a row does not use leaves its values bit for bit (a mask with nothing set),
    so a row's result does not depend on whether another row of its batch made the sampler run
    that transform. The arrays are the sampled rows' parameters (NumPy: per-row arithmetic on a
    few values costs a microsecond there, several as torch operations)."""

    all_greedy: bool
    any_greedy: bool
    top_k: bool
    """Some sampled row has ``top_k > 0`` (one at or above the vocabulary keeps every token)."""
    top_p: bool
    min_p: bool
    penalty: bool
    """Some row (greedy ones included) has a repetition, frequency or presence penalty."""
    sampled: np.ndarray
    """The sampled rows' indices (int64)."""
    temperature: np.ndarray
    top_k_of: np.ndarray
    top_p_of: np.ndarray
    min_p_of: np.ndarray
    seed: np.ndarray
    index: np.ndarray
    top_p_rows: np.ndarray
    """The indices (among the sampled rows) of the rows with ``top_p < 1``."""
    top_p_limit: np.ndarray
    """Their top-p limits, ``1 - float32(1 - top_p)`` (float64 [R, 1], ``_top_k_top_p``)."""
    unit_temperature: bool
    """Every sampled row's temperature is 1 (dividing by it would change no bit: it is skipped)."""
    keys: Keys
    """The sampled rows' random streams with their seeds and indices absorbed (``backend.rng``)."""


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
    host: HostColumns | None = attrs.field(default=None, eq=False)
    """The same columns on the host (NumPy, the tensors' dtypes and values), when they were built
    from host values: ``uses`` and ``keys`` read them instead of reading the tensors back (a host
    synchronisation each on a device). ``None``: read back where needed."""

    @classmethod
    def of(cls, params: Sequence[SamplingParams], indices: Sequence[int] | None = None, device: torch.device | str = "cpu") -> RowParams:
        """The rows of ``params`` (completion ``indices``, default 0). A sampled row must carry its
        seed (``SamplingParams.seeded``): ``ValueError`` naming the row otherwise."""
        for i, p in enumerate(params):
            if p.seed is None and not p.greedy:
                raise ValueError(f"row {i}: a sampled row needs a seed (SamplingParams.seeded), got seed=None")

        return cls.from_host(HostColumns(
            temperature=[p.temperature for p in params], top_k=[p.top_k for p in params], top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params], presence_penalty=[p.presence_penalty for p in params],
            frequency_penalty=[p.frequency_penalty for p in params], repetition_penalty=[p.repetition_penalty for p in params],
            seed=[p.seed or 0 for p in params], index=list(indices) if indices is not None else [0] * len(params),
        ), torch.device(device))

    @classmethod
    def from_host(cls, host: HostColumns, device: torch.device) -> RowParams:
        """The rows of ``host`` as tensors on ``device`` (one copy each, asynchronous on a CUDA
        device), keeping ``host`` so that nothing is read back."""
        cols = {name: to_device(value, device) for name, value in attrs.asdict(host, recurse=False).items()}
        return cls(**cols, host=host)

    def _on_host(self, name: str) -> np.ndarray:
        """Column ``name`` on the host: ``host``'s, else read back from the tensor."""
        if self.host is not None:
            values: np.ndarray = attrs.asdict(self.host, recurse=False)[name]
            return values
        return np.asarray(self._columns()[name].numpy(force=True))

    def _columns(self) -> dict[str, torch.Tensor]:
        """The column tensors by name (``_COLUMNS``), without ``host``."""
        fields = attrs.asdict(self, recurse=False)
        return {name: fields[name] for name in _COLUMNS}

    @functools.cached_property
    def greedy(self) -> torch.Tensor:
        """Per row, whether it is greedy (temperature 0): a bool tensor."""
        return self.temperature == 0

    @functools.cached_property
    def keys(self) -> Keys:
        """Every row's random stream, its seed and index absorbed (``backend.rng.Keys``; a greedy
        row's is never read)."""
        return Keys.of(self._on_host("seed"), self._on_host("index"))

    @functools.cached_property
    def uses(self) -> Uses:
        """Which transforms some row uses, and the sampled rows' parameters on the host."""
        t = self._on_host("temperature")
        sampled = np.flatnonzero(t != 0)
        k, p, m = (self._on_host(name)[sampled] for name in ("top_k", "top_p", "min_p"))
        penalty = (self._on_host("repetition_penalty") != 1) | (self._on_host("frequency_penalty") != 0) | (self._on_host("presence_penalty") != 0)
        temperature, seed, index = t[sampled], self._on_host("seed")[sampled], self._on_host("index")[sampled]
        prows = np.flatnonzero(p < 1.0)
        return Uses(
            all_greedy=sampled.size == 0, any_greedy=sampled.size < t.size, top_k=bool((k > 0).any()), top_p=bool((p < 1.0).any()),
            min_p=bool((m > 0).any()), penalty=bool(penalty.any()), sampled=sampled, temperature=temperature, top_k_of=k, top_p_of=p,
            min_p_of=m, seed=seed, index=index, top_p_rows=prows,
            top_p_limit=1.0 - (1.0 - p[prows, None]).astype(np.float32).astype(np.float64), unit_temperature=bool((temperature == 1).all()), keys=self.keys.take(sampled) if sampled.size < t.size else self.keys,
        )

    def repeat(self, times: int) -> RowParams:
        """Each row ``times`` times in a row (the ``k + 1`` window positions of a verify)."""
        cols = {name: t.repeat_interleave(times) for name, t in self._columns().items()}
        return RowParams(**cols, host=None if self.host is None else self.host.repeat(times))


_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "index")


# (each converts to a fresh array: a tensor on the CPU shares it, and the IR's columns are read only)
def _f32(values: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def _f64(values: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def _i64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@final
@attrs.frozen(kw_only=True, eq=False)
class HostColumns:
    """``RowParams``' columns on the host, in its tensors' dtypes: float32 but float64 ``top_p``,
    int64 ``top_k``, ``seed`` and ``index`` (each converted to a fresh array)."""

    temperature: np.ndarray = attrs.field(converter=_f32)
    top_k: np.ndarray = attrs.field(converter=_i64)
    top_p: np.ndarray = attrs.field(converter=_f64)
    min_p: np.ndarray = attrs.field(converter=_f32)
    presence_penalty: np.ndarray = attrs.field(converter=_f32)
    frequency_penalty: np.ndarray = attrs.field(converter=_f32)
    repetition_penalty: np.ndarray = attrs.field(converter=_f32)
    seed: np.ndarray = attrs.field(converter=_i64)
    index: np.ndarray = attrs.field(converter=_i64)

    def repeat(self, times: int) -> HostColumns:
        """Each row ``times`` times in a row (``RowParams.repeat``)."""
        return HostColumns(**{name: np.repeat(value, times) for name, value in attrs.asdict(self, recurse=False).items()})


@final
class Distribution:
    """What ``distribution`` gives: ``probs`` [N, V] float32 (a sampled row's final distribution;
    a greedy row's one-hot at ``top``; zeros where ``top`` is ``NON_FINITE``), ``top`` [N] int64
    (``greedy_or_flag`` of the penalised logits) and ``greedy`` [N] bool.

    ``distribution`` keeps the sampled rows' probabilities apart (``sampled``: their row indices,
    ``None`` for every row; ``sampled_probs``: theirs, zeros where ``top`` is ``NON_FINITE``) and
    builds the dense ``probs`` only when it is read: a greedy batch is an argmax and never a
    [N, V] tensor, and ``sample_rows`` draws from the sampled rows alone. Built from ``probs``
    (``Distribution(probs=..., top=..., greedy=...)``), the rows where ``greedy`` is false are the
    sampled ones."""

    __slots__ = ("_probs", "all_finite", "all_greedy", "greedy", "sampled", "sampled_probs", "top", "vocab")

    def __init__(
        self, *, top: torch.Tensor, greedy: torch.Tensor, probs: torch.Tensor | None = None,
        sampled: torch.Tensor | None = None, sampled_probs: torch.Tensor | None = None, vocab: int | None = None,
        all_greedy: bool | None = None, all_finite: bool | None = None,
    ) -> None:
        """``all_greedy`` and ``all_finite`` (every row greedy; no ``top`` is ``NON_FINITE``) are
        read from ``greedy`` and ``top`` when not given."""
        if probs is not None:
            vocab = int(probs.shape[-1])
        elif sampled_probs is not None:
            vocab = int(sampled_probs.shape[-1])
        elif vocab is None:
            raise ValueError("a Distribution needs probs, sampled_probs or vocab, got none of them")
        self.vocab: int = vocab
        self.top = top
        self.greedy = greedy
        self._probs = probs
        self.sampled = sampled
        self.sampled_probs = sampled_probs if probs is None else None
        self.all_greedy = (probs is None and sampled_probs is None or bool(greedy.all())) if all_greedy is None else all_greedy
        self.all_finite = bool((top != NON_FINITE).all()) if all_finite is None else all_finite

    @property
    def probs(self) -> torch.Tensor:
        """Every row's probabilities ``[rows, vocab]`` (float32): a sampled row's own, a greedy row's
        one-hot at its ``top`` (all zeros for a ``NON_FINITE`` row); made dense on first use."""
        if self._probs is None:
            self._probs = self._dense()
        return self._probs

    def _dense(self) -> torch.Tensor:
        sp = self.sampled_probs
        if sp is not None and self.sampled is None:
            return sp  # every row is sampled
        out = torch.zeros((self.top.shape[0], self.vocab), dtype=torch.float32, device=self.top.device)
        # (every row's entry at its top: 1 for a greedy row with a finite one, else 0, which the
        # zeros already hold; no data-dependent shape, which a device would synchronise on)
        out.scatter_(1, self.top.clamp(min=0)[:, None], (self.greedy & (self.top != NON_FINITE)).to(torch.float32)[:, None])
        if sp is not None:
            assert self.sampled is not None
            out[self.sampled] = sp
        return out


def _penalised(logits: torch.Tensor, rows: RowParams, output_counts: torch.Tensor | None, prompt_mask: torch.Tensor | None) -> torch.Tensor:
    if output_counts is None and prompt_mask is None or not rows.uses.penalty:
        return logits
    rep = rows.repetition_penalty
    freq, pres = rows.frequency_penalty, rows.presence_penalty
    on = (rep != 1) | (freq != 0) | (pres != 0)
    seen_out = output_counts > 0 if output_counts is not None else None
    seen = seen_out if prompt_mask is None else prompt_mask if seen_out is None else seen_out | prompt_mask
    assert seen is not None
    # only the penalised rows' seen tokens change: the penalty is computed for every entry and kept
    # where the row has a penalty and the token was seen (an elementwise select: a data-dependent
    # index of those entries would make a device synchronise). Every other entry keeps its logit bit
    # for bit (float32 holds every float16 and bfloat16 value exactly, so a row without a penalty
    # keeps greedy_or_flag's argmax).
    x = logits.to(torch.float32)
    rr = rep[:, None]
    v = torch.where(x < 0, x * rr, x / rr)
    if output_counts is not None:
        assert seen_out is not None
        v = v - output_counts.to(v.dtype) * freq[:, None] - seen_out.to(v.dtype) * pres[:, None]
    return torch.where(seen & on[:, None], v, x)


def _order_desc(z: torch.Tensor, *, host: bool | None = None) -> torch.Tensor:
    """The ids of each row of ``z`` [N, V] float32 by value descending, equal values by increasing
    id (a stable descending sort). ``z`` holds no NaN and no positive value (logits shifted by their
    row's maximum; ``-0.0`` equals ``0.0``).

    On the CPU (``host`` None) torch's sort of many short rows is slow (1.26 ms for 128 rows of
    256, one thread), so the rows are sorted in NumPy as int64 keys ``(|z| bits << 32) | id``: for
    ``z <= 0`` a float's magnitude bits grow as it falls, so ascending keys are ``z`` descending,
    ties by increasing id, with no stable sort needed (0.06 ms). Both ways give the same total
    order, so the result does not depend on which ran (tested)."""
    if not (z.is_cpu if host is None else host):
        return z.sort(dim=-1, descending=True, stable=True)[1]
    key = cpu_branch(z).view(np.int32).astype(np.int64)
    key &= 0x7FFFFFFF
    key <<= 32
    key |= np.arange(z.shape[-1], dtype=np.int64)
    key.sort(axis=-1)
    key &= 0xFFFFFFFF
    return torch.from_numpy(key)


def _order_asc(z: torch.Tensor, *, host: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``z`` sorted ascending along rows with equal values in decreasing id order (``_order_desc``
    read backwards), and the ids in that order."""
    order = _order_desc(z, host=host).flip(-1)
    return z.gather(1, order), order


FULL_SORT = False
"""Force the full sort for every top-k and top-p row (``_top_k_top_p``): the tests set it to check
that the candidate path gives the same bits."""

TOP_P_CANDIDATES: tuple[int, ...] = (1024, 16384)
"""The candidate counts a top-p row tries in turn before the full sort (``_top_k_top_p``)."""


def _desc_order(values: torch.Tensor, ids: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """The permutation sorting each row's ``inside`` entries by value descending, ties by increasing
    id, then the others: ``values`` float32 ``<= 0`` without NaN, ``ids`` their distinct token ids.
    The key ``(|value| bits << 32) | id`` grows as the value falls, then with the id (``_order_asc``),
    and distinct keys need no stable sort."""
    key = ((values.view(torch.int32).to(torch.int64) & 0x7FFFFFFF) << 32) | ids
    key = key.masked_fill(~inside, torch.iinfo(torch.int64).max)
    if not key.is_cpu:
        return key.argsort(dim=-1)
    return torch.from_numpy(cpu_branch(key).argsort(axis=-1))


def _top_p_kept(probs_desc: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p on rows in descending order (``probs_desc`` float32, the rows' softmax; ``limit``
    float64 [R, 1]): which entries stay (the probability above an entry is below ``limit``; the
    first always stays) and whether the entries given reach ``limit`` (then every entry after them
    goes). The cumulative sum is float64 and sequential, so its value at an entry depends only on
    the entries before it: a prefix of the order gives the bits the whole order gives there."""
    cum = probs_desc.cumsum(dim=-1, dtype=torch.float64)
    kept = torch.ones_like(cum, dtype=torch.bool)
    torch.lt(cum[:, :-1], limit, out=kept[:, 1:])
    return kept, cum[:, -1:] >= limit


def _top_k_top_p(z: torch.Tensor, uses: Uses, vocab: int) -> torch.Tensor:
    """``z`` (the sampled rows, shifted so each row's maximum is 0) with what top-k and then top-p
    remove set to ``-inf`` (transformers' rules, module docstring); ``top_k <= 0`` or ``>= vocab``
    and ``top_p >= 1`` remove nothing.

    Top-k removes the values below the row's k-th largest (ties with it stay): a threshold, read
    from ``torch.topk`` (the k-th largest value is the same number however the sort breaks ties),
    or from the full sort under ``FULL_SORT``.

    Top-p reads the row (after top-k) in descending order, equal values by increasing id, and keeps
    an entry while the probability above it (the float64 running sum of the row's float32 softmax
    over the entries before it) is below ``1 - float32(1 - top_p)``; transformers removes the
    ascending prefix whose float32 cumulative probability is at most ``float32(1 - top_p)``: the
    same cut in exact arithmetic. Where it falls inside a tie the lower ids stay.

    A row first tries its ``C`` largest values for each ``C`` of ``TOP_P_CANDIDATES``: the
    candidates are the values strictly above the ``C + 1``-th largest (so no tie crosses the cut),
    the full order's first places. When their cumulative probability reaches the limit, or the
    ``C + 1``-th is ``-inf`` (top-k removed the rest), every other entry goes, and the candidates'
    decisions are the full order's, bit for bit (the probabilities and the float64 prefix sums are
    the same numbers). Otherwise the row takes the next ``C``, then the
    full sort. On a GPU the full sort runs (its scans need not give a prefix the whole row's bits)."""
    device = z.device
    fast = z.is_cpu and not FULL_SORT
    k = uses.top_k_of
    k_on = (k > 0) & (k < vocab) if uses.top_k else None
    if k_on is not None and k_on.any():
        krows = np.flatnonzero(k_on)
        zk = z if krows.size == z.shape[0] else z.index_select(0, to_device(krows, device))
        if fast:
            at = to_device((k[krows] - 1)[:, None], device)
            kth = zk.topk(int(k[krows].max()), dim=-1).values.gather(1, at)
        else:
            at = to_device((vocab - k[krows])[:, None], device)
            kth = _order_asc(zk)[0].gather(1, at)
        z = _put(z, krows, zk.masked_fill(zk < kth, -math.inf))
    prows = uses.top_p_rows
    if prows.size == 0:
        return z
    zp = z if prows.size == z.shape[0] else z.index_select(0, to_device(prows, device))
    e = zp.softmax(dim=-1)  # (per row and per entry: a candidate's probability is the full row's, bit for bit)
    limit = to_device(uses.top_p_limit, device)
    stages = [c for c in TOP_P_CANDIDATES if c + 1 < vocab] if fast else []
    if not stages:  # (a small vocabulary, or FULL_SORT: every row sorted, the fewest steps)
        return _put(z, prows, (_top_p_sorted_host if z.is_cpu else _top_p_sorted)(zp, e, limit))
    kept = torch.zeros_like(zp, dtype=torch.bool)
    pending = torch.arange(prows.size, device=device)

    def rows_of(t: torch.Tensor) -> torch.Tensor:
        return t if pending.numel() == t.shape[0] else t.index_select(0, pending)

    def picked(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # (the pending rows' entries ``ids`` without copying their whole rows first)
        return t.gather(1, ids) if pending.numel() == t.shape[0] else t[pending[:, None], ids]

    for c in stages:
        if pending.numel() == 0:
            break
        vals, ids = rows_of(zp).topk(c + 1, dim=-1, sorted=False)
        floor = vals.min(dim=-1, keepdim=True).values
        inside = vals > floor
        order = _desc_order(vals, ids, inside)
        ids, inside = ids.gather(1, order), inside.gather(1, order)
        es = picked(e, ids).masked_fill_(~inside, 0.0)
        keep, reached = _top_p_kept(es, rows_of(limit))
        done = (reached | (floor == -math.inf)).squeeze(1)
        at = torch.from_numpy(np.flatnonzero(cpu_branch(done)))  # (``fast``: the CPU only)
        ids, keep = (ids, keep & inside) if at.numel() == done.numel() else (ids.index_select(0, at), (keep & inside).index_select(0, at))
        sub = torch.zeros((at.numel(), vocab), dtype=torch.bool, device=device)
        kept.index_copy_(0, pending.index_select(0, at), sub.scatter_(1, ids, keep))
        pending = pending[~done]
    if pending.numel():
        order = _order_desc(rows_of(zp))
        keep, _ = _top_p_kept(picked(e, order), rows_of(limit))
        full = torch.zeros_like(keep).scatter_(1, order, keep)
        kept = full if pending.numel() == kept.shape[0] else kept.index_copy_(0, pending, full)
    return _put(z, prows, zp.masked_fill(~kept, -math.inf))


def _top_p_sorted(zp: torch.Tensor, e: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Top-p by the full sort: ``zp`` with what top-p removes at ``-inf`` (``e`` its softmax,
    ``limit`` [R, 1] float64, as ``_top_k_top_p``'s)."""
    order = _order_desc(zp)
    keep, _ = _top_p_kept(e.gather(1, order), limit)
    return zp.masked_fill(~torch.zeros_like(keep).scatter_(1, order, keep), -math.inf)


def _top_p_sorted_host(zp: torch.Tensor, e: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``_top_p_sorted`` on the host, bit for bit (tested) in fewer operations: the rows are sorted as
    ``_order_desc``'s keys; the entries kept are a prefix of that order (the float64 running sum
    never falls, so once it reaches the limit it stays there), so a row keeps exactly the entries
    whose key is at most the last kept entry's: no scatter back to token order is needed, and the
    kept set is ``_top_p_kept``'s over the same order, bit for bit."""
    key = cpu_branch(zp).view(np.int32).astype(np.int64)
    key &= 0x7FFFFFFF
    key <<= 32
    key |= _ids(zp.shape[-1])
    ordered = np.sort(key, axis=-1)
    ids = ordered & 0xFFFFFFFF
    cum = e.gather(1, torch.from_numpy(ids)).cumsum(dim=-1, dtype=torch.float64)
    # the last entry kept: the first, then one per running sum (before the last) below the limit
    last = cpu_branch(torch.searchsorted(cum, limit).clamp_(max=zp.shape[-1] - 1))[:, 0]
    return zp.masked_fill(torch.from_numpy(key > ordered[np.arange(ordered.shape[0]), last][:, None]), -math.inf)


@functools.cache
def _ids(vocab: int) -> np.ndarray:
    """``0`` to ``vocab - 1`` (int64; read only, shared)."""
    ids = np.arange(vocab, dtype=np.int64)
    ids.flags.writeable = False
    return ids


def _put(z: torch.Tensor, rows: np.ndarray[tuple[int], np.dtype[np.int64]], values: torch.Tensor) -> torch.Tensor:
    """``z`` with its rows ``rows`` (host indices) replaced by ``values``."""
    return values if rows.size == z.shape[0] else z.index_copy(0, to_device(rows, z.device), values)


def distribution(
    logits: torch.Tensor, rows: RowParams, *, output_counts: torch.Tensor | None = None, prompt_mask: torch.Tensor | None = None
) -> Distribution:
    """The final distribution of each row of ``[N, V]`` logits (module docstring, step 1).

    ``output_counts`` [N, V]: how often each token was generated so far (frequency, presence and
    repetition penalties); ``prompt_mask`` [N, V] bool: the prompt's tokens (repetition penalty
    only). Either may be ``None`` (no such tokens).

    Only the sampled rows' distributions are computed, and only the transforms some sampled row
    uses are run (``RowParams.uses``): a greedy batch is one argmax; without top-k or top-p nothing
    is sorted. Every step works row by row, so a row's result is the same bits whatever else is in
    its batch (tested)."""
    vocab = logits.shape[1]
    uses = rows.uses
    pen = _penalised(logits, rows, output_counts, prompt_mask)
    best, top = pen.max(dim=-1)
    # which rows are finite stays on the device (reading it would make the host wait for the
    # forward): every step below treats a row that is not as one that may be, changing no bit of a
    # finite row's result (a mask with nothing set)
    finite = torch.isfinite(best)
    top = torch.where(finite, top, NON_FINITE)
    greedy = rows.greedy
    if uses.all_greedy:
        return Distribution(top=top, greedy=greedy, vocab=vocab, all_greedy=True, all_finite=False)
    device = logits.device
    sampled = to_device(uses.sampled, device) if uses.any_greedy else None
    x, b = (pen, best) if sampled is None else (pen.index_select(0, sampled), best.index_select(0, sampled))
    # shifting by the maximum first changes no filter (each is invariant under a shift) and keeps
    # a small temperature from overflowing to inf
    z = x - b[:, None] if x.dtype == torch.float32 else x.float() - b.float()[:, None]
    if not uses.unit_temperature:  # (x / 1 is x, bit for bit)
        z.div_(to_device(uses.temperature[:, None], device))
    not_finite = ~(finite if sampled is None else finite.index_select(0, sampled))[:, None]
    z.masked_fill_(not_finite, 0.0)
    if uses.top_p or uses.top_k:
        z = _top_k_top_p(z, uses, vocab)
    if uses.min_p:
        # min-p (after top-p; the maximum, 0 after the shift, always survives both): a token's
        # probability over the maximum's is exp(z), so "p < min_p * p_max" is "z < log(min_p)"
        z.masked_fill_(z < torch.log(to_device(uses.min_p_of[:, None], device)), -math.inf)
    probs = z.softmax(dim=-1)
    probs.masked_fill_(not_finite, 0.0)
    return Distribution(top=top, greedy=greedy, sampled=sampled, sampled_probs=probs, all_greedy=False, all_finite=False)


def window_counts(output_counts: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The generated-token counts at each of the ``k + 1`` positions of a verify window, row-major
    ``[N * (k + 1), V]``: position ``j`` has also generated the proposals before it (it is the
    target's distribution given that they were accepted)."""
    n, k = drafts.shape
    vocab = output_counts.shape[1]
    added = torch.zeros((n, k + 1, vocab), dtype=output_counts.dtype, device=output_counts.device)
    added[:, 1:].scatter_add_(2, drafts[:, :, None], torch.ones_like(drafts[:, :, None], dtype=output_counts.dtype))
    return (output_counts[:, None, :] + added.cumsum(dim=1)).reshape(n * (k + 1), vocab)


CDF_BLOCK = 256
"""Above this vocabulary ``_inverse_cdf`` searches in two levels, blocks of this many tokens."""


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token ``t`` of each row with ``c[t - 1] <= u * c[-1] < c[t]`` for ``c`` the row's
    cumulative weights (float64): ``t`` is drawn with probability ``weights[t] / sum`` when ``u``
    is uniform in [0, 1), and a zero-weight token is never drawn. ``c[t] > c[t - 1]`` only where
    ``weights[t] > 0``, so the one way to land on a zero weight is ``u * c[-1]`` rounding up to
    ``c[-1]`` (past the end): the target is capped at the float64 just below ``c[-1]``, which
    lands on the token where ``c`` reaches ``c[-1]``, the last weight that counted. (A row of zero
    weights gives the last token; its caller discards it.)

    Past ``CDF_BLOCK`` tokens a whole float64 cumulative sum is the sampler's largest cost (128
    rows of 131,072: about 200 ms, where float32 sums of blocks take 3 ms), so the search takes
    two levels: ``c`` over the blocks' float32 sums picks the block, then the same rule inside
    that one block (its float64 cumulative sum) picks the token, at ``u``'s place within the
    block's share rescaled to the block's own total. A token's chance is its block's share times
    its share of the block: the law above up to the rounding of a float32 sum of 256 weights
    (relative 1e-7, the rounding the float32 probabilities have anyway), still with no zero-weight
    token drawn. Every step is per row, so the token stays a function of the row and ``u``."""
    n, vocab = weights.shape
    if vocab <= CDF_BLOCK:
        return _search(weights.cumsum(dim=-1, dtype=torch.float64), u[:, None]).squeeze(1)
    pad = -vocab % CDF_BLOCK
    w = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    blocks = w.reshape(n, -1, CDF_BLOCK)
    ends = blocks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)
    b = _search(ends, u[:, None])  # [n, 1]: the first block whose end passes the target
    start = torch.where(b > 0, ends.gather(1, (b - 1).clamp(min=0)), 0.0)
    width = ends.gather(1, b) - start  # > 0 (the block's end passed the target, its start did not) unless the row is all zero
    inner = blocks[torch.arange(n, device=w.device), b.squeeze(1)].cumsum(dim=-1, dtype=torch.float64)
    total = ends[:, -1:]
    at = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    j = _search(inner, (at - start) / torch.where(width > 0, width, 1.0))
    return (b * CDF_BLOCK + j).squeeze(1).clamp_(max=vocab - 1)


def _search(c: torch.Tensor, fraction: torch.Tensor) -> torch.Tensor:
    """The first index of each row of cumulative sums ``c`` [N, M] past ``fraction`` [N, 1] of the
    row's total (capped below the total: ``_inverse_cdf``), clamped to ``M - 1``; [N, 1]."""
    if c.is_cpu:  # (the same arithmetic on a few host numbers in NumPy: a torch op costs microseconds each)
        total_np = cpu_branch(c)[:, -1:]
        t_np = np.minimum(cpu_branch(fraction) * total_np, np.nextafter(total_np, 0.0))
        return torch.searchsorted(c, torch.from_numpy(t_np), right=True).clamp_(max=c.shape[1] - 1)
    total = c[:, -1:]
    t = torch.minimum(fraction * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(c, t, right=True).clamp_(max=c.shape[1] - 1)


def sample_rows(dist: Distribution, rows: RowParams, position: torch.Tensor, purpose: Purpose = Purpose.TARGET) -> torch.Tensor:
    """One token per row of ``dist`` (int64 [N]): ``top`` for greedy rows and ``NON_FINITE`` rows;
    a sampled row's token is drawn from ``probs`` with the uniform of its key (``rows.seed``,
    ``rows.index``, ``position`` [N], ``purpose``). Only the sampled rows' keys are hashed and only
    their probabilities read. ``rows`` are the rows ``dist`` was computed for. The keys are hashed on
    the host: a ``position`` marked with its host values (``backend.readback.staged``) is not read back."""
    if dist.all_greedy:
        return dist.top
    if dist.sampled_probs is None:
        u = uniform(rows.seed, rows.index, position, purpose)
        drawn = _inverse_cdf(dist.probs, u)
        return torch.where(dist.greedy | (dist.top == NON_FINITE), dist.top, drawn)
    uses = rows.uses
    sel = dist.sampled
    at = host_values(position)
    u = to_device(uses.keys.uniform(at if sel is None else at[uses.sampled], purpose), dist.sampled_probs.device)
    drawn = _inverse_cdf(dist.sampled_probs, u)
    if sel is None:
        return drawn if dist.all_finite else torch.where(dist.top == NON_FINITE, dist.top, drawn)
    if not dist.all_finite:
        top_s = dist.top.index_select(0, sel)
        drawn = torch.where(top_s == NON_FINITE, top_s, drawn)
    return dist.top.index_copy(0, sel, drawn)


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
    match draft:
        case OneHotDraft():
            r = p_m.scatter(1, drafts.gather(1, m[:, None]), 0.0)
        case FullDraft(q=q):
            r = (p_m - q[torch.arange(p_m.shape[0], device=p_m.device), m]).clamp(min=0.0)
    return torch.where((r.sum(dim=-1) > 0)[:, None], r, p_m)


@functools.cache
def _window_purposes(k: int) -> np.ndarray:
    """The purpose of each number ``rejection_sample`` draws for a row with ``k`` proposals
    ([1, 2k + 1]: the tests, the residuals, the bonus)."""
    return np.array([[Purpose.ACCEPT] * k + [Purpose.RESIDUAL] * k + [Purpose.TARGET]], dtype=np.int64)


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
    vocab = target.vocab
    p = target.probs.reshape(n, k + 1, vocab)
    device = drafts.device
    # the decisions stay on the device (reading the target's tokens or probabilities back would make
    # the host wait for the verify); only the uniforms are drawn on the host, from the rows' keys and
    # ``start`` (its staged host values when marked, ``backend.readback``), and copied over once
    top = target.top.reshape(n, k + 1)
    greedy = rows.greedy
    first = host_values(start)
    # every number a row may read, in one draw: the tests at positions 0 to k - 1, the residual's
    # draw at each of them, the bonus's at k (which of the last two it reads depends on the tests)
    steps = np.arange(k + 1)
    u = to_device(rows.keys.uniform(first[:, None] + np.concatenate((steps[:k], steps)), _window_purposes(k)), device)
    if k:
        p_x = p[:, :k].gather(2, drafts[:, :, None]).squeeze(2)
        ok = (u[:, :k] < acceptance(p_x, drafts, draft)) & (top[:, :k] != NON_FINITE)
        ok = torch.where(greedy[:, None], drafts == top[:, :k], ok)
        m = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        m = torch.zeros(n, dtype=torch.int64, device=device)
    top_m = top.gather(1, m[:, None]).squeeze(1)
    if rows.uses.all_greedy:
        final = top_m
    else:
        p_m = p.reshape(n * (k + 1), vocab).index_select(0, torch.arange(n, device=device) * (k + 1) + m)
        weights = torch.where((m < k)[:, None], residual(p_m, drafts, draft, m.clamp(max=k - 1)), p_m) if k else p_m
        drawn = _inverse_cdf(weights, u.gather(1, (k + m)[:, None]).squeeze(1))
        final = torch.where(greedy | (top_m == NON_FINITE), top_m, drawn)
    slots = torch.arange(k + 1, device=device)[None, :]
    padded = torch.cat([drafts, torch.full((n, 1), PAD, dtype=torch.int64, device=device)], dim=1)
    tokens = torch.where(slots < m[:, None], padded, PAD)
    tokens = torch.where(slots == m[:, None], final[:, None], tokens)
    return Speculated(accepted=m, tokens=tokens)
