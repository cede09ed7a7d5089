"""Speculative decoding entry points: verify + commit equals the accepted decode steps, propose
leaves the pool alone and equals greedy decoding, and the whole loop is lossless (on each
architecture's target made state-sensitive, ``compiler.testing.models.state_sensitive``: its tokens
change when a commit leaves a wrong Mamba state, where attention would carry the context past it)."""

from __future__ import annotations

import pytest
import torch

from backend.hybrid import HybridModel, perturb
from backend.hybrid.reference import greedy_generate_reference, reference_logits
from compiler.testing.models import state_sensitive
from tests.helpers import ARCHITECTURES, BYTE_PROMPTS, Backend, assert_close, grid, ids, tiny_model

T = 4
ACCEPT = [-1, 0, 1, 2, 3]  # one row per accept position, each in its own slot


def _prefilled(model: HybridModel, prompt: list[int]) -> Backend:
    """The prompt (all but its last token) in slot 1, COW-shared into slots 2..len(ACCEPT)."""
    be = Backend(model)
    be.extend([(1, prompt[:-1], 0)])
    for slot in range(2, len(ACCEPT) + 1):
        be.pool.buffer[slot] = be.pool.buffer[1]
        be.table.copy_prefix(1, slot, len(prompt) - 1)
    return be


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_verify_then_commit_equals_the_accepted_decode_steps(arch: str) -> None:
    model = tiny_model(arch=arch)
    prompt = BYTE_PROMPTS[0]
    start = len(prompt) - 1  # position of the first verified token (the prompt's last one)
    slots = list(range(1, len(ACCEPT) + 1))
    # every row verifies the prompt's last token followed by its own three draft bytes
    drafts = [[prompt[-1], *b"ump"], [prompt[-1], *b"ox "], [prompt[-1], *b"abc"], [prompt[-1], *b"  j"], [prompt[-1], *b"xyz"]]

    verified = _prefilled(model, prompt)
    before = verified.pool.copy_buffer()
    out = model.verify(
        verified.pool,
        verified.kv,
        verified.table,
        slots=ids(slots),
        input_ids=grid(drafts),
        positions=grid([list(range(start, start + T))] * len(slots)),
        kv_locs=grid([verified.alloc(T) for _ in slots]),
    )
    assert torch.equal(verified.pool.buffer, before), "verify must not write the committed state"
    for row, draft in enumerate(drafts):
        assert_close(out.logits[row], reference_logits(model, prompt[:-1] + draft)[start:])
    model.commit(verified.pool, out.states, accept_pos=ids(ACCEPT), slots=ids(slots))

    decoded = _prefilled(model, prompt)
    for t in range(T):
        rows = [(s, d[t], start + t) for s, d, a in zip(slots, drafts, ACCEPT, strict=True) if t <= a]
        step = decoded.decode(rows)
        for j, (s, _, _) in enumerate(rows):
            assert_close(out.logits[slots.index(s), t], step.logits[j])
            assert_close(out.hidden[slots.index(s), t], step.hidden[j])

    assert_close(verified.pool.buffer.view(torch.float32), decoded.pool.buffer.view(torch.float32))
    assert torch.equal(verified.pool.buffer[1], before[1]), "accept -1 commits nothing"


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_propose_leaves_the_pool_alone_and_decodes_greedily(arch: str) -> None:
    model = tiny_model(arch=arch)
    k = 5
    prompts = [BYTE_PROMPTS[0], BYTE_PROMPTS[2]]
    slots = [3, 1]
    be = Backend(model)
    be.extend([(s, p[:-1], 0) for s, p in zip(slots, prompts, strict=True)])
    before = be.pool.copy_buffer()
    tokens = model.propose(
        be.pool,
        be.kv,
        be.table,
        slots=ids([*slots, -1]),  # and a padding row
        input_ids=ids([p[-1] for p in prompts] + [0]),
        positions=ids([len(p) - 1 for p in prompts] + [0]),
        kv_locs=grid([be.alloc(k) for _ in range(3)]),
        k=k,
    )
    assert torch.equal(be.pool.buffer, before)
    assert tokens.shape == (3, k)
    for row, prompt in enumerate(prompts):
        assert tokens[row].tolist() == greedy_generate_reference(model, prompt, k)

    # the same steps as plain decodes from the same state
    again = Backend(model)
    again.extend([(s, p[:-1], 0) for s, p in zip(slots, prompts, strict=True)])
    fed = [p[-1] for p in prompts]
    for j in range(k):
        out = again.decode([(s, f, len(p) - 1 + j) for s, f, p in zip(slots, fed, prompts, strict=True)])
        fed = [int(t) for t in out.logits.argmax(dim=-1).tolist()]
        assert fed == tokens[:2, j].tolist()


def _speculative_generate(target: HybridModel, draft: HybridModel, prompt: list[int], n: int, k: int) -> tuple[list[int], float]:
    """Greedy speculative decoding of one request through the backend entry points only.
    Returns the generated tokens and the fraction of drafted tokens accepted."""
    slot = 1
    tgt, drf = Backend(target), Backend(draft)
    out = tgt.extend([(slot, prompt, 0)])
    drf.extend([(slot, prompt, 0)])
    token, pos = int(out.logits[0].argmax()), len(prompt)  # known, processed by neither model yet
    # the draft's committed state covers positions < dpos; draft_pending starts at dpos and ends
    # with the target's pending token, which propose feeds first
    draft_pending, dpos = [token], pos
    generated = [token]
    drafted = accepted = 0
    while len(generated) < n:
        if len(draft_pending) > 1:  # draft catch-up over the accepted tokens (chunked continuation)
            drf.extend([(slot, draft_pending[:-1], dpos)])
            dpos += len(draft_pending) - 1
            draft_pending = draft_pending[-1:]
        proposal = draft.propose(
            drf.pool, drf.kv, drf.table, slots=ids([slot]), input_ids=ids(draft_pending), positions=ids([dpos]),
            kv_locs=grid([drf.alloc(k)]), k=k,
        )[0].tolist()
        ver = target.verify(
            tgt.pool, tgt.kv, tgt.table, slots=ids([slot]), input_ids=grid([[token, *proposal]]),
            positions=grid([list(range(pos, pos + k + 1))]), kv_locs=grid([tgt.alloc(k + 1)]),
        )
        best = ver.logits[0].argmax(dim=-1).tolist()
        n_ok = 0
        while n_ok < k and proposal[n_ok] == best[n_ok]:
            n_ok += 1
        target.commit(tgt.pool, ver.states, accept_pos=ids([n_ok]), slots=ids([slot]))
        drafted += k
        accepted += n_ok
        new = [*proposal[:n_ok], int(best[n_ok])]
        generated += new
        draft_pending += new
        token, pos = new[-1], pos + len(new)
    return generated[:n], accepted / drafted


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_speculative_decoding_with_a_perturbed_draft_is_lossless(arch: str) -> None:
    target = state_sensitive(tiny_model(seed=2, arch=arch))
    draft = HybridModel(target.config, perturb(target.weights, 0.05, seed=7))
    for prompt in BYTE_PROMPTS[:2]:
        got, rate = _speculative_generate(target, draft, prompt, n=16, k=3)
        assert got == greedy_generate_reference(target, prompt, 16)
        assert rate >= 0.3, f"a draft this close to the target should mostly agree, accepted {rate:.2f}"
