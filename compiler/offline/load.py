"""Where ``batchc run``'s requests come from: the built-in workload (``builtin_workload``) or a JSONL
file (``load_workload``), checked against the same bounds as ``Engine.admit``."""

from __future__ import annotations

import json
import os
import random
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from backend.files import file_kind
from compiler.offline.tokenizer import Tokenizer
from compiler.workload import (
    ARRIVALS,
    BURST_EVERY,
    BURST_SIZE,
    BYTE_VOCAB,
    MAX_ARRIVAL,
    MAX_BODY_SNIPPETS,
    MAX_REQUESTS,
    MAX_WORKLOAD_BYTES,
    SNIPPETS,
    SYSTEM_PREFIXES,
    Request,
    WorkloadError,
    context_overflow,
)
from ir.columns import int_problem
from ir.errors import IRValidationError, short_repr
from ir.ids import RequestId
from ir.sampling import FIELDS, GREEDY, SamplingParams

__all__ = ["CLI_DEFAULTS", "LINE_FIELDS", "builtin_workload", "load_workload", "sampling_params", "tokenize_workload", "tokenized_overflow"]

CLI_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")
"""The sampling fields ``batchc run`` takes a default for (``--temperature``, ``--top-p``,
``--top-k``, ``--min-p``)."""
LINE_FIELDS = frozenset({"prompt", "arrival"}) | FIELDS
"""The keys a workload line may hold: its prompt, its arrival step and any ``SamplingParams`` field."""


def sampling_params(fields: Mapping[str, object], defaults: Mapping[str, object], *, max_new_tokens: int) -> SamplingParams:
    """A request's ``SamplingParams``: each field is the request's own if it sets it, else the run's
    default for that field (``defaults``: ``--temperature`` and the like) if there is one, else
    ``GREEDY``'s (so ``temperature`` is 0, greedy, unless the request or the run sets it: a request
    that sets only ``top_p`` decodes greedily). ``IRValidationError`` names the first bad field."""
    return SamplingParams(**{**attrs.asdict(GREEDY, recurse=False), **defaults, **fields, "max_new_tokens": max_new_tokens})


