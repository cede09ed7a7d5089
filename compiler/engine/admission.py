"""Argument checks of the engine's public entry points, all run before anything is allocated.

Prompts (and prefix tokens) are checked by ``checked_prompt``. Counts are ints (numpy integers
too; never ``bool``, ``float``, ``str`` or ``None``) within their bounds; a bad argument raises ``PreconditionError`` naming the argument and the value, and leaves
the engine, its allocators, pools and prefix cache as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from typing import Any, cast

import numpy as np

from backend.boundary import Transport
from backend.counts import TokenCounts
from backend.model import ServedModel
from backend.pool import MAX_POOL_BYTES as MAMBA_POOL_MAX_BYTES
from compiler.engine.policy import SchedulePolicy
from compiler.manager import PassManager
from compiler.prefix_cache import PrefixCache
from ir.columns import I64, as_i64, int_problem
from ir.errors import IRValidationError, PreconditionError, short_repr
from ir.ids import DRAFT_POOL, TARGET_POOL, PoolId, RequestId
from ir.sampling import GREEDY, SEED_MAX, SamplingParams

__all__ = [
    "MAX_CAPACITY", "MAX_K", "MAX_KV_CAPACITY", "MAX_LEN", "MAX_POOL_BYTES", "MAX_RETRIES", "MAX_STOPS", "MAX_TABLE_ENTRIES", "check_engine_args",
    "check_request", "check_sampling", "checked_prompt", "engine_int",
]

MAX_K = 32
"""Most draft tokens per speculative iteration (the same bound as ``compiler.workload.MAX_K``, the
command line's; the engine does not import the command line's modules)."""
MAX_CAPACITY = 2**20
"""Most Mamba slots (per pool) an engine takes: running requests, prefix states and cache entries."""
MAX_KV_CAPACITY = 2**31
"""Most attention KV locations an engine takes."""
MAX_LEN = 2**20
"""Longest context (prompt, new tokens and the k + 1 speculative positions) an engine takes."""
MAX_TABLE_ENTRIES = 2**31
"""Bound on ``(capacity + 1) * max_len``, the entries of each model's token table (int64: 16 GiB)."""
MAX_POOL_BYTES = MAMBA_POOL_MAX_BYTES
"""Bound on each Mamba state pool's bytes (``backend.pool.MAX_POOL_BYTES``), checked up front."""
MAX_RETRIES = 100
"""Most re-executions of a failing forward."""
MAX_STOPS = 64
"""Most stop ids of one request."""


