"""The stale-replay bug (a finished prefill's init ops carried into decode), written against batchc: mypy must reject each line."""

from __future__ import annotations

import attrs

from ir.batch import DecodeBatch, ExtendBatch
from passes.prepare_for_decode import DecodeContext, prepare_for_decode


def carry_init_into_decode(extend: ExtendBatch, ctx: DecodeContext) -> None:
    decode = prepare_for_decode(extend, ctx)
    decode.init  # type: ignore[attr-defined]  # reading an init field of a DecodeBatch
    attrs.evolve(decode, init=extend.init)  # type: ignore[call-arg]  # evolve adding one
    DecodeBatch(  # type: ignore[call-arg]  # constructing one with it
        rids=decode.rids,
        slots=decode.slots,
        seq_lens=decode.seq_lens,
        input_ids=decode.input_ids,
        kv_locs=decode.kv_locs,
        init=extend.init,
    )
    decode.rids = extend.rids  # type: ignore[misc]  # assigning a frozen field


def carry_snapshot_into_decode(extend: ExtendBatch, ctx: DecodeContext) -> None:
    decode = prepare_for_decode(extend, ctx)
    decode.snapshot  # type: ignore[attr-defined]  # nor a prefix-cache snapshot
