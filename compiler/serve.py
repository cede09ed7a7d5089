"""``batchc run``: the main job. A workload of requests served by ``Engine`` on a target and a
draft model, with the prefix cache, chunked prefill, continuous batching and speculative decoding,
and a summary an engine author can judge the library by.

Workloads: the built-in one (``builtin_workload``: requests built from a bundled prompt set, with
shared system prefixes, arrivals in bursts or a trickle, and mixed lengths) or a JSONL file (``load_workload``), one
request per line: ``{"prompt": str, "max_new_tokens": int, "arrival": int (optional, scheduler step),
"stop": str (optional, one character)}``. A malformed file raises ``WorkloadError`` naming the line.
``load_workload`` checks the same bounds as ``Engine.admit`` (context length with the k + 1
speculative positions, token ids below the vocabulary), so a loaded workload is never refused
mid-run; its file limits are in its docstring.

Before anything is allocated, ``check_serving`` refuses models that the byte-level serving path
cannot serve (target/draft vocabulary mismatch, vocabulary other than 256) and runs whose estimated
memory (``memory_estimate``: state pools, KV caches, token tables, allocators, verify states,
attention scores and activations, for every engine the run builds) is over ``MAX_SERVE_BYTES``.

A forward that fails aborts its requests (``Engine``, no retries here); the summary counts
them (``aborted_requests``, ``failed_forwards``, ``first_failure``), and the lossless check skips
them.

The lossless check re-runs a sample of the requests with plain greedy decoding of the target alone
(no draft, no cache, no chunking) and compares the outputs token for token.
"""

from __future__ import annotations

import json
import os
import random
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from backend.hybrid.checkpoint import file_kind
from backend.hybrid.config import HybridConfig
from backend.hybrid.model import HybridModel
from compiler.engine import Engine
from compiler.manager import PassManager
from compiler.prefix_cache import PrefixCache
from compiler.workload import (
    ARRIVALS,
    BURST_EVERY,
    BURST_SIZE,
    MAX_BODY_SNIPPETS,
    MAX_K,
    MAX_REQUESTS,
    MAX_SERVE_BYTES,
    MAX_WORKLOAD_BYTES,
    SNIPPETS,
    SYSTEM_PREFIXES,
)
from ir.errors import BatchcError
from ir.ids import DRAFT_POOL, TARGET_POOL, PoolId, RequestId

MAX_ARRIVAL = 1_000_000
"""Latest arrival step a workload may ask for (a larger one would idle the scheduler for ever)."""
BYTE_VOCAB = 256
"""Vocabulary of the byte-level serving path: prompts, completions and stop tokens are bytes."""


class WorkloadError(BatchcError, ValueError):
    """A workload file that cannot be served; the message names the file and line."""


class ServeError(BatchcError, ValueError):
    """Options or models that cannot be served; the message names the option or model field."""


@attrs.frozen(kw_only=True)
class Request:
    rid: RequestId
    prompt: bytes
    max_new_tokens: int
    arrival: int = 0
    stop: int | None = None


LONGEST_BUILTIN_PROMPT = max(len(p) for p in SYSTEM_PREFIXES) + MAX_BODY_SNIPPETS * max(len(s) for s in SNIPPETS)
"""Longest prompt ``builtin_workload`` can build (bytes)."""


@attrs.frozen(kw_only=True)
class ServeConfig:
    """Serving options (checked on construction, ``ServeError``; memory bounds: ``check_serving``)."""

    k: int = 2
    max_running: int = 8
    chunk_size: int = 64
    token_budget: int = 256
    cache_entries: int = 8
    cache_block: int = 16
    max_len: int = 512
    lossless_sample: int = 4

    def __attrs_post_init__(self) -> None:
        for name, value in attrs.asdict(self).items():
            if type(value) is not int:  # noqa: E721 - bool, float and str are not option values
                raise ServeError(f"{name} must be an int, got {value!r}")
            lo = 0 if name in ("k", "lossless_sample") else 1
            if value < lo:
                raise ServeError(f"{name} must be >= {lo}, got {value}")
        if self.k > MAX_K:
            raise ServeError(f"k must be in [0, {MAX_K}], got {self.k}")
        if self.max_len < self.k + 3:
            raise ServeError(f"max_len {self.max_len} leaves no room for a prompt and a new token next to k + 1 = {self.k + 1}")

    @property
    def reserve(self) -> int:
        """Context positions a request keeps free after its prompt and new tokens (``Engine.admit``)."""
        return self.k + 1

    @property
    def builtin_max_new_tokens(self) -> int:
        """Largest ``max_new_tokens`` the built-in workload can ask for: its longest possible prompt
        plus that many tokens plus ``reserve`` must fit ``max_len``."""
        return self.max_len - LONGEST_BUILTIN_PROMPT - self.reserve


