"""Extend (whole, chunked, copy-on-write) and decode of the hybrid model against the cache-free
full-sequence reference, and greedy generation token for token."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from backend.hybrid.reference import greedy_generate_reference, reference_hidden, reference_logits
from tests.helpers import ARCHITECTURES, BYTE_PROMPTS, Backend, assert_close, tiny_model


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_extend_whole_prompts_match_the_reference(arch: str) -> None:
    model = tiny_model(arch=arch)
    be = Backend(model)
    out = be.extend([(slot, prompt, 0) for slot, prompt in zip((3, 1, 5), BYTE_PROMPTS, strict=True)])
    for row, prompt in enumerate(BYTE_PROMPTS):
        assert_close(out.logits[row], reference_logits(model, prompt)[-1])
        assert_close(out.hidden[row], reference_hidden(model, prompt)[-1])


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_extend_skips_padding_rows(arch: str) -> None:
    model = tiny_model(arch=arch)
    be = Backend(model)
    out = be.extend([(2, BYTE_PROMPTS[0], 0), (-1, BYTE_PROMPTS[1], 0), (4, BYTE_PROMPTS[2], 0)])
    assert_close(out.logits[0], reference_logits(model, BYTE_PROMPTS[0])[-1])
    assert_close(out.logits[2], reference_logits(model, BYTE_PROMPTS[2])[-1])
    untouched = [s for s in range(be.pool.num_slots) if s not in (2, 4)]
    assert not be.pool.buffer[untouched].any()


@pytest.mark.parametrize("cuts", [(7,), (5, 14), (1, 9, 17)])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_chunked_extend_equals_unchunked_and_reference(cuts: tuple[int, ...], arch: str) -> None:
    model = tiny_model(arch=arch)
    prompt = BYTE_PROMPTS[2]
    whole = Backend(model)
    whole_out = whole.extend([(1, prompt, 0)])

    chunked = Backend(model)
    bounds = [0, *cuts, len(prompt)]
    ref = reference_logits(model, prompt)
    for a, b in pairwise(bounds):
        # a fresh request rides along in the same batch as every continuation chunk
        out = chunked.extend([(1, prompt[a:b], a), (2 + len(cuts) - bounds.index(a), BYTE_PROMPTS[0], 0)])
        assert_close(out.logits[0], ref[b - 1])
    assert_close(out.logits[0], whole_out.logits[0])
    assert_close(chunked.pool.buffer[1].view(torch.float32), whole.pool.buffer[1].view(torch.float32))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_extend_then_decode_matches_the_growing_reference(arch: str) -> None:
    model = tiny_model(arch=arch)
    be = Backend(model)
    seqs = [list(BYTE_PROMPTS[0]), list(BYTE_PROMPTS[1])]
    slots = [2, 6]
    be.extend([(s, seq, 0) for s, seq in zip(slots, seqs, strict=True)])
    fed = [list(b"jumps over"), list(b" x * 2 + 1")]  # teacher-forced continuation
    for step in range(len(fed[0])):
        out = be.decode([(s, f[step], len(seq)) for s, f, seq in zip(slots, fed, seqs, strict=True)])
        for row, f in enumerate(fed):
            seqs[row].append(f[step])
            assert_close(out.logits[row], reference_logits(model, seqs[row])[-1])


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_copy_on_write_prefix_then_extend_the_rest(arch: str) -> None:
    model = tiny_model(arch=arch)
    be = Backend(model)
    prompt = BYTE_PROMPTS[1]
    split = 11
    be.extend([(1, prompt[:split], 0)])  # slot A holds the cached prefix
    be.pool.buffer[4] = be.pool.buffer[1]  # COW: one row copy
    be.table.copy_prefix(1, 4, split)  # and the prefix's KV locations are shared
    out = be.extend([(4, prompt[split:], split)])
    assert_close(out.logits[0], reference_logits(model, prompt)[-1])

    # the source request continues differently and is unaffected by the sharer
    other = prompt[:split] + list(b"pass")
    out_a = be.extend([(1, other[split:], split)])
    assert_close(out_a.logits[0], reference_logits(model, other)[-1])


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_generation_through_extend_and_decode_equals_the_reference(arch: str) -> None:
    model = tiny_model(seed=1, arch=arch)
    be = Backend(model)
    slots = [1, 2, 3]
    n_new = 16
    out = be.extend([(s, p, 0) for s, p in zip(slots, BYTE_PROMPTS, strict=True)])
    generated: list[list[int]] = [[] for _ in BYTE_PROMPTS]
    lengths = [len(p) for p in BYTE_PROMPTS]
    for _ in range(n_new):
        tokens = [int(t) for t in out.logits.argmax(dim=-1).tolist()]
        for row, t in enumerate(tokens):
            generated[row].append(t)
        out = be.decode([(s, t, n) for s, t, n in zip(slots, tokens, lengths, strict=True)])
        lengths = [n + 1 for n in lengths]
    for prompt, got in zip(BYTE_PROMPTS, generated, strict=True):
        assert got == greedy_generate_reference(model, prompt, n_new)
        assert len(set(got)) > 3, f"degenerate greedy output {bytes(got)!r}"
