"""Extend (whole, chunked, copy-on-write) and decode of the hybrid model against the cache-free
full-sequence reference, and greedy generation token for token."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from backend.hybrid.model import HybridModel
from backend.hybrid.reference import greedy_generate_reference, reference_hidden, reference_logits
from backend.staging import Captures
from tests.helpers import ARCHITECTURES, BYTE_PROMPTS, Backend, assert_close, ids, tiny_model


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


def _mixed_rig(model: HybridModel) -> Backend:
    """A backend with slots 2 and 6 prefilled (decode rows) and slot 3 holding a chunk of a prompt."""
    be = Backend(model)
    be.extend([(2, list(BYTE_PROMPTS[0]), 0), (6, list(BYTE_PROMPTS[1]), 0), (3, list(BYTE_PROMPTS[2][:5]), 0)])
    return be


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_mixed_forward_equals_extend_then_decode(arch: str) -> None:
    """A MIXED forward (extend rows and decode rows through the layers together) leaves the pool,
    the KV cache and the table as the extend and then the decode alone leave them, and returns
    their logits and hidden states, extend rows first; padding rows (slot -1) in either part and
    a snapshot inside an extend row included."""
    model = tiny_model(arch=arch)
    apart, together = _mixed_rig(model), _mixed_rig(model)
    prompt = BYTE_PROMPTS[2]
    ext = [(3, list(prompt[5:]), 5), (-1, list(b"pad"), 0), (1, list(prompt[:9]), 0)]
    dec = [(2, 7, len(BYTE_PROMPTS[0])), (-1, 9, 4), (6, 11, len(BYTE_PROMPTS[1]))]
    ext_args = _extend_args(apart, ext)
    dec_args = {"slots": ids([s for s, _, _ in dec]), "input_ids": ids([t for _, t, _ in dec]),
                "positions": ids([p for _, _, p in dec])}
    n_ext = int(ext_args["input_ids"].shape[0])
    locs = ids(list(range(500, 500 + n_ext))), ids([600, 601, 602])
    into_a, into_b = model.new_pool(2), model.new_pool(2)
    e_out = model.extend(apart.pool, apart.kv, apart.table, **ext_args, kv_locs=locs[0], keep_hidden=True,
                         captures=Captures(seq=(2,), at=(4,), entries=(0,), into=into_a))
    d_out = model.decode(apart.pool, apart.kv, apart.table, **dec_args, kv_locs=locs[1])
    m_out = model.mixed(together.pool, together.kv, together.table, **ext_args, kv_locs=locs[0], keep_hidden=True,
                        captures=Captures(seq=(2,), at=(4,), entries=(0,), into=into_b), decode_slots=dec_args["slots"],
                        decode_ids=dec_args["input_ids"], decode_positions=dec_args["positions"], decode_kv_locs=locs[1])
    live = [0, 2, 3, 5]  # the padding rows' outputs are garbage
    assert_close(m_out.logits[live], torch.cat((e_out.logits, d_out.logits))[live])
    assert_close(m_out.hidden[live], torch.cat((e_out.hidden, d_out.hidden))[live])
    assert m_out.all_hidden is not None and e_out.all_hidden is not None
    real = [i for i, s in enumerate(torch.repeat_interleave(ext_args["slots"], torch.tensor([len(t) for _, t, _ in ext])).tolist()) if s >= 0]
    assert_close(m_out.all_hidden[real], e_out.all_hidden[real])
    assert_close(together.pool.buffer[1:].view(torch.float32), apart.pool.buffer[1:].view(torch.float32))
    assert_close(into_b.buffer[1].view(torch.float32), into_a.buffer[1].view(torch.float32))
    assert_close(together.kv.k[:, 1:], apart.kv.k[:, 1:])  # location 0: whatever padding rows wrote
    assert torch.equal(together.table.table[1:], apart.table.table[1:])


def test_mixed_forward_refuses_bad_parts_before_writing() -> None:
    model = tiny_model()
    be = _mixed_rig(model)
    ext_args = _extend_args(be, [(3, list(BYTE_PROMPTS[2][5:8]), 5)])
    table, pool = be.table.table.clone(), be.pool.buffer.clone()
    for slots, position, match in ((ids([3]), 8, "in both the extend and the decode rows"), (ids([]), 8, "needs extend and decode rows"),
                                   (ids([2]), be.table.max_len, "positions must lie in")):
        n = int(slots.shape[0])
        with pytest.raises(ValueError, match=match):
            model.mixed(be.pool, be.kv, be.table, **ext_args, kv_locs=ids([500, 501, 502]), decode_slots=slots,
                        decode_ids=ids([7] * n), decode_positions=ids([position] * n), decode_kv_locs=ids([600] * n))
        assert torch.equal(be.table.table, table) and torch.equal(be.pool.buffer, pool)  # refused before either part wrote


def _extend_args(be: Backend, rows: list[tuple[int, list[int], int]]) -> dict[str, torch.Tensor]:
    """``extend``'s packed arguments for ``rows`` ``(slot, tokens, prefix_len)``, without KV locations."""
    cu = [0]
    for _, tokens, _ in rows:
        cu.append(cu[-1] + len(tokens))
    return {
        "slots": ids([s for s, _, _ in rows]), "cu_seqlens": ids(cu), "prefix_lens": ids([p for _, _, p in rows]),
        "input_ids": ids([t for _, tokens, _ in rows for t in tokens]),
        "positions": ids([p + j for _, tokens, p in rows for j in range(len(tokens))]),
    }