def builtin_workload(
    *, num_requests: int = 64, max_new_tokens: int = 32, seed: int = 0, arrivals: str = "bursts"
) -> list[Request]:
    """Byte prompts from the bundled snippets: about two thirds start with one of the shared system
    prefixes; bodies of 1 to 6 snippets (long ones are prefilled in chunks); generation lengths vary
    from a quarter of ``max_new_tokens`` to all of it.

    ``arrivals``: ``"bursts"`` (default): ``BURST_SIZE`` requests arrive together every
    ``BURST_EVERY`` scheduler steps, as when clients submit batches of prompts (evaluation
    harnesses, agent fan-out, batch APIs). ``"trickle"``: one request at a time, 0 to 2 steps
    apart. The pattern decides how far the pre-fix engine's stale-init bug reaches: its stale
    indices ride on the running batch from the moment a prefill batch becomes the running batch
    (nothing else was running) until that batch's first request finishes. Each burst opens that
    window over all of its requests; a trickle opens it over one request at a time."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {ARRIVALS}, got {arrivals!r}")
    rng = random.Random(seed)
    out = []
    arrival = 0
    for i in range(num_requests):
        prefix = rng.choice((-1, 0, 1))
        body = b"".join(rng.choice(SNIPPETS) for _ in range(rng.randint(1, MAX_BODY_SNIPPETS)))
        prompt = (SYSTEM_PREFIXES[prefix] if prefix >= 0 else b"") + body
        step = rng.choice((0, 0, 1, 2))  # drawn under both patterns: prompts and lengths stay the same
        arrival = (i // BURST_SIZE) * BURST_EVERY if arrivals == "bursts" else arrival + step
        out.append(
            Request(rid=RequestId(i), prompt=prompt, max_new_tokens=rng.randint(max(1, max_new_tokens // 4), max_new_tokens), arrival=arrival)
        )
    return out


def _read_bounded(p: Path) -> bytes:
    """The bytes of the regular file ``p``, at most ``MAX_WORKLOAD_BYTES`` of them."""
    try:
        st = os.stat(p)
    except ValueError:  # a NUL byte in the path
        raise WorkloadError(f"{str(p)!r}: cannot read workload file (a path cannot hold a NUL byte)") from None
    except OSError as exc:
        raise WorkloadError(f"{p}: cannot read workload file ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise WorkloadError(f"{p}: cannot read workload file: {file_kind(st.st_mode)}, not a regular file")
    if st.st_size > MAX_WORKLOAD_BYTES:
        raise WorkloadError(f"{p}: workload file of {st.st_size} bytes is over the limit of {MAX_WORKLOAD_BYTES} bytes (64 MiB)")
    try:
        # O_NONBLOCK: a FIFO swapped in after the stat cannot block the open; fstat refuses it
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise WorkloadError(f"{p}: cannot read workload file: {file_kind(mode)}, not a regular file")
            data = f.read(MAX_WORKLOAD_BYTES + 1)
    except OSError as exc:
        raise WorkloadError(f"{p}: cannot read workload file ({exc.strerror})") from None
    if len(data) > MAX_WORKLOAD_BYTES:
        raise WorkloadError(f"{p}: workload file is over the limit of {MAX_WORKLOAD_BYTES} bytes (64 MiB)")
    return data


def _check_workload_args(path: object, *, max_len: object, reserve: object, vocab: object, default_max_new_tokens: object) -> None:
    """``load_workload``'s argument checks, before the file is opened (``WorkloadError``)."""
    from typing import cast

    from backend.hybrid.config import MAX_DIM
    from compiler.engine.admission import MAX_LEN
    from ir.columns import int_problem

    if not isinstance(path, (str, os.PathLike)):
        raise WorkloadError(f"load_workload: path must be a str or a path, not {type(path).__name__} (got {path!r})")
    values: dict[str, int] = {}
    for name, value, lo, hi in (
        ("max_len", max_len, 1, MAX_LEN), ("reserve", reserve, 0, MAX_LEN), ("vocab", vocab, 1, MAX_DIM),
        ("default_max_new_tokens", default_max_new_tokens, 1, MAX_LEN),
    ):
        problem = int_problem(value)
        if problem is not None:
            raise WorkloadError(f"load_workload: {name} {problem} (got {value!r})")
        n = int(cast(int, value))  # an int or a numpy integer: int_problem said so
        if not lo <= n <= hi:
            raise WorkloadError(f"load_workload: {name} must be in [{lo}, {hi}], got {n}")
        values[name] = n
    if values["reserve"] + 2 > values["max_len"]:
        raise WorkloadError(
            f"load_workload: reserve {values['reserve']} leaves no room under max_len {values['max_len']} "
            "for a prompt byte and a new token"
        )


