"""Preflight of ``batchc run``: what the run will hold (``memory_estimate``: the models' weights,
state pools, KV caches, working memory), whether the models can be served together within the
memory budget taken from the machine (``check_serving``; ``compiler.offline.budget``), and the
sizes that fit it when the user left them to the run (``fit_serving``), before anything is
allocated.

``fit_serving``'s search, for the options the user did not give among ``SIZED_OPTIONS``
(``compiler.offline.budget``; ``--max-running``, ``--token-budget``, ``--cache-entries``: the
running rows, the prefill tokens of a forward and the prefix-cache entries, which size the state
pools, the KV cache and the working memory): today's defaults when they fit, unchanged; else each of them scaled down by one common
factor (the largest of ``L / 1024``, ``L`` an integer found by bisection, each option at least 1),
then each in turn, in the order of ``SIZED_OPTIONS``, raised back to the largest value up to its
default that still fits (bisection). The estimate grows with each option, so both bisections are
exact, and the result depends on the models, the other options and the budget only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import attrs
import torch

from backend.counts import TokenCounts
from backend.hybrid.config import HybridConfig
from backend.kernels.chunked import SCAN_GROUP_ELEMENTS
from compiler.engine.config import ServeConfig
from compiler.offline.budget import SIZED_OPTIONS, MemoryBudget, gib, memory_budget
from compiler.workload import BYTE_VOCAB, SYSTEM_PREFIXES, ServeError

__all__ = ["RUNTIME_BYTES", "Weighted", "check_serving", "fit_serving", "memory_estimate", "weight_bytes"]


class Weighted(Protocol):
    """A model whose tensors are its ``weights`` (``HybridModel``, a draft head)."""

    @property
    def weights(self) -> Mapping[str, torch.Tensor]:
        """The model's tensors by name."""
        ...


def weight_bytes(models: Iterable[Weighted | None]) -> int:
    """Bytes the ``models``' weights hold, each storage once (tied embeddings, a draft head's
    tensors shared with its target); ``None`` entries are skipped."""
    storages: dict[tuple[str, int], int] = {}
    for model in models:
        if model is None:
            continue
        for tensor in model.weights.values():
            storage = tensor.untyped_storage()
            storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


RUNTIME_BYTES = 128 << 20
"""What every run holds besides its models and engines (``memory_estimate``'s ``runtime`` part): the
code of torch's kernels, paged in at their first call, the engine's modules and Python objects, the
workload, the allocator's slack. Measured: a run of one request of one new token at the smallest
sizes on the bundled target (``--requests 1 --max-new-tokens 1 --k 0 --max-running 1
--cache-entries 1 --token-budget 16 --lossless-sample 0``) grew by 88 to 92 MiB of resident memory
from the budget's reading to its end, of which the rest of the estimate was 4 MiB (torch 2.13 on a
CPU, Python 3.11); 128 MiB leaves room for other builds and platforms."""

_F32 = 4
_INDEX_BYTES = 48
"""Per allocator index: a Python int in the free list (8 + 28 bytes), a live byte, slack."""


def _engine_bytes(c: HybridConfig, *, capacity: int, kv_capacity: int, max_len: int) -> int:
    """State pool, KV cache and token table of one model in one engine."""
    pool = (capacity + 1) * c.pool_layout().row_bytes
    kv = 2 * c.n_attn * (kv_capacity + 1) * c.kv_dim * _F32  # grouped-query attention caches the KV heads only
    table = (capacity + 1) * max_len * 8
    return pool + kv + table


_SCAN_LIVE = 4
"""``[rows, Q, Q, nheads]`` float32 tensors alive at once at the peak of a step of the chunked SSD
scan, a bound with room (``backend.kernels.chunked._ssd_chunk`` builds its decay matrix in place, so
one such tensor and the smaller per-group ``C Bᵀ`` product are alive)."""


