"""The draft head's serving entry points against its cache-free reference: after
a chunked extend and several commits, and after a COW from a snapshot taken inside a chunk, the
head's state gives the reference's last logits and the reference's proposals; a proposal leaves the
pool as it was; rows of other slots are never touched."""

from __future__ import annotations

import pytest
import torch

from backend.hybrid import HybridModel, tiny
from backend.hybrid.head import DraftHeadHook, HeadConfig, HeadModel, pack_accepted
from backend.hybrid.reference import reference_hidden
from backend.model import HeadHook
from backend.pool import MambaStatePool
from backend.staging import Captures
from tests.helpers import DEVICE, assert_close

_MAX_LEN = 64
_KV_STRIDE = 70  # slot s, position p -> KV location (s - 1) * 70 + p + 1


def _loc(slot: int, pos: int) -> int:
    return (slot - 1) * _KV_STRIDE + pos + 1


def _models(layers: str = "mamba,attn") -> tuple[HybridModel, HeadModel]:
    target = HybridModel.from_seed(tiny(), 1, device=DEVICE)
    return target, HeadModel.from_seed(HeadConfig.for_target(tiny(), layers), target, 2)


def _seq(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Rig:
    """A head, its pool (4 slots), KV cache and table, and packed-batch helpers."""

    def __init__(self, head: HeadModel) -> None:
        self.head = head
        self.pool = head.new_pool(4)
        self.hook = head.serving_hook(capacity=4, kv_capacity=4 * _KV_STRIDE, max_len=_MAX_LEN)

    def extend(
        self, rows: list[tuple[int, int, list[int], torch.Tensor]], captures: Captures | None = None
    ) -> torch.Tensor:
        """Rows ``(slot, prefix, tokens, target hidden at those tokens)``; logits at each last token."""
        ids = [t for _, _, toks, _ in rows for t in toks]
        pos = [p + j for _, p, toks, _ in rows for j in range(len(toks))]
        locs = [_loc(s, p + j) for s, p, toks, _ in rows for j in range(len(toks))]
        cu = [0]
        for _, _, toks, _ in rows:
            cu.append(cu[-1] + len(toks))

        def t(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device=DEVICE)

        return self.head.extend(
            self.pool, self.hook.kv, self.hook.table, slots=t([s for s, *_ in rows]), cu_seqlens=t(cu),
            prefix_lens=t([p for _, p, _, _ in rows]), input_ids=t(ids), positions=t(pos), kv_locs=t(locs),
            hidden=torch.cat([h for *_, h in rows]), captures=captures,
        ).logits

    def propose(self, slot: int, committed: int, pending: int, k: int) -> list[int]:
        t = torch.tensor
        before = self.pool.copy_buffer()
        out = self.head.propose(
            self.pool, self.hook.kv, self.hook.table, slots=t([slot], device=DEVICE), input_ids=t([pending], device=DEVICE),
            positions=t([committed], device=DEVICE), kv_locs=t([[_loc(slot, committed + j) for j in range(k + 1)]], device=DEVICE), k=k,
        )
        assert torch.equal(self.pool.buffer, before), "a proposal wrote the pool"
        assert out.shape == (1, k)
        return [int(x) for x in out[0]]


def _check_state(rig: _Rig, slot: int, ids: list[int], hidden: torch.Tensor, committed: int, logits: torch.Tensor, k: int = 2) -> None:
    """The head of ``slot`` at length ``committed`` equals the cache-free reference over the prefix."""
    head = rig.head
    seq = torch.tensor(ids, dtype=torch.int64, device=DEVICE)
    # positions 0..committed (the pending token last; the target hidden at it is never read)
    ref = head.reference(hidden[: committed + 1], seq[: committed + 1])
    assert_close(logits, ref[-2])
    pending = ids[committed]
    proposals = rig.propose(slot, committed, pending, k)
    assert proposals[0] == int(ref[-1].argmax())
    assert proposals == head.reference_propose(hidden[:committed], seq[:committed], pending, k)


def test_chunked_extend_and_commits_follow_the_reference() -> None:
    target, head = _models()
    rig = _Rig(head)
    a, b = _seq(10, 30), _seq(11, 20)
    ha, hb = reference_hidden(target, a), reference_hidden(target, b)
    untouched = torch.randint(0, 255, (rig.pool.layout.row_bytes,), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    rig.pool.buffer[4] = untouched.to(DEVICE)

    # prefill: slot 1 in two chunks, the second batched with slot 2's whole prompt
    rig.extend([(1, 0, a[:7], ha[:7])])
    logits = rig.extend([(1, 7, a[7:13], ha[7:13]), (2, 0, b[:9], hb[:9])])
    _check_state(rig, 1, a, ha, 13, logits[0])
    _check_state(rig, 2, b, hb, 9, logits[1])
    slot2 = rig.pool.buffer[2].clone()

    # commits: window tokens p, d1..dm at c..c+m with the verify's hidden there (here the target's,
    # as a lossless verify of the sequence's own tokens gives), packed from [n, k + 1, d]
    k = 3
    c = 13
    for m in (2, 0, 3):
        window = ha[c : c + k + 1][None]
        lens = torch.tensor([m + 1], dtype=torch.int64, device=DEVICE)
        packed = pack_accepted(window, lens)
        assert torch.equal(packed, ha[c : c + m + 1])
        logits = rig.extend([(1, c, a[c : c + m + 1], packed)])
        c += m + 1
        _check_state(rig, 1, a, ha, c, logits[0])
    assert c == 21
    assert torch.equal(rig.pool.buffer[2], slot2)  # slot 1's commits left slot 2's row as it was
    assert torch.equal(rig.pool.buffer[4].cpu(), untouched)
    assert int(rig.pool.buffer[3].count_nonzero()) == 0


def test_cow_from_a_snapshot_inside_a_chunk() -> None:
    target, head = _models()
    rig = _Rig(head)
    a = _seq(20, 24)
    c_seq = a[:10] + _seq(21, 12)
    ha, hc = reference_hidden(target, a), reference_hidden(target, c_seq)
    into = MambaStatePool(rig.pool.pool_id, rig.pool.layout, 2, device=DEVICE)
    rig.extend([(1, 0, a[:7], ha[:7])])
    # the second chunk (positions 7..15) snapshots the state after its first 3 tokens: length 10
    rig.extend([(1, 7, a[7:16], ha[7:16])], captures=Captures(seq=(0,), at=(3,), entries=(0,), into=into))
    assert torch.equal(into.carried_hidden()[1], ha[9].to(into.carried_hidden().dtype))

    # a request sharing the first 10 tokens starts from the snapshot (a COW into slot 3)
    rig.pool.buffer[3] = into.buffer[1]
    rig.hook.share_prefix(1, 3, 10)
    before = rig.pool.copy_buffer()
    logits = rig.extend([(3, 10, c_seq[10:17], hc[10:17])])
    _check_state(rig, 3, c_seq, hc, 17, logits[0])
    assert torch.equal(rig.pool.buffer[[0, 1, 2, 4]], before[[0, 1, 2, 4]])  # only slot 3's row moved
    # and slot 1 goes on from its own state
    logits = rig.extend([(1, 16, a[16:20], ha[16:20])])
    _check_state(rig, 1, a, ha, 20, logits[0])


def test_attention_only_head_follows_the_reference() -> None:
    target, head = _models("attn")
    rig = _Rig(head)
    a = _seq(30, 20)
    ha = reference_hidden(target, a)
    rig.extend([(2, 0, a[:5], ha[:5])])
    logits = rig.extend([(2, 5, a[5:12], ha[5:12])])
    _check_state(rig, 2, a, ha, 12, logits[0])


def test_a_cleared_row_starts_from_a_zero_hidden() -> None:
    """After a clear (zeroed row), position 0 pairs with h_{-1} = 0: the reference from scratch."""
    target, head = _models()
    rig = _Rig(head)
    a = _seq(40, 12)
    ha = reference_hidden(target, a)
    rig.extend([(1, 0, a, ha)])
    rig.pool.buffer[1] = 0  # what the executor's clear does
    logits = rig.extend([(1, 0, a[:6], ha[:6])])
    _check_state(rig, 1, a, ha, 6, logits[0])


def test_the_hook_fits_the_protocol_and_refuses_a_foreign_pool() -> None:
    target, head = _models()
    hook = head.serving_hook(capacity=2, kv_capacity=8, max_len=8)
    assert isinstance(hook, DraftHeadHook) and isinstance(hook, HeadHook)

    def t(v: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int64, device=DEVICE)

    with pytest.raises(ValueError, match="not this head's"):
        head.propose(target.new_pool(2), hook.kv, hook.table, slots=t([1]), input_ids=t([0]), positions=t([0]), kv_locs=t([[1]]), k=1)
    pool = head.new_pool(2)

    def extend(hidden: torch.Tensor, cu: list[int]) -> None:
        head.extend(pool, hook.kv, hook.table, slots=t([1]), cu_seqlens=t(cu), prefix_lens=t([0]), input_ids=t([1, 2]),
                    positions=t([0, 1]), kv_locs=t([1, 2]), hidden=hidden)

    with pytest.raises(ValueError, match=r"hidden has shape \(2, 16\), expected \(2, 32\)"):
        extend(torch.zeros(2, 16, device=DEVICE), [0, 2])
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to 2 by at least one per sequence, got \[0, 3\]"):
        extend(torch.zeros(2, 32, device=DEVICE), [0, 3])