def load_workload(
    path: str | Path, *, max_len: int, reserve: int = 8, vocab: int = BYTE_VOCAB, default_max_new_tokens: int = 32
) -> list[Request]:
    """The requests of the JSONL file ``path``, or ``WorkloadError`` naming the file and line.

    File limits: a regular file (not a FIFO, device or directory) of at most ``MAX_WORKLOAD_BYTES``
    (64 MiB), UTF-8, at most ``MAX_REQUESTS`` requests. Lines are split on ``"\\n"`` only, so a
    raw U+2028 or U+0085 inside a JSON string is part of the string; blank lines are skipped.

    Request limits, the same as ``Engine.admit``'s so that nothing loaded is refused mid-run:
    prompt bytes + ``max_new_tokens`` + ``reserve`` <= ``max_len`` (``reserve`` = k + 1 for
    speculative decoding with k draft tokens; the default 8 covers k <= 7), every prompt byte and
    the stop byte below ``vocab``.

    The arguments are checked first (``WorkloadError`` naming the argument and the value): ``path``
    a ``str`` or ``os.PathLike``; ``max_len``, ``reserve``, ``vocab`` and ``default_max_new_tokens``
    ints (never ``bool``, ``float``, ``str`` or ``None``) with ``max_len`` in
    ``[reserve + 2, compiler.engine.admission.MAX_LEN]``, ``reserve >= 0``, ``vocab`` in ``[1, MAX_DIM]`` (the
    model config's bound) and ``default_max_new_tokens >= 1``."""
    _check_workload_args(path, max_len=max_len, reserve=reserve, vocab=vocab, default_max_new_tokens=default_max_new_tokens)
    p = Path(path)
    data = _read_bounded(p)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = data[: exc.start].count(b"\n") + 1
        raise WorkloadError(f"{p}: cannot read workload file ({exc}, line {at})") from None
    out: list[Request] = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip(" \t\r"):
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: bad JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise WorkloadError(f"{where}: bad JSON (nested too deeply)") from None
        except ValueError:  # int(): a literal longer than the interpreter's digit limit
            raise WorkloadError(f"{where}: bad JSON (an integer of more than {sys.get_int_max_str_digits()} digits)") from None
        if not isinstance(obj, dict):
            raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if len(out) == MAX_REQUESTS:
            raise WorkloadError(f"{where}: more than {MAX_REQUESTS} requests")
        out.append(_request(where, obj, RequestId(len(out)), max_len=max_len, reserve=reserve, vocab=vocab,
                            default_max_new_tokens=default_max_new_tokens))
    if not out:
        raise WorkloadError(f"{p}: no requests")
    return out


