"""``ir.sampling.SamplingParams``: defaults, normalisation, and one refusal per rule of its docstring
(each a one-line ``IRValidationError`` naming the field and the value); ``derive_seed``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ir.errors import IRValidationError
from ir.sampling import FIELDS, GREEDY, SEED_MAX, SamplingParams, derive_seed


def test_defaults_and_greedy() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.n, p.logprobs) == (1.0, 1.0, -1, 0.0, None, 1, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens, p.max_new_tokens) == ((), (), False, 0, 32)
    assert not p.greedy and not p.penalised
    assert GREEDY.greedy and GREEDY == SamplingParams(temperature=0)
    assert SamplingParams(repetition_penalty=1.1).penalised
    assert FIELDS == {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "stop", "stop_token_ids", "ignore_eos", "min_tokens", "max_new_tokens", "logprobs", "n"}


def test_normalised_values_compare_and_hash_alike() -> None:
    a = SamplingParams(temperature=1, top_k=np.int64(5), stop="ab", stop_token_ids=[np.int32(3)], seed=np.uint8(7), min_p=np.float32(0.5))
    b = SamplingParams(temperature=1.0, top_k=5, stop=["ab"], stop_token_ids=(3,), seed=7, min_p=0.5)
    assert a == b and hash(a) == hash(b)
    assert type(a.temperature) is float and type(a.top_k) is int and a.stop == ("ab",) and type(a.stop_token_ids[0]) is int
    # edges that are allowed
    SamplingParams(top_p=1.0, min_p=1.0, top_k=0, seed=0, presence_penalty=-2, frequency_penalty=2, n=16, logprobs=0, min_tokens=32)
    SamplingParams(seed=SEED_MAX, logprobs=20, stop=["x"] * 16, stop_token_ids=list(range(256)))


BAD = [
    ("temperature", -0.5, "must be >= 0"),
    ("temperature", math.nan, "must be >= 0 and finite"),
    ("temperature", math.inf, "finite"),
    ("temperature", True, "must be a number, not bool"),
    ("temperature", "1", "must be a number, not str"),
    ("top_p", 0.0, r"in \(0, 1\]"),
    ("top_p", 1.5, r"in \(0, 1\]"),
    ("top_p", math.nan, r"in \(0, 1\]"),
    ("min_p", -0.1, r"in \[0, 1\]"),
    ("min_p", 1.01, r"in \[0, 1\]"),
    ("top_k", -2, ">= -1"),
    ("top_k", 2.0, "must be an int, not float"),
    ("top_k", np.bool_(True), "must be an int, not bool"),
    ("seed", -1, r"\[0, 2\*\*63 - 1\]"),
    ("seed", 2**63, r"\[0, 2\*\*63 - 1\]"),
    ("seed", 1.0, "must be an int"),
    ("presence_penalty", 2.5, r"\[-2, 2\]"),
    ("frequency_penalty", -3, r"\[-2, 2\]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", math.inf, "finite"),
    ("stop", "", "must not be empty"),
    ("stop", ["a", ""], "must not be empty"),
    ("stop", ["a"] * 17, "at most 16"),
    ("stop", "x" * 257, "at most 256 characters"),
    ("stop", [1], "must be a str, not int"),
    ("stop", 3, "a str or a list of str"),
    ("stop_token_ids", [-1], ">= 0"),
    ("stop_token_ids", [1.0], "must be an int"),
    ("stop_token_ids", 5, "a list of int"),
    ("stop_token_ids", list(range(257)), "at most 256"),
    ("ignore_eos", 1, "must be a bool, not int"),
    ("min_tokens", -1, r"\[0, max_new_tokens = 32\]"),
    ("min_tokens", 33, r"\[0, max_new_tokens = 32\]"),
    ("max_new_tokens", 0, r"\[1, "),
    ("max_new_tokens", True, "must be an int, not bool"),
    ("logprobs", 21, r"\[0, 20\]"),
    ("logprobs", -1, r"\[0, 20\]"),
    ("n", 0, r"\[1, 16\]"),
    ("n", 17, r"\[1, 16\]"),
    ("n", 2.0, "must be an int"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD, ids=[f"{f}-{v!r}"[:40] for f, v, _ in BAD])
def test_bad_values_are_refused_naming_field_and_value(field: str, value: object, message: str) -> None:
    with pytest.raises(IRValidationError, match=rf"^SamplingParams\.{field}: .*{message}") as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]  # (deliberately ill-typed values)
    assert info.value.field == field
    assert "\n" not in str(info.value)


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=1.0)  # type: ignore[call-arg]  # (the misspelling is the point)


def test_derive_seed_is_a_fixed_function_of_run_seed_and_request() -> None:
    seeds = [derive_seed(0, rid) for rid in range(10_000)]
    assert len(set(seeds)) == 10_000 and all(0 <= s <= SEED_MAX for s in seeds)
    assert derive_seed(0, 5) == seeds[5] and derive_seed(1, 5) != seeds[5]
    # pinned: the same on every machine and Python (a change would change every unseeded run's output)
    assert derive_seed(0, 1) == 7544677968619910237
    p = SamplingParams(temperature=0.7)
    assert p.seeded(0, 1).seed == derive_seed(0, 1)
    assert SamplingParams(seed=3).seeded(0, 1).seed == 3 and GREEDY.seeded(0, 1) is GREEDY
