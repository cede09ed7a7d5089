"""A model whose tokens depend on its Mamba state, so that a test comparing tokens sees a state bug.

On a hybrid model the attention layers see the whole context through the KV cache, which no Mamba
state bug touches, and a Mamba layer of short memory forgets a wrong start within a few tokens. Both
hide a state bug from a token comparison: on batchc's own tiny test model (``backend.hybrid.tiny``,
seed 0) and on the bundled trained target, a request whose Mamba state is zeroed at the end of a
shared prefix (a copy from an all-zero row), then prefilled over the rest of its prompt, gives the
same greedy tokens as the correct run for most prompts (measured: ``tests/testing/test_models.py``).

``state_sensitive(model)`` returns a copy of a model in which every piece of context reaches the
output through the Mamba states:

- every attention layer's output projection (``o_proj``) is zero: attention adds nothing to the
  residual stream (its KV cache is still written and read, so every attention path still runs);
- every Mamba layer remembers for hundreds of tokens: ``A`` drawn log-uniform in [0.02, 0.2] per
  head and the bias of ``dt`` set so that ``dt`` is log-uniform in [0.02, 0.1] at a zero input, so
  a token's share of the state decays by ``exp(-dt * A)``, 0.96 to 0.9996 a token (the input's own
  part of ``dt`` still selects);
- ``D`` is zero: a Mamba layer's output is read from its state only, not from the token itself.

A zeroed state then changes the greedy tokens that follow, whether it is zeroed after the whole
prompt or at a prefix inside it (``greedy_continuation``'s ``zero_state_at``). The model is served
by every path a hybrid model is (chunked prefill, prefix-cache copies, speculation, padding), and
its outputs are whatever its weights give: use it where a test compares an engine's tokens with a
reference run's, beside the from-scratch state comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from backend.hybrid.model import HybridModel, greedy
from ir.errors import short_repr

__all__ = ["greedy_continuation", "state_sensitive"]

MEMORY_A = (0.02, 0.2)
"""The range (log-uniform) of a Mamba head's decay rate ``A = exp(A_log)``."""
MEMORY_DT = (0.02, 0.1)
"""The range (log-uniform) of a Mamba head's step ``dt`` at a zero input (``softplus(dt_bias)``)."""


def _model(fn: str, model: object) -> HybridModel:
    if not isinstance(model, HybridModel):
        raise TypeError(f"{fn}: model must be a backend.hybrid.HybridModel, got {short_repr(model)} ({type(model).__name__})")
    return model


def _int(fn: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{fn}: {name} must be an int >= {minimum}, got {short_repr(value)}")
    return value


def _log_uniform(n: int, bounds: tuple[float, float], gen: torch.Generator) -> torch.Tensor:
    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    return torch.exp(torch.rand(n, generator=gen, dtype=torch.float64) * (hi - lo) + lo)


def state_sensitive(model: HybridModel, *, seed: int = 0) -> HybridModel:
    """A copy of ``model`` (same config, dtype and device; its weights untouched) whose attention
    output projections are zero and whose Mamba layers have long memory and no ``D`` skip (the
    module docstring), the decay rates and steps drawn from ``seed``. ``TypeError``/``ValueError``
    naming the argument otherwise."""
    model = _model("state_sensitive", model)
    gen = torch.Generator().manual_seed(_int("state_sensitive", "seed", seed, 0))
    weights = dict(model.weights)
    for i, kind in enumerate(model.config.layers):
        p = f"layers.{i}.mixer"
        if kind == "attn":
            weights[f"{p}.o_proj"] = torch.zeros_like(model.weights[f"{p}.o_proj"])
        elif kind == "mamba":
            like = model.weights[f"{p}.A_log"]
            a = _log_uniform(like.numel(), MEMORY_A, gen)
            dt = _log_uniform(like.numel(), MEMORY_DT, gen)
            weights[f"{p}.A_log"] = torch.log(a).to(like)
            weights[f"{p}.dt_bias"] = (dt + torch.log(-torch.expm1(-dt))).to(like)  # softplus^-1(dt)
            weights[f"{p}.D"] = torch.zeros_like(model.weights[f"{p}.D"])
    return HybridModel(model.config, weights)


def _tokens(fn: str, model: HybridModel, prompt: object) -> list[int]:
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not prompt:
        raise ValueError(f"{fn}: prompt must be a non-empty sequence of token ids, got {short_repr(prompt)}")
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < model.vocab:
            raise ValueError(f"{fn}: prompt holds {short_repr(t)}, not a token id in [0, {model.vocab})")
    return [int(t) for t in prompt]


def _cut(fn: str, value: object, length: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= length):
        raise ValueError(f"{fn}: zero_state_at must be None or an int in [1, {length}] (the prompt's length), got {short_repr(value)}")


def greedy_continuation(model: HybridModel, prompt: Sequence[int], new_tokens: int, *, zero_state_at: int | None = None) -> list[int]:
    """The ``new_tokens`` greedy tokens ``model`` gives after ``prompt``, through its own entry points
    (the prompt's prefill, then one decode per token, one request in slot 1 of a fresh pool, on the
    model's device). ``zero_state_at``: every Mamba layer's conv and SSM state of the request is
    zeroed after its first ``zero_state_at`` prompt tokens (1 to ``len(prompt)``; the prompt is
    then prefilled in two chunks split there), as a copy from an all-zero row would leave it; the
    KV cache keeps every token. ``TypeError``/``ValueError`` naming the bad argument."""
    fn = "greedy_continuation"
    model = _model(fn, model)
    tokens = _tokens(fn, model, prompt)
    total = len(tokens) + _int(fn, "new_tokens", new_tokens, 1)
    _cut(fn, zero_state_at, len(tokens))
    device = model.device
    pool, kv, table = model.new_pool(2), model.new_kv_cache(total + 1), model.new_token_table(2, total)
    slot = torch.ones(1, dtype=torch.int64, device=device)

    def ids(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=device)

    def extend(start: int, stop: int) -> torch.Tensor:
        chunk = tokens[start:stop]
        out = model.extend(pool, kv, table, slots=slot, cu_seqlens=ids([0, len(chunk)]), prefix_lens=ids([start]), input_ids=ids(chunk),
                           positions=ids(range(start, stop)), kv_locs=ids(range(1 + start, 1 + stop)))
        return out.logits

    cut = len(tokens) if zero_state_at is None else zero_state_at
    logits = extend(0, cut)
    if zero_state_at is not None:
        for layer in range(len(pool.layout.layers)):
            pool.conv_state(layer)[1].zero_()
            pool.ssm_state(layer)[1].zero_()
        if cut < len(tokens):
            logits = extend(cut, len(tokens))
    out = [int(greedy(logits)[0])]
    for pos in range(len(tokens), total - 1):
        step = model.decode(pool, kv, table, slots=slot, input_ids=ids([out[-1]]), positions=ids([pos]), kv_locs=ids([1 + pos]))
        out.append(int(greedy(step.logits)[0]))
    return out