def _step_bytes(c: HybridConfig, cfg: ServeConfig, *, seq: int, tokens: int) -> int:
    """Working memory of the largest forward of one engine whose prefill sequences are at most
    ``seq`` tokens long and pack at most ``tokens`` tokens: verify states of every running row,
    attention scores of the prefill chunk (or the verify window) over the longest context, the
    chunked SSD scan of one Mamba layer (its ``[rows, Q, Q, nheads]`` tensors with ``Q =
    min(chunk_size of the model, seq)`` over the prefill sequences of a step, at most
    ``max_running`` of them, fewer when ``SCAN_GROUP_ELEMENTS`` splits them into groups, and its
    chunk table: ``x``, ``y``, ``dt``, ``B``, ``C`` of every sequence padded to whole chunks of
    ``Q`` tokens), activations of the widest layer but the output projection for every token, and
    logits for the rows that have them: each prefill sequence's last token and each decode or
    verify row (``HybridModel.extend`` and ``mixed`` project those only; transformers' model is
    asked for the last position too)."""
    rows = cfg.max_running
    verify = (cfg.k + 1) * rows * c.pool_layout().row_bytes
    queries = max(seq, cfg.k + 1)
    scores = 3 * rows * c.attn_heads * queries * cfg.max_len * _F32 if c.n_attn else 0
    q = min(c.chunk_size, seq)
    sequences = min(rows, tokens)
    scanned = min(sequences * q * q * c.nheads, max(q * q * c.nheads, SCAN_GROUP_ELEMENTS))
    padded = min(tokens + sequences * q, sequences * -(-seq // q) * q)  # tokens in the chunk table
    table = padded * (2 * c.nheads * c.head_dim + c.nheads + 2 * c.ngroups * c.d_state)  # x, y, dt, B, C
    scan = (_SCAN_LIVE * scanned + table) * _F32
    width = max(c.in_proj_dim, 2 * c.mlp_hidden, 3 * c.attn_dim, c.d_model)
    logit_rows = min(rows, tokens) + rows * (cfg.k + 1)  # logits: each prefill sequence's last token, each decode or verify row
    return verify + scores + scan + 4 * (tokens + rows * (cfg.k + 1)) * width * _F32 + 4 * logit_rows * c.vocab * _F32


def memory_estimate(
    target: HybridConfig, draft: HybridConfig | None, cfg: ServeConfig, *, compare_mutable: bool = False, weights: int = 0
) -> dict[str, int]:
    """Estimated bytes of a ``run``, by part (every engine it builds stays alive until it returns):
    ``weights``, the bytes of the models as loaded (``weight_bytes``, or what loading them added to
    the process, ``compiler.offline.budget.resident_memory``, when more; 0 leaves them out, as for
    models not loaded yet), ``runtime`` (``RUNTIME_BYTES``), then what the engines allocate. An
    upper bound of what the run allocates from the budget's reading (before the models are loaded)
    to its end: its resident memory's growth, less the pages mapped from files (torch's code, the
    checkpoint), which the kernel can reclaim and counts as available (tests/compiler/offline/
    test_memory_budget.py measures it)."""
    if type(weights) is not int or weights < 0:  # noqa: E721 - a bool or a float is not a byte count
        raise ServeError(f"weights must be an int >= 0 bytes, got {weights!r}")
    capacity = cfg.max_running + cfg.cache_entries + 2
    kv_capacity = cfg.max_running * cfg.max_len + cfg.cache_entries * 128
    parts = {"weights": weights} if weights else {}
    parts["runtime"] = RUNTIME_BYTES
    parts["target"] = _engine_bytes(target, capacity=capacity, kv_capacity=kv_capacity, max_len=cfg.max_len)
    indices = capacity + kv_capacity
    if draft is not None and cfg.k:
        parts["draft"] = _engine_bytes(draft, capacity=capacity, kv_capacity=kv_capacity, max_len=cfg.max_len)
    if cfg.lossless_sample:
        parts["lossless check"] = _engine_bytes(target, capacity=cfg.max_running + 2, kv_capacity=kv_capacity, max_len=cfg.max_len)
        indices += cfg.max_running + 2 + kv_capacity
    if compare_mutable and draft is not None and cfg.k:
        mutable = {"capacity": cfg.max_running + len(SYSTEM_PREFIXES) + 2,
                   "kv_capacity": cfg.max_running * cfg.max_len + 1024, "max_len": cfg.max_len}
        parts["mutable baseline"] = _engine_bytes(target, **mutable) + _engine_bytes(draft, **mutable)
    if cfg.penalties:  # the target's token counts (backend.counts), in the served engine and the lossless check's
        parts["token counts"] = TokenCounts.nbytes(capacity, target.vocab)
        if cfg.lossless_sample:
            parts["token counts"] += TokenCounts.nbytes(cfg.max_running + 2, target.vocab)
    parts["allocators"] = indices * _INDEX_BYTES
    # prefill sequence length and packed tokens of one forward: the served engines chunk prompts by
    # --chunk-size within --token-budget; the lossless check's plain engine by the context limit
    # within the budget; the mutable baseline prefills its admitted prompts whole, in one forward
    packed = min(cfg.token_budget, cfg.max_running * cfg.max_len)
    served = {"seq": min(cfg.chunk_size, cfg.token_budget, cfg.max_len), "tokens": packed}
    models = [target, draft] if draft is not None and cfg.k else [target]
    steps = [_step_bytes(m, cfg, **served) for m in models]
    if cfg.lossless_sample:
        steps.append(_step_bytes(target, cfg, seq=min(cfg.max_len, cfg.token_budget), tokens=packed))
    if compare_mutable and draft is not None and cfg.k:
        steps += [_step_bytes(m, cfg, seq=cfg.max_len, tokens=cfg.max_running * cfg.max_len) for m in models]
    parts["forward working memory"] = max(steps)
    return parts


def check_serving(
    target: HybridConfig,
    draft: HybridConfig | None,
    cfg: ServeConfig,
    *,
    compare_mutable: bool = False,
    names: tuple[str, str] = ("target", "draft"),
    vocab: int | None = None,
    budget: MemoryBudget | None = None,
    weights: int = 0,
) -> None:
    """``ServeError`` (one line, naming the model by ``names`` or the options) unless the models can
    be served together on the byte-level path (``vocab`` None: the models' vocabulary must be 256) or
    with a checkpoint's tokenizer of ``vocab`` ids (at most the model's vocabulary, which may hold
    padding rows), and ``memory_estimate`` (``weights``: the bytes of the models' weights,
    ``weight_bytes``) fits ``budget`` (default: the machine's memory now, with ``weights`` already
    held: ``memory_budget(held=weights)``). ``fit_serving`` with no option left to size."""
    fit_serving(target, draft, cfg, compare_mutable=compare_mutable, names=names, vocab=vocab, budget=budget, weights=weights)


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def fit_serving(
    target: HybridConfig,
    draft: HybridConfig | None,
    cfg: ServeConfig,
    *,
    sized: Iterable[str] = (),
    compare_mutable: bool = False,
    names: tuple[str, str] = ("target", "draft"),
    vocab: int | None = None,
    budget: MemoryBudget | None = None,
    weights: int = 0,
) -> ServeConfig:
    """The config to serve: ``cfg`` when ``check_serving``'s checks pass, else ``cfg`` with the
    options named in ``sized`` (some of ``SIZED_OPTIONS``: those the user did not give) lowered to
    the largest values that fit ``budget`` (the module says how). ``ServeError`` in one line naming
    what to lower when nothing fits: the models' weights alone (``--memory-fraction``, a smaller
    model), or the options ``sized`` does not hold even with those it holds at 1."""
    sized = tuple(sized)
    bad = [name for name in sized if name not in SIZED_OPTIONS]
    if bad:
        raise ServeError(f"sized: {bad[0]!r} is not one of {SIZED_OPTIONS}")
    if draft is not None and cfg.k and draft.vocab != target.vocab:
        raise ServeError(f"{names[1]}: vocab {draft.vocab} does not match the vocab {target.vocab} of {names[0]}")
    for name, c in ((names[0], target), (names[1], draft if cfg.k else None)):
        if c is not None and vocab is None and c.vocab != BYTE_VOCAB:
            raise ServeError(f"{name}: vocab {c.vocab}; batchc run serves byte prompts and needs vocab {BYTE_VOCAB}")
        if c is not None and vocab is not None and c.vocab < vocab:
            raise ServeError(f"{name}: vocab {c.vocab} is smaller than its tokenizer's {vocab} ids")
    if budget is None:
        budget = memory_budget(held=weights)
    bound = budget.bytes

    def parts_of(c: ServeConfig) -> dict[str, int]:
        return memory_estimate(target, draft, c, compare_mutable=compare_mutable, weights=weights)

    def fits(c: ServeConfig) -> bool:
        return sum(parts_of(c).values()) <= bound

    if fits(cfg):
        return cfg
    raise_it = "raise --memory-fraction or " if budget.fraction < 1 else ""
    fewer = " or fewer --dp replicas" if budget.shares > 1 else ""
    if weights + RUNTIME_BYTES > bound:
        raise ServeError(f"the models alone need about {gib(weights)} as loaded (and the runtime {gib(RUNTIME_BYTES)}), over the budget of "
                         f"{budget.describe()}; "
                         f"{raise_it}use a smaller model{fewer}")
    defaults = attrs.asdict(cfg)
    ones: dict[str, Any] = {name: 1 for name in sized}
    lowest = attrs.evolve(cfg, **ones)
    if not fits(lowest):
        parts = parts_of(lowest)
        total = sum(parts.values())
        part, size = max(parts.items(), key=lambda kv: kv[1])
        even = f" even with {', '.join(f'{_option(n)} 1' for n in sized)}" if sized else ""
        given = [name for name in ("max_running", "cache_entries", "k", "chunk_size", "token_budget", "max_len") if name not in sized]
        lower = ", ".join(f"{_option(n)} ({defaults[n]})" for n in given)
        raise ServeError(
            f"the run would need about {gib(total)} (largest part: {part}, {gib(size)}){even}, over the budget of "
            f"{budget.describe()}; lower {lower}, {raise_it}use a smaller model{fewer}"
        )

    def scaled(level: int) -> ServeConfig:
        changes: dict[str, Any] = {name: max(1, defaults[name] * level // 1024) for name in sized}
        return attrs.evolve(cfg, **changes)

    low, high = 0, 1024  # scaled(0) is ``lowest``, which fits; scaled(1024) is ``cfg``, which does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(scaled(mid)) else (low, mid)
    best = scaled(low)
    for name in (n for n in SIZED_OPTIONS if n in sized):  # each raised back as far as it goes
        lo, hi = attrs.asdict(best)[name], defaults[name] + 1  # lo fits, hi is past the default
        while hi - lo > 1:
            mid = (lo + hi) // 2
            change: dict[str, Any] = {name: mid}
            lo, hi = (mid, hi) if fits(attrs.evolve(best, **change)) else (lo, mid)
        raised: dict[str, Any] = {name: lo}
        best = attrs.evolve(best, **raised)
    return best