def engine_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """``value`` as an ``int`` in ``[lo, hi]``, or ``PreconditionError`` naming ``Engine``'s
    argument ``name`` and the value (``bool``, ``float``, ``str``, ``None`` are not ints)."""
    problem = int_problem(value)
    if problem is not None:
        raise PreconditionError("Engine", f"{name} {problem} (got {short_repr(value)})")
    n = int(cast(int, value))
    if n < lo or (hi is not None and n > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise PreconditionError("Engine", f"{name} must be {bound}, got {n}")
    return n


def check_engine_args(
    target: object,
    draft: object,
    *,
    k: object,
    capacity: object,
    kv_capacity: object,
    max_len: object,
    chunk_size: object,
    token_budget: object,
    prefix_cache: object,
    retries: object,
    mixed: object,
    pm: object,
    transport: object = None,
    policy: object = None,
    seed: object = 0,
    penalties: object = False,
) -> None:
    """``Engine``'s argument checks, all before anything is allocated (``PreconditionError`` naming
    the argument and the value): counts are ints (numpy
    integers too; never ``bool``, ``float``, ``str`` or ``None``) with ``k`` in ``[0, MAX_K]``,
    ``capacity`` in ``[1, MAX_CAPACITY]``, ``kv_capacity`` in ``[1, MAX_KV_CAPACITY]``,
    ``max_len`` in ``[k + 3, MAX_LEN]`` (room for a prompt token, a new token and the k + 1
    speculative positions) with ``(capacity + 1) * max_len <= MAX_TABLE_ENTRIES`` and each state
    pool within ``MAX_POOL_BYTES``, ``chunk_size`` and ``token_budget`` ``None`` or ``>= 1``,
    ``retries`` in ``[0, MAX_RETRIES]``; ``target`` a ``ServedModel`` (a ``HybridModel``, or
    any model with the protocol's methods); ``draft`` a ``ServedModel`` of the target's vocabulary when ``k > 0`` (``None`` or unused when ``k ==
    0``); ``mixed`` a ``bool``; ``prefix_cache`` a ``PrefixCache`` or ``None``; ``pm`` a
    ``PassManager`` or ``None``; ``policy`` a ``SchedulePolicy``; ``seed`` an int in [0, 2**63 - 1]; ``penalties`` a ``bool``
    (with it, the target's token counts, ``backend.counts``, within ``MAX_POOL_BYTES``); ``transport`` a
    ``backend.boundary.Transport`` that does not refuse the models and ``retries`` (a
    tensor-parallel group's refuses retries, shards of another rank or world, and a leader whose
    session is in use)."""
    kk = engine_int("k", k, 0, MAX_K)
    slots = engine_int("capacity", capacity, 1, MAX_CAPACITY)
    engine_int("kv_capacity", kv_capacity, 1, MAX_KV_CAPACITY)
    length = engine_int("max_len", max_len, 1, MAX_LEN)
    if length < kk + 3:
        raise PreconditionError(
            "Engine", f"max_len {length} leaves no room for a prompt token and a new token next to the k + 1 = {kk + 1} speculative positions"
        )
    if (slots + 1) * length > MAX_TABLE_ENTRIES:
        raise PreconditionError(
            "Engine", f"(capacity + 1) * max_len = {(slots + 1) * length} token-table entries, over the bound {MAX_TABLE_ENTRIES}"
        )
    for name, value in (("chunk_size", chunk_size), ("token_budget", token_budget)):
        if value is not None:
            engine_int(name, value, 1)
    engine_int("retries", retries, 0, MAX_RETRIES)
    if type(mixed) is not bool:  # noqa: E721 - 0, 1, 'no' and None are not switches
        raise PreconditionError("Engine", f"mixed must be a bool, not {type(mixed).__name__} (got {short_repr(mixed)})")
    if not isinstance(target, ServedModel):
        raise PreconditionError("Engine", f"target must be a ServedModel, not {type(target).__name__} (got {short_repr(target)})")
    if draft is not None and not isinstance(draft, ServedModel):
        raise PreconditionError("Engine", f"draft must be a ServedModel or None, not {type(draft).__name__} (got {short_repr(draft)})")
    if kk > 0 and draft is None:
        raise PreconditionError("Engine", f"speculative decoding (k = {kk}) needs a draft model, got draft=None")
    if kk > 0 and draft is not None and draft.vocab != target.vocab:
        raise PreconditionError(
            "Engine", f"draft vocabulary {draft.vocab} differs from the target's {target.vocab}"
        )
    for name, model in (("target", target), ("draft", draft if kk > 0 else None)):
        if model is not None:
            row_bytes = model.pool_layout().row_bytes
            if (slots + 1) * row_bytes > MAX_POOL_BYTES:
                raise PreconditionError(
                    "Engine",
                    f"capacity {slots}: the {name}'s state pool would take {(slots + 1) * row_bytes} bytes, over the bound {MAX_POOL_BYTES}",
                )
    if type(penalties) is not bool:  # noqa: E721 - 0, 1, 'no' and None are not switches
        raise PreconditionError("Engine", f"penalties must be a bool, not {type(penalties).__name__} (got {short_repr(penalties)})")
    if penalties and TokenCounts.nbytes(slots, target.vocab) > MAX_POOL_BYTES:
        raise PreconditionError(
            "Engine", f"capacity {slots}: the penalties' token counts would take {TokenCounts.nbytes(slots, target.vocab)} bytes, "
            f"over the bound {MAX_POOL_BYTES}",
        )
    if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
        raise PreconditionError(
            "Engine", f"prefix_cache must be a PrefixCache or None, not {type(prefix_cache).__name__} (got {short_repr(prefix_cache)})"
        )
    if pm is not None and not isinstance(pm, PassManager):
        raise PreconditionError("Engine", f"pm must be a PassManager or None, not {type(pm).__name__} (got {short_repr(pm)})")
    if not isinstance(policy, SchedulePolicy):
        raise PreconditionError(
            "Engine", f"policy must be a SchedulePolicy (compiler.engine.policy), not {type(policy).__name__} (got {short_repr(policy)})"
        )
    problem = int_problem(seed)
    if problem is not None or not (0 <= int(cast(int, seed)) <= SEED_MAX):
        raise PreconditionError("Engine", f"seed must be an int in [0, 2**63 - 1] (got {short_repr(seed)})")
    if not isinstance(transport, Transport):
        raise PreconditionError(
            "Engine", f"transport must be a backend.boundary.Transport, not {type(transport).__name__} (got {short_repr(transport)})"
        )
    models: dict[PoolId, ServedModel[Any]] = {pool: model for pool, model in ((TARGET_POOL, target), (DRAFT_POOL, draft if kk > 0 else None)) if model is not None}
    refusal = transport.refusal(models, retries=int(cast(int, retries)))
    if refusal is not None:
        raise PreconditionError("Engine", refusal)


def check_request(
    rid: object,
    prompt: Sequence[int],
    max_new_tokens: object,
    stop: object,
    *,
    in_use: Callable[[RequestId], bool],
    vocab: int,
    max_len: int,
    k: int,
    kv_capacity: int | None = None,
) -> tuple[RequestId, I64, int, frozenset[int]]:
    """``Engine.admit``'s argument checks (``PreconditionError``, or ``IRValidationError`` for the
    prompt's tokens), before anything changes: the request id, the prompt (huge ones refused by
    their length, unread), ``max_new_tokens >= 1`` with room under ``max_len`` for the prompt, the
    new tokens and the k + 1 speculative positions (and, given the engine's ``kv_capacity``, room in
    it for the KV of the prompt, the new tokens but the last and k speculative positions at once: a
    request that needs more than the engine has would never finish), and ``stop`` ``None``, a token
    id or a list or tuple of them (every one that ends the request: a tokenizer's end-of-sequence
    ids). Returns them as ``(rid, prompt, max_new_tokens, stop ids)``."""
    problem = int_problem(rid)
    if problem is not None:
        raise PreconditionError("admit", f"rid {problem} (got {short_repr(rid)})")
    rid = RequestId(int(cast(int, rid)))
    if in_use(rid):
        raise PreconditionError("admit", f"request id {rid} is already in use")
    arr = checked_prompt(f"request {rid}", prompt, vocab, MAX_LEN)
    problem = int_problem(max_new_tokens)
    if problem is not None:
        raise PreconditionError("admit", f"request {rid}: max_new_tokens {problem} (got {short_repr(max_new_tokens)})")
    new = int(cast(int, max_new_tokens))
    if new < 1:
        raise PreconditionError("admit", f"request {rid}: max_new_tokens must be >= 1, got {new}")
    if arr.shape[0] + new + k + 1 > max_len:
        raise PreconditionError("admit", f"request {rid}: prompt {arr.shape[0]} + {new} new tokens exceed max_len {max_len}")
    kv_need = arr.shape[0] + new - 1 + k
    if kv_capacity is not None and kv_need > kv_capacity:
        raise PreconditionError(
            "admit", f"request {rid}: prompt {arr.shape[0]} + {new} new tokens + {k} speculative positions, less its last token, need "
            f"{kv_need} KV locations at once, over the engine's kv_capacity {kv_capacity}"
        )
    if stop is None:
        return rid, arr, new, frozenset()
    stops: list[object] = list(stop) if isinstance(stop, (list, tuple)) else [stop]
    if len(stops) > MAX_STOPS:
        raise PreconditionError("admit", f"request {rid}: at most {MAX_STOPS} stop ids, got {len(stops)}")
    tokens = []
    for value in stops:
        problem = int_problem(value)
        if problem is not None:
            raise PreconditionError("admit", f"request {rid}: stop {problem} (got {short_repr(value)})")
        token = int(cast(int, value))
        if not 0 <= token < vocab:
            raise PreconditionError("admit", f"request {rid}: stop must be a token id in [0, {vocab}), got {token}")
        tokens.append(token)
    return rid, arr, new, frozenset(tokens)


def checked_prompt(where: str, prompt: Sequence[int], vocab: int | None = None, max_len: int | None = None) -> I64:
    """The prompt as a read-only int64 column, or ``IRValidationError`` naming ``where`` (``"request
    3"``, ``"prefix"``) and the bad token (negative, or ``>= vocab`` when the model's vocabulary
    size is given). With ``max_len``, a longer prompt is refused by its length before any of it is
    read (``range(10**10)`` is not materialised); a prompt without a length (a generator) is refused."""
    if not isinstance(prompt, Sized):
        raise IRValidationError(where, "prompt", prompt, f"must be a sequence of int token ids, not {type(prompt).__name__}")
    if max_len is not None and len(prompt) > max_len:
        raise IRValidationError(where, "prompt", f"<{len(prompt)} tokens>", f"is longer than {max_len} tokens")
    arr = as_i64(prompt)
    if arr.dtype != np.int64 or arr.ndim != 1:
        shown: object = arr[0] if arr.dtype == object and arr.shape == (1,) else prompt
        raise IRValidationError(where, "prompt", shown, "must be a 1-D sequence of int token ids")
    if arr.shape[0] == 0:
        raise IRValidationError(where, "prompt", [], "must hold at least one token")
    if int(arr.min()) < 0:
        raise IRValidationError(where, "prompt", int(arr.min()), "token ids must be >= 0")
    if vocab is not None and int(arr.max()) >= vocab:
        raise IRValidationError(where, "prompt", int(arr.max()), f"token ids must be < the vocabulary size {vocab}")
    return arr


def check_sampling(rid: RequestId, sampling: object) -> SamplingParams:
    """``Engine.admit``'s ``sampling``: ``None`` (``GREEDY``) or a ``SamplingParams`` (validated when
    it was built), else ``PreconditionError`` naming the request and the value."""
    if sampling is None:
        return GREEDY
    if not isinstance(sampling, SamplingParams):
        raise PreconditionError(
            "admit", f"request {rid}: sampling must be an ir.sampling.SamplingParams or None, not {type(sampling).__name__} (got {short_repr(sampling)})"
        )
    return sampling
