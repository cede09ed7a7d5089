"""An attention-free model (Mamba layers only, like the bundled draft): its whole context lives in
its recurrent state. Extend, decode, verify + commit against the cache-free reference, and a
speculative run with it as the draft of a hybrid target."""

from __future__ import annotations

import attrs
import torch

from backend.hybrid import HybridModel, tiny
from backend.hybrid.reference import greedy_generate_reference, reference_logits
from compiler.engine import Engine
from compiler.testing.models import state_sensitive
from ir.ids import DRAFT_POOL, TARGET_POOL, RequestId
from tests.helpers import BYTE_PROMPTS, DEVICE, Backend, assert_close, grid, ids

MAMBA_ONLY = attrs.evolve(tiny(), layers=("mamba", "mamba"))


def _model(seed: int = 0) -> HybridModel:
    return HybridModel.from_seed(MAMBA_ONLY, seed, device=DEVICE)


def test_the_config_has_no_attention_and_an_empty_kv_cache() -> None:
    model = _model()
    assert MAMBA_ONLY.n_attn == 0 and MAMBA_ONLY.n_mamba == 2
    kv = model.new_kv_cache(16)
    assert kv.k.shape[0] == 0 and kv.v.shape[0] == 0
    assert not any(name.startswith("layers.") and ".q_proj" in name for name in model.weights)


def test_extend_chunks_and_decode_match_the_reference() -> None:
    model = _model()
    be = Backend(model)
    prompt = BYTE_PROMPTS[1]
    out = be.extend([(1, prompt[:9], 0), (2, BYTE_PROMPTS[0], 0)])
    assert_close(out.logits[1], reference_logits(model, BYTE_PROMPTS[0])[-1])
    out = be.extend([(1, prompt[9:], 9)])  # a continuation chunk starts from the state, nothing else
    assert_close(out.logits[0], reference_logits(model, prompt)[-1])
    seq = list(prompt)
    for token in b" x + 1":
        out = be.decode([(1, token, len(seq))])
        seq.append(token)
        assert_close(out.logits[0], reference_logits(model, seq)[-1])


def test_a_cleared_state_forgets_the_whole_context() -> None:
    # what a replayed clear does to this model: with no attention, nothing else remembers the prompt
    model = _model()
    be = Backend(model)
    prompt = BYTE_PROMPTS[1]
    be.extend([(1, prompt[:-1], 0)])
    be.pool.buffer[1] = 0  # a stale clear of the live slot
    out = be.decode([(1, prompt[-1], len(prompt) - 1)])
    assert_close(out.logits[0], reference_logits(model, prompt[-1:])[-1])
    assert not torch.allclose(out.logits[0], reference_logits(model, prompt)[-1], atol=1e-3)


def test_verify_then_commit_equals_decoding() -> None:
    model = _model()
    prompt = BYTE_PROMPTS[0]
    start = len(prompt) - 1
    drafts = [[prompt[-1], *b"ump"], [prompt[-1], *b"ox "]]
    accept = [2, 0]
    ver, dec = Backend(model), Backend(model)
    for be in (ver, dec):
        be.extend([(1, prompt[:-1], 0), (2, prompt[:-1], 0)])
    out = model.verify(
        ver.pool, ver.kv, ver.table, slots=ids([1, 2]), input_ids=grid(drafts),
        positions=grid([list(range(start, start + 4))] * 2), kv_locs=grid([ver.alloc(4) for _ in drafts]),
    )
    model.commit(ver.pool, out.states, accept_pos=ids(accept), slots=ids([1, 2]))
    for slot, draft, a in zip((1, 2), drafts, accept, strict=True):
        for t in range(a + 1):
            dec.decode([(slot, draft[t], start + t)])
        assert_close(out.logits[slot - 1], reference_logits(model, prompt[:-1] + draft)[start:])
    assert_close(ver.pool.buffer.view(torch.float32), dec.pool.buffer.view(torch.float32))


def test_greedy_generation_equals_the_reference() -> None:
    model = _model(seed=3)
    be = Backend(model)
    out = be.extend([(1, BYTE_PROMPTS[2], 0)])
    got, n = [], len(BYTE_PROMPTS[2])
    for _ in range(12):
        token = int(out.logits[0].argmax())
        got.append(token)
        out = be.decode([(1, token, n)])
        n += 1
    assert got == greedy_generate_reference(model, BYTE_PROMPTS[2], 12)


def test_as_the_draft_of_a_hybrid_target_speculation_is_lossless() -> None:
    """On the tiny target made state-sensitive (``compiler.testing.models.state_sensitive``), whose
    tokens change when its Mamba state is wrong, where its attention would carry the context past it."""
    target = state_sensitive(HybridModel.from_seed(tiny(), 0, device=DEVICE))
    draft = _model(seed=1)
    spec = Engine(target, draft, k=3, capacity=4, kv_capacity=512, max_len=96)
    for i, p in enumerate(BYTE_PROMPTS):
        spec.admit(RequestId(i), p, max_new_tokens=10)
    spec.run_until_done()
    # the oracle is the from-scratch reference model, not the engine at k = 0
    assert spec.outputs == {RequestId(i): greedy_generate_reference(target, p, 10) for i, p in enumerate(BYTE_PROMPTS)}
    assert spec.stats.iterations > 0
    assert spec.ledger.counts(DRAFT_POOL) == spec.ledger.counts(TARGET_POOL)
    spec.ledger.assert_drained()