def builtin_workload(
    *, num_requests: int = 64, max_new_tokens: int = 32, seed: int = 0, arrivals: str = "bursts",
    defaults: Mapping[str, object] | None = None,
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
    window over all of its requests; a trickle opens it over one request at a time.

    ``defaults``: the run's sampling defaults (``sampling_params``; ``IRValidationError`` names a bad
    one); without them every request is greedy."""
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
        new = rng.randint(max(1, max_new_tokens // 4), max_new_tokens)
        out.append(Request(rid=RequestId(i), prompt=prompt, max_new_tokens=new, arrival=arrival,
                           sampling=sampling_params({}, defaults or {}, max_new_tokens=new)))
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

    from backend.hybrid.config import MAX_VOCAB
    from compiler.engine.admission import MAX_LEN
    from ir.columns import int_problem

    if not isinstance(path, (str, os.PathLike)):
        raise WorkloadError(f"load_workload: path must be a str or a path, not {type(path).__name__} (got {path!r})")
    values: dict[str, int] = {}
    for name, value, lo, hi in (
        ("max_len", max_len, 1, MAX_LEN), ("reserve", reserve, 0, MAX_LEN), ("vocab", vocab, 1, MAX_VOCAB),
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
    path: str | Path, *, max_len: int, reserve: int = 8, vocab: int = BYTE_VOCAB, default_max_new_tokens: int = 32,
    tokenizer: Tokenizer | None = None, defaults: Mapping[str, object] | None = None,
) -> list[Request]:
    """The requests of the JSONL file ``path``, or ``WorkloadError`` naming the file and line.

    File limits: a regular file (not a FIFO, device or directory) of at most ``MAX_WORKLOAD_BYTES``
    (64 MiB), UTF-8, at most ``MAX_REQUESTS`` requests. Lines are split on ``"\\n"`` only, so a
    raw U+2028 or U+0085 inside a JSON string is part of the string; blank lines are skipped.

    A line is a JSON object with ``prompt`` (a non-empty string), optionally ``arrival`` (the
    scheduler step it arrives at) and any ``SamplingParams`` field under its name (``temperature``,
    ``top_p``, ..., ``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``max_new_tokens``
    (default ``default_max_new_tokens``), ``logprobs``, ``n``); any other key is refused. A field the
    line does not set, or sets to ``null``, takes ``defaults``' value for it (the run's ``--temperature`` and the like), else
    ``GREEDY``'s (``sampling_params``). A value ``SamplingParams`` refuses (a wrong type, a bool for a
    number, out of range, an empty, over-long or one-too-many stop string) is a ``WorkloadError``
    naming the line, the field and the value; so is a ``stop_token_ids`` id not below ``vocab``.
    ``stop`` is text (a string or a list of strings; the output ends before it, ``compiler.offline.stops``).

    Request limits, the same as ``Engine.admit``'s so that nothing loaded is refused mid-run:
    every prompt byte below ``vocab``, else ``WorkloadError``; and prompt bytes +
    ``max_new_tokens`` + ``reserve`` <= ``max_len`` (``reserve`` = k + 1 for speculative decoding
    with k draft tokens; the default 8 covers k <= 7), else that request alone is refused: it is
    returned with ``Request.refused`` saying why (file, line, sizes), never to be admitted.

    The arguments are checked first (``WorkloadError`` naming the argument and the value): ``path``
    a ``str`` or ``os.PathLike``; ``max_len``, ``reserve``, ``vocab`` and ``default_max_new_tokens``
    ints (never ``bool``, ``float``, ``str`` or ``None``) with ``max_len`` in
    ``[reserve + 2, compiler.engine.admission.MAX_LEN]``, ``reserve >= 0``, ``vocab`` in ``[1, MAX_VOCAB]`` (the
    model config's bound) and ``default_max_new_tokens >= 1``.

    With a ``tokenizer`` (a checkpoint's) the prompts are its ids (``Request.ids``) and the limits
    count them."""
    _check_workload_args(path, max_len=max_len, reserve=reserve, vocab=vocab, default_max_new_tokens=default_max_new_tokens)
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise WorkloadError(f"load_workload: tokenizer must be a Tokenizer (ByteTokenizer, HFTokenizer) or None, got {short_repr(tokenizer)}")
    p = Path(path)
    data = _read_bounded(p)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = data[: exc.start].count(b"\n") + 1
        raise WorkloadError(f"{p}: cannot read workload file ({exc}, line {at})") from None
    lines = text.split("\n")
    # the request count first: a file over the bound is refused before any line is parsed (at the
    # line that goes over it)
    count = 0
    for n, line in enumerate(lines, 1):
        if line.strip(" \t\r"):
            count += 1
            if count > MAX_REQUESTS:
                raise WorkloadError(f"{p}:{n}: more than {MAX_REQUESTS} requests")
    out: list[Request] = []
    for n, line in enumerate(lines, 1):
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
        out.append(_request(where, obj, RequestId(len(out)), max_len=max_len, reserve=reserve, vocab=vocab,
                            default_max_new_tokens=default_max_new_tokens, tokenizer=tokenizer, defaults=defaults or {}))
    if not out:
        raise WorkloadError(f"{p}: no requests")
    return out


def _request(where: str, obj: dict[str, Any], rid: RequestId, *, max_len: int, reserve: int, vocab: int,
             default_max_new_tokens: int, tokenizer: Tokenizer | None, defaults: Mapping[str, object]) -> Request:
    unknown = set(obj) - LINE_FIELDS
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {sorted(unknown)}")
    # null means "not given", as in batchc serve's and the OpenAI API's bodies: the field takes its
    # default (a null prompt is still no prompt)
    obj = {k: v for k, v in obj.items() if v is not None or k == "prompt"}
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
    sampling = _sampling(where, obj, new, vocab=vocab, defaults=defaults)
    if tokenizer is not None:
        return _tokenized(where, obj, rid, prompt, data, sampling, max_len=max_len, reserve=reserve, vocab=vocab, tokenizer=tokenizer)
    refused = _refusal(where, len(data), "bytes", new, max_len=max_len, reserve=reserve)
    if max(data) >= vocab:
        raise WorkloadError(f"{where}: 'prompt' holds byte {max(data)}, not below the vocabulary size {vocab}")
    return Request(rid=rid, prompt=data, max_new_tokens=new, arrival=_arrival(where, obj), sampling=sampling, refused=refused)


def _sampling(where: str, obj: dict[str, Any], new: int, *, vocab: int, defaults: Mapping[str, object]) -> SamplingParams:
    """The line's ``SamplingParams`` (``sampling_params``), or ``WorkloadError`` naming the line,
    the field and the value."""
    try:
        sampling = sampling_params({k: v for k, v in obj.items() if k in FIELDS and k != "max_new_tokens"}, defaults, max_new_tokens=new)
    except IRValidationError as exc:
        said = str(exc).removeprefix(f"{exc.node}.{exc.field}: ")
        raise WorkloadError(f"{where}: '{exc.field}': {said}") from None
    past = [t for t in sampling.stop_token_ids if t >= vocab]
    if past:
        raise WorkloadError(f"{where}: 'stop_token_ids' holds id {past[0]}, not below the model's vocabulary size {vocab}")
    return sampling


def _refusal(where: str, n: int, unit: str, new: int, *, max_len: int, reserve: int) -> str | None:
    """Why the request of line ``where`` is refused (it does not fit the context), or ``None``: a
    request that does not fit is refused on its own, the rest of the file is served."""
    why = context_overflow(n, unit, new, max_len=max_len, k=reserve - 1)
    return None if why is None else f"{where}: {why}"


def _arrival(where: str, obj: dict[str, Any]) -> int:
    arrival = obj.get("arrival", 0)
    if not isinstance(arrival, int) or isinstance(arrival, bool) or not 0 <= arrival <= MAX_ARRIVAL:
        raise WorkloadError(f"{where}: 'arrival' must be an integer step in [0, {MAX_ARRIVAL}], got {arrival!r}")
    return arrival


def _tokenized(where: str, obj: dict[str, Any], rid: RequestId, text: str, data: bytes, sampling: SamplingParams, *, max_len: int,
               reserve: int, vocab: int, tokenizer: Tokenizer) -> Request:
    """A workload line's request on a checkpoint's tokenizer: limits in tokens."""
    ids = tokenizer.encode(text)
    if not ids:
        raise WorkloadError(f"{where}: 'prompt' encodes to no tokens")
    new = sampling.max_new_tokens
    refused = _refusal(where, len(ids), "tokens", new, max_len=max_len, reserve=reserve)
    if max(ids) >= vocab:
        raise WorkloadError(f"{where}: the tokenizer gave id {max(ids)}, not below the model's vocabulary size {vocab}")
    return Request(rid=rid, prompt=data, max_new_tokens=new, arrival=_arrival(where, obj), sampling=sampling, ids=tuple(ids),
                   refused=refused)


def tokenized_overflow(workload: Sequence[Request], *, max_len: int, reserve: int) -> str | None:
    """Why the first of the built-in ``workload``'s requests on a tokenizer's ids does not fit a
    context of ``max_len`` (prompt tokens + new tokens + ``reserve`` = k + 1), or ``None`` when all fit."""
    for r in workload:
        if len(r.token_ids) + r.max_new_tokens + reserve > max_len:
            return (f"built-in request {r.rid}: {len(r.token_ids)} prompt tokens + {r.max_new_tokens} new tokens "
                    f"+ k + 1 = {reserve} exceed the context limit {max_len}; lower --max-new-tokens")
    return None


def tokenize_workload(workload: Sequence[Request], tokenizer: Tokenizer, *, vocab: int) -> list[Request]:
    """The built-in workload's requests on a checkpoint's tokenizer (their text is UTF-8)."""
    from backend.hybrid.config import MAX_VOCAB  # (here: ``sampling_params`` is read by batchc serve's torch-free HTTP side)

    if not isinstance(tokenizer, Tokenizer):
        raise WorkloadError(f"tokenize_workload: tokenizer must be a Tokenizer, got {short_repr(tokenizer)}")
    problem = int_problem(vocab)
    if problem is not None or not 1 <= int(vocab) <= MAX_VOCAB:
        raise WorkloadError(f"tokenize_workload: vocab must be an int in [1, {MAX_VOCAB}], got {short_repr(vocab)}")
    given: object = workload
    if not isinstance(given, (list, tuple)) or not all(isinstance(r, Request) for r in given):
        raise WorkloadError(f"tokenize_workload: workload must be a list of Request, got {short_repr(given)}")
    out = []
    for r in workload:
        ids = tokenizer.encode(r.prompt.decode("utf-8"))
        if not ids:
            raise WorkloadError(f"request {r.rid}: the prompt encodes to no tokens")
        if max(ids) >= vocab:
            raise WorkloadError(f"request {r.rid}: the tokenizer gave id {max(ids)}, not below the model's vocabulary size {vocab}")
        out.append(attrs.evolve(r, ids=tuple(ids)))
    return out


