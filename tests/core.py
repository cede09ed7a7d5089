"""Small builders shared by the core tests."""

from __future__ import annotations

from collections.abc import Sequence

from backend.pool import MambaLayerSpec, PoolLayout
from ir.batch import DecodeBatch
from ir.ids import MambaSlot, RequestId
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom

LAYOUT = PoolLayout(layers=(MambaLayerSpec(conv_dim=8, kernel_width=4, nheads=2, head_dim=4, d_state=4),))


def fresh(rid: int, slot: int, tokens: Sequence[int], kv_start: int, *, more: bool = False) -> AdmittedRequest:
    return AdmittedRequest(
        rid=RequestId(rid), slot=MambaSlot(slot), input_ids=list(tokens),
        kv_locs=list(range(kv_start, kv_start + len(tokens))), intent=Clear(), more_chunks=more,
    )


def cow(rid: int, slot: int, src: int, prefix: int, tokens: Sequence[int], kv_start: int) -> AdmittedRequest:
    return AdmittedRequest(
        rid=RequestId(rid), slot=MambaSlot(slot), input_ids=list(tokens),
        kv_locs=list(range(kv_start, kv_start + len(tokens))), intent=CopyFrom(src=MambaSlot(src), prefix_len=prefix),
    )


def cont(rid: int, slot: int, prefix: int, tokens: Sequence[int], kv_start: int, *, more: bool = False) -> AdmittedRequest:
    return AdmittedRequest(
        rid=RequestId(rid), slot=MambaSlot(slot), input_ids=list(tokens),
        kv_locs=list(range(kv_start, kv_start + len(tokens))), intent=Continue(prefix_len=prefix), more_chunks=more,
    )


def decode_batch(rids: Sequence[int], slots: Sequence[int], seq_lens: Sequence[int], tokens: Sequence[int], kv: Sequence[int]) -> DecodeBatch:
    return DecodeBatch(rids=rids, slots=slots, seq_lens=seq_lens, input_ids=tokens, kv_locs=kv)


def empty_decode() -> DecodeBatch:
    return DecodeBatch.empty()
