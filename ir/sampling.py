"""How a request's tokens are chosen: ``SamplingParams``, one frozen, validated value per request.

The names and meanings are the OpenAI API's and vLLM's:

- ``temperature``: 0 is greedy (argmax; every other sampling field is then ignored), otherwise the
  logits are divided by it before the filters below. Default 1.0 (OpenAI, vLLM); ``GREEDY`` is the
  value a request gets when it asks for nothing.
- ``top_k`` (-1 or 0: off), ``top_p`` (1: off), ``min_p`` (0: off): the filters of transformers'
  ``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper``, applied in that order after
  the temperature (``backend.sampling.distribution``).
- ``presence_penalty`` and ``frequency_penalty`` (OpenAI semantics, over the generated tokens):
  ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``.
- ``repetition_penalty`` (transformers semantics, over the prompt and the generated tokens): a seen
  token's logit is divided by it when positive, multiplied by it when negative; 1 is off.
- ``seed``: the key of the request's random stream (``backend.rng``); ``None`` until the run
  derives one (``derive_seed``) for a sampled request that set none.
- ``stop`` (a string or a list of strings; the text ends before the stop string), ``stop_token_ids``,
  ``ignore_eos``, ``min_tokens`` (no end-of-sequence or stop token id before this many tokens),
  ``max_new_tokens``, ``logprobs`` (``None``: none; 0 to 20 alternatives per position) and ``n``
  (completions per prompt).

Invariants (checked on construction; ``IRValidationError`` naming the field and the value, one line):

- numbers are numbers: a ``bool`` is not a number, a float is not an integer (``top_k=2.0`` is
  refused); integer fields take Python or numpy integers, float fields also take integers;
- ``temperature`` >= 0 and finite; ``top_p`` in (0, 1]; ``min_p`` in [0, 1]; ``top_k`` >= -1;
  ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (the OpenAI range);
  ``repetition_penalty`` > 0 and finite;
- ``seed`` is ``None`` or in [0, 2**63 - 1];
- ``stop`` holds at most ``MAX_STOP_STRINGS`` non-empty strings of at most ``MAX_STOP_CHARS``
  characters each; ``stop_token_ids`` at most ``MAX_STOP_TOKEN_IDS`` ids, each >= 0;
- 1 <= ``max_new_tokens`` <= ``MAX_SEQ_LEN``; 0 <= ``min_tokens`` <= ``max_new_tokens``;
  ``logprobs`` is ``None`` or in [0, ``MAX_LOGPROBS``]; 1 <= ``n`` <= ``MAX_N``;
- ``ignore_eos`` is a ``bool``.

After construction ``stop`` is a tuple of str, ``stop_token_ids`` a tuple of int, the float fields
are ``float`` and the integer fields ``int``: two values built from equal inputs are equal and hash
alike. Unknown fields are refused by the constructor (``TypeError``); ``FIELDS`` names the known
ones for whoever reads them from a dict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar, Final, final

import attrs
import numpy as np

from ir.columns import F64, I64, MAX_SEQ_LEN, REQUEST, BoolArray, ColumnNode, as_f64, as_i64, build_unchecked, column, own, per, tokens_of
from ir.errors import IRValidationError

__all__ = [
    "FIELDS",
    "GREEDY",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "SEED_MAX",
    "SamplingParams",
    "SamplingRows",
    "derive_seed",
    "rows_joined",
    "rows_take",
]

MAX_N: Final = 16
MAX_LOGPROBS: Final = 20
MAX_STOP_STRINGS: Final = 16
MAX_STOP_CHARS: Final = 256
MAX_STOP_TOKEN_IDS: Final = 256
SEED_MAX: Final = 2**63 - 1
PENALTY_BOUND: Final = 2.0
DEFAULT_MAX_NEW_TOKENS: Final = 32
"""The workload file's default (``compiler.offline.load``)."""

_NAME = "SamplingParams"


def _bad(field: str, value: object, message: str) -> IRValidationError:
    return IRValidationError(_NAME, field, value, message)


def _int(field: str, value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise _bad(field, value, f"must be an int, not {type(value).__name__}")
    return int(value)


def _float(field: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer, float, np.floating)):
        raise _bad(field, value, f"must be a number, not {type(value).__name__}")
    return float(value)


def _opt_int(field: str, value: object) -> int | None:
    return None if value is None else _int(field, value)


