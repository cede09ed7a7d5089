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
from typing import Final, final

import attrs
import numpy as np

from ir.columns import MAX_SEQ_LEN
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
    "derive_seed",
]

MAX_N: Final = 16
MAX_LOGPROBS: Final = 20
MAX_STOP_STRINGS: Final = 16
MAX_STOP_CHARS: Final = 256
MAX_STOP_TOKEN_IDS: Final = 256
SEED_MAX: Final = 2**63 - 1
PENALTY_BOUND: Final = 2.0
DEFAULT_MAX_NEW_TOKENS: Final = 32
"""The workload file's default (``compiler.serve.load``)."""

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
