"""Preflight of ``batchc run``: what the run will allocate (``memory_estimate``) and whether the
models can be served together within ``MAX_SERVE_BYTES`` (``check_serving``), before anything is
allocated."""

from __future__ import annotations

from backend.counts import TokenCounts
from backend.hybrid.config import HybridConfig
from backend.kernels.chunked import SCAN_GROUP_ELEMENTS
from compiler.engine.config import ServeConfig
from compiler.workload import BYTE_VOCAB, MAX_SERVE_BYTES, SYSTEM_PREFIXES, ServeError

__all__ = ["check_serving", "memory_estimate"]

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
    ``Q`` tokens), activations of the widest layer."""
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
    width = max(c.in_proj_dim, 2 * c.mlp_hidden, c.vocab, 3 * c.attn_dim, c.d_model)
    return verify + scores + scan + 4 * (tokens + rows * (cfg.k + 1)) * width * _F32


def memory_estimate(
    target: HybridConfig, draft: HybridConfig | None, cfg: ServeConfig, *, compare_mutable: bool = False
) -> dict[str, int]:
    """Estimated bytes of a ``run``, by part (every engine it builds stays alive until it returns)."""
    capacity = cfg.max_running + cfg.cache_entries + 2
    kv_capacity = cfg.max_running * cfg.max_len + cfg.cache_entries * 128
    parts = {"target": _engine_bytes(target, capacity=capacity, kv_capacity=kv_capacity, max_len=cfg.max_len)}
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
) -> None:
    """``ServeError`` (one line, naming the model by ``names`` or the options) unless the models can
    be served together on the byte-level path (``vocab`` None: the models' vocabulary must be 256) or
    with a checkpoint's tokenizer of ``vocab`` ids (at most the model's vocabulary, which may hold
    padding rows), and
    ``memory_estimate`` is within ``MAX_SERVE_BYTES``."""
    if draft is not None and cfg.k and draft.vocab != target.vocab:
        raise ServeError(f"{names[1]}: vocab {draft.vocab} does not match the vocab {target.vocab} of {names[0]}")
    for name, c in ((names[0], target), (names[1], draft if cfg.k else None)):
        if c is not None and vocab is None and c.vocab != BYTE_VOCAB:
            raise ServeError(f"{name}: vocab {c.vocab}; batchc run serves byte prompts and needs vocab {BYTE_VOCAB}")
        if c is not None and vocab is not None and c.vocab < vocab:
            raise ServeError(f"{name}: vocab {c.vocab} is smaller than its tokenizer's {vocab} ids")
    parts = memory_estimate(target, draft, cfg, compare_mutable=compare_mutable)
    total = sum(parts.values())
    if total > MAX_SERVE_BYTES:
        part, size = max(parts.items(), key=lambda kv: kv[1])
        raise ServeError(
            f"the run would need about {total / 2**30:.1f} GiB (largest part: {part}, {size / 2**30:.1f} GiB), over the "
            f"bound of {MAX_SERVE_BYTES >> 30} GiB; lower --max-running ({cfg.max_running}), --cache-entries "
            f"({cfg.cache_entries}), --k ({cfg.k}), --chunk-size ({cfg.chunk_size}), --token-budget "
            f"({cfg.token_budget}) or --max-len ({cfg.max_len}), or use a smaller model"
        )


