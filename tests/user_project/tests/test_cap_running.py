"""The engine's own pass, tested with batchc's shipped helpers: a property over valid batches drawn
by batchc's strategies, a golden dump with batchc's update switch, the pass through batchc's pass
manager (dumps, timings, errors under its name), and the engine's own pipeline run on batchc's
fixtures (a fake model hook returning logits, executors and a ledger that must be drained at
teardown)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.manager import PassError, PassManager
from compiler.steps import Pipeline
from compiler.testing.fakes import FakeBackend, FakeModel
from compiler.testing.golden import assert_golden_ir
from compiler.testing.strategies import decode_batches
from ir.batch import DecodeBatch
from ir.ids import MambaSlot, RequestId
from ir.printer import dump
from ir.request import AdmittedRequest, Clear
from ir.results import Sampled
from ir.verify import verify
from myengine.passes import cap_running
from myengine.pipeline import CappedPipeline
from passes import DecodeContext

GOLDEN = Path(__file__).resolve().parent / "golden"


@settings(max_examples=30, deadline=None)
@given(decode_batches(max_rows=8), st.integers(0, 10))
def test_cap_running_keeps_the_oldest_rows_in_order(batch: DecodeBatch, limit: int) -> None:
    capped, retracted = cap_running(batch, limit)
    verify(capped)
    assert capped.rids.tolist() == batch.rids.tolist()[:limit]
    assert retracted == batch.rids.tolist()[limit:]
    assert capped.slots.tolist() == batch.slots.tolist()[:limit]


def test_cap_running_golden() -> None:
    running = DecodeBatch(rids=[7, 8, 9], slots=[1, 2, 3], seq_lens=[10, 30, 12], input_ids=[5, 6, 7], kv_locs=[20, 21, 22])
    capped, _ = cap_running(running, 2)
    assert_golden_ir(dump(capped), GOLDEN / "cap_running.txt")


def test_cap_running_refuses_a_bad_limit() -> None:
    with pytest.raises(ValueError, match="limit must be an int >= 0, got True"):
        cap_running(DecodeBatch.empty(), True)


def test_cap_running_through_the_pass_manager(tmp_path: Path) -> None:
    running = DecodeBatch(rids=[7, 8, 9], slots=[1, 2, 3], seq_lens=[10, 30, 12], input_ids=[5, 6, 7], kv_locs=[20, 21, 22])
    pm = PassManager(verify_level=2, dump_dir=tmp_path)
    capped, retracted = pm.run(cap_running, running, 2)
    assert retracted == [RequestId(9)] and capped.num_requests == 2
    assert list(pm.timings()) == ["cap_running"]
    assert [p.name for p in tmp_path.iterdir()] == ["00001-cap_running.txt"]
    assert_golden_ir((tmp_path / "00001-cap_running.txt").read_text(), GOLDEN / "cap_running.txt")
    with pytest.raises(PassError, match="^pass 'cap_running' failed: ValueError: cap_running: limit must be an int >= 0, got -1"):
        pm.run(cap_running, running, -1)


@pytest.mark.batchc(pools=("target", "draft"), capacity=4)
def test_prefill_decode_and_cap_on_batchc_fixtures(batchc_pipeline: Pipeline, batchc_backend: FakeBackend, batchc_model_hook: FakeModel) -> None:
    requests = [
        AdmittedRequest(rid=RequestId(r), slot=MambaSlot(r), input_ids=[3, r], kv_locs=[2 * r, 2 * r + 1], intent=Clear())
        for r in (1, 2)
    ]
    pipeline = CappedPipeline(batchc_pipeline.ledger, batchc_pipeline.lower_ctx, batchc_pipeline.pm)
    batch, plan = pipeline.prefill(requests)
    first = batchc_backend.execute(plan)  # each pool's clear ticket consumed once
    assert isinstance(first, Sampled)  # (execute returns the union of every phase's result)
    assert first.tokens.tolist() == [batchc_model_hook.next_token(1), batchc_model_hook.next_token(2)]
    running = pipeline.merge(DecodeBatch.empty(), batch)
    _, decode_plan, retracted = pipeline.capped_decode(running, DecodeContext(next_tokens=first.tokens[:1], kv_locs=[8]), 1)
    assert retracted == [RequestId(2)]
    assert "cap_running" in pipeline.pm.timings()
    decoded = batchc_backend.execute(decode_plan)
    assert isinstance(decoded, Sampled)
    assert decoded.tokens.tolist() == [batchc_model_hook.next_token(int(first.tokens[0]))]
    # the ledger fixture is checked at teardown: every ticket minted was consumed