def _stop(value: object) -> tuple[str, ...]:
    items: Sequence[object]
    if isinstance(value, str):
        items = (value,)
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        raise _bad("stop", value, f"must be a str or a list of str, not {type(value).__name__}")
    if len(items) > MAX_STOP_STRINGS:
        raise _bad("stop", value, f"holds {len(items)} strings, at most {MAX_STOP_STRINGS} allowed")
    for s in items:
        if not isinstance(s, str):
            raise _bad("stop", s, f"each stop must be a str, not {type(s).__name__}")
        if not s:
            raise _bad("stop", s, "a stop string must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise _bad("stop", s, f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(s)}")
    return tuple(str(s) for s in items)


def _stop_token_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise _bad("stop_token_ids", value, f"must be a list of int, not {type(value).__name__}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise _bad("stop_token_ids", value, f"holds {len(value)} ids, at most {MAX_STOP_TOKEN_IDS} allowed")
    ids = tuple(_int("stop_token_ids", v) for v in value)
    for t in ids:
        if t < 0:
            raise _bad("stop_token_ids", t, "a token id must be >= 0")
    return ids


def _bool(field: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise _bad(field, value, f"must be a bool, not {type(value).__name__}")
    return bool(value)


@final
@attrs.frozen(kw_only=True)
class SamplingParams:
    """One request's sampling parameters (module docstring: names, meanings, invariants)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_token_ids)
    ignore_eos: bool = False
    min_tokens: int = 0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    logprobs: int | None = None
    n: int = 1

    def __attrs_post_init__(self) -> None:
        given = attrs.asdict(self, recurse=False)
        for name, check in _TYPED:
            # normalise in place (the value is not yet shared): an int temperature becomes a
            # float, a numpy integer an int, so equal inputs give equal, equally hashed values
            object.__setattr__(self, name, check(name, given[name]))
        t = self.temperature
        if not (math.isfinite(t) and t >= 0.0):
            raise _bad("temperature", t, "must be >= 0 and finite (0 is greedy)")
        if not (0.0 < self.top_p <= 1.0):  # (NaN fails every comparison: refused too)
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        if self.top_k < -1:
            raise _bad("top_k", self.top_k, "must be >= -1 (-1 or 0: off)")
        if self.seed is not None and not (0 <= self.seed <= SEED_MAX):
            raise _bad("seed", self.seed, "must be in [0, 2**63 - 1]")
        for name, v in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            if not (-PENALTY_BOUND <= v <= PENALTY_BOUND):
                raise _bad(name, v, "must be in [-2, 2]")
        r = self.repetition_penalty
        if not (math.isfinite(r) and r > 0.0):
            raise _bad("repetition_penalty", r, "must be > 0 and finite (1 is off)")
        if not (1 <= self.max_new_tokens <= MAX_SEQ_LEN):
            raise _bad("max_new_tokens", self.max_new_tokens, f"must be in [1, {MAX_SEQ_LEN}]")
        if not (0 <= self.min_tokens <= self.max_new_tokens):
            raise _bad("min_tokens", self.min_tokens, f"must be in [0, max_new_tokens = {self.max_new_tokens}]")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise _bad("logprobs", self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        if not (1 <= self.n <= MAX_N):
            raise _bad("n", self.n, f"must be in [1, {MAX_N}]")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the token is the argmax, no random stream is read."""
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether any penalty is on (the sampler then needs the request's token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def seeded(self, run_seed: int, request_id: int) -> SamplingParams:
        """This value with its ``seed`` set: its own if it has one, else ``derive_seed(run_seed,
        request_id)``; greedy values are returned as they are (they read no random stream)."""
        if self.seed is not None or self.greedy:
            return self
        return attrs.evolve(self, seed=derive_seed(run_seed, request_id))


_TYPED: Final[tuple[tuple[str, Callable[[str, object], object]], ...]] = (
    *((name, _float) for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")),
    *((name, _int) for name in ("top_k", "min_tokens", "max_new_tokens", "n")),
    *((name, _opt_int) for name in ("seed", "logprobs")),
    ("ignore_eos", _bool),
)

GREEDY: Final = SamplingParams(temperature=0.0)
"""What a request that sets no sampling field gets: greedy decoding, as batchc did before sampling."""

FIELDS: Final = frozenset(a.name for a in attrs.fields(SamplingParams))
"""The field names a request may carry (a workload line's other keys are not sampling fields)."""

_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    # splitmix64's finaliser: a bijection of 64-bit words whose every output bit depends on every
    # input bit
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def derive_seed(run_seed: int, request_id: int) -> int:
    """The seed of a sampled request that set none: a hash of the run's seed and the request id, in
    [0, 2**63 - 1]. Pure integer arithmetic (the same on every machine and Python), so a run with
    the same ``--seed`` gives each request the same stream whatever it is batched with; distinct
    request ids of one run always get distinct seeds before the final 63-bit truncation (``_mix64``
    is a bijection), so two collide only with probability about 2**-63 per pair."""
    run = _int("seed", run_seed) & _M64
    rid = _int("request_id", request_id) & _M64
    return _mix64(_mix64(run ^ 0x5EED5EED5EED5EED) ^ rid) >> 1


@final
@attrs.frozen(kw_only=True)
class SamplingRows(ColumnNode):
    """The sampling parameters of a batch's rows, one entry per row in each column: the IR columns
    the one sampler (``backend.sampling``) reads, all rows at once. A batch or plan holds one in its
    ``sampling`` field, aligned with its rows (``None``: every row greedy, as before sampling);
    every pass that selects, reorders or joins rows does the same to these (``take``, ``joined``).

    ``seed`` and ``index`` (the completion index among the prompt's ``n``) key the row's random
    stream; a greedy row's (temperature 0) are 0 and never read. ``logprobs`` is -1 where the row
    asks for none, else the alternatives per position (0 to ``MAX_LOGPROBS``).

    ``min_tokens`` (transformers' ``MinNewTokensLengthLogitsProcessor``, vLLM): the row's ids
    ``banned`` (packed, ``banned_lens[i]`` of them for row ``i``: its stop ids, end-of-sequence
    included) get logit ``-inf`` while the token being chosen sits at an absolute position below
    ``ban_until[i]`` (prompt length + ``min_tokens``; 0: no ban), greedy rows too, so they cannot
    be emitted early. An absolute position keeps the ban right through chunking, decoding,
    speculation and retraction (a retracted prompt grows by the output, the position does not move).

    Invariants (``IRValidationError``): the ranges of ``SamplingParams`` per entry (temperature >= 0
    and finite, top_p in (0, 1], min_p in [0, 1], top_k >= -1, presence and frequency penalties in
    [-2, 2], repetition penalty > 0 and finite, seed in [0, 2**63 - 1], index in [0, MAX_N),
    logprobs in [-1, MAX_LOGPROBS]); NaN is refused everywhere; ``ban_until`` in [0, MAX_SEQ_LEN],
    ``banned_lens`` >= 0, ``banned`` ids >= 0 and ``sum(banned_lens)`` of them."""

    ALIGNED: ClassVar[bool] = True

    temperature: F64 = column(converter=as_f64, metadata=per(REQUEST, text="temp"))
    top_k: I64 = column(converter=as_i64, metadata=per(REQUEST, min=-1, text="top_k"))
    top_p: F64 = column(converter=as_f64, metadata=per(REQUEST, text="top_p"))
    min_p: F64 = column(converter=as_f64, metadata=per(REQUEST, text="min_p"))
    presence_penalty: F64 = column(converter=as_f64, metadata=per(REQUEST, text="presence"))
    frequency_penalty: F64 = column(converter=as_f64, metadata=per(REQUEST, text="frequency"))
    repetition_penalty: F64 = column(converter=as_f64, metadata=per(REQUEST, text="repetition"))
    seed: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text="seed"))
    index: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, max=MAX_N - 1, text="index"))
    logprobs: I64 = column(converter=as_i64, metadata=per(REQUEST, min=-1, max=MAX_LOGPROBS, text="logprobs"))
    ban_until: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, max=MAX_SEQ_LEN, text="ban_until"))
    banned_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, text="bans"))
    banned: I64 = column(converter=as_i64, metadata=per(tokens_of("banned_lens"), min=0, text="banned"))

    def _check(self) -> None:
        def refuse(name: str, arr: F64, ok: BoolArray, rule: str) -> None:
            if not ok.all():
                raise IRValidationError("SamplingRows", name, float(arr[~ok][0]), rule)

        t = self.temperature
        refuse("temperature", t, np.isfinite(t) & (t >= 0.0), "must be >= 0 and finite (0 is greedy)")
        refuse("top_p", self.top_p, (self.top_p > 0.0) & (self.top_p <= 1.0), "must be in (0, 1]")
        refuse("min_p", self.min_p, (self.min_p >= 0.0) & (self.min_p <= 1.0), "must be in [0, 1]")
        for name, v in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            refuse(name, v, (v >= -PENALTY_BOUND) & (v <= PENALTY_BOUND), "must be in [-2, 2]")
        r = self.repetition_penalty
        refuse("repetition_penalty", r, np.isfinite(r) & (r > 0.0), "must be > 0 and finite (1 is off)")

    @classmethod
    def of(cls, params: Sequence[SamplingParams], indices: Sequence[int] | None = None,
           bans: Sequence[tuple[int, Sequence[int]]] | None = None) -> SamplingRows:
        """The rows of ``params`` (completion ``indices``, default 0 each; ``bans``: each row's
        ``ban_until`` and banned ids, default none). A sampled row must carry its seed
        (``SamplingParams.seeded``): ``IRValidationError`` naming the row otherwise."""
        for i, p in enumerate(params):
            if p.seed is None and not p.greedy:
                raise IRValidationError("SamplingRows", "seed", None, f"row {i} is sampled (temperature {p.temperature}) and has no seed (SamplingParams.seeded)")
        ban = list(bans) if bans is not None else [(0, ())] * len(params)
        return cls(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            presence_penalty=[p.presence_penalty for p in params],
            frequency_penalty=[p.frequency_penalty for p in params],
            repetition_penalty=[p.repetition_penalty for p in params],
            seed=[p.seed or 0 for p in params],
            index=list(indices) if indices is not None else [0] * len(params),
            logprobs=[-1 if p.logprobs is None else p.logprobs for p in params],
            ban_until=[until for until, _ in ban],
            banned_lens=[len(ids) for _, ids in ban],
            banned=[t for _, ids in ban for t in ids],
        )

    @classmethod
    def greedy(cls, n: int) -> SamplingRows:
        """``n`` rows of ``GREEDY``."""
        return _GREEDY_ROWS.take(np.zeros(n, dtype=np.int64))

    @property
    def all_greedy(self) -> bool:
        """Every row takes its argmax (temperature 0), asks for no logprobs and bans nothing: the
        sampler has nothing to do past ``greedy_or_flag``."""
        return not self.temperature.any() and bool((self.logprobs < 0).all()) and not self.bans_any

    @property
    def bans_any(self) -> bool:
        """Some row bans ids before some position (``min_tokens``)."""
        return bool(((self.ban_until > 0) & (self.banned_lens > 0)).any())

    def take(self, rows: I64 | BoolArray) -> SamplingRows:
        """The rows ``rows`` selects (a boolean mask, or row indices in the new order); each row's
        packed ``banned`` ids go with it."""
        # rows of a checked node, each entry kept whole: every local check still holds
        cols = {name: col[rows] for name, col in attrs.asdict(self, recurse=False).items() if name != "banned"}
        lens = self.banned_lens
        starts = (np.cumsum(lens) - lens)[rows]
        new_lens = cols["banned_lens"]
        # entry j of the result is the old entry j - (its row's new start) + (its row's old start)
        shift = np.repeat(starts - (np.cumsum(new_lens) - new_lens), new_lens)
        cols["banned"] = self.banned[np.arange(int(new_lens.sum()), dtype=np.int64) + shift]
        return build_unchecked(SamplingRows, **{name: own(col) for name, col in cols.items()})

    def joined(self, other: SamplingRows) -> SamplingRows:
        """These rows, then ``other``'s (every column concatenates, the packed ``banned`` too: its
        rows keep their order)."""
        mine, theirs = attrs.asdict(self, recurse=False), attrs.asdict(other, recurse=False)
        return build_unchecked(SamplingRows, **{name: own(np.concatenate((mine[name], theirs[name]))) for name in mine})


_GREEDY_ROWS: Final = SamplingRows.of([GREEDY])


def rows_take(rows: SamplingRows | None, select: I64 | BoolArray) -> SamplingRows | None:
    """``rows.take(select)``, or ``None`` for a batch whose rows are all greedy."""
    return None if rows is None else rows.take(select)


def rows_joined(a: SamplingRows | None, na: int, b: SamplingRows | None, nb: int) -> SamplingRows | None:
    """The sampling rows of ``na`` rows then ``nb`` rows: ``None`` when both are ``None`` (all
    greedy), else both sides as columns (``greedy`` rows for a ``None`` side)."""
    if a is None and b is None:
        return None
    if nb == 0 and a is not None:
        return a
    if na == 0 and b is not None:
        return b
    return (a if a is not None else SamplingRows.greedy(na)).joined(b if b is not None else SamplingRows.greedy(nb))