def _request(where: str, obj: dict[str, Any], rid: RequestId, *, max_len: int, reserve: int, vocab: int,
             default_max_new_tokens: int) -> Request:
    unknown = set(obj) - {"prompt", "max_new_tokens", "arrival", "stop"}
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {sorted(unknown)}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise WorkloadError(f"{where}: 'prompt' must be a non-empty string")
    try:
        data = prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise WorkloadError(f"{where}: 'prompt' is not valid Unicode ({exc.reason} at character {exc.start})") from None
    new = obj.get("max_new_tokens", default_max_new_tokens)
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise WorkloadError(f"{where}: 'max_new_tokens' must be a positive integer, got {new!r}")
    if len(data) + new + reserve > max_len:
        raise WorkloadError(
            f"{where}: prompt of {len(data)} bytes + {new} new tokens exceeds the context limit {max_len} "
            f"(with {reserve} positions reserved for speculation)"
        )
    if max(data) >= vocab:
        raise WorkloadError(f"{where}: 'prompt' holds byte {max(data)}, not below the vocabulary size {vocab}")
    arrival = obj.get("arrival", 0)
    if not isinstance(arrival, int) or isinstance(arrival, bool) or not 0 <= arrival <= MAX_ARRIVAL:
        raise WorkloadError(f"{where}: 'arrival' must be an integer step in [0, {MAX_ARRIVAL}], got {arrival!r}")
    stop = obj.get("stop")
    if stop is not None and (not isinstance(stop, str) or len(stop.encode("utf-8")) != 1):
        raise WorkloadError(f"{where}: 'stop' must be a single one-byte character, got {stop!r}")
    stop_byte = stop.encode("utf-8")[0] if stop is not None else None
    if stop_byte is not None and stop_byte >= vocab:
        raise WorkloadError(f"{where}: 'stop' byte {stop_byte} is not below the vocabulary size {vocab}")
    return Request(rid=rid, prompt=data, max_new_tokens=new, arrival=arrival, stop=stop_byte)


# ---- preflight: what the run will allocate ------------------------------------------------------------

_F32 = 4
_INDEX_BYTES = 48
"""Per allocator index: a Python int in the free list (8 + 28 bytes), a live byte, slack."""


def _engine_bytes(c: HybridConfig, *, capacity: int, kv_capacity: int, max_len: int) -> int:
    """State pool, KV cache and token table of one model in one engine."""
    pool = (capacity + 1) * c.pool_layout().row_bytes
    kv = 2 * c.n_attn * (kv_capacity + 1) * c.attn_dim * _F32
    table = (capacity + 1) * max_len * 8
    return pool + kv + table


_SCAN_LIVE = 4
"""``[Q, Q, nheads]`` float32 tensors alive at once at the peak of the chunked SSD scan
(``backend.kernels.chunked._ssd_scan``: the masked log-decay differences, their exp, the ``C Bᵀ``
product and the decay-weighted product; measured on the CPU)."""


def _step_bytes(c: HybridConfig, cfg: ServeConfig, *, seq: int, tokens: int) -> int:
    """Working memory of the largest forward of one engine whose prefill sequences are at most
    ``seq`` tokens long and pack at most ``tokens`` tokens: verify states of every running row,
    attention scores of the prefill chunk (or the verify window) over the longest context, the
    chunked SSD scan of one Mamba layer (its ``[Q, Q, nheads]`` tensors with ``Q = min(chunk_size
    of the model, seq)``, and ``B``, ``C`` expanded to every head), activations of the widest layer."""
    rows = cfg.max_running
    verify = (cfg.k + 1) * rows * c.pool_layout().row_bytes
    queries = max(seq, cfg.k + 1)
    scores = 3 * rows * c.attn_heads * queries * cfg.max_len * _F32 if c.n_attn else 0
    q = min(c.chunk_size, seq)
    scan = _SCAN_LIVE * q * q * c.nheads * _F32 + 2 * tokens * c.nheads * c.d_state * _F32
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
) -> None:
    """``ServeError`` (one line, naming the model by ``names`` or the options) unless the models can
    be served together on the byte-level path and ``memory_estimate`` is within ``MAX_SERVE_BYTES``."""
    if draft is not None and cfg.k and draft.vocab != target.vocab:
        raise ServeError(f"{names[1]}: vocab {draft.vocab} does not match the vocab {target.vocab} of {names[0]}")
    for name, c in ((names[0], target), (names[1], draft if cfg.k else None)):
        if c is not None and c.vocab != BYTE_VOCAB:
            raise ServeError(f"{name}: vocab {c.vocab}; batchc run serves byte prompts and needs vocab {BYTE_VOCAB}")
    parts = memory_estimate(target, draft, cfg, compare_mutable=compare_mutable)
    total = sum(parts.values())
    if total > MAX_SERVE_BYTES:
        part, size = max(parts.items(), key=lambda kv: kv[1])
        raise ServeError(
            f"the run would need about {total / 2**30:.1f} GiB (largest part: {part}, {size / 2**30:.1f} GiB), over the "
            f"bound of {MAX_SERVE_BYTES >> 30} GiB; lower --max-running ({cfg.max_running}), --cache-entries "
            f"({cfg.cache_entries}), --k ({cfg.k}), --chunk-size ({cfg.chunk_size}) or --token-budget "
            f"({cfg.token_budget}), or use a smaller model"
        )


