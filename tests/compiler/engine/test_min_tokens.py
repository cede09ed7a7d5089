"""``min_tokens`` in the sampler: a request's stop ids (its end-of-sequence ids included) are banned
(logit ``-inf``) while fewer than ``min_tokens`` tokens were generated, so the model cannot emit
them early (transformers' ``MinNewTokensLengthLogitsProcessor``, vLLM), greedy and sampled rows
alike, at k = 0 and through speculative verification; from index ``min_tokens`` on they may come
and end the request. The bundled target continues ``PROMPT`` greedily with ``"\n    def"``: its
first token and its sixth (``d``) each appear once there, so either, as a stop id, is the argmax
exactly where the test wants it.
"""

from __future__ import annotations

from functools import cache

import attrs
import pytest

from backend.hybrid.checkpoint import default_draft, default_target
from backend.hybrid.model import HybridModel
from compiler.engine import Engine
from ir.ids import RequestId
from ir.sampling import GREEDY, SamplingParams

PROMPT = list(b"import os\n")
NEW = 8


@cache
def _models() -> tuple[HybridModel, HybridModel]:
    return default_target(), default_draft()


def _serve(k: int, requests: list[tuple[list[int], SamplingParams]], new: int = NEW) -> list[list[int]]:
    target, draft = _models()
    eng = Engine(target, draft if k else None, k=k)
    for i, (stop, params) in enumerate(requests):
        eng.admit(RequestId(i), PROMPT, max_new_tokens=new, stop=stop or None, sampling=attrs.evolve(params, max_new_tokens=new))
    eng.run_until_done()
    eng.close()
    return [eng.outputs[RequestId(i)] for i in range(len(requests))]


@cache
def _free() -> list[int]:
    (out,) = _serve(0, [([], GREEDY)])
    assert out[0] not in out[1:6] and out[5] not in out[:5], out
    return out


@pytest.mark.parametrize("k", [0, 2])
def test_a_greedy_stop_id_is_banned_before_min_tokens_and_allowed_after(k: int) -> None:
    free = _free()
    s0, s5 = free[0], free[5]
    out = _serve(k, [
        ([s0], attrs.evolve(GREEDY, min_tokens=3)),  # the argmax at index 0 is the stop id: banned there
        ([s5], attrs.evolve(GREEDY, min_tokens=5)),  # the argmax at index 5: allowed there, and it ends the request
        ([s5], attrs.evolve(GREEDY, min_tokens=6)),  # banned at index 5
        ([s0], GREEDY),  # no min_tokens: ends at once
    ])
    assert out[0][0] != s0 and s0 not in out[0][:3] and len(out[0]) >= 3, out[0]
    assert out[1] == free[:6]
    assert out[2][:5] == free[:5] and out[2][5] != s5, out[2]
    assert out[3] == [s0]


def test_sampled_rows_never_emit_a_banned_id_before_min_tokens() -> None:
    free = _free()
    stops = free[:3]  # the likeliest first tokens
    params = [SamplingParams(temperature=1.0, seed=seed, min_tokens=4, stop_token_ids=stops) for seed in range(12)]
    for k in (0, 2):
        outs = _serve(k, [([], p) for p in params])
        for out in outs:
            assert not set(out[:4]) & set(stops), out
            assert len(out) >= 4
    # the same seeds without min_tokens do stop early somewhere (the ban made the difference)
    early = _serve(0, [([], attrs.evolve(p, min_tokens=0)) for p in params])
    assert any(len(out) < 4 for out in early), early
