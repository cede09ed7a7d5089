"""The prefix-cache snapshot point no longer cuts a prefill chunk: the chunk that reaches the
boundary carries a snapshot at that position inside it (``AdmittedRequest.snapshot_at``), the
forward captures the state there, and a later request starts from that entry. Outputs are the
from-scratch reference's, as with the cut chunks; the runs take fewer prefill forwards. A model
that cannot capture inside a chunk keeps the cuts (``ChunkPlanner.inner_snapshots``)."""

from __future__ import annotations

import pytest

from compiler.engine import Engine
from compiler.prefix_cache import PrefixCache
from ir.ids import DRAFT_POOL, TARGET_POOL, RequestId
from ir.request import AdmittedRequest
from tests.helpers import REVIEW_NEW, REVIEW_PROMPTS, SYSTEM, engine, review_greedy


def _served(k: int, *, inner: bool) -> tuple[Engine, PrefixCache, list[AdmittedRequest]]:
    """The review prompts two at a time (the second of the first pair snapshots ``SYSTEM[:32]``),
    with every prefill chunk the planner sent."""
    pc = PrefixCache(capacity=4, block=16)
    drv = engine(k, prefix_cache=pc, chunk_size=64)
    assert drv.planner.inner_snapshots  # the tiny hybrid models capture inside a chunk
    drv.planner.inner_snapshots = inner
    sent: list[AdmittedRequest] = []
    plan = drv.planner.next_chunks

    def recording() -> list[AdmittedRequest]:
        chunks = plan()
        sent.extend(chunks)
        return chunks

    drv.planner.next_chunks = recording  # type: ignore[method-assign]
    for start in range(0, len(REVIEW_PROMPTS), 2):
        for i in range(start, min(start + 2, len(REVIEW_PROMPTS))):
            drv.admit(RequestId(i), REVIEW_PROMPTS[i], max_new_tokens=REVIEW_NEW)
        drv.run_until_done()
    return drv, pc, sent


@pytest.mark.parametrize("k", [0, 2])
def test_a_snapshot_inside_a_chunk_saves_the_cut_and_keeps_the_outputs(k: int) -> None:
    inner, inner_cache, inner_chunks = _served(k, inner=True)
    cut, cut_cache, cut_chunks = _served(k, inner=False)
    assert inner.outputs == cut.outputs == review_greedy()
    snapshots = [a for a in inner_chunks if a.snapshot_to is not None]
    assert snapshots and all(a.snapshot_at is not None and a.snapshot_at < a.input_ids.shape[0] for a in snapshots)
    cut_snapshots = [a for a in cut_chunks if a.snapshot_to is not None]
    assert all(a.snapshot_at is None for a in cut_chunks)
    # the same prefix boundaries (block multiples inside SYSTEM), without ending a chunk there
    assert [a.prefix_len + a.snapshot_len for a in snapshots] == [a.prefix_len + a.input_ids.shape[0] for a in cut_snapshots]
    assert {a.prefix_len + a.snapshot_len for a in snapshots} <= {16, 32}
    # one chunk per prompt (each fits in 64 tokens) instead of one more per snapshot
    assert len(inner_chunks) == len(REVIEW_PROMPTS) == len(cut_chunks) - len(snapshots)
    assert inner.stats.prefills < cut.stats.prefills
    assert {e.tokens for e in inner_cache.entries()} == {e.tokens for e in cut_cache.entries()}
    assert tuple(SYSTEM[:32]) in {e.tokens for e in inner_cache.entries()}
    assert inner_cache.stats.hits == cut_cache.stats.hits >= 3
    for pool in (TARGET_POOL, DRAFT_POOL) if k else (TARGET_POOL,):
        assert inner.ledger.counts(pool).snapshots == inner_cache.stats.snapshots == cut_cache.stats.snapshots
    for drv in (inner, cut):
        drv.ledger.assert_drained()
        drv.drop_cache()
        assert drv.slots.num_live == 0 and drv.kv.num_live == 0