def _driver(target: HybridModel, draft: HybridModel | None, cfg: ServeConfig, pm: PassManager | None, cache: bool, k: int) -> Engine:
    total = cfg.max_running + (cfg.cache_entries if cache else 0) + 2
    return Engine(
        target, draft if k else None, k=k, capacity=total, kv_capacity=cfg.max_running * cfg.max_len + cfg.cache_entries * 128,
        max_len=cfg.max_len, chunk_size=cfg.chunk_size, token_budget=cfg.token_budget,
        prefix_cache=PrefixCache(capacity=cfg.cache_entries, block=cfg.cache_block) if cache else None, pm=pm,
    )


def serve(
    driver: Engine, workload: Sequence[Request], *, max_running: int, on_finish: Callable[[int], None] | None = None
) -> tuple[float, dict[str, int]]:
    """Admit requests as they arrive (scheduler steps) and while fewer than ``max_running`` are live."""
    queue = sorted(workload, key=lambda r: r.arrival)
    steps: dict[str, int] = {}
    step_no = 0
    t0 = time.perf_counter()
    done = 0
    while queue or driver.live:
        while queue and queue[0].arrival <= step_no and driver.live < max_running:
            r = queue.pop(0)
            driver.admit(r.rid, list(r.prompt), max_new_tokens=r.max_new_tokens, stop=r.stop)
        kind = driver.step().kind.value
        steps[kind] = steps.get(kind, 0) + 1
        step_no += 1
        if on_finish is not None and len(driver.outputs) != done:
            done = len(driver.outputs)
            on_finish(done)
    return time.perf_counter() - t0, steps


@attrs.frozen(kw_only=True)
class Sample:
    """The end of a prompt and its completion (bytes decoded with replacement)."""

    rid: int
    prompt: str
    completion: str


@attrs.frozen(kw_only=True)
class MutableRun:
    """The same workload through the mutable baseline (``compiler.tools.compare_mutable``)."""

    acceptance_rate: float
    mean_accepted_length: float
    init_ops_target: int
    init_ops_draft: int
    replays: int
    stale_ops_run: int
    wall_s: float
    tokens_per_s: float


_OPTIONAL = frozenset({
    "draft_clears_minted_consumed", "draft_cows_minted_consumed", "draft_snapshots_minted_consumed", "lossless_check",
    "lossless_ok", "mutable_baseline", "mutable_baseline_fixed",
})


@attrs.frozen(kw_only=True)
class ServeSummary:
    """What ``batchc run`` reports; ``to_json`` is what ``--json`` writes (the same field names,
    optional parts left out when they did not run)."""

    requests: int
    prompt_tokens: int
    generated_tokens: int
    k: int
    steps: int
    steps_by_kind: str
    wall_s: float
    tokens_per_s: float
    acceptance_rate: float
    mean_accepted_length: float
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prefix_cache_evictions: int
    retractions: int
    aborted_requests: int
    """Requests aborted because a forward carrying them failed."""
    failed_forwards: int
    first_failure: str | None
    target_clears_minted_consumed: str
    target_cows_minted_consumed: str
    target_snapshots_minted_consumed: str
    draft_clears_minted_consumed: str | None
    draft_cows_minted_consumed: str | None
    draft_snapshots_minted_consumed: str | None
    replays_blocked: int
    outstanding_tickets: int
    slots_live_after: int
    kv_live_after: int
    pass_us_per_step: dict[str, tuple[int, float]]
    """Pass name -> (calls, microseconds per call)."""
    samples: tuple[Sample, ...]
    lossless_check: str | None = None
    lossless_ok: bool | None = None
    mutable_baseline: MutableRun | None = None
    mutable_baseline_fixed: MutableRun | None = None

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in attrs.asdict(self).items() if not (k in _OPTIONAL and v is None)}


def run(
    workload: Sequence[Request],
    target: HybridModel,
    draft: HybridModel | None,
    cfg: ServeConfig,
    *,
    on_finish: Callable[[int], None] | None = None,
    compare_mutable: bool = False,
) -> ServeSummary:
    """Serve ``workload`` on the engine and summarise the run. ``compare_mutable`` only sizes the
    memory check for the baseline runs that ``compiler.tools.compare_mutable`` adds afterwards."""
    check_serving(target.config, draft.config if draft is not None else None, cfg, compare_mutable=compare_mutable)
    pm = PassManager.from_env()
    driver = _driver(target, draft, cfg, pm, cache=True, k=cfg.k)
    wall, steps = serve(driver, workload, max_running=cfg.max_running, on_finish=on_finish)
    driver.drop_cache()
    ledger = driver.ledger
    generated = sum(len(v) for v in driver.outputs.values())

    def minted_consumed(pool: PoolId) -> tuple[str, str, str]:
        """Clears, COWs and snapshots of ``pool``, each as "minted/consumed"."""
        m, c = ledger.minted(pool), ledger.counts(pool)
        return f"{m.clears}/{c.clears}", f"{m.cows}/{c.cows}", f"{m.snapshots}/{c.snapshots}"

    target_counts = minted_consumed(TARGET_POOL)
    draft_counts: tuple[str | None, str | None, str | None] = minted_consumed(DRAFT_POOL) if cfg.k else (None, None, None)

    lossless_check: str | None = None
    lossless_ok: bool | None = None
    sample = list(workload)[: cfg.lossless_sample]
    checked = [r for r in sample if r.rid not in driver.aborted_by_failure]  # an aborted request's output is cut short
    if sample:
        plain = _driver(target, None, cfg, None, cache=False, k=0)
        plain.chunk_size = cfg.max_len
        serve(plain, [attrs.evolve(r, arrival=0) for r in checked], max_running=cfg.max_running)
        same = not plain.aborted_by_failure and all(plain.outputs[r.rid] == driver.outputs[r.rid] for r in checked)
        skipped = f" ({len(sample) - len(checked)} aborted requests not compared)" if len(checked) < len(sample) else ""
        lossless_check = f"{'passed' if same else 'FAILED'}: {len(checked)} requests equal plain greedy of the target{skipped}"
        lossless_ok = same
    cache = driver.cache
    return ServeSummary(
        requests=len(workload),
        prompt_tokens=sum(len(r.prompt) for r in workload),
        generated_tokens=generated,
        k=cfg.k,
        steps=sum(steps.values()),
        steps_by_kind=", ".join(f"{k}={v}" for k, v in sorted(steps.items())),
        wall_s=wall,
        tokens_per_s=generated / wall if wall else 0.0,
        acceptance_rate=driver.stats.acceptance_rate,
        mean_accepted_length=driver.stats.mean_accepted_length,
        prefix_cache_hit_rate=cache.stats.hit_rate if cache is not None else 0.0,
        prefix_cache_hit_tokens=cache.stats.hit_tokens if cache is not None else 0,
        prefix_cache_evictions=cache.stats.evictions if cache is not None else 0,
        retractions=driver.stats.retractions,
        aborted_requests=len(driver.aborted_by_failure),
        failed_forwards=driver.stats.failed_steps,
        first_failure=driver.first_failure,
        replays_blocked=ledger.replays_blocked,
        outstanding_tickets=len(ledger.outstanding()),
        slots_live_after=driver.slots.num_live,
        kv_live_after=driver.kv.num_live,
        pass_us_per_step={name: (t.calls, t.seconds / t.calls * 1e6) for name, t in pm.timings().items()},
        samples=tuple(
            Sample(rid=int(r.rid), prompt=r.prompt[-40:].decode("utf-8", "replace"),
                   completion=bytes(driver.outputs[r.rid]).decode("utf-8", "replace"))
            for r in list(workload)[:3]
        ),
        target_clears_minted_consumed=target_counts[0],
        target_cows_minted_consumed=target_counts[1],
        target_snapshots_minted_consumed=target_counts[2],
        draft_clears_minted_consumed=draft_counts[0],
        draft_cows_minted_consumed=draft_counts[1],
        draft_snapshots_minted_consumed=draft_counts[2],
        lossless_check=lossless_check,
        lossless_ok=lossless_ok,
    )
